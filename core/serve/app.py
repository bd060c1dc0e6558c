"""The ``chunkcache serve`` FastAPI app: OpenAI's endpoints over any :class:`Backend`.

Endpoints: ``POST /v1/chat/completions`` and ``/v1/completions`` (SSE with
``stream: true``), ``GET /v1/models``, ``POST /v1/chunks`` (chunks to find in later
prompts), ``POST /v1/chunkcache/render`` (chat messages -> prompt text, for
:class:`~chunkcache.core.http_backend.HttpBackend`), ``GET /health``, ``GET /metrics``.

A prompt is split into text and chunks the way ``ChunkCacheLLM`` splits it
(:func:`~chunkcache.core.prompting.build_request`): by the request's ``chunkcache.chunks``
and the chunks registered through ``/v1/chunks``.

>>> app = create_app(FakeBackend())  # doctest: +SKIP
>>> uvicorn.run(app)  # doctest: +SKIP
"""

from __future__ import annotations

import hmac
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from chunkcache.core.cache import ChunkCache
from chunkcache.core.errors import ChunkCacheError
from chunkcache.core.generation import DEFAULT_POLICY, DEFAULT_RECOMPUTE_RATIO, Backend
from chunkcache.core.generation import GenerationRequest as EngineRequest
from chunkcache.core.prompting import backend_model_name, build_request
from chunkcache.core.serve.errors import ServeError, handle_error, handle_validation_error
from chunkcache.core.serve.metrics import ServeMetrics
from chunkcache.core.serve.middleware import ServeMiddleware
from chunkcache.core.serve.responses import Kind, Reply
from chunkcache.core.serve.runner import Runner
from chunkcache.core.serve.schemas import (
    ChatCompletionBody,
    ChunksBody,
    CompletionBody,
    GenerationBody,
    RenderBody,
)
from chunkcache.core.serve.settings import ServeSettings
from chunkcache.core.serve.streaming import SSE_HEADERS, sse_events


class ServeState:
    """What the routes share: backend, runner, chunk registry, settings, metrics."""

    def __init__(
        self, backend: Backend, settings: ServeSettings, cache: ChunkCache | None, store: Any
    ) -> None:
        self.backend = backend
        self.settings = settings
        self.model_name = backend_model_name(backend)
        self.cache = cache if cache is not None else ChunkCache(backend=backend)
        self.unregistered = ChunkCache(backend=backend)  # matches only a request's own chunks
        self.store = store
        self.metrics = ServeMetrics()
        self.runner = Runner(
            backend,
            self.metrics,
            max_in_flight=settings.max_queue + settings.max_batch,
            parallel=getattr(backend, "max_batch", 1),
            retry_after_s=settings.retry_after_s,
        )
        self.started = time.time()

    def request_for(self, body: GenerationBody, prompt: str) -> EngineRequest:
        """The engine request for ``body`` and its prompt text; ServeError when over a limit."""
        limits = self.settings
        if body.model != self.model_name:
            raise ServeError(
                404,
                f"model {body.model!r} is not served here; this server runs {self.model_name!r}",
                code="model_not_found",
            )
        if len(prompt) > limits.max_prompt_chars:
            raise ServeError(
                400,
                f"prompt of {len(prompt)} characters is over the limit "
                f"of {limits.max_prompt_chars}",
                code="prompt_too_long",
            )
        max_tokens = body.requested_max_tokens()
        if max_tokens is not None and max_tokens > limits.max_tokens_limit:
            raise ServeError(
                400,
                f"max_tokens {max_tokens} is over this server's limit of {limits.max_tokens_limit}",
                code="max_tokens_too_large",
            )
        options = body.chunkcache
        chunks = [c.pair() for c in options.chunks] if options.chunks is not None else None
        return build_request(
            prompt,
            self.cache if options.match_registered else self.unregistered,
            chunks=chunks,
            conversation_id=options.conversation_id,
            recompute=options.policy or DEFAULT_POLICY,
            recompute_ratio=(
                DEFAULT_RECOMPUTE_RATIO
                if options.recompute_ratio is None
                else options.recompute_ratio
            ),
            max_tokens=max_tokens or min(limits.default_max_tokens, limits.max_tokens_limit),
            temperature=body.temperature,
            top_p=body.top_p,
            stop=body.stops(),
            seed=body.seed,
        )

    def gauges(self) -> dict[str, Any]:
        """Live values for /metrics: in-flight requests, the backend's and store's metrics."""
        out: dict[str, Any] = {
            "chunkcache_in_flight_requests": self.runner.in_flight,
            "chunkcache_registered_chunks": len(self.cache.registry),
        }
        metrics = getattr(self.backend, "metrics", None)
        if callable(metrics):
            out["chunkcache_engine"] = metrics()
        if self.store is not None and callable(getattr(self.store, "metrics", None)):
            out["chunkcache_store"] = self.store.metrics()
        return out

    def close(self) -> None:
        """Refuse new work, let the backend finish what it runs, release the store."""
        self.runner.close()
        shutdown = getattr(self.backend, "shutdown", None)
        if callable(shutdown):
            shutdown(timeout_s=self.settings.shutdown_timeout_s, drain=True)
        if self.store is not None and callable(getattr(self.store, "close", None)):
            self.store.close()


def create_app(
    backend: Backend,
    settings: ServeSettings | None = None,
    *,
    cache: ChunkCache | None = None,
    store: Any = None,
) -> FastAPI:
    """The server app over ``backend``; ``store`` (if given) is reported and closed with it."""
    state = ServeState(backend, settings or ServeSettings(), cache, store)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        await anyio.to_thread.run_sync(state.close)

    app = FastAPI(title="chunkcache serve", lifespan=lifespan)
    app.state.serve = state
    app.add_middleware(
        ServeMiddleware, metrics=state.metrics, max_bytes=state.settings.max_body_bytes
    )
    app.add_exception_handler(RequestValidationError, handle_validation_error)
    for expected in (ServeError, ChunkCacheError, ValueError, TypeError):
        app.add_exception_handler(expected, handle_error)
    app.add_exception_handler(Exception, handle_error)  # 500, logged
    app.add_exception_handler(HTTPException, _http_error)
    app.include_router(_open_routes(state))
    app.include_router(_v1_routes(state), dependencies=[Depends(_auth(state))])
    return app


def _open_routes(state: ServeState) -> APIRouter:
    router = APIRouter()

    @router.get("/health")
    async def health() -> JSONResponse:
        if state.runner.closing:
            return JSONResponse({"status": "shutting_down"}, 503)
        return JSONResponse({"status": "ok", "model": state.model_name})

    @router.get("/metrics")
    async def metrics() -> PlainTextResponse:
        text = await anyio.to_thread.run_sync(lambda: state.metrics.render(state.gauges()))
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    return router


def _v1_routes(state: ServeState) -> APIRouter:
    router = APIRouter(prefix="/v1")

    @router.get("/models")
    async def models() -> dict[str, Any]:
        context = getattr(state.backend, "context_window", None)
        model = {
            "id": state.model_name,
            "object": "model",
            "created": int(state.started),
            "owned_by": "chunkcache",
            "max_model_len": context,
        }
        return {"object": "list", "data": [model]}

    @router.post("/chunks")
    async def chunks(body: ChunksBody) -> dict[str, Any]:
        pairs = [c.pair() for c in body.chunks]
        kept = [cid for cid, text in pairs if state.cache.registry.register(cid, text)]
        return {
            "registered": kept,
            "too_large": [cid for cid, _ in pairs if cid not in kept],
            "total": len(state.cache.registry),
        }

    @router.post("/chunkcache/render")
    async def render(body: RenderBody) -> dict[str, str]:
        messages = [m.as_dict() for m in body.messages]
        return {"prompt": await anyio.to_thread.run_sync(state.backend.render_chat, messages)}

    @router.post("/chat/completions", response_model=None)
    async def chat(body: ChatCompletionBody, request: Request) -> Response:
        def prepare() -> EngineRequest:
            prompt = state.backend.render_chat([m.as_dict() for m in body.messages])
            return state.request_for(body, prompt)

        return await _generate(state, "chat", body, request, prepare)

    @router.post("/completions", response_model=None)
    async def completions(body: CompletionBody, request: Request) -> Response:
        return await _generate(
            state, "text", body, request, lambda: state.request_for(body, body.prompt_text())
        )

    return router


async def _generate(
    state: ServeState, kind: Kind, body: GenerationBody, request: Request, prepare: Any
) -> Response:
    """Run one completion: streamed as SSE, or whole as JSON."""
    engine_request = await anyio.to_thread.run_sync(prepare)  # template, segmenting: CPU
    pieces = await state.runner.open(engine_request)  # refusals and bad input raise here
    reply = Reply(kind, state.model_name)
    if body.stream:
        events = sse_events(reply, pieces, body.include_usage())
        return StreamingResponse(events, media_type="text/event-stream", headers=SSE_HEADERS)
    texts, stats = [], None
    try:
        async for piece in pieces:
            texts.append(piece.text)
            stats = piece.stats
            if stats is None and await request.is_disconnected():
                return Response(status_code=499)  # nobody is listening: stop generating
    finally:
        await pieces.aclose()
    assert stats is not None  # the runner checks that the last piece carries stats
    return JSONResponse(reply.whole("".join(texts), stats))


def _auth(state: ServeState) -> Any:
    key = state.settings.api_key

    async def check(request: Request) -> None:
        if key is None:
            return
        given = request.headers.get("authorization", "")
        scheme, _, token = given.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(
            token.encode(), key.get_secret_value().encode()
        ):
            raise ServeError(
                401,
                "missing or wrong API key (Authorization: Bearer <key>)",
                "authentication_error",
                "invalid_api_key",
            )

    return check


async def _http_error(request: Request, error: Exception) -> JSONResponse:
    assert isinstance(error, HTTPException)
    return ServeError(error.status_code, str(error.detail), code=None).response()


__all__ = ["ServeState", "create_app"]
