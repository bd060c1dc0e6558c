"""chunkcache serve and its HttpBackend client: the temperatures they take, how often the
client asks for the model, server-sent events with empty data, API keys no header can carry,
and tickets the garbage collector drops while a lock is held."""

from __future__ import annotations

import gc
import threading
from collections.abc import Callable, Iterator

import pytest
from fake_backend import FakeBackend
from fastapi.testclient import TestClient
from pydantic import SecretStr
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route
from test_cli import run

from chunkcache.core.cache import ChunkCache
from chunkcache.core.errors import BackendUnavailableError, UsageError
from chunkcache.core.http_backend import HttpBackend
from chunkcache.core.json_shapes import completion_events
from chunkcache.core.prompting import build_request, generate
from chunkcache.core.serve import ServeSettings, create_app
from chunkcache.core.serve.launcher import serve_app
from chunkcache.core.serve.metrics import ServeMetrics
from chunkcache.core.serve.runner import Runner, Ticket
from chunkcache.integrations.vllm import VllmBackend


async def healthy(request: Request) -> Response:
    return PlainTextResponse("ok")  # what serve_app waits for


HELLO = '{"choices": [{"index": 0, "text": "Hello"}]}'
USAGE = '{"choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": 1}}'


# --- temperature: what SamplingParams takes, the server takes -------------------------------


@pytest.mark.parametrize("temperature", [2.5, 1e300])
def test_the_http_backend_sends_a_temperature_the_local_backend_runs(temperature: float) -> None:
    """The server capped it at OpenAI's 2: a 400 for what SamplingParams accepts."""
    backend = FakeBackend()
    with serve_app(create_app(backend)) as url:
        request = build_request("hello", ChunkCache(), max_tokens=2, temperature=temperature)
        text, _ = generate(HttpBackend(url), request)
    assert text == "The answer"
    assert backend.requests[-1].sampling.temperature == temperature


@pytest.mark.parametrize("temperature", ["Infinity", "NaN", "-0.5", "1e400"])
def test_a_temperature_that_is_not_finite_and_positive_is_a_400(temperature: str) -> None:
    body = f'{{"model": "{FakeBackend.model_name}", "prompt": "hi", "temperature": {temperature}}}'
    with TestClient(create_app(FakeBackend())) as client:
        response = client.post(
            "/v1/completions", content=body, headers={"content-type": "application/json"}
        )
    assert response.status_code == 400, response.text
    assert "temperature" in response.json()["error"]["message"]


# --- context_window: asked once, even when the server does not know it ------------------------


def test_an_unknown_context_window_is_asked_for_once() -> None:
    asked: list[str] = []

    async def models(request: Request) -> Response:
        asked.append(request.url.path)
        return JSONResponse({"data": [{"id": "m", "max_model_len": None}]})

    app = Starlette(routes=[Route("/health", healthy), Route("/v1/models", models)])
    with serve_app(app) as url:
        http = HttpBackend(url)
        assert [http.context_window, http.context_window, http.model_name] == [None, None, "m"]
    assert asked == ["/v1/models"]


# --- server-sent events: empty data is no event ---------------------------------------------


def events(*lines: str) -> list[dict[str, object]]:
    return list(completion_events(lines, "POST /v1/completions", "the server"))


@pytest.mark.parametrize("empty", ["data:", "data: ", "data:   \t", "data"])
def test_an_event_with_empty_or_blank_data_is_skipped(empty: str) -> None:
    """It was parsed as JSON: a BackendUnavailableError for a stream the SSE spec allows."""
    assert events(empty, "", f"data: {HELLO}", "", empty, "", "data: [DONE]", "") == [
        {"choices": [{"index": 0, "text": "Hello"}]}
    ]


def test_the_data_lines_of_one_event_are_one_json_object() -> None:
    """The SSE spec joins an event's data lines with newlines (JSON may span them)."""
    lines = ["event: message", 'data: {"choices":', "data: []}", "", "data: [DONE]", ""]
    assert events(*lines) == [{"choices": []}]


def test_an_event_the_stream_ends_before_its_blank_line_is_dropped() -> None:
    with pytest.raises(BackendUnavailableError, match=r"without data: \[DONE\], after 1 event"):
        events(f"data: {HELLO}", "", f"data: {HELLO}")


def test_the_http_backend_reads_a_stream_with_an_empty_event() -> None:
    async def completions(request: Request) -> Response:
        body = f"data:\n\ndata: {HELLO}\n\ndata: \n\ndata: {USAGE}\n\ndata: [DONE]\n\n"
        return Response(body, media_type="text/event-stream")

    routes = [Route("/health", healthy), Route("/v1/completions", completions, methods=["POST"])]
    app = Starlette(routes=routes)
    with serve_app(app) as url:
        text, stats = generate(HttpBackend(url, model="m"), build_request("hi", ChunkCache()))
    assert (text, stats.completion_tokens) == ("Hello", 1)


# --- API keys: visible ASCII, or a clear error that does not quote the key ------------------

BAD_KEYS = [
    ("clé-secrète", "character 3 is not ASCII"),
    ("s3cret\u00a0", "character 7 is U+00A0 (NO-BREAK SPACE)"),
    ("s3cret\n", "character 7 is U+000A (a control character)"),
    ("s3 cret", "character 3 is U+0020 (SPACE)"),
]


def _vllm_backend(key: str) -> object:
    return VllmBackend("http://127.0.0.1:1", "some-model", api_key=key)


def _chunk_cache(key: str) -> object:  # its backend is built on first use: checked before
    return ChunkCache(backend="http", base_url="http://127.0.0.1:1", api_key=key)


@pytest.mark.parametrize(("key", "problem"), BAD_KEYS)
@pytest.mark.parametrize(
    "client",
    [lambda key: HttpBackend("http://127.0.0.1:1", api_key=key), _vllm_backend, _chunk_cache],
    ids=["http", "vllm", "chunk-cache"],
)
def test_the_client_refuses_a_key_no_header_can_carry(
    key: str, problem: str, client: Callable[[str], object]
) -> None:
    """It was a UnicodeEncodeError from httpx, or a request that failed as 'unreachable'."""
    with pytest.raises(UsageError) as refused:
        client(key)
    message = str(refused.value)
    assert message == (
        f"api_key must be visible ASCII characters (it travels in an HTTP header): its {problem}"
    )
    assert key.strip() not in message


@pytest.mark.parametrize(("key", "problem"), BAD_KEYS)
def test_the_server_refuses_a_key_no_client_can_send(key: str, problem: str) -> None:
    """It started, and refused every request with a 401."""
    with pytest.raises(UsageError) as refused:
        ServeSettings(api_key=SecretStr(key))
    assert str(refused.value).startswith("api_key (CHUNKCACHE_SERVE_API_KEY) must be visible")
    assert str(refused.value).endswith(f"its {problem}")


def refuse_to_start(settings: ServeSettings) -> None:
    raise AssertionError("the server would have started with a key no client can send")


def test_serve_stops_with_one_line_that_does_not_quote_the_key(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("CHUNKCACHE_SERVE_API_KEY", "s3cret\u00a0")
    monkeypatch.setattr("chunkcache.core.serve.run_server", refuse_to_start)
    code, err = run(["serve", "--port", "0"], capsys)
    assert code == 1
    assert err == [
        "chunkcache: error: api_key (CHUNKCACHE_SERVE_API_KEY) must be visible ASCII characters "
        "(it travels in an HTTP header): its character 7 is U+00A0 (NO-BREAK SPACE)"
    ]


def test_a_visible_ascii_key_still_works() -> None:
    key = "sk-A1_b.2~+/="
    with serve_app(create_app(FakeBackend(), ServeSettings(api_key=SecretStr(key)))) as url:
        assert HttpBackend(url, api_key=key).context_window == FakeBackend.context_window


# --- a ticket collected by the garbage collector while a lock is held -----------------------


@pytest.fixture
def no_automatic_gc() -> Iterator[None]:
    """Garbage is collected only where the test says (gc.collect), not on any allocation."""
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def drop_in_a_cycle(ticket: Ticket) -> None:
    """Leave ``ticket`` unreleased in garbage only the cycle collector frees, as a ticket
    held by a frame in an exception's traceback is."""
    cycle: list[object] = [ticket]
    cycle.append(cycle)


def finishes(action: Callable[[], None], timeout_s: float = 10.0) -> bool:
    """Whether ``action`` returns within ``timeout_s`` on a thread (a deadlock never does:
    the daemon thread is left behind)."""
    thread = threading.Thread(target=action, daemon=True)
    thread.start()
    thread.join(timeout_s)
    return not thread.is_alive()


@pytest.mark.usefixtures("no_automatic_gc")
@pytest.mark.parametrize("lock", ["runner", "metrics"])
def test_a_ticket_collected_under_a_lock_does_not_deadlock(lock: str) -> None:
    """Ticket.__del__ took the runner's lock, then the metrics' lock: the collector can run
    it on a thread that holds either (it runs on any allocation, e.g. in admit or render)."""
    metrics = ServeMetrics()
    runner = Runner(FakeBackend(), metrics, max_in_flight=2)
    drop_in_a_cycle(runner.admit())
    held = runner._lock if lock == "runner" else metrics._lock

    def collect() -> None:
        with held:
            gc.collect()

    assert finishes(collect)
    assert runner.in_flight == 0  # the dropped ticket's place is back, counted as cancelled
    assert metrics.value("chunkcache_generations_total", outcome="cancelled") == 1.0
    tickets = [runner.admit(), runner.admit()]
    tickets[0].release("completed")
    assert runner.in_flight == 1
