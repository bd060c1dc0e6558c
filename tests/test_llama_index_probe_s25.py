"""LlamaIndex integration probed as an app uses it (session 25): retrieved media nodes."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from fake_backend import FakeBackend
from llama_index.core import get_response_synthesizer
from llama_index.core.base.llms.types import (
    ChatMessage,
    ChatResponse,
    ImageBlock,
    LLMMetadata,
    MessageRole,
)
from llama_index.core.bridge.pydantic import Field
from llama_index.core.llms import MockLLM
from llama_index.core.query_engine import RetrieverQueryEngine
from llama_index.core.retrievers import BaseRetriever
from llama_index.core.schema import (
    BaseNode,
    ImageNode,
    MediaResource,
    Node,
    NodeWithScore,
    QueryBundle,
    TextNode,
)

from chunkcache.core import ChunkCache, chunk_id
from chunkcache.integrations.llama_index import (
    ChunkCacheLLM,
    ChunkCachePostprocessor,
    ChunkCacheRetriever,
)
from chunkcache.integrations.llama_index_chat import ChunkCacheChatEngine

TEXT = "A cat sits on the mat and watches the birds outside."
PNG = "iVBORw0KGgo="  # base64 of a PNG signature: LlamaIndex decodes it without fetching


def media_nodes() -> list[BaseNode]:
    """Nodes with no text whose content is an image or audio, no metadata for the LLM."""
    return [
        ImageNode(image=PNG, image_mimetype="image/png"),
        ImageNode(image_path="/data/figures/cat.png"),
        Node(audio_resource=MediaResource(path=Path("/data/sounds/purr.mp3"))),
    ]


class Fixed(BaseRetriever):
    """Returns the given nodes, a text chunk first."""

    def __init__(self, nodes: Sequence[BaseNode]) -> None:
        super().__init__()
        self._nodes = nodes

    def _retrieve(self, query_bundle: QueryBundle) -> list[NodeWithScore]:
        return [NodeWithScore(node=n, score=1.0 - i / 10) for i, n in enumerate(self._nodes)]


def all_nodes() -> list[BaseNode]:
    return [TextNode(text=TEXT), *media_nodes()]


@pytest.mark.parametrize("wrap", ["retriever", "postprocessor"])
def test_media_nodes_without_text_are_kept_after_the_chunks(wrap: str) -> None:
    """A drop-in wrapper must not drop an image the app retrieved: LlamaIndex's multimodal
    synthesizers send it to the LLM."""
    nodes = all_nodes()
    cache = ChunkCache()
    if wrap == "retriever":
        out = ChunkCacheRetriever(Fixed(nodes), cache=cache).retrieve("q")
    else:
        out = ChunkCachePostprocessor(cache=cache).postprocess_nodes(Fixed(nodes).retrieve("q"))
    assert [n.node.node_id for n in out] == [n.node_id for n in nodes]
    assert out[0].node.metadata["chunk_id"] == chunk_id(TEXT)
    assert all("chunk_id" not in n.node.metadata for n in out[1:])  # no text: no chunk
    assert isinstance(out[1].node, ImageNode) and out[1].node.image == PNG
    assert cache.registry.get(chunk_id(TEXT)) == TEXT


class RecordingChatLLM(MockLLM):
    """A chat LLM that records the messages it is sent."""

    sent: list[list[ChatMessage]] = Field(default_factory=list)

    @property
    def metadata(self) -> LLMMetadata:
        return LLMMetadata(is_chat_model=True)

    def chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        self.sent.append(list(messages))
        return ChatResponse(message=ChatMessage(role=MessageRole.ASSISTANT, content="A cat."))


def test_a_multimodal_query_engine_still_sends_the_retrieved_image() -> None:
    llm = RecordingChatLLM(max_tokens=None)
    retriever = ChunkCacheRetriever(
        Fixed([TextNode(text=TEXT), media_nodes()[0]]), cache=ChunkCache()
    )
    synthesizer = get_response_synthesizer(llm=llm, multimodal=True)
    response = RetrieverQueryEngine(retriever, response_synthesizer=synthesizer).query("animal?")
    assert len(response.source_nodes) == 2
    images = [b for m in llm.sent[0] for b in m.blocks if isinstance(b, ImageBlock)]
    assert len(images) == 1


def test_the_chat_engine_leaves_a_textless_image_out_of_its_text_prompt() -> None:
    """The chat engine sends text: an image node (now returned by its retriever) adds no
    empty context entry, and a turn that retrieved only an image sends the question alone."""
    llm = ChunkCacheLLM(cache=ChunkCache(backend=FakeBackend()))
    retriever = Fixed([TextNode(text=TEXT), media_nodes()[0]])
    engine = ChunkCacheChatEngine.from_defaults(retriever, llm, context_template="{context_str}|")
    assert len(engine.chat("What does the cat do?").source_nodes) == 2
    assert engine.chat_history[0].content == f"{TEXT}|"
    image_only = ChunkCacheChatEngine.from_defaults(Fixed(media_nodes()[:1]), llm)
    image_only.chat("What is in the picture?")
    assert image_only.chat_history[0].content == "What is in the picture?"
