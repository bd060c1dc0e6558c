"""Review of the LangChain ChunkCacheRetriever: what reaches the base retriever (the caller's
config, ``k``) and that the async path returns what the sync one does."""

from __future__ import annotations

from typing import Any
from uuid import UUID

import pytest
from langchain_core.callbacks import BaseCallbackHandler, CallbackManagerForRetrieverRun
from langchain_core.documents import Document
from langchain_core.retrievers import BaseRetriever
from langchain_core.runnables import RunnableConfig

from chunkcache.core import ChunkCache
from chunkcache.integrations.langchain import ChunkCacheRetriever

TEXTS = [f"review text {i}" for i in range(8)]


def session(name: str, **configurable: Any) -> RunnableConfig:
    return RunnableConfig(configurable={"session_id": name, **configurable})


class ConfigReading(BaseRetriever):
    """Reads ``config["configurable"]["user"]`` in ``invoke``, as EnsembleRetriever and
    configurable retrievers do: returns that user's documents."""

    def invoke(
        self, input: str, config: RunnableConfig | None = None, **kwargs: Any
    ) -> list[Document]:
        user = ((config or {}).get("configurable") or {}).get("user", "nobody")
        return super().invoke(input, config, user=user, **kwargs)

    async def ainvoke(
        self, input: str, config: RunnableConfig | None = None, **kwargs: Any
    ) -> list[Document]:
        user = ((config or {}).get("configurable") or {}).get("user", "nobody")
        return await super().ainvoke(input, config, user=user, **kwargs)

    def _get_relevant_documents(
        self, query: str, *, run_manager: CallbackManagerForRetrieverRun, user: str = ""
    ) -> list[Document]:
        return [Document(page_content=f"{user}'s document")]

    async def _aget_relevant_documents(
        self, query: str, *, run_manager: Any, user: str = ""
    ) -> list[Document]:
        return [Document(page_content=f"{user}'s document")]


def test_the_callers_configurable_reaches_the_base_retriever() -> None:
    wrapped = ChunkCacheRetriever(base_retriever=ConfigReading(), cache=ChunkCache())
    docs = wrapped.invoke("q", config=session("s", user="alice"))
    assert [d.page_content for d in docs] == ["alice's document"]


async def test_the_callers_configurable_reaches_the_base_retriever_async() -> None:
    wrapped = ChunkCacheRetriever(base_retriever=ConfigReading(), cache=ChunkCache())
    docs = await wrapped.ainvoke("q", config=session("s", user="alice"))
    assert [d.page_content for d in docs] == ["alice's document"]


class Listed(BaseRetriever):
    """The first ``k`` of ``TEXTS``; sync only (no native async)."""

    def _get_relevant_documents(
        self, query: str, *, run_manager: CallbackManagerForRetrieverRun, k: int = 3
    ) -> list[Document]:
        return [Document(page_content=t) for t in TEXTS[:k]]


def test_an_inner_wrapper_on_another_cache_dedupes_by_the_callers_session() -> None:
    inner = ChunkCacheRetriever(base_retriever=Listed(), cache=ChunkCache(), dedupe="drop")
    outer = ChunkCacheRetriever(base_retriever=inner, cache=ChunkCache(), dedupe="off")
    assert len(outer.invoke("q", config=session("s"))) == 3
    assert outer.invoke("q", config=session("s")) == []  # the inner one dropped them
    assert inner.cache.ledger.seen("s") and not outer.cache.ledger.seen("s")


class Events(BaseCallbackHandler):
    """Records (run id, parent run id) of every retriever run."""

    def __init__(self) -> None:
        self.runs: list[tuple[UUID, UUID | None]] = []

    def on_retriever_start(
        self,
        serialized: Any,
        query: str,
        *,
        run_id: UUID,
        parent_run_id: UUID | None = None,
        **kwargs: Any,
    ) -> None:
        self.runs.append((run_id, parent_run_id))


@pytest.mark.parametrize("is_async", [False, True])
async def test_the_base_run_is_a_child_of_the_wrappers(is_async: bool) -> None:
    events = Events()
    wrapped = ChunkCacheRetriever(base_retriever=Listed(), cache=ChunkCache(), k=2)
    config = RunnableConfig(callbacks=[events], run_name="mine")
    docs = await wrapped.ainvoke("q", config) if is_async else wrapped.invoke("q", config)
    assert len(docs) == 2
    (outer, no_parent), (_, parent) = events.runs
    assert (no_parent, parent) == (None, outer)


@pytest.mark.parametrize("k", [2, 5])
async def test_async_returns_what_sync_does_for_a_sync_only_base_taking_k(k: int) -> None:
    wrapped = ChunkCacheRetriever(
        base_retriever=Listed(), cache=ChunkCache(), ordering="retriever", k=k
    )
    sync = [d.page_content for d in wrapped.invoke("q")]
    assert sync == TEXTS[:k]
    assert [d.page_content for d in await wrapped.ainvoke("q")] == sync


class Filtered(BaseRetriever):
    """Takes a ``filter`` keyword but no ``k``: all of ``TEXTS`` that pass it."""

    def _get_relevant_documents(
        self,
        query: str,
        *,
        run_manager: CallbackManagerForRetrieverRun,
        filter: str | None = None,
    ) -> list[Document]:
        return [Document(page_content=t) for t in TEXTS if filter is None or filter in t]

    async def _aget_relevant_documents(
        self, query: str, *, run_manager: Any, filter: str | None = None
    ) -> list[Document]:
        return self._get_relevant_documents(query, run_manager=run_manager, filter=filter)


@pytest.mark.parametrize("is_async", [False, True])
async def test_k_is_not_forced_on_a_base_with_other_keywords_but_no_k(is_async: bool) -> None:
    wrapped = ChunkCacheRetriever(
        base_retriever=Filtered(), cache=ChunkCache(), ordering="retriever", k=2
    )
    if is_async:
        docs = await wrapped.ainvoke("q", filter="text")
    else:
        docs = wrapped.invoke("q", filter="text")
    assert [d.page_content for d in docs] == TEXTS[:2]


def test_a_per_call_k_of_none_leaves_the_constructors() -> None:
    wrapped = ChunkCacheRetriever(base_retriever=Listed(), cache=ChunkCache(), k=2)
    assert len(wrapped.invoke("q", k=None)) == 2
