"""What Cache-Craft reads from attention while a prompt's rows run (Cache-Craft §3.1, §3.2.2).

- :class:`MetaProbe`: for chunks computed fresh, on a few sampled layers, each token's
  attention to everything before the chunk (Eq. 14's score) and to its own chunk, and the
  chunk's attention to each segment before it (Eq. 3-4); at the end, a :class:`CraftMeta`
  per chunk with CCI (Eq. 9-11).
- :class:`FocusProbe`: the question's attention to each chunk, cumulated layer by layer,
  until Algorithm 1's focused set holds for ``w`` layers.
- :class:`CraftSchedule`: the :class:`RowSchedule` that runs both and, once the focused set
  is known, stops recomputing the rows of the other chunks (early termination, §3.2.2).

Probabilities come from :func:`chunkcache.kernels.layer.layer_step_probed`, for these rows
only and only on the layers that need them; attention-sink positions are zeroed first.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from chunkcache.core.craft import CraftMeta, cache_context_impact, focused_chunks
from chunkcache.core.recompute import LayerRun, RowSet


@dataclass(frozen=True)
class Span:
    """A prompt segment's slots ``start ... end - 1``."""

    segment_id: str
    start: int
    end: int

    @property
    def num_tokens(self) -> int:
        return self.end - self.start


def tokens_past_sinks(span: Span, sinks: int) -> int:
    """A segment's length, the first ``sinks`` positions of the prompt left out."""
    return max(0, span.end - max(span.start, sinks))


def span_slots(spans: Sequence[Span], device: torch.device) -> Tensor:
    """Every slot of ``spans``, in their order."""
    ranges = [torch.arange(s.start, s.end, device=device) for s in spans]
    return torch.cat(ranges) if ranges else torch.zeros(0, dtype=torch.long, device=device)


def _span_sums(cumulated: Tensor, spans: Sequence[Span]) -> Tensor:
    """Sums over each span of the values whose cumulative sum (with a leading 0) is given."""
    # cumulated: [S + 1] -> [len(spans)]
    starts = torch.tensor([s.start for s in spans], dtype=torch.long, device=cumulated.device)
    ends = torch.tensor([s.end for s in spans], dtype=torch.long, device=cumulated.device)
    return cumulated[ends] - cumulated[starts]


class MetaProbe:
    """Accumulates the metadata of chunks computed fresh, one sampled layer at a time."""

    def __init__(
        self, chunks: Sequence[Span], segments: Sequence[Span], layers: range, sinks: int
    ) -> None:
        """``chunks`` are the chunks to measure; ``segments`` every segment of the prompt."""
        self.chunks, self.layers, self.sinks = list(chunks), layers, sinks
        self.contexts = [[s for s in segments if s.end <= c.start] for c in self.chunks]
        self.num_slots = sum(c.num_tokens for c in self.chunks)
        self._a, self._b = [0.0] * len(self.chunks), [0.0] * len(self.chunks)
        self._token: list[Tensor] = []  # per chunk: [n] float64
        self._inter: list[Tensor] = []  # per chunk: [J] float64
        self._count = 0

    def add(self, probs: Tensor) -> None:
        """Add one layer's probabilities of every chunk row (sink columns already zeroed)."""
        # probs: [P, S] float32, rows = the chunks' slots in order, P = self.num_slots
        row = 0
        for i, (chunk, context) in enumerate(zip(self.chunks, self.contexts, strict=True)):
            n = chunk.num_tokens
            p = probs[row : row + n].double()  # p: [n, S]
            row += n
            before = p[:, : chunk.start]  # before: [n, start]
            token = before.sum(dim=1)  # token: [n], Eq. 14's score on this layer
            cumulated = F.pad(before.sum(dim=0).cumsum(0), (1, 0))  # [start + 1]
            inter = _span_sums(cumulated, context)  # inter: [J], Eq. 3 per context segment
            lengths = torch.tensor(
                [tokens_past_sinks(s, self.sinks) for s in context],
                dtype=torch.float64,
                device=inter.device,
            )  # lengths: [J]
            seen = lengths > 0
            self._a[i] += float((inter[seen] / (n * lengths[seen])).sum())  # Eq. 9, a_l
            self._b[i] += float(p[:, chunk.start : chunk.end].sum()) / n**2  # Eq. 9, b_l
            if self._count == 0:
                self._token.append(token)
                self._inter.append(inter)
            else:
                self._token[i] += token
                self._inter[i] += inter
        self._count += 1

    def metas(self) -> list[CraftMeta]:
        """Each chunk's metadata, averaged over the layers added (Eq. 10)."""
        if self._count == 0:
            return []
        count, metas = self._count, []
        for i, context in enumerate(self.contexts):
            cci = cache_context_impact(self._a[i] / count, self._b[i] / count)  # Eq. 11
            metas.append(
                CraftMeta(
                    cci,
                    tuple((self._token[i] / count).tolist()),
                    tuple(s.segment_id for s in context),
                    tuple((self._inter[i] / count).tolist()),
                    tuple(tokens_past_sinks(s, self.sinks) for s in context),
                )
            )
        return metas


class FocusProbe:
    """Algorithm 1: the question's cumulated attention to each chunk, until the focused set
    of chunks has stayed the same for ``window`` layers."""

    def __init__(self, question: Tensor, chunks: Sequence[Span], window: int) -> None:
        # question: [U] long slots of the question rows
        self.slots, self.chunks, self.window = question, list(chunks), window
        self.focused: frozenset[int] | None = None  # F*, indices into chunks, once known
        self.cutoff_layer: int | None = None  # L*
        self._cumulated = torch.zeros(len(self.chunks), dtype=torch.float64)
        self._history: list[frozenset[int]] = []

    def add(self, layer: int, probs: Tensor) -> None:
        """Add one layer's probabilities of the question rows (sink columns zeroed)."""
        # probs: [U, S] float32
        cumulated = F.pad(probs.double().sum(dim=0).cumsum(0), (1, 0))  # [S + 1]
        self._cumulated += _span_sums(cumulated, self.chunks).cpu()  # Eq. 15
        self._history.append(focused_chunks(self._cumulated.tolist()))
        recent = self._history[-self.window :]
        if len(recent) == self.window and all(f == recent[0] for f in recent):
            self.focused, self.cutoff_layer = recent[0], layer


class CraftSchedule:
    """Runs the layers where Cache-Craft reads attention; drops unfocused chunks' rows."""

    def __init__(self, meta: MetaProbe | None, focus: FocusProbe | None, sinks: int) -> None:
        self.meta, self.focus, self.sinks = meta, focus, sinks
        device = focus.slots.device if focus is not None else torch.device("cpu")
        self._meta_slots = span_slots(meta.chunks, device) if meta is not None else None
        self._meta_last = meta.layers[-1] if meta is not None and len(meta.layers) else -1

    def done(self, layer: int) -> bool:
        return layer > self._meta_last and (self.focus is None or self.focus.focused is not None)

    def step(self, layer: int, rows: RowSet, run: LayerRun) -> None:
        wants_meta = self.meta is not None and layer in self.meta.layers
        focus = self.focus if self.focus is not None and self.focus.focused is None else None
        parts = [self._meta_slots] if wants_meta and self._meta_slots is not None else []
        parts += [focus.slots] if focus is not None else []
        if not parts:
            run.run(rows)
            return
        slots = torch.cat([p.to(rows.slots.device) for p in parts])  # [P]
        probe = torch.searchsorted(rows.slots, slots)  # [P] indices into rows
        assert torch.equal(rows.slots[probe], slots), "probed rows must be running"
        probs = run.run_probed(rows, probe)  # probs: [P, S]
        probs[:, : self.sinks] = 0  # attention sinks (CraftConfig)
        if wants_meta and self.meta is not None:
            self.meta.add(probs[: self.meta.num_slots])
            probs = probs[self.meta.num_slots :]
        if focus is not None:
            focus.add(layer, probs)
            if focus.focused is not None:
                kept = [focus.chunks[i] for i in sorted(focus.focused)]
                rows.keep_reused(span_slots(kept, rows.slots.device))
