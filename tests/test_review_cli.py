"""``chunkcache``'s command line under a user's mistakes: every subcommand's help states its
defaults; a seed, an ``--out`` folder, a port, a ``CHUNKCACHE_SERVE_*`` setting, an empty
model path or a ``--collection`` without ``--chroma`` that cannot be used is one line and an
exit code, found before any model loads, benchmark runs or server starts; Ctrl-C is exit 130."""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from test_cli import fail_slow_steps, run

from chunkcache.core.cli import build_parser, main
from chunkcache.core.errors import UsageError
from chunkcache.core.serve import ServeSettings


@pytest.fixture(autouse=True)
def nothing_slow_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A home of its own, and a failure if a model loads, a benchmark or a server starts."""
    monkeypatch.setenv("CHUNKCACHE_HOME", str(tmp_path / "home"))
    fail_slow_steps(monkeypatch)


def subcommands(parser: argparse.ArgumentParser) -> Iterator[argparse.ArgumentParser]:
    """``parser`` and every parser below it."""
    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in action.choices.values():
                yield from subcommands(child)


@pytest.mark.parametrize("parser", list(subcommands(build_parser())), ids=lambda p: p.prog)
def test_every_help_states_every_default(parser: argparse.ArgumentParser) -> None:
    text = " ".join(parser.format_help().split())
    for action in parser._actions:
        default = action.default
        if default is None or default is False or default in ("", argparse.SUPPRESS):
            continue
        assert f"{action.option_strings[-1]} " in text
        assert f"(default: {default})" in text, (parser.prog, action.dest)


@pytest.mark.parametrize("argv", [["--help"], ["bench", "engine", "--help"], ["serve", "-h"]])
def test_help_is_printed_with_exit_0(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 0
    assert capsys.readouterr().out.startswith("usage: chunkcache")


@pytest.mark.parametrize("bench", ["engine", "rag", "store"])
@pytest.mark.parametrize("seed", [str(2**64), "-1"])
def test_a_seed_torch_cannot_take_is_a_usage_error(
    bench: str, seed: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, err = run(["bench", bench, "--seed", seed], capsys)
    assert code == 2
    assert err[-1].endswith(f"argument --seed: must be 0 to {2**64 - 1}, got {seed}")


def test_the_largest_seed_is_taken() -> None:
    args = build_parser().parse_args(["bench", "engine", "--seed", str(2**64 - 1)])
    assert args.seed == 2**64 - 1


BENCHES_WITH_REPORTS = ["engine", "rag", "store", "vllm", "serve"]


@pytest.fixture
def a_file(tmp_path: Path) -> Path:
    path = tmp_path / "report.md"
    path.write_text("the last good report\n")
    return path


@pytest.mark.parametrize("bench", BENCHES_WITH_REPORTS)
def test_an_out_that_is_a_file_is_refused_before_the_run(
    bench: str, a_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, err = run(["bench", bench, "--out", str(a_file)], capsys)
    assert code == 2
    assert err[-1].endswith(f"argument --out: {a_file} is a file, not a folder")
    code, err = run(["bench", bench, "--out", f"{a_file}/sub"], capsys)
    assert code == 2
    assert err[-1].endswith(f"argument --out: {a_file}/sub is under a file, {a_file}")
    assert a_file.read_text() == "the last good report\n"


@pytest.mark.parametrize("bench", BENCHES_WITH_REPORTS)
def test_an_unwritable_out_is_refused_before_the_run(
    bench: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    locked = tmp_path / "locked"
    locked.mkdir()
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda p, mode: Path(p) != locked and real_access(p, mode))
    code, err = run(["bench", bench, "--out", f"{locked}/new"], capsys)
    assert code == 2
    assert err[-1].endswith(f"argument --out: {locked}/new: {locked} is not writable")
    assert not (locked / "new").exists()


@pytest.mark.parametrize("bench", ["engine", "summary"])
def test_the_default_out_is_checked_too(
    bench: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    Path("docs").write_text("a file where the report folder would go\n")
    code, err = run(["bench", bench], capsys)
    assert code == 2
    assert "argument --out: docs/benchmarks " in err[-1]


@pytest.fixture
def busy_port() -> Iterator[int]:
    """A loopback port some other socket listens on."""
    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen()
        yield other.getsockname()[1]


def test_a_port_in_use_is_one_line_before_the_model_loads(
    busy_port: int, capsys: pytest.CaptureFixture[str]
) -> None:
    code, err = run(["serve", "--port", str(busy_port)], capsys)
    assert code == 1
    assert err == [
        f"chunkcache: error: cannot listen on 127.0.0.1:{busy_port}: Address already in use"
    ]


def test_a_port_in_use_from_the_environment_is_one_line(
    busy_port: int, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("CHUNKCACHE_SERVE_PORT", str(busy_port))
    code, err = run(["serve"], capsys)
    assert code == 1
    assert err[0].endswith(f"127.0.0.1:{busy_port}: Address already in use")


def test_a_host_that_is_not_this_machine_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    code, err = run(["serve", "--host", "192.0.2.1", "--port", "0"], capsys)  # TEST-NET-1
    assert code == 1
    assert err == [
        "chunkcache: error: cannot listen on 192.0.2.1:0: Cannot assign requested address"
    ]


def test_a_free_port_gets_as_far_as_the_server() -> None:
    with pytest.raises(AssertionError, match="caught before this ran"):
        main(["serve", "--port", "0"])


def test_serve_on_a_port_in_use_exits_1_without_a_traceback(busy_port: int, tmp_path: Path) -> None:
    """The real command: one line, exit 1, and no model loaded first (no uvicorn output)."""
    result = subprocess.run(
        [sys.executable, "-m", "chunkcache.core.cli", "serve", "--port", str(busy_port)],
        env={**os.environ, "CHUNKCACHE_HOME": str(tmp_path / "home")},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 1
    assert result.stderr.splitlines() == [
        f"chunkcache: error: cannot listen on 127.0.0.1:{busy_port}: Address already in use"
    ]
    assert not (tmp_path / "home").exists()  # no model pulled, no store made


@pytest.mark.parametrize(
    ("name", "value", "message"),
    [
        ("SHUTDOWN_TIMEOUT_S", "inf", "shutdown_timeout_s='inf': Input should be a finite number"),
        ("TRIM_HEAP_S", "inf", "trim_heap_s='inf': Input should be a finite number"),
        ("RETRY_AFTER_S", "inf", "retry_after_s='inf': Input should be a finite number"),
        ("RETRY_AFTER_S", "nan", "retry_after_s='nan': Input should be a finite number"),
        ("HOST", "", "host='': String should have at least 1 character"),
        (
            "API_KEY",
            "",
            "api_key='': Value error, empty: unset CHUNKCACHE_SERVE_API_KEY to serve without a key",
        ),
    ],
)
def test_a_setting_the_server_cannot_use_is_one_line(
    name: str,
    value: str,
    message: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setenv(f"CHUNKCACHE_SERVE_{name}", value)
    code, err = run(["serve", "--port", "0"], capsys)
    assert code == 1
    assert err == [f"chunkcache: error: invalid ServeSettings: {message}"]


def test_an_empty_host_on_the_command_line_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    """An empty host would listen on every interface."""
    code, err = run(["serve", "--host", "", "--port", "0"], capsys)
    assert code == 1
    assert err == [
        "chunkcache: error: invalid ServeSettings: host='': String should have at least 1 character"
    ]


@pytest.mark.parametrize("name", ["CHUNKCACHE_SERVE_APIKEY", "chunkcache_serve_max_batchs"])
def test_a_misspelt_setting_is_refused(
    name: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A misspelt API_KEY would otherwise serve with no key at all."""
    monkeypatch.setenv(name, "s3cret")
    with pytest.raises(UsageError, match=f"unknown setting {name}; known: CHUNKCACHE_SERVE_HOST"):
        ServeSettings()
    code, err = run(["serve", "--port", "0"], capsys)
    assert code == 1
    assert len(err) == 1
    assert err[0].startswith(f"chunkcache: error: unknown setting {name}; known: ")
    assert "CHUNKCACHE_SERVE_API_KEY" in err[0]
    assert "s3cret" not in err[0]


def test_known_settings_in_any_case_are_taken(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("chunkcache_serve_max_batch", "3")
    monkeypatch.setenv("CHUNKCACHE_SERVE_API_KEY", "s3cret")
    settings = ServeSettings()
    assert settings.max_batch == 3
    assert settings.api_key is not None and settings.api_key.get_secret_value() == "s3cret"


@pytest.mark.parametrize(
    "argv", [["models", "pull", ""], ["warm", "--model", ""], ["serve", "--model", ""]]
)
def test_an_empty_model_path_is_a_usage_error(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    """``models pull ''`` used to install the default model."""
    code, err = run(argv, capsys)
    assert code == 2
    assert "must not be empty (leave it out for the default model)" in err[-1]


def test_a_collection_without_chroma_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    code, err = run(["warm", "--collection", "docs"], capsys)
    assert code == 1
    assert err == [
        "chunkcache: error: --collection names a collection of --chroma DIR: add --chroma"
    ]


@pytest.mark.parametrize(("given", "read"), [([], "langchain"), (["--collection", "x"], "x")])
def test_chroma_reads_the_collection_given(
    given: list[str],
    read: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def load_chroma_corpus(folder: Path, collection: str) -> None:
        raise SystemExit(f"read {collection}")

    monkeypatch.setattr("chunkcache.core.user_corpus.load_chroma_corpus", load_chroma_corpus)
    with pytest.raises(SystemExit, match=f"^read {read}$"):
        main(["warm", "--chroma", str(tmp_path), *given])


def test_ctrl_c_exits_130_without_a_traceback(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def interrupted(args: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr("chunkcache.core.cli._models_pull", interrupted)
    try:
        assert run(["models", "pull"], capsys) == (130, [])
    except KeyboardInterrupt:  # would stop pytest itself
        pytest.fail("Ctrl-C went through main()")
