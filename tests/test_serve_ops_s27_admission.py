"""A request ``chunkcache serve`` refuses for a full queue (429) or a shutdown (503) is refused
before any work on it: its messages are not rendered with the chat template, nor its prompt
split into chunks.  A request refused while it is prepared gives its place back."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from fake_backend import FakeBackend, RenderCountingBackend
from fastapi.testclient import TestClient

from chunkcache.core.serve import ServeSettings, create_app
from chunkcache.core.serve import state as serve_state
from chunkcache.core.serve.runner import Runner

MODEL = FakeBackend.model_name
CHAT: dict[str, Any] = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}


@pytest.fixture
def segmented(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every prompt the server splits into text and chunks."""
    prompts: list[str] = []
    build = serve_state.build_request

    def counted(prompt: str, *args: Any, **kwargs: Any) -> Any:
        prompts.append(prompt)
        return build(prompt, *args, **kwargs)

    monkeypatch.setattr(serve_state, "build_request", counted)
    return prompts


@pytest.fixture
def backend() -> RenderCountingBackend:
    return RenderCountingBackend()


@pytest.fixture
def client(backend: RenderCountingBackend) -> Iterator[TestClient]:
    settings = ServeSettings(max_queue=1, max_batch=1, max_prompt_chars=100)
    with TestClient(create_app(backend, settings)) as test_client:
        yield test_client


def _runner(client: TestClient) -> Runner:
    runner = client.app.state.serve.runner  # type: ignore[attr-defined]
    assert isinstance(runner, Runner)
    return runner


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(
    ("path", "body"),
    [("/v1/chat/completions", CHAT), ("/v1/completions", {"model": MODEL, "prompt": "hi"})],
)
def test_a_request_over_the_queue_is_refused_before_any_work(
    client: TestClient,
    backend: RenderCountingBackend,
    segmented: list[str],
    path: str,
    body: dict[str, Any],
    stream: bool,
) -> None:
    runner = _runner(client)
    held = [runner.admit(), runner.admit()]  # the queue is full
    response = client.post(path, json={**body, "stream": stream})
    assert response.status_code == 429
    assert response.json()["error"]["code"] == "queue_full"
    assert (backend.renders, segmented, backend.requests) == (0, [], [])
    for ticket in held:
        ticket.release()
    assert client.post(path, json={**body, "stream": stream}).status_code == 200


def test_a_request_after_shutdown_is_refused_before_any_work(
    client: TestClient, backend: RenderCountingBackend, segmented: list[str]
) -> None:
    _runner(client).close()
    assert client.post("/v1/chat/completions", json=CHAT).status_code == 503
    assert (backend.renders, segmented) == (0, [])


@pytest.mark.parametrize(
    ("body", "status"),
    [
        ({**CHAT, "model": "another"}, 404),
        ({**CHAT, "messages": [{"role": "user", "content": "x" * 200}]}, 400),
        ({**CHAT, "max_tokens": 10**6}, 400),
    ],
)
def test_a_request_refused_while_prepared_gives_its_place_back(
    client: TestClient, body: dict[str, Any], status: int
) -> None:
    runner = _runner(client)
    for _ in range(3):  # more than the two places there are
        assert client.post("/v1/chat/completions", json=body).status_code == status
    assert runner.in_flight == 0
    metrics = client.get("/metrics").text
    assert "chunkcache_generations_total" not in metrics  # it never reached the engine
    assert client.post("/v1/chat/completions", json=CHAT).status_code == 200
