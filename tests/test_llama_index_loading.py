"""LlamaIndex ChunkCacheLLM: the first async call loads the model in a worker thread, never on
the event loop (LlamaIndex reads ``llm.metadata`` before our code runs, and the metadata
comes from the loaded model)."""

from __future__ import annotations

import asyncio
import threading

import pytest
from fake_backend import DEFAULT_ANSWER, FakeBackend
from llama_index.core.base.llms.types import ChatMessage, MessageRole
from llama_index.core.prompts import PromptTemplate
from llama_index.core.retrievers import BaseRetriever
from llama_index.core.schema import NodeWithScore, QueryBundle, TextNode

from chunkcache.core.cache import ChunkCache
from chunkcache.core.generation import Backend
from chunkcache.integrations.llama_index import ChunkCacheLLM
from chunkcache.integrations.llama_index_chat import ChunkCacheChatEngine

# Long enough for a test whose load wrongly blocks the loop to fail rather than hang.
LOAD_TIMEOUT_S = 5


class LoadingCache(ChunkCache):
    """A cache whose backend "loads" until ``release`` is set: every access before then
    waits for it (``loading`` says one started; ``loaders`` holds the waiting threads)."""

    def __init__(self) -> None:
        super().__init__(backend=FakeBackend())
        self.loading = threading.Event()
        self.release = threading.Event()
        self.loaders: list[int] = []

    @property
    def backend(self) -> Backend:
        if not self.release.is_set():
            self.loaders.append(threading.get_ident())
            self.loading.set()
            if not self.release.wait(timeout=LOAD_TIMEOUT_S):
                raise TimeoutError("nothing released the load: was the event loop blocked?")
        return super().backend


async def answer(llm: ChunkCacheLLM, method: str) -> str:
    """The text ``method`` answers for a one-word prompt."""
    messages = [ChatMessage(role=MessageRole.USER, content="hi")]
    if method == "apredict":
        return await llm.apredict(PromptTemplate("{q}"), q="hi")
    if method == "astream":
        return "".join([t async for t in await llm.astream(PromptTemplate("{q}"), q="hi")])
    if method == "acomplete":
        return (await llm.acomplete("hi")).text
    if method == "achat":
        return (await llm.achat(messages)).message.content or ""
    if method == "astream_complete":
        return [r async for r in await llm.astream_complete("hi")][-1].text
    return [r async for r in await llm.astream_chat(messages)][-1].message.content or ""


@pytest.mark.parametrize(
    "method", ["acomplete", "achat", "astream_complete", "astream_chat", "apredict", "astream"]
)
async def test_the_first_async_call_lets_other_coroutines_run_while_the_model_loads(
    method: str,
) -> None:
    cache = LoadingCache()
    call = asyncio.create_task(answer(ChunkCacheLLM(cache=cache), method))
    assert await asyncio.to_thread(cache.loading.wait, LOAD_TIMEOUT_S)
    assert not call.done()
    cache.release.set()  # this coroutine runs while the load waits: the loop is free
    assert await call == DEFAULT_ANSWER
    assert threading.get_ident() not in cache.loaders


class _OneChunk(BaseRetriever):
    def _retrieve(self, query_bundle: QueryBundle) -> list[NodeWithScore]:
        return [NodeWithScore(node=TextNode(text="A chunk."), score=1.0)]


def test_building_a_chat_engine_does_not_load_the_model() -> None:
    """An async app may build an engine per conversation on its event loop."""
    cache = LoadingCache()
    engine = ChunkCacheChatEngine.from_defaults(_OneChunk(), llm=ChunkCacheLLM(cache=cache))
    assert engine.conversation_id and not cache.loading.is_set()
