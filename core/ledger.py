"""CRAFT's ChunkMap: the chunk ids each conversation has already put in its prompts.

CRAFT §4.3: a chunk already in an earlier turn of the same conversation is
already in the conversation's context (its KV too), so the new turn may drop it
(``drop``), keep it but say so (``mark``), or ignore the ledger (``off``).
Dropping is only safe when every earlier turn's chunks stay in the prompt, which
is what the multi-turn layout helpers guarantee.

The ledger is bounded: at most ``max_conversations`` (least recently used go
first), each forgotten ``ttl_s`` seconds after its last use, each holding at
most ``max_chunks_per_conversation`` ids (the ones put in a prompt longest ago go
first).  An id costs ~100 bytes, so the worst case is ``max_conversations x
max_chunks_per_conversation x 100`` bytes: 400 MB in :class:`ChunkCache`'s default
ledger (2,000 conversations), 2 GB in a ledger made with the defaults here.  Forgetting
an id is always safe: the chunk is sent again.  All methods are thread-safe.

Turns of one conversation may run at once (two tabs, a turn retried while the first try
still streams): each one's prompt holds the chunks of its own history, not those another
running turn just recorded.  A turn that knows its history's chunks dedupes against them
inside :meth:`ConversationLedger.turn`, whatever the other turns record meanwhile.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Literal, get_args

from chunkcache.core.errors import InvalidConversationIdError

DedupeMode = Literal["drop", "mark", "off"]
DEDUPE_MODES: tuple[DedupeMode, ...] = get_args(DedupeMode)
MAX_CONVERSATION_ID_LENGTH = 256
# Twice a conversation of 100 turns x 10 chunks; 2,000 chunks of ~250 tokens are 500,000
# tokens, more than any prompt holds, so a conversation past it has dropped its oldest
# chunks from the prompt anyway.  At 10,000 ids a conversation, ChunkCache's 2,000
# conversations could keep 20 million ids (~2 GB) for nothing.
DEFAULT_MAX_CHUNKS_PER_CONVERSATION = 2_000


def check_dedupe_mode(mode: str) -> DedupeMode:
    """Return ``mode`` if it names a dedupe mode, else raise ValueError."""
    if mode not in DEDUPE_MODES:
        raise ValueError(f"unknown dedupe mode {mode!r}; choose one of {DEDUPE_MODES}")
    return mode


def check_conversation_id(conversation_id: object) -> str:
    """Return a usable conversation id or raise :class:`InvalidConversationIdError`."""
    if not isinstance(conversation_id, str | int) or isinstance(conversation_id, bool):
        raise InvalidConversationIdError(
            f"conversation id must be str or int, got {type(conversation_id).__name__}"
        )
    text = str(conversation_id)
    if not text or len(text) > MAX_CONVERSATION_ID_LENGTH:
        raise InvalidConversationIdError(
            f"conversation id must be 1-{MAX_CONVERSATION_ID_LENGTH} characters"
        )
    return text


def _check_chunk_ids(chunk_ids: Iterable[str]) -> None:
    """Refuse one bare str for ``chunk_ids``: its characters would pass for ids."""
    if isinstance(chunk_ids, str):
        raise TypeError("chunk_ids must be a sequence of chunk ids, not one str")


@dataclass(frozen=True)
class DedupeResult:
    """What a turn keeps: ``kept`` in input order, and which of them or others were seen."""

    kept: list[str]
    dropped: list[str]
    seen: frozenset[str]


@dataclass
class _Conversation:
    chunk_ids: dict[str, None]
    last_used: float


@dataclass(frozen=True, eq=False)
class _Turn:
    """One turn's own view of its conversation: the chunks its prompt holds."""

    ledger: ConversationLedger
    key: str
    chunk_ids: set[str]  # grows with what the turn records; changed under the ledger's lock


# The turns open in this context (a thread or task, and work given its context), innermost last.
_open_turns: ContextVar[tuple[_Turn, ...]] = ContextVar("chunkcache_ledger_turns", default=())


class ConversationLedger:
    """Per-conversation sets of chunk ids, bounded by LRU, TTL and size."""

    def __init__(
        self,
        max_conversations: int = 10_000,
        ttl_s: float = 24 * 3600.0,
        max_chunks_per_conversation: int = DEFAULT_MAX_CHUNKS_PER_CONVERSATION,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if max_conversations < 1 or max_chunks_per_conversation < 1 or ttl_s <= 0:
            raise ValueError("ledger bounds must be positive")
        self.max_conversations = max_conversations
        self.ttl_s = ttl_s
        self.max_chunks_per_conversation = max_chunks_per_conversation
        self._clock = clock
        self._conversations: OrderedDict[str, _Conversation] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        with self._lock:
            self._expire(self._clock())
            return len(self._conversations)

    def __contains__(self, conversation_id: object) -> bool:
        try:
            key = check_conversation_id(conversation_id)
        except InvalidConversationIdError:
            return False
        with self._lock:
            self._expire(self._clock())
            return key in self._conversations

    def seen(self, conversation_id: str) -> frozenset[str]:
        """Chunk ids already in ``conversation_id``; empty for an unknown or expired id."""
        key = check_conversation_id(conversation_id)
        with self._lock:
            self._expire(self._clock())
            conversation = self._conversations.get(key)
            return frozenset(conversation.chunk_ids) if conversation else frozenset()

    def apply(
        self, conversation_id: str, chunk_ids: Sequence[str], mode: DedupeMode
    ) -> DedupeResult:
        """Dedupe one turn's chunks against the conversation, then record them as seen.

        An unknown (or expired) conversation id starts a new conversation.
        """
        check_dedupe_mode(mode)
        key = check_conversation_id(conversation_id)
        _check_chunk_ids(chunk_ids)
        turn = self._open_turn(key)
        with self._lock:
            now = self._clock()
            self._expire(now)
            conversation = self._conversations.get(key)
            if turn is not None:
                seen = frozenset(turn.chunk_ids)
            else:
                seen = frozenset(conversation.chunk_ids) if conversation else frozenset()
            unique = list(dict.fromkeys(chunk_ids))
            if mode == "drop":
                kept = [cid for cid in unique if cid not in seen]
                dropped = [cid for cid in unique if cid in seen]
            else:
                kept, dropped = unique, []
            if mode != "off":
                self._record(key, kept, now)
                if turn is not None:
                    turn.chunk_ids.update(kept)
            return DedupeResult(kept=kept, dropped=dropped, seen=seen)

    @contextmanager
    def turn(self, conversation_id: str, chunk_ids: Iterable[str]) -> Iterator[None]:
        """A turn of ``conversation_id`` whose prompt holds ``chunk_ids`` (its history's):
        inside, :meth:`apply` for that conversation dedupes against ``chunk_ids`` and what it
        recorded inside, not against the conversation's shared set, which other turns running
        at once add to (their chunks are in their own prompts, not this one's).  Inside means
        this thread or task and the work it hands its context to (tasks it creates,
        ``asyncio.to_thread``, LangChain's executors), not a plain ``threading.Thread``.
        What :meth:`apply` records still goes to the shared set too."""
        key = check_conversation_id(conversation_id)
        _check_chunk_ids(chunk_ids)
        turn = _Turn(self, key, set(chunk_ids))
        token = _open_turns.set((*_open_turns.get(), turn))
        try:
            yield
        finally:
            _open_turns.reset(token)

    def record(self, conversation_id: str, chunk_ids: Iterable[str]) -> None:
        """Mark ``chunk_ids`` as in the conversation's context."""
        key = check_conversation_id(conversation_id)
        _check_chunk_ids(chunk_ids)
        with self._lock:
            now = self._clock()
            self._expire(now)
            self._record(key, chunk_ids, now)

    def replace(self, conversation_id: str, chunk_ids: Iterable[str]) -> None:
        """Make ``chunk_ids`` the conversation's whole set, e.g. to match a history that
        was trimmed or replaced, or that lost a failed turn's chunks.  Later ids count as
        more recent: a history's ids go oldest first."""
        key = check_conversation_id(conversation_id)
        _check_chunk_ids(chunk_ids)
        with self._lock:
            now = self._clock()
            self._expire(now)
            self._conversations.pop(key, None)
            self._record(key, chunk_ids, now)

    def forget(self, conversation_id: str) -> bool:
        """Drop a conversation (e.g. when its history is cleared). True if it existed."""
        key = check_conversation_id(conversation_id)
        with self._lock:
            return self._conversations.pop(key, None) is not None

    def _open_turn(self, key: str) -> _Turn | None:
        """The innermost :meth:`turn` open here on this ledger for conversation ``key``."""
        turns = [t for t in _open_turns.get() if t.ledger is self and t.key == key]
        return turns[-1] if turns else None

    def _record(self, key: str, chunk_ids: Iterable[str], now: float) -> None:
        conversation = self._conversations.get(key)
        if conversation is None:
            conversation = _Conversation(chunk_ids={}, last_used=now)
            self._conversations[key] = conversation
        conversation.last_used = now
        self._conversations.move_to_end(key)
        for cid in chunk_ids:
            # An id put in a prompt again is as recent as this turn.
            conversation.chunk_ids.pop(cid, None)
            conversation.chunk_ids[cid] = None
        # Oldest ids go first when a conversation outgrows its bound.
        while len(conversation.chunk_ids) > self.max_chunks_per_conversation:
            del conversation.chunk_ids[next(iter(conversation.chunk_ids))]
        while len(self._conversations) > self.max_conversations:
            self._conversations.popitem(last=False)

    def _expire(self, now: float) -> None:
        while self._conversations:
            key, oldest = next(iter(self._conversations.items()))
            if now - oldest.last_used <= self.ttl_s:
                return
            del self._conversations[key]
