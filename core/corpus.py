"""A bundled corpus: the docstrings of the running Python's standard library.

Real, varied technical text that needs no download and carries the PSF licence
of the interpreter itself.  Docstrings are read with :mod:`ast` from the stdlib
source files (nothing is imported: ``antigravity`` opens a browser), packed into
self-contained chunks that start with a title line such as ``json.dumps``, and
cached as JSON lines under ``home_subdir("corpus")``.

>>> chunks = load_corpus()
>>> chunks[0].text.splitlines()[0] == chunks[0].title
True
"""

from __future__ import annotations

import ast
import hashlib
import json
import logging
import os
import re
import sys
import sysconfig
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from itertools import zip_longest
from pathlib import Path

from chunkcache.core.atomic_files import write_files
from chunkcache.core.chunk_ids import chunk_id
from chunkcache.core.paths import home_subdir

logger = logging.getLogger(__name__)

# 2: a line longer than a chunk is cut at any whitespace, not only spaces, from its first word.
FORMAT_VERSION = 2
# The stdlib sources hold ~1,430 chunks of 1000 chars.  MiniLM embeds one in ~0.1
# CPU-second, so 1000 chunks take under a minute on 2 cores; taken topic by topic
# they keep all ~157 topics and at most ~19 chunks of the biggest (distutils, asyncio).
DEFAULT_MAX_CHUNKS = 1000
DEFAULT_CHUNK_CHARS = 1000
MIN_CHUNK_CHARS = 200
MIN_DOC_CHARS = 80
# Not prose worth retrieving (tests, GUI, generated codecs) or not importable by name.
SKIPPED_NAMES = frozenset(
    {
        "antigravity",
        "encodings",
        "ensurepip",
        "idle_test",
        "idlelib",
        "lib2to3",
        "pydoc_data",
        "test",
        "tests",
        "this",
        "tkinter",
        "turtle",
        "turtledemo",
    }
)
_SENTENCE_END = re.compile(r"(?<=[.!?:])\s+")
_PARAGRAPH_BREAK = re.compile(r"\n\s*\n")
_LAST_SPACE = re.compile(r".*\s", re.DOTALL)  # up to the last whitespace
_NON_SPACE = re.compile(r"\S")
_DefNode = ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef


@dataclass(frozen=True)
class CorpusChunk:
    """One chunk of the corpus; ``text`` starts with the ``title`` line."""

    chunk_id: str
    text: str
    topic: str
    title: str
    source: str


def load_corpus(
    chunk_chars: int = DEFAULT_CHUNK_CHARS, max_chunks: int | None = DEFAULT_MAX_CHUNKS
) -> list[CorpusChunk]:
    """The stdlib docstring corpus in chunks of at most ``chunk_chars`` characters.

    ``max_chunks`` caps the size by taking chunks from every topic in turn, so
    small modules are all kept and big packages are trimmed; ``None`` keeps all.
    """
    if chunk_chars < MIN_CHUNK_CHARS:
        raise ValueError(f"chunk_chars must be at least {MIN_CHUNK_CHARS}, got {chunk_chars}")
    if max_chunks is not None and max_chunks < 1:
        raise ValueError(f"max_chunks must be positive or None, got {max_chunks}")
    path = corpus_cache_path(chunk_chars)
    chunks = _read_cache(path)
    if chunks is None:
        chunks = extract_corpus(chunk_chars)
        _write_cache(path, chunks)
    return chunks if max_chunks is None else _balanced_subset(chunks, max_chunks)


def topics(chunks: Sequence[CorpusChunk]) -> dict[str, list[CorpusChunk]]:
    """Chunks grouped by topic (top-level module), topics and chunks in corpus order."""
    grouped: dict[str, list[CorpusChunk]] = {}
    for chunk in chunks:
        grouped.setdefault(chunk.topic, []).append(chunk)
    return grouped


def corpus_cache_path(chunk_chars: int = DEFAULT_CHUNK_CHARS) -> Path:
    """Where the extracted corpus for this Python and ``chunk_chars`` is cached."""
    version = ".".join(map(str, sys.version_info[:3]))
    name = f"stdlib-py{version}-v{FORMAT_VERSION}-c{chunk_chars}.jsonl"
    return home_subdir("corpus") / name


def extract_corpus(chunk_chars: int = DEFAULT_CHUNK_CHARS) -> list[CorpusChunk]:
    """Extract every chunk from the stdlib sources, in sorted path order (no cache)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks: dict[str, CorpusChunk] = {}
    for path, module in _stdlib_modules(root):
        source = path.relative_to(root).as_posix()
        topic = module.split(".")[0]
        for title, text in _module_chunks(path, module, chunk_chars):
            if len(text) < MIN_DOC_CHARS:
                continue  # the lone tail of a split docstring
            chunk = CorpusChunk(chunk_id(text), text, topic, title, source)
            chunks.setdefault(chunk.chunk_id, chunk)  # the same def twice under an `if`
    if not chunks:
        raise RuntimeError(f"no stdlib sources with docstrings found under {root}")
    return list(chunks.values())


def _stdlib_modules(root: Path) -> Iterator[tuple[Path, str]]:
    """(file, dotted module name) of every public stdlib module, sorted by path."""
    for dirpath, dirnames, filenames in os.walk(root):
        prefix = Path(dirpath).relative_to(root).parts
        if prefix and "__init__.py" not in filenames:
            dirnames[:] = []  # not a package: data files, not modules
            continue
        dirnames[:] = sorted(name for name in dirnames if _is_public(name))
        for filename in sorted(filenames):
            stem = filename.removesuffix(".py")
            if filename.endswith(".py") and (stem == "__init__" or _is_public(stem)):
                parts = prefix if stem == "__init__" else (*prefix, stem)
                if parts:
                    yield Path(dirpath, filename), ".".join(parts)


def _is_public(name: str) -> bool:
    return name.isidentifier() and not name.startswith("_") and name not in SKIPPED_NAMES


def _module_chunks(path: Path, module: str, chunk_chars: int) -> Iterator[tuple[str, str]]:
    """(title, text) chunks of one module: its docstring sections packed in order."""
    sections = [
        piece
        for title, doc in _docstrings(path, module)
        for piece in split_section(title, doc, chunk_chars)
    ]
    packed: list[str] = []
    first_title = ""
    for title, section in sections:
        if packed and len("\n\n".join([*packed, section])) > chunk_chars:
            yield first_title, "\n\n".join(packed)
            packed = []
        if not packed:
            first_title = title
        packed.append(section)
    if packed:
        yield first_title, "\n\n".join(packed)


def _docstrings(path: Path, module: str) -> Iterator[tuple[str, str]]:
    """(qualified name, docstring) of the module and its public classes and functions."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # invalid escapes in old sources
            tree = ast.parse(path.read_bytes(), filename=str(path))
    except (OSError, SyntaxError, ValueError) as error:
        logger.debug("skipping %s: %s", path, error)
        return
    for name, node in [(module, tree), *_definitions(tree.body, module)]:
        doc = ast.get_docstring(node, clean=True)
        if doc and len(doc.strip()) >= MIN_DOC_CHARS:
            yield name, doc.strip()


def _definitions(body: list[ast.stmt], prefix: str) -> Iterator[tuple[str, _DefNode]]:
    """Public classes, functions and methods, also those defined under ``if``/``try``."""
    for node in body:
        if isinstance(node, _DefNode):
            if not node.name.startswith("_"):
                name = f"{prefix}.{node.name}"
                yield name, node
                if isinstance(node, ast.ClassDef):
                    yield from _definitions(node.body, name)
            continue
        for field in ("body", "orelse", "finalbody"):
            yield from _definitions(getattr(node, field, []), prefix)
        for clause in [*getattr(node, "handlers", []), *getattr(node, "cases", [])]:
            yield from _definitions(clause.body, prefix)


def split_section(title: str, doc: str, chunk_chars: int) -> Iterator[tuple[str, str]]:
    """``title`` + ``doc`` as sections of at most ``chunk_chars``, each led by the title."""
    budget = chunk_chars - len(title) - 1
    if budget < MIN_DOC_CHARS:
        return  # a title this long leaves no room for text
    for piece in _pack(_PARAGRAPH_BREAK.split(doc), budget, "\n\n", _SENTENCE_END):
        yield title, f"{title}\n{piece}"


def _pack(
    parts: list[str], budget: int, joiner: str, finer: re.Pattern[str] | None
) -> Iterator[str]:
    """Greedily join ``parts`` into pieces of at most ``budget`` characters.

    A part longer than the budget is split by ``finer`` (sentences), then on
    whitespace; a word longer than the budget is cut.
    """
    piece = ""
    for part in (p.lstrip("\n").rstrip() for p in parts):
        if not part:
            continue
        if len(part) > budget:
            if piece:
                yield piece
                piece = ""
            if finer is not None:
                yield from _pack(finer.split(part), budget, " ", None)
            else:
                yield from _split_words(part, budget)
            continue
        candidate = f"{piece}{joiner}{part}" if piece else part
        if len(candidate) > budget:
            yield piece
            candidate = part
        piece = candidate
    if piece:
        yield piece


def _split_words(text: str, budget: int) -> Iterator[str]:
    """``text`` in pieces of at most ``budget`` characters, broken at whitespace if possible.

    Walks ``text`` by position, copying one window at a time (slicing off the rest at
    every piece made a 20 MB line take quadratic time)."""
    start = _next_word(text, 0)
    while len(text) - start > budget:
        window = text[start : start + budget + 1]
        space = _LAST_SPACE.match(window)  # window[0] is no space: a cut is never empty
        cut = budget if space is None else space.end() - 1
        yield window[:cut].rstrip()
        start = _next_word(text, start + cut)
    if start < len(text):
        yield text[start:].rstrip()


def _next_word(text: str, position: int) -> int:
    """The position of the first non-space character of ``text`` from ``position`` on."""
    found = _NON_SPACE.search(text, position)
    return len(text) if found is None else found.start()


def _balanced_subset(chunks: list[CorpusChunk], max_chunks: int) -> list[CorpusChunk]:
    """At most ``max_chunks`` chunks, taken from every topic in turn, in corpus order."""
    chosen: set[str] = set()
    for row in zip_longest(*topics(chunks).values()):
        for chunk in row:
            if chunk is not None and len(chosen) < max_chunks:
                chosen.add(chunk.chunk_id)
    return [chunk for chunk in chunks if chunk.chunk_id in chosen]


def _read_cache(path: Path) -> list[CorpusChunk] | None:
    """The cached chunks, or ``None`` if the file is missing, truncated or corrupt."""
    try:
        header, _, body = path.read_bytes().partition(b"\n")
        meta = json.loads(header)
        if meta != _cache_header(body):
            raise ValueError(f"header {meta} does not match the body")
        return [CorpusChunk(**json.loads(line)) for line in body.splitlines()]
    except FileNotFoundError:
        return None
    except (OSError, ValueError, TypeError) as error:
        logger.warning("rebuilding corrupt corpus cache %s: %s", path, error)
        return None


def _write_cache(path: Path, chunks: list[CorpusChunk]) -> None:
    """Write atomically: a reader sees the old file, the new one, or none."""
    body = b"".join(
        json.dumps(asdict(chunk), ensure_ascii=False).encode("utf-8") + b"\n" for chunk in chunks
    )
    header = json.dumps(_cache_header(body)).encode("ascii") + b"\n"
    write_files({path: header + body})


def _cache_header(body: bytes) -> dict[str, object]:
    return {
        "format": FORMAT_VERSION,
        "count": body.count(b"\n"),
        "sha256": hashlib.sha256(body).hexdigest(),
    }
