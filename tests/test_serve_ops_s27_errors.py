"""An internal bug in ``chunkcache serve`` is a logged 500, not a silent 400: a TypeError raised
deep in a backend is answered ``server_error`` without its text and logged with its
traceback; a plain ValueError keeps its 400 but is logged too; the library's own refusals
(:mod:`chunkcache.core.errors`) stay quiet 400s with their message."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from typing import Any

import pytest
from fake_backend import FakeBackend, RaisingBackend
from fastapi.testclient import TestClient

from chunkcache.core.errors import InvalidChunkError, PromptTooLongError
from chunkcache.core.generation import GenerationChunk, GenerationRequest
from chunkcache.core.serve import create_app

MODEL = FakeBackend.model_name
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
LOGGER = "chunkcache.serve"


def _deep_helper(value: Any) -> int:
    return int(value + 1)


class BuggyBackend(RaisingBackend):
    """Raises a real TypeError deep inside its stream, where a bug would, before or after
    the first piece."""

    def stream(self, request: GenerationRequest) -> Iterator[GenerationChunk]:
        yield from super().stream(request)
        _deep_helper(None)


def _client(backend: FakeBackend) -> TestClient:
    return TestClient(create_app(backend), raise_server_exceptions=False)


def _logged(caplog: pytest.LogCaptureFixture, level: int) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == LOGGER and r.levelno >= level and r.exc_info]


@pytest.mark.parametrize("stream", [False, True])
def test_a_type_error_in_the_backend_is_a_logged_500(
    caplog: pytest.LogCaptureFixture, stream: bool
) -> None:
    with _client(BuggyBackend()) as client, caplog.at_level(logging.WARNING, LOGGER):
        response = client.post("/v1/chat/completions", json={**CHAT, "stream": stream})
    assert response.status_code == 500
    error = response.json()["error"]
    assert error["type"] == "server_error"
    assert "NoneType" not in error["message"]  # no internals for the client
    (record,) = _logged(caplog, logging.ERROR)
    assert record.exc_info is not None and record.exc_info[0] is TypeError
    assert "_deep_helper" in caplog.text  # the traceback, for the operator


def test_a_type_error_mid_stream_is_a_server_error_event(caplog: pytest.LogCaptureFixture) -> None:
    body = {**CHAT, "stream": True}
    with (
        _client(BuggyBackend(after_first=True)) as client,
        caplog.at_level(logging.WARNING, LOGGER),
        client.stream("POST", "/v1/chat/completions", json=body) as response,
    ):
        events = [line[6:] for line in response.read().decode().splitlines() if line]
    assert json.loads(events[-1])["error"]["type"] == "server_error"
    assert len(_logged(caplog, logging.ERROR)) == 1


def test_a_plain_value_error_stays_a_400_and_is_logged(caplog: pytest.LogCaptureFixture) -> None:
    backend = RaisingBackend(ValueError("need one token per sequence, got 3 for 2"))
    with _client(backend) as client, caplog.at_level(logging.WARNING, LOGGER):
        response = client.post("/v1/chat/completions", json=CHAT)
    assert response.status_code == 400
    assert response.json()["error"]["message"] == "need one token per sequence, got 3 for 2"
    (record,) = _logged(caplog, logging.WARNING)
    assert record.exc_info is not None and record.exc_info[0] is ValueError


@pytest.mark.parametrize(
    ("error", "code"),
    [
        (PromptTooLongError("4000 prompt tokens exceed the context window"), "prompt_too_long"),
        (InvalidChunkError("chunk 'x' is empty"), None),
    ],
)
def test_a_deliberate_refusal_is_a_quiet_400_with_its_message(
    caplog: pytest.LogCaptureFixture, error: Exception, code: str | None
) -> None:
    with _client(RaisingBackend(error)) as client, caplog.at_level(logging.WARNING, LOGGER):
        response = client.post("/v1/chat/completions", json=CHAT)
    assert response.status_code == 400
    assert response.json()["error"] == {
        "message": str(error),
        "type": "invalid_request_error",
        "param": None,
        "code": code,
    }
    assert _logged(caplog, logging.WARNING) == []


def test_an_empty_text_prompt_is_a_400_naming_the_prompt(caplog: pytest.LogCaptureFixture) -> None:
    """The engine refuses a prompt with no tokens (EmptyPromptError, a quiet 400): an
    empty one is refused before it, naming the field."""
    backend = FakeBackend()
    with _client(backend) as client, caplog.at_level(logging.WARNING, LOGGER):
        response = client.post("/v1/completions", json={"model": MODEL, "prompt": ""})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "prompt"
    assert backend.requests == []
    assert _logged(caplog, logging.WARNING) == []
