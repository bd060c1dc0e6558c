"""Randomized property tests of RoPE at arbitrary positions against its formula in float64,
of moving cached keys between position ranges, and of the agreement with Hugging Face's
rotary embedding (whose angles are float32 products).

Tolerances: float32 results within 1e-5 (relative and absolute, outputs O(1)) of the float64
formula at every position up to 131,072; bfloat16 keys within one bf16 rounding (2^-8
relative) of the exact result.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import Tensor
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from chunkcache.core.models import rope_from_config
from chunkcache.kernels.rope import Rope

D = 64
MAX_POS = 131_072
SCALINGS: dict[str, dict[str, Any]] = {
    "default": {"rope_type": "default", "rope_theta": 10000.0},
    "big_theta": {"rope_type": "default", "rope_theta": 500000.0},
    "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
    "llama3": {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
    "yarn": {
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 4.0,
        "original_max_position_embeddings": 32768,
    },
}


def _config(kind: str) -> LlamaConfig:
    return LlamaConfig(
        hidden_size=4 * D,
        num_attention_heads=4,
        max_position_embeddings=MAX_POS,
        rope_parameters=dict(SCALINGS[kind]),
    )


def _rope(kind: str) -> Rope:
    return rope_from_config(_config(kind), D)


def formula(rope: Rope, x: Tensor, positions: Tensor) -> Tensor:
    """RoPE from its definition in float64: the pair ``(x[i], x[i + D/2])`` rotated by
    ``pos * inv_freq[i]``, times the attention scaling."""
    # x: [..., N, D]; positions: [N] -> [..., N, D] float64
    angle = positions.double()[:, None] * rope.inv_freq.double()  # [N, D/2]
    cos, sin = angle.cos(), angle.sin()
    x = x.double()
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return out * rope.attention_scaling


def _positions(gen: torch.Generator, n: int, top: int = MAX_POS) -> Tensor:
    """``n`` random positions in ``[0, top)``, always including both ends and some huge."""
    picks = torch.randint(0, top, (n,), generator=gen)
    picks[:3] = torch.tensor([0, top - 1, min(100_000, top - 1)])
    return picks


def _close(actual: Tensor, expected: Tensor, tol: float = 1e-5) -> None:
    torch.testing.assert_close(actual.double(), expected, atol=tol, rtol=tol)


@pytest.mark.parametrize("kind", list(SCALINGS))
def test_rotate_matches_the_formula_at_any_position(kind: str) -> None:
    rope, gen = _rope(kind), torch.Generator().manual_seed(1)
    for _ in range(5):
        positions = _positions(gen, 64)
        x = torch.randn(3, 64, D, generator=gen)  # [H_kv, N, D]
        _close(rope.rotate(x, positions), formula(rope, x, positions))
        cos, sin = rope.cos_sin(positions)
        assert cos.dtype == sin.dtype == torch.float32


@pytest.mark.parametrize("kind", list(SCALINGS))
def test_moving_keys_anywhere_in_the_window_equals_rotating_them_there(kind: str) -> None:
    # forwards, backwards (negative offset), by zero, across the whole 128k window
    rope, gen = _rope(kind), torch.Generator().manual_seed(2)
    for _ in range(20):
        n = int(torch.randint(1, 50, (1,), generator=gen))
        a, b = (int(p) for p in torch.randint(0, MAX_POS - n, (2,), generator=gen))
        for src, dst in ((a, b), (b, a), (a, a), (0, MAX_POS - n), (MAX_POS - n, 0)):
            raw = torch.randn(2, n, D, generator=gen)  # [H_kv, n, D]
            at_src = rope.rotate(raw, torch.arange(src, src + n))
            moved = rope.shift(at_src, dst - src)
            _close(moved, formula(rope, raw, torch.arange(dst, dst + n)))
            _close(rope.unrotate(moved, torch.arange(dst, dst + n)), raw.double())


@pytest.mark.parametrize("kind", ["default", "llama3", "yarn"])
def test_per_token_moves_compose(kind: str) -> None:
    # a -> b -> c equals a -> c, each token by its own offset (negative ones too)
    rope, gen = _rope(kind), torch.Generator().manual_seed(3)
    for _ in range(10):
        a, b, c = (_positions(gen, 40) for _ in range(3))
        raw = torch.randn(4, 40, D, generator=gen)
        twice = rope.shift(rope.shift(rope.rotate(raw, a), b - a), c - b)
        _close(twice, formula(rope, raw, c))


def test_bfloat16_keys_move_within_one_rounding() -> None:
    rope, gen = _rope("llama3"), torch.Generator().manual_seed(4)
    for _ in range(10):
        n = 32
        a, b = (int(p) for p in torch.randint(0, MAX_POS - n, (2,), generator=gen))
        raw = torch.randn(2, n, D, generator=gen)
        stored = rope.rotate(raw, torch.arange(a, a + n)).bfloat16()
        buffer = torch.zeros(2, n + 10, D, dtype=torch.bfloat16)
        rope.shift(stored, b - a, out=buffer[:, 5 : 5 + n])
        exact = formula(rope, stored.double(), torch.arange(b - a, b - a + 1).expand(n))
        # rotated in float32 from the stored bf16 keys and rounded once to bf16
        torch.testing.assert_close(buffer[:, 5 : 5 + n].double(), exact, atol=1e-6, rtol=2**-8)
        assert not buffer[:, :5].any() and not buffer[:, 5 + n :].any()


@pytest.mark.parametrize("kind", list(SCALINGS))
def test_rotate_agrees_with_hf_up_to_hf_float32_angles(kind: str) -> None:
    # Hugging Face's angle is the float32 product pos * inv_freq (off by up to half an ulp
    # of it: ~0.004 rad at 100k); ours is exact. The two keys differ by at most that angle
    # error times the pair's length, plus float32 rounding.
    config, rope, gen = _config(kind), _rope(kind), torch.Generator().manual_seed(5)
    hf_rope = LlamaRotaryEmbedding(config)
    assert torch.equal(rope.inv_freq, hf_rope.inv_freq)
    assert rope.attention_scaling == pytest.approx(hf_rope.attention_scaling)
    positions = _positions(gen, 256)
    x = torch.randn(1, 1, 256, D, generator=gen)  # [1, H, N, D]
    cos, sin = hf_rope(x, positions[None])
    hf, _ = apply_rotary_pos_emb(x, x, cos, sin)  # [1, 1, N, D]
    angle32 = positions.float()[:, None] * hf_rope.inv_freq  # [N, D/2] as HF rounds it
    half_ulp = (angle32.nextafter(torch.tensor(float("inf"))) - angle32).double() / 2
    pair = x[0, 0].double().view(256, 2, D // 2).norm(dim=1)  # [N, D/2] each pair's length
    bound = (half_ulp * pair).repeat(1, 2) * rope.attention_scaling + 1e-5  # [N, D]
    diff = (rope.rotate(x[0, 0], positions).double() - hf[0, 0].double()).abs()
    assert bool((diff <= bound).all()), float((diff - bound).max())


@pytest.mark.parametrize("overlap", [0, 5, 12])
def test_moving_keys_within_one_buffer(overlap: int) -> None:
    # keys moved to a range of the same buffer (in place when overlap is 0, overlapping
    # ranges otherwise) equal keys rotated there: shift reads every source value first
    rope, gen = _rope("llama3"), torch.Generator().manual_seed(6)
    n = 12
    raw = torch.randn(2, n, D, generator=gen)  # [H_kv, n, D]
    buffer = torch.zeros(2, 3 * n, D)
    src, dst = 3, 3 + overlap
    buffer[:, src : src + n] = rope.rotate(raw, torch.arange(1000, 1000 + n))
    rope.shift(buffer[:, src : src + n], 500, out=buffer[:, dst : dst + n])
    _close(buffer[:, dst : dst + n], formula(rope, raw, torch.arange(1500, 1500 + n)))
