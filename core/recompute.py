"""Selective recompute over a merged KV: one layer loop, two ways to choose the rows.

The rows to run are the tokens with no cached KV (always computed) and some of
the tokens whose KV was reused from a chunk variant; a reused row left out keeps
its cached KV.  :func:`run_rows` is the layer loop; a :class:`RowSchedule` runs
the first layers itself, where it may read attention and drop reused rows, and
the loop runs the rest plainly.

- :func:`recompute` (CacheBlend §4.2-4.3): every reused row runs the check
  layers; after each check layer only the reused rows whose values moved most
  (highest V deviation, HKVD tokens) stay, gradually filtered down to the
  recompute ratio.  A check layer writes every row's K/V but finishes
  (attention, MLP) only the rows it keeps: a dropped row's output is never
  read, so this is the same computation at a fraction of the cost.  Choosing
  by V deviation, and a true causal mask for the recomputed rows, were both
  measured on this project's default model (DESIGN: facts checked).
- :func:`recompute_rows` (Cache-Craft §3.2): the caller chooses the reused rows
  up front; an optional schedule reads attention and may drop rows
  (:mod:`chunkcache.core.craft_probe`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor

from chunkcache.core.model_forward import embed, run_layers_to_last
from chunkcache.core.models import LoadedModel
from chunkcache.kernels.kv import SeqKV
from chunkcache.kernels.layer import (
    Probe,
    Rows,
    finish_rows,
    layer_step,
    layer_step_probed,
    write_kv,
)

# Share of the reused rows kept after each check layer, as multiples of the target
# ratio r: a little above r after the first check, r after the second (§4.3).
GRADUAL_FILTER = (1.5, 1.0)
# The first layer whose values depend on the context: layer 0's V = W_v · norm(embedding)
# is the same wherever a token sits, so a moved chunk's cached V there equals the
# recomputed V and its deviation says nothing.  Layer 0 runs every row, and deviation is
# read from layer 1 on.  Measured on SmolLM2 (float32, 6 prompts): checking from layer 0
# left cacheblend 0.15 barely better than reuse; from layer 1 its teacher-forced KL was
# 0.036 against reuse's 0.065.
FIRST_CHECK_LAYER = 1


@dataclass(frozen=True)
class RecomputeResult:
    """The last row's final hidden state and what the recompute cost."""

    last_hidden: Tensor  # [E]
    num_recomputed: int  # reused rows still recomputed in the last layer
    token_layers: int  # rows x layers whose K/V were recomputed


@dataclass
class RowSet:
    """The rows still running: their slots, which of them hold reused KV, their hidden states."""

    slots: Tensor  # [M] long, increasing
    is_reused: Tensor  # [M] bool
    x: Tensor  # [M, E], entering the next layer
    rows: Rows

    def keep(self, index: Tensor) -> None:
        """Keep only the rows at ``index`` (increasing indices into these rows)."""
        # index: [M'] long
        self.slots, self.is_reused = self.slots[index], self.is_reused[index]
        self.x, self.rows = self.x[index], self.rows.subset(index)

    def keep_reused_rows(self, reused_rows: Tensor) -> Tensor:
        """Keep every computed row and the reused rows at ``reused_rows`` (indices into these
        rows, any order); returns the increasing indices of the rows kept."""
        # reused_rows: [R'] long
        stay = ~self.is_reused  # stay: [M] bool
        stay[reused_rows] = True
        index = stay.nonzero().squeeze(1)  # index: [M']
        self.keep(index)
        return index

    def keep_reused(self, reused: Tensor) -> None:
        """Keep every computed row and the reused rows whose slot is in ``reused``."""
        # reused: [R'] long slots
        stay = ~self.is_reused | torch.isin(self.slots, reused)  # stay: [M] bool
        self.keep(stay.nonzero().squeeze(1))


@dataclass(frozen=True)
class LayerRun:
    """One decoder layer with its slice of the merged KV, ready to advance a :class:`RowSet`."""

    module: Any
    k: Tensor  # [H_kv, S, D] view into the merged KV
    v: Tensor  # [H_kv, S, D]

    def run(self, rows: RowSet) -> None:
        """Advance ``rows.x`` through the layer (writing the rows' K/V)."""
        rows.x = layer_step(self.module, rows.x, rows.rows, self.k, self.v)

    def write_kv(self, rows: RowSet) -> tuple[Tensor, Tensor]:
        """The first half of :meth:`run`: write the rows' K/V only. Returns the rows' normed
        inputs (for :meth:`finish`) and their new values."""
        # -> h: [M, E]; v_rows: [H_kv, M, D]
        h = self.module.input_layernorm(rows.x)
        return h, write_kv(self.module, h, rows.rows, self.k, self.v)

    def finish(self, rows: RowSet, h: Tensor) -> None:
        """The second half of :meth:`run`, for the rows still in ``rows`` (``h``: theirs)."""
        # h: [M', E]
        rows.x = finish_rows(self.module, rows.x, h, rows.rows, self.k, self.v)[0]

    def run_probed(self, rows: RowSet, probe: Probe) -> Tensor:
        """:meth:`run`, returning the attention of the rows ``probe.rows`` per slot group."""
        # -> [P, G] float32, averaged over heads
        rows.x, mass = layer_step_probed(self.module, rows.x, rows.rows, self.k, self.v, probe)
        return mass


class RowSchedule(Protocol):
    """Runs the first layers of a recompute, choosing which reused rows go on."""

    def done(self, layer: int) -> bool:
        """True once every layer from ``layer`` on runs the remaining rows plainly."""
        ...

    def step(self, layer: int, rows: RowSet, run: LayerRun) -> None:
        """Run ``layer`` for ``rows`` (through ``run``), then drop rows from ``rows``."""
        ...


class _Plain:
    """No schedule: every row runs every layer."""

    def done(self, layer: int) -> bool:
        return True

    def step(self, layer: int, rows: RowSet, run: LayerRun) -> None:
        run.run(rows)


@torch.no_grad()
def run_rows(
    lm: LoadedModel,
    kv: SeqKV,
    ids: Tensor,
    computed: Tensor,
    reused: Tensor,
    schedule: RowSchedule | None = None,
) -> RecomputeResult:
    """Run the rows ``computed`` and ``reused`` through every layer, as ``schedule`` says.

    ``computed`` must hold the last slot, whose hidden state gives the next-token logits.
    """
    # ids: [S] long (all slots); computed, reused: [C], [R] long slot indices, disjoint
    schedule = schedule if schedule is not None else _Plain()
    slots, order = torch.cat((computed, reused)).sort()  # slots: [M]
    rows = RowSet(
        slots,
        order >= computed.numel(),
        embed(lm, ids[slots]),
        Rows.build(slots, kv.length, lm.rope),
    )
    num_layers, layer, token_layers = lm.spec.num_layers, 0, 0
    while layer < num_layers and not schedule.done(layer):
        recomputed = int(rows.is_reused.sum())  # rows dropped after the last layer still ran it
        token_layers += rows.slots.numel()
        schedule.step(layer, rows, LayerRun(lm.decoder.layers[layer], *kv.layer(layer)))
        layer += 1
    if layer == num_layers:
        return RecomputeResult(rows.x[-1], recomputed, token_layers)
    last = run_layers_to_last(lm, rows.x, rows.rows, kv, layer)  # last: [E]
    token_layers += rows.slots.numel() * (num_layers - layer)
    return RecomputeResult(last, int(rows.is_reused.sum()), token_layers)


class GradualFilter:
    """CacheBlend's schedule: keep the reused rows of highest V deviation (§4.2-4.3)."""

    def __init__(self, ratio: float, num_reused: int, num_layers: int) -> None:
        self.ratio, self.num_reused = ratio, num_reused
        self.checks = min(FIRST_CHECK_LAYER + len(GRADUAL_FILTER), num_layers)

    def done(self, layer: int) -> bool:
        return layer >= self.checks

    def step(self, layer: int, rows: RowSet, run: LayerRun) -> None:
        """Recompute every row's K/V, keep the reused rows whose values moved most, and
        finish the layer for the rows kept only (a dropped row's output is never read).
        Layers before :data:`FIRST_CHECK_LAYER` run every row and keep them all."""
        if layer < FIRST_CHECK_LAYER:
            run.run(rows)
            return
        reused_rows = rows.is_reused.nonzero().squeeze(1)  # [R'] indices into rows
        cached_v = run.v[:, rows.slots[reused_rows]].float()  # cached_v: [H_kv, R', D]
        h, v_rows = run.write_kv(rows)  # h: [M, E]; v_rows: [H_kv, M, D]
        deviation = (v_rows[:, reused_rows].float() - cached_v).norm(dim=(0, 2))  # [R']
        share = min(1.0, GRADUAL_FILTER[layer - FIRST_CHECK_LAYER] * self.ratio)
        keep = math.ceil(share * self.num_reused)
        top = deviation.topk(min(keep, reused_rows.numel())).indices  # [R''] into reused_rows
        run.finish(rows, h[rows.keep_reused_rows(reused_rows[top])])


def kv_write_share(lm: LoadedModel) -> float:
    """The share of a row's matmul work in a decoder layer that is its K and V projections:
    what a check layer spends on a row it then drops (SmolLM2: 0.0625).  Attention scores
    are left out, so a dropped row counts a little more than it costs."""
    layer = lm.decoder.layers[0]
    kv = layer.self_attn.k_proj.weight.numel() + layer.self_attn.v_proj.weight.numel()
    return kv / sum(p.numel() for p in layer.parameters() if p.dim() == 2)


def blend_share(ratio: float, num_layers: int, kv_share: float = 1.0) -> float:
    """The share of the reused tokens that, recomputed on every layer, costs what
    :func:`recompute` spends at ``ratio``: its first layers run every reused row and its
    check layers filter them down gradually.

    A check layer writes the K/V of every row it gets (``kv_share`` of a layer each) and
    finishes the rows it keeps.  ``kv_share`` 1.0 counts token-layers, every row a check
    layer writes as a whole layer (0.209 at 0.15 over 30 layers); :func:`kv_write_share`
    counts compute (0.183 for SmolLM2)."""
    if ratio <= 0 or ratio >= 1:
        return min(1.0, max(0.0, ratio))
    gradual = [min(1.0, share * ratio) for share in GRADUAL_FILTER]
    entering = [1.0] * (FIRST_CHECK_LAYER + 1) + gradual  # rows entering each layer
    checks = range(FIRST_CHECK_LAYER, FIRST_CHECK_LAYER + len(GRADUAL_FILTER))

    def cost(layer: int) -> float:
        rows = entering[min(layer, len(entering) - 1)]
        if layer not in checks:
            return rows
        return kv_share * rows + (1 - kv_share) * entering[layer + 1]  # kept: the next's

    return sum(cost(layer) for layer in range(num_layers)) / num_layers


@torch.no_grad()
def recompute(
    lm: LoadedModel, kv: SeqKV, ids: Tensor, computed: Tensor, reused: Tensor, ratio: float
) -> RecomputeResult:
    """Run the rows ``computed`` in full and selectively recompute the ``reused`` rows.

    ``ratio`` 0 keeps every reused KV as it is (full reuse); 1 recomputes them all
    on every layer, which equals a full prefill.  ``computed`` must hold the last
    slot, whose hidden state gives the next-token logits.
    """
    if ratio <= 0 or reused.numel() == 0:
        return run_rows(lm, kv, ids, computed, reused[:0])
    if ratio >= 1:
        return run_rows(lm, kv, ids, computed, reused)
    schedule = GradualFilter(ratio, reused.numel(), lm.spec.num_layers)
    return run_rows(lm, kv, ids, computed, reused, schedule)


@torch.no_grad()
def recompute_rows(
    lm: LoadedModel,
    kv: SeqKV,
    ids: Tensor,
    computed: Tensor,
    chosen: Tensor,
    schedule: RowSchedule | None = None,
) -> RecomputeResult:
    """Run the rows ``computed`` and recompute the reused rows ``chosen`` (Cache-Craft §3.2).

    Every other reused slot keeps its cached KV.  ``schedule`` (e.g. Algorithm 1's
    focused chunks) may read attention and drop chosen rows on the way.
    """
    # computed, chosen: [C], [N] long slot indices, disjoint
    return run_rows(lm, kv, ids, computed, chosen, schedule)
