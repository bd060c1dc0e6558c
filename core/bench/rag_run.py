"""Runs ``chunkcache bench rag``: workloads x systems, then the JSON, markdown and plots."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from chunkcache.core.bench.rag_bench import (
    DEFAULT_STORE_MIB,
    Progress,
    System,
    replay,
    select_systems,
)
from chunkcache.core.bench.rag_metrics import poisson_arrivals, system_figures
from chunkcache.core.bench.rag_quality import RagQualityScorer, quality_figures, sample_requests
from chunkcache.core.bench.rag_workload import (
    Workload,
    corpus_workload,
    gold_chunks_needed,
    gold_workload,
    user_workload,
)
from chunkcache.core.bench.report import environment, write_report
from chunkcache.core.corpus import DEFAULT_CHUNK_CHARS
from chunkcache.core.errors import UsageError
from chunkcache.core.user_corpus import chroma_database
from chunkcache.core.vllm_server import VllmServerSlot, vllm_installed, vllm_venv


@dataclass(frozen=True)
class RagWorkloadSizes:
    """The requests a RAG benchmark replays: shared by ``bench rag`` and ``bench vllm``."""

    conversations: int = 24
    min_turns: int = 2
    max_turns: int = 5
    gold_questions: int = 48
    k: int = 5
    chunk_chars: int = DEFAULT_CHUNK_CHARS  # the bundled corpus's or a corpus folder's
    max_tokens: int = 32
    rate: float = 0.5  # Poisson arrivals per second, for the throughput simulation
    seed: int = 0

    def sizes(self) -> dict[str, Any]:
        """Just the workload sizes, as keyword arguments for another config."""
        return {f.name: getattr(self, f.name) for f in fields(RagWorkloadSizes)}


@dataclass(frozen=True)
class RagBenchConfig(RagWorkloadSizes):
    """Workload sizes, systems and output of one ``chunkcache bench rag`` run."""

    systems: tuple[str, ...] = ()
    store_mib: int = DEFAULT_STORE_MIB
    # Requests per workload whose logits are scored against full (seeded sample; None: all):
    # 6 aims at ~25% more time on the published run (estimated from the quick run, not
    # measured there); quick mode's workloads are no larger, so it scores them all.
    quality_requests: int | None = 6
    corpus_dir: Path | None = None
    chroma: tuple[str, str] | None = None
    questions: Path | None = None
    out: Path = field(default_factory=lambda: Path("docs/benchmarks"))
    name: str = "rag"


def quick(config: RagBenchConfig) -> RagBenchConfig:
    """The smoke-test size: a few short conversations and gold questions, short answers."""
    return replace(
        config, conversations=3, min_turns=2, max_turns=2, gold_questions=4, max_tokens=8
    )


def check_config(config: RagBenchConfig) -> None:
    """Raise :class:`UsageError` (or ``UserCorpusError``) for a mistake in ``config``'s
    options, in a moment and before anything loads; the data itself is read by
    :func:`workloads`, which ``run_rag_bench`` calls before it loads a model."""
    if config.min_turns > config.max_turns:
        raise UsageError(
            f"--min-turns {config.min_turns} is more than --max-turns {config.max_turns}"
        )
    if config.corpus_dir is not None and config.chroma is not None:
        raise UsageError("give one corpus of your own: --corpus-dir or --chroma, not both")
    own_corpus = (
        "--corpus-dir" if config.corpus_dir is not None else "--chroma" if config.chroma else None
    )
    if own_corpus is not None and config.questions is None:
        raise UsageError(f"{own_corpus} needs your questions: add --questions FILE")
    if config.questions is not None and own_corpus is None:
        raise UsageError("--questions needs your corpus: add --corpus-dir DIR or --chroma DIR NAME")
    if config.chroma is not None:
        chroma_database(config.chroma[0])
    needed = gold_chunks_needed(config.gold_questions, config.seed)
    if config.k < needed:
        raise UsageError(
            f"--k {config.k} is fewer than the {needed} chunks some gold questions need: "
            f"use --k {needed} or more, or --gold-questions 0"
        )
    if config.out.exists() and not config.out.is_dir():
        raise UsageError(f"--out {config.out} is a file, not a folder for the reports")


def workloads(config: RagBenchConfig) -> list[Workload]:
    """The user's corpus if given, else the bundled corpus; and the gold workload.

    Checks ``config`` first (:func:`check_config`); a corpus or questions file that cannot
    be used raises ``UserCorpusError``."""
    check_config(config)
    if config.questions is not None:
        main = user_workload(
            config.questions, config.k, config.corpus_dir, config.chroma, config.chunk_chars
        )
    else:
        main = corpus_workload(
            config.conversations,
            config.min_turns,
            config.max_turns,
            config.k,
            config.seed,
            config.chunk_chars,
        )
    if config.gold_questions == 0:
        return [main]
    return [main, gold_workload(config.gold_questions, config.k, config.seed)]


def run_rag_bench(
    config: RagBenchConfig, command: str, progress: Progress | None = None
) -> dict[str, Any]:
    """Replay every workload on every system; write ``<name>.json``, ``.md`` and plots.

    The options, the user's corpus and questions and the report folder are checked
    before a model loads."""
    import torch

    from chunkcache.core.bench.rag_report import markdown, plot
    from chunkcache.core.models import load_model

    chosen = workloads(config)
    config.out.mkdir(parents=True, exist_ok=True)
    systems = select_systems(config.systems)
    env = environment(("torch", "transformers", "langchain-core", "chromadb"))
    lm = load_model(dtype=torch.bfloat16)
    scorer = None
    if config.quality_requests != 0 and any(s.generator == "engine" for s in systems):
        scorer = RagQualityScorer(load_model(dtype=torch.float32), config.max_tokens)
    report: dict[str, Any] = {
        "command": command,
        "config": {k: str(v) if isinstance(v, Path) else v for k, v in asdict(config).items()},
        "environment": env,
        "model": "SmolLM2-135M-Instruct",
        "fingerprint": lm.fingerprint,
        "systems": [asdict(s) for s in systems],
        "skipped": skipped_systems(),
        "workloads": {},
    }
    runs: dict[str, dict[str, Any]] = {workload.name: {} for workload in chosen}
    # System by system, so a vLLM server starts once for all workloads (and once for
    # the two prefix-caching systems), not once per workload and system.
    with VllmServerSlot() as vllm:
        for system in systems:
            for workload in chosen:
                scored = sample_requests(
                    len(workload.requests), config.quality_requests, config.seed
                )
                runs[workload.name][system.name] = replay(
                    system,
                    lm,
                    workload,
                    config.max_tokens,
                    store_mib=config.store_mib,
                    progress=progress,
                    scorer=scorer,
                    scored=scored,
                    vllm=vllm,
                )
    for workload in chosen:
        report["workloads"][workload.name] = workload_figures(
            workload, systems, runs[workload.name], config
        )
    report["plots"] = plot(report, config.out, config.name)
    write_report(config.out, config.name, report, markdown(report))
    return report


def workload_figures(
    workload: Workload,
    systems: list[System],
    runs: dict[str, dict[str, Any]],
    config: RagBenchConfig,
) -> dict[str, Any]:
    """Each system's figures on ``workload`` from its run, against ``full`` in its layout."""
    arrivals = poisson_arrivals(len(workload.requests), config.rate, config.seed)
    figures = {}
    for system in systems:
        reference = runs.get(f"full / {system.layout}")
        figures[system.name] = {
            **system_figures(
                runs[system.name]["records"],
                workload.requests,
                arrivals,
                reference["records"] if reference is not None else None,
            ),
            **quality_figures(runs[system.name].get("quality")),
            "cpu": runs[system.name]["cpu"],
        }
    return {
        "description": workload.description,
        "requests": len(workload.requests),
        "figures": figures,
        "records": {
            name: [asdict(record) for record in run["records"]] for name, run in runs.items()
        },
    }


def skipped_systems() -> list[str]:
    """Systems of the issue this run cannot include, each with the reason."""
    if vllm_installed():
        return []
    return [
        "vLLM (prefix caching off / on / on with chunkcache layout): vLLM is not installed "
        f"in {vllm_venv()} (run `make vllm`)",
    ]
