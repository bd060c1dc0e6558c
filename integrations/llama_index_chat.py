"""CRAFT §4.3's multi-turn layout as a LlamaIndex chat engine.

``ContextChatEngine`` rewrites the system message with new context every turn,
so nothing after the first token is reusable from one turn to the next.
:class:`ChunkCacheChatEngine` keeps the system prompt first and fixed and puts
each turn's *new* chunks into that turn's user message::

    system | user(chunks_1 + q_1) | assistant(a_1) | user(chunks_2 + q_2) | ...

so the prompt of turn t+1 is exactly the prompt of turn t, plus its answer, plus
one new user message: a prefix cache (ours or vLLM's) reuses all of it.

Because every chunk the conversation has seen is still in the prompt, the
engine's retriever drops repeats (``dedupe="drop"``) by default.  Each turn's
user message records its chunk ids (``additional_kwargs["chunk_ids"]``, the key
the LangChain helper uses too), so a history saved from :attr:`chat_history`
and passed back as ``chat_history=`` keeps its chunks.  Before every turn the
history is trimmed to ``max_history_turns`` and the conversation's ledger is
reset to the chunks still in it, so a chunk that left the prompt (trimmed,
replaced, a failed turn or abandoned stream) is sent again the next time it is
retrieved, and one still in it is not sent again even if the ledger lost the
conversation (LRU bound, TTL).  (CRAFT argues the answers already carry what
trimmed chunks said; re-sending is the cautious choice.)

With a :class:`~chunkcache.integrations.llama_index_llm.ChunkCacheLLM` the engine also
keeps each prompt inside the model's context window: a prompt that, with the answer's
``max_tokens``, would not fit loses its oldest turns the way ``max_history_turns`` trims
(see :class:`ChunkCacheChatEngine`).

>>> engine = ChunkCacheChatEngine.from_defaults(  # doctest: +SKIP
...     index.as_retriever(similarity_top_k=4), llm, system_prompt="Answer from the context."
... )
>>> print(engine.chat("What does json.dumps return?"))  # doctest: +SKIP
"""

from __future__ import annotations

import asyncio
import threading
import uuid
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass

from llama_index.core.base.llms.types import (
    ChatMessage,
    ChatResponseAsyncGen,
    ChatResponseGen,
    MessageRole,
)
from llama_index.core.chat_engine.types import (
    AgentChatResponse,
    BaseChatEngine,
    StreamingAgentChatResponse,
)
from llama_index.core.llms.llm import LLM
from llama_index.core.retrievers import BaseRetriever
from llama_index.core.schema import MetadataMode, NodeWithScore
from llama_index.core.settings import Settings

from chunkcache.core.cache import ChunkCache
from chunkcache.core.chat_turns import (
    CHUNK_IDS_KEY,
    halved,
    held_chunk_ids,
    recorded_chunk_ids,
    retrimmed,
    trimmed,
)
from chunkcache.core.chunk_ids import CHUNK_ID_METADATA_KEY
from chunkcache.core.errors import PromptTooLongError
from chunkcache.core.ledger import DedupeMode
from chunkcache.core.ordering import Ordering
from chunkcache.core.prompting import counts_prompts, fits_context_window
from chunkcache.core.retrieval import replanning
from chunkcache.integrations.llama_index import ChunkCacheRetriever
from chunkcache.integrations.llama_index_llm import ChunkCacheLLM, node_text

__all__ = [
    "CHUNK_IDS_KEY",
    "DEFAULT_CONTEXT_TEMPLATE",
    "DEFAULT_SYSTEM_PROMPT",
    "ChunkCacheChatEngine",
]

DEFAULT_SYSTEM_PROMPT = (
    "You are a helpful assistant. Answer using the context given in the conversation."
)
DEFAULT_CONTEXT_TEMPLATE = "Context:\n{context_str}\n\nQuestion: {query_str}"
CHUNK_SEPARATOR = "\n\n"
# A refused chat prompt names these fixes, not the query engines' counting hint.
CHAT_FIT_HINT = (
    "A chat engine drops earlier turns until its prompt fits when it can count it (a "
    "ChunkCacheLLM on the local or vllm backend), else set max_history_turns; retrieving "
    "fewer chunks (similarity_top_k) or a lower max_tokens also helps"
)

Prompt = list[ChatMessage]


@dataclass(frozen=True)
class _Turn:
    """A turn begun: how many resets came before it, and the history it began with."""

    resets: int
    history: list[ChatMessage]


class ChunkCacheChatEngine(BaseChatEngine):
    """A chat engine whose every prompt extends the previous one.

    Args:
        retriever: a :class:`ChunkCacheRetriever` bound to a conversation id
            (:meth:`from_defaults` builds one).
        llm: the chat model; a :class:`~chunkcache.integrations.llama_index_llm.ChunkCacheLLM`
            is bound to the engine's conversation (one bound to another, or on another
            cache than the retriever's, raises ValueError).
        system_prompt: the first message of every prompt, never changed.
        context_template: the user message of a turn with new chunks; it gets
            ``{context_str}`` (the chunks, each rendered with its LLM metadata,
            the chunk text verbatim) and ``{query_str}``.  A turn without new
            chunks sends the question alone.
        max_history_turns: earlier turns a prompt may carry (None: no limit).
            When exceeded, the oldest turns go in one step, keeping the newest
            ``(max_history_turns + 1) // 2``, so the cached prefix breaks once
            every few turns rather than every turn.  A ``chat_history=`` given
            to a turn is trimmed the same way (a turn starts at a user message).

    The context window: when ``llm`` is a ChunkCacheLLM, a turn counts its prompt
    (history, retrieved chunks and message, through the chat template) as the LLM's
    backend counts it; if that plus the LLM's ``max_tokens`` exceeds the backend's
    ``context_window``, the oldest half of the turns goes, again and again until the
    prompt fits (each drop, like ``max_history_turns``, breaks the cached prefix once
    for several turns).  With ``dedupe="drop"``, when a dropped turn held chunks the
    retriever runs again (the access table still counts the turn once), so one it
    returns that left with those turns is sent again.  A prompt that does not fit even
    without history is sent as it is, for the backend to refuse
    (:class:`~chunkcache.core.errors.PromptTooLongError`), and the history is left as it
    was.  Nothing is counted for another LLM, or on a backend without a tokenizer in
    this process (``http``): there the caller keeps the conversation within the window
    (``max_history_turns``).

    Turns may run at once (two tabs, a retry while the first try still streams; threads or
    tasks): each builds its prompt on the history it began with and dedupes against the
    chunks that history holds, so it sends again a chunk only another running turn holds.
    A turn is added to the history once it has answered (a stream: read to its end), after
    whatever was added meanwhile, unless :meth:`reset` came since it began; a trim it made
    to fit the window is applied to the history as it is by then.  The history and the
    ledger are updated under the engine's lock, held for those updates only.  Engines of one
    conversation (an app building one per request, with ``chat_history=``) share its ledger,
    not their histories: which turns the app keeps is up to the store it saves them to.
    """

    def __init__(
        self,
        retriever: ChunkCacheRetriever,
        llm: LLM,
        *,
        system_prompt: str = DEFAULT_SYSTEM_PROMPT,
        context_template: str = DEFAULT_CONTEXT_TEMPLATE,
        max_history_turns: int | None = None,
    ) -> None:
        if retriever.conversation_id is None:
            raise ValueError("bind the retriever to a conversation: retriever.for_conversation(id)")
        if max_history_turns is not None and max_history_turns < 1:
            raise ValueError(f"max_history_turns must be >= 1, got {max_history_turns}")
        try:
            context_template.format(context_str="", query_str="")
        except (KeyError, IndexError, ValueError) as error:
            raise ValueError(
                "context_template may use only {context_str} and {query_str}"
            ) from error
        self._retriever = retriever
        self._conversation_id: str = retriever.conversation_id
        self._llm = _bound(llm, retriever.cache, self._conversation_id)
        self._system_message = ChatMessage(role=_system_role(llm), content=system_prompt)
        self._context_template = context_template
        self._max_history_turns = max_history_turns
        self._history: list[ChatMessage] = []
        # A turn begun before a reset is not added to the conversation that follows it.
        self._resets = 0
        # Held while the history, and the ledger synced to it, are read and replaced; never
        # across a call to the retriever or the LLM, so no turn waits on another's I/O.
        self._lock = threading.Lock()

    @classmethod
    def from_defaults(
        cls,
        retriever: BaseRetriever,
        llm: LLM | None = None,
        *,
        system_prompt: str = DEFAULT_SYSTEM_PROMPT,
        conversation_id: str | None = None,
        cache: ChunkCache | None = None,
        ordering: Ordering = "tree",
        dedupe: DedupeMode = "drop",
        context_template: str = DEFAULT_CONTEXT_TEMPLATE,
        max_history_turns: int | None = None,
    ) -> ChunkCacheChatEngine:
        """Wrap ``retriever`` for a new conversation (a random id unless given), on
        ``cache``: by default a :class:`ChunkCacheLLM`'s own (the cache whose chunks the
        LLM looks for), else the process-wide one."""
        if isinstance(retriever, ChunkCacheRetriever):
            raise TypeError(
                "from_defaults wraps a base retriever; for a ChunkCacheRetriever use "
                "ChunkCacheChatEngine(retriever.for_conversation(id), llm)"
            )
        llm = llm or Settings.llm
        if cache is None and isinstance(llm, ChunkCacheLLM):
            cache = llm.cache
        wrapped = ChunkCacheRetriever(
            retriever,
            cache=cache,
            ordering=ordering,
            dedupe=dedupe,
            conversation_id=uuid.uuid4().hex if conversation_id is None else conversation_id,
        )
        return cls(
            wrapped,
            llm,
            system_prompt=system_prompt,
            context_template=context_template,
            max_history_turns=max_history_turns,
        )

    @property
    def conversation_id(self) -> str:
        return self._conversation_id

    @property
    def chat_history(self) -> list[ChatMessage]:
        """User and assistant messages; each user message holds its turn's chunks and
        records their ids under ``additional_kwargs[CHUNK_IDS_KEY]``."""
        return list(self._history)

    def reset(self) -> None:
        """Forget the history and the conversation's chunks in the ledger (turns still
        running are not added to the new conversation)."""
        with self._lock:
            self._history = []
            self._retriever.cache.ledger.forget(self._conversation_id)
            self._resets += 1

    def chat(
        self, message: str, chat_history: list[ChatMessage] | None = None
    ) -> AgentChatResponse:
        turn = self._begin(chat_history)
        nodes, user, prompt = self._fitted_turn(turn, message)
        with _chat_refusal():
            answer = self._llm.chat(prompt).message
        self._commit(turn, user, answer)
        return _response(answer, nodes)

    async def achat(
        self, message: str, chat_history: list[ChatMessage] | None = None
    ) -> AgentChatResponse:
        turn = self._begin(chat_history)
        nodes, user, prompt = await self._afitted_turn(turn, message)
        with _chat_refusal():
            answer = (await self._llm.achat(prompt)).message
        self._commit(turn, user, answer)
        return _response(answer, nodes)

    def stream_chat(
        self, message: str, chat_history: list[ChatMessage] | None = None
    ) -> StreamingAgentChatResponse:
        turn = self._begin(chat_history)
        nodes, user, prompt = self._fitted_turn(turn, message)
        with _chat_refusal():
            stream = self._llm.stream_chat(prompt)

        def commit_at_end() -> ChatResponseGen:
            answer = ""
            with _chat_refusal():
                for response in stream:
                    answer += response.delta or ""
                    yield response
            self._commit(turn, user, _assistant(answer))

        return StreamingAgentChatResponse(
            chat_stream=commit_at_end(), source_nodes=nodes, is_writing_to_memory=False
        )

    async def astream_chat(
        self, message: str, chat_history: list[ChatMessage] | None = None
    ) -> StreamingAgentChatResponse:
        turn = self._begin(chat_history)
        nodes, user, prompt = await self._afitted_turn(turn, message)
        with _chat_refusal():
            stream = await self._llm.astream_chat(prompt)

        async def commit_at_end() -> ChatResponseAsyncGen:
            answer = ""
            with _chat_refusal():
                async for response in stream:
                    answer += response.delta or ""
                    yield response
            self._commit(turn, user, _assistant(answer))

        return StreamingAgentChatResponse(
            achat_stream=commit_at_end(), source_nodes=nodes, is_writing_to_memory=False
        )

    def _begin(self, chat_history: list[ChatMessage] | None) -> _Turn:
        """Start a turn: adopt a caller's history (if given), trim it, sync the ledger."""
        with self._lock:
            self._settle(self._history if chat_history is None else list(chat_history))
            return _Turn(self._resets, self._history)

    def _fitted_turn(
        self, turn: _Turn, message: str
    ) -> tuple[list[NodeWithScore], ChatMessage, Prompt]:
        """This turn's nodes, user message and prompt, the history cut until the prompt fits
        the context window (see the class docstring)."""
        earlier = turn.history
        with self._deduped_against(earlier):
            nodes = self._retriever.retrieve(message)
        user, prompt = self._prompt(message, nodes, earlier)
        fitted = self._fits(prompt)
        while not fitted and earlier:
            earlier, retrieve_again = self._without_oldest_turns(earlier)
            if retrieve_again:
                # this turn's request is counted already
                with replanning(), self._deduped_against(earlier):
                    nodes = self._retriever.retrieve(message)
            user, prompt = self._prompt(message, nodes, earlier)
            fitted = self._fits(prompt)
        if earlier is not turn.history:
            self._end_trim(turn, earlier, fitted)
        return nodes, user, prompt

    async def _afitted_turn(
        self, turn: _Turn, message: str
    ) -> tuple[list[NodeWithScore], ChatMessage, Prompt]:
        """:meth:`_fitted_turn` for async turns; counting (which may load the model) runs in
        a worker thread."""
        earlier = turn.history
        with self._deduped_against(earlier):
            nodes = await self._retriever.aretrieve(message)
        user, prompt = self._prompt(message, nodes, earlier)
        fitted = await asyncio.to_thread(self._fits, prompt)
        while not fitted and earlier:
            earlier, retrieve_again = self._without_oldest_turns(earlier)
            if retrieve_again:
                with replanning(), self._deduped_against(earlier):
                    nodes = await self._retriever.aretrieve(message)
            user, prompt = self._prompt(message, nodes, earlier)
            fitted = await asyncio.to_thread(self._fits, prompt)
        if earlier is not turn.history:
            self._end_trim(turn, earlier, fitted)
        return nodes, user, prompt

    def _fits(self, prompt: Prompt) -> bool:
        """Whether ``prompt`` and the answer's ``max_tokens`` fit the LLM's context window;
        True when that is not counted (see the class docstring)."""
        llm = self._llm
        if not isinstance(llm, ChunkCacheLLM) or not counts_prompts(llm.cache.backend):
            return True
        # The request exactly as ChunkCacheLLM.chat builds it: chat template, chunks found.
        request = llm._request(llm._chat_prompt(prompt), {})
        return fits_context_window(llm.cache.backend, request)

    def _without_oldest_turns(self, history: list[ChatMessage]) -> tuple[list[ChatMessage], bool]:
        """``history`` less its older half of turns (a single turn: it), as
        ``max_history_turns`` trims; and whether the retriever must run again: it drops
        repeats, and chunks it may have left out of this turn left the prompt."""
        kept = halved(history, _is_user)
        before = set(recorded_chunk_ids(history, _is_user))
        after = set(recorded_chunk_ids(kept, _is_user))
        return kept, self._retriever.dedupe == "drop" and not before <= after

    def _deduped_against(self, history: list[ChatMessage]) -> AbstractContextManager[None]:
        """The retriever, called inside, dedupes this turn against the chunks ``history``
        (what its prompt carries) holds, not against the ledger: another turn running at
        once records there chunks its own prompt holds, this one's not."""
        held = self._held_in(history)
        return self._retriever.cache.ledger.turn(self._conversation_id, held)

    def _prompt(
        self, message: str, nodes: list[NodeWithScore], history: list[ChatMessage]
    ) -> tuple[ChatMessage, Prompt]:
        """This turn's user message, and the whole prompt: ``history``, then it."""
        # A node with media alone (an image) renders as no text: this prompt is text only.
        contents = [n.node.get_content(metadata_mode=MetadataMode.LLM) for n in nodes]
        if any(contents):
            context = CHUNK_SEPARATOR.join(c for c in contents if c)
            text = self._context_template.format(context_str=context, query_str=message)
        else:
            text = message
        # A node with metadata only is sent but holds no chunk (see ChunkCacheRetriever).
        chunk_ids = [n.node.metadata[CHUNK_ID_METADATA_KEY] for n in nodes if node_text(n.node)]
        user = ChatMessage(
            role=MessageRole.USER, content=text, additional_kwargs={CHUNK_IDS_KEY: chunk_ids}
        )
        earlier = [_for_llm(m) for m in history]
        return user, [self._system_message, *earlier, _for_llm(user)]

    def _commit(self, turn: _Turn, user: ChatMessage, answer: ChatMessage) -> None:
        """Add a finished turn after whatever was added meanwhile (unless a reset came
        first), then trim."""
        with self._lock:
            if turn.resets == self._resets:
                self._settle([*self._history, user, answer])

    def _end_trim(self, turn: _Turn, kept: list[ChatMessage], fitted: bool) -> None:
        """Trim the history as ``turn`` trimmed the one it began with to ``kept``, as the
        history is now (turns added since stay), unless a reset came first.  An unfitted
        prompt, which the backend refuses, changes nothing: the ledger is synced back to
        the history (its retrievals recorded chunks there)."""
        with self._lock:
            if turn.resets == self._resets:
                history = self._history
                self._settle(retrimmed(history, turn.history, kept) if fitted else history)

    def _settle(self, history: list[ChatMessage]) -> None:
        """Make ``history``, trimmed, the engine's, and the ledger exactly its chunks (those
        a user message recorded and still holds: a history passed in may have been edited).
        Called holding the engine's lock."""
        self._history = trimmed(history, self._max_history_turns, _is_user)
        self._retriever.cache.ledger.replace(self._conversation_id, self._held_in(self._history))

    def _held_in(self, history: list[ChatMessage]) -> list[str]:
        """The chunk ids ``history``'s user messages recorded and still hold."""
        return held_chunk_ids(history, _is_user, _text_of, self._retriever.cache.registry.get)


def _bound(llm: LLM, cache: ChunkCache, conversation_id: str) -> LLM:
    """``llm``; a :class:`ChunkCacheLLM` bound to ``conversation_id``, so the engine keeps
    each turn's KV for the next turn's prompt, which extends it.  A ChunkCacheLLM on
    another cache than the retriever's (``cache``) is a ValueError: it looks for the
    chunks in its own cache, and would never find one."""
    if not isinstance(llm, ChunkCacheLLM):
        return llm
    if llm.cache is not cache:
        raise ValueError(
            "the llm and the retriever use different ChunkCaches, so the llm would find none "
            "of the retrieved chunks in its prompts: give both the same cache"
        )
    if llm.conversation_id == conversation_id:
        return llm
    if llm.conversation_id is not None:
        raise ValueError(
            f"the llm is bound to conversation {llm.conversation_id!r}, "
            f"the engine's is {conversation_id!r}"
        )
    return llm.for_conversation(conversation_id)


def _system_role(llm: LLM) -> MessageRole:
    """The role of ``llm``'s system message; a ChunkCacheLLM's is known without reading its
    metadata, which loads the model (an async app may build an engine on its event loop)."""
    return MessageRole.SYSTEM if isinstance(llm, ChunkCacheLLM) else llm.metadata.system_role


@contextmanager
def _chat_refusal() -> Iterator[None]:
    """A PromptTooLongError explained for a chat (:data:`CHAT_FIT_HINT`)."""
    try:
        yield
    except PromptTooLongError as error:
        cause = error.__cause__ if isinstance(error.__cause__, PromptTooLongError) else error
        raise PromptTooLongError(f"{cause}. {CHAT_FIT_HINT}") from cause


def _is_user(message: ChatMessage) -> bool:
    return message.role == MessageRole.USER


def _text_of(message: ChatMessage) -> str:
    return message.content or ""


def _for_llm(message: ChatMessage) -> ChatMessage:
    """``message`` without its chunk ids: some LLM classes (OpenAI's among them) send
    ``additional_kwargs`` to the API as message fields."""
    if CHUNK_IDS_KEY not in message.additional_kwargs:
        return message
    kwargs = {k: v for k, v in message.additional_kwargs.items() if k != CHUNK_IDS_KEY}
    return message.model_copy(update={"additional_kwargs": kwargs})


def _assistant(text: str) -> ChatMessage:
    return ChatMessage(role=MessageRole.ASSISTANT, content=text)


def _response(answer: ChatMessage, nodes: list[NodeWithScore]) -> AgentChatResponse:
    return AgentChatResponse(response=answer.content or "", source_nodes=nodes)
