"""docs/benchmarks/README.md: findings computed from the reports, never typed in."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from chunkcache.core.bench.findings import (
    FINDERS,
    engine_findings,
    rag_findings,
    serve_findings,
    store_findings,
    verdict_of,
    vllm_findings,
)
from chunkcache.core.bench.summary import summary_markdown, write_summary

PUBLISHED = Path(__file__).resolve().parent.parent / "docs" / "benchmarks"


@pytest.mark.parametrize(
    ("ratio", "lower_is_better", "verdict"),
    [(0.5, True, "win"), (1.5, True, "loss"), (1.03, True, "even"), (1.5, False, "win")],
)
def test_verdict_of_a_ratio(ratio: float, lower_is_better: bool, verdict: str) -> None:
    assert verdict_of(ratio, lower_is_better) == verdict


def test_every_published_report_yields_findings() -> None:
    for name, finder in FINDERS.items():
        path = PUBLISHED / f"{name}.json"
        if path.exists():
            assert finder(json.loads(path.read_text())), name


def test_a_missed_target_is_a_loss_with_a_next_step() -> None:
    report = {
        "targets": [
            {
                "target": "cacheblend-0.15 TTFT <= 0.2 x full",
                "measured": 0.33,
                "unit": "",
                "met": False,
            },
        ],
        "speed": {"summary": {"cacheblend-0.15": {"ratio_to_full": {"median": 0.33}}}},
        "quality": {"summary": {"cacheblend-0.15": {"token_layer_share": {"mean": 0.2}}}},
    }
    found = engine_findings(report)
    assert [f.verdict for f in found] == ["loss", "loss"]
    assert "Missed: cacheblend-0.15 TTFT" in found[0].text
    assert "0.33x full prefill" in found[1].text and found[1].next_step


def test_store_findings_follow_the_figures() -> None:
    def report(disk_ratio: float) -> dict[str, object]:
        return {"ttft": {"configs": {"disk+prefetch": {"ratio_to_host": disk_ratio}}}}

    assert store_findings(report(1.1))[0].verdict == "win"
    missed = store_findings(report(1.4))[0]
    assert missed.verdict == "loss" and "1.40x" in missed.text and missed.next_step


@pytest.mark.parametrize(("questions", "verdict"), [(12, "even"), (200, "loss")])
def test_rag_accuracy_gap_is_a_loss_only_beyond_noise(questions: int, verdict: str) -> None:
    row = {"ttft_s": {"median": 1.0}, "computed_share": 0.5, "prompt_tokens": 100}
    row["requests"] = questions
    figures = {
        "full / plain": {**row, "accuracy": 0.25},
        "cacheblend-0.15 / plain": {**row, "accuracy": 0.25},
        "cacheblend-0.15 / chunkcache": {**row, "accuracy": 0.0},
    }
    found = rag_findings({"workloads": {"gold": {"figures": figures}}})
    accuracy = [f for f in found if "exact match" in f.text]
    assert len(accuracy) == 1 and accuracy[0].verdict == verdict
    assert "chunkcache layout 0%" in accuracy[0].text and accuracy[0].next_step


def test_summary_stamps_reports_and_names_missing_ones(tmp_path: Path) -> None:
    shutil.copy(PUBLISHED / "store.json", tmp_path / "store.json")
    text = write_summary(tmp_path).read_text()
    assert text == summary_markdown(tmp_path)
    assert "| [store](store.md) |" in text
    assert "## Where chunkcache wins" in text
    assert "Not run yet: `retriever`, `engine`, `rag`, `vllm`, `serve`." in text


@pytest.mark.parametrize(("cached", "verdict"), [(1.8, "win"), (1.2, "loss")])
def test_vllm_cached_share_is_judged_against_its_target(cached: float, verdict: str) -> None:
    ratios = {
        "cached_share": cached,
        "target_cached_share": 1.5,
        "closed_loop_throughput": 1.0,
        "ttft_p50": 1.0,
    }
    found = vllm_findings({"workloads": {"corpus": {"ratios": ratios}}})
    assert found[0].verdict == verdict and f"{cached:.2f}x" in found[0].text
    assert found[1].verdict == "even"


def test_a_load_test_that_lost_a_request_is_a_loss() -> None:
    counts = {"requests": 10, "completed": 9, "rejected_429": 0, "errors": 0, "lost": 1}
    report = {
        "ok": False,
        "counts": {**counts, "answered_twice": 0},
        "config": {"clients": 4, "duration_s": 10.0},
        "ttft_s": {"p50": 0.5, "p99": 1.0},
        "throughput": {"requests_per_s": 1.0},
        "memory": {"flat": True, "growth_mib": 3.0, "early_mib": 900.0},
    }
    found = serve_findings(report)
    assert [f.verdict for f in found] == ["loss", "win"]
    assert "1 lost" in found[0].text and found[0].next_step


def test_the_default_system_is_compared_with_vllm_prefix_caching() -> None:
    def row(rps: float, ttft: float) -> dict[str, object]:
        return {
            "ttft_s": {"median": ttft},
            "queue": {"throughput_rps": rps},
            "computed_share": 0.5,
            "prompt_tokens": 100,
            "rouge_l_vs_full": 0.9,
        }

    figures = {
        "cacheblend-0.15 / chunkcache": row(0.3, 1.0),
        "vLLM prefix caching on / plain": row(0.6, 0.5),
    }
    (found,) = [f for f in rag_findings({"workloads": {"corpus": {"figures": figures}}})]
    assert found.verdict == "loss"
    assert "0.50x the requests per second" in found.text and "2.00x its median" in found.text


def test_the_default_systems_rag_finding_carries_its_kl_from_full() -> None:
    def row(ttft: float, kl: float | None) -> dict[str, object]:
        return {
            "ttft_s": {"median": ttft},
            "computed_share": 0.4,
            "tf_kl_vs_full": kl,
            "tf_top1_vs_full": None if kl is None else 0.9,
            "logit_quality": {"scored_requests": [0, 3, 5]},
        }

    figures = {"cacheblend-0.15 / chunkcache": row(0.5, 0.0412), "full / plain": row(1.0, 0.0)}
    (found,) = rag_findings({"workloads": {"corpus": {"figures": figures}}})
    assert found.verdict == "win" and "0.50x" in found.text
    assert "teacher-forced KL of 0.041" in found.text and "90%, 3 requests" in found.text
    figures["cacheblend-0.15 / chunkcache"] = row(0.5, None)
    (found,) = rag_findings({"workloads": {"corpus": {"figures": figures}}})
    assert "KL" not in found.text


def test_a_two_part_report_is_stamped_with_one_part_s_command_and_commit(tmp_path: Path) -> None:
    report = json.loads((PUBLISHED / "engine.json").read_text())
    report["command"] = "chunkcache bench engine --part quality"  # the last run, quality
    report["quality"]["environment"]["commit"] = "aaaaaaa"
    report["speed"]["command"] = "chunkcache bench engine --part speed"
    report["speed"]["environment"]["commit"] = "bbbbbbb"
    (tmp_path / "engine.json").write_text(json.dumps(report))
    text = summary_markdown(tmp_path)
    assert "| `chunkcache bench engine --part speed` | bbbbbbb |" in text


def test_the_published_summary_is_the_one_its_reports_give() -> None:
    """A re-run report without a regenerated summary leaves docs/benchmarks/README.md naming
    old commits and figures (``chunkcache bench summary`` writes it)."""
    published = (PUBLISHED / "README.md").read_text(encoding="utf-8")
    assert published == summary_markdown(PUBLISHED), "run `chunkcache bench summary`"
