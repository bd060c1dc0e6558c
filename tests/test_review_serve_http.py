"""Review of chunkcache serve's HTTP side and its HttpBackend client: what an OpenAI client
may send, how unexpected errors are answered, and how the client reads a server that breaks
off, fails or redirects."""

from __future__ import annotations

import contextlib
import re
import socket
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from fake_backend import FakeBackend
from fastapi.testclient import TestClient
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import HTMLResponse, RedirectResponse, Response
from starlette.routing import Route
from test_http_backend import Refusing

from chunkcache.core.cache import ChunkCache
from chunkcache.core.errors import BackendUnavailableError, QueueFullError, ShuttingDownError
from chunkcache.core.http_backend import HttpBackend
from chunkcache.core.prompting import build_request, generate
from chunkcache.core.registry import ChunkRegistry
from chunkcache.core.serve import ServeSettings, create_app
from chunkcache.core.serve.launcher import serve_app

MODEL = FakeBackend.model_name


def metric_lines(client: TestClient, name: str) -> list[str]:
    return [line for line in client.get("/metrics").text.splitlines() if line.startswith(name)]


def test_an_unexpected_error_is_counted_and_echoes_the_request_id() -> None:
    """Starlette answers a 500 outside every middleware: it went uncounted and unechoed."""
    app = create_app(Refusing(RuntimeError("boom")))
    with TestClient(app, raise_server_exceptions=False) as client:
        body = {"model": MODEL, "prompt": "x"}
        response = client.post("/v1/completions", json=body, headers={"X-Request-Id": "r-7"})
        assert response.status_code == 500
        assert response.json()["error"]["type"] == "server_error"
        assert response.headers["x-request-id"] == "r-7"
        assert metric_lines(client, "chunkcache_http_responses_total") == [
            'chunkcache_http_responses_total{code="500",path="/v1/completions"} 1'
        ]
        assert client.get("/health").status_code == 200


def test_a_chunk_sent_again_too_large_is_reported_too_large() -> None:
    """The registry drops an id whose new text is too large; the answer said 'registered'."""
    cache = ChunkCache(registry=ChunkRegistry(max_chunks=10, max_chars=100))
    with TestClient(create_app(FakeBackend(), cache=cache)) as client:
        chunks = [{"id": "a", "text": "x" * 50}, {"id": "b", "text": "y" * 40}]
        chunks.append({"id": "a", "text": "z" * 150})
        answer = client.post("/v1/chunks", json={"chunks": chunks}).json()
    assert answer == {"registered": ["b"], "too_large": ["a"], "total": 1}
    assert cache.registry.get("a") is None


@pytest.mark.parametrize("field", ["temperature", "top_p", "n", "stream", "chunkcache"])
def test_null_is_the_default_as_in_openai(field: str) -> None:
    """OpenAI's API takes null for these (the openai client sends temperature=None so)."""
    backend = FakeBackend()
    with TestClient(create_app(backend)) as client:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], field: None}
        response = client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    assert response.json()["object"] == "chat.completion"
    sampling = backend.requests[-1].sampling
    assert (sampling.temperature, sampling.top_p) == (1.0, 1.0)


def test_a_405_names_the_allowed_methods() -> None:
    with TestClient(create_app(FakeBackend())) as client:
        response = client.get("/v1/chat/completions")
    assert response.status_code == 405
    assert response.headers["allow"] == "POST"
    assert response.json()["error"]["type"] == "invalid_request_error"


def test_a_backend_429_waits_at_least_the_configured_retry_after() -> None:
    app = create_app(Refusing(QueueFullError("full", 0.05)), ServeSettings(retry_after_s=5))
    with TestClient(app) as client:
        response = client.post("/v1/completions", json={"model": MODEL, "prompt": "x"})
    assert response.status_code == 429
    assert response.headers["retry-after"] == "5"


def test_a_failed_engine_is_backend_unavailable_not_shutting_down() -> None:
    """The server answers 503 backend_unavailable when its engine died; the local backends
    raise BackendUnavailableError for that, and so must the http one."""
    failed = create_app(Refusing(BackendUnavailableError("the scheduler stopped")))
    with (
        serve_app(failed) as url,
        pytest.raises(BackendUnavailableError, match="scheduler stopped"),
    ):
        generate(HttpBackend(url), build_request("hello", ChunkCache()))
    app = create_app(FakeBackend())
    with serve_app(app) as url, pytest.raises(ShuttingDownError):
        app.state.serve.runner.close()
        generate(HttpBackend(url), build_request("hello", ChunkCache()))


@pytest.fixture(scope="module")
def misbehaving() -> Iterator[tuple[str, dict[str, Response]]]:
    """A server answering each path with the reply set for it."""
    replies: dict[str, Response] = {}

    async def reply(request: Request) -> Response:
        return replies[request.url.path]

    app = Starlette(routes=[Route("/{path:path}", reply, methods=["GET", "POST"])])
    replies["/health"] = Response("ok")
    with serve_app(app) as url:
        yield url, replies


@pytest.mark.parametrize(
    ("reply", "match"),
    [
        (RedirectResponse("https://example.invalid/v1/completions", 307), "307.*redirect"),
        (RedirectResponse("/elsewhere", 301), "301.*redirect.*/elsewhere"),
        (HTMLResponse("<html>upstream down</html>", 503), "503: <html>upstream down"),
    ],
)
def test_redirects_and_a_proxy_503_are_backend_unavailable(
    misbehaving: tuple[str, dict[str, Response]], reply: Response, match: str
) -> None:
    """A redirect was read as the answer's body (a puzzling 'not server-sent events'); a
    proxy's 503 claimed the server was shutting down."""
    url, replies = misbehaving
    replies["/v1/completions"] = reply
    with pytest.raises(BackendUnavailableError, match=match) as raised:
        generate(HttpBackend(url, model="m"), build_request("hello", ChunkCache()))
    assert not isinstance(raised.value, ShuttingDownError)


@contextlib.contextmanager
def _raw_server(*replies: bytes) -> Iterator[tuple[str, list[int]]]:
    """A raw HTTP server on loopback: the i-th connection gets its request read, then
    ``replies[i]`` (the last one from then on) and is closed.  Yields the url and the count
    of connections taken."""
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.2)
    stopping = threading.Event()
    taken = [0]

    def answer(conn: socket.socket, reply: bytes) -> None:
        with conn:
            data = b""
            while b"\r\n\r\n" not in data:
                data += conn.recv(65536)
            head, _, body = data.partition(b"\r\n\r\n")
            length = re.search(rb"(?i)content-length: *(\d+)", head)
            while length is not None and len(body) < int(length.group(1)):
                body += conn.recv(65536)
            conn.sendall(reply)

    def run() -> None:
        while not stopping.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            taken[0] += 1  # before the answer: a client may count once it is closed
            answer(conn, replies[min(taken[0], len(replies)) - 1])

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}", taken
    finally:
        stopping.set()
        thread.join(5)
        listener.close()


_CALLS: dict[str, Callable[[HttpBackend], Any]] = {
    "render": lambda http: http.render_chat([{"role": "user", "content": "x"}]),
    "models": lambda http: http.context_window,
    "completions": lambda http: generate(http, build_request("hello", ChunkCache())),
}
_HEAD = "HTTP/1.1 {status}\r\ncontent-type: application/json\r\ncontent-length: 100\r\n\r\n"


@pytest.mark.parametrize(
    ("call", "reply"),
    [
        ("render", _HEAD.format(status="200 OK") + '{"prompt": "ab'),
        ("models", _HEAD.format(status="200 OK") + '{"data": [{"id'),
        ("completions", _HEAD.format(status="429 Too Many Requests") + '{"error'),
    ],
)
def test_a_server_that_breaks_off_its_answer_is_backend_unavailable(call: str, reply: str) -> None:
    """The body reads of JSON answers and error answers let httpx's own error through."""
    with (
        _raw_server(reply.encode()) as (url, _),
        pytest.raises(BackendUnavailableError, match="broke off its answer"),
    ):
        _CALLS[call](HttpBackend(url, model=None if call == "models" else "m", timeout_s=10))


def test_stop_strings_are_bounded() -> None:
    """Each stop string is searched for at every token on the engine's thread: thousands of
    them in one body stalled every request in the batch."""
    backend = FakeBackend()
    with TestClient(create_app(backend)) as client:
        body: dict[str, Any] = {"model": MODEL, "prompt": "x"}
        stops = [f"zq{i:06d}" for i in range(10_000)]
        response = client.post("/v1/completions", json={**body, "stop": stops})
        assert response.status_code == 400
        assert response.json()["error"]["message"].startswith("stop")
        assert client.post("/v1/completions", json={**body, "stop": stops[:16]}).status_code == 200
    assert len(backend.requests) == 1


_RENDERED = b'{"prompt": "ok"}'
_ANSWER = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (
    len(_RENDERED),
    _RENDERED,
)


def test_a_connection_closed_before_any_answer_is_tried_once_more() -> None:
    """uvicorn closes a pooled connection after 5 s idle; a request sent just then found it
    closed ("connection reset", "disconnected without sending a response": 2 requests in
    400 with a 20 ms keep-alive) and failed, though the server was fine."""
    with _raw_server(b"", _ANSWER) as (url, taken):
        render = _CALLS["render"]
        assert render(HttpBackend(url, model="m", timeout_s=10)) == "ok"
        assert taken[0] == 2
    with _raw_server(b"") as (url, taken):
        with pytest.raises(BackendUnavailableError, match="unreachable"):
            render(HttpBackend(url, model="m", timeout_s=10))
        assert taken[0] == 2  # once more, not on and on


@pytest.mark.parametrize("timeout_s", [0, -1.0, float("nan"), float("inf"), True])
def test_a_timeout_that_is_not_a_positive_number_is_refused_when_made(timeout_s: float) -> None:
    """0 failed every request as 'unreachable'; inf, NaN and -1 failed inside httpx."""
    with pytest.raises(ValueError, match="timeout_s"):
        HttpBackend("http://127.0.0.1:8000", timeout_s=timeout_s)
