"""Precompute chunk KV offline (RAG-DCache §III, step 1: offline cache preparation).

:func:`warm` runs each chunk through the engine once, after an optional prefix (the system
prompt the app will use: chunks computed after it are reused better than chunks computed at
position 0), and lets the store keep the chunk's variant; with the settings' default
write-through it lands in the disk tier.  It is resumable: a chunk with any stored variant
is skipped, so an interrupted run picks up where it stopped.

Chunk sources: the bundled corpus (:func:`chunkcache.core.corpus.load_corpus`), a folder of
``.txt`` / ``.md`` files split on blank lines into chunks of at most ``chunk_chars``, or a
vector store's contents (a persistent Chroma collection).  Chunk ids are the ones the
retriever wrappers give (``metadata["chunk_id"]``, else the content hash of the text).
"""

from __future__ import annotations

import errno
import os
import re
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from chunkcache.core.chunk_ids import chunk_id
from chunkcache.core.engine import ChunkEngine
from chunkcache.core.generation import Policy
from chunkcache.core.segmenter import ChunkSegment, Segment, TextSegment
from chunkcache.core.store.tiered import TieredKVStore
from chunkcache.core.tokenization import SegmentTokenizer

_PARAGRAPHS = re.compile(r"\n\s*\n")


@dataclass(frozen=True)
class WarmReport:
    """What one :func:`warm` run did."""

    computed: int
    skipped: int
    seconds: float


def folder_chunks(folder: str | Path, chunk_chars: int = 1000) -> Iterator[tuple[str, str]]:
    """``(chunk_id, text)`` for the ``.txt``/``.md`` files under ``folder``, in path order;
    paragraphs are packed into chunks of at most ``chunk_chars`` (a longer paragraph stays
    whole).  A ``folder`` that is not a directory raises ``FileNotFoundError`` or
    ``NotADirectoryError`` here, not when the chunks are read."""
    root = Path(folder)
    if not root.is_dir():
        code = errno.ENOTDIR if root.exists() else errno.ENOENT
        raise OSError(code, os.strerror(code), str(root))  # FileNotFoundError / NotADirectoryError
    return _folder_chunks(root, chunk_chars)


def _folder_chunks(root: Path, chunk_chars: int) -> Iterator[tuple[str, str]]:
    for path in sorted(root.rglob("*")):
        if path.suffix not in (".txt", ".md") or not path.is_file():
            continue
        chunk = ""
        for paragraph in _PARAGRAPHS.split(path.read_text(encoding="utf-8", errors="replace")):
            paragraph = paragraph.strip()
            if not paragraph:
                continue
            if chunk and len(chunk) + 2 + len(paragraph) > chunk_chars:
                yield chunk_id(chunk), chunk
                chunk = ""
            chunk = f"{chunk}\n\n{paragraph}" if chunk else paragraph
        if chunk:
            yield chunk_id(chunk), chunk


def chroma_chunks(path: str | Path, collection: str) -> Iterator[tuple[str, str]]:
    """``(chunk_id, text)`` of every document in a persistent Chroma collection, with the id
    the retriever wrappers give it (``metadata["chunk_id"]``, else the content hash).

    A ``path`` without a Chroma database raises ``FileNotFoundError`` (and is left as it is:
    Chroma would make an empty database there); a missing collection raises ``ValueError``.
    """
    if not (Path(path) / "chroma.sqlite3").is_file():
        raise FileNotFoundError(errno.ENOENT, "no Chroma database (chroma.sqlite3)", str(path))
    import chromadb
    from chromadb.errors import NotFoundError

    from chunkcache.core.chunk_ids import chunk_id_for

    client = chromadb.PersistentClient(path=str(path))
    try:
        stored = client.get_collection(collection)
    except NotFoundError:
        names = ", ".join(sorted(c.name for c in client.list_collections())) or "none"
        raise ValueError(f"no collection {collection!r} in {path} (it has: {names})") from None
    got = stored.get(include=["documents", "metadatas"])
    documents = got["documents"] or []
    metadatas: list[Mapping[str, Any] | None] = [None] * len(documents)
    if got["metadatas"]:
        metadatas = list(got["metadatas"])
    pairs = zip(documents, metadatas, strict=True)
    return iter([(chunk_id_for(text, metadata), text) for text, metadata in pairs if text])


def corpus_chunks(max_chunks: int | None = None) -> Iterator[tuple[str, str]]:
    """``(chunk_id, text)`` of the bundled corpus."""
    from chunkcache.core.corpus import load_corpus

    for chunk in load_corpus(max_chunks=max_chunks):
        yield chunk.chunk_id, chunk.text


def warm(
    engine: ChunkEngine,
    chunks: Sequence[tuple[str, str]],
    prefix: str = "",
    policy: Policy = "full",
    progress: bool = True,
) -> WarmReport:
    """Compute and store the KV of every chunk not stored yet.

    ``policy`` ``cachecraft`` also measures each chunk's Cache-Craft metadata (CCI and
    per-token context attention) for the ``cachecraft`` serving policy.
    """
    store = engine.store
    if not isinstance(store, TieredKVStore):
        raise TypeError("warm needs the engine to run on a TieredKVStore")
    if engine.lm.tokenizer is None:
        raise ValueError("warm needs a model loaded with its tokenizer")
    tokenize = SegmentTokenizer(engine.lm.tokenizer)
    fingerprint = engine.lm.fingerprint
    started = time.perf_counter()
    computed = skipped = 0
    bar = _progress(len(chunks), progress)
    for cid, text in chunks:
        if store.contains_segment(fingerprint, cid):
            skipped += 1
        else:
            segments: list[Segment] = [TextSegment(prefix)] if prefix else []
            segments.append(ChunkSegment(cid, text))
            engine.prefill(tokenize(segments), policy)
            computed += 1
        bar.update(1)
        bar.set_postfix(computed=computed, skipped=skipped)
    bar.close()
    store.flush()
    return WarmReport(computed, skipped, time.perf_counter() - started)


def _progress(total: int, enabled: bool) -> Any:
    from tqdm import tqdm

    return tqdm(total=total, unit="chunk", desc="warm", disable=not enabled)
