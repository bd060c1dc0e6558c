"""Faults on the tiered store's read side: a hit found below whose copy up to the host tier
fails, an entry found corrupt on read, and a disk commit interrupted while making room.

A failed promotion still serves the KV it found (from the lower copy); a corrupt entry
dropped on read is dropped completely (its statistics forgotten and every drop listener
told, once no tier holds it); a disk commit replacing an older variant keeps that variant
until the new one is in place.  After each, no entry is counted that no tier holds."""

from __future__ import annotations

import json
import logging
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from test_store_support import FP, cache_on, make_variant, promoted, same_kv

from chunkcache.core.chunk_ids import chunk_key
from chunkcache.core.store import DiskTier, MemoryTier, TieredKVStore
from chunkcache.core.store.codec import CorruptEntryError, EntryKey, entry_key
from chunkcache.core.store.layer_file import LayerFile
from chunkcache.core.store.lazy import LazyKVVariant

SIZE = make_variant("x").num_bytes
Names = tuple[str, str, str]
ERRORS = [lambda: MemoryError("no room on the device"), lambda: RuntimeError("a bug")]
ERROR_IDS = ["MemoryError", "RuntimeError"]


def held_keys(store: TieredKVStore) -> set[EntryKey]:
    """Every key a tier of ``store`` holds."""
    return {key for tier in store.tiers for key in tier.entry_keys()}  # type: ignore[attr-defined]


def assert_consistent(store: TieredKVStore) -> None:
    """No entry counted that no tier holds; the counters and byte gauges add up."""
    assert set(store.stats) <= held_keys(store)
    metrics = store.metrics()
    assert metrics["lookups"] == metrics["hits"] + metrics["misses"]
    for tier in store.tiers:
        if isinstance(tier, MemoryTier):
            assert tier.num_bytes == sum(v.num_bytes for v in tier._entries.values())


def listened(store: TieredKVStore) -> list[Names]:
    """The drops ``store`` reports from now on."""
    gone: list[Names] = []
    store.drop_listeners.append(lambda *names: gone.append(names))
    return gone


def host_over_disk(tmp_path: Path, host_entries: int = 1) -> tuple[TieredKVStore, list[Names]]:
    store = TieredKVStore(
        [MemoryTier("host", host_entries * SIZE), DiskTier(tmp_path / "kv", 10**6)]
    )
    return store, listened(store)


def fail_promotions(store: TieredKVStore, error: Callable[[], BaseException]) -> list[int]:
    """The host tier raises ``error()`` on every put of a key a lower tier holds (a
    promotion: the store's own puts here are of new keys); the calls it failed."""
    host = store.tiers[0]
    put = host.put
    calls: list[int] = []

    def failing(key: EntryKey, *args: Any) -> bool:
        if any(key in tier for tier in store.tiers[1:]):
            calls.append(1)
            raise error()
        return put(key, *args)

    host.put = failing  # type: ignore[method-assign,assignment]
    return calls


def data_file(root: Path, segment_id: str) -> Path:
    for header in root.rglob("*.json"):
        named = json.loads(header.read_text())["segment_id"] if header.name[0] != "." else None
        if named == segment_id:
            return header.with_suffix(".safetensors")
    raise AssertionError(f"no stored entry for {segment_id}")


def flip_in_layer(path: Path, layer: int) -> None:
    """Flip one bit inside layer ``layer`` of tensor ``v`` of a stored data file."""
    raw = bytearray(path.read_bytes())
    (length,) = struct.unpack_from("<Q", raw)
    entry = json.loads(raw[8 : 8 + length])["v"]
    begin, end = entry["data_offsets"]
    raw[8 + length + begin + layer * (end - begin) // entry["shape"][0] + 1] ^= 0x10
    path.write_bytes(bytes(raw))


# -- a promotion that fails ----------------------------------------------------------------


@pytest.mark.parametrize("error", ERRORS, ids=ERROR_IDS)
def test_a_failed_promotion_still_serves_an_exact_hit(
    tmp_path: Path, error: Callable[[], BaseException], caplog: pytest.LogCaptureFixture
) -> None:
    store, gone = host_over_disk(tmp_path)
    a, b = make_variant("a", seed=1), make_variant("b", seed=2)
    store.put(FP, a)
    store.put(FP, b)  # a goes down to the disk
    calls = fail_promotions(store, error)
    with caplog.at_level(logging.DEBUG, "chunkcache.core.store.tiered"):
        for _ in range(2):
            assert same_kv(store.exact(FP, "a", a.context), a)
    assert len(calls) == 2 and gone == []
    counts = store.metrics()
    assert counts["tiers"]["host"]["errors"] == 2 and counts["tiers"]["host"]["promotions"] == 0
    assert counts["hits"] == 2 and counts["tiers"]["disk"]["hits"] == 2
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "host" in warnings[0].getMessage()
    assert entry_key(FP, "a", a.context) in store.stats
    assert same_kv(store.exact(FP, "b", b.context), b)  # the host tier is as it was
    assert_consistent(store)


@pytest.mark.parametrize("error", ERRORS, ids=ERROR_IDS)
def test_a_failed_promotion_of_a_lazy_disk_hit_still_gives_every_layer(
    tmp_path: Path, error: Callable[[], BaseException]
) -> None:
    """The copy up is made once the last layer is read, inside the placement's read."""
    store, gone = host_over_disk(tmp_path)
    a = make_variant("a", seed=1)
    store.put(FP, a)
    store.put(FP, make_variant("b"))
    calls = fail_promotions(store, error)
    (found,) = store.variants(FP, "a")
    assert isinstance(found, LazyKVVariant)
    assert same_kv(found, a)  # every layer read: the promotion ran, and failed
    assert calls == [1] and gone == []
    assert store.metrics()["tiers"]["host"]["errors"] == 1
    assert_consistent(store)


def test_a_prefetch_goes_on_past_a_promotion_that_fails(tmp_path: Path) -> None:
    store, gone = host_over_disk(tmp_path, host_entries=2)
    for i, name in enumerate("abcd"):
        store.put(FP, make_variant(name, seed=i))  # a and b go down to the disk
    host, put = store.tiers[0], store.tiers[0].put
    failed: list[int] = []

    def first_fails(*args: Any) -> bool:
        if not failed:
            failed.append(1)
            raise RuntimeError("a bug")
        return put(*args)

    host.put = first_fails  # type: ignore[method-assign,assignment]
    assert store.prefetch(FP, ["a", "b"]).result() == 1
    assert gone == [] and store.metrics()["tiers"]["host"]["errors"] == 1
    assert_consistent(store)


def test_an_interrupted_promotion_reaches_the_caller_and_the_hit_stays_below(
    tmp_path: Path,
) -> None:
    store, gone = host_over_disk(tmp_path)
    a = make_variant("a", seed=1)
    store.put(FP, a)
    store.put(FP, make_variant("b"))
    fail_promotions(store, KeyboardInterrupt)
    with pytest.raises(KeyboardInterrupt):
        store.exact(FP, "a", a.context)
    assert gone == [] and entry_key(FP, "a", a.context) in store.tiers[1]
    assert_consistent(store)


# -- corrupt entries dropped on read -------------------------------------------------------


def test_a_corrupt_entry_dropped_on_a_whole_read_is_forgotten_and_announced(
    tmp_path: Path,
) -> None:
    store, gone = host_over_disk(tmp_path)
    a = make_variant("a", seed=1)
    store.put(FP, a)
    store.put(FP, make_variant("b"))
    flip_in_layer(data_file(tmp_path / "kv", "a"), 1)
    assert store.exact(FP, "a", a.context) is None
    assert store.metrics()["corrupt_dropped"] == 1
    assert gone == [(FP, "a", a.context)]
    assert entry_key(FP, "a", a.context) not in store.stats
    assert_consistent(store)


@pytest.mark.parametrize("fault", ["checksum", "io"])
def test_a_lazy_entry_dropped_mid_read_is_forgotten_and_announced(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fault: str
) -> None:
    store, gone = host_over_disk(tmp_path)
    a = make_variant("a", seed=1)
    store.put(FP, a)
    store.put(FP, make_variant("b"))
    if fault == "checksum":
        flip_in_layer(data_file(tmp_path / "kv", "a"), 1)
    else:

        def unreadable(self: LayerFile, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
            raise OSError(5, "Input/output error")

        monkeypatch.setattr(LayerFile, "read", unreadable)
    (found,) = store.variants(FP, "a")
    with pytest.raises(CorruptEntryError):
        found.layers(slice(None))
    assert gone == [(FP, "a", a.context)]
    assert entry_key(FP, "a", a.context) not in store.stats
    assert not store.contains_segment(FP, "a")
    assert_consistent(store)


def test_a_corrupt_copy_is_dropped_alone_while_another_tier_holds_the_entry(
    tmp_path: Path,
) -> None:
    spare = MemoryTier("spare", 10 * SIZE)
    store = TieredKVStore(
        [MemoryTier("host", SIZE), DiskTier(tmp_path / "kv", 10**6), spare], write_through=True
    )
    gone = listened(store)
    a = make_variant("a", seed=1)
    store.put(FP, a)
    store.put(FP, make_variant("b"))  # a: on the disk and the spare tier
    store.flush()
    flip_in_layer(data_file(tmp_path / "kv", "a"), 0)
    assert same_kv(store.exact(FP, "a", a.context), a)  # from the spare tier
    assert store.metrics()["corrupt_dropped"] == 1
    assert gone == [] and entry_key(FP, "a", a.context) in store.stats
    assert_consistent(store)


def test_the_prefix_tree_forgets_a_chunk_dropped_as_corrupt(tmp_path: Path) -> None:
    store, _ = host_over_disk(tmp_path)
    cache = cache_on(store)
    assert promoted(cache, ["doc-a"]) == 1
    segment = chunk_key("doc-a", (1,))
    store.put(FP, make_variant(segment))
    store.put(FP, make_variant("text"))  # doc-a goes down to the disk
    flip_in_layer(data_file(tmp_path / "kv", segment), 0)
    assert store.exact(FP, segment, "root") is None
    assert not store.contains_chunk(FP, "doc-a")
    assert cache.prefix_tree.longest_prefix_length(["doc-a"]) == 0


# -- a disk commit that makes room ---------------------------------------------------------


def disk_holding(tmp_path: Path, entries: int) -> DiskTier:
    """A disk tier with room for ``entries`` variants of 4 tokens."""
    probe = DiskTier(tmp_path / "probe", 10**6)
    TieredKVStore([probe]).put(FP, make_variant("probe"))
    return DiskTier(tmp_path / "kv", entries * probe.num_bytes + 10)


def interrupted(out: EntryKey, loader: Any) -> None:
    raise KeyboardInterrupt


def test_an_interrupted_disk_commit_keeps_the_variant_it_replaces(tmp_path: Path) -> None:
    disk = disk_holding(tmp_path, 2)
    a, b = make_variant("a", exact=False, seed=1), make_variant("b", seed=2)
    ka, kb = entry_key(FP, "a", a.context), entry_key(FP, "b", b.context)
    for key, variant in ((ka, a), (kb, b)):
        assert disk.put(key, FP, variant, lambda keys: keys[0], interrupted)
    bigger = make_variant("a", num_tokens=6, seed=3)  # must evict b first
    offered: list[list[EntryKey]] = []

    def victim(keys: list[EntryKey]) -> EntryKey:
        offered.append(keys)
        return keys[0]

    with pytest.raises(KeyboardInterrupt):
        disk.put(ka, FP, bigger, victim, interrupted)
    assert offered == [[kb]]  # never the key being replaced
    assert same_kv(disk.get(ka, FP), a)
    assert kb not in disk  # the victim is gone, as the store was told
    assert disk.num_bytes == sum(p.stat().st_size for p in disk.data_root.rglob("*.*"))
    assert disk.put(ka, FP, bigger, victim, lambda out, loader: None)
    assert same_kv(disk.get(ka, FP), bigger)
    assert disk.num_bytes == sum(p.stat().st_size for p in disk.data_root.rglob("*.*"))


def test_a_demotion_over_an_older_copy_interrupted_while_the_disk_makes_room(
    tmp_path: Path,
) -> None:
    """The host evicts a newer variant of a key the disk holds an older one of; the disk,
    full, evicts another entry, and moving that one down is interrupted: the older copy
    stays held and counted, the victim is dropped and announced."""
    disk = disk_holding(tmp_path, 2)
    below = MemoryTier("below", 10 * SIZE)
    store = TieredKVStore([MemoryTier("host", 2 * SIZE), disk, below])
    gone = listened(store)
    old = make_variant("a", exact=False, seed=1)
    for variant in (old, make_variant("b"), make_variant("c"), make_variant("d")):
        store.put(FP, variant)  # the disk: a (approximate), b
    store.put(FP, make_variant("a", num_tokens=6, seed=3))  # the host: the new a alone

    def interrupted_put(*args: Any) -> bool:
        raise KeyboardInterrupt

    below.put = interrupted_put  # type: ignore[method-assign,assignment]
    with pytest.raises(KeyboardInterrupt):
        store.put(FP, make_variant("e"))  # evicts the new a: the disk, full, evicts another
    key = entry_key(FP, "a", old.context)
    assert key in disk and key in store.stats
    (kept,) = store.variants(FP, "a")
    assert same_kv(kept, old)
    assert (FP, "a", old.context) not in gone
    assert_consistent(store)


def test_a_replacing_disk_commit_counts_the_older_variant_as_room(tmp_path: Path) -> None:
    """The older variant's bytes are freed by the replace: no other entry is evicted for
    a variant that fits in their place."""
    disk = disk_holding(tmp_path, 2)
    a, b = make_variant("a", seed=1), make_variant("b", seed=2)
    ka, kb = entry_key(FP, "a", a.context), entry_key(FP, "b", b.context)
    for key, variant in ((ka, a), (kb, b)):
        assert disk.put(key, FP, variant, lambda keys: keys[0], interrupted)
    again = make_variant("a", seed=5)
    assert disk.put(ka, FP, again, lambda keys: keys[0], interrupted)
    assert kb in disk and same_kv(disk.get(ka, FP), again)


# -- a put that fails ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "error", [*ERRORS, KeyboardInterrupt], ids=[*ERROR_IDS, "KeyboardInterrupt"]
)
def test_a_put_that_fails_leaves_no_statistics_of_its_variant(
    tmp_path: Path, error: Callable[[], BaseException]
) -> None:
    """The caller's own put raises (its error): its variant is in no tier, so not counted;
    an older variant of the key still held below stays counted."""
    store, _ = host_over_disk(tmp_path)
    old = make_variant("a", exact=False, seed=1)
    store.put(FP, old)
    store.put(FP, make_variant("b"))  # the older a goes down to the disk

    def failing(*args: Any) -> bool:
        raise error()

    store.tiers[0].put = failing  # type: ignore[method-assign,assignment]
    for name in ("c", "a"):
        with pytest.raises(type(error())):
            store.put(FP, make_variant(name, seed=3))
    assert entry_key(FP, "c", "root") not in store.stats
    assert entry_key(FP, "a", "root") in store.stats
    assert_consistent(store)


def test_a_variant_no_tier_can_hold_is_not_counted(tmp_path: Path) -> None:
    store, gone = host_over_disk(tmp_path)
    store.tiers[1].capacity_bytes = SIZE  # nor the disk, with its header
    store.put(FP, make_variant("big", num_tokens=8))
    assert entry_key(FP, "big", "root") not in store.stats
    assert not store.contains_chunk(FP, "big")
    assert gone == []  # never held: it never left
    assert_consistent(store)
