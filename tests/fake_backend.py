"""A deterministic :class:`~chunkcache.core.generation.Backend` for unit tests only.

Words stand in for tokens.  ``render_chat`` joins messages ChatML-style;
``stream`` records the request and yields a canned answer word by word, cut at
the first stop string (which is left out, as OpenAI-style servers do) and at
``max_tokens`` words.  Its stats count a chunk segment as a hit when the same
chunk id was in an earlier request (a miss otherwise); with ``"cacheblend"`` or
``"cachecraft"`` a hit's words are split into recomputed (``recompute_ratio``)
and reused, with ``"full"`` nothing is reused.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping, Sequence

from chunkcache.core.generation import GenerationChunk, GenerationRequest, GenerationStats
from chunkcache.core.segmenter import ChunkSegment

DEFAULT_ANSWER = "The answer is in the context above, friend."


class FakeBackend:
    """Canned answers and plausible stats; ``requests`` holds every request seen."""

    model_name = "fake-chatml"
    context_window = 2048

    def __init__(self, answer: str = DEFAULT_ANSWER) -> None:
        self.answer = answer
        self.requests: list[GenerationRequest] = []
        self._seen: set[str] = set()
        self._lock = threading.Lock()

    def render_chat(self, messages: Sequence[Mapping[str, str]]) -> str:
        turns = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
        return turns + "<|im_start|>assistant\n"

    def stream(self, request: GenerationRequest) -> Iterator[GenerationChunk]:
        with self._lock:
            self.requests.append(request)
            stats = self._stats(request)
        words = self._answer(request).split()
        max_tokens = request.sampling.max_tokens
        stats.finish_reason = "length" if len(words) > max_tokens else "stop"
        words = words[:max_tokens]
        stats.completion_tokens = len(words)
        pieces = [word if i == 0 else f" {word}" for i, word in enumerate(words)] or [""]
        for piece in pieces[:-1]:
            yield GenerationChunk(piece)
        yield GenerationChunk(pieces[-1], stats)

    def _answer(self, request: GenerationRequest) -> str:
        """The canned answer up to its first stop string."""
        cuts = [self.answer.find(s) for s in request.sampling.stop if s in self.answer]
        return self.answer[: min(cuts)] if cuts else self.answer

    def _stats(self, request: GenerationRequest) -> GenerationStats:
        stats = GenerationStats(policy=request.policy, ttft_s=0.001, total_s=0.002)
        selective = request.policy in ("cacheblend", "cachecraft")
        ratio = request.recompute_ratio if selective else 0.0
        for segment in request.segments:
            words = len(segment.text.split())
            stats.prompt_tokens += words
            if not isinstance(segment, ChunkSegment):
                stats.computed_tokens += words
            elif segment.chunk_id in self._seen and request.policy != "full":
                stats.chunk_hits += 1
                stats.recomputed_tokens += round(words * ratio)
                stats.reused_tokens += words - round(words * ratio)
            else:
                stats.chunk_misses += 1
                stats.computed_tokens += words
        self._seen.update(s.chunk_id for s in request.segments if isinstance(s, ChunkSegment))
        return stats


class GatedBackend(FakeBackend):
    """Yields the first piece, then waits for ``gate`` before the rest; ``closed`` is set
    when a stream ends or is closed.  Shows whether a wrapper streams incrementally."""

    def __init__(self, answer: str = DEFAULT_ANSWER) -> None:
        super().__init__(answer)
        self.gate = threading.Event()
        self.closed = threading.Event()

    def stream(self, request: GenerationRequest) -> Iterator[GenerationChunk]:
        try:
            pieces = super().stream(request)
            yield next(pieces)
            if not self.gate.wait(timeout=10):
                raise TimeoutError("the gate was never opened")
            yield from pieces
        finally:
            self.closed.set()


class RaisingBackend(FakeBackend):
    """Raises ``error`` before its first piece, or after it with ``after_first`` (with no
    error, the stream ends there)."""

    def __init__(self, error: Exception | None = None, after_first: bool = False) -> None:
        super().__init__()
        self.error = error
        self.after_first = after_first

    def stream(self, request: GenerationRequest) -> Iterator[GenerationChunk]:
        if self.after_first:
            yield GenerationChunk("partial")
        if self.error is not None:
            raise self.error


class RenderCountingBackend(FakeBackend):
    """Counts the chat template renders (a backend without a tokenizer in this process, as
    ``http``)."""

    def __init__(self) -> None:
        super().__init__()
        self.renders = 0

    def render_chat(self, messages: Sequence[Mapping[str, str]]) -> str:
        self.renders += 1
        return super().render_chat(messages)
