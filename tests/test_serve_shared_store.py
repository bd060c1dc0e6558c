"""Two ``chunkcache serve`` processes sharing one disk directory and one Redis reuse each
other's chunk KV (Shared RAG-DCache); SIGTERM finishes the request in flight."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any, NamedTuple

import httpx
import pytest

from chunkcache.core.serve.launcher import start_process, stop, wait_healthy
from chunkcache.core.store.redis_server import REDIS_SERVER, redis_server

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(REDIS_SERVER is None, reason="needs Debian's redis-server"),
]

CHUNKS = [
    "Basalt forms when lava rich in iron and magnesium cools quickly at the surface, "
    "which is why ocean floors are mostly basalt.",
    "Granite cools slowly deep underground, so its crystals of quartz and feldspar grow "
    "large enough to see with the naked eye.",
]


def body(model: str, system: str = "Answer from the context.", **extra: Any) -> dict[str, Any]:
    context = "\n\n".join(CHUNKS)
    return {
        "model": model,
        "messages": [
            {"role": "system", "content": system},
            {"role": "user", "content": f"Context:\n{context}\n\nWhich rock cools slowly?"},
        ],
        "max_tokens": 8,
        "temperature": 0,
        "chunkcache": {"chunks": [{"text": text} for text in CHUNKS]},
        **extra,
    }


def gauge(url: str, name: str) -> float:
    match = re.search(rf"^{re.escape(name)} (\S+)$", httpx.get(f"{url}/metrics").text, re.M)
    return float(match.group(1)) if match else 0.0


class Servers(NamedTuple):
    folder: Path
    started: list[tuple[str, subprocess.Popen[bytes]]]


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Servers]:
    folder = tmp_path_factory.mktemp("shared")
    with ExitStack() as stack:
        redis_url, _ = stack.enter_context(redis_server(folder))
        env = {
            "CHUNKCACHE_STORE_DISK_DIR": str(folder / "kv"),
            "CHUNKCACHE_STORE_REDIS_URL": redis_url,
            "OMP_NUM_THREADS": "1",
        }
        started = []
        for name in ("a", "b"):  # both load the model at once
            proc, url, output = start_process(env=env, log=folder / f"{name}.log")
            if not isinstance(output, int):
                stack.callback(output.close)
            stack.callback(stop, proc)
            started.append((url, proc))
        for url, proc in started:
            wait_healthy(url, 300, proc)
        yield Servers(folder, started)


def test_second_server_reuses_what_the_first_computed(servers: Servers) -> None:
    (url_a, _), (url_b, _) = servers.started
    model = httpx.get(f"{url_a}/v1/models").json()["data"][0]["id"]
    first = httpx.post(f"{url_a}/v1/chat/completions", json=body(model), timeout=120).json()
    assert first["usage"]["chunkcache"]["chunk_misses"] == 2
    puts = gauge(url_a, "chunkcache_store_puts")
    assert puts >= 2
    for tier in ("disk", "redis"):  # A writes through to the shared tiers in the background
        assert _eventually(url_a, f'chunkcache_store_tier_entries{{tier="{tier}"}}', puts), tier
    # B never saw these chunks; another system prompt, so they are moved, not a prefix
    second = httpx.post(f"{url_b}/v1/chat/completions", json=body(model, "Be brief."), timeout=120)
    usage = second.json()["usage"]
    assert usage["chunkcache"]["chunk_hits"] == 2
    assert usage["prompt_tokens_details"]["cached_tokens"] > 0
    # Served from the tiers the two servers share: read by the request itself, or moved up
    # to B's host tier by the prefetch that starts while it is queued (whichever ran first)
    tiers = usage["chunkcache"]["extra"]["store"]["tiers"]
    shared_hits = sum(tiers.get(tier, {}).get("hits", 0) for tier in ("disk", "redis"))
    prefetched = sum(
        gauge(url_b, f'chunkcache_store_tier_prefetched{{tier="{tier}"}}')
        for tier in ("disk", "redis")
    )
    assert shared_hits + prefetched >= 1, tiers


def test_sigterm_finishes_the_request_in_flight(servers: Servers) -> None:
    url, proc = servers.started[1]
    model = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
    events: list[Any] = []
    first_token = threading.Event()

    def read() -> None:
        request = body(model, max_tokens=32, stream=True)
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=request, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:] if line == "data: [DONE]" else json.loads(line[6:]))
                    first_token.set()

    reader = threading.Thread(target=read)
    reader.start()
    assert first_token.wait(120)
    # uvicorn shuts down cleanly, then re-raises the signal, which the CLI turns into exit 143
    assert stop(proc, timeout_s=60) in (0, 128 + signal.SIGTERM, -signal.SIGTERM)
    reader.join(60)
    assert events[-1] == "[DONE]"  # the stream ran to its end
    assert any(e["choices"] and e["choices"][0]["finish_reason"] for e in events[:-1])
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{url}/health")
    log = (servers.folder / "b.log").read_text()
    assert "Application shutdown complete" in log and "Traceback" not in log


def _eventually(url: str, name: str, at_least: float, timeout_s: float = 30.0) -> bool:
    """Whether gauge ``name`` reaches ``at_least`` within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if gauge(url, name) >= at_least:
            return True
        time.sleep(0.1)
    return False
