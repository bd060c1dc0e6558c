"""Requests of one conversation at the same time: two tabs of one user, a graph fanning out
two LLM calls of one thread, a turn retried while its first try still streams.

Threads (and asyncio tasks for the async APIs) send overlapping turns of the same and of
different conversation ids, with fixed seeds, through ``LocalBackend``,
``BatchingBackend`` and LangChain's ``ChunkCacheRetriever`` + ``ChunkCacheLLM``, on a tiny
seeded float32 Llama.  Over all of it: nothing raises but the documented refusals; what a
policy promises exact (``full``, ``prefix``, ``cacheblend`` at ratio 1.0) answers as a full
prefill of the same prompt does; stats add up; the engine's conversation memory stays in its
bounds and holds only sequences a request of that conversation ran, with their own KV; and
a ``with_chunk_history`` turn never drops a chunk its prompt does not hold.
"""

from __future__ import annotations

import asyncio
import random
import threading
from collections.abc import AsyncGenerator, Iterator
from dataclasses import dataclass, field
from typing import Any, cast

import pytest
import torch
from concurrency_support import TIMEOUT_S, run_threads
from langchain_core.callbacks import CallbackManagerForRetrieverRun
from langchain_core.documents import Document
from langchain_core.messages import (
    AIMessage,
    AIMessageChunk,
    BaseMessage,
    HumanMessage,
    SystemMessage,
)
from langchain_core.retrievers import BaseRetriever
from langchain_core.runnables import RunnableConfig
from pydantic import Field
from tiny_models import TOLERANCE, text, tiny_lm, tiny_tokenizer

from chunkcache.core.batching import BatchingBackend
from chunkcache.core.cache import ChunkCache
from chunkcache.core.conversation_memory import (
    SEQUENCES_PER_CONVERSATION,
    UNCONTINUED_PER_CONVERSATION,
)
from chunkcache.core.engine import ChunkEngine, Prefilled
from chunkcache.core.errors import QueueFullError
from chunkcache.core.generation import (
    GenerationChunk,
    GenerationRequest,
    GenerationStats,
    Policy,
    SamplingParams,
)
from chunkcache.core.ledger import ConversationLedger, DedupeMode
from chunkcache.core.local_backend import LocalBackend
from chunkcache.core.models import LoadedModel
from chunkcache.core.segmenter import ChunkSegment, Segment, TextSegment
from chunkcache.integrations.langchain import ChunkCacheLLM, ChunkCacheRetriever
from chunkcache.integrations.langchain_history import (
    InMemoryChatHistory,
    chunk_chat_prompt,
    with_chunk_history,
)

POLICIES: tuple[tuple[Policy, float], ...] = (
    ("full", 0.15),
    ("prefix", 0.15),
    ("cacheblend", 1.0),
    ("cacheblend", 0.15),
    ("reuse", 0.15),
    ("cachecraft", 0.3),
)
EXACT: tuple[tuple[Policy, float], ...] = (("full", 0.15), ("prefix", 0.15), ("cacheblend", 1.0))
CHUNKS = [
    ChunkSegment(f"c{i}", " ".join(f"w{3 + (11 * i + 5 * j) % 120}" for j in range(6 + i % 5)))
    for i in range(10)
]
MAX_CONVERSATIONS = 3
MAX_CONVERSATION_TOKENS = 400


@pytest.fixture(scope="module")
def lm() -> LoadedModel:
    """The tiny Llama, with a chat template that writes each message's text then a space."""
    model, tokenizer = tiny_lm("llama"), tiny_tokenizer()
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    return LoadedModel(model.hf, tokenizer, model.spec, model.rope, model.fingerprint)


# The engine under threads: what each request ran, what the memory kept.


class WatchedEngine(ChunkEngine):
    """A :class:`ChunkEngine` that records the sequences :meth:`remember` is given."""

    def __init__(self, lm: LoadedModel) -> None:
        super().__init__(
            lm,
            max_conversations=MAX_CONVERSATIONS,
            max_conversation_tokens=MAX_CONVERSATION_TOKENS,
        )
        self.remembered_ids: dict[str, set[tuple[int, ...]]] = {}
        self.prompts_run: dict[str, set[tuple[int, ...]]] = {}
        self._record = threading.Lock()

    def remember(self, conversation_id: str, prefilled: Prefilled) -> None:
        with self._record:
            prompt = tuple(prefilled.ids[: prefilled.stats.prompt_tokens])
            self.prompts_run.setdefault(conversation_id, set()).add(prompt)
            ran = tuple(prefilled.ids[: prefilled.kv.length])
            self.remembered_ids.setdefault(conversation_id, set()).add(ran)
        super().remember(conversation_id, prefilled)


def memory_bounds_hold(engine: ChunkEngine) -> None:
    """The memory's bounds: conversations, tokens in all, sequences of each conversation."""
    lengths = engine.remembered()
    assert len(lengths) <= MAX_CONVERSATIONS
    assert sum(lengths.values()) <= MAX_CONVERSATION_TOKENS
    with engine.conversations._lock:  # between two turns' changes, as every reader sees it
        for kept in engine.conversations._conversations.values():
            assert len(kept) <= SEQUENCES_PER_CONVERSATION
            assert sum(not k.continued for k in kept) <= UNCONTINUED_PER_CONVERSATION


def assert_memory_holds_only_what_ran(engine: WatchedEngine, lm: LoadedModel) -> None:
    """Every kept sequence is one a request of its conversation ran (its prompt and answer),
    and its KV is that sequence's: exact up to ``exact_until`` as a full prefill computes it."""
    reference = ChunkEngine(lm)
    for conversation, kept in list(engine.conversations._conversations.items()):
        for k in kept:
            past = k.past
            assert past.ids in engine.remembered_ids[conversation]
            assert past.ids[: past.prompt_length] in engine.prompts_run[conversation]
            exact = past.exact_until
            if exact == 0:
                continue
            full = reference.prefill([text(list(past.ids[:exact]))], "full")
            for ours, theirs in ((past.kv.k, full.kv.k), (past.kv.v, full.kv.v)):
                # ours, theirs: [L, H_kv, S, D]
                assert torch.allclose(ours[:, :, :exact], theirs, atol=TOLERANCE, rtol=0)


@dataclass
class Sent:
    """One request a thread sent and what came back (``text`` None: it was cut short)."""

    request: GenerationRequest
    text: str | None = None
    stats: GenerationStats | None = None


@dataclass
class Conversation:
    """What one client of a conversation has seen: its last prompt and that prompt's answer."""

    conversation_id: str
    segments: list[Segment] = field(default_factory=list)


def next_request(rng: random.Random, client: Conversation, turn: int) -> GenerationRequest:
    """A random next turn: the last prompt and answer continued with new chunks and a
    question, the same prompt again (a retry), or another prompt shape."""
    question = TextSegment(f" w{4 + turn % 7} w{90 + rng.randrange(30)}")
    chunks = rng.sample(CHUNKS, rng.randint(1, 3))
    roll = rng.random()
    if client.segments and roll < 0.25:
        segments = list(client.segments)  # the retry of a turn
    elif client.segments and roll < 0.8:
        segments = [*client.segments, *chunks, question]
    else:
        segments = [TextSegment(f"w1 w2 w{rng.randrange(3, 9)}"), *chunks, question]
    policy, ratio = rng.choice(POLICIES)
    sampling = SamplingParams(max_tokens=rng.randint(1, 6))
    return GenerationRequest(segments, client.conversation_id, policy, ratio, sampling)


def read(rng: random.Random, stream: Iterator[GenerationChunk], sent: Sent) -> None:
    """Read ``stream`` to its end, or (rarely) close it after its first piece."""
    pieces: list[GenerationChunk] = []
    with_close = getattr(stream, "close", None)
    for piece in stream:
        pieces.append(piece)
        if piece.stats is None and rng.random() < 0.1 and with_close is not None:
            with_close()
            return
    sent.text = "".join(piece.text for piece in pieces)
    sent.stats = pieces[-1].stats


def run_clients(backend: Any, seed: int, clients: list[Conversation], turns: int) -> list[Sent]:
    """Each client in its own thread sends ``turns`` random turns, reading each as it
    streams; the clients start together.  Returns every request sent."""
    barrier = threading.Barrier(len(clients))
    sent: list[Sent] = []
    errors: list[BaseException] = []
    lock = threading.Lock()

    def client_loop(index: int, client: Conversation) -> None:
        rng = random.Random(seed * 1000 + index)
        barrier.wait()
        try:
            for turn in range(turns):
                request = next_request(rng, client, turn)
                one = Sent(request)
                try:
                    read(rng, backend.stream(request), one)
                except QueueFullError:  # a documented refusal
                    continue
                with lock:
                    sent.append(one)
                if one.text is not None:
                    client.segments = [*request.segments, TextSegment(one.text)]
        except BaseException as error:
            errors.append(error)

    threads = [
        threading.Thread(target=client_loop, args=(i, c), daemon=True)
        for i, c in enumerate(clients)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(TIMEOUT_S)
    assert not any(thread.is_alive() for thread in threads), "a client hung"
    assert not errors, errors
    return sent


def assert_answers_and_stats(lm: LoadedModel, backend: Any, sent: list[Sent]) -> None:
    """Exact policies answer as a full prefill alone; every request's stats add up."""
    reference = LocalBackend(ChunkEngine(lm))
    for one in sent:
        if one.text is None:
            continue
        stats = one.stats
        assert stats is not None
        tokens = backend.segment_tokenizer(one.request.segments)
        assert stats.prompt_tokens == sum(len(s.ids) for s in tokens)
        assert (
            stats.reused_tokens + stats.recomputed_tokens + stats.computed_tokens
            == stats.prompt_tokens
        )
        assert stats.chunk_hits + stats.chunk_misses == sum(s.is_chunk for s in tokens)
        request = one.request
        if (request.policy, request.recompute_ratio) in EXACT:
            alone = GenerationRequest(request.segments, None, "full", sampling=request.sampling)
            pieces = list(reference.stream(alone))
            assert one.text == "".join(piece.text for piece in pieces), request


def clients() -> list[Conversation]:
    """Three clients of conversation "a" (tabs), one each of "b", "c", "d": more
    conversations than the memory keeps."""
    return [Conversation(c) for c in ("a", "a", "a", "b", "c", "d")]


class Watch:
    """Checks the memory's bounds, from another thread, while the clients run."""

    def __init__(self, engine: ChunkEngine) -> None:
        self.engine = engine
        self.stop = threading.Event()
        self.errors: list[BaseException] = []
        self.thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        while not self.stop.wait(0.002):
            try:
                memory_bounds_hold(self.engine)
            except BaseException as error:
                self.errors.append(error)
                return

    def __enter__(self) -> Watch:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(TIMEOUT_S)
        assert not self.errors, self.errors


@pytest.mark.parametrize("seed", range(2))
def test_local_backend_threads_sharing_conversations(lm: LoadedModel, seed: int) -> None:
    probe_backend(lm, seed, batching=False, turns=5)


@pytest.mark.parametrize("seed", range(2))
def test_batching_backend_threads_sharing_conversations(lm: LoadedModel, seed: int) -> None:
    probe_backend(lm, seed, batching=True, turns=5)


def probe_backend(lm: LoadedModel, seed: int, batching: bool, turns: int) -> None:
    """Clients of shared conversations on a local or batching backend; every claim checked."""
    engine = WatchedEngine(lm)
    backend: Any = (
        BatchingBackend(engine, max_queue=4, max_batch=3) if batching else LocalBackend(engine)
    )
    try:
        with Watch(engine):
            sent = run_clients(backend, seed, clients(), turns)
    finally:
        if batching:
            assert backend.shutdown()
    assert_answers_and_stats(lm, backend, sent)
    memory_bounds_hold(engine)
    assert_memory_holds_only_what_ran(engine, lm)


@pytest.mark.slow
@pytest.mark.parametrize("batching", [False, True])
@pytest.mark.parametrize("seed", range(2, 8))
def test_longer_runs_sharing_conversations(lm: LoadedModel, seed: int, batching: bool) -> None:
    probe_backend(lm, seed, batching, turns=10)


# LangChain: with_chunk_history turns of one session at the same time.

FACTS = [" ".join(f"w{3 + (13 * i + 7 * j) % 120}" for j in range(8)) for i in range(14)]
SYSTEM = "w1 w2 w3"
TURN = "w4 {context} w5 {question}"


class PlannedRetriever(BaseRetriever):
    """Returns the facts ``plan`` gives each query; a query in ``hooks`` first calls its
    hook (to hold it at a chosen point of another turn)."""

    plan: dict[str, list[str]]
    hooks: dict[str, Any] = Field(default_factory=dict)

    def _get_relevant_documents(
        self, query: str, *, run_manager: CallbackManagerForRetrieverRun
    ) -> list[Document]:
        hook = self.hooks.get(query)
        if hook is not None:
            hook()
        return [Document(page_content=fact) for fact in self.plan[query]]


class RecordedStream(Iterator[GenerationChunk]):
    """A backend's stream whose pieces are recorded in ``sent`` as they are read; cancel and
    close reach the backend's stream."""

    def __init__(self, stream: Any, sent: Sent) -> None:
        self._stream = stream
        self._sent = sent
        self._pieces: list[GenerationChunk] = []

    def __next__(self) -> GenerationChunk:
        piece = next(self._stream)
        self._pieces.append(piece)
        if piece.stats is not None:
            self._sent.text = "".join(p.text for p in self._pieces)
            self._sent.stats = piece.stats
        return piece

    def cancel(self) -> None:
        self._stream.cancel()

    def close(self) -> None:
        self._stream.close()


class Recording:
    """A backend mixin recording each request and its answer; ``on_request`` (if set) is
    called with each request's prompt text before it runs."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.sent: list[Sent] = []
        self.on_request: Any = None
        self._record = threading.Lock()

    def stream(self, request: GenerationRequest) -> Any:
        if self.on_request is not None:
            self.on_request(prompt_text(request))
        one = Sent(request)
        with self._record:
            self.sent.append(one)
        return RecordedStream(super().stream(request), one)  # type: ignore[misc]


class RecordingBackend(Recording, LocalBackend):
    """The local backend, recording its requests."""


class RecordingBatchingBackend(Recording, BatchingBackend):
    """The batching backend, recording its requests."""


def prompt_text(request: GenerationRequest) -> str:
    return "".join(segment.text for segment in request.segments)


class TabbedChat:
    """``with_chunk_history`` chains (one per exact policy) over one cache, retriever and
    session histories, on the tiny model."""

    def __init__(self, lm: LoadedModel, dedupe: DedupeMode, plan: dict[str, list[str]]) -> None:
        self.backend = RecordingBackend(ChunkEngine(lm))
        cache = ChunkCache(backend=self.backend)
        self.base = PlannedRetriever(plan=plan)
        retriever = ChunkCacheRetriever(base_retriever=self.base, cache=cache, dedupe=dedupe)
        self.histories: dict[str, InMemoryChatHistory] = {}
        self.chains = [
            with_chunk_history(
                chunk_chat_prompt(SYSTEM)
                | ChunkCacheLLM(
                    chunk_cache=cache, max_tokens=3, recompute=policy, recompute_ratio=ratio
                ),
                retriever,
                lambda session_id: self.histories.setdefault(session_id, InMemoryChatHistory()),
                turn_template=TURN,
            )
            for policy, ratio in EXACT[1:]
        ]

    def assert_every_retrieved_chunk_is_sent(self) -> None:
        """Each prompt holds every fact the base retriever returned for its question: this
        turn's, or an earlier turn's still in its history (never one only another turn has)."""
        assert self.backend.sent
        for one in self.backend.sent:
            prompt = prompt_text(one.request)
            question = next(q for q in self.base.plan if prompt.rstrip().endswith(q))
            missing = [fact for fact in self.base.plan[question] if fact not in prompt]
            assert not missing, f"{question!r}: {missing} not in {prompt!r}"


def config(session: str) -> RunnableConfig:
    return RunnableConfig(configurable={"session_id": session})


def racing_plan() -> dict[str, list[str]]:
    """Two questions sharing a fact (FACTS[0])."""
    return {"w60 w61": [FACTS[0], FACTS[1]], "w62 w63": [FACTS[0], FACTS[2]]}


def hold_b_until_a_is_planned(chat: TabbedChat) -> None:
    """Turn B synced the ledger to the history and waits in its base retriever; turn A's
    retrieval then records its facts, and B's retrieval goes on once A's prompt is sent."""
    asked_a, asked_b = racing_plan()
    b_retrieving, a_sent = threading.Event(), threading.Event()

    def b_waits() -> None:
        b_retrieving.set()
        assert a_sent.wait(TIMEOUT_S)

    def on_request(prompt: str) -> None:
        if prompt.rstrip().endswith(asked_a):
            a_sent.set()

    chat.base.hooks = {asked_a: lambda: b_retrieving.wait(TIMEOUT_S), asked_b: b_waits}
    chat.backend.on_request = on_request


@pytest.mark.parametrize("dedupe", ["drop", "mark"])
def test_two_tabs_of_one_session_each_send_the_chunks_they_leave_out(
    lm: LoadedModel, dedupe: DedupeMode
) -> None:
    """Turn B loaded the history before turn A (same session) recorded FACTS[0] in the
    ledger: B's prompt lacks A's unsaved turn, so B must send FACTS[0] itself."""
    chat = TabbedChat(lm, dedupe, racing_plan())
    hold_b_until_a_is_planned(chat)
    chain = chat.chains[0]
    asked = [lambda q=q: chain.invoke({"question": q}, config("s")) for q in racing_plan()]
    assert not run_threads(asked)
    assert len(chat.backend.sent) == 2
    chat.assert_every_retrieved_chunk_is_sent()


async def test_two_async_turns_of_one_session_each_send_the_chunks_they_leave_out(
    lm: LoadedModel,
) -> None:
    chat = TabbedChat(lm, "drop", racing_plan())
    hold_b_until_a_is_planned(chat)
    chain = chat.chains[0]
    turns = [chain.ainvoke({"question": q}, config("s")) for q in racing_plan()]
    await asyncio.wait_for(asyncio.gather(*turns), TIMEOUT_S)
    assert len(chat.backend.sent) == 2
    chat.assert_every_retrieved_chunk_is_sent()


def random_plan(rng: random.Random, n: int) -> dict[str, list[str]]:
    """``n`` questions, each retrieving 1-3 random facts (so turns share facts often)."""
    questions = [f"w{60 + i} w{100 + (7 * i) % 20}" for i in range(n)]
    return {q: rng.sample(FACTS, rng.randint(1, 3)) for q in questions}


def turns_of(rng: random.Random, plan: dict[str, list[str]], n: int) -> list[tuple[str, int, str]]:
    """A client's ``n`` turns: question (sometimes the last one again: a retry), chain
    index, and how it is called."""
    turns: list[tuple[str, int, str]] = []
    for _ in range(n):
        again = turns and rng.random() < 0.25
        question = turns[-1][0] if again else rng.choice(list(plan))
        turns.append((question, rng.randrange(2), rng.choice(["invoke", "stream"])))
    return turns


SESSIONS = ("s1", "s1", "s1", "s2")  # three tabs of one session, one of another


def assert_chat_claims(lm: LoadedModel, chat: TabbedChat, turns: int) -> None:
    """Every retrieved chunk is sent; answers exact, stats add up; each session's history
    holds one user message and one answer per turn."""
    chat.assert_every_retrieved_chunk_is_sent()
    assert_answers_and_stats(lm, chat.backend, chat.backend.sent)
    for session, history in chat.histories.items():
        assert len(history.messages) == 2 * turns * SESSIONS.count(session)


@pytest.mark.parametrize("dedupe", ["drop", "mark"])
@pytest.mark.parametrize("seed", range(2))
def test_threads_of_tabs_and_retries_never_lose_a_chunk(
    lm: LoadedModel, dedupe: DedupeMode, seed: int
) -> None:
    rng = random.Random(seed)
    chat = TabbedChat(lm, dedupe, random_plan(rng, 8))
    plans = [turns_of(rng, chat.base.plan, 3) for _ in SESSIONS]
    barrier = threading.Barrier(len(SESSIONS))

    def client(session: str, turns: list[tuple[str, int, str]]) -> None:
        barrier.wait()
        for question, chain, how in turns:
            call = getattr(chat.chains[chain], how)
            answer = call({"question": question}, config(session))
            if how == "stream":
                list(answer)

    errors = run_threads(
        [lambda s=s, p=p: client(s, p) for s, p in zip(SESSIONS, plans, strict=True)]
    )
    assert not errors, errors
    assert_chat_claims(lm, chat, 3)


@pytest.mark.parametrize("dedupe", ["drop", "mark"])
async def test_async_tasks_of_tabs_and_retries_never_lose_a_chunk(
    lm: LoadedModel, dedupe: DedupeMode
) -> None:
    rng = random.Random(7)
    chat = TabbedChat(lm, dedupe, random_plan(rng, 8))
    plans = [turns_of(rng, chat.base.plan, 3) for _ in SESSIONS]

    async def client(session: str, turns: list[tuple[str, int, str]]) -> None:
        for question, chain, how in turns:
            inputs = {"question": question}
            if how == "stream":
                _ = [piece async for piece in chat.chains[chain].astream(inputs, config(session))]
            else:
                await chat.chains[chain].ainvoke(inputs, config(session))

    clients = [client(session, turns) for session, turns in zip(SESSIONS, plans, strict=True)]
    await asyncio.wait_for(asyncio.gather(*clients), TIMEOUT_S)
    assert_chat_claims(lm, chat, 3)


# ChunkCacheLLM's async API: tasks of one conversation on the local and batching backends.


async def chat_task(rng: random.Random, llm: ChunkCacheLLM, conversation: str, turns: int) -> None:
    """``turns`` turns of a chat: each continues the messages and answer so far (or asks the
    last turn again), under a random policy; some are left after their first piece."""
    messages: list[BaseMessage] = [SystemMessage(SYSTEM)]
    for turn in range(turns):
        if turn == 0 or rng.random() > 0.25:
            facts = " ".join(rng.sample(FACTS, rng.randint(1, 3)))
            messages = [*messages, HumanMessage(f"w4 {facts} w5 w{60 + rng.randrange(50)}")]
        policy, ratio = rng.choice(POLICIES)
        options: dict[str, Any] = {
            "recompute": policy,
            "recompute_ratio": ratio,
            "max_tokens": rng.randint(1, 5),
        }
        stream = cast(
            AsyncGenerator[AIMessageChunk, None],
            llm.astream(messages, config(conversation), **options),
        )
        answer = ""
        async for piece in stream:
            answer += str(piece.content)
            if rng.random() < 0.08:  # the app stops reading: the request is cancelled
                await stream.aclose()
                break
        else:
            messages = [*messages, AIMessage(answer)]


@pytest.mark.parametrize("batching", [False, True])
async def test_async_llm_tasks_sharing_conversations(lm: LoadedModel, batching: bool) -> None:
    engine = WatchedEngine(lm)
    backend: Any = (
        RecordingBatchingBackend(engine, max_queue=8, max_batch=3)
        if batching
        else RecordingBackend(engine)
    )
    cache = ChunkCache(backend=backend)
    for i, fact in enumerate(FACTS):
        cache.registry.register(f"fact{i}", fact)
    llm = ChunkCacheLLM(chunk_cache=cache)
    rng = random.Random(3)
    conversations = ("a", "a", "a", "b", "c", "d")
    tasks = [chat_task(random.Random(rng.random()), llm, c, 4) for c in conversations]
    try:
        with Watch(engine):
            await asyncio.wait_for(asyncio.gather(*tasks), TIMEOUT_S)
    finally:
        if batching:
            assert backend.shutdown()
    assert sum(one.stats is not None and one.stats.chunk_hits > 0 for one in backend.sent)
    assert_answers_and_stats(lm, backend, backend.sent)
    memory_bounds_hold(engine)
    assert_memory_holds_only_what_ran(engine, lm)


# The ledger: a turn dedupes against its own prompt's chunks.


def test_a_ledger_turn_dedupes_against_its_own_chunks_and_records_to_the_shared_set() -> None:
    ledger = ConversationLedger()
    ledger.replace("s", ["x"])
    recorded_by_other_turn = threading.Event()

    def other_turn() -> None:
        ledger.apply("s", ["y"], "drop")
        recorded_by_other_turn.set()

    with ledger.turn("s", ["x"]):
        assert not run_threads([other_turn]) and recorded_by_other_turn.is_set()
        first = ledger.apply("s", ["x", "y", "z"], "drop")
        assert (first.kept, first.dropped, first.seen) == (["y", "z"], ["x"], {"x"})
        again = ledger.apply("s", ["z", "w"], "mark")  # what this turn sent counts
        assert again.seen == {"x", "y", "z"} and again.kept == ["z", "w"]
        assert ledger.apply("t", ["y"], "drop").kept == ["y"]  # other conversations: shared
        assert ledger.apply("t", ["y"], "drop").kept == []
    assert ledger.seen("s") == {"x", "y", "z", "w"}
    assert ledger.apply("s", ["y"], "drop").kept == []  # outside: the shared set again
