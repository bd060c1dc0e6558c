"""One decoder-layer step for a chosen set of token rows over a merged KV sequence.

This is selective recompute (CacheBlend §4.2, Cache-Craft §3.4.3): Q, K and V are computed for
the chosen rows only, their K/V overwrite the reused entries, and the rows attend over the whole
merged sequence. With every row chosen it is an ordinary prefill layer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from chunkcache.kernels.attention import (
    ROWS_PER_BLOCK,
    RowBlock,
    attention,
    attention_mass,
    blocked_attention,
    causal_blocks,
    causal_mask,
    rows_per_block,
    tail_attention,
    uses_matmul_attention,
)
from chunkcache.kernels.rope import Rope, apply_rope


@dataclass(frozen=True)
class Rows:
    """The token rows one forward step computes: their slots (= positions), RoPE and mask."""

    index: Tensor  # [N] slots in the merged KV, strictly increasing
    cos: Tensor  # [N, D] float32
    sin: Tensor  # [N, D] float32
    mask: Tensor | None  # [N, S] bool; None when the rows are all S slots (plain causal)
    # the rows split for attention, by query heads and rows per block; built on first use
    _blocks: dict[tuple[int, int], tuple[RowBlock, ...]] = field(
        default_factory=dict, compare=False, repr=False
    )

    @classmethod
    def build(cls, index: Tensor, num_slots: int, rope: Rope) -> Rows:
        """Rows at slots ``index`` of a merged sequence of ``num_slots`` tokens."""
        # index: [N] long
        if index.numel() == 0 or index[-1] >= num_slots or bool((index[1:] <= index[:-1]).any()):
            raise ValueError(f"rows must be increasing slots in [0, {num_slots}), got {index}")
        cos, sin = rope.cos_sin(index)  # cos, sin: [N, D]
        return cls(index, cos, sin, cls._mask(index, num_slots))

    @staticmethod
    def _mask(index: Tensor, num_slots: int) -> Tensor | None:
        if index.numel() == num_slots:  # increasing and in range: every slot, in order
            return None
        return causal_mask(index, torch.arange(num_slots, device=index.device))  # [N, S]

    @property
    def num_slots(self) -> int:
        return self.index.numel() if self.mask is None else self.mask.shape[1]

    def probe_mask(self, probe: Tensor) -> Tensor:
        """The causal mask of the rows at ``probe`` (indices into these rows)."""
        # probe: [P] long -> [P, S] bool
        if self.mask is not None:
            return self.mask[probe]
        return causal_mask(self.index[probe], torch.arange(self.num_slots, device=probe.device))

    def subset(self, keep: Tensor) -> Rows:
        """The rows at ``keep`` (increasing indices into these rows), e.g. after a filter step."""
        # keep: [M] long
        index = self.index[keep]  # index: [M]
        mask = self._mask(index, self.num_slots) if self.mask is None else self.mask[keep]
        return Rows(index, self.cos[keep], self.sin[keep], mask)

    def blocks(self, heads: int, rows_per_block: int = ROWS_PER_BLOCK) -> tuple[RowBlock, ...]:
        """These rows split for :func:`blocked_attention` with ``heads`` query heads."""
        key = (heads, rows_per_block)
        if key not in self._blocks:
            self._blocks[key] = causal_blocks(self.index, self.mask, heads, rows_per_block)
        return self._blocks[key]

    def attention(self, q: Tensor, k: Tensor, v: Tensor, scale: float) -> Tensor:
        """Attention of these rows' queries over the merged KV, causal by position."""
        # q: [H, N, D]; k, v: [H_kv, S, D] -> [N, H * D]
        first, n = int(self.index[0]), self.index.numel()
        consecutive = int(self.index[-1]) == first + n - 1  # a prefill, on a past if first > 0
        if not uses_matmul_attention(q):
            if self.mask is None:
                return attention(q, k, v, None, scale)
            if consecutive:
                return tail_attention(q, k, v, first, scale)
        return blocked_attention(q, k, v, self.blocks(q.shape[0], rows_per_block(q)), scale)


def layer_step(layer: Any, x: Tensor, rows: Rows, k: Tensor, v: Tensor) -> Tensor:
    """Run a Hugging Face Llama/Mistral/Qwen2 decoder ``layer`` for ``rows`` only.

    ``x`` holds the rows' input hidden states. Their keys (rotated) and values are written into
    ``k`` and ``v`` in place at ``rows.index``; every other slot is reused as it is. Returns the
    rows' output hidden states (attention and MLP, each with its residual).
    """
    return _step(layer, x, rows, k, v, None)[0]


@dataclass(frozen=True)
class Probe:
    """Rows whose attention a layer step also returns, summed over groups of key slots.

    ``groups = arange(S)`` asks for the plain attention probabilities over all slots.
    """

    rows: Tensor  # [P] long, indices into the step's Rows
    groups: Tensor  # [S] long, the group of each slot of the merged sequence
    num_groups: int


def layer_step_probed(
    layer: Any, x: Tensor, rows: Rows, k: Tensor, v: Tensor, probe: Probe
) -> tuple[Tensor, Tensor]:
    """:func:`layer_step`, plus the attention of the rows ``probe.rows`` per slot group.

    The attention is averaged over heads, float32, ``[P, G]`` (Cache-Craft §3.1 reads
    inter and intra attention from it). The hidden states are those of :func:`layer_step`:
    the attention is an extra product, so the normal path pays nothing for it.
    """
    x, mass = _step(layer, x, rows, k, v, probe)
    assert mass is not None
    return x, mass


def write_kv(layer: Any, h: Tensor, rows: Rows, k: Tensor, v: Tensor) -> Tensor:
    """Compute the rows' keys (rotated) and values from their normed inputs ``h`` and write
    them into ``k`` and ``v`` at ``rows.index``. Returns the rows' new values.

    The first half of :func:`layer_step`: a selective-recompute check layer (CacheBlend §4.3)
    writes K/V for every candidate row, compares values, and finishes the layer
    (:func:`finish_rows`) only for the rows it keeps.
    """
    # h: [N, E] = layer.input_layernorm(x); k, v: [H_kv, S, D] (views into the merged KV)
    attn = layer.self_attn
    n, head_dim = h.shape[0], attn.head_dim
    k_rows = attn.k_proj(h).view(n, -1, head_dim).transpose(0, 1)  # k_rows: [H_kv, N, D]
    v_rows = attn.v_proj(h).view(n, -1, head_dim).transpose(0, 1)  # v_rows: [H_kv, N, D]
    k.index_copy_(1, rows.index, apply_rope(k_rows, rows.cos, rows.sin))
    v.index_copy_(1, rows.index, v_rows)
    return v_rows  # [H_kv, N, D]


def finish_rows(
    layer: Any, x: Tensor, h: Tensor, rows: Rows, k: Tensor, v: Tensor, probe: Probe | None = None
) -> tuple[Tensor, Tensor | None]:
    """The second half of :func:`layer_step`, once every row's K/V is in ``k`` and ``v``:
    queries, attention over the merged KV, output projection and MLP, for ``rows`` only.

    Returns the rows' output hidden states, and the probed attention when ``probe`` is set.
    """
    # x: [N, E] layer inputs; h: [N, E] normed; k, v: [H_kv, S, D]
    attn = layer.self_attn
    n, head_dim = x.shape[0], attn.head_dim
    q = attn.q_proj(h).view(n, -1, head_dim).transpose(0, 1)  # q: [H, N, D]
    q = apply_rope(q, rows.cos, rows.sin)
    mass = None
    if probe is not None and rows.mask is None and 2 * probe.rows.numel() > n:
        # most of the whole sequence probed: every row on SDPA's causal fast path, then pick
        mass = attention_mass(q, k, None, attn.scaling, probe.groups, probe.num_groups)
        mass = mass[probe.rows]  # mass: [P, G]
    elif probe is not None:
        mask = rows.probe_mask(probe.rows)  # mask: [P, S]
        q_probe = q[:, probe.rows]  # q_probe: [H, P, D]
        mass = attention_mass(q_probe, k, mask, attn.scaling, probe.groups, probe.num_groups)
    x = x + attn.o_proj(rows.attention(q, k, v, attn.scaling))  # x: [N, E]
    return x + layer.mlp(layer.post_attention_layernorm(x)), mass  # mass: [P, G]


def _step(
    layer: Any, x: Tensor, rows: Rows, k: Tensor, v: Tensor, probe: Probe | None
) -> tuple[Tensor, Tensor | None]:
    # x: [N, E]; k, v: [H_kv, S, D] (views into the merged KV)
    h = layer.input_layernorm(x)  # h: [N, E]
    write_kv(layer, h, rows, k, v)
    return finish_rows(layer, x, h, rows, k, v, probe)
