"""Errors raised by chunkcache. Every public failure is one of these (or a TypeError)."""


class ChunkCacheError(Exception):
    """Base class for chunkcache errors."""


class InvalidChunkError(ChunkCacheError, ValueError):
    """A chunk's text or id cannot be used (empty, too large, malformed id)."""


class InvalidConversationIdError(ChunkCacheError, ValueError):
    """A conversation id is empty, too long or not a string."""
