"""The multi-turn layout's history bookkeeping, shared by the LangChain and LlamaIndex
helpers (:mod:`chunkcache.integrations.langchain_history`,
:mod:`chunkcache.integrations.llama_index_chat`).

A turn starts at a user message.  Each turn's user message records the ids of the
chunks it brought under ``additional_kwargs[CHUNK_IDS_KEY]``, so the chunks a history
holds can be read back from the history itself (after trimming, a failed turn, or a
save and reload) and the conversation's ledger reset to exactly those (CRAFT §4.3:
``drop`` is safe only for chunks still in the prompt).  :func:`held_chunk_ids` also
checks that each message still holds its chunks' text, for histories an app edits.

Turns of one conversation may run at once (two tabs, a retry while the first try still
streams).  A trim rewrites a saved history (clear, then add what is kept), so a turn saved
in between would be lost, and two trims at once could add the kept turns twice:
:class:`~chunkcache.core.session_locks.SessionLocks` makes those steps of one session take
turns within a process, and
:func:`retrimmed` applies a trim decided on an earlier read to the history as it is now.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol, TypeVar

from chunkcache.core.chunk_ids import normalize_text

CHUNK_IDS_KEY = "chunk_ids"


class ChatMessageLike(Protocol):
    """A LangChain or LlamaIndex chat message: both carry ``additional_kwargs``."""

    additional_kwargs: dict[str, Any]


M = TypeVar("M", bound=ChatMessageLike)
T = TypeVar("T")


def recorded_chunk_ids(messages: Sequence[M], is_user: Callable[[M], bool]) -> list[str]:
    """The chunk ids the user messages in ``messages`` recorded, in order."""
    return [chunk_id for message in messages if is_user(message) for chunk_id in _ids_of(message)]


def held_chunk_ids(
    messages: Sequence[M],
    is_user: Callable[[M], bool],
    content_of: Callable[[M], str],
    text_of: Callable[[str], str | None],
) -> list[str]:
    """The ids :func:`recorded_chunk_ids` gives, less those whose text (``text_of``, e.g.
    the chunk registry's ``get``) the recording message no longer holds: an app that
    rewrote a message but kept its ``additional_kwargs`` took those chunks out of the
    prompt.  An id whose text ``text_of`` does not know (None: e.g. a history saved by
    another process) is taken on trust."""
    held: list[str] = []
    for message in messages:
        ids = _ids_of(message) if is_user(message) else []
        if ids:
            content = normalize_text(content_of(message))
            held.extend(cid for cid in ids if _in(text_of(cid), content))
    return held


def _in(text: str | None, content: str) -> bool:
    """Whether ``content`` holds ``text``; True for an unknown (None) text."""
    return text is None or normalize_text(text) in content


def _ids_of(message: ChatMessageLike) -> list[str]:
    """The chunk ids ``message`` recorded.  A ``CHUNK_IDS_KEY`` that is not a list of str
    (set by something else, or a damaged saved history) records none: the ledger then
    just does not know those chunks, and they are sent again when retrieved."""
    recorded = message.additional_kwargs.get(CHUNK_IDS_KEY)
    if not isinstance(recorded, list | tuple):
        return []
    return [chunk_id for chunk_id in recorded if isinstance(chunk_id, str)]


def trimmed(messages: list[M], max_turns: int | None, is_user: Callable[[M], bool]) -> list[M]:
    """``messages`` less the oldest turns when they hold more than ``max_turns``: then the
    newest ``(max_turns + 1) // 2`` stay, so a cached prefix breaks once every few turns
    rather than every turn."""
    starts = [i for i, message in enumerate(messages) if is_user(message)]
    if max_turns is None or len(starts) <= max_turns:
        return messages
    return messages[starts[len(starts) - (max_turns + 1) // 2] :]


def halved(messages: list[M], is_user: Callable[[M], bool]) -> list[M]:
    """``messages`` less their older half of turns (the newest ``turns // 2`` stay; none of
    a single turn), as :func:`trimmed` trims: what goes when a prompt outgrows its window."""
    turns = sum(map(is_user, messages))
    return trimmed(messages, turns - 1, is_user) if turns > 1 else []


def retrimmed(current: list[T], began: list[T], kept: list[T]) -> list[T]:
    """``current`` (a history read now) trimmed as ``began`` (the same history read earlier)
    was trimmed to ``kept`` (a suffix of it): less the messages of ``began`` before ``kept``
    that are still at its head.  Turns saved since stay; what another trim dropped meanwhile
    is not dropped again.  A history no longer starting with what is left of ``began``
    (cleared or rewritten meanwhile) is given back as it is."""
    dropped = len(began) - len(kept)
    # The first ``start`` messages of ``began`` left the history since (another trim).
    start = next(s for s in range(len(began) + 1) if current[: len(began) - s] == began[s:])
    return current[max(dropped - start, 0) :]
