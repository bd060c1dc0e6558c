"""A client pointed at the wrong path of ``chunkcache serve`` is told the right one: a
base_url without ``/v1``, or a path with a trailing slash, gets a 404 in OpenAI's error
shape naming the path to use (not a bare "Not Found", nor a 307 redirect with an empty body
that a POST client does not follow)."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest
from fake_backend import FakeBackend
from fastapi.testclient import TestClient
from openai.types.chat import ChatCompletionMessageParam

from chunkcache.core.serve import create_app
from chunkcache.core.serve.launcher import serve_app

MODEL = FakeBackend.model_name
HELLO: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hi"}]
CHAT = {"model": MODEL, "messages": HELLO}


@pytest.fixture
def client() -> Iterator[TestClient]:
    with TestClient(create_app(FakeBackend()), follow_redirects=False) as test_client:
        yield test_client


@pytest.mark.parametrize(
    ("method", "path", "right"),
    [
        ("POST", "/chat/completions", "/v1/chat/completions"),
        ("POST", "/completions", "/v1/completions"),
        ("GET", "/models", "/v1/models"),
        ("GET", f"/models/{MODEL}", f"/v1/models/{MODEL}"),
        ("POST", "/v1/chat/completions/", "/v1/chat/completions"),
        ("POST", "/chat/completions/", "/v1/chat/completions"),
        ("GET", "/v1/models/", "/v1/models"),
    ],
)
def test_a_wrong_path_is_a_404_naming_the_right_one(
    client: TestClient, method: str, path: str, right: str
) -> None:
    response = client.request(method, path, json=CHAT if method == "POST" else None)
    assert response.status_code == 404
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert f"{method} {path}" in error["message"]
    assert f"did you mean {method} {right}" in error["message"]


def test_an_unknown_path_is_a_404_naming_it(client: TestClient) -> None:
    response = client.post("/v1/embeddings", json={"model": MODEL, "input": "x"})
    assert response.status_code == 404
    assert response.json()["error"]["message"] == "Invalid URL (POST /v1/embeddings)"


def test_the_right_paths_still_answer(client: TestClient) -> None:
    assert client.post("/v1/chat/completions", json=CHAT).status_code == 200
    assert client.get(f"/v1/models/{MODEL}").status_code == 200


def test_the_openai_client_without_v1_is_told_to_add_it() -> None:
    with serve_app(create_app(FakeBackend())) as base:
        client = openai.OpenAI(base_url=base, api_key="unused", max_retries=0, timeout=30)
        with pytest.raises(openai.NotFoundError) as refused:
            client.chat.completions.create(model=MODEL, messages=HELLO)
    assert "did you mean POST /v1/chat/completions" in str(refused.value)
