"""CRAFT §4.3's multi-turn layout for LangChain chat chains.

A LangChain chat history normally stores only the user's question, and a
typical RAG prompt puts this turn's context before the history or in the system
message.  Both break chunk reuse across turns: the chunks of turn t vanish from
the prompt of turn t+1 (so dropping repeats would lose them), and whatever
changes each turn sits before what stays.

:func:`with_chunk_history` stores each turn's *new* chunks inside that turn's
user message, so the prompt of turn t+1 is exactly the prompt of turn t, plus
its answer, plus one new user message::

    system | user(chunks_1 + q_1) | ai(a_1) | user(chunks_2 + q_2) | ...

With this layout ``dedupe="drop"`` is safe: every chunk the conversation has
seen is still in the prompt.  Each turn's user message records its chunk ids
(``additional_kwargs["chunk_ids"]``), and before every turn the conversation's
ledger is reset to the chunks still in the history, so a chunk that left it
(the history was trimmed, cleared, replaced or edited, a turn failed, the process
restarted over a persisted history) is sent again the next time it is retrieved.
A user message the app rewrote keeps only the recorded chunks whose text it still
holds.
``max_history_turns`` trims the history to a number of turns (CRAFT §4.3 drops the
earliest turns; their answers carry what they said); with a ``ChunkCacheLLM`` the history
is also trimmed, the same way, whenever the prompt would not fit the context window.
Turns of one conversation may run at once (two tabs, a turn retried while the first try
still streams): each one dedupes against the chunks of the history it loaded, so it sends
again a chunk only another running turn holds, and is saved once it has answered, after
whatever was saved meanwhile.  A trim rewrites the saved history (clear, then add what is
kept).  Within a process, a turn's reading of the history, a trim and a finished turn's
save take turns per session (one lock per session, held for those steps only, never while
the retriever or the chain runs; an async turn awaits it without blocking its event loop,
and a sync turn on the thread of a loop whose task holds it raises rather than hang),
and a trim made to fit the window is applied to the history as it is by then: no turn saved
meanwhile is lost, none is saved twice, no turn reads a history half rewritten.  Processes
sharing one history store (Redis, SQL) are not ordered by that lock: there a turn another
process saves during a trim may be lost, two trims at once may leave the kept turns in the
history twice, and a turn may read it half rewritten.  Send the turns of a session to one
process (sticky sessions) when they may overlap.

>>> chain = with_chunk_history(  # doctest: +SKIP
...     chunk_chat_prompt("Answer from the context.") | llm,
...     ChunkCacheRetriever(base_retriever=base, dedupe="drop"),
...     get_session_history,
... )
>>> chain.invoke({"question": "What is json.dumps?"},  # doctest: +SKIP
...              config={"configurable": {"session_id": "user-42"}})

In LangGraph, where a checkpointer keeps each thread's messages, the same layout is a
retrieve node that replaces the question by its turn's message (same id), then a generate
node that sends a fixed system message and the thread's messages; the ``thread_id`` is the
conversation of both the retriever and the LLM, read from the config LangGraph gives nodes:

>>> def retrieve(state: MessagesState) -> dict:  # doctest: +SKIP
...     asked = state["messages"][-1]
...     docs = retriever.invoke(asked.content)
...     return {"messages": [HumanMessage(format_turn(asked.content, docs), id=asked.id)]}

There, nothing resyncs the ledger with the thread: keep ``dedupe="mark"`` unless the generate
node always sends all of the thread's messages (``trim_messages`` there would lose chunks
``"drop"`` left out).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from langchain_core.documents import Document
from langchain_core.messages import BaseMessage, HumanMessage
from langchain_core.prompts import ChatPromptTemplate, MessagesPlaceholder
from langchain_core.runnables import ConfigurableFieldSpec, Runnable, RunnableConfig
from langchain_core.runnables.base import RunnableBinding, RunnableBindingBase
from langchain_core.runnables.fallbacks import RunnableWithFallbacks

from chunkcache.core.cache import ChunkCache
from chunkcache.core.chat_turns import (
    CHUNK_IDS_KEY,
    halved,
    held_chunk_ids,
    recorded_chunk_ids,
    retrimmed,
    trimmed,
)
from chunkcache.core.retrieval import replanning
from chunkcache.core.session_locks import SessionLock
from chunkcache.integrations.langchain import ChunkCacheRetriever
from chunkcache.integrations.langchain_chat_turns import (
    HISTORY_LOCKS,
    SESSION_ID,
    ChatTurns,
    InMemoryChatHistory,
    PromptBudget,
    SessionHistory,
    Turn,
    history_lookup,
    prompt_budget,
)
from chunkcache.integrations.langchain_llm import TURN_CONVERSATION_KEY, conversation_key

__all__ = [
    "DEFAULT_TURN_TEMPLATE",
    "InMemoryChatHistory",
    "chunk_chat_prompt",
    "chunk_ids_in",
    "format_turn",
    "with_chunk_history",
]

DEFAULT_TURN_TEMPLATE = "Context:\n{context}\n\nQuestion: {question}"
DEFAULT_DOCUMENT_SEPARATOR = "\n\n"


def format_turn(
    question: str,
    documents: list[Document],
    template: str = DEFAULT_TURN_TEMPLATE,
    separator: str = DEFAULT_DOCUMENT_SEPARATOR,
) -> str:
    """One turn's user message: this turn's new chunks, verbatim, then the question.

    Chunk texts are inserted unchanged so the LLM side can find them by exact match.
    With no new chunks (all already in the conversation) only the question remains.
    """
    if not documents:
        return question
    context = separator.join(doc.page_content for doc in documents)
    return template.format(context=context, question=question)


def chunk_chat_prompt(
    system_prompt: str, *, history_key: str = "history", turn_key: str = "turn"
) -> ChatPromptTemplate:
    """A chat prompt in the multi-turn layout: fixed system message, history, this turn."""
    return ChatPromptTemplate.from_messages(
        [
            ("system", system_prompt),
            MessagesPlaceholder(history_key),
            MessagesPlaceholder(turn_key),
        ]
    )


def with_chunk_history(
    chain: Runnable[dict[str, Any], Any],
    retriever: Runnable[str, list[Document]],
    get_session_history: Callable[..., SessionHistory],
    *,
    question_key: str = "question",
    history_key: str = "history",
    turn_key: str = "turn",
    turn_template: str = DEFAULT_TURN_TEMPLATE,
    document_separator: str = DEFAULT_DOCUMENT_SEPARATOR,
    max_history_turns: int | None = None,
    history_factory_config: Sequence[ConfigurableFieldSpec] | None = None,
    output_messages_key: str | None = None,
) -> Runnable[dict[str, Any], Any]:
    """Wrap ``chain`` so each turn's chunks are stored in that turn's user message.

    ``chain`` receives the input dict plus ``history_key`` (earlier messages) and
    ``turn_key`` (a one-message list holding this turn's chunks and question); see
    :func:`chunk_chat_prompt`.  ``get_session_history`` is called as
    ``RunnableWithMessageHistory`` called it: with ``config["configurable"]["session_id"]``,
    or with the ids of the ``history_factory_config`` fields as keyword arguments, or with
    nothing when it takes no argument.  Those values are the conversation, passed to the
    retriever as its ``conversation_id`` (a retriever wrapped by ``with_config`` works) and
    to a ``ChunkCacheLLM`` in ``chain`` through its config, unless the app set a
    ``conversation_id`` there that is not one of those keys.
    ``max_history_turns`` (None: no limit) bounds the earlier turns a prompt carries:
    past it the oldest go in one step, keeping the newest ``(max_history_turns + 1) // 2``,
    so the cached prefix breaks once every few turns rather than every turn.  Trimming
    deletes those turns from the session history itself (a persistent one included).

    The context window: when ``chain`` is a prompt template then a ``ChunkCacheLLM``
    (``chunk_chat_prompt(...) | llm``, anything after; see
    :func:`~chunkcache.integrations.langchain_chat_turns.prompt_budget`), a turn counts
    the prompt it would send as the LLM's backend counts it; if that plus the LLM's
    ``max_tokens`` exceeds the backend's ``context_window``, the oldest half of the turns
    goes, again and again until the prompt fits, trimmed as above (from the session history
    too).  With a ``dedupe="drop"`` retriever, when a dropped turn held chunks the
    retriever runs again (the access table still counts the turn once), so one it returns
    that left with those turns is sent again.  A prompt that does not fit even without
    history is sent as it is, for the backend to refuse (``PromptTooLongError``), and the
    history is left as it was.  Nothing is counted for a chain of another shape or another
    LLM, or on a backend without a tokenizer in this process (``http``): there
    ``max_history_turns`` keeps a long chat inside the window.
    The turn's user message and answer are saved once the chain has returned (or its
    stream has been read to the end); a chain that raises saves nothing.  A chain that
    returns a dict holds the answer under ``output_messages_key`` (or its only key).
    """
    if max_history_turns is not None and max_history_turns < 1:
        raise ValueError(f"max_history_turns must be >= 1, got {max_history_turns}")
    specs = list(history_factory_config or [SESSION_ID])
    history_keys = [spec.id for spec in specs]
    turns = _ChunkHistoryTurns(
        retriever,
        history_lookup(get_session_history, history_keys),
        history_keys,
        _TurnLayout(question_key, history_key, turn_key, turn_template, document_separator),
        max_history_turns,
        prompt_budget(chain),
    )
    config_specs = [*chain.config_specs, *retriever.config_specs, *specs]
    # ChatTurns runs the chain with the turn's config; this adds the turn's conversation.
    chain_in_turn = RunnableBinding(bound=chain, config_factories=[turns.chain_config])
    return ChatTurns(chain_in_turn, turns.start, turns.astart, output_messages_key, config_specs)


@dataclass(frozen=True)
class _TurnLayout:
    """Where a turn reads its question and puts the chain's inputs, and how it writes
    its user message (see :func:`with_chunk_history`)."""

    question_key: str
    history_key: str
    turn_key: str
    turn_template: str
    document_separator: str

    def question_in(self, inputs: dict[str, Any]) -> str:
        if self.question_key not in inputs:
            raise KeyError(
                f"with_chunk_history reads the question from input key {self.question_key!r} "
                f"(question_key=); the input has {sorted(inputs)}"
            )
        return str(inputs[self.question_key])

    def turn_of(
        self,
        inputs: dict[str, Any],
        history: SessionHistory,
        earlier: list[BaseMessage],
        documents: list[Document],
        lock: SessionLock,
    ) -> Turn:
        """The turn asking ``inputs``' question over ``documents``, after ``earlier``, saved
        to ``history`` under ``lock``."""
        question = self.question_in(inputs)
        text = format_turn(question, documents, self.turn_template, self.document_separator)
        chunk_ids = [doc.metadata["chunk_id"] for doc in documents if "chunk_id" in doc.metadata]
        asked: list[BaseMessage] = [
            HumanMessage(content=text, additional_kwargs={CHUNK_IDS_KEY: chunk_ids})
        ]
        chain_input = {**inputs, self.turn_key: asked, self.history_key: earlier}
        return Turn(history, chain_input, asked, lock)


class _ChunkHistoryTurns:
    """How :func:`with_chunk_history` starts a turn: load and trim the history, sync the
    retriever's ledger to it, retrieve, and drop the oldest turns until the prompt fits.
    ``start`` and ``astart`` are the same steps, the second awaiting the I/O.  The history
    is read and rewritten holding its session's lock (see the module docstring)."""

    def __init__(
        self,
        retriever: Runnable[str, list[Document]],
        history_of: Callable[[RunnableConfig], SessionHistory],
        history_keys: list[str],
        layout: _TurnLayout,
        max_history_turns: int | None,
        budget: PromptBudget | None,
    ) -> None:
        self.retriever = retriever
        self.chunk_retriever = _chunk_cache_retriever(retriever)
        self.history_of = history_of
        self.history_keys = history_keys
        self.layout = layout
        self.max_history_turns = max_history_turns
        self.budget = budget
        self.drops_repeats = (
            self.chunk_retriever is not None and self.chunk_retriever.dedupe == "drop"
        )

    def start(self, inputs: dict[str, Any], config: RunnableConfig) -> Turn:
        """The turn for ``inputs``, its history trimmed to fit (and saved so)."""
        question = self.layout.question_in(inputs)
        history, lock = self.history_of(config), self.lock_of(config)
        began = earlier = self.prepare(history, lock, config)
        with self.deduped_against(earlier, config):
            documents = self.retriever.invoke(question, config, **self.retrieval_kwargs(config))
        turn = self.layout.turn_of(inputs, history, earlier, documents, lock)
        fitted = self.fits(turn)
        while not fitted and earlier:
            earlier, retrieve_again = self.drop_oldest_turns(earlier, config)
            if retrieve_again:
                # this turn's request is counted already
                with replanning(), self.deduped_against(earlier, config):
                    kwargs = self.retrieval_kwargs(config)
                    documents = self.retriever.invoke(question, config, **kwargs)
            turn = self.layout.turn_of(inputs, history, earlier, documents, lock)
            fitted = self.fits(turn)
        if earlier is not began and fitted:
            self.save_trim(history, lock, began, earlier)
        elif earlier is not began:  # the backend refuses the prompt: the turn changes nothing
            self.sync_ledger(began, config)
        return turn

    async def astart(self, inputs: dict[str, Any], config: RunnableConfig) -> Turn:
        """:meth:`start`, awaiting the history, the retriever and the count."""
        question = self.layout.question_in(inputs)
        history, lock = self.history_of(config), self.lock_of(config)
        began = earlier = await self.aprepare(history, lock, config)
        with self.deduped_against(earlier, config):
            kwargs = self.retrieval_kwargs(config)
            documents = await self.retriever.ainvoke(question, config, **kwargs)
        turn = self.layout.turn_of(inputs, history, earlier, documents, lock)
        fitted = await asyncio.to_thread(self.fits, turn)
        while not fitted and earlier:
            earlier, retrieve_again = self.drop_oldest_turns(earlier, config)
            if retrieve_again:
                with replanning(), self.deduped_against(earlier, config):
                    kwargs = self.retrieval_kwargs(config)
                    documents = await self.retriever.ainvoke(question, config, **kwargs)
            turn = self.layout.turn_of(inputs, history, earlier, documents, lock)
            fitted = await asyncio.to_thread(self.fits, turn)
        if earlier is not began and fitted:
            await self.asave_trim(history, lock, began, earlier)
        elif earlier is not began:
            self.sync_ledger(began, config)
        return turn

    def conversation_of(self, config: RunnableConfig) -> str | None:
        """The conversation a turn belongs to: its history's key values (the session id by
        default); the retriever dedupes against it, whatever keys the app names."""
        configurable = config.get("configurable", {})
        if any(key not in configurable for key in self.history_keys):
            return None
        values = [str(configurable[key]) for key in self.history_keys]
        return conversation_key(values[0] if len(values) == 1 else json.dumps(values))

    def lock_of(self, config: RunnableConfig) -> SessionLock:
        """The lock of the turn's session, keyed by its conversation (one lock for the single
        history of a ``get_session_history`` without parameters)."""
        return HISTORY_LOCKS.lock(self.conversation_of(config))

    def chain_config(self, config: RunnableConfig) -> RunnableConfig:
        """What a turn adds to the chain's config: its conversation, for a ``ChunkCacheLLM``
        (or retriever) in the chain to name it as the retriever here does.  Not when the app
        set a ``conversation_id`` beside other history keys: that one is its choice."""
        conversation_id = self.conversation_of(config)
        configurable = config.get("configurable", {})
        chosen = "conversation_id" in configurable and "conversation_id" not in self.history_keys
        if conversation_id is None or chosen:
            return {}
        return {"configurable": {TURN_CONVERSATION_KEY: conversation_id}}

    def retrieval_kwargs(self, config: RunnableConfig) -> dict[str, Any]:
        """The retriever's ``conversation_id``, when it is one of ours (else nothing)."""
        if self.chunk_retriever is None:
            return {}
        return {"conversation_id": self.conversation_of(config)}

    def sync_ledger(self, messages: Sequence[BaseMessage], config: RunnableConfig) -> None:
        """Reset the conversation's ledger to the chunks ``messages`` still hold."""
        conversation_id = self.conversation_of(config)
        if self.chunk_retriever is not None and conversation_id is not None:
            cache = self.chunk_retriever.cache
            cache.ledger.replace(conversation_id, _held_in(messages, cache))

    @contextmanager
    def deduped_against(
        self, messages: Sequence[BaseMessage], config: RunnableConfig
    ) -> Iterator[None]:
        """The retriever, called inside, dedupes this turn against the chunks ``messages``
        (the earlier messages its prompt carries) hold, not against the ledger: another turn
        of the conversation running at once records chunks its own prompt holds, this one's
        not (its history was loaded before that turn is saved)."""
        conversation_id = self.conversation_of(config)
        if self.chunk_retriever is None or conversation_id is None:
            yield
            return
        cache = self.chunk_retriever.cache
        with cache.ledger.turn(conversation_id, _held_in(messages, cache)):
            yield

    def prepare(
        self, history: SessionHistory, lock: SessionLock, config: RunnableConfig
    ) -> list[BaseMessage]:
        """The earlier messages this turn's prompt carries, trimmed (in the history too)."""
        with lock.hold():
            messages = list(history.messages)  # a copy: saving a turn must not change it
            kept = trimmed(messages, self.max_history_turns, _is_user)
            if len(kept) < len(messages):
                _save(history, kept)
        self.sync_ledger(kept, config)
        return kept

    async def aprepare(
        self, history: SessionHistory, lock: SessionLock, config: RunnableConfig
    ) -> list[BaseMessage]:
        async with lock.ahold():
            messages = list(await history.aget_messages())
            kept = trimmed(messages, self.max_history_turns, _is_user)
            if len(kept) < len(messages):
                await _asave(history, kept)
        self.sync_ledger(kept, config)
        return kept

    def save_trim(
        self,
        history: SessionHistory,
        lock: SessionLock,
        began: list[BaseMessage],
        kept: list[BaseMessage],
    ) -> None:
        """Trim the history as this turn trimmed ``began`` (what it read) to ``kept``, as
        the history is now: turns saved since stay, what another trim dropped stays out."""
        with lock.hold():
            messages = list(history.messages)
            now = retrimmed(messages, began, kept)
            if len(now) < len(messages):
                _save(history, now)

    async def asave_trim(
        self,
        history: SessionHistory,
        lock: SessionLock,
        began: list[BaseMessage],
        kept: list[BaseMessage],
    ) -> None:
        async with lock.ahold():
            messages = list(await history.aget_messages())
            now = retrimmed(messages, began, kept)
            if len(now) < len(messages):
                await _asave(history, now)

    def fits(self, turn: Turn) -> bool:
        """Whether the chain's prompt fits the context window (True when not counted)."""
        return self.budget is None or self.budget.fits(turn.chain_input)

    def drop_oldest_turns(
        self, earlier: list[BaseMessage], config: RunnableConfig
    ) -> tuple[list[BaseMessage], bool]:
        """``earlier`` less its older half of turns, as ``max_history_turns`` trims, with
        the ledger synced to it (not yet the history: the trim may not be kept); and whether
        the retriever must run again: it drops repeats, and chunks it may have left out of
        this turn left the prompt with those turns."""
        kept = halved(earlier, _is_user)
        self.sync_ledger(kept, config)
        lost = not set(chunk_ids_in(earlier)) <= set(chunk_ids_in(kept))
        return kept, self.drops_repeats and lost


def _held_in(messages: Sequence[BaseMessage], cache: ChunkCache) -> list[str]:
    """The chunk ids ``messages``' user messages recorded and still hold."""
    return held_chunk_ids(messages, _is_user, _text_of, cache.registry.get)


def _save(history: SessionHistory, messages: list[BaseMessage]) -> None:
    """Make ``messages`` the session's whole history (not atomic in the store: hold the
    session's lock).  A copy is saved, so a history keeping the list it is given never
    changes a list a turn holds."""
    history.clear()
    history.add_messages(list(messages))


async def _asave(history: SessionHistory, messages: list[BaseMessage]) -> None:
    await history.aclear()
    await history.aadd_messages(list(messages))


def _chunk_cache_retriever(retriever: Runnable[Any, Any]) -> ChunkCacheRetriever | None:
    """``retriever``, or the one inside its wrappers (``with_config``, ``bind``,
    ``with_retry``, ``with_fallbacks``, a retriever over one other such as
    ``ContextualCompressionRetriever`` or ``MultiQueryRetriever``), when it is a
    :class:`ChunkCacheRetriever`: the one whose ledger a turn keeps in sync.  Under a
    compressor the sync matters most: a chunk the compressor filtered out was never sent,
    and only the history says so."""
    found: Runnable[Any, Any] | None = retriever
    while found is not None and not isinstance(found, ChunkCacheRetriever):
        if isinstance(found, RunnableBindingBase):
            found = found.bound
        elif isinstance(found, RunnableWithFallbacks):
            found = found.runnable
        else:
            found = _inner_retriever(found)
    return found


def _inner_retriever(retriever: Runnable[Any, Any]) -> Runnable[Any, Any] | None:
    """The one retriever a retriever wraps, by langchain-classic's attribute names:
    ``base_retriever`` (``ContextualCompressionRetriever``), ``retriever``
    (``MultiQueryRetriever``)."""
    for name in ("base_retriever", "retriever"):
        inner = getattr(retriever, name, None)
        if isinstance(inner, Runnable):
            return inner
    return None


def chunk_ids_in(messages: Sequence[BaseMessage]) -> list[str]:
    """The chunk ids the turns' user messages in ``messages`` recorded, in order."""
    return recorded_chunk_ids(messages, _is_user)


def _is_user(message: BaseMessage) -> bool:
    return isinstance(message, HumanMessage)


def _text_of(message: BaseMessage) -> str:
    return str(message.text)
