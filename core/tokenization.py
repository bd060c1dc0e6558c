"""Tokenize a segmented prompt one segment at a time (chunk tokens cached by chunk id).

Each segment is tokenized on its own, so a chunk has the same tokens wherever it
sits in a prompt and its cached KV can be moved (CacheBlend §3).  A token that
would have merged across a segment boundary is split there; every policy,
``full`` included, sees the same tokens, so quality comparisons isolate KV reuse.

A chunk's segment id is its chunk id plus a hash of its tokens
(:func:`~chunkcache.core.chunk_ids.chunk_key`), and its tokens are cached by its text
(a 16-byte BLAKE2b digest of it), so an id sent with another text than before is a
miss, never the old text's tokens or KV.  The cache is bounded by tokens as well as by
chunks, so a long-running service with long chunks keeps tens of megabytes, not gigabytes.

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

import hashlib
import json
import threading
from array import array
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


# A cached entry costs 4 B per token (array('I')) plus ~200 B (its key, the array and the
# dict slot), so the defaults keep at most ~16 MB of ids + ~10 MB of entries: ~16,000
# chunks of 1,000 characters (~250 tokens).  A miss costs one tokenizer call, far less than
# the prefill it goes with.
DEFAULT_MAX_CACHED_TOKENS = 4_000_000
DEFAULT_MAX_CACHED_CHUNKS = 50_000


class SegmentTokenizer:
    """Turns text/chunk segments into :class:`TokenSegment`; LRU cache of chunk tokens,
    bounded by ``max_cached_tokens`` in all and ``max_cached_chunks`` entries."""

    def __init__(
        self,
        tokenizer: Any,
        max_cached_chunks: int = DEFAULT_MAX_CACHED_CHUNKS,
        max_cached_tokens: int = DEFAULT_MAX_CACHED_TOKENS,
    ) -> None:
        if max_cached_chunks < 0 or max_cached_tokens < 0:
            raise ValueError("token cache bounds must not be negative")
        self.tokenizer = tokenizer
        self.max_cached_chunks = max_cached_chunks
        self.max_cached_tokens = max_cached_tokens
        self._unprefixed = _unprefixed_backend(tokenizer)
        self._chunk_backend = _unprefixed_backend(tokenizer, special_as_text=True)
        # digest of the chunk's UTF-8 text -> its ids: the text itself is not kept
        self._chunks: OrderedDict[bytes, array[int]] = OrderedDict()
        self._num_cached_tokens = 0
        self._lock = threading.Lock()

    @property
    def num_cached_chunks(self) -> int:
        """Chunks whose tokens are cached."""
        return len(self._chunks)

    @property
    def num_cached_tokens(self) -> int:
        """Tokens cached in all (at most ``max_cached_tokens``)."""
        return self._num_cached_tokens

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
                ids = self._chunk_ids(segment.text)
                token = TokenSegment(chunk_key(segment.chunk_id, ids), ids, is_chunk=True)
            elif segment.text:
                ids = self.encode(segment.text, at_start=not token_segments)
                token = TokenSegment(segment_key(ids), ids, is_chunk=False)
            else:
                continue
            if ids:
                token_segments.append(token)
        return token_segments

    def _chunk_ids(self, text: str) -> tuple[int, ...]:
        """A chunk's token ids, from the cache when its text is there.  The ids depend on
        the text alone, so one text under two chunk ids is one entry."""
        # 128 bits: a collision (another text's ids) is out of reach by chance.
        key = hashlib.blake2b(check_unicode(text).encode("utf-8"), digest_size=16).digest()
        with self._lock:
            cached = self._chunks.get(key)
            if cached is not None:
                self._chunks.move_to_end(key)
                return tuple(cached)
        ids = self._encode_chunk(text)
        self._remember(key, ids)
        return ids

    def _remember(self, key: bytes, ids: tuple[int, ...]) -> None:
        """Cache ``ids``, least recently used out first; a chunk over the whole budget is not
        cached (it would evict everything else and then itself)."""
        if len(ids) > self.max_cached_tokens:
            return
        stored = array("I", ids)  # 4 B a token, where a tuple of ints takes ~36 B
        with self._lock:
            replaced = self._chunks.pop(key, None)  # two threads may both have missed it
            if replaced is not None:
                self._num_cached_tokens -= len(replaced)
            self._chunks[key] = stored
            self._num_cached_tokens += len(stored)
            while (
                len(self._chunks) > self.max_cached_chunks
                or self._num_cached_tokens > self.max_cached_tokens
            ):
                _, evicted = self._chunks.popitem(last=False)
                self._num_cached_tokens -= len(evicted)

    def _encode_chunk(self, text: str) -> tuple[int, ...]:
        """A chunk's token ids: as :meth:`encode` inside a prompt, special-token text as text."""
        if self._chunk_backend is None:  # no tokenizers backend: transformers' own switch
            encoded = self.tokenizer(text, add_special_tokens=False, split_special_tokens=True)
            return tuple(encoded["input_ids"])
        return tuple(self._chunk_backend.encode(text, add_special_tokens=False).ids)
