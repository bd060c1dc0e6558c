"""A newer variant put under a key replaces the older one in every tier, by every path that
copies entries between tiers (write-through, demotion, promotion, prefetch, backfill).

One key (fingerprint, segment, context) holds different variants over time: a chunk reused
with selective recompute stores the segment after it as approximate (``exact=False``); a
later request computing that segment in full (policy ``full``/``prefix``, ``chunkcache warm``
with a prefix, a conversation's exact past) puts the exact variant under the same key.
"""

from __future__ import annotations

import errno
from pathlib import Path

import pytest
from test_store_backfill import _FlakyShared
from test_store_support import FP, make_variant, same_kv

from chunkcache.core.kv_store import KVVariant
from chunkcache.core.store import DiskTier, MemoryTier, TieredKVStore
from chunkcache.core.store.codec import EntryKey, entry_key
from chunkcache.core.store.lazy import LazyKVVariant

SIZE = make_variant("x").num_bytes
CTX = "after-a-chunk"


def approximate() -> KVVariant:
    return make_variant("b", CTX, seed=1, exact=False)


def exact() -> KVVariant:
    return make_variant("b", CTX, seed=2)


def host_disk(tmp_path: Path, host_entries: int, write_through: bool) -> TieredKVStore:
    host = MemoryTier("host", host_entries * SIZE)
    return TieredKVStore([host, DiskTier(tmp_path / "kv", 100_000)], write_through=write_through)


def fill_host(store: TieredKVStore, entries: int) -> None:
    """Evict everything the host holds: ``entries`` other variants."""
    for i in range(entries):
        store.put(FP, make_variant(f"filler{i}", seed=10 + i))
    store.flush()


def header_mtime(tmp_path: Path) -> int:
    key = entry_key(FP, "b", CTX)
    (header,) = (tmp_path / "kv").rglob(f"{key.context}.json")
    return header.stat().st_mtime_ns


# -- write-through -------------------------------------------------------------------------


def test_write_through_replaces_an_older_variant_on_disk(tmp_path: Path) -> None:
    store = host_disk(tmp_path, host_entries=2, write_through=True)
    store.put(FP, approximate())
    store.flush()
    store.put(FP, exact())  # the same key, now computed in full
    store.flush()
    fill_host(store, 2)  # the host forgets it: the disk copy is what is left
    assert same_kv(store.exact(FP, "b", CTX), exact())


def test_write_through_replaces_an_older_variant_in_a_shared_tier() -> None:
    shared = _FlakyShared()
    store = TieredKVStore([MemoryTier("host", 10 * SIZE), shared], write_through=True)
    store.put(FP, approximate())
    store.put(FP, exact())
    store.flush()
    held = shared.get(entry_key(FP, "b", CTX), FP)
    assert held is not None and held.exact and same_kv(held, exact())


def test_write_through_leaves_the_same_variant_alone(tmp_path: Path) -> None:
    """A variant put again as it was (a ``full`` request, ``warm``'s prefix) is not rewritten."""
    store = host_disk(tmp_path, host_entries=2, write_through=True)
    store.put(FP, exact())
    store.flush()
    written = header_mtime(tmp_path)
    store.put(FP, make_variant("b", CTX, seed=3))  # recomputed: exact again
    store.flush()
    assert header_mtime(tmp_path) == written


# -- demotion (no write-through: lower copies come from evictions) -------------------------


def test_demotion_replaces_an_older_variant_below(tmp_path: Path) -> None:
    store = host_disk(tmp_path, host_entries=1, write_through=False)
    store.put(FP, approximate())
    fill_host(store, 1)  # the approximate variant moves down to disk
    store.put(FP, exact())
    fill_host(store, 1)  # the exact one is evicted: it must not be dropped for the old copy
    assert same_kv(store.exact(FP, "b", CTX), exact())
    assert store.metrics()["tiers"]["host"]["demotions"] == 3  # approx, filler0, exact


def test_demotion_still_swaps_out_the_same_variant_only_once(tmp_path: Path) -> None:
    store = host_disk(tmp_path, host_entries=1, write_through=False)
    store.put(FP, exact())
    fill_host(store, 1)  # b -> disk
    written = header_mtime(tmp_path)
    store.put(FP, make_variant("b", CTX, seed=3))  # recomputed: exact again
    fill_host(store, 1)  # b evicted again: the disk copy is the same kind of variant
    assert header_mtime(tmp_path) == written
    assert store.metrics()["tiers"]["host"]["demotions"] == 2  # b once, filler0 once


def test_a_newer_variant_the_disk_refuses_leaves_the_older_copy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The newer variant's demotion fails (the disk filled up): the older copy below was
    deleted first, so the chunk was lost from every tier; an approximate copy beats none."""
    store = host_disk(tmp_path, host_entries=1, write_through=False)
    store.put(FP, approximate())
    fill_host(store, 1)  # the approximate variant moves down to disk
    store.put(FP, exact())

    def full(*args: object) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(DiskTier, "prepare", full)
    fill_host(store, 1)  # the exact one is evicted, and cannot be written down
    held = store.variants(FP, "b")
    assert len(held) == 1 and not held[0].exact and same_kv(held[0], approximate())


# -- promotion and prefetch: a lower copy read before a newer put must not replace it ------


def test_a_lazy_hit_finished_after_a_newer_put_does_not_replace_it(tmp_path: Path) -> None:
    store = host_disk(tmp_path, host_entries=1, write_through=False)
    store.put(FP, approximate())
    fill_host(store, 1)  # disk: approximate; host: filler
    (lazy,) = store.variants(FP, "b")
    assert isinstance(lazy, LazyKVVariant)
    store.put(FP, exact())  # meanwhile another request computes it in full
    lazy.layers(slice(None))  # the placement reads the last layer: the lazy variant is promoted
    assert same_kv(store.exact(FP, "b", CTX), exact())


def test_a_prefetch_read_before_a_newer_put_does_not_replace_it(tmp_path: Path) -> None:
    store = host_disk(tmp_path, host_entries=4, write_through=False)
    store.tiers[1].put(entry_key(FP, "b", CTX), FP, approximate(), min, lambda *_: None)
    load = store._load

    def put_while_loading(i: int, key: EntryKey, fingerprint: str) -> KVVariant | None:
        loaded = load(i, key, fingerprint)
        store.put(FP, exact())  # lands while the prefetch holds the old copy
        return loaded

    store._load = put_while_loading  # type: ignore[method-assign]
    assert store.prefetch(FP, ["b"]).result() == 0
    store._load = load  # type: ignore[method-assign]
    assert same_kv(store.exact(FP, "b", CTX), exact())


# -- backfill of a shared tier that was down -----------------------------------------------


def test_backfill_replaces_the_older_variant_the_shared_tier_kept() -> None:
    shared = _FlakyShared()
    store = TieredKVStore([MemoryTier("host", 10 * SIZE), shared], write_through=True)
    store.put(FP, approximate())
    store.flush()
    shared.up = False
    store.put(FP, exact())  # missed by the shared tier: remembered
    store.flush()
    shared.back()
    store.flush()
    held = shared.get(entry_key(FP, "b", CTX), FP)
    assert held is not None and held.exact and same_kv(held, exact())
    assert store.metrics()["tiers"]["shared"]["backfilled"] == 1


def test_backfill_skips_what_the_shared_tier_already_holds() -> None:
    shared = _FlakyShared()
    store = TieredKVStore([MemoryTier("host", 10 * SIZE), shared], write_through=True)
    store.put(FP, exact())
    store.flush()
    shared.up = False
    store.put(FP, make_variant("b", CTX, seed=3))  # recomputed: exact again, missed
    store.flush()
    shared.back()
    store.flush()
    assert shared.num_puts == 1
    assert store.metrics()["tiers"]["shared"]["backfilled"] == 0
