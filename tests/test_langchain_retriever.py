"""ChunkCacheRetriever for LangChain: metadata, dedupe, ordering, config, k, async."""

from __future__ import annotations

from typing import Any

import pytest
from langchain_core.callbacks import CallbackManagerForRetrieverRun
from langchain_core.documents import Document
from langchain_core.retrievers import BaseRetriever
from langchain_core.runnables import RunnableConfig

from chunkcache.core import ChunkCache, chunk_id
from chunkcache.core.chunk_ids import chunk_id_for
from chunkcache.integrations.langchain import ChunkCacheRetriever, conversation_id_from_config


class ListRetriever(BaseRetriever):
    """Returns ``documents[start:start + k]`` where the query names ``start``."""

    documents: list[Document]

    def _get_relevant_documents(
        self, query: str, *, run_manager: CallbackManagerForRetrieverRun, k: int = 3
    ) -> list[Document]:
        start = int(query)
        return self.documents[start : start + k]

    async def _aget_relevant_documents(
        self, query: str, *, run_manager: Any, k: int = 3
    ) -> list[Document]:
        return self._get_relevant_documents(query, run_manager=run_manager, k=k)


def make_retriever(texts: list[str], **kwargs: Any) -> ChunkCacheRetriever:
    base = ListRetriever(documents=[Document(page_content=t) for t in texts])
    return ChunkCacheRetriever(base_retriever=base, cache=ChunkCache(), **kwargs)


TEXTS = [f"chunk number {i}" for i in range(10)]


def session(name: str) -> RunnableConfig:
    return RunnableConfig(configurable={"session_id": name})


def test_every_document_gets_chunk_metadata_and_id() -> None:
    docs = make_retriever(TEXTS, ordering="retriever").invoke("0")
    assert [d.metadata["chunk_id"] for d in docs] == [chunk_id(t) for t in TEXTS[:3]]
    assert [d.metadata["retriever_rank"] for d in docs] == [0, 1, 2]
    assert all(d.id == d.metadata["chunk_id"] for d in docs)


def test_existing_ids_are_kept_or_bound_and_base_documents_untouched() -> None:
    source = Document(page_content="text", id="doc-7", metadata={"chunk_id": "my-id"})
    ours = Document(page_content="more", metadata={"chunk_id": chunk_id("more")})
    base = ListRetriever(documents=[source, ours])
    retriever = ChunkCacheRetriever(base_retriever=base, cache=ChunkCache(), ordering="retriever")
    doc, again = retriever.invoke("0", k=2)
    assert (doc.id, doc.metadata["chunk_id"]) == ("doc-7", chunk_id_for("text", source.metadata))
    assert again.metadata["chunk_id"] == chunk_id("more")  # a chunkcache id is kept
    assert source.metadata == {"chunk_id": "my-id"}


def test_duplicate_documents_collapse_to_best_rank() -> None:
    docs = make_retriever(["a", "b", "a", "c"], ordering="retriever").invoke("0", k=4)
    assert [d.page_content for d in docs] == ["a", "b", "c"]
    assert [d.metadata["retriever_rank"] for d in docs] == [0, 1, 2]


def test_k_is_forwarded_from_constructor_and_call() -> None:
    assert len(make_retriever(TEXTS, k=5).invoke("0")) == 5
    assert len(make_retriever(TEXTS, k=5).invoke("0", k=2)) == 2


@pytest.mark.parametrize("key", ["conversation_id", "session_id", "thread_id"])
def test_conversation_id_read_from_any_config_key(key: str) -> None:
    assert conversation_id_from_config(RunnableConfig(configurable={key: "c1"})) == "c1"


def test_conversation_id_key_precedence() -> None:
    config = RunnableConfig(configurable={"thread_id": "t", "conversation_id": "c"})
    assert conversation_id_from_config(config) == "c"
    assert conversation_id_from_config(None) is None


def test_drop_removes_chunks_seen_earlier_in_the_same_conversation_only() -> None:
    retriever = make_retriever(TEXTS, dedupe="drop")
    retriever.invoke("0", config=session("s1"))
    again = retriever.invoke("1", config=session("s1"))
    assert [d.page_content for d in again] == [TEXTS[3]]
    other = retriever.invoke("1", config=session("s2"))
    assert len(other) == 3


def test_mark_keeps_chunks_and_flags_seen_ones() -> None:
    retriever = make_retriever(TEXTS, dedupe="mark")
    retriever.invoke("0", config=session("s1"))
    docs = retriever.invoke("1", config=session("s1"))
    seen = {d.page_content: d.metadata["seen_in_conversation"] for d in docs}
    assert seen == {TEXTS[1]: True, TEXTS[2]: True, TEXTS[3]: False}


def test_off_neither_drops_nor_marks() -> None:
    retriever = make_retriever(TEXTS, dedupe="off")
    retriever.invoke("0", config=session("s1"))
    docs = retriever.invoke("0", config=session("s1"))
    assert len(docs) == 3
    assert all("seen_in_conversation" not in d.metadata for d in docs)


def test_new_chunks_are_ordered_independently_of_retriever_rank() -> None:
    # Chunks first seen together tie on count and go by id, so the same set
    # retrieved in another order by another conversation lines up the same way.
    first = make_retriever(["a", "b", "c"]).invoke("0")
    second = make_retriever(["c", "a", "b"]).invoke("0")
    assert [d.page_content for d in first] == [d.page_content for d in second]


def test_frequency_order_puts_popular_chunks_first() -> None:
    retriever = make_retriever(TEXTS, ordering="frequency")
    for _ in range(3):
        retriever.invoke("2", k=1)
    docs = retriever.invoke("0", k=3)
    assert docs[0].page_content == TEXTS[2]


def test_retriever_order_is_left_alone() -> None:
    retriever = make_retriever(TEXTS, ordering="retriever")
    retriever.invoke("2", k=1)
    assert [d.page_content for d in retriever.invoke("0")] == TEXTS[:3]


def test_equal_sets_get_equal_orders() -> None:
    texts = ["x", "y", "z", "x", "y"]
    retriever = make_retriever(texts, ordering="tree")
    first = retriever.invoke("0", k=3)
    second = retriever.invoke("1", k=3)  # y, z, x: same set, other order
    assert [d.page_content for d in first] == [d.page_content for d in second]


def test_empty_documents_are_left_out() -> None:
    docs = make_retriever(["", "  \n", "real text"]).invoke("0")
    assert [d.page_content for d in docs] == ["real text"]


def test_invalid_settings_are_rejected() -> None:
    with pytest.raises(ValueError):
        make_retriever(TEXTS, ordering="random")
    with pytest.raises(ValueError):
        make_retriever(TEXTS, dedupe="sometimes")


def test_wrappers_share_the_default_cache() -> None:
    base = ListRetriever(documents=[Document(page_content=t) for t in TEXTS])
    first = ChunkCacheRetriever(base_retriever=base)
    second = ChunkCacheRetriever(base_retriever=base)
    assert first.cache is second.cache


def test_registers_chunk_texts_for_the_llm_side() -> None:
    retriever = make_retriever(TEXTS)
    docs = retriever.invoke("0")
    assert retriever.cache.registry.get(docs[0].metadata["chunk_id"]) == docs[0].page_content


async def test_async_matches_sync() -> None:
    retriever = make_retriever(TEXTS, dedupe="drop")
    await retriever.ainvoke("0", config=session("a"))
    docs = await retriever.ainvoke("1", config=session("a"), k=3)
    assert [d.page_content for d in docs] == [TEXTS[3]]


class AllRetriever(BaseRetriever):
    """Returns every document, and takes no ``k``: langchain-core drops one given to it."""

    documents: list[Document]

    def _get_relevant_documents(
        self, query: str, *, run_manager: CallbackManagerForRetrieverRun
    ) -> list[Document]:
        return self.documents


def test_k_holds_for_a_base_retriever_that_takes_none() -> None:
    base = AllRetriever(documents=[Document(page_content=f"text {i}") for i in range(10)])
    wrapped = ChunkCacheRetriever(base_retriever=base, cache=ChunkCache(), ordering="retriever")
    assert [d.page_content for d in wrapped.model_copy(update={"k": 2}).invoke("q")] == [
        "text 0",
        "text 1",
    ]
    assert len(wrapped.invoke("q")) == 10  # no k: everything


def test_a_per_call_k_wins_over_the_constructors() -> None:
    base = ListRetriever(documents=[Document(page_content=f"text {i}") for i in range(10)])
    wrapped = ChunkCacheRetriever(base_retriever=base, cache=ChunkCache(), k=2)
    assert len(wrapped.invoke("0")) == 2
    assert len(wrapped.invoke("0", k=5)) == 5
