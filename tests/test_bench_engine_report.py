"""The engine report states its targets from the measured parts only."""

from __future__ import annotations

from typing import Any

from chunkcache.core.bench.engine_bench import PARTS
from chunkcache.core.bench.engine_report import markdown, targets
from chunkcache.core.bench.policies import POLICY_RUNS
from chunkcache.core.bench.quality import QUALITY_METRICS
from chunkcache.core.cli import build_parser

ENV = {
    "cpu": "test cpu",
    "cores": "2",
    "torch_threads": "2",
    "python": "3.11",
    "torch": "2.13.0",
    "transformers": "5",
    "chunkcache": "0.1.0",
    "commit": "abc1234",
}


def stat(value: float) -> dict[str, float]:
    return {"mean": value, "median": value, "p99": value}


def quality_part(tf_kl: dict[str, float]) -> dict[str, Any]:
    def row(name: str) -> dict[str, Any]:
        return {m: stat(tf_kl.get(name, 0.0) if m == "tf_kl" else 0.2) for m in QUALITY_METRICS}

    summary = {run.name: row(run.name) for run in POLICY_RUNS}
    return {
        "answer_tokens": 32,
        "summary": summary,
        "tf_kl_wins": {"cachecraft < cacheblend-0.15": 0.75},
        "environment": ENV,
        "fingerprint": "fp32",
    }


def speed_part(ratio: float) -> dict[str, Any]:
    names = [run.name for run in POLICY_RUNS]
    summary = {
        name: {"ms": stat(100.0 * ratio), "ratio_to_full": stat(ratio)}
        for name in [*names, *(f"{n} e2e" for n in names)]
    }
    summary["hf generate"] = summary["hf forward"] = {"ms": stat(90.0), "ratio_to_full": stat(0.9)}
    return {
        "rounds": 3,
        "summary": summary,
        "cpu": {"own_cores": 2.0, "other_cores": 0.0},
        "environment": ENV,
        "fingerprint": "bf16",
    }


def report(**parts: Any) -> dict[str, Any]:
    base = {
        "command": "chunkcache bench engine",
        "seed": 0,
        "model": "SmolLM2-135M-Instruct",
        "prompts": 50,
        "chunks_per_prompt": 5,
        "prompt_tokens": stat(900.0),
        "runs": [{"name": r.name, "policy": r.policy, "ratio": r.ratio} for r in POLICY_RUNS],
        **parts,
    }
    base["targets"] = targets(base)
    return base


def test_quality_only_report_says_speed_was_not_measured() -> None:
    kl = {"cacheblend-0.15": 0.05, "cacheblend-0.30": 0.04, "cachecraft": 0.03}
    made = report(quality=quality_part(kl))
    met = {t["target"]: t["met"] for t in made["targets"]}
    assert met["cacheblend-0.15 TF KL <= 0.054"]
    assert met["cachecraft TF KL <= cacheblend-0.30's"]
    assert not any("TTFT" in name for name in met)
    text = markdown(made)
    assert "## Speed: not measured" in text
    assert "quality by `chunkcache bench engine` at commit abc1234" in text


def test_speed_targets_compare_with_full_and_hf_generate() -> None:
    made = report(quality=quality_part({"cacheblend-0.15": 0.08}), speed=speed_part(0.5))
    met = {t["target"]: t["met"] for t in made["targets"]}
    assert not met["cacheblend-0.15 TF KL <= 0.054"]
    assert not met["cacheblend-0.15 TTFT <= 0.2 x full (median of per-prompt ratios)"]
    assert met["cacheblend-0.15 TTFT < HF generate (medians)"]  # 50 ms < 90 ms
    assert "| cacheblend-0.15 | 50 | 50 | 0.50 |" in markdown(made)


def test_reordered_quality_adds_cachecraft_targets_of_its_own() -> None:
    system = quality_part({"cacheblend-0.30": 0.02, "cachecraft": 0.03})
    reordered = quality_part({"cacheblend-0.30": 0.02, "cachecraft": 0.01})
    made = report(quality=system, **{"quality-reordered": reordered})
    met = {t["target"]: t["met"] for t in made["targets"]}
    assert not met["cachecraft TF KL <= cacheblend-0.30's"]
    assert met["cachecraft TF KL <= cacheblend-0.30's (chunks cached reordered)"]
    assert not any("cacheblend-0.15 TF KL" in name and "reordered" in name for name in met)
    text = markdown(made)
    assert "## Quality, chunks also cached by an earlier request in another order" in text
    assert "quality-reordered by `chunkcache bench engine`" in text
    assert "## Speed: not measured" in text


def test_the_cli_offers_every_part() -> None:
    assert build_parser().parse_args(["bench", "engine"]).part == "all"
    for part in PARTS:
        assert build_parser().parse_args(["bench", "engine", "--part", part]).part == part


def test_parts_from_different_machines_each_name_their_machine() -> None:
    speed = {**speed_part(0.5), "environment": {**ENV, "cpu": "other cpu"}}
    first_line = markdown(report(quality=quality_part({}), speed=speed)).splitlines()[2]
    assert first_line.startswith("Parts on different machines:")
    assert "quality by `chunkcache bench engine` on test cpu (2 cores)" in first_line
    assert "speed by `chunkcache bench engine` on other cpu (2 cores)" in first_line
    same = markdown(report(quality=quality_part({}), speed=speed_part(0.5))).splitlines()[2]
    assert same.startswith("On test cpu (2 cores), Python 3.11") and " on test cpu" not in same
