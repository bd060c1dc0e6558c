"""The local backend on a tiny model: tokenization per segment, streaming, stop, stats."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest
from tiny_models import tiny_lm, tiny_tokenizer

from chunkcache.core.engine import ChunkEngine, Prefilled
from chunkcache.core.errors import InvalidTextError
from chunkcache.core.generation import GenerationRequest, GenerationStats, Policy, SamplingParams
from chunkcache.core.local_backend import LocalBackend
from chunkcache.core.models import LoadedModel
from chunkcache.core.sampling import StopChecker
from chunkcache.core.segmenter import ChunkSegment, TextSegment

CHUNK = ChunkSegment("chunk-1", "the quick brown fox jumps over the lazy dog " * 3)


@pytest.fixture(scope="module")
def backend() -> LocalBackend:
    lm = tiny_lm("llama")
    lm_with_tokenizer = LoadedModel(lm.hf, tiny_tokenizer(), lm.spec, lm.rope, lm.fingerprint)
    return LocalBackend(ChunkEngine(lm_with_tokenizer))


def run(backend: LocalBackend, **kwargs: object) -> tuple[str, object]:
    request = GenerationRequest(
        [TextSegment("system: answer. "), CHUNK, TextSegment(" question?")],
        sampling=SamplingParams(max_tokens=8),
        **kwargs,  # type: ignore[arg-type]
    )
    pieces = list(backend.stream(request))
    assert all(piece.stats is None for piece in pieces[:-1])
    return "".join(piece.text for piece in pieces), pieces[-1].stats


def test_second_request_reuses_the_chunk(backend: LocalBackend) -> None:
    _, first = run(backend, policy="full")
    _, second = run(backend, policy="cacheblend")
    assert first.chunk_misses == 1  # type: ignore[attr-defined]
    assert second.reused_tokens > 0  # type: ignore[attr-defined]
    assert second.completion_tokens > 0  # type: ignore[attr-defined]


def test_policies_agree_on_an_exact_prefix(backend: LocalBackend) -> None:
    full_text, _ = run(backend, policy="full")
    prefix_text, stats = run(backend, policy="prefix")
    assert prefix_text == full_text
    assert stats.computed_tokens == 1  # type: ignore[attr-defined]


def test_a_chunk_id_sent_with_another_text_never_serves_the_old_one(
    backend: LocalBackend,
) -> None:
    """A caller's id is bound to its text: an edited document, or another tenant's text
    under the same id, is a miss computed from the text sent, never the old tokens or KV."""

    def ask(text: str, policy: Policy) -> GenerationStats:
        request = GenerationRequest(
            [TextSegment("system: answer. "), ChunkSegment("doc-7", text), TextSegment(" q?")],
            sampling=SamplingParams(max_tokens=1),
            policy=policy,
        )
        stats = list(backend.stream(request))[-1].stats
        assert stats is not None
        return stats

    old, new = "the old text of the doc " * 3, "another, longer and newer text of it " * 3
    ask(old, "full")
    edited = ask(new, "reuse")
    assert (edited.chunk_hits, edited.chunk_misses) == (0, 1)
    assert edited.prompt_tokens == ask(new, "full").prompt_tokens
    assert ask(new, "reuse").chunk_hits == 1
    assert ask(old, "reuse").chunk_hits == 1  # the old text keeps its own entry


@pytest.mark.parametrize("where", ["text", "chunk"])
def test_a_lone_surrogate_is_refused_with_a_clear_error(backend: LocalBackend, where: str) -> None:
    bad = "half an emoji: \ud83d."
    segment = TextSegment(bad) if where == "text" else ChunkSegment("chunk-bad", bad * 2)
    request = GenerationRequest(
        [TextSegment("system: "), segment], sampling=SamplingParams(max_tokens=1)
    )
    with pytest.raises(InvalidTextError, match=r"not valid Unicode: \\ud83d at character 15"):
        list(backend.stream(request))
    assert run(backend, policy="full")[0]  # the backend still answers


def test_stop_checker_holds_back_a_possible_stop_prefix() -> None:
    checker = StopChecker(("STOP",))
    assert checker.split("abc ST") == ("abc", False)
    assert checker.split("abc STOP more") == ("abc ", True)
    assert checker.final("abc ST") == "abc ST"


class CountingEngine(ChunkEngine):
    """Counts the tokens its decode yields, and whether that decode was closed."""

    decoded = 0
    closed = False

    def decode(self, prefilled: Prefilled, params: SamplingParams) -> Iterator[int]:
        try:
            for token in super().decode(prefilled, params):
                self.decoded += 1
                yield token
        finally:
            self.closed = True


def test_closing_a_stream_stops_decoding_at_once() -> None:
    engine = CountingEngine(tiny_lm("llama"))
    backend = LocalBackend(engine)
    words = " ".join(f"w{(14 + i * 3) % 120}" for i in range(16))
    request = GenerationRequest([TextSegment(words)], sampling=SamplingParams(max_tokens=300))
    stream = backend.stream(request)
    assert next(stream).text
    decoded = engine.decoded
    stream.close()  # type: ignore[attr-defined]
    assert engine.closed and engine.decoded == decoded < 300
    # the engine is free again: the next request runs at once
    after = ThreadPoolExecutor(1).submit(lambda: list(backend.stream(request)))
    assert after.result(timeout=60)[-1].stats is not None
