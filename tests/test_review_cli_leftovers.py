"""Leftovers of the command-line review: reports written atomically through one helper,
and Ctrl-C or a closed pipe ending the ``chunkcache`` process without a traceback (the
other leftovers are tested in test_review_cli.py and test_store_settings.py)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from chunkcache.core.atomic_files import write_files
from chunkcache.core.bench.report import write_report
from chunkcache.core.bench.summary import write_summary

REPO = Path(__file__).resolve().parent.parent
UNWRITABLE = "\ud800"  # a lone surrogate: UTF-8 cannot encode it, so its write fails midway
# Every module that writes a benchmark report, and the one way it may write it.
REPORT_WRITERS = (
    "core/bench/engine_bench.py",
    "core/bench/rag_run.py",
    "core/bench/store_bench.py",
    "core/bench/vllm_bench.py",
    "core/bench/summary.py",
    "core/serve/loadtest_run.py",
    "cookbook/retriever_benchmark.py",
)


def old_pair(folder: Path) -> dict[str, str]:
    """An earlier run's ``engine.json`` and ``engine.md`` in ``folder``."""
    files = {"engine.json": '{"old": true}\n', "engine.md": "# old\n"}
    for name, text in files.items():
        (folder / name).write_text(text)
    return files


def test_a_report_replaces_the_previous_pair(tmp_path: Path) -> None:
    old_pair(tmp_path)
    write_report(tmp_path, "engine", {"new": "é"}, "# new é\n")
    assert json.loads((tmp_path / "engine.json").read_text("utf-8")) == {"new": "é"}
    assert (tmp_path / "engine.md").read_text("utf-8") == "# new é\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["engine.json", "engine.md"]


def test_a_report_makes_its_folder(tmp_path: Path) -> None:
    write_report(tmp_path / "a" / "b", "serve", {}, "# serve\n")
    assert (tmp_path / "a" / "b" / "serve.json").read_text() == "{}\n"


def test_a_failed_write_leaves_the_previous_pair_whole(tmp_path: Path) -> None:
    files = old_pair(tmp_path)
    with pytest.raises(UnicodeEncodeError):
        write_report(tmp_path, "engine", {"new": True}, f"# new {UNWRITABLE}\n")
    assert {p.name: p.read_text() for p in tmp_path.iterdir()} == files  # no temporary left


def test_an_interrupted_write_leaves_no_temporary_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    files = old_pair(tmp_path)

    def interrupted(fd: int) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(os, "fsync", interrupted)
    with pytest.raises(KeyboardInterrupt):
        write_files({tmp_path / "engine.md": "# new\n"})
    assert {p.name: p.read_text() for p in tmp_path.iterdir()} == files


def test_a_failed_summary_leaves_the_previous_readme(tmp_path: Path) -> None:
    (tmp_path / "README.md").write_text("# old summary\n")
    report = {"command": f"chunkcache bench store {UNWRITABLE}", "environment": {}}
    (tmp_path / "store.json").write_text(json.dumps(report))
    with pytest.raises(UnicodeEncodeError):
        write_summary(tmp_path)
    assert (tmp_path / "README.md").read_text() == "# old summary\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["README.md", "store.json"]


@pytest.mark.parametrize("module", REPORT_WRITERS)
def test_every_report_is_written_through_the_shared_helper(module: str) -> None:
    source = (REPO / module).read_text()
    assert "write_report(" in source or "write_files(" in source
    assert ".write_text(" not in source and "open(" not in source


# A ``chunkcache`` process whose ``models pull`` says "ready", then blocks or prints forever.
CHILD = textwrap.dedent(
    """
    import sys, time
    import chunkcache.core.cli as cli

    def pull(args):
        print("ready", flush=True)
        if sys.argv[1] == "block":
            time.sleep(60)
        while True:
            print("line " * 20)

    cli._models_pull = pull
    cli.main(["models", "pull"])
    """
)


def child(mode: str, tmp_path: Path) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", CHILD, mode],
        env={**os.environ, "CHUNKCACHE_HOME": str(tmp_path / "home")},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_sigint_exits_130_without_a_traceback(tmp_path: Path) -> None:
    proc = child("block", tmp_path)
    assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert (proc.returncode, err) == (130, "")


def test_a_closed_pipe_ends_quietly(tmp_path: Path) -> None:
    """As ``chunkcache ... | head -1``: the reader goes away, the writer stops."""
    proc = child("print", tmp_path)
    assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
    proc.stdout.close()
    assert proc.stderr is not None
    err = proc.stderr.read()
    assert (proc.wait(timeout=60), err) == (1, "")
