"""Engine hooks: per-request counts, PGDSF cost feed, prefetch, Cache-Craft preload depth."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_store_support import FP, make_variant

from chunkcache.core.kv_store import MemoryKVStore
from chunkcache.core.store import DiskTier, MemoryTier, TieredKVStore
from chunkcache.core.store.hooks import prefetch, preload_depth, record_prefill, track_store


def test_preload_depth_is_equation_16() -> None:
    assert preload_depth(5, prefill_s=1.0, load_s=2.0) == 3  # Figure 19: L = 5, 1:2
    assert preload_depth(32, prefill_s=2.0, load_s=1.0) == 1  # loading hides behind compute
    assert preload_depth(32, prefill_s=0.0, load_s=1.0) == 32
    with pytest.raises(ValueError):
        preload_depth(0, 1.0, 1.0)


def test_hooks_are_no_ops_on_a_plain_store() -> None:
    plain = MemoryKVStore()
    with track_store(plain) as usage:
        plain.put(FP, make_variant("a"))
    assert usage.as_dict() == {"tiers": {}}
    record_prefill(plain, FP, [("a", "root")], 0, 4, 1.0)
    assert prefetch(plain, FP, ["a"]) is None


def test_hooks_on_a_tiered_store(tmp_path: Path) -> None:
    store = TieredKVStore([MemoryTier("host", 10_000), DiskTier(tmp_path, 10**6)], "pgdsf")
    with track_store(store) as usage:
        store.put(FP, make_variant("a"))
        store.exact(FP, "a", "root")
    assert usage.as_dict()["tiers"]["host"] == {"hits": 1}
    record_prefill(store, FP, [("a", "root")], cached_tokens=10, new_tokens=4, seconds=2.0)
    assert next(iter(store.stats.values())).cost_per_token == pytest.approx(0.5)
    future = prefetch(store, FP, ["a"])
    assert future is not None and future.result(timeout=30) == 0  # already on top
    store.close()


@pytest.mark.parametrize("kind", ["memory", "tiered"])
def test_variants_come_most_recently_used_first(kind: str) -> None:
    """The KVStore contract both stores keep: a use moves a variant to the front."""
    store = MemoryKVStore() if kind == "memory" else TieredKVStore([MemoryTier("host", 10**6)])
    for context in ("ctx1", "ctx2"):
        store.put(FP, make_variant("a", context))
    assert [v.context for v in store.variants(FP, "a")] == ["ctx2", "ctx1"]
    assert store.exact(FP, "a", "ctx1") is not None
    assert [v.context for v in store.variants(FP, "a")] == ["ctx1", "ctx2"]
