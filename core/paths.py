"""Where chunkcache keeps files: ``$CHUNKCACHE_HOME`` or the user cache directory."""

from __future__ import annotations

import os
from pathlib import Path

from platformdirs import user_cache_dir

from chunkcache.core.errors import ChunkCacheError


class CacheHomeError(ChunkCacheError, OSError):
    """The chunkcache home (``$CHUNKCACHE_HOME`` or the user cache directory) or a folder in
    it cannot be made: the path is a file, or not writable."""


def home_path() -> Path:
    """Where :func:`chunkcache_home` is, without creating it."""
    override = os.environ.get("CHUNKCACHE_HOME")
    return Path(override).expanduser() if override else Path(user_cache_dir("chunkcache"))


def chunkcache_home() -> Path:
    """The root of everything chunkcache writes (models, corpus, indexes, KV files)."""
    return _make_dir(home_path())


def home_subdir(name: str) -> Path:
    """A named sub-directory of :func:`chunkcache_home`, created on demand."""
    return _make_dir(chunkcache_home() / name)


def is_utf8(path: Path) -> bool:
    """Whether ``path`` is valid UTF-8, as safetensors and tokenizers need: bytes that are
    not reach Python as surrogates, and those libraries refuse the path."""
    try:
        str(path).encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _make_dir(path: Path) -> Path:
    if not is_utf8(path):  # the model files there could be neither read nor written
        raise CacheHomeError(
            f"cannot use {str(path)!a} for chunkcache's files (not valid UTF-8): set "
            "CHUNKCACHE_HOME to a writable directory whose path is UTF-8"
        )
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise CacheHomeError(
            f"cannot use {path} for chunkcache's files ({error.strerror or error}): set "
            "CHUNKCACHE_HOME to a writable directory"
        ) from error
    return path
