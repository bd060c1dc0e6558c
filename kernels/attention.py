"""Attention for a set of query rows at scattered positions over a merged KV sequence.

The mask is causal by position: a query at position ``p`` sees every key at a position ``<= p``,
wherever the key came from (reused chunk KV or freshly computed). This is the true causal mask
for recomputed rows (Cache-Craft §3.4.3), not the bottom-right aligned one of CacheBlend's
vLLM patch, which lets a row see keys after it.
"""

from __future__ import annotations

from dataclasses import dataclass

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
MAX_BLOCKS = 8


@dataclass(frozen=True)
class RowBlock:
    """Query rows ``first:end`` (consecutive, increasing positions) and the keys
    ``0:num_keys`` any of them may see."""

    first: int
    end: int
    num_keys: int
    mask: Tensor  # [end - first, num_keys] bool, a view into the rows' causal mask


def causal_blocks(q_pos: Tensor, mask: Tensor) -> tuple[RowBlock, ...]:
    """Split rows at increasing slots ``q_pos`` into blocks of about equal size."""
    # q_pos: [N] long, strictly increasing; mask: [N, S] = causal_mask(q_pos, arange(S))
    n = q_pos.numel()
    count = max(1, min(MAX_BLOCKS, n // ROWS_PER_BLOCK))
    bounds = [i * n // count for i in range(count + 1)]
    ends = torch.tensor(bounds[1:], device=q_pos.device) - 1  # each block's last row
    last = q_pos[ends].tolist()  # their positions
    return tuple(
        RowBlock(first, end, pos + 1, mask[first:end, : pos + 1])
        for first, end, pos in zip(bounds[:-1], bounds[1:], last, strict=True)
    )


def blocked_attention(
    q: Tensor, k: Tensor, v: Tensor, blocks: tuple[RowBlock, ...], scale: float
) -> Tensor:
    """:func:`attention` of scattered rows, block by block (see :func:`causal_blocks`)."""
    # q: [H, N, D]; k, v: [H_kv, S, D] -> [N, H * D]
    parts = [
        attention(q[:, b.first : b.end], k[:, : b.num_keys], v[:, : b.num_keys], b.mask, scale)
        for b in blocks
    ]  # parts: [n_b, H * D] each
    return torch.cat(parts) if len(parts) > 1 else parts[0]


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
