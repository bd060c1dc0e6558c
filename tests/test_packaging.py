"""The wheel carries chunkcache.core, .kernels and .integrations under the right names."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "build",
            "--wheel",
            "--no-isolation",
            "--outdir",
            str(out),
            str(ROOT),
        ],
        check=True,
        capture_output=True,
    )
    (built,) = out.glob("chunkcache-*.whl")
    return built


def test_wheel_holds_the_design_card_packages(wheel: Path) -> None:
    names = set(zipfile.ZipFile(wheel).namelist())
    for module in (
        "__init__.py",
        "core/__init__.py",
        "kernels/__init__.py",
        "integrations/__init__.py",
        "integrations/langchain.py",
        "py.typed",
    ):
        assert f"chunkcache/{module}" in names
    assert not any(name.startswith(("chunkcache/tests/", "chunkcache/cookbook/")) for name in names)


def test_modules_import_from_the_unpacked_wheel(wheel: Path, tmp_path: Path) -> None:
    zipfile.ZipFile(wheel).extractall(tmp_path)
    code = (
        "import chunkcache, chunkcache.core, chunkcache.kernels, chunkcache.integrations;"
        "import chunkcache.integrations.langchain, chunkcache.integrations.llama_index;"
        "print(chunkcache.core.__file__)"
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        env={"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"},
        check=True,
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert result.stdout.strip() == str(tmp_path / "chunkcache" / "core" / "__init__.py")
