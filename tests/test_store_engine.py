"""The tiered store behind the real engine (tiny random Llama): wrong KV is never served."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from tiny_models import TOLERANCE, chunk, random_ids, text, tiny_lm

from chunkcache.core.engine import ChunkEngine, Prefilled, TokenSegment
from chunkcache.core.generation import Policy, SamplingParams
from chunkcache.core.models import LoadedModel
from chunkcache.core.store import DiskTier, MemoryTier, TieredKVStore

SYSTEM = text(random_ids(9, 1))
A, B = (chunk(name, random_ids(17, seed)) for seed, name in enumerate("ab", start=2))
QUESTION = text(random_ids(7, 9))
OTHER_QUESTION = text(random_ids(5, 11))


@pytest.fixture(scope="module")
def lm() -> LoadedModel:
    return tiny_lm("llama")


def disk_engine(lm: LoadedModel, root: Path) -> ChunkEngine:
    return ChunkEngine(lm, TieredKVStore([DiskTier(root, 10**8)]))


def answer(
    engine: ChunkEngine, request: list[TokenSegment], policy: Policy
) -> tuple[Prefilled, list[int]]:
    out = engine.prefill(request, policy)
    tokens = list(engine.decode(out, SamplingParams(max_tokens=4, temperature=0.0)))
    return out, tokens


def flip_a_byte(root: Path, segment_id: str) -> None:
    for header in root.rglob("*.json"):
        if (
            not header.name.startswith(".")
            and json.loads(header.read_text())["segment_id"] == segment_id
        ):
            data = header.with_suffix(".safetensors")
            raw = bytearray(data.read_bytes())
            raw[len(raw) // 2] ^= 0x40
            data.write_bytes(bytes(raw))
            return
    raise AssertionError(f"no stored entry for {segment_id}")


@pytest.mark.parametrize("policy", ["prefix", "reuse"])
def test_a_flipped_byte_is_recomputed_and_the_answer_is_unchanged(
    lm: LoadedModel, tmp_path: Path, policy: Policy
) -> None:
    disk_engine(lm, tmp_path / "kv").prefill([SYSTEM, A, B, QUESTION], "full")
    shutil.copytree(tmp_path / "kv", tmp_path / "bad")
    flip_a_byte(tmp_path / "bad", "a")
    request = [SYSTEM, A, B, OTHER_QUESTION]

    clean, clean_tokens = answer(disk_engine(lm, tmp_path / "kv"), request, policy)
    bad_engine = disk_engine(lm, tmp_path / "bad")
    bad, bad_tokens = answer(bad_engine, request, policy)
    full = ChunkEngine(lm).prefill(request, "full").logits

    store = bad_engine.store
    assert isinstance(store, TieredKVStore)
    assert store.metrics()["corrupt_dropped"] == 1
    assert bad.stats.reused_tokens < clean.stats.reused_tokens  # A was recomputed
    assert (bad.logits - clean.logits).abs().max().item() < TOLERANCE
    assert (bad.logits - full).abs().max().item() < TOLERANCE
    assert bad_tokens == clean_tokens
    # the recomputed A was stored again, sound: the next request hits it
    again = bad_engine.prefill(request, policy)
    assert again.stats.reused_tokens >= clean.stats.reused_tokens
    assert store.metrics()["corrupt_dropped"] == 1


def test_engine_on_host_and_disk_tiers_is_exact(lm: LoadedModel, tmp_path: Path) -> None:
    """Hits served after demotion to disk and promotion back give full-prefill logits."""
    per_token = 2 * lm.spec.num_layers * lm.spec.num_kv_heads * lm.spec.head_dim * 4
    host = MemoryTier("host", 4 * 17 * per_token)  # about four chunks: A and B go to disk
    store = TieredKVStore([host, DiskTier(tmp_path / "kv", 10**8)], policy="pgdsf")
    engine = ChunkEngine(lm, store)
    for seed in range(4):  # other chunks push A and B down to disk
        engine.prefill([SYSTEM, chunk(f"x{seed}", random_ids(17, 50 + seed)), QUESTION], "full")
    engine.prefill([SYSTEM, A, B, QUESTION], "full")
    for seed in range(4):
        engine.prefill([SYSTEM, chunk(f"y{seed}", random_ids(17, 70 + seed)), QUESTION], "full")
    request = [SYSTEM, A, B, OTHER_QUESTION]
    with store.track() as usage:
        out = engine.prefill(request, "reuse")
    assert out.stats.chunk_hits == 2
    assert usage.as_dict()["tiers"]["disk"]["hits"] >= 1
    # The engine reports the same request's tier counts itself (response metadata).
    assert out.stats.extra["store"]["tiers"] == usage.as_dict()["tiers"]
    full = ChunkEngine(lm).prefill(request, "full").logits
    assert (out.logits - full).abs().max().item() < TOLERANCE
    assert host.num_bytes <= host.capacity_bytes
