"""The segmenter matches in NFC but gives the app's own text back as the app wrote it."""

from __future__ import annotations

import unicodedata

from hypothesis import given, settings
from hypothesis import strategies as st

from chunkcache.core.chunk_ids import chunk_id
from chunkcache.core.nfc_map import OffsetMap, nfc_with_changes
from chunkcache.core.registry import ChunkRegistry
from chunkcache.core.segmenter import ChunkSegment, TextSegment, segment_prompt


def nfd(text: str) -> str:
    return unicodedata.normalize("NFD", text)


def registry_of(*texts: str) -> ChunkRegistry:
    registry = ChunkRegistry()
    for text in texts:
        registry.register(chunk_id(text), text)
    return registry


CREME = "Crème brûlée is a dessert of rich custard under caramelised sugar."
SEOUL = "서울은 대한민국의 수도이며 가장 큰 도시입니다. 한강이 도시를 가로질러 흐릅니다."
QUESTION = "Question : quel dessert a une croûte de sucre brûlé ? Réponds en français."
HANGUL_QUESTION = "질문: 한국의 수도는 어디입니까?"


def test_nfd_question_around_nfc_chunks_is_kept_as_written() -> None:
    prompt = f"{nfd(QUESTION)}\n{CREME}\n{SEOUL}\n{nfd(HANGUL_QUESTION)}"
    assert segment_prompt(prompt, registry_of(CREME, SEOUL)) == [
        TextSegment(nfd(QUESTION) + "\n"),
        ChunkSegment(chunk_id(CREME), CREME),
        TextSegment("\n"),
        ChunkSegment(chunk_id(SEOUL), SEOUL),
        TextSegment("\n" + nfd(HANGUL_QUESTION)),
    ]


def test_nfd_chunks_around_nfc_text_come_back_as_registered() -> None:
    prompt = f"{QUESTION}\n{nfd(CREME)}\n{nfd(SEOUL)}\nFin : é."
    for registered in [(CREME, SEOUL), (nfd(CREME), nfd(SEOUL))]:  # same ids either way
        assert segment_prompt(prompt, registry_of(*registered)) == [
            TextSegment(QUESTION + "\n"),
            ChunkSegment(chunk_id(CREME), CREME),
            TextSegment("\n"),
            ChunkSegment(chunk_id(SEOUL), SEOUL),
            TextSegment("\nFin : é."),
        ]


def test_a_prompt_without_chunks_comes_back_unchanged_in_any_form() -> None:
    mixed = f"{nfd(QUESTION)} {HANGUL_QUESTION} {nfd(HANGUL_QUESTION)} \u212b \u0958 z\u0335\u0301"
    for prompt in (nfd(QUESTION), nfd(HANGUL_QUESTION), mixed, "\u0301 leading mark"):
        assert segment_prompt(prompt, registry_of(CREME, SEOUL)) == [TextSegment(prompt)]


def test_text_between_chunks_keeps_its_characters_in_a_mixed_prompt() -> None:
    gaps = [nfd("À propos : "), " et ", "\u212b\u0958 ", nfd(" 끝.")]
    prompt = gaps[0] + nfd(CREME) + gaps[1] + SEOUL + gaps[2] + CREME + gaps[3]
    segments = segment_prompt(prompt, registry_of(CREME, SEOUL))
    assert [s.text for s in segments if isinstance(s, TextSegment)] == gaps
    assert [s.text for s in segments if isinstance(s, ChunkSegment)] == [CREME, SEOUL, CREME]


def test_a_match_that_would_cut_a_combining_sequence_stays_text() -> None:
    # In NFC the prompt holds the chunk (ending in U+1EB9, e with dot below) and then
    # U+0301; in the prompt the acute comes before the dot below, so no cut of the
    # prompt is the chunk.
    chunk = "The last letter of this chunk has a dot below it: \u1eb9"
    prompt = "Intro " + chunk[:-1] + "e\u0301\u0323 and more"
    assert unicodedata.normalize("NFC", prompt) == "Intro " + chunk + "\u0301 and more"
    assert segment_prompt(prompt, registry_of(chunk)) == [TextSegment(prompt)]


def test_a_match_that_cannot_be_cut_out_hides_no_overlapping_match() -> None:
    # The first chunk would end inside "e\u0301\u0323"; a second chunk starting inside
    # the first and ending after the sequence is a whole cut of the prompt: it is found.
    first = "The last letter of this chunk has a dot below it: \u1eb9"
    second = "this chunk has a dot below it: \u1eb9\u0301 and the text after it"
    prompt = "Intro " + first[:-1] + "e\u0301\u0323 and the text after it."
    assert unicodedata.normalize("NFC", prompt).endswith(second + ".")
    assert segment_prompt(prompt, registry_of(first, second)) == [
        TextSegment("Intro The last letter of "),
        ChunkSegment(chunk_id(second), second),
        TextSegment("."),
    ]


def test_offsets_inside_a_changed_sequence_cannot_be_cut_asked_in_any_order() -> None:
    nfc, changes = nfc_with_changes("ab" + nfd("\u00e9") + nfd("\u1eb9\u0301") + "cd")
    assert nfc == "ab\u00e9\u1eb9\u0301cd"
    offsets = OffsetMap(changes)
    cuts = {i: offsets.can_cut(i) for i in reversed(range(len(nfc) + 1))}
    assert [i for i, ok in sorted(cuts.items()) if not ok] == [4]  # between U+1EB9 and U+0301


def test_hangul_jamo_question_next_to_a_chunk() -> None:
    # Conjoining jamo compose across characters (L+V+T): the question stays in jamo.
    prompt = SEOUL + nfd(HANGUL_QUESTION)
    assert segment_prompt(prompt, registry_of(SEOUL)) == [
        ChunkSegment(chunk_id(SEOUL), SEOUL),
        TextSegment(nfd(HANGUL_QUESTION)),
    ]


# Marks in both orders, Hangul jamo, Indic two-part vowels, singletons, Tibetan vowels
# that decompose to marks, musical symbols and CJK compatibility ideographs outside the
# BMP, and the ASCII around them.
TRICKY = st.sampled_from(
    [
        *"ae<=> \n",
        *("\u0301", "\u0323", "\u0338", "\u00e9", "\u1100", "\u1161", "\u11a8", "\uac00"),
        *("\u0b47", "\u0b3e", "\u0b4b", "\u212b", "\u2126", "\u0958", "\u0f73", "\u0f74"),
        *("\u304b", "\u3099", "\uf900", "\ud800"),
        *("\U0001d15e", "\U0001d165", "\U0002f800"),  # outside the BMP
    ]
)


@given(text=st.one_of(st.text(), st.lists(TRICKY, max_size=12).map("".join)))
@settings(max_examples=500, deadline=None)
def test_nfc_pieces_and_the_offset_map_agree_with_unicodedata(text: str) -> None:
    nfc, changes = nfc_with_changes(text)
    assert nfc == unicodedata.normalize("NFC", text)
    offsets = OffsetMap(changes)
    for nfc_offset in range(len(nfc) + 1):
        original = offsets.offset(nfc_offset)
        assert offsets.can_cut(nfc_offset) == (original is not None)
        if original is not None:  # a cut of the text with the same NFC halves
            assert unicodedata.normalize("NFC", text[:original]) == nfc[:nfc_offset]
            assert unicodedata.normalize("NFC", text[original:]) == nfc[nfc_offset:]
