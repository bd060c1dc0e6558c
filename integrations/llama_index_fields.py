"""Pydantic field types the LlamaIndex wrappers share: the chunk cache and a conversation id.

``None`` means the process-wide :func:`~chunkcache.core.cache.default_cache` for a
cache, and "no conversation" for an id; any other id is checked.
"""

from __future__ import annotations

from typing import Annotated

from llama_index.core.bridge.pydantic import BeforeValidator

from chunkcache.core.cache import ChunkCache, default_cache
from chunkcache.core.ledger import check_conversation_id


def optional_conversation_id(value: object) -> str | None:
    """``None``, or ``value`` checked as a conversation id."""
    return None if value is None else check_conversation_id(value)


def _cache_or_default(value: ChunkCache | None) -> ChunkCache:
    return default_cache() if value is None else value


CacheField = Annotated[ChunkCache, BeforeValidator(_cache_or_default)]
ConversationIdField = Annotated[str | None, BeforeValidator(optional_conversation_id)]
