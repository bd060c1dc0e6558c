"""Review of chained retrieval: scopes that outlive their call, and a LlamaIndex query
engine running a ChunkCacheRetriever and a ChunkCachePostprocessor on one cache."""

from __future__ import annotations

import contextvars
from typing import Any

import pytest
from llama_index.core.llms import MockLLM
from llama_index.core.postprocessor.types import BaseNodePostprocessor
from llama_index.core.query_engine import RetrieverQueryEngine
from llama_index.core.retrievers import BaseRetriever
from llama_index.core.schema import NodeWithScore, QueryBundle, TextNode

from chunkcache.core import ChunkCache, chunk_id
from chunkcache.core.retrieval import plan_retrieval, retrieval_scope
from chunkcache.integrations import llama_index as li

A, B, C = (
    "Alpha: json.dumps serializes an object to a JSON string.",
    "Bravo: json.loads parses a JSON string into Python objects.",
    "Charlie: pathlib.Path joins paths with the / operator.",
)


def counts(cache: ChunkCache) -> dict[str, int]:
    return {text[0]: cache.access_table.count(chunk_id(text)) for text in (A, B, C)}


def test_a_context_copied_inside_a_scope_plans_again_once_the_scope_closed() -> None:
    cache = ChunkCache()
    with retrieval_scope(cache, None):
        later = contextvars.copy_context()  # e.g. a thread or task started by the base
    plan = later.run(
        plan_retrieval, [(A, None)], cache, conversation_id=None, ordering="tree", dedupe="off"
    )
    assert plan is not None and [c.chunk_id for c in plan.chunks] == [chunk_id(A)]
    assert cache.num_requests == 1


class Fixed(BaseRetriever):
    """Returns fresh nodes for ``texts``."""

    def __init__(self, texts: list[str]) -> None:
        super().__init__()
        self.texts = texts

    def _retrieve(self, query_bundle: QueryBundle) -> list[NodeWithScore]:
        return [NodeWithScore(node=TextNode(text=t), score=1.0) for t in self.texts]


class Adding(BaseNodePostprocessor):
    """Appends nodes for ``texts`` (like a postprocessor that fetches neighbours)."""

    texts: list[str]

    def _postprocess_nodes(
        self, nodes: list[NodeWithScore], query_bundle: QueryBundle | None = None
    ) -> list[NodeWithScore]:
        return [*nodes, *(NodeWithScore(node=TextNode(text=t), score=0.5) for t in self.texts)]


def engine(cache: ChunkCache, dedupe: Any, *postprocessors: Any) -> RetrieverQueryEngine:
    retriever = li.ChunkCacheRetriever(
        Fixed([A, B]), cache=cache, ordering="retriever", dedupe=dedupe, conversation_id="c"
    )
    return RetrieverQueryEngine.from_args(
        retriever, llm=MockLLM(), node_postprocessors=list(postprocessors)
    )


def texts(nodes: list[NodeWithScore]) -> list[str]:
    return [n.node.get_content() for n in nodes]


@pytest.mark.parametrize("dedupe", ["drop", "mark"])
def test_a_postprocessor_behind_a_retriever_on_its_cache_keeps_what_the_retriever_planned(
    dedupe: Any,
) -> None:
    cache = ChunkCache()
    postprocessor = li.ChunkCachePostprocessor(cache=cache, dedupe=dedupe, conversation_id="c")
    sources = engine(cache, dedupe, postprocessor).query("q").source_nodes
    assert texts(sources) == [A, B]  # not dropped as "already sent"
    if dedupe == "mark":
        assert [n.node.metadata["seen_in_conversation"] for n in sources] == [False, False]
    assert (counts(cache), cache.num_requests) == ({"A": 1, "B": 1, "C": 0}, 1)


def test_nodes_added_between_them_are_planned_after_the_retrievers() -> None:
    cache = ChunkCache()
    postprocessor = li.ChunkCachePostprocessor(cache=cache, dedupe="off")
    sources = engine(cache, "off", Adding(texts=[C, A]), postprocessor).query("q").source_nodes
    assert texts(sources) == [A, B, C]  # A again is a repeat, C is new
    assert sources[2].node.metadata["chunk_id"] == chunk_id(C)
    assert (counts(cache), cache.num_requests) == ({"A": 1, "B": 1, "C": 1}, 2)


def test_a_postprocessor_on_another_cache_or_after_a_text_change_plans() -> None:
    cache, other = ChunkCache(), ChunkCache()
    postprocessor = li.ChunkCachePostprocessor(cache=other, dedupe="drop", conversation_id="c")
    assert sorted(texts(engine(cache, "drop", postprocessor).query("q").source_nodes)) == [A, B]
    assert counts(cache) == counts(other) == {"A": 1, "B": 1, "C": 0}

    class Replacing(BaseNodePostprocessor):
        """Replaces each node's text in place (as ``MetadataReplacementPostProcessor`` does)."""

        def _postprocess_nodes(
            self, nodes: list[NodeWithScore], query_bundle: QueryBundle | None = None
        ) -> list[NodeWithScore]:
            for n in nodes:
                n.node.set_content(C)
            return nodes

    postprocessor = li.ChunkCachePostprocessor(cache=cache, dedupe="off")
    sources = engine(cache, "off", Replacing(), postprocessor).query("q").source_nodes
    # planned anew: the text they were planned with is gone, and the one text both now hold
    # is one chunk, under its own id (not one built from each replaced text's id)
    assert texts(sources) == [C]
    assert [n.node.metadata["chunk_id"] for n in sources] == [chunk_id(C)]
    assert cache.num_requests == 3  # each engine's retriever, and this postprocessor
