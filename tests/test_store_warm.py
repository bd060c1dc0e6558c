"""``chunkcache warm``: chunk KV precomputed into the disk tier, resumable, then served."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_store_readonly_s26 import ReadOnlyMount
from tiny_models import save_tiny_checkpoint

from chunkcache.core.cli import main
from chunkcache.core.corpus import CorpusChunk
from chunkcache.core.engine import ChunkEngine
from chunkcache.core.models import LoadedModel, load_model
from chunkcache.core.segmenter import ChunkSegment, TextSegment
from chunkcache.core.store import DiskTier, TieredKVStore
from chunkcache.core.store.codec import namespace_of, segment_of
from chunkcache.core.tokenization import SegmentTokenizer
from chunkcache.core.user_corpus import load_text_folder

WORDS = [f"w{i}" for i in range(3, 120)]


def write_texts(folder: Path) -> None:
    folder.mkdir()
    for f in range(2):
        paragraphs = [
            " ".join(WORDS[(f * 31 + p * 7 + j) % len(WORDS)] for j in range(12)) for p in range(5)
        ]
        (folder / f"doc{f}.txt").write_text("\n\n".join(paragraphs))
    (folder / "skip.bin").write_bytes(b"\x00")


def keys_of(lm: LoadedModel, chunks: list[CorpusChunk]) -> list[str]:
    """The store keys of ``chunks``: their ids bound to their tokens."""
    tokenize = SegmentTokenizer(lm.tokenizer)
    return [tokenize([ChunkSegment(c.chunk_id, c.text)])[0].segment_id for c in chunks]


def test_warm_is_resumable_and_its_kv_is_served(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    model = save_tiny_checkpoint(tmp_path / "model")
    write_texts(tmp_path / "texts")
    monkeypatch.setenv("CHUNKCACHE_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("CHUNKCACHE_STORE_HOST_BYTES", "100000")
    args = ["warm", "--folder", str(tmp_path / "texts"), "--model", str(model)]
    args += ["--dtype", "float32", "--chunk-chars", "200", "--prefix", "w1 w2 w3"]
    main([*args, "--max-chunks", "2"])
    assert "2 chunks computed, 0 already stored" in capsys.readouterr().out
    main(args)  # interrupted and restarted: only the rest is computed
    assert "2 chunks computed, 2 already stored" in capsys.readouterr().out

    lm = load_model(model, dtype=torch.float32)
    store = TieredKVStore([DiskTier(tmp_path / "home" / "kv", 10**8)])
    chunks = load_text_folder(tmp_path / "texts", chunk_chars=200)
    assert all(store.contains_segment(lm.fingerprint, key) for key in keys_of(lm, chunks))
    tokenize = SegmentTokenizer(lm.tokenizer)
    chunk = ChunkSegment(chunks[3].chunk_id, chunks[3].text)
    request = tokenize([TextSegment("w1 w2 w3"), chunk, TextSegment("w9 w8")])
    out = ChunkEngine(lm, store).prefill(request, "reuse")
    assert out.stats.chunk_hits == 1
    full = ChunkEngine(lm).prefill(request, "full").logits
    assert (out.logits - full).abs().max().item() < 1e-4


def test_warm_folder_stores_the_chunks_bench_rag_retrieves(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``warm --folder X`` and ``bench rag --corpus-dir X`` chunk X the same way: every chunk
    warmed is one the benchmark retrieves, and the other way round."""
    model = save_tiny_checkpoint(tmp_path / "model")
    texts = tmp_path / "texts"
    write_texts(texts)
    (texts / "guides").mkdir()
    (texts / "guides" / "notes.md").write_text("w4 w5 w6\n\nw7 w8")
    (texts / ".drafts").mkdir()
    (texts / ".drafts" / "hidden.txt").write_text("w9 w10")
    monkeypatch.setenv("CHUNKCACHE_HOME", str(tmp_path / "home"))
    args = ["warm", "--folder", str(texts), "--model", str(model), "--dtype", "float32"]
    main([*args, "--chunk-chars", "250"])

    chunks = load_text_folder(texts, chunk_chars=250)
    disk = DiskTier(tmp_path / "home" / "kv", 10**8)
    lm = load_model(model, dtype=torch.float32)
    namespace = namespace_of(lm.fingerprint)
    stored = {key.segment for key in disk.entry_keys() if key.namespace == namespace}
    assert stored == {segment_of(key) for key in keys_of(lm, chunks)}


def test_warm_into_a_read_only_disk_tier_refuses_before_computing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A read-only disk tier keeps nothing warm writes: computing every chunk and storing
    none (behind one start-up warning) wasted the run and looked like success."""
    model = save_tiny_checkpoint(tmp_path / "model")
    write_texts(tmp_path / "texts")
    monkeypatch.setenv("CHUNKCACHE_HOME", str(tmp_path / "home"))
    DiskTier(tmp_path / "home" / "kv", 10**6)  # the directory exists, then turns read-only
    ReadOnlyMount(tmp_path / "home" / "kv", monkeypatch).on = True
    computed: list[object] = []
    monkeypatch.setattr(ChunkEngine, "prefill", lambda *args: computed.append(args))
    with pytest.raises(SystemExit) as exited:
        main(["warm", "--folder", str(tmp_path / "texts"), "--model", str(model)])
    assert exited.value.code == 1 and not computed
    assert "read-only" in capsys.readouterr().err
