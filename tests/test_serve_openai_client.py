"""chunkcache serve as the official ``openai`` client (sync and async, streamed and whole) sees
it: what it sends either works or is a 400 naming the field in OpenAI's error shape."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import openai
import pytest
from fake_backend import FakeBackend
from openai.types.chat import ChatCompletionMessageParam
from test_serve_openai import client, model, server  # noqa: F401  (fixtures)
from transformers import AutoTokenizer

from chunkcache.core.model_files import pull_default_model
from chunkcache.core.serve import ServeSettings, create_app
from chunkcache.core.serve.launcher import serve_app
from chunkcache.core.tokenization import render_chat

MODEL = FakeBackend.model_name
HELLO: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Hello there"}]
# How a template without a system role refuses one (Gemma's does; transformers' helper).
NO_SYSTEM_TEMPLATE = (
    "{% if messages[0]['role'] == 'system' %}"
    "{{ raise_exception('System role not supported') }}{% endif %}"
    "{% for m in messages %}{{ m['content'] }}{% endfor %}"
)


class StrictTemplateBackend(FakeBackend):
    """Renders with SmolLM2's tokenizer under a template that refuses system messages."""

    def __init__(self) -> None:
        super().__init__()
        self.tokenizer = AutoTokenizer.from_pretrained(pull_default_model())
        self.tokenizer.chat_template = NO_SYSTEM_TEMPLATE

    def render_chat(self, messages: Sequence[Mapping[str, str]]) -> str:
        return render_chat(self.tokenizer, messages)


@pytest.fixture(scope="module")
def backend() -> FakeBackend:
    return FakeBackend()


@pytest.fixture(scope="module")
def url(backend: FakeBackend) -> Iterator[str]:
    with serve_app(create_app(backend, ServeSettings(max_tokens_limit=64))) as base:
        yield f"{base}/v1"


@pytest.fixture(scope="module")
def sync_client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=30)


def refusal(call: Any, **kwargs: Any) -> dict[str, Any]:
    """The error body of the 400 that ``call(**kwargs)`` gets."""
    with pytest.raises(openai.BadRequestError) as caught:
        call(**kwargs)
    body = caught.value.body
    assert isinstance(body, dict)
    return body


# --- what the client commonly sends and the server honours ----------------------------------


@pytest.mark.parametrize(
    ("extra", "seen"),
    [
        ({"max_completion_tokens": 2}, {"max_tokens": 2}),
        ({"max_tokens": 3, "max_completion_tokens": 3}, {"max_tokens": 3}),
        ({"seed": 7, "max_tokens": 2}, {"seed": 7}),
        ({"stop": "in", "max_tokens": 9}, {"stop": ("in",)}),
        ({"stop": ["is", "zz"], "max_tokens": 9}, {"stop": ("is", "zz")}),
        ({"user": "u-1", "max_tokens": 2}, {}),
        ({"presence_penalty": 0, "frequency_penalty": 0.0, "max_tokens": 2}, {}),
        ({"logit_bias": {}, "logprobs": False, "top_logprobs": 0, "max_tokens": 2}, {}),
        ({"response_format": {"type": "text"}, "n": 1, "max_tokens": 2}, {}),
        ({"tools": [], "parallel_tool_calls": False, "store": False, "max_tokens": 2}, {}),
    ],
)
def test_accepted_chat_fields_reach_the_engine(
    sync_client: openai.OpenAI,
    backend: FakeBackend,
    extra: dict[str, Any],
    seen: dict[str, Any],
) -> None:
    reply = sync_client.chat.completions.create(model=MODEL, messages=HELLO, **extra)
    assert reply.choices[0].message.content
    sampling = backend.requests[-1].sampling
    for name, value in seen.items():
        got = getattr(sampling, name)
        assert (tuple(got) if name == "stop" else got) == value


def test_text_parts_developer_role_and_names(
    sync_client: openai.OpenAI, backend: FakeBackend
) -> None:
    messages: list[ChatCompletionMessageParam] = [
        {"role": "developer", "content": "Be brief."},
        {
            "role": "user",
            "name": "bob",
            "content": [{"type": "text", "text": "Hello "}, {"type": "text", "text": "there"}],
        },
    ]
    sync_client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2)
    prompt = "".join(s.text for s in backend.requests[-1].segments)
    assert prompt == backend.render_chat(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]
    )


def test_every_response_parses_in_the_sync_client(sync_client: openai.OpenAI) -> None:
    whole = sync_client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=3)
    assert whole.object == "chat.completion" and whole.id.startswith("chatcmpl-")
    assert isinstance(whole.created, int) and whole.choices[0].finish_reason == "length"
    assert whole.choices[0].message.role == "assistant"
    chunks = list(
        sync_client.chat.completions.create(
            model=MODEL,
            messages=HELLO,
            max_tokens=3,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert {c.id for c in chunks} == {chunks[0].id} and chunks[0].id.startswith("chatcmpl-")
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks[:-1]][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 3
    text = sync_client.completions.create(model=MODEL, prompt=["Say hi"], max_tokens=2)
    assert text.object == "text_completion" and text.choices[0].text == "The answer"


def test_every_response_parses_in_the_async_client(url: str) -> None:
    async def run() -> tuple[str, str, int]:
        async_client = openai.AsyncOpenAI(base_url=url, api_key="unused", max_retries=0)
        whole = await async_client.chat.completions.create(
            model=MODEL, messages=HELLO, max_tokens=2
        )
        stream = await async_client.completions.create(
            model=MODEL,
            prompt="Say hi",
            max_tokens=2,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = [c async for c in stream]
        last = chunks[-1].usage
        assert last is not None and chunks[-1].choices == []
        streamed = "".join(c.choices[0].text for c in chunks if c.choices)
        return whole.choices[0].message.content or "", streamed, last.completion_tokens

    assert asyncio.run(run()) == ("The answer", "The answer", 2)


# --- what the server cannot honour: a 400 naming the field, never a silent answer -----------


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
        ({"tool_choice": "auto"}, "tool_choice"),
        ({"logprobs": True}, "logprobs"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"logit_bias": {"50256": -100}}, "logit_bias"),
        ({"presence_penalty": 0.5}, "presence_penalty"),
        ({"frequency_penalty": -1}, "frequency_penalty"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
        ({"n": 2}, "n"),
        ({"stop": [str(i) for i in range(17)]}, "stop"),
        ({"max_tokens": 65}, "max_tokens"),
        ({"max_completion_tokens": 65}, "max_completion_tokens"),
    ],
)
def test_chat_refusals_name_the_field(
    sync_client: openai.OpenAI, extra: dict[str, Any], param: str
) -> None:
    error = refusal(sync_client.chat.completions.create, model=MODEL, messages=HELLO, **extra)
    assert error["param"] == param and error["type"] == "invalid_request_error"
    assert param in error["message"] and "Value error" not in error["message"]


def test_max_tokens_and_max_completion_tokens_that_differ_are_a_400(
    sync_client: openai.OpenAI,
) -> None:
    """Which of the two a server honours differs (vLLM takes max_completion_tokens, this server
    took max_tokens): two different caps are ambiguous, not silently one of them."""
    create = sync_client.chat.completions.create
    error = refusal(create, model=MODEL, messages=HELLO, max_tokens=5, max_completion_tokens=2)
    assert error["param"] == "max_completion_tokens" and "max_tokens" in error["message"]


def test_content_parts_other_than_text_are_named(sync_client: openai.OpenAI) -> None:
    image: list[ChatCompletionMessageParam] = [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "What is this?"},
                {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}},
            ],
        }
    ]
    error = refusal(sync_client.chat.completions.create, model=MODEL, messages=image)
    assert error["param"] == "messages[0].content[1]"
    assert "image_url" in error["message"] and "text" in error["message"]
    assert "function-after" not in error["message"]


@pytest.mark.parametrize(
    ("extra", "param", "words"),
    [
        ({"logprobs": 0}, "logprobs", "logprobs"),  # 0 asks for the chosen tokens' logprobs
        ({"echo": True}, "echo", "echo"),
        ({"best_of": 2}, "best_of", "best_of"),
        ({"prompt": [1, 2, 3]}, "prompt", "token ids"),
        ({"prompt": ["one", "two"]}, "prompt", "one string"),
    ],
)
def test_text_completion_refusals_name_the_field(
    sync_client: openai.OpenAI, extra: dict[str, Any], param: str, words: str
) -> None:
    arguments = {"model": MODEL, "prompt": "Say hi", "max_tokens": 2, **extra}
    error = refusal(sync_client.completions.create, **arguments)
    assert error["param"] == param and words in error["message"]
    assert "function-after" not in error["message"]


def test_models_retrieve(sync_client: openai.OpenAI) -> None:
    card = sync_client.models.retrieve(MODEL)
    assert card.id == MODEL and card.object == "model"
    assert card.model_extra is not None
    assert card.model_extra["max_model_len"] == FakeBackend.context_window
    with pytest.raises(openai.NotFoundError) as caught:
        sync_client.models.retrieve("gpt-4o")
    assert isinstance(caught.value.body, dict) and caught.value.body["code"] == "model_not_found"


def test_a_chat_template_that_refuses_the_messages_is_a_400() -> None:
    """A template without a system role raises on a system message: that was a 500."""
    system: list[ChatCompletionMessageParam] = [{"role": "system", "content": "Be brief."}]
    with serve_app(create_app(StrictTemplateBackend())) as base:
        strict = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
        error = refusal(strict.chat.completions.create, model=MODEL, messages=system + HELLO)
        assert "System role not supported" in error["message"] and error["param"] == "messages"
        reply = strict.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=2)
        assert reply.choices[0].message.content == "The answer"
        body = {"messages": system + HELLO}
        error = refusal(strict.post, path="/chunkcache/render", cast_to=object, body=body)
        assert "System role not supported" in error["message"]


# --- the real model --------------------------------------------------------------------------


@pytest.mark.slow
def test_real_model_stops_and_streams_usage_as_the_client_expects(
    client: openai.OpenAI,  # noqa: F811
    model: str,  # noqa: F811
) -> None:
    prompt = "1, 2, 3, 4, 5,"
    whole = client.completions.create(
        model=model, prompt=prompt, max_tokens=12, temperature=0, stop=["8", "zz"]
    )
    assert whole.choices[0].finish_reason == "stop" and "8" not in whole.choices[0].text
    stream = client.completions.create(
        model=model,
        prompt=prompt,
        max_tokens=12,
        temperature=0,
        stop="8",
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert whole.usage is not None and chunks[-1].usage.total_tokens == whole.usage.total_tokens
    reply = client.chat.completions.create(
        model=model, messages=HELLO, max_completion_tokens=6, seed=11, user="u-1"
    )
    assert reply.choices[0].finish_reason in ("stop", "length")
    assert reply.usage is not None and 0 < reply.usage.completion_tokens <= 6
