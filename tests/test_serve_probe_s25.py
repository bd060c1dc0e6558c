"""Probes of ``chunkcache serve`` that the other serve tests leave out: a body over the limit
sent chunked (no Content-Length: counted as it streams in), a body not sent as JSON, and the
local (unbatched) backend on a tiny random Llama: a streaming client that leaves frees its
place and the server answers the next request, and a streamed answer agrees with the whole
one on text, finish reason and usage."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from fake_backend import FakeBackend
from test_serve_cancel import metric
from tiny_models import tiny_lm

from chunkcache.core.engine import ChunkEngine
from chunkcache.core.local_backend import LocalBackend
from chunkcache.core.serve import ServeSettings, create_app
from chunkcache.core.serve.launcher import serve_app

PROMPT = " ".join(f"w{(14 + i * 3) % 120}" for i in range(16))  # greedy: no EOS for 400 tokens
CHUNK = " ".join(f"w{(7 + i * 5) % 120}" for i in range(20))  # 32+ characters: a chunk


def completion(max_tokens: int, stream: bool = False, policy: str = "cacheblend") -> dict[str, Any]:
    return {
        "model": "chunkcache-local",
        "prompt": f"{PROMPT} {CHUNK} w3",
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": stream,
        "stream_options": {"include_usage": True} if stream else None,
        "chunkcache": {"chunks": [{"id": "c1", "text": CHUNK}], "policy": policy},
    }


@pytest.fixture(scope="module")
def fake_url() -> Iterator[str]:
    with serve_app(create_app(FakeBackend(), ServeSettings(max_body_bytes=4096))) as url:
        yield url


@pytest.fixture(scope="module")
def local_url() -> Iterator[str]:
    with serve_app(create_app(LocalBackend(ChunkEngine(tiny_lm("llama"))))) as url:
        yield url


def test_a_chunked_body_over_the_limit_is_a_413_and_the_server_goes_on(fake_url: str) -> None:
    body = json.dumps({"model": FakeBackend.model_name, "prompt": "y" * 20_000}).encode()
    pieces = iter([body[i : i + 1000] for i in range(0, len(body), 1000)])  # no Content-Length
    with httpx.Client(base_url=fake_url, timeout=30) as client:
        response = client.post("/v1/completions", content=pieces)
        assert response.status_code == 413
        assert response.json()["error"]["code"] == "body_too_large"
        small = {"model": FakeBackend.model_name, "prompt": "hi", "max_tokens": 2}
        assert client.post("/v1/completions", json=small).status_code == 200


@pytest.mark.parametrize("content_type", [None, "text/plain", "application/x-www-form-urlencoded"])
def test_a_body_not_sent_as_json_is_a_400_in_openais_shape(
    fake_url: str, content_type: str | None
) -> None:
    body = json.dumps({"model": FakeBackend.model_name, "prompt": "hi", "max_tokens": 2})
    headers = {"content-type": content_type} if content_type else {}
    response = httpx.post(f"{fake_url}/v1/completions", content=body, headers=headers)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert "Content-Type: application/json" in error["message"]


@pytest.mark.parametrize("field", ["tool_choice", "function_call"])
def test_choosing_no_tool_is_taken(fake_url: str, field: str) -> None:
    body = {"model": FakeBackend.model_name, "messages": [{"role": "user", "content": "hi"}]}
    response = httpx.post(f"{fake_url}/v1/chat/completions", json={**body, field: "none"})
    assert response.status_code == 200, response.text
    auto = httpx.post(f"{fake_url}/v1/chat/completions", json={**body, field: "auto"})
    assert auto.status_code == 400 and auto.json()["error"]["param"] == field


def test_a_streaming_client_that_leaves_the_local_backend_frees_its_place(local_url: str) -> None:
    cancelled = 'chunkcache_generations_total{outcome="cancelled"}'
    with httpx.Client(base_url=local_url, timeout=60) as client:
        before = metric(client, cancelled)
        with client.stream("POST", "/v1/completions", json=completion(400, True)) as response:
            lines = response.iter_lines()
            assert next(lines).startswith("data: ")
        for _ in range(200):  # bounded: 200 scrapes
            if metric(client, cancelled) == before + 1:
                break
        assert metric(client, cancelled) == before + 1
        assert metric(client, "chunkcache_in_flight_requests") == 0
        answer = client.post("/v1/completions", json=completion(3))
        assert answer.status_code == 200
        assert answer.json()["usage"]["completion_tokens"] == 3


def test_a_streamed_answer_agrees_with_the_whole_one(local_url: str) -> None:
    # "full" recomputes every token, so the two runs are the same computation (reuse is
    # approximate: a cold and a warm run may differ by design)
    with httpx.Client(base_url=local_url, timeout=60) as client:
        whole = client.post("/v1/completions", json=completion(12, policy="full")).json()
        texts, finishes, usage = [], [], None
        with client.stream(
            "POST", "/v1/completions", json=completion(12, True, "full")
        ) as response:
            for line in response.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line.removeprefix("data: "))
                for choice in event["choices"]:
                    texts.append(choice["text"])
                    finishes += [choice["finish_reason"]] if choice["finish_reason"] else []
                usage = event.get("usage") or usage
    assert "".join(texts) == whole["choices"][0]["text"]
    assert finishes == [whole["choices"][0]["finish_reason"]]
    assert usage is not None
    for field in ("prompt_tokens", "completion_tokens", "total_tokens"):
        assert usage[field] == whole["usage"][field]
