"""A ``~user`` with no such home, typed where a path goes, is a path that is not found (with
the caller's own message), not pathlib's RuntimeError as a traceback."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from chunkcache.core.bench.cli import existing_file, report_dir
from chunkcache.core.paths import user_path
from chunkcache.core.user_corpus import UserCorpusError, load_questions
from chunkcache.core.vllm_server import VllmNotInstalledError, vllm_python

NO_HOME = "~no_such_user_chunkcache_s27/folder"


def test_user_path_expands_a_known_home_and_keeps_an_unknown_one_as_written() -> None:
    assert user_path("~/x") == Path.home() / "x"
    assert user_path(NO_HOME) == Path(NO_HOME)


def test_bench_arguments_say_the_path_does_not_exist() -> None:
    with pytest.raises(argparse.ArgumentTypeError, match="does not exist"):
        existing_file(NO_HOME)
    assert report_dir(NO_HOME) == Path(NO_HOME)  # made under the current folder, as typed


def test_a_user_corpus_path_says_it_does_not_exist() -> None:
    with pytest.raises(UserCorpusError, match="does not exist"):
        load_questions(NO_HOME)


def test_a_vllm_venv_override_says_vllm_is_not_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CHUNKCACHE_VLLM_VENV", NO_HOME)
    with pytest.raises(VllmNotInstalledError):
        vllm_python()


def test_a_store_disk_dir_under_an_unknown_home_is_kept_as_written() -> None:
    from chunkcache.core.store.settings import StoreSettings

    assert StoreSettings(disk_dir=Path(NO_HOME)).resolved_disk_dir() == Path(NO_HOME)
