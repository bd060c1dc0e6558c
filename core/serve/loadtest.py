"""A bounded load test of ``chunkcache serve`` over loopback: ``chunkcache bench serve``.

``clients`` concurrent clients each send streamed RAG chat requests (a system prompt,
``chunks_per_prompt`` corpus chunks named in the ``chunkcache`` extension, a question)
back to back for ``warmup_s`` then ``duration_s`` seconds; a 429 waits its Retry-After and
tries again.  Throughput, TTFT and memory are judged on the measured window after warm-up
(requests sent in it); every request of the run is checked.
Every request carries a unique ``X-Request-Id``.  Checked: every request got exactly one
answer (one ``finish_reason``, one ``[DONE]``, its own id echoed, a response id no other
request got) or a 429; the server's counters agree with the client's; the server's
resident memory stays flat after warm-up.  Reported: throughput, TTFT and latency
percentiles, reuse.  Bounded in time (``duration_s`` plus ``request_timeout_s``) and
count (``max_requests``).

Warm-up matters for memory: torch/oneDNN caches kernels per tensor shape, and every new
prompt length and batch size is a new shape (see core/serve/server.py).
"""

from __future__ import annotations

import asyncio
import json
import random
import re
import threading
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

SYSTEM = "Answer the question from the context. Be brief."


@dataclass(frozen=True)
class LoadTestConfig:
    clients: int = 32
    duration_s: float = 60.0
    warmup_s: float = 45.0  # the same load first; timings and memory are judged after it
    max_tokens: int = 16
    chunks_per_prompt: int = 3
    pool: int = 24  # distinct corpus chunks the prompts draw from
    max_requests: int = 100_000
    request_timeout_s: float = 300.0
    seed: int = 0
    host_mib: int = 64  # the started server's host tier: full after warm-up, so RSS can settle
    url: str | None = None  # an already running server; None: start one
    out: Path | None = Path("docs/benchmarks")
    name: str = "serve"


@dataclass
class Outcome:
    """One request as the client saw it."""

    request_id: str
    start: float
    status: int = 0
    ttft_s: float | None = None
    latency_s: float = 0.0
    finishes: int = 0
    done: int = 0
    response_ids: set[str] = field(default_factory=set)
    echoed: str | None = None
    completion_tokens: int = 0
    cached_tokens: int = 0
    prompt_tokens: int = 0
    error: str | None = None


class LoadTest:
    """Drives ``config.clients`` clients against ``url`` and keeps every outcome."""

    def __init__(
        self,
        config: LoadTestConfig,
        url: str,
        chunks: list[str],
        model: str,
        headers: dict[str, str] | None = None,
    ) -> None:
        self.config = config
        self.url = url
        self.headers = headers or {}  # e.g. the server's API key; not in the report
        self.chunks = chunks
        self.model = model
        self.outcomes: list[Outcome] = []
        self._rng = random.Random(config.seed)
        self.measure_from = 0.0  # monotonic time the measured window starts

    def body(self) -> dict[str, Any]:
        picked = self._rng.sample(self.chunks, self.config.chunks_per_prompt)
        context = "\n\n".join(picked)
        question = f"Question {self._rng.randrange(1000)}: what does the context describe?"
        return {
            "model": self.model,
            "messages": [
                {"role": "system", "content": SYSTEM},
                {"role": "user", "content": f"Context:\n{context}\n\n{question}"},
            ],
            "max_tokens": self.config.max_tokens,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
            "chunkcache": {"chunks": [{"text": text} for text in picked]},
        }

    async def run(self) -> float:
        """Run every client through warm-up and the measured window; the wall seconds from
        the window's start to the last answer."""
        started = time.monotonic()
        self.measure_from = started + self.config.warmup_s
        deadline = self.measure_from + self.config.duration_s
        limits = httpx.Limits(max_connections=self.config.clients + 4)
        timeout = httpx.Timeout(self.config.request_timeout_s, connect=10.0)
        async with httpx.AsyncClient(
            base_url=self.url, headers=self.headers, limits=limits, timeout=timeout
        ) as http:
            await asyncio.gather(
                *(self._client(http, deadline) for _ in range(self.config.clients))
            )
        return time.monotonic() - self.measure_from

    def finished_in_window(self) -> list[Outcome]:
        """The answered requests that ended inside the measured window (for throughput)."""
        end = self.measure_from + self.config.duration_s
        return [
            o
            for o in self.outcomes
            if o.status == 200
            and o.error is None
            and self.measure_from <= o.start + o.latency_s < end
        ]

    def measured(self) -> list[Outcome]:
        """The answered requests sent in the measured window (after warm-up)."""
        return [
            o
            for o in self.outcomes
            if o.status == 200 and o.error is None and o.start >= self.measure_from
        ]

    async def _client(self, http: httpx.AsyncClient, deadline: float) -> None:
        while time.monotonic() < deadline and len(self.outcomes) < self.config.max_requests:
            outcome = Outcome(uuid.uuid4().hex, time.monotonic())
            self.outcomes.append(outcome)
            retry_after = await self._one(http, outcome)
            if retry_after:
                await asyncio.sleep(min(retry_after, max(0.0, deadline - time.monotonic())))

    async def _one(self, http: httpx.AsyncClient, outcome: Outcome) -> float:
        headers = {"X-Request-Id": outcome.request_id}
        try:
            async with http.stream(
                "POST", "/v1/chat/completions", json=self.body(), headers=headers
            ) as response:
                outcome.status = response.status_code
                outcome.echoed = response.headers.get("x-request-id")
                if response.status_code == 429:
                    await response.aread()
                    return float(response.headers.get("retry-after", "1"))
                if response.status_code != 200:
                    outcome.error = (await response.aread()).decode()[:200]
                    return 0.0
                async for line in response.aiter_lines():
                    self._line(outcome, line)
        except httpx.HTTPError as error:
            outcome.error = f"{type(error).__name__}: {error}"
        outcome.latency_s = time.monotonic() - outcome.start
        return 0.0

    def _line(self, outcome: Outcome, line: str) -> None:
        if not line.startswith("data:"):
            return
        data = line[5:].strip()
        if data == "[DONE]":
            outcome.done += 1
            return
        event = json.loads(data)
        if "error" in event:
            outcome.error = str(event["error"].get("message"))
            return
        outcome.response_ids.add(event["id"])
        for choice in event["choices"]:
            if choice["delta"].get("content") and outcome.ttft_s is None:
                outcome.ttft_s = time.monotonic() - outcome.start
            if choice.get("finish_reason"):
                outcome.finishes += 1
        if event.get("usage"):
            usage = event["usage"]
            outcome.completion_tokens = usage["completion_tokens"]
            outcome.prompt_tokens = usage["prompt_tokens"]
            outcome.cached_tokens = usage["prompt_tokens_details"]["cached_tokens"]


class MemorySampler:
    """Samples a process's resident memory once a second in a thread."""

    def __init__(self, pid: int, interval_s: float = 1.0) -> None:
        import psutil

        self.process = psutil.Process(pid)
        self.interval_s = interval_s
        self.samples: list[tuple[float, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)

    def __enter__(self) -> MemorySampler:
        self._started = time.monotonic()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                rss = self.process.memory_info().rss
            except Exception:  # the process is gone: nothing more to sample
                return
            self.samples.append((time.monotonic() - self._started, rss))
            self._stop.wait(self.interval_s)


def server_counters(url: str) -> dict[str, float]:
    """The server's completed generations and 429/200 chat responses, from /metrics."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    chat = r'chunkcache_http_responses_total\{code="%s",path="/v1/chat/completions"\} (\S+)'
    wanted = {
        "completed": r'chunkcache_generations_total\{outcome="completed"\} (\S+)',
        "http_200": chat % 200,
        "http_429": chat % 429,
    }
    out = {}
    for name, pattern in wanted.items():
        match = re.search(pattern, text)
        out[name] = float(match.group(1)) if match else 0.0
    return out


def check(outcomes: list[Outcome]) -> dict[str, int]:
    """Counts of each way a request ended, and of every broken promise."""
    ids = Counter(rid for o in outcomes for rid in o.response_ids)
    return {
        "requests": len(outcomes),
        "completed": sum(o.status == 200 and o.finishes == 1 and o.done == 1 for o in outcomes),
        "rejected_429": sum(o.status == 429 for o in outcomes),
        "errors": sum(o.error is not None for o in outcomes),
        "lost": sum(o.status == 200 and (o.finishes == 0 or o.done == 0) for o in outcomes),
        "answered_twice": sum(o.finishes > 1 or o.done > 1 for o in outcomes)
        + sum(n > 1 for n in ids.values()),
        "wrong_echo": sum(o.status != 0 and o.echoed != o.request_id for o in outcomes),
    }
