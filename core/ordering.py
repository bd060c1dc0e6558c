"""Chunk orderings: the retriever's, CRAFT's frequency order, and our tree-guided order.

Frequency order (CRAFT §4.2) sorts a request's chunks by descending access count.
Tree-guided order is our step beyond it: among the chunk-prefix tree's paths
that the request's chunks cover, follow the deepest one, so the request starts
with the longest chunk-prefix the tree caches; where paths tie in depth, take the
most visited child at the level they part.  The chunks left over follow in
frequency order.  Both are deterministic functions of the table and tree state,
so equal chunk sets get equal orders.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal, get_args

from chunkcache.core.access_table import AccessTable
from chunkcache.core.prefix_tree import ChunkPrefixTree, PrefixNode

Ordering = Literal["tree", "frequency", "retriever"]
ORDERINGS: tuple[Ordering, ...] = get_args(Ordering)


def check_ordering(ordering: str) -> Ordering:
    """Return ``ordering`` if it names a known ordering, else raise ValueError."""
    if ordering not in ORDERINGS:
        raise ValueError(f"unknown ordering {ordering!r}; choose one of {ORDERINGS}")
    return ordering


def tree_guided_order(
    chunk_ids: Sequence[str], table: AccessTable, tree: ChunkPrefixTree
) -> list[str]:
    """Follow the deepest tree path the request covers (the most visited where paths
    tie in depth), then the rest by frequency."""
    covered, heights = _covered_paths(tree.root, set(chunk_ids))
    remaining = dict.fromkeys(chunk_ids)
    ordered: list[str] = []
    children = covered[tree.root]
    while children:
        node = min(children, key=lambda n: (-heights[n], -n.visits, *table.sort_key(n.chunk_id)))
        ordered.append(node.chunk_id)
        del remaining[node.chunk_id]
        children = covered[node]
    return ordered + table.order_by_frequency(list(remaining))


def _covered_paths(
    root: PrefixNode, wanted: set[str]
) -> tuple[dict[PrefixNode, list[PrefixNode]], dict[PrefixNode, int]]:
    """Each reachable node's covered children, and the depth of its deepest covered path.

    A node is reachable when its path from the root is made of distinct ``wanted``
    chunks (an order holds each chunk once).  One depth-first walk of the tree
    restricted to those paths; a node's height is set when the walk leaves it,
    after all its children.
    """
    covered: dict[PrefixNode, list[PrefixNode]] = {}
    heights: dict[PrefixNode, int] = {}
    on_path: set[str] = set()
    stack: list[tuple[PrefixNode, bool]] = [(root, False)]
    while stack:
        node, leaving = stack.pop()
        if leaving:
            children = covered[node]
            heights[node] = 1 + max([heights[c] for c in children]) if children else 0
            on_path.discard(node.chunk_id)
            continue
        if node is not root:
            on_path.add(node.chunk_id)
        # The intersection iterates the smaller side: a request's few chunks or a
        # node's few children.
        children = [
            node.children[cid] for cid in node.children.keys() & wanted if cid not in on_path
        ]
        covered[node] = children
        stack.append((node, True))
        stack += [(child, False) for child in children]
    return covered, heights


def order_chunks(
    chunk_ids: Sequence[str], ordering: Ordering, table: AccessTable, tree: ChunkPrefixTree
) -> list[str]:
    """Order one request's (distinct) chunk ids by ``ordering``."""
    if ordering == "tree":
        return tree_guided_order(chunk_ids, table, tree)
    if ordering == "frequency":
        return table.order_by_frequency(chunk_ids)
    check_ordering(ordering)
    return list(dict.fromkeys(chunk_ids))
