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
    """Where :func:`chunkcache_home` is, without creating it (a ``~`` that cannot be
    expanded is left in: :func:`chunkcache_home` refuses it)."""
    override = os.environ.get("CHUNKCACHE_HOME")
    if not override:
        return Path(user_cache_dir("chunkcache"))
    return user_path(override)


def user_path(text: str | os.PathLike[str]) -> Path:
    """The path a user typed, ``~`` expanded; as written when that home does not exist (then
    it is not found, and the caller says so, rather than raising pathlib's RuntimeError)."""
    path = Path(text)
    return expand_user(path) or path


def expand_user(path: Path) -> Path | None:
    """``path`` with a leading ``~`` or ``~user`` expanded; None when there is no such home
    (no such user, or no HOME for a user the system does not list)."""
    try:
        return path.expanduser()
    except RuntimeError:  # what pathlib raises for it
        return None


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
    if path.parts and path.parts[0].startswith("~"):  # else a folder named "~user" here
        raise CacheHomeError(
            f"cannot expand {path.parts[0]} in {path} (no such home directory): set "
            "CHUNKCACHE_HOME to a writable directory"
        )
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
