"""``chunkcache``'s command line: a user's mistake is one line and an exit code, no traceback,
and it is caught before a model loads or a benchmark starts."""

from __future__ import annotations

from pathlib import Path

import pytest

from chunkcache.core.cli import build_parser, main

# Whatever runs after validation: each is replaced by a failure in these tests.
SLOW_STEPS = (
    "chunkcache.core.models.load_model",
    "chunkcache.core.model_files.pull_default_model",
    "chunkcache.core.bench.rag_run.run_rag_bench",
    "chunkcache.core.bench.engine_bench.run_engine_bench",
    "chunkcache.core.bench.store_bench.run_store_bench",
    "chunkcache.core.bench.vllm_bench.run_vllm_bench",
    "chunkcache.core.bench.summary.write_summary",
    "chunkcache.core.serve.run_server",
    "chunkcache.core.serve.loadtest_run.run_loadtest",
)


def fail_slow_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make every slow step fail the test: a mistake must be caught before it runs."""

    def ran(*args: object, **kwargs: object) -> None:
        raise AssertionError("the mistake should have been caught before this ran")

    for target in SLOW_STEPS:
        monkeypatch.setattr(target, ran)


@pytest.fixture(autouse=True)
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CHUNKCACHE_HOME", str(tmp_path / "home"))


@pytest.fixture
def nothing_slow_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail the test if a model loads, a benchmark starts or a server starts."""
    fail_slow_steps(monkeypatch)


def run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[object, list[str]]:
    """``main(argv)``'s exit code and the lines it wrote to stderr."""
    with pytest.raises(SystemExit) as exited:
        main(argv)
    return exited.value.code, capsys.readouterr().err.splitlines()


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        ("serve --port 99999", "argument --port: must be 0 to 65535, got 99999"),
        ("bench rag --rate 0", "argument --rate: must be a positive number, got 0"),
        ("bench rag --k 0", "argument --k: must be at least 1, got 0"),
        ("bench rag --system bogus", "argument --system: unknown systems ['bogus']; known: "),
        ("bench engine --rounds 0", "argument --rounds: must be at least 1, got 0"),
        ("bench store --prompts 0", "argument --prompts: must be at least 1, got 0"),
        ("bench vllm --gold-questions -1", "argument --gold-questions: must be at least 0"),
        ("bench summary --out {tmp}/missing", "argument --out: {tmp}/missing does not exist"),
        ("warm --folder {tmp}/missing", "argument --folder: {tmp}/missing does not exist"),
        ("warm --chroma {tmp}/missing", "argument --chroma: {tmp}/missing does not exist"),
        ("warm --max-chunks -1", "argument --max-chunks: must be at least 1, got -1"),
        ("warm --chunk-chars 199", "argument --chunk-chars: must be at least 200, got 199"),
        ("bench serve --clients 0", "argument --clients: must be at least 1, got 0"),
        ("bench serve --duration 0", "argument --duration: must be a positive number, got 0"),
        ("bench serve --warmup nan", "argument --warmup: must be a positive number, got nan"),
        ("bench serve --max-tokens 0", "argument --max-tokens: must be at least 1, got 0"),
        ("warm --config {tmp}/missing.toml", "argument --config: {tmp}/missing.toml does not"),
    ],
)
@pytest.mark.usefixtures("nothing_slow_runs")
def test_a_bad_argument_is_a_usage_error(
    argv: str, message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, err = run(argv.format(tmp=tmp_path).split(), capsys)
    assert code == 2
    assert f"error: {message.format(tmp=tmp_path)}" in err[-1]
    assert not (tmp_path / "missing").exists()  # a mistyped --chroma made no database


def assert_one_line_error(
    argv: str, message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``argv`` exits with 1 and ``chunkcache: error: <message>...``, one line ({tmp}:
    ``tmp_path``, which holds an empty folder and two bad settings files)."""
    (tmp_path / "empty").mkdir()
    (tmp_path / "bad.toml").write_text("not toml [[[\n")
    (tmp_path / "bogus.toml").write_text("bogus = 1\n")
    code, err = run(argv.format(tmp=tmp_path).split(), capsys)
    assert code == 1
    assert len(err) == 1
    assert err[0].startswith(f"chunkcache: error: {message.format(tmp=tmp_path)}")


@pytest.mark.parametrize(
    "argv", ["models pull {tmp}/missing", "warm --max-chunks 1 --model {tmp}/missing"]
)
def test_a_missing_model_is_one_line(
    argv: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert_one_line_error(argv, "no model at {tmp}/missing: give a Hugging Face", tmp_path, capsys)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        ("warm --config {tmp}/bad.toml", "{tmp}/bad.toml: Expected '=' after a key"),
        ("warm --config {tmp}/bogus.toml", "invalid StoreSettings: bogus=1: Extra inputs"),
        ("warm --chroma {tmp}/empty", "Chroma directory {tmp}/empty has no database"),
        ("warm --folder {tmp}/empty", "corpus folder {tmp}/empty has no .txt or .md files"),
        ("bench rag --min-turns 3 --max-turns 2", "--min-turns 3 is more than --max-turns 2"),
    ],
)
@pytest.mark.usefixtures("nothing_slow_runs")
def test_a_user_error_is_one_line_before_anything_slow(
    argv: str, message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert_one_line_error(argv, message, tmp_path, capsys)
    assert not any((tmp_path / "empty").iterdir())  # --chroma left the folder as it was


@pytest.mark.usefixtures("nothing_slow_runs")
def test_a_bad_setting_from_the_environment_is_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("CHUNKCACHE_SERVE_PORT", "abc")
    code, err = run(["serve"], capsys)
    assert code == 1
    assert err == [
        "chunkcache: error: invalid ServeSettings: port='abc': Input should be a valid "
        "integer, unable to parse string as an integer"
    ]


@pytest.mark.usefixtures("nothing_slow_runs")
def test_bench_serve_warmup_may_be_zero_but_not_negative(
    capsys: pytest.CaptureFixture[str],
) -> None:
    args = build_parser().parse_args(["bench", "serve", "--warmup", "0"])
    assert args.warmup == 0.0
    code, err = run(["bench", "serve", "--warmup", "-1"], capsys)
    assert code == 2
    assert err[-1].endswith("argument --warmup: must be a positive number, got -1")


def test_a_bug_keeps_its_traceback(monkeypatch: pytest.MonkeyPatch) -> None:
    """A plain ValueError from inside a command is a bug, not a user's mistake."""

    def broken(*args: object, **kwargs: object) -> None:
        raise ValueError("not enough values to unpack")

    monkeypatch.setattr("chunkcache.core.bench.engine_bench.run_engine_bench", broken)
    with pytest.raises(ValueError, match="not enough values"):
        main(["bench", "engine"])
