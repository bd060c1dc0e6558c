"""Chunk orderings: retriever, CRAFT frequency order, tree-guided order."""

from __future__ import annotations

import itertools
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from chunkcache.core.access_table import AccessTable
from chunkcache.core.cache import ChunkCache
from chunkcache.core.ordering import (
    ORDERINGS,
    Ordering,
    check_ordering,
    order_chunks,
    tree_guided_order,
)
from chunkcache.core.prefix_tree import ChunkPrefixTree

chunk = st.sampled_from([f"c{i}" for i in range(10)])
request = st.lists(chunk, max_size=6)
ordering = st.sampled_from(ORDERINGS)


def test_orderings() -> None:
    assert set(ORDERINGS) == {"tree", "frequency", "retriever"}
    for name in ORDERINGS:
        assert check_ordering(name) == name


@pytest.mark.parametrize("name", ["bogus", "", "Tree", "FREQUENCY", "random"])
def test_unknown_ordering_raises_value_error(name: str) -> None:
    with pytest.raises(ValueError, match="unknown ordering"):
        check_ordering(name)
    with pytest.raises(ValueError, match="unknown ordering"):
        order_chunks(["a", "b"], name, AccessTable(), ChunkPrefixTree())  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="unknown ordering"):
        ChunkCache().arrange(["a", "b"], ordering=name)  # type: ignore[arg-type]


def test_crafts_frequency_example() -> None:
    # CRAFT §4.2: {C1, C2, C3} and {C2, C3, C4}; C2 and C3 more frequent -> both [C2, C3, ...].
    table = AccessTable()
    table.record(["C2", "C3"])
    table.record(["C3", "C2", "C9"])
    tree = ChunkPrefixTree()
    first = order_chunks(["C1", "C2", "C3"], "frequency", table, tree)
    second = order_chunks(["C2", "C3", "C4"], "frequency", table, tree)
    assert first[:2] == second[:2] == ["C2", "C3"]
    assert first == ["C2", "C3", "C1"]
    assert second == ["C2", "C3", "C4"]


@pytest.mark.parametrize("name", ["frequency", "tree"])
def test_crafts_example_through_the_cache(name: Ordering) -> None:
    cache = ChunkCache()
    for _ in range(3):
        cache.arrange(["C3", "C2"], ordering=name)  # C2, C3 become frequent
    first = cache.arrange(["C1", "C2", "C3"], ordering=name)
    second = cache.arrange(["C4", "C3", "C2"], ordering=name)
    assert first.order[:2] == second.order[:2]
    assert set(first.order[:2]) == {"C2", "C3"}
    assert second.prefix_length >= 2


def test_retriever_order_keeps_input_order_without_duplicates() -> None:
    table, tree = AccessTable(), ChunkPrefixTree()
    table.record(["c", "b"])
    assert order_chunks(["a", "b", "a", "c"], "retriever", table, tree) == ["a", "b", "c"]


def test_tree_guided_order_follows_the_most_visited_path() -> None:
    table = AccessTable()
    tree = ChunkPrefixTree(promotion_threshold=1)
    for _ in range(3):
        tree.update(["a", "b"], lambda _: 1)
    tree.update(["c", "d"], lambda _: 1)
    for _ in range(5):
        table.record(["c", "d"])  # c, d far more frequent than a, b
    table.record(["a", "b"])
    ids = ["d", "c", "b", "a"]
    assert table.order_by_frequency(ids) == ["c", "d", "a", "b"]
    assert tree_guided_order(ids, table, tree) == ["a", "b", "c", "d"]
    assert order_chunks(ids, "tree", table, tree) == ["a", "b", "c", "d"]
    # Without a, the path [a, b] is not covered: c's path is followed instead.
    assert tree_guided_order(["b", "d", "c"], table, tree) == ["c", "d", "b"]


def test_tree_guided_order_takes_the_most_visited_child_at_each_level() -> None:
    table = AccessTable()
    tree = ChunkPrefixTree(promotion_threshold=1)
    tree.update(["r", "x"], lambda _: 1)
    tree.update(["r", "y"], lambda _: 1)
    tree.update(["r", "y"], lambda _: 1)
    table.record(["x"])
    table.record(["x"])
    assert tree_guided_order(["x", "y", "r"], table, tree) == ["r", "y", "x"]


def _tree_of(paths: list[tuple[list[str], int]]) -> ChunkPrefixTree:
    """A tree (threshold 1) that served each path the given number of times."""
    tree = ChunkPrefixTree(promotion_threshold=1)
    for path, times in paths:
        for _ in range(times):
            tree.update(path, lambda _: 1)
    return tree


def test_tree_guided_order_takes_the_deepest_path_over_a_more_visited_one() -> None:
    # A greedy walk by visits takes [a] and matches 1 chunk; [b, c, d] matches 3.
    tree = _tree_of([(["a"], 3), (["b", "c", "d"], 1)])
    table = AccessTable()
    order = tree_guided_order(["a", "b", "c", "d"], table, tree)
    assert order == ["b", "c", "d", "a"]
    assert tree.longest_prefix_length(order) == 3
    # Covering only part of the deep path still beats the shallow one: 2 > 1.
    assert tree_guided_order(["a", "c", "b"], table, tree) == ["b", "c", "a"]


def test_tree_guided_order_takes_the_deeper_branch_below_a_shared_node() -> None:
    tree = _tree_of([(["r", "x"], 3), (["r", "y", "z"], 1)])
    assert tree_guided_order(["x", "y", "z", "r"], AccessTable(), tree) == ["r", "y", "z", "x"]
    # Without z the branches tie in depth, and visits decide.
    assert tree_guided_order(["x", "y", "r"], AccessTable(), tree) == ["r", "x", "y"]


def test_tree_guided_order_uses_each_chunk_once_on_a_path_that_repeats_one() -> None:
    # tree.update takes any sequence; a path through a twice is not an order of {a, b}.
    tree = _tree_of([(["a", "a", "b"], 3), (["b", "a"], 1)])
    order = tree_guided_order(["a", "b"], AccessTable(), tree)
    assert order == ["b", "a"]
    assert tree.longest_prefix_length(order) == 2


def test_tree_guided_order_follows_a_long_path_without_recursion() -> None:
    path = [f"c{i}" for i in range(5000)]
    tree = _tree_of([(path, 1)])
    assert tree_guided_order(path[::-1], AccessTable(), tree) == path


@given(
    st.lists(st.tuples(request, st.integers(1, 3)), max_size=12),
    st.lists(st.sampled_from([f"c{i}" for i in range(6)]), max_size=5, unique=True),
)
@settings(max_examples=150, deadline=None)
def test_tree_guided_order_matches_the_longest_prefix_any_order_would(
    paths: list[tuple[list[str], int]], ids: list[str]
) -> None:
    tree = _tree_of(paths)
    order = tree_guided_order(ids, AccessTable(), tree)
    best = max((tree.longest_prefix_length(p) for p in itertools.permutations(ids)), default=0)
    assert tree.longest_prefix_length(order) == best


def test_tree_guided_ties_in_visits_go_by_frequency_then_first_access() -> None:
    table = AccessTable()
    tree = ChunkPrefixTree(promotion_threshold=1)
    tree.update(["p"], lambda _: 1)
    tree.update(["q"], lambda _: 1)
    table.record(["q"])
    table.record(["p"])
    assert tree_guided_order(["p", "q"], table, tree) == ["q", "p"]
    table.record(["p"])
    assert tree_guided_order(["q", "p"], table, tree) == ["p", "q"]


def test_tree_guided_order_on_an_empty_tree_is_frequency_order() -> None:
    table = AccessTable()
    table.record(["b"])
    table.record(["b", "c"])
    ids = ["a", "c", "b"]
    assert tree_guided_order(ids, table, ChunkPrefixTree()) == table.order_by_frequency(ids)
    assert tree_guided_order([], table, ChunkPrefixTree()) == []


@given(
    st.lists(request, max_size=25),
    request,
    ordering,
    st.randoms(use_true_random=False),
)
@settings(max_examples=80, deadline=None)
def test_every_ordering_is_a_permutation_of_the_distinct_input(
    history: list[list[str]], ids: list[str], name: Ordering, rng: random.Random
) -> None:
    cache = ChunkCache(window=10)
    for past in history:
        cache.arrange(past, ordering=rng.choice(ORDERINGS))
    table, tree = cache.access_table, cache.prefix_tree
    order = order_chunks(ids, name, table, tree)
    assert len(order) == len(set(order))
    assert sorted(order) == sorted(set(ids))
    if name != "retriever":
        shuffled = list(ids)
        rng.shuffle(shuffled)
        assert order_chunks(shuffled, name, table, tree) == order


@given(
    st.lists(st.tuples(request, ordering), max_size=25),
    st.lists(chunk, min_size=1, max_size=6, unique=True),
    st.sampled_from(["tree", "frequency"]),
    st.randoms(use_true_random=False),
)
@settings(max_examples=60, deadline=None)
def test_equal_sets_at_equal_state_get_equal_orders(
    history: list[tuple[list[str], Ordering]], ids: list[str], name: Ordering, rng: random.Random
) -> None:
    # Two caches fed the same history hold the same state.
    one, two = ChunkCache(window=10), ChunkCache(window=10)
    for past, past_ordering in history:
        a = one.arrange(past, ordering=past_ordering)
        b = two.arrange(past, ordering=past_ordering)
        assert a == b
    shuffled = list(ids)
    rng.shuffle(shuffled)
    first = one.arrange(ids, ordering=name)
    second = two.arrange(shuffled, ordering=name)
    assert first.order == second.order
    assert first.prefix_length == second.prefix_length
    assert sorted(first.order) == sorted(ids)
