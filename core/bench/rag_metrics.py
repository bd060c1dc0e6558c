"""Per-system figures of a RAG benchmark run, from the records each request left.

Throughput under Poisson arrivals is a queue simulation over the measured service
times: the engine serves one request at a time in process, so a request arriving
while another runs waits for it (first come, first served).  Arrival times are
seeded and the same for every system.
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Sequence
from typing import Any

from chunkcache.core.bench.gold import score_answers
from chunkcache.core.bench.rag_bench import Record
from chunkcache.core.bench.rag_workload import BenchRequest
from chunkcache.core.bench.report import summarize
from chunkcache.core.bench.scoring import rouge_l_f1
from chunkcache.core.metrics import prefix_metric, total_metric


def poisson_arrivals(count: int, rate: float, seed: int) -> list[float]:
    """``count`` arrival times (s) of a Poisson process of ``rate`` requests per second."""
    if rate <= 0:
        raise ValueError(f"rate must be positive, got {rate}")
    rng = random.Random(f"arrivals/{seed}")
    times, now = [], 0.0
    for _ in range(count):
        now += rng.expovariate(rate)
        times.append(now)
    return times


def fifo_queue(arrivals: Sequence[float], service_s: Sequence[float]) -> dict[str, Any]:
    """One server, first come first served: throughput and latency (wait + service)."""
    finish = 0.0
    latencies = []
    for arrival, service in zip(arrivals, service_s, strict=True):
        finish = max(finish, arrival) + service
        latencies.append(finish - arrival)
    span = finish - arrivals[0] if arrivals else 0.0
    return {
        "throughput_rps": len(arrivals) / span if span > 0 else 0.0,
        "latency_s": summarize(latencies),
        "utilisation": sum(service_s) / span if span > 0 else 0.0,
    }


def system_figures(
    records: Sequence[Record],
    requests: Sequence[BenchRequest],
    arrivals: Sequence[float],
    reference: Sequence[Record] | None,
) -> dict[str, Any]:
    """TTFT, end-to-end latency, queueing, token shares, reuse metrics and quality."""
    stats = [r.stats for r in records]
    prompt = sum(s["prompt_tokens"] for s in stats)
    figures: dict[str, Any] = {
        "requests": len(records),
        "ttft_s": summarize([s["ttft_s"] for s in stats]),
        "e2e_s": summarize([s["total_s"] for s in stats]),
        "queue": fifo_queue(arrivals, [s["total_s"] for s in stats]),
        "prompt_tokens": prompt,
        "computed_share": sum(s["computed_tokens"] + s["recomputed_tokens"] for s in stats)
        / max(prompt, 1),
        "reused_share": sum(s["reused_tokens"] for s in stats) / max(prompt, 1),
        "chunk_hit_rate": _hit_rate(stats),
        "tier_hit_rates": tier_hit_rates(stats),
        "craft_prefix": prefix_metric([r.chunk_ids for r in records if r.chunk_ids]),
        "craft_total": total_metric([r.chunk_ids for r in records if r.chunk_ids]),
    }
    if reference is not None:
        figures["rouge_l_vs_full"] = statistics.fmean(
            rouge_l_f1(_words(r.answer), _words(ref.answer))
            for r, ref in zip(records, reference, strict=True)
        )
    if any(q.answer is not None for q in requests):
        score = score_answers(requests, [r.answer for r in records])
        figures["accuracy"] = score.accuracy
        figures["accuracy_by_kind"] = score.by_kind
    return figures


def _hit_rate(stats: Sequence[dict[str, Any]]) -> float | None:
    hits = sum(s["chunk_hits"] for s in stats)
    looked_up = hits + sum(s["chunk_misses"] for s in stats)
    return hits / looked_up if looked_up else None


def tier_hit_rates(stats: Sequence[dict[str, Any]]) -> dict[str, float]:
    """Per tier, the share of the store's lookups it served (the engine's KV store, every
    segment looked up); empty for a system without a tiered store."""
    lookups = 0
    hits: dict[str, int] = {}
    for s in stats:
        store = s.get("extra", {}).get("store", {})
        lookups += store.get("lookups", 0)
        for tier, counts in store.get("tiers", {}).items():
            hits[tier] = hits.get(tier, 0) + counts.get("hits", 0)
    return {tier: count / lookups for tier, count in hits.items()} if lookups else {}


def _words(text: str) -> list[str]:
    return text.lower().split()
