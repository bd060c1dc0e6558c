"""Tokenize a segmented prompt one segment at a time (chunk tokens cached by chunk id).

Each segment is tokenized on its own, so a chunk has the same tokens wherever it
sits in a prompt and its cached KV can be moved (CacheBlend §3).  A token that
would have merged across a segment boundary is split there; every policy,
``full`` included, sees the same tokens, so quality comparisons isolate KV reuse.

A chunk's segment id is its chunk id plus a hash of its tokens
(:func:`~chunkcache.core.chunk_ids.chunk_key`), and its tokens are cached by chunk id
and text, so an id sent with another text than before is a miss, never the old
text's tokens or KV.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any

from chunkcache.core.chunk_ids import check_unicode, chunk_key
from chunkcache.core.engine import TokenSegment
from chunkcache.core.kv_store import segment_key
from chunkcache.core.segmenter import ChunkSegment, Segment


def render_chat(tokenizer: Any, messages: Sequence[Mapping[str, str]]) -> str:
    """The tokenizer's chat template applied to ``messages``, ready for the assistant."""
    rendered = tokenizer.apply_chat_template(
        [dict(m) for m in messages], tokenize=False, add_generation_prompt=True
    )
    return str(rendered)


class SegmentTokenizer:
    """Turns text/chunk segments into :class:`TokenSegment`; LRU cache of chunk tokens."""

    def __init__(self, tokenizer: Any, max_cached_chunks: int = 50_000) -> None:
        self.tokenizer = tokenizer
        self.max_cached_chunks = max_cached_chunks
        self._chunks: OrderedDict[tuple[str, str], tuple[int, ...]] = OrderedDict()
        self._lock = threading.Lock()

    def encode(self, text: str) -> tuple[int, ...]:
        """Token ids of ``text`` with no special tokens added."""
        check_unicode(text)
        return tuple(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def __call__(self, segments: Sequence[Segment]) -> list[TokenSegment]:
        token_segments = []
        for segment in segments:
            if isinstance(segment, ChunkSegment):
                ids = self._chunk_ids(segment.chunk_id, segment.text)
                key = chunk_key(segment.chunk_id, ids)
                token_segments.append(TokenSegment(key, ids, is_chunk=True))
            elif segment.text:
                ids = self.encode(segment.text)
                token_segments.append(TokenSegment(segment_key(ids), ids, is_chunk=False))
        return [segment for segment in token_segments if segment.ids]

    def _chunk_ids(self, chunk_id: str, text: str) -> tuple[int, ...]:
        key = (chunk_id, text)
        with self._lock:
            ids = self._chunks.get(key)
            if ids is not None:
                self._chunks.move_to_end(key)
                return ids
        ids = self.encode(text)
        with self._lock:
            self._chunks[key] = ids
            while len(self._chunks) > self.max_cached_chunks:
                self._chunks.popitem(last=False)
        return ids
