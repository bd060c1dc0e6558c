"""CacheBlend's loading controller and layer-wise loading (Cache-Craft Algorithm 2)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch
from test_store_support import FP, make_variant
from tiny_models import chunk, random_ids, text, tiny_lm

from chunkcache.core.engine import ChunkEngine
from chunkcache.core.models import LoadedModel
from chunkcache.core.store import DiskTier, MemoryTier, TieredKVStore
from chunkcache.core.store.lazy import LazyKVVariant
from chunkcache.core.store.loading import (
    LayerLoader,
    cheapest_hiding_tier,
    controlled_ratio,
    hidden_recompute_ratio,
    layer_load_seconds,
)

SYSTEM = text(random_ids(6, seed=1))
CHUNK_A = chunk("a", random_ids(20, seed=2))
CHUNK_B = chunk("b", random_ids(24, seed=3))
QUESTION = text(random_ids(5, seed=4))


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


def test_a_header_only_read_gives_no_bandwidth(tmp_path: Path) -> None:
    # Opening a disk entry lazily reads its header: time but no layer bytes yet.  The
    # controller divides by the bandwidth, so such a tier must stay unmeasured, not 0.
    store = TieredKVStore([MemoryTier("host", 10**6), DiskTier(tmp_path, 10**7)])
    TieredKVStore([DiskTier(tmp_path, 10**7)]).put(FP, make_variant("a", num_tokens=64))
    (variant,) = store.variants(FP, "a")
    assert isinstance(variant, LazyKVVariant) and variant.tier == "disk"
    assert store.metrics()["tiers"]["disk"]["bytes_loaded"] == 0
    assert store.load_bandwidth() == {}


@pytest.mark.parametrize("depth", [1, 3, 8])
def test_layer_loader_stays_within_its_depth(depth: int) -> None:
    num_layers, order = 8, []
    lock = threading.Lock()

    def load(layer: int) -> None:
        time.sleep(0.001)
        with lock:
            order.append(("load", layer))

    with LayerLoader(load, num_layers, depth) as loader:
        for layer in range(num_layers):
            loader.wait(layer)
            with lock:
                order.append(("run", layer))
            time.sleep(0.002)  # compute slower than loading: the loader would run far ahead
    assert [e for e in order if e[0] == "load"] == [("load", i) for i in range(num_layers)]
    assert 1 <= loader.max_lead <= depth
    for i, (kind, layer) in enumerate(order):  # every layer loads before it runs
        if kind == "run":
            assert ("load", layer) in order[:i]
            loaded = sum(1 for k, _ in order[:i] if k == "load")
            assert loaded - 1 - layer <= depth  # layers 0..layer + depth at most


def test_layer_loader_hands_errors_to_compute() -> None:
    def load(layer: int) -> None:
        if layer == 2:
            raise OSError("disk gone")

    with LayerLoader(load, 4, 2) as loader:
        loader.wait(1)
        with pytest.raises(OSError, match="disk gone"):
            loader.wait(2)
    with pytest.raises(ValueError):
        LayerLoader(load, 4, 5)


def test_controller_raises_the_ratio_with_slower_loads() -> None:
    token_layer_s, reused = 1e-5, 1000  # 15% of 1000 tokens: 1.5 ms a layer
    ratios = [controlled_ratio(0.15, load, reused, token_layer_s) for load in (0, 1e-3, 3e-3, 1)]
    assert ratios == pytest.approx([0.15, 0.15, 0.3, 1.0])
    assert controlled_ratio(0.0, 1.0, reused, token_layer_s) == 0.0  # reuse stays reuse


def _tiny_store(tmp_path: Path, lm: LoadedModel) -> TieredKVStore:
    """Chunks prefilled into a disk tier, read back through a fresh host tier."""
    disk = TieredKVStore([DiskTier(tmp_path, 10**8)])
    engine = ChunkEngine(lm, disk)
    for segment in (CHUNK_A, CHUNK_B):
        engine.prefill([SYSTEM, segment], "full")
    return TieredKVStore([MemoryTier("host", 10**8), DiskTier(tmp_path, 10**8)])


@pytest.mark.parametrize("policy", ["reuse", "cacheblend", "cachecraft"])
def test_layer_wise_loading_from_disk_gives_the_same_bits(tmp_path: Path, policy: str) -> None:
    lm = tiny_lm()
    request = [SYSTEM, CHUNK_B, CHUNK_A, QUESTION]
    outs = {}
    for layer_loading in (False, True):
        engine = ChunkEngine(lm, _tiny_store(tmp_path, lm), layer_loading=layer_loading)
        outs[layer_loading] = engine.prefill(request, policy, ratio=0.3)  # type: ignore[arg-type]
    plain, piped = outs[False], outs[True]
    assert "layer_loading" in piped.stats.extra and "layer_loading" not in plain.stats.extra
    ratio = piped.stats.extra["layer_loading"]["ratio"]
    assert ratio == 0.0 if policy == "reuse" else ratio >= 0.3
    assert piped.stats.recomputed_tokens >= plain.stats.recomputed_tokens
    if ratio in (0.0, 0.3):  # the controller left the ratio: the same bits
        assert torch.equal(piped.logits, plain.logits)
        assert torch.equal(piped.kv.keys(), plain.kv.keys())
        assert torch.equal(piped.kv.values(), plain.kv.values())


def test_pipelined_placement_equals_placing_first(tmp_path: Path) -> None:
    lm = tiny_lm()
    request = [SYSTEM, CHUNK_B, CHUNK_A, QUESTION]
    store = _tiny_store(tmp_path, lm)
    engine = ChunkEngine(lm, store, layer_loading=False)
    engine.prefill(request[:1] + request[1:2], "reuse")  # warm the host tier: no disk reads
    plain = engine.prefill(request, "cacheblend", ratio=0.3)
    engine.layer_loading = True  # forced on, nothing read from disk: the ratio stays
    piped = engine.prefill(request, "cacheblend", ratio=0.3)
    assert piped.stats.extra["layer_loading"]["ratio"] == 0.3
    assert torch.equal(piped.logits, plain.logits)
    assert torch.equal(piped.kv.keys(), plain.kv.keys())
    assert torch.equal(piped.kv.values(), plain.kv.values())
