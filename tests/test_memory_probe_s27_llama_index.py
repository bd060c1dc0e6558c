"""Probe s27: LlamaIndex state that must not grow with the number of requests.

A LlamaIndex ``CallbackManager`` keeps a trace map (event ids under their parent's) and
clears it only when a trace starts on it at the top.  A manager that only ever runs nested
under another one's trace keeps two entries per request, for the life of the process.
LlamaIndex's components share one manager (``Settings.callback_manager``) for that reason;
a ``ChunkCacheRetriever`` with a manager of its own nested one under the other: its base's
under a direct ``retrieve`` or a ``ChunkCacheChatEngine`` turn, its own under a query engine.
"""

from __future__ import annotations

from fake_backend import FakeBackend
from llama_index.core.callbacks import CallbackManager
from llama_index.core.query_engine import RetrieverQueryEngine
from llama_index.core.retrievers import BaseRetriever
from llama_index.core.schema import NodeWithScore, QueryBundle, TextNode

from chunkcache.core import ChunkCache
from chunkcache.integrations.llama_index import ChunkCacheLLM, ChunkCacheRetriever
from chunkcache.integrations.llama_index_chat import ChunkCacheChatEngine

REQUESTS = 60
# A finished request leaves its own trace in a manager (the map is cleared when the next
# one starts), never more than a few entries.
MAX_ENTRIES = 8


class FreshTexts(BaseRetriever):
    """Two chunks no earlier query returned: ever-new texts, as in a long-running service."""

    def _retrieve(self, query_bundle: QueryBundle) -> list[NodeWithScore]:
        query = query_bundle.query_str
        return [
            NodeWithScore(node=TextNode(text=f"Chunk {i} for {query}: text long enough to match."))
            for i in range(2)
        ]


def trace_entries(*managers: CallbackManager) -> int:
    """Parents and event ids held in the trace maps of ``managers`` (each counted once)."""
    unique = {id(m): m for m in managers}.values()
    return sum(1 + len(ids) for m in unique for ids in m.trace_map.values())


def test_direct_retrieves_leave_no_trace_entries_behind() -> None:
    base = FreshTexts(callback_manager=CallbackManager())
    retriever = ChunkCacheRetriever(base, cache=ChunkCache(backend=FakeBackend()))
    for i in range(REQUESTS):
        retriever.for_conversation(f"conv-{i}").retrieve(f"q{i}")
    assert trace_entries(retriever.callback_manager, base.callback_manager) <= MAX_ENTRIES


async def test_async_retrieves_leave_no_trace_entries_behind() -> None:
    base = FreshTexts(callback_manager=CallbackManager())
    retriever = ChunkCacheRetriever(base, cache=ChunkCache(backend=FakeBackend()))
    for i in range(REQUESTS):
        await retriever.aretrieve(f"q{i}")
    assert trace_entries(retriever.callback_manager, base.callback_manager) <= MAX_ENTRIES


def test_a_query_engine_over_the_retriever_leaves_no_trace_entries_behind() -> None:
    # As index.as_query_engine() builds it: the index's retriever and the engine share one
    # manager (Settings.callback_manager there).
    manager = CallbackManager()
    cache = ChunkCache(backend=FakeBackend())
    retriever = ChunkCacheRetriever(FreshTexts(callback_manager=manager), cache=cache)
    engine = RetrieverQueryEngine.from_args(
        retriever, llm=ChunkCacheLLM(cache=cache, max_tokens=4), callback_manager=manager
    )
    for i in range(REQUESTS):
        engine.query(f"q{i}")
    assert trace_entries(retriever.callback_manager, manager) <= MAX_ENTRIES


def test_chat_engine_turns_leave_no_trace_entries_behind() -> None:
    base = FreshTexts(callback_manager=CallbackManager())
    cache = ChunkCache(backend=FakeBackend())
    retriever = ChunkCacheRetriever(base, cache=cache, dedupe="drop")
    chat = ChunkCacheChatEngine(
        retriever.for_conversation("c"),
        ChunkCacheLLM(cache=cache, max_tokens=4),
        max_history_turns=2,
    )
    for i in range(REQUESTS):
        chat.chat(f"q{i}")
    assert trace_entries(retriever.callback_manager, base.callback_manager) <= MAX_ENTRIES


def test_a_callback_manager_given_is_kept() -> None:
    mine = CallbackManager()
    retriever = ChunkCacheRetriever(FreshTexts(), callback_manager=mine)
    assert retriever.callback_manager is mine
    assert retriever.for_conversation("c").callback_manager is mine
