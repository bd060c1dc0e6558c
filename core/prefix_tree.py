"""CRAFT's Chunk-Prefix Tree (CP-Tree): which chunk orders are worth caching as prefixes.

CRAFT §4.1-4.2.  Each node is one chunk; the path from the root to a node is a
chunk-prefix seen in earlier requests.  A prefix is promoted into the tree when
each of its chunks has reached the promotion threshold in the access table
(default 2, CRAFT §6.2.5), and a cached prefix is extended by the next chunk of
a request once that chunk reaches the threshold.  Any path's sub-prefix is
usable on its own (prefix slicing).  Nodes carry a ``kv`` slot the KV store
fills with where the prefix's KV lives; evicting that KV removes the node and
everything below it, since a longer prefix's KV needs its parent's.  When the KV
store drops a chunk's last variant (of every text sent under its id),
:meth:`ChunkPrefixTree.remove_chunk` removes every prefix through that chunk
(``ChunkCache`` wires this to the store of an in-process engine; an eviction no one
reports, by a shared Redis tier, a server's store or vLLM, leaves the nodes: see
:mod:`chunkcache.core.cache`).

The tree is bounded: beyond ``max_nodes`` the least recently used leaves go first.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

DEFAULT_PROMOTION_THRESHOLD = 2
DEFAULT_MAX_NODES = 100_000


@dataclass(eq=False)
class PrefixNode:
    """One chunk in a chunk-prefix; ``kv`` is the KV store's metadata slot."""

    chunk_id: str
    parent: PrefixNode | None
    depth: int
    visits: int = 0
    last_used: int = 0
    kv: Any = None
    children: dict[str, PrefixNode] = field(default_factory=dict)

    def path(self) -> list[str]:
        """The chunk-prefix this node ends, from the root down."""
        chunk_ids: list[str] = []
        node: PrefixNode | None = self
        while node is not None and node.parent is not None:
            chunk_ids.append(node.chunk_id)
            node = node.parent
        return chunk_ids[::-1]


class ChunkPrefixTree:
    """Radix-like tree of promoted chunk-prefixes (one node per chunk)."""

    def __init__(
        self,
        promotion_threshold: int = DEFAULT_PROMOTION_THRESHOLD,
        max_nodes: int = DEFAULT_MAX_NODES,
    ) -> None:
        if promotion_threshold < 1:
            raise ValueError(f"promotion_threshold must be >= 1, got {promotion_threshold}")
        if max_nodes < 1:
            raise ValueError(f"max_nodes must be >= 1, got {max_nodes}")
        self.promotion_threshold = promotion_threshold
        self.max_nodes = max_nodes
        self.root = PrefixNode(chunk_id="", parent=None, depth=0)
        self.num_nodes = 0
        self.num_evicted_nodes = 0
        self._clock = itertools.count(1)
        self._nodes_of_chunk: dict[str, set[PrefixNode]] = {}

    def __len__(self) -> int:
        return self.num_nodes

    def match(self, chunk_ids: Sequence[str]) -> list[PrefixNode]:
        """Nodes of the longest cached chunk-prefix of ``chunk_ids`` (CRAFT §4.2 lookup).

        ``len(result)`` is the matched prefix length; ``result[i].kv`` is the KV
        metadata of the prefix ``chunk_ids[: i + 1]`` (prefix slicing).
        """
        nodes: list[PrefixNode] = []
        node = self.root
        for cid in chunk_ids:
            child = node.children.get(cid)
            if child is None:
                break
            nodes.append(child)
            node = child
        return nodes

    def longest_prefix_length(self, chunk_ids: Sequence[str]) -> int:
        return len(self.match(chunk_ids))

    def update(
        self, chunk_ids: Sequence[str], count: Callable[[str], int], *, visit: bool = True
    ) -> list[PrefixNode]:
        """Record a served request; promote or extend its prefix (CRAFT §4.2, Table Update).

        ``count`` gives each chunk's access count *after* this request was
        recorded.  The matched prefix is followed; then each next chunk whose
        count reaches the threshold is inserted as a child, until one does not.
        ``visit=False``: the request was recorded already (it is arranged again), so
        its nodes' visits are left as they are.  Returns the nodes of the request's
        prefix now in the tree.
        """
        tick = next(self._clock)
        path: list[PrefixNode] = []
        node = self.root
        for cid in chunk_ids:
            child = node.children.get(cid)
            if child is None:
                # A path longer than max_nodes could never fit: stop growing it there.
                if len(path) >= self.max_nodes or count(cid) < self.promotion_threshold:
                    break
                child = PrefixNode(chunk_id=cid, parent=node, depth=node.depth + 1)
                node.children[cid] = child
                self._nodes_of_chunk.setdefault(cid, set()).add(child)
                self.num_nodes += 1
            child.visits += visit
            child.last_used = tick
            path.append(child)
            node = child
        if self.num_nodes > self.max_nodes:
            self._evict_lru_leaves(keep=set(map(id, path)))
        return path

    def remove(self, chunk_ids: Sequence[str]) -> int:
        """Drop the node ending prefix ``chunk_ids`` and its subtree (its KV was evicted).

        Returns the number of nodes removed (0 if the prefix is not in the tree).
        """
        nodes = self.match(chunk_ids)
        if not chunk_ids or len(nodes) != len(chunk_ids):
            return 0
        return self._detach(nodes[-1])

    def remove_chunk(self, chunk_id: str) -> int:
        """Drop every prefix through ``chunk_id`` (its KV is gone), with their subtrees.

        Returns the number of nodes removed.
        """
        removed = 0
        for node in list(self._nodes_of_chunk.get(chunk_id, ())):
            # A node inside a subtree removed earlier in this loop has left the index.
            if node in self._nodes_of_chunk.get(chunk_id, ()):
                removed += self._detach(node)
        return removed

    def iter_nodes(self) -> Iterator[PrefixNode]:
        """All nodes, depth first."""
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def _detach(self, node: PrefixNode) -> int:
        assert node.parent is not None
        del node.parent.children[node.chunk_id]
        removed = 0
        for gone in _subtree(node):
            removed += 1
            same_chunk = self._nodes_of_chunk[gone.chunk_id]
            same_chunk.discard(gone)
            if not same_chunk:
                del self._nodes_of_chunk[gone.chunk_id]
        self.num_nodes -= removed
        self.num_evicted_nodes += removed
        return removed

    def _evict_lru_leaves(self, keep: set[int]) -> None:
        # Amortised: trim to 90% so a full tree is not scanned on every insert.
        target = int(self.max_nodes * 0.9)
        while self.num_nodes > target:
            leaves = sorted(
                (n for n in self.iter_nodes() if not n.children and id(n) not in keep),
                key=lambda n: n.last_used,
            )
            if not leaves:
                return
            for leaf in leaves[: self.num_nodes - target]:
                self._detach(leaf)


def _subtree(node: PrefixNode) -> Iterator[PrefixNode]:
    stack = [node]
    while stack:
        current = stack.pop()
        yield current
        stack.extend(current.children.values())
