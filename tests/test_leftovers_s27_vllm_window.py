"""VllmBackend follows a vLLM server restarted behind the same URL with another
``--max-model-len``: its window is asked again before a prompt is refused, and after vLLM
refused one as over its window; a request that fits costs no extra round trip."""

from __future__ import annotations

import json

import httpx
import pytest

from chunkcache.core.errors import PromptTooLongError
from chunkcache.core.generation import GenerationRequest, SamplingParams
from chunkcache.core.prompting import generate
from chunkcache.core.segmenter import TextSegment
from chunkcache.integrations.vllm import VllmBackend

PROMPT = "one two three four five"  # 5 tokens: one per word
OVER_THE_WINDOW = "This model's maximum context length is 8 tokens. However, you requested 9"


class WordTokenizer:
    def encode(self, text: str, add_special_tokens: bool) -> list[str]:
        return text.split()


class RestartableVllm:
    """A fake vLLM whose ``max_model_len`` the test changes (a restart); it refuses a prompt
    over its window as vLLM does, and logs every request's path."""

    def __init__(self, window: int | None) -> None:
        self.window = window
        self.asked: list[str] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.asked.append(request.url.path)
        if request.url.path == "/v1/models":
            models = [{"id": "smol", "max_model_len": self.window}]
            return httpx.Response(200, json={"data": models})
        body = json.loads(request.content)
        wanted = len(body["prompt"].split()) + body["max_tokens"]
        if self.window is not None and wanted > self.window:
            error = {"message": OVER_THE_WINDOW, "type": "BadRequestError", "code": 400}
            return httpx.Response(400, json={"error": error})
        usage = {"prompt_tokens": 5, "completion_tokens": 1, "prompt_tokens_details": {}}
        events = [
            {"choices": [{"text": "ok", "finish_reason": "stop"}], "usage": None},
            {"choices": [], "usage": usage},
        ]
        lines = [f"data: {json.dumps(e)}\n\n" for e in events] + ["data: [DONE]\n\n"]
        return httpx.Response(200, content="".join(lines).encode())


def backend_on(server: RestartableVllm) -> VllmBackend:
    transport = httpx.MockTransport(server)
    return VllmBackend("http://vllm.test", "smol", tokenizer=WordTokenizer(), transport=transport)


def ask(max_tokens: int) -> GenerationRequest:
    return GenerationRequest([TextSegment(PROMPT)], sampling=SamplingParams(max_tokens=max_tokens))


pytestmark = pytest.mark.filterwarnings("ignore:vLLM at .* does not report cached prompt tokens")


def test_a_server_restarted_with_a_longer_window_is_asked_before_a_refusal() -> None:
    server = RestartableVllm(window=8)
    backend = backend_on(server)
    assert generate(backend, ask(max_tokens=3))[0] == "ok"  # fills the window
    server.window = 64
    assert generate(backend, ask(max_tokens=20))[0] == "ok"
    assert server.asked == ["/v1/models", "/v1/completions", "/v1/models", "/v1/completions"]
    assert backend.context_window == 64


def test_a_prompt_over_an_unchanged_window_is_refused_after_one_more_question() -> None:
    server = RestartableVllm(window=8)
    backend = backend_on(server)
    with pytest.raises(PromptTooLongError, match="context window of 8"):
        generate(backend, ask(max_tokens=20))
    assert server.asked == ["/v1/models", "/v1/models"]


def test_a_server_restarted_with_a_shorter_window_is_asked_after_it_refused() -> None:
    server = RestartableVllm(window=64)
    backend = backend_on(server)
    generate(backend, ask(max_tokens=20))
    server.window = 8
    with pytest.raises(PromptTooLongError, match="maximum context length is 8"):
        generate(backend, ask(max_tokens=20))  # vLLM's own refusal
    with pytest.raises(PromptTooLongError, match="context window of 8"):
        generate(backend, ask(max_tokens=20))  # refused here now, before it is sent
    completions = [path for path in server.asked if path == "/v1/completions"]
    assert len(completions) == 2


def test_a_server_restarted_without_a_window_is_left_to_check_prompts_itself() -> None:
    server = RestartableVllm(window=8)
    backend = backend_on(server)
    generate(backend, ask(max_tokens=3))
    server.window = None  # names no window now: as for a server that never named one
    assert generate(backend, ask(max_tokens=20))[0] == "ok"


def test_a_refusal_stands_when_the_window_cannot_be_asked_again() -> None:
    server = RestartableVllm(window=8)
    calls = 0

    def down_after_the_first_question(request: httpx.Request) -> httpx.Response:
        nonlocal calls
        calls += 1
        if calls > 1:
            raise httpx.ConnectError("connection refused", request=request)
        return server(request)

    transport = httpx.MockTransport(down_after_the_first_question)
    backend = VllmBackend(
        "http://vllm.test", "smol", tokenizer=WordTokenizer(), transport=transport
    )
    with pytest.raises(PromptTooLongError, match="context window of 8"):
        generate(backend, ask(max_tokens=20))


def test_the_window_is_asked_once_while_requests_fit() -> None:
    server = RestartableVllm(window=64)
    backend = backend_on(server)
    for _ in range(3):
        generate(backend, ask(max_tokens=4))
    assert server.asked.count("/v1/models") == 1
