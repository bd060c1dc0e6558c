"""The chunk registry: chunk id -> text, so the LLM side can find chunks in prompts.

Bounded by entry count and total characters; least recently registered or used
entries go first.  A text larger than the whole budget is not kept (the LLM
side then treats it as plain prompt text).  Thread-safe.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

from chunkcache.core.chunk_ids import validate_chunk_id

DEFAULT_MAX_CHUNKS = 100_000
# Fixed, not scaled with the model's window: ~64 M tokens of text is already far more than
# a KV store holds the KV of (a token's KV takes thousands of times its text's bytes), so
# a larger bound would only keep chunks with nothing left to reuse (see ChunkCache).
DEFAULT_MAX_CHARS = 256 * 1024 * 1024


class ChunkRegistry:
    """LRU map of chunk id to chunk text."""

    def __init__(
        self, max_chunks: int = DEFAULT_MAX_CHUNKS, max_chars: int = DEFAULT_MAX_CHARS
    ) -> None:
        if max_chunks < 1 or max_chars < 1:
            raise ValueError("registry bounds must be positive")
        self.max_chunks = max_chunks
        self.max_chars = max_chars
        self._texts: OrderedDict[str, str] = OrderedDict()
        self._num_chars = 0
        self._version = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._texts)

    def __contains__(self, chunk_id: object) -> bool:
        return chunk_id in self._texts

    @property
    def num_chars(self) -> int:
        return self._num_chars

    @property
    def version(self) -> int:
        """Bumped on every change, so matchers built over the registry know when to rebuild."""
        return self._version

    def register(self, chunk_id: str, text: str) -> bool:
        """Keep ``text`` under ``chunk_id``; False if it is too large to keep at all."""
        validate_chunk_id(chunk_id)
        if not isinstance(text, str):
            raise TypeError(f"chunk text must be str, got {type(text).__name__}")
        if len(text) > self.max_chars:
            with self._lock:
                # An older text under this id is stale now: do not keep serving it.
                previous = self._texts.pop(chunk_id, None)
                if previous is not None:
                    self._num_chars -= len(previous)
                    self._version += 1
            return False
        with self._lock:
            previous = self._texts.pop(chunk_id, None)
            if previous is not None:
                self._num_chars -= len(previous)
            self._texts[chunk_id] = text
            self._num_chars += len(text)
            if previous != text:
                self._version += 1
            while len(self._texts) > self.max_chunks or self._num_chars > self.max_chars:
                _, evicted = self._texts.popitem(last=False)
                self._num_chars -= len(evicted)
                self._version += 1
            return True

    def get(self, chunk_id: str) -> str | None:
        """The text of ``chunk_id``, or None if unknown or evicted."""
        with self._lock:
            text = self._texts.get(chunk_id)
            if text is not None:
                self._texts.move_to_end(chunk_id)
            return text

    def items(self) -> list[tuple[str, str]]:
        """A snapshot of (chunk id, text) pairs, oldest first."""
        with self._lock:
            return list(self._texts.items())
