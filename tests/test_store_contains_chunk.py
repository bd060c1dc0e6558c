"""What ``TieredKVStore.contains_chunk`` does not need to see: the premises its docstring
rests on.  A content-bound chunk another process stores on a shared disk keeps the prefix
tree through ``contains_segment``; with Redis below, an eviction Redis takes is no drop,
and one it refuses (down) is a drop nothing could have found."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from test_store_support import FP, cache_on, make_variant, promoted

from chunkcache.core.chunk_ids import chunk_id, chunk_key
from chunkcache.core.store import DiskTier, MemoryTier, TieredKVStore
from chunkcache.core.store.redis_server import REDIS_SERVER, free_port, redis_server
from chunkcache.core.store.redis_tier import RedisTier

SIZE = make_variant("x").num_bytes
BIG = make_variant("x", num_tokens=64).num_bytes
CHUNK = chunk_id("A chunk every process retrieves with the same text.")
SEGMENT = chunk_key(CHUNK, (11, 12, 13))  # the one segment a content-bound id has


def _disk_entry_bytes(tmp_path: Path) -> int:
    disk = DiskTier(tmp_path / "probe", 10**6)
    TieredKVStore([disk]).put(FP, make_variant("probe"))
    return disk.num_bytes


def test_another_processs_variant_on_a_shared_disk_keeps_the_chunks_prefixes(
    tmp_path: Path,
) -> None:
    """The other process writes after this store opened its disk tier: this store never read
    the entry, its index never rescanned, yet the drop listener sees it."""
    disk = DiskTier(tmp_path / "kv", 2 * _disk_entry_bytes(tmp_path))
    store = TieredKVStore([MemoryTier("host", BIG + BIG // 2), disk])
    other = TieredKVStore([DiskTier(tmp_path / "kv", 10**6)])
    cache = cache_on(store)
    assert promoted(cache, [CHUNK]) == 1
    other.put(FP, make_variant(SEGMENT, "ctx-other"))
    gone: list[tuple[str, str, str]] = []
    store.drop_listeners.append(lambda *names: gone.append(names))
    store.put(FP, make_variant(SEGMENT, "ctx-ours", num_tokens=64))
    store.put(FP, make_variant("next", num_tokens=64))  # ours: too big for the disk, dropped
    assert gone == [(FP, SEGMENT, "ctx-ours")]
    assert cache.prefix_tree.longest_prefix_length([CHUNK]) == 1
    other.close()
    store.close()


@pytest.fixture
def redis_url(tmp_path: Path) -> Iterator[str]:
    if REDIS_SERVER is None:
        pytest.skip("redis-server is not installed (apt-get install redis-server)")
    with redis_server(tmp_path) as (url, _):
        yield url


def _over_redis(url: str) -> TieredKVStore:
    return TieredKVStore([MemoryTier("host", SIZE), RedisTier(url, 10**7, retry_after_s=3600)])


def test_an_eviction_redis_takes_is_no_drop(redis_url: str) -> None:
    store = _over_redis(redis_url)
    cache = cache_on(store)
    assert promoted(cache, [CHUNK]) == 1
    gone: list[tuple[str, str, str]] = []
    store.drop_listeners.append(lambda *names: gone.append(names))
    store.put(FP, make_variant(SEGMENT))
    store.put(FP, make_variant("next"))  # the host evicts the chunk: Redis takes it
    assert gone == []
    assert cache.prefix_tree.longest_prefix_length([CHUNK]) == 1
    store.close()


def test_an_eviction_redis_refuses_is_a_drop_while_redis_cannot_be_read(
    caplog: pytest.LogCaptureFixture,
) -> None:
    store = _over_redis(f"redis://127.0.0.1:{free_port()}/0")  # nothing listens there
    cache = cache_on(store)
    assert promoted(cache, [CHUNK]) == 1
    store.put(FP, make_variant(SEGMENT))
    store.put(FP, make_variant("next"))
    assert not store.contains_segment(FP, SEGMENT)
    assert cache.prefix_tree.longest_prefix_length([CHUNK]) == 0
    assert "down" in caplog.text
    store.close()
