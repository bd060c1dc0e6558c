"""CRAFT's Chunk-Prefix Tree: promotion, extension, prefix slicing, eviction, bounds."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from chunkcache.core.access_table import AccessTable
from chunkcache.core.prefix_tree import (
    DEFAULT_PROMOTION_THRESHOLD,
    ChunkPrefixTree,
    PrefixNode,
)


def _paths(tree: ChunkPrefixTree) -> set[tuple[str, ...]]:
    return {tuple(node.path()) for node in tree.iter_nodes()}


def _check_structure(tree: ChunkPrefixTree) -> None:
    nodes = list(tree.iter_nodes())
    assert len(nodes) == tree.num_nodes == len(tree)
    for node in nodes:
        assert node.parent is not None
        assert node.parent.children[node.chunk_id] is node
        assert node.depth == node.parent.depth + 1 == len(node.path())


def _serve(tree: ChunkPrefixTree, table: AccessTable, request: list[str]) -> int:
    """CRAFT §4.2 per request: look up the prefix, count the chunks, update the tree."""
    matched = tree.longest_prefix_length(request)
    table.record(request)
    tree.update(request, table.count)
    return matched


def test_defaults() -> None:
    assert DEFAULT_PROMOTION_THRESHOLD == 2
    tree = ChunkPrefixTree()
    assert tree.promotion_threshold == 2
    assert len(tree) == 0
    assert tree.match(["a"]) == []


@pytest.mark.parametrize(("threshold", "max_nodes"), [(0, 10), (2, 0), (-1, 10)])
def test_bounds_must_be_positive(threshold: int, max_nodes: int) -> None:
    with pytest.raises(ValueError):
        ChunkPrefixTree(threshold, max_nodes)


def test_crafts_worked_example() -> None:
    # CRAFT §4.2 "Example": the table holds C1:1, C2:1, the tree is empty, threshold 2.
    table = AccessTable()
    table.record(["C1", "C2"])
    tree = ChunkPrefixTree(promotion_threshold=2)

    # [C1, C2, C5]: no prefix found; C1, C2 reach 2 -> [C1, C2] promoted; C5 (1) is not.
    assert _serve(tree, table, ["C1", "C2", "C5"]) == 0
    assert (table.count("C1"), table.count("C2"), table.count("C5")) == (2, 2, 1)
    assert _paths(tree) == {("C1",), ("C1", "C2")}
    c2 = tree.root.children["C1"].children["C2"]
    assert c2.parent is tree.root.children["C1"]

    # The KV metadata recorded for the prefix (the paper's "resides on GPU1").
    for node in tree.match(["C1", "C2"]):
        node.kv = {"tier": "gpu1", "prefix": tuple(node.path())}

    # [C1, C2, C6]: [C1, C2] is found and reused; C6 (1) does not extend the tree.
    assert _serve(tree, table, ["C1", "C2", "C6"]) == 2
    assert (table.count("C1"), table.count("C2"), table.count("C6")) == (3, 3, 1)
    assert _paths(tree) == {("C1",), ("C1", "C2")}

    # The same request again: [C1, C2] reused once more, C6 reaches 2 and extends it.
    assert _serve(tree, table, ["C1", "C2", "C6"]) == 2
    assert _paths(tree) == {("C1",), ("C1", "C2"), ("C1", "C2", "C6")}
    assert tree.longest_prefix_length(["C1", "C2", "C6"]) == 3
    c6 = tree.match(["C1", "C2", "C6"])[2]
    assert c6.parent is c2

    # The KV of [C1, C2] moves from GPU1 to CPU: the entry is updated in place.
    c2.kv = {"tier": "cpu", "prefix": ("C1", "C2")}
    assert tree.match(["C1", "C2"])[1].kv["tier"] == "cpu"
    assert tree.match(["C1"])[0].kv["tier"] == "gpu1"

    # The KV of [C1, C2] is removed: its node and everything below it go.
    assert tree.remove(["C1", "C2"]) == 2
    assert _paths(tree) == {("C1",)}
    assert tree.longest_prefix_length(["C1", "C2", "C6"]) == 1
    assert tree.num_evicted_nodes == 2
    _check_structure(tree)


def test_match_returns_one_node_per_prefix_for_slicing() -> None:
    table = AccessTable()
    tree = ChunkPrefixTree(promotion_threshold=1)
    _serve(tree, table, ["C1", "C2", "C3"])
    nodes = tree.match(["C1", "C2", "C3"])
    assert [n.chunk_id for n in nodes] == ["C1", "C2", "C3"]
    for i, node in enumerate(nodes):
        node.kv = f"kv-of-{'+'.join(node.path())}"
        assert node.path() == ["C1", "C2", "C3"][: i + 1]
    # Shorter prefixes are served by the same nodes, no extra storage.
    assert [n.kv for n in tree.match(["C1", "C2"])] == ["kv-of-C1", "kv-of-C1+C2"]
    # CRAFT's [C1, C10, C11]: C1's KV is still reusable.
    sliced = tree.match(["C1", "C10", "C11"])
    assert len(sliced) == 1
    assert sliced[0].kv == "kv-of-C1"
    assert sliced[0] is nodes[0]


def test_longest_prefix_lookup() -> None:
    tree = ChunkPrefixTree(promotion_threshold=1)
    table = AccessTable()
    _serve(tree, table, ["a", "b", "c"])
    _serve(tree, table, ["a", "x"])
    assert tree.longest_prefix_length(["a", "b", "c", "d"]) == 3
    assert tree.longest_prefix_length(["a", "b", "x"]) == 2
    assert tree.longest_prefix_length(["a", "x", "b"]) == 2
    assert tree.longest_prefix_length(["b", "a"]) == 0  # matching starts at the root
    assert tree.longest_prefix_length([]) == 0
    assert len(tree) == 4


def test_below_threshold_nothing_is_promoted() -> None:
    tree = ChunkPrefixTree(promotion_threshold=3)
    table = AccessTable()
    _serve(tree, table, ["a", "b"])
    _serve(tree, table, ["a", "b"])
    assert len(tree) == 0
    _serve(tree, table, ["a", "b"])
    assert _paths(tree) == {("a",), ("a", "b")}


def test_promotion_stops_at_the_first_chunk_below_threshold() -> None:
    tree = ChunkPrefixTree(promotion_threshold=2)
    counts = {"a": 2, "b": 1, "c": 5}
    path = tree.update(["a", "b", "c"], counts.__getitem__)
    assert [n.chunk_id for n in path] == ["a"]
    assert _paths(tree) == {("a",)}


def test_update_returns_the_request_path_and_counts_visits() -> None:
    tree = ChunkPrefixTree(promotion_threshold=1)
    first = tree.update(["a", "b"], lambda _: 1)
    second = tree.update(["a", "c"], lambda _: 1)
    assert [n.chunk_id for n in first] == ["a", "b"]
    assert [n.chunk_id for n in second] == ["a", "c"]
    assert first[0] is second[0]
    assert first[0].visits == 2
    assert first[1].visits == 1
    assert second[1].last_used > first[1].last_used


def test_remove_absent_prefixes_returns_zero() -> None:
    tree = ChunkPrefixTree(promotion_threshold=1)
    tree.update(["a", "b"], lambda _: 1)
    assert tree.remove([]) == 0
    assert tree.remove(["b"]) == 0
    assert tree.remove(["a", "c"]) == 0
    assert tree.remove(["a", "b", "c"]) == 0
    assert len(tree) == 2
    assert tree.num_evicted_nodes == 0
    assert tree.remove(["a"]) == 2
    assert len(tree) == 0
    assert tree.remove(["a"]) == 0


def test_kv_slot_is_settable_and_kept() -> None:
    tree = ChunkPrefixTree(promotion_threshold=1)
    (node,) = tree.update(["a"], lambda _: 1)
    assert node.kv is None
    node.kv = ("store-key", 0, 128)
    tree.update(["a", "b"], lambda _: 1)
    assert tree.match(["a"])[0].kv == ("store-key", 0, 128)
    assert isinstance(tree.match(["a"])[0], PrefixNode)


def test_lru_leaves_are_evicted_first() -> None:
    tree = ChunkPrefixTree(promotion_threshold=1, max_nodes=3)
    tree.update(["old"], lambda _: 1)
    tree.update(["mid"], lambda _: 1)
    tree.update(["new"], lambda _: 1)
    tree.update(["newest"], lambda _: 1)  # 4 > 3: trim to int(3 * 0.9) = 2
    assert _paths(tree) == {("new",), ("newest",)}
    assert tree.num_evicted_nodes == 2


def test_a_path_longer_than_max_nodes_is_capped() -> None:
    tree = ChunkPrefixTree(promotion_threshold=1, max_nodes=2)
    path = tree.update(["a", "b", "c", "d"], lambda _: 1)
    assert len(tree) <= 2
    assert [n.chunk_id for n in path] == ["a", "b"]
    assert tree.longest_prefix_length(["a", "b", "c", "d"]) == 2
    _check_structure(tree)


@given(
    st.integers(min_value=1, max_value=12),
    st.integers(min_value=1, max_value=3),
    st.lists(
        st.lists(st.sampled_from([f"c{i}" for i in range(10)]), max_size=6, unique=True),
        max_size=50,
    ),
)
@settings(max_examples=80, deadline=None)
def test_max_nodes_holds_and_the_current_path_survives(
    max_nodes: int, threshold: int, requests: list[list[str]]
) -> None:
    tree = ChunkPrefixTree(promotion_threshold=threshold, max_nodes=max_nodes)
    table = AccessTable(window=8)
    for request in requests:
        table.record(request)
        path = tree.update(request, table.count)
        assert len(tree) <= max_nodes
        # The request's own path is still attached and is its matched prefix.
        assert tree.match(request) == path
        assert [n.chunk_id for n in path] == request[: len(path)]
        _check_structure(tree)


def test_remove_chunk_drops_every_prefix_through_it() -> None:
    tree = ChunkPrefixTree(promotion_threshold=1)
    tree.update(["a", "b", "c"], lambda _: 1)
    tree.update(["b", "a"], lambda _: 1)
    tree.update(["d", "b"], lambda _: 1)
    # Gone: a/b with its child a/b/c, b with its child b/a, and d/b.
    assert tree.remove_chunk("b") == 5
    assert _paths(tree) == {("a",), ("d",)}
    assert tree.num_evicted_nodes == 5
    assert tree.remove_chunk("b") == 0
    assert tree.remove_chunk("never-seen") == 0
    _check_structure(tree)


@given(
    st.integers(min_value=2, max_value=12),
    st.lists(
        st.lists(st.sampled_from([f"c{i}" for i in range(6)]), max_size=4, unique=True),
        max_size=30,
    ),
    st.lists(st.sampled_from([f"c{i}" for i in range(6)]), max_size=4),
)
@settings(max_examples=60, deadline=None)
def test_remove_chunk_matches_removing_its_prefixes_one_by_one(
    max_nodes: int, requests: list[list[str]], gone: list[str]
) -> None:
    tree = ChunkPrefixTree(promotion_threshold=1, max_nodes=max_nodes)
    for request in requests:
        tree.update(request, lambda _: 1)
    for chunk_id in gone:
        expected = {p for p in _paths(tree) if chunk_id not in p}
        before = len(tree)
        removed = tree.remove_chunk(chunk_id)
        assert _paths(tree) == expected
        assert removed == before - len(tree)
        _check_structure(tree)
