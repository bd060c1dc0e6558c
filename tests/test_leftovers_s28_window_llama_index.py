"""LlamaIndex's ``ChunkCacheLLM.metadata.context_window`` is the backend's window as it is
now, not as it was at the first read: a vLLM server restarted with another
``--max-model-len`` must not leave LlamaIndex packing prompts for the old window.  Reading
it costs what the backend's own ``context_window`` costs (vLLM's asks once, and again only
after a refusal); the model's other facts are read once per cache."""

from __future__ import annotations

import functools
import json
import threading

import httpx
import pytest
from fake_backend import DEFAULT_ANSWER, FakeBackend

from chunkcache.core.cache import ChunkCache
from chunkcache.core.errors import BackendUnavailableError, PromptTooLongError
from chunkcache.integrations.llama_index import ChunkCacheLLM
from chunkcache.integrations.vllm import VllmBackend

OVER_THE_WINDOW = "This model's maximum context length is 8 tokens. However, you requested 9"


class ChangingWindow(FakeBackend):
    """A backend whose window the test changes (a server restarted with another one)."""

    def __init__(self, window: int | None) -> None:
        super().__init__()
        self.window = window

    @property
    def context_window(self) -> int | None:
        return self.window


class AskingWindow(FakeBackend):
    """A window kept as VllmBackend keeps it: asked once (``asked`` logs the asking
    threads), asked again after :meth:`forget`; ``down`` makes asking fail."""

    def __init__(self, window: int) -> None:
        super().__init__()
        self.window = window
        self.down = False
        self.asked: list[int] = []
        self.names_read = 0

    @property
    def model_name(self) -> str:
        self.names_read += 1
        return "asking"

    @functools.cached_property
    def context_window(self) -> int:
        self.asked.append(threading.get_ident())
        if self.down:
            raise BackendUnavailableError("the server is restarting")
        return self.window

    def forget(self) -> None:
        self.__dict__.pop("context_window", None)


def test_metadata_follows_a_backend_whose_window_changes() -> None:
    backend = ChangingWindow(window=2048)
    llm = ChunkCacheLLM(cache=ChunkCache(backend=backend))
    assert llm.metadata.context_window == 2048
    backend.window = 1024
    assert llm.metadata.context_window == 1024
    backend.window = 131072
    assert llm.metadata.context_window == 131072
    backend.window = None  # the server names no window now: LlamaIndex's default
    assert llm.metadata.context_window == 3900


def test_metadata_asks_only_when_the_backend_would() -> None:
    backend = AskingWindow(window=2048)
    llm = ChunkCacheLLM(cache=ChunkCache(backend=backend))
    windows = {llm.metadata.context_window for _ in range(5)}
    assert windows == {2048} and len(backend.asked) == 1
    backend.window = 4096
    backend.forget()  # as VllmBackend does after a refusal
    assert [llm.metadata.context_window for _ in range(5)] == [4096] * 5
    assert len(backend.asked) == 2
    assert backend.names_read == 1  # the model's name is read once per cache


def test_a_window_that_cannot_be_asked_now_stays_as_last_read() -> None:
    """A request to a server that is down fails by itself; metadata, which LlamaIndex reads
    everywhere (callbacks, prompt packing), keeps the window it knew."""
    backend = AskingWindow(window=2048)
    llm = ChunkCacheLLM(cache=ChunkCache(backend=backend))
    assert llm.metadata.context_window == 2048
    backend.down = True
    backend.forget()
    assert llm.metadata.context_window == 2048
    backend.down = False
    backend.window = 1024
    assert llm.metadata.context_window == 1024


async def test_an_async_call_asks_for_the_window_off_the_event_loop() -> None:
    backend = AskingWindow(window=2048)
    llm = ChunkCacheLLM(cache=ChunkCache(backend=backend))
    assert (await llm.acomplete("hi")).text == DEFAULT_ANSWER
    backend.window = 4096
    backend.forget()
    assert (await llm.acomplete("hi")).text == DEFAULT_ANSWER
    assert len(backend.asked) == 2
    assert threading.get_ident() not in backend.asked
    assert llm.metadata.context_window == 4096


class RestartableVllm:
    """A fake vLLM whose ``max_model_len`` the test changes; it refuses a prompt over its
    window as vLLM does."""

    def __init__(self, window: int) -> None:
        self.window = window

    def __call__(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            models = [{"id": "smol", "max_model_len": self.window}]
            return httpx.Response(200, json={"data": models})
        body = json.loads(request.content)
        if len(body["prompt"].split()) + body["max_tokens"] > self.window:
            error = {"message": OVER_THE_WINDOW, "type": "BadRequestError", "code": 400}
            return httpx.Response(400, json={"error": error})
        usage = {"prompt_tokens": 5, "completion_tokens": 1, "prompt_tokens_details": {}}
        events = [
            {"choices": [{"text": "ok", "finish_reason": "stop"}], "usage": None},
            {"choices": [], "usage": usage},
        ]
        lines = [f"data: {json.dumps(e)}\n\n" for e in events] + ["data: [DONE]\n\n"]
        return httpx.Response(200, content="".join(lines).encode())


class WordTokenizer:
    def encode(self, text: str, add_special_tokens: bool) -> list[str]:
        return text.split()


@pytest.mark.filterwarnings("ignore:vLLM at .* does not report cached prompt tokens")
def test_metadata_follows_a_vllm_server_restarted_with_another_window() -> None:
    server = RestartableVllm(window=64)
    backend = VllmBackend(
        "http://vllm.test",
        "smol",
        tokenizer=WordTokenizer(),
        transport=httpx.MockTransport(server),
    )
    llm = ChunkCacheLLM(cache=ChunkCache(backend=backend), max_tokens=4)
    prompt = "one two three four five"
    assert llm.complete(prompt).text == "ok"
    assert llm.metadata.context_window == 64
    server.window = 8  # restarted shorter: vLLM refuses, and the window is asked again
    with pytest.raises(PromptTooLongError, match="maximum context length is 8"):
        llm.complete(prompt)
    assert llm.metadata.context_window == 8
    server.window = 256  # restarted longer: asked again before refusing a long prompt
    assert llm.complete(" ".join([prompt] * 20)).text == "ok"
    assert llm.metadata.context_window == 256
