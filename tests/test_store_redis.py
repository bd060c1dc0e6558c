"""The Redis tier against a real ``redis-server`` on a free loopback port."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from test_store_support import FP, make_variant, same_kv
from tiny_models import tiny_lm

from chunkcache.core.engine import ChunkEngine, TokenSegment
from chunkcache.core.kv_store import segment_key
from chunkcache.core.store import MemoryTier, TieredKVStore, codec
from chunkcache.core.store.codec import entry_key
from chunkcache.core.store.redis_server import REDIS_SERVER, redis_server
from chunkcache.core.store.redis_tier import RedisTier

pytestmark = pytest.mark.skipif(
    REDIS_SERVER is None, reason="redis-server is not installed (apt-get install redis-server)"
)

SIZE = make_variant("x").num_bytes


@pytest.fixture
def server(tmp_path: Path) -> Iterator[tuple[str, object]]:
    with redis_server(tmp_path) as running:
        yield running


def redis_tier(url: str, capacity: int = 10**7) -> RedisTier:
    return RedisTier(url, capacity, retry_after_s=3600)


def test_entries_round_trip_between_two_clients(server: tuple[str, object]) -> None:
    url, _ = server
    writer = TieredKVStore([MemoryTier("host", SIZE), redis_tier(url)])
    a, b = make_variant("a", "ctx", exact=False), make_variant("b", seed=1)
    writer.put(FP, a)
    writer.put(FP, b)  # a is demoted to Redis
    reader = TieredKVStore([MemoryTier("host", 4 * SIZE), redis_tier(url)])  # another machine
    (got,) = reader.variants(FP, "a")
    assert same_kv(got, a) and (got.context, got.exact) == ("ctx", False)
    assert reader.metrics()["tiers"]["redis"]["hits"] == 1
    assert reader.exact(FP, "a", "ctx") is None  # not exact: never a prefix hit
    assert reader.variants("another-model", "a") == []


def test_write_through_shares_at_once(server: tuple[str, object]) -> None:
    url, _ = server
    writer = TieredKVStore([MemoryTier("host", 4 * SIZE), redis_tier(url)], write_through=True)
    a = make_variant("a")
    writer.put(FP, a)
    writer.flush()
    reader = TieredKVStore([MemoryTier("host", 4 * SIZE), redis_tier(url)])
    assert same_kv(reader.exact(FP, "a", "root"), a)


def test_server_side_capacity_evicts_least_recently_used(server: tuple[str, object]) -> None:
    url, _ = server
    blob = len(codec.pack(*codec.encode(FP, make_variant("a"))))
    tier = redis_tier(url, capacity=3 * blob + blob // 2)  # room for three entries
    store = TieredKVStore([tier])
    for i, name in enumerate("abcdefgh"):
        store.put(FP, make_variant(name, seed=i))
        if name != "a":
            store.exact(FP, "a", "root")  # a stays the most recently used
        assert 0 < tier.num_bytes <= tier.capacity_bytes
    assert store.exact(FP, "a", "root") is not None
    assert len(tier) == 3
    assert store.exact(FP, "b", "root") is None


def test_a_tampered_blob_is_dropped_and_counted(server: tuple[str, object]) -> None:
    import redis

    url, _ = server
    store = TieredKVStore([redis_tier(url)])
    store.put(FP, make_variant("a"))
    client = redis.Redis.from_url(url)
    key_a, key_b = ("chunkcache:v1:" + ":".join(astuple) for astuple in (_parts("a"), _parts("b")))
    stored = client.get(key_a)
    assert isinstance(stored, bytes)
    blob = bytearray(stored)
    client.set(key_b, bytes(blob))  # a's entry under b's key: the header says "a"
    blob[-3] ^= 0x08
    client.set(key_a, bytes(blob))
    assert store.exact(FP, "a", "root") is None
    assert store.exact(FP, "b", "root") is None
    assert store.metrics()["corrupt_dropped"] == 2
    assert client.get(key_a) is None and client.get(key_b) is None


def test_garbage_under_the_tiers_keys_is_skipped_or_repaired(server: tuple[str, object]) -> None:
    """What another program, or a half-finished old version, may leave under our keys."""
    import redis

    url, _ = server
    client = redis.Redis.from_url(url)
    tier = redis_tier(url)
    store = TieredKVStore([tier])
    a, b = make_variant("a"), make_variant("b", seed=1)
    store.put(FP, a)
    ns, seg, _ = _parts("a")
    client.sadd(f"chunkcache:v1:{ns}:{seg}", b"\xff\xfe", b"not:a hash")
    assert [same_kv(v, a) for v in store.variants(FP, "a")] == [True]
    client.set("chunkcache:v1:bytes", "abc")
    client.set("chunkcache:v1:clock", "?")
    assert tier.num_bytes == 0  # damaged: reads as nothing, never raises
    store.put(FP, b)
    blobs = [client.strlen("chunkcache:v1:" + ":".join(_parts(s))) for s in "ab"]
    assert tier.num_bytes == sum(blobs)  # rebuilt from the sizes, then b added
    assert store.exact(FP, "b", "root") is not None
    entry_b = "chunkcache:v1:" + ":".join(_parts("b"))
    client.delete(entry_b)
    client.hset(entry_b, "field", "value")  # a hash where b's blob was: no entry
    assert entry_key(FP, "b", "root") not in tier
    store.put(FP, b)
    assert same_kv(store.exact(FP, "b", "root"), b)


def test_a_key_of_the_wrong_type_fails_the_put_before_any_write(
    server: tuple[str, object],
) -> None:
    import redis

    url, _ = server
    client = redis.Redis.from_url(url)
    tier = redis_tier(url)
    client.set("chunkcache:v1:lru", "not a sorted set")
    TieredKVStore([tier]).put(FP, make_variant("a"))
    assert tier.num_errors == 1
    assert sorted(client.keys("chunkcache:*")) == [b"chunkcache:v1:lru"]  # nothing written


def test_server_gone_mid_run_degrades_with_one_warning(
    server: tuple[str, object], caplog: pytest.LogCaptureFixture
) -> None:
    url, proc = server
    lm = tiny_lm("llama")
    per_token = 2 * lm.spec.num_layers * lm.spec.num_kv_heads * lm.spec.head_dim * 4
    host = MemoryTier("host", 20 * per_token)  # one chunk: the rest lives in Redis only
    store = TieredKVStore([host, redis_tier(url)], write_through=True)
    engine = ChunkEngine(lm, store)

    def ids(n: int, seed: int) -> tuple[int, ...]:
        gen = torch.Generator().manual_seed(seed)
        return tuple(torch.randint(3, 120, (n,), generator=gen).tolist())

    system = TokenSegment(segment_key(ids(9, 1)), ids(9, 1), is_chunk=False)
    chunks = [TokenSegment(f"c{i}", ids(17, 10 + i), is_chunk=True) for i in range(3)]
    question = TokenSegment(segment_key(ids(6, 2)), ids(6, 2), is_chunk=False)
    request = [system, *chunks, question]
    engine.prefill(request, "full")
    store.flush()
    warm = engine.prefill(request, "prefix")
    assert warm.stats.reused_tokens == sum(len(s.ids) for s in request) - 1  # all but last
    assert store.metrics()["tiers"]["redis"]["hits"] > 0

    proc.kill()  # type: ignore[attr-defined]
    proc.wait()  # type: ignore[attr-defined]
    caplog.set_level(logging.WARNING)
    full = ChunkEngine(lm).prefill(request, "full").logits
    for _ in range(2):
        out = engine.prefill(request, "prefix")  # no exception, recomputed where Redis was
        assert out.stats.reused_tokens < warm.stats.reused_tokens
        assert (out.logits - full).abs().max().item() < 1e-4
    warnings = [r for r in caplog.records if "Redis tier" in r.getMessage()]
    assert len(warnings) == 1 and "down" in warnings[0].getMessage()
    assert store.metrics()["tiers"]["redis"]["up"] is False


def _parts(segment_id: str) -> tuple[str, str, str]:
    key = entry_key(FP, segment_id, "root")
    return key.namespace, key.segment, key.context
