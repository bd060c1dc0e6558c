"""The in-process backend: the chunk-cache engine behind the :class:`Backend` contract."""

from __future__ import annotations

import threading
import time
from collections.abc import Generator, Iterator, Mapping, Sequence
from contextlib import closing, contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any, cast

import torch

from chunkcache.core.engine import ChunkEngine, TokenSegment
from chunkcache.core.generation import GenerationChunk, GenerationRequest, tokens_to_generate
from chunkcache.core.kv_store import KVStore
from chunkcache.core.model_files import DEFAULT_MODEL_NAME
from chunkcache.core.models import load_model
from chunkcache.core.store.hooks import prefetch
from chunkcache.core.text_stream import TextStream
from chunkcache.core.tokenization import SegmentTokenizer, render_chat

CANCEL_POLL_S = 0.05  # how often a request waiting for the engine checks it was cancelled


class LocalBackend:
    """Runs requests on a :class:`ChunkEngine` in this process, one engine step at a time."""

    def __init__(self, engine: ChunkEngine, model_name: str = "chunkcache-local") -> None:
        if engine.lm.tokenizer is None:
            raise ValueError("the local backend needs a model loaded with its tokenizer")
        self.engine = engine
        self.model_name = model_name
        self.tokenizer = engine.lm.tokenizer
        self.segment_tokenizer = SegmentTokenizer(self.tokenizer)
        self.eos_ids = engine.lm.eos_ids
        self._lock = threading.Lock()

    @classmethod
    def default(
        cls,
        model: str | Path | None = None,
        dtype: torch.dtype = torch.bfloat16,
        store: KVStore | None = None,
        engine_options: Mapping[str, Any] | None = None,
    ) -> LocalBackend:
        """A backend on ``model`` (default: SmolLM2-135M-Instruct, installed on first use);
        ``engine_options`` go to :class:`ChunkEngine` (e.g. ``max_conversation_tokens``)."""
        return cls(*default_engine(model, dtype, store, engine_options))

    @property
    def context_window(self) -> int:
        return self.engine.lm.spec.context_window

    def render_chat(self, messages: Sequence[Mapping[str, str]]) -> str:
        """The model's chat template applied to ``messages``, ready for the assistant."""
        return render_chat(self.tokenizer, messages)

    def stream(self, request: GenerationRequest) -> LocalStream:
        """Generate for ``request``; closing the stream early stops decoding at once, and
        :meth:`LocalStream.cancel` (from any thread) stops it even while it waits."""
        cancelled = threading.Event()
        return LocalStream(self._run(request, cancelled), cancelled)

    def _run(
        self, request: GenerationRequest, cancelled: threading.Event
    ) -> Generator[GenerationChunk]:
        started = time.perf_counter()
        segments = self.segment_tokenizer(request.segments)
        params = fit_to_window(request, segments, self.context_window).sampling
        engine = self.engine.salted(request.cache_salt)
        # Start moving this request's chunks up to host memory while it waits for the engine.
        chunk_ids = [segment.segment_id for segment in segments if segment.is_chunk]
        prefetch(engine.store, engine.namespace, chunk_ids)
        text = TextStream(self.tokenizer, self.eos_ids, params.stop)
        try:
            with self._engine_turn(cancelled):
                prefilled = engine.prefill(
                    segments,
                    request.policy,
                    request.recompute_ratio,
                    request.conversation_id,
                    reserve=params.max_tokens,
                )
            stats = prefilled.stats
            decoding = cast(Generator[int], engine.decode(prefilled, params))  # a generator
            with closing(decoding) as tokens:
                while not text.finished:
                    with self._engine_turn(cancelled):  # one decode step
                        token = next(tokens, None)
                    if token is None:
                        break
                    if not text.tokens:
                        stats.ttft_s = time.perf_counter() - started
                    piece = text.push(token)
                    if piece:
                        yield GenerationChunk(piece)
        except _Cancelled:
            return
        if request.conversation_id is not None:
            engine.remember(request.conversation_id, prefilled)
        final = text.finish()
        stats.finish_reason = text.finish_reason
        stats.completion_tokens = len(text.tokens)
        stats.total_s = time.perf_counter() - started
        yield GenerationChunk(final, stats)

    @contextmanager
    def _engine_turn(self, cancelled: threading.Event) -> Iterator[None]:
        """The engine to this request for one prefill or decode step.  Held only per step,
        never across a ``yield``: a stream its consumer paused (or interleaves with another
        on the same thread) does not hold up other requests.  Raises :class:`_Cancelled`
        once ``cancelled`` is set, also while waiting for the engine."""
        while not self._lock.acquire(timeout=CANCEL_POLL_S):
            if cancelled.is_set():
                raise _Cancelled
        try:
            if cancelled.is_set():
                raise _Cancelled
            yield
        finally:
            self._lock.release()


def default_engine(
    model: str | Path | None,
    dtype: torch.dtype,
    store: KVStore | None,
    engine_options: Mapping[str, Any] | None,
) -> tuple[ChunkEngine, str]:
    """An engine on ``model`` (None: the default model) and the model's name."""
    name = Path(model).name if model is not None else DEFAULT_MODEL_NAME
    return ChunkEngine(load_model(model, dtype=dtype), store, **(engine_options or {})), name


def fit_to_window(
    request: GenerationRequest, segments: Sequence[TokenSegment], context_window: int
) -> GenerationRequest:
    """``request`` as the engine runs it, ``segments`` being its prompt's tokens: with
    ``sampling.fit_window``, its ``max_tokens`` cut to the room they leave in the context
    window, a :class:`PromptTooLongError` when they leave none; else ``request`` itself."""
    if not request.sampling.fit_window:
        return request
    prompt_tokens = sum(len(segment.ids) for segment in segments)
    max_tokens = tokens_to_generate(prompt_tokens, request.sampling, context_window)
    sampling = replace(request.sampling, max_tokens=max_tokens)
    return replace(request, sampling=sampling)


class LocalStream(Iterator[GenerationChunk]):
    """One local request's pieces (the last carries the stats)."""

    def __init__(self, pieces: Generator[GenerationChunk], cancelled: threading.Event) -> None:
        self._pieces = pieces
        self._cancelled = cancelled
        self._stepping = threading.Lock()  # held while a piece is made

    def __next__(self) -> GenerationChunk:
        with self._stepping:
            return next(self._pieces)

    def cancel(self) -> None:
        """Stop at the request's next engine step; thread-safe, the stream then just ends."""
        self._cancelled.set()

    def close(self) -> None:
        """Stop: at once when no piece is being made (decoding ends at the piece read last),
        else at the request's next engine step; safe from any thread."""
        self._cancelled.set()
        if self._stepping.acquire(blocking=False):
            try:
                self._pieces.close()
            finally:
                self._stepping.release()


class _Cancelled(Exception):
    """The request was cancelled before one of its engine steps."""
