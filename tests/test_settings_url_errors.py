"""A malformed store setting or ``bench serve --url`` is one line naming it, found when the
settings are read or the command line parsed, never a traceback from redis-py, pydantic's
file reader or httpx mid-run."""

from __future__ import annotations

import sys
from pathlib import Path

import httpx
import pytest
from test_cli import run

from chunkcache.core.errors import UsageError
from chunkcache.core.store import TieredKVStore
from chunkcache.core.store.settings import StoreSettings

SCHEMES = "redis://, rediss:// or unix://"


@pytest.fixture(autouse=True)
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("CHUNKCACHE_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


@pytest.fixture
def no_model(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fails the test if a command gets as far as loading a model."""

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("the bad setting should have stopped the command before this")

    monkeypatch.setattr("chunkcache.core.models.load_model", refuse)
    monkeypatch.setattr("chunkcache.core.serve.server.build_backend", refuse)


# CHUNKCACHE_STORE_REDIS_URL ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("url", "problem"),
    [
        ("notaurl", f"must start with {SCHEMES}"),
        ("http://cache:6379", f"must start with {SCHEMES}"),
        ("localhost:6379", f"must start with {SCHEMES}"),
        ("redis://cache:port", "port"),
        ("redis://cache:70000", "port"),
        ("redis://cache:0", "port"),
        ("redis://cache:6379/0?db=zero", "db"),
    ],
)
def test_a_malformed_redis_url_is_refused_when_read(
    url: str, problem: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CHUNKCACHE_STORE_REDIS_URL", url)
    with pytest.raises(UsageError, match="CHUNKCACHE_STORE_REDIS_URL") as refused:
        StoreSettings()
    assert problem in str(refused.value)
    with pytest.raises(UsageError, match="CHUNKCACHE_STORE_REDIS_URL"):
        TieredKVStore.from_settings(host_bytes=1000)  # what chunkcache serve builds


def test_a_redis_url_from_a_file_or_argument_is_checked_too(tmp_path: Path) -> None:
    config = tmp_path / "store.toml"
    config.write_text('redis_url = "notaurl"\n')
    with pytest.raises(UsageError, match=f"redis_url .*must start with {SCHEMES}"):
        StoreSettings.from_file(config)
    with pytest.raises(UsageError, match=f"redis_url .*must start with {SCHEMES}"):
        StoreSettings(redis_url="notaurl")


def test_the_refusal_never_shows_the_url(monkeypatch: pytest.MonkeyPatch) -> None:
    """A Redis URL may carry a password."""
    for url in ("http://:hunter2@cache:6379", "redis://:hunter2@cache:99999"):
        monkeypatch.setenv("CHUNKCACHE_STORE_REDIS_URL", url)
        with pytest.raises(UsageError) as refused:
            StoreSettings()
        assert "hunter2" not in str(refused.value)


@pytest.mark.parametrize(
    "url",
    [
        "redis://cache.internal:6379/0",
        "rediss://:secret@cache:6380",
        "redis://localhost",
        "unix:///run/redis.sock?db=1",
        "",  # no Redis tier, as when unset
    ],
)
def test_redis_urls_redis_py_takes_are_taken(url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CHUNKCACHE_STORE_REDIS_URL", url)
    assert StoreSettings().redis_url == url


def test_a_redis_url_without_redis_py_says_how_to_install_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "redis", None)  # import redis: ModuleNotFoundError
    monkeypatch.delitem(sys.modules, "redis.connection", raising=False)
    monkeypatch.delitem(sys.modules, "chunkcache.core.store.redis_tier", raising=False)
    with pytest.raises(UsageError, match=r"needs redis-py: pip install 'chunkcache\[redis\]'"):
        TieredKVStore.from_settings(redis_url="redis://cache:6379/0", disk_bytes=0)


@pytest.mark.parametrize("command", [["warm"], ["serve", "--port", "0"]])
def test_commands_with_a_malformed_redis_url_are_one_line(
    command: list[str],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    no_model: None,
) -> None:
    monkeypatch.setenv("CHUNKCACHE_STORE_REDIS_URL", "notaurl")
    code, err = run(command, capsys)
    assert code == 1 and len(err) == 1, err
    assert err[0].startswith("chunkcache: error: redis_url (CHUNKCACHE_STORE_REDIS_URL) ")


# Store config files that do not parse or are no mapping -------------------------------------

BAD_FILES = [
    ("list.json", "[1, 2]", "expected an object of settings"),
    ("string.json", '"host_bytes"', "expected an object of settings"),
    ("broken.json", "{", "Expecting property name"),
    ("broken.toml", "x: 1\n", "Expected '=' after a key"),
    ("latin1.toml", "disk_dir = '/caf\xe9'\n", "not UTF-8"),
    ("latin1.json", '{"disk_dir": "/caf\xe9"}', "not UTF-8"),
]


def write(path: Path, text: str) -> Path:
    path.write_bytes(text.encode("latin-1"))
    return path


@pytest.mark.parametrize(("name", "content", "problem"), BAD_FILES)
def test_a_config_file_that_is_no_settings_table_is_refused(
    name: str, content: str, problem: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = write(tmp_path / name, content)
    with pytest.raises(UsageError, match=f"^{config}: .*{problem}"):
        StoreSettings.from_file(config)
    monkeypatch.setenv("CHUNKCACHE_STORE_CONFIG", str(config))
    named = f"^CHUNKCACHE_STORE_CONFIG={config}: .*{problem}"
    with pytest.raises(UsageError, match=named):
        StoreSettings()
    with pytest.raises(UsageError, match=named):
        TieredKVStore.from_settings()  # what chunkcache serve builds


def test_an_empty_json_file_is_no_settings(tmp_path: Path) -> None:
    """As an empty TOML file is."""
    empty = StoreSettings.from_file(write(tmp_path / "empty.json", " \n"))
    assert empty == StoreSettings.from_file(write(tmp_path / "empty.toml", ""))


@pytest.mark.parametrize(("name", "content", "problem"), BAD_FILES)
@pytest.mark.parametrize("command", ["warm", "serve"])
def test_commands_with_a_bad_config_file_are_one_line(
    name: str,
    content: str,
    problem: str,
    command: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    no_model: None,
) -> None:
    config = write(tmp_path / name, content)
    monkeypatch.setenv("CHUNKCACHE_STORE_CONFIG", str(config))
    code, err = run([command, *(["--port", "0"] if command == "serve" else [])], capsys)
    assert code == 1 and len(err) == 1, err
    assert err[0].startswith(f"chunkcache: error: CHUNKCACHE_STORE_CONFIG={config}: "), err
    assert problem in err[0]
    if command == "warm":
        code, err = run(["warm", "--config", str(config)], capsys)
        assert code == 1 and len(err) == 1, err
        assert err[0].startswith(f"chunkcache: error: {config}: "), err


# chunkcache bench serve --url ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("url", "problem"),
    [
        ("notaurl", "must be an http(s) URL with a host"),
        ("http://127.0.0.1:0", "port outside 1-65535"),
        ("ftp://127.0.0.1:8000", "must be an http(s) URL with a host"),
        ("http://127.0.0.1:8000/v1?x=1", "query"),
    ],
)
def test_bench_serve_refuses_a_malformed_url_up_front(
    url: str, problem: str, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    code, err = run(["bench", "serve", "--url", url, "--out", str(tmp_path)], capsys)
    assert code == 2, err
    assert err[-1].startswith("chunkcache bench serve: error: argument --url: "), err
    assert problem in err[-1]


def test_bench_serve_against_no_server_is_one_line(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """Port 9 (discard) on loopback: nothing listens there."""
    url, out = "http://127.0.0.1:9/v1", tmp_path / "reports"
    argv = ["bench", "serve", "--url", url, "--duration", "1", "--out", str(out)]
    code, err = run(argv, capsys)
    assert code == 1 and len(err) == 1, err
    assert err[0].startswith("chunkcache: error: the server at http://127.0.0.1:9 is "), err
    assert not out.exists()  # no report


@pytest.mark.parametrize(
    ("response", "problem"),
    [
        (httpx.Response(404, text="Not Found"), "answered GET /v1/models with 404: 'Not Found'"),
        (httpx.Response(200, text="<html>"), "answered GET /v1/models with non-JSON"),
        (httpx.Response(200, json={"data": []}), "answered GET /v1/models with no model"),
    ],
)
def test_bench_serve_against_a_server_that_is_not_chunkcache_is_one_line(
    response: httpx.Response,
    problem: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
) -> None:
    monkeypatch.setattr("chunkcache.core.serve.loadtest_run.httpx.get", lambda *a, **k: response)
    argv = ["bench", "serve", "--url", "http://127.0.0.1:8000", "--out", str(tmp_path / "out")]
    code, err = run(argv, capsys)
    assert code == 1 and len(err) == 1, err
    assert err[0].startswith(f"chunkcache: error: the server at http://127.0.0.1:8000 {problem}")
