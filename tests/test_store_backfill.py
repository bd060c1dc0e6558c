"""Write-throughs the shared tier missed while down are made once it answers again."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from test_store_support import FP, make_variant, same_kv

from chunkcache.core.kv_store import KVVariant
from chunkcache.core.store import DiskTier, MemoryTier, TieredKVStore
from chunkcache.core.store.backfill import PendingWrites
from chunkcache.core.store.codec import EntryKey, entry_key
from chunkcache.core.store.redis_server import REDIS_SERVER, redis_server
from chunkcache.core.store.redis_tier import RedisTier
from chunkcache.core.store.tier import Evicted, Victim

SIZE = make_variant("x").num_bytes
needs_redis = pytest.mark.skipif(
    REDIS_SERVER is None, reason="redis-server is not installed (apt-get install redis-server)"
)


def test_pending_writes_forget_the_oldest_past_the_limit() -> None:
    pending = PendingWrites(limit=3)
    keys = [EntryKey("ns", f"seg{i}", "ctx") for i in range(5)]
    for key in keys[:3]:
        pending.add(key, "fp")
    pending.add(keys[0], "fp")  # remembered again: now the newest
    pending.add(keys[3], "fp")
    pending.add(keys[4], "fp")
    assert [key for key, _ in pending.oldest_first()] == [keys[0], keys[3], keys[4]]
    assert len(pending) == 3 and pending.num_forgotten == 2
    pending.discard(keys[3])
    pending.discard(keys[1])  # long forgotten: nothing happens
    assert keys[3] not in pending and [k for k, _ in pending.oldest_first()] == [keys[0], keys[4]]
    with pytest.raises(ValueError, match="limit"):
        PendingWrites(limit=0)


class _FlakyShared(MemoryTier):
    """A shared tier (as Redis: self-evicting) that can be taken down; it tells
    ``up_listeners`` when it is back, goes down again after ``puts_left`` puts if that is
    set, and counts the puts it took (``num_puts``)."""

    self_evicting = True

    def __init__(self) -> None:
        super().__init__("shared", 10**6)
        self.up = True
        self.up_listeners: list[Callable[[], None]] = []
        self.puts_left: int | None = None
        self.num_puts = 0

    def back(self) -> None:
        self.up = True
        for listener in self.up_listeners:
            listener()

    def __contains__(self, key: EntryKey) -> bool:
        return self.up and super().__contains__(key)

    def get(self, key: EntryKey, fingerprint: str) -> KVVariant | None:
        return super().get(key, fingerprint) if self.up else None

    def put(
        self, key: EntryKey, fingerprint: str, variant: KVVariant, victim: Victim, evicted: Evicted
    ) -> bool:
        if self.puts_left == 0:
            self.up = False
        if not self.up:
            return False
        if self.puts_left is not None:
            self.puts_left -= 1
        self.num_puts += 1
        return super().put(key, fingerprint, variant, victim, evicted)


def test_a_tier_down_again_mid_backfill_keeps_the_rest_for_next_time() -> None:
    shared = _FlakyShared()
    store = TieredKVStore([MemoryTier("host", 10 * SIZE), shared], write_through=True)
    shared.up = False
    names = "abcd"
    for name in names:
        store.put(FP, make_variant(name))
    store.flush()
    assert store.metrics()["tiers"]["shared"]["backfill_pending"] == 4
    shared.puts_left = 2
    shared.back()
    store.flush()
    held = [entry_key(FP, name, "root") in shared.entry_keys() for name in names]
    assert held == [True, True, False, False]  # oldest first, then it failed again
    assert store.metrics()["tiers"]["shared"]["backfill_pending"] == 2
    shared.puts_left = None
    shared.back()
    store.flush()
    assert len(shared) == 4
    counts = store.metrics()["tiers"]["shared"]
    assert counts["backfilled"] == 4 and counts["backfill_pending"] == 0


def _port(url: str) -> int:
    return int(url.rsplit(":", 1)[1].split("/")[0])


@needs_redis
def test_writes_missed_while_redis_was_down_reach_it_when_it_is_back(tmp_path: Path) -> None:
    with redis_server(tmp_path) as (url, proc):
        tier = RedisTier(url, 10**7, retry_after_s=0)  # every call probes a down server
        store = TieredKVStore([MemoryTier("host", 2 * SIZE), tier], write_through=True)
        store.put(FP, make_variant("a"))
        store.flush()
        proc.kill()
        proc.wait()
    variants = {name: make_variant(name, seed=i) for i, name in enumerate("bcd")}
    for variant in variants.values():  # the host keeps two: b is evicted and gone
        store.put(FP, variant)
        store.flush()
    assert store.variants(FP, "c")  # a lookup: Redis is still down, nothing to do yet
    store.flush()
    counts = store.metrics()["tiers"]["redis"]
    assert counts["up"] is False and counts["backfill_pending"] == 3

    with redis_server(tmp_path, port=_port(url)) as (again, _):
        assert again == url  # restarted empty: no persistence
        store.variants(FP, "e")  # the next call it answers starts the backfill
        store.flush()
        other = TieredKVStore([MemoryTier("host", 4 * SIZE), RedisTier(url, 10**7)])
        assert same_kv(other.exact(FP, "c", "root"), variants["c"])
        assert same_kv(other.exact(FP, "d", "root"), variants["d"])
        assert other.exact(FP, "b", "root") is None  # evicted locally meanwhile: forgotten
        counts = store.metrics()["tiers"]["redis"]
        assert counts["up"] is True and counts["backfilled"] == 2
        assert counts["backfill_pending"] == 0


@needs_redis
def test_the_backfill_reads_an_entry_only_the_disk_still_holds(tmp_path: Path) -> None:
    with redis_server(tmp_path) as (url, proc):
        tier = RedisTier(url, 10**7, retry_after_s=0)
        disk = DiskTier(tmp_path / "kv", 10**6)
        store = TieredKVStore([MemoryTier("host", SIZE), disk, tier], write_through=True)
        proc.kill()
        proc.wait()
    b, c = make_variant("b", seed=1), make_variant("c", seed=2)
    for variant in (b, c):
        store.put(FP, variant)
        store.flush()
    assert entry_key(FP, "b", "root") not in store.tiers[0]  # b is on disk only
    with redis_server(tmp_path, port=_port(url)):
        store.variants(FP, "e")
        store.flush()
        other = TieredKVStore([RedisTier(url, 10**7)])
        assert same_kv(other.exact(FP, "b", "root"), b)
        assert same_kv(other.exact(FP, "c", "root"), c)
