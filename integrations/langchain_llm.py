"""LangChain's ``ChunkCacheLLM``: a chat model that reuses the KV cache of retrieved chunks.

Put it where any chat model goes and build the prompt any way you like: the
messages are rendered with the backend's chat template, and the chunks a
:class:`~chunkcache.integrations.langchain.ChunkCacheRetriever` returned are found
in the rendered prompt by exact text, wherever the template put them: put the documents'
text in the template (a ``Document`` list itself renders as its repr, escaped, and no chunk
is found).

>>> llm = ChunkCacheLLM(max_tokens=64)  # doctest: +SKIP
>>> context = "\\n\\n".join(doc.page_content for doc in docs)  # doctest: +SKIP
>>> answer = (prompt | llm).invoke(  # doctest: +SKIP
...     {"question": q, "context": context}, config={"configurable": {"session_id": "user-42"}}
... )
>>> answer.usage_metadata["input_token_details"]["cache_read"]  # doctest: +SKIP
>>> answer.response_metadata["chunkcache"]["chunk_hits"]  # doctest: +SKIP

``cache_read`` counts the prompt tokens served from cache; ``response_metadata
["chunkcache"]`` holds the backend's :class:`~chunkcache.core.generation.GenerationStats`.

Chunks the registry does not hold (another process retrieved them, or they were
evicted) can be named per call: ``llm.invoke(messages, chunks=docs)`` takes
Documents (id: as the retriever computes it, so its own documents keep theirs) or
(chunk id, text) pairs.  Other per-call options: ``recompute``,
``recompute_ratio``, ``max_tokens``, ``temperature``, ``top_p``, ``seed``, ``stop``,
``cache_salt``.

A ``cache_salt`` (vLLM's field, on the model or per call: ``llm.invoke(messages,
cache_salt=tenant_secret)``) keeps a tenant's cache apart: no request reuses KV computed
under another salt or none, on every backend.  Traces and LangChain's response cache key
see its digest, never the salt.

Token counting (``get_num_tokens``, ``get_num_tokens_from_messages``, hence
``trim_messages(..., token_counter=llm)``) uses the backend's tokenizer and counts the
prompt as it is sent, never LangChain's fallback GPT-2 tokenizer (a hub download, and
other counts): on the ``local`` and ``vllm`` backends; ``http`` has no tokenizer in the
app's process, so there it needs LangChain's ``custom_get_token_ids``.

>>> recent = trim_messages(history, max_tokens=2000, token_counter=llm)  # doctest: +SKIP

Several LLM calls per turn of one conversation (``create_history_aware_retriever``
rephrases the question before the answer is written; a LangGraph graph may rewrite or
grade) need nothing more: the local engine keeps each conversation's last sequence per
prompt shape (:mod:`chunkcache.core.conversation_memory`), so each call's next turn reuses
its own past.

>>> retriever = create_history_aware_retriever(  # doctest: +SKIP
...     llm, ChunkCacheRetriever(base_retriever=base), rephrase_prompt
... )
>>> chain = create_retrieval_chain(  # doctest: +SKIP
...     retriever, create_stuff_documents_chain(llm, answer_prompt)
... )
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Annotated, Any

from langchain_core.callbacks import (
    AsyncCallbackManagerForLLMRun,
    CallbackManagerForLLMRun,
)
from langchain_core.documents import Document
from langchain_core.language_models import BaseChatModel, LangSmithParams, LanguageModelInput
from langchain_core.language_models.chat_models import (
    agenerate_from_stream,
    generate_from_stream,
)
from langchain_core.messages import (
    AIMessage,
    AIMessageChunk,
    BaseMessage,
    ChatMessage,
    HumanMessage,
    SystemMessage,
    UsageMetadata,
)
from langchain_core.outputs import ChatGenerationChunk, ChatResult
from langchain_core.runnables import RunnableConfig, ensure_config
from pydantic import AfterValidator, Field, model_validator

from chunkcache.core.cache import ChunkCache, default_cache
from chunkcache.core.chunk_ids import check_unicode, chunk_id_for
from chunkcache.core.errors import UsageError
from chunkcache.core.generation import (
    DEFAULT_POLICY,
    DEFAULT_RECOMPUTE_RATIO,
    SEED_MAX,
    SEED_MIN,
    Backend,
    GenerationChunk,
    GenerationRequest,
    GenerationStats,
    Policy,
    check_cache_salt,
    openai_sampling,
    salt_digest,
)
from chunkcache.core.prompting import (
    SETTINGS,
    arun_stream,
    backend_model_name,
    build_request,
    call_options,
    has_tokenizer,
    prompt_tokens,
    run_stream,
)
from chunkcache.core.retrieval import conversation_id_from

__all__ = ["ChunkCacheLLM"]


class ChunkCacheLLM(BaseChatModel):
    """A chat model on a chunkcache backend (the local engine unless the cache has another).

    Args:
        chunk_cache: shared chunk state and backend; the process-wide default when
            omitted, so retrievers and this model cooperate unwired.  ``cache=`` is
            accepted for it too when given a :class:`ChunkCache`, as on the
            retrievers; LangChain's ``cache`` (response cache: bool or BaseCache)
            keeps its meaning.
        recompute: the recompute policy (``"cacheblend"``, ``"cachecraft"``,
            ``"reuse"``, ``"prefix"`` or ``"full"``).
        recompute_ratio: share of reused chunk tokens recomputed (CacheBlend).
        max_tokens, temperature, top_p, stop, seed: decoding, as OpenAI's API takes them
            (:func:`~chunkcache.core.generation.openai_sampling`): ``temperature=0`` or
            ``top_p=0`` is greedy; ``seed`` is an int from -2**63 to 2**64 - 1, a negative
            one seeded as ``seed + 2**64``, as torch does.
        cache_salt: isolates this model's requests' cache from other salts' and unsalted
            ones (see the module docstring); 1-128 characters, no ``@``, ``/``, ``\\``, NUL.

    The conversation id is read from ``config["configurable"]`` (``conversation_id``,
    ``session_id`` or ``thread_id``), as :class:`ChunkCacheRetriever` reads it, or
    from a ``conversation_id=`` keyword.  Tool calling and structured output are not
    supported: the default model does not do them.
    """

    chunk_cache: ChunkCache = Field(default_factory=default_cache, exclude=True)
    recompute: Policy = DEFAULT_POLICY
    recompute_ratio: float = Field(default=DEFAULT_RECOMPUTE_RATIO, ge=0, le=1)
    max_tokens: int = Field(default=256, ge=1)
    temperature: float = Field(default=0.0, ge=0)
    top_p: float = Field(default=1.0, ge=0, le=1)
    stop: list[str] | None = None
    seed: int | None = Field(default=None, ge=SEED_MIN, le=SEED_MAX)
    # a tenant's secret: kept out of repr (LangChain traces a model by its repr) and dumps
    cache_salt: Annotated[str | None, AfterValidator(check_cache_salt)] = Field(
        default=None, repr=False, exclude=True
    )

    @model_validator(mode="before")
    @classmethod
    def _chunk_cache_given_as_cache(cls, values: Any) -> Any:
        if isinstance(values, dict) and isinstance(values.get("cache"), ChunkCache):
            if "chunk_cache" in values:
                raise ValueError("give the ChunkCache once, as cache= or as chunk_cache=")
            values = {**values, "chunk_cache": values["cache"]}
            del values["cache"]
        return values

    @property
    def _llm_type(self) -> str:
        return "chunkcache"

    @property
    def model_name(self) -> str:
        """The backend's model name (creating the backend if needed)."""
        return backend_model_name(self.chunk_cache.backend)

    @property
    def _identifying_params(self) -> dict[str, Any]:
        settings = {name: getattr(self, name) for name in SETTINGS}
        return {"model_name": self.model_name, **_salt_hidden(settings)}

    # Traces and the response cache's key read a call's keyword arguments too.
    def _get_invocation_params(
        self, stop: list[str] | None = None, **kwargs: Any
    ) -> dict[str, Any]:
        return super()._get_invocation_params(stop=stop, **_salt_hidden(kwargs))

    def _get_llm_string(self, stop: list[str] | None = None, **kwargs: Any) -> str:
        return super()._get_llm_string(stop=stop, **_salt_hidden(kwargs))

    def _get_ls_params(self, stop: list[str] | None = None, **kwargs: Any) -> LangSmithParams:
        params = super()._get_ls_params(stop=stop or self.stop, **kwargs)
        params["ls_provider"] = "chunkcache"
        return params

    # The conversation id lives in the caller's config, which langchain-core does
    # not pass to _generate/_stream: read it at every public entry point.
    def invoke(
        self,
        input: LanguageModelInput,
        config: RunnableConfig | None = None,
        *,
        stop: list[str] | None = None,
        **kwargs: Any,
    ) -> AIMessage:
        kwargs = _with_conversation(config, kwargs)
        return super().invoke(input, config, stop=stop, **kwargs)

    async def ainvoke(
        self,
        input: LanguageModelInput,
        config: RunnableConfig | None = None,
        *,
        stop: list[str] | None = None,
        **kwargs: Any,
    ) -> AIMessage:
        kwargs = _with_conversation(config, kwargs)
        return await super().ainvoke(input, config, stop=stop, **kwargs)

    def stream(
        self,
        input: LanguageModelInput,
        config: RunnableConfig | None = None,
        *,
        stop: list[str] | None = None,
        **kwargs: Any,
    ) -> Iterator[AIMessageChunk]:
        kwargs = _with_conversation(config, kwargs)
        return super().stream(input, config, stop=stop, **kwargs)

    def astream(
        self,
        input: LanguageModelInput,
        config: RunnableConfig | None = None,
        *,
        stop: list[str] | None = None,
        **kwargs: Any,
    ) -> AsyncIterator[AIMessageChunk]:
        kwargs = _with_conversation(config, kwargs)
        return super().astream(input, config, stop=stop, **kwargs)

    def stream_events(
        self, input: LanguageModelInput, config: RunnableConfig | None = None, **kwargs: Any
    ) -> Any:
        return super().stream_events(input, config, **_with_conversation(config, kwargs))

    def astream_events(
        self, input: LanguageModelInput, config: RunnableConfig | None = None, **kwargs: Any
    ) -> Any:
        return super().astream_events(input, config, **_with_conversation(config, kwargs))

    def _generate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        return generate_from_stream(self._stream(messages, stop, **kwargs))

    def _stream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> Iterator[ChatGenerationChunk]:
        request = self._request(messages, stop, kwargs)
        for piece in run_stream(self.chunk_cache.backend, request):
            yield self._chunk(piece)

    async def _astream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> AsyncIterator[ChatGenerationChunk]:
        # The blocking work (chat template, segmenting, decoding) runs in worker threads;
        # a cancelled task stops the request, also while it waits for the engine.
        request = await asyncio.to_thread(self._request, messages, stop, kwargs)
        async for piece in arun_stream(self.chunk_cache.backend, request):
            yield self._chunk(piece)

    async def _agenerate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        # Not langchain-core's default (_generate in an executor): that runs to the end
        # when the awaiting task is cancelled, holding the engine.
        return await agenerate_from_stream(self._astream(messages, stop, **kwargs))

    def get_token_ids(self, text: str) -> list[int]:
        """The ids of ``text``'s tokens under the backend's tokenizer, no special tokens
        added; ``custom_get_token_ids(text)`` instead when it is set.

        Counting needs the tokenizer in this process, so it may load the local model, as
        the first generation would (the vllm backend loads its tokenizer only).

        Raises:
            UsageError: the backend has no tokenizer here (``http``: the server holds it).
        """
        if self.custom_get_token_ids is not None:
            return self.custom_get_token_ids(text)
        backend = _counting_backend(self.chunk_cache.backend)
        segment_tokenizer = getattr(backend, "segment_tokenizer", None)
        if segment_tokenizer is not None:
            return list(segment_tokenizer.encode(text, at_start=True))
        return list(backend.tokenizer.encode(check_unicode(text), add_special_tokens=False))

    def get_num_tokens_from_messages(
        self, messages: list[BaseMessage], tools: Sequence[Any] | None = None, **kwargs: Any
    ) -> int:
        """The tokens of the prompt this model sends for ``messages``: the chat template
        applied and the chunks found as :meth:`invoke` does (``kwargs``: its per-call
        options, e.g. ``chunks=``), counted as the backend counts them (each segment on its
        own on the local engines, the whole prompt on vllm).  May load the local model, as
        :meth:`get_token_ids` may.

        With ``custom_get_token_ids`` set, LangChain's own count with it (each message as
        its ``"Human: ..."`` text): nothing is rendered, no model is loaded.

        Raises:
            TypeError: ``tools`` given (this model has no tool calling), or an unknown
                option in ``kwargs``.
            UsageError: the backend has no tokenizer here (``http``: the server holds it).
        """
        if tools:
            raise TypeError(
                "ChunkCacheLLM has no tool calling (the default model does not do it), so "
                "there are no tool schemas to count: call it without tools"
            )
        call_options(self, kwargs)  # unknown options are refused, as invoke refuses them
        if self.custom_get_token_ids is not None:
            return super().get_num_tokens_from_messages(messages)
        backend = _counting_backend(self.chunk_cache.backend)
        return prompt_tokens(backend, self._request(messages, None, kwargs))

    def _request(
        self, messages: list[BaseMessage], stop: list[str] | None, kwargs: dict[str, Any]
    ) -> GenerationRequest:
        # langchain-core reads ``stream`` to choose _stream or _generate, then passes it on.
        kwargs = {name: value for name, value in kwargs.items() if name != "stream"}
        options = call_options(self, kwargs)
        options.update(openai_sampling(options["temperature"], options["top_p"], options["seed"]))
        options["chunks"] = self._chunk_pairs(kwargs.get("chunks"))
        if stop is not None:
            options["stop"] = stop
        prompt = self.chunk_cache.backend.render_chat(_chat_messages(messages))
        return build_request(prompt, self.chunk_cache, **options)

    def _chunk_pairs(
        self, chunks: Sequence[Document | tuple[str, str]] | None
    ) -> list[tuple[str, str]] | None:
        if chunks is None:
            return None
        if isinstance(chunks, str | Document):
            raise TypeError("chunks must be a list of Documents or (chunk id, text) pairs")
        return [
            (chunk_id_for(c.page_content, c.metadata, self.chunk_cache.namespace), c.page_content)
            if isinstance(c, Document)
            else c
            for c in chunks
        ]

    def _chunk(self, piece: GenerationChunk) -> ChatGenerationChunk:
        if piece.stats is None:
            return ChatGenerationChunk(message=AIMessageChunk(content=piece.text))
        message = AIMessageChunk(
            content=piece.text,
            usage_metadata=_usage(piece.stats),
            response_metadata=self._response_metadata(piece.stats),
            chunk_position="last",
        )
        return ChatGenerationChunk(message=message)

    def _response_metadata(self, stats: GenerationStats) -> dict[str, Any]:
        return {
            "model_name": self.model_name,
            "finish_reason": stats.finish_reason,
            "chunkcache": stats.as_dict(),
        }


# Longer session keys (a signed token, several ids joined) are named by their hash: the
# ledger and the engine take conversation ids of at most 256 characters.
_MAX_PLAIN_CONVERSATION_KEY = 200


def conversation_key(key: str) -> str:
    """The conversation id for an app's session key: the key itself, or past 200
    characters its SHA-256 (hex), so any session key names one conversation."""
    if len(key) <= _MAX_PLAIN_CONVERSATION_KEY:
        return key
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()


# with_chunk_history names a conversation by the app's history keys, whatever they are, and
# passes that name to the chain under this key, so the LLM and the retriever agree on it.
TURN_CONVERSATION_KEY = "chunkcache_conversation_id"


def config_conversation_id(config: RunnableConfig | None) -> str | None:
    """The conversation id in ``config["configurable"]`` (``chunkcache_conversation_id``,
    set by ``with_chunk_history``, else ``conversation_id``, ``session_id`` or ``thread_id``,
    the first one set), as :func:`conversation_key` names it."""
    configurable = ensure_config(config).get("configurable", {})
    found = configurable.get(TURN_CONVERSATION_KEY)
    found = conversation_id_from(configurable) if found is None else str(found)
    return None if found is None else conversation_key(found)


def _with_conversation(config: RunnableConfig | None, kwargs: dict[str, Any]) -> dict[str, Any]:
    """``kwargs`` plus the config's conversation id, unless one was passed explicitly."""
    conversation_id = config_conversation_id(config)
    if conversation_id is None or "conversation_id" in kwargs:
        return kwargs
    return {**kwargs, "conversation_id": conversation_id}


def _salt_hidden(params: dict[str, Any]) -> dict[str, Any]:
    """``params`` with its ``cache_salt`` (checked) as the salt's digest: what tells salts
    apart in traces and in LangChain's response cache key (so one tenant's cached answer is
    never another's), without holding the salt."""
    salt = check_cache_salt(params.get("cache_salt"))
    return params if salt is None else {**params, "cache_salt": f"digest-{salt_digest(salt)}"}


def _counting_backend(backend: Backend) -> Any:
    """``backend``, checked to hold a tokenizer in this process (:func:`has_tokenizer`).
    LangChain's fallback, GPT-2's tokenizer fetched from the Hugging Face hub, counts other
    tokens than the model's: never used."""
    if has_tokenizer(backend):
        return backend
    raise UsageError(
        f"ChunkCacheLLM cannot count tokens on its backend ({type(backend).__name__}): it "
        "has no tokenizer in this process (with backend='http' the chunkcache server holds "
        "it, and counting there is not available). Pass custom_get_token_ids= (a function "
        "from text to the served model's token ids) or use backend='local' or 'vllm'"
    )


def _chat_messages(messages: Sequence[BaseMessage]) -> list[dict[str, str]]:
    """``role``/``content`` dicts for the chat template; text content only."""
    return [{"role": _role(m), "content": _text(m)} for m in messages]


# A ChatMessage's free-form role, in the chat template's three: the names other providers
# give the same turns (OpenAI's developer, Cohere's chatbot, Gemini's model), as
# langchain-core's convert_to_messages reads them.
_CHAT_ROLES = {
    "system": "system",
    "developer": "system",
    "user": "user",
    "human": "user",
    "assistant": "assistant",
    "ai": "assistant",
    "chatbot": "assistant",
    "model": "assistant",
}


def _role(message: BaseMessage) -> str:
    if isinstance(message, SystemMessage):
        return "system"
    if isinstance(message, HumanMessage):
        return "user"
    if isinstance(message, AIMessage) and not message.tool_calls:
        return "assistant"
    if isinstance(message, ChatMessage) and message.role in _CHAT_ROLES:
        return _CHAT_ROLES[message.role]
    what = (
        f"message of role {message.role!r}"
        if isinstance(message, ChatMessage)
        else f"{message.type!r} message"
    )
    raise ValueError(
        f"ChunkCacheLLM cannot send a {what}"
        f"{' with tool calls' if isinstance(message, AIMessage) else ''}: "
        "it supports system, user and assistant text messages (no tool calling)"
    )


# A past turn's reasoning, as a reasoning model's messages carry it (langchain-core's standard
# block, Anthropic's thinking, OpenAI-compatible servers' reasoning_content): the message's
# ``text`` leaves it out and the chat template has no place for it, so it is not sent.
_REASONING_BLOCKS = frozenset({"reasoning", "thinking", "redacted_thinking", "reasoning_content"})


def _text(message: BaseMessage) -> str:
    if isinstance(message.content, str):
        return message.content
    texts = []
    for block in message.content:
        if isinstance(block, str):
            texts.append(block)
        elif block.get("type") == "text":
            texts.append(block["text"])
        elif block.get("type") in _REASONING_BLOCKS:
            continue
        else:
            raise ValueError(
                f"ChunkCacheLLM takes text only, got a {block.get('type')!r} content block"
            )
    return "".join(texts)


def _usage(stats: GenerationStats) -> UsageMetadata:
    return UsageMetadata(
        input_tokens=stats.prompt_tokens,
        output_tokens=stats.completion_tokens,
        total_tokens=stats.prompt_tokens + stats.completion_tokens,
        input_token_details={"cache_read": stats.reused_tokens},
    )
