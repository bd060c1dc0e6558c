"""The ``chunkcache serve`` FastAPI app: OpenAI's endpoints over any :class:`Backend`.

Endpoints: ``POST /v1/chat/completions`` and ``/v1/completions`` (SSE with
``stream: true``), ``GET /v1/models`` and ``/v1/models/{model}``, ``POST /v1/chunks``
(chunks to find in later prompts), ``POST /v1/chunkcache/render`` (chat messages -> prompt
text, for :class:`~chunkcache.core.http_backend.HttpBackend`), ``GET /health``,
``GET /metrics``.

A prompt is split into text and chunks the way ``ChunkCacheLLM`` splits it
(:func:`~chunkcache.core.prompting.build_request`): by the request's ``chunkcache.chunks``
and the chunks registered through ``/v1/chunks``.

>>> app = create_app(FakeBackend())  # doctest: +SKIP
>>> uvicorn.run(app)  # doctest: +SKIP
"""

from __future__ import annotations

import hmac
from collections.abc import AsyncIterator, Callable, Coroutine
from contextlib import asynccontextmanager
from typing import Any

import anyio
from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from fastapi.routing import APIRoute
from pydantic import SecretStr
from starlette.exceptions import HTTPException
from starlette.routing import Match, get_route_path

from chunkcache.core.cache import ChunkCache
from chunkcache.core.errors import ChunkCacheError
from chunkcache.core.generation import Backend
from chunkcache.core.generation import GenerationRequest as EngineRequest
from chunkcache.core.serve.completions import generate
from chunkcache.core.serve.errors import ServeError, handle_error, handle_validation_error
from chunkcache.core.serve.heap_trim import HeapTrimmer
from chunkcache.core.serve.middleware import ServeMiddleware
from chunkcache.core.serve.schemas import (
    ChatCompletionBody,
    ChunksBody,
    CompletionBody,
    RenderBody,
)
from chunkcache.core.serve.settings import ServeSettings
from chunkcache.core.serve.state import ServeState


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
        trimmer = HeapTrimmer(state.settings.trim_heap_s) if state.settings.trim_heap_s else None
        if trimmer is not None:
            trimmer.start()
        try:
            yield
        finally:
            if trimmer is not None:
                trimmer.stop()
        await anyio.to_thread.run_sync(state.close)

    # No 307 to the path without its trailing slash: POST clients do not follow it, and
    # its body is empty; the 404 names the path instead (_http_error).
    app = FastAPI(title="chunkcache serve", lifespan=lifespan, redirect_slashes=False)
    app.state.serve = state
    app.add_middleware(
        ServeMiddleware, metrics=state.metrics, max_bytes=state.settings.max_body_bytes
    )
    app.add_exception_handler(RequestValidationError, handle_validation_error)
    # Anything else (a TypeError too: a bug) is ServeMiddleware's logged 500.
    for expected in (ServeError, ChunkCacheError, ValueError):
        app.add_exception_handler(expected, handle_error)
    app.add_exception_handler(HTTPException, _http_error)
    app.include_router(_open_routes(state))
    app.include_router(_v1_routes(state))
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
    router = APIRouter(prefix="/v1", route_class=_authenticated(state.settings.api_key))

    def card() -> dict[str, Any]:
        return {
            "id": state.model_name,
            "object": "model",
            "created": int(state.started),
            "owned_by": "chunkcache",
            "max_model_len": getattr(state.backend, "context_window", None),
        }

    @router.get("/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [card()]}

    @router.get("/models/{model:path}")  # a model name may hold a "/"
    async def model(model: str) -> dict[str, Any]:
        if not model:  # "/v1/models/": a wrong path, not a model named ""
            raise HTTPException(404)
        state.check_model(model)
        return card()

    @router.post("/chunks")
    async def chunks(body: ChunksBody) -> dict[str, Any]:
        # An id sent twice ends as its last text left it (a text too large drops the id).
        kept: dict[str, bool] = {}
        for chunk in body.chunks:
            cid, text = chunk.pair()
            kept[cid] = state.cache.registry.register(cid, text)
        return {
            "registered": [cid for cid, ok in kept.items() if ok],
            "too_large": [cid for cid, ok in kept.items() if not ok],
            "total": len(state.cache.registry),
        }

    @router.post("/chunkcache/render")
    async def render(body: RenderBody) -> dict[str, str]:
        return {"prompt": await anyio.to_thread.run_sync(state.render, body.messages)}

    @router.post("/chat/completions", response_model=None)
    async def chat(body: ChatCompletionBody, request: Request) -> Response:
        def prepare() -> EngineRequest:
            return state.request_for(body, state.render(body.messages))

        return await generate(state, "chat", body, request, prepare)

    @router.post("/completions", response_model=None)
    async def completions(body: CompletionBody, request: Request) -> Response:
        return await generate(
            state, "text", body, request, lambda: state.request_for(body, body.prompt)
        )

    return router


def _authenticated(api_key: SecretStr | None) -> type[APIRoute]:
    """The route class of ``/v1/*``: with an ``api_key``, a request without it is a 401 before
    its body is read (FastAPI parses a body before it runs a route's dependencies)."""

    class AuthenticatedRoute(APIRoute):
        def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
            handle = super().get_route_handler()
            if api_key is None:
                return handle

            async def checked(request: Request) -> Response:
                _check_key(request, api_key)
                return await handle(request)

            return checked

    return AuthenticatedRoute


def _check_key(request: Request, api_key: SecretStr) -> None:
    """A 401 ServeError unless ``request`` carries ``Authorization: Bearer <api_key>``."""
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(
        token.encode(), api_key.get_secret_value().encode()
    ):
        raise ServeError(
            401,
            "missing or wrong API key (Authorization: Bearer <key>)",
            "authentication_error",
            "invalid_api_key",
        )


async def _http_error(request: Request, error: Exception) -> JSONResponse:
    assert isinstance(error, HTTPException)
    # a 405 keeps its Allow header
    headers = dict(error.headers or {})
    message = _wrong_path(request) if error.status_code == 404 else str(error.detail)
    return ServeError(error.status_code, message, headers=headers).response()


def _wrong_path(request: Request) -> str:
    """The 404 of a path no route serves (OpenAI's words), naming the path the client
    likely meant: with ``/v1`` in front (a base_url without it) or without a trailing slash."""
    message = f"Invalid URL ({request.method} {request.url.path})"
    root = request.scope.get("root_path", "")
    for path, why in _meant(get_route_path(request.scope)):
        scope = {**request.scope, "path": root + path}
        if any(route.matches(scope)[0] == Match.FULL for route in request.app.router.routes):
            return f"{message}: did you mean {request.method} {root}{path}? ({why})"
    return message


def _meant(path: str) -> list[tuple[str, str]]:
    """Paths a client may have meant by ``path``, each with what was wrong with it."""
    bare = path.rstrip("/") or "/"
    meant = [(bare, "no trailing slash")] if bare != path else []
    if bare != "/v1" and not bare.startswith("/v1/"):
        meant.append((f"/v1{bare}", "the API is under /v1: a client's base_url ends with /v1"))
    return meant


__all__ = ["create_app"]
