"""The package as a plain ``pip install chunkcache`` leaves it: only the standard library and
``platformdirs`` (pyproject's one base dependency) are importable, every extra is missing."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

# A meta path finder that refuses every top-level module a bare install would not have.
_BARE = textwrap.dedent(
    """
    import importlib.abc, json, sys

    ALLOWED = set(sys.stdlib_module_names) | {"platformdirs", "chunkcache", "_distutils_hack"}

    class Bare(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] not in ALLOWED:
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)
            return None

    sys.meta_path.insert(0, Bare())
    """
)


def run_bare(code: str) -> subprocess.CompletedProcess[str]:
    """``code`` run in a fresh interpreter that can import only what a bare install has."""
    return subprocess.run(
        [sys.executable, "-c", _BARE + textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_core_imports_and_works_without_any_extra() -> None:
    """``chunkcache.core`` imported httpx (the ``server`` extra's) through its backend
    names, so ``import chunkcache.core`` failed on a plain install."""
    done = run_bare(
        """
        import chunkcache, chunkcache.core
        from chunkcache.core import *
        cache = ChunkCache()
        ids = [chunk_id("alpha"), chunk_id("beta")]
        print(json.dumps(sorted(cache.arrange(ids, conversation_id="c").order) == sorted(ids)))
        """
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) is True


def test_the_cli_without_the_server_extra_says_what_to_install() -> None:
    """``chunkcache --help`` must not need fastapi or httpx (the server extra); ``bench
    serve`` and ``serve`` name the extra they need, in one line."""
    done = run_bare(
        """
        from chunkcache.core.cli import main
        try:
            main(["--help"])
        except SystemExit as end:
            print("help", end.code)
        for command in (["bench", "serve", "--duration", "1"], ["serve", "--port", "0"]):
            try:
                main(command)
            except SystemExit as end:
                print(command[0], end.code)
        """
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-3:] == ["help 0", "bench 1", "serve 1"]
    assert "Traceback" not in done.stderr
    assert done.stderr.count("not installed: pip install 'chunkcache[") == 2, done.stderr
