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
