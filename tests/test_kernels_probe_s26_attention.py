"""Randomized property tests of scattered-row attention against a float64 reference written
here: plain softmax attention, causal by position, every kernel path forced in turn.

Tolerances: float32 kernels within 1e-5 (relative and absolute) of the float64 reference;
bfloat16 and float16 inputs within 2e-2 (a few bf16 ulps of O(1) outputs: bf16 scores and
probabilities on the matmul path, bf16 outputs on SDPA).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from torch import Tensor

from chunkcache.kernels import attention as attention_module
from chunkcache.kernels import layer as layer_module
from chunkcache.kernels.attention import (
    AMX_ROWS_PER_BLOCK,
    attention,
    attention_mass,
    blocked_attention,
    causal_blocks,
    tail_attention,
)
from chunkcache.kernels.layer import Rows
from chunkcache.kernels.rope import Rope

F32_TOL = 1e-5
LOW_TOL = 2e-2
ROPE = Rope(1.0 / (10000.0 ** (torch.arange(0, 8, 2).float() / 8)))  # rows need a Rope only


def reference(
    q: Tensor, k: Tensor, v: Tensor, q_pos: Tensor, k_pos: Tensor, scale: float
) -> Tensor:
    """Naive float64 attention: query ``i`` sees key ``j`` iff ``k_pos[j] <= q_pos[i]``;
    query head ``h`` reads KV head ``h // (H / H_kv)``."""
    # q: [H, N, D]; k, v: [H_kv, S, D]; q_pos: [N]; k_pos: [S] -> [N, H * D] float64
    q, k, v = q.double(), k.double(), v.double()
    group = q.shape[0] // k.shape[0]
    out = torch.empty(q.shape[1], q.shape[0], q.shape[2], dtype=torch.float64)
    for h in range(q.shape[0]):
        for i in range(q.shape[1]):
            seen = (k_pos <= q_pos[i]).nonzero().squeeze(1)  # [S_i]
            scores = (k[h // group, seen] @ q[h, i]) * scale  # [S_i]
            weights = (scores - scores.max()).exp()
            out[i, h] = (weights / weights.sum()) @ v[h // group, seen]
    return out.flatten(1)


def _close(actual: Tensor, expected: Tensor, dtype: torch.dtype) -> None:
    tol = F32_TOL if dtype in (torch.float32, torch.float64) else LOW_TOL
    assert actual.dtype == dtype
    torch.testing.assert_close(actual.double(), expected, atol=tol, rtol=tol)


def _case(
    gen: torch.Generator, h_kv: int, groups: int, d: int, n: int, s: int, dtype: torch.dtype
) -> tuple[Tensor, Tensor, Tensor]:
    """Inputs laid out as the engine has them: queries head-major views of token-major
    projections, keys and values views of the used slots of a larger buffer."""
    q = torch.randn(n, h_kv * groups, d, generator=gen).to(dtype).transpose(0, 1)  # [H, N, D]
    kv = torch.randn(2, h_kv, s + 3, d, generator=gen)  # [2, H_kv, C, D]
    kv[0] *= 2  # larger keys: a peakier softmax
    kv = kv.to(dtype)
    return q, kv[0, :, :s], kv[1, :, :s]


def _rows(gen: torch.Generator, s: int, shape: str) -> Tensor:
    """Increasing row slots of one of the shapes callers pass."""
    if shape == "all":
        return torch.arange(s)
    if shape == "first":
        return torch.tensor([0])
    if shape == "last":
        return torch.tensor([s - 1])
    if shape == "ends":
        return torch.tensor([0, s - 1])
    if shape == "tail":
        start = int(torch.randint(1, s, (1,), generator=gen))
        return torch.arange(start, s)
    if shape == "head":
        return torch.arange(int(torch.randint(1, s, (1,), generator=gen)))
    if shape == "runs":
        cut = sorted(torch.randperm(s, generator=gen)[:4].tolist())
        return torch.cat((torch.arange(cut[0], cut[1] + 1), torch.arange(cut[2], cut[3] + 1)))
    n = int(torch.randint(1, s + 1, (1,), generator=gen))  # scattered
    return torch.randperm(s, generator=gen)[:n].sort().values


SHAPES = ("all", "first", "last", "ends", "tail", "head", "runs", "scattered")
HEADS = ((1, 1), (1, 3), (2, 2), (3, 1), (3, 2))  # (H_kv, G): GQA with 1, 2, 3 KV heads


def _cases(seed: int, count: int, max_s: int = 80) -> Iterator[tuple[int, int, int, int, str]]:
    gen = torch.Generator().manual_seed(seed)
    for i in range(count):
        h_kv, groups = HEADS[i % len(HEADS)]
        d = (8, 64, 24)[i % 3]
        s = int(torch.randint(1, max_s, (1,), generator=gen))
        yield h_kv, groups, d, s, SHAPES[i % len(SHAPES)]


@pytest.fixture
def amx(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> bool:
    monkeypatch.setattr(attention_module, "cpu_has_amx", lambda: request.param)
    return bool(request.param)


@pytest.mark.parametrize("amx", [False, True], indirect=True)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_rows_attention_matches_the_reference_on_every_dispatch(
    amx: bool, dtype: torch.dtype
) -> None:
    # Rows.attention picks: SDPA causal (all rows), tail_attention (consecutive rows, short
    # or long past), blocks of SDPA or, bf16/fp16 without AMX, blocks of matmuls.
    gen = torch.Generator().manual_seed(1)
    for h_kv, groups, d, s, shape in _cases(seed=2, count=40):
        q, k, v = _case(gen, h_kv, groups, d, s, s, dtype)
        rows = _rows(gen, s, shape)
        scale = d**-0.5
        actual = Rows.build(rows, s, ROPE).attention(q[:, rows], k, v, scale)  # [N, H * D]
        expected = reference(q[:, rows], k, v, rows, torch.arange(s), scale)
        _close(actual, expected, dtype)


@pytest.mark.parametrize("on_matmuls", [False, True])
@pytest.mark.parametrize("per_block", [1, 3, 32, AMX_ROWS_PER_BLOCK])
def test_blocked_attention_in_float32_on_both_kernels(
    on_matmuls: bool, per_block: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # matmul blocks forced in float32 too, so their masking and head folding are held to 1e-5
    monkeypatch.setattr(attention_module, "uses_matmul_attention", lambda q: on_matmuls)
    gen = torch.Generator().manual_seed(3)
    for h_kv, groups, d, s, shape in _cases(seed=4, count=24):
        q, k, v = _case(gen, h_kv, groups, d, s, s, torch.float32)
        rows = _rows(gen, s, shape)
        blocks = causal_blocks(rows, None, h_kv * groups, per_block)
        assert [b.first for b in blocks[1:]] == [b.end for b in blocks[:-1]]
        actual = blocked_attention(q[:, rows], k, v, blocks, d**-0.5)
        _close(actual, reference(q[:, rows], k, v, rows, torch.arange(s), d**-0.5), torch.float32)


def test_blocks_split_by_the_score_cap_still_cover_every_row(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # a tiny cap forces a block per row or two, past MAX_BLOCKS
    monkeypatch.setattr(attention_module, "MAX_BLOCK_SCORES", 64)
    gen = torch.Generator().manual_seed(5)
    for h_kv, groups, d, s, shape in _cases(seed=6, count=10, max_s=60):
        q, k, v = _case(gen, h_kv, groups, d, s, s, torch.float32)
        rows = _rows(gen, s, shape)
        blocks = causal_blocks(rows, None, h_kv * groups)
        assert blocks[0].first == 0 and blocks[-1].end == rows.numel()
        assert all(b.end > b.first for b in blocks)
        actual = blocked_attention(q[:, rows], k, v, blocks, d**-0.5)
        _close(actual, reference(q[:, rows], k, v, rows, torch.arange(s), d**-0.5), torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_masked_sdpa_call_matches_the_reference(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(7)
    for h_kv, groups, d, s, shape in _cases(seed=8, count=20):
        q, k, v = _case(gen, h_kv, groups, d, s, s, dtype)
        rows = _rows(gen, s, shape)
        mask = torch.arange(s)[None, :] <= rows[:, None]  # [N, S]
        actual = attention(q[:, rows], k, v, mask, d**-0.5)
        _close(actual, reference(q[:, rows], k, v, rows, torch.arange(s), d**-0.5), dtype)


def test_keys_at_scattered_positions_unsorted_queries() -> None:
    # attention() with an explicit mask is causal by position whatever order keys and rows are in
    gen = torch.Generator().manual_seed(9)
    for h_kv, groups, d, s, _ in _cases(seed=10, count=15):
        n = int(torch.randint(1, s + 1, (1,), generator=gen))
        q, k, v = _case(gen, h_kv, groups, d, n, s, torch.float32)
        k_pos = torch.randperm(s, generator=gen)  # [S] a permutation: slot != position
        q_pos = k_pos[torch.randperm(s, generator=gen)[:n]]  # [N] unsorted, duplicate-free
        mask = k_pos[None, :] <= q_pos[:, None]
        actual = attention(q, k, v, mask, d**-0.5)
        _close(actual, reference(q, k, v, q_pos, k_pos, d**-0.5), torch.float32)


def test_rows_refuse_unsorted_or_duplicate_slots() -> None:
    for bad in ([5, 2, 9], [1, 1], [3, 2], [0, 7, 6]):
        with pytest.raises(ValueError, match="increasing"):
            Rows.build(torch.tensor(bad), 10, ROPE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("past", [0, 1, 2, 5, 40, 700, 5000])
def test_tail_attention_matches_the_reference(past: int, dtype: torch.dtype) -> None:
    # past 0: one causal call; past <= rows: padded; past > rows: two calls merged by LSE
    gen = torch.Generator().manual_seed(11 + past)
    for i, n in enumerate((1, 2, 7, 33)):
        h_kv, groups = HEADS[i % len(HEADS)]
        d = (8, 64)[i % 2]
        s = past + n + i  # keys after the last row exist and must stay unseen
        q, k, v = _case(gen, h_kv, groups, d, n, s, dtype)
        actual = tail_attention(q, k, v, past, d**-0.5)  # [N, H * D]
        rows = torch.arange(past, past + n)
        _close(actual, reference(q, k, v, rows, torch.arange(s), d**-0.5), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tail_attention_merges_a_past_that_holds_all_the_mass(dtype: torch.dtype) -> None:
    # one part's softmax sum is e^-100s of the other's: the LSE merge must weight it ~0, not NaN
    gen = torch.Generator().manual_seed(12)
    past, n, d = 50, 4, 8
    q, k, v = _case(gen, 2, 2, d, n, past + n, dtype)
    for boost in (30.0, -30.0):  # the past dominates, then the rows' own keys do
        k_b = k.clone()
        k_b[:, :past] = (q[::2].mean(1, keepdim=True) * boost).to(dtype)  # aligned or opposed
        actual = tail_attention(q, k_b, v, past, 1.0)
        assert torch.isfinite(actual).all()
        rows = torch.arange(past, past + n)
        _close(actual, reference(q, k_b, v, rows, torch.arange(past + n), 1.0), dtype)


def test_layer_dispatch_reaches_each_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    # the cases above exercise every path: check the dispatch takes the one it claims
    calls: list[str] = []
    for name in ("attention", "tail_attention", "blocked_attention"):
        original = getattr(layer_module, name)

        def spy(*args: object, _name: str = name, _f: object = original) -> Tensor:
            calls.append(_name)
            return _f(*args)  # type: ignore[operator]

        monkeypatch.setattr(layer_module, name, spy)
    q, k, v = _case(torch.Generator().manual_seed(13), 2, 2, 8, 30, 30, torch.float32)
    for rows, path in (
        (torch.arange(30), "attention"),
        (torch.arange(10, 30), "tail_attention"),
        (torch.arange(0, 20), "tail_attention"),
        (torch.tensor([0, 5, 29]), "blocked_attention"),
    ):
        calls.clear()
        Rows.build(rows, 30, ROPE).attention(q[:, rows], k, v, 0.3)
        assert calls == [path], rows


def _mass_reference(
    q: Tensor, k: Tensor, q_pos: Tensor, scale: float, groups: Tensor, num_groups: int
) -> Tensor:
    """Float64 attention probabilities over all slots, averaged over heads, summed by group."""
    # q: [H, P, D]; k: [H_kv, S, D]; q_pos: [P]; groups: [S] -> [P, G]
    group = q.shape[0] // k.shape[0]
    keys = k.double().repeat_interleave(group, 0)  # [H, S, D]
    scores = (q.double() @ keys.transpose(1, 2)) * scale  # [H, P, S]
    seen = torch.arange(k.shape[1])[None, :] <= q_pos[:, None]  # [P, S]
    probs = scores.masked_fill(~seen, float("-inf")).softmax(-1).mean(0)  # [P, S]
    return torch.zeros(q.shape[1], num_groups, dtype=torch.float64).index_add_(1, groups, probs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_mass_matches_the_reference(dtype: torch.dtype) -> None:
    # per slot (more groups than D: several calls) and per random group; all rows or some
    gen = torch.Generator().manual_seed(14)
    for h_kv, groups, d, s, shape in _cases(seed=15, count=16):
        q, k, _ = _case(gen, h_kv, groups, d, s, s, dtype)
        rows = _rows(gen, s, shape)
        num_groups = (
            s if shape in ("all", "scattered") else int(torch.randint(1, 12, (1,), generator=gen))
        )
        slot_groups = (
            torch.arange(s)
            if num_groups == s
            else torch.randint(0, num_groups, (s,), generator=gen)
        )
        mask = None if rows.numel() == s else torch.arange(s)[None, :] <= rows[:, None]
        mass = attention_mass(q[:, rows], k, mask, d**-0.5, slot_groups, num_groups)
        assert mass.dtype == torch.float32 and mass.shape == (rows.numel(), num_groups)
        expected = _mass_reference(q[:, rows], k, rows, d**-0.5, slot_groups, num_groups)
        tol = F32_TOL if dtype == torch.float32 else 1e-2  # bf16 probabilities: ~1e-3
        torch.testing.assert_close(mass.double(), expected, atol=tol, rtol=0)
