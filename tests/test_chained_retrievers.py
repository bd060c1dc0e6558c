"""A wrapper around a wrapper on one cache plans each request once (both frameworks)."""

from __future__ import annotations

from typing import Any

import pytest
from langchain_core.callbacks import CallbackManagerForRetrieverRun
from langchain_core.documents import Document
from langchain_core.retrievers import BaseRetriever as LangChainRetriever
from langchain_core.runnables import RunnableConfig
from llama_index.core.retrievers import BaseRetriever as LlamaRetriever
from llama_index.core.schema import NodeWithScore, QueryBundle, TextNode

from chunkcache.core import ChunkCache, chunk_id
from chunkcache.core.retrieval import plan_retrieval, retrieval_scope
from chunkcache.integrations import langchain as lc
from chunkcache.integrations import llama_index as li

A, B, C = (
    "Alpha: json.dumps serializes an object to a JSON string.",
    "Bravo: json.loads parses a JSON string into Python objects.",
    "Charlie: pathlib.Path joins paths with the / operator.",
)
RESULTS = {"q1": [A, B], "q2": [B, C]}


def counts(cache: ChunkCache) -> dict[str, int]:
    return {text[0]: cache.access_table.count(chunk_id(text)) for text in (A, B, C)}


# --- core ------------------------------------------------------------------------------


def test_plan_is_left_to_the_open_scope_on_the_same_cache_only() -> None:
    cache, other = ChunkCache(), ChunkCache()
    documents: list[tuple[str, Any]] = [(A, None)]
    with retrieval_scope(cache, None) as scope:
        nested = plan_retrieval(
            documents, cache, conversation_id="inner", ordering="tree", dedupe="drop"
        )
        elsewhere = plan_retrieval(
            documents, other, conversation_id=None, ordering="tree", dedupe="drop"
        )
    assert nested is None and elsewhere is not None
    assert scope.conversation_id == "inner"  # the outer one had none
    assert (cache.num_requests, len(cache.ledger), other.num_requests) == (0, 0, 1)


# --- LangChain -------------------------------------------------------------------------


class ListRetriever(LangChainRetriever):
    """Returns the texts listed under the query."""

    results: dict[str, list[str]]

    def _get_relevant_documents(
        self, query: str, *, run_manager: CallbackManagerForRetrieverRun
    ) -> list[Document]:
        return [Document(page_content=text) for text in self.results[query]]


class BothRetriever(LangChainRetriever):
    """Another library's retriever: the documents of two retrievers, in turn."""

    first: LangChainRetriever
    second: LangChainRetriever

    def _get_relevant_documents(
        self, query: str, *, run_manager: CallbackManagerForRetrieverRun
    ) -> list[Document]:
        return [*self.first.invoke(query), *self.second.invoke(query)]


def session(name: str) -> RunnableConfig:
    return RunnableConfig(configurable={"session_id": name})


def langchain_chain(cache: ChunkCache, dedupe: Any = "drop") -> lc.ChunkCacheRetriever:
    inner = lc.ChunkCacheRetriever(
        base_retriever=ListRetriever(results=RESULTS), cache=cache, dedupe=dedupe
    )
    return lc.ChunkCacheRetriever(
        base_retriever=inner, cache=cache, ordering="retriever", dedupe=dedupe
    )


def test_langchain_chained_wrappers_count_and_dedupe_once() -> None:
    cache = ChunkCache()
    outer = langchain_chain(cache)
    first = outer.invoke("q1", config=session("s"))
    assert [d.page_content for d in first] == [A, B]
    assert counts(cache) == {"A": 1, "B": 1, "C": 0}
    assert cache.num_requests == 1
    second = outer.invoke("q2", config=session("s"))
    assert [d.page_content for d in second] == [C]  # B was sent in turn 1
    assert [d.metadata["chunk_id"] for d in second] == [chunk_id(C)]


async def test_langchain_async_chain_counts_once() -> None:
    cache = ChunkCache()
    outer = langchain_chain(cache, dedupe="mark")
    await outer.ainvoke("q1", config=session("s"))
    docs = await outer.ainvoke("q2", config=session("s"))
    assert [d.metadata["seen_in_conversation"] for d in docs] == [True, False]
    assert counts(cache) == {"A": 1, "B": 2, "C": 1}


def test_langchain_wrappers_inside_another_retriever_leave_it_to_the_outer_one() -> None:
    cache = ChunkCache()
    wrapped = [
        lc.ChunkCacheRetriever(base_retriever=ListRetriever(results=RESULTS), cache=cache)
        for _ in range(2)
    ]
    outer = lc.ChunkCacheRetriever(
        base_retriever=BothRetriever(first=wrapped[0], second=wrapped[1]), cache=cache
    )
    assert len(outer.invoke("q1")) == 2  # the duplicates collapse
    assert (counts(cache), cache.num_requests) == ({"A": 1, "B": 1, "C": 0}, 1)


def test_langchain_wrappers_on_different_caches_each_plan() -> None:
    inner_cache, outer_cache = ChunkCache(), ChunkCache()
    inner = lc.ChunkCacheRetriever(base_retriever=ListRetriever(results=RESULTS), cache=inner_cache)
    lc.ChunkCacheRetriever(base_retriever=inner, cache=outer_cache).invoke("q1")
    assert counts(inner_cache) == counts(outer_cache) == {"A": 1, "B": 1, "C": 0}


# --- LlamaIndex ------------------------------------------------------------------------


class FixedRetriever(LlamaRetriever):
    """Returns fresh nodes for the texts listed under each query."""

    def __init__(self, results: dict[str, list[str]]) -> None:
        super().__init__()
        self.results = results

    def _retrieve(self, query_bundle: QueryBundle) -> list[NodeWithScore]:
        texts = self.results[query_bundle.query_str]
        return [NodeWithScore(node=TextNode(text=text), score=1.0) for text in texts]


def texts(nodes: list[NodeWithScore]) -> list[str]:
    return [n.node.get_content() for n in nodes]


@pytest.mark.parametrize("outer_conversation", ["conv", None])
def test_llama_index_chained_drop_wrappers_keep_the_first_turn(
    outer_conversation: str | None,
) -> None:
    cache = ChunkCache()
    inner = li.ChunkCacheRetriever(
        FixedRetriever(RESULTS), cache=cache, dedupe="drop", conversation_id="conv"
    )
    outer = li.ChunkCacheRetriever(
        inner,
        cache=cache,
        ordering="retriever",
        dedupe="drop",
        conversation_id=outer_conversation,  # without one, the inner wrapper's is used
    )
    assert texts(outer.retrieve("q1")) == [A, B]
    assert counts(cache) == {"A": 1, "B": 1, "C": 0}
    assert texts(outer.retrieve("q2")) == [C]
    assert cache.ledger.seen("conv") == {chunk_id(A), chunk_id(B), chunk_id(C)}


async def test_llama_index_async_chain_plans_once() -> None:
    cache = ChunkCache()
    inner = li.ChunkCacheRetriever(FixedRetriever(RESULTS), cache=cache, dedupe="drop")
    outer = li.ChunkCacheRetriever(
        inner, cache=cache, dedupe="drop", conversation_id="conv", ordering="retriever"
    )
    assert texts(await outer.aretrieve("q1")) == [A, B]
    assert texts(await outer.aretrieve("q2")) == [C]
    assert counts(cache) == {"A": 1, "B": 2, "C": 1}


def test_llama_index_postprocessor_inside_a_wrapped_retriever_leaves_it_to_the_wrapper() -> None:
    cache = ChunkCache()
    postprocessor = li.ChunkCachePostprocessor(cache=cache, dedupe="drop", conversation_id="c")

    class Postprocessed(LlamaRetriever):
        def _retrieve(self, query_bundle: QueryBundle) -> list[NodeWithScore]:
            nodes = FixedRetriever(RESULTS).retrieve(query_bundle)
            return postprocessor.postprocess_nodes(nodes, query_bundle)

    outer = li.ChunkCacheRetriever(Postprocessed(), cache=cache, dedupe="drop")
    assert sorted(texts(outer.retrieve("q1"))) == [A, B]
    assert outer.retrieve("q1") == []  # deduped in conversation "c", the postprocessor's
    assert (counts(cache), cache.num_requests) == ({"A": 2, "B": 2, "C": 0}, 2)
