"""Attention for a set of query rows at scattered positions over a merged KV sequence.

The mask is causal by position: a query at position ``p`` sees every key at a position ``<= p``,
wherever the key came from (reused chunk KV or freshly computed). This is the true causal mask
for recomputed rows (Cache-Craft §3.4.3), not the bottom-right aligned one of CacheBlend's
vLLM patch, which lets a row see keys after it.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor


def causal_mask(q_pos: Tensor, k_pos: Tensor) -> Tensor:
    """``mask[i, j]``: query ``i`` may attend to key ``j``, i.e. ``k_pos[j] <= q_pos[i]``."""
    # q_pos: [N]; k_pos: [S] -> mask: [N, S] bool
    return k_pos[None, :] <= q_pos[:, None]


def attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, scale: float) -> Tensor:
    """Grouped-query attention of ``q``'s rows over all keys, returned token-major.

    ``mask=None`` means the rows are the whole sequence in order (plain causal attention, the
    fast path of SDPA); otherwise ``mask`` comes from :func:`causal_mask`. KV heads are shared
    by ``H // H_kv`` query heads each (``enable_gqa``).
    """
    # q: [H, N, D]; k, v: [H_kv, S, D]; mask: [N, S] bool or None
    # SDPA picks its fast CPU kernel only for 4-D inputs, hence the batch dimension of one.
    out = F.scaled_dot_product_attention(
        q[None],
        k[None],
        v[None],
        attn_mask=mask,
        is_causal=mask is None,
        scale=scale,
        enable_gqa=True,
    )  # out: [1, H, N, D]
    return out[0].transpose(0, 1).flatten(1)  # -> [N, H * D]


# Scattered rows run in blocks of consecutive rows, each over the keys up to its last row's
# position only: SDPA's CPU kernel skips no masked keys, so one call over all keys costs
# rows x slots, about twice the causal work. 4-8 blocks measured ~25% less attention
# time than one call (SmolLM2 shapes, 170 rows over 1,129 slots); more blocks cost more.
ROWS_PER_BLOCK = 32
# On matmuls (bf16 on a CPU) each block costs three calls whatever its size, so blocks are
# larger: 201 rows over 1,177 slots took 1.45 ms in one or two blocks, 2.0 ms in six; a whole
# 1,177-token sequence 6.6 ms in four blocks, 7.0 ms in eight (SmolLM2 shapes, 2 threads).
MATMUL_ROWS_PER_BLOCK = 256
# SDPA in bfloat16 on AMX: the fewer calls the better, so the rows split only where a block
# would pass MAX_BLOCK_SCORES.  One call for cacheblend 0.15's ~200 rows over ~1,200 slots
# took the prefill 0.91x the time of 32-row blocks, cachecraft 0.94x, cacheblend 0.30 0.94x
# (Intel Xeon with AMX, 2 cores, 3 prompts, best of 6 interleaved); in float32 the 32-row
# blocks stay (one call 1.00-1.04x).
AMX_ROWS_PER_BLOCK = 1 << 30
MAX_BLOCKS = 8
# No block has more scores than this over all its heads.
MAX_BLOCK_SCORES = 1 << 22


@dataclass(frozen=True)
class RowBlock:
    """Query rows ``first:end`` (consecutive, increasing positions) and the keys
    ``0:num_keys`` any of them may see."""

    first: int
    end: int
    num_keys: int
    mask: Tensor  # [end - first, num_keys] bool
    _biases: dict[tuple[torch.dtype, int], Tensor] = field(
        default_factory=dict, compare=False, repr=False
    )

    def bias(self, dtype: torch.dtype, groups: int) -> Tensor:
        """The mask as an additive bias (0 or -inf) in ``dtype``, its rows repeated for the
        ``groups`` query heads sharing a KV head; built once per dtype, then reused by
        every layer (SDPA would otherwise convert a bool mask on every call)."""
        # -> [groups * (end - first), num_keys]
        key = (dtype, groups)
        if key not in self._biases:
            bias = torch.zeros(self.mask.shape, dtype=dtype, device=self.mask.device)
            self._biases[key] = bias.masked_fill_(~self.mask, float("-inf")).repeat(groups, 1)
        return self._biases[key]


def causal_blocks(
    q_pos: Tensor, mask: Tensor | None, heads: int = 1, rows_per_block: int = ROWS_PER_BLOCK
) -> tuple[RowBlock, ...]:
    """Split rows at increasing slots ``q_pos`` into blocks of about ``rows_per_block`` rows
    (at most :data:`MAX_BLOCKS`), more where a block would otherwise have more than
    :data:`MAX_BLOCK_SCORES` scores over ``heads`` heads.

    ``mask`` is the rows' causal mask if already built; each block takes a view of it.
    """
    # q_pos: [N] long, strictly increasing; mask: [N, S] = causal_mask(q_pos, arange(S))
    n = q_pos.numel()
    max_rows = max(1, MAX_BLOCK_SCORES // (heads * (int(q_pos[-1]) + 1)))  # over every key
    count = max(1, min(MAX_BLOCKS, n // rows_per_block), -(-n // max_rows))
    bounds = [i * n // count for i in range(count + 1)]
    ends = torch.tensor(bounds[1:], device=q_pos.device) - 1  # each block's last row
    last = q_pos[ends].tolist()  # their positions
    blocks = []
    for first, end, pos in zip(bounds[:-1], bounds[1:], last, strict=True):
        if mask is not None:
            block_mask = mask[first:end, : pos + 1]
        else:
            block_mask = causal_mask(q_pos[first:end], torch.arange(pos + 1, device=q_pos.device))
        blocks.append(RowBlock(first, end, pos + 1, block_mask))
    return tuple(blocks)


def uses_matmul_attention(q: Tensor) -> bool:
    """Whether attention for queries like ``q`` runs block by block as plain matmuls
    (:func:`matmul_attention`) rather than on SDPA: in bfloat16 or float16 on a CPU without
    AMX (:func:`cpu_has_amx`).

    With AMX, SDPA was the faster for every kind of rows (Intel Xeon with AMX, 2 cores,
    SmolLM2 bf16): ``full`` prefill took 391 ms against 535 ms on matmul blocks (4 prompts
    of ~1,170 tokens, medians of the best of 3); a prefill after a longer past (a
    conversation's next turn, :func:`tail_attention`) 0.73x the time for 700 rows after
    1,300 past tokens, 0.58x after 2,500, the same for 1-40 rows; the layer loop over rows
    of a 1,265-slot KV 0.85-0.97x for 128-1,024 scattered rows (selective recompute) and
    0.66-0.95x for rows in a few runs (a prompt's uncached chunks), best of 6 interleaved.

    Without AMX, SDPA's flash kernel ran at about a seventh of the matmuls' FLOP rate (SmolLM2,
    bf16, 2-core AMD EPYC with AVX512-BF16).  Two matmuls per block with a float32 softmax
    between them, as Hugging Face's eager attention computes it, took 0.4-0.8x its time
    for blocks of 16-32 rows over 300-4,000 keys.  The engine's prefill, best of 3 on the
    same prompt: 0.77x for ``full``, 0.84x for ``cacheblend`` 0.15, 0.79x for ``reuse``.
    A prompt whose shapes are new pays for oneDNN building a matmul for each shape (about
    0.7 ms each, which SDPA does not); blocks of :data:`MATMUL_ROWS_PER_BLOCK` rows keep
    that to a few shapes a layer: a new prompt's first ``cacheblend`` 0.15 run took 1.08x
    the time of its repeat, ``full`` 1.0x (12 prompts, medians).

    The scores are bf16, as in Hugging Face's eager attention, and the softmax computes in
    float32 internally, so a single block is a few times further from the exact result than
    SDPA's, but that is lost in the model's own bf16 rounding: first-token KL against the
    same policy in float32 (20 prompts, mean) was 0.0022 for ``full`` (SDPA 0.0024) and
    0.0026 for ``cacheblend`` 0.15 (SDPA 0.0021), whose KL to ``full`` is 0.11.  In float32
    SDPA was as fast or faster.
    """
    if q.device.type != "cpu" or q.dtype not in (torch.bfloat16, torch.float16):
        return False
    return not cpu_has_amx()


def rows_per_block(q: Tensor) -> int:
    """Rows per block of :func:`blocked_attention` for queries like ``q``: the size each
    kernel runs fastest at (:data:`ROWS_PER_BLOCK`, :data:`MATMUL_ROWS_PER_BLOCK`,
    :data:`AMX_ROWS_PER_BLOCK`)."""
    if uses_matmul_attention(q):
        return MATMUL_ROWS_PER_BLOCK
    if q.device.type == "cpu" and q.dtype in (torch.bfloat16, torch.float16):
        return AMX_ROWS_PER_BLOCK  # low precision on SDPA: this CPU has AMX
    return ROWS_PER_BLOCK


@functools.cache
def cpu_has_amx() -> bool:
    """Whether this CPU has AMX tiles for bfloat16 (``amx_bf16`` in Linux's
    ``/proc/cpuinfo``; False where that cannot be read).  torch 2.13 has no public query."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as cpuinfo:
            return any(line.startswith("flags") and "amx_bf16" in line.split() for line in cpuinfo)
    except OSError:
        return False


def matmul_attention(q: Tensor, k: Tensor, v: Tensor, bias: Tensor, scale: float) -> Tensor:
    """One block's attention in three calls: scaled scores plus the mask's bias in one
    matmul, a softmax (float32 inside, ``q``'s dtype out), and the matmul with the values.

    ``q`` holds the rows of the ``G`` query heads that share each KV head, head-major, and
    ``bias`` the mask for those rows.  Against converting the scores to float32 first and
    scaling, masking and converting back in separate passes (the same result: the scores
    were bf16 before either way), the engine's prefill took 0.92x the time for ``full`` and
    0.83x for ``cacheblend`` 0.15, with :data:`MATMUL_ROWS_PER_BLOCK` (6 prompts x 3
    interleaved rounds, medians).
    """
    # q: [H_kv, G * n, D]; k, v: [H_kv, K, D]; bias: [G * n, K] (0 or -inf) -> [H_kv, G * n, D]
    scores = torch.baddbmm(bias, q, k.transpose(1, 2), alpha=scale)  # [H_kv, G * n, K]
    return torch.bmm(scores.softmax(-1), v)  # [H_kv, G * n, D]


def blocked_attention(
    q: Tensor, k: Tensor, v: Tensor, blocks: tuple[RowBlock, ...], scale: float
) -> Tensor:
    """:func:`attention` of scattered rows, block by block (see :func:`causal_blocks`).

    The ``G = H // H_kv`` query heads sharing a KV head are folded into one head of
    ``G x`` the rows, so each key block is read once per KV head rather than once per
    query head: with few rows SDPA's CPU kernel is bound by reading keys (measured on
    SmolLM2 shapes, 170 rows over 1,170 slots, bf16: ~15% less time than unfolded).
    In bfloat16 on a CPU without AMX each block runs as :func:`matmul_attention` instead of SDPA
    (:func:`uses_matmul_attention`).
    """
    # q: [H, N, D]; k, v: [H_kv, S, D] -> [N, H * D]
    (h, n, d), h_kv = q.shape, k.shape[0]
    groups = h // h_kv
    q_folded = q.view(h_kv, groups, n, d)  # heads h_kv * G + g share KV head h_kv
    on_matmuls, parts = uses_matmul_attention(q), []
    for b in blocks:
        rows = b.end - b.first
        q_b = q_folded[:, :, b.first : b.end].reshape(h_kv, groups * rows, d)
        k_b, v_b = k[:, : b.num_keys], v[:, : b.num_keys]  # [H_kv, K, D]
        bias = b.bias(q.dtype, groups)  # [G * n_b, K]
        if on_matmuls:
            out = matmul_attention(q_b, k_b, v_b, bias, scale)
        else:
            out = F.scaled_dot_product_attention(
                q_b[None], k_b[None], v_b[None], attn_mask=bias, scale=scale
            )[0]  # out: [H_kv, G * n_b, D]
        parts.append(out.view(h_kv, groups, rows, d))
    out = torch.cat(parts, dim=2) if len(parts) > 1 else parts[0]  # out: [H_kv, G, N, D]
    return out.reshape(h, n, d).transpose(0, 1).flatten(1)  # -> [N, H * D]


def tail_attention(q: Tensor, k: Tensor, v: Tensor, start: int, scale: float) -> Tensor:
    """:func:`attention` of consecutive rows at slots ``start..start + N - 1``, all keys
    ``0..start + N - 1``: a prefill on top of ``start`` past tokens.

    A past no longer than the rows is padded with dummy query rows, so the whole runs
    on SDPA's causal fast path (which skips the keys above the diagonal).  A longer past
    takes two SDPA calls, the past keys without a mask and the rows' own keys causal,
    merged by their log-sum-exp; one masked call over every key would do the masked
    half for nothing.  The merge needs the log-sum-exp, which only the CPU kernel
    returns; other devices take the masked call.  Measured for 1,142 rows after 35
    (SmolLM2 shapes, bf16, one thread): padded 0.86-0.92x the time of 8 masked blocks, the
    merged split 1.04x.
    """
    # q: [H, N, D]; k, v: [H_kv, >= start + N, D] -> [N, H * D]
    n = q.shape[1]
    own_k, own_v = k[None, :, start : start + n], v[None, :, start : start + n]
    if start == 0:
        return attention(q, own_k[0], own_v[0], None, scale)
    if start <= n:  # a short past: pad it with query rows whose output is dropped
        padded = torch.cat((q.new_zeros(q.shape[0], start, q.shape[2]), q), dim=1)
        return attention(padded, k[:, : start + n], v[:, : start + n], None, scale)[start:]
    if q.device.type != "cpu":
        mask = causal_mask(
            torch.arange(start, start + n, device=q.device),
            torch.arange(start + n, device=q.device),
        )
        return attention(q, k[:, : start + n], v[:, : start + n], mask, scale)
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    past, past_lse = flash(q[None], k[None, :, :start], v[None, :, :start], scale=scale)
    own, own_lse = flash(q[None], own_k, own_v, is_causal=True, scale=scale)
    # past, own: [1, H, N, D]; *_lse: [1, H, N] float32 (log of each part's softmax sum)
    lse = torch.logaddexp(past_lse, own_lse)
    out = past.float().mul_((past_lse - lse).exp_().unsqueeze(-1))
    out.addcmul_(own.float(), (own_lse - lse).exp_().unsqueeze(-1))
    return out[0].to(q.dtype).transpose(0, 1).flatten(1)  # -> [N, H * D]


def attention_mass(
    q: Tensor, k: Tensor, mask: Tensor | None, scale: float, groups: Tensor, num_groups: int
) -> Tensor:
    """The attention of ``q``'s rows summed over groups of key slots, averaged over heads.

    ``groups[j]`` is slot ``j``'s group; with ``groups = arange(S)`` the result is the rows'
    attention probabilities over the merged sequence.  It is attention whose values are
    one-hot group indicators, ``D`` groups per call: SDPA's fused kernel (which wants value
    width ``D``) then never materialises the ``[H, P, S]`` probabilities, and a call costs
    about what the rows' own attention does.  Float32 out; bf16 models give ~1e-3 accuracy.
    ``mask=None`` means the rows are the whole sequence in order (SDPA's causal fast path).
    """
    # q: [H, P, D]; k: [H_kv, S, D]; mask: [P, S] bool or None; groups: [S] long in [0, G)
    width = q.shape[-1]
    out = []
    for first in range(0, num_groups, width):
        index = groups - first  # [S]
        inside = ((index >= 0) & (index < width)).nonzero().squeeze(1)  # [S']
        onehot = q.new_zeros(k.shape[1], width)  # onehot: [S, D]
        onehot[inside, index[inside]] = 1
        mass = F.scaled_dot_product_attention(
            q[None],
            k[None],
            onehot.expand(k.shape[0], -1, -1)[None],
            attn_mask=mask,
            is_causal=mask is None,
            scale=scale,
            enable_gqa=True,
        )  # mass: [1, H, P, D]
        out.append(mass[0].float().mean(dim=0))  # [P, D]
    return torch.cat(out, dim=1)[:, :num_groups]  # [P, G]
