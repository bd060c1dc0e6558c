"""HttpBackend against a real uvicorn server over a fake backend, and its failure modes."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from email.utils import format_datetime
from typing import Any

import pytest
from fake_backend import FakeBackend
from langchain_core.messages import HumanMessage, SystemMessage
from pydantic import SecretStr
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from chunkcache.core.cache import ChunkCache
from chunkcache.core.errors import BackendUnavailableError, QueueFullError, ShuttingDownError
from chunkcache.core.generation import GenerationChunk, GenerationRequest
from chunkcache.core.http_backend import HttpBackend
from chunkcache.core.prompting import build_request, generate
from chunkcache.core.segmenter import ChunkSegment
from chunkcache.core.serve import ServeSettings, create_app
from chunkcache.core.serve.launcher import serve_app
from chunkcache.core.store.redis_server import free_port
from chunkcache.integrations.langchain_llm import ChunkCacheLLM

CHUNK = "The quick brown fox jumps over the lazy dog near the river bank."


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[str, FakeBackend]]:
    backend = FakeBackend()
    with serve_app(create_app(backend, ServeSettings(api_key=SecretStr("k")))) as url:
        yield url, backend


def test_model_info_and_render(served: tuple[str, FakeBackend]) -> None:
    url, backend = served
    http = HttpBackend(url + "/v1/", api_key="k")
    assert (http.model_name, http.context_window) == (backend.model_name, backend.context_window)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    assert http.render_chat(messages) == backend.render_chat(messages)


def test_segments_travel_as_the_client_split_them(served: tuple[str, FakeBackend]) -> None:
    url, backend = served
    cache = ChunkCache(backend=HttpBackend(url, api_key="k"))
    cache.registry.register("c1", CHUNK)
    request = build_request(f"Context: {CHUNK}\nQ?", cache, max_tokens=3, conversation_id="u-9")
    text, stats = generate(cache.backend, request)
    assert text == "The answer is"
    seen = backend.requests[-1]
    assert seen.segments == request.segments  # the server matched exactly the client's chunks
    assert isinstance(seen.segments[1], ChunkSegment) and seen.segments[1].chunk_id == "c1"
    assert (seen.conversation_id, seen.policy, seen.sampling) == (
        "u-9",
        request.policy,
        request.sampling,
    )
    assert (stats.completion_tokens, stats.finish_reason) == (3, "length")
    assert stats.chunk_misses == 1


def test_chunkcache_llm_through_langchain(served: tuple[str, FakeBackend]) -> None:
    url, _ = served
    cache = ChunkCache(backend=HttpBackend(url, api_key="k"))
    cache.registry.register("c2", CHUNK.replace("fox", "cat"))
    llm = ChunkCacheLLM(chunk_cache=cache, max_tokens=5)
    messages = [SystemMessage("Be brief."), HumanMessage(f"Context: {CHUNK.replace('fox', 'cat')}")]
    llm.invoke(messages)
    answer = llm.invoke(messages)
    assert answer.content == "The answer is in the"
    assert answer.usage_metadata is not None
    assert answer.usage_metadata["input_token_details"]["cache_read"] > 0
    assert answer.response_metadata["chunkcache"]["chunk_hits"] == 1
    streamed = [chunk.content for chunk in llm.stream(messages)]
    assert "".join(str(c) for c in streamed) == "The answer is in the"
    assert len(streamed) > 2  # it streams, piece by piece


def test_server_refusals_become_chunkcache_errors(served: tuple[str, FakeBackend]) -> None:
    url, _ = served
    request = build_request("hello", ChunkCache(), max_tokens=4000)  # over the server's limit
    with pytest.raises(ValueError, match="max_tokens"):
        generate(HttpBackend(url, api_key="k"), request)
    # the caller's key: a retry, or a fallback as for a server that is down, cannot help
    with pytest.raises(ValueError, match=r"401.*api_key") as refused:
        HttpBackend(url, api_key="wrong").render_chat([{"role": "user", "content": "x"}])
    assert not isinstance(refused.value, BackendUnavailableError)
    with pytest.raises(ValueError, match=r"401.*api_key"):
        generate(HttpBackend(url), build_request("hello", ChunkCache(), max_tokens=4))


class Refusing(FakeBackend):
    def __init__(self, error: Exception) -> None:
        super().__init__()
        self.error = error

    def stream(self, request: GenerationRequest) -> Iterator[GenerationChunk]:
        raise self.error


@pytest.mark.parametrize(
    ("error", "expected"),
    [
        (QueueFullError("full", 4.0), QueueFullError),
        (RuntimeError("boom"), BackendUnavailableError),
    ],
)
def test_status_codes_map_back(error: Exception, expected: type[Exception]) -> None:
    with serve_app(create_app(Refusing(error))) as url, pytest.raises(expected) as raised:
        generate(HttpBackend(url), build_request("hello", ChunkCache()))
    if isinstance(raised.value, QueueFullError):
        assert raised.value.retry_after_s == 4.0


def test_shutting_down_and_unreachable() -> None:
    app = create_app(FakeBackend())
    with serve_app(app) as url:
        app.state.serve.runner.close()
        with pytest.raises(ShuttingDownError):
            generate(HttpBackend(url), build_request("hello", ChunkCache()))
    with pytest.raises(BackendUnavailableError, match="unreachable"):
        HttpBackend(f"http://127.0.0.1:{free_port()}", model="m").render_chat(
            [{"role": "user", "content": "x"}]
        )
    with pytest.raises(ValueError, match="http"):
        HttpBackend("127.0.0.1:8000")


Canned = tuple[str, dict[str, Response]]


@pytest.fixture(scope="module")
def canned_server() -> Iterator[Canned]:
    """A misbehaving server: its url, and the replies it gives by path (``/health`` gets "ok")."""
    replies: dict[str, Response] = {}

    async def reply(request: Request) -> Response:
        return replies.get(request.url.path, PlainTextResponse("ok"))

    app = Starlette(routes=[Route("/{path:path}", reply, methods=["GET", "POST"])])
    with serve_app(app) as url:
        yield url, replies


@pytest.fixture
def canned(canned_server: Canned) -> Canned:
    """The misbehaving server with no replies left from an earlier test."""
    canned_server[1].clear()
    return canned_server


def _queue_full(retry_after: str) -> JSONResponse:
    return JSONResponse({"error": {"message": "full"}}, 429, headers={"Retry-After": retry_after})


def _retry_after_s(canned: Canned, retry_after: str) -> float:
    """The retry_after_s of the QueueFullError for a 429 with this Retry-After header."""
    url, replies = canned
    replies["/v1/completions"] = _queue_full(retry_after)
    with pytest.raises(QueueFullError) as raised:
        generate(HttpBackend(url, model="m"), build_request("hello", ChunkCache()))
    return raised.value.retry_after_s


@pytest.mark.parametrize(
    ("retry_after", "seconds"),
    [
        ("7", 7.0),
        ("Wed, 21 Oct 2015 07:28:00 GMT", 0.0),  # a date past: retry now
        ("soon", 1.0),  # unreadable: the default
        ("nan", 1.0),
        ("-3", 0.0),  # a delay past: retry now
    ],
)
def test_retry_after_seconds_or_date(canned: Canned, retry_after: str, seconds: float) -> None:
    assert _retry_after_s(canned, retry_after) == seconds


def test_retry_after_a_date_ahead(canned: Canned) -> None:
    when = format_datetime(datetime.now(UTC) + timedelta(seconds=30), usegmt=True)
    assert 25.0 < _retry_after_s(canned, when) <= 30.0


def _sse(*events: str) -> Response:
    return Response("".join(f"data: {e}\n\n" for e in events), media_type="text/event-stream")


_CALLS: dict[str, Callable[[HttpBackend], Any]] = {
    "/v1/chunkcache/render": lambda http: http.render_chat([{"role": "user", "content": "x"}]),
    "/v1/models": lambda http: http.context_window,
    "/v1/completions": lambda http: generate(http, build_request("hello", ChunkCache())),
}
_HELLO = '{"choices": [{"index": 0, "text": "Hello"}]}'


@pytest.mark.parametrize(
    ("path", "reply", "match"),
    [
        ("/v1/chunkcache/render", HTMLResponse("<html>login</html>"), "render with non-JSON"),
        ("/v1/chunkcache/render", JSONResponse({"nope": 1}), "render with .*'prompt'"),
        ("/v1/chunkcache/render", JSONResponse(["a"]), "render with .*not a JSON object"),
        (
            "/v1/chunkcache/render",
            Response("[" * 100_000, media_type="application/json"),
            "render with non-JSON",
        ),
        ("/v1/models", JSONResponse({"data": []}), "models with no model"),
        ("/v1/models", JSONResponse({"data": [{"name": "m"}]}), "models with .*'id'"),
        ("/v1/completions", HTMLResponse("<html>login</html>"), "completions with something other"),
        ("/v1/completions", _sse(_HELLO, '{"choices": [tru'), "completions with non-JSON"),
        ("/v1/completions", _sse(_HELLO, "[1, 2]"), "completions with .*not a JSON object"),
        ("/v1/completions", _sse('{"choices": ["Hello"]}'), "completions with .*not a JSON"),
        ("/v1/completions", _sse('{"error": "engine died"}'), "completions with .*'error'"),
        ("/v1/completions", _sse('{"usage": {"chunkcache": {}}}'), "completions with .*'policy'"),
        ("/v1/completions", _sse('{"usage": {"prompt_tokens": "3"}}'), "'prompt_tokens'"),
    ],
)
def test_garbage_answers_are_backend_unavailable(
    canned: Canned, path: str, reply: Response, match: str
) -> None:
    """A 200 whose body is not the JSON the endpoint promises, not a bare Python error."""
    url, replies = canned
    replies[path] = reply
    with pytest.raises(BackendUnavailableError, match=f"^chunkcache serve answered .*{match}"):
        _CALLS[path](HttpBackend(url, model="m"))
