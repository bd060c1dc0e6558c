"""The in-process backend: the chunk-cache engine behind the :class:`Backend` contract."""

from __future__ import annotations

import threading
import time
from collections.abc import Generator, Iterator, Mapping, Sequence
from contextlib import closing
from pathlib import Path
from typing import cast

import torch

from chunkcache.core.engine import ChunkEngine
from chunkcache.core.generation import GenerationChunk, GenerationRequest
from chunkcache.core.kv_store import KVStore
from chunkcache.core.model_files import DEFAULT_MODEL_NAME
from chunkcache.core.models import load_model
from chunkcache.core.store.hooks import prefetch
from chunkcache.core.text_stream import TextStream
from chunkcache.core.tokenization import SegmentTokenizer, render_chat


class LocalBackend:
    """Runs requests on a :class:`ChunkEngine` in this process, one at a time."""

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
    ) -> LocalBackend:
        """A backend on ``model`` (default: SmolLM2-135M-Instruct, installed on first use)."""
        name = Path(model).name if model is not None else DEFAULT_MODEL_NAME
        return cls(ChunkEngine(load_model(model, dtype=dtype), store), name)

    @property
    def context_window(self) -> int:
        return self.engine.lm.spec.max_positions

    def render_chat(self, messages: Sequence[Mapping[str, str]]) -> str:
        """The model's chat template applied to ``messages``, ready for the assistant."""
        return render_chat(self.tokenizer, messages)

    def stream(self, request: GenerationRequest) -> Iterator[GenerationChunk]:
        """Generate for ``request``; closing the iterator early stops decoding at once."""
        started = time.perf_counter()
        segments = self.segment_tokenizer(request.segments)
        params = request.sampling
        # Start moving this request's chunks up to host memory while it waits for the lock.
        chunk_ids = [segment.segment_id for segment in segments if segment.is_chunk]
        prefetch(self.engine.store, self.engine.lm.fingerprint, chunk_ids)
        text = TextStream(self.tokenizer, self.eos_ids, params.stop)
        with self._lock:
            prefilled = self.engine.prefill(
                segments,
                request.policy,
                request.recompute_ratio,
                request.conversation_id,
                reserve=params.max_tokens,
            )
            stats = prefilled.stats
            # Closed early (the consumer stopped reading), decoding stops at that piece and
            # the lock is free for the next request.
            decoding = cast(Generator[int], self.engine.decode(prefilled, params))  # a generator
            with closing(decoding) as tokens:
                for token in tokens:
                    if not text.tokens and not text.finished:
                        stats.ttft_s = time.perf_counter() - started
                    piece = text.push(token)
                    if piece:
                        yield GenerationChunk(piece)
                    if text.finished:
                        break
            if request.conversation_id is not None:
                self.engine.remember(request.conversation_id, prefilled)
        final = text.finish()
        stats.finish_reason = text.finish_reason
        stats.completion_tokens = len(text.tokens)
        stats.total_s = time.perf_counter() - started
        yield GenerationChunk(final, stats)
