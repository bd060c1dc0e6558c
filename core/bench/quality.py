"""Quality of every policy against a full prefill, prompt by prompt and summarized.

Run it in float32: it measures the recompute policies, not bfloat16 rounding.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Collection, Sequence
from typing import Any

import torch

from chunkcache.core.bench.policies import FULL, POLICY_RUNS, PolicyRun, warm_views
from chunkcache.core.bench.rag_prompts import RagPrompt
from chunkcache.core.bench.report import summarize
from chunkcache.core.bench.scoring import greedy, kl_divergence, rouge_l_f1, teacher_forced
from chunkcache.core.engine import ChunkEngine, TokenSegment
from chunkcache.core.models import LoadedModel
from chunkcache.core.tokenization import SegmentTokenizer

Progress = Callable[[str], None]


def prompt_quality(
    lm: LoadedModel,
    segments: Sequence[TokenSegment],
    runs: Sequence[PolicyRun] = POLICY_RUNS,
    answer_tokens: int = 32,
) -> dict[str, dict[str, Any]]:
    """Each run's distance from ``full`` on one prompt (run it in float32)."""
    views = warm_views(lm, segments, runs)
    stop = lm.eos_ids
    reference = FULL.prefill(ChunkEngine(lm), segments, reserve=answer_tokens)
    answer = greedy(lm, reference.logits, reference.kv, answer_tokens, stop)
    reference.kv.length = len(reference.ids)  # back to the prompt alone
    full_log, _ = teacher_forced(lm, reference.logits, reference.kv, answer, answer_tokens, stop)
    full_words = _words(lm, answer, stop)
    rows: dict[str, dict[str, Any]] = {}
    for run in runs:
        if run == FULL:
            prefilled, tf_log, own_words = reference, full_log, full_words
        else:
            engine = ChunkEngine(lm, views[run.warm])
            prefilled = run.prefill(engine, segments, reserve=answer_tokens)
            tf_log, own = teacher_forced(
                lm, prefilled.logits, prefilled.kv, answer, answer_tokens, stop
            )
            own_words = _words(lm, own, stop)
        kl = kl_divergence(full_log, tf_log)  # [T]
        top1 = (tf_log.argmax(dim=-1) == torch.tensor(answer)).float()  # [T]
        stats = prefilled.stats
        rows[run.name] = {
            "first_kl": float(kl[0]),
            "first_top1": float(top1[0]),
            "tf_kl": float(kl.mean()),
            "tf_top1": float(top1.mean()),
            "rouge_l": rouge_l_f1(own_words, full_words),
            "token_layer_share": float(stats.extra["token_layer_share"]),
            "prompt_tokens": stats.prompt_tokens,
            "prefix_tokens": int(stats.extra.get("prefix_tokens", 0)),
            "reused_tokens": stats.reused_tokens,
            "recomputed_tokens": stats.recomputed_tokens,
            "computed_tokens": stats.computed_tokens,
            "answer_tokens": len(answer),
        }
    return rows


def _words(lm: LoadedModel, tokens: Sequence[int], stop: Collection[int]) -> list[str]:
    assert lm.tokenizer is not None
    text = lm.tokenizer.decode([t for t in tokens if t not in stop], skip_special_tokens=True)
    return str(text).lower().split()


QUALITY_METRICS = (
    "first_kl",
    "first_top1",
    "tf_kl",
    "tf_top1",
    "rouge_l",
    "token_layer_share",
    "reused_tokens",
    "recomputed_tokens",
    "computed_tokens",
)
# Per prompt, is the first policy's teacher-forced KL below the second's?
KL_PAIRS = (
    ("cacheblend-0.15", "reuse"),
    ("cacheblend-0.30", "cacheblend-0.15"),
    ("cachecraft", "cacheblend-0.15"),
)


def evaluate_quality(
    lm: LoadedModel,
    prompts: Sequence[RagPrompt],
    runs: Sequence[PolicyRun] = POLICY_RUNS,
    answer_tokens: int = 32,
    progress: Progress | None = None,
) -> dict[str, Any]:
    """:func:`prompt_quality` on every prompt: ``summary`` (run -> metric -> mean, median,
    p99), ``tf_kl_wins`` (share of prompts where a run of :data:`KL_PAIRS` beats the
    other) and ``per_prompt``."""
    tokenize = SegmentTokenizer(lm.tokenizer)
    per_prompt = []
    for index, prompt in enumerate(prompts):
        started = time.perf_counter()
        per_prompt.append(prompt_quality(lm, tokenize(prompt.segments), runs, answer_tokens))
        if progress is not None:
            progress(f"quality {index + 1}/{len(prompts)}: {time.perf_counter() - started:.0f} s")
    summary = {
        run.name: {m: summarize([row[run.name][m] for row in per_prompt]) for m in QUALITY_METRICS}
        for run in runs
    }
    names = {run.name for run in runs}
    wins = {
        f"{a} < {b}": statistics.fmean(row[a]["tf_kl"] < row[b]["tf_kl"] for row in per_prompt)
        for a, b in KL_PAIRS
        if a in names and b in names
    }
    return {
        "answer_tokens": answer_tokens,
        "summary": summary,
        "tf_kl_wins": wins,
        "per_prompt": per_prompt,
    }
