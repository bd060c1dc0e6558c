"""The RAG benchmark: queue arithmetic, the HF baseline backend, and a quick run (slow)."""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

import pytest
from tiny_models import tiny_lm

from chunkcache.core.bench.hf_backend import HFGenerateBackend
from chunkcache.core.bench.rag_metrics import fifo_queue, poisson_arrivals, tier_hit_rates
from chunkcache.core.bench.rag_quality import (
    RagQualityScorer,
    RecordingBackend,
    quality_figures,
    sample_requests,
)
from chunkcache.core.cache import ChunkCache
from chunkcache.core.engine import ChunkEngine
from chunkcache.core.generation import GenerationRequest, Policy, SamplingParams
from chunkcache.core.kv_store import MemoryKVStore
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


def test_tier_hit_rates_are_each_tiers_share_of_the_store_lookups() -> None:
    def stats(lookups: int, **tiers: int) -> dict[str, Any]:
        counts = {name: {"hits": hits} for name, hits in tiers.items()}
        return {"extra": {"store": {"lookups": lookups, "tiers": counts}}}

    requests = [stats(4, host=2), stats(6, host=1, disk=3), {"extra": {}}]
    assert tier_hit_rates(requests) == {"host": 0.3, "disk": 0.3}
    assert tier_hit_rates([{"extra": {"store": {"tiers": {}}}}]) == {}  # nothing looked up


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


CHUNK = ChunkSegment("c1", " ".join(f"w{i}" for i in range(10, 40)))


def _request(head: str, policy: Policy) -> GenerationRequest:
    return GenerationRequest(
        [TextSegment(head), CHUNK, TextSegment(" w4 w5 w6")],
        policy=policy,
        sampling=SamplingParams(max_tokens=6),
    )


def test_scoring_is_exact_for_full_and_finds_reuse_in_a_changed_context() -> None:
    lm = tiny_lm("llama")
    backend = RecordingBackend(LocalBackend(ChunkEngine(lm, MemoryKVStore())))
    cache = ChunkCache(backend=backend)
    assert cache.backend is backend and backend.engine.lm is lm  # attributes pass through
    for head in ("w1 w2 w3 ", "w7 w8 w9 w1 w2 "):  # the chunk is stored after the first head
        *_, last = backend.stream(_request(head, "full"))
        assert last.stats is not None
    assert [r.segments[0].text for r in backend.requests] == ["w1 w2 w3 ", "w7 w8 w9 w1 w2 "]
    store = backend.engine.store
    stored = len(store)
    scorer = RagQualityScorer(lm, answer_tokens=6)
    fingerprint = lm.fingerprint
    full = scorer.score(_request("w7 w8 w9 w1 w2 ", "full"), store, fingerprint)
    assert full == {"first_kl": 0.0, "first_top1": 1.0, "tf_kl": 0.0, "tf_top1": 1.0}
    # The stored prefix is exact: "prefix" matches full; "reuse" moves the chunk's KV
    # from another context (the other head), which full prefill would not compute.
    exact = scorer.score(_request("w1 w2 w3 ", "prefix"), store, fingerprint)
    assert exact["tf_kl"] == pytest.approx(0.0, abs=1e-6) and exact["tf_top1"] == 1.0
    moved = scorer.score(_request("w4 w1 w2 w3 ", "reuse"), store, fingerprint)
    assert moved["tf_kl"] > 1e-4 and moved["first_kl"] > 1e-4
    assert len(store) == stored  # scoring reads the system's store, never writes it
    requests = [_request("w4 w1 w2 w3 ", "reuse"), _request("w1 w2 w3 ", "full")]
    result = scorer.score_system(requests, [0, 1], store, fingerprint)
    figures = quality_figures(result)
    assert figures["tf_kl_vs_full"] == pytest.approx(moved["tf_kl"] / 2)
    assert figures["logit_quality"]["scored_requests"] == [0, 1]
    assert quality_figures({"n/a": "no logits"})["tf_kl_vs_full"] is None


def test_quality_sample_is_seeded_ordered_and_all_when_small() -> None:
    sample = sample_requests(50, 12, seed=3)
    assert sample == sorted(set(sample)) and len(sample) == 12 and max(sample) < 50
    assert sample == sample_requests(50, 12, seed=3) != sample_requests(50, 12, seed=4)
    assert sample_requests(5, 12, seed=3) == sample_requests(5, None, seed=3) == [0, 1, 2, 3, 4]
    assert sample_requests(5, 0, seed=3) == []
    with pytest.raises(ValueError, match="sample size"):
        sample_requests(50, -1, seed=3)


@pytest.mark.slow
def test_corpus_chunk_size_is_configurable() -> None:
    from chunkcache.core.bench.rag_workload import corpus_workload

    workload = corpus_workload(2, 1, 1, k=4, seed=0, chunk_chars=500)  # a new index: ~1 min
    assert "at most 500 characters" in workload.description
    documents = workload.retriever().invoke(workload.requests[0].question)
    assert len(documents) == 4
    assert all(len(d.page_content) <= 500 for d in documents)
    assert any(len(d.page_content) > 500 for d in corpus_docs(workload.requests[0].question))


def corpus_docs(question: str) -> list[Any]:
    """The default workload's chunks for ``question`` (1000 characters at most)."""
    from chunkcache.core.bench.rag_workload import corpus_workload

    return corpus_workload(1, 1, 1, k=4, seed=0).retriever().invoke(question)


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
    # the engine's store is tiered: the host tier serves every hit of this small run
    assert corpus["reuse / chunkcache"]["tier_hit_rates"]["host"] > 0.0
    assert corpus["reuse / chunkcache"]["tier_hit_rates"].get("disk", 0.0) == 0.0
    assert corpus["full / plain"]["tier_hit_rates"] == {}  # full looks nothing up
    assert corpus["hf generate / plain"]["tier_hit_rates"] == {}
    # Turn 2 of a conversation extends turn 1's prompt in chunkcache's layout only.
    assert corpus["prefix / chunkcache"]["reused_share"] > 0.2
    assert (
        corpus["reuse / chunkcache"]["reused_share"]
        >= corpus["prefix / chunkcache"]["reused_share"]
    )
    for name, row in corpus.items():  # logits against full, in float32
        if name.startswith(("hf ", "vLLM ")):
            assert row["tf_kl_vs_full"] is None and "n/a" in row["logit_quality"], name
            continue
        scored = row["logit_quality"]["scored_requests"]
        assert scored == list(range(row["requests"])), name  # quick mode scores every request
        assert row["tf_kl_vs_full"] >= 0.0 and 0.0 <= row["tf_top1_vs_full"] <= 1.0, name
        assert row["first_kl_vs_full"] >= 0.0 and 0.0 <= row["first_top1_vs_full"] <= 1.0, name
    for layout in ("plain", "chunkcache"):
        assert corpus[f"full / {layout}"]["tf_kl_vs_full"] == 0.0
        assert corpus[f"full / {layout}"]["tf_top1_vs_full"] == 1.0
        assert corpus[f"prefix / {layout}"]["tf_kl_vs_full"] < 1e-3  # exact reuse only
    assert corpus["reuse / plain"]["tf_kl_vs_full"] > corpus["prefix / plain"]["tf_kl_vs_full"]
    gold = report["workloads"]["gold"]["figures"]
    assert all(0.0 <= row["accuracy"] <= 1.0 for row in gold.values())
    text = (tmp_path / "smoke.md").read_text()
    assert "## corpus:" in text and "## gold:" in text and "vLLM" in text
    assert "| TF KL | TF top-1 |" in text and "seeded requests" in text
    assert "| store hits by tier |" in text and " | host " in text
    assert len(list(tmp_path.glob("smoke-*.png"))) == 6
