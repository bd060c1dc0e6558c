"""Attention for a set of query rows at scattered positions over a merged KV sequence.

The mask is causal by position: a query at position ``p`` sees every key at a position ``<= p``,
wherever the key came from (reused chunk KV or freshly computed). This is the true causal mask
for recomputed rows (Cache-Craft §3.4.3), not the bottom-right aligned one of CacheBlend's
vLLM patch, which lets a row see keys after it.
"""

from __future__ import annotations

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


def attention_probs(q: Tensor, k: Tensor, mask: Tensor, scale: float, block: int = 256) -> Tensor:
    """The softmax attention probabilities of ``q``'s rows over all keys, averaged over heads.

    The explicit form of what :func:`attention` computes inside SDPA, for the few rows whose
    attention the caller wants to read (Cache-Craft §3.1); float32, ``block`` rows at a time
    so the ``[H, block, S]`` scores stay small.
    """
    # q: [H, P, D]; k: [H_kv, S, D]; mask: [P, S] bool
    groups = q.shape[0] // k.shape[0]
    k = k.float().repeat_interleave(groups, dim=0)  # k: [H, S, D], as enable_gqa shares heads
    out = []
    for i in range(0, q.shape[1], block):
        scores = (q[:, i : i + block].float() @ k.transpose(1, 2)) * scale  # [H, b, S]
        scores.masked_fill_(~mask[i : i + block], float("-inf"))
        out.append(scores.softmax(dim=-1).mean(dim=0))  # [b, S]
    return torch.cat(out) if out else q.new_zeros(0, k.shape[1], dtype=torch.float32)  # [P, S]
