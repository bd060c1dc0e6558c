"""`import chunkcache.core` stays light: no torch, no RAG framework; its __all__ is real."""

from __future__ import annotations

import json
import subprocess
import sys

import chunkcache.core

# None of these is a base dependency (pyproject: only platformdirs), so a plain
# `pip install chunkcache` must be able to import chunkcache.core without them.
HEAVY = ("torch", "transformers", "langchain_core", "llama_index", "numpy")


def test_import_core_loads_no_heavy_dependency() -> None:
    script = (
        "import json, sys\n"
        "import chunkcache.core\n"
        "from chunkcache.core import *\n"
        f"heavy = {HEAVY!r}\n"
        "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in heavy)))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True, timeout=60
    )
    assert json.loads(out.stdout) == []


def test_all_names_exist() -> None:
    names = chunkcache.core.__all__
    assert len(names) == len(set(names))
    assert names == sorted(names)
    for name in names:
        assert getattr(chunkcache.core, name) is not None, name


def test_all_covers_the_public_core_api() -> None:
    expected = {
        "AccessTable",
        "ChunkCache",
        "ChunkPrefixTree",
        "ChunkRegistry",
        "ConversationLedger",
        "InvalidChunkError",
        "InvalidConversationIdError",
        "chunk_id",
        "default_cache",
        "prefix_metric",
        "total_metric",
    }
    assert expected <= set(chunkcache.core.__all__)
