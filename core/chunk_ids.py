"""Stable content ids for chunks.

A chunk id is the first 128 bits of BLAKE2b over the Unicode-NFC form of the
chunk text, prefixed by a version tag and the namespace.  It depends on nothing
but the text and the namespace, so every process on every machine computes the
same id for the same chunk.  A caller's own id for a text does not replace that
hash, it scopes it (:func:`content_bound_id`); the engine keys KV by the id and
a hash of the tokens (:func:`chunk_key`).
"""

from __future__ import annotations

import hashlib
import re
import unicodedata
from collections.abc import Mapping, Sequence
from typing import Any

from chunkcache.core.errors import InvalidChunkError, InvalidTextError

CHUNK_ID_METADATA_KEY = "chunk_id"
_ID_TAG = b"chunkcache/chunk-id/v1\x00"
_MAX_ID_LENGTH = 128
# Used with fullmatch: a `^...$` match would let a trailing newline through.
_VALID_ID = re.compile(r"[A-Za-z0-9._:\-]+")
_SCOPE_HEX = 16  # hex digits of a label's hash in a content-bound id
_SCOPE = re.compile(f"[0-9a-f]{{{_SCOPE_HEX}}}-")  # a content-bound id's start


def normalize_text(text: str) -> str:
    """Return the NFC form of ``text``, the form every id and match is computed on."""
    if not isinstance(text, str):
        raise TypeError(f"chunk text must be str, got {type(text).__name__}")
    return unicodedata.normalize("NFC", text)


def check_unicode(text: str) -> str:
    """Return ``text`` if it is valid Unicode a tokenizer can read, else raise
    :class:`InvalidTextError` naming the lone surrogate (half of a split emoji) and where."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        bad = text[error.start : error.end].encode("unicode_escape").decode()
        raise InvalidTextError(
            f"the text is not valid Unicode: {bad} at character {error.start} "
            "(a lone surrogate, e.g. half of an emoji split apart)"
        ) from None
    return text


def chunk_id(text: str, namespace: str = "") -> str:
    """Return the stable 32-hex-char id of ``text`` within ``namespace``.

    >>> chunk_id("hello world")
    'aa2b272e0007adbdfa8bb32120defe03'
    >>> chunk_id("hello world") == chunk_id("hello world", namespace="tenant-a")
    False

    Raises :class:`InvalidChunkError` for empty or whitespace-only text.
    """
    if not isinstance(namespace, str):
        raise TypeError(f"namespace must be str, got {type(namespace).__name__}")
    normalized = normalize_text(text)
    if not normalized.strip():
        raise InvalidChunkError("chunk text is empty or whitespace only")
    namespace_bytes = namespace.encode("utf-8", "surrogatepass")
    digest = hashlib.blake2b(digest_size=16)
    digest.update(_ID_TAG)
    digest.update(len(namespace_bytes).to_bytes(8, "big"))
    digest.update(namespace_bytes)
    # Lone surrogates cannot be encoded strictly; surrogatepass gives them a defined id.
    digest.update(normalized.encode("utf-8", "surrogatepass"))
    return digest.hexdigest()


def content_bound_id(label: str, text: str, namespace: str = "") -> str:
    """``text``'s id when a caller names it ``label`` (e.g. ``metadata["chunk_id"]``).

    ``label`` itself when it already is the text's id (its content hash, or an id made
    here); else ``<16 hex of the label>-<content hash>``.  So two texts under one caller
    id (per-file chunk numbers, two versions of a document) never share an id, and an id
    this returns is returned unchanged when it comes back.

    >>> content_bound_id(chunk_id("hello"), "hello") == chunk_id("hello")
    True
    >>> bound = content_bound_id("doc-7", "hello")
    >>> bound.endswith(chunk_id("hello")) and content_bound_id(bound, "hello") == bound
    True
    >>> bound == content_bound_id("doc-7", "hello, edited")
    False
    """
    content = chunk_id(text, namespace)
    if label == content or _is_bound_to(label, content):
        return label
    scope = hashlib.blake2b(digest_size=_SCOPE_HEX // 2)
    scope.update(f"{len(namespace)}:{namespace}{label}".encode("utf-8", "surrogatepass"))
    return f"{scope.hexdigest()}-{content}"


def _is_bound_to(label: str, content: str) -> bool:
    """Whether ``label`` is an id :func:`content_bound_id` made for the text ``content``
    hashes to (a caller's own label merely ending in ``-<hash>`` is not)."""
    scoped = _SCOPE.match(label)
    return scoped is not None and label[scoped.end() :] == content


def chunk_key(chunk_id: str, token_ids: Sequence[int]) -> str:
    """A chunk's segment id in the engine and its KV store: the chunk id and a hash of its
    tokens.

    The tokens bind the KV to the text: a chunk id sent again with another text (an edited
    document, another tenant's text under the same id) is another key, so a miss, never
    the old text's KV.  :func:`chunk_id_of` gives the chunk id back.
    """
    digest = hashlib.blake2b(digest_size=8)
    digest.update(b"chunkcache/chunk-tokens/v1\x00")
    digest.update(",".join(map(str, token_ids)).encode())
    return f"{chunk_id}#{digest.hexdigest()}"


def chunk_id_of(segment_id: str) -> str:
    """The chunk id inside a :func:`chunk_key` (any other segment id is returned as is)."""
    return segment_id.partition("#")[0]


def validate_chunk_id(value: object) -> str:
    """Check a caller-supplied chunk id (an explicit ``(chunk id, text)`` pair's, a registry
    key) and return it."""
    if not isinstance(value, str):
        raise InvalidChunkError(f"chunk id must be str, got {type(value).__name__}")
    if not value or len(value) > _MAX_ID_LENGTH or not _VALID_ID.fullmatch(value):
        raise InvalidChunkError(
            f"chunk id {value[:40]!r} must be 1-{_MAX_ID_LENGTH} chars of [A-Za-z0-9._:-]"
        )
    return value


def chunk_id_for(text: str, metadata: Mapping[str, Any] | None, namespace: str = "") -> str:
    """Id for a document: the content hash of its text, scoped by a ``metadata["chunk_id"]``
    the caller set (:func:`content_bound_id`: kept when it is that hash already)."""
    label = metadata.get(CHUNK_ID_METADATA_KEY) if metadata else None
    if label is None:
        return chunk_id(text, namespace)
    return content_bound_id(str(label), text, namespace)
