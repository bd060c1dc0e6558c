"""CRAFT §3.1 reuse metrics: Prefix and Total."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from chunkcache.core.metrics import prefix_metric, total_metric

R1 = ["C1", "C4", "C5", "C6", "C7"]
R2 = ["C1", "C2", "C3", "C4", "C5"]
R2_PERMUTED = ["C1", "C4", "C5", "C2", "C3"]


def _lcp(a: Sequence[str], b: Sequence[str]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def brute_prefix(requests: Sequence[Sequence[str]]) -> float:
    shares = [
        max(_lcp(requests[i], requests[j]) for j in range(i)) / len(requests[i])
        for i in range(1, len(requests))
        if requests[i]
    ]
    return sum(shares) / len(shares) if shares else 0.0


def brute_total(requests: Sequence[Sequence[str]]) -> float:
    shares = [
        max(len(set(requests[i]) & set(requests[j])) for j in range(i)) / len(set(requests[i]))
        for i in range(1, len(requests))
        if requests[i]
    ]
    return sum(shares) / len(shares) if shares else 0.0


def test_crafts_example() -> None:
    # §3.1: only C1 is prefix-aligned, but C1, C4, C5 are shared.
    assert prefix_metric([R1, R2]) == pytest.approx(1 / 5)
    assert total_metric([R1, R2]) == pytest.approx(3 / 5)


def test_crafts_permutation_triples_the_prefix() -> None:
    # §3.1: Request'_2 = [C1, C4, C5, C2, C3] aligns C1, C4, C5.
    assert prefix_metric([R1, R2_PERMUTED]) == pytest.approx(3 / 5)
    assert total_metric([R1, R2_PERMUTED]) == pytest.approx(3 / 5)


def test_best_earlier_request_counts() -> None:
    requests = [["a", "b", "c"], ["a", "x", "y"], ["a", "b", "z"], ["q", "r", "s"]]
    # i=1: LCP 1 (a); i=2: LCP 2 with request 0; i=3: 0.
    assert prefix_metric(requests) == pytest.approx((1 / 3 + 2 / 3 + 0) / 3)
    assert total_metric(requests) == pytest.approx((1 / 3 + 2 / 3 + 0) / 3)


def test_later_requests_do_not_count_for_earlier_ones() -> None:
    assert prefix_metric([["a"], ["b"], ["a", "b"]]) == pytest.approx((0 + 1 / 2) / 2)
    assert total_metric([["a"], ["b"], ["b", "a"]]) == pytest.approx((0 + 1 / 2) / 2)


def test_identical_requests_reuse_everything() -> None:
    assert prefix_metric([R1] * 4) == 1.0
    assert total_metric([R1] * 4) == 1.0


@pytest.mark.parametrize("requests", [[], [R1], [[]], [R1, []], [[], []]])
def test_fewer_than_two_usable_requests_give_zero(requests: list[list[str]]) -> None:
    assert prefix_metric(requests) == 0.0
    assert total_metric(requests) == 0.0


def test_accepts_tuples_and_generic_sequences() -> None:
    assert prefix_metric((tuple(R1), tuple(R2))) == pytest.approx(1 / 5)
    assert total_metric((tuple(R1), tuple(R2))) == pytest.approx(3 / 5)


requests_strategy = st.lists(
    st.lists(st.sampled_from([f"C{i}" for i in range(8)]), max_size=6), max_size=12
)
distinct_requests_strategy = st.lists(
    st.lists(st.sampled_from([f"C{i}" for i in range(8)]), max_size=6, unique=True), max_size=12
)


@given(distinct_requests_strategy)
@settings(max_examples=150, deadline=None)
def test_matches_brute_force_on_retrieval_sets(requests: list[list[str]]) -> None:
    prefix, total = prefix_metric(requests), total_metric(requests)
    assert prefix == pytest.approx(brute_prefix(requests))
    assert total == pytest.approx(brute_total(requests))
    assert 0.0 <= prefix <= total <= 1.0  # a shared prefix is a shared set


@given(requests_strategy)
@settings(max_examples=100, deadline=None)
def test_matches_brute_force_with_repeated_ids(requests: list[list[str]]) -> None:
    assert prefix_metric(requests) == pytest.approx(brute_prefix(requests))
    assert total_metric(requests) == pytest.approx(brute_total(requests))
    assert 0.0 <= prefix_metric(requests) <= 1.0
    assert 0.0 <= total_metric(requests) <= 1.0
