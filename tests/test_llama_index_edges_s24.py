"""LlamaIndex edge cases: a reasoning model's past thinking in a chat history, and nodes
whose only content is their metadata."""

from __future__ import annotations

from collections.abc import Sequence

from fake_backend import FakeBackend
from llama_index.core.base.llms.types import ChatMessage, MessageRole, TextBlock, ThinkingBlock
from llama_index.core.query_engine import RetrieverQueryEngine
from llama_index.core.retrievers import BaseRetriever
from llama_index.core.schema import (
    BaseNode,
    MetadataMode,
    NodeWithScore,
    QueryBundle,
    TextNode,
)
from test_llama_index_llm import backend_of, chunk_ids, make_llm
from test_llama_index_roles import sent_text

from chunkcache.core import ChunkCache, chunk_id
from chunkcache.integrations.llama_index import (
    ChunkCachePostprocessor,
    ChunkCacheRetriever,
)
from chunkcache.integrations.llama_index_chat import ChunkCacheChatEngine

TEXTS = [
    "json.loads parses a json string into a Python object.",
    "json.dumps turns a Python object into a json string.",
    "csv.reader reads the rows of a file.",
]


class Fixed(BaseRetriever):
    """Returns copies of the same nodes, whatever the query."""

    def __init__(self, nodes: Sequence[BaseNode]) -> None:
        super().__init__()
        self._nodes = nodes

    def _retrieve(self, query_bundle: QueryBundle) -> list[NodeWithScore]:
        return [NodeWithScore(node=n.model_copy(), score=1.0) for n in self._nodes]


# A reasoning model's past turn, as LlamaIndex's LLMs hand it back in a chat history.


def test_a_past_turns_thinking_is_left_out_and_its_text_kept() -> None:
    """LlamaIndex's ``ChatMessage.content`` (what its ``messages_to_prompt`` and text LLMs
    send) holds a message's text blocks only: past reasoning is not sent back."""
    llm = make_llm()
    answer = ChatMessage(
        role=MessageRole.ASSISTANT,
        blocks=[ThinkingBlock(content="The user wants 4."), TextBlock(text="4")],
    )
    llm.chat([ChatMessage(content="2+2?"), answer, ChatMessage(content="and 3+3?")])
    expected = FakeBackend().render_chat(
        [
            {"role": "user", "content": "2+2?"},
            {"role": "assistant", "content": "4"},
            {"role": "user", "content": "and 3+3?"},
        ]
    )
    assert sent_text(backend_of(llm).requests[-1]) == expected


def test_a_chat_engine_history_with_thinking_is_sent_without_it() -> None:
    llm = make_llm()
    engine = ChunkCacheChatEngine.from_defaults(Fixed([TextNode(text=TEXTS[0])]), llm)
    history = [
        ChatMessage(content="hi"),
        ChatMessage(
            role=MessageRole.ASSISTANT,
            blocks=[ThinkingBlock(content="greet back"), TextBlock(text="Hello!")],
        ),
    ]
    engine.chat("What does json.loads do?", chat_history=history)
    sent = sent_text(backend_of(llm).requests[-1])
    assert "Hello!" in sent and "greet back" not in sent


# Nodes whose content LlamaIndex renders from their metadata alone.

TITLE_ONLY = TextNode(text="", metadata={"title": "Release notes for json 2.0"})


def test_a_metadata_only_node_reaches_the_prompt_but_is_no_chunk() -> None:
    """LlamaIndex renders a node with ``MetadataMode.LLM``: one with no text but LLM
    metadata is content the app retrieved.  It has no chunk text to cache, so it gets no
    chunk id and follows the chunks."""
    llm = make_llm()
    nodes = [TITLE_ONLY, TextNode(text=TEXTS[0]), TextNode(text="  ")]
    retriever = ChunkCacheRetriever(Fixed(nodes), cache=llm.cache)
    response = RetrieverQueryEngine.from_args(retriever, llm=llm).query("q")
    texts = [n.node.get_content(metadata_mode=MetadataMode.LLM) for n in response.source_nodes]
    assert texts == [TEXTS[0], "title: Release notes for json 2.0"]
    assert "chunk_id" not in response.source_nodes[1].node.metadata
    request = backend_of(llm).requests[-1]
    assert "Release notes for json 2.0" in sent_text(request)
    assert chunk_ids(request) == [chunk_id(TEXTS[0])]


def test_a_node_with_no_text_and_no_llm_metadata_is_still_left_out() -> None:
    hidden = TextNode(text=" ", metadata={"title": "x"}, excluded_llm_metadata_keys=["title"])
    assert ChunkCacheRetriever(Fixed([hidden]), cache=ChunkCache()).retrieve("q") == []


def test_a_metadata_only_node_passes_the_postprocessor() -> None:
    cache = ChunkCache()
    retriever = ChunkCacheRetriever(Fixed([TITLE_ONLY, TextNode(text=TEXTS[1])]), cache=cache)
    behind = ChunkCachePostprocessor(cache=cache).postprocess_nodes(retriever.retrieve("q"))
    alone = ChunkCachePostprocessor(cache=ChunkCache()).postprocess_nodes(
        Fixed([TITLE_ONLY, TextNode(text=TEXTS[1])]).retrieve("q")
    )
    for nodes in (behind, alone):
        assert [n.node.get_content() for n in nodes] == [TEXTS[1], ""]


def test_a_metadata_only_node_in_a_chat_turn_and_as_explicit_chunks() -> None:
    llm = make_llm()
    engine = ChunkCacheChatEngine.from_defaults(Fixed([TITLE_ONLY, TextNode(text=TEXTS[2])]), llm)
    response = engine.chat("What changed?")
    assert "Release notes for json 2.0" in sent_text(backend_of(llm).requests[-1])
    assert engine.chat_history[0].additional_kwargs["chunk_ids"] == [chunk_id(TEXTS[2])]
    llm.complete(f"{TEXTS[2]} title", chunks=response.source_nodes)
    assert chunk_ids(backend_of(llm).requests[-1]) == [chunk_id(TEXTS[2])]
