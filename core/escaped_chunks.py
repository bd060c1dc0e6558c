"""A warning for prompts that hold registered chunks only in escaped form.

The segmenter matches exact text (:mod:`chunkcache.core.segmenter`).  A template that
is given a list of Documents or nodes writes their repr, with newlines and quotes
escaped, and an HTML or JSON template escapes the text too.  Then no chunk is found and
nothing is reused, silently.  :func:`warn_if_escaped` looks for the registered chunks in
the unescaped prompt when none was found as written, and warns once with the fix.
"""

from __future__ import annotations

import html
import re
import sys
import warnings
from collections.abc import Sequence

from chunkcache.core.chunk_ids import normalize_text
from chunkcache.core.segmenter import ChunkSegment, Segment
from chunkcache.core.text_matcher import TextIndex

# What repr() and JSON write for a character: \n \t \r \' \" \\, \b \f (JSON), and \xXX
# \uXXXX \UXXXXXXXX (repr writes \xa0 for a no-break space, JSON \f for a form feed).
_BACKSLASH_ESCAPE = re.compile(r"\\(x[0-9a-fA-F]{2}|u[0-9a-fA-F]{4}|U[0-9a-fA-F]{8}|[ntrbf'\"\\])")
_BACKSLASHED = {
    "n": "\n",
    "t": "\t",
    "r": "\r",
    "b": "\b",
    "f": "\f",
    "'": "'",
    '"': '"',
    "\\": "\\",
}


class EscapedChunksWarning(UserWarning):
    """The prompt holds registered chunks only escaped, so none of their KV is reused."""


def warn_if_escaped(prompt: str, segments: Sequence[Segment], index: TextIndex) -> None:
    """Warn (:class:`EscapedChunksWarning`) when ``segments`` hold no chunk but the
    backslash- or HTML-unescaped ``prompt`` holds registered ones.  Linear in the prompt,
    and run only when no chunk was found."""
    if any(isinstance(s, ChunkSegment) for s in segments) or len(index) == 0:
        return
    if any(index.find(normalize_text(form)) for form in _unescaped_forms(prompt)):
        warnings.warn(
            "the prompt holds retrieved chunks only in escaped form (the repr of a list of "
            "Documents or nodes, or an HTML/JSON template), so no chunk's KV is reused: put "
            "the chunk texts in the prompt as retrieved, e.g. "
            "'\\n\\n'.join(doc.page_content for doc in docs)",
            EscapedChunksWarning,
            stacklevel=3,
        )


def _unescaped_forms(prompt: str) -> list[str]:
    """``prompt`` with repr/JSON backslash escapes undone, and with HTML entities undone;
    only the forms that differ from ``prompt``."""
    backslash = _BACKSLASH_ESCAPE.sub(_unescape_one, prompt)
    # \uXXXX pairs give surrogate halves: join them (a lone half becomes U+FFFD)
    backslash = backslash.encode("utf-16", "surrogatepass").decode("utf-16", "replace")
    return [form for form in (backslash, html.unescape(prompt)) if form != prompt]


def _unescape_one(escape: re.Match[str]) -> str:
    code = escape.group(1)
    if code[0] not in "xuU":
        return _BACKSLASHED[code]
    code_point = int(code[1:], 16)
    return chr(code_point) if code_point <= sys.maxunicode else escape.group(0)
