"""CRAFT §3.1 reuse metrics over a sequence of requests (each a list of chunk ids).

Prefix = mean over requests i >= 2 of  max_{j<i} LCP(R_i, R_j) / k
Total  = mean over requests i >= 2 of  max_{j<i} |R_i ∩ R_j| / k

``k`` is each request's own length (the paper's fixed k when all are equal).
Both run in time linear in the total number of chunk occurrences (times the
number of earlier requests sharing a chunk, for Total).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence


class PrefixTracker:
    """Longest common chunk-prefix of each new request with any earlier one (a trie)."""

    def __init__(self) -> None:
        self._trie: dict[str, dict] = {}

    def add(self, request: Sequence[str]) -> int:
        """Record ``request``; return its LCP length with the best earlier request."""
        node = self._trie
        matched = 0
        for cid in request:
            if cid not in node:
                break
            node = node[cid]
            matched += 1
        node = self._trie
        for cid in request:
            node = node.setdefault(cid, {})
        return matched


def prefix_metric(requests: Sequence[Sequence[str]]) -> float:
    """CRAFT's Prefix metric: how much of each request is a prefix of an earlier one."""
    tracker = PrefixTracker()
    shares: list[float] = []
    for index, request in enumerate(requests):
        matched = tracker.add(request)
        if index > 0 and request:
            shares.append(matched / len(request))
    return sum(shares) / len(shares) if shares else 0.0


def total_metric(requests: Sequence[Sequence[str]]) -> float:
    """CRAFT's Total metric: the best chunk overlap of each request with an earlier one."""
    requests_with: dict[str, list[int]] = defaultdict(list)
    shares: list[float] = []
    for index, request in enumerate(requests):
        unique = set(request)
        overlap: dict[int, int] = defaultdict(int)
        for cid in unique:
            for earlier in requests_with[cid]:
                overlap[earlier] += 1
        if index > 0 and unique:
            shares.append(max(overlap.values(), default=0) / len(unique))
        for cid in unique:
            requests_with[cid].append(index)
    return sum(shares) / len(shares) if shares else 0.0
