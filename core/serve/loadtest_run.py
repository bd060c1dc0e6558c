"""``chunkcache bench serve``: run the load test and write ``docs/benchmarks/serve.{json,md}``."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shlex
import statistics
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

import httpx

from chunkcache.core.bench.cli import POSITIVE, positive_float, report_dir
from chunkcache.core.bench.report import environment, percentile, tail_label, write_report
from chunkcache.core.errors import BackendUnavailableError
from chunkcache.core.json_shapes import clip, json_object
from chunkcache.core.serve.loadtest import (
    LoadTest,
    LoadTestConfig,
    MemorySampler,
    check,
    server_counters,
)
from chunkcache.core.urls import check_api_key, server_root

MiB = 2**20
FLAT_SHARE = 0.05  # resident memory "flat": grew by less than 5% (or 32 MiB) after warm-up
FLAT_MIB = 32
API_KEY_ENV = "CHUNKCACHE_SERVE_API_KEY"  # the server's key (ServeSettings.api_key)


@contextlib.contextmanager
def _server(config: LoadTestConfig) -> Iterator[tuple[str, int | None]]:
    """The server under test: ``config.url``, or a fresh one with a throwaway store."""
    if config.url is not None:
        yield server_root(config.url, name="url"), None
        return
    from chunkcache.core.serve.launcher import serve_process

    with tempfile.TemporaryDirectory(prefix="chunkcache-loadtest-") as folder:
        env = {
            "CHUNKCACHE_STORE_DISK_DIR": folder,
            "CHUNKCACHE_STORE_HOST_BYTES": str(config.host_mib * MiB),
        }
        log = Path(folder) / "serve.log"
        with serve_process(env=env, log=log) as (url, proc):
            yield url, proc.pid


def run_loadtest(config: LoadTestConfig, command: str) -> dict[str, Any]:
    """Run the load test; write the report when ``config.out`` is set; the results."""
    from chunkcache.core.corpus import load_corpus

    chunks = [c.text for c in load_corpus(max_chunks=config.pool)]
    headers = _auth_headers()
    with _server(config) as (url, pid):
        model = _first_model(url, headers)
        test = LoadTest(config, url, chunks, model, headers)
        before = server_counters(url)
        sampler = MemorySampler(pid) if pid is not None else contextlib.nullcontext()
        with sampler:
            wall_s = asyncio.run(test.run())
        after = server_counters(url)
    results = summarize_run(config, test, wall_s, before, after, sampler)
    results["command"] = command
    results["machine_load"] = {
        "loadavg_1m_after": os.getloadavg()[0],
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS", "unset (torch default)"),
    }
    if config.out is not None:
        write_report(config.out, config.name, results, markdown(results))
    return results


def _auth_headers() -> dict[str, str]:
    """The API key header: ``CHUNKCACHE_SERVE_API_KEY``, the variable the server reads (a
    server this test starts inherits it), from the environment only, never from the
    command line, which the report records."""
    key = os.environ.get(API_KEY_ENV)
    if not key:
        return {}
    check_api_key(key, API_KEY_ENV)
    return {"Authorization": f"Bearer {key}"}


def _first_model(url: str, headers: dict[str, str]) -> str:
    """The id of the first model the server at ``url`` serves; a
    :class:`BackendUnavailableError` naming ``url`` when it cannot tell."""
    server, where = f"the server at {url}", "GET /v1/models"
    try:
        response = httpx.get(f"{url}/v1/models", headers=headers, timeout=10)
    except httpx.HTTPError as error:
        raise BackendUnavailableError(f"{server} is unreachable: {error}") from None
    if response.status_code != 200:
        raise BackendUnavailableError(
            f"{server} answered {where} with {response.status_code}: {response.text[:200]!r}"
        )
    models = json_object(response.text, where, server, data=list)["data"]
    if not models or not isinstance(models[0], dict) or not isinstance(models[0].get("id"), str):
        raise BackendUnavailableError(f"{server} answered {where} with no model: {clip(models)}")
    return str(models[0]["id"])


def summarize_run(
    config: LoadTestConfig,
    test: LoadTest,
    wall_s: float,
    before: dict[str, float],
    after: dict[str, float],
    sampler: Any,
) -> dict[str, Any]:
    counts = check(test.outcomes)
    done = test.measured()
    finished = test.finished_in_window()  # throughput: answers that ended in the window
    ttft = [o.ttft_s for o in done if o.ttft_s is not None]
    latency = [o.latency_s for o in done]
    server = {k: after[k] - before[k] for k in after}
    counts["server_disagrees"] = int(
        server["completed"] != counts["completed"] or server["http_429"] != counts["rejected_429"]
    )
    prompt = sum(o.prompt_tokens for o in done)
    return {
        "config": {k: str(v) if isinstance(v, Path) else v for k, v in asdict(config).items()},
        "environment": environment(["fastapi", "uvicorn", "httpx", "torch", "transformers"]),
        "wall_s": wall_s,
        "counts": counts,
        "server_counts": server,
        "throughput": {
            "requests_per_s": len(finished) / config.duration_s,
            "output_tokens_per_s": sum(o.completion_tokens for o in finished) / config.duration_s,
        },
        "ttft_s": _percentiles(ttft),
        "latency_s": _percentiles(latency),
        "cached_token_share": sum(o.cached_tokens for o in done) / prompt if prompt else 0.0,
        "memory": memory(getattr(sampler, "samples", []), config.warmup_s),
        "ok": not any(counts[k] for k in ("errors", "lost", "answered_twice", "wrong_echo"))
        and not counts["server_disagrees"],
    }


def _percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    return {
        "n": len(values),
        "p50": percentile(values, 0.5),
        "p99": percentile(values, 0.99),
        "mean": statistics.fmean(values),
        "max": max(values),
    }


def memory(samples: list[tuple[float, int]], warmup_s: float) -> dict[str, Any]:
    """Resident memory after warm-up: median of its first and last thirds, and the growth."""
    after = [rss for t, rss in samples if t >= warmup_s]
    if len(after) < 3:
        return {"samples": len(samples)}
    third = len(after) // 3
    early, late = statistics.median(after[:third]), statistics.median(after[-third:])
    growth = late - early
    return {
        "samples": len(samples),
        "timeline_mib": [[round(t), round(rss / MiB)] for t, rss in samples[::5]],
        "early_mib": early / MiB,
        "late_mib": late / MiB,
        "max_mib": max(after) / MiB,
        "growth_mib": growth / MiB,
        "flat": growth < max(FLAT_SHARE * early, FLAT_MIB * MiB),
    }


def markdown(results: dict[str, Any]) -> str:
    """The report as markdown."""
    c, cfg, env = results["counts"], results["config"], results["environment"]
    ttft, lat, mem, tp = (results[k] for k in ("ttft_s", "latency_s", "memory", "throughput"))
    ttft_tail, lat_tail = (tail_label([stats.get("n")]) for stats in (ttft, lat))
    lines = [
        "# chunkcache serve: load test over loopback",
        "",
        f"`{results['command']}`: {cfg['clients']} concurrent streaming clients for "
        f"{cfg['duration_s']:.0f} s after {cfg['warmup_s']:.0f} s of warm-up under the same "
        f"load, on the default model, {cfg['chunks_per_prompt']} chunks of a "
        f"{cfg['pool']}-chunk pool per prompt, {cfg['max_tokens']} output tokens. Every "
        "request is checked; timings are of the requests sent after warm-up.",
        "",
        f"Result: **{'pass' if results['ok'] else 'FAIL'}** (no errors but 429s, no request "
        "lost or answered twice, server counters agree with the client's).",
        "",
        "| requests | completed | 429 | errors | lost | answered twice | server disagrees |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
        f"| {c['requests']} | {c['completed']} | {c['rejected_429']} | {c['errors']} | "
        f"{c['lost']} | {c['answered_twice']} | {c['server_disagrees']} |",
        "",
        f"| throughput | TTFT p50 | TTFT {ttft_tail} | latency p50 | latency {lat_tail} | "
        "cached share of prompt tokens |",
        "| ---: | ---: | ---: | ---: | ---: | ---: |",
        f"| {tp['requests_per_s']:.2f} req/s, {tp['output_tokens_per_s']:.1f} tok/s | "
        f"{ttft.get('p50', 0):.2f} s | {ttft.get('p99', 0):.2f} s | {lat.get('p50', 0):.2f} s | "
        f"{lat.get('p99', 0):.2f} s | {results['cached_token_share']:.0%} |",
        "",
    ]
    if "growth_mib" in mem:
        lines += [
            f"Server resident memory after {cfg['warmup_s']:.0f} s of warm-up: "
            f"{mem['early_mib']:.0f} MiB (first third, median) -> {mem['late_mib']:.0f} MiB "
            f"(last third), growth {mem['growth_mib']:+.1f} MiB, max {mem['max_mib']:.0f} MiB: "
            f"**{'flat' if mem['flat'] else 'GROWING'}**.",
            "",
        ]
    load = results.get("machine_load", {})
    if load:
        lines += [
            f"Machine load average (1 min) at the end: {load['loadavg_1m_after']:.1f} on "
            f"{env['cores']} cores; OMP_NUM_THREADS={load['omp_num_threads']}.",
            "",
        ]
    lines += ["Machine and versions:", ""]
    lines += [f"- {k}: {v}" for k, v in env.items()]
    return "\n".join(lines) + "\n"


def _zero_or_positive(text: str) -> float:
    """An argparse ``type``: 0, or a number :func:`positive_float` accepts."""
    with contextlib.suppress(ValueError):
        if float(text) == 0:
            return 0.0
    return positive_float(text)


def _server_url(text: str) -> str:
    """An argparse ``type``: a server's http(s) URL, with or without its ``/v1``
    (:func:`~chunkcache.core.urls.server_root`), checked before the run starts."""
    try:
        return server_root(text, name="--url")
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def add_bench_serve_parser(bench: Any) -> None:
    """Add ``serve`` to ``chunkcache bench``'s subcommands."""
    parser = bench.add_parser("serve", help="load test of chunkcache serve over loopback")
    defaults = LoadTestConfig()
    parser.add_argument("--clients", type=POSITIVE, default=defaults.clients)
    parser.add_argument(
        "--duration", type=positive_float, default=defaults.duration_s, help="seconds"
    )
    parser.add_argument(
        "--warmup", type=_zero_or_positive, default=defaults.warmup_s, help="seconds (0: none)"
    )
    parser.add_argument("--max-tokens", type=POSITIVE, default=defaults.max_tokens)
    parser.add_argument(
        "--url", type=_server_url, help="test this running server instead of starting one"
    )
    parser.add_argument("--out", type=report_dir, default=str(defaults.out))
    parser.set_defaults(run=_bench_serve)


def _bench_serve(args: argparse.Namespace) -> None:
    config = LoadTestConfig(
        clients=args.clients,
        duration_s=args.duration,
        warmup_s=args.warmup,
        max_tokens=args.max_tokens,
        url=args.url,
        out=args.out,
    )
    results = run_loadtest(config, shlex.join(["chunkcache", *sys.argv[1:]]))
    print(markdown(results))
    if not results["ok"]:
        raise SystemExit(1)


__all__ = ["add_bench_serve_parser", "run_loadtest"]
