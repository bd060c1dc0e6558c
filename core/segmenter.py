"""Split whatever prompt the app built into plain text and the chunks inside it.

:func:`segment_prompt` finds the texts the retriever registered (and any chunks the
caller names) in the prompt by exact text, in time linear in the prompt, so it works
with any template.  The rules:

- The prompt is matched in NFC, the form chunk ids are computed on, but the app's own
  text reaches the model as the app wrote it: text segments are slices of the prompt as
  given.  A chunk segment's text is its chunk's NFC text (what its KV was computed on),
  so the segments concatenate to the prompt itself, except that a chunk written in
  another normalization form comes back in NFC.  An occurrence that would cut a
  combining sequence of a non-NFC prompt (e.g. end between a letter and its accent) is
  no match: it stays text, and hides no other match.
- Leftmost-longest, non-overlapping: of two overlapping matches the one starting
  first is kept, the longer on a tie.  The other chunk's text stays plain text and is
  simply computed.  A chunk present twice gives two segments with the same id.
- Exact text only.  A template that escapes (HTML, JSON), re-wraps or re-indents a
  chunk has made another text: it stays plain text.  Matching the variant would need
  another id and another KV anyway (the KV must be that of the prompt's own tokens),
  and serving the registered chunk's KV for it would be wrong KV, worse than none.
  :func:`~chunkcache.core.prompting.build_request` warns when a prompt holds registered
  chunks only escaped (:mod:`chunkcache.core.escaped_chunks`).
- Texts shorter than ``min_length`` (default 32) characters are never matched.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from chunkcache.core.chunk_ids import validate_chunk_id
from chunkcache.core.nfc_map import OffsetMap, nfc_with_changes
from chunkcache.core.registry import ChunkRegistry
from chunkcache.core.text_matcher import DEFAULT_MIN_LENGTH, TextIndex


@dataclass(frozen=True)
class TextSegment:
    """Prompt text that is no known chunk."""

    text: str


@dataclass(frozen=True)
class ChunkSegment:
    """The text of chunk ``chunk_id``, found in the prompt."""

    chunk_id: str
    text: str


Segment = TextSegment | ChunkSegment


@dataclass(frozen=True)
class _Synced:
    version: int | None  # the registry version ``index`` holds; None before the first sync
    texts: dict[str, str]  # chunk id -> text, as the registry gave them
    index: TextIndex


class ChunkMatcher:
    """Finds a registry's chunks in prompts, following the registry as it changes.

    The index is brought up to date lazily, only when ``registry.version`` moved, and
    only for the chunks that changed; a new immutable index replaces the old one, so
    concurrent callers need no lock to match.

    >>> registry = ChunkRegistry()
    >>> registry.register("c1", "The quick brown fox jumps over the lazy dog.")
    True
    >>> matcher = ChunkMatcher(registry)
    >>> segments = segment_prompt("Q: The quick brown fox jumps over the lazy dog.", matcher)
    >>> segments[0], segments[1].chunk_id
    (TextSegment(text='Q: '), 'c1')
    """

    def __init__(self, registry: ChunkRegistry, min_length: int = DEFAULT_MIN_LENGTH) -> None:
        if not isinstance(registry, ChunkRegistry):
            raise TypeError(f"registry must be a ChunkRegistry, got {type(registry).__name__}")
        self.registry = registry
        self._synced = _Synced(None, {}, TextIndex.build((), min_length))
        self._lock = threading.Lock()
        self.num_syncs = 0

    def index(self) -> TextIndex:
        """The index of the registry's texts as they are now."""
        synced = self._synced
        if synced.version == self.registry.version:
            return synced.index
        with self._lock:
            synced = self._synced
            # Read before the snapshot: a change in between only causes one more sync.
            version = self.registry.version
            if synced.version != version:
                texts = dict(self.registry.items())
                old = synced.texts
                removed = [(cid, text) for cid, text in old.items() if texts.get(cid) != text]
                added = [(cid, text) for cid, text in texts.items() if old.get(cid) != text]
                synced = _Synced(version, texts, synced.index.updated(removed, added))
                self._synced = synced
                self.num_syncs += 1
            return synced.index


def segment_prompt(
    prompt: str,
    source: ChunkMatcher | ChunkRegistry | None,
    explicit_chunks: Sequence[tuple[str, str]] | None = None,
) -> list[Segment]:
    """Split ``prompt`` into text and chunk segments (see the module docstring for the rules).

    ``source`` gives the registered chunks: keep one :class:`ChunkMatcher` across calls
    (a bare registry is indexed anew on every call).  ``explicit_chunks`` are
    (chunk id, text) pairs the caller knows are in the prompt; they are matched in
    addition to the registered ones and win when a registered text has another id.
    Pass ``source=None`` to match only them.

    >>> chunk = "Paris is the capital of France."  # 31 chars: too short to match
    >>> segment_prompt(f"Q: {chunk}", None, [("c1", chunk)])
    [TextSegment(text='Q: Paris is the capital of France.')]
    >>> chunk = "Paris is the capital of France, on the Seine."
    >>> segment_prompt(f"Q: {chunk}", None, [("c1", chunk)])[1]
    ChunkSegment(chunk_id='c1', text='Paris is the capital of France, on the Seine.')
    """
    text, changes = nfc_with_changes(prompt)
    index = _index_of(source)
    if explicit_chunks is not None:
        index = index.updated(removed=(), added=_checked_pairs(explicit_chunks))
    to_prompt = OffsetMap(changes)
    segments: list[Segment] = []
    position = 0  # in the prompt as given
    for match in index.find(text, can_cut=to_prompt.can_cut):
        start, end = to_prompt.offset(match.start), to_prompt.offset(match.end)
        assert start is not None and end is not None  # find() kept only cuttable matches
        if start > position:
            segments.append(TextSegment(prompt[position:start]))
        segments.append(ChunkSegment(match.chunk_id, text[match.start : match.end]))
        position = end
    if position < len(prompt):
        segments.append(TextSegment(prompt[position:]))
    return segments


@dataclass(frozen=True)
class SegmentStats:
    """How much of a prompt the chunks cover, e.g. for an LLM call's metadata."""

    num_chunks: int
    num_unique_chunks: int
    num_chunk_chars: int
    num_chars: int


def segment_stats(segments: Iterable[Segment]) -> SegmentStats:
    """Count the chunk segments of a segmented prompt and the characters they cover.

    >>> segment_stats([TextSegment("Q: "), ChunkSegment("c1", "abc"), ChunkSegment("c1", "abc")])
    SegmentStats(num_chunks=2, num_unique_chunks=1, num_chunk_chars=6, num_chars=9)
    """
    segments = list(segments)
    chunks = [s for s in segments if isinstance(s, ChunkSegment)]
    return SegmentStats(
        num_chunks=len(chunks),
        num_unique_chunks=len({s.chunk_id for s in chunks}),
        num_chunk_chars=sum(len(s.text) for s in chunks),
        num_chars=sum(len(s.text) for s in segments),
    )


def _index_of(source: ChunkMatcher | ChunkRegistry | None) -> TextIndex:
    if source is None:
        return TextIndex.build(())
    if isinstance(source, ChunkRegistry):
        source = ChunkMatcher(source)
    if not isinstance(source, ChunkMatcher):
        raise TypeError(
            f"source must be a ChunkMatcher, ChunkRegistry or None, got {type(source).__name__}"
        )
    return source.index()


def _checked_pairs(explicit_chunks: Sequence[tuple[str, str]]) -> list[tuple[str, str]]:
    if isinstance(explicit_chunks, str | bytes):
        raise TypeError("explicit_chunks must be a sequence of (chunk id, text) pairs")
    pairs = []
    for pair in explicit_chunks:
        if not isinstance(pair, tuple | list) or len(pair) != 2:
            raise TypeError(f"explicit chunk must be a (chunk id, text) pair, got {pair!r:.60}")
        chunk_id, text = pair
        pairs.append((validate_chunk_id(chunk_id), text))  # the index checks the text
    return pairs
