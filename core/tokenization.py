"""Tokenize a segmented prompt one segment at a time (chunk tokens cached by chunk id).

Each segment is tokenized on its own, so a chunk has the same tokens wherever it
sits in a prompt and its cached KV can be moved (CacheBlend §3).  A token that
would have merged across a segment boundary is split there; every policy,
``full`` included, sees the same tokens, so quality comparisons isolate KV reuse.

A chunk's segment id is its chunk id plus a hash of its tokens
(:func:`~chunkcache.core.chunk_ids.chunk_key`), and its tokens are cached by chunk id
and text, so an id sent with another text than before is a miss, never the old
text's tokens or KV.

A segment is tokenized as it sits inside the prompt.  SentencePiece-style tokenizers
(Llama-2, Mistral: a ``Metaspace`` pre-tokenizer that prepends ``▁``, or a ``Prepend``
normalizer) and byte-level ones with ``add_prefix_space`` put a space before every text
they are given, which the whole prompt has only at its start: ``"Context:\n" + "The"``
is ``… <0x0A> The`` as one text but ``… <0x0A> ▁The`` in two calls.  So the first
segment of a prompt, when it is text, is tokenized as given, and every other segment
(every chunk, wherever it sits, so its tokens stay position independent) without that
prefix.  Whether a tokenizer prepends is read once from its ``tokenizers`` backend; a
tokenizer without one (a custom or slow tokenizer) is used as it is.

A chunk is retrieved data, never markup: text in it that spells a special token
(``<|im_start|>``, ``<|endoftext|>``) is tokenized as the characters it is, not as the
control token, so a retrieved document cannot open a turn of its own in the chat
template.  The app's own text around the chunks (the template) keeps its special tokens.
"""

from __future__ import annotations

import json
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


def _without_prefix(node: Any) -> Any:
    """A normalizer or pre-tokenizer config minus what it prepends to every text (None: drop it)."""
    if not isinstance(node, dict):
        return node
    kind = node.get("type")
    if kind == "Sequence":
        key = "normalizers" if "normalizers" in node else "pretokenizers"
        return {**node, key: [n for n in map(_without_prefix, node[key]) if n is not None]}
    if kind == "Prepend":
        return None
    if kind == "Metaspace":
        return {**node, "prepend_scheme": "never"}
    if kind == "ByteLevel":
        return {**node, "add_prefix_space": False}
    return node


def _unprefixed_backend(tokenizer: Any, *, special_as_text: bool = False) -> Any | None:
    """A copy of ``tokenizer``'s ``tokenizers`` backend that prepends nothing to a text, or
    None when there is no such backend, or it prepends nothing already and
    ``special_as_text`` asks for nothing else.  With ``special_as_text`` it tokenizes
    special-token text as plain text: a copy of its own, as transformers sets that flag on
    the shared backend at every call (two threads asking differently would race)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    from tokenizers import Tokenizer

    config = json.loads(backend.to_str())
    bare = {
        **config,
        "normalizer": _without_prefix(config.get("normalizer")),
        "pre_tokenizer": _without_prefix(config.get("pre_tokenizer")),
    }
    if bare == config and not special_as_text:
        return None
    unprefixed = Tokenizer.from_str(json.dumps({**bare, "truncation": None, "padding": None}))
    # Not in the json: the tokenizer's own setting, unless special tokens are text here.
    unprefixed.encode_special_tokens = special_as_text or backend.encode_special_tokens
    return unprefixed


class SegmentTokenizer:
    """Turns text/chunk segments into :class:`TokenSegment`; LRU cache of chunk tokens."""

    def __init__(self, tokenizer: Any, max_cached_chunks: int = 50_000) -> None:
        self.tokenizer = tokenizer
        self.max_cached_chunks = max_cached_chunks
        self._unprefixed = _unprefixed_backend(tokenizer)
        self._chunk_backend = _unprefixed_backend(tokenizer, special_as_text=True)
        self._chunks: OrderedDict[tuple[str, str], tuple[int, ...]] = OrderedDict()
        self._lock = threading.Lock()

    def encode(self, text: str, at_start: bool = False) -> tuple[int, ...]:
        """Token ids of ``text`` inside a prompt, or at its start if ``at_start`` (where a
        SentencePiece-style tokenizer's leading ``▁`` belongs); no special tokens added."""
        check_unicode(text)
        if at_start or self._unprefixed is None:
            return tuple(self.tokenizer(text, add_special_tokens=False)["input_ids"])
        return tuple(self._unprefixed.encode(text, add_special_tokens=False).ids)

    def __call__(self, segments: Sequence[Segment]) -> list[TokenSegment]:
        token_segments: list[TokenSegment] = []
        for segment in segments:
            if isinstance(segment, ChunkSegment):
                ids = self._chunk_ids(segment.chunk_id, segment.text)
                token = TokenSegment(chunk_key(segment.chunk_id, ids), ids, is_chunk=True)
            elif segment.text:
                ids = self.encode(segment.text, at_start=not token_segments)
                token = TokenSegment(segment_key(ids), ids, is_chunk=False)
            else:
                continue
            if ids:
                token_segments.append(token)
        return token_segments

    def _chunk_ids(self, chunk_id: str, text: str) -> tuple[int, ...]:
        key = (chunk_id, text)
        with self._lock:
            ids = self._chunks.get(key)
            if ids is not None:
                self._chunks.move_to_end(key)
                return ids
        ids = self._encode_chunk(text)
        with self._lock:
            self._chunks[key] = ids
            while len(self._chunks) > self.max_cached_chunks:
                self._chunks.popitem(last=False)
        return ids

    def _encode_chunk(self, text: str) -> tuple[int, ...]:
        """A chunk's token ids: as :meth:`encode` inside a prompt, special-token text as text."""
        check_unicode(text)
        if self._chunk_backend is None:  # no tokenizers backend: transformers' own switch
            encoded = self.tokenizer(text, add_special_tokens=False, split_special_tokens=True)
            return tuple(encoded["input_ids"])
        return tuple(self._chunk_backend.encode(text, add_special_tokens=False).ids)
