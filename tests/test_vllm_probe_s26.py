"""VllmBackend as a user meets it: a seed vLLM would drop, text the tokenizer cannot read,
a timeout httpx cannot use, a server that wants an api_key, and a server that does not
report its cached tokens.  A fake transport stands in for the server (what the real one
does is quoted from vLLM's source where it matters)."""

from __future__ import annotations

import json
import math
import warnings
from typing import Any

import httpx
import pytest

from chunkcache.core.cache import ChunkCache
from chunkcache.core.errors import BackendUnavailableError, InvalidTextError
from chunkcache.core.generation import GenerationRequest, SamplingParams
from chunkcache.core.prompting import generate, prompt_tokens
from chunkcache.core.segmenter import TextSegment
from chunkcache.integrations.langchain import ChunkCacheLLM
from chunkcache.integrations.vllm import VllmBackend


class WordTokenizer:
    """One token per word, as a real tokenizer fails on a lone surrogate (a TypeError)."""

    def encode(self, text: str, add_special_tokens: bool) -> list[str]:
        text.encode("utf-8")  # tokenizers cannot take what UTF-8 cannot encode
        return text.split()


def stream_body(usage: dict[str, Any]) -> bytes:
    events = [
        {"choices": [{"index": 0, "text": "ok", "finish_reason": "stop"}], "usage": None},
        {"choices": [], "usage": usage},
    ]
    return "".join(f"data: {json.dumps(e)}\n\n" for e in events).encode() + b"data: [DONE]\n\n"


USAGE = {"prompt_tokens": 3, "completion_tokens": 1, "prompt_tokens_details": {"cached_tokens": 0}}


class FakeServer:
    """``GET /v1/models`` with a 2048-token window, ``POST /v1/completions`` answering ``ok``
    with ``usage``; or ``status`` with vLLM's body for every request when set."""

    def __init__(self, usage: dict[str, Any] = USAGE, status: int | None = None) -> None:
        self.usage = usage
        self.status = status
        self.bodies: list[dict[str, Any]] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        if self.status is not None:
            # vLLM's AuthenticationMiddleware answers exactly this on /v1/*
            return httpx.Response(self.status, json={"error": "Unauthorized"})
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "smol", "max_model_len": 2048}]})
        self.bodies.append(json.loads(request.content))
        return httpx.Response(200, content=stream_body(self.usage))

    def backend(self) -> VllmBackend:
        return VllmBackend(
            "http://vllm.test",
            "smol",
            tokenizer=WordTokenizer(),
            transport=httpx.MockTransport(self),
        )


def ask(prompt: str = "hello there", **sampling: Any) -> GenerationRequest:
    return GenerationRequest([TextSegment(prompt)], sampling=SamplingParams(**sampling))


def test_the_one_seed_vllm_reads_as_no_seed_is_refused_not_sent() -> None:
    """2**64 - 1 has the bits of -1, and vLLM's SamplingParams turns seed -1 into None:
    the answer would be sampled afresh on every call, the seed silently ignored."""
    server = FakeServer()
    with pytest.raises(ValueError, match=r"seed 2\*\*64 - 1"):
        generate(server.backend(), ask(temperature=0.7, seed=2**64 - 1))
    assert server.bodies == []
    generate(server.backend(), ask(temperature=0.7, seed=2**64 - 2))
    assert server.bodies[-1]["seed"] == -2


@pytest.mark.parametrize(
    ("prompt", "stop"),
    [
        pytest.param("half an emoji \ud83d here", (), id="prompt"),
        pytest.param("hello", ("\udc00",), id="stop"),
    ],
)
def test_a_lone_surrogate_is_invalid_text_before_anything_is_sent(
    prompt: str, stop: tuple[str, ...]
) -> None:
    """As on the local backends: not the tokenizer's TypeError, nor a request vLLM fails."""
    server = FakeServer()
    with pytest.raises(InvalidTextError, match="lone surrogate"):
        generate(server.backend(), ask(prompt, stop=stop))
    assert server.bodies == []


@pytest.mark.parametrize("timeout_s", [math.nan, math.inf, True, -1.0, 0])
def test_a_timeout_httpx_cannot_use_is_refused_when_the_backend_is_made(timeout_s: Any) -> None:
    with pytest.raises(ValueError, match="timeout_s"):
        VllmBackend("http://vllm.test", "smol", timeout_s=timeout_s)


def test_a_missing_or_wrong_api_key_is_the_callers_error_not_an_unavailable_server() -> None:
    """vLLM started with --api-key answers 401 to every /v1 request without that key:
    retrying, or falling back as for a server that is down, cannot help."""
    with pytest.raises(ValueError, match=r"\(401\).*api_key") as raised:
        generate(FakeServer(status=401).backend(), ask())
    assert not isinstance(raised.value, BackendUnavailableError)


def test_a_server_that_does_not_report_cached_tokens_is_named_once() -> None:
    """Without --enable-prompt-tokens-details vLLM's usage has no cached tokens: cache_read 0
    then means unknown, and the app is told so (once per backend), not left to read it as
    a cold cache."""
    server = FakeServer(usage={"prompt_tokens": 3, "completion_tokens": 1})
    backend = server.backend()
    with pytest.warns(UserWarning, match="--enable-prompt-tokens-details"):
        _, stats = generate(backend, ask())
    assert stats.extra["cached_tokens_reported"] is False
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        generate(backend, ask())


class StrictTokenizer:
    """Fails on a lone surrogate as Hugging Face's fast tokenizers do (a TypeError)."""

    def encode(self, text: str, add_special_tokens: bool) -> list[str]:
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            raise TypeError("TextEncodeInput must be Union[TextInputSequence, ...]") from None
        return text.split()


def test_counting_a_prompt_with_a_lone_surrogate_is_invalid_text() -> None:
    """Token counting (the window check, LangChain's get_num_tokens) on a backend that
    counts the whole prompt: InvalidTextError as generation gives, not the tokenizer's
    TypeError."""
    backend = VllmBackend("http://vllm.test", "smol", tokenizer=StrictTokenizer())
    with pytest.raises(InvalidTextError, match="lone surrogate"):
        prompt_tokens(backend, ask("half an emoji \ud83d"))
    llm = ChunkCacheLLM(chunk_cache=ChunkCache(backend=backend))
    with pytest.raises(InvalidTextError, match="lone surrogate"):
        llm.get_num_tokens("half an emoji \ud83d")
