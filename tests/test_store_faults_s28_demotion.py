"""A demotion that fails for a reason other than OSError (a MemoryError encoding the victim,
a bug raising RuntimeError in a lower tier) drops the victim cleanly and lets the caller's
put or lookup go on: the victim had already left the tier evicting it, and failing the
caller for a move of another entry left that entry in no tier but still counted in the
statistics and in every ChunkCache prefix tree following the store."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from test_store_support import FP, cache_on, make_variant, promoted, same_kv

from chunkcache.core.chunk_ids import chunk_key
from chunkcache.core.store import DiskTier, MemoryTier, TieredKVStore
from chunkcache.core.store.codec import entry_key

SIZE = make_variant("x").num_bytes
Names = tuple[str, str, str]


def failing(error: Callable[[], BaseException], calls: list[int]) -> Callable[..., Any]:
    """A tier method that raises ``error()``, counting its calls."""

    def raise_it(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        raise error()

    return raise_it


def host_over_failing_disk(
    tmp_path: Path, error: Callable[[], BaseException], host_entries: int = 2
) -> tuple[TieredKVStore, list[Names], list[int]]:
    """A host tier of ``host_entries`` variants over a disk whose every write raises
    ``error()``; the drops the store reported, and the disk's failed writes."""
    disk = DiskTier(tmp_path / "kv", 10**6)
    calls: list[int] = []
    disk.put = failing(error, calls)  # type: ignore[method-assign]
    store = TieredKVStore([MemoryTier("host", host_entries * SIZE), disk])
    gone: list[Names] = []
    store.drop_listeners.append(lambda *names: gone.append(names))
    return store, gone, calls


@pytest.mark.parametrize(
    "error",
    [lambda: MemoryError("no room to encode"), lambda: RuntimeError("a bug")],
    ids=["MemoryError", "RuntimeError"],
)
def test_a_demotion_failing_drops_the_victim_and_the_put_goes_on(
    tmp_path: Path, error: Callable[[], BaseException], caplog: pytest.LogCaptureFixture
) -> None:
    store, gone, calls = host_over_failing_disk(tmp_path, error)
    a, b, c = (make_variant(s, seed=i) for i, s in enumerate("abc"))
    with caplog.at_level(logging.DEBUG, "chunkcache.core.store.tiered"):
        for variant in (a, b, c):  # c evicts a, whose demotion fails
            store.put(FP, variant)
    assert calls == [1]
    assert same_kv(store.exact(FP, "c", c.context), c)
    assert same_kv(store.exact(FP, "b", b.context), b)
    key = entry_key(FP, "a", a.context)
    assert all(key not in tier for tier in store.tiers)
    assert key not in store.stats
    assert gone == [(FP, "a", a.context)]
    assert store.metrics()["tiers"]["disk"]["errors"] == 1
    assert store.metrics()["tiers"]["host"]["demotions"] == 0
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "disk" in warnings[0].getMessage()
    with caplog.at_level(logging.DEBUG, "chunkcache.core.store.tiered"):
        store.put(FP, make_variant("d"))  # evicts c: the same failure, not warned again
    assert gone[-1] == (FP, "c", c.context) and len(calls) == 2
    assert len([r for r in caplog.records if r.levelno == logging.WARNING]) == 1
    assert store.metrics()["tiers"]["disk"]["errors"] == 2


def test_a_promotion_whose_demotion_fails_still_returns_the_hit(tmp_path: Path) -> None:
    """A disk hit copied up evicts a host entry whose demotion fails: the lookup gives the
    hit, the evicted entry is dropped."""
    disk = DiskTier(tmp_path / "kv", 10**6)
    store = TieredKVStore([MemoryTier("host", SIZE), disk])
    gone: list[Names] = []
    store.drop_listeners.append(lambda *names: gone.append(names))
    a, b = make_variant("a", seed=1), make_variant("b", seed=2)
    store.put(FP, a)
    store.put(FP, b)  # a goes down to the disk
    disk.put = failing(lambda: MemoryError("no room"), [])  # type: ignore[method-assign]
    assert same_kv(store.exact(FP, "a", a.context), a)  # promoted: evicts b, which fails
    assert gone == [(FP, "b", b.context)]
    assert entry_key(FP, "b", b.context) not in store.stats


def test_a_failing_tier_is_passed_over_for_the_next_one_down(tmp_path: Path) -> None:
    """As with an OSError, the victim goes on to the tier below the failing one."""
    disk = DiskTier(tmp_path / "kv", 10**6)
    disk.put = failing(lambda: RuntimeError("a bug"), [])  # type: ignore[method-assign]
    spare = MemoryTier("spare", 10 * SIZE)
    store = TieredKVStore([MemoryTier("host", SIZE), disk, spare])
    gone: list[Names] = []
    store.drop_listeners.append(lambda *names: gone.append(names))
    a = make_variant("a", seed=1)
    store.put(FP, a)
    store.put(FP, make_variant("b"))
    assert entry_key(FP, "a", a.context) in spare and gone == []
    counts = store.metrics()["tiers"]
    assert counts["disk"]["errors"] == 1 and counts["host"]["demotions"] == 1
    assert same_kv(store.exact(FP, "a", a.context), a)


def test_a_victim_that_cannot_be_read_for_its_demotion_is_dropped(tmp_path: Path) -> None:
    """The disk evicts: reading its victim to move it down raises MemoryError (decoding);
    the disk's write goes on and the victim is dropped."""
    probe = DiskTier(tmp_path / "probe", 10**6)
    TieredKVStore([probe]).put(FP, make_variant("probe"))
    disk = DiskTier(tmp_path / "kv", probe.num_bytes + 10)  # holds one entry
    store = TieredKVStore([MemoryTier("host", SIZE), disk, MemoryTier("spare", 10 * SIZE)])
    gone: list[Names] = []
    store.drop_listeners.append(lambda *names: gone.append(names))
    a, b = make_variant("a", seed=1), make_variant("b", seed=2)
    store.put(FP, a)
    store.put(FP, b)  # a goes down to the disk
    disk._load_quietly = failing(lambda: MemoryError("decoding"), [])  # type: ignore[method-assign]
    store.put(FP, make_variant("c"))  # b goes down: the disk evicts a, unreadable
    assert gone == [(FP, "a", a.context)]
    assert all(entry_key(FP, "a", a.context) not in tier for tier in store.tiers)
    assert same_kv(store.exact(FP, "b", b.context), b)


def test_the_prefix_tree_forgets_a_chunk_whose_demotion_failed(tmp_path: Path) -> None:
    store, _, _ = host_over_failing_disk(tmp_path, lambda: MemoryError("no room"), 1)
    cache = cache_on(store)
    assert promoted(cache, ["doc-a"]) == 1
    store.put(FP, make_variant(chunk_key("doc-a", (1,))))
    store.put(FP, make_variant("text"))  # evicts doc-a, whose demotion fails
    assert not store.contains_chunk(FP, "doc-a")
    assert cache.prefix_tree.longest_prefix_length(["doc-a"]) == 0


def test_an_interrupted_demotion_reaches_the_caller_with_the_victim_dropped(
    tmp_path: Path,
) -> None:
    """Ctrl-C is the caller's own: it is raised, but the victim is not left counted."""
    store, gone, _ = host_over_failing_disk(tmp_path, KeyboardInterrupt, 1)
    a = make_variant("a")
    store.put(FP, a)
    with pytest.raises(KeyboardInterrupt):
        store.put(FP, make_variant("b"))
    assert gone == [(FP, "a", a.context)]
    assert entry_key(FP, "a", a.context) not in store.stats


def test_a_put_interrupted_while_making_room_keeps_the_variant_it_replaces(
    tmp_path: Path,
) -> None:
    """A new variant under a held key needs room; the demotion of the entry it evicts is
    interrupted: the older variant is still held (and known), not gone unannounced."""
    store, gone, _ = host_over_failing_disk(tmp_path, KeyboardInterrupt)
    a, b = make_variant("a", seed=1), make_variant("b", seed=2)
    store.put(FP, a)
    store.put(FP, b)
    with pytest.raises(KeyboardInterrupt):
        store.put(FP, make_variant("a", num_tokens=6, seed=3))  # evicts b
    assert gone == [(FP, "b", b.context)]
    assert same_kv(store.exact(FP, "a", a.context), a)
    assert entry_key(FP, "a", a.context) in store.stats
