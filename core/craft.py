"""Cache-Craft's reusability scores for chunk-KV variants (Cache-Craft §3.1-3.3).

Plain Python over the small metadata a variant carries (:class:`CraftMeta`, JSON-able), so a
store can keep it beside the KV and the engine can score every stored variant of a chunk
before loading any of them:

- CCI, how much the chunk's KV leans on what came before it (Eq. 9-11), and each token's
  attention to that context (Eq. 14's score), measured when the chunk was computed fresh
  (:mod:`chunkcache.core.craft_probe`);
- beta, gamma, beta': how much of that context a request keeps, and in which order (Eq. 6-8);
- CFO = alpha * CCI * (1 - beta'), the share of the chunk to recompute (Eq. 12), and the top-N
  tokens to recompute (Eq. 14);
- Algorithm 1's split of chunks into focused and unfocused from the question's attention.

The context of a variant is every segment before it (chunks, and text such as the system
prompt or the question), not only chunks: a chunk computed after the system prompt alone and
reused after other chunks would otherwise keep beta = 1 and CFO = 0 (see :func:`prefix_overlap`).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

# f_r += 1 / CFO (§3.3) with CFO floored here, so a perfect match adds a finite 100.
MIN_CFO_FOR_REUSE_COUNT = 0.01


@dataclass(frozen=True)
class CraftConfig:
    """Cache-Craft's knobs.

    ``alpha`` scales CFO (Eq. 12): 0 reuses every chunk as it is, a huge value recomputes all
    of any chunk whose context changed; the paper fits it on validation data (Eq. 13).
    Metadata is read on every ``meta_layer_stride``-th layer (1: every layer, Eq. 10 exactly).
    The first ``sink_tokens`` positions are left out of every attention mass: they draw a
    large share of every token's attention whatever their content (attention sinks, Xiao et
    al. 2023), which would make every chunk look contextualised by its prefix.
    ``focus_window`` is Algorithm 1's w (the paper's tuning is not given; 3 is a start):
    once the question's focused chunks hold for w layers, the other chunks' rows stop
    (§3.2.2).  Off (None) by default: on SmolLM2 it found its set within the first few
    layers and multiplied the teacher-forced KL against full prefill several times over
    (docs/engine.md).
    """

    alpha: float = 1.0
    meta_layer_stride: int = 4
    sink_tokens: int = 4
    focus_window: int | None = None

    def __post_init__(self) -> None:
        if self.alpha < 0 or self.meta_layer_stride < 1 or self.sink_tokens < 0:
            raise ValueError(f"invalid Cache-Craft settings: {self}")
        if self.focus_window is not None and self.focus_window < 1:
            raise ValueError(f"focus_window must be positive or None, got {self.focus_window}")

    def meta_layers(self, num_layers: int) -> range:
        """The layers metadata is read on: the middle one of each ``stride`` layers."""
        stride = self.meta_layer_stride
        return range(min(stride // 2, num_layers - 1), num_layers, stride)


@dataclass(frozen=True)
class CraftMeta:
    """What Cache-Craft keeps about a variant, measured when its chunk was computed fresh.

    Attention masses are layer averages over the sampled layers, attention sinks left out.
    """

    cci: float  # Eq. 11, in (0.5, 1)
    token_inter: tuple[float, ...]  # per chunk token: attention to everything before the chunk
    context_ids: tuple[str, ...]  # the segments before the chunk, in order
    context_inter: tuple[float, ...]  # inter(C, C_j) of Eq. 3 for each of them
    context_tokens: tuple[int, ...]  # their lengths, attention-sink positions left out

    def to_json(self) -> dict[str, Any]:
        return {
            "cci": self.cci,
            "token_inter": list(self.token_inter),
            "context_ids": list(self.context_ids),
            "context_inter": list(self.context_inter),
            "context_tokens": list(self.context_tokens),
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> CraftMeta:
        return cls(
            float(data["cci"]),
            tuple(float(x) for x in data["token_inter"]),
            tuple(str(x) for x in data["context_ids"]),
            tuple(float(x) for x in data["context_inter"]),
            tuple(int(x) for x in data["context_tokens"]),
        )


def cache_context_impact(a_bar: float, b_bar: float) -> float:
    """CCI = sigmoid(a_bar / b_bar) (Eq. 11).

    ``a_bar`` and ``b_bar`` are the layer-averaged normalised inter and intra attention of
    Eq. 9-10.  No intra attention at all counts as fully contextualised.
    """
    if b_bar <= 0:
        return 1.0
    return 1.0 / (1.0 + math.exp(-a_bar / b_bar))


def _tagged(ids: Iterable[str]) -> list[tuple[str, int]]:
    """Ids with their occurrence number, so a segment present twice (a repeated separator, a
    chunk quoted twice) matches occurrence by occurrence."""
    seen: Counter[str] = Counter()
    tagged = []
    for segment_id in ids:
        tagged.append((segment_id, seen[segment_id]))
        seen[segment_id] += 1
    return tagged


def prefix_overlap(
    meta: CraftMeta, context_ids: Sequence[str], context_tokens: Sequence[int]
) -> float:
    """beta (Eq. 6): the share of the chunk's old context attention that the new context keeps.

    Eq. 6 sums over the old context only, so a request that adds segments the variant never
    saw would keep beta = 1.  Here each such segment also enters the denominator with the
    attention the chunk would give it at the old context's mean mass per token (its length
    times ``sum inter / sum tokens`` of the old context); with the same segments in old and new
    context this is Eq. 6 exactly.  A variant that saw no context (beyond attention sinks)
    has beta = 1 in a context equally empty, else 0.
    """
    new = dict(zip(_tagged(context_ids), context_tokens, strict=True))
    old = list(zip(_tagged(meta.context_ids), meta.context_inter, meta.context_tokens, strict=True))
    old_keys = {key for key, _, _ in old}
    old_mass = sum(inter for _, inter, _ in old)
    unseen_tokens = sum(tokens for key, tokens in new.items() if key not in old_keys)
    if old_mass <= 0:
        return 1.0 if unseen_tokens == 0 else 0.0
    shared = sum(inter for key, inter, _ in old if key in new)
    density = old_mass / max(1, sum(tokens for _, _, tokens in old))
    return shared / (old_mass + density * unseen_tokens)


def order_penalty(old_ids: Sequence[str], new_ids: Sequence[str]) -> float:
    """gamma (Eq. 7): the normalised Kendall tau distance between the segments the two contexts
    share, each in its own context's order; 0 with fewer than two shared."""
    new_rank = {key: rank for rank, key in enumerate(_tagged(new_ids))}
    ranks = [new_rank[key] for key in _tagged(old_ids) if key in new_rank]  # in old order
    m = len(ranks)
    if m < 2:
        return 0.0
    discordant = sum(ranks[i] > ranks[j] for i in range(m) for j in range(i + 1, m))
    return discordant / (m * (m - 1) / 2)


def adjusted_overlap(
    meta: CraftMeta, context_ids: Sequence[str], context_tokens: Sequence[int]
) -> float:
    """beta' = beta * (1 - gamma) (Eq. 8)."""
    beta = prefix_overlap(meta, context_ids, context_tokens)
    return beta * (1.0 - order_penalty(meta.context_ids, context_ids))


def fix_overhead(
    meta: CraftMeta | None, context_ids: Sequence[str], context_tokens: Sequence[int], alpha: float
) -> float:
    """CFO = alpha * CCI * (1 - beta') (Eq. 12) in [0, 1]: the share of the chunk to recompute.

    A variant without metadata (stored by another policy) scores as the worst case, CCI = 1
    and beta' = 0, so CFO = min(1, alpha).
    """
    if meta is None:
        return min(1.0, alpha)
    cfo = alpha * meta.cci * (1.0 - adjusted_overlap(meta, context_ids, context_tokens))
    return min(1.0, max(0.0, cfo))


def cheapest_variant(
    metas: Sequence[CraftMeta | None],
    context_ids: Sequence[str],
    context_tokens: Sequence[int],
    alpha: float,
) -> tuple[int, float]:
    """The variant with the lowest CFO (§3.3), the first one on a tie, and that CFO."""
    cfos = [fix_overhead(meta, context_ids, context_tokens, alpha) for meta in metas]
    best = min(range(len(cfos)), key=cfos.__getitem__)
    return best, cfos[best]


def fit_budget(wants: Sequence[int], budget: int) -> list[int]:
    """Scale per-chunk token counts down to ``budget`` in all, keeping their proportions
    (largest remainders get the leftover tokens); counts within budget stay as they are."""
    total = sum(wants)
    if total <= budget:
        return list(wants)
    shares = [want * budget / total for want in wants]
    counts = [math.floor(share) for share in shares]
    by_remainder = sorted(range(len(wants)), key=lambda i: (counts[i] - shares[i], i))
    for i in by_remainder[: budget - sum(counts)]:
        counts[i] += 1
    return counts


def num_fix_tokens(cfo: float, num_tokens: int) -> int:
    """N = ceil(CFO * |C|) (§3.2.1), float noise (0.1 * 30 = 3.0000000000000004) rounded off."""
    return min(num_tokens, math.ceil(round(cfo * num_tokens, 9)))


def top_tokens(meta: CraftMeta | None, num_tokens: int, n: int) -> list[int]:
    """The ``n`` most contextualised tokens of the chunk, by attention to its context (Eq. 14);
    offsets into the chunk, most contextualised first.  Without metadata, the first tokens,
    which have the fewest of their own chunk's tokens to attend to."""
    if meta is None or len(meta.token_inter) != num_tokens:
        return list(range(min(n, num_tokens)))
    order = sorted(range(num_tokens), key=lambda t: (-meta.token_inter[t], t))
    return order[:n]


def focused_chunks(scores: Sequence[float]) -> frozenset[int]:
    """The chunks the question focuses on, from their cumulated attention (Algorithm 1, 4-9).

    Sorted descending, the gaps between neighbours become a distribution ``p``; the cut goes
    where the cumulated entropy of ``p`` jumps most, and the chunks above it are focused.
    With fewer than three chunks, or no gap at all, every chunk is focused.
    """
    k = len(scores)
    everything = frozenset(range(k))
    if k < 3:
        return everything
    order = sorted(range(k), key=lambda i: (-scores[i], i))
    ranked = [scores[i] for i in order]
    diff = [ranked[i] - ranked[i + 1] for i in range(k - 1)]  # k - 1 gaps, >= 0
    total = sum(diff)
    if total <= 0:
        return everything
    # h_{i+1} - h_i = -p_{i+1} log p_{i+1}; Algorithm 1 indexes from 1, i* in [1, k - 2]
    gains = [-p * math.log(p) if p > 0 else 0.0 for p in (d / total for d in diff)]
    cut = 1 + max(range(k - 2), key=lambda j: (gains[j + 1], -j))
    return frozenset(order[:cut])
