"""chunkcache serve's routes over a fake backend: OpenAI shapes, the extension, errors."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
from fake_backend import FakeBackend, RaisingBackend
from fastapi.testclient import TestClient
from pydantic import SecretStr

from chunkcache.core.chunk_ids import chunk_id
from chunkcache.core.engine import TokenSegment
from chunkcache.core.errors import BackendUnavailableError, PromptTooLongError, QueueFullError
from chunkcache.core.generation import GenerationChunk, GenerationRequest
from chunkcache.core.local_backend import fit_to_window
from chunkcache.core.segmenter import ChunkSegment
from chunkcache.core.serve import ServeSettings, create_app

CHUNK = "The quick brown fox jumps over the lazy dog near the river bank."
MODEL = FakeBackend.model_name
JSON = {"content-type": "application/json"}


def chat(content: str = "Hello there", **extra: object) -> dict[str, object]:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], **extra}


@pytest.fixture
def backend() -> FakeBackend:
    return FakeBackend()


@pytest.fixture
def client(backend: FakeBackend) -> Iterator[TestClient]:
    with TestClient(create_app(backend)) as test_client:
        yield test_client


def chunk_ids(request: GenerationRequest) -> list[str]:
    return [s.chunk_id for s in request.segments if isinstance(s, ChunkSegment)]


def test_models_and_health(client: TestClient) -> None:
    assert client.get("/health").json()["status"] == "ok"
    models = client.get("/v1/models").json()
    assert [m["id"] for m in models["data"]] == [MODEL]
    assert models["data"][0]["max_model_len"] == FakeBackend.context_window


def test_chat_completion_shape_and_usage(client: TestClient, backend: FakeBackend) -> None:
    body = chat(
        f"Context: {CHUNK} Question?",
        max_tokens=4,
        chunkcache={"chunks": [{"id": "c1", "text": CHUNK}]},
    )
    first = client.post("/v1/chat/completions", json=body).json()
    assert first["object"] == "chat.completion"
    assert first["choices"][0]["message"] == {"role": "assistant", "content": "The answer is in"}
    assert first["choices"][0]["finish_reason"] == "length"
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    second = client.post("/v1/chat/completions", json=body).json()["usage"]
    assert (
        second["prompt_tokens_details"]["cached_tokens"]
        == second["chunkcache"]["reused_tokens"]
        > 0
    )
    assert second["chunkcache"]["chunk_hits"] == 1
    assert second["chunkcache"]["recomputed_tokens"] > 0  # the documented extension
    assert second["total_tokens"] == second["prompt_tokens"] + second["completion_tokens"]
    assert chunk_ids(backend.requests[-1]) == ["c1"]
    assert backend.requests[-1].sampling.max_tokens == 4


def test_extension_options_reach_the_backend(client: TestClient, backend: FakeBackend) -> None:
    options = {
        "chunks": [{"text": CHUNK}],
        "policy": "full",
        "recompute_ratio": 0.3,
        "conversation_id": "u-1",
    }
    body = chat(f"Context: {CHUNK}", chunkcache=options, temperature=0.5, stop=["x"], seed=3)
    assert client.post("/v1/chat/completions", json=body).status_code == 200
    request = backend.requests[-1]
    assert chunk_ids(request) == [chunk_id(CHUNK)]  # no id: the content hash
    assert (request.policy, request.recompute_ratio, request.conversation_id) == (
        "full",
        0.3,
        "u-1",
    )
    assert (request.sampling.temperature, request.sampling.stop, request.sampling.seed) == (
        0.5,
        ("x",),
        3,
    )


def test_registered_chunks_are_found_by_matching(client: TestClient, backend: FakeBackend) -> None:
    registered = client.post("/v1/chunks", json={"chunks": [{"id": "doc-7", "text": CHUNK}]}).json()
    assert registered["registered"] == ["doc-7"]
    client.post("/v1/completions", json={"model": MODEL, "prompt": f"Q: {CHUNK} A:"})
    assert chunk_ids(backend.requests[-1]) == ["doc-7"]
    client.post(
        "/v1/completions",
        json={"model": MODEL, "prompt": f"Q: {CHUNK}", "chunkcache": {"match_registered": False}},
    )
    assert chunk_ids(backend.requests[-1]) == []


def test_text_completion_and_render(client: TestClient, backend: FakeBackend) -> None:
    reply = client.post(
        "/v1/completions", json={"model": MODEL, "prompt": ["Once"], "max_tokens": 2}
    ).json()
    assert reply["object"] == "text_completion"
    assert reply["choices"][0]["text"] == "The answer"
    rendered = client.post(
        "/v1/chunkcache/render", json={"messages": [{"role": "user", "content": "hi"}]}
    )
    assert rendered.json()["prompt"] == backend.render_chat([{"role": "user", "content": "hi"}])


def sse(text: str) -> list[object]:
    events = [block for block in text.split("\n\n") if block]
    assert all(block.startswith("data: ") for block in events)
    return [b[6:] if b[6:] == "[DONE]" else json.loads(b[6:]) for b in events]


@pytest.mark.parametrize("include_usage", [True, False])
def test_chat_stream_framing(client: TestClient, include_usage: bool) -> None:
    body = chat(stream=True, stream_options={"include_usage": include_usage})
    with client.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        events = sse(response.read().decode())
    assert events[-1] == "[DONE]"
    chunks = [e for e in events[:-1] if isinstance(e, dict)]
    assert {c["object"] for c in chunks} == {"chat.completion.chunk"}
    assert len({c["id"] for c in chunks}) == 1
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    text = "".join(c["choices"][0]["delta"]["content"] for c in chunks if c["choices"])
    assert text == "The answer is in the context above, friend."
    finishes = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
    assert finishes[:-1] == [None] * (len(finishes) - 1) and finishes[-1] == "stop"
    usage = [c for c in chunks if c.get("usage")]
    assert len(usage) == (1 if include_usage else 0)
    if include_usage:
        assert usage[0]["choices"] == [] and usage[0] is chunks[-1]
        # OpenAI: "All other chunks will also include a usage field, but with a null value."
        assert all(c["usage"] is None for c in chunks[:-1])
    else:
        assert not any("usage" in c for c in chunks)


def test_request_id_is_echoed(client: TestClient) -> None:
    response = client.post(
        "/v1/completions", json={"model": MODEL, "prompt": "x"}, headers={"X-Request-Id": "r-42"}
    )
    assert response.headers["x-request-id"] == "r-42"


def error_of(response: object) -> tuple[int, str]:
    status = response.status_code  # type: ignore[attr-defined]
    body = response.json()  # type: ignore[attr-defined]
    assert set(body["error"]) == {"message", "type", "param", "code"}
    return status, body["error"]["type"]


@pytest.mark.parametrize(
    "body",
    [
        {"model": MODEL, "messages": []},
        chat(max_tokens=10_000),
        chat(max_completion_tokens=10_000),
        chat(chunkcache={"policy": "bogus"}),
        chat(chunkcache={"recompute_ratio": 2}),
        chat(tools=[{"type": "function", "function": {"name": "f"}}]),
        chat(n=2),
        chat(frequency_penalty=0.5),
        chat(presence_penalty=-1),
        {"model": MODEL, "prompt": "Hello", "best_of": 2},
        chat("x" * 200_001),
        chat(chunkcache={"chunks": [{"id": "bad id!", "text": CHUNK}]}),
        {"model": MODEL, "prompt": ["a", "b"]},
        {"messages": [{"role": "user", "content": "no model"}]},
    ],
)
def test_bad_input_is_a_400(client: TestClient, body: dict[str, object]) -> None:
    path = "/v1/completions" if "prompt" in body else "/v1/chat/completions"
    assert error_of(client.post(path, json=body)) == (400, "invalid_request_error")


@pytest.mark.parametrize(
    "body",
    [
        chat(frequency_penalty=0, presence_penalty=0.0),
        {"model": MODEL, "prompt": "Hello", "best_of": 1},
    ],
)
def test_openai_defaults_of_unsupported_fields_pass(
    client: TestClient, body: dict[str, object]
) -> None:
    path = "/v1/completions" if "prompt" in body else "/v1/chat/completions"
    assert client.post(path, json=body).status_code == 200


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/chat/completions", chat("half an emoji \ud83d")),
        ("/v1/chunkcache/render", {"messages": [{"role": "user", "content": "x \ud83d"}]}),
        ("/v1/completions", {"model": MODEL, "prompt": "x \ud83d"}),
        ("/v1/chunks", {"chunks": [{"text": "x \ud83d"}]}),
    ],
)
def test_a_lone_surrogate_is_a_400_that_names_it(
    client: TestClient, path: str, body: dict[str, object]
) -> None:
    response = client.post(path, content=json.dumps(body), headers=JSON)  # escaped: "\\ud83d"
    assert error_of(response) == (400, "invalid_request_error")
    assert "unicode" in response.json()["error"]["message"].lower()


def test_malformed_json_and_unknown_model(client: TestClient) -> None:
    response = client.post(
        "/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"}
    )
    assert error_of(response) == (400, "invalid_request_error")
    response = client.post("/v1/chat/completions", json={**chat(), "model": "gpt-4o"})
    assert response.status_code == 404 and response.json()["error"]["code"] == "model_not_found"


class TokenizingBackend(FakeBackend):
    """A fake that applies ``fit_window`` as the engine's backends do (one token a word, as
    its stats count); ``requests`` holds the requests as they would run."""

    context_window = 300

    def stream(self, request: GenerationRequest) -> Iterator[GenerationChunk]:
        tokens = [
            TokenSegment(str(i), tuple(range(len(s.text.split()))), isinstance(s, ChunkSegment))
            for i, s in enumerate(request.segments)
        ]
        return super().stream(fit_to_window(request, tokens, self.context_window))


@pytest.mark.parametrize(
    ("words", "limit", "max_tokens"),
    [
        (10, {}, 256),  # the default
        (100, {}, 200),  # no limit given: the room the prompt leaves
        (299, {}, 1),
        (100, {"max_tokens": 250}, 250),  # a limit given is kept; the engine refuses it
        (100, {"max_completion_tokens": 250}, 250),
        (100, {"max_tokens": 250, "chunkcache": {"fit_window": True}}, 200),  # asked to fit
    ],
)
def test_default_max_tokens_fits_the_context_window(
    words: int, limit: dict[str, object], max_tokens: int
) -> None:
    backend = TokenizingBackend()
    with TestClient(create_app(backend)) as client:
        body = {"model": MODEL, "prompt": " ".join(["w"] * words), **limit}
        assert client.post("/v1/completions", json=body).status_code == 200
    assert backend.requests[-1].sampling.max_tokens == max_tokens


def test_a_prompt_that_fills_the_context_window_is_a_400() -> None:
    backend = TokenizingBackend()
    with TestClient(create_app(backend)) as client:
        body = {"model": MODEL, "prompt": " ".join(["w"] * 300)}
        response = client.post("/v1/completions", json=body)
    assert error_of(response) == (400, "invalid_request_error")
    assert response.json()["error"]["code"] == "prompt_too_long"
    assert backend.requests == []


def test_body_over_the_limit_is_a_413(backend: FakeBackend) -> None:
    with TestClient(create_app(backend, ServeSettings(max_body_bytes=2048))) as client:
        response = client.post("/v1/chat/completions", json=chat("y" * 4096))
    assert response.status_code == 413
    assert backend.requests == []


@pytest.fixture
def keyed_client(backend: FakeBackend) -> Iterator[TestClient]:
    with TestClient(create_app(backend, ServeSettings(api_key=SecretStr("s3cret")))) as client:
        yield client


def test_api_key(keyed_client: TestClient, backend: FakeBackend) -> None:
    assert keyed_client.get("/health").status_code == 200  # probes need no key
    assert error_of(keyed_client.get("/v1/models")) == (401, "authentication_error")
    wrong = {"Authorization": "Bearer nope"}
    assert keyed_client.post("/v1/chat/completions", json=chat(), headers=wrong).status_code == 401
    right = {"Authorization": "Bearer s3cret"}
    assert keyed_client.post("/v1/chat/completions", json=chat(), headers=right).status_code == 200
    assert len(backend.requests) == 1


@pytest.mark.parametrize(
    "path", ["/v1/chat/completions", "/v1/completions", "/v1/chunks", "/v1/chunkcache/render"]
)
@pytest.mark.parametrize("authorization", [None, "Bearer nope", "s3cret"])
def test_api_key_is_checked_before_the_body(
    keyed_client: TestClient, path: str, authorization: str | None
) -> None:
    headers = {"content-type": "application/json"}
    if authorization is not None:
        headers["Authorization"] = authorization
    response = keyed_client.post(path, content=b"{not json", headers=headers)
    assert error_of(response) == (401, "authentication_error")


def test_backend_refusals_map_to_status_codes() -> None:
    completion = {"model": MODEL, "prompt": "x"}
    with TestClient(
        create_app(RaisingBackend(QueueFullError("full", retry_after_s=2.2)))
    ) as client:
        response = client.post("/v1/chat/completions", json=chat(stream=True))
        assert error_of(response) == (429, "rate_limit_error")
        assert response.headers["retry-after"] == "3"
    with TestClient(create_app(RaisingBackend(BackendUnavailableError("gone")))) as client:
        assert error_of(client.post("/v1/completions", json=completion)) == (
            503,
            "service_unavailable",
        )
    with TestClient(create_app(RaisingBackend(PromptTooLongError("4000 tokens > 2048")))) as client:
        response = client.post("/v1/chat/completions", json=chat())
        assert error_of(response) == (400, "invalid_request_error")
        assert response.json()["error"]["code"] == "prompt_too_long"
    with TestClient(
        create_app(RaisingBackend(RuntimeError("boom"))), raise_server_exceptions=False
    ) as client:
        assert error_of(client.post("/v1/chat/completions", json=chat())) == (500, "server_error")
        assert client.get("/health").status_code == 200  # the server lives on


def test_failure_mid_stream_is_an_error_event() -> None:
    app = create_app(RaisingBackend(RuntimeError("boom"), after_first=True))
    body = {"model": MODEL, "prompt": "x", "stream": True}
    with TestClient(app) as client, client.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        events = sse(response.read().decode())
    assert events[0]["choices"][0]["text"] == "partial"  # type: ignore[index]
    assert events[-1]["error"]["type"] == "server_error"  # type: ignore[index]


def test_shutting_down_is_a_503(backend: FakeBackend, client: TestClient) -> None:
    client.app.state.serve.runner.close()  # type: ignore[attr-defined]
    assert error_of(client.post("/v1/chat/completions", json=chat())) == (
        503,
        "service_unavailable",
    )
    assert client.get("/health").status_code == 503
    assert backend.requests == []


class MeteredBackend(FakeBackend):
    def __init__(self) -> None:
        super().__init__()
        self.shut_down: list[tuple[float, bool]] = []

    def metrics(self) -> dict[str, float]:
        return {"queue_depth": 3.0, "running": 1.0}

    def shutdown(self, timeout_s: float = 30.0, drain: bool = True) -> None:
        self.shut_down.append((timeout_s, drain))


def test_metrics_text_and_clean_shutdown() -> None:
    backend = MeteredBackend()
    with TestClient(create_app(backend, ServeSettings(shutdown_timeout_s=7))) as client:
        body = chat(f"Context: {CHUNK}", chunkcache={"chunks": [{"text": CHUNK}]})
        for _ in range(2):
            client.post("/v1/chat/completions", json=body)
        client.post("/v1/chat/completions", json={"model": MODEL, "messages": []})
        response = client.get("/metrics")
    assert response.headers["content-type"].startswith("text/plain; version=0.0.4")
    samples = {}
    for line in response.text.splitlines():
        if not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            samples[name] = float(value)
    assert samples['chunkcache_generations_total{outcome="completed"}'] == 2
    assert samples['chunkcache_http_responses_total{code="200",path="/v1/chat/completions"}'] == 2
    assert samples['chunkcache_http_responses_total{code="400",path="/v1/chat/completions"}'] == 1
    assert samples["chunkcache_chunk_hits_total"] == 1
    assert samples["chunkcache_reused_tokens_total"] > 0
    assert samples['chunkcache_ttft_seconds_bucket{le="+Inf"}'] == 2
    assert samples["chunkcache_engine_queue_depth"] == 3
    assert samples["chunkcache_in_flight_requests"] == 0
    assert backend.shut_down == [(7.0, True)]  # the app's shutdown drained the backend
