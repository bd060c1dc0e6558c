"""Cache-aware reordering (RAGCache §5.2), on the two scenarios of its Figure 12."""

from __future__ import annotations

import pytest

from chunkcache.core.store.reorder import CacheAwareQueue


def test_figure_12a_larger_cached_context_first() -> None:
    """Same recompute demand, different cached contexts (the paper counts 5 units of compute
    for Q1 first, 6 for Q2 first): Q1 goes first although Q2 arrived first."""
    queue: CacheAwareQueue[str] = CacheAwareQueue()
    queue.push("Q2", cached_tokens=1, compute_tokens=2)
    queue.push("Q1", cached_tokens=2, compute_tokens=2)
    assert [queue.pop(), queue.pop()] == ["Q1", "Q2"]


def test_figure_12b_shorter_recompute_first() -> None:
    """Same cached context, different recompute demands (the paper counts 3 for Q2 first,
    5 for Q1 first): the shorter recompute goes first."""
    queue: CacheAwareQueue[str] = CacheAwareQueue()
    queue.push("Q1", cached_tokens=2, compute_tokens=2)
    queue.push("Q2", cached_tokens=2, compute_tokens=1)
    assert [queue.pop(), queue.pop()] == ["Q2", "Q1"]


def test_ties_keep_arrival_order() -> None:
    queue: CacheAwareQueue[int] = CacheAwareQueue()
    for i in range(4):
        queue.push(i, 10, 10)
    assert [queue.pop() for _ in range(4)] == [0, 1, 2, 3]


def test_starvation_window_bounds_the_wait() -> None:
    """A request with nothing cached is passed by at most ``window`` later arrivals."""
    queue: CacheAwareQueue[str] = CacheAwareQueue(window=2)
    queue.push("cold", cached_tokens=0, compute_tokens=100)
    served = []
    for i in range(5):
        queue.push(f"hot{i}", cached_tokens=90, compute_tokens=10)
        served.append(queue.pop())
    assert served.index("cold") == 2


def test_update_and_empty() -> None:
    queue: CacheAwareQueue[str] = CacheAwareQueue()
    queue.push("a", 1, 10)
    queue.push("b", 5, 10)
    queue.update("a", 10, 1)  # a's chunks were prefetched meanwhile
    assert queue.pop() == "a"
    assert len(queue) == 1
    queue.pop()
    with pytest.raises(IndexError):
        queue.pop()
