"""Request bodies of ``chunkcache serve``: OpenAI's shapes plus the ``chunkcache`` extension.

Every generation request may carry a ``chunkcache`` object (with the ``openai`` client:
``extra_body={"chunkcache": {...}}``)::

    {"chunks": [{"id": "doc-7", "text": "..."}],   # chunks known to be in the prompt
     "match_registered": true,                     # also find chunks sent to /v1/chunks
     "policy": "cacheblend", "recompute_ratio": 0.15, "conversation_id": "user-42"}

A chunk without ``id`` gets its content hash, as the retrievers compute it.  Instead of
``chunks``, a text completion may give the prompt's split itself, ``"segments": [{"text":
"..."}, {"text": "...", "chunk_id": "doc-7"}, ...]``, whose texts make up the prompt: what
:class:`~chunkcache.core.http_backend.HttpBackend` sends for segments its caller built, which
finding the chunks would not give back.  Fields
OpenAI defines but the engine cannot honour (tools, logprobs, n > 1, content parts other
than text, ...) are refused with a 400 naming the field (the error's ``param``) rather than
silently ignored; other unknown fields (``user``, a message's ``name``...) are ignored.  A field
of another JSON type (``"3"`` or ``true`` for an integer) is refused, as OpenAI does.  A null
``temperature``, ``top_p``, ``n``, ``stream`` or ``chunkcache`` means its default, as
OpenAI reads it; ``stop`` takes at most 16 strings, and an empty one is ignored;
``temperature`` is any finite number >= 0 (OpenAI caps it at 2;
:class:`~chunkcache.core.generation.SamplingParams` does not); ``top_p`` 0 is greedy; ``seed``
is any integer ``torch.Generator.manual_seed`` takes: OpenAI's signed 64-bit range, and up to
2**64 - 1.

A top-level ``cache_salt`` (vLLM's field: 1-128 characters, no ``@``, ``/``, ``\\`` or NUL)
isolates the request's cache: see :class:`~chunkcache.core.generation.GenerationRequest`.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    model_validator,
)
from pydantic_core import PydanticCustomError

from chunkcache.core.chunk_ids import check_unicode, chunk_id
from chunkcache.core.generation import (
    MAX_STOP_STRINGS,
    SEED_MAX,
    SEED_MIN,
    Policy,
    check_cache_salt,
    openai_sampling,
)

MAX_CHUNKS_PER_REQUEST = 10_000
# JSON may escape a lone surrogate ("\\ud83d"); no tokenizer reads one: a 400 naming it.
Text = Annotated[str, AfterValidator(check_unicode)]
StopString = Annotated[str, AfterValidator(check_unicode)]
# Every body takes a field of its JSON type only, as OpenAI's API does: no "3" for 3, no true
# for 1, no "yes" for true (a JSON integer is still a number where a float is taken).
STRICT = ConfigDict(strict=True)
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

# The value of a field above that asks for nothing: "none" chooses no tool.
ASKS_NOTHING = {"tool_choice": "none", "function_call": "none"}


class ChunkRef(BaseModel):
    """One chunk: its id (content hash when omitted) and its exact text."""

    model_config = ConfigDict(extra="forbid", strict=True)

    id: str | None = Field(default=None, max_length=128)
    text: Text = Field(min_length=1)

    def pair(self) -> tuple[str, str]:
        """(chunk id, text), the id computed from the text when it was not given."""
        return (self.id if self.id is not None else chunk_id(self.text), self.text)


class SegmentRef(BaseModel):
    """One segment of a prompt split by the client: its text, and its chunk id if a chunk."""

    model_config = ConfigDict(extra="forbid", strict=True)

    text: Text
    chunk_id: str | None = Field(default=None, max_length=128)


class ChunkCacheOptions(BaseModel):
    """The ``chunkcache`` extension object of a generation request."""

    model_config = ConfigDict(extra="forbid", strict=True)

    chunks: list[ChunkRef] | None = Field(default=None, max_length=MAX_CHUNKS_PER_REQUEST)
    # a prompt with the most chunks, and a text around each
    segments: list[SegmentRef] | None = Field(
        default=None, max_length=2 * MAX_CHUNKS_PER_REQUEST + 1
    )
    match_registered: bool = True
    policy: Policy | None = None
    recompute_ratio: float | None = Field(default=None, ge=0, le=1)
    conversation_id: str | None = None
    fit_window: bool = False  # max_tokens is a cap, cut to the room the prompt leaves

    @model_validator(mode="after")
    def _one_split(self) -> ChunkCacheOptions:
        if self.segments is not None and self.chunks is not None:
            raise PydanticCustomError(
                "conflict",
                "chunks and segments both split the prompt: give one of them",
                {"param": "chunkcache.segments"},
            )
        return self


class StreamOptions(BaseModel):
    model_config = STRICT

    include_usage: bool = False


def _refusal(*fields: str) -> PydanticCustomError:
    """The validation error of a request asking for what this server cannot do; the first
    field becomes the error's ``param``."""
    return PydanticCustomError(
        "unsupported",
        "unsupported by chunkcache serve: {fields}",
        {"fields": ", ".join(fields), "param": fields[0]},
    )


class TextPart(BaseModel):
    model_config = STRICT

    type: Literal["text"]
    text: Text


def _text_part(part: Any) -> Any:
    """A part that is not text, refused by its type (the error names its index)."""
    kind = part.get("type") if isinstance(part, dict) else type(part).__name__
    if kind != "text":
        raise PydanticCustomError(
            "unsupported",
            "only text content parts are supported by chunkcache serve, not {kind}",
            {"kind": repr(kind)},
        )
    return part


def _as_parts(content: Any) -> Any:
    """String content as one text part.  Checked here, not by a union of the two, whose
    error lists every branch's failure."""
    if isinstance(content, str):
        return [{"type": "text", "text": check_unicode(content)}]
    if not isinstance(content, list):
        raise PydanticCustomError(
            "content_type", "content must be a string or a list of text parts"
        )
    return content


class ChatMessage(BaseModel):
    """A chat message with text content (a string or text parts).  Its ``name`` is ignored,
    as chat templates ignore it."""

    model_config = STRICT

    role: Literal["system", "developer", "user", "assistant"]
    content: Annotated[
        list[Annotated[TextPart, BeforeValidator(_text_part)]], BeforeValidator(_as_parts)
    ]

    def as_dict(self) -> dict[str, str]:
        """``role``/``content`` for the chat template (``developer`` is a system message)."""
        text = "".join(p.text for p in self.content)
        return {"role": "system" if self.role == "developer" else self.role, "content": text}


def _stop_list(stop: Any) -> Any:
    """``stop`` as a list: one string, a list of them, or null (none)."""
    if stop is None:
        return []
    return [stop] if isinstance(stop, str) else stop


def _non_empty(stop: list[str]) -> list[str]:
    """``stop`` without empty strings: one would match at every position and end every
    answer before its first token, which no one asks for; it is taken as no stop string."""
    return [s for s in stop if s]


def _check_seed(seed: int | None) -> int | None:
    """``seed`` if torch can seed with it, else a one-line error giving the range."""
    if seed is not None and not SEED_MIN <= seed <= SEED_MAX:
        raise PydanticCustomError(
            "seed_range",
            "must be an integer from {low} to {high} (a signed 64-bit integer, as OpenAI's, "
            "or an unsigned one)",
            {"low": SEED_MIN, "high": SEED_MAX},
        )
    return seed


def _one_prompt(prompt: Any) -> Any:
    """The one prompt string of a text completion (a list of one string is one)."""
    if not isinstance(prompt, list):
        return prompt
    if any(not isinstance(p, str) for p in prompt):
        raise PydanticCustomError(
            "unsupported", "token ids are not supported by chunkcache serve: send the text"
        )
    if len(prompt) != 1:
        raise PydanticCustomError(
            "unsupported", "must be one string (batched prompts are not supported)"
        )
    return prompt[0]


# OpenAI's API takes null for these as "the default" (the openai client sends
# temperature=None as null): dropped before validation, so their defaults apply.
NULL_IS_DEFAULT = frozenset({"temperature", "top_p", "n", "stream", "chunkcache"})


class GenerationBody(BaseModel):
    """What chat and text completions share: sampling, streaming, the extension."""

    model_config = ConfigDict(extra="allow", strict=True)

    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    # No upper bound, unlike OpenAI's 2: SamplingParams takes any finite temperature >= 0
    # (a large one samples near uniformly), so HttpBackend runs what LocalBackend runs.
    temperature: float = Field(default=1.0, ge=0, allow_inf_nan=False)
    top_p: float = Field(default=1.0, ge=0, le=1)  # 0: greedy (see sampling())
    stop: Annotated[list[StopString], BeforeValidator(_stop_list), AfterValidator(_non_empty)] = (
        Field(default_factory=list, max_length=MAX_STOP_STRINGS)
    )
    seed: Annotated[int | None, AfterValidator(_check_seed)] = None
    n: int = Field(default=1, ge=1, le=1, description="one choice per request")
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    cache_salt: Annotated[str | None, AfterValidator(check_cache_salt)] = None
    chunkcache: ChunkCacheOptions = Field(default_factory=ChunkCacheOptions)

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        return {k: v for k, v in data.items() if v is not None or k not in NULL_IS_DEFAULT}

    @model_validator(mode="after")
    def _refuse_unsupported(self) -> GenerationBody:
        asked = self.unsupported_fields()
        if asked:
            raise _refusal(*asked)
        caps = (self.max_tokens, self.max_completion_tokens)
        if None not in caps and caps[0] != caps[1]:
            # Servers differ on which wins (vLLM: max_completion_tokens): not silently one.
            raise PydanticCustomError(
                "conflict",
                "max_tokens {max_tokens} and max_completion_tokens {max_completion_tokens} "
                "differ: set one of them",
                {
                    "max_tokens": caps[0],
                    "max_completion_tokens": caps[1],
                    "param": "max_completion_tokens",
                },
            )
        return self

    def unsupported_fields(self) -> list[str]:
        """The fields of this body that ask for what the engine cannot do."""
        extra = self.model_extra or {}
        asked = [
            name
            for name in UNSUPPORTED
            if extra.get(name) not in (None, False, [], {}, ASKS_NOTHING.get(name))
        ]
        if extra.get("response_format") not in (None, {"type": "text"}):
            asked.append("response_format")
        if extra.get("best_of") not in (None, 1):  # completions' default is 1
            asked.append("best_of")
        return asked

    def max_tokens_field(self) -> str:
        """The name of the field that set the cap: ``max_completion_tokens`` or ``max_tokens``."""
        return "max_tokens" if self.max_completion_tokens is None else "max_completion_tokens"

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_tokens is None else self.max_tokens

    def sampling(self) -> dict[str, Any]:
        """``temperature``, ``top_p``, ``stop`` and ``seed`` as SamplingParams takes them
        (:func:`~chunkcache.core.generation.openai_sampling`: ``top_p`` 0 is greedy, a
        negative seed the unsigned one torch seeds the same generator with)."""
        return {**openai_sampling(self.temperature, self.top_p, self.seed), "stop": list(self.stop)}

    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class ChatCompletionBody(GenerationBody):
    messages: list[ChatMessage] = Field(min_length=1)


class CompletionBody(GenerationBody):
    # An empty prompt has no token to start from: the engine would refuse it.
    prompt: Annotated[Text, BeforeValidator(_one_prompt)] = Field(min_length=1)

    def unsupported_fields(self) -> list[str]:
        asked = super().unsupported_fields()
        # A count here, not chat's bool: 0 asks for the chosen tokens' logprobs.
        logprobs = (self.model_extra or {}).get("logprobs")
        if "logprobs" not in asked and logprobs == 0 and logprobs is not False:
            asked.append("logprobs")
        return asked


class ChunksBody(BaseModel):
    """``POST /v1/chunks``: chunks to find in later prompts."""

    model_config = ConfigDict(extra="forbid", strict=True)

    chunks: list[ChunkRef] = Field(min_length=1, max_length=MAX_CHUNKS_PER_REQUEST)


class RenderBody(BaseModel):
    """``POST /v1/chunkcache/render``: chat messages to render with the model's template."""

    model_config = ConfigDict(extra="forbid", strict=True)

    messages: list[ChatMessage] = Field(min_length=1)


def error_body(
    message: str, type_: str, code: str | None = None, param: str | None = None
) -> dict[str, Any]:
    """OpenAI's error object (``param``: the request field at fault, when one is)."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}
