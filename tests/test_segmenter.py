"""The segmenter: finding registered and explicit chunks in any prompt, by exact text."""

from __future__ import annotations

import doctest
import html
import itertools
import json
import random
import re
import textwrap
import threading
import unicodedata
from collections.abc import Callable
from types import ModuleType
from typing import Any, Literal

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from chunkcache.core import segmenter, text_matcher
from chunkcache.core.chunk_ids import chunk_id
from chunkcache.core.errors import InvalidChunkError
from chunkcache.core.registry import ChunkRegistry
from chunkcache.core.segmenter import (
    ChunkMatcher,
    ChunkSegment,
    Segment,
    SegmentStats,
    TextSegment,
    segment_prompt,
    segment_stats,
)
from chunkcache.core.text_matcher import TextIndex

PARIS = "Paris is the capital and most populous city of France, on the Seine."
BERLIN = "Berlin is the capital of Germany and its largest city by population."
TOKYO = "Tokyo is the capital of Japan; its metropolitan area is the largest."


def registry_of(*texts: str) -> ChunkRegistry:
    registry = ChunkRegistry()
    for text in texts:
        registry.register(chunk_id(text), text)
    return registry


def check_invariants(prompt: str, segments: list[Segment]) -> None:
    """Text segments are the prompt's own text; chunk segments the NFC form of its text."""
    if "".join(s.text for s in segments) != prompt:
        position = 0
        for segment in segments:
            if isinstance(segment, TextSegment):
                assert prompt.startswith(segment.text, position)
                position += len(segment.text)
            else:  # the shortest prompt text whose NFC is the chunk's (only one can be)
                position = next(
                    end
                    for end in range(position + 1, len(prompt) + 1)
                    if unicodedata.normalize("NFC", prompt[position:end]) == segment.text
                )
        assert position == len(prompt)
    assert all(s.text for s in segments)
    for left, right in itertools.pairwise(segments):
        assert not (isinstance(left, TextSegment) and isinstance(right, TextSegment))


def chunk_ids_in(segments: list[Segment]) -> list[str]:
    return [s.chunk_id for s in segments if isinstance(s, ChunkSegment)]


def test_finds_chunks_in_a_template() -> None:
    prompt = f"Answer from the context.\n\nContext:\n{PARIS}\n\n{BERLIN}\n\nQuestion: capitals?"
    segments = segment_prompt(prompt, registry_of(PARIS, BERLIN, TOKYO))
    check_invariants(prompt, segments)
    assert segments == [
        TextSegment("Answer from the context.\n\nContext:\n"),
        ChunkSegment(chunk_id(PARIS), PARIS),
        TextSegment("\n\n"),
        ChunkSegment(chunk_id(BERLIN), BERLIN),
        TextSegment("\n\nQuestion: capitals?"),
    ]


def test_adjacent_chunks_and_a_prompt_that_is_one_chunk() -> None:
    registry = registry_of(PARIS, BERLIN)
    assert segment_prompt(PARIS + BERLIN, registry) == [
        ChunkSegment(chunk_id(PARIS), PARIS),
        ChunkSegment(chunk_id(BERLIN), BERLIN),
    ]
    assert segment_prompt(PARIS, registry) == [ChunkSegment(chunk_id(PARIS), PARIS)]


def test_a_chunk_twice_gives_two_segments_with_its_id() -> None:
    prompt = f"{PARIS}\n---\n{PARIS}"
    segments = segment_prompt(prompt, registry_of(PARIS))
    check_invariants(prompt, segments)
    assert chunk_ids_in(segments) == [chunk_id(PARIS), chunk_id(PARIS)]


def test_unregistered_text_stays_plain() -> None:
    prompt = f"Context:\n{TOKYO}\n{PARIS}"
    segments = segment_prompt(prompt, registry_of(PARIS))
    assert segments == [TextSegment(f"Context:\n{TOKYO}\n"), ChunkSegment(chunk_id(PARIS), PARIS)]
    assert segment_prompt(prompt, ChunkRegistry()) == [TextSegment(prompt)]
    assert segment_prompt(prompt, None) == [TextSegment(prompt)]


def test_overlapping_chunks_keep_the_one_starting_first() -> None:
    # A splitter with overlap: the prompt holds the source text, so the chunks overlap in it.
    document = " ".join(f"Sentence {i} of the source document." for i in range(30))
    first, second = document[:600], document[400:]
    prompt = f"Doc: {document}"
    segments = segment_prompt(prompt, registry_of(first, second))
    check_invariants(prompt, segments)
    assert segments == [
        TextSegment("Doc: "),
        ChunkSegment(chunk_id(first), first),
        TextSegment(document[600:]),  # the overlapped chunk is simply computed
    ]


def test_on_the_same_start_the_longer_chunk_wins() -> None:
    longer = PARIS + " " + BERLIN
    segments = segment_prompt(f"> {longer}", registry_of(PARIS, longer))
    assert segments == [TextSegment("> "), ChunkSegment(chunk_id(longer), longer)]


def test_a_chunk_inside_a_matched_chunk_is_not_matched() -> None:
    outer = f"Cities: {PARIS} And more."
    segments = segment_prompt(outer, registry_of(PARIS, outer))
    assert segments == [ChunkSegment(chunk_id(outer), outer)]


def test_an_earlier_chunk_hides_a_longer_overlapping_one() -> None:
    # Leftmost wins over longest: the rule is simple and predictable, and costs one chunk.
    tail = PARIS[-40:]
    longer = tail + " " + BERLIN
    prompt = PARIS + " " + BERLIN
    segments = segment_prompt(prompt, registry_of(PARIS, longer))
    assert segments == [ChunkSegment(chunk_id(PARIS), PARIS), TextSegment(" " + BERLIN)]


CHUNK_WITH_SPECIALS = (
    'The "<b>bold</b>" tag & the  <i>italic</i> tag\nare HTML; write them\n'
    "    indented, with  double spaces and a very long line that a re-wrapping template "
    "would certainly break somewhere in the middle of it."
)


@pytest.mark.parametrize(
    "rewrite",
    [
        html.escape,
        lambda text: json.dumps(text)[1:-1],
        lambda text: textwrap.fill(text, width=40),
        lambda text: textwrap.indent(text, "    "),
        lambda text: " ".join(text.split()),
        lambda text: text.replace("\n", "\r\n"),
        str.strip,
    ],
    ids=["html", "json", "rewrap", "indent", "collapse-spaces", "crlf", "strip"],
)
def test_escaped_or_rewrapped_chunks_stay_plain_text(rewrite: Callable[[str], str]) -> None:
    chunk = "  " + CHUNK_WITH_SPECIALS + "\n"
    rewritten = rewrite(chunk)
    assert rewritten != chunk
    prompt = f"Context: {rewritten}\nQuestion: which tags?"
    assert segment_prompt(prompt, registry_of(chunk)) == [TextSegment(prompt)]


def test_escaping_that_changes_nothing_still_matches() -> None:
    # JSON-escaping a chunk without quotes, backslashes or newlines leaves its exact text.
    prompt = json.dumps({"context": PARIS, "question": "capital?"})
    assert chunk_ids_in(segment_prompt(prompt, registry_of(PARIS))) == [chunk_id(PARIS)]


def test_llama_index_metadata_prefix_stays_plain_and_the_chunk_matches() -> None:
    # LlamaIndex's context: each node as "key: value\n\n<content>" (MetadataMode.LLM).
    context = "\n\n".join(
        f"file_path: data/{name}.txt\n\n{text}"
        for name, text in [("paris", PARIS), ("berlin", BERLIN)]
    )
    prompt = (
        f"Context information is below.\n---------------------\n{context}\n---------------------\n"
    )
    segments = segment_prompt(prompt, registry_of(PARIS, BERLIN))
    check_invariants(prompt, segments)
    assert chunk_ids_in(segments) == [chunk_id(PARIS), chunk_id(BERLIN)]
    assert segments[0] == TextSegment(
        "Context information is below.\n---------------------\nfile_path: data/paris.txt\n\n"
    )


def test_short_texts_are_not_matched_unless_configured() -> None:
    short = "Answer: yes, it is."  # would match by accident in many prompts
    prompt = f"Q: is it? {short}"
    registry = registry_of(short)
    assert segment_prompt(prompt, registry) == [TextSegment(prompt)]
    matched = segment_prompt(prompt, ChunkMatcher(registry, min_length=len(short)))
    assert matched[1] == ChunkSegment(chunk_id(short), short)
    assert segment_prompt(prompt, ChunkMatcher(registry, min_length=len(short) + 1)) == [
        TextSegment(prompt)
    ]


def test_min_length_above_the_anchor_length() -> None:
    registry = registry_of(PARIS, BERLIN[:60])
    matcher = ChunkMatcher(registry, min_length=61)
    assert len(PARIS) >= 61
    segments = segment_prompt(f"{PARIS} {BERLIN}", matcher)
    assert chunk_ids_in(segments) == [chunk_id(PARIS)]


@pytest.mark.parametrize(
    ("min_length", "error"),
    [(0, ValueError), (-1, ValueError), (True, TypeError), (1.5, TypeError), ("32", TypeError)],
)
def test_bad_min_length(min_length: Any, error: type[Exception]) -> None:
    with pytest.raises(error):
        ChunkMatcher(ChunkRegistry(), min_length=min_length)


def test_blank_texts_are_never_matched() -> None:
    registry = ChunkRegistry()
    registry.register("blank", " " * 40)
    prompt = "a" + " " * 50 + "b"
    assert segment_prompt(prompt, registry) == [TextSegment(prompt)]


def test_nfd_prompt_matches_and_its_chunk_comes_back_in_nfc() -> None:
    chunk = "Crème brûlée is a dessert of rich custard under caramelised sugar."
    nfd_chunk = unicodedata.normalize("NFD", chunk)
    prompt = f"Recette : {nfd_chunk} Fin."
    for registered in (chunk, nfd_chunk):  # ids are the same for both forms
        segments = segment_prompt(prompt, registry_of(registered))
        check_invariants(prompt, segments)
        assert segments[1] == ChunkSegment(chunk_id(chunk), chunk)


def test_a_combining_mark_after_a_chunk_changes_its_text() -> None:
    chunk = "The word at the end of this chunk is cafe"
    prompt = chunk + "\u0301 and more"  # in NFC the chunk's last letter becomes "é"
    assert unicodedata.normalize("NFC", prompt).endswith("café and more")
    assert segment_prompt(prompt, registry_of(chunk)) == [TextSegment(prompt)]


def test_odd_unicode() -> None:
    chunk = "Emoji 👩‍👩‍👧 and 🇫🇷, a lone \ud800 surrogate, Hangul 한국어, and z\u0335\u0301 marks."
    prompt = f"\udfff{chunk}\U0010ffff{chunk}"
    segments = segment_prompt(prompt, registry_of(chunk))
    check_invariants(prompt, segments)
    assert chunk_ids_in(segments) == [chunk_id(chunk)] * 2


def test_explicit_chunks_are_matched_in_addition() -> None:
    prompt = f"{PARIS}\n{TOKYO}"
    segments = segment_prompt(prompt, registry_of(PARIS), [("tokyo", TOKYO)])
    assert chunk_ids_in(segments) == [chunk_id(PARIS), "tokyo"]
    assert chunk_ids_in(segment_prompt(prompt, None, [("tokyo", TOKYO)])) == ["tokyo"]
    assert chunk_ids_in(segment_prompt(prompt, registry_of(PARIS), [])) == [chunk_id(PARIS)]


def test_an_explicit_id_wins_over_a_registered_one_for_the_same_text() -> None:
    matcher = ChunkMatcher(registry_of(PARIS))
    assert chunk_ids_in(segment_prompt(PARIS, matcher, [("mine", PARIS)])) == ["mine"]
    assert chunk_ids_in(segment_prompt(PARIS, matcher)) == [chunk_id(PARIS)]  # matcher unchanged


def test_of_two_registered_ids_for_one_text_the_newer_wins() -> None:
    registry = ChunkRegistry()
    registry.register("old", PARIS)
    registry.register("new", PARIS)
    assert chunk_ids_in(segment_prompt(PARIS, registry)) == ["new"]
    matcher = ChunkMatcher(registry)
    segment_prompt(PARIS, matcher)
    registry.register("new", BERLIN)
    assert chunk_ids_in(segment_prompt(PARIS, matcher)) == ["old"]


@pytest.mark.parametrize(
    ("explicit", "error"),
    [
        (PARIS, TypeError),
        ([PARIS], TypeError),
        ([("a", "b", "c")], TypeError),
        ([("bad id", PARIS)], InvalidChunkError),
        ([(None, PARIS)], InvalidChunkError),
        ([("ok", b"bytes")], TypeError),
        ([("ok", None)], TypeError),
    ],
)
def test_bad_explicit_chunks(explicit: Any, error: type[Exception]) -> None:
    with pytest.raises(error):
        segment_prompt(PARIS, None, explicit)


@pytest.mark.parametrize("prompt", [None, b"bytes", 42, ["text"]])
def test_non_str_prompt_raises_type_error(prompt: Any) -> None:
    with pytest.raises(TypeError):
        segment_prompt(prompt, registry_of(PARIS))


def test_bad_source_raises_type_error() -> None:
    not_a_registry: Any = {"id": PARIS}
    with pytest.raises(TypeError):
        segment_prompt(PARIS, not_a_registry)
    with pytest.raises(TypeError):
        ChunkMatcher(not_a_registry)


def test_empty_prompt_gives_no_segments() -> None:
    assert segment_prompt("", registry_of(PARIS)) == []
    assert segment_prompt("", None, [("c", PARIS)]) == []


def test_the_index_follows_the_registry_lazily() -> None:
    registry = ChunkRegistry(max_chunks=2)
    matcher = ChunkMatcher(registry)
    registry.register("paris", PARIS)
    prompt = f"{PARIS} {BERLIN} {TOKYO}"
    assert chunk_ids_in(segment_prompt(prompt, matcher)) == ["paris"]
    index = matcher.index()
    assert matcher.num_syncs == 1
    registry.get("paris")  # a read changes nothing to match
    registry.register("paris", PARIS)  # neither does the same text again
    assert matcher.index() is index
    registry.register("berlin", BERLIN)
    assert chunk_ids_in(segment_prompt(prompt, matcher)) == ["paris", "berlin"]
    registry.register("tokyo", TOKYO)  # evicts paris
    assert chunk_ids_in(segment_prompt(prompt, matcher)) == ["berlin", "tokyo"]
    registry.register("tokyo", PARIS)  # new text under the same id
    assert chunk_ids_in(segment_prompt(prompt, matcher)) == ["tokyo", "berlin"]
    assert matcher.num_syncs == 4
    assert len(matcher.index()) == 2


def test_updated_gives_a_new_index_and_leaves_the_old_one() -> None:
    index = TextIndex.build([("a", PARIS), ("b", BERLIN)])
    smaller = index.updated(removed=[("a", PARIS)], added=())
    assert len(smaller) == 1
    assert smaller.find(PARIS) == []
    assert len(index) == 2  # indexes are immutable


SMALL_TEXTS = st.text(alphabet="ab \u0301", min_size=3, max_size=12)


@given(
    texts=st.lists(SMALL_TEXTS, min_size=1, max_size=6),
    picks=st.lists(st.one_of(st.integers(0, 5), st.text(alphabet="ab \u0301e", max_size=5))),
)
@settings(max_examples=300, deadline=None)
def test_matches_equal_a_brute_force_leftmost_longest(texts: list[str], picks: list) -> None:
    # A tiny alphabet makes chunks overlap, nest, repeat and share prefixes all the time.
    prompt = "".join(texts[p % len(texts)] if isinstance(p, int) else p for p in picks)
    registry = ChunkRegistry()
    for i, text in enumerate(texts):
        registry.register(f"c{i}", text)
    segments = segment_prompt(prompt, ChunkMatcher(registry, min_length=3))
    check_invariants(prompt, segments)
    nfc = unicodedata.normalize("NFC", prompt)
    blocked = inside_changed_sequences(prompt)
    eligible = {unicodedata.normalize("NFC", t) for t in texts}
    eligible = {t for t in eligible if len(t) >= 3 and not t.isspace()}
    expected, start = [], 0
    while start < len(nfc):
        found = [
            t
            for t in eligible
            if nfc.startswith(t, start) and not {start, start + len(t)} & blocked
        ]
        if found:
            longest = max(found, key=len)
            expected.append((start, longest))
            start += len(longest)
        else:
            start += 1
    got, position = [], 0
    for segment in segments:
        if isinstance(segment, ChunkSegment):
            got.append((position, segment.text))
            assert unicodedata.normalize("NFC", texts[int(segment.chunk_id[1:])]) == segment.text
        position += len(unicodedata.normalize("NFC", segment.text))
    assert got == expected


def inside_changed_sequences(prompt: str) -> set[int]:
    """The NFC offsets a chunk may not start or end at: inside a combining sequence that
    NFC changes (a prompt cut there would split what the model sees as one character).
    For SMALL_TEXTS' alphabet, where U+0301 is the only combining mark."""
    blocked: set[int] = set()
    offset = position = 0
    for sequence in re.finditer("[^\u0301]?\u0301+", prompt):
        offset += sequence.start() - position  # unchanged characters before it
        nfc = unicodedata.normalize("NFC", sequence.group())
        if nfc != sequence.group():
            blocked.update(range(offset + 1, offset + len(nfc)))
        offset, position = offset + len(nfc), sequence.end()
    return blocked


@given(
    chunks=st.lists(st.text(min_size=32, max_size=60), min_size=1, max_size=4),
    layout=st.lists(st.tuples(st.text(max_size=8), st.integers(0, 3)), max_size=8),
    form=st.sampled_from(["NFC", "NFD"]),
)
@settings(max_examples=200, deadline=None)
def test_segments_concatenate_to_the_prompt_with_chunks_in_nfc(
    chunks: list[str], layout: list[tuple[str, int]], form: Literal["NFC", "NFD"]
) -> None:
    prompt = "".join(filler + chunks[i % len(chunks)] for filler, i in layout)
    prompt = unicodedata.normalize(form, prompt)
    registry = registry_of(*(chunk for chunk in chunks if chunk.strip()))
    segments = segment_prompt(prompt, registry)
    check_invariants(prompt, segments)
    for segment in segments:
        if isinstance(segment, ChunkSegment):
            assert chunk_id(segment.text) == segment.chunk_id


def test_concurrent_registering_and_matching() -> None:
    texts = [f"Chunk number {i}: " + "lorem ipsum dolor sit amet " * 3 for i in range(200)]
    registry = ChunkRegistry(max_chunks=50)
    matcher = ChunkMatcher(registry)
    prompt = "\n".join(texts)
    errors: list[BaseException] = []

    def register(offset: int) -> None:
        for text in texts[offset::4]:
            registry.register(chunk_id(text), text)

    def match() -> None:
        try:
            for _ in range(30):
                segments = segment_prompt(prompt, matcher)
                check_invariants(prompt, segments)
                assert all(
                    chunk_id(s.text) == s.chunk_id for s in segments if isinstance(s, ChunkSegment)
                )
        except BaseException as error:  # reported below, in the main thread
            errors.append(error)

    threads = [threading.Thread(target=register, args=(i,)) for i in range(4)]
    threads += [threading.Thread(target=match) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    final = segment_prompt(prompt, matcher)
    assert sorted(chunk_ids_in(final)) == sorted(cid for cid, _ in registry.items())


def test_one_megabyte_prompt_with_a_thousand_chunks() -> None:
    rng = random.Random(7)
    words = ["the", "of", "cache", "chunk", "token", "layer", "model", "prefix", "key", "value"]
    chunks = [f"[chunk {i}] " + " ".join(rng.choices(words, k=150)) for i in range(1000)]
    registry = registry_of(*chunks)
    pieces, inserted, size = [], [], 0
    while size < 1_000_000:
        if rng.random() < 0.5:
            i = rng.randrange(len(chunks))
            pieces.append(chunks[i] + "\n\n")
            inserted.append(chunk_id(chunks[i]))
        else:
            pieces.append(" ".join(rng.choices(words, k=rng.randint(5, 300))) + "\n\n")
        size += len(pieces[-1])
    prompt = "".join(pieces)
    segments = segment_prompt(prompt, ChunkMatcher(registry))
    check_invariants(prompt, segments)
    assert chunk_ids_in(segments) == inserted


def test_segment_stats() -> None:
    prompt = f"Q: {PARIS}\n{PARIS}\n{BERLIN}"
    stats = segment_stats(iter(segment_prompt(prompt, registry_of(PARIS, BERLIN))))
    assert stats == SegmentStats(
        num_chunks=3,
        num_unique_chunks=2,
        num_chunk_chars=2 * len(PARIS) + len(BERLIN),
        num_chars=len(prompt),
    )
    assert segment_stats([]) == SegmentStats(0, 0, 0, 0)


@pytest.mark.parametrize("module", [segmenter, text_matcher])
def test_docstring_examples_run(module: ModuleType) -> None:
    failures, attempted = doctest.testmod(module)
    assert attempted > 0
    assert failures == 0
