"""CacheBlend's loading controller: the ratio the load hides, the cheapest tier that hides."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_store_support import FP, make_variant

from chunkcache.core.store import DiskTier, MemoryTier, TieredKVStore
from chunkcache.core.store.loading import (
    cheapest_hiding_tier,
    hidden_recompute_ratio,
    layer_load_seconds,
)


def test_ratio_rises_to_what_the_load_hides() -> None:
    # CacheBlend §5: Llama-7B, 4K tokens: 15% recompute takes 3 ms a layer, NVMe load 16 ms
    token_layer_s = 0.003 / (0.15 * 4096)
    assert hidden_recompute_ratio(0.016, 4096, token_layer_s) == pytest.approx(0.8)
    # Llama-70B: 15% takes 7 ms, load 4 ms: the load hides less, the floor holds
    token_layer_s = 0.007 / (0.15 * 4096)
    assert hidden_recompute_ratio(0.004, 4096, token_layer_s) == pytest.approx(0.15)
    assert hidden_recompute_ratio(1.0, 4096, token_layer_s) == 1.0
    assert hidden_recompute_ratio(0.01, 0, 1.0) == 0.15


def test_cheapest_tier_that_still_hides() -> None:
    bandwidth = {"host": 10e9, "disk": 1e9, "redis": 0.1e9}
    tiers = ["host", "disk", "redis"]
    assert cheapest_hiding_tier(tiers, 10_000_000, bandwidth, recompute_s=0.02) == "disk"
    assert cheapest_hiding_tier(tiers, 10_000_000, bandwidth, recompute_s=0.2) == "redis"
    assert cheapest_hiding_tier(tiers, 10_000_000, bandwidth, recompute_s=1e-4) is None
    assert layer_load_seconds(1000, 1000.0) == 1.0
    with pytest.raises(ValueError):
        layer_load_seconds(1, 0)


def test_store_measures_tier_bandwidth(tmp_path: Path) -> None:
    store = TieredKVStore([MemoryTier("host", 10**6), DiskTier(tmp_path, 10**7)])
    TieredKVStore([DiskTier(tmp_path, 10**7)]).put(FP, make_variant("a", num_tokens=64))
    assert store.load_bandwidth() == {}
    store.exact(FP, "a", "root")
    bandwidth = store.load_bandwidth()
    assert set(bandwidth) == {"disk"} and bandwidth["disk"] > 0
    assert (
        store.metrics()["tiers"]["disk"]["bytes_loaded"]
        == make_variant("a", num_tokens=64).num_bytes
    )
