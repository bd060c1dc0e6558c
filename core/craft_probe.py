"""What Cache-Craft reads from attention while a prompt's rows run (Cache-Craft §3.1, §3.2.2).

Attention is read per prompt segment: every slot belongs to its segment's group, and the
first ``sinks`` slots to a group of their own that nothing counts (attention sinks, see
:class:`CraftConfig`).  Layer steps return, for the probed rows only and only on the layers
that need it, their head-averaged attention summed per group
(:func:`chunkcache.kernels.layer.layer_step_probed`).

- :class:`MetaProbe`: for chunks computed fresh, on a few sampled layers, each token's
  attention to everything before its chunk (Eq. 14's score) and the chunk's attention to
  each segment before it and to itself (Eq. 3-4); at the end a :class:`CraftMeta` per
  chunk with CCI (Eq. 9-11).
- :class:`FocusProbe`: the question's attention to each chunk, cumulated layer by layer,
  until Algorithm 1's focused set holds for ``w`` layers.
- :class:`CraftSchedule`: the :class:`RowSchedule` that runs both and, once the focused set
  is known, stops recomputing the rows of the other chunks (early termination, §3.2.2).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from chunkcache.core.craft import CraftMeta, cache_context_impact, focused_chunks
from chunkcache.core.recompute import LayerRun, RowSet
from chunkcache.kernels.layer import Probe


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


def segment_groups(spans: Sequence[Span], sinks: int, device: torch.device) -> Tensor:
    """Each slot's segment index; the first ``sinks`` slots get group ``len(spans)``."""
    lengths = torch.tensor([s.num_tokens for s in spans], device=device)
    groups = torch.repeat_interleave(torch.arange(len(spans), device=device), lengths)  # [S]
    groups[:sinks] = len(spans)
    return groups


class MetaProbe:
    """Accumulates the metadata of chunks computed fresh, one sampled layer at a time."""

    def __init__(self, chunks: Sequence[int], spans: Sequence[Span], layers: range, sinks: int):
        """``chunks`` index ``spans`` (every segment of the prompt, in order)."""
        self.chunks, self.spans, self.layers, self.sinks = list(chunks), list(spans), layers, sinks
        self.slots = span_slots([spans[c] for c in self.chunks], torch.device("cpu"))  # [P]
        self._a, self._b = [0.0] * len(self.chunks), [0.0] * len(self.chunks)
        self._token: list[Tensor] = []  # per chunk: [n] float64
        self._inter: list[Tensor] = []  # per chunk: [c] float64
        self._count = 0

    def add(self, mass: Tensor) -> None:
        """Add one layer's attention of the chunks' rows per segment group."""
        # mass: [P, G] float32, rows = self.slots in order, G = len(spans) + 1 (sinks last)
        row = 0
        for i, c in enumerate(self.chunks):
            n = self.spans[c].num_tokens
            m = mass[row : row + n].double().cpu()  # m: [n, G]
            row += n
            token = m[:, :c].sum(dim=1)  # token: [n], Eq. 14's score on this layer
            inter = m[:, :c].sum(dim=0)  # inter: [c], Eq. 3 for each segment before
            lengths = torch.tensor(
                [tokens_past_sinks(s, self.sinks) for s in self.spans[:c]], dtype=torch.float64
            )  # lengths: [c]
            seen = lengths > 0
            self._a[i] += float((inter[seen] / (n * lengths[seen])).sum())  # Eq. 9, a_l
            self._b[i] += float(m[:, c].sum()) / n**2  # Eq. 9, b_l (intra, Eq. 4)
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
        for i, c in enumerate(self.chunks):
            context = self.spans[:c]
            metas.append(
                CraftMeta(
                    cache_context_impact(self._a[i] / count, self._b[i] / count),  # Eq. 11
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

    def __init__(self, question: Tensor, chunks: Sequence[int], window: int) -> None:
        # question: [U] long slots of the question rows; chunks: segment indices
        self.slots, self.chunks, self.window = question, list(chunks), window
        self.focused: frozenset[int] | None = None  # F*, indices into chunks, once known
        self.cutoff_layer: int | None = None  # L*
        self._cumulated = torch.zeros(len(self.chunks), dtype=torch.float64)
        self._history: list[frozenset[int]] = []

    def add(self, layer: int, mass: Tensor) -> None:
        """Add one layer's attention of the question rows per segment group."""
        # mass: [U, G] float32
        self._cumulated += mass[:, self.chunks].double().sum(dim=0).cpu()  # Eq. 15
        self._history.append(focused_chunks(self._cumulated.tolist()))
        recent = self._history[-self.window :]
        if len(recent) == self.window and all(f == recent[0] for f in recent):
            self.focused, self.cutoff_layer = recent[0], layer


class CraftSchedule:
    """Runs the layers where Cache-Craft reads attention; drops unfocused chunks' rows."""

    def __init__(
        self,
        meta: MetaProbe | None,
        focus: FocusProbe | None,
        spans: Sequence[Span],
        sinks: int,
        device: torch.device,
    ) -> None:
        self.meta, self.focus, self.spans = meta, focus, list(spans)
        self.groups = segment_groups(spans, sinks, device)  # [S]
        self._meta_last = meta.layers[-1] if meta is not None and len(meta.layers) else -1

    def done(self, layer: int) -> bool:
        return layer > self._meta_last and (self.focus is None or self.focus.focused is not None)

    def step(self, layer: int, rows: RowSet, run: LayerRun) -> None:
        meta = self.meta if self.meta is not None and layer in self.meta.layers else None
        focus = self.focus if self.focus is not None and self.focus.focused is None else None
        parts = ([meta.slots] if meta is not None else []) + ([focus.slots] if focus else [])
        if not parts:
            run.run(rows)
            return
        slots = torch.cat([p.to(rows.slots.device) for p in parts])  # [P]
        index = torch.searchsorted(rows.slots, slots)  # [P] indices into rows
        assert torch.equal(rows.slots[index], slots), "probed rows must be running"
        mass = run.run_probed(rows, Probe(index, self.groups, len(self.spans) + 1))  # [P, G]
        if meta is not None:
            meta.add(mass[: meta.slots.numel()])
            mass = mass[meta.slots.numel() :]
        if focus is not None:
            focus.add(layer, mass)
            if focus.focused is not None:
                kept = [self.spans[focus.chunks[i]] for i in sorted(focus.focused)]
                rows.keep_reused(span_slots(kept, rows.slots.device))
