"""Requests that ``chunkcache serve`` refuses are refused in process too, with the same error,
where every backend's request is made (:class:`SamplingParams`, :class:`GenerationRequest`):
more stop strings than the server takes, a stop string with a lone surrogate (no JSON body
carries one: it raised a bare UnicodeEncodeError over HTTP and was ignored in process), an
empty or over-long conversation id, a malformed chunk id.  The server keeps refusing them in
a plain OpenAI body as it did."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
from fake_backend import FakeBackend

from chunkcache.core.cache import ChunkCache
from chunkcache.core.errors import InvalidChunkError, InvalidConversationIdError, InvalidTextError
from chunkcache.core.generation import MAX_STOP_STRINGS, GenerationRequest, SamplingParams
from chunkcache.core.http_backend import HttpBackend
from chunkcache.core.prompting import build_request, generate
from chunkcache.core.segmenter import ChunkSegment, TextSegment
from chunkcache.core.serve import create_app
from chunkcache.core.serve.launcher import serve_app

CHUNK = "The river Seine flows through Paris and then into the English Channel."
STOPS = tuple(f"stop-{i}" for i in range(MAX_STOP_STRINGS))


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[HttpBackend, FakeBackend]]:
    backend = FakeBackend()
    with serve_app(create_app(backend)) as url:
        http = HttpBackend(url)
        yield http, backend
        http.close()


def test_more_stop_strings_than_a_server_takes_are_refused() -> None:
    assert SamplingParams(stop=STOPS).stop == STOPS
    with pytest.raises(ValueError, match=f"stop takes at most {MAX_STOP_STRINGS} strings, got 17"):
        SamplingParams(stop=(*STOPS, "one more"))


def test_a_stop_string_with_a_lone_surrogate_is_invalid_text() -> None:
    with pytest.raises(InvalidTextError, match=r"stop string 1: .*ud83d at character 5"):
        SamplingParams(stop=("fine", "half \ud83d"))


@pytest.mark.parametrize(
    ("conversation_id", "error"),
    [("", "1-256 characters"), ("c" * 257, "1-256 characters"), (b"c", "str or int")],
)
def test_an_unusable_conversation_id_is_refused(conversation_id: Any, error: str) -> None:
    with pytest.raises(InvalidConversationIdError, match=error):
        GenerationRequest([TextSegment("Q?")], conversation_id=conversation_id)


def test_a_conversation_id_given_as_an_int_is_its_string() -> None:
    """As the ledger takes it; the server's body takes a string only."""
    assert GenerationRequest([TextSegment("Q?")], conversation_id=42).conversation_id == "42"  # type: ignore[arg-type]


@pytest.mark.parametrize("chunk_id", ["", "a b", "doc/7", "c" * 129, "dé"])
def test_a_malformed_chunk_id_is_refused(chunk_id: str) -> None:
    with pytest.raises(InvalidChunkError, match="chunk id"):
        GenerationRequest([TextSegment("Q: "), ChunkSegment(chunk_id, CHUNK)])


def test_the_ids_a_prompt_is_split_by_pass(served: tuple[HttpBackend, FakeBackend]) -> None:
    """Content hashes, content-bound ids and the caller's own: as before, on both paths."""
    http, backend = served
    cache = ChunkCache()
    cache.registry.register("doc-7:v1.2", CHUNK)
    request = build_request(f"Q: {CHUNK}", cache, chunks=[("x", CHUNK)], conversation_id="u-1")
    assert generate(backend, request)[0] == generate(http, request)[0]
    assert backend.requests[-1].segments == request.segments


def refusal(http: HttpBackend, **fields: Any) -> str:
    """The message of the 400 the server answers a body with ``fields`` (OpenAI's shape;
    JSON escapes a lone surrogate, as ``json.dumps`` does)."""
    body = {"model": FakeBackend.model_name, "prompt": "Q?", "max_tokens": 2, **fields}
    response = httpx.post(
        f"{http.base_url}/v1/completions",
        content=json.dumps(body),
        headers={"content-type": "application/json"},
    )
    assert response.status_code == 400, response.text
    return str(response.json()["error"]["message"])


def local_error(build: Callable[[], object]) -> str:
    with pytest.raises(ValueError) as raised:
        build()
    return str(raised.value)


def test_the_server_refuses_them_in_a_plain_body_as_before(
    served: tuple[HttpBackend, FakeBackend],
) -> None:
    http, _ = served
    assert "at most 16" in refusal(http, stop=[*STOPS, "one more"])
    assert "ud83d" in refusal(http, stop=["half \ud83d"])
    message = refusal(http, chunkcache={"conversation_id": ""})
    assert message == local_error(lambda: GenerationRequest([TextSegment("Q")], conversation_id=""))
    segments = [{"text": "Q: "}, {"text": CHUNK, "chunk_id": "a b"}]
    message = refusal(http, prompt=f"Q: {CHUNK}", chunkcache={"segments": segments})
    local = local_error(lambda: GenerationRequest([ChunkSegment("a b", CHUNK)]))
    assert message == local
