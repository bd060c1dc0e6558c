"""The benchmark's warm-ups: which variants each prompt finds in its store."""

from __future__ import annotations

from tiny_models import chunk, random_ids, text, tiny_lm

from chunkcache.core.bench.policies import reordered_request, warm_store
from chunkcache.core.kv_store import ROOT_CONTEXT, extend_context

SYSTEM, HEAD, SEP, QUESTION = (
    text(random_ids(n, seed)) for n, seed in ((6, 1), (3, 2), (1, 3), (5, 4))
)
CHUNKS = [chunk(f"c{i}", random_ids(8, 10 + i)) for i in range(4)]
PROMPT = [SYSTEM, HEAD, CHUNKS[0], SEP, CHUNKS[1], SEP, CHUNKS[2], SEP, CHUNKS[3], QUESTION]


def test_reordered_request_shuffles_the_chunks_among_their_places() -> None:
    earlier = reordered_request(PROMPT)
    places = [i for i, segment in enumerate(PROMPT) if segment.is_chunk]
    assert len(earlier) == places[-1] + 1  # the question is not part of it
    assert [s for s in earlier if not s.is_chunk] == [SYSTEM, HEAD, SEP, SEP, SEP]
    assert [earlier[i] for i in places] != CHUNKS
    assert sorted(s.segment_id for s in earlier if s.is_chunk) == ["c0", "c1", "c2", "c3"]
    assert reordered_request(PROMPT) == earlier  # seeded by the prompt: every warm-up agrees


def test_reordered_request_of_a_single_chunk_keeps_it() -> None:
    assert reordered_request([SYSTEM, CHUNKS[0], QUESTION]) == [SYSTEM, CHUNKS[0]]


def test_reordered_warm_up_adds_the_earlier_request_as_each_chunks_latest_variant() -> None:
    lm = tiny_lm()
    earlier = reordered_request(PROMPT)
    store = warm_store(lm, PROMPT, "full", "reordered")
    after_system = extend_context(ROOT_CONTEXT, SYSTEM.segment_id)
    context = ROOT_CONTEXT
    for segment in earlier:
        if segment.is_chunk:
            variants = store.variants(lm.fingerprint, segment.segment_id)  # latest first
            assert [v.context for v in variants] == [context, after_system]
        context = extend_context(context, segment.segment_id)
    # the earlier request's text is not kept: the system prefix stays the only exact hit
    assert store.exact(lm.fingerprint, HEAD.segment_id, after_system) is None
    assert store.exact(lm.fingerprint, SYSTEM.segment_id, ROOT_CONTEXT) is not None


def test_cachecraft_warm_up_gives_both_variants_their_metadata() -> None:
    lm = tiny_lm()
    store = warm_store(lm, PROMPT, "cachecraft", "reordered")
    for segment in CHUNKS:
        variants = store.variants(lm.fingerprint, segment.segment_id)
        assert len(variants) == 2 and all(v.meta is not None for v in variants)


def test_system_warm_up_stores_each_chunk_after_the_system_prefix() -> None:
    lm = tiny_lm()
    store = warm_store(lm, PROMPT, "full")
    after_system = extend_context(ROOT_CONTEXT, SYSTEM.segment_id)
    for segment in CHUNKS:
        variants = store.variants(lm.fingerprint, segment.segment_id)
        assert [v.context for v in variants] == [after_system]
