"""``VllmBackend``: chunkcache's LLM wrappers in front of a vLLM OpenAI-compatible server.

vLLM's automatic prefix caching reuses exact token prefixes only, so what chunkcache
adds on this route is the prompt's layout (CRAFT §4.2-4.3): the retriever wrapper puts
chunks in frequency/tree order and the multi-turn layout keeps everything that stays
before what changes.  This backend then sends the prompt as it is, text already
rendered with the model's chat template, to ``/v1/completions`` and reports vLLM's
cached prompt tokens as ``reused_tokens`` (``usage_metadata`` ``cache_read``).  A request's
``cache_salt`` goes to vLLM as its own ``cache_salt``, so vLLM's prefix cache is isolated
as the local engine's is.

The context window: vLLM itself cuts ``max_tokens`` to the room a prompt leaves.  This
backend keeps the local backends' rule instead (:func:`~chunkcache.core.generation.
tokens_to_generate`): it reads the window from ``GET /v1/models`` (``max_model_len``),
counts the prompt's tokens with its tokenizer, and refuses a prompt that leaves no room, or
no room for ``max_tokens`` unless the request sets ``fit_window``, before sending it.  The
window is read once, and again when it may have changed (the server restarted behind the
same URL with another ``--max-model-len``): before refusing a prompt, and after vLLM refused
one as over its window.  A request that fits is never delayed by it.

The server must be started with ``--enable-prompt-tokens-details`` for vLLM to report
cached tokens (and ``--enable-prefix-caching`` to have any); a server that does not report
them is named once in a warning, as ``reused_tokens`` 0 then means unknown.

Chunk counts: vLLM caches whole KV blocks from the start of the prompt, so its cached
tokens are a prefix of the prompt as its tokenizer reads it (whole, no special tokens
added).  The prompt is tokenized once per request, the same way, with character offsets
(which the window check also counts): a chunk segment is a ``chunk_hit`` when every token
holding one of its characters lies in that cached prefix, a ``chunk_miss`` otherwise, each
occurrence of a chunk counted apart.  When that cannot be measured (vLLM reports no cached
tokens, the tokenizer gives no offsets (not a fast tokenizer) or counts the prompt otherwise
than vLLM did, or no local tokenizer for a server that names no window), both stay 0 and
``extra["unmeasured_chunks"]`` says how many chunks are unknown, never misses; so
``chunk_hits + chunk_misses + extra["unmeasured_chunks"]`` is the number of chunk segments.

Errors: a ``base_url`` that is not an http(s) URL with a host, or a ``timeout_s`` that is not
a positive finite number -> ValueError when the backend is made
(:func:`~chunkcache.core.urls.server_root`); a prompt or stop string with a lone surrogate ->
:class:`InvalidTextError`, and ``seed`` 2**64 - 1 or -1 (vLLM reads those bits as no seed) ->
ValueError, before anything is sent; a prompt over the context window ->
:class:`PromptTooLongError`; a request the server refuses (400, 404, 413, 422), or an
``api_key`` it does not take (401, 403) -> ValueError with its message
(:class:`PromptTooLongError` for vLLM's context-length 400); the server
unreachable, timing out or failing, or answering anything but a complete event stream of
completion events (ending in ``data: [DONE]``, with the usage asked for) ->
:class:`BackendUnavailableError` naming the server and the endpoint.

>>> backend = VllmBackend("http://127.0.0.1:8000", "SmolLM2-135M-Instruct")  # doctest: +SKIP
>>> llm = ChunkCacheLLM(chunk_cache=ChunkCache(backend=backend))  # doctest: +SKIP
"""

from __future__ import annotations

import functools
import math
import re
import threading
import time
import warnings
from collections.abc import Callable, Generator, Mapping, Sequence
from typing import Any

import httpx

from chunkcache.core.chunk_ids import check_unicode
from chunkcache.core.errors import BackendUnavailableError, ChunkCacheError, PromptTooLongError
from chunkcache.core.generation import (
    GenerationChunk,
    GenerationRequest,
    GenerationStats,
    SamplingParams,
    tokens_to_generate,
)
from chunkcache.core.http_streams import HttpStream, StreamConnection, own_connection_client
from chunkcache.core.json_shapes import completion_events, error_message, json_object, shaped
from chunkcache.core.segmenter import ChunkSegment, Segment
from chunkcache.core.tokenization import render_chat
from chunkcache.core.urls import check_api_key, server_root

__all__ = ["VllmBackend"]

_COMPLETIONS = "POST /v1/completions"
_MODELS = "GET /v1/models"
# How vLLM words a prompt over the window (vllm/renderers/params.py, v1/engine/input_processor.py).
_OVER_THE_WINDOW = re.compile(r"maximum (context|model) length")


class VllmBackend:
    """Runs requests on a vLLM server; vLLM's prefix cache does the reuse.

    Args:
        base_url: the server, an http(s) URL with a host such as ``http://127.0.0.1:8000``
            (``/v1`` optional).
        model: the model name the server serves (``--served-model-name``).
        api_key: sent as a bearer token when the server wants one (``--api-key``).
        timeout_s: how long one request may take, end to end.
        tokenizer: a Hugging Face tokenizer for the chat template and for counting a
            prompt's tokens against the context window; by default the tokenizer of the
            local model named ``model`` (the default model's safetensors copy, or a
            checkpoint folder), loaded offline on first use.
        transport: an httpx transport (tests pass ``httpx.MockTransport``).  A cancel cuts
            a request at once on a connection opened for it (every request asks for its
            connection to be closed after it); not on one that other clients sharing the
            transport left in its pool, nor over HTTP/2.
    """

    def __init__(
        self,
        base_url: str,
        model: str,
        *,
        api_key: str | None = None,
        timeout_s: float = 600.0,
        tokenizer: Any = None,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        if not model:
            raise ValueError("model must name the model the vLLM server serves")
        # NaN or inf failed inside httpx at the first request, a bool read as 1 s
        if isinstance(timeout_s, bool) or not (
            isinstance(timeout_s, int | float) and 0 < timeout_s < math.inf
        ):
            raise ValueError(f"timeout_s must be a positive number of seconds, got {timeout_s!r}")
        self.base_url = server_root(base_url)
        self.model_name = model
        self._server = f"vLLM at {self.base_url}"
        if api_key:
            check_api_key(api_key, "api_key")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        # Every request on a connection of its own, which HttpStream.cancel can cut: the
        # stream learns a connection's socket as it opens.  "close" leaves no connection in
        # the pool of a caller's transport, which httpx gives no limits, for the next
        # request to go out on unseen.
        self._client = own_connection_client(
            base_url=f"{self.base_url}/v1",
            headers={**headers, "Connection": "close"},
            timeout=httpx.Timeout(timeout_s, connect=10.0),
            transport=transport,
        )
        self._window: tuple[int | None] | None = None  # (max_model_len,) once asked
        self._tokenizer = tokenizer
        self._tokenizer_lock = threading.Lock()
        self._warned_no_cached_tokens = False

    @property
    def tokenizer(self) -> Any:
        """The model's tokenizer (loaded from the local model on first use)."""
        with self._tokenizer_lock:
            if self._tokenizer is None:
                self._tokenizer = _local_tokenizer(self.model_name)
            return self._tokenizer

    def render_chat(self, messages: Sequence[Mapping[str, str]]) -> str:
        """The model's chat template applied to ``messages``, ready for the assistant."""
        return render_chat(self.tokenizer, messages)

    def stream(self, request: GenerationRequest) -> HttpStream:
        """Send the prompt (the segments' text, in order) and stream vLLM's answer; the last
        piece carries the stats, from the usage vLLM reports after the text.  Closing or
        cancelling the stream closes the request at once (vLLM then aborts it), also while
        another thread waits on it, or on the window's first ``GET /v1/models``."""
        connection = StreamConnection()
        return HttpStream(self._pieces(request, connection), connection)

    def _pieces(
        self, request: GenerationRequest, connection: StreamConnection
    ) -> Generator[GenerationChunk]:
        started = time.perf_counter()
        stats = GenerationStats(policy="prefix")
        has_usage = False
        body = self._body(request)
        prompt = _PromptTokens(body["prompt"], lambda: self.tokenizer)
        self._check_window(prompt, request.sampling, connection)
        try:
            with self._client.stream(
                "POST", "/completions", json=body, extensions=connection.extensions
            ) as response:
                if response.status_code >= 400:
                    response.read()
                    error = self._refusal(response)
                    if isinstance(error, PromptTooLongError):
                        self._forget_window()  # smaller than the one read: ask next time
                    raise error
                for event in completion_events(response.iter_lines(), _COMPLETIONS, self._server):
                    for item in event.get("choices") or ():
                        choice = shaped(
                            item,
                            _COMPLETIONS,
                            self._server,
                            text=str | None,
                            finish_reason=str | None,
                        )
                        if not stats.ttft_s:
                            stats.ttft_s = time.perf_counter() - started
                        stats.finish_reason = choice.get("finish_reason") or stats.finish_reason
                        if choice.get("text"):
                            yield GenerationChunk(choice["text"])
                    if event.get("usage") is not None:
                        _fill_usage(stats, event["usage"], self._server)
                        has_usage = True
        except httpx.HTTPError as e:
            raise BackendUnavailableError(f"{self._server} failed: {e}") from e
        if not has_usage:
            raise BackendUnavailableError(
                f"{self._server} answered {_COMPLETIONS} without the usage it was asked for "
                "(stream_options.include_usage)"
            )
        _count_chunks(stats, request.segments, prompt)
        stats.total_s = time.perf_counter() - started
        if not stats.extra["cached_tokens_reported"]:
            self._warn_no_cached_tokens()
        yield GenerationChunk("", stats)

    def close(self) -> None:
        """Close the HTTP connections."""
        self._client.close()

    def _warn_no_cached_tokens(self) -> None:
        if self._warned_no_cached_tokens:
            return
        self._warned_no_cached_tokens = True
        warnings.warn(
            f"{self._server} does not report cached prompt tokens (start it with "
            "--enable-prompt-tokens-details): reused_tokens and cache_read are 0 whatever "
            "its prefix cache served, and chunk hits and misses are unknown "
            "(extra['unmeasured_chunks'])",
            UserWarning,
            stacklevel=2,
        )

    @property
    def context_window(self) -> int | None:
        """The server's ``max_model_len`` for this model, None if it gives none: asked once,
        and again when it may have changed (see the module docstring)."""
        return self._read_window(StreamConnection())

    def _read_window(self, connection: StreamConnection) -> int | None:
        """:attr:`context_window`, asked on ``connection`` (cut with it) if not known."""
        if self._window is None:
            self._window = (self._ask_window(connection),)
        return self._window[0]

    def _ask_window(self, connection: StreamConnection) -> int | None:
        try:
            response = self._client.get("/models", extensions=connection.extensions)
        except httpx.HTTPError as e:
            raise BackendUnavailableError(f"{self._server} failed: {e}") from e
        if response.status_code == 404:
            return None  # not vLLM's API: its own checks are all there is
        if response.status_code >= 400:
            raise self._refusal(response, _MODELS)
        models = json_object(response.text, _MODELS, self._server, data=list)["data"]
        for item in models:
            model = shaped(item, _MODELS, self._server, id=str, max_model_len=int | None)
            if model["id"] == self.model_name:
                return model.get("max_model_len")
        return None

    def _check_window(
        self, prompt: _PromptTokens, sampling: SamplingParams, connection: StreamConnection
    ) -> None:
        """Refuse ``prompt`` as a local backend would (see the module docstring); the window
        is asked on the request's ``connection``, so that a cancel cuts that question too."""
        window = self._read_window(connection)
        if window is None:
            return
        try:
            tokens_to_generate(prompt.count, sampling, window)
        except PromptTooLongError as too_long:
            # A server restarted with a longer window would be refused what it takes, for
            # good: ask again before refusing (one GET, on a refusal only).
            self._forget_window()
            try:
                fresh = self._read_window(connection)
            except (ChunkCacheError, ValueError):  # unreachable, or refusing: no news
                raise too_long from None
            if fresh == window:
                raise
            if fresh is not None:
                tokens_to_generate(prompt.count, sampling, fresh)

    def _forget_window(self) -> None:
        """Make the next :attr:`context_window` read ask the server again."""
        self._window = None

    def _refusal(self, response: httpx.Response, where: str = _COMPLETIONS) -> Exception:
        """The error for a failed ``response``: the request's fault or the server's."""
        message, _ = error_message(response.text)
        status = response.status_code
        if status == 400 and _OVER_THE_WINDOW.search(message):
            return PromptTooLongError(f"{self._server} refused the prompt: {message}")
        if status in (400, 404, 413, 422):
            return ValueError(f"{self._server} refused {where} ({status}): {message}")
        if status in (401, 403):
            # vLLM's --api-key: a retry, or a fallback as for a server that is down, cannot help
            return ValueError(
                f"{self._server} refused {where} ({status}): {message}; check the api_key "
                "it was given"
            )
        return BackendUnavailableError(f"{self._server} answered {where} with {status}: {message}")

    def _body(self, request: GenerationRequest) -> dict[str, Any]:
        params = request.sampling
        # The ChunkCacheLLM side has ordered the chunks and laid out the conversation:
        # the prompt is sent exactly as the segments spell it.
        prompt = check_unicode("".join(segment.text for segment in request.segments))
        for stop in params.stop:
            check_unicode(stop)
        body: dict[str, Any] = {
            "model": self.model_name,
            "prompt": prompt,
            "max_tokens": params.max_tokens,
            "temperature": params.temperature,
            "top_p": params.top_p,
            "stream": True,
            "stream_options": {"include_usage": True},
            # The chat template already wrote the special tokens (vLLM extension).
            "add_special_tokens": False,
        }
        if params.stop:
            body["stop"] = list(params.stop)
        if params.seed is not None:
            body["seed"] = signed_seed(params.seed)
        if request.cache_salt is not None:  # vLLM salts its prefix cache's block hashes with it
            body["cache_salt"] = request.cache_salt
        return body


class _PromptTokens:
    """A prompt tokenized as vLLM tokenizes it (whole, no special tokens added), at most once
    whoever asks: the window check and the chunk counts."""

    def __init__(self, text: str, tokenizer: Callable[[], Any]) -> None:
        self.text = text
        self._tokenizer = tokenizer

    @functools.cached_property
    def offsets(self) -> list[tuple[int, int]] | None:
        """Each token's character span, None from a tokenizer that gives none (a slow one)."""
        tokenizer = self._tokenizer()
        if not getattr(tokenizer, "is_fast", False):
            return None
        encoded = tokenizer(self.text, add_special_tokens=False, return_offsets_mapping=True)
        return [(start, end) for start, end in encoded["offset_mapping"]]

    @functools.cached_property
    def count(self) -> int:
        """How many tokens vLLM reads in the prompt."""
        if self.offsets is not None:
            return len(self.offsets)
        return len(self._tokenizer().encode(self.text, add_special_tokens=False))


def _count_chunks(
    stats: GenerationStats, segments: Sequence[Segment], prompt: _PromptTokens
) -> None:
    """``chunk_hits`` and ``chunk_misses`` from vLLM's cached prefix (module docstring)."""
    ends = _chunk_ends(segments)
    offsets = None
    if ends and stats.extra["cached_tokens_reported"]:
        try:
            offsets = prompt.offsets
        except ChunkCacheError:  # ModelLoadError: no local tokenizer, and no window needed one
            offsets = None
    if offsets is None or len(offsets) != stats.prompt_tokens:  # not vLLM's tokens
        stats.extra["unmeasured_chunks"] = len(ends)
        return
    hits = sum(_cached_through(offsets, stats.reused_tokens, end) for end in ends)
    stats.chunk_hits, stats.chunk_misses = hits, len(ends) - hits
    stats.extra["unmeasured_chunks"] = 0


def _chunk_ends(segments: Sequence[Segment]) -> list[int]:
    """Where each chunk segment ends in the prompt (a character index), in order."""
    ends: list[int] = []
    position = 0
    for segment in segments:
        position += len(segment.text)
        if isinstance(segment, ChunkSegment):
            ends.append(position)
    return ends


def _cached_through(offsets: Sequence[tuple[int, int]], cached: int, end: int) -> bool:
    """Whether every token holding a character before ``end`` is among the first ``cached``.

    The first uncached token must start at ``end`` or later (a character split over two
    tokens gives both its span), and the cached ones must reach ``end``: a tokenizer that
    trims offsets reports a token's leading space as not its own.
    """
    cached = min(cached, len(offsets))
    reaches = cached > 0 and offsets[cached - 1][1] >= end
    return reaches and (cached == len(offsets) or offsets[cached][0] >= end)


def signed_seed(seed: int) -> int:
    """``seed`` (in [0, 2**64)) as the signed 64-bit integer with the same bits: vLLM takes
    seeds in [-2**63, 2**63) and refuses the upper half of the unsigned range.  Its -1
    means no seed (vLLM's ``SamplingParams``), so 2**64 - 1 is a ValueError: a wrapper's
    ``seed=-1`` arrives as that seed (:func:`~chunkcache.core.generation.openai_sampling`),
    which the local engines seed torch with, and vLLM would not seed at all."""
    if seed == 2**64 - 1:
        raise ValueError(
            "seed 2**64 - 1 (or -1: the same bits) cannot be sent to vLLM: it reads -1 as "
            "no seed and would sample afresh on every call; choose another seed"
        )
    return seed - 2**64 if seed >= 2**63 else seed


def _fill_usage(stats: GenerationStats, usage: Any, server: str) -> None:
    """Token counts from an OpenAI ``usage`` object; vLLM's cached tokens are the reused."""
    counts = shaped(
        usage,
        _COMPLETIONS,
        server,
        prompt_tokens=int,
        completion_tokens=int | None,
        prompt_tokens_details=dict | None,
    )
    details = shaped(
        counts.get("prompt_tokens_details") or {}, _COMPLETIONS, server, cached_tokens=int | None
    )
    stats.prompt_tokens = counts["prompt_tokens"]
    stats.completion_tokens = counts.get("completion_tokens") or 0
    stats.reused_tokens = details.get("cached_tokens") or 0
    stats.computed_tokens = stats.prompt_tokens - stats.reused_tokens
    stats.extra["cached_tokens_reported"] = "cached_tokens" in details


def _local_tokenizer(model: str) -> Any:
    """The tokenizer of the local model ``model`` names, loaded offline."""
    from transformers import AutoTokenizer

    from chunkcache.core.model_files import ModelLoadError, resolve_model_path

    try:
        directory, gguf_file = resolve_model_path(model)
    except ModelLoadError as e:
        raise ModelLoadError(
            f"VllmBackend needs the chat template of {model!r}: pass tokenizer=, or name a "
            f"local model ({e})"
        ) from e
    return AutoTokenizer.from_pretrained(directory, gguf_file=gguf_file, local_files_only=True)
