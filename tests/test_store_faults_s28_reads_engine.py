"""Read-side store faults under the engine (tiny random Llama, float32): a hit whose copy up
to the host tier fails, and a disk entry found corrupt, whether read whole (a prefix hit)
or layer by layer (a placed chunk).  The request is served exactly as a full prefill would
be, the store counts what happened, and no entry is counted that no tier holds."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from test_store_faults_s28_reads import (
    assert_consistent,
    data_file,
    fail_promotions,
    flip_in_layer,
    listened,
)
from tiny_models import TOLERANCE, chunk, random_ids, text, tiny_lm

from chunkcache.core.engine import ChunkEngine
from chunkcache.core.kv_store import ROOT_CONTEXT, extend_context
from chunkcache.core.models import LoadedModel
from chunkcache.core.store import DiskTier, MemoryTier, TieredKVStore

SYSTEM = text(random_ids(9, 1))
A, B, C = (chunk(name, random_ids(17, seed)) for seed, name in enumerate("abc", start=2))
QUESTION, OTHER_QUESTION = text(random_ids(7, 9)), text(random_ids(6, 12))
HISTORY = ([SYSTEM, A, QUESTION], [SYSTEM, B, QUESTION])
REQUEST = [SYSTEM, B, A, C, OTHER_QUESTION]  # B: a prefix hit; A moved, placed; C new
CHUNK_BYTES = 17 * 3 * 2 * 2 * 16 * 4  # tokens x layers x (k, v) x KV heads x head dim x 4 B


@pytest.fixture(scope="module")
def lm() -> LoadedModel:
    return tiny_lm("llama")


@pytest.fixture(scope="module")
def full_request_logits(lm: LoadedModel) -> torch.Tensor:
    return ChunkEngine(lm).prefill(REQUEST, "full").logits


def history_on_disk(lm: LoadedModel, root: Path) -> ChunkEngine:
    """The history run over a host tier that holds one chunk: A and B end on disk."""
    store = TieredKVStore([MemoryTier("host", CHUNK_BYTES + 1000), DiskTier(root, 10**8)])
    engine = ChunkEngine(lm, store)
    for segments in HISTORY:
        engine.prefill(segments, "full")
    assert data_file(root, "a") and data_file(root, "b")
    return engine


def assert_exact(engine: ChunkEngine, expected: torch.Tensor, chunk_hits: int) -> None:
    out = engine.prefill(REQUEST, "cacheblend", ratio=1.0)
    assert (out.logits - expected).abs().max().item() < TOLERANCE
    assert out.stats.chunk_hits >= chunk_hits


@pytest.mark.parametrize(
    "error",
    [lambda: MemoryError("no room on the device"), lambda: RuntimeError("a bug")],
    ids=["MemoryError", "RuntimeError"],
)
def test_a_request_whose_hits_fail_to_move_up_is_served_from_below_exactly(
    lm: LoadedModel,
    full_request_logits: torch.Tensor,
    tmp_path: Path,
    error: Callable[[], BaseException],
) -> None:
    """B's prefix hit (read whole) and A's placed hit (read layer by layer) both come from
    the disk, and copying either up fails."""
    engine = history_on_disk(lm, tmp_path)
    store = engine.store
    assert isinstance(store, TieredKVStore)
    gone = listened(store)
    failed = fail_promotions(store, error)
    assert_exact(engine, full_request_logits, chunk_hits=2)
    assert len(failed) >= 2 and gone == []
    counts = store.metrics()["tiers"]
    assert counts["host"]["errors"] == len(failed) and counts["disk"]["hits"] >= 2
    assert_consistent(store)
    assert_exact(engine, full_request_logits, chunk_hits=3)
    assert_consistent(store)


@pytest.mark.parametrize(("segment", "layer_loading"), [("b", False), ("a", False), ("a", True)])
def test_a_corrupt_disk_hit_is_dropped_completely_and_the_request_is_exact(
    lm: LoadedModel,
    full_request_logits: torch.Tensor,
    tmp_path: Path,
    segment: str,
    layer_loading: bool,
) -> None:
    """B, a prefix hit, is read whole at lookup; A, placed, is read layer by layer and
    found corrupt mid-prefill (the engine runs the request again)."""
    engine = history_on_disk(lm, tmp_path)
    engine = ChunkEngine(lm, engine.store, layer_loading=layer_loading)
    store = engine.store
    assert isinstance(store, TieredKVStore)
    gone = listened(store)
    flip_in_layer(data_file(tmp_path, segment), 2)
    assert_exact(engine, full_request_logits, chunk_hits=1)
    assert store.metrics()["corrupt_dropped"] == 1
    context = extend_context(ROOT_CONTEXT, SYSTEM.segment_id)
    assert gone == [(lm.fingerprint, segment, context)]
    assert_consistent(store)
    assert_exact(engine, full_request_logits, chunk_hits=3)
    assert_consistent(store)
