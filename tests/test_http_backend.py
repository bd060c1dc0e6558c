"""HttpBackend against a real uvicorn server over a fake backend, and its failure modes."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from fake_backend import FakeBackend
from langchain_core.messages import HumanMessage, SystemMessage
from pydantic import SecretStr

from chunkcache.core.cache import ChunkCache
from chunkcache.core.errors import BackendUnavailableError, QueueFullError, ShuttingDownError
from chunkcache.core.generation import GenerationChunk, GenerationRequest
from chunkcache.core.http_backend import HttpBackend
from chunkcache.core.prompting import build_request, generate
from chunkcache.core.segmenter import ChunkSegment
from chunkcache.core.serve import ServeSettings, create_app
from chunkcache.core.serve.launcher import serve_app
from chunkcache.core.store.redis_server import free_port
from chunkcache.integrations.langchain_llm import ChunkCacheLLM

CHUNK = "The quick brown fox jumps over the lazy dog near the river bank."


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[str, FakeBackend]]:
    backend = FakeBackend()
    with serve_app(create_app(backend, ServeSettings(api_key=SecretStr("k")))) as url:
        yield url, backend


def test_model_info_and_render(served: tuple[str, FakeBackend]) -> None:
    url, backend = served
    http = HttpBackend(url + "/v1/", api_key="k")
    assert (http.model_name, http.context_window) == (backend.model_name, backend.context_window)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    assert http.render_chat(messages) == backend.render_chat(messages)


def test_segments_travel_as_the_client_split_them(served: tuple[str, FakeBackend]) -> None:
    url, backend = served
    cache = ChunkCache(backend=HttpBackend(url, api_key="k"))
    cache.registry.register("c1", CHUNK)
    request = build_request(f"Context: {CHUNK}\nQ?", cache, max_tokens=3, conversation_id="u-9")
    text, stats = generate(cache.backend, request)
    assert text == "The answer is"
    seen = backend.requests[-1]
    assert seen.segments == request.segments  # the server matched exactly the client's chunks
    assert isinstance(seen.segments[1], ChunkSegment) and seen.segments[1].chunk_id == "c1"
    assert (seen.conversation_id, seen.policy, seen.sampling) == (
        "u-9",
        request.policy,
        request.sampling,
    )
    assert (stats.completion_tokens, stats.finish_reason) == (3, "length")
    assert stats.chunk_misses == 1


def test_chunkcache_llm_through_langchain(served: tuple[str, FakeBackend]) -> None:
    url, _ = served
    cache = ChunkCache(backend=HttpBackend(url, api_key="k"))
    cache.registry.register("c2", CHUNK.replace("fox", "cat"))
    llm = ChunkCacheLLM(chunk_cache=cache, max_tokens=5)
    messages = [SystemMessage("Be brief."), HumanMessage(f"Context: {CHUNK.replace('fox', 'cat')}")]
    llm.invoke(messages)
    answer = llm.invoke(messages)
    assert answer.content == "The answer is in the"
    assert answer.usage_metadata is not None
    assert answer.usage_metadata["input_token_details"]["cache_read"] > 0
    assert answer.response_metadata["chunkcache"]["chunk_hits"] == 1
    streamed = [chunk.content for chunk in llm.stream(messages)]
    assert "".join(str(c) for c in streamed) == "The answer is in the"
    assert len(streamed) > 2  # it streams, piece by piece


def test_server_refusals_become_chunkcache_errors(served: tuple[str, FakeBackend]) -> None:
    url, _ = served
    request = build_request("hello", ChunkCache(), max_tokens=4000)  # over the server's limit
    with pytest.raises(ValueError, match="max_tokens"):
        generate(HttpBackend(url, api_key="k"), request)
    with pytest.raises(BackendUnavailableError, match="401"):
        HttpBackend(url, api_key="wrong").render_chat([{"role": "user", "content": "x"}])


class Refusing(FakeBackend):
    def __init__(self, error: Exception) -> None:
        super().__init__()
        self.error = error

    def stream(self, request: GenerationRequest) -> Iterator[GenerationChunk]:
        raise self.error


@pytest.mark.parametrize(
    ("error", "expected"),
    [
        (QueueFullError("full", 4.0), QueueFullError),
        (RuntimeError("boom"), BackendUnavailableError),
    ],
)
def test_status_codes_map_back(error: Exception, expected: type[Exception]) -> None:
    with serve_app(create_app(Refusing(error))) as url, pytest.raises(expected) as raised:
        generate(HttpBackend(url), build_request("hello", ChunkCache()))
    if isinstance(raised.value, QueueFullError):
        assert raised.value.retry_after_s == 4.0


def test_shutting_down_and_unreachable() -> None:
    app = create_app(FakeBackend())
    with serve_app(app) as url:
        app.state.serve.runner.close()
        with pytest.raises(ShuttingDownError):
            generate(HttpBackend(url), build_request("hello", ChunkCache()))
    with pytest.raises(BackendUnavailableError, match="unreachable"):
        HttpBackend(f"http://127.0.0.1:{free_port()}", model="m").render_chat(
            [{"role": "user", "content": "x"}]
        )
    with pytest.raises(ValueError, match="http"):
        HttpBackend("127.0.0.1:8000")
