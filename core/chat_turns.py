"""The multi-turn layout's history bookkeeping, shared by the LangChain and LlamaIndex
helpers (:mod:`chunkcache.integrations.langchain_history`,
:mod:`chunkcache.integrations.llama_index_chat`).

A turn starts at a user message.  Each turn's user message records the ids of the
chunks it brought under ``additional_kwargs[CHUNK_IDS_KEY]``, so the chunks a history
holds can be read back from the history itself (after trimming, a failed turn, or a
save and reload) and the conversation's ledger reset to exactly those (CRAFT §4.3:
``drop`` is safe only for chunks still in the prompt).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol, TypeVar

CHUNK_IDS_KEY = "chunk_ids"


class ChatMessageLike(Protocol):
    """A LangChain or LlamaIndex chat message: both carry ``additional_kwargs``."""

    additional_kwargs: dict[str, Any]


M = TypeVar("M", bound=ChatMessageLike)


def recorded_chunk_ids(messages: Sequence[M], is_user: Callable[[M], bool]) -> list[str]:
    """The chunk ids the user messages in ``messages`` recorded, in order."""
    return [
        chunk_id
        for message in messages
        if is_user(message)
        for chunk_id in message.additional_kwargs.get(CHUNK_IDS_KEY, ())
    ]


def trimmed(messages: list[M], max_turns: int | None, is_user: Callable[[M], bool]) -> list[M]:
    """``messages`` less the oldest turns when they hold more than ``max_turns``: then the
    newest ``(max_turns + 1) // 2`` stay, so a cached prefix breaks once every few turns
    rather than every turn."""
    starts = [i for i, message in enumerate(messages) if is_user(message)]
    if max_turns is None or len(starts) <= max_turns:
        return messages
    return messages[starts[len(starts) - (max_turns + 1) // 2] :]
