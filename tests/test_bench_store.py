"""``chunkcache bench store``: its pure helpers (fast) and a quick run end to end (slow)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import pytest

from chunkcache.core.bench.store_bench import StoreBenchConfig, quick, run_store_bench
from chunkcache.core.bench.store_hit_rates import (
    CAPACITIES,
    POLICIES,
    fit_prefill_cost,
    fitted_cost,
    trace_requests,
    working_set_bytes,
)
from chunkcache.core.store.simulate import replay
from chunkcache.core.workload import Turn


def turn(conversation: str, index: int, question: str) -> Turn:
    return Turn(conversation, index, question, "topic", float(index))


RETRIEVED = {"q1": ["a", "b", "c"], "q2": ["b", "c", "d"], "q3": ["a", "b"]}


def retrieve(question: str, k: int) -> Sequence[str]:
    return RETRIEVED[question][:k]


def test_trace_drops_what_the_conversation_holds_and_skips_empty_turns() -> None:
    turns = [turn("c1", 0, "q1"), turn("c1", 1, "q2"), turn("c1", 2, "q3"), turn("c2", 0, "q3")]
    requests = trace_requests(turns, retrieve, lambda chunk_id: 10 + ord(chunk_id), k=3)
    assert [sorted(c for c, _ in r) for r in requests] == [["a", "b", "c"], ["d"], ["a", "b"]]
    assert all(n == 10 + ord(c) for r in requests for c, n in r)


def test_trace_keeps_k() -> None:
    requests = trace_requests([turn("c1", 0, "q1")], retrieve, lambda _: 4, k=2)
    assert [c for c, _ in requests[0]] and len(requests[0]) == 2


def test_working_set_is_what_an_unbounded_replay_stores() -> None:
    requests = [[("a", 3), ("b", 5)], [("b", 5), ("c", 2)], [("a", 3)]]
    working_set = working_set_bytes(requests, 4)
    assert working_set == (3 + 5 + 2) * 4
    everything = replay(requests, "lru", working_set, 4)  # just fits: nothing evicted
    assert everything.evictions == 0 and (everything.hits, everything.lookups) == (2, 5)
    assert replay(requests, "lru", working_set - 4, 4).evictions > 0


def test_fit_recovers_the_cost_shape() -> None:
    truth = fitted_cost(2e-4, 1e-7)
    samples = [(n, truth(0, n)) for n in (256, 768, 1280)]
    a, b = fit_prefill_cost(samples)
    assert a == pytest.approx(2e-4) and b == pytest.approx(1e-7)
    assert fitted_cost(a, b)(100, 50) == pytest.approx(truth(100, 50))
    flat = fit_prefill_cost([(100, 0.02), (200, 0.02)])  # faster per token when longer
    assert flat[1] == 0.0


@pytest.mark.slow
def test_quick_run_writes_a_sane_report(tmp_path: Path) -> None:
    config = quick(StoreBenchConfig(out=tmp_path))
    run_store_bench(config, "pytest", lambda _: None)
    report = json.loads((tmp_path / "store.json").read_text())
    rows = report["hit_rates"]["rows"]
    assert len(rows) == len(POLICIES) * len(CAPACITIES)
    lru = [r["hit_rate"] for r in rows if r["policy"] == "lru"]
    assert lru == sorted(lru) and lru[0] >= 0 and lru[-1] <= 1
    assert report["hit_rates"]["working_set_bytes"] > 0
    assert all(r["hit_rate"] <= report["hit_rates"]["unbounded_hit_rate"] for r in rows)
    configs = report["ttft"]["configs"]
    assert {"host", "host+queue", "disk", "disk, pipelined", "disk+prefetch", "full"} <= set(
        configs
    )
    assert configs["host"]["ratio_to_host"] == pytest.approx(1.0)
    assert configs["full"]["ratio_to_full"] == pytest.approx(1.0)
    assert configs["host"]["store"]["host"]["hits"] > 0
    assert "disk" not in configs["host"]["store"]
    assert "disk" not in configs["host+queue"]["store"]
    assert configs["disk"]["store"]["disk"]["hits"] > 0
    assert configs["disk"]["store"]["disk"]["load_seconds"] > 0
    assert configs["disk+prefetch"]["store"]["disk"]["prefetched"] > 0
    # the same disk hits, read whole by default on the CPU, layer by layer when asked
    piped = configs["disk, pipelined"]
    assert configs["disk"]["pipelined"] == 0.0 and piped["pipelined"] == 1.0
    assert piped["store"]["disk"]["hits"] == configs["disk"]["store"]["disk"]["hits"]
    assert piped["store"]["disk"]["load_seconds"] > 0
    assert configs["disk"]["ratio_to_disk"] == pytest.approx(1.0)
    if "redis" in configs:
        assert configs["redis"]["store"]["redis"]["hits"] > 0
    assert isinstance(report["target"]["met"], bool)
    assert (tmp_path / "store-hit-rate.png").stat().st_size > 0
    text = (tmp_path / "store.md").read_text()
    assert "## Hit rates" in text and "## TTFT by tier" in text and "**Target**" in text
    assert "| disk, pipelined |" in text and "**Lazy disk reads**" in text
