"""LlamaIndex's ``ChunkCacheLLM``: an LLM that reuses the KV cache of retrieved chunks.

The chunks a :class:`~chunkcache.integrations.llama_index.ChunkCacheRetriever`
returned are found in the prompt by exact text, whatever template built it.
``chat``/``stream_chat`` render the messages with the backend's chat template (with
``messages_to_prompt`` where the app sets one, as LlamaIndex's local LLMs do, or on a
model without a template, a base model, as LlamaIndex does for completion models);
``complete``/``stream_complete`` send the prompt as it is (after ``completion_to_prompt``
unless ``formatted=True``): a completion, no chat template.

>>> llm = ChunkCacheLLM(max_tokens=64).for_conversation("user-42")  # doctest: +SKIP
>>> response = llm.chat([ChatMessage(role="user", content=prompt_with_chunks)])  # doctest: +SKIP
>>> response.additional_kwargs["chunkcache"]["reused_tokens"]  # doctest: +SKIP

Every final response carries the backend's
:class:`~chunkcache.core.generation.GenerationStats` as ``additional_kwargs["chunkcache"]``
and in ``raw`` (with an OpenAI-style ``raw["usage"]``, which LlamaIndex's token
counter reads); in a stream, the last response does.  A query or chat engine returns a
response of its own, without them: read each LLM call's stats (``reused_tokens``, the
``cache_read`` of the LangChain side, ``ttft_s``, ``chunk_hits``) from LlamaIndex's
instrumentation, whose LLM end events carry the LLM's response, streamed or not::

    from llama_index.core.instrumentation import get_dispatcher
    from llama_index.core.instrumentation.event_handlers import BaseEventHandler
    from llama_index.core.instrumentation.events.llm import (
        LLMChatEndEvent,
        LLMCompletionEndEvent,
    )

    class ChunkCacheStats(BaseEventHandler):
        def handle(self, event, **kwargs):
            if isinstance(event, LLMChatEndEvent | LLMCompletionEndEvent) and event.response:
                stats = event.response.additional_kwargs.get("chunkcache")  # None: another LLM

    get_dispatcher().add_event_handler(ChunkCacheStats())

:class:`~chunkcache.integrations.llama_index_chat.ChunkCacheChatEngine` binds the
LLM to the engine's conversation itself::

    engine = ChunkCacheChatEngine.from_defaults(retriever, llm=ChunkCacheLLM())

LlamaIndex's query engines pack retrieved text up to ``metadata.context_window``
counting tokens with ``Settings.tokenizer`` (tiktoken unless set), not the model's
tokenizer, so a prompt they fill can exceed the window and be refused
(:class:`~chunkcache.core.errors.PromptTooLongError`; their refine step only logs it
and answers without that text).  :meth:`ChunkCacheLLM.prompt_helper` counts as the
model does, per engine::

    synthesizer = get_response_synthesizer(llm=llm, prompt_helper=llm.prompt_helper())
    engine = index.as_query_engine(llm=llm, response_synthesizer=synthesizer)

The model is loaded on first use; an async call loads it in a worker thread, so the
event loop runs on meanwhile.

Per-call keywords: ``chunks`` (nodes, or (chunk id, text) pairs, for chunks the
registry does not hold; nodes without text are no chunks, skipped), ``conversation_id``,
``recompute``, ``recompute_ratio``, ``max_tokens``, ``temperature``, ``top_p``, ``stop``,
``seed``, ``cache_salt``.

A ``cache_salt`` (vLLM's field: ``ChunkCacheLLM(cache_salt=tenant_secret)``) keeps a
tenant's cache apart: no request reuses KV computed under another salt or none, on every
backend.  It is left out of the LLM's dumps and repr (LlamaIndex's instrumentation events
carry them).
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass, replace
from typing import Annotated, Any, TypeVar

from llama_index.core.base.llms.generic_utils import (
    messages_to_prompt as generic_messages_to_prompt,
)
from llama_index.core.base.llms.types import (
    CachePoint,
    ChatMessage,
    ChatResponse,
    ChatResponseAsyncGen,
    ChatResponseGen,
    CompletionResponse,
    CompletionResponseAsyncGen,
    CompletionResponseGen,
    LLMMetadata,
    MessageRole,
    TextBlock,
    ThinkingBlock,
)
from llama_index.core.bridge.pydantic import BeforeValidator, Field, PrivateAttr
from llama_index.core.constants import DEFAULT_CONTEXT_WINDOW
from llama_index.core.indices.prompt_helper import PromptHelper
from llama_index.core.llms.callbacks import llm_chat_callback, llm_completion_callback
from llama_index.core.llms.llm import LLM
from llama_index.core.schema import BaseNode, MetadataMode, NodeWithScore

from chunkcache.core.cache import ChunkCache, default_cache
from chunkcache.core.chunk_ids import chunk_id_for
from chunkcache.core.errors import ChunkCacheError
from chunkcache.core.generation import (
    DEFAULT_POLICY,
    DEFAULT_RECOMPUTE_RATIO,
    SEED_MAX,
    SEED_MIN,
    Backend,
    GenerationRequest,
    GenerationStats,
    Policy,
    check_cache_salt,
    openai_sampling,
)
from chunkcache.core.ledger import check_conversation_id
from chunkcache.core.prompting import (
    agenerate,
    arun_stream,
    backend_model_name,
    build_request,
    call_options,
    generate,
    run_stream,
)
from chunkcache.integrations.llama_index_fields import (
    CacheField,
    ConversationIdField,
)
from chunkcache.integrations.llama_index_tokens import model_prompt_helper, refusal_explained

__all__ = ["ChunkCacheLLM", "node_text"]

# The chat template's role for each LlamaIndex text role: ``developer`` is OpenAI's name
# for system (our server maps it so too); ``chatbot`` (Cohere) and ``model`` (Gemini) name
# the assistant's turn.  Tool and function messages have none: refused.
_ROLES = {
    MessageRole.SYSTEM: "system",
    MessageRole.DEVELOPER: "system",
    MessageRole.USER: "user",
    MessageRole.ASSISTANT: "assistant",
    MessageRole.CHATBOT: "assistant",
    MessageRole.MODEL: "assistant",
}

ChunkLike = BaseNode | NodeWithScore | tuple[str, str]
_T = TypeVar("_T")


@dataclass(frozen=True)
class _ModelFacts:
    """What :class:`ChunkCacheLLM`'s metadata takes from the backend: the window as last
    read, the rest as read once per cache."""

    context_window: int
    is_chat_model: bool
    model_name: str


def _loading_first(
    method: Callable[..., Coroutine[Any, Any, _T]],
) -> Callable[..., Coroutine[Any, Any, _T]]:
    """``method``, called once the model facts are read (off the event loop)."""

    @functools.wraps(method)
    async def loaded(self: ChunkCacheLLM, *args: Any, **kwargs: Any) -> _T:
        await self._aload()
        return await method(self, *args, **kwargs)

    return loaded


class ChunkCacheLLM(LLM):
    """An LLM on a chunkcache backend (the local engine unless the cache has another).

    ``cache`` is shared chunk state and backend (the process-wide default when
    omitted); ``recompute`` and ``recompute_ratio`` choose the recompute policy;
    ``max_tokens``, ``temperature``, ``top_p``, ``stop`` and ``seed`` decode, as OpenAI's
    API takes them (:func:`~chunkcache.core.generation.openai_sampling`): ``temperature``
    0 or ``top_p`` 0 is greedy; ``seed`` is an int from -2**63 to 2**64 - 1, a negative
    one seeded as ``seed + 2**64``, as torch does.  ``cache_salt`` isolates the LLM's
    requests' cache (see the module docstring).  ``metadata.context_window`` is the
    backend's ``context_window`` as the backend knows it now (``vllm`` asks its server
    again after a refusal, so a server restarted with another ``--max-model-len`` is
    followed), else LlamaIndex's default (3900 tokens).  What LlamaIndex built from an
    earlier read keeps that window (a response synthesizer's prompt helper, a chat
    memory's token limit): build them again after such a restart.
    ``metadata.is_chat_model`` is False when the backend's tokenizer has no chat template
    (a base model), so LlamaIndex's query engines send it completions rather than chat
    messages.
    """

    cache: CacheField = Field(default_factory=default_cache, exclude=True)
    recompute: Policy = DEFAULT_POLICY
    recompute_ratio: float = Field(default=DEFAULT_RECOMPUTE_RATIO, ge=0, le=1)
    max_tokens: int = Field(default=256, ge=1)
    temperature: float = Field(default=0.0, ge=0)
    top_p: float = Field(default=1.0, ge=0, le=1)
    stop: list[str] | None = None
    seed: int | None = Field(default=None, ge=SEED_MIN, le=SEED_MAX)
    conversation_id: ConversationIdField = None
    cache_salt: Annotated[str | None, BeforeValidator(check_cache_salt)] = Field(
        default=None, repr=False, exclude=True
    )
    # (the cache they were read from, the facts as last read): see _model_facts
    _facts: tuple[ChunkCache, _ModelFacts] | None = PrivateAttr(default=None)

    @classmethod
    def class_name(cls) -> str:
        return "ChunkCacheLLM"

    @property
    def metadata(self) -> LLMMetadata:
        facts = self._model_facts()
        return LLMMetadata(
            context_window=facts.context_window,
            num_output=self.max_tokens,
            is_chat_model=facts.is_chat_model,
            model_name=facts.model_name,
        )

    def for_conversation(self, conversation_id: str) -> ChunkCacheLLM:
        """A copy bound to ``conversation_id``, sharing this LLM's cache."""
        return self.model_copy(update={"conversation_id": check_conversation_id(conversation_id)})

    def prompt_helper(self, **kwargs: Any) -> PromptHelper:
        """A LlamaIndex ``PromptHelper`` that counts tokens as this model does.

        LlamaIndex's response synthesizers pack retrieved text up to
        ``metadata.context_window`` counting with ``Settings.tokenizer`` (tiktoken unless
        set), so with another tokenizer a full prompt can exceed the model's window and
        be refused.  This helper counts with the model's tokenizer, and counts chat
        prompts as the chat template renders them; give it to the engine::

            synthesizer = get_response_synthesizer(llm=llm, prompt_helper=llm.prompt_helper())
            engine = index.as_query_engine(llm=llm, response_synthesizer=synthesizer)

        ``kwargs`` go to ``PromptHelper.from_llm_metadata`` (``chunk_size_limit``,
        ``chunk_overlap_ratio``, ``separator``).  With a backend that has no tokenizer in
        this process (``http``), the helper counts as LlamaIndex does.
        """
        tokenizer = getattr(self.cache.backend, "tokenizer", None)
        if tokenizer is None:
            return PromptHelper.from_llm_metadata(self.metadata, **kwargs)

        def render(messages: list[ChatMessage]) -> str:
            return self._chat_prompt(self._extend_messages(messages))

        return model_prompt_helper(
            self.metadata, tokenizer, render, self.system_prompt or "", **kwargs
        )

    @llm_completion_callback()
    def complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        return self._complete(self._completion_prompt(prompt, formatted), kwargs)

    @llm_completion_callback()
    def stream_complete(
        self, prompt: str, formatted: bool = False, **kwargs: Any
    ) -> CompletionResponseGen:
        return self._stream(self._completion_prompt(prompt, formatted), kwargs)

    @llm_chat_callback()
    def chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        return self._chat(messages, kwargs)

    @llm_chat_callback()
    def stream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseGen:
        return self._stream_chat(messages, kwargs)

    # Async variants run the blocking work in worker threads, piece by piece, so a
    # cancelled task stops its request (also while it waits for the engine).  Each first
    # reads the model facts in a thread: LlamaIndex reads ``metadata`` on the event loop
    # before our code runs (callbacks, predict), the first read loads the model, and a
    # later one may ask the server for its window again.
    @_loading_first
    @llm_completion_callback()
    async def acomplete(
        self, prompt: str, formatted: bool = False, **kwargs: Any
    ) -> CompletionResponse:
        return await self._acomplete(self._completion_prompt(prompt, formatted), kwargs)

    @_loading_first
    @llm_completion_callback()
    async def astream_complete(
        self, prompt: str, formatted: bool = False, **kwargs: Any
    ) -> CompletionResponseAsyncGen:
        return self._astream(self._completion_prompt(prompt, formatted), kwargs)

    @_loading_first
    @llm_chat_callback()
    async def achat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        prompt = await asyncio.to_thread(self._chat_prompt, messages)
        return _as_chat(await self._acomplete(prompt, kwargs))

    @_loading_first
    @llm_chat_callback()
    async def astream_chat(
        self, messages: Sequence[ChatMessage], **kwargs: Any
    ) -> ChatResponseAsyncGen:
        return self._astream_chat(messages, kwargs)

    # LlamaIndex's async helpers that read ``metadata`` before calling the ones above.
    apredict = _loading_first(LLM.apredict)
    astream = _loading_first(LLM.astream)
    astructured_predict = _loading_first(LLM.astructured_predict)
    astream_structured_predict = _loading_first(LLM.astream_structured_predict)
    apredict_and_call = _loading_first(LLM.apredict_and_call)

    async def _aload(self) -> None:
        """Read the model facts in a worker thread, so that the reads of ``metadata`` on
        the event loop that follow find them known."""
        await asyncio.to_thread(self._model_facts)

    def _model_facts(self) -> _ModelFacts:
        """What ``metadata`` says about the model.  The name and chat template are read
        once per cache (building the backend loads the model, an http backend asks its
        server); the window on every call, as cheap as the backend keeps it (an
        attribute of the local engine, asked once by http and vllm)."""
        cache, backend = self.cache, self.cache.backend
        known = self._facts[1] if self._facts is not None and self._facts[0] is cache else None
        if known is None:
            facts = _ModelFacts(
                context_window=_context_window(backend, None),
                is_chat_model=_has_chat_template(backend),
                model_name=backend_model_name(backend),
            )
        else:
            window = _context_window(backend, known.context_window)
            if window == known.context_window:
                return known
            facts = replace(known, context_window=window)
        self._facts = (cache, facts)
        return facts

    def _chat(self, messages: Sequence[ChatMessage], kwargs: dict[str, Any]) -> ChatResponse:
        return _as_chat(self._complete(self._chat_prompt(messages), kwargs))

    def _stream_chat(
        self, messages: Sequence[ChatMessage], kwargs: dict[str, Any]
    ) -> ChatResponseGen:
        for response in self._stream(self._chat_prompt(messages), kwargs):
            yield _as_chat(response)

    def _complete(self, prompt: str, kwargs: dict[str, Any]) -> CompletionResponse:
        with refusal_explained():
            text, stats = generate(self.cache.backend, self._request(prompt, kwargs))
        return _completion(text, None, stats)

    async def _astream_chat(
        self, messages: Sequence[ChatMessage], kwargs: dict[str, Any]
    ) -> ChatResponseAsyncGen:
        prompt = await asyncio.to_thread(self._chat_prompt, messages)
        async for response in self._astream(prompt, kwargs):
            yield _as_chat(response)

    async def _astream(self, prompt: str, kwargs: dict[str, Any]) -> CompletionResponseAsyncGen:
        request = await asyncio.to_thread(self._request, prompt, kwargs)
        text = ""
        with refusal_explained():
            async for piece in arun_stream(self.cache.backend, request):
                text += piece.text
                yield _completion(text, piece.text, piece.stats)

    async def _acomplete(self, prompt: str, kwargs: dict[str, Any]) -> CompletionResponse:
        request = await asyncio.to_thread(self._request, prompt, kwargs)
        with refusal_explained():
            text, stats = await agenerate(self.cache.backend, request)
        return _completion(text, None, stats)

    def _stream(self, prompt: str, kwargs: dict[str, Any]) -> CompletionResponseGen:
        text = ""
        with refusal_explained():
            for piece in run_stream(self.cache.backend, self._request(prompt, kwargs)):
                text += piece.text
                yield _completion(text, piece.text, piece.stats)

    def _completion_prompt(self, prompt: str, formatted: bool) -> str:
        if formatted or self.completion_to_prompt is None:
            return prompt
        return self.completion_to_prompt(prompt)

    def _chat_prompt(self, messages: Sequence[ChatMessage]) -> str:
        # A messages_to_prompt the app set wins over the chat template, as in LlamaIndex's
        # own local LLMs (HuggingFaceLLM, LlamaCPP); its default is only for base models.
        own = self.messages_to_prompt not in (None, generic_messages_to_prompt)
        backend = self.cache.backend
        if not own and _has_chat_template(backend):
            return backend.render_chat([_chat_message(m) for m in messages])
        return (self.messages_to_prompt or generic_messages_to_prompt)(messages)

    def _request(self, prompt: str, kwargs: dict[str, Any]) -> GenerationRequest:
        options = call_options(self, kwargs)
        options.update(openai_sampling(options["temperature"], options["top_p"], options["seed"]))
        options["chunks"] = _chunk_pairs(kwargs.get("chunks"), self.cache.namespace)
        options.setdefault("conversation_id", self.conversation_id)
        return build_request(prompt, self.cache, **options)


def _chat_message(message: ChatMessage) -> dict[str, str]:
    role = _ROLES.get(message.role)
    if role is None:
        raise ValueError(
            f"ChunkCacheLLM cannot send a {message.role.value!r} message: it supports "
            "system, user and assistant text messages (no tool calling)"
        )
    if message.additional_kwargs.get("tool_calls"):
        raise ValueError(
            f"ChunkCacheLLM cannot send a {message.role.value!r} message with tool calls: "
            "it supports system, user and assistant text messages (no tool calling)"
        )
    for block in message.blocks:
        # A CachePoint marks where a provider should cache the prompt up to; it holds no
        # text, and the engine caches every prompt on its own.  A ThinkingBlock is a past
        # turn's reasoning: LlamaIndex's ``content`` (what its messages_to_prompt and
        # text-only LLMs send) holds the text blocks alone, so it is not sent back.
        if not isinstance(block, TextBlock | CachePoint | ThinkingBlock):
            raise ValueError(f"ChunkCacheLLM takes text only, got a {block.block_type!r} block")
    return {"role": role, "content": message.content or ""}


def node_text(node: BaseNode) -> str:
    """The text of ``node`` a LlamaIndex prompt holds, the text its chunk id is computed on:
    its bare content (``MetadataMode.NONE``) without the whitespace around it, which
    LlamaIndex strips when it renders a node with its metadata and when a response
    synthesizer packs nodes into a prompt (``PromptHelper.repack``)."""
    return node.get_content(metadata_mode=MetadataMode.NONE).strip()


def _context_window(backend: Backend, last: int | None) -> int:
    """``backend``'s context window (LlamaIndex's default if it names none), or ``last``,
    the one read before, while the backend cannot tell (its server is down): the request
    then fails on its own, and ``metadata``, which LlamaIndex reads everywhere, must not."""
    try:
        window = getattr(backend, "context_window", None)
    except (ChunkCacheError, ValueError):
        if last is None:
            raise
        return last
    return window if isinstance(window, int) else DEFAULT_CONTEXT_WINDOW


def _has_chat_template(backend: Backend) -> bool:
    """False for a backend whose tokenizer has no chat template (a base model), True
    otherwise (a server without a tokenizer here applies its own template)."""
    tokenizer = getattr(backend, "tokenizer", None)
    return tokenizer is None or getattr(tokenizer, "chat_template", None) is not None


def _chunk_pairs(
    chunks: Sequence[ChunkLike] | None, namespace: str
) -> list[tuple[str, str]] | None:
    if chunks is None:
        return None
    if isinstance(chunks, str | BaseNode | NodeWithScore):
        raise TypeError("chunks must be a list of nodes or (chunk id, text) pairs")
    pairs = []
    for chunk in chunks:
        node = chunk.node if isinstance(chunk, NodeWithScore) else chunk
        if not isinstance(node, BaseNode):
            pairs.append(node)
        elif text := node_text(node):  # a node without text (metadata only) is no chunk
            pairs.append((chunk_id_for(text, node.metadata, namespace), text))
    return pairs


def _completion(text: str, delta: str | None, stats: GenerationStats | None) -> CompletionResponse:
    if stats is None:
        return CompletionResponse(text=text, delta=delta)
    info = stats.as_dict()
    usage = {
        "prompt_tokens": stats.prompt_tokens,
        "completion_tokens": stats.completion_tokens,
        "total_tokens": stats.prompt_tokens + stats.completion_tokens,
    }
    return CompletionResponse(
        text=text,
        delta=delta,
        raw={"usage": usage, "chunkcache": info},
        additional_kwargs={"chunkcache": info},
    )


def _as_chat(response: CompletionResponse) -> ChatResponse:
    return ChatResponse(
        message=ChatMessage(role=MessageRole.ASSISTANT, content=response.text),
        delta=response.delta,
        raw=response.raw,
        additional_kwargs=response.additional_kwargs,
    )
