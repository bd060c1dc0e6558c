"""HttpBackend's model info after ``chunkcache serve`` restarted behind the same URL with
another window or model: a refusal that says the info read before is stale makes it ask
``GET /v1/models`` again, once, before the error is raised (as VllmBackend does), so what
the wrappers read next (LlamaIndex's ``metadata.context_window``, the model name) is the
new server's; a request that the server takes asks nothing."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import pytest
import uvicorn
from fake_backend import FakeBackend
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from chunkcache.core.errors import PromptTooLongError
from chunkcache.core.generation import (
    GenerationChunk,
    GenerationRequest,
    SamplingParams,
    tokens_to_generate,
)
from chunkcache.core.http_backend import HttpBackend
from chunkcache.core.prompting import generate
from chunkcache.core.segmenter import TextSegment
from chunkcache.core.serve import create_app
from chunkcache.core.serve.launcher import wait_healthy
from chunkcache.core.store.redis_server import free_port


class Windowed:
    """A fake model named ``model_name`` with a window of ``window`` words, refusing a
    prompt that leaves no room for ``max_tokens``; ``reads`` counts the reads of its
    window (the server reads it for ``GET /v1/models`` only)."""

    def __init__(self, model_name: str, window: int) -> None:
        self.model_name = model_name
        self.window = window
        self.reads = 0
        self._fake = FakeBackend()

    @property
    def context_window(self) -> int:
        self.reads += 1
        return self.window

    def render_chat(self, messages: Sequence[Mapping[str, str]]) -> str:
        return self._fake.render_chat(messages)

    def stream(self, request: GenerationRequest) -> Iterator[GenerationChunk]:
        words = sum(len(segment.text.split()) for segment in request.segments)
        tokens_to_generate(words, request.sampling, self.window)
        yield from self._fake.stream(request)


@contextlib.contextmanager
def serving(app: Any, port: int) -> Iterator[str]:
    """``app`` served on ``port``, stopped on exit, so that another can start on the same
    port: a server restarted behind the same URL."""
    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name="chunkcache-restarted", daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, 10.0)
        yield url
    finally:
        server.should_exit = True
        thread.join(10.0)


def ask(max_tokens: int) -> GenerationRequest:
    """Two words of prompt, and ``max_tokens`` to generate."""
    return GenerationRequest([TextSegment("Why now?")], sampling=SamplingParams(max_tokens))


@pytest.fixture
def port() -> int:
    return free_port()


def test_a_prompt_refused_over_a_smaller_window_makes_it_read_the_window_again(
    port: int,
) -> None:
    with serving(create_app(Windowed("tiny", 2048)), port) as url:
        http = HttpBackend(url)
        assert http.context_window == 2048
    smaller = Windowed("tiny", 16)
    with serving(create_app(smaller), port):
        generate(http, ask(4))  # fits: nothing asked
        assert smaller.reads == 0
        with pytest.raises(PromptTooLongError):
            generate(http, ask(32))
        assert smaller.reads == 1  # asked before the error was raised
        assert http.context_window == 16
        with pytest.raises(PromptTooLongError):
            generate(http, ask(32))
        assert smaller.reads == 2  # one GET a refusal
    http.close()


def test_a_server_that_serves_another_model_now_is_asked_which(port: int) -> None:
    with serving(create_app(Windowed("tiny-a", 2048)), port) as url:
        http = HttpBackend(url)
        assert (http.model_name, http.context_window) == ("tiny-a", 2048)
    with serving(create_app(Windowed("tiny-b", 64)), port):
        with pytest.raises(ValueError, match="'tiny-a' is not served here"):
            generate(http, ask(4))
        assert (http.model_name, http.context_window) == ("tiny-b", 64)
        assert generate(http, ask(4))[0] == "The answer is in"
    http.close()


def test_a_model_the_caller_named_is_kept(port: int) -> None:
    """The caller's own model name is not the server's to change: no GET for its 404."""
    with serving(create_app(Windowed("tiny-a", 2048)), port) as url:
        http = HttpBackend(url, model="tiny-a")
        assert http.context_window == 2048
    other = Windowed("tiny-b", 64)
    with serving(create_app(other), port):
        with pytest.raises(ValueError, match="'tiny-a' is not served here"):
            generate(http, ask(4))
        assert other.reads == 0
        assert http.model_name == "tiny-a"
    http.close()


def broken_models_app() -> Starlette:
    """A server that refuses every prompt as over its window and fails ``/v1/models``."""

    async def refuse(request: Request) -> JSONResponse:
        error = {"message": "too long", "type": "invalid_request_error", "code": "prompt_too_long"}
        return JSONResponse({"error": error}, 400)

    async def fail(request: Request) -> JSONResponse:
        return JSONResponse({"error": {"message": "down", "type": "server_error"}}, 500)

    async def health(request: Request) -> JSONResponse:
        return JSONResponse({"status": "ok"})

    routes = [
        Route("/v1/completions", refuse, methods=["POST"]),
        Route("/v1/models", fail),
        Route("/health", health),
    ]
    return Starlette(routes=routes)


def test_a_server_that_cannot_tell_leaves_the_window_known(port: int) -> None:
    """The GET after a refusal failing raises the refusal still, and keeps what was known."""
    with serving(create_app(Windowed("tiny", 2048)), port) as url:
        http = HttpBackend(url)
        assert http.context_window == 2048
    with serving(broken_models_app(), port):
        with pytest.raises(PromptTooLongError, match="too long"):
            generate(http, ask(4))
        assert (http.model_name, http.context_window) == ("tiny", 2048)
    http.close()
