"""The check of the default model's converted copy: tokenizer.json (several MB) is parsed only
when it changed since it last parsed, and damage is still caught."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from tiny_models import save_tiny_checkpoint

from chunkcache.core import model_files
from chunkcache.core.model_files import _copy_damage


@pytest.fixture
def copy(tmp_path: Path) -> Path:
    """A checkpoint laid out like a converted default model (chat template included)."""
    target = save_tiny_checkpoint(tmp_path / "copy")
    (target / "chat_template.jinja").write_text("{{ messages[0]['content'] }}")
    return target


@pytest.fixture
def tokenizer_parses(copy: Path, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Records one entry per ``json.loads`` of the copy's tokenizer.json."""
    tokenizer = (copy / "tokenizer.json").read_bytes()
    parses: list[int] = []
    loads = json.loads

    def counting_loads(document: str | bytes, **kwargs: Any) -> Any:
        if document == tokenizer:
            parses.append(1)
        return loads(document, **kwargs)

    monkeypatch.setattr(model_files.json, "loads", counting_loads)
    return parses


def test_an_unchanged_tokenizer_is_parsed_once(copy: Path, tokenizer_parses: list[int]) -> None:
    assert _copy_damage(copy) is None
    assert _copy_damage(copy) is None
    assert _copy_damage(copy) is None
    assert tokenizer_parses == [1]


def test_a_copy_of_the_copy_parses_its_tokenizer_again(
    copy: Path, tmp_path: Path, tokenizer_parses: list[int]
) -> None:
    """The record travels with ``cp -a`` but vouches only for the file it was made for."""
    assert _copy_damage(copy) is None
    again = shutil.copytree(copy, tmp_path / "again", copy_function=shutil.copy2)
    assert _copy_damage(again) is None
    assert tokenizer_parses == [1, 1]


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:-100])


def _empty(path: Path) -> None:
    path.write_bytes(b"")


def _same_size_same_mtime(path: Path) -> None:
    """Garbage of the same length, the mtime set back: only the ctime tells."""
    stat = path.stat()
    path.write_bytes(b"#" * stat.st_size)
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))


def _replaced(path: Path) -> None:
    broken = path.with_name("broken.json")
    broken.write_bytes(path.read_bytes()[:-1])
    broken.replace(path)


@pytest.mark.parametrize(
    "damage",
    [
        pytest.param(_truncate, id="truncated"),
        pytest.param(_empty, id="empty"),
        pytest.param(_same_size_same_mtime, id="same-size-and-mtime"),
        pytest.param(_replaced, id="replaced"),
    ],
)
def test_a_tokenizer_damaged_after_a_check_is_caught(
    copy: Path, damage: Callable[[Path], None]
) -> None:
    assert _copy_damage(copy) is None  # records the intact file
    damage(copy / "tokenizer.json")
    assert str(_copy_damage(copy)).startswith("tokenizer.json: ")
    assert str(_copy_damage(copy)).startswith("tokenizer.json: ")  # never recorded as whole


@pytest.mark.parametrize("record", ["", "[]", "{", '{"tokenizer.json": {"size": 1}}'])
def test_a_damaged_record_means_parsing_again(
    copy: Path, tokenizer_parses: list[int], record: str
) -> None:
    (copy / model_files.CHECKED_CACHE).write_text(record)
    assert _copy_damage(copy) is None
    assert _copy_damage(copy) is None
    assert tokenizer_parses == [1]


def test_a_read_only_copy_is_checked_in_full(
    copy: Path, tokenizer_parses: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    def refuse(contents: object) -> None:
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(model_files, "write_files", refuse)
    assert _copy_damage(copy) is None
    assert _copy_damage(copy) is None
    assert tokenizer_parses == [1, 1]
