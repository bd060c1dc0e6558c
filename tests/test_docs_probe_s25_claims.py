"""The user docs' concrete claims that the code decides: the settings tables' defaults, the
engine's conversation limits, and every module path and repository file the docs name.

A default changed in the code (or a name moved) without the docs following fails here,
naming the claim.
"""

from __future__ import annotations

import importlib
import inspect
import re
from pathlib import Path
from typing import Any

import pytest

from chunkcache.core.engine import ChunkEngine
from chunkcache.core.serve.settings import ServeSettings
from chunkcache.core.store.settings import StoreSettings

ROOT = Path(__file__).resolve().parent.parent
DOCS = ("README.md", "docs/engine.md", "docs/serve.md", "docs/store.md")
UNITS = {"GiB": 2**30, "MiB": 2**20}
NONE = ("none", "none (off)", "default model", "$chunkcache_home/kv")  # a None default


def table_after(doc: str, header: str) -> list[list[str]]:
    """The cells of each row of the markdown table whose header line is ``header``."""
    lines = (ROOT / doc).read_text().splitlines()
    start = lines.index(header) + 2  # past the header and its --- row
    rows = []
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip("|").split("|")])
    return rows


def documented_value(text: str) -> Any:
    """A table's default as Python: ``4 MiB``, ``0 (off)``, ``none``, ``true``, ``30``..."""
    text = text.strip().replace("`", "")
    if text.lower() in NONE:
        return None
    text = re.sub(r" \(off\)$", "", text)
    if match := re.fullmatch(r"(\d+) (GiB|MiB)", text):
        return int(match.group(1)) * UNITS[match.group(2)]
    if text in ("true", "false"):
        return text == "true"
    if re.fullmatch(r"\d+", text):
        return int(text)
    if re.fullmatch(r"\d+\.\d+", text):
        return float(text)
    return text


def engine_default(name: str) -> Any:
    return inspect.signature(ChunkEngine.__init__).parameters[name].default


def test_store_settings_table_gives_the_code_defaults() -> None:
    rows = table_after("docs/store.md", "| field | default | meaning |")
    documented = {row[0].strip("`"): documented_value(row[1]) for row in rows}
    assert set(documented) == set(StoreSettings.model_fields)
    for name, field in StoreSettings.model_fields.items():
        assert documented[name] == field.default, f"docs/store.md: {name}"


def test_serve_settings_table_gives_the_code_defaults() -> None:
    documented: dict[str, Any] = {}
    for row in table_after("docs/serve.md", "| setting | default | |"):
        names = [name.strip(" `").lower() for name in row[0].split(",")]
        values = [documented_value(value) for value in row[1].split(",")]
        assert len(names) == len(values), row
        documented.update(zip(names, values, strict=True))
    assert set(documented) == set(ServeSettings.model_fields)
    for name, field in ServeSettings.model_fields.items():
        default = field.default
        if name in ("max_conversations", "max_conversation_tokens") and default is None:
            default = engine_default(name)  # None: the engine's own default
        assert documented[name] == default, f"docs/serve.md: {name.upper()}"


def test_conversation_limits_are_the_engines() -> None:
    readme = (ROOT / "README.md").read_text()
    match = re.search(r"at most (\d+) conversations and ([\d,]+) tokens", readme)
    assert match is not None
    assert int(match.group(1)) == engine_default("max_conversations")
    assert int(match.group(2).replace(",", "")) == engine_default("max_conversation_tokens")
    engine_doc = (ROOT / "docs/engine.md").read_text()
    match = re.search(r"`max_conversation_tokens` \(default ([\d,]+)", engine_doc)
    assert match is not None
    assert int(match.group(1).replace(",", "")) == engine_default("max_conversation_tokens")


def code_spans(doc: str) -> list[str]:
    return re.findall(r"`([^`\n]+)`", (ROOT / doc).read_text())


MODULE_PATHS = sorted(
    {
        (doc, match.group(0).rstrip("."))
        for doc in DOCS
        for span in code_spans(doc)
        if (match := re.match(r"(chunkcache\.)?(core|kernels|integrations)\.[\w.]+", span))
    }
)
FILES = sorted(
    {
        (doc, span)
        for doc in DOCS
        for span in code_spans(doc)
        if re.fullmatch(r"(core|kernels|integrations|tests|cookbook|scripts)/[\w/.]+", span)
    }
)


def resolves(path: str) -> bool:
    """Whether ``path`` (``chunkcache.`` optional) names a module or an attribute of one."""
    parts = path.removeprefix("chunkcache.").split(".")
    for split in range(len(parts), 0, -1):
        try:
            found: Any = importlib.import_module(".".join(["chunkcache", *parts[:split]]))
        except ModuleNotFoundError:
            continue
        try:
            for name in parts[split:]:
                found = getattr(found, name)
        except AttributeError:
            return False
        return True
    return False


def test_the_docs_name_paths_at_all() -> None:
    assert len(MODULE_PATHS) >= 15 and len(FILES) >= 5  # the extraction found them


@pytest.mark.parametrize(("doc", "path"), MODULE_PATHS, ids=[f"{d}: {p}" for d, p in MODULE_PATHS])
def test_named_module_path_exists(doc: str, path: str) -> None:
    assert resolves(path), f"{doc} names {path}, which does not import"


@pytest.mark.parametrize(("doc", "path"), FILES, ids=[f"{d}: {p}" for d, p in FILES])
def test_named_file_exists(doc: str, path: str) -> None:
    assert (ROOT / path).exists(), f"{doc} names {path}, which is not in the repository"
