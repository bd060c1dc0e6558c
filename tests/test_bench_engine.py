"""``chunkcache bench engine`` end to end on two prompts of the real model (slow)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from chunkcache.core.bench.engine_bench import EngineBenchConfig, run_engine_bench

pytestmark = pytest.mark.slow


def test_engine_bench_writes_every_part_and_the_targets(tmp_path: Path) -> None:
    config = EngineBenchConfig(prompts=2, rounds=1, answer_tokens=4, out=tmp_path)
    run_engine_bench(config, "pytest")
    report = json.loads((tmp_path / "engine.json").read_text())
    quality, speed = report["quality"]["summary"], report["speed"]["summary"]
    assert quality["full"]["tf_kl"]["mean"] == 0.0
    assert quality["prefix"]["tf_kl"]["mean"] < 1e-3
    assert quality["reuse"]["token_layer_share"]["mean"] < 0.1
    assert speed["full"]["ratio_to_full"]["median"] == pytest.approx(1.0)
    assert {"hf generate", "hf forward", "cacheblend-0.15 e2e"} <= set(speed)
    reordered = report["quality-reordered"]["summary"]
    assert reordered["full"]["tf_kl"]["mean"] == 0.0
    assert report["quality-reordered"]["warmup"] == "reordered"
    assert len(report["targets"]) == 10
    text = (tmp_path / "engine.md").read_text()
    assert "## Quality" in text and "## Time to first token" in text
    assert "## Quality, chunks also cached by an earlier request in another order" in text

    # The speed part alone keeps the quality part measured on the same prompts.
    speed_only = EngineBenchConfig(
        prompts=2, rounds=1, answer_tokens=4, out=tmp_path, parts=("speed",)
    )
    again = run_engine_bench(speed_only, "pytest")
    assert again["quality"] == report["quality"]
    assert again["quality-reordered"] == report["quality-reordered"]
