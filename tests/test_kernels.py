"""Kernels against Hugging Face and naive references: RoPE, moved keys, scattered attention."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tiny_models import tiny_config, tiny_hf_model
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from chunkcache.core.models import rope_from_config
from chunkcache.kernels import attention as attention_module
from chunkcache.kernels.attention import (
    AMX_ROWS_PER_BLOCK,
    MATMUL_ROWS_PER_BLOCK,
    MAX_BLOCK_SCORES,
    ROWS_PER_BLOCK,
    attention,
    blocked_attention,
    causal_blocks,
    causal_mask,
    rows_per_block,
    tail_attention,
    uses_matmul_attention,
)
from chunkcache.kernels.kv import SeqKV
from chunkcache.kernels.layer import Rows, layer_step
from chunkcache.kernels.rope import Rope

H, H_KV, D = 4, 2, 16
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0}


def _config(kind: str) -> LlamaConfig:
    if kind == "yarn":  # scales cos and sin: attention_scaling != 1
        return LlamaConfig(
            hidden_size=64, num_attention_heads=H, max_position_embeddings=256, rope_parameters=YARN
        )
    return tiny_config(kind)


def _rope(kind: str) -> Rope:
    return rope_from_config(_config(kind), D)


def _randn(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("kind", ["llama", "llama3_rope", "yarn"])
def test_rope_matches_hf_at_scattered_positions(kind: str) -> None:
    config = _config(kind)
    hf_rope = LlamaRotaryEmbedding(config)
    rope = _rope(kind)
    assert rope.attention_scaling == pytest.approx(hf_rope.attention_scaling)
    assert torch.equal(rope.inv_freq, hf_rope.inv_freq)
    positions = torch.tensor([0, 3, 4, 17, 100, 255])
    q, k = _randn(1, H, 6, D, seed=1), _randn(1, H_KV, 6, D, seed=2)  # [1, H, N, D]
    cos, sin = hf_rope(q, positions[None])  # [1, N, D]
    q_ref, k_ref = apply_rotary_pos_emb(q, k, cos, sin)
    # HF takes angles in float32 (off by ~ulp(pos * freq)); ours are float64, hence 1e-4.
    torch.testing.assert_close(rope.rotate(q[0], positions), q_ref[0], atol=1e-4, rtol=0)
    torch.testing.assert_close(rope.rotate(k[0], positions), k_ref[0], atol=1e-4, rtol=0)


@settings(max_examples=30, deadline=None)
@given(
    a=st.integers(0, 8000),
    b=st.integers(0, 8000),
    n=st.integers(1, 40),
    kind=st.sampled_from(["llama", "llama3_rope", "yarn"]),
)
def test_moving_keys_equals_computing_them_at_the_new_positions(
    a: int, b: int, n: int, kind: str
) -> None:
    rope = _rope(kind)
    raw = _randn(H_KV, n, D)  # raw keys: [H_kv, n, D]
    at_a = rope.rotate(raw, torch.arange(a, a + n))
    at_b = rope.rotate(raw, torch.arange(b, b + n))
    torch.testing.assert_close(rope.shift(at_a, b - a), at_b, atol=1e-5, rtol=0)
    torch.testing.assert_close(rope.unrotate(at_a, torch.arange(a, a + n)), raw, atol=1e-5, rtol=0)


def test_shift_by_a_delta_per_token() -> None:
    rope = _rope("llama")
    raw = _randn(H_KV, 5, D)
    old, new = torch.tensor([0, 1, 2, 50, 51]), torch.tensor([10, 30, 31, 7, 8])
    moved = rope.shift(rope.rotate(raw, old), new - old)
    torch.testing.assert_close(moved, rope.rotate(raw, new), atol=1e-5, rtol=0)


def test_shift_keeps_bfloat16_keys_in_bfloat16() -> None:
    rope = _rope("llama")
    k = rope.rotate(_randn(H_KV, 8, D), torch.arange(8)).bfloat16()
    assert rope.shift(k, 5).dtype == torch.bfloat16


def test_shift_into_a_slice_rotates_bfloat16_keys_in_float32() -> None:
    rope = _rope("llama")
    k = rope.rotate(_randn(H_KV, 8, D), torch.arange(8)).bfloat16()  # [H_kv, 8, D]
    merged = torch.zeros(H_KV, 20, D, dtype=torch.bfloat16)
    rope.shift(k, 5, out=merged[:, 5:13])
    expected = rope.shift(k.float(), 5).bfloat16()  # rotated in float32, rounded once
    assert torch.equal(merged[:, 5:13], expected)
    assert not merged[:, :5].any() and not merged[:, 13:].any()


def _naive_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor):
    # q: [H, N, D]; k, v: [H_kv, S, D]; mask: [N, S] -> [N, H * D]
    group = q.shape[0] // k.shape[0]
    k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)  # [H, S, D]
    scores = (q @ k.transpose(1, 2)) / q.shape[-1] ** 0.5  # [H, N, S]
    probs = scores.masked_fill(~mask, float("-inf")).softmax(-1)
    return (probs @ v).transpose(0, 1).flatten(1)


def test_scattered_rows_equal_rows_of_full_causal_attention() -> None:
    s = 50
    q, k, v = _randn(H, s, D, seed=1), _randn(H_KV, s, D, seed=2), _randn(H_KV, s, D, seed=3)
    full = attention(q, k, v, None, D**-0.5)  # [S, H * D]
    slots = torch.arange(s)
    torch.testing.assert_close(full, _naive_attention(q, k, v, causal_mask(slots, slots)))
    rows = torch.tensor([0, 7, 8, 20, 49])
    part = attention(q[:, rows], k, v, causal_mask(rows, slots), D**-0.5)  # [5, H * D]
    torch.testing.assert_close(part, full[rows], atol=1e-6, rtol=0)


def test_mask_is_causal_by_position_not_by_slot() -> None:
    k_pos = torch.tensor([5, 0, 9, 2, 7])
    mask = causal_mask(torch.tensor([2, 7]), k_pos)
    assert mask.tolist() == [
        [False, True, False, True, False],
        [True, True, False, True, True],
    ]


@pytest.mark.parametrize("num_rows", [1, 5, 33, 100, 300])
def test_blocked_attention_equals_one_masked_call(num_rows: int) -> None:
    s = 300
    q, k, v = _randn(H, num_rows, D, seed=4), _randn(H_KV, s, D, seed=5), _randn(H_KV, s, D, seed=6)
    perm = torch.randperm(s, generator=torch.Generator().manual_seed(7))
    rows = perm[:num_rows].sort().values  # [N] scattered, increasing
    mask = causal_mask(rows, torch.arange(s))  # [N, S]
    blocks = causal_blocks(rows, mask)
    assert blocks[0].first == 0 and blocks[-1].end == num_rows
    assert all(b.num_keys == rows[b.end - 1] + 1 for b in blocks)
    expected = attention(q, k, v, mask, D**-0.5)  # [N, H * D]
    torch.testing.assert_close(blocked_attention(q, k, v, blocks, D**-0.5), expected)


def test_blocks_built_without_a_mask_equal_views_of_it() -> None:
    rows = torch.tensor([3, 9, 10, 40, 41, 77, 78, 79, 120])
    mask = causal_mask(rows, torch.arange(121))
    viewed, built = causal_blocks(rows, mask), causal_blocks(rows, None)
    assert [(b.first, b.end, b.num_keys) for b in viewed] == [
        (b.first, b.end, b.num_keys) for b in built
    ]
    assert all(torch.equal(a.mask, b.mask) for a, b in zip(viewed, built, strict=True))


def test_blocks_keep_their_scores_under_the_cap() -> None:
    s = 4096
    blocks = causal_blocks(torch.arange(s), None, heads=9)
    assert all(9 * (b.end - b.first) * b.num_keys <= MAX_BLOCK_SCORES for b in blocks)
    assert blocks[0].first == 0 and blocks[-1].end == s


@pytest.mark.parametrize(
    ("amx", "dtype", "size", "num_blocks"),
    [
        (True, torch.float32, ROWS_PER_BLOCK, 6),
        (False, torch.float32, ROWS_PER_BLOCK, 6),
        (True, torch.bfloat16, AMX_ROWS_PER_BLOCK, 1),
        (False, torch.bfloat16, MATMUL_ROWS_PER_BLOCK, 1),
    ],
)
def test_scattered_rows_split_into_the_blocks_their_kernel_runs_fastest(
    amx: bool, dtype: torch.dtype, size: int, num_blocks: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # bf16 SDPA on AMX: one call for cacheblend's ~200 rows of a ~1,200-token prompt
    monkeypatch.setattr(attention_module, "cpu_has_amx", lambda: amx)
    rows = torch.arange(0, 1200, 6)  # 200 scattered rows
    q = _randn(9, rows.numel(), D, seed=1).to(dtype)
    assert rows_per_block(q) == size
    blocks = Rows.build(rows, 1200, _rope("llama")).blocks(9, rows_per_block(q))
    assert len(blocks) == num_blocks


@pytest.mark.parametrize("num_rows", [1, 40, 300])
def test_bf16_blocks_on_matmuls_match_sdpa(num_rows: int, monkeypatch: pytest.MonkeyPatch) -> None:
    # bf16 on a CPU without AMX: every block runs as two matmuls and a float32 softmax
    monkeypatch.setattr(attention_module, "cpu_has_amx", lambda: False)
    s = 300
    q = _randn(H, num_rows, D, seed=4).to(torch.bfloat16)
    k, v = (_randn(H_KV, s, D, seed=i).to(torch.bfloat16) for i in (5, 6))
    rows = torch.randperm(s, generator=torch.Generator().manual_seed(7))[:num_rows].sort().values
    mask = causal_mask(rows, torch.arange(s))  # [N, S]
    blocks = causal_blocks(rows, mask, H)
    assert uses_matmul_attention(q) and not uses_matmul_attention(q.float())
    expected = attention(q.double(), k.double(), v.double(), mask, D**-0.5)  # [N, H * D]
    actual = blocked_attention(q, k, v, blocks, D**-0.5)
    # bf16 scores and probabilities: within bf16 rounding of the exact result
    torch.testing.assert_close(actual.double(), expected, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("amx", [False, True])
def test_bf16_attention_takes_sdpa_with_amx_else_matmul_blocks(
    amx: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(attention_module, "cpu_has_amx", lambda: amx)
    matmul_calls: list[int] = []
    on_matmuls = attention_module.matmul_attention

    def counting(*args: object, **kwargs: object) -> torch.Tensor:
        matmul_calls.append(1)
        return on_matmuls(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(attention_module, "matmul_attention", counting)
    s = 600
    q = _randn(H, s, D, seed=1).to(torch.bfloat16)
    k, v = (_randn(H_KV, s, D, seed=i).to(torch.bfloat16) for i in (2, 3))
    expected = attention(q.double(), k.double(), v.double(), None, D**-0.5)  # [S, H * D]
    cases = {
        "whole sequence": torch.arange(s),
        "scattered rows": torch.arange(0, s, 3),
        "after a short past": torch.arange(200, s),  # a prefix hit
        "after a long past": torch.arange(500, s),  # a conversation's next turn
        "one row": torch.tensor([s - 1]),
        "rows in runs": torch.cat((torch.arange(50, 150), torch.arange(400, 450))),
    }
    for name, index in cases.items():
        matmul_calls.clear()
        actual = Rows.build(index, s, _rope("llama")).attention(q[:, index], k, v, D**-0.5)
        torch.testing.assert_close(actual.double(), expected[index], atol=2e-2, rtol=2e-2)
        assert bool(matmul_calls) is not amx, name  # AMX: SDPA everywhere; else matmul blocks


def test_cpu_has_amx_reads_the_cpu_flags() -> None:
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    assert attention_module.cpu_has_amx() is ("amx_bf16" in flags.split())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("start", "num_rows"), [(0, 9), (1, 1), (7, 20), (40, 3)])
def test_tail_attention_equals_one_masked_call(
    start: int, num_rows: int, dtype: torch.dtype
) -> None:
    s = start + num_rows + 5  # keys after the last row exist and must stay unseen
    q = _randn(H, num_rows, D, seed=8).to(dtype)
    k, v = _randn(H_KV, s, D, seed=9).to(dtype), _randn(H_KV, s, D, seed=10).to(dtype)
    rows = torch.arange(start, start + num_rows)
    expected = attention(q, k, v, causal_mask(rows, torch.arange(s)), D**-0.5)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    actual = tail_attention(q, k, v, start, D**-0.5)
    torch.testing.assert_close(actual, expected, atol=tol, rtol=tol)


def test_rows_build_and_subset() -> None:
    rope = _rope("llama")
    all_rows = Rows.build(torch.arange(10), 10, rope)
    assert all_rows.mask is None and all_rows.num_slots == 10
    keep = torch.tensor([1, 4, 9])
    sub = all_rows.subset(keep)
    direct = Rows.build(keep, 10, rope)
    assert torch.equal(sub.index, direct.index) and sub.mask is not None
    assert direct.mask is not None and torch.equal(sub.mask, direct.mask)
    torch.testing.assert_close(sub.cos, direct.cos)
    assert torch.equal(sub.subset(torch.tensor([0, 2])).index, torch.tensor([1, 9]))
    for bad in ([3, 3], [4, 2], [0, 10], []):
        with pytest.raises(ValueError, match="increasing"):
            Rows.build(torch.tensor(bad, dtype=torch.long), 10, rope)


def test_seq_kv_grows_and_keeps_its_contents() -> None:
    kv = SeqKV.empty(2, H_KV, 4, capacity=3, dtype=torch.float32, device=torch.device("cpu"))
    kv.extend(3)
    kv.k[:, :, :3], kv.v[:, :, :3] = 1.0, 2.0
    kv.extend(2)
    assert (kv.length, kv.capacity) == (5, 6)
    assert kv.keys().shape == (2, H_KV, 5, 4)
    assert bool((kv.keys()[:, :, :3] == 1).all()) and bool((kv.values()[:, :, :3] == 2).all())
    k0, _ = kv.layer(0)
    k0[:, 4] = 7.0  # layer views write the buffer
    assert bool((kv.k[0, :, 4] == 7).all())


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_layer_step_with_every_row_equals_the_hf_layer(kind: str) -> None:
    model = tiny_hf_model(kind)
    layer, rope = model.model.layers[0], rope_from_config(model.config, D)
    s = 12
    x = _randn(s, 64, seed=4)  # [S, E]
    cos, sin = model.model.rotary_emb(x[None], torch.arange(s)[None])
    with torch.no_grad():
        ref = layer(x[None], attention_mask=None, position_embeddings=(cos, sin))[0]
        k, v = torch.full((H_KV, s, D), float("nan")), torch.full((H_KV, s, D), float("nan"))
        out = layer_step(layer, x, Rows.build(torch.arange(s), s, rope), k, v)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)
    assert not k.isnan().any() and not v.isnan().any()
