"""Review of the decoding path: stop strings and streamed text on byte-level and byte-fallback
tokenizers, sampling at its edges, and what a backend reports when a stop string cuts."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from tiny_models import tiny_lm
from tokenizers import Tokenizer, decoders, models
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from chunkcache.core.engine import ChunkEngine, Prefilled
from chunkcache.core.generation import GenerationRequest, SamplingParams
from chunkcache.core.local_backend import LocalBackend
from chunkcache.core.sampling import StopChecker, sample_token
from chunkcache.core.segmenter import TextSegment
from chunkcache.core.text_stream import TextStream

EOS = 2  # "</s>" in every tokenizer below
SPECIALS = ["<unk>", "<s>", "</s>"]


def gpt2_byte_chars() -> list[str]:
    """The character GPT-2's byte-level BPE shows for each byte 0..255."""
    shown = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    shown += range(ord("®"), ord("ÿ") + 1)
    hidden = [b for b in range(256) if b not in shown]
    chars = {b: chr(b) for b in shown} | {b: chr(256 + i) for i, b in enumerate(hidden)}
    return [chars[b] for b in range(256)]


Encode = Callable[[str], list[int]]


def byte_level_tokenizer() -> tuple[PreTrainedTokenizerFast, Encode]:
    """One token per byte, decoded like GPT-2 / SmolLM2 / Qwen2 (byte-level BPE): the bytes
    of an unfinished character show as one U+FFFD."""
    pieces = SPECIALS + gpt2_byte_chars()  # byte b is token 3 + b
    backend = Tokenizer(models.WordLevel({p: i for i, p in enumerate(pieces)}, "<unk>"))
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="</s>")
    return tokenizer, lambda text: [3 + b for b in text.encode()]


def byte_fallback_tokenizer() -> tuple[PreTrainedTokenizerFast, Encode]:
    """SentencePiece with byte fallback (Llama 2, Mistral): ASCII characters are tokens, any
    other character its UTF-8 bytes ``<0xNN>``; an unfinished character shows one U+FFFD per
    byte, more characters than it will hold."""
    ascii_chars = [chr(c) for c in range(32, 127)]
    pieces = SPECIALS + [f"<0x{b:02X}>" for b in range(256)] + ascii_chars
    vocab = {p: i for i, p in enumerate(pieces)}
    backend = Tokenizer(models.WordLevel(vocab, "<unk>"))
    backend.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Fuse()])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="</s>")

    def encode(text: str) -> list[int]:
        return [
            i
            for char in text
            for i in ([vocab[char]] if char in vocab else [3 + b for b in char.encode()])
        ]

    return tokenizer, encode


TOKENIZERS = {"byte_level": byte_level_tokenizer(), "byte_fallback": byte_fallback_tokenizer()}


def stream_text(
    tokenizer: Any, ids: list[int], stop: tuple[str, ...]
) -> tuple[list[str], TextStream]:
    """Push ``ids`` through a :class:`TextStream` as a backend does: every piece, the final
    one included."""
    stream = TextStream(tokenizer, {EOS}, stop)
    pieces: list[str] = []
    for token in ids:
        pieces.append(stream.push(token))
        if stream.finished:
            break
    pieces.append(stream.finish())
    return pieces, stream


def first_stop(text: str, stop: tuple[str, ...]) -> int | None:
    found = [text.find(s) for s in stop if s and s in text]
    return min(found) if found else None


CASES = [
    ("x你 more", ("x你",)),  # a stop whose last character arrives in bytes after its first
    ("abc你好xyz", ("c你好",)),
    ("say STOP now", ("STOP",)),  # spans several tokens
    ("STOP at the start", ("STOP",)),
    ("one two three", ("three", "two", "ne t")),  # a later stop string matches earliest
    ("abcd", ("bc", "bcd")),  # one stop string is a prefix of another
    ("abc", ("",)),  # an empty stop string stops nothing
    ("a😀b你 ok", ()),
    ("x 你好😀 y", ("😀",)),
    ("😀😀 end", ("😀😀",)),
    ("a你好b", ("好b",)),
    ("naïve café au lait", ("é a",)),
    ("ab你好", ("b你好c",)),  # never matches: the held-back end comes out at finish
]


@pytest.mark.parametrize("kind", TOKENIZERS)
@pytest.mark.parametrize(("text", "stop"), CASES)
def test_the_stream_emits_exactly_the_answer_cut_at_the_first_stop(
    kind: str, text: str, stop: tuple[str, ...]
) -> None:
    """Pieces are never taken back: their concatenation must be the answer cut at the first
    stop string, with no U+FFFD of a character whose bytes were still arriving."""
    tokenizer, encode = TOKENIZERS[kind]
    ids = encode(text)
    assert tokenizer.decode(ids) == text
    pieces, stream = stream_text(tokenizer, ids, stop)
    cut = first_stop(text, stop)
    assert "".join(pieces) == text[:cut]
    assert not any("\ufffd" in piece for piece in pieces)
    assert stream.finish_reason == ("length" if cut is None else "stop")
    if cut is not None:  # counted up to the token that completed the stop string, no further
        decoded = [str(tokenizer.decode(ids[:n])) for n in range(len(ids) + 1)]
        completing = [n for n, t in enumerate(decoded) if first_stop(t, stop) is not None]
        assert len(stream.tokens) == completing[0]


def test_text_shorter_than_the_holdback_is_all_held() -> None:
    """``text[: len(text) - holdback]`` went negative and emitted the start of a stop."""
    checker = StopChecker(("STOP", "xy"))
    assert [checker.split(t) for t in ("S", "ST", "STO")] == [("", False)] * 3
    assert checker.split("STOP") == ("", True)


def test_an_eos_first_ends_the_stream_with_no_text_and_no_tokens() -> None:
    pieces, stream = stream_text(byte_level_tokenizer()[0], [EOS, 3 + ord("a")], ("a",))
    assert pieces == ["", ""]
    assert stream.finish_reason == "stop" and stream.tokens == []


@pytest.mark.slow
def test_the_default_model_tokenizer_streams_cjk_and_emoji_whole() -> None:
    """SmolLM2's byte-level BPE merges bytes across character boundaries."""
    from chunkcache.core.model_files import pull_default_model

    tokenizer = AutoTokenizer.from_pretrained(pull_default_model())
    text = "Réponse : 你好\uff0c世界\uff01🙂👍🏽 naïve — “quotes” 東京 then STOP here"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids) == text
    for stop in [(), ("STOP",), ("世界",), ("👍🏽 n",), ("\uff01🙂",)]:
        pieces, _ = stream_text(tokenizer, ids, stop)
        assert "".join(pieces) == text[: first_stop(text, stop)]
        assert not any("\ufffd" in piece for piece in pieces)


# Sampling at the edges.


def draws(logits: list[float], n: int = 200, **settings: Any) -> set[int]:
    params = SamplingParams(**settings)
    generator = torch.Generator().manual_seed(0)
    tensor = torch.tensor(logits)  # [V] float32
    return {sample_token(tensor, params, generator) for _ in range(n)}


@pytest.mark.parametrize("temperature", [1e-50, 1e-300, 5e-324])
def test_a_temperature_below_float32_range_still_samples_the_argmax(temperature: float) -> None:
    assert draws([1.0, 30.0, -5.0, 29.5], n=20, temperature=temperature) == {1}


def test_top_p_keeps_the_fewest_tokens_that_reach_it() -> None:
    """Four equally likely tokens: two of them already hold half the mass."""
    assert len(draws([0.0] * 4, temperature=1.0, top_p=0.5)) == 2
    assert len(draws([0.0] * 4, temperature=1.0, top_p=0.51)) == 3
    assert draws([0.0, 1.0, 2.0], temperature=1.0, top_p=0.3) == {2}  # one token reaches it
    assert draws([0.0, 1.0, 2.0], temperature=1.0, top_p=1.0) == {0, 1, 2}


def test_infinite_logits_share_all_the_probability() -> None:
    inf = math.inf
    assert draws([0.0, inf, 3.0, -inf], temperature=0.7) == {1}
    assert draws([0.0, inf, 3.0, inf], temperature=0.7, top_p=0.9) == {1, 3}
    assert draws([0.0, inf, 3.0, -inf], n=1, temperature=0.0) == {1}
    assert draws([-inf, 1.0, -inf], temperature=2.0) == {1}  # masked tokens never come


@pytest.mark.parametrize("temperature", [0.0, 0.8])
@pytest.mark.parametrize("logits", [[0.0, math.nan, 1.0], [-math.inf, -math.inf]])
def test_logits_no_token_can_come_from_are_a_clear_error(
    temperature: float, logits: list[float]
) -> None:
    with pytest.raises(RuntimeError, match="logit"):
        draws(logits, n=1, temperature=temperature)


def test_a_seed_gives_the_same_tokens() -> None:
    logits = torch.randn(300, generator=torch.Generator().manual_seed(5))  # [V]
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=11)

    def run() -> list[int]:
        generator = torch.Generator().manual_seed(11)
        return [sample_token(logits, params, generator) for _ in range(30)]

    first = run()
    assert first == run() and len(set(first)) > 1


def test_a_bad_recompute_ratio_is_a_value_error() -> None:
    for bad in ("0.5", True, math.nan, -0.1):
        with pytest.raises(ValueError, match="recompute_ratio"):
            GenerationRequest([TextSegment("hi")], recompute_ratio=bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("segments", ["a prompt", ["a prompt"], [TextSegment("hi"), None]])
def test_segments_that_are_not_segments_are_a_type_error(segments: Any) -> None:
    """Before: accepted, and an AttributeError deep in the backend at the first token."""
    with pytest.raises(TypeError, match="segments must be TextSegment or ChunkSegment"):
        GenerationRequest(segments)


# A backend on the tiny model: what it reports when a stop string cuts.


@pytest.fixture(scope="module")
def backend() -> LocalBackend:
    return LocalBackend(ChunkEngine(tiny_lm("llama")))


PROMPT = [TextSegment("w1 w2 w3 w4 w5 w6 w7 w8 w9")]


def answer(backend: LocalBackend, **settings: Any) -> tuple[str, Any]:
    request = GenerationRequest(PROMPT, policy="full", sampling=SamplingParams(**settings))
    pieces = list(backend.stream(request))
    return "".join(piece.text for piece in pieces), pieces[-1].stats


def test_usage_counts_the_tokens_up_to_the_stop_and_the_text_ends_before_it(
    backend: LocalBackend,
) -> None:
    engine = backend.engine
    segments = backend.segment_tokenizer(PROMPT)
    prefilled = engine.prefill(segments, "full", reserve=16)
    tokens = list(engine.decode(prefilled, SamplingParams(max_tokens=16)))
    full, _ = answer(backend, max_tokens=16)
    words = full.split(" ")
    assert len(words) >= 4, full
    stop = f"{words[1][-1]} {words[2][:2]}"  # spans two tokens
    text, stats = answer(backend, max_tokens=16, stop=(stop,))
    assert text == full[: full.index(stop)]
    assert stats.finish_reason == "stop"
    assert stats.prompt_tokens == sum(len(segment.ids) for segment in segments)
    decoded = [
        backend.tokenizer.decode(tokens[:n], skip_special_tokens=True)
        for n in range(len(tokens) + 1)
    ]
    assert stats.completion_tokens == next(n for n, t in enumerate(decoded) if stop in t)


def test_one_token_and_a_seed_are_honoured(backend: LocalBackend) -> None:
    _, stats = answer(backend, max_tokens=1)
    assert stats.completion_tokens <= 1 and stats.finish_reason in ("length", "stop")
    sampled = [answer(backend, max_tokens=8, temperature=1.0, top_p=0.8, seed=3) for _ in range(2)]
    assert sampled[0][0] == sampled[1][0]
    greedy, _ = answer(backend, max_tokens=8)
    assert answer(backend, max_tokens=8, temperature=1e-30, seed=1)[0] == greedy


class EosFirstEngine(ChunkEngine):
    def decode(self, prefilled: Prefilled, params: SamplingParams) -> Iterator[int]:
        yield next(iter(self.lm.eos_ids))


def test_eos_as_the_first_token_is_an_empty_stopped_answer() -> None:
    backend = LocalBackend(EosFirstEngine(tiny_lm("llama")))
    text, stats = answer(backend, max_tokens=4)
    assert text == "" and stats.finish_reason == "stop" and stats.completion_tokens == 0
