"""What the LangChain and LlamaIndex ``ChunkCacheLLM`` share: prompt in, text and stats out.

Both wrappers render their framework's messages (or take a completion prompt as
it is), turn the prompt into a :class:`GenerationRequest` with
:func:`build_request` (the segmenter finds the chunks the retrievers registered,
plus any the caller names), run it with :func:`run_stream` or :func:`generate` (async:
:func:`arun_stream`, :func:`agenerate`),
and report the :class:`GenerationStats` in their framework's response metadata.

Per-call options (keyword arguments of ``invoke``/``complete``/...) are
:data:`CALL_OPTIONS` (see :func:`call_options`); anything else (tools, a response
format, another model) is refused with a TypeError rather than silently ignored.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar, cast

from chunkcache.core.cache import ChunkCache
from chunkcache.core.chunk_ids import check_unicode
from chunkcache.core.escaped_chunks import warn_if_escaped
from chunkcache.core.generation import (
    DEFAULT_POLICY,
    DEFAULT_RECOMPUTE_RATIO,
    Backend,
    GenerationChunk,
    GenerationRequest,
    GenerationStats,
    SamplingParams,
    check_policy,
)
from chunkcache.core.ledger import check_conversation_id
from chunkcache.core.segmenter import segment_prompt

T = TypeVar("T")

DEFAULT_MODEL_NAME = "chunkcache"
# A wrapper's constructor settings, each also a per-call option of the same name.
SETTINGS = (
    "recompute",
    "recompute_ratio",
    "max_tokens",
    "temperature",
    "top_p",
    "stop",
    "seed",
    "cache_salt",
)
CALL_OPTIONS = frozenset({*SETTINGS, "chunks", "conversation_id"})


def call_options(wrapper: object, kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """``wrapper``'s :data:`SETTINGS` overridden by a call's keyword arguments.

    Raises TypeError naming any keyword argument that is not in :data:`CALL_OPTIONS`.
    """
    unknown = sorted(set(kwargs) - CALL_OPTIONS)
    if unknown:
        raise TypeError(
            f"ChunkCacheLLM got unsupported arguments {unknown} (tool calling, structured "
            f"output and per-call model choice are not supported); per-call options are "
            f"{sorted(CALL_OPTIONS)}"
        )
    return {**{name: getattr(wrapper, name) for name in SETTINGS}, **kwargs}


def build_request(
    prompt: str,
    cache: ChunkCache,
    *,
    chunks: Sequence[tuple[str, str]] | None = None,
    conversation_id: str | None = None,
    cache_salt: str | None = None,
    recompute: str = DEFAULT_POLICY,
    recompute_ratio: float = DEFAULT_RECOMPUTE_RATIO,
    max_tokens: int = 256,
    temperature: float = 0.0,
    top_p: float = 1.0,
    stop: Sequence[str] | None = None,
    seed: int | None = None,
    fit_window: bool = False,
) -> GenerationRequest:
    """The request for ``prompt``: its chunks found by exact text, and how to decode.

    ``chunks`` are (chunk id, text) pairs the caller knows are in the prompt, in
    addition to the texts registered in ``cache``.  ``fit_window``: ``max_tokens`` is cut
    to the room the prompt leaves in the context window (see :class:`SamplingParams`).
    ``cache_salt`` isolates the request's cache (see :class:`GenerationRequest`).

    >>> cache = ChunkCache()
    >>> cache.registry.register("c1", "The quick brown fox jumps over the lazy dog.")
    True
    >>> request = build_request(
    ...     "Context: The quick brown fox jumps over the lazy dog.\\nWho jumps?", cache
    ... )
    >>> [type(segment).__name__ for segment in request.segments]
    ['TextSegment', 'ChunkSegment', 'TextSegment']
    """
    if isinstance(stop, str):
        raise TypeError("stop must be a list of strings, not one str")
    stops = tuple(stop or ())
    if not all(isinstance(s, str) and s for s in stops):
        raise ValueError(f"stop strings must be non-empty str, got {stops!r}")
    sampling = SamplingParams(
        max_tokens=max_tokens,
        temperature=temperature,
        top_p=top_p,
        stop=stops,
        seed=seed,
        fit_window=fit_window,
    )
    segments = segment_prompt(prompt, cache.matcher, chunks)
    warn_if_escaped(prompt, segments, cache.matcher.index())
    return GenerationRequest(
        segments=segments,
        conversation_id=None if conversation_id is None else check_conversation_id(conversation_id),
        policy=check_policy(recompute),
        recompute_ratio=recompute_ratio,
        sampling=sampling,
        cache_salt=cache_salt,
    )


def run_stream(backend: Backend, request: GenerationRequest) -> Iterator[GenerationChunk]:
    """``backend.stream(request)``, checked: exactly the last piece carries the stats."""
    return _checked(backend.stream(request))


async def arun_stream(
    backend: Backend, request: GenerationRequest
) -> AsyncGenerator[GenerationChunk, None]:
    """:func:`run_stream` driven from a worker thread.  Left early (break, a cancelled task),
    the backend's stream is also cancelled if it can be (the local and batching backends'
    can), so a request still waiting for the engine stops there instead of running."""
    stream = await asyncio.to_thread(backend.stream, request)
    async for piece in aiterate(_checked(stream), cancel=getattr(stream, "cancel", None)):
        yield piece


def generate(backend: Backend, request: GenerationRequest) -> tuple[str, GenerationStats]:
    """Run ``request`` to the end: the whole text and the stats."""
    return _joined(list(run_stream(backend, request)))


async def agenerate(backend: Backend, request: GenerationRequest) -> tuple[str, GenerationStats]:
    """:func:`generate` from async code; cancelling the awaiting task stops the request."""
    return _joined([piece async for piece in arun_stream(backend, request)])


def _checked(pieces: Iterator[GenerationChunk]) -> Iterator[GenerationChunk]:
    stats: GenerationStats | None = None
    for piece in pieces:
        if stats is not None:
            raise RuntimeError("the backend yielded text after its stats")
        stats = piece.stats
        yield piece
    if stats is None:
        raise RuntimeError("the backend's stream ended without stats")


def _joined(pieces: Sequence[GenerationChunk]) -> tuple[str, GenerationStats]:
    """The text of a checked stream's pieces, and its stats (on the last piece)."""
    stats = pieces[-1].stats
    assert stats is not None  # _checked raises otherwise
    return "".join(piece.text for piece in pieces), stats


async def aiterate(
    items: Iterator[T], cancel: Callable[[], None] | None = None
) -> AsyncGenerator[T, None]:
    """Drive a blocking iterator from async code, one item at a time, in a worker thread.

    Items arrive as the iterator produces them and the event loop keeps running.
    When the consumer stops early (break, cancel), ``cancel`` is called at once (from
    the event loop: it must be thread-safe) and the iterator is closed in the same
    worker thread, after the step in flight, so a generator's cleanup runs.
    """
    loop = asyncio.get_running_loop()
    worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="chunkcache-stream")
    done = object()
    finished = False
    try:
        while True:
            item = await loop.run_in_executor(worker, next, items, done)
            if item is done:
                finished = True
                return
            yield cast(T, item)
    finally:
        if cancel is not None and not finished:
            cancel()
        close = getattr(items, "close", None)
        if close is not None:
            worker.submit(close)
        worker.shutdown(wait=False)


def backend_model_name(backend: Backend) -> str:
    """The backend's ``model_name`` attribute if it has one, else ``"chunkcache"``."""
    name = getattr(backend, "model_name", None)
    return name if isinstance(name, str) and name else DEFAULT_MODEL_NAME


def has_tokenizer(backend: Backend) -> bool:
    """Whether ``backend`` holds its tokenizer in this process: ``segment_tokenizer`` on the
    local engines, ``tokenizer`` on vllm (``http`` has none: the server holds it)."""
    tokenizers = (getattr(backend, name, None) for name in ("segment_tokenizer", "tokenizer"))
    return any(tokenizer is not None for tokenizer in tokenizers)


def counts_prompts(backend: Backend) -> bool:
    """Whether :func:`fits_context_window` can count ``backend``'s prompts in this process:
    it :func:`has_tokenizer` and a context window."""
    return has_tokenizer(backend) and isinstance(getattr(backend, "context_window", None), int)


def prompt_tokens(backend: Any, request: GenerationRequest) -> int:
    """How many tokens ``request``'s prompt is to ``backend`` (one that
    :func:`counts_prompts`), counted as it counts: per segment on the local engines (each
    chunk is tokenized on its own), the whole prompt on another (vLLM's check)."""
    segment_tokenizer = getattr(backend, "segment_tokenizer", None)
    if segment_tokenizer is not None:
        return sum(len(segment.ids) for segment in segment_tokenizer(request.segments))
    text = check_unicode("".join(segment.text for segment in request.segments))
    return len(backend.tokenizer.encode(text, add_special_tokens=False))


def fits_context_window(backend: Any, request: GenerationRequest) -> bool:
    """Whether ``request``'s prompt (:func:`prompt_tokens`) and ``max_tokens`` fit the
    context window of ``backend`` (one that :func:`counts_prompts`)."""
    tokens = prompt_tokens(backend, request)
    return bool(tokens + request.sampling.max_tokens <= backend.context_window)
