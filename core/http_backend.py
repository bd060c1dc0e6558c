"""``HttpBackend``: the :class:`Backend` that runs prompts on a ``chunkcache serve`` server.

The prompt's segments travel as a text completion whose ``chunkcache`` extension names
every chunk (id and text) and turns off the server's own matching, so the server splits
the prompt exactly as this process did; a request whose segments that matching would not
give back (segments the caller built: two texts side by side, a chunk too short to match,
a chunk's text also in plain text) sends its segments themselves.  The text streams back
as SSE and the final usage carries the server's :class:`GenerationStats`.  Chat templates
are applied by the server (``POST /v1/chunkcache/render``), which holds the tokenizer.
A request's ``cache_salt`` goes as the completion's top-level ``cache_salt``, as to vLLM.

>>> backend = HttpBackend("http://127.0.0.1:8000")  # doctest: +SKIP
>>> llm = ChunkCacheLLM(cache=ChunkCache(backend=backend))  # doctest: +SKIP

Errors: the server unreachable, timing out, failing, breaking off an answer, redirecting
or answering something other than the JSON it should -> :class:`BackendUnavailableError`;
a 429 -> :class:`QueueFullError` (with the server's Retry-After, seconds or a date); a
503 ``shutting_down`` -> :class:`ShuttingDownError` (its other 503, a failed engine, is
a :class:`BackendUnavailableError`, as the local backends raise);
a 400, 404 or 413 -> ValueError with the server's message (for a 400 whose input the local
backends refuse, their error: :class:`PromptTooLongError`, :class:`EmptyPromptError`,
:class:`InvalidTextError`...); a prompt with no text or with a lone surrogate is refused here,
as the local backends refuse it, before it is sent; a 401 or 403 (the ``api_key``
is missing or wrong) -> ValueError saying so; a ``base_url`` that is not an
http(s) URL with a host (:func:`~chunkcache.core.urls.server_root`), or an ``api_key`` that
is not visible ASCII (:func:`check_api_key`) -> ValueError when the backend is made.

The model's name (unless given) and its context window are asked from ``GET /v1/models``
once, and again (one GET, before the error is raised) when the server refuses a prompt as
over its window, or refuses the name it gave (a server restarted behind the same URL with
another ``--max-model-len`` or model): what the wrappers read next is the server's now.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Generator, Mapping, Sequence
from dataclasses import fields
from datetime import UTC, datetime
from email.utils import parsedate_to_datetime
from types import UnionType
from typing import Any

import httpx

from chunkcache.core.chunk_ids import check_unicode
from chunkcache.core.errors import (
    BackendUnavailableError,
    ChunkCacheError,
    EmptyPromptError,
    InvalidConversationIdError,
    InvalidTextError,
    PromptTooLongError,
    QueueFullError,
    ShuttingDownError,
)
from chunkcache.core.generation import GenerationChunk, GenerationRequest, GenerationStats
from chunkcache.core.http_streams import HttpStream, StreamConnection, own_connection_client
from chunkcache.core.json_shapes import completion_events, error_message, json_object, shaped
from chunkcache.core.segmenter import ChunkSegment, Segment, segment_prompt
from chunkcache.core.urls import check_api_key, server_root

_STATS_FIELDS = frozenset(f.name for f in fields(GenerationStats))
_DEFAULT_RETRY_AFTER_S = 1.0
_COMPLETIONS = "POST /v1/completions"
_SERVER = "chunkcache serve"
# The connection broke before an answer (not a timeout: that server may still be working).
_NO_ANSWER = (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError)
# A 400's code -> the error the local backends raise for the same input.
_REFUSALS: dict[str, type[ValueError]] = {
    "prompt_too_long": PromptTooLongError,
    "empty_prompt": EmptyPromptError,
    "invalid_text": InvalidTextError,
    "invalid_conversation_id": InvalidConversationIdError,
}


class HttpBackend:
    """A ``chunkcache serve`` server at ``base_url`` (``http://host:port``, ``/v1`` optional)."""

    def __init__(
        self,
        base_url: str,
        *,
        api_key: str | None = None,
        model: str | None = None,
        timeout_s: float = 600.0,
    ) -> None:
        root = server_root(base_url)
        # 0 timed out every request as "unreachable"; inf or NaN failed inside httpx later
        if isinstance(timeout_s, bool) or not (
            isinstance(timeout_s, int | float) and 0 < timeout_s < math.inf
        ):
            raise ValueError(f"timeout_s must be a positive number of seconds, got {timeout_s!r}")
        if api_key:
            check_api_key(api_key, "api_key")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.base_url = root
        self._given_model = model
        self._model = model
        self._context_window: int | None = None
        self._model_info_read = False  # the window may be unknown (null): asked once all the same
        timeout = httpx.Timeout(timeout_s, connect=10.0)
        self._client = httpx.Client(base_url=root, headers=headers, timeout=timeout)
        # Completions each on a connection of their own, which HttpStream.cancel can cut
        self._streams = own_connection_client(base_url=root, headers=headers, timeout=timeout)

    @property
    def model_name(self) -> str:
        """The served model's name (asked from ``/v1/models`` unless given)."""
        if self._model is None:
            self._load_model_info()
        assert self._model is not None
        return self._model

    @property
    def context_window(self) -> int | None:
        """The served model's context length, as ``/v1/models`` reports it: asked once,
        and again after a refusal that says it changed (see the module docstring)."""
        if not self._model_info_read:
            self._load_model_info()
        return self._context_window

    def render_chat(self, messages: Sequence[Mapping[str, str]]) -> str:
        """The server's chat template applied to ``messages``; :class:`InvalidTextError` for a
        lone surrogate (no JSON body carries one), as generating from it locally raises."""
        body = {
            "messages": [
                {"role": m["role"], "content": check_unicode(m["content"])} for m in messages
            ]
        }
        return self._json("POST", "/v1/chunkcache/render", body, prompt=str)["prompt"]

    def stream(self, request: GenerationRequest) -> HttpStream:
        """Run ``request`` on the server, yielding text as it arrives; the last piece
        carries the server's stats.  Closing or cancelling the stream closes the request at
        once (the server then stops generating), also while another thread waits on it."""
        connection = StreamConnection()
        return HttpStream(self._pieces(request, connection), connection)

    def close(self) -> None:
        """Close its connections."""
        self._client.close()
        self._streams.close()

    def _pieces(
        self, request: GenerationRequest, connection: StreamConnection
    ) -> Generator[GenerationChunk]:
        """The local backends' pieces: the text the server sends with the finish reason
        (held back for a stop string, or a character's last bytes) comes with the stats."""
        stats: GenerationStats | None = None
        last = ""
        for event in self._events(request, connection):
            for item in event.get("choices") or ():
                choice = shaped(
                    item, _COMPLETIONS, _SERVER, text=str | None, finish_reason=str | None
                )
                text = choice.get("text") or ""
                if choice.get("finish_reason") is not None:
                    last += text
                elif text:
                    yield GenerationChunk(text)
            if event.get("usage"):
                stats = _stats(event["usage"])
        if stats is None:
            raise BackendUnavailableError("chunkcache serve ended the stream without usage")
        yield GenerationChunk(last, stats)

    def _events(
        self, request: GenerationRequest, connection: StreamConnection
    ) -> Generator[dict[str, Any]]:
        """The completion events the server streams for ``request``.  A refusal that says
        the model info read before is stale makes it ask again, before it is raised."""
        body = self._body(request)
        try:
            with _Response(self._streams, "POST", "/v1/completions", body, connection) as response:
                yield from completion_events(response.iter_lines(), _COMPLETIONS, _SERVER)
        except PromptTooLongError:
            self._reload_model_info()
            raise
        except _ModelNotServed:
            if self._given_model is None:  # the name the server gave before
                self._reload_model_info()
            raise

    def _body(self, request: GenerationRequest) -> dict[str, Any]:
        """The completion request for ``request``; raises what the local backends raise for
        a prompt with a lone surrogate or with no text, before anything is sent."""
        for segment in request.segments:
            check_unicode(segment.text)
        prompt = "".join(segment.text for segment in request.segments)
        if not prompt:
            raise EmptyPromptError("the prompt has no tokens")
        params = request.sampling
        # vLLM's top-level field; sent only when set (a server older than it ignores it)
        salt = {} if request.cache_salt is None else {"cache_salt": request.cache_salt}
        return {
            "model": self.model_name,
            "prompt": prompt,
            "max_tokens": params.max_tokens,
            "temperature": params.temperature,
            "top_p": params.top_p,
            "stop": list(params.stop) or None,
            "seed": params.seed,
            "stream": True,
            "stream_options": {"include_usage": True},
            **salt,
            "chunkcache": {
                **_split(prompt, request.segments),
                "match_registered": False,
                "policy": request.policy,
                "recompute_ratio": request.recompute_ratio,
                "conversation_id": request.conversation_id,
                # sent only when set: a server older than the option refuses the key
                **({"fit_window": True} if params.fit_window else {}),
            },
        }

    def _load_model_info(self) -> None:
        models = self._json("GET", "/v1/models", data=list)["data"]
        if not models:
            raise BackendUnavailableError("chunkcache serve answered GET /v1/models with no model")
        model = shaped(models[0], "GET /v1/models", _SERVER, id=str, max_model_len=int | None)
        self._model = self._given_model or model["id"]
        self._context_window = model.get("max_model_len")
        self._model_info_read = True

    def _reload_model_info(self) -> None:
        """Ask ``/v1/models`` again; a server that cannot tell now leaves what was known."""
        with contextlib.suppress(ChunkCacheError, ValueError):
            self._load_model_info()

    def _request(self, method: str, path: str, body: Any = None) -> _Response:
        return _Response(self._client, method, path, body)

    def _json(
        self, method: str, path: str, body: Any = None, /, **shape: type | UnionType
    ) -> dict[str, Any]:
        """The JSON object ``path`` answers, checked against ``shape`` (see :func:`shaped`)."""
        with self._request(method, path, body) as response:
            response.read()
            return json_object(response.text, f"{method} {path}", _SERVER, **shape)


def _split(prompt: str, segments: Sequence[Segment]) -> dict[str, Any]:
    """How the server is to split ``prompt`` into ``segments``: by finding the chunks in it,
    as the segmenter split it, or (when that would not give ``segments`` back) by the
    segments themselves, which a server older than that option refuses."""
    pairs = list(
        dict.fromkeys((s.chunk_id, s.text) for s in segments if isinstance(s, ChunkSegment))
    )
    if segment_prompt(prompt, None, pairs) == list(segments):
        return {"chunks": [{"id": cid, "text": text} for cid, text in pairs]}
    return {
        "segments": [
            {"text": s.text, "chunk_id": s.chunk_id}
            if isinstance(s, ChunkSegment)
            else {"text": s.text}
            for s in segments
        ]
    }


class _ModelNotServed(ValueError):
    """The server's 404 ``model_not_found``: it serves another model than the one named."""


class _Response:
    """A streamed request whose failures become chunkcache errors: on entry (unreachable,
    an error status) and while its body is read (the server or the connection broke).

    A connection that breaks before any answer is tried once more on a new one: the pooled
    connection may be one the server closed as idle just as the request went out (uvicorn
    does after 5 s), and a request without an answer is safe to send again (generating
    changes nothing but the cache)."""

    def __init__(
        self,
        client: httpx.Client,
        method: str,
        path: str,
        body: Any,
        connection: StreamConnection | None = None,
    ) -> None:
        self._where = f"{method} {path}"
        extensions = {} if connection is None else connection.extensions
        self._open = lambda: client.stream(method, path, json=body, extensions=extensions)
        self._context = self._open()

    def __enter__(self) -> httpx.Response:
        try:
            try:
                response = self._context.__enter__()
            except _NO_ANSWER:
                self._context = self._open()
                response = self._context.__enter__()
        except httpx.HTTPError as error:
            raise BackendUnavailableError(f"chunkcache serve unreachable: {error}") from error
        if not response.is_success:
            try:
                _raise_for(response)
            except BaseException as error:
                self.__exit__(type(error), error, error.__traceback__)
                raise
        return response

    def __exit__(self, kind: Any, error: BaseException | None, traceback: Any) -> None:
        self._context.__exit__(kind, error, traceback)
        if isinstance(error, httpx.HTTPError):
            raise BackendUnavailableError(
                f"chunkcache serve broke off its answer to {self._where}: {error}"
            ) from error


def _raise_for(response: httpx.Response) -> None:
    response.read()
    message, code = error_message(response.text)
    status = response.status_code
    if status == 400 and code in _REFUSALS:
        raise _REFUSALS[code](f"chunkcache serve refused the request ({status}): {message}")
    if status == 429:
        retry = _retry_after_s(response.headers.get("retry-after", ""))
        raise QueueFullError(f"chunkcache serve is full: {message}", retry_after_s=retry)
    # Only the server's own word: its other 503 is a failed engine, a proxy's a dead server.
    if status == 503 and code == "shutting_down":
        raise ShuttingDownError(f"chunkcache serve is shutting down: {message}")
    if status == 404 and code == "model_not_found":
        raise _ModelNotServed(f"chunkcache serve refused the request ({status}): {message}")
    if status in (400, 404, 413):
        raise ValueError(f"chunkcache serve refused the request ({status}): {message}")
    if status in (401, 403):  # a retry, or a fallback as for a server that is down, cannot help
        raise ValueError(
            f"chunkcache serve refused the request ({status}): {message}; check the api_key "
            "the backend was given"
        )
    if response.is_redirect:
        message = f"a redirect to {response.headers.get('location')!r}: use that base_url"
    raise BackendUnavailableError(f"chunkcache serve answered {status}: {message}")


def _retry_after_s(header: str) -> float:
    """The wait a Retry-After header asks for, as delay-seconds or an HTTP date (RFC 9110):
    0 for a date past, the default when the header is missing or unreadable."""
    try:
        seconds = float(header)
    except ValueError:
        try:
            when = parsedate_to_datetime(header)
        except (ValueError, OverflowError):
            return _DEFAULT_RETRY_AFTER_S
        seconds = (when.replace(tzinfo=when.tzinfo or UTC) - datetime.now(UTC)).total_seconds()
    return max(0.0, seconds) if math.isfinite(seconds) else _DEFAULT_RETRY_AFTER_S


def _stats(usage: Mapping[str, Any]) -> GenerationStats:
    """The server's GenerationStats from a usage object (OpenAI fields if no extension)."""
    if usage.get("chunkcache") is not None:
        extension = shaped(usage["chunkcache"], _COMPLETIONS, _SERVER, policy=str)
        return GenerationStats(**{k: v for k, v in extension.items() if k in _STATS_FIELDS})
    counts = shaped(
        usage,
        _COMPLETIONS,
        _SERVER,
        prompt_tokens=int | None,
        completion_tokens=int | None,
        prompt_tokens_details=dict | None,
    )
    details = counts.get("prompt_tokens_details") or {}
    cached = shaped(details, _COMPLETIONS, _SERVER, cached_tokens=int | None)
    prompt_tokens = counts.get("prompt_tokens") or 0
    reused = cached.get("cached_tokens") or 0
    return GenerationStats(
        policy="unknown",
        prompt_tokens=prompt_tokens,
        reused_tokens=reused,
        computed_tokens=prompt_tokens - reused,
        completion_tokens=counts.get("completion_tokens") or 0,
    )
