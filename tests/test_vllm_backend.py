"""VllmBackend: request mapping and usage parsing on a fake transport, garbage answers from a
local HTTP server, and a real vLLM server (slow)."""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from chunkcache.core.cache import ChunkCache
from chunkcache.core.errors import BackendUnavailableError, PromptTooLongError
from chunkcache.core.generation import GenerationRequest, GenerationStats, SamplingParams
from chunkcache.core.model_files import ModelLoadError
from chunkcache.core.prompting import generate
from chunkcache.core.segmenter import ChunkSegment, Segment, TextSegment
from chunkcache.core.serve.launcher import serve_app
from chunkcache.core.vllm_server import VllmServerConfig, vllm_installed
from chunkcache.integrations.langchain import ChunkCacheLLM
from chunkcache.integrations.vllm import VllmBackend

CHUNK = "Alpha: json.dumps serializes an object to a JSON formatted string."


class ChatMLTokenizer:
    """Just enough of a tokenizer for ``render_chat``."""

    def apply_chat_template(
        self, messages: Sequence[Mapping[str, str]], tokenize: bool, add_generation_prompt: bool
    ) -> str:
        turns = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
        return turns + ("<|im_start|>assistant\n" if add_generation_prompt else "")

    def encode(self, text: str, add_special_tokens: bool) -> list[str]:
        """One token per word."""
        assert add_special_tokens is False
        return text.split()


def sse(*events: dict[str, Any]) -> bytes:
    lines = [f"data: {json.dumps(e)}\n\n" for e in events] + ["data: [DONE]\n\n"]
    return "".join(lines).encode()


def completion_stream(texts: Sequence[str], prompt: int, cached: int) -> bytes:
    choices = [{"index": 0, "text": t, "finish_reason": None} for t in texts]
    choices[-1]["finish_reason"] = "stop"
    usage = {
        "prompt_tokens": prompt,
        "completion_tokens": len(texts),
        "total_tokens": prompt + len(texts),
        "prompt_tokens_details": {"cached_tokens": cached},
    }
    return sse(*({"choices": [c], "usage": None} for c in choices), {"choices": [], "usage": usage})


class FakeVllm:
    """A /v1/completions endpoint that records request bodies and streams a canned answer."""

    def __init__(self, texts: Sequence[str] = ("Paris", " is", " it."), cached: int = 48) -> None:
        self.texts = texts
        self.cached = cached
        self.requests: list[httpx.Request] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        assert request.url.path == "/v1/completions"
        body = completion_stream(self.texts, prompt=100, cached=self.cached)
        return httpx.Response(200, content=body, headers={"content-type": "text/event-stream"})

    def body(self, index: int = -1) -> dict[str, Any]:
        return dict(json.loads(self.requests[index].content))


def models(window: int | None) -> httpx.Response:
    """vLLM's GET /v1/models answer for the model "smol" and its context window."""
    return httpx.Response(200, json={"data": [{"id": "smol", "max_model_len": window}]})


def make_backend(
    handler: Any, window: int | None = 2048, tokenizer: Any = None, **kwargs: Any
) -> VllmBackend:
    """A backend on ``handler``, GET /v1/models answering ``window`` (words: see encode)."""

    def route(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            return models(window)
        return handler(request)

    return VllmBackend(
        "http://vllm.test:8000/v1",
        "smol",
        tokenizer=tokenizer or ChatMLTokenizer(),
        transport=httpx.MockTransport(route),
        **kwargs,
    )


def request(**sampling: Any) -> GenerationRequest:
    segments: list[Segment] = [
        TextSegment("<|im_start|>user\n"),
        ChunkSegment("c1", CHUNK),
        TextSegment("Q?"),
    ]
    return GenerationRequest(segments, policy="cacheblend", sampling=SamplingParams(**sampling))


def test_stream_yields_text_and_vllm_cached_tokens_as_reused() -> None:
    server = FakeVllm(cached=48)
    pieces = list(make_backend(server).stream(request()))
    assert "".join(p.text for p in pieces) == "Paris is it."
    assert [p.stats is not None for p in pieces] == [False] * (len(pieces) - 1) + [True]
    stats = pieces[-1].stats
    assert stats is not None
    assert (stats.prompt_tokens, stats.reused_tokens, stats.computed_tokens) == (100, 48, 52)
    assert stats.recomputed_tokens == 0
    assert (stats.completion_tokens, stats.finish_reason, stats.policy) == (3, "stop", "prefix")
    assert 0 < stats.ttft_s <= stats.total_s


def test_request_body_is_the_joined_prompt_with_sampling_mapped() -> None:
    server = FakeVllm()
    backend = make_backend(server, api_key="secret")
    generate(backend, request(max_tokens=7, temperature=0.5, top_p=0.9, stop=("\n",), seed=3))
    body = server.body()
    assert body["prompt"] == f"<|im_start|>user\n{CHUNK}Q?"
    assert body["model"] == "smol"
    assert (body["max_tokens"], body["temperature"], body["top_p"]) == (7, 0.5, 0.9)
    assert (body["stop"], body["seed"]) == (["\n"], 3)
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["add_special_tokens"] is False
    assert server.requests[-1].headers["authorization"] == "Bearer secret"


@pytest.mark.parametrize(
    ("seed", "sent"), [(0, 0), (2**63 - 1, 2**63 - 1), (2**63, -(2**63)), (2**64 - 2, -2)]
)
def test_seeds_are_sent_in_vllms_signed_64_bit_range(seed: int, sent: int) -> None:
    server = FakeVllm()
    generate(make_backend(server), request(temperature=0.5, seed=seed))
    assert server.body()["seed"] == sent


def test_greedy_request_sends_no_stop_or_seed_and_no_auth() -> None:
    server = FakeVllm()
    generate(make_backend(server), request())
    assert "stop" not in server.body() and "seed" not in server.body()
    assert "authorization" not in server.requests[-1].headers


def test_server_without_prompt_tokens_details_reports_no_reuse() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        usage = {"prompt_tokens": 10, "completion_tokens": 1, "total_tokens": 11}
        choice = {"index": 0, "text": "ok", "finish_reason": "length"}
        return httpx.Response(
            200, content=sse({"choices": [choice]}, {"choices": [], "usage": usage})
        )

    _, stats = generate(make_backend(handler), request())
    assert (stats.prompt_tokens, stats.reused_tokens, stats.computed_tokens) == (10, 0, 10)
    assert stats.extra["cached_tokens_reported"] is False
    assert stats.finish_reason == "length"


@pytest.mark.parametrize(
    "handler",
    [
        pytest.param(lambda r: (_ for _ in ()).throw(httpx.ConnectError("refused")), id="refused"),
        pytest.param(lambda r: httpx.Response(500, text="engine dead"), id="http-500"),
        pytest.param(lambda r: httpx.Response(200, content=b"data: {not json\n\n"), id="bad-json"),
        pytest.param(
            lambda r: httpx.Response(200, content=sse({"error": {"message": "oom"}})),
            id="error-event",
        ),
    ],
)
def test_failures_raise_backend_unavailable(handler: Any) -> None:
    with pytest.raises(BackendUnavailableError, match=r"vLLM"):
        generate(make_backend(handler), request())


# request()'s prompt in ChatMLTokenizer.encode's tokens (words)
PROMPT_TOKENS = len(f"<|im_start|>user\n{CHUNK}Q?".split())


@pytest.mark.parametrize(
    ("window", "sampling"),
    [
        pytest.param(PROMPT_TOKENS, {"max_tokens": 1, "fit_window": True}, id="no-room"),
        pytest.param(PROMPT_TOKENS + 4, {"max_tokens": 5}, id="no-room-for-max-tokens"),
    ],
)
def test_a_prompt_over_the_window_is_refused_before_it_is_sent(
    window: int, sampling: dict[str, Any]
) -> None:
    server = FakeVllm()
    with pytest.raises(PromptTooLongError, match=f"context window of {window}"):
        generate(make_backend(server, window=window), request(**sampling))
    assert server.requests == []


def test_fit_window_sends_max_tokens_for_vllm_to_cut() -> None:
    server = FakeVllm()
    backend = make_backend(server, window=PROMPT_TOKENS + 4)
    generate(backend, request(max_tokens=4))  # exactly fills the window
    generate(backend, request(max_tokens=100, fit_window=True))
    assert [server.body(i)["max_tokens"] for i in (0, 1)] == [4, 100]


def test_the_window_is_asked_once() -> None:
    asked: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        asked.append(request.url.path)
        return models(2048) if request.url.path == "/v1/models" else FakeVllm()(request)

    backend = VllmBackend(
        "http://vllm.test",
        "smol",
        tokenizer=ChatMLTokenizer(),
        transport=httpx.MockTransport(handler),
    )
    for _ in range(3):
        generate(backend, request())
    assert asked == ["/v1/models"] + ["/v1/completions"] * 3


@pytest.mark.parametrize(
    "models_answer",
    [
        pytest.param(models(None), id="no-max-model-len"),
        pytest.param(httpx.Response(200, json={"data": [{"id": "other"}]}), id="other-model"),
        pytest.param(httpx.Response(404, text="Not Found"), id="no-models-endpoint"),
    ],
)
def test_without_a_known_window_the_prompt_is_not_counted(models_answer: httpx.Response) -> None:
    server = FakeVllm()

    def handler(request: httpx.Request) -> httpx.Response:
        return models_answer if request.url.path == "/v1/models" else server(request)

    backend = VllmBackend(
        "http://vllm.test",
        "smol",
        tokenizer=object(),  # cannot encode
        transport=httpx.MockTransport(handler),
    )
    assert generate(backend, request())[0] == "Paris is it."


@pytest.mark.parametrize(
    ("status", "message", "error"),
    [
        pytest.param(
            400,
            "This model's maximum context length is 2048 tokens. However, your prompt "
            "contains 3000 input tokens",
            PromptTooLongError,
            id="context-length",
        ),
        pytest.param(
            400,
            "The decoder prompt (length 3000) is longer than the maximum model length of 2048.",
            PromptTooLongError,
            id="model-length",
        ),
        pytest.param(400, "temperature must be non-negative", ValueError, id="bad-request"),
        pytest.param(404, "The model `smol` does not exist.", ValueError, id="unknown-model"),
    ],
)
def test_a_refused_request_is_the_callers_error_not_an_unavailable_server(
    status: int, message: str, error: type[Exception]
) -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        body = {"error": {"message": message, "type": "BadRequestError", "code": status}}
        return httpx.Response(status, json=body)

    with pytest.raises(error) as raised:
        generate(make_backend(handler), request())
    assert not isinstance(raised.value, BackendUnavailableError)
    assert message in str(raised.value) and "vLLM at http://vllm.test:8000" in str(raised.value)


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="model"):
        VllmBackend("http://127.0.0.1:1", "")
    with pytest.raises(ValueError, match="timeout_s"):
        VllmBackend("http://127.0.0.1:1", "m", timeout_s=0)


Canned = tuple[str, list[Response]]


@pytest.fixture(scope="module")
def canned_server() -> Iterator[Canned]:
    """A local HTTP server whose /v1/completions answers the reply put in its list."""
    reply: list[Response] = []

    async def completions(request: Request) -> Response:
        return reply[0]

    async def health(request: Request) -> Response:
        return PlainTextResponse("ok")

    routes = [Route("/health", health), Route("/v1/completions", completions, methods=["POST"])]
    with serve_app(Starlette(routes=routes)) as url:
        yield url, reply


def answer(canned_server: Canned, reply: Response) -> tuple[str, GenerationStats]:
    """What VllmBackend makes of ``reply`` from a real HTTP server: the text and stats."""
    url, replies = canned_server
    replies[:] = [reply]
    return generate(VllmBackend(url, "smol", tokenizer=ChatMLTokenizer()), request())


def _sse(*data: str) -> Response:
    return Response("".join(f"data: {d}\n\n" for d in data), media_type="text/event-stream")


_HI = json.dumps({"choices": [{"index": 0, "text": "Hi", "finish_reason": "stop"}]})
_USAGE = json.dumps({"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 1}})


def test_a_complete_stream_from_a_real_server_is_the_answer(canned_server: Canned) -> None:
    """Comments and other SSE fields are allowed around the events."""
    body = f": ping\n\nevent: message\ndata: {_HI}\n\ndata: {_USAGE}\n\ndata: [DONE]\n\n"
    reply = Response(body, media_type="text/event-stream")
    text, stats = answer(canned_server, reply)
    assert (text, stats.prompt_tokens, stats.finish_reason) == ("Hi", 9, "stop")


def _usage(usage: Any) -> str:
    return json.dumps({"choices": [], "usage": usage})


@pytest.mark.parametrize(
    ("reply", "wrong"),
    [
        pytest.param(
            HTMLResponse("<html><body>Welcome to nginx</body></html>"),
            "with something other than server-sent events: '<html>",
            id="html",
        ),
        pytest.param(
            JSONResponse({"choices": [{"text": "all of it"}], "usage": {"prompt_tokens": 3}}),
            "with something other than server-sent events: '{",
            id="plain-json",
        ),
        pytest.param(_sse(), "without data: [DONE], after 0 event(s)", id="empty"),
        pytest.param(_sse(_HI), "without data: [DONE], after 1 event(s)", id="cut-off"),
        pytest.param(_sse(_HI, "[DONE]"), "without the usage it was asked for", id="no-usage"),
        pytest.param(_sse("{not json"), "with non-JSON: '{not json'", id="not-json"),
        pytest.param(_sse("[" * 100_000), "with non-JSON: '[[[", id="too-deep"),
        pytest.param(_sse("5"), "with 5, not a JSON object", id="number"),
        pytest.param(_sse("null"), "with null, not a JSON object", id="null"),
        pytest.param(_sse("[1, 2]"), "with [1, 2], not a JSON object", id="list"),
        pytest.param(_sse('{"choices": ["Hi"]}'), 'with "Hi", not a JSON object', id="choice"),
        pytest.param(_sse('{"choices": {"text": "Hi"}}'), "malformed 'choices'", id="choices"),
        pytest.param(_sse('{"choices": [{"text": 123}]}'), "malformed 'text'", id="text"),
        pytest.param(_sse(_HI, _usage("lots")), "malformed 'usage'", id="usage"),
        pytest.param(_sse(_HI, _usage({})), "malformed 'prompt_tokens'", id="no-prompt-tokens"),
        pytest.param(
            _sse(_HI, _usage({"prompt_tokens": "ten"})), "malformed 'prompt_tokens'", id="tokens"
        ),
        pytest.param(
            _sse(_HI, _usage({"prompt_tokens": 5, "prompt_tokens_details": [1]})),
            "malformed 'prompt_tokens_details'",
            id="details",
        ),
    ],
)
def test_garbage_answers_are_backend_unavailable(
    canned_server: Canned, reply: Response, wrong: str
) -> None:
    """A 200 that is not a complete stream of completion events is an error naming the
    server, the endpoint and what was wrong, never a (partial) answer or a bare Python error."""
    with pytest.raises(BackendUnavailableError) as raised:
        answer(canned_server, reply)
    url = canned_server[0]
    assert str(raised.value).startswith(f"vLLM at {url} ")
    assert "POST /v1/completions" in str(raised.value) and wrong in str(raised.value)


def test_chat_template_of_an_unknown_model_asks_for_a_tokenizer(tmp_path: Path) -> None:
    backend = VllmBackend("http://127.0.0.1:1", str(tmp_path / "no-such-model"))
    with pytest.raises(ModelLoadError, match="pass tokenizer="):
        backend.render_chat([{"role": "user", "content": "hi"}])


def test_render_chat_uses_the_given_tokenizer() -> None:
    backend = make_backend(FakeVllm())
    assert backend.render_chat([{"role": "user", "content": "hi"}]) == (
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )


def test_chunkcache_llm_reports_vllm_cached_tokens_as_cache_read() -> None:
    server = FakeVllm(cached=64)
    cache = ChunkCache(backend=make_backend(server))
    cache.registry.register("c1", CHUNK)
    llm = ChunkCacheLLM(chunk_cache=cache, max_tokens=5)
    answer = llm.invoke([("system", "Be brief."), ("human", f"Context: {CHUNK}\nWho?")])
    assert answer.content == "Paris is it."
    assert answer.usage_metadata is not None
    assert answer.usage_metadata["input_token_details"] == {"cache_read": 64}
    assert answer.response_metadata["model_name"] == "smol"
    assert server.body()["prompt"].startswith("<|im_start|>system\nBe brief.<|im_end|>\n")
    assert CHUNK in server.body()["prompt"]


# --- a real vLLM server (slow) ----------------------------------------------------------

needs_vllm = pytest.mark.skipif(not vllm_installed(), reason="vLLM is not installed: make vllm")


@pytest.fixture(scope="module")
def vllm_url() -> Iterator[str]:
    from chunkcache.core.vllm_server import vllm_server

    with vllm_server(VllmServerConfig(max_model_len=2048)) as server:
        yield server.base_url


@pytest.fixture(scope="module")
def real_backend(vllm_url: str) -> Iterator[VllmBackend]:
    backend = VllmBackend(vllm_url, "SmolLM2-135M-Instruct", timeout_s=120)
    yield backend
    backend.close()


@pytest.mark.slow
@needs_vllm
def test_real_vllm_reports_cached_tokens_for_a_repeated_prompt(real_backend: VllmBackend) -> None:
    prompt = real_backend.render_chat([{"role": "user", "content": f"{CHUNK} " * 8 + "Who?"}])
    ask = GenerationRequest([TextSegment(prompt)], sampling=SamplingParams(max_tokens=4))
    first_text, first = generate(real_backend, ask)
    second_text, second = generate(real_backend, ask)
    assert first.prompt_tokens == second.prompt_tokens > 100
    assert first.extra["cached_tokens_reported"] is True
    assert second.reused_tokens > first.reused_tokens
    block = VllmServerConfig().block_size
    assert second.reused_tokens >= second.prompt_tokens - block  # all but the last block
    assert second_text == first_text and 1 <= second.completion_tokens <= 4


@pytest.mark.slow
@needs_vllm
def test_real_vllm_through_langchain_reports_cache_read(real_backend: VllmBackend) -> None:
    cache = ChunkCache(backend=real_backend)
    cache.registry.register("c1", CHUNK)
    llm = ChunkCacheLLM(chunk_cache=cache, max_tokens=8)
    messages = [("system", "Answer from the context."), ("human", f"{CHUNK}\nWhat does it do?")]
    answers = [llm.invoke(messages) for _ in range(2)]
    assert all(isinstance(a.content, str) and a.content.strip() for a in answers)
    usage = answers[-1].usage_metadata
    assert usage is not None and usage["input_tokens"] > 16
    assert usage["input_token_details"]["cache_read"] > 0
    assert answers[-1].response_metadata["chunkcache"]["policy"] == "prefix"
    first = answers[0].response_metadata["chunkcache"]
    assert (first["chunk_hits"], first["chunk_misses"]) == (0, 1)  # a cold prefix cache
    last = answers[-1].response_metadata["chunkcache"]
    assert last["chunk_hits"] + last["chunk_misses"] == 1  # measured, whatever the blocks


class UndercountingTokenizer:
    """Counts no tokens, so every prompt reaches the server's own check."""

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        return []


@pytest.mark.slow
@needs_vllm
def test_real_vllm_prompts_over_the_window(real_backend: VllmBackend, vllm_url: str) -> None:
    assert real_backend.context_window == 2048
    words = real_backend.render_chat([{"role": "user", "content": "word " * 1990}])
    near_full = GenerationRequest([TextSegment(words)], sampling=SamplingParams(max_tokens=100))
    with pytest.raises(PromptTooLongError, match="to generate exceed"):
        generate(real_backend, near_full)
    fitted = GenerationRequest(
        [TextSegment(words)], sampling=SamplingParams(max_tokens=100, fit_window=True)
    )
    _, stats = generate(real_backend, fitted)  # vLLM cuts max_tokens to the room
    assert stats.prompt_tokens + stats.completion_tokens <= 2048
    assert 1 <= stats.completion_tokens < 100
    # The server's own refusal of a prompt this backend let through is read as such.
    uncounted = VllmBackend(vllm_url, "SmolLM2-135M-Instruct", tokenizer=UndercountingTokenizer())
    too_long = GenerationRequest([TextSegment("word " * 3000)], sampling=SamplingParams())
    with pytest.raises(PromptTooLongError, match="refused the prompt"):
        generate(uncounted, too_long)
    uncounted.close()


@pytest.mark.slow
@needs_vllm
def test_real_vllm_keeps_salted_prefix_caches_apart(real_backend: VllmBackend) -> None:
    content = "Salted. " + f"{CHUNK} " * 8 + "Who?"  # a prefix no other test sends
    prompt = real_backend.render_chat([{"role": "user", "content": content}])

    def reused(salt: str | None) -> int:
        ask = GenerationRequest(
            [TextSegment(prompt)], sampling=SamplingParams(max_tokens=1), cache_salt=salt
        )
        return generate(real_backend, ask)[1].reused_tokens

    assert reused("tenant-a-4bT9qk2LxZ") == 0  # computed and cached under A's salt
    assert reused("tenant-b-Qm7Rw1s8Vd") == 0  # another salt: nothing of A's
    # no salt: nothing of A's (at most the chat template's system header other tests cached)
    assert reused(None) < 64
    assert reused("tenant-a-4bT9qk2LxZ") > 100  # A's own cache
