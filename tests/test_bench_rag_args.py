"""``chunkcache bench rag`` on a user's own data: every mistake in the options or the data
is one line, found before a model loads (``load_model`` fails these tests if it runs)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from chunkcache.core.cli import main


class ModelLoaded(Exception):
    """Raised in place of loading a model: the run got past every check."""


@pytest.fixture(autouse=True)
def no_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A home of its own, a few user files, and no model ever loaded."""
    monkeypatch.setenv("CHUNKCACHE_HOME", str(tmp_path / "home"))

    def load_model(*args: object, **kwargs: object) -> None:
        raise ModelLoaded

    monkeypatch.setattr("chunkcache.core.models.load_model", load_model)
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "notes.md").write_text("Velmora Tech was founded in 1923.\n")
    (tmp_path / "empty").mkdir()
    (tmp_path / "questions.txt").write_text("When was Velmora Tech founded?\n")
    (tmp_path / "blank.txt").write_text("\n\n")
    (tmp_path / "bad.jsonl").write_text("{not json\n")


def _chroma(folder: Path) -> Path:
    """A persistent Chroma database with one collection, ``docs``."""
    import chromadb
    from chromadb.config import Settings

    client = chromadb.PersistentClient(path=folder, settings=Settings(anonymized_telemetry=False))
    collection = client.create_collection("docs")
    collection.add(ids=["a"], documents=["text"], embeddings=np.ones((1, 2), np.float32))
    client.close()  # type: ignore[attr-defined]
    return folder


CORPUS = "--corpus-dir {tmp}/corpus"
QUESTIONS = "--questions {tmp}/questions.txt"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (CORPUS, "--corpus-dir needs your questions: add --questions FILE"),
        ("--chroma {tmp}/chroma docs", "--chroma needs your questions: add --questions FILE"),
        (QUESTIONS, "--questions needs your corpus: add --corpus-dir DIR or --chroma DIR NAME"),
        (f"{CORPUS} --chroma {{tmp}}/chroma docs {QUESTIONS}", "give one corpus of your own"),
        (f"--chroma {{tmp}}/missing docs {QUESTIONS}", "Chroma directory {tmp}/missing does not"),
        (f"--chroma {{tmp}}/empty docs {QUESTIONS}", "Chroma directory {tmp}/empty has no data"),
        ("--k 1", "--k 1 is fewer than the 2 chunks some gold questions need: use --k 2 or more"),
        (f"{CORPUS} {QUESTIONS} --k 1", "--k 1 is fewer than the 2 chunks some gold questions"),
        ("--min-turns 3 --max-turns 2", "--min-turns 3 is more than --max-turns 2"),
        # the data itself, read before a model loads
        (f"--corpus-dir {{tmp}}/empty {QUESTIONS}", "corpus folder {tmp}/empty has no .txt or"),
        (f"{CORPUS} --questions {{tmp}}/blank.txt", "questions file {tmp}/blank.txt has no"),
        (f"{CORPUS} --questions {{tmp}}/bad.jsonl", "{tmp}/bad.jsonl:1: not JSON"),
        (f"--chroma {{tmp}}/chroma nosuch {QUESTIONS}", "no collection 'nosuch' in {tmp}/chroma"),
    ],
)
def test_a_mistake_is_one_line_before_a_model_loads(
    argv: str, message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _chroma(tmp_path / "chroma")
    with pytest.raises(SystemExit) as exited:
        main(["bench", "rag", *argv.format(tmp=tmp_path).split()])
    err = capsys.readouterr().err.splitlines()
    assert exited.value.code == 1
    assert len(err) == 1, err
    assert err[0].startswith(f"chunkcache: error: {message.format(tmp=tmp_path)}"), err
    assert not (tmp_path / "missing").exists()  # no database was made there
    assert not any((tmp_path / "empty").iterdir())


@pytest.mark.parametrize(
    "argv",
    [
        "--k 1 --gold-questions 0",  # no gold questions: any k
        f"{CORPUS} {QUESTIONS} --gold-questions 0 --k 1",
        f"--chroma {{tmp}}/chroma docs {QUESTIONS}",
        "--quick --out {tmp}/new/reports",  # a folder that does not exist yet is made
    ],
)
def test_good_options_get_as_far_as_the_model(argv: str, tmp_path: Path) -> None:
    _chroma(tmp_path / "chroma")
    with pytest.raises(ModelLoaded):
        main(["bench", "rag", *argv.format(tmp=tmp_path).split()])


@pytest.mark.parametrize("name", ["../rag", "sub/rag", "", ".."])
def test_a_report_name_with_a_folder_is_refused(
    name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["bench", "rag", "--name", name])
    assert exited.value.code == 2
    assert "argument --name: must be a file name without a folder" in capsys.readouterr().err
