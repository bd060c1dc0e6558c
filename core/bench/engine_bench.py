"""``chunkcache bench engine``: every recompute policy against a full prefill.

Builds seeded RAG prompts over the bundled corpus (:mod:`.rag_prompts`), warms a
fresh store per prompt (:mod:`.policies`), then runs each policy: full, prefix, reuse,
cacheblend at 0.05/0.15/0.30 and cachecraft.  The parts: ``quality`` (float32,
:mod:`.quality`) with every chunk computed after the system prefix,
``quality-reordered`` with each chunk also cached by an earlier request that held the
chunks in another order, and ``speed`` (bfloat16, :mod:`.speed`, chunks after the
system prefix).
Running some parts keeps the others from the previous report if it was made on the
same prompts (else the report says a part was not measured).  Each part records the
commit and machine it ran on.  Writes ``engine.json`` and ``engine.md``.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from chunkcache.core.bench.engine_report import markdown, targets
from chunkcache.core.bench.policies import POLICY_RUNS, Warmup
from chunkcache.core.bench.quality import evaluate_quality
from chunkcache.core.bench.rag_prompts import RagPrompt, build_rag_prompts, corpus_search
from chunkcache.core.bench.report import environment, summarize, write_report
from chunkcache.core.bench.speed import evaluate_speed
from chunkcache.core.corpus import load_corpus
from chunkcache.core.models import load_model
from chunkcache.core.tokenization import SegmentTokenizer

# The quality parts, by the warm-up their stores get.
QUALITY_PARTS: dict[str, Warmup] = {"quality": "system", "quality-reordered": "reordered"}
PARTS = (*QUALITY_PARTS, "speed")


@dataclass(frozen=True)
class EngineBenchConfig:
    """What one engine benchmark run measures, and where it writes."""

    prompts: int = 50
    seed: int = 0
    rounds: int = 3  # timed rounds per prompt; each item's best is kept
    answer_tokens: int = 32
    parts: tuple[str, ...] = PARTS
    out: Path = field(default_factory=lambda: Path("docs/benchmarks"))


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def part_environment() -> dict[str, str]:
    """Machine, versions and commit of the code about to be measured."""
    env = environment(("torch", "transformers"))
    env["torch_threads"] = str(torch.get_num_threads())
    return env


def prompt_list(prompts: Sequence[RagPrompt], lengths: Sequence[int]) -> list[dict[str, Any]]:
    return [
        {
            "question": p.question,
            "asked": list(p.asked),
            "chunk_ids": list(p.chunk_ids),
            "tokens": n,
        }
        for p, n in zip(prompts, lengths, strict=True)
    ]


def previous_parts(path: Path, prompts: list[dict[str, Any]]) -> dict[str, Any]:
    """The parts of the report at ``path`` if it was made on the same prompts, else none."""
    try:
        previous = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    if previous.get("prompt_list") != prompts:
        return {}
    return {part: previous[part] for part in PARTS if part in previous}


def run_engine_bench(config: EngineBenchConfig, command: str) -> dict[str, Any]:
    """Run the requested parts, write ``engine.json`` and ``engine.md``, return the report."""
    unknown = set(config.parts) - set(PARTS)
    if unknown:
        raise ValueError(f"unknown parts {sorted(unknown)}; choose from {PARTS}")
    torch.manual_seed(config.seed)
    lm32 = load_model(dtype=torch.float32)
    prompts = build_rag_prompts(
        load_corpus(), corpus_search, lm32.tokenizer, config.prompts, config.seed
    )
    tokenize = SegmentTokenizer(lm32.tokenizer)
    lengths = [sum(len(s.ids) for s in tokenize(p.segments)) for p in prompts]
    listed = prompt_list(prompts, lengths)
    parts = previous_parts(config.out / "engine.json", listed)
    for part, warmup in QUALITY_PARTS.items():
        if part not in config.parts:
            continue
        env = part_environment()
        quality = evaluate_quality(
            lm32, prompts, POLICY_RUNS, config.answer_tokens, log, warmup=warmup
        )
        parts[part] = {
            **quality,
            "command": command,
            "environment": env,
            "fingerprint": lm32.fingerprint,
        }
    del lm32
    if "speed" in config.parts:
        env = part_environment()
        lm16 = load_model(dtype=torch.bfloat16)
        speed = evaluate_speed(lm16, prompts, POLICY_RUNS, config.rounds, log)
        parts["speed"] = {
            **speed,
            "command": command,
            "environment": env,
            "fingerprint": lm16.fingerprint,
        }
    report = {
        "command": command,
        "seed": config.seed,
        "model": "SmolLM2-135M-Instruct",
        "prompts": len(prompts),
        "chunks_per_prompt": len(prompts[0].chunk_ids),
        "prompt_tokens": summarize(lengths),
        "runs": [{"name": r.name, "policy": r.policy, "ratio": r.ratio} for r in POLICY_RUNS],
        **parts,
        "prompt_list": listed,
    }
    report["targets"] = targets(report)
    write_report(config.out, "engine", report, markdown(report))
    return report
