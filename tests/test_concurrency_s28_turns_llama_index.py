"""``ChunkCacheChatEngine`` turns of one conversation at once (two tabs, a retry while the
first try still streams), from threads and asyncio tasks.

A turn synced the ledger to its history, then retrieved: a turn running at once recorded
its chunks there meanwhile, so ``dedupe="drop"`` left them out of this prompt, whose
history does not hold them.  And only the turn begun last was saved: a turn that finished
after another had begun was lost.  Hooks in the retriever and the LLM force the bad
interleavings.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Sequence
from typing import Any

import pytest
from concurrency_support import TIMEOUT_S, run_threads
from llama_index.core.base.llms.types import (
    ChatMessage,
    ChatResponse,
    ChatResponseAsyncGen,
    CompletionResponse,
    CompletionResponseGen,
    LLMMetadata,
    MessageRole,
)
from llama_index.core.bridge.pydantic import Field
from llama_index.core.llms import CustomLLM
from llama_index.core.retrievers import BaseRetriever
from llama_index.core.schema import NodeWithScore, QueryBundle, TextNode

from chunkcache.core.cache import ChunkCache
from chunkcache.core.chunk_ids import chunk_id
from chunkcache.integrations.llama_index_chat import ChunkCacheChatEngine

FACTS = [f"Fact {i}: the depot at gate {i} opens at {i + 6} o'clock." for i in range(6)]
PLAN = {
    "qa": [FACTS[0], FACTS[1]],
    "qb": [FACTS[0], FACTS[2]],
    "q0": [FACTS[3]],
    "q1": [FACTS[4]],
}
Hook = Callable[[], Any]


class HookedRetriever(BaseRetriever):
    """Returns the facts :data:`PLAN` gives each query; ``hooks[query]`` (``ahooks`` for
    async retrievals) holds a hook per call, run (awaited) first."""

    def __init__(self) -> None:
        super().__init__()
        self.hooks: dict[str, list[Hook]] = {}
        self.ahooks: dict[str, list[Hook]] = {}

    def _retrieve(self, query_bundle: QueryBundle) -> list[NodeWithScore]:
        hooks = self.hooks.get(query_bundle.query_str)
        if hooks:
            hooks.pop(0)()
        return self._nodes(query_bundle.query_str)

    async def _aretrieve(self, query_bundle: QueryBundle) -> list[NodeWithScore]:
        hooks = self.ahooks.get(query_bundle.query_str)
        if hooks:
            await hooks.pop(0)()
        return self._nodes(query_bundle.query_str)

    def _nodes(self, query: str) -> list[NodeWithScore]:
        return [NodeWithScore(node=TextNode(text=fact), score=1.0) for fact in PLAN[query]]


def joined(messages: Sequence[ChatMessage]) -> str:
    return "\n".join(m.content or "" for m in messages)


class HookedLLM(CustomLLM):
    """Records each prompt and answers it; a prompt ending with a question in ``gates``
    (``agates`` for async chats) first calls (awaits) its gate."""

    prompts: list[str] = Field(default_factory=list)
    gates: dict[str, Any] = Field(default_factory=dict)
    agates: dict[str, Any] = Field(default_factory=dict)

    @property
    def metadata(self) -> LLMMetadata:
        return LLMMetadata()

    def _asked(self, prompt: str) -> str:
        return next((q for q in PLAN if prompt.endswith(q)), "")

    def _answer(self, prompt: str) -> str:
        self.prompts.append(prompt)
        gate = self.gates.get(self._asked(prompt))
        if gate is not None:
            gate()
        return f"answer to {self._asked(prompt)}"

    def complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        return CompletionResponse(text=self._answer(prompt))

    def stream_complete(
        self, prompt: str, formatted: bool = False, **kwargs: Any
    ) -> CompletionResponseGen:
        text = self._answer(prompt)  # now: a stream's prompt is sent when it is asked for

        def one_piece() -> CompletionResponseGen:
            yield CompletionResponse(text=text, delta=text)

        return one_piece()

    async def achat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        await self._agate(messages)
        return self.chat(messages, **kwargs)

    async def astream_chat(
        self, messages: Sequence[ChatMessage], **kwargs: Any
    ) -> ChatResponseAsyncGen:
        await self._agate(messages)
        return await super().astream_chat(messages, **kwargs)

    async def _agate(self, messages: Sequence[ChatMessage]) -> None:
        gate = self.agates.get(self._asked(joined(messages)))
        if gate is not None:
            await gate()


def make_engine() -> tuple[ChunkCacheChatEngine, HookedRetriever, HookedLLM]:
    retriever, llm = HookedRetriever(), HookedLLM(messages_to_prompt=joined)
    engine = ChunkCacheChatEngine.from_defaults(
        retriever, llm, system_prompt="Answer.", cache=ChunkCache(), conversation_id="chat"
    )
    return engine, retriever, llm


def ask(engine: ChunkCacheChatEngine, method: str, question: str) -> str:
    if method == "chat":
        return engine.chat(question).response
    return "".join(engine.stream_chat(question).response_gen)


async def aask(engine: ChunkCacheChatEngine, method: str, question: str) -> str:
    if method == "achat":
        return (await engine.achat(question)).response
    streamed = await engine.astream_chat(question)
    return "".join([token async for token in streamed.async_response_gen()])


def assert_every_retrieved_fact_is_sent(llm: HookedLLM) -> None:
    """Each prompt holds every fact its question retrieved (sent now or in its history)."""
    for prompt in llm.prompts:
        question = llm._asked(prompt)
        missing = [fact for fact in PLAN[question] if fact not in prompt]
        assert not missing, f"{question}: {missing} not in {prompt!r}"


def questions_in(engine: ChunkCacheChatEngine) -> list[str]:
    users = [m.content or "" for m in engine.chat_history if m.role == MessageRole.USER]
    return [next(q for q in PLAN if text.endswith(q)) for text in users]


def hold_b_until_a_is_sent(retriever: HookedRetriever, llm: HookedLLM, retrieval: int) -> None:
    """B's ``retrieval``-th retrieval (0: its first) waits until A's prompt is sent; A's
    retrieval starts once B's is under way, and A answers once B's prompt is sent."""
    b_retrieving, a_sent, b_sent = threading.Event(), threading.Event(), threading.Event()

    def b_waits() -> None:
        b_retrieving.set()
        assert a_sent.wait(TIMEOUT_S)

    def a_answers_after_b_sent() -> None:
        a_sent.set()
        assert b_sent.wait(TIMEOUT_S)

    retriever.hooks = {
        "qb": [lambda: None] * retrieval + [b_waits],
        "qa": [lambda: b_retrieving.wait(TIMEOUT_S)],
    }
    llm.gates = {"qa": a_answers_after_b_sent, "qb": b_sent.set}


@pytest.mark.parametrize("method", ["chat", "stream_chat"])
def test_a_turn_sends_the_chunk_a_turn_running_at_once_recorded(method: str) -> None:
    """B synced the ledger, then A (begun later) recorded FACTS[0] there before B's
    retrieval was planned: B's prompt, whose history lacks A's unsaved turn, must send it."""
    engine, retriever, llm = make_engine()
    hold_b_until_a_is_sent(retriever, llm, retrieval=0)
    assert not run_threads([lambda: ask(engine, method, "qb"), lambda: ask(engine, method, "qa")])
    assert len(llm.prompts) == 2
    assert_every_retrieved_fact_is_sent(llm)


@pytest.mark.parametrize("method", ["achat", "astream_chat"])
async def test_an_async_turn_sends_the_chunk_a_turn_running_at_once_recorded(
    method: str,
) -> None:
    engine, retriever, llm = make_engine()
    b_retrieving, a_sent, b_sent = asyncio.Event(), asyncio.Event(), asyncio.Event()

    async def b_waits() -> None:
        b_retrieving.set()
        await a_sent.wait()

    async def a_answers_after_b_sent() -> None:
        a_sent.set()
        await b_sent.wait()

    async def b_is_sent() -> None:
        b_sent.set()

    retriever.ahooks = {"qb": [b_waits], "qa": [b_retrieving.wait]}
    llm.agates = {"qa": a_answers_after_b_sent, "qb": b_is_sent}
    turns = [aask(engine, method, "qb"), aask(engine, method, "qa")]
    await asyncio.wait_for(asyncio.gather(*turns), TIMEOUT_S)
    assert len(llm.prompts) == 2
    assert_every_retrieved_fact_is_sent(llm)


def test_a_turn_retrieving_again_after_a_trim_sends_the_chunk_another_turn_recorded(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """B's prompt does not fit: it drops its oldest turn (FACTS[3]) and retrieves again;
    A records FACTS[0] just before: B must still send it."""
    engine, retriever, llm = make_engine()
    for question in ("q0", "q1"):
        engine.chat(question)
    del llm.prompts[:]
    fitted: list[bool] = []

    def fits(prompt: list[ChatMessage]) -> bool:  # B's first prompt (three turns) is too long
        fitted.append(not (joined(prompt).endswith("qb") and len(prompt) > 5 and not fitted))
        return fitted[-1]

    monkeypatch.setattr(engine, "_fits", fits)
    hold_b_until_a_is_sent(retriever, llm, retrieval=1)
    assert not run_threads([lambda: engine.chat("qb"), lambda: engine.chat("qa")])
    assert False in fitted and len(llm.prompts) == 2
    assert_every_retrieved_fact_is_sent(llm)


# The engine's history: every finished turn is kept.


def test_two_turns_at_once_are_both_kept() -> None:
    """B began first and answers after A was saved: B is saved too, after A."""
    engine, _, llm = make_engine()
    b_answering, a_saved = threading.Event(), threading.Event()

    def b_answers_after_a() -> None:
        b_answering.set()
        assert a_saved.wait(TIMEOUT_S)

    llm.gates = {"qb": b_answers_after_a}

    def a_turn() -> None:
        assert b_answering.wait(TIMEOUT_S)
        engine.chat("qa")
        a_saved.set()

    assert not run_threads([lambda: engine.chat("qb"), a_turn])
    assert questions_in(engine) == ["qa", "qb"]


def test_a_stream_read_to_its_end_after_another_turn_is_kept_after_it() -> None:
    """A retry while the first try still streams: both tries were answered, both kept."""
    engine, _, _ = make_engine()
    first = engine.stream_chat("qb")
    engine.chat("qa")
    assert "".join(first.response_gen) == "answer to qb"
    assert questions_in(engine) == ["qa", "qb"]


def test_a_turn_begun_before_a_reset_is_not_kept() -> None:
    engine, _, _ = make_engine()
    engine.chat("q0")
    streamed = engine.stream_chat("qb")
    engine.reset()
    assert "".join(streamed.response_gen) == "answer to qb"
    assert engine.chat_history == [] and "chat" not in engine._retriever.cache.ledger


def test_a_turn_added_while_another_trims_to_fit_is_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    """B's prompt does not fit; A is added while B counts; B's trim then drops what B
    dropped (q0) from the history as it is, A's turn included."""
    engine, _, _ = make_engine()
    for question in ("q0", "q1"):
        engine.chat(question)
    fitted: list[bool] = []

    def fits(prompt: list[ChatMessage]) -> bool:
        first_of_b = joined(prompt).endswith("qb") and not fitted
        fitted.append(not first_of_b)
        if first_of_b:
            engine.chat("qa")
        return not first_of_b

    monkeypatch.setattr(engine, "_fits", fits)
    engine.chat("qb")
    assert questions_in(engine) == ["q1", "qa", "qb"]
    held = {chunk_id(FACTS[i]) for i in (0, 1, 2, 4)}  # q1's, qa's and qb's
    assert engine._retriever.cache.ledger.seen("chat") == held
