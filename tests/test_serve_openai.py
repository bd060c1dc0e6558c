"""The real ``chunkcache serve`` on the default model, driven by the official ``openai``
client, by ChunkCacheLLM over the http backend, and by a tiny bounded load test."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from langchain_core.documents import Document
from langchain_core.prompts import ChatPromptTemplate
from openai.types.chat import ChatCompletionMessageParam
from transformers import AutoTokenizer

from chunkcache.core.cache import ChunkCache
from chunkcache.core.model_files import pull_default_model
from chunkcache.core.serve.launcher import serve_process
from chunkcache.core.serve.loadtest import LoadTest, LoadTestConfig, check
from chunkcache.integrations.langchain_llm import ChunkCacheLLM

pytestmark = pytest.mark.slow

CHUNK = (
    "The Danube flows through ten countries, more than any other river in the world, "
    "from the Black Forest in Germany to the Black Sea."
)
QUESTION = "How many countries does the Danube flow through?"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    folder = tmp_path_factory.mktemp("serve")
    env = {"CHUNKCACHE_STORE_DISK_DIR": str(folder / "kv"), "OMP_NUM_THREADS": "1"}
    with serve_process(env=env, log=folder / "serve.log") as (url, _):
        yield url


@pytest.fixture(scope="module")
def client(server: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def model(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def messages(system: str = "Answer from the context.") -> list[ChatCompletionMessageParam]:
    return [
        {"role": "system", "content": system},
        {"role": "user", "content": f"Context: {CHUNK}\n\n{QUESTION}"},
    ]


def test_chat_completion_reuses_the_named_chunk(client: openai.OpenAI, model: str) -> None:
    extension = {"chunkcache": {"chunks": [{"id": "danube", "text": CHUNK}]}}
    first = client.chat.completions.create(
        model=model, messages=messages(), max_tokens=12, temperature=0, extra_body=extension
    )
    assert first.choices[0].message.content
    assert first.choices[0].finish_reason in ("stop", "length")
    assert first.usage is not None and (first.usage.completion_tokens or 0) <= 12
    assert first.usage.prompt_tokens_details is not None
    # the same chunk after another system prompt: its KV is moved, not computed
    moved = messages("Be brief.")
    second = client.chat.completions.create(
        model=model, messages=moved, max_tokens=12, temperature=0, extra_body=extension
    )
    assert second.usage is not None and second.usage.prompt_tokens_details is not None
    assert (second.usage.prompt_tokens_details.cached_tokens or 0) > 0
    stats = second.usage.model_extra["chunkcache"]  # type: ignore[index]
    assert stats["chunk_hits"] == 1 and stats["recomputed_tokens"] > 0


def test_chat_stream(client: openai.OpenAI, model: str) -> None:
    stream = client.chat.completions.create(
        model=model,
        messages=messages(),
        max_tokens=12,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    whole = client.chat.completions.create(
        model=model, messages=messages(), max_tokens=12, temperature=0
    )
    assert text == whole.choices[0].message.content  # greedy: streamed equals whole
    assert sum(1 for c in chunks if c.choices and c.choices[0].finish_reason) == 1
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0


def test_text_completions(client: openai.OpenAI, model: str) -> None:
    whole = client.completions.create(model=model, prompt="The capital of France is", max_tokens=6)
    assert whole.choices[0].text and whole.usage is not None
    stream = client.completions.create(
        model=model, prompt="The capital of France is", max_tokens=6, temperature=0, stream=True
    )
    pieces = [c.choices[0].text for c in stream if c.choices]
    again = client.completions.create(
        model=model, prompt="The capital of France is", max_tokens=6, temperature=0
    )
    assert "".join(pieces) == again.choices[0].text


def test_errors_reach_the_client(client: openai.OpenAI, model: str) -> None:
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=model, messages=messages(), max_tokens=100_000)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4o", messages=messages(), max_tokens=4)


def test_default_max_tokens_fits_the_context_window(client: openai.OpenAI, model: str) -> None:
    """With no max_tokens, a prompt leaving less room than the default still runs, capped
    to that room (as OpenAI does); a max_tokens that does not fit, or no room, is a 400."""
    window = client.models.list().data[0].model_extra["max_model_len"]  # type: ignore[index]
    tokenizer = AutoTokenizer.from_pretrained(pull_default_model(), local_files_only=True)
    ids = tokenizer(" ".join(f"fact {i}." for i in range(window)))["input_ids"]
    room = 4
    prompt = tokenizer.decode(ids[: window - room])
    assert len(tokenizer(prompt)["input_ids"]) == window - room
    reply = client.completions.create(model=model, prompt=prompt, temperature=0)
    assert reply.usage is not None and reply.usage.prompt_tokens == window - room
    assert 0 < reply.usage.completion_tokens <= room
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=model, prompt=prompt, max_tokens=room + 1)
    with pytest.raises(openai.BadRequestError, match="context window"):
        client.completions.create(model=model, prompt=tokenizer.decode(ids[:window]))


def test_chunkcache_llm_over_http(server: str) -> None:
    cache = ChunkCache(backend="http", base_url=server)
    llm = ChunkCacheLLM(chunk_cache=cache, max_tokens=12)
    prompt = ChatPromptTemplate.from_messages(
        [("system", "Answer from the context."), ("human", "Context: {context}\n\n{question}")]
    )
    chunk = CHUNK.replace("Danube", "Rhine-Danube")
    chain = prompt | llm.bind(chunks=[Document(chunk, metadata={"chunk_id": "rhine"})])
    first = chain.invoke({"context": chunk, "question": QUESTION})
    second = chain.invoke({"context": chunk, "question": "And where does it start?"})
    assert first.content and second.content
    assert first.response_metadata["chunkcache"]["chunk_misses"] == 1
    assert second.usage_metadata is not None
    assert second.usage_metadata["input_token_details"]["cache_read"] > 0


def test_tiny_load_test_loses_and_doubles_nothing(server: str, model: str) -> None:
    config = LoadTestConfig(
        clients=4,
        warmup_s=2,
        duration_s=8,
        max_tokens=4,
        chunks_per_prompt=2,
        max_requests=200,
        out=None,
    )
    test = LoadTest(config, server, [CHUNK, CHUNK.upper(), CHUNK.replace("ten", "10")], model)
    asyncio.run(test.run())
    counts = check(test.outcomes)
    assert counts["requests"] >= 4
    assert counts["completed"] + counts["rejected_429"] == counts["requests"]
    assert counts["errors"] == counts["lost"] == counts["answered_twice"] == 0
    assert counts["wrong_echo"] == 0


def test_log_has_no_tracebacks(server: str, tmp_path_factory: pytest.TempPathFactory) -> None:
    logs = list(Path(tmp_path_factory.getbasetemp()).glob("serve*/serve.log"))
    assert logs and all("Traceback" not in log.read_text() for log in logs)
