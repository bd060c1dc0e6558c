"""The Redis tier when the server misbehaves the way production servers do: a ``maxmemory``
policy evicting the tier's own bookkeeping keys, and a request the server refuses alone."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
import torch
from test_store_support import FP, make_variant, same_kv

from chunkcache.core.kv_store import KVVariant
from chunkcache.core.store import MemoryTier, TieredKVStore, codec
from chunkcache.core.store.redis_server import REDIS_SERVER, redis_server
from chunkcache.core.store.redis_tier import RedisTier

pytestmark = pytest.mark.skipif(
    REDIS_SERVER is None, reason="redis-server is not installed (apt-get install redis-server)"
)

BLOB = len(codec.pack(*codec.encode(FP, make_variant("s0"))))
CAPACITY = 10 * BLOB + BLOB // 2  # room for 10 entries


@pytest.fixture
def url(tmp_path: Path) -> Iterator[str]:
    with redis_server(tmp_path) as (running, _):
        yield running


def stored_bytes(client: redis.Redis) -> int:
    """Bytes of every entry blob the server holds."""
    return sum(int(client.strlen(key)) for key in client.keys("chunkcache:v1:*:*:*"))


@pytest.mark.parametrize("lost", ["lru", "sizes", "clock", "bytes"])
def test_bookkeeping_redis_evicted_is_rebuilt_and_the_tier_keeps_working(
    url: str, lost: str
) -> None:
    """``maxmemory-policy allkeys-lru`` (or ``-random``) may evict any key, the tier's sorted
    set, sizes hash, clock or byte total among them: new entries must still be kept, the
    newest last to go, within the capacity."""
    client = redis.Redis.from_url(url)
    store = TieredKVStore([RedisTier(url, CAPACITY, retry_after_s=3600)])
    for i in range(10):
        store.put(FP, make_variant(f"s{i}", seed=i))
    for _ in range(5):  # hits move the clock well past the number of entries
        for i in range(10):
            assert store.exact(FP, f"s{i}", "root") is not None
    client.delete(f"chunkcache:v1:{lost}")  # what a maxmemory eviction does
    for i in range(10, 30):
        store.put(FP, make_variant(f"s{i}", seed=i))
    for i in range(25, 30):
        assert same_kv(store.exact(FP, f"s{i}", "root"), make_variant(f"s{i}", seed=i))
    assert stored_bytes(client) <= CAPACITY
    assert int(client.get("chunkcache:v1:bytes") or 0) == stored_bytes(client)


def test_one_entry_the_server_refuses_does_not_take_the_tier_down(url: str) -> None:
    """A blob above the server's ``proto-max-bulk-len`` (512 MB by default) makes Redis close
    the connection: that entry is not stored, but the server is up and every other entry
    still goes there (and the refused one is not retried forever as a missed write)."""
    client = redis.Redis.from_url(url)
    client.config_set("proto-max-bulk-len", 1 << 20)
    tier = RedisTier(url, 10**8, retry_after_s=3600)
    store = TieredKVStore([MemoryTier("host", 10**8), tier], write_through=True)
    k = torch.randn(2, 1, 40_000, 4)  # k and v: 1.28 MB
    store.put(FP, KVVariant("big", "root", 0, True, k, k.clone()))
    small = make_variant("small")
    store.put(FP, small)
    store.flush()
    assert tier.up
    counts = store.metrics()["tiers"]["redis"]
    assert counts["backfill_pending"] == 0
    assert counts["errors"] == tier.num_errors >= 1  # the refused put is counted
    reader = TieredKVStore([RedisTier(url, 10**8, retry_after_s=3600)])
    assert same_kv(reader.exact(FP, "small", "root"), small)
    assert reader.exact(FP, "big", "root") is None


def test_an_entry_larger_than_the_tier_is_refused_and_evicts_nothing(url: str) -> None:
    tier = RedisTier(url, 2 * BLOB, retry_after_s=3600)
    store = TieredKVStore([tier])
    kept = make_variant("kept")
    store.put(FP, kept)
    k = torch.randn(2, 1, 400, 4)  # over twice a small entry's bytes
    store.put(FP, KVVariant("big", "root", 0, True, k, k.clone()))
    store.flush()  # the write to Redis is done
    assert store.exact(FP, "big", "root") is None
    assert same_kv(store.exact(FP, "kept", "root"), kept)
    assert tier.up and tier.num_bytes <= tier.capacity_bytes
