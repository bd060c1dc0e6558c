"""A request without max_tokens generates up to the room its prompt leaves in the context window
(``SamplingParams.fit_window``), applied by the backend that tokenizes the prompt anyway: the
server never tokenizes it, and the local, batching and http backends all honour it."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import pytest
from fastapi.testclient import TestClient
from tiny_models import tiny_lm

from chunkcache.core.batching import BatchingBackend
from chunkcache.core.engine import ChunkEngine, Prefilled, TokenSegment
from chunkcache.core.generation import GenerationRequest, SamplingParams
from chunkcache.core.http_backend import HttpBackend
from chunkcache.core.local_backend import LocalBackend
from chunkcache.core.models import LoadedModel
from chunkcache.core.prompting import generate
from chunkcache.core.segmenter import TextSegment
from chunkcache.core.serve import ServeSettings, create_app
from chunkcache.core.serve.launcher import serve_app

DEFAULT = 16  # the server's default max_tokens in these tests
CHUNK = " ".join(f"w{i}" for i in range(40, 60))


@pytest.fixture(scope="module")
def lm() -> LoadedModel:
    return tiny_lm("llama")


class RecordingEngine(ChunkEngine):
    """Records the ``reserve`` (tokens to generate) of every prefill."""

    def __init__(self, lm: LoadedModel) -> None:
        super().__init__(lm)
        self.reserves: list[int] = []

    def prefill(self, segments: Sequence[TokenSegment], *args: Any, **kwargs: Any) -> Prefilled:
        self.reserves.append(kwargs["reserve"])
        return super().prefill(segments, *args, **kwargs)


class CountingTokenizer:
    """A tokenizer whose calls are recorded: ``texts`` holds every text it tokenized."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.texts: list[str] = []

    def __call__(self, text: str, **kwargs: Any) -> Any:
        self.texts.append(text)
        return self.tokenizer(text, **kwargs)


Served = tuple[TestClient, RecordingEngine, CountingTokenizer, int]


@pytest.fixture(params=["local", "batching"])
def served(request: pytest.FixtureRequest, lm: LoadedModel) -> Iterator[Served]:
    engine = RecordingEngine(lm)
    backend = LocalBackend(engine) if request.param == "local" else BatchingBackend(engine)
    counting = CountingTokenizer(backend.segment_tokenizer.tokenizer)
    backend.segment_tokenizer.tokenizer = counting
    app = create_app(backend, ServeSettings(default_max_tokens=DEFAULT))
    with TestClient(app) as client:
        yield client, engine, counting, backend.context_window


def words(n: int, start: int = 0) -> str:
    """``n`` words of the tiny vocabulary, one token each."""
    return " ".join(f"w{(start + i) % 120}" for i in range(n))


def complete(client: TestClient, prompt: str, **body: Any) -> Any:
    return client.post(
        "/v1/completions", json={"model": "chunkcache-local", "prompt": prompt, **body}
    )


def test_a_prompt_without_max_tokens_is_tokenized_once(served: Served) -> None:
    client, _, counting, _ = served
    prompt = f"{words(5)} {CHUNK} {words(5, 60)}"
    chunks = {"chunks": [{"id": "c1", "text": CHUNK}]}
    response = complete(client, prompt, temperature=0, chunkcache=chunks)
    assert response.status_code == 200, response.text
    # the text around the chunk; a chunk has a tokenizer of its own and its tokens are cached
    assert sorted(counting.texts) == sorted([f"{words(5)} ", f" {words(5, 60)}"])


@pytest.mark.parametrize(
    ("room", "limit", "reserve"),
    [
        (200, {}, DEFAULT),  # room enough: the default
        (4, {}, 4),  # less room than the default: up to the end of the window
        (4, {"max_completion_tokens": 3}, 3),  # a limit given is kept
        (4, {"max_tokens": 10, "chunkcache": {"fit_window": True}}, 4),  # asked to fit
    ],
)
def test_without_max_tokens_the_backend_generates_up_to_the_room_left(
    served: Served, room: int, limit: dict[str, Any], reserve: int
) -> None:
    client, engine, _, window = served
    response = complete(client, words(window - room), temperature=0, **limit)
    assert response.status_code == 200, response.text
    assert engine.reserves == [reserve]
    assert 0 < response.json()["usage"]["completion_tokens"] <= reserve


@pytest.mark.parametrize(
    ("room", "limit", "reserves"),
    [
        (0, {}, []),  # no room: refused before any prefill
        (4, {"max_tokens": 5}, [5]),  # a limit that does not fit: the engine refuses it
    ],
)
def test_a_prompt_that_leaves_too_little_room_is_a_400(
    served: Served, room: int, limit: dict[str, int], reserves: list[int]
) -> None:
    client, engine, _, window = served
    response = complete(client, words(window - room), **limit)
    assert response.status_code == 400
    error = response.json()["error"]
    assert (error["code"], error["type"]) == ("prompt_too_long", "invalid_request_error")
    assert f"context window of {window}" in error["message"]
    assert engine.reserves == reserves


def test_the_http_backend_has_its_server_fit_the_window(lm: LoadedModel) -> None:
    engine = RecordingEngine(lm)
    backend = LocalBackend(engine)
    window = backend.context_window
    with serve_app(create_app(backend)) as url:
        http = HttpBackend(url)
        try:
            for max_tokens, fit_window in [(10, True), (3, True), (3, False)]:
                sampling = SamplingParams(max_tokens=max_tokens, fit_window=fit_window)
                request = GenerationRequest([TextSegment(words(window - 4))], sampling=sampling)
                generate(http, request)
            # without fit_window, 256 tokens do not fit: the server's engine refuses them
            with pytest.raises(ValueError, match="context window of"):
                generate(http, GenerationRequest([TextSegment(words(window - 4))]))
        finally:
            http.close()
    assert engine.reserves == [4, 3, 3, 256]


def test_fit_window_must_be_a_bool() -> None:
    with pytest.raises(ValueError, match="fit_window must be a bool"):
        SamplingParams(fit_window=1)  # type: ignore[arg-type]
