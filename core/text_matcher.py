"""Exact search for many chunk texts at once inside one prompt.

:class:`TextIndex` files every chunk text (in NFC, the form chunk ids are computed
on) under its first ``anchor_length`` characters, its *anchor*.  :meth:`TextIndex.find`
looks the prompt window at each position up in that dict and checks the few texts
filed under it with ``str.startswith``: one dict lookup per prompt character plus
C-speed comparisons.  :meth:`TextIndex.updated` redoes only the anchors whose texts
changed, so following a registry costs little per change.

Why not an Aho-Corasick automaton: in pure Python it needs a dict per character of
every registered text (1,000 chunks of 1 kB: 1.0 M nodes, 1.9 s and 226 MB to build),
and the registry changes on almost every request.

Texts shorter than ``min_length`` are not indexed: they would match by accident
(a short line can recur anywhere) and a cache entry for them saves nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from chunkcache.core.chunk_ids import normalize_text

DEFAULT_MIN_LENGTH = 32
# Anchors longer than this only make each lookup hash more characters.
MAX_ANCHOR_LENGTH = 32

# (chunk id, NFC text)
Candidate = tuple[str, str]


@dataclass(frozen=True)
class TextMatch:
    """``text[start:end]`` is the chunk ``chunk_id``."""

    start: int
    end: int
    chunk_id: str


class TextIndex:
    """Immutable index of chunk texts for leftmost-longest exact matching.

    When several ids share one text, matches report the one indexed last.

    >>> index = TextIndex.build([("c1", "The quick brown fox jumps over the lazy dog.")])
    >>> index.find("Context: The quick brown fox jumps over the lazy dog. Answer:")
    [TextMatch(start=9, end=53, chunk_id='c1')]
    """

    def __init__(self, min_length: int, groups: dict[str, tuple[Candidate, ...]]) -> None:
        self.min_length = min_length
        self.anchor_length = min(min_length, MAX_ANCHOR_LENGTH)
        # anchor -> candidates filed under it, longest first, later-indexed first on ties
        self._groups = groups

    def __len__(self) -> int:
        return sum(len(group) for group in self._groups.values())

    @classmethod
    def build(
        cls, chunks: Iterable[tuple[str, str]], min_length: int = DEFAULT_MIN_LENGTH
    ) -> TextIndex:
        """Index (chunk id, text) pairs."""
        if isinstance(min_length, bool) or not isinstance(min_length, int):
            raise TypeError(f"min_length must be an int, got {type(min_length).__name__}")
        if min_length < 1:
            raise ValueError(f"min_length must be positive, got {min_length}")
        return cls(min_length, {}).updated(removed=(), added=chunks)

    def updated(
        self, removed: Iterable[tuple[str, str]], added: Iterable[tuple[str, str]]
    ) -> TextIndex:
        """A new index without the ``removed`` pairs and with the ``added`` ones."""
        removed_pairs = list(self._eligible(removed))
        gone = {candidate for candidate, _ in removed_pairs}
        # anchor -> its new candidates, the last added first
        changed: dict[str, list[Candidate]] = {anchor: [] for _, anchor in removed_pairs}
        for candidate, anchor in reversed(list(self._eligible(added))):
            changed.setdefault(anchor, []).append(candidate)
        groups = dict(self._groups)
        for anchor, fresh in changed.items():
            kept = [c for c in groups.get(anchor, ()) if c not in gone]
            # A stable sort keeps the fresh candidates first among equal lengths.
            group = tuple(sorted([*fresh, *kept], key=lambda c: -len(c[1])))
            if group:
                groups[anchor] = group
            else:
                groups.pop(anchor, None)
        return TextIndex(self.min_length, groups)

    def find(self, text: str, can_cut: Callable[[int], bool] | None = None) -> list[TextMatch]:
        """Non-overlapping matches in ``text`` (an NFC string), leftmost first, then longest.

        A match hides every later match that overlaps it, even a longer one.  With
        ``can_cut``, an occurrence counts only where ``can_cut`` allows cutting ``text`` at
        both its ends; one that does not hides nothing.  Cost: one lookup per character,
        plus a ``startswith`` per text filed under each anchor found; a failing one stops
        at the first differing character.
        """
        matches: list[TextMatch] = []
        lookup = self._groups.get
        width = self.anchor_length
        start, last_start = 0, len(text) - width

        def fits(chunk: str) -> bool:
            if not text.startswith(chunk, start):
                return False
            return can_cut is None or (can_cut(start) and can_cut(start + len(chunk)))

        while start <= last_start:
            group = lookup(text[start : start + width])
            hit = next((c for c in group if fits(c[1])), None) if group else None
            if hit is None:
                start += 1
                continue
            chunk_id, chunk = hit
            matches.append(TextMatch(start, start + len(chunk), chunk_id))
            start += len(chunk)
        return matches

    def _eligible(self, chunks: Iterable[tuple[str, str]]) -> Iterable[tuple[Candidate, str]]:
        """(candidate, anchor) for each chunk long enough and not blank, in NFC."""
        for chunk_id, text in chunks:
            normalized = normalize_text(text)
            if len(normalized) >= self.min_length and not normalized.isspace():
                yield (chunk_id, normalized), normalized[: self.anchor_length]
