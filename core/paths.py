"""Where chunkcache keeps files: ``$CHUNKCACHE_HOME`` or the user cache directory."""

from __future__ import annotations

import os
from pathlib import Path

from platformdirs import user_cache_dir


def chunkcache_home() -> Path:
    """The root of everything chunkcache writes (models, corpus, indexes, KV files)."""
    override = os.environ.get("CHUNKCACHE_HOME")
    root = Path(override).expanduser() if override else Path(user_cache_dir("chunkcache"))
    root.mkdir(parents=True, exist_ok=True)
    return root


def home_subdir(name: str) -> Path:
    """A named sub-directory of :func:`chunkcache_home`, created on demand."""
    path = chunkcache_home() / name
    path.mkdir(parents=True, exist_ok=True)
    return path
