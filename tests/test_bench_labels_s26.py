"""Benchmark reports label their figures no more than their JSON holds: a "p99" of fewer
than 100 samples is their maximum and is called so, each with its sample count; the
README stamps every part of a multi-part report with the commit it ran at."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from chunkcache.core.bench import engine_report, rag_report, store_report, vllm_report
from chunkcache.core.bench.findings import engine_findings, serve_findings, store_findings
from chunkcache.core.bench.report import tail_label
from chunkcache.core.bench.summary import summary_markdown

PUBLISHED = Path(__file__).resolve().parent.parent / "docs" / "benchmarks"


def published(name: str) -> dict[str, Any]:
    return dict(json.loads((PUBLISHED / f"{name}.json").read_text()))


@pytest.mark.parametrize(
    ("counts", "label"),
    [
        ([30, 30], "max (n=30)"),
        ([99], "max (n=99)"),
        ([100], "p99 (n=100)"),
        ([250, 400], "p99 (n=250-400)"),
        ([50, 250], "p99, max where n < 100 (n=50-250)"),
        ([None], "p99 (n not recorded)"),
    ],
)
def test_tail_label_names_a_small_sample_s_p99_its_maximum(
    counts: list[int | None], label: str
) -> None:
    assert tail_label(counts) == label


def test_engine_speed_table_calls_its_p99_over_50_prompts_a_max() -> None:
    text = engine_report.markdown(published("engine"))
    n = published("engine")["prompts"]
    assert n < 100
    assert f"| prefill p50 ms | prefill max (n={n}) ms |" in text
    assert f"| e2e max (n={n}) ms |" in text
    assert "p99" not in text


def test_store_ttft_table_calls_its_p99_over_30_measurements_a_max() -> None:
    report = published("store")
    n = report["ttft"]["configs"]["host"]["samples"]
    text = store_report.markdown(report)
    assert f"| TTFT max (n={n}) ms |" in text
    assert f"medians and max (n={n}) over prompts x rounds" in text
    assert "p99" not in text


def test_rag_tables_call_their_tails_maxima_of_each_workload_s_requests() -> None:
    report = published("rag")
    text = rag_report.markdown(report)
    for result in report["workloads"].values():
        n = result["requests"]
        assert f"| TTFT max (n={n}) ms | e2e p50 ms | queue max (n={n}) s |" in text
    assert "p99" not in text


def test_vllm_tables_call_their_tails_maxima_of_each_workload_s_requests() -> None:
    report = published("vllm")
    text = vllm_report.markdown(report)
    for result in report["workloads"].values():
        n = result["requests"]
        assert f"| TTFT max (n={n}) ms |" in text and f"| queue max (n={n}) s |" in text
    assert "p99" not in text


def test_rag_and_vllm_say_other_cpu_is_in_cores() -> None:
    assert "| other CPU cores |" in rag_report.markdown(published("rag"))
    assert "| other CPU cores |" in vllm_report.markdown(published("vllm"))


def test_rag_throughput_column_says_it_is_the_queue_simulation_s() -> None:
    text = rag_report.markdown(published("rag"))
    assert "| queue req/s |" in text and "| throughput/s |" not in text


def test_rag_report_says_when_nothing_was_skipped() -> None:
    """An empty heading left a reader wondering whether the list was lost."""
    report = {**published("rag"), "skipped": []}
    assert rag_report.markdown(report).endswith("## Skipped\n\n- nothing\n")


def test_serve_report_says_its_cached_column_is_a_share_of_prompt_tokens() -> None:
    loadtest_run = pytest.importorskip("chunkcache.core.serve.loadtest_run")
    assert "| cached share of prompt tokens |" in loadtest_run.markdown(_serve_results(40))


def _serve_results(ttft_n: int | None) -> dict[str, Any]:
    report = published("serve")
    for key in ("ttft_s", "latency_s"):
        report[key].pop("n", None)
        if ttft_n is not None:
            report[key]["n"] = ttft_n
    return report


def test_serve_report_and_finding_carry_the_sample_count() -> None:
    loadtest_run = pytest.importorskip("chunkcache.core.serve.loadtest_run")
    text = loadtest_run.markdown(_serve_results(40))
    assert "| TTFT p50 | TTFT max (n=40) | latency p50 | latency max (n=40) |" in text
    ttft = published("serve")["ttft_s"]
    p50, p99 = f"{ttft['p50']:.2f} s", f"{ttft['p99']:.2f} s"
    (found, *_) = serve_findings(_serve_results(40))
    assert f"TTFT p50 {p50} and max (n=40) {p99}." in found.text
    (found, *_) = serve_findings(_serve_results(None))
    assert f"and p99 (n not recorded) {p99}." in found.text
    (found, *_) = serve_findings(_serve_results(250))
    assert f"and p99 (n=250) {p99}." in found.text


def test_serve_percentiles_record_their_sample_count() -> None:
    loadtest_run = pytest.importorskip("chunkcache.core.serve.loadtest_run")
    stats = loadtest_run._percentiles([0.1, 0.2, 0.3])
    assert stats["n"] == 3 and stats["p99"] == stats["max"] == 0.3


def test_store_speedup_finding_says_it_is_a_paired_median() -> None:
    report = published("store")
    samples = report["ttft"]["configs"]["full"]["samples"]
    (found,) = [f for f in store_findings(report) if "sooner" in f.text]
    assert f"median of {samples} paired measurements" in found.text


def test_every_engine_part_is_stamped_with_its_own_commit(tmp_path: Path) -> None:
    shutil.copy(PUBLISHED / "engine.json", tmp_path / "engine.json")
    report = published("engine")
    rows = [line for line in summary_markdown(tmp_path).splitlines() if "[engine]" in line]
    assert len(rows) == 3
    for part, row in zip(("quality", "quality-reordered", "speed"), rows, strict=True):
        assert f"part `{part}`" in row
        assert f"| `{report[part]['command']}` | {report[part]['environment']['commit']} |" in row


def test_a_single_part_report_keeps_one_row(tmp_path: Path) -> None:
    shutil.copy(PUBLISHED / "store.json", tmp_path / "store.json")
    rows = [line for line in summary_markdown(tmp_path).splitlines() if "[store]" in line]
    assert len(rows) == 1 and "part" not in rows[0]


def test_rag_report_says_what_its_prefix_and_total_columns_count() -> None:
    text = rag_report.markdown(published("rag"))
    assert "Prefix and Total: CRAFT §3.1's metrics" in text and "chunks, not tokens" in text


def test_engine_overhead_finding_names_which_part_each_figure_comes_from() -> None:
    (found,) = [f for f in engine_findings(published("engine")) if "compute share" in f.text]
    assert "token-layers (mean over prompts, quality part)" in found.text
    assert "time (median of per-prompt ratios, speed part)" in found.text
