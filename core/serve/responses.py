"""OpenAI response shapes for chat and text completions, whole and as stream chunks.

``usage.prompt_tokens_details.cached_tokens`` counts the prompt tokens served from cache
(:attr:`GenerationStats.reused_tokens`); the extension ``usage.chunkcache`` is the whole
:class:`~chunkcache.core.generation.GenerationStats` (``recomputed_tokens``,
``computed_tokens``, ``chunk_hits``, ``ttft_s``, per-tier store counts in ``extra``...).
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

from chunkcache.core.generation import GenerationStats

Kind = Literal["chat", "text"]


def usage(stats: GenerationStats) -> dict[str, Any]:
    """OpenAI's usage object, with the chunkcache extension."""
    return {
        "prompt_tokens": stats.prompt_tokens,
        "completion_tokens": stats.completion_tokens,
        "total_tokens": stats.prompt_tokens + stats.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": stats.reused_tokens},
        "chunkcache": stats.as_dict(),
    }


@dataclass
class Reply:
    """One response's identity; builds its whole body or its stream chunks."""

    kind: Kind
    model: str
    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    created: int = field(default_factory=lambda: int(time.time()))

    def _envelope(self, streamed: bool, choices: list[dict[str, Any]]) -> dict[str, Any]:
        if self.kind == "chat":
            prefix, obj = "chatcmpl-", "chat.completion.chunk" if streamed else "chat.completion"
        else:
            prefix, obj = "cmpl-", "text_completion"
        return {
            "id": prefix + self.id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }

    def whole(self, text: str, stats: GenerationStats) -> dict[str, Any]:
        """The non-streamed response."""
        if self.kind == "chat":
            choice = {"index": 0, "message": {"role": "assistant", "content": text}}
        else:
            choice = {"index": 0, "text": text, "logprobs": None}
        choice["finish_reason"] = stats.finish_reason
        return {**self._envelope(False, [choice]), "usage": usage(stats)}

    def chunk(
        self, text: str, finish_reason: str | None = None, first: bool = False
    ) -> dict[str, Any]:
        """A stream chunk carrying ``text`` (the role too in a chat's first chunk)."""
        if self.kind == "chat":
            delta = {"role": "assistant", "content": text} if first else {"content": text}
            choice: dict[str, Any] = {"index": 0, "delta": delta}
        else:
            choice = {"index": 0, "text": text, "logprobs": None}
        choice["finish_reason"] = finish_reason
        return self._envelope(True, [choice])

    def usage_chunk(self, stats: GenerationStats) -> dict[str, Any]:
        """The last stream chunk when ``stream_options.include_usage``: no choices, usage."""
        return {**self._envelope(True, []), "usage": usage(stats)}
