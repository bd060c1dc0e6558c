"""Quality of every policy against a full prefill, prompt by prompt and summarized.

Run it in float32: it measures the recompute policies, not bfloat16 rounding.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from chunkcache.core.bench.policies import FULL, POLICY_RUNS, PolicyRun, Warmup, warm_views
from chunkcache.core.bench.rag_prompts import RagPrompt
from chunkcache.core.bench.report import summarize
from chunkcache.core.bench.scoring import (
    forced_log_probs,
    greedy,
    kl_divergence,
    rouge_l_f1,
    teacher_forced,
)
from chunkcache.core.engine import ChunkEngine, TokenSegment
from chunkcache.core.generation import GenerationStats
from chunkcache.core.models import LoadedModel
from chunkcache.core.tokenization import SegmentTokenizer

Progress = Callable[[str], None]


@dataclass(frozen=True)
class Reference:
    """A full prefill's greedy answer on a prompt, and its log-probs along that answer."""

    answer: list[int]
    log: Tensor  # [T, V] float32
    stats: GenerationStats


def full_reference(
    lm: LoadedModel, segments: Sequence[TokenSegment], answer_tokens: int
) -> Reference:
    """``full``'s greedy answer of at most ``answer_tokens`` on ``segments``."""
    reference = FULL.prefill(ChunkEngine(lm), segments, reserve=answer_tokens)
    answer = greedy(lm, reference.logits, reference.kv, answer_tokens, lm.eos_ids)
    reference.kv.length = len(reference.ids)  # back to the prompt alone
    log = forced_log_probs(lm, reference.logits, reference.kv, answer)
    return Reference(answer, log, reference.stats)


def along_answer(reference: Reference, log: Tensor) -> dict[str, float]:
    """First-token and teacher-forced KL from ``full`` and top-1 agreement with its
    answer, for a run's log-probs ``log`` [T, V] along ``reference.answer``."""
    kl = kl_divergence(reference.log, log)  # [T]
    top1 = (log.argmax(dim=-1).cpu() == torch.tensor(reference.answer)).float()  # [T]
    return {
        "first_kl": float(kl[0]),
        "first_top1": float(top1[0]),
        "tf_kl": float(kl.mean()),
        "tf_top1": float(top1.mean()),
    }


def prompt_quality(
    lm: LoadedModel,
    segments: Sequence[TokenSegment],
    runs: Sequence[PolicyRun] = POLICY_RUNS,
    answer_tokens: int = 32,
    warmup: Warmup = "system",
) -> dict[str, dict[str, Any]]:
    """Each run's distance from ``full`` on one prompt (run it in float32), its chunks
    cached as ``warmup`` says (:mod:`chunkcache.core.bench.policies`)."""
    views = warm_views(lm, segments, runs, warmup)
    stop = lm.eos_ids
    reference = full_reference(lm, segments, answer_tokens)
    answer = reference.answer
    full_words = _words(lm, answer, stop)
    rows: dict[str, dict[str, Any]] = {}
    for run in runs:
        if run == FULL:
            stats, tf_log, own_words = reference.stats, reference.log, full_words
        else:
            engine = ChunkEngine(lm, views[run.warm])
            prefilled = run.prefill(engine, segments, reserve=answer_tokens)
            tf_log, own = teacher_forced(
                lm, prefilled.logits, prefilled.kv, answer, answer_tokens, stop
            )
            stats, own_words = prefilled.stats, _words(lm, own, stop)
        rows[run.name] = {
            **along_answer(reference, tf_log),
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
    ("cachecraft", "cacheblend-0.30"),
)


def evaluate_quality(
    lm: LoadedModel,
    prompts: Sequence[RagPrompt],
    runs: Sequence[PolicyRun] = POLICY_RUNS,
    answer_tokens: int = 32,
    progress: Progress | None = None,
    warmup: Warmup = "system",
) -> dict[str, Any]:
    """:func:`prompt_quality` on every prompt: ``summary`` (run -> metric -> mean, median,
    p99), ``tf_kl_wins`` (share of prompts where a run of :data:`KL_PAIRS` beats the
    other) and ``per_prompt``."""
    tokenize = SegmentTokenizer(lm.tokenizer)
    per_prompt = []
    for index, prompt in enumerate(prompts):
        started = time.perf_counter()
        segments = tokenize(prompt.segments)
        per_prompt.append(prompt_quality(lm, segments, runs, answer_tokens, warmup))
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
        "warmup": warmup,
        "answer_tokens": answer_tokens,
        "summary": summary,
        "tf_kl_wins": wins,
        "per_prompt": per_prompt,
    }
