"""Probe s27: the state a long-running RAG service keeps stays within its bounds.

Ever-new chunk texts and conversations driven through the real wrappers (a fake base
retriever, the fake backend): the access table, prefix tree, ledger, registry and the
matcher over it stay within what ``ChunkCache(window=...)`` allows, and what a bound
evicts (the least recently used) comes back as a fresh start, not an error.
"""

from __future__ import annotations

import gc

from fake_backend import FakeBackend
from langchain_core.callbacks import CallbackManagerForRetrieverRun
from langchain_core.documents import Document
from langchain_core.messages import HumanMessage
from langchain_core.retrievers import BaseRetriever
from langchain_core.runnables import RunnableConfig
from llama_index.core.retrievers import BaseRetriever as LlamaRetriever
from llama_index.core.schema import NodeWithScore, QueryBundle, TextNode

from chunkcache.core import ChunkCache, chunk_id
from chunkcache.core.generation import GenerationRequest
from chunkcache.core.registry import ChunkRegistry
from chunkcache.core.segmenter import ChunkSegment
from chunkcache.integrations import llama_index
from chunkcache.integrations.langchain import ChunkCacheLLM, ChunkCacheRetriever

WINDOW = 10
K = 5
HOT = [f"Hot chunk {i}: a text that many requests retrieve, again and again." for i in range(8)]


class MixedTexts(BaseRetriever):
    """``K`` chunks per query: one of a few hot texts, the rest new to this query."""

    def _get_relevant_documents(
        self, query: str, *, run_manager: CallbackManagerForRetrieverRun
    ) -> list[Document]:
        n = int(query)
        fresh = [f"Chunk {n}-{i}: text never retrieved before this query." for i in range(K - 1)]
        return [Document(page_content=t) for t in [HOT[n % len(HOT)], *fresh]]


class FreshNodes(LlamaRetriever):
    def _retrieve(self, query_bundle: QueryBundle) -> list[NodeWithScore]:
        text = f"Chunk for {query_bundle.query_str}: text never retrieved before."
        return [NodeWithScore(node=TextNode(text=text))]


def session(name: str) -> RunnableConfig:
    return RunnableConfig(configurable={"session_id": name})


def chunk_ids(request: GenerationRequest) -> list[str]:
    return [s.chunk_id for s in request.segments if isinstance(s, ChunkSegment)]


def test_state_stays_within_the_window_bounds_over_many_requests() -> None:
    cache = ChunkCache(window=WINDOW, backend=FakeBackend())
    retriever = ChunkCacheRetriever(base_retriever=MixedTexts(), cache=cache)
    llm = ChunkCacheLLM(chunk_cache=cache, max_tokens=2)
    for n in range(500 * WINDOW):  # 20,000 distinct texts, 5,000 conversations
        docs = retriever.invoke(str(n), config=session(f"conv-{n}"))
        if n % 10 == 9:
            llm.invoke([HumanMessage("\n\n".join(d.page_content for d in docs))])
    stats = cache.stats()
    assert stats["access_table_requests"] == WINDOW
    assert stats["access_table_chunks"] <= WINDOW * K
    assert stats["prefix_tree_nodes"] <= 16 * WINDOW
    assert stats["conversations"] == 2 * WINDOW
    assert stats["registered_chunks"] == 20 * WINDOW
    assert len(cache.matcher.index()) == 20 * WINDOW  # follows the registry's evictions
    backend = cache.backend
    assert isinstance(backend, FakeBackend)
    assert chunk_ids(backend.requests[-1]) == [d.metadata["chunk_id"] for d in docs]


def test_an_evicted_conversation_starts_fresh_and_a_recent_one_is_kept() -> None:
    cache = ChunkCache(window=2, backend=FakeBackend())  # the ledger keeps 4 conversations
    retriever = ChunkCacheRetriever(base_retriever=MixedTexts(), cache=cache, dedupe="drop")
    first = retriever.invoke("0", config=session("old"))
    assert retriever.invoke("0", config=session("old")) == []  # all seen: dropped
    retriever.invoke("1", config=session("recent"))
    for n in range(3):
        retriever.invoke(str(10 + n), config=session(f"other-{n}"))
    retriever.invoke("1", config=session("recent"))  # a use: the least recently used go first
    retriever.invoke("20", config=session("one-more"))
    assert "old" not in cache.ledger and "recent" in cache.ledger
    again = retriever.invoke("0", config=session("old"))
    assert [d.metadata["chunk_id"] for d in again] == [d.metadata["chunk_id"] for d in first]
    assert retriever.invoke("1", config=session("recent")) == []


def test_a_chunk_the_registry_evicted_is_sent_as_plain_text() -> None:
    cache = ChunkCache(registry=ChunkRegistry(max_chunks=K), backend=FakeBackend())
    retriever = ChunkCacheRetriever(base_retriever=MixedTexts(), cache=cache)
    old = retriever.invoke("0")
    new = retriever.invoke("1")
    prompt = old[1].page_content + new[1].page_content
    ChunkCacheLLM(chunk_cache=cache).invoke([HumanMessage(prompt)])
    backend = cache.backend
    assert isinstance(backend, FakeBackend)
    assert chunk_ids(backend.requests[-1]) == [chunk_id(new[1].page_content)]


def test_planned_llama_index_nodes_are_held_only_while_the_app_holds_them() -> None:
    cache = ChunkCache(backend=FakeBackend())
    retriever = llama_index.ChunkCacheRetriever(FreshNodes(), cache=cache)
    kept = retriever.retrieve("kept")
    for n in range(200):
        retriever.retrieve(str(n))
    gc.collect()
    assert list(llama_index._planned[cache].values()) == [kept[0].node]
