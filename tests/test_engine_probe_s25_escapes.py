"""The escaped-chunk warning also undoes the escapes repr and JSON write for a no-break space,
a soft hyphen, a form feed or a backspace: a list of Documents from web or PDF text holds them."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest
from fake_backend import FakeBackend

from chunkcache.core import ChunkCache
from chunkcache.core.escaped_chunks import EscapedChunksWarning
from chunkcache.core.prompting import build_request

# Web and PDF text: a no-break space (repr writes \xa0), a soft hyphen (\xad), a form
# feed between pages (repr \x0c, JSON \f) and a backspace (JSON \b).
CHUNK = "Price:\xa010\xa0EUR per month, billed in ad\xadvance.\x0cPage 2: no re\x08funds."


@pytest.mark.parametrize("escape", [repr, json.dumps], ids=["repr", "json"])
def test_a_chunk_escaped_with_byte_escapes_warns(escape: Callable[[Any], str]) -> None:
    cache = ChunkCache(backend=FakeBackend())
    cache.registry.register("c1", CHUNK)
    with pytest.warns(EscapedChunksWarning):
        build_request(f"Context: {escape([CHUNK])}\nQuestion: the price?", cache)


def test_an_escape_past_the_last_code_point_is_left_as_written() -> None:
    cache = ChunkCache(backend=FakeBackend())
    cache.registry.register("c1", CHUNK)
    with pytest.warns(EscapedChunksWarning):
        build_request(f"\\UFFFFFFFF {CHUNK!r}", cache)
