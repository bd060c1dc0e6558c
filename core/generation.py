"""What an LLM wrapper sends a backend, and what comes back.

A request is a prompt already split into segments (plain text and chunks) plus a
recompute policy and sampling settings.  A backend streams text pieces; the last
piece carries the request's :class:`GenerationStats`.  Every backend (the local
engine, ``chunkcache serve`` over HTTP, vLLM) implements :class:`Backend`.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Literal, Protocol, get_args

from chunkcache.core.chunk_ids import check_unicode, validate_chunk_id
from chunkcache.core.errors import InvalidTextError, PromptTooLongError
from chunkcache.core.ledger import check_conversation_id
from chunkcache.core.segmenter import ChunkSegment, Segment, TextSegment

Policy = Literal["full", "prefix", "reuse", "cacheblend", "cachecraft"]
POLICIES: tuple[Policy, ...] = get_args(Policy)
DEFAULT_POLICY: Policy = "cacheblend"
DEFAULT_RECOMPUTE_RATIO = 0.15  # CacheBlend §4.3 / §7: 15% keeps quality at full-prefill level
# The seeds torch.Generator.manual_seed takes: OpenAI's signed 64-bit ones, and the unsigned
# ones SamplingParams takes.  Torch seeds a negative one as seed + 2**64.
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1
# Every stop string is searched for in the whole answer at every token, on the engine's
# thread: 200,000 of them (2.8 MB) cost 0.16 s a token and stalled every request in a batch.
# OpenAI takes 4; this is lenient with clients written for other servers.
MAX_STOP_STRINGS = 16
# vLLM's rule for ``cache_salt`` (vllm/entrypoints/generate/base/protocol.py), so a salt one
# backend takes every backend takes: 1-128 characters, none of these.
MAX_CACHE_SALT_LENGTH = 128
CACHE_SALT_FORBIDDEN = frozenset("@/\\\x00")


def check_policy(policy: str) -> Policy:
    """Return ``policy`` if it names a recompute policy, else raise ValueError."""
    for known in POLICIES:
        if policy == known:
            return known
    raise ValueError(f"unknown recompute policy {policy!r}; choose one of {POLICIES}")


@dataclass(frozen=True)
class SamplingParams:
    """Decoding settings. ``temperature == 0`` is greedy.

    ``fit_window``: generate up to ``max_tokens`` or up to the room the prompt leaves in the
    model's context window, whichever is less, as OpenAI does for a request that sets no
    limit.  The backend that tokenizes the prompt applies it (local, batching, ``vllm``; the
    ``http`` backend has its server apply it); a prompt that fills the window is refused
    either way.  Without it, a prompt plus ``max_tokens`` over the window is refused
    (:func:`tokens_to_generate`).

    ``stop``: at most :data:`MAX_STOP_STRINGS` strings (ValueError), each valid Unicode
    (:class:`~chunkcache.core.errors.InvalidTextError` for a lone surrogate, which no decoded
    text holds); an empty one is ignored.  Every backend takes what this takes.
    """

    max_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    stop: tuple[str, ...] = ()
    seed: int | None = None
    fit_window: bool = False

    def __post_init__(self) -> None:
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an int >= 1, got {self.max_tokens!r}")
        if not isinstance(self.fit_window, bool):
            raise ValueError(f"fit_window must be a bool, got {self.fit_window!r}")
        _check_temperature(self.temperature)
        if not _is_real(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed < 2**64):
            raise ValueError(f"seed must be an int in [0, 2**64), got {self.seed!r}")
        _check_stop(self.stop)


def _check_stop(stop: object) -> None:
    if not isinstance(stop, tuple | list) or not all(isinstance(s, str) for s in stop):
        raise ValueError(f"stop must be a sequence of strings, got {stop!r:.200}")
    if len(stop) > MAX_STOP_STRINGS:
        raise ValueError(f"stop takes at most {MAX_STOP_STRINGS} strings, got {len(stop)}")
    for i, string in enumerate(stop):
        try:
            check_unicode(string)
        except InvalidTextError as error:
            raise InvalidTextError(f"stop string {i}: {error}") from None


def check_cache_salt(cache_salt: object) -> str | None:
    """Return ``cache_salt`` if it is None or a salt vLLM takes too: a str of 1-128
    characters, valid Unicode, without ``@``, ``/``, ``\\`` or NUL; else raise ValueError
    (:class:`~chunkcache.core.errors.InvalidTextError` for a lone surrogate)."""
    if cache_salt is None:
        return None
    if not isinstance(cache_salt, str) or not cache_salt:
        raise ValueError(f"cache_salt must be a non-empty string, got {cache_salt!r:.80}")
    if len(cache_salt) > MAX_CACHE_SALT_LENGTH:
        raise ValueError(
            f"cache_salt must be at most {MAX_CACHE_SALT_LENGTH} characters, got {len(cache_salt)}"
        )
    if CACHE_SALT_FORBIDDEN.intersection(cache_salt):
        raise ValueError("cache_salt must not contain '@', '/', '\\' or NUL")
    try:
        return check_unicode(cache_salt)
    except InvalidTextError as error:
        raise InvalidTextError(f"cache_salt: {error}") from None


def salt_digest(cache_salt: str) -> str:
    """A 128-bit hex digest of ``cache_salt``: what keys, files and traces hold of a salt,
    never the salt itself."""
    h = hashlib.blake2b(digest_size=16, person=b"cc-cache-salt")
    h.update(cache_salt.encode())
    return h.hexdigest()


def salted_namespace(fingerprint: str, cache_salt: str | None) -> str:
    """The namespace a request's KV is stored and looked up under: the model ``fingerprint``,
    with the digest of ``cache_salt`` when there is one, so requests of different salts (or
    one salted, one not) never share an entry."""
    if cache_salt is None:
        return fingerprint
    return f"{fingerprint}+salt-{salt_digest(cache_salt)}"


def openai_sampling(temperature: float, top_p: float, seed: int | None) -> dict[str, Any]:
    """``temperature``, ``top_p`` and ``seed`` as OpenAI's API takes them, as
    :class:`SamplingParams` takes them: what ``chunkcache serve`` and the ``ChunkCacheLLM``
    wrappers accept from a client written for OpenAI.

    ``top_p`` 0 (OpenAI takes [0, 1]; SamplingParams and vLLM take (0, 1]) keeps the most
    likely token alone, the limit of an ever smaller nucleus: greedy decoding.  A negative
    ``seed`` (OpenAI's are signed 64-bit) becomes the unsigned one torch seeds the same
    generator with, ``seed + 2**64``.  ValueError for a value neither takes.

    >>> openai_sampling(0.7, 0, -1)
    {'temperature': 0.0, 'top_p': 1.0, 'seed': 18446744073709551615}
    """
    _check_temperature(temperature)
    if not _is_real(top_p) or not 0 <= top_p <= 1:
        raise ValueError(f"top_p must be in [0, 1], got {top_p!r}")
    if seed is not None and (not _is_int(seed) or not SEED_MIN <= seed <= SEED_MAX):
        raise ValueError(f"seed must be an int from -2**63 to 2**64 - 1, got {seed!r}")
    greedy = top_p == 0
    return {
        "temperature": 0.0 if greedy else temperature,
        "top_p": 1.0 if greedy else top_p,
        "seed": None if seed is None else seed % 2**64,
    }


def tokens_to_generate(prompt_tokens: int, sampling: SamplingParams, context_window: int) -> int:
    """How many tokens a prompt of ``prompt_tokens`` may generate in ``context_window``:
    ``sampling.max_tokens``, cut to the room left with ``fit_window``.  A prompt that leaves
    no room, or (without ``fit_window``) no room for ``max_tokens``, is a
    :class:`PromptTooLongError`."""
    room = context_window - prompt_tokens
    if room < 1:
        raise PromptTooLongError(
            f"{prompt_tokens} prompt tokens leave no room to generate in the model's "
            f"context window of {context_window}"
        )
    if sampling.fit_window:
        return min(sampling.max_tokens, room)
    if sampling.max_tokens > room:
        raise PromptTooLongError(
            f"{prompt_tokens} prompt tokens + {sampling.max_tokens} to generate exceed the "
            f"model's context window of {context_window}"
        )
    return sampling.max_tokens


def _check_temperature(temperature: float) -> None:
    if not _is_finite_real(temperature) or temperature < 0:
        raise ValueError(f"temperature must be a finite number >= 0, got {temperature!r}")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _is_finite_real(value: object) -> bool:
    """A real number that is finite as a float too (``10**400`` is an int, not a float)."""
    if not _is_real(value):
        return False
    try:
        return math.isfinite(float(value))  # type: ignore[arg-type]
    except OverflowError:
        return False


@dataclass(frozen=True)
class GenerationRequest:
    """One prompt, as segments, and how to run it.

    Checked as every backend checks it: a ``conversation_id`` that is not 1-256 characters
    (an int becomes its string) -> :class:`~chunkcache.core.errors.InvalidConversationIdError`,
    a chunk id that is not 1-128 characters of ``[A-Za-z0-9._:-]`` ->
    :class:`~chunkcache.core.errors.InvalidChunkError`.

    ``cache_salt`` isolates the request's cache, as vLLM's does: KV computed under one salt
    (or under none) is never reused by a request under another, whether stored entries,
    exact prefixes or a conversation's memory; requests of one salt share as unsalted ones
    do.  Checked by :func:`check_cache_salt` (vLLM's rule); keys, files and memory hold
    only its digest (:func:`salted_namespace`).
    """

    segments: Sequence[Segment]
    conversation_id: str | None = None
    policy: Policy = DEFAULT_POLICY
    recompute_ratio: float = DEFAULT_RECOMPUTE_RATIO
    sampling: SamplingParams = field(default_factory=SamplingParams)
    cache_salt: str | None = None

    def __post_init__(self) -> None:
        check_policy(self.policy)
        wrong = [s for s in self.segments if not isinstance(s, TextSegment | ChunkSegment)]
        if isinstance(self.segments, str) or wrong:
            found = self.segments if isinstance(self.segments, str) else wrong[0]
            raise TypeError(f"segments must be TextSegment or ChunkSegment, got {found!r:.80}")
        if not _is_real(self.recompute_ratio) or not 0 <= self.recompute_ratio <= 1:
            raise ValueError(f"recompute_ratio must be in [0, 1], got {self.recompute_ratio!r}")
        if self.conversation_id is not None:
            # frozen: the checked id replaces the given one (an int's string)
            object.__setattr__(self, "conversation_id", check_conversation_id(self.conversation_id))
        check_cache_salt(self.cache_salt)
        for segment in self.segments:
            if isinstance(segment, ChunkSegment):
                validate_chunk_id(segment.chunk_id)


@dataclass
class GenerationStats:
    """Where a request's prompt tokens came from, and how long the first token took.

    ``reused_tokens`` were served from cache (exact prefix or moved chunk KV, minus
    those recomputed); ``recomputed_tokens`` were cached but computed again
    (selective recompute); ``computed_tokens`` had no cache entry.  The three add
    up to ``prompt_tokens``.
    """

    policy: str
    prompt_tokens: int = 0
    reused_tokens: int = 0
    recomputed_tokens: int = 0
    computed_tokens: int = 0
    chunk_hits: int = 0
    chunk_misses: int = 0
    completion_tokens: int = 0
    ttft_s: float = 0.0
    total_s: float = 0.0
    finish_reason: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class GenerationChunk:
    """A piece of generated text; the final piece has ``stats`` set."""

    text: str
    stats: GenerationStats | None = None


class Backend(Protocol):
    """Something that runs segmented prompts: the local engine, a server, vLLM."""

    def render_chat(self, messages: Sequence[Mapping[str, str]]) -> str:
        """The prompt text for chat ``messages`` (``role``/``content`` dicts), ready for
        the assistant's turn: the model's chat template applied."""
        ...

    def stream(self, request: GenerationRequest) -> Iterator[GenerationChunk]:
        """Generate for ``request``, yielding text as it is decoded; the last chunk
        carries the stats."""
        ...
