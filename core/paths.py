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


def _make_dir(path: Path) -> Path:
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise CacheHomeError(
            f"cannot use {path} for chunkcache's files ({error.strerror or error}): set "
            "CHUNKCACHE_HOME to a writable directory"
        ) from error
    return path
