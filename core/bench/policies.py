"""The policies a benchmark runs, and the warmed stores they all read.

A fresh store per prompt is warmed one of two ways (``cachecraft`` warms its own store
under its own policy, so its variants carry the CFO metadata):

- ``system``: every chunk of the prompt prefilled right after the system prefix, on its
  own.  The prompt then finds the system prefix as its only exact hit and every chunk as
  a variant to move and selectively recompute.
- ``reordered``: as ``system``, and then one earlier request held the same chunks in
  another order (seeded by the prompt), as when another question retrieves the same
  top-k: every chunk has two variants, the earlier request's the more recent.  The
  policies that take the most recent variant place that one; ``cachecraft`` picks the
  variant of lowest CFO (Cache-Craft §3.3), a choice ``system`` never offers.  Only the
  earlier request's chunk variants are kept, so the system prefix stays the only exact
  hit and a chunk that kept its place is placed too (unmoved; its KV is exact only when
  every chunk before it kept its place as well).

Every policy reads the warmed store through :class:`ReadOnlyStore`, so one policy's new
variants never serve another (a ``full`` run would otherwise store the whole prompt
as an exact prefix).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

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


Warmup = Literal["system", "reordered"]


def reordered_request(segments: Sequence[TokenSegment]) -> list[TokenSegment]:
    """An earlier request with the prompt's chunks in another order: the prompt up to its
    last chunk, the chunks shuffled among their places (the text between them stays).

    The order is seeded by the chunk ids, so every warm-up of a prompt sees the same one.
    """
    places = [i for i, segment in enumerate(segments) if segment.is_chunk]
    if not places:
        return list(segments)
    rng = random.Random(" ".join(segments[i].segment_id for i in places))
    order = list(places)
    while len(places) > 1 and order == places:
        rng.shuffle(order)
    earlier = list(segments[: places[-1] + 1])
    for place, source in zip(places, order, strict=True):
        earlier[place] = segments[source]
    return earlier


def warm_store(
    lm: LoadedModel,
    segments: Sequence[TokenSegment],
    policy: Policy = "full",
    warmup: Warmup = "system",
) -> MemoryKVStore:
    """A fresh store warmed for the prompt ``segments`` as ``warmup`` says (module docstring):
    every chunk prefilled right after ``segments[0]``, and for ``reordered`` then the chunk
    variants of the earlier request of :func:`reordered_request`.

    Both are computed fresh, as by two servers or two store lifetimes: a request that
    found the first variants would have reused them and stored no second one.
    """
    store = MemoryKVStore()
    engine = ChunkEngine(lm, store)
    for segment in segments[1:]:
        if segment.is_chunk:
            engine.prefill([segments[0], segment], policy)
    if warmup == "reordered":
        earlier = MemoryKVStore()
        ChunkEngine(lm, earlier).prefill(reordered_request(segments), policy)
        for segment_id in dict.fromkeys(s.segment_id for s in segments if s.is_chunk):
            for variant in earlier.variants(lm.fingerprint, segment_id):
                store.put(lm.fingerprint, variant)
    return store


def warm_views(
    lm: LoadedModel,
    segments: Sequence[TokenSegment],
    runs: Sequence[PolicyRun],
    warmup: Warmup = "system",
) -> dict[str, ReadOnlyStore]:
    """A read-only view of a freshly warmed store for each warm-up policy of ``runs``."""
    return {
        policy: ReadOnlyStore(warm_store(lm, segments, policy, warmup))
        for policy in {r.warm for r in runs}
    }
