"""A stream over ``chunkcache serve`` has the local backend's pieces: the text a backend holds
back to the end (for a stop string, or a character's last bytes) arrives with the stats, in
one piece, not as a piece of its own followed by an empty one with the stats.  The server
sends that text in the chunk with ``finish_reason``, which plain OpenAI clients read as
they read any chunk."""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import httpx
import openai
import pytest
from fake_backend import FakeBackend
from langchain_core.messages import HumanMessage

from chunkcache.core.cache import ChunkCache
from chunkcache.core.generation import (
    Backend,
    GenerationChunk,
    GenerationRequest,
    GenerationStats,
    SamplingParams,
)
from chunkcache.core.http_backend import HttpBackend
from chunkcache.core.segmenter import TextSegment
from chunkcache.core.serve import create_app
from chunkcache.core.serve.launcher import serve_app
from chunkcache.integrations.langchain_llm import ChunkCacheLLM

# What a backend may stream: pieces of text, then the last one, with the stats.
SHAPES = {
    "held-back": (["The", " answer"], " is here"),
    "nothing-held": (["The", " answer"], ""),
    "all-held": ([], "The answer"),
    "no-text": ([], ""),
}


class Scripted(FakeBackend):
    """Streams ``SHAPES[shape]`` for a prompt naming ``shape``; its chat template gives the
    last message's content."""

    def render_chat(self, messages: Sequence[Mapping[str, str]]) -> str:
        return messages[-1]["content"]

    def stream(self, request: GenerationRequest) -> Iterator[GenerationChunk]:
        self.requests.append(request)
        pieces, last = SHAPES[request.segments[-1].text]
        yield from (GenerationChunk(text) for text in pieces)
        completion = len(pieces) + bool(last)
        stats = GenerationStats("full", 1, computed_tokens=1, completion_tokens=completion)
        stats.finish_reason = "stop"
        yield GenerationChunk(last, stats)


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[HttpBackend, Scripted]]:
    backend = Scripted()
    with serve_app(create_app(backend)) as url:
        http = HttpBackend(url)
        yield http, backend
        http.close()


def layout(pieces: Iterator[GenerationChunk]) -> list[tuple[str, str | None]]:
    """Each piece's text, and its finish reason where it carries the stats."""
    return [(p.text, None if p.stats is None else p.stats.finish_reason) for p in pieces]


def request(shape: str) -> GenerationRequest:
    return GenerationRequest([TextSegment(shape)], sampling=SamplingParams(max_tokens=4))


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_the_http_stream_has_the_local_pieces(
    served: tuple[HttpBackend, Scripted], shape: str
) -> None:
    http, backend = served
    local = layout(backend.stream(request(shape)))
    assert layout(http.stream(request(shape))) == local
    assert local[-1] == (SHAPES[shape][1], "stop")


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_langchain_streams_the_same_chunks_on_both(
    served: tuple[HttpBackend, Scripted], shape: str
) -> None:
    http, backend = served

    def chunks(backend: Backend) -> list[tuple[Any, bool]]:
        llm = ChunkCacheLLM(chunk_cache=ChunkCache(backend=backend))
        return [
            (chunk.content, bool(chunk.response_metadata))
            for chunk in llm.stream([HumanMessage(shape)], max_tokens=4)
        ]

    local = chunks(backend)
    assert chunks(http) == local
    assert local[-1] == (SHAPES[shape][1], True)  # the held text with the metadata


def sse(url: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    """The events of a streamed answer, ``[DONE]`` left out (checked)."""
    with httpx.stream("POST", url, json={**body, "stream": True}) as response:
        lines = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("usage", [True, False])
def test_the_finish_chunk_is_an_openai_chunk(
    served: tuple[HttpBackend, Scripted], shape: str, usage: bool
) -> None:
    """Text and chat completions: one chunk with a finish reason, which carries the held
    text (a chat's first chunk names the role even then); the usage after it, when asked."""
    http, _ = served
    pieces, last = SHAPES[shape]
    shape_text = "".join(pieces) + last
    options = {"stream_options": {"include_usage": True}} if usage else {}
    base = {"model": Scripted.model_name, "max_tokens": 4, **options}
    text = sse(f"{http.base_url}/v1/completions", {**base, "prompt": shape})
    chat = sse(
        f"{http.base_url}/v1/chat/completions",
        {**base, "messages": [{"role": "user", "content": shape}]},
    )
    for events, read in ((text, "text"), (chat, "delta")):
        if usage:
            assert events[-1]["choices"] == [] and "usage" in events[-1]
            events = events[:-1]
        finishes = [e["choices"][0]["finish_reason"] for e in events]
        assert finishes == [None] * (len(events) - 1) + ["stop"]
        if read == "text":
            assert [e["choices"][0]["text"] for e in events] == [*pieces, last]
        else:
            assert "".join(e["choices"][0]["delta"]["content"] for e in events) == shape_text
    assert chat[0]["choices"][0]["delta"]["role"] == "assistant"


def test_a_plain_openai_client_reads_the_held_text(
    served: tuple[HttpBackend, Scripted],
) -> None:
    http, _ = served
    client = openai.OpenAI(base_url=f"{http.base_url}/v1", api_key="none")
    chunks = list(
        client.completions.create(
            model=Scripted.model_name,
            prompt="held-back",
            max_tokens=4,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == "The answer is here"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 3
    client.close()
