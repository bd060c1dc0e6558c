"""Generated tokens to streamed text: incremental detokenizing, EOS and stop strings.

Shared by every in-process backend, so they all emit the same text pieces and finish for the
same reasons.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from chunkcache.core.sampling import StopChecker


class TextStream:
    """The text of one request's sampled tokens, released piece by piece as it becomes safe.

    :meth:`push` each sampled token; it returns the new text to emit (held back while the text
    ends in a partial UTF-8 character or might start a stop string). ``finish_reason`` becomes
    ``"stop"`` on an EOS token or a stop string; :meth:`finish` returns the rest of the text
    and sets ``"length"`` when neither happened.
    """

    def __init__(self, tokenizer: Any, eos_ids: Collection[int], stop: tuple[str, ...]) -> None:
        self.tokenizer = tokenizer
        self.eos_ids = eos_ids
        self.tokens: list[int] = []  # sampled tokens, EOS excluded
        self.finish_reason: str | None = None
        self._stop = StopChecker(stop)
        self._emitted = ""

    @property
    def finished(self) -> bool:
        """An EOS token or a stop string ended generation."""
        return self.finish_reason is not None

    def push(self, token: int) -> str:
        """Take the next sampled token; returns the text it makes safe to emit (maybe "")."""
        if self.finished:
            raise ValueError("the stream already finished")
        if token in self.eos_ids:
            self.finish_reason = "stop"
            return ""
        self.tokens.append(token)
        text, stopped = self._stop.split(self._decode())
        if stopped:
            self.finish_reason = "stop"
        if len(text) > len(self._emitted):  # shorter while bytes still join into a character
            piece, self._emitted = text[len(self._emitted) :], text
            return piece
        return ""

    def finish(self) -> str:
        """The text not emitted yet, cut at the first stop string; ends the stream."""
        if self.finish_reason is None:
            self.finish_reason = "length"
        return self._stop.final(self._decode())[len(self._emitted) :]

    def _decode(self) -> str:
        return str(self.tokenizer.decode(self.tokens, skip_special_tokens=True))
