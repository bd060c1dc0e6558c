"""Hit rates of the eviction policies on the bundled multi-turn trace (issue 5).

The trace, retrieved (FAISS, k chunks) and arranged by a :class:`ChunkCache` (tree order,
conversation dedupe ``drop``) as the app would, is replayed through ``lru``, ``lfu``,
``pgdsf`` (RAGCache §5.1) and ``cachecraft`` (Cache-Craft §3.3) at 10%, 30% and 60% of its
working set (:func:`chunkcache.core.store.simulate.replay`).  PGDSF's cost is the model's
measured prefill time fitted to ``T = new (a + b (cached + new / 2))``.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

from chunkcache.core.cache import ChunkCache
from chunkcache.core.engine import ChunkEngine, TokenSegment
from chunkcache.core.kv_store import MemoryKVStore
from chunkcache.core.models import LoadedModel
from chunkcache.core.store.simulate import Request, replay
from chunkcache.core.workload import Turn

POLICIES = ("lru", "lfu", "pgdsf", "cachecraft")
CAPACITIES = (0.1, 0.3, 0.6)  # shares of the working set
Retrieve = Callable[[str, int], Sequence[str]]  # question, k -> chunk ids, best first
PrefillCost = Callable[[int, int], float]  # (cached, new tokens) -> seconds


def trace_requests(
    turns: Sequence[Turn],
    retrieve: Retrieve,
    num_tokens: Callable[[str], int],
    k: int = 5,
    cache: ChunkCache | None = None,
) -> list[Request]:
    """Each turn's chunks as chunkcache places them: retrieved, then arranged by ``cache``
    (tree order, chunks the conversation already holds dropped, CRAFT §4.2-4.3); turns left
    with no chunk are skipped (their context is all in the conversation's past)."""
    cache = cache if cache is not None else ChunkCache()
    requests: list[Request] = []
    for turn in turns:
        ids = retrieve(turn.question, k)
        arranged = cache.arrange(ids, conversation_id=turn.conversation_id, dedupe="drop")
        if arranged.order:
            requests.append([(chunk_id, num_tokens(chunk_id)) for chunk_id in arranged.order])
    return requests


def working_set_bytes(requests: Sequence[Request], bytes_per_token: int) -> int:
    """Bytes the replay stores with unbounded capacity: one variant per distinct chunk (a
    chunk found in any context is a hit, so only its first retrieval stores one)."""
    tokens: dict[str, int] = {}
    for request in requests:
        for chunk_id, num_tokens in request:
            tokens.setdefault(chunk_id, num_tokens)
    return sum(tokens.values()) * bytes_per_token


def fit_prefill_cost(samples: Sequence[tuple[int, float]]) -> tuple[float, float]:
    """Least squares ``(a, b)`` of ``T / n = a + b n / 2`` over full prefills ``(n, T)``:
    :func:`linear_prefill_cost`'s shape, ``b`` (attention's share) clamped at 0."""
    xs = [n / 2 for n, _ in samples]
    ys = [t / n for n, t in samples]
    mean_x, mean_y = statistics.fmean(xs), statistics.fmean(ys)
    spread = sum((x - mean_x) ** 2 for x in xs)
    b = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys, strict=True)) / spread
    b = max(b, 0.0)
    return mean_y - b * mean_x, b


def fitted_cost(a: float, b: float) -> PrefillCost:
    """``T(cached, new) = new (a + b (cached + new / 2))`` seconds."""

    def cost(cached: int, new: int) -> float:
        return new * (a + b * (cached + new / 2))

    return cost


def measure_prefill(lm: LoadedModel, ids: Sequence[int], lengths: Sequence[int]) -> list[Any]:
    """Best of 2 full prefills (no store) of the first ``n`` of ``ids`` for each ``n``."""
    engine = ChunkEngine(lm, MemoryKVStore())
    samples = []
    for n in lengths:
        segment = [TokenSegment(f"bench-prefill-{n}", tuple(ids[:n]), is_chunk=False)]
        times = []
        for _ in range(2):
            engine.store = MemoryKVStore()
            started = time.perf_counter()
            engine.prefill(segment, "full")
            times.append(time.perf_counter() - started)
        samples.append((n, min(times)))
    return samples


def hit_rates(
    requests: Sequence[Request], bytes_per_token: int, cost: PrefillCost
) -> dict[str, Any]:
    """Every policy at every capacity share of the working set."""
    working_set = working_set_bytes(requests, bytes_per_token)
    rows = []
    for share in CAPACITIES:
        capacity = int(share * working_set)
        for policy in POLICIES:
            result = replay(requests, policy, capacity, bytes_per_token, cost)
            rows.append(
                {
                    "policy": policy,
                    "capacity_share": share,
                    "capacity_bytes": capacity,
                    "hit_rate": result.hit_rate,
                    "hits": result.hits,
                    "lookups": result.lookups,
                    "evictions": result.evictions,
                }
            )
    lookups = sum(len(request) for request in requests)
    distinct = len({chunk_id for request in requests for chunk_id, _ in request})
    unbounded = 1 - distinct / lookups if lookups else 0.0  # only first retrievals miss
    return {"working_set_bytes": working_set, "unbounded_hit_rate": unbounded, "rows": rows}
