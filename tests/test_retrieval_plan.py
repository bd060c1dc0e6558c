"""plan_retrieval: the framework-neutral retriever step both wrappers share."""

from __future__ import annotations

import logging
import unicodedata
from collections.abc import Mapping
from typing import Any

import pytest

from chunkcache.core.cache import ChunkCache
from chunkcache.core.chunk_ids import chunk_id
from chunkcache.core.errors import InvalidConversationIdError
from chunkcache.core.ledger import DedupeMode
from chunkcache.core.ordering import Ordering
from chunkcache.core.registry import ChunkRegistry
from chunkcache.core.retrieval import (
    PlannedChunk,
    RetrievalPlan,
    conversation_id_from,
    plan_retrieval,
)

Docs = list[tuple[str, Mapping[str, Any] | None]]


def plan(
    documents: Docs,
    cache: ChunkCache,
    *,
    conversation_id: str | None = None,
    ordering: Ordering = "retriever",
    dedupe: DedupeMode = "mark",
) -> RetrievalPlan:
    result = plan_retrieval(
        documents,
        cache,
        conversation_id=conversation_id,
        ordering=ordering,
        dedupe=dedupe,
    )
    assert result is not None  # no wrapper is retrieving around this call
    return result


def docs(*texts: str) -> Docs:
    return [(text, None) for text in texts]


def test_plan_in_retriever_order() -> None:
    cache = ChunkCache()
    result = plan(docs("alpha", "beta", "gamma"), cache)
    assert result.chunks == [
        PlannedChunk(
            source_index=i, chunk_id=chunk_id(t), retriever_rank=i, seen_in_conversation=False
        )
        for i, t in enumerate(["alpha", "beta", "gamma"])
    ]
    assert result.dropped_chunk_ids == []
    assert (result.num_collapsed, result.num_empty, result.prefix_length) == (0, 0, 0)
    for text in ["alpha", "beta", "gamma"]:
        assert cache.registry.get(chunk_id(text)) == text


def test_ids_use_the_cache_namespace() -> None:
    result = plan(docs("alpha"), ChunkCache(namespace="tenant"))
    assert result.chunks[0].chunk_id == chunk_id("alpha", namespace="tenant")
    assert result.chunks[0].chunk_id != chunk_id("alpha")


def test_duplicates_collapse_to_the_best_rank() -> None:
    cache = ChunkCache()
    result = plan(docs("alpha", "beta", "alpha", "gamma", "beta"), cache)
    assert [c.source_index for c in result.chunks] == [0, 1, 3]
    assert [c.retriever_rank for c in result.chunks] == [0, 1, 2]
    assert result.num_collapsed == 2
    assert cache.access_table.count(chunk_id("alpha")) == 1


def test_documents_sharing_a_metadata_id_but_not_a_text_are_all_kept() -> None:
    """A caller's id is no reason to drop a document: per-file chunk numbers, two
    versions of one document."""
    cache = ChunkCache()
    documents: Docs = [
        ("first version", {"chunk_id": "doc-1"}),
        ("other", None),
        ("second version", {"chunk_id": "doc-1"}),
        ("first version", {"chunk_id": "doc-1"}),  # the same document twice: one chunk
    ]
    result = plan(documents, cache)
    assert [c.source_index for c in result.chunks] == [0, 1, 2]
    assert result.num_collapsed == 1
    texts = [cache.registry.get(c.chunk_id) for c in result.chunks]
    assert texts == ["first version", "other", "second version"]


def test_nfc_and_nfd_copies_of_a_document_are_one_chunk() -> None:
    text = "Caf\u00e9 cr\u00e8me"
    result = plan(docs(unicodedata.normalize("NFD", text), text), ChunkCache())
    assert len(result.chunks) == 1
    assert result.chunks[0].source_index == 0
    assert result.num_collapsed == 1


def test_retriever_rank_is_the_rank_among_distinct_non_empty_documents() -> None:
    cache = ChunkCache()
    for _ in range(3):  # make "late" the most frequent so frequency order moves it first
        plan(docs("late"), cache)
    result = plan(docs("", "early", "early", "mid", "late"), cache, ordering="frequency")
    by_id = {c.chunk_id: c for c in result.chunks}
    assert result.chunks[0].chunk_id == chunk_id("late")
    assert by_id[chunk_id("early")].retriever_rank == 0
    assert by_id[chunk_id("early")].source_index == 1
    assert by_id[chunk_id("mid")].retriever_rank == 1
    assert by_id[chunk_id("mid")].source_index == 3
    assert by_id[chunk_id("late")].retriever_rank == 2
    assert by_id[chunk_id("late")].source_index == 4


def test_empty_documents_are_left_out_and_counted(caplog: pytest.LogCaptureFixture) -> None:
    cache = ChunkCache()
    with caplog.at_level(logging.WARNING, logger="chunkcache.core.retrieval"):
        result = plan(docs("", "alpha", "   ", "\n\t", "beta"), cache)
    assert [c.source_index for c in result.chunks] == [1, 4]
    assert [c.retriever_rank for c in result.chunks] == [0, 1]
    assert result.num_empty == 3
    assert result.num_collapsed == 0
    assert "3 empty" in caplog.text
    assert len(cache.registry) == 2


def test_an_empty_document_with_a_metadata_id_is_still_empty() -> None:
    result = plan([("  ", {"chunk_id": "doc-1"}), ("x", None)], ChunkCache())
    assert result.num_empty == 1
    assert [c.source_index for c in result.chunks] == [1]


def test_no_documents() -> None:
    result = plan([], ChunkCache(), conversation_id="conv", dedupe="drop")
    assert result == RetrievalPlan(
        chunks=[], dropped_chunk_ids=[], num_collapsed=0, num_empty=0, prefix_length=0
    )
    result = plan(docs("", " "), ChunkCache())
    assert result.chunks == []
    assert result.num_empty == 2


def test_drop_mode_drops_seen_chunks_in_one_conversation_only() -> None:
    cache = ChunkCache()
    first = plan(docs("C1", "C2", "C3"), cache, conversation_id="conv", dedupe="drop")
    assert len(first.chunks) == 3
    second = plan(docs("C2", "C3", "C4"), cache, conversation_id="conv", dedupe="drop")
    assert [c.chunk_id for c in second.chunks] == [chunk_id("C4")]
    assert second.chunks[0].source_index == 2
    assert second.chunks[0].retriever_rank == 2
    assert second.chunks[0].seen_in_conversation is False
    assert second.dropped_chunk_ids == [chunk_id("C2"), chunk_id("C3")]
    other = plan(docs("C2", "C3", "C4"), cache, conversation_id="other", dedupe="drop")
    assert len(other.chunks) == 3
    assert other.dropped_chunk_ids == []
    anonymous = plan(docs("C2", "C3"), cache, dedupe="drop")
    assert len(anonymous.chunks) == 2


def test_mark_mode_reports_seen_chunks() -> None:
    cache = ChunkCache()
    plan(docs("C1", "C2"), cache, conversation_id="conv", dedupe="mark")
    result = plan(docs("C2", "C3"), cache, conversation_id="conv", dedupe="mark")
    assert [(c.chunk_id, c.seen_in_conversation) for c in result.chunks] == [
        (chunk_id("C2"), True),
        (chunk_id("C3"), False),
    ]
    assert result.dropped_chunk_ids == []


def test_prefix_length_grows_when_the_same_set_repeats() -> None:
    cache = ChunkCache()
    texts = ["one", "two", "three"]
    lengths = [plan(docs(*texts), cache, ordering="tree").prefix_length for _ in range(3)]
    assert lengths == [0, 0, 3]
    # The same set in another retriever order: same prompt order, same cached prefix.
    again = plan(docs(*reversed(texts)), cache, ordering="tree")
    assert again.prefix_length == 3
    first = plan(docs(*texts), cache, ordering="tree")
    assert [c.chunk_id for c in again.chunks] == [c.chunk_id for c in first.chunks]


@pytest.mark.parametrize("bad", [None, b"bytes", 42, ["text"]])
def test_non_str_text_raises_type_error(bad: object) -> None:
    cache = ChunkCache()
    with pytest.raises(TypeError):
        plan([("fine", None), (bad, None)], cache)  # type: ignore[list-item]
    assert cache.num_requests == 0


def test_any_metadata_id_value_is_a_usable_label() -> None:
    result = plan([("text", {"chunk_id": "not an id\n"}), ("more", {"chunk_id": 3})], ChunkCache())
    assert len(result.chunks) == 2


def test_bad_conversation_id_raises() -> None:
    with pytest.raises(InvalidConversationIdError):
        plan(docs("text"), ChunkCache(), conversation_id="")


def test_one_megabyte_document() -> None:
    cache = ChunkCache()
    big = "lorem ipsum dolor " * (1024 * 1024 // 18 + 1)
    result = plan(docs(big, "small"), cache)
    assert [c.chunk_id for c in result.chunks] == [chunk_id(big), chunk_id("small")]
    assert cache.registry.get(chunk_id(big)) == big


def test_a_document_too_large_to_register_is_still_planned(
    caplog: pytest.LogCaptureFixture,
) -> None:
    cache = ChunkCache(registry=ChunkRegistry(max_chars=100))
    with caplog.at_level(logging.WARNING, logger="chunkcache.core.retrieval"):
        result = plan(docs("x" * 101, "small"), cache)
    assert len(result.chunks) == 2
    assert chunk_id("x" * 101) not in cache.registry
    assert "too large to register" in caplog.text


@pytest.mark.parametrize(
    "text",
    [
        "\ud800 lone surrogate",
        "\U0001f600\U0001f469\u200d\U0001f4bb",
        "\u05e9\u05dc\u05d5\u05dd \u0645\u0631\u062d\u0628\u0627",
        "\u200b",  # zero-width space only: not whitespace, so it is a chunk
        "a\x00b",
    ],
)
def test_odd_unicode_gives_a_defined_plan(text: str) -> None:
    cache = ChunkCache()
    result = plan(docs(text), cache)
    assert [c.chunk_id for c in result.chunks] == [chunk_id(text)]
    assert cache.registry.get(chunk_id(text)) == text


def test_conversation_id_from_configurable() -> None:
    assert conversation_id_from(None) is None
    assert conversation_id_from({}) is None
    assert conversation_id_from({"other": "x"}) is None
    assert conversation_id_from({"thread_id": "t"}) == "t"
    assert conversation_id_from({"session_id": "s", "thread_id": "t"}) == "s"
    assert conversation_id_from({"conversation_id": "c", "session_id": "s"}) == "c"
    assert conversation_id_from({"conversation_id": None, "session_id": "s"}) == "s"
    assert conversation_id_from({"thread_id": 7}) == "7"
