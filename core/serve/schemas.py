"""Request bodies of ``chunkcache serve``: OpenAI's shapes plus the ``chunkcache`` extension.

Every generation request may carry a ``chunkcache`` object (with the ``openai`` client:
``extra_body={"chunkcache": {...}}``)::

    {"chunks": [{"id": "doc-7", "text": "..."}],   # chunks known to be in the prompt
     "match_registered": true,                     # also find chunks sent to /v1/chunks
     "policy": "cacheblend", "recompute_ratio": 0.15, "conversation_id": "user-42"}

A chunk without ``id`` gets its content hash, as the retrievers compute it.  Fields
OpenAI defines but the engine cannot honour (tools, logprobs, n > 1, ...) are refused
with a 400 rather than silently ignored; other unknown fields are ignored.  A null
``temperature``, ``top_p``, ``n``, ``stream`` or ``chunkcache`` means its default, as
OpenAI reads it; ``stop`` takes at most 16 strings; ``temperature`` is any finite number
>= 0 (OpenAI caps it at 2; :class:`~chunkcache.core.generation.SamplingParams` does not).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator

from chunkcache.core.chunk_ids import check_unicode, chunk_id
from chunkcache.core.generation import Policy

MAX_CHUNKS_PER_REQUEST = 10_000
# Every stop string is searched for in the whole answer at every token, on the engine's
# thread: 200,000 of them (2.8 MB) cost 0.16 s a token and stalled every request in the
# batch.  OpenAI takes 4; this is lenient with clients written for other servers.
MAX_STOP_STRINGS = 16
# JSON may escape a lone surrogate ("\\ud83d"); no tokenizer reads one: a 400 naming it.
Text = Annotated[str, AfterValidator(check_unicode)]
# Present and not null/false/empty: the request asks for something this server cannot do.
UNSUPPORTED = (
    "tools",
    "functions",
    "tool_choice",
    "function_call",
    "logprobs",
    "top_logprobs",
    "logit_bias",
    "echo",
    "suffix",
    "audio",
    "prediction",
    # 0 (OpenAI's default) passes: it equals False below
    "frequency_penalty",
    "presence_penalty",
)


class ChunkRef(BaseModel):
    """One chunk: its id (content hash when omitted) and its exact text."""

    model_config = ConfigDict(extra="forbid")

    id: str | None = Field(default=None, max_length=128)
    text: Text = Field(min_length=1)

    def pair(self) -> tuple[str, str]:
        """(chunk id, text), the id computed from the text when it was not given."""
        return (self.id if self.id is not None else chunk_id(self.text), self.text)


class ChunkCacheOptions(BaseModel):
    """The ``chunkcache`` extension object of a generation request."""

    model_config = ConfigDict(extra="forbid")

    chunks: list[ChunkRef] | None = Field(default=None, max_length=MAX_CHUNKS_PER_REQUEST)
    match_registered: bool = True
    policy: Policy | None = None
    recompute_ratio: float | None = Field(default=None, ge=0, le=1)
    conversation_id: str | None = None
    fit_window: bool = False  # max_tokens is a cap, cut to the room the prompt leaves


class StreamOptions(BaseModel):
    include_usage: bool = False


class TextPart(BaseModel):
    type: Literal["text"]
    text: Text


class ChatMessage(BaseModel):
    """A chat message with text content (a string or text parts)."""

    role: Literal["system", "developer", "user", "assistant"]
    content: Text | list[TextPart]

    def as_dict(self) -> dict[str, str]:
        """``role``/``content`` for the chat template (``developer`` is a system message)."""
        content = self.content
        text = content if isinstance(content, str) else "".join(p.text for p in content)
        return {"role": "system" if self.role == "developer" else self.role, "content": text}


# OpenAI's API takes null for these as "the default" (the openai client sends
# temperature=None as null): dropped before validation, so their defaults apply.
NULL_IS_DEFAULT = frozenset({"temperature", "top_p", "n", "stream", "chunkcache"})


class GenerationBody(BaseModel):
    """What chat and text completions share: sampling, streaming, the extension."""

    model_config = ConfigDict(extra="allow")

    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    # No upper bound, unlike OpenAI's 2: SamplingParams takes any finite temperature >= 0
    # (a large one samples near uniformly), so HttpBackend runs what LocalBackend runs.
    temperature: float = Field(default=1.0, ge=0, allow_inf_nan=False)
    top_p: float = Field(default=1.0, gt=0, le=1)
    stop: Text | Annotated[list[Text], Field(max_length=MAX_STOP_STRINGS)] | None = None
    seed: int | None = None
    n: int = Field(default=1, ge=1, le=1, description="one choice per request")
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    chunkcache: ChunkCacheOptions = Field(default_factory=ChunkCacheOptions)

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        return {k: v for k, v in data.items() if v is not None or k not in NULL_IS_DEFAULT}

    @model_validator(mode="after")
    def _refuse_unsupported(self) -> GenerationBody:
        extra = self.model_extra or {}
        asked = [name for name in UNSUPPORTED if extra.get(name) not in (None, False, [], {})]
        if asked:
            raise ValueError(f"unsupported by chunkcache serve: {', '.join(asked)}")
        if extra.get("response_format") not in (None, {"type": "text"}):
            raise ValueError("unsupported by chunkcache serve: response_format")
        if extra.get("best_of") not in (None, 1):  # completions' default is 1
            raise ValueError("unsupported by chunkcache serve: best_of")
        return self

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_tokens is None else self.max_tokens

    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or ())

    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class ChatCompletionBody(GenerationBody):
    messages: list[ChatMessage] = Field(min_length=1)


class CompletionBody(GenerationBody):
    prompt: Text | list[Text]

    def prompt_text(self) -> str:
        if isinstance(self.prompt, str):
            return self.prompt
        if len(self.prompt) != 1:
            raise ValueError("prompt must be one string (batched prompts are not supported)")
        return self.prompt[0]


class ChunksBody(BaseModel):
    """``POST /v1/chunks``: chunks to find in later prompts."""

    model_config = ConfigDict(extra="forbid")

    chunks: list[ChunkRef] = Field(min_length=1, max_length=MAX_CHUNKS_PER_REQUEST)


class RenderBody(BaseModel):
    """``POST /v1/chunkcache/render``: chat messages to render with the model's template."""

    model_config = ConfigDict(extra="forbid")

    messages: list[ChatMessage] = Field(min_length=1)


def error_body(message: str, type_: str, code: str | None = None) -> dict[str, Any]:
    """OpenAI's error object."""
    return {"error": {"message": message, "type": type_, "param": None, "code": code}}
