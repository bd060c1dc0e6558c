"""Both ChunkCacheLLM wrappers take ``top_p`` 0 and negative seeds as OpenAI's API (and so
``chunkcache serve``) takes them, mapped the same way, on every backend."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import httpx
import pytest
from fake_backend import FakeBackend
from langchain_core.messages import HumanMessage
from llama_index.core.base.llms.types import ChatMessage
from pydantic import ValidationError

from chunkcache.core.cache import ChunkCache
from chunkcache.core.generation import SamplingParams, openai_sampling
from chunkcache.core.serve.schemas import CompletionBody
from chunkcache.integrations import langchain, llama_index
from chunkcache.integrations.vllm import VllmBackend

# (temperature, top_p, seed) as a client written for OpenAI sends them
OPENAI_VALUES = [
    (0.7, 0.0, None),
    (0.0, 0.0, -1),
    (1.3, 0.5, -(2**63)),
    (0.7, 1.0, 2**64 - 1),
    (0.2, 0.9, 0),
]


def langchain_llm(backend: Any = None, **settings: Any) -> langchain.ChunkCacheLLM:
    return langchain.ChunkCacheLLM(
        chunk_cache=ChunkCache(backend=backend or FakeBackend()), **settings
    )


def llama_index_llm(backend: Any = None, **settings: Any) -> llama_index.ChunkCacheLLM:
    return llama_index.ChunkCacheLLM(cache=ChunkCache(backend=backend or FakeBackend()), **settings)


def sent(backend: FakeBackend) -> tuple[float, float, int | None]:
    sampling = backend.requests[-1].sampling
    return sampling.temperature, sampling.top_p, sampling.seed


@pytest.mark.parametrize(("temperature", "top_p", "seed"), OPENAI_VALUES)
def test_the_mapping_is_serves(temperature: float, top_p: float, seed: int | None) -> None:
    body = CompletionBody(model="m", prompt="p", temperature=temperature, top_p=top_p, seed=seed)
    served = {k: v for k, v in body.sampling().items() if k != "stop"}
    assert openai_sampling(temperature, top_p, seed) == served
    SamplingParams(**served)  # which SamplingParams, strict as ever, takes


def langchain_calls(temperature: float, top_p: float, seed: int | None) -> list[Any]:
    """The backends of a LangChain wrapper given the values, and of one given them per call."""
    llm = langchain_llm(temperature=temperature, top_p=top_p, seed=seed)
    llm.invoke([HumanMessage("hi")])
    per_call = langchain_llm()
    per_call.invoke("hi", temperature=temperature, top_p=top_p, seed=seed)
    return [llm.chunk_cache.backend, per_call.chunk_cache.backend]


def llama_index_calls(temperature: float, top_p: float, seed: int | None) -> list[Any]:
    """As :func:`langchain_calls`, for the LlamaIndex wrapper (chat, then completion)."""
    llm = llama_index_llm(temperature=temperature, top_p=top_p, seed=seed)
    llm.chat([ChatMessage(content="hi")])
    per_call = llama_index_llm()
    per_call.complete("hi", temperature=temperature, top_p=top_p, seed=seed)
    return [llm.cache.backend, per_call.cache.backend]


@pytest.mark.parametrize("calls", [langchain_calls, llama_index_calls])
@pytest.mark.parametrize(("temperature", "top_p", "seed"), OPENAI_VALUES)
def test_the_wrappers_take_what_serve_takes(
    calls: Callable[[float, float, int | None], list[Any]],
    temperature: float,
    top_p: float,
    seed: int | None,
) -> None:
    mapped = openai_sampling(temperature, top_p, seed)
    expected = (mapped["temperature"], mapped["top_p"], mapped["seed"])
    backends = calls(temperature, top_p, seed)
    assert [sent(b) for b in backends if isinstance(b, FakeBackend)] == [expected] * 2


REFUSED = r"top_p must be in \[0, 1\]|seed must be an int from -2\*\*63"


@pytest.mark.parametrize(
    "settings",
    [{"top_p": -0.1}, {"top_p": 1.5}, {"seed": -(2**63) - 1}, {"seed": 2**64}],
)
def test_what_serve_refuses_the_wrappers_refuse(settings: dict[str, Any]) -> None:
    with pytest.raises(ValidationError):
        langchain_llm(**settings)
    with pytest.raises(ValidationError):
        llama_index_llm(**settings)
    with pytest.raises(ValueError, match=REFUSED):
        langchain_llm().invoke("hi", **settings)
    with pytest.raises(ValueError, match=REFUSED):
        llama_index_llm().complete("hi", **settings)


def test_top_p_0_does_not_hide_a_bad_temperature() -> None:
    with pytest.raises(ValueError, match="temperature"):
        langchain_llm().invoke("hi", temperature=float("nan"), top_p=0)


class FakeVllm:
    """``GET /v1/models`` and a one-word ``POST /v1/completions`` stream; keeps the bodies."""

    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "smol", "max_model_len": 2048}]})
        self.bodies.append(json.loads(request.content))
        usage = {"prompt_tokens": 3, "completion_tokens": 1, "prompt_tokens_details": {}}
        events = [
            {"choices": [{"text": "Paris", "finish_reason": "stop"}], "usage": None},
            {"choices": [], "usage": usage},
        ]
        lines = [f"data: {json.dumps(e)}\n\n" for e in events] + ["data: [DONE]\n\n"]
        return httpx.Response(200, content="".join(lines).encode())


class WordTokenizer:
    def apply_chat_template(
        self, messages: Any, tokenize: bool, add_generation_prompt: bool
    ) -> str:
        return "".join(f"{m['role']}: {m['content']}\n" for m in messages)

    def encode(self, text: str, add_special_tokens: bool) -> list[str]:
        return text.split()


def vllm_llm(server: FakeVllm) -> langchain.ChunkCacheLLM:
    backend = VllmBackend(
        "http://vllm.test", "smol", tokenizer=WordTokenizer(), transport=httpx.MockTransport(server)
    )
    return langchain_llm(backend)


@pytest.mark.filterwarnings("ignore:vLLM at .* does not report cached prompt tokens")
def test_vllm_gets_greedy_for_top_p_0_and_negative_seeds_with_their_bits() -> None:
    server = FakeVllm()
    llm = vllm_llm(server)
    llm.invoke("hi", temperature=0.8, top_p=0)
    llm.invoke("hi", temperature=0.8, seed=-2)
    body = server.bodies
    assert (body[0]["temperature"], body[0]["top_p"]) == (0.0, 1.0)
    assert (body[1]["temperature"], body[1]["seed"]) == (0.8, -2)  # torch's seed 2**64 - 2


def test_vllm_refuses_seed_minus_1_which_it_reads_as_no_seed() -> None:
    server = FakeVllm()
    with pytest.raises(ValueError, match="or -1"):
        vllm_llm(server).invoke("hi", temperature=0.8, seed=-1)
    assert server.bodies == []
