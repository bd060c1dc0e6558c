"""Errors raised by chunkcache. Every public failure is one of these (or a TypeError)."""


class ChunkCacheError(Exception):
    """Base class for chunkcache errors."""


class InvalidChunkError(ChunkCacheError, ValueError):
    """A chunk's text or id cannot be used (empty, too large, malformed id)."""


class InvalidTextError(ChunkCacheError, ValueError):
    """Prompt text the model cannot read: not valid Unicode (a lone surrogate)."""


class EmptyPromptError(ChunkCacheError, ValueError):
    """The prompt has no tokens: there is nothing to predict the first token from."""


class PromptTooLongError(ChunkCacheError, ValueError):
    """The prompt (plus the tokens to generate) does not fit the model's context window."""


class UsageError(ChunkCacheError, ValueError):
    """A command's input cannot be used (a settings file, a combination of options)."""


class InvalidConversationIdError(ChunkCacheError, ValueError):
    """A conversation id is empty, too long or not a string."""


class QueueFullError(ChunkCacheError):
    """The request queue is full; the request was not taken. Retry after ``retry_after_s``."""

    def __init__(self, message: str, retry_after_s: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class ShuttingDownError(ChunkCacheError):
    """The backend is shutting down and takes no new requests."""


class BackendUnavailableError(ChunkCacheError):
    """A remote backend (``chunkcache serve`` or vLLM) could not be reached or failed."""
