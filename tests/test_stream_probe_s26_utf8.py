"""An answer cut (by ``max_tokens`` or an EOS) while a character's bytes were still arriving
ends before that character, as vLLM's detokenizer ends it: never with a U+FFFD, the same in
every piece, streamed or whole, through the backends and ``chunkcache serve``."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from test_review_decoding import EOS, TOKENIZERS, byte_level_tokenizer, stream_text
from tiny_models import tiny_hf_model
from transformers import AutoTokenizer

from chunkcache.core.engine import ChunkEngine, Prefilled
from chunkcache.core.generation import GenerationRequest, SamplingParams
from chunkcache.core.local_backend import LocalBackend
from chunkcache.core.models import LoadedModel
from chunkcache.core.segmenter import TextSegment
from chunkcache.core.serve import create_app
from chunkcache.core.serve.launcher import serve_app

ANSWER = "ok 你好😀"
MODEL = "chunkcache-local"


@pytest.mark.parametrize("kind", TOKENIZERS)
@pytest.mark.parametrize("cut", [1, 2, 3])  # bytes of the last character left out
@pytest.mark.parametrize("stop", [(), ("zz",), ("😀",)])
def test_a_cut_inside_a_character_ends_before_it(
    kind: str, cut: int, stop: tuple[str, ...]
) -> None:
    tokenizer, encode = TOKENIZERS[kind]
    ids = encode(ANSWER)[:-cut]
    pieces, stream = stream_text(tokenizer, ids, stop)
    assert "".join(pieces) == "ok 你好"
    assert stream.finish_reason == "length" and stream.tokens == ids  # all counted


@pytest.mark.parametrize("kind", TOKENIZERS)
def test_an_eos_inside_a_character_ends_before_it(kind: str) -> None:
    tokenizer, encode = TOKENIZERS[kind]
    ids = encode("ab你")[:-1]
    pieces, stream = stream_text(tokenizer, [*ids, EOS], ())
    assert "".join(pieces) == "ab"
    assert stream.finish_reason == "stop" and stream.tokens == ids


@pytest.mark.parametrize("kind", TOKENIZERS)
def test_a_character_never_finished_in_the_middle_stays(kind: str) -> None:
    """Bytes that can never join (a character cut by the next one) are the model's output."""
    tokenizer, encode = TOKENIZERS[kind]
    ids = [*encode("a你")[:-1], *encode("b")]
    pieces, _ = stream_text(tokenizer, ids, ())
    assert "".join(pieces) == tokenizer.decode(ids)
    assert "".join(pieces).endswith("\ufffdb")


class ScriptedEngine(ChunkEngine):
    """Decodes ``script`` whatever the prompt, as far as ``max_tokens`` lets it."""

    def __init__(self, lm: LoadedModel, script: list[int]) -> None:
        super().__init__(lm)
        self.script = script

    def decode(self, prefilled: Prefilled, params: SamplingParams) -> Iterator[int]:
        yield from self.script[: params.max_tokens]


def byte_level_backend(script: list[int]) -> LocalBackend:
    tokenizer, _ = byte_level_tokenizer()
    engine = ScriptedEngine(LoadedModel.from_hf(tiny_hf_model(vocab_size=259), tokenizer), script)
    return LocalBackend(engine)


@pytest.fixture(scope="module")
def served() -> Iterator[str]:
    _, encode = byte_level_tokenizer()
    with serve_app(create_app(byte_level_backend(encode(ANSWER)))) as url:
        yield url


def sse_events(client: httpx.Client, body: dict[str, Any]) -> list[dict[str, Any]]:
    with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
        assert response.status_code == 200
        data = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    return [json.loads(event) for event in data[:-1]]


@pytest.mark.parametrize("cut", [1, 3])
def test_serve_ends_before_the_cut_character_streamed_or_whole(served: str, cut: int) -> None:
    max_tokens = len(ANSWER.encode()) - cut
    body = {"model": MODEL, "prompt": "hi", "max_tokens": max_tokens, "temperature": 0}
    with httpx.Client(base_url=served, timeout=30) as client:
        whole = client.post("/v1/completions", json=body).json()
        events = sse_events(client, {**body, "stream_options": {"include_usage": True}})
    assert whole["choices"][0]["text"] == "ok 你好"
    assert whole["choices"][0]["finish_reason"] == "length"
    assert whole["usage"]["completion_tokens"] == max_tokens
    streamed = "".join(c["text"] for e in events for c in e["choices"])
    assert streamed == "ok 你好"
    assert [c["finish_reason"] for c in events[-2]["choices"]] == ["length"]
    assert events[-1]["usage"]["completion_tokens"] == max_tokens


def test_the_local_backend_ends_before_the_cut_character() -> None:
    _, encode = byte_level_tokenizer()
    backend = byte_level_backend(encode(ANSWER))
    request = GenerationRequest([TextSegment("hi")], sampling=SamplingParams(max_tokens=11))
    pieces = list(backend.stream(request))
    assert "".join(p.text for p in pieces) == "ok 你好"
    stats = pieces[-1].stats
    assert stats is not None and stats.completion_tokens == 11


@pytest.mark.slow
def test_the_default_model_tokenizer_cut_in_an_emoji() -> None:
    from chunkcache.core.model_files import pull_default_model

    tokenizer = AutoTokenizer.from_pretrained(pull_default_model())
    ids = tokenizer.encode("Yes 👍🏽 你好", add_special_tokens=False)
    whole = [str(tokenizer.decode(ids[:n])) for n in range(len(ids) + 1)]
    cuts = [n for n, text in enumerate(whole) if text.endswith("\ufffd")]
    assert cuts  # SmolLM2 spreads these characters over several tokens
    for n in cuts:
        pieces, stream = stream_text(tokenizer, ids[:n], ())
        assert "".join(pieces) == whole[n].rstrip("\ufffd")
        assert stream.finish_reason == "length" and len(stream.tokens) == n
