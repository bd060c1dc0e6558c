"""``chunkcache bench store``: the tiered store's hit rates and TTFT by tier (issue 5).

Two parts, one report (``store.json``, ``store.md``, ``store-hit-rate.png``):

1. Hit rates.  The bundled multi-turn trace, retrieved (FAISS, k chunks) and arranged by a
   :class:`~chunkcache.core.cache.ChunkCache` (tree order, conversation dedupe ``drop``) as
   the app would, is replayed through ``lru``, ``lfu``, ``pgdsf`` (RAGCache §5.1) and
   ``cachecraft`` (Cache-Craft §3.3) at 10%, 30% and 60% of its working set
   (:func:`chunkcache.core.store.simulate.replay`).  Sizes are the default model's KV bytes;
   PGDSF's cost is the model's measured prefill time fitted to ``T = new (a + b (cached +
   new / 2))``.
2. TTFT.  Seeded 5-chunk RAG prompts whose chunks were all warmed after the system prefix;
   ``cacheblend`` at 0.15 with every hit in host memory, on disk, on disk prefetched while
   queued (RAG-DCache §III, Cache-Craft §3.5), in Redis, and no cache (``full``).  Each
   measurement gets a fresh store, so nothing a run stores serves the next one.
"""

from __future__ import annotations

import contextlib
import shutil
import socket
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from chunkcache.core.bench.rag_prompts import build_rag_prompts
from chunkcache.core.bench.report import CpuMeter, environment, summarize
from chunkcache.core.bench.store_report import markdown, plot_hit_rates
from chunkcache.core.cache import ChunkCache
from chunkcache.core.corpus import CorpusChunk, load_corpus
from chunkcache.core.engine import ChunkEngine, TokenSegment
from chunkcache.core.generation import Policy
from chunkcache.core.kv_store import KVVariant, MemoryKVStore
from chunkcache.core.models import LoadedModel, load_model
from chunkcache.core.store import MemoryTier, TieredKVStore
from chunkcache.core.store.disk import DiskTier
from chunkcache.core.store.simulate import Request, linear_prefill_cost, replay
from chunkcache.core.tokenization import SegmentTokenizer
from chunkcache.core.workload import Turn, WorkloadConfig, multi_turn_trace

POLICIES = ("lru", "lfu", "pgdsf", "cachecraft")
CAPACITIES = (0.1, 0.3, 0.6)  # shares of the working set
CONFIGS = ("host", "host+queue", "disk", "disk+prefetch", "redis", "full")
QUEUED = ("host+queue", "disk+prefetch")  # served right after another request's full prefill
TARGET_PREFETCH_RATIO = 1.2  # issue 5: disk-hit TTFT with prefetch <= 1.2 x host-hit TTFT
BIG = 2**40  # a tier that never evicts in this benchmark
Retrieve = Callable[[str, int], Sequence[str]]  # question, k -> chunk ids, best first
PrefillCost = Callable[[int, int], float]  # (cached, new tokens) -> seconds


@dataclass(frozen=True)
class StoreBenchConfig:
    """What one store benchmark run measures, and where it writes."""

    conversations: int = 200  # of the multi-turn trace
    k: int = 5
    prompts: int = 10  # TTFT prompts
    rounds: int = 3
    seed: int = 0
    out: Path = field(default_factory=lambda: Path("docs/benchmarks"))


def quick(config: StoreBenchConfig) -> StoreBenchConfig:
    """A smoke-test run: a short trace, 2 prompts, 1 round."""
    return StoreBenchConfig(20, config.k, 2, 1, config.seed, config.out)


# -- hit rates ------------------------------------------------------------------------------


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


# -- TTFT by tier ---------------------------------------------------------------------------


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


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextlib.contextmanager
def redis_server(folder: Path) -> Iterator[str | None]:
    """A throwaway ``redis-server`` on a free loopback port, no persistence; its url, or
    None when the binary is absent."""
    binary = shutil.which("redis-server")
    if binary is None:
        yield None
        return
    port = free_port()
    args = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", ""]
    args += ["--appendonly", "no", "--dir", str(folder)]
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                break
            except OSError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise RuntimeError("redis-server did not start") from None
                time.sleep(0.05)
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        proc.kill()
        proc.wait()


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
        if config in ("disk", "disk+prefetch"):
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
) -> tuple[float, dict[str, Any], bool]:
    """TTFT of one request under ``config`` on a fresh store, its metrics, and whether a
    prefetch (``disk+prefetch`` only) had finished when the request started.

    ``disk+prefetch`` issues the prefetch when the request is queued, then the engine serves
    the request ahead of it (a full prefill of ``before``) while the chunks move up
    (RAG-DCache §III); ``host+queue`` serves the same request ahead with no prefetch, the
    host-hit TTFT under the same conditions (a long prefill just before changes the CPU's
    caches and the allocator's state)."""
    store = setup.store(config)
    engine.store = store
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
    engine.prefill(segments, policy, 0.15)
    seconds = time.perf_counter() - started
    store.flush()
    metrics = store.metrics()
    store.close()
    return seconds, metrics, prefetched


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
    with redis_server(folder) as url:
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
        for round_index in range(rounds):
            for index, segments in enumerate(prompts):
                turn = (round_index + index) % len(configs)
                for config in configs[turn:] + configs[:turn]:
                    before = prompts[(index + 1) % len(prompts)]
                    took, metrics, ready = timed_request(engine, setup, config, segments, before)
                    seconds[config].append(took)
                    _add_metrics(totals[config], metrics)
                    done[config] += ready
                progress(
                    f"ttft round {round_index + 1} prompt {index + 1}: "
                    + ", ".join(f"{c} {1e3 * seconds[c][-1]:.0f} ms" for c in configs)
                )
        cpu = meter.share()
    return {
        "configs": _summaries(seconds, totals, done),
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
    seconds: dict[str, list[float]], totals: dict[str, dict[str, Any]], done: dict[str, int]
) -> dict[str, Any]:
    out = {}
    for config, values in seconds.items():
        row: dict[str, Any] = {"ms": summarize([1e3 * s for s in values]), "samples": len(values)}
        for base in ("host", "full"):
            ratios = [s / b for s, b in zip(values, seconds[base], strict=True)]
            row[f"ratio_to_{base}"] = statistics.median(ratios)
        row["store"] = totals[config]
        if config == "disk+prefetch":
            row["prefetch_done_before_start"] = done[config] / len(values)
        out[config] = row
    return out


# -- the run --------------------------------------------------------------------------------


def corpus_ids_search(question: str, k: int) -> list[str]:
    """Chunk ids of the ``k`` nearest corpus chunks (FAISS over MiniLM), best first."""
    from chunkcache.integrations.indexes import search_corpus

    return [chunk.chunk_id for chunk, _ in search_corpus(question, "faiss", k)]


def corpus_search(question: str, k: int) -> list[CorpusChunk]:
    from chunkcache.integrations.indexes import search_corpus

    return [chunk for chunk, _ in search_corpus(question, "faiss", k)]


def kv_bytes_per_token(lm: LoadedModel) -> int:
    """Bytes of one token's k and v over every layer, in the model's dtype."""
    s = lm.spec
    return 2 * s.num_layers * s.num_kv_heads * s.head_dim * lm.dtype.itemsize


def run_store_bench(
    config: StoreBenchConfig, command: str, progress: Callable[[str], None]
) -> dict[str, Any]:
    """Both parts; writes ``store.json``, ``store.md`` and the hit-rate PNG under ``out``."""
    import json

    torch.manual_seed(config.seed)
    meter = CpuMeter()
    lm = load_model(dtype=torch.bfloat16)
    corpus = load_corpus()
    tokenize = SegmentTokenizer(lm.tokenizer)
    prompts = build_rag_prompts(corpus, corpus_search, lm.tokenizer, config.prompts, config.seed)
    segments = [tokenize(p.segments) for p in prompts]
    ids = [t for s in segments[0] for t in s.ids]
    lengths = [n for n in (256, 640, 1024) if n <= len(ids)] or [len(ids)]
    samples = measure_prefill(lm, ids, lengths)
    cost: PrefillCost = linear_prefill_cost
    cost_note = "the default `linear_prefill_cost`"
    if len(samples) >= 2:
        a, b = fit_prefill_cost(samples)
        cost = fitted_cost(a, b)
        cost_note = f"fitted to measured full prefills: a = {a:.3g} s/token, b = {b:.3g} s/token²"
    progress(f"prefill samples {samples}; cost: {cost_note}")
    texts = {chunk.chunk_id: chunk.text for chunk in corpus}
    token_counts: dict[str, int] = {}

    def num_tokens(chunk_id: str) -> int:
        if chunk_id not in token_counts:
            token_counts[chunk_id] = len(tokenize.encode(texts[chunk_id]))
        return token_counts[chunk_id]

    workload = WorkloadConfig(num_conversations=config.conversations, seed=config.seed)
    turns = multi_turn_trace(corpus, workload)
    requests = trace_requests(turns, corpus_ids_search, num_tokens, config.k)
    progress(f"trace: {len(turns)} turns, {len(requests)} requests with chunks")
    hits = hit_rates(requests, kv_bytes_per_token(lm), cost)
    with tempfile.TemporaryDirectory(prefix="chunkcache-bench-store-") as folder:
        ttft = ttft_by_tier(lm, segments, config.rounds, Path(folder), progress)
    lengths_all = [sum(len(s.ids) for s in p) for p in segments]
    chunk_tokens = [len(s.ids) for p in segments for s in p if s.is_chunk]
    report: dict[str, Any] = {
        "command": command,
        "environment": {
            **environment(("torch", "transformers", "redis")),
            "threads": str(torch.get_num_threads()),
        },
        "model": "SmolLM2-135M-Instruct",
        "fingerprint": lm.fingerprint,
        "dtype": "bfloat16",
        "seed": config.seed,
        "config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(config).items()},
        "hit_rates": {
            **hits,
            "turns": len(turns),
            "requests": len(requests),
            "bytes_per_token": kv_bytes_per_token(lm),
            "prefill_cost": cost_note,
            "prefill_samples": samples,
        },
        "ttft": {
            **ttft,
            "prompt_tokens": summarize(lengths_all),
            "chunk_tokens": summarize(chunk_tokens),
            "rounds": config.rounds,
            "prompts": len(segments),
        },
        "cpu": meter.share(),
    }
    prefetch = ttft["configs"]["disk+prefetch"]["ms"]["median"]
    host = ttft["configs"]["host"]["ms"]["median"]
    queued = ttft["configs"]["host+queue"]["ms"]["median"]
    report["target"] = {
        "label": f"disk+prefetch TTFT <= {TARGET_PREFETCH_RATIO} x host TTFT (medians)",
        "measured": prefetch / host,
        "met": prefetch / host <= TARGET_PREFETCH_RATIO,
        "measured_vs_host_queue": prefetch / queued,
        "met_vs_host_queue": prefetch / queued <= TARGET_PREFETCH_RATIO,
    }
    config.out.mkdir(parents=True, exist_ok=True)
    report["plots"] = plot_hit_rates(report, config.out)
    (config.out / "store.json").write_text(json.dumps(report, indent=2) + "\n")
    (config.out / "store.md").write_text(markdown(report))
    return report
