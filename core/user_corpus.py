"""A user's own corpus and questions, as :class:`CorpusChunk` lists.

``chunkcache warm`` and ``chunkcache bench rag`` both read a user's corpus here, so what
one warms is what the other retrieves.  Three sources:

- a folder of ``.txt`` / ``.md`` files, read recursively (UTF-8, or UTF-16/32 with a
  byte-order mark) and chunked the way the bundled corpus is (paragraphs packed up to
  ``chunk_chars``, each chunk led by a title line: here the file's path relative to
  the folder);
- a persistent Chroma collection, one chunk per stored document, unchanged, so the
  chunks are exactly what a retriever over that collection returns;
- a questions file: JSON lines (``{"question": ..., "answer": ...}``, answer optional)
  when it ends in ``.jsonl`` / ``.ndjson``, otherwise plain text, one question a line.

>>> import pathlib, tempfile
>>> folder = pathlib.Path(tempfile.mkdtemp())
>>> _ = (folder / "notes.md").write_text("Velmora Tech was founded in 1923.", encoding="utf-8")
>>> [chunk.text for chunk in load_text_folder(folder)]
['notes.md\\nVelmora Tech was founded in 1923.']
"""

from __future__ import annotations

import codecs
import json
import os
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path, PurePath
from typing import Any

from chunkcache.core.chunk_ids import chunk_id, chunk_id_for
from chunkcache.core.corpus import (
    DEFAULT_CHUNK_CHARS,
    MIN_CHUNK_CHARS,
    CorpusChunk,
    split_section,
)
from chunkcache.core.errors import ChunkCacheError, InvalidChunkError
from chunkcache.core.paths import user_path

TEXT_SUFFIXES = frozenset({".txt", ".md"})
JSONL_SUFFIXES = frozenset({".jsonl", ".ndjson"})
_CHROMA_PAGE = 1000

__all__ = [
    "UserCorpusError",
    "UserQuestion",
    "chroma_database",
    "load_chroma_corpus",
    "load_questions",
    "load_text_folder",
]


class UserCorpusError(ChunkCacheError, ValueError):
    """A user's corpus or questions cannot be read: missing, empty or malformed."""


@dataclass(frozen=True)
class UserQuestion:
    """A question from the user's file; ``answer`` is its gold answer when given."""

    question: str
    answer: str | None = None
    kind: str = "user"


def load_text_folder(
    folder: str | os.PathLike[str], chunk_chars: int = DEFAULT_CHUNK_CHARS
) -> list[CorpusChunk]:
    """Chunks of every ``.txt``/``.md`` file under ``folder``, in sorted path order.

    Files are UTF-8, or UTF-16/32 with a byte-order mark; line ends become ``\\n``.
    Hidden files and folders are skipped; so are, each with a warning naming it, an
    empty file, a binary one (NUL bytes), a broken symlink and a folder already read
    (a symlink loop).  A file in another encoding, or a file or folder that cannot be
    read, raises :class:`UserCorpusError`.  A chunk's ``title`` and ``source`` are the
    file's relative path, its ``topic`` the first folder of that path (or the file's
    stem for a file at the top).
    """
    if chunk_chars < MIN_CHUNK_CHARS:
        raise ValueError(f"chunk_chars must be at least {MIN_CHUNK_CHARS}, got {chunk_chars}")
    root = _existing(folder, "corpus folder")
    if not root.is_dir():
        raise UserCorpusError(f"corpus folder {root} is not a directory")
    chunks: dict[str, CorpusChunk] = {}
    files = _text_files(root)
    for path in files:
        try:
            text = _read_text(path).strip()
        except _BinaryFileError as error:
            _skip(f"skipping {error}")
            continue
        if not text:
            _skip(f"skipping empty file {path}")
            continue
        # A name that is not UTF-8 (its bytes kept as lone surrogates) would make text
        # no tokenizer or index accepts.
        relative = PurePath(os.fsencode(path.relative_to(root)).decode("utf-8", "replace"))
        title = relative.as_posix()
        topic = relative.parts[0] if len(relative.parts) > 1 else relative.stem
        pieces = list(split_section(title, text, chunk_chars))
        if not pieces:
            raise UserCorpusError(f"the path of {path} is too long for {chunk_chars}-char chunks")
        for _, piece in pieces:
            chunk = CorpusChunk(chunk_id(piece), piece, topic, title, title)
            chunks.setdefault(chunk.chunk_id, chunk)
    if not chunks:
        found = (
            f"only empty or binary files among its {len(files)} .txt/.md files"
            if files
            else "no .txt or .md files"
        )
        raise UserCorpusError(f"corpus folder {root} has {found}")
    return list(chunks.values())


def load_chroma_corpus(
    persist_dir: str | os.PathLike[str], collection_name: str, embedding_function: Any = None
) -> list[CorpusChunk]:
    """The documents of a persistent Chroma collection, one chunk each, sorted by Chroma id.

    A chunk's id is the content hash, scoped by ``metadata["chunk_id"]`` if set (as
    ``ChunkCacheRetriever`` assigns them); ``source`` is the Chroma id, ``title`` and
    ``topic`` the metadata's ``title`` / ``topic`` (or ``source``) when present.
    Entries without text are skipped with a warning; entries with the same text (and
    ``chunk_id``) are one chunk, the first by Chroma id.  Nothing is embedded: pass the
    collection's ``embedding_function`` only if Chroma insists on it.  A directory
    without ``chroma.sqlite3`` is refused before Chroma opens it (it would make an
    empty database there).
    """
    root = chroma_database(persist_dir)
    import chromadb
    from chromadb.config import Settings
    from chromadb.errors import InternalError, NotFoundError

    try:
        settings = Settings(anonymized_telemetry=False)
        client = chromadb.PersistentClient(path=root, settings=settings)
    except InternalError as error:  # e.g. "file is not a database": damaged, or not Chroma's
        raise UserCorpusError(f"cannot open the Chroma database in {root}: {error}") from error
    try:
        collection = client.get_collection(collection_name, embedding_function=embedding_function)
    except NotFoundError as error:
        names = sorted(c.name for c in client.list_collections())
        raise UserCorpusError(
            f"no collection {collection_name!r} in {root} (it has: {', '.join(names) or 'none'})"
        ) from error
    chunks: list[CorpusChunk] = []
    skipped: list[str] = []
    for chroma_id, text, metadata in _chroma_entries(collection):
        try:
            if text is None or not text.strip():
                raise InvalidChunkError("no text")
            cid = chunk_id_for(text, metadata)
        except InvalidChunkError:
            skipped.append(chroma_id)
            continue
        title = _string(metadata, "title") or chroma_id
        topic = _string(metadata, "topic") or _string(metadata, "source") or collection_name
        chunks.append(CorpusChunk(cid, text, topic, title, chroma_id))
    if skipped:
        warnings.warn(
            f"skipping {len(skipped)} entries of {collection_name!r} without usable text or id, "
            f"e.g. {skipped[0]!r}",
            UserWarning,
            stacklevel=2,
        )
    if not chunks:
        raise UserCorpusError(f"collection {collection_name!r} in {root} has no documents")
    unique: dict[str, CorpusChunk] = {}
    for chunk in sorted(chunks, key=lambda chunk: chunk.source):
        unique.setdefault(chunk.chunk_id, chunk)  # the same text twice is one chunk
    return list(unique.values())


def chroma_database(persist_dir: str | os.PathLike[str]) -> Path:
    """``persist_dir`` if it holds a Chroma database (``chroma.sqlite3``), else
    :class:`UserCorpusError`; a cheap check, made before anything slow loads."""
    root = _existing(persist_dir, "Chroma directory")
    if not (root / "chroma.sqlite3").is_file():
        raise UserCorpusError(f"Chroma directory {root} has no database (chroma.sqlite3)")
    return root


def load_questions(path: str | os.PathLike[str]) -> list[UserQuestion]:
    """Questions from a JSON-lines (``.jsonl``/``.ndjson``) or plain-text file.

    JSON lines are objects with a non-empty string ``question`` and an optional
    ``answer`` (string or number, or null); blank lines are skipped in both formats.
    """
    file = _existing(path, "questions file")
    jsonl = file.suffix.lower() in JSONL_SUFFIXES
    questions: list[UserQuestion] = []
    for number, line in enumerate(_read_text(file).splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{file}:{number}"
        questions.append(_json_question(line, where) if jsonl else UserQuestion(line.strip()))
    if not questions:
        raise UserCorpusError(f"questions file {file} has no questions")
    return questions


def _json_question(line: str, where: str) -> UserQuestion:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as error:
        raise UserCorpusError(f"{where}: not JSON ({error.msg})") from error
    question = record.get("question") if isinstance(record, dict) else None
    if not isinstance(question, str) or not question.strip():
        raise UserCorpusError(f'{where}: need an object with a non-empty string "question"')
    answer = record.get("answer")
    if isinstance(answer, bool) or not isinstance(answer, str | int | float | None):
        raise UserCorpusError(f'{where}: "answer" must be a string or a number')
    return UserQuestion(question.strip(), None if answer is None else str(answer))


def _existing(path: str | os.PathLike[str], what: str) -> Path:
    resolved = user_path(path)
    if not resolved.exists():
        raise UserCorpusError(f"{what} {resolved} does not exist")
    return resolved


def _text_files(root: Path) -> list[Path]:
    """The visible ``.txt``/``.md`` files under ``root``, sorted; symlinks followed."""
    found: list[Path] = []
    seen: set[str] = set()
    for dirpath, dirnames, filenames in os.walk(root, onerror=_unreadable, followlinks=True):
        real = os.path.realpath(dirpath)
        if real in seen:
            _skip(f"skipping folder {dirpath}: it is {real}, read already (a symlink loop?)")
            dirnames[:] = []
            continue
        seen.add(real)
        dirnames[:] = sorted(name for name in dirnames if not name.startswith("."))
        for name in filenames:
            path = Path(dirpath, name)
            if name.startswith(".") or path.suffix.lower() not in TEXT_SUFFIXES:
                continue
            if path.is_file():
                found.append(path)
            elif path.is_symlink() and not path.exists():
                _skip(f"skipping broken symlink {path}")
    return sorted(found)


def _unreadable(error: OSError) -> None:
    raise UserCorpusError(f"cannot read folder {error.filename}: {error.strerror}") from error


def _skip(message: str) -> None:
    warnings.warn(message, UserWarning, stacklevel=3)


class _BinaryFileError(UserCorpusError):
    """A file holds NUL bytes: it is no text (or UTF-16 without a byte-order mark)."""


# (byte-order mark, codec, name); UTF-32's marks first: UTF-32-LE's starts with UTF-16-LE's.
_BOMS = (
    (codecs.BOM_UTF32_LE, "utf-32", "UTF-32"),
    (codecs.BOM_UTF32_BE, "utf-32", "UTF-32"),
    (codecs.BOM_UTF8, "utf-8-sig", "UTF-8"),
    (codecs.BOM_UTF16_LE, "utf-16", "UTF-16"),
    (codecs.BOM_UTF16_BE, "utf-16", "UTF-16"),
)


def _read_text(path: Path) -> str:
    """The text of ``path``: UTF-8, or what its byte-order mark says; ``\\r\\n`` and ``\\r``
    made ``\\n`` (as Python's text mode does), so a file means the same on every system."""
    try:
        data = path.read_bytes()
    except OSError as error:
        raise UserCorpusError(f"cannot read {path}: {error.strerror}") from error
    codec, name = next(((c, n) for bom, c, n in _BOMS if data.startswith(bom)), ("utf-8", "UTF-8"))
    if name == "UTF-8" and b"\x00" in data:
        raise _BinaryFileError(
            f"{path}: binary, it holds NUL bytes (UTF-16 text needs a byte-order mark)"
        )
    try:
        text = data.decode(codec)
    except UnicodeDecodeError as error:
        fix = "convert it to UTF-8 first, e.g. iconv -f latin1 -t utf-8"
        if name != "UTF-8":
            fix = f"its byte-order mark says {name}, but it is damaged"
        raise UserCorpusError(
            f"{path} is not {name} (byte {error.start}: {error.reason}); {fix}"
        ) from error
    return text.replace("\r\n", "\n").replace("\r", "\n")


def _chroma_entries(collection: Any) -> Iterator[tuple[str, str | None, dict[str, Any]]]:
    """(id, document, metadata) of every entry, a page at a time."""
    for offset in range(0, collection.count(), _CHROMA_PAGE):
        page = collection.get(limit=_CHROMA_PAGE, offset=offset, include=["documents", "metadatas"])
        documents = page["documents"] or [None] * len(page["ids"])
        metadatas = page["metadatas"] or [None] * len(page["ids"])
        for entry in zip(page["ids"], documents, metadatas, strict=True):
            yield entry[0], entry[1], dict(entry[2] or {})


def _string(metadata: dict[str, Any], key: str) -> str | None:
    value = metadata.get(key)
    return value if isinstance(value, str) and value.strip() else None
