"""Running a chat chain as turns of a saved conversation, without langchain-core's
``RunnableWithMessageHistory`` (deprecated since langchain-core 1.3.3, gone in 2.0).

:class:`ChatTurns` loads a session's history (found by :func:`history_lookup`), lets the
caller build the chain's input from it, runs the chain and, once it has answered (a stream:
read to its end), saves the turn's user message and the answer.  :func:`prompt_budget` tells
whether a chain's input makes a prompt that fits its ``ChunkCacheLLM``'s context window.
:mod:`chunkcache.integrations.langchain_history` builds CRAFT §4.3's multi-turn layout on it.
A turn that names its session's lock (:data:`HISTORY_LOCKS`) is saved holding it, so the
save never lands in the middle of a trim of that session's history in this process.
"""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, Protocol

from langchain_core.callbacks import (
    AsyncCallbackManagerForChainRun,
    CallbackManagerForChainRun,
)
from langchain_core.messages import AIMessage, BaseMessage
from langchain_core.prompts import BasePromptTemplate
from langchain_core.runnables import (
    ConfigurableFieldSpec,
    Runnable,
    RunnableConfig,
    RunnableSequence,
)
from langchain_core.runnables.base import RunnableBindingBase
from langchain_core.runnables.utils import get_unique_config_specs

from chunkcache.core.prompting import counts_prompts, fits_context_window
from chunkcache.core.session_locks import SessionLock, SessionLocks
from chunkcache.integrations.langchain_llm import ChunkCacheLLM


class SessionHistory(Protocol):
    """What a turn uses of a session's history: any LangChain ``BaseChatMessageHistory``."""

    @property
    def messages(self) -> list[BaseMessage]: ...

    def add_messages(self, messages: Sequence[BaseMessage]) -> None: ...

    def clear(self) -> None: ...

    async def aget_messages(self) -> list[BaseMessage]: ...

    async def aadd_messages(self, messages: Sequence[BaseMessage]) -> None: ...

    async def aclear(self) -> None: ...


class InMemoryChatHistory:
    """A session's messages in memory: a :class:`SessionHistory` for apps and tests
    (langchain-core's ``InMemoryChatMessageHistory`` is deprecated since 1.6.4)."""

    def __init__(self) -> None:
        self.messages: list[BaseMessage] = []

    def add_messages(self, messages: Sequence[BaseMessage]) -> None:
        self.messages.extend(messages)

    def clear(self) -> None:
        self.messages = []

    async def aget_messages(self) -> list[BaseMessage]:
        return list(self.messages)

    async def aadd_messages(self, messages: Sequence[BaseMessage]) -> None:
        self.add_messages(messages)

    async def aclear(self) -> None:
        self.clear()


# The locks of the sessions whose saved history turns of this process read, trim or save.
HISTORY_LOCKS = SessionLocks()

SESSION_ID = ConfigurableFieldSpec(
    id="session_id",
    annotation=str,
    name="Session ID",
    description="The conversation: names its saved history.",
    default="",
    is_shared=True,
)


def history_lookup(
    get_session_history: Callable[..., SessionHistory], keys: list[str]
) -> Callable[[RunnableConfig], SessionHistory]:
    """How a turn finds its session's history from its config (as
    ``RunnableWithMessageHistory`` did): a factory without parameters is called without
    arguments, one key's value goes positionally, several keys' values by name."""
    signature = inspect.signature(get_session_history)
    if len(keys) > 1:
        try:
            signature.bind(**dict.fromkeys(keys))
        except TypeError as error:
            raise TypeError(
                f"get_session_history must take the history_factory_config keys {keys} "
                f"as keyword arguments: {error}"
            ) from None

    def history_of(config: RunnableConfig) -> SessionHistory:
        if not signature.parameters:
            return get_session_history()
        configurable = config.get("configurable", {})
        missing = [key for key in keys if key not in configurable]
        if missing:
            raise ValueError(
                f"Missing keys {missing} in config['configurable']: the chat passes "
                f"{keys} to get_session_history, e.g. "
                f"chain.invoke(..., config={{'configurable': {dict.fromkeys(keys, '...')}}})"
            )
        if len(keys) == 1:
            return get_session_history(configurable[keys[0]])
        return get_session_history(**{key: configurable[key] for key in keys})

    return history_of


@dataclass(frozen=True)
class PromptBudget:
    """A chain ``prompt | llm`` (then anything) whose ``llm`` is a :class:`ChunkCacheLLM`,
    with the keyword arguments bound to it (``llm.bind(max_tokens=64)``)."""

    prompt: BasePromptTemplate[Any]
    llm: ChunkCacheLLM
    options: dict[str, Any]

    def fits(self, chain_input: dict[str, Any]) -> bool:
        """Whether the prompt the chain makes of ``chain_input``, plus the answer's
        ``max_tokens``, fits the LLM's context window, counted as its backend counts
        (chat template and chunks included); True on a backend without a tokenizer in
        this process (``http``).  May load the model, as the chain would."""
        backend = self.llm.chunk_cache.backend
        if not counts_prompts(backend):
            return True
        messages = self.prompt.format_prompt(**chain_input).to_messages()
        # The request exactly as ChunkCacheLLM builds it from these messages.
        request = self.llm._request(messages, None, dict(self.options))
        return fits_context_window(backend, request)


def prompt_budget(chain: Runnable[Any, Any]) -> PromptBudget | None:
    """``chain``'s :class:`PromptBudget` when it is a prompt template then a ChunkCacheLLM
    (either may be wrapped by ``bind``, ``with_config`` or ``with_retry``): the chains whose
    prompt is counted without running them.  None for any other, an LLM of another kind
    included, whose tokens are not counted (that would load its tokenizer)."""
    chain, _ = _unbound(chain)
    steps = chain.steps if isinstance(chain, RunnableSequence) else [chain]
    if len(steps) < 2:
        return None
    (prompt, _), (llm, options) = _unbound(steps[0]), _unbound(steps[1])
    if isinstance(prompt, BasePromptTemplate) and isinstance(llm, ChunkCacheLLM):
        return PromptBudget(prompt, llm, options)
    return None


def _unbound(runnable: Runnable[Any, Any]) -> tuple[Runnable[Any, Any], dict[str, Any]]:
    """The runnable inside ``runnable``'s bindings, and the keyword arguments they bind
    (an outer binding's win, as they do when the chain runs)."""
    options: dict[str, Any] = {}
    while isinstance(runnable, RunnableBindingBase):
        options = {**runnable.kwargs, **options}
        runnable = runnable.bound
    return runnable, options


@dataclass
class Turn:
    """One turn, ready for the chain: where it is saved, the chain's input, this turn's
    user message, and the lock its session's history is saved under (None: none, for a
    history nothing rewrites)."""

    history: SessionHistory
    chain_input: dict[str, Any]
    asked: list[BaseMessage]
    lock: SessionLock | None = None

    def save(self, messages: list[BaseMessage]) -> None:
        """Add ``messages`` to the history, holding its session's lock."""
        with nullcontext() if self.lock is None else self.lock.hold():
            self.history.add_messages(messages)

    async def asave(self, messages: list[BaseMessage]) -> None:
        async with nullcontext() if self.lock is None else self.lock.ahold():
            await self.history.aadd_messages(messages)


class ChatTurns(Runnable[dict[str, Any], Any]):
    """``chain`` run as turns of saved conversations.  ``start`` loads the session's
    history and builds the chain's input; once the chain has answered (a stream: read to
    its end), this turn's user message and the answer are added to the history (holding the
    turn's session lock, if it names one).  A chain that raises, or a stream left
    unfinished, saves nothing, as with ``RunnableWithMessageHistory``.
    ``batch``/``abatch`` are Runnable's: a turn per input.
    """

    def __init__(
        self,
        chain: Runnable[dict[str, Any], Any],
        start: Callable[[dict[str, Any], RunnableConfig], Turn],
        astart: Callable[[dict[str, Any], RunnableConfig], Awaitable[Turn]],
        answer_key: str | None,
        config_specs: list[ConfigurableFieldSpec],
        name: str = "with_chunk_history",
    ) -> None:
        self.name = name
        self.chain = chain
        self._start = start
        self._astart = astart
        self._answer_key = answer_key
        self._config_specs = get_unique_config_specs(config_specs)

    @property
    def config_specs(self) -> list[ConfigurableFieldSpec]:
        return self._config_specs

    def invoke(
        self, input: dict[str, Any], config: RunnableConfig | None = None, **kwargs: Any
    ) -> Any:
        return self._call_with_config(self._invoke, input, config)

    async def ainvoke(
        self, input: dict[str, Any], config: RunnableConfig | None = None, **kwargs: Any
    ) -> Any:
        return await self._acall_with_config(self._ainvoke, input, config)

    def stream(
        self, input: dict[str, Any], config: RunnableConfig | None = None, **kwargs: Any
    ) -> Iterator[Any]:
        yield from self._transform_stream_with_config(iter([input]), self._stream, config)

    async def astream(
        self, input: dict[str, Any], config: RunnableConfig | None = None, **kwargs: Any
    ) -> AsyncIterator[Any]:
        stream = self._atransform_stream_with_config(_once(input), self._astream, config)
        async for chunk in stream:
            yield chunk

    # The helpers above pass the run's child config (its callbacks) as ``config``, and
    # its run manager, unused here, as ``run_manager``.
    def _invoke(
        self,
        inputs: dict[str, Any],
        run_manager: CallbackManagerForChainRun,
        config: RunnableConfig,
    ) -> Any:
        turn = self._start(inputs, config)
        answer = self.chain.invoke(turn.chain_input, config)
        turn.save(self._saved(turn, answer))
        return answer

    async def _ainvoke(
        self,
        inputs: dict[str, Any],
        run_manager: AsyncCallbackManagerForChainRun,
        config: RunnableConfig,
    ) -> Any:
        turn = await self._astart(inputs, config)
        answer = await self.chain.ainvoke(turn.chain_input, config)
        await turn.asave(self._saved(turn, answer))
        return answer

    def _stream(
        self,
        inputs: Iterator[dict[str, Any]],
        run_manager: CallbackManagerForChainRun,
        config: RunnableConfig,
    ) -> Iterator[Any]:
        turn = self._start(next(inputs), config)
        answer = None
        for chunk in self.chain.stream(turn.chain_input, config):
            yield chunk
            answer = _added(answer, chunk)
        turn.save(self._saved(turn, answer))

    async def _astream(
        self,
        inputs: AsyncIterator[dict[str, Any]],
        run_manager: AsyncCallbackManagerForChainRun,
        config: RunnableConfig,
    ) -> AsyncIterator[Any]:
        turn = await self._astart(await anext(inputs), config)
        answer = None
        async for chunk in self.chain.astream(turn.chain_input, config):
            yield chunk
            answer = _added(answer, chunk)
        await turn.asave(self._saved(turn, answer))

    def _saved(self, turn: Turn, answer: Any) -> list[BaseMessage]:
        """The messages a turn adds to its history: its user message, then the answer."""
        return [*turn.asked, *_answer_messages(answer, self._answer_key)]


async def _once(value: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
    """An async iterator over ``value`` alone: a turn's input, as a stream of one."""
    yield value


def _added(total: Any, chunk: Any) -> Any:
    """``total + chunk``, the streamed answer so far; a chunk that cannot be added to it
    (a plain dict, say) takes its place."""
    if total is None:
        return chunk
    try:
        return total + chunk
    except TypeError:
        return chunk


def _answer_messages(answer: Any, key: str | None) -> list[BaseMessage]:
    """The chain's answer as messages: a string is an AI message; a dict holds the answer
    under ``key``, its only key, or ``"output"``."""
    if isinstance(answer, dict):
        answer = answer.get(key or (next(iter(answer)) if len(answer) == 1 else "output"))
    if isinstance(answer, str):
        return [AIMessage(content=answer)]
    if isinstance(answer, BaseMessage):
        return [answer]
    if isinstance(answer, list | tuple) and all(isinstance(m, BaseMessage) for m in answer):
        return list(answer)
    raise ValueError(
        "with_chunk_history saves the chain's answer as messages: the chain must return a "
        "str, a message, a list of messages, or a dict holding one under "
        f"output_messages_key; got {type(answer).__name__}"
    )
