"""Unicode NFC with a map back: match text in NFC, cut the original where it matched.

Chunk ids and the segmenter's text index are computed on NFC text, but a prompt may be
in another form, and the app's own text must reach the model as the app wrote it.
:func:`nfc_with_changes` gives a prompt's NFC form and the pieces where it differs;
:class:`OffsetMap` turns offsets in the NFC form back into offsets in the prompt.
Both are linear in the prompt, and free for a prompt that already is NFC.
"""

from __future__ import annotations

import bisect
import functools
import re
import sys
import unicodedata
from collections.abc import Iterable, Iterator

# (start, end, nfc start, nfc): ``prompt[start:end]`` is ``nfc`` in the NFC text, from
# ``nfc start`` there.  Plain tuples: a non-NFC prompt may have one per character.
Change = tuple[int, int, int, str]


def nfc_with_changes(prompt: str) -> tuple[str, list[Change]]:
    """The NFC form of ``prompt`` and where it differs from ``prompt``, in linear time.

    Each piece :func:`_changeable_pieces` finds is normalized on its own: a piece starts
    and ends at normalization boundaries, so every change covers whole combining
    sequences.
    """
    if not isinstance(prompt, str):
        raise TypeError(f"prompt must be str, got {type(prompt).__name__}")
    if unicodedata.is_normalized("NFC", prompt):
        return prompt, []
    normalize = unicodedata.normalize
    pieces: list[str] = []
    changes: list[Change] = []
    position = nfc_length = 0
    for start, end in _changeable_pieces(prompt):
        piece = prompt[start:end]
        nfc = normalize("NFC", piece)
        if nfc == piece:
            continue
        pieces.append(prompt[position:start])
        nfc_length += start - position
        changes.append((start, end, nfc_length, nfc))
        pieces.append(nfc)
        nfc_length += len(nfc)
        position = end
    pieces.append(prompt[position:])
    return "".join(pieces), changes


def _changeable_pieces(prompt: str) -> Iterator[tuple[int, int]]:
    """(start, end) of the pieces of ``prompt`` NFC may change: each run of characters
    that join the one before, with that character, and each character NFC replaces."""
    start = end = 0
    for found in _unit_pattern().finditer(prompt):
        found_start, found_end = found.span()
        if found.lastgroup == "joining" and found_start:
            found_start -= 1
        if found_start < end:  # a run joining a replaced character: one piece
            end = found_end
            continue
        if end:
            yield start, end
        start, end = found_start, found_end
    if end:
        yield start, end


@functools.cache
def _unit_pattern() -> re.Pattern[str]:
    """Finds what NFC may change in a text (built on first use, ~0.2 s): runs of
    characters that join the one before them (group ``joining``) and characters NFC
    replaces on their own (e.g. U+212B ANGSTROM SIGN, joining none).

    Before any character that joins none lies a normalization boundary.  Joining are
    the combining marks, the characters that compose with the one before (the second
    of a canonical pair, Hangul vowel and trailing jamo) and those whose decomposition
    starts with either.
    """
    decomposed: list[int] = []  # code points with a canonical decomposition
    marks: set[int] = set()
    joins_previous = set(range(0x1161, 0x1176)) | set(range(0x11A8, 0x11C3))
    for code_point in range(sys.maxunicode + 1):
        char = chr(code_point)
        if unicodedata.combining(char):
            marks.add(code_point)
        decomposition = unicodedata.decomposition(char)
        if decomposition and not decomposition.startswith("<"):
            decomposed.append(code_point)
            parts = decomposition.split()
            if len(parts) == 2:
                joins_previous.add(int(parts[1], 16))
    joins = marks | joins_previous
    no_boundary_before = set(joins)
    changed_alone = set()
    for code_point in decomposed:
        char = chr(code_point)
        if ord(unicodedata.normalize("NFD", char)[0]) in joins:
            no_boundary_before.add(code_point)
        elif unicodedata.normalize("NFC", char) != char:
            changed_alone.add(code_point)
    joining, alone = _char_class(no_boundary_before), _char_class(changed_alone)
    return re.compile(f"(?P<joining>[{joining}]+)|[{alone}]")


def _char_class(code_points: Iterable[int]) -> str:
    """The inside of a regex character class holding ``code_points``, as ranges."""
    ranges: list[list[int]] = []
    for code_point in sorted(code_points):
        if ranges and ranges[-1][1] == code_point - 1:
            ranges[-1][1] = code_point
        else:
            ranges.append([code_point, code_point])
    return "".join(
        re.escape(chr(low)) + ("" if low == high else "-" + re.escape(chr(high)))
        for low, high in ranges
    )


class OffsetMap:
    """Maps offsets in the NFC text back to the prompt, for increasing offsets (linear)."""

    def __init__(self, changes: list[Change]) -> None:
        self._changes = changes
        self._nfc_starts = [nfc_start for _, _, nfc_start, _ in changes]
        self._next = 0  # the first change not wholly before the last offset asked for
        self._shift = 0  # prompt offset minus NFC offset after the changes passed

    def offset(self, nfc_offset: int) -> int | None:
        """The prompt offset of ``nfc_offset``; None inside a changed sequence."""
        while self._next < len(self._changes):
            start, end, nfc_start, nfc = self._changes[self._next]
            if nfc_start + len(nfc) > nfc_offset:
                if nfc_start < nfc_offset:
                    return None
                break
            self._shift += (end - start) - len(nfc)
            self._next += 1
        return nfc_offset + self._shift

    def can_cut(self, nfc_offset: int) -> bool:
        """Whether the prompt can be cut at ``nfc_offset``: it is not inside a changed
        sequence.  Any order of offsets, a binary search each."""
        index = bisect.bisect_left(self._nfc_starts, nfc_offset) - 1
        if index < 0:
            return True
        _, _, nfc_start, nfc = self._changes[index]
        return nfc_offset >= nfc_start + len(nfc)
