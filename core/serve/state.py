"""What the server's routes share, and how a request body becomes an engine request.

:class:`ServeState` holds the backend, the :class:`Runner`, the chunk registry, the settings
and the metrics; it checks a body against the limits, splits its prompt into text and chunks
(:func:`~chunkcache.core.prompting.build_request`, as ``ChunkCacheLLM`` does) and gathers the
live gauges for ``/metrics``.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from chunkcache.core.cache import ChunkCache
from chunkcache.core.chunk_ids import validate_chunk_id
from chunkcache.core.generation import DEFAULT_POLICY, DEFAULT_RECOMPUTE_RATIO, Backend
from chunkcache.core.generation import GenerationRequest as EngineRequest
from chunkcache.core.prompting import backend_model_name, build_request
from chunkcache.core.segmenter import ChunkSegment, Segment, TextSegment
from chunkcache.core.serve.errors import ServeError, template_refusal
from chunkcache.core.serve.metrics import ServeMetrics
from chunkcache.core.serve.runner import Runner
from chunkcache.core.serve.schemas import ChatMessage, GenerationBody, SegmentRef
from chunkcache.core.serve.settings import ServeSettings


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

    def check_model(self, model: str) -> None:
        """A 404 ServeError unless ``model`` is the one served."""
        if model != self.model_name:
            raise ServeError(
                404,
                f"model {model!r} is not served here; this server runs {self.model_name!r}",
                code="model_not_found",
                param="model",
            )

    def render(self, messages: Sequence[ChatMessage]) -> str:
        """The model's chat template applied to ``messages``; a 400 when it refuses them."""
        try:
            return self.backend.render_chat([m.as_dict() for m in messages])
        except Exception as error:
            refusal = template_refusal(error)
            if refusal is None:
                raise
            raise refusal from error

    def request_for(self, body: GenerationBody, prompt: str) -> EngineRequest:
        """The engine request for ``body`` and its prompt text; ServeError when over a limit.

        A body with no max_tokens gets the default with ``fit_window``: the backend, which
        tokenizes the prompt anyway, cuts it to the room the prompt leaves in the context
        window (as OpenAI does), and refuses a prompt that leaves none."""
        limits = self.settings
        self.check_model(body.model)
        if len(prompt) > limits.max_prompt_chars:
            raise ServeError(
                400,
                f"prompt of {len(prompt)} characters is over the limit "
                f"of {limits.max_prompt_chars}",
                code="prompt_too_long",
            )
        max_tokens = body.requested_max_tokens()
        if max_tokens is not None and max_tokens > limits.max_tokens_limit:
            field = body.max_tokens_field()
            raise ServeError(
                400,
                f"{field} {max_tokens} is over this server's limit of {limits.max_tokens_limit}",
                code="max_tokens_too_large",
                param=field,
            )
        options = body.chunkcache
        chunks = [c.pair() for c in options.chunks] if options.chunks is not None else None
        # Given segments are the split: the prompt is matched against no chunk.
        matching = options.match_registered and options.segments is None
        request = build_request(
            prompt,
            self.cache if matching else self.unregistered,
            chunks=chunks,
            conversation_id=options.conversation_id,
            cache_salt=body.cache_salt,
            recompute=options.policy or DEFAULT_POLICY,
            recompute_ratio=(
                DEFAULT_RECOMPUTE_RATIO
                if options.recompute_ratio is None
                else options.recompute_ratio
            ),
            max_tokens=max_tokens or min(limits.default_max_tokens, limits.max_tokens_limit),
            **body.sampling(),
            fit_window=max_tokens is None or options.fit_window,
        )
        if options.segments is None:
            return request
        return replace(request, segments=_given_segments(options.segments, prompt))

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


def _given_segments(segments: Sequence[SegmentRef], prompt: str) -> list[Segment]:
    """The segments a request gave, checked to make up its prompt and to name valid ids."""
    if "".join(segment.text for segment in segments) != prompt:
        raise ServeError(
            400, "chunkcache.segments do not make up the prompt", param="chunkcache.segments"
        )
    return [
        TextSegment(s.text)
        if s.chunk_id is None
        else ChunkSegment(validate_chunk_id(s.chunk_id), s.text)
        for s in segments
    ]


__all__ = ["ServeState"]
