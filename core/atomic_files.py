"""Write files so that a reader sees each one whole, old or new, never a part of it.

Every file chunkcache writes for later reading (benchmark reports, the corpus cache, the
weights digest cache) goes through :func:`write_files`.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Mapping
from pathlib import Path


def write_files(contents: Mapping[Path, str | bytes]) -> None:
    """Write each content (a str as UTF-8) to its path atomically: every one goes in full to
    a temporary file beside its path first, and only then do they replace their paths.  A
    failed or interrupted write leaves every previous file whole and no temporary file."""
    temporary: dict[Path, Path] = {}
    try:
        for path, content in contents.items():
            temporary[path] = path.with_name(f".{path.name}.{secrets.token_hex(6)}.tmp")
            data = content.encode("utf-8") if isinstance(content, str) else content
            with temporary[path].open("xb") as file:  # "x": the umask sets its mode
                file.write(data)
                file.flush()
                os.fsync(file.fileno())
        for path, temp in temporary.items():
            os.replace(temp, path)
    finally:
        for temp in temporary.values():
            temp.unlink(missing_ok=True)


def new_file_mode(directory: Path) -> int:
    """The permission bits a file newly created in ``directory`` gets: 0666 less the umask
    (read by creating one, since reading the umask means setting it, which races threads).
    Files made with :mod:`tempfile` (0600) take these before they replace shared ones."""
    probe = directory / f".mode-probe-{secrets.token_hex(6)}"
    probe.touch()
    try:
        return probe.stat().st_mode & 0o777
    finally:
        probe.unlink()
