"""A newer variant put under a key replaces the older one a real Redis tier holds."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from test_store_support import FP, make_variant, same_kv

from chunkcache.core.kv_store import KVVariant
from chunkcache.core.store import MemoryTier, TieredKVStore
from chunkcache.core.store.codec import entry_key
from chunkcache.core.store.redis_server import REDIS_SERVER, redis_server
from chunkcache.core.store.redis_tier import RedisTier

pytestmark = pytest.mark.skipif(
    REDIS_SERVER is None, reason="redis-server is not installed (apt-get install redis-server)"
)

SIZE = make_variant("x").num_bytes
CTX = "after-a-chunk"


@pytest.fixture
def url(tmp_path: Path) -> Iterator[str]:
    with redis_server(tmp_path) as (running, _):
        yield running


def approximate() -> KVVariant:
    return make_variant("b", CTX, seed=1, exact=False)


def exact() -> KVVariant:
    return make_variant("b", CTX, seed=2)


def test_write_through_replaces_an_older_variant_in_redis(url: str) -> None:
    redis = RedisTier(url, 10**7, retry_after_s=3600)
    store = TieredKVStore([MemoryTier("host", 10 * SIZE), redis], write_through=True)
    store.put(FP, approximate())
    store.put(FP, exact())
    store.flush()
    held = redis.get(entry_key(FP, "b", CTX), FP)
    assert held is not None and held.exact and same_kv(held, exact())
    store.close()


def test_demotion_replaces_an_older_variant_in_redis(url: str) -> None:
    store = TieredKVStore([MemoryTier("host", SIZE), RedisTier(url, 10**7, retry_after_s=3600)])
    store.put(FP, approximate())
    store.put(FP, make_variant("filler", seed=3))  # the approximate variant -> Redis
    store.put(FP, exact())
    store.put(FP, make_variant("filler", seed=3))  # the exact one is evicted in its place
    assert same_kv(store.exact(FP, "b", CTX), exact())
    store.close()
