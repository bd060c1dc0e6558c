"""``chunkcache serve`` takes request fields of their JSON type only, as OpenAI's API does: a
string for a number, a bool for an integer or a string for a bool is a 400 naming the field
(pydantic's lax mode took ``"3"``, ``true`` and ``"yes"``).  A JSON integer is a number:
it is taken where a float is."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from fake_backend import FakeBackend
from fastapi.testclient import TestClient

from chunkcache.core.serve import create_app

MODEL = FakeBackend.model_name
CHAT: dict[str, Any] = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}


@pytest.fixture
def backend() -> FakeBackend:
    return FakeBackend()


@pytest.fixture
def client(backend: FakeBackend) -> Iterator[TestClient]:
    with TestClient(create_app(backend)) as test_client:
        yield test_client


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("max_tokens", "3"),
        ("max_tokens", True),
        ("max_tokens", 3.0),
        ("max_completion_tokens", "3"),
        ("stream", "yes"),
        ("stream", 1),
        ("seed", True),
        ("seed", "7"),
        ("temperature", "0.5"),
        ("temperature", False),
        ("top_p", "1"),
        ("n", True),
        ("stream_options", {"include_usage": "true"}),
        ("chunkcache", {"match_registered": "no"}),
        ("chunkcache", {"fit_window": 1}),
        ("chunkcache", {"recompute_ratio": "0.2"}),
    ],
)
def test_a_field_of_the_wrong_json_type_is_a_400_naming_it(
    client: TestClient, backend: FakeBackend, field: str, value: Any
) -> None:
    body = {**CHAT, field: value}
    if field == "stream_options":
        body["stream"] = True
    response = client.post("/v1/chat/completions", json=body)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["param"].split(".")[0] == field
    assert backend.requests == []


def test_a_json_integer_is_a_number(client: TestClient, backend: FakeBackend) -> None:
    options = {"recompute_ratio": 0, "match_registered": False, "fit_window": True}
    body = {**CHAT, "temperature": 0, "top_p": 1, "seed": 7, "max_tokens": 3}
    response = client.post("/v1/chat/completions", json={**body, "chunkcache": options})
    assert response.status_code == 200, response.text
    (request,) = backend.requests
    assert request.sampling.temperature == 0.0 and request.sampling.top_p == 1.0
    assert request.recompute_ratio == 0.0


def test_a_text_completion_is_strict_too(client: TestClient) -> None:
    body = {"model": MODEL, "prompt": "hi", "max_tokens": "3"}
    response = client.post("/v1/completions", json=body)
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "max_tokens"
