"""CRAFT's Chunk-Access Table: counts over a sliding window of requests."""

from __future__ import annotations

import random
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from chunkcache.core.access_table import DEFAULT_WINDOW, AccessTable

chunk = st.sampled_from([f"c{i}" for i in range(12)])
request = st.lists(chunk, max_size=6)


def test_default_window_is_crafts() -> None:
    assert DEFAULT_WINDOW == 1000
    assert AccessTable().window == 1000


@pytest.mark.parametrize("window", [0, -1])
def test_window_must_be_positive(window: int) -> None:
    with pytest.raises(ValueError):
        AccessTable(window)


def test_counts_each_request() -> None:
    table = AccessTable()
    table.record(["a", "b"])
    table.record(["b", "c"])
    table.record(["b"])
    assert (table.count("a"), table.count("b"), table.count("c")) == (1, 3, 1)
    assert table.count("never") == 0
    assert len(table) == 3
    assert table.num_requests == 3
    assert "b" in table
    assert "never" not in table


def test_duplicate_ids_in_one_request_count_once() -> None:
    table = AccessTable()
    table.record(["a", "a", "b", "a"])
    assert table.count("a") == 1
    table.record(iter(["a", "a"]))  # any iterable
    assert table.count("a") == 2


def test_chunks_leave_when_their_last_request_leaves_the_window() -> None:
    table = AccessTable(window=3)
    table.record(["a", "b"])  # r1
    table.record(["b"])  # r2
    table.record(["c"])  # r3
    assert table.count("a") == 1
    table.record(["d"])  # r4: r1 leaves -> a gone, b down to 1
    assert "a" not in table
    assert table.count("a") == 0
    assert table.count("b") == 1
    table.record(["e"])  # r5: r2 leaves -> b gone
    assert "b" not in table
    assert [c for c in "abcde" if c in table] == ["c", "d", "e"]
    assert table.num_requests == 3


def test_window_of_one_keeps_only_the_last_request() -> None:
    table = AccessTable(window=1)
    table.record(["a", "b"])
    table.record(["b", "c"])
    assert (table.count("a"), table.count("b"), table.count("c")) == (0, 1, 1)
    assert len(table) == 2


def test_empty_requests_take_a_window_slot() -> None:
    table = AccessTable(window=2)
    table.record(["a"])
    table.record([])
    assert table.count("a") == 1
    table.record([])
    assert table.count("a") == 0
    assert len(table) == 0


def test_frequency_order_descending_with_stable_ties() -> None:
    table = AccessTable()
    table.record(["z", "y"])
    table.record(["x", "y"])
    table.record(["w"])
    # y:2; then z, x, w all 1, in order of first access.
    assert table.order_by_frequency(["w", "x", "y", "z"]) == ["y", "z", "x", "w"]
    assert table.order_by_frequency(["z", "x", "w", "y"]) == ["y", "z", "x", "w"]


def test_chunks_new_in_one_request_tie_by_id_not_by_request_order() -> None:
    # Otherwise the order the retriever happened to return a set in would decide its
    # ties for as long as the chunks stay in the window.
    one, two = AccessTable(), AccessTable()
    one.record(["b", "c", "a"])
    two.record(["c", "a", "b"])
    assert one.order_by_frequency(["c", "b", "a"]) == ["a", "b", "c"]
    assert two.order_by_frequency(["c", "b", "a"]) == ["a", "b", "c"]
    # Chunks already in the table keep their place; only the new ones are numbered by id.
    one.record(["z", "b", "y"])
    assert one.order_by_frequency(["a", "b", "c", "y", "z"]) == ["b", "a", "c", "y", "z"]


def test_unknown_chunks_go_last_sorted_by_id() -> None:
    table = AccessTable()
    table.record(["m"])
    assert table.order_by_frequency(["q", "m", "b", "q"]) == ["m", "b", "q"]


def test_tie_breaker_resets_after_a_chunk_leaves_the_window() -> None:
    table = AccessTable(window=2)
    table.record(["a"])
    table.record(["b"])
    assert table.order_by_frequency(["b", "a"]) == ["a", "b"]
    table.record(["c"])  # a leaves
    table.record(["a"])  # b leaves; a re-enters after c
    assert table.order_by_frequency(["a", "c"]) == ["c", "a"]


def test_sort_key_orders_by_count_then_first_access_then_id() -> None:
    table = AccessTable()
    table.record(["a"])
    table.record(["b", "a"])
    assert table.sort_key("a") < table.sort_key("b") < table.sort_key("unknown")


@given(st.integers(min_value=1, max_value=6), st.lists(request, max_size=40))
@settings(max_examples=80, deadline=None)
def test_counts_equal_a_brute_force_recount(window: int, requests: list[list[str]]) -> None:
    table = AccessTable(window)
    for index, ids in enumerate(requests):
        table.record(ids)
        recent = requests[max(0, index + 1 - window) : index + 1]
        expected = Counter(cid for r in recent for cid in set(r))
        assert {cid: table.count(cid) for cid in expected} == dict(expected)
        assert len(table) == len(expected)
        assert table.num_requests == len(recent)
        max_request_len = max(len(set(r)) for r in requests[: index + 1])
        assert len(table) <= window * max_request_len


@given(
    st.lists(request, max_size=30),
    st.lists(chunk, min_size=1, max_size=8, unique=True),
    st.randoms(use_true_random=False),
)
@settings(max_examples=80, deadline=None)
def test_permutations_of_a_set_get_the_same_order(
    history: list[list[str]], ids: list[str], rng: random.Random
) -> None:
    table = AccessTable(window=7)
    for ids_ in history:
        table.record(ids_)
    shuffled = list(ids)
    rng.shuffle(shuffled)
    order = table.order_by_frequency(ids)
    assert order == table.order_by_frequency(shuffled)
    assert sorted(order) == sorted(ids)
    counts = [table.count(cid) for cid in order]
    assert counts == sorted(counts, reverse=True)
