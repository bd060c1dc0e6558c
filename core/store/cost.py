"""Prefill cost estimate T(cached, new) for PGDSF (RAGCache §5.1, Algorithm 1 lines 6-7).

RAGCache profiles prefill time over a grid of cached and non-cached token counts offline and
estimates a request's cost by bilinear interpolation between the four surrounding grid
points.  :class:`PrefillCostModel` does the same from measured ``(cached, new, seconds)``
records: on the grid where all four corners were measured it interpolates bilinearly;
elsewhere it falls back to the mean seconds per non-cached token times ``new``.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable


class PrefillCostModel:
    """Measured prefill seconds by (cached tokens, non-cached tokens), interpolated."""

    def __init__(self, records: Iterable[tuple[int, int, float]] = ()) -> None:
        self._sums: dict[tuple[int, int], tuple[float, int]] = {}
        self._seconds = 0.0
        self._new_tokens = 0
        for cached, new, seconds in records:
            self.record(cached, new, seconds)

    def __len__(self) -> int:
        return len(self._sums)

    def record(self, cached: int, new: int, seconds: float) -> None:
        """One measured prefill: ``new`` tokens computed after ``cached`` reused ones."""
        if new <= 0 or seconds < 0:
            return
        total, count = self._sums.get((cached, new), (0.0, 0))
        self._sums[(cached, new)] = (total + seconds, count + 1)
        self._seconds += seconds
        self._new_tokens += new

    def _at(self, cached: int, new: int) -> float | None:
        found = self._sums.get((cached, new))
        return found[0] / found[1] if found else None

    def estimate(self, cached: int, new: int) -> float:
        """T(cached, new) in seconds; 0 before any record."""
        if new <= 0 or not self._sums:
            return 0.0
        alphas = sorted({a for a, _ in self._sums})
        betas = sorted({b for _, b in self._sums})
        a_lo, a_hi = _bracket(alphas, cached)
        b_lo, b_hi = _bracket(betas, new)
        corners = [self._at(a, b) for a in (a_lo, a_hi) for b in (b_lo, b_hi)]
        if any(c is None for c in corners):
            return new * self._seconds / self._new_tokens
        t_ll, t_lh, t_hl, t_hh = (float(c) for c in corners if c is not None)
        x = 0.0 if a_hi == a_lo else (min(max(cached, a_lo), a_hi) - a_lo) / (a_hi - a_lo)
        y = 0.0 if b_hi == b_lo else (min(max(new, b_lo), b_hi) - b_lo) / (b_hi - b_lo)
        low = t_ll * (1 - y) + t_lh * y
        high = t_hl * (1 - y) + t_hh * y
        return low * (1 - x) + high * x

    def per_token(self, cached: int, new: int) -> float:
        """Cost_i / NewSize_i of Formula 4: estimated seconds per non-cached token."""
        return self.estimate(cached, new) / new if new > 0 else 0.0


def _bracket(grid: list[int], value: int) -> tuple[int, int]:
    """The grid points around ``value`` (clamped to the grid's ends)."""
    i = bisect.bisect_left(grid, value)
    if i < len(grid) and grid[i] == value:
        return value, value
    if i == 0:
        return grid[0], grid[0]
    if i == len(grid):
        return grid[-1], grid[-1]
    return grid[i - 1], grid[i]
