"""Hugging Face ``generate`` as a :class:`~chunkcache.core.generation.Backend`.

The no-cache baseline of the benchmarks: the prompt's text, tokenized whole, goes
through transformers' own ``generate`` (full prefill every time), so it runs in the
same LangChain app as the engine's systems.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch

from chunkcache.core.generation import GenerationChunk, GenerationRequest, GenerationStats
from chunkcache.core.models import LoadedModel
from chunkcache.core.sampling import StopChecker
from chunkcache.core.tokenization import render_chat


class FirstTokenClock:
    """A ``generate`` streamer that notes when the first new token arrives."""

    def __init__(self) -> None:
        self.started = time.perf_counter()
        self.first_token_s: float | None = None
        self._prompt_seen = False

    def put(self, value: Any) -> None:
        if not self._prompt_seen:  # generate hands the prompt first
            self._prompt_seen = True
        elif self.first_token_s is None:
            self.first_token_s = time.perf_counter() - self.started

    def end(self) -> None:
        pass


class HFGenerateBackend:
    """Runs every request with transformers' ``generate``: no KV reuse at all."""

    def __init__(self, lm: LoadedModel, model_name: str = "hf-generate") -> None:
        if lm.tokenizer is None:
            raise ValueError("the Hugging Face backend needs a model loaded with its tokenizer")
        self.lm = lm
        self.model_name = model_name
        self.tokenizer = lm.tokenizer

    @property
    def context_window(self) -> int:
        return self.lm.spec.context_window

    def render_chat(self, messages: Sequence[Mapping[str, str]]) -> str:
        return render_chat(self.tokenizer, messages)

    @torch.no_grad()
    def stream(self, request: GenerationRequest) -> Iterator[GenerationChunk]:
        clock = FirstTokenClock()
        text = "".join(segment.text for segment in request.segments)
        ids = self.tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
        ids = ids.to(self.lm.device)  # ids: [1, N]
        params = request.sampling
        sampled = params.temperature > 0
        if params.seed is not None:
            torch.manual_seed(params.seed)
        output = self.lm.hf.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=params.max_tokens,
            do_sample=sampled,
            temperature=params.temperature if sampled else None,
            top_p=params.top_p if sampled else None,
            top_k=None,
            pad_token_id=min(self.lm.eos_ids),
            streamer=clock,
        )  # output: [1, N + T]
        new = [int(t) for t in output[0, ids.shape[1] :] if int(t) not in self.lm.eos_ids]
        answer = StopChecker(params.stop).final(
            self.tokenizer.decode(new, skip_special_tokens=True)
        )
        total_s = time.perf_counter() - clock.started
        stats = GenerationStats(
            policy="hf-generate",
            prompt_tokens=ids.shape[1],
            computed_tokens=ids.shape[1],
            completion_tokens=len(new),
            ttft_s=clock.first_token_s if clock.first_token_s is not None else total_s,
            total_s=total_s,
            finish_reason="length" if len(new) >= params.max_tokens else "stop",
        )
        yield GenerationChunk(answer, stats)
