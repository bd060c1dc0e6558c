"""Generated tokens to streamed text: incremental detokenizing, EOS and stop strings.

Shared by every in-process backend, so they all emit the same text pieces and finish for the
same reasons.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from chunkcache.core.sampling import PARTIAL_CHAR, StopChecker

_MAX_PARTIAL_BYTES = 3  # of a UTF-8 character not finished yet


class TextStream:
    """The text of one request's sampled tokens, released piece by piece as it becomes safe.

    :meth:`push` each sampled token; it returns the new text to emit (held back while the text
    ends in a partial UTF-8 character or might start a stop string). ``finish_reason`` becomes
    ``"stop"`` on an EOS token or a stop string; :meth:`finish` returns the rest of the text
    and sets ``"length"`` when neither happened.  A character whose bytes were still arriving
    when generation ended is left out, as vLLM's detokenizer leaves it (its tokens still
    count in :attr:`tokens`): the answer never ends in a U+FFFD.
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
        """The text not emitted yet, cut at the first stop string and without an unfinished
        last character; ends the stream."""
        if self.finish_reason is None:
            self.finish_reason = "length"
        return self._stop.final(self._whole_characters())[len(self._emitted) :]

    def _whole_characters(self) -> str:
        """The text without the U+FFFD of a last character the limit or the EOS cut off."""
        text = self._decode()
        if not text.endswith(PARTIAL_CHAR):
            return text
        # Byte-level BPE shows the cut character's bytes as one U+FFFD; byte fallback shows
        # the whole run of byte tokens it ends as U+FFFDs, which leaving out the (at most 3)
        # tokens of the cut character brings back.
        for drop in range(1, min(_MAX_PARTIAL_BYTES, len(self.tokens)) + 1):
            shorter = self._decode(self.tokens[:-drop])
            if not shorter.endswith(PARTIAL_CHAR):
                return max(shorter, text.rstrip(PARTIAL_CHAR), key=len)
        return text.rstrip(PARTIAL_CHAR)

    def _decode(self, tokens: list[int] | None = None) -> str:
        ids = self.tokens if tokens is None else tokens
        return str(self.tokenizer.decode(ids, skip_special_tokens=True))
