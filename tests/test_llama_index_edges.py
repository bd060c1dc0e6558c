"""LlamaIndex integration edge cases found by probing the real LlamaIndex classes: node text
with whitespace around it, and the chat engine's conversation id."""

from __future__ import annotations

import pytest
from fake_backend import FakeBackend
from llama_index.core.query_engine import RetrieverQueryEngine
from llama_index.core.response_synthesizers import ResponseMode
from llama_index.core.retrievers import BaseRetriever, QueryFusionRetriever
from llama_index.core.schema import MetadataMode, NodeWithScore, QueryBundle, TextNode
from test_llama_index_llm import TEXTS, backend_of, chunk_ids, make_llm
from test_llama_index_window import Records

from chunkcache.core import ChunkCache, InvalidConversationIdError, chunk_id
from chunkcache.integrations.llama_index import ChunkCachePostprocessor, ChunkCacheRetriever
from chunkcache.integrations.llama_index_chat import ChunkCacheChatEngine

# Text as a file read whole gives it (final newline), or a store another pipeline filled.
PADDED = [f"\n  {text}  \n" for text in TEXTS]
MODES = [
    ResponseMode.COMPACT,
    ResponseMode.REFINE,
    ResponseMode.TREE_SUMMARIZE,
    ResponseMode.ACCUMULATE,
]


class Padded(BaseRetriever):
    """Nodes whose text has whitespace around it, with metadata the LLM sees."""

    def _retrieve(self, query_bundle: QueryBundle) -> list[NodeWithScore]:
        return [
            NodeWithScore(node=TextNode(text=text, metadata={"file_name": f"doc{i}.txt"}))
            for i, text in enumerate(PADDED)
        ]


def found_ids(backend: FakeBackend) -> set[str]:
    return {cid for request in backend.requests for cid in chunk_ids(request)}


@pytest.mark.parametrize("mode", MODES)
def test_padded_nodes_are_found_in_a_query_engines_prompts(mode: ResponseMode) -> None:
    """LlamaIndex strips a node's text when it renders it with metadata and when a
    synthesizer packs nodes into a prompt: the chunk must be the stripped text."""
    llm = make_llm()
    retriever = ChunkCacheRetriever(Padded(), cache=llm.cache)
    response = RetrieverQueryEngine.from_args(retriever, llm=llm, response_mode=mode).query("q")
    sent = {n.node.metadata["chunk_id"] for n in response.source_nodes}
    assert len(sent) == len(PADDED) and found_ids(backend_of(llm)) == sent


@pytest.mark.parametrize("mode", MODES)
def test_padded_nodes_are_found_behind_the_postprocessor(mode: ResponseMode) -> None:
    llm = make_llm()
    engine = RetrieverQueryEngine.from_args(
        Padded(),
        llm=llm,
        response_mode=mode,
        node_postprocessors=[ChunkCachePostprocessor(cache=llm.cache)],
    )
    response = engine.query("q")
    sent = {n.node.metadata["chunk_id"] for n in response.source_nodes}
    assert len(sent) == len(PADDED) and found_ids(backend_of(llm)) == sent


def test_explicit_padded_nodes_are_found_under_the_retrievers_ids() -> None:
    nodes = ChunkCacheRetriever(Padded(), cache=ChunkCache()).retrieve("q")
    prompt = "\n\n".join(n.node.get_content(metadata_mode=MetadataMode.LLM) for n in nodes)
    llm = make_llm()  # another cache: only the chunks named in the call can be found
    llm.complete(prompt, chunks=[Padded().retrieve("q")[0]])
    assert chunk_ids(backend_of(llm).requests[-1]) == [nodes_id(nodes, PADDED[0])]


def nodes_id(nodes: list[NodeWithScore], text: str) -> str:
    (node,) = [n for n in nodes if n.node.get_content() == text]
    chunk_id: str = node.node.metadata["chunk_id"]
    return chunk_id


def test_the_chat_engine_holds_padded_chunks_and_does_not_send_them_twice() -> None:
    llm = make_llm()
    engine = ChunkCacheChatEngine.from_defaults(Padded(), llm)
    first = engine.chat("q1")
    again = engine.chat("q2")  # the same nodes: all still in the prompt
    sent = {n.node.metadata["chunk_id"] for n in first.source_nodes}
    assert len(sent) == len(PADDED) and set(chunk_ids(backend_of(llm).requests[0])) == sent
    assert again.source_nodes == []


@pytest.mark.parametrize("conversation_id", [0, 7])
def test_the_chat_engine_keeps_an_int_conversation_id(conversation_id: int) -> None:
    llm = make_llm()
    engine = ChunkCacheChatEngine.from_defaults(
        Padded(),
        llm,
        conversation_id=conversation_id,  # type: ignore[arg-type]
    )
    engine.chat("q")
    assert engine.conversation_id == str(conversation_id)
    assert backend_of(llm).requests[-1].conversation_id == str(conversation_id)


def test_the_chat_engine_refuses_an_empty_conversation_id() -> None:
    with pytest.raises(InvalidConversationIdError):
        ChunkCacheChatEngine.from_defaults(Padded(), make_llm(), conversation_id="")


def test_a_chunk_two_wrapped_sub_retrievers_returned_reaches_the_prompt_once() -> None:
    """Fusion merges nodes by hash, which covers the metadata a wrapper adds (its rank):
    a chunk two wrapped sub-retrievers return at different ranks comes out twice."""
    llm = make_llm()
    shared, first, second = TEXTS
    fusion = QueryFusionRetriever(
        [
            ChunkCacheRetriever(Records([shared, first]), cache=llm.cache),
            ChunkCacheRetriever(Records([second, shared]), cache=llm.cache, ordering="retriever"),
        ],
        llm=llm,
        num_queries=1,
        use_async=False,
        similarity_top_k=10,
    )
    engine = RetrieverQueryEngine.from_args(
        fusion, llm=llm, node_postprocessors=[ChunkCachePostprocessor(cache=llm.cache)]
    )
    response = engine.query("q")
    assert sorted(n.node.get_content() for n in response.source_nodes) == sorted(TEXTS)
    assert sorted(chunk_ids(backend_of(llm).requests[-1])) == sorted(map(chunk_id, TEXTS))
