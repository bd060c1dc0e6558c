"""Chunk orderings: the retriever's, CRAFT's frequency order, and our tree-guided order.

Frequency order (CRAFT §4.2) sorts a request's chunks by descending access count.
Tree-guided order is our step beyond it: walk down the chunk-prefix tree of
earlier orders, at each level taking the most visited child that the request
contains, so a request follows the path earlier requests travelled most (greedily:
not always the longest one it covers); the chunks left over follow in frequency
order.  Both are deterministic functions of the table and tree state, so equal
chunk sets get equal orders.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal, get_args

from chunkcache.core.access_table import AccessTable
from chunkcache.core.prefix_tree import ChunkPrefixTree

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
    """Follow the most visited tree path the request covers, then the rest by frequency."""
    remaining = dict.fromkeys(chunk_ids)
    ordered: list[str] = []
    node = tree.root
    while remaining:
        present = [node.children[cid] for cid in remaining if cid in node.children]
        if not present:
            break
        node = min(present, key=lambda n: (-n.visits, *table.sort_key(n.chunk_id)))
        ordered.append(node.chunk_id)
        del remaining[node.chunk_id]
    return ordered + table.order_by_frequency(list(remaining))


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
