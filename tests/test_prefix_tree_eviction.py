"""The prefix tree keeps a chunk while the store holds any text sent under its id."""

from __future__ import annotations

import pytest
from test_store_support import FP, cache_on, make_variant, promoted

from chunkcache.core.chunk_ids import chunk_key
from chunkcache.core.kv_store import KVStore, MemoryKVStore
from chunkcache.core.store import MemoryTier, TieredKVStore

VARIANT_BYTES = make_variant("x").num_bytes


def _store(tiered: bool, entries: int) -> KVStore:
    capacity = entries * VARIANT_BYTES
    return TieredKVStore([MemoryTier("host", capacity)]) if tiered else MemoryKVStore(capacity)


@pytest.mark.parametrize("tiered", [False, True])
def test_a_chunk_id_stays_while_another_of_its_texts_is_stored(tiered: bool) -> None:
    store = _store(tiered, entries=3)
    cache = cache_on(store)
    assert promoted(cache, ["doc-1", "doc-2"]) == 2
    old_text, new_text = chunk_key("doc-1", (5, 6, 7)), chunk_key("doc-1", (5, 6, 8))
    for segment_id in (old_text, new_text, chunk_key("doc-2", (9,))):
        store.put(FP, make_variant(segment_id))
    store.put(FP, make_variant("other"))  # evicts doc-1's old text, the oldest entry
    assert not store.contains_segment(FP, old_text)  # type: ignore[attr-defined]
    assert cache.prefix_tree.longest_prefix_length(["doc-1", "doc-2"]) == 2
    store.put(FP, make_variant("another"))  # evicts doc-1's last text
    assert cache.prefix_tree.longest_prefix_length(["doc-1", "doc-2"]) == 0


@pytest.mark.parametrize("tiered", [False, True])
def test_contains_chunk_follows_every_segment_of_the_id(tiered: bool) -> None:
    store = _store(tiered, entries=2)
    first, second = chunk_key("c", (1,)), chunk_key("c", (2,))
    assert not store.contains_chunk(FP, "c")  # type: ignore[attr-defined]
    store.put(FP, make_variant(first))
    store.put(FP, make_variant(second, "ctx"))
    assert store.contains_chunk(FP, "c")  # type: ignore[attr-defined]
    assert not store.contains_chunk("another-model", "c")  # type: ignore[attr-defined]
    store.put(FP, make_variant("x"))
    store.put(FP, make_variant("y"))  # both of c's segments evicted
    assert not store.contains_chunk(FP, "c")  # type: ignore[attr-defined]


class _StoreWithoutChunkIndex(MemoryKVStore):
    """A user's store with eviction listeners but no ``contains_chunk`` (it is optional)."""

    contains_chunk = None  # type: ignore[assignment]


def test_a_store_without_contains_chunk_still_prunes_the_tree() -> None:
    store = _StoreWithoutChunkIndex(capacity_bytes=2 * VARIANT_BYTES)
    cache = cache_on(store)
    assert promoted(cache, ["doc-1", "doc-2"]) == 2
    store.put(FP, make_variant(chunk_key("doc-1", (5,))))
    store.put(FP, make_variant("x"))
    store.put(FP, make_variant("y"))  # evicts doc-1's only text
    assert cache.prefix_tree.longest_prefix_length(["doc-1", "doc-2"]) == 0
