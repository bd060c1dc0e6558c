"""The chunk token cache of a long-running service stays within its budget.

``SegmentTokenizer`` caches each chunk's token ids.  Bounded by entries only, with the
chunk text in its key and the ids as a tuple of ints (~36 B a token), 50,000 chunks of
8,000 characters kept gigabytes; now it keeps 4 B a token, no text, within a token budget.
"""

from __future__ import annotations

import gc
import tracemalloc
from collections.abc import Callable, Sequence
from typing import Any

import pytest

from chunkcache.core.chunk_ids import chunk_id_of
from chunkcache.core.errors import InvalidTextError
from chunkcache.core.segmenter import ChunkSegment
from chunkcache.core.tokenization import SegmentTokenizer

PER_ENTRY_BYTES = 400  # key, array header and dict slot: ~200 B measured, with room


class CharTokenizer:
    """One token a character, ids past the small-int cache as a real vocabulary's are;
    no ``tokenizers`` backend, so :class:`SegmentTokenizer` calls it as it is."""

    def __init__(self) -> None:
        self.num_calls = 0

    def __call__(self, text: str, **kwargs: Any) -> dict[str, list[int]]:
        self.num_calls += 1
        return {"input_ids": [1000 + ord(c) for c in text]}


def text(n: int, length: int) -> str:
    """A distinct chunk text of ``length`` characters."""
    return f"Chunk {n}: " + ("the fox is red and the dog is brown " * (length // 30 + 1))[:length]


def chunk_ids(tokenize: SegmentTokenizer, chunk_id: str, chunk_text: str) -> tuple[int, ...]:
    (segment,) = tokenize([ChunkSegment(chunk_id, chunk_text)])
    assert chunk_id_of(segment.segment_id) == chunk_id
    return segment.ids


def retained_bytes(drive: Callable[[], None]) -> int:
    """What ``drive`` leaves allocated once its temporaries are gone."""
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        drive()
        gc.collect()
        return tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()


def drive_texts(tokenize: SegmentTokenizer, texts: Sequence[str]) -> None:
    for n, chunk_text in enumerate(texts):
        chunk_ids(tokenize, f"c{n}", chunk_text)


def test_many_long_chunks_stay_within_the_token_budget() -> None:
    budget = 50_000
    tokenize = SegmentTokenizer(CharTokenizer(), max_cached_tokens=budget)
    lengths: list[int] = []

    def drive() -> None:
        for n in range(200):  # 800,000 tokens in all, 16 x the budget
            chunk_ids(tokenize, f"c{n}", text(n, 4000))
            lengths.append(tokenize.num_cached_tokens)

    retained = retained_bytes(drive)
    assert max(lengths) <= budget
    assert tokenize.num_cached_tokens > budget - 4100  # full, less than one chunk short
    assert retained < 4 * budget + PER_ENTRY_BYTES * tokenize.num_cached_chunks + 64 * 1024


def test_the_default_cache_keeps_four_bytes_a_token_and_not_the_text() -> None:
    tokenize = SegmentTokenizer(CharTokenizer())
    texts = [text(n, 8000) for n in range(100)]
    retained = retained_bytes(lambda: drive_texts(tokenize, texts))
    num_tokens = sum(map(len, texts))  # one a character, all under the default budget
    # 4 B a token and some room; a tuple of ints is ~36 B a token, the text in a key 1 B more.
    assert retained < 5 * num_tokens + PER_ENTRY_BYTES * len(texts)
    assert (tokenize.num_cached_chunks, tokenize.num_cached_tokens) == (len(texts), num_tokens)


def test_a_hit_gives_the_ids_of_that_text_under_any_chunk_id() -> None:
    tokenizer = CharTokenizer()
    tokenize = SegmentTokenizer(tokenizer)
    first = chunk_ids(tokenize, "a", "The fox is red.")
    assert chunk_ids(tokenize, "b", "The fox is red.") == first  # one text, one entry
    assert tokenizer.num_calls == 1
    other = chunk_ids(tokenize, "a", "The dog is brown.")  # another text under "a": a miss
    assert other == tuple(1000 + ord(c) for c in "The dog is brown.")
    assert tokenizer.num_calls == 2
    assert chunk_ids(tokenize, "a", "The fox is red.") == first
    assert tokenizer.num_calls == 2


def test_the_least_recently_used_chunk_goes_first() -> None:
    tokenizer = CharTokenizer()
    tokenize = SegmentTokenizer(tokenizer, max_cached_tokens=3 * 110)
    a, b, c, d = (text(n, 100) for n in range(4))  # ~110 tokens each
    for n, chunk_text in enumerate([a, b, c, a, d]):  # a is used again before d comes
        chunk_ids(tokenize, f"c{n}", chunk_text)
    assert tokenizer.num_calls == 4
    chunk_ids(tokenize, "a", a)
    chunk_ids(tokenize, "d", d)
    assert tokenizer.num_calls == 4
    chunk_ids(tokenize, "b", b)  # evicted
    assert tokenizer.num_calls == 5


def test_a_chunk_over_the_whole_budget_is_tokenized_and_not_cached() -> None:
    tokenizer = CharTokenizer()
    tokenize = SegmentTokenizer(tokenizer, max_cached_tokens=100)
    small = chunk_ids(tokenize, "small", "The fox is red.")
    big = text(0, 500)
    assert chunk_ids(tokenize, "big", big) == tuple(1000 + ord(c) for c in big)
    assert (tokenize.num_cached_chunks, tokenize.num_cached_tokens) == (1, len(small))
    chunk_ids(tokenize, "big", big)
    assert tokenizer.num_calls == 3
    chunk_ids(tokenize, "small", "The fox is red.")
    assert tokenizer.num_calls == 3


def test_a_lone_surrogate_is_named_not_hashed() -> None:
    with pytest.raises(InvalidTextError, match="lone surrogate"):
        SegmentTokenizer(CharTokenizer())([ChunkSegment("a", "half an emoji \ud83d")])


@pytest.mark.parametrize("kwargs", [{"max_cached_tokens": -1}, {"max_cached_chunks": -1}])
def test_negative_bounds_are_refused(kwargs: dict[str, int]) -> None:
    with pytest.raises(ValueError, match="bounds"):
        SegmentTokenizer(CharTokenizer(), **kwargs)
