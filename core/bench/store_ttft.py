"""TTFT with every chunk hit in one tier: host, disk, disk prefetched, Redis, no cache.

Seeded 5-chunk RAG prompts whose chunks were all warmed after the system prefix run
``cacheblend`` at 0.15 with every hit in host memory, on disk (the engine's default: on a
CPU every layer read, then compute), on disk read layer by layer behind compute
(``disk, pipelined``: the engine's ``layer_loading=True``), on disk prefetched while
queued (RAG-DCache §III, Cache-Craft §3.5), in Redis, and with no cache (``full``).  Each
measurement gets a fresh store, so nothing a run stores serves the next one.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from chunkcache.core.bench.report import CpuMeter, summarize
from chunkcache.core.engine import ChunkEngine, TokenSegment
from chunkcache.core.generation import Policy
from chunkcache.core.kv_store import KVVariant, MemoryKVStore
from chunkcache.core.models import LoadedModel
from chunkcache.core.store import MemoryTier, TieredKVStore
from chunkcache.core.store.disk import DiskTier
from chunkcache.core.store.redis_server import REDIS_SERVER, redis_server

CONFIGS = ("host", "host+queue", "disk", "disk, pipelined", "disk+prefetch", "redis", "full")
DISK = ("disk", "disk, pipelined", "disk+prefetch")  # an empty host tier over the disk tier
QUEUED = ("host+queue", "disk+prefetch")  # served right after another request's full prefill
BIG = 2**40  # a tier that never evicts in this benchmark


class _Recorder(MemoryKVStore):
    """A memory store that also keeps every variant put, for copying into other stores."""

    def __init__(self) -> None:
        super().__init__(BIG)
        self.recorded: dict[tuple[str, str], KVVariant] = {}

    def put(self, fingerprint: str, variant: KVVariant) -> None:
        super().put(fingerprint, variant)
        self.recorded[(variant.segment_id, variant.context)] = variant


def warm_variants(lm: LoadedModel, prompts: Sequence[Sequence[TokenSegment]]) -> list[KVVariant]:
    """Every chunk of every prompt prefilled right after the system prefix (as
    :func:`chunkcache.core.bench.policies.warm_store`), and the prefix itself."""
    recorder = _Recorder()
    engine = ChunkEngine(lm, recorder)
    for segments in prompts:
        for segment in segments[1:]:
            if segment.is_chunk:
                engine.prefill([segments[0], segment], "full")
    return list(recorder.recorded.values())


@contextlib.contextmanager
def optional_redis(folder: Path) -> Iterator[str | None]:
    """A throwaway Redis's url, or None when ``redis-server`` is not installed."""
    if REDIS_SERVER is None:
        yield None
        return
    with redis_server(folder) as (url, _):
        yield url


class TierSetup:
    """The stores each configuration runs on, all holding the same warmed variants."""

    def __init__(self, fingerprint: str, variants: Sequence[KVVariant], folder: Path) -> None:
        self.fingerprint, self.variants, self.disk_dir = fingerprint, variants, folder / "kv"
        self.redis_url: str | None = None
        disk = TieredKVStore([DiskTier(self.disk_dir, BIG)])
        for variant in variants:
            disk.put(fingerprint, variant)
        disk.close()

    def fill_redis(self, url: str) -> None:
        from chunkcache.core.store.redis_tier import RedisTier

        self.redis_url = url
        shared = TieredKVStore([RedisTier(url, BIG)])
        for variant in self.variants:
            shared.put(self.fingerprint, variant)
        shared.close()

    def store(self, config: str) -> TieredKVStore:
        """A fresh store for one measurement: host holds everything (``host``), nothing
        (``full``), or nothing above a lower tier that holds everything."""
        host = MemoryTier("host", BIG)
        if config in ("host", "host+queue"):
            store = TieredKVStore([host])
            for variant in self.variants:
                store.put(self.fingerprint, variant)
            return store
        if config in DISK:
            return TieredKVStore([host, DiskTier(self.disk_dir, BIG)])
        if config == "redis":
            from chunkcache.core.store.redis_tier import RedisTier

            assert self.redis_url is not None
            return TieredKVStore([host, RedisTier(self.redis_url, BIG)])
        return TieredKVStore([host])


def timed_request(
    engine: ChunkEngine,
    setup: TierSetup,
    config: str,
    segments: Sequence[TokenSegment],
    before: Sequence[TokenSegment],
) -> tuple[float, dict[str, Any], bool, bool]:
    """TTFT of one request under ``config`` on a fresh store, its metrics, whether a
    prefetch (``disk+prefetch`` only) had finished when the request started, and whether
    the request placed its chunks layer by layer behind compute.

    ``disk, pipelined`` runs the engine with ``layer_loading=True``: each layer of every hit
    is read (and verified) in the loader thread while the layer before it computes, next
    to ``disk``'s default (on a CPU: every layer read before compute starts).

    ``disk+prefetch`` issues the prefetch when the request is queued, then the engine serves
    the request ahead of it (a full prefill of ``before``) while the chunks move up
    (RAG-DCache §III); ``host+queue`` serves the same request ahead with no prefetch, the
    host-hit TTFT under the same conditions (a long prefill just before changes the CPU's
    caches and the allocator's state)."""
    store = setup.store(config)
    engine.store = store
    engine.layer_loading = True if config == "disk, pipelined" else None
    prefetched = False
    if config in QUEUED:
        future = None
        if config == "disk+prefetch":
            chunk_ids = [s.segment_id for s in segments if s.is_chunk]
            future = store.prefetch(setup.fingerprint, [segments[0].segment_id, *chunk_ids])
        engine.prefill(before, "full")  # the request ahead of it in the queue
        prefetched = future is not None and future.done()
    policy: Policy = "full" if config == "full" else "cacheblend"
    started = time.perf_counter()
    prefilled = engine.prefill(segments, policy, 0.15)
    seconds = time.perf_counter() - started
    store.flush()
    metrics = store.metrics()
    store.close()
    return seconds, metrics, prefetched, "layer_loading" in prefilled.stats.extra


def ttft_by_tier(
    lm: LoadedModel,
    prompts: Sequence[Sequence[TokenSegment]],
    rounds: int,
    folder: Path,
    progress: Callable[[str], None],
) -> dict[str, Any]:
    """Every configuration on every prompt, ``rounds`` times, order rotated per prompt and
    round; medians/p99 over prompts x rounds, paired ratios, summed store metrics."""
    setup = TierSetup(lm.fingerprint, warm_variants(lm, prompts), folder)
    skipped = []
    with optional_redis(folder) as url:
        configs = list(CONFIGS)
        if url is None:
            configs.remove("redis")
            skipped.append("redis: `redis-server` is not installed, no Redis configuration")
        else:
            setup.fill_redis(url)
        engine = ChunkEngine(lm)
        for config in configs:  # discarded warm-up
            timed_request(engine, setup, config, prompts[0], prompts[-1])
        meter = CpuMeter()
        seconds: dict[str, list[float]] = {c: [] for c in configs}
        totals: dict[str, dict[str, Any]] = {c: {} for c in configs}
        done = {c: 0 for c in configs}
        piped = {c: 0 for c in configs}
        for round_index in range(rounds):
            for index, segments in enumerate(prompts):
                turn = (round_index + index) % len(configs)
                for config in configs[turn:] + configs[:turn]:
                    before = prompts[(index + 1) % len(prompts)]
                    took, metrics, ready, layered = timed_request(
                        engine, setup, config, segments, before
                    )
                    seconds[config].append(took)
                    _add_metrics(totals[config], metrics)
                    done[config] += ready
                    piped[config] += layered
                progress(
                    f"ttft round {round_index + 1} prompt {index + 1}: "
                    + ", ".join(f"{c} {1e3 * seconds[c][-1]:.0f} ms" for c in configs)
                )
        cpu = meter.share()
    return {
        "configs": _summaries(seconds, totals, done, piped),
        "cpu": cpu,
        "skipped": skipped,
        "warmed_variants": len(setup.variants),
    }


def _add_metrics(total: dict[str, Any], metrics: dict[str, Any]) -> None:
    """Sum the counters of one measurement's store into ``total`` (gauges left out)."""
    for name, counts in metrics["tiers"].items():
        tier = total.setdefault(name, {})
        for counter in ("hits", "misses", "promotions", "prefetched", "load_seconds"):
            tier[counter] = tier.get(counter, 0) + counts[counter]
        tier["bytes_loaded"] = tier.get("bytes_loaded", 0) + counts["bytes_loaded"]


def _summaries(
    seconds: dict[str, list[float]],
    totals: dict[str, dict[str, Any]],
    done: dict[str, int],
    piped: dict[str, int],
) -> dict[str, Any]:
    out = {}
    for config, values in seconds.items():
        row: dict[str, Any] = {"ms": summarize([1e3 * s for s in values]), "samples": len(values)}
        for base in ("host", "full", "disk"):
            ratios = [s / b for s, b in zip(values, seconds[base], strict=True)]
            row[f"ratio_to_{base}"] = statistics.median(ratios)
        row["pipelined"] = piped[config] / len(values)
        row["store"] = totals[config]
        if config == "disk+prefetch":
            row["prefetch_done_before_start"] = done[config] / len(values)
        out[config] = row
    return out
