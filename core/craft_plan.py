"""The ``cachecraft`` policy for one request (Cache-Craft §3.2-3.3, §3.4.1).

:func:`choose_variant` picks, among a chunk's stored variants, the one of lowest CFO in this
request's context, and :func:`count_reuses` counts f_r += 1/CFO on it once the request ran
(a prefill that fails, or runs again after a corrupt entry, counts no reuse it did not
make).  :func:`craft_recompute` then recomputes, on
every layer, the top ``ceil(CFO * |C|)`` tokens of each placed chunk by their stored
attention to the chunk's old context (Eq. 14), reads the metadata of the chunks computed
fresh (§3.1), and stops the rows of chunks the question does not focus on (Algorithm 1).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from chunkcache.core.craft import (
    CraftConfig,
    CraftMeta,
    cheapest_variant,
    fit_budget,
    num_fix_tokens,
    top_tokens,
)
from chunkcache.core.craft_probe import (
    CraftSchedule,
    FocusProbe,
    MetaProbe,
    Span,
    tokens_past_sinks,
)
from chunkcache.core.kv_store import KVVariant
from chunkcache.core.models import LoadedModel
from chunkcache.core.recompute import (
    RecomputeResult,
    blend_share,
    kv_write_share,
    recompute_rows,
)
from chunkcache.kernels.kv import SeqKV


@dataclass(frozen=True)
class PlacedChunk:
    """A chunk whose stored variant was moved into the request's KV."""

    span: Span
    variant: KVVariant
    cfo: float  # Cache-Craft's fix overhead; 0 for the other policies
    slots: list[int]  # the reused slots: the chunk's, but the prompt's last slot


@dataclass(frozen=True)
class CraftOutcome:
    """What :func:`craft_recompute` ran, and the metadata of the chunks it computed fresh."""

    result: RecomputeResult
    metas: dict[int, CraftMeta]  # by the chunk's start slot
    focus_layer: int | None  # Algorithm 1's L*, when the focused chunks were found


def choose_variant(
    variants: Sequence[KVVariant], context: Sequence[Span], config: CraftConfig
) -> tuple[KVVariant, float]:
    """The variant of lowest CFO after the segments ``context`` (§3.3), and its CFO."""
    context_ids = [span.segment_id for span in context]
    context_tokens = [tokens_past_sinks(span, config.sink_tokens) for span in context]
    metas = [variant.meta for variant in variants]
    best, cfo = cheapest_variant(metas, context_ids, context_tokens, config.alpha)
    return variants[best], cfo


def count_reuses(placed: Sequence[PlacedChunk]) -> None:
    """Count f_r += 1/CFO (§3.3) on each placed variant, once the prefill placing it ran."""
    for p in placed:
        p.variant.reuse.record(p.cfo)


def fix_slots(placed: Sequence[PlacedChunk], ratio: float, lm: LoadedModel) -> list[int]:
    """The reused slots to recompute: each chunk's top ``ceil(CFO * |C|)`` tokens (Eq. 14),
    all counts shrunk in proportion when they exceed the budget: the compute ``cacheblend``
    spends at ``ratio`` (:func:`blend_share` with :func:`kv_write_share`), as tokens run
    on every layer."""
    num_reused = sum(len(p.slots) for p in placed)
    wants = [num_fix_tokens(p.cfo, p.span.num_tokens) for p in placed]
    share = blend_share(ratio, lm.spec.num_layers, kv_write_share(lm))
    budget = math.floor(round(share * num_reused, 9))
    chosen: list[int] = []
    for p, count in zip(placed, fit_budget(wants, budget), strict=True):
        reused = set(p.slots)
        ranked = top_tokens(p.variant.meta, p.span.num_tokens, p.span.num_tokens)
        chosen += [p.span.start + t for t in ranked if p.span.start + t in reused][:count]
    return sorted(chosen)


def craft_recompute(
    lm: LoadedModel,
    config: CraftConfig,
    spans: Sequence[Span],
    chunks: Sequence[int],
    fresh: Sequence[int],
    placed: Sequence[PlacedChunk],
    computed: Tensor,
    ids: Tensor,
    kv: SeqKV,
    ratio: float,
) -> CraftOutcome:
    """Run the request's rows: ``computed`` in full, the placed chunks' fix tokens.

    ``spans`` are every segment of the prompt; ``chunks`` index its chunks, ``fresh`` those
    computed fresh (their metadata is read); ``ratio`` caps the recomputed share.
    """
    # computed: [C] long slots; ids: [S] long
    chosen = fix_slots(placed, ratio, lm)
    chosen_slots = torch.tensor(chosen, dtype=torch.long, device=computed.device)  # [N]
    layers = config.meta_layers(lm.spec.num_layers)
    meta = MetaProbe(fresh, spans, layers, config.sink_tokens) if fresh else None
    focus = None
    if config.focus_window is not None and chosen and len(chunks) >= 3:
        question = computed[computed >= spans[chunks[-1]].end]  # the rows after the last chunk
        question = question if question.numel() else computed[-1:]
        focus = FocusProbe(question, chunks, config.focus_window)
    schedule = CraftSchedule(meta, focus, spans, config.sink_tokens, computed.device)
    result = recompute_rows(lm, kv, ids, computed, chosen_slots, schedule)
    metas = meta.metas() if meta is not None else []
    return CraftOutcome(
        result,
        {spans[c].start: m for c, m in zip(fresh, metas, strict=True)},
        focus.cutoff_layer if focus is not None else None,
    )
