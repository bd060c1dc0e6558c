"""The policies a benchmark runs, and the warmed stores they all read.

Warm-up: every chunk of a prompt is prefilled right after the system prefix, in a
fresh store per prompt (``cachecraft`` warms its own store under its own policy, so
its variants carry the CFO metadata).  The prompt then finds the system prefix as its
only exact hit and every chunk as a variant to move and selectively recompute.  Every
policy reads the warmed store through :class:`ReadOnlyStore`, so one policy's new
variants never serve another (a ``full`` run would otherwise store the whole prompt
as an exact prefix).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from chunkcache.core.engine import ChunkEngine, Prefilled, TokenSegment
from chunkcache.core.generation import (
    DEFAULT_RECOMPUTE_RATIO,
    GenerationRequest,
    Policy,
    SamplingParams,
)
from chunkcache.core.kv_store import KVStore, KVVariant, MemoryKVStore
from chunkcache.core.models import LoadedModel
from chunkcache.core.segmenter import Segment


@dataclass(frozen=True)
class PolicyRun:
    """A policy as the benchmark names it; ``ratio`` None leaves the engine's default.

    ``warm`` is the policy the warm-up prefills chunks with: ``cachecraft`` stores the
    metadata its CFO needs beside the same KV (variants a ``full`` run stores have none).
    """

    name: str
    policy: Policy
    ratio: float | None = None
    warm: Policy = "full"

    def prefill(
        self, engine: ChunkEngine, segments: Sequence[TokenSegment], reserve: int = 0
    ) -> Prefilled:
        if self.ratio is None:
            return engine.prefill(segments, self.policy, reserve=reserve)
        return engine.prefill(segments, self.policy, self.ratio, reserve=reserve)

    def request(self, segments: Sequence[Segment], max_tokens: int) -> GenerationRequest:
        ratio = DEFAULT_RECOMPUTE_RATIO if self.ratio is None else self.ratio
        sampling = SamplingParams(max_tokens=max_tokens)
        return GenerationRequest(
            segments, policy=self.policy, recompute_ratio=ratio, sampling=sampling
        )


FULL = PolicyRun("full", "full")
POLICY_RUNS = (
    FULL,
    PolicyRun("prefix", "prefix"),
    PolicyRun("reuse", "reuse"),
    PolicyRun("cacheblend-0.05", "cacheblend", 0.05),
    PolicyRun("cacheblend-0.15", "cacheblend", 0.15),
    PolicyRun("cacheblend-0.30", "cacheblend", 0.30),
    PolicyRun("cachecraft", "cachecraft", warm="cachecraft"),
)


class ReadOnlyStore:
    """A warmed store seen by one run: lookups go to ``base``, new variants are dropped.

    The engine still clones the KV it would store (that cost stays in its TTFT).
    """

    def __init__(self, base: KVStore) -> None:
        self.base = base
        self.num_dropped = 0

    def put(self, fingerprint: str, variant: KVVariant) -> None:
        self.num_dropped += 1

    def exact(self, fingerprint: str, segment_id: str, context: str) -> KVVariant | None:
        return self.base.exact(fingerprint, segment_id, context)

    def variants(self, fingerprint: str, segment_id: str) -> list[KVVariant]:
        return self.base.variants(fingerprint, segment_id)


def warm_store(
    lm: LoadedModel, segments: Sequence[TokenSegment], policy: Policy = "full"
) -> MemoryKVStore:
    """A fresh store holding every chunk of the prompt prefilled right after ``segments[0]``."""
    store = MemoryKVStore()
    engine = ChunkEngine(lm, store)
    for segment in segments[1:]:
        if segment.is_chunk:
            engine.prefill([segments[0], segment], policy)
    return store


def warm_views(
    lm: LoadedModel, segments: Sequence[TokenSegment], runs: Sequence[PolicyRun]
) -> dict[str, ReadOnlyStore]:
    """A read-only view of a freshly warmed store for each warm-up policy of ``runs``."""
    return {
        policy: ReadOnlyStore(warm_store(lm, segments, policy)) for policy in {r.warm for r in runs}
    }
