"""Policy replay on synthetic traces: hit rates behave as caches must."""

from __future__ import annotations

import random

import pytest

from chunkcache.core.store.simulate import replay


def zipf_trace(num_requests: int, num_chunks: int, seed: int) -> list[list[tuple[str, int]]]:
    rng = random.Random(seed)
    weights = [1 / (rank + 1) for rank in range(num_chunks)]
    trace = []
    for _ in range(num_requests):
        chosen = rng.choices(range(num_chunks), weights, k=3)
        trace.append([(f"c{i}", 10 + i % 7) for i in dict.fromkeys(chosen)])
    return trace


@pytest.mark.parametrize("policy", ["lru", "lfu", "pgdsf", "cachecraft"])
def test_hit_rate_grows_with_capacity(policy: str) -> None:
    trace = zipf_trace(300, 60, seed=1)
    rates = [replay(trace, policy, capacity).hit_rate for capacity in (60, 300, 3000)]
    assert 0 < rates[0] <= rates[1] <= rates[2]


def test_unbounded_capacity_misses_only_first_sights() -> None:
    """With room for everything, only a chunk's first retrieval in a new context misses
    under position-independent reuse (any variant hits)."""
    trace = zipf_trace(200, 40, seed=2)
    result = replay(trace, "lru", capacity_bytes=10**9)
    distinct = len({chunk for request in trace for chunk, _ in request})
    assert result.lookups - result.hits == distinct
    assert result.evictions == 0


def test_frequency_aware_policies_beat_lru_on_a_scan() -> None:
    """A hot set reused throughout plus a one-off scan: LRU lets the scan flush the hot set,
    LFU and PGDSF keep it."""
    hot = [[(f"h{i}", 10)] for i in range(4)]
    trace = hot + hot  # the hot set is established
    for step in range(60):
        trace.extend(hot)
        trace.append([(f"scan{step}-{j}", 10) for j in range(3)])
    capacity = 2 * 10 * 5  # room for five 10-token chunks
    lru = replay(trace, "lru", capacity).hit_rate
    assert replay(trace, "lfu", capacity).hit_rate > lru
    assert replay(trace, "pgdsf", capacity).hit_rate > lru
