"""What each benchmark report says, as sentences computed from its JSON.

Each ``*_findings`` function reads one report (as written by its ``chunkcache bench``
command) and returns :class:`Finding` s: a win, a loss or an even result, each with the
figures that back it.  Nothing here is typed in by hand: every number comes from the
report, and a sentence changes when a re-run changes the figures.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from chunkcache.core.bench.report import tail_label

Verdict = Literal["win", "loss", "even"]
Report = dict[str, Any]

# Within this band of 1.0 a ratio of medians is reported as even (run-to-run noise on a
# shared 2-core machine is of this order).
EVEN_BAND = 0.05


@dataclass(frozen=True)
class Finding:
    """One reading of a report: ``verdict``, what it says, and what to do about it."""

    report: str
    verdict: Verdict
    text: str
    next_step: str | None = None


def verdict_of(ratio: float, lower_is_better: bool = True) -> Verdict:
    """Win/loss/even of a chunkcache-over-baseline ratio."""
    if abs(ratio - 1.0) <= EVEN_BAND:
        return "even"
    return "win" if (ratio < 1.0) == lower_is_better else "loss"


def engine_findings(report: Report) -> list[Finding]:
    """engine.json: recompute policies against full prefill (quality in float32, TTFT in bf16)."""
    found = [
        Finding(
            "engine",
            "win" if target["met"] else "loss",
            f"{'Met' if target['met'] else 'Missed'}: {target['target']} "
            f"(measured {_number(target['measured'])}{target['unit'] and ' ' + target['unit']}).",
        )
        for target in report.get("targets", [])
    ]
    speed = report.get("speed", {}).get("summary", {})
    quality = report.get("quality", {}).get("summary", {})
    blend = "cacheblend-0.15"
    if blend in speed and blend in quality:
        ratio = speed[blend]["ratio_to_full"]["median"]
        share = quality[blend]["token_layer_share"]["mean"]
        if ratio > 1.25 * share:
            found.append(
                Finding(
                    "engine",
                    "loss",
                    f"{blend} computes {share:.0%} of the prompt's token-layers (mean over "
                    f"prompts, quality part) but takes {ratio:.2f}x full prefill's time "
                    "(median of per-prompt ratios, speed part): "
                    f"{ratio / share:.1f}x what its compute share alone would cost.",
                    "Cut the per-row cost of recomputing scattered rows (attention over a "
                    "merged KV, K/V moves): that overhead, not the ratio, holds TTFT up.",
                )
            )
    if "prefix" in speed:
        ratio = speed["prefix"]["ratio_to_full"]["median"]
        verdict = verdict_of(ratio)
        if verdict != "win":
            found.append(
                Finding(
                    "engine",
                    verdict,
                    f"`prefix` (exact prefix reuse only) runs at {ratio:.2f}x full prefill in "
                    "this set-up, where only the system prompt is a prefix hit.",
                    "Prefill after a short prefix hit should cost what one causal prefill costs."
                    if verdict == "loss"
                    else None,
                )
            )
    return found


def retriever_findings(report: Report) -> list[Finding]:
    """retriever.json: CRAFT ordering (Prefix/Total) and the wrapper's overhead."""
    orderings = report.get("ordering", {}).get("orderings", {})
    found: list[Finding] = []
    if "tree" in orderings and "retriever" in orderings:
        tree, plain = orderings["tree"], orderings["retriever"]
        ratio = tree["prefix"] / plain["prefix"]
        found.append(
            Finding(
                "retriever",
                verdict_of(ratio, lower_is_better=False),
                # CRAFT's Prefix and Total count chunks, not tokens.
                f"Tree ordering turns {tree['prefix'] / tree['total']:.0%} of the reusable "
                f"chunks into prefix hits against {plain['prefix'] / plain['total']:.0%} "
                f"in retriever order ({ratio:.2f}x).",
            )
        )
    added = report.get("overhead", {}).get("added_ms")
    if added:
        found.append(
            Finding(
                "retriever",
                "even",
                f"The retriever wrapper adds {added['p50']:.2f} ms at p50 and "
                f"{added['p99']:.2f} ms at p99 per request.",
            )
        )
    return found


def store_findings(report: Report) -> list[Finding]:
    """store.json: TTFT by the tier that holds the hits, and policy hit rates."""
    found: list[Finding] = []
    configs = report.get("ttft", {}).get("configs", {})
    target = report.get("target")
    if "disk+prefetch" in configs:
        # The report's own target (a ratio of medians) decides, so this says what store.md says.
        ratio = target["measured"] if target else configs["disk+prefetch"]["ratio_to_host"]
        met = target["met"] if target else ratio <= 1.2
        found.append(
            Finding(
                "store",
                "win" if met else "loss",
                f"{'Met' if met else 'Missed'}: disk hits with prefetch take {ratio:.2f}x the "
                "TTFT of host-memory hits (target at most 1.2x).",
                None if met else "Start loading earlier or layer by layer (Cache-Craft §3.5).",
            )
        )
    if "full" in configs:
        full = configs["full"]
        speedup = full["ratio_to_host"]  # median over (prompt, round) pairs of full / host
        pairs = f"median of {full['samples']} paired" if "samples" in full else "paired median of"
        found.append(
            Finding(
                "store",
                verdict_of(1 / speedup),
                f"A prompt whose 5 chunks are all host-memory hits reaches its first token "
                f"{speedup:.1f}x sooner than with no cache ({pairs} measurements).",
            )
        )
    rows = report.get("hit_rates", {}).get("rows", [])
    for share in sorted({row["capacity_share"] for row in rows}):
        at = {row["policy"]: row["hit_rate"] for row in rows if row["capacity_share"] == share}
        top = max(at.values())
        best = [policy for policy, rate in at.items() if rate == top]  # ties all named
        if "lru" in at and at["lru"] > 0:
            ratio = top / at["lru"]
            found.append(
                Finding(
                    "store",
                    verdict_of(ratio, lower_is_better=False),
                    f"At {share:.0%} of the working set {_best_policies(best)} "
                    f"({top:.0%} hits, {ratio:.2f}x LRU's {at['lru']:.0%}).",
                )
            )
    return found


def rag_findings(report: Report) -> list[Finding]:
    """rag.json: whole RAG requests, every system side by side."""
    found: list[Finding] = []
    for workload, result in report.get("workloads", {}).items():
        figures = result["figures"]
        found.extend(_rag_speed(workload, figures))
        found.extend(_rag_against_vllm(workload, figures))
        found.extend(_rag_accuracy(workload, figures))
    for line in report.get("skipped", []):
        found.append(Finding("rag", "even", f"Skipped: {line}."))
    return found


def _best_policies(names: list[str]) -> str:
    """``the best policy is lfu``, or for a tie ``lfu, pgdsf and cachecraft tie for best``."""
    if len(names) == 1:
        return f"the best policy is {names[0]}"
    return f"{', '.join(names[:-1])} and {names[-1]} tie for best"


# The system a user gets by default: the engine's default policy on chunkcache's layout.
DEFAULT_SYSTEM = "cacheblend-0.15 / chunkcache"


def _rag_speed(workload: str, figures: dict[str, Any]) -> list[Finding]:
    found: list[Finding] = []
    ours = figures.get(DEFAULT_SYSTEM)
    if ours is None:
        return found
    for baseline in ("hf generate / plain", "full / plain"):
        if baseline in figures:
            ratio = ours["ttft_s"]["median"] / figures[baseline]["ttft_s"]["median"]
            found.append(
                Finding(
                    "rag",
                    verdict_of(ratio),
                    f"{workload}: {DEFAULT_SYSTEM} has a median TTFT {ratio:.2f}x that of "
                    f"{baseline} ({ours['ttft_s']['median'] * 1000:.0f} ms against "
                    f"{figures[baseline]['ttft_s']['median'] * 1000:.0f} ms); it computes "
                    f"{ours['computed_share']:.0%} of its prompt tokens" + _rag_kl(ours) + ".",
                )
            )
    plain = figures.get("cacheblend-0.15 / plain")
    if plain:
        ratio = ours["ttft_s"]["median"] / plain["ttft_s"]["median"]
        longer = ours["prompt_tokens"] / plain["prompt_tokens"]
        found.append(
            Finding(
                "rag",
                verdict_of(ratio),
                f"{workload}: chunkcache's layout computes {ours['computed_share']:.0%} of "
                f"prompt tokens against {plain['computed_share']:.0%} with the plain layout, "
                f"and its median TTFT is {ratio:.2f}x the plain layout's (both cacheblend "
                f"0.15); its prompts hold {longer:.2f}x the plain layout's tokens.",
                "Keep the layout's prompts as short as the plain layout's: the tokens it "
                "saves are spent on the longer prompt."
                if longer > 1 + EVEN_BAND and ratio > 1 - EVEN_BAND
                else None,
            )
        )
    return found


def _rag_kl(row: dict[str, Any]) -> str:
    """The system's teacher-forced KL and top-1 agreement against full, if scored."""
    if row.get("tf_kl_vs_full") is None:
        return ""
    scored = len(row["logit_quality"]["scored_requests"])
    return (
        f", at a teacher-forced KL of {row['tf_kl_vs_full']:.3f} from full prefill of the same "
        f"prompts (top-1 agreement {row['tf_top1_vs_full']:.0%}, {scored} requests)"
    )


VLLM_PREFIX_SYSTEM = "vLLM prefix caching on / plain"


def _rag_against_vllm(workload: str, figures: dict[str, Any]) -> list[Finding]:
    """The default system against vLLM with prefix caching, same model and requests."""
    ours, vllm = figures.get(DEFAULT_SYSTEM), figures.get(VLLM_PREFIX_SYSTEM)
    if ours is None or vllm is None:
        return []
    throughput = ours["queue"]["throughput_rps"] / vllm["queue"]["throughput_rps"]
    ttft = ours["ttft_s"]["median"] / vllm["ttft_s"]["median"]
    quality = "; ".join(
        f"{label} {ours[key]:.2f} against {vllm[key]:.2f}"
        for key, label in (("accuracy", "exact match"), ("rouge_l_vs_full", "ROUGE-L vs full"))
        if ours.get(key) is not None and vllm.get(key) is not None
    )
    return [
        Finding(
            "rag",
            verdict_of(throughput, lower_is_better=False),
            f"{workload}: {DEFAULT_SYSTEM} serves {throughput:.2f}x the requests per second of "
            f"{VLLM_PREFIX_SYSTEM} under the same Poisson arrivals, at {ttft:.2f}x its median "
            f"TTFT" + (f" ({quality})." if quality else "."),
        )
    ]


def _rag_accuracy(workload: str, figures: dict[str, Any]) -> list[Finding]:
    scored = {name: row for name, row in figures.items() if "accuracy" in row}
    if not scored:
        return []
    by_layout: dict[str, list[float]] = {}
    for name, row in scored.items():
        by_layout.setdefault(name.rsplit(" / ", 1)[-1], []).append(row["accuracy"])
    means = {layout: sum(a) / len(a) for layout, a in by_layout.items()}
    parts = ", ".join(f"{layout} layout {mean:.0%}" for layout, mean in sorted(means.items()))
    text = f"{workload}: gold-answer exact match, mean over systems: {parts}"
    reference_row = scored.get("full / plain")
    if reference_row is None:
        return [Finding("rag", "even", text + ".")]
    reference, questions = reference_row["accuracy"], reference_row["requests"]
    worst = min(means.values())
    # Two standard errors of the difference of two accuracies over ``questions`` answers.
    noise = 2 * ((reference * (1 - reference) + worst * (1 - worst)) / questions) ** 0.5
    text += f" (full prefill, plain layout: {reference:.0%}; over {questions} questions "
    if reference - worst > noise:
        return [
            Finding(
                "rag",
                "loss",
                text + f"a gap over twice its standard error, {noise:.0%}).",
                "Find out why one layout loses answers that full prefill gets: chunkcache's "
                "layout differs in chunk order (frequency ordering moves often-retrieved "
                "chunks ahead of the retriever's first) and in where the chunks sit (the "
                "user turn, not the system message); measure each alone.",
            )
        ]
    return [
        Finding(
            "rag",
            "even",
            text + f"a gap within twice its standard error, {noise:.0%}).",
            f"Run more gold questions: {questions} cannot tell the layouts apart."
            if reference - worst > 0
            else None,
        )
    ]


def vllm_findings(report: Report) -> list[Finding]:
    """vllm.json: vLLM's prefix-cache hits with chunkcache's layout vs plain LangChain."""
    found: list[Finding] = []
    for workload, result in report.get("workloads", {}).items():
        ratios = result["ratios"]
        target, cached = ratios["target_cached_share"], ratios["cached_share"]
        met = cached >= target
        found.append(
            Finding(
                "vllm",
                "win" if met else "loss",
                f"{'Met' if met else 'Missed'}: {workload}: with chunkcache's ordering and "
                f"layout vLLM reports {cached:.2f}x the plain app's share of cached prompt "
                f"tokens (target at least {target}x).",
                None if met else "Line more of each prompt up as a prefix of the last one.",
            )
        )
        throughput = ratios["closed_loop_throughput"]
        found.append(
            Finding(
                "vllm",
                verdict_of(throughput, lower_is_better=False),
                f"{workload}: on vLLM the chunkcache app serves {throughput:.2f}x the plain "
                f"app's requests per second, at {ratios['ttft_p50']:.2f}x its median TTFT.",
            )
        )
    return found


def serve_findings(report: Report) -> list[Finding]:
    """serve.json: the bounded load test of ``chunkcache serve`` over loopback."""
    counts, config = report["counts"], report["config"]
    ttft, throughput = report["ttft_s"], report["throughput"]
    found = [
        Finding(
            "serve",
            "win" if report["ok"] else "loss",
            f"{config['clients']} clients for {config['duration_s']:.0f} s"
            f"{_warmup(config)}: "
            f"{counts['completed']} of {counts['requests']} requests completed, "
            f"{counts['rejected_429']} answered 429, {counts['errors']} errors, "
            f"{counts['lost']} lost, {counts['answered_twice']} answered twice; "
            f"{throughput['requests_per_s']:.2f} requests/s, TTFT p50 "
            f"{ttft.get('p50', 0):.2f} s and {tail_label([ttft.get('n')])} "
            f"{ttft.get('p99', 0):.2f} s.",
            None if report["ok"] else "Find what failed or lost requests under load.",
        )
    ]
    memory = report.get("memory", {})
    if "flat" in memory:
        found.append(
            Finding(
                "serve",
                "win" if memory["flat"] else "loss",
                f"Resident memory after warm-up grew by {memory['growth_mib']:.0f} MiB "
                f"(from {memory['early_mib']:.0f} MiB)"
                + ("; flat." if memory["flat"] else ": not flat."),
                None if memory["flat"] else "Find what the server keeps per request.",
            )
        )
    return found


def _warmup(config: dict[str, Any]) -> str:
    """The load test's warm-up, when it had one: its requests are in the counts, not in the
    throughput and TTFT (those are of the measured window after it)."""
    warmup = config.get("warmup_s") or 0
    if not warmup:
        return ""
    return f" after {warmup:.0f} s of warm-up (counts include the warm-up's requests)"


def _number(value: float) -> str:
    return f"{value:.3g}" if abs(value) < 100 else f"{value:.0f}"


# The reports ``docs/benchmarks/README.md`` reads, in the order it shows them.
FINDERS: dict[str, Callable[[Report], list[Finding]]] = {
    "retriever": retriever_findings,
    "engine": engine_findings,
    "store": store_findings,
    "rag": rag_findings,
    "vllm": vllm_findings,
    "serve": serve_findings,
}
