"""Time to first token of every policy, side by side with Hugging Face on the same ids.

Per prompt, every item runs once per round in an order rotated by prompt and
round (reversed every other round), so slow drift of a shared machine hits all
items alike; each item's best round is kept.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from chunkcache.core.bench.policies import POLICY_RUNS, PolicyRun, warm_views
from chunkcache.core.bench.quality import Progress
from chunkcache.core.bench.rag_prompts import RagPrompt
from chunkcache.core.bench.report import CpuMeter, summarize
from chunkcache.core.engine import ChunkEngine
from chunkcache.core.local_backend import LocalBackend
from chunkcache.core.models import LoadedModel


def prompt_speed(
    backend: LocalBackend,
    prompt: RagPrompt,
    runs: Sequence[PolicyRun] = POLICY_RUNS,
    rounds: int = 3,
    shift: int = 0,
) -> dict[str, list[float]]:
    """Seconds to the first token of each run, ``rounds`` times, interleaved.

    Keys: a run's name (``engine.prefill`` alone), ``"<name> e2e"`` (the backend's
    TTFT: tokenizing, prefill, first sample), ``"hf generate"`` and ``"hf forward"``
    (transformers on the same token ids). Each round runs every item once, in an
    order rotated by ``shift + round`` and reversed every other round.
    """
    engine = backend.engine
    lm = engine.lm
    segments = backend.segment_tokenizer(prompt.segments)  # caches the chunks' tokens
    views = warm_views(lm, segments, runs)
    ids = torch.tensor([[t for segment in segments for t in segment.ids]], device=lm.device)

    def engine_prefill(run: PolicyRun) -> Callable[[], float]:
        def measure() -> float:
            engine.store = views[run.warm]
            started = time.perf_counter()
            run.prefill(engine, segments)
            return time.perf_counter() - started

        return measure

    def end_to_end(run: PolicyRun) -> Callable[[], float]:
        def measure() -> float:
            engine.store = views[run.warm]
            *_, last = backend.stream(run.request(prompt.segments, max_tokens=1))
            assert last.stats is not None
            return last.stats.ttft_s

        return measure

    def hf_generate() -> float:
        started = time.perf_counter()
        lm.hf.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=1,
            do_sample=False,
            pad_token_id=lm.hf.generation_config.eos_token_id,
        )
        return time.perf_counter() - started

    @torch.no_grad()
    def hf_forward() -> float:
        started = time.perf_counter()
        lm.hf(input_ids=ids, logits_to_keep=1)
        return time.perf_counter() - started

    items: list[tuple[str, Callable[[], float]]] = [
        *((run.name, engine_prefill(run)) for run in runs),
        *((f"{run.name} e2e", end_to_end(run)) for run in runs),
        ("hf generate", hf_generate),
        ("hf forward", hf_forward),
    ]
    seconds: dict[str, list[float]] = {name: [] for name, _ in items}
    for round_index in range(rounds):
        turn = (shift + round_index) % len(items)
        order = items[turn:] + items[:turn]
        for name, measure in reversed(order) if round_index % 2 else order:
            seconds[name].append(measure())
    return seconds


def evaluate_speed(
    lm: LoadedModel,
    prompts: Sequence[RagPrompt],
    runs: Sequence[PolicyRun] = POLICY_RUNS,
    rounds: int = 3,
    progress: Progress | None = None,
) -> dict[str, Any]:
    """:func:`prompt_speed` on every prompt after a discarded warm-up: per prompt the best
    of ``rounds``; ``summary`` (item -> ms and ratio to full, mean/median/p99), ``cpu``
    (cores this process and everything else used meanwhile) and ``per_prompt`` (s)."""
    backend = LocalBackend(ChunkEngine(lm))
    prompt_speed(backend, prompts[0], runs, rounds=1)
    meter = CpuMeter()
    per_prompt = []
    for index, prompt in enumerate(prompts):
        seconds = prompt_speed(backend, prompt, runs, rounds, shift=index)
        per_prompt.append({name: min(values) for name, values in seconds.items()})
        if progress is not None:
            progress(f"speed {index + 1}/{len(prompts)}: full {per_prompt[-1]['full']:.2f} s")
    cpu = meter.share()
    summary = {}
    for name in per_prompt[0]:
        base = "full e2e" if name.endswith(" e2e") else "full"
        summary[name] = {
            "ms": summarize([1e3 * row[name] for row in per_prompt]),
            "ratio_to_full": summarize([row[name] / row[base] for row in per_prompt]),
        }
    return {"rounds": rounds, "summary": summary, "cpu": cpu, "per_prompt": per_prompt}
