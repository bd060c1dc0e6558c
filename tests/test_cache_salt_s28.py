"""``cache_salt`` (vLLM's field): requests of different salts never share cached KV (stored
chunks, exact prefixes, conversation memory), requests of one salt share it all, and requests
without a salt behave as before.  Carried by the server, HttpBackend, VllmBackend and the
LangChain and LlamaIndex wrappers; a salt vLLM refuses is refused everywhere."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fake_backend import FakeBackend
from fastapi.testclient import TestClient
from langchain_core.messages import HumanMessage
from llama_index.core.base.llms.types import ChatMessage
from test_vllm_backend import FakeVllm, make_backend
from tiny_models import TOLERANCE, chunk, random_ids, text, tiny_lm
from torch import Tensor

from chunkcache.core import batching
from chunkcache.core.batch_queue import Job
from chunkcache.core.batching import BatchingBackend
from chunkcache.core.cache import ChunkCache
from chunkcache.core.engine import ChunkEngine, Prefilled, TokenSegment
from chunkcache.core.errors import InvalidTextError
from chunkcache.core.generation import (
    GenerationRequest,
    Policy,
    SamplingParams,
    check_cache_salt,
    salted_namespace,
)
from chunkcache.core.http_backend import HttpBackend
from chunkcache.core.local_backend import LocalBackend
from chunkcache.core.models import LoadedModel
from chunkcache.core.prompting import build_request, generate
from chunkcache.core.segmenter import TextSegment
from chunkcache.core.serve import ServeSettings, create_app
from chunkcache.core.serve.launcher import serve_app
from chunkcache.core.store import DiskTier, MemoryTier, TieredKVStore
from chunkcache.core.store.tier import Tier
from chunkcache.core.text_stream import TextStream
from chunkcache.integrations.langchain_llm import ChunkCacheLLM as LangChainLLM
from chunkcache.integrations.llama_index_llm import ChunkCacheLLM as LlamaIndexLLM

SYSTEM = text(random_ids(9, 1))
A, B = (chunk(name, random_ids(17, seed)) for seed, name in enumerate("ab", start=2))
QUESTION = text(random_ids(7, 9))
PROMPT = [SYSTEM, A, B, QUESTION]
MOVED = [SYSTEM, B, A, QUESTION]  # the chunks at other positions: no exact prefix past SYSTEM
TENANT_A = "tenant-a-4bT9qk2LxZ"
TENANT_B = "tenant-b-Qm7Rw1s8Vd"
REUSING: tuple[Policy, ...] = ("prefix", "reuse", "cacheblend", "cachecraft")
BAD_SALTS = ["", "x" * 129, "a/b", "a@b", "a\\b", "a\x00b", "half \ud83d emoji"]


@pytest.fixture(scope="module")
def lm() -> LoadedModel:
    return tiny_lm("llama")


def run(
    engine: ChunkEngine,
    segments: list[TokenSegment],
    policy: Policy,
    salt: str | None,
    ratio: float = 0.15,
    conversation_id: str | None = None,
) -> Prefilled:
    return engine.salted(salt).prefill(segments, policy, ratio, conversation_id)


def full_logits(lm: LoadedModel, segments: list[TokenSegment]) -> Tensor:
    return ChunkEngine(lm).prefill(segments, "full").logits


# The engine: a salt is a namespace of its own.


@pytest.mark.parametrize("policy", REUSING)
@pytest.mark.parametrize(
    ("first", "second"),
    [(TENANT_A, TENANT_B), (None, TENANT_A), (TENANT_A, None)],
    ids=["two-salts", "unsalted-then-salted", "salted-then-unsalted"],
)
def test_requests_of_other_salts_never_share_kv(
    lm: LoadedModel, policy: Policy, first: str | None, second: str | None
) -> None:
    for prompt in (PROMPT, MOVED):  # an exact prefix, and chunks that moved
        engine = ChunkEngine(lm)
        run(engine, PROMPT, "full", first)
        other = run(engine, prompt, policy, second).stats
        assert (other.reused_tokens, other.chunk_hits, other.chunk_misses) == (0, 0, 2)
        same = run(engine, PROMPT, policy, first).stats
        assert same.reused_tokens == same.prompt_tokens - 1  # all but the last, as unsalted
        assert same.chunk_hits == 2


def test_requests_of_one_salt_reuse_moved_chunks(lm: LoadedModel) -> None:
    engine = ChunkEngine(lm)
    run(engine, PROMPT, "full", TENANT_A)
    stats = run(engine, MOVED, "reuse", TENANT_A).stats
    assert stats.chunk_hits == 2
    assert stats.reused_tokens == len(SYSTEM.ids) + len(A.ids) + len(B.ids)


def test_unsalted_requests_use_the_model_fingerprint_and_salted_ones_its_digest(
    lm: LoadedModel,
) -> None:
    engine = ChunkEngine(lm)
    assert engine.salted(None) is engine and engine.namespace == lm.fingerprint
    salted = salted_namespace(lm.fingerprint, TENANT_A)
    assert engine.salted(TENANT_A).namespace == salted != lm.fingerprint
    assert salted.startswith(lm.fingerprint) and TENANT_A not in salted
    assert salted != salted_namespace(lm.fingerprint, TENANT_B)
    run(engine, PROMPT, "full", TENANT_A)
    assert engine.store.variants(salted, "a") and not engine.store.variants(lm.fingerprint, "a")
    run(engine, PROMPT, "full", None)
    assert engine.store.variants(lm.fingerprint, "a")


def test_conversation_memory_is_kept_per_salt_and_conversation(lm: LoadedModel) -> None:
    engine = ChunkEngine(lm)
    first = run(engine, PROMPT, "full", TENANT_A, conversation_id="c")
    answer = list(engine.decode(first, SamplingParams(max_tokens=4)))
    engine.salted(TENANT_A).remember("c", first)
    # The next turn: the past prompt and its answer (only the memory holds the answer's KV,
    # all of it but its last token's).
    turn = [*PROMPT, text(answer[:-1]), text(random_ids(5, 20))]
    past = len(first.ids)
    for salt in (TENANT_B, None):
        other = run(engine, turn, "prefix", salt, conversation_id="c").stats
        assert (other.reused_tokens, other.extra["prefix_tokens"]) == (0, 0)
    own = run(engine, turn, "prefix", TENANT_A, conversation_id="c").stats
    assert own.extra["prefix_tokens"] == own.reused_tokens == past
    assert list(engine.remembered()) == [f"{engine.salted(TENANT_A).namespace}\x00c"]


@pytest.mark.parametrize("policy", REUSING)
def test_a_tiered_store_on_disk_keeps_salts_apart_across_engines(
    lm: LoadedModel, tmp_path: Path, policy: Policy
) -> None:
    def tiered() -> TieredKVStore:
        tiers: list[Tier] = [MemoryTier("host", 10**6), DiskTier(tmp_path / "kv", 10**8)]
        return TieredKVStore(tiers, write_through=True)

    first = tiered()
    run(ChunkEngine(lm, first), PROMPT, "full", TENANT_A)
    first.close()  # its writes to disk are done
    second = tiered()
    engine = ChunkEngine(lm, second)  # another process on the same disk tier
    for salt in (TENANT_B, None):
        other = run(engine, PROMPT, policy, salt).stats
        assert (other.reused_tokens, other.chunk_hits) == (0, 0)
    own = run(engine, PROMPT, policy, TENANT_A).stats
    assert (own.reused_tokens, own.chunk_hits) == (own.prompt_tokens - 1, 2)
    second.close()
    files = [path for path in (tmp_path / "kv").rglob("*") if path.is_file()]
    assert files and not any(TENANT_A.encode() in path.read_bytes() for path in files)


def test_within_a_salt_reuse_stays_exact(lm: LoadedModel) -> None:
    engine = ChunkEngine(lm)
    run(engine, [SYSTEM, A, QUESTION], "full", TENANT_A)
    run(engine, [SYSTEM, B, QUESTION], "full", TENANT_A)
    blended = run(engine, PROMPT, "cacheblend", TENANT_A, ratio=1.0)
    assert blended.stats.chunk_hits == 2
    expected = full_logits(lm, PROMPT)
    assert (blended.logits - expected).abs().max().item() < TOLERANCE
    run(engine, PROMPT, "full", TENANT_A)
    prefix = run(engine, [*PROMPT, text(random_ids(4, 30))], "prefix", TENANT_A)
    assert prefix.stats.reused_tokens == sum(len(s.ids) for s in PROMPT)
    expected = full_logits(lm, [*PROMPT, text(random_ids(4, 30))])
    assert (prefix.logits - expected).abs().max().item() < TOLERANCE


def test_the_batching_queue_orders_a_job_by_what_its_own_salt_cached(lm: LoadedModel) -> None:
    engine = ChunkEngine(lm)
    run(engine, PROMPT, "full", TENANT_A)
    backend = BatchingBackend(engine)
    try:
        jobs = [
            Job(
                GenerationRequest([TextSegment("hi")], cache_salt=salt),
                list(PROMPT),  # the prompt as the engine runs it
                TextStream(backend.tokenizer, lm.eos_ids, ()),
            )
            for salt in (TENANT_A, TENANT_B, None)
        ]
        counts = backend._scheduler._cached_counts(jobs)
    finally:
        backend.shutdown()
    total = sum(len(s.ids) for s in PROMPT)
    assert [counts[job] for job in jobs] == [(total, 0), (0, total), (0, total)]


# Validation: vLLM's rule, everywhere.


@pytest.mark.parametrize("salt", [*BAD_SALTS, 7])
def test_a_bad_salt_is_a_value_error(salt: Any) -> None:
    with pytest.raises(ValueError, match="cache_salt"):
        GenerationRequest([TextSegment("hi")], cache_salt=salt)
    with pytest.raises(ValueError, match="cache_salt"):
        build_request("hi", ChunkCache(backend=FakeBackend()), cache_salt=salt)


def test_a_lone_surrogate_is_invalid_text() -> None:
    with pytest.raises(InvalidTextError, match="cache_salt"):
        check_cache_salt("\udc00")
    assert check_cache_salt("x" * 128) == "x" * 128


# The server and HttpBackend.


def test_completions_and_chat_completions_take_a_top_level_salt() -> None:
    backend = FakeBackend()
    with TestClient(create_app(backend, ServeSettings())) as client:
        model = backend.model_name
        messages = [{"role": "user", "content": "hi"}]
        bodies: list[tuple[str, dict[str, Any]]] = [
            ("/v1/completions", {"prompt": "hi"}),
            ("/v1/chat/completions", {"messages": messages}),
        ]
        for path, body in bodies:
            for salt in (TENANT_A, None):
                answer = client.post(path, json={"model": model, **body, "cache_salt": salt})
                assert answer.status_code == 200, answer.text
                assert backend.requests[-1].cache_salt == salt
        client.post("/v1/completions", json={"model": model, "prompt": "hi"})
        assert backend.requests[-1].cache_salt is None


@pytest.mark.parametrize("salt", [*BAD_SALTS[:-1], 7, ["a"]])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_the_server_refuses_a_bad_salt_with_a_400_naming_it(path: str, salt: Any) -> None:
    backend = FakeBackend()
    hi: dict[str, Any] = {"prompt": "hi"}
    if "chat" in path:
        hi = {"messages": [{"role": "user", "content": "hi"}]}
    body = {"model": backend.model_name, "cache_salt": salt, **hi}
    with TestClient(create_app(backend, ServeSettings())) as client:
        answer = client.post(path, json=body)
    assert answer.status_code == 400
    error = answer.json()["error"]
    assert error["param"] == "cache_salt" and "cache_salt" in error["message"]
    assert not backend.requests


def test_the_server_refuses_an_escaped_lone_surrogate_salt() -> None:
    backend = FakeBackend()
    # spelled out: httpx cannot encode a lone surrogate, JSON can escape one
    raw = '{"model": "fake-chatml", "prompt": "hi", "cache_salt": "a\\ud83d"}'
    with TestClient(create_app(backend, ServeSettings())) as client:
        answer = client.post(
            "/v1/completions", content=raw, headers={"content-type": "application/json"}
        )
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "cache_salt"


@pytest.fixture(params=["local", "batching"])
def served_url(request: pytest.FixtureRequest, lm: LoadedModel) -> Iterator[str]:
    engine = ChunkEngine(lm)
    backend = LocalBackend(engine) if request.param == "local" else BatchingBackend(engine)
    with serve_app(create_app(backend, ServeSettings())) as url:
        yield url


def test_http_backend_carries_the_salt_to_the_engine_end_to_end(served_url: str) -> None:
    http = HttpBackend(served_url)
    cache = ChunkCache(backend=http)
    words = " ".join(f"w{i}" for i in range(40, 60))

    def ask(salt: str | None, question: str) -> Any:
        prompt = f"w1 w2 w3 {words} {question}"
        request = build_request(
            prompt, cache, chunks=[("c1", words)], max_tokens=2, cache_salt=salt
        )
        assert request.cache_salt == salt
        return generate(http, request)[1]

    first = ask(TENANT_A, "w7 w8")
    assert (first.reused_tokens, first.chunk_misses) == (0, 1)
    for salt in (TENANT_B, None):
        other = ask(salt, "w7 w9")
        assert (other.reused_tokens, other.chunk_hits) == (0, 0)
    own = ask(TENANT_A, "w7 w10")
    assert own.chunk_hits == 1 and own.reused_tokens >= 3 + 20


# VllmBackend and the wrappers.


def test_vllm_backend_puts_the_salt_in_the_request_body() -> None:
    server = FakeVllm()
    backend = make_backend(server)
    segments = [TextSegment("Q?")]
    generate(backend, GenerationRequest(segments, cache_salt=TENANT_A))
    assert server.body()["cache_salt"] == TENANT_A
    generate(backend, GenerationRequest(segments))
    assert "cache_salt" not in server.body()


def test_langchain_llm_takes_a_salt_and_per_call_overrides_it() -> None:
    backend = FakeBackend()
    llm = LangChainLLM(chunk_cache=ChunkCache(backend=backend), cache_salt=TENANT_A)
    llm.invoke([HumanMessage("hi")])
    assert backend.requests[-1].cache_salt == TENANT_A
    llm.invoke([HumanMessage("hi")], cache_salt=TENANT_B)
    assert backend.requests[-1].cache_salt == TENANT_B
    LangChainLLM(chunk_cache=ChunkCache(backend=backend)).invoke([HumanMessage("hi")])
    assert backend.requests[-1].cache_salt is None
    with pytest.raises(ValueError, match="cache_salt"):
        LangChainLLM(chunk_cache=ChunkCache(backend=backend), cache_salt="a/b")
    with pytest.raises(ValueError, match="cache_salt"):
        llm.invoke([HumanMessage("hi")], cache_salt="")


def test_langchain_traces_and_response_cache_keys_see_a_digest_never_the_salt() -> None:
    llm = LangChainLLM(chunk_cache=ChunkCache(backend=FakeBackend()), cache_salt=TENANT_A)
    other = llm.model_copy(update={"cache_salt": TENANT_B})
    shown = [
        repr(llm),
        str(llm._identifying_params),
        str(llm._get_invocation_params(stop=None)),
        llm._get_llm_string(),
        llm._get_llm_string(cache_salt=TENANT_B),
        json.dumps(llm.model_dump(), default=str),
    ]
    assert not any(TENANT_A in s or TENANT_B in s for s in shown)
    assert llm._get_llm_string() != other._get_llm_string()  # one tenant's answer is not another's
    assert llm._get_llm_string() != llm._get_llm_string(cache_salt=TENANT_B)


def test_llama_index_llm_takes_a_salt_and_keeps_it_out_of_its_dumps() -> None:
    backend = FakeBackend()
    llm = LlamaIndexLLM(cache=ChunkCache(backend=backend), cache_salt=TENANT_A)
    llm.chat([ChatMessage(role="user", content="hi")])
    assert backend.requests[-1].cache_salt == TENANT_A
    assert llm.for_conversation("c").cache_salt == TENANT_A
    llm.complete("hi", cache_salt=TENANT_B)
    assert backend.requests[-1].cache_salt == TENANT_B
    assert TENANT_A not in json.dumps(llm.to_dict(), default=str) and TENANT_A not in repr(llm)
    with pytest.raises(ValueError, match="cache_salt"):
        LlamaIndexLLM(cache=ChunkCache(backend=backend), cache_salt="x" * 129)


def test_a_batched_request_prefetches_and_is_first_counted_under_its_own_salt(
    lm: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Prefetching another salt's entries is wasted work, and a first queue position counted
    from them a timing signal across tenants."""
    namespaces: list[str] = []
    counting = batching.cached_tokens

    def counted(store: Any, namespace: str, segments: Any) -> tuple[int, int]:
        namespaces.append(namespace)
        return counting(store, namespace, segments)

    monkeypatch.setattr(batching, "prefetch", lambda store, ns, ids: namespaces.append(ns))
    monkeypatch.setattr(batching, "cached_tokens", counted)
    backend = BatchingBackend(ChunkEngine(lm))
    try:
        sampling = SamplingParams(max_tokens=1)
        request = GenerationRequest([TextSegment("w1 w2")], cache_salt=TENANT_A, sampling=sampling)
        list(backend.submit(request))
    finally:
        backend.shutdown()
    assert namespaces == [salted_namespace(lm.fingerprint, TENANT_A)] * 2
