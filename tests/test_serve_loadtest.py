"""The load test's bookkeeping: lost and doubled answers are caught, memory growth is judged."""

from __future__ import annotations

import asyncio
import json

import pytest
from fake_backend import FakeBackend
from pydantic import SecretStr

from chunkcache.core.errors import BackendUnavailableError
from chunkcache.core.serve import ServeSettings, create_app
from chunkcache.core.serve.launcher import serve_app
from chunkcache.core.serve.loadtest import LoadTest, LoadTestConfig, Outcome, check, server_counters
from chunkcache.core.serve.loadtest_run import (
    MiB,
    markdown,
    memory,
    run_loadtest,
    summarize_run,
)

CHUNKS = [
    f"Chunk number {i} says something long enough to be matched as a chunk." for i in range(4)
]


def answered(request_id: str, response_id: str) -> Outcome:
    outcome = Outcome(request_id, 0.0, status=200, finishes=1, done=1, echoed=request_id)
    outcome.response_ids.add(response_id)
    return outcome


def test_check_catches_every_broken_promise() -> None:
    fine = [answered("a", "r1"), Outcome("b", 0.0, status=429, echoed="b")]
    assert check(fine) == {
        "requests": 2,
        "completed": 1,
        "rejected_429": 1,
        "errors": 0,
        "lost": 0,
        "answered_twice": 0,
        "wrong_echo": 0,
    }
    lost = answered("c", "r2")
    lost.done = 0
    twice = answered("d", "r3")
    twice.finishes = 2
    shared_id = answered("e", "r1")  # the same response as request "a"
    wrong = answered("f", "r4")
    wrong.echoed = "a"
    counts = check([*fine, lost, twice, shared_id, wrong])
    assert (counts["lost"], counts["answered_twice"], counts["wrong_echo"]) == (1, 2, 1)


def test_memory_is_judged_after_warmup() -> None:
    flat = [(float(t), 500 * MiB + (t % 3) * MiB) for t in range(60)]
    assert memory(flat, warmup_s=10)["flat"]
    growing = [(float(t), (500 + 4 * t) * MiB) for t in range(60)]
    result = memory(growing, warmup_s=10)
    assert not result["flat"] and result["growth_mib"] > 100
    warming = [(float(t), (300 + 40 * min(t, 10)) * MiB) for t in range(60)]
    assert memory(warming, warmup_s=10)["flat"]  # growth during warm-up does not count


def test_a_short_run_against_a_fake_server() -> None:
    config = LoadTestConfig(
        clients=3, warmup_s=0.5, duration_s=1.0, max_tokens=3, chunks_per_prompt=2, out=None
    )
    with serve_app(create_app(FakeBackend())) as url:
        test = LoadTest(config, url, CHUNKS, FakeBackend.model_name)
        before = server_counters(url)
        wall_s = asyncio.run(test.run())
        after = server_counters(url)
    results = summarize_run(config, test, wall_s, before, after, None)
    assert results["ok"], results["counts"]
    assert results["counts"]["completed"] == len(test.outcomes) >= 3
    assert results["server_counts"]["completed"] == results["counts"]["completed"]
    assert results["ttft_s"]["p50"] <= results["ttft_s"]["p99"]
    assert results["throughput"]["requests_per_s"] > 0
    results["command"] = "chunkcache bench serve"
    assert "**pass**" in markdown(results)


def test_a_server_with_an_api_key_is_load_tested_with_the_key_from_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The key comes from CHUNKCACHE_SERVE_API_KEY (what the server reads), never from the
    command line, and the report does not hold it."""
    key = "s3cret-load-test-key"
    app = create_app(FakeBackend(), ServeSettings(api_key=SecretStr(key)))
    with serve_app(app) as url:
        config = LoadTestConfig(
            clients=2, warmup_s=0.2, duration_s=0.5, max_tokens=3, pool=4, url=url, out=None
        )
        with pytest.raises(BackendUnavailableError, match="answered GET /v1/models with 401"):
            run_loadtest(config, "chunkcache bench serve")  # no key
        monkeypatch.setenv("CHUNKCACHE_SERVE_API_KEY", key)
        results = run_loadtest(config, "chunkcache bench serve")
    assert results["ok"], results["counts"]
    assert results["counts"]["completed"] >= 2
    assert key not in json.dumps(results)
