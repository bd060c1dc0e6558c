"""The RAG benchmark: queue arithmetic, the HF baseline backend, and a quick run (slow)."""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

import pytest
from tiny_models import tiny_lm

from chunkcache.core.bench.hf_backend import HFGenerateBackend
from chunkcache.core.bench.rag_metrics import fifo_queue, poisson_arrivals
from chunkcache.core.engine import ChunkEngine
from chunkcache.core.generation import GenerationRequest, SamplingParams
from chunkcache.core.local_backend import LocalBackend
from chunkcache.core.segmenter import ChunkSegment, Segment, TextSegment


def test_poisson_arrivals_are_seeded_and_spaced_by_the_rate() -> None:
    arrivals = poisson_arrivals(2000, rate=4.0, seed=7)
    assert arrivals == poisson_arrivals(2000, rate=4.0, seed=7)
    assert arrivals != poisson_arrivals(2000, rate=4.0, seed=8)
    gaps = [b - a for a, b in zip([0.0, *arrivals], arrivals, strict=False)]
    assert statistics.fmean(gaps) == pytest.approx(0.25, rel=0.1)
    with pytest.raises(ValueError, match="rate"):
        poisson_arrivals(3, rate=0.0, seed=0)


def test_fifo_queue_makes_late_requests_wait_for_the_busy_server() -> None:
    # Arrivals at 0, 1, 2; services of 3 s, 1 s, 1 s: the 2nd waits 2 s, the 3rd 2 s.
    queue = fifo_queue([0.0, 1.0, 2.0], [3.0, 1.0, 1.0])
    assert queue["latency_s"]["median"] == pytest.approx(3.0)  # latencies 3, 3, 3
    assert queue["throughput_rps"] == pytest.approx(3 / 5)
    assert queue["utilisation"] == pytest.approx(1.0)
    idle = fifo_queue([0.0, 10.0], [1.0, 1.0])
    assert idle["latency_s"]["p99"] == pytest.approx(1.0)
    assert idle["utilisation"] == pytest.approx(2 / 11)


def test_hf_baseline_answers_like_the_engine_with_full_prefill() -> None:
    lm = tiny_lm("llama")
    segments: list[Segment] = [
        TextSegment("w1 w2 w3 "),
        ChunkSegment("c1", "w10 w11 w12 w13 w14 w15 w16 w17"),
        TextSegment(" w4 w5"),
    ]
    request = GenerationRequest(segments, policy="full", sampling=SamplingParams(max_tokens=6))
    *_, hf_last = HFGenerateBackend(lm).stream(request)
    engine_text = "".join(p.text for p in LocalBackend(ChunkEngine(lm)).stream(request))
    hf_text = hf_last.text
    assert hf_last.stats is not None
    assert hf_text == engine_text
    stats = hf_last.stats
    assert stats.prompt_tokens == stats.computed_tokens == 13
    assert stats.reused_tokens == stats.recomputed_tokens == 0
    assert 0 < stats.ttft_s <= stats.total_s


@pytest.mark.slow
def test_quick_run_reports_every_system_on_both_workloads(tmp_path: Path) -> None:
    from chunkcache.core.bench.rag_run import RagBenchConfig, quick, run_rag_bench
    from chunkcache.core.vllm_server import vllm_installed

    config = quick(RagBenchConfig(out=tmp_path, name="smoke"))
    run_rag_bench(config, "pytest")
    report: Any = json.loads((tmp_path / "smoke.json").read_text())
    assert set(report["workloads"]) == {"corpus", "gold"}
    corpus = report["workloads"]["corpus"]["figures"]
    assert len(corpus) == len(report["systems"]) == 15 + 3 * vllm_installed()
    for name, row in corpus.items():
        assert row["requests"] == report["workloads"]["corpus"]["requests"], name
    for name in ("hf generate / plain", "full / plain", "full / chunkcache"):
        assert corpus[name]["computed_share"] == pytest.approx(1.0)
        assert corpus[name]["reused_share"] == 0.0
    assert corpus["full / plain"]["rouge_l_vs_full"] == pytest.approx(1.0)
    # Turn 2 of a conversation extends turn 1's prompt in chunkcache's layout only.
    assert corpus["prefix / chunkcache"]["reused_share"] > 0.2
    assert (
        corpus["reuse / chunkcache"]["reused_share"]
        >= corpus["prefix / chunkcache"]["reused_share"]
    )
    gold = report["workloads"]["gold"]["figures"]
    assert all(0.0 <= row["accuracy"] <= 1.0 for row in gold.values())
    text = (tmp_path / "smoke.md").read_text()
    assert "## corpus:" in text and "## gold:" in text and "vLLM" in text
    assert len(list(tmp_path.glob("smoke-*.png"))) == 6
