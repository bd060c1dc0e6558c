"""Error answers of ``chunkcache serve`` to sloppy bodies: a body that is not JSON says so
and where, and names no request field (FastAPI's error holds a character offset where a
field's path would be)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from fake_backend import FakeBackend
from fastapi.testclient import TestClient

from chunkcache.core.serve import create_app

JSON = {"content-type": "application/json"}


@pytest.fixture
def client() -> Iterator[TestClient]:
    with TestClient(create_app(FakeBackend())) as test_client:
        yield test_client


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        (b'{"model": "m", "messages": [', "Expecting value at character 28"),
        (b"{not json", "Expecting property name enclosed in double quotes at character 1"),
        (b'{"model": "m",}', "at character 14"),
    ],
)
def test_a_body_that_is_not_json_is_a_400_naming_no_field(
    client: TestClient, body: bytes, reason: str
) -> None:
    response = client.post("/v1/chat/completions", content=body, headers=JSON)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["param"] is None
    assert error["message"].startswith("the body is not valid JSON: ")
    assert error["message"].endswith(reason)
