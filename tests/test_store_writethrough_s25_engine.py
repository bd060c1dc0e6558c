"""The engine puts a second variant under one key: the exact one must reach disk."""

from __future__ import annotations

from pathlib import Path

from tiny_models import chunk, random_ids, text, tiny_lm

from chunkcache.core.engine import ChunkEngine
from chunkcache.core.store import DiskTier, MemoryTier, TieredKVStore

SYSTEM = text(random_ids(9, 1))
QUESTION = text(random_ids(7, 9))
A, B = (chunk(name, random_ids(17, seed)) for seed, name in enumerate("ab", start=2))


def test_an_exact_recompute_replaces_the_approximate_variant_on_disk(tmp_path: Path) -> None:
    lm = tiny_lm("llama")
    host = MemoryTier("host", 10**8)
    store = TieredKVStore([host, DiskTier(tmp_path / "kv", 10**8)], write_through=True)
    engine = ChunkEngine(lm, store)
    engine.prefill([SYSTEM, A], "full")
    request = [SYSTEM, QUESTION, A, B]
    engine.prefill(request, "cacheblend", 0.15)  # A reused: B is stored approximate
    engine.prefill(request, "full")  # B computed exactly after A: the same key, exact now
    store.close()
    restarted = ChunkEngine(
        lm, TieredKVStore([MemoryTier("host", 10**8), DiskTier(tmp_path / "kv", 10**8)])
    )
    out = restarted.prefill(request, "prefix")
    assert out.stats.extra["prefix_tokens"] == sum(len(s.ids) for s in request) - 1
