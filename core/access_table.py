"""CRAFT's Chunk-Access Table (CA-Table): access counts over a sliding window.

CRAFT §4.1: each request increments the count of every chunk it retrieved; the
table covers only the last ``window`` requests (default 1000, CRAFT §6.2.4), so a
chunk leaves the table when the last request that retrieved it leaves the window.
Memory is bounded by ``window x chunks per request``, never by history.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Iterable, Sequence

DEFAULT_WINDOW = 1000


class AccessTable:
    """Per-chunk access counts over the last ``window`` requests."""

    def __init__(self, window: int = DEFAULT_WINDOW) -> None:
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        self.window = window
        self._requests: deque[tuple[str, ...]] = deque()
        self._counts: dict[str, int] = {}
        # Sequence number of a chunk's first access while it is in the window: the
        # tie-breaker that makes equal sets sort into equal orders.
        self._first_seen: dict[str, int] = {}
        self._sequence = itertools.count()

    def __len__(self) -> int:
        return len(self._counts)

    def __contains__(self, chunk_id: object) -> bool:
        return chunk_id in self._counts

    @property
    def num_requests(self) -> int:
        return len(self._requests)

    def count(self, chunk_id: str) -> int:
        """Accesses of ``chunk_id`` within the window (0 if absent)."""
        return self._counts.get(chunk_id, 0)

    def record(self, chunk_ids: Iterable[str]) -> None:
        """Count one request that retrieved ``chunk_ids`` (duplicates count once)."""
        request = tuple(dict.fromkeys(chunk_ids))
        # New chunks are numbered in id order, not request order: otherwise the
        # order a retriever returned one set in would decide its ties for good.
        # Sorted before anything changes: ids that cannot be sorted (int beside str)
        # raise with the table as it was, not with a request it never counted.
        new = sorted(cid for cid in request if cid not in self._counts)
        self._requests.append(request)
        for cid in new:
            self._counts[cid] = 0
            self._first_seen[cid] = next(self._sequence)
        for cid in request:
            self._counts[cid] += 1
        if len(self._requests) > self.window:
            self._forget(self._requests.popleft())

    def _forget(self, request: tuple[str, ...]) -> None:
        for cid in request:
            remaining = self._counts[cid] - 1
            if remaining:
                self._counts[cid] = remaining
            else:
                del self._counts[cid]
                del self._first_seen[cid]

    def sort_key(self, chunk_id: str) -> tuple[int, int, str]:
        """Key ordering chunks by descending count, then first access, then id."""
        return (
            -self._counts.get(chunk_id, 0),
            self._first_seen.get(chunk_id, -1),
            chunk_id,
        )

    def order_by_frequency(self, chunk_ids: Sequence[str]) -> list[str]:
        """CRAFT §4.2: ``sort(C, -freq(c))`` with ties broken the same way every time."""
        return sorted(dict.fromkeys(chunk_ids), key=self.sort_key)
