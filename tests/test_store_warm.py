"""``chunkcache warm``: chunk KV precomputed into the disk tier, resumable, then served."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tiny_models import save_tiny_checkpoint

from chunkcache.core.cli import main
from chunkcache.core.engine import ChunkEngine
from chunkcache.core.models import load_model
from chunkcache.core.segmenter import ChunkSegment, TextSegment
from chunkcache.core.store import DiskTier, TieredKVStore
from chunkcache.core.store.warm import folder_chunks
from chunkcache.core.tokenization import SegmentTokenizer

WORDS = [f"w{i}" for i in range(3, 120)]


def write_texts(folder: Path) -> None:
    folder.mkdir()
    for f in range(2):
        paragraphs = [
            " ".join(WORDS[(f * 31 + p * 7 + j) % len(WORDS)] for j in range(12)) for p in range(5)
        ]
        (folder / f"doc{f}.txt").write_text("\n\n".join(paragraphs))
    (folder / "skip.bin").write_bytes(b"\x00")


def test_folder_chunks_pack_paragraphs(tmp_path: Path) -> None:
    write_texts(tmp_path / "texts")
    chunks = list(folder_chunks(tmp_path / "texts", chunk_chars=100))
    assert len(chunks) == 6  # 5 paragraphs of 40-47 chars a file: 2 + 2 + 1
    assert all(len(text) <= 100 for _, text in chunks)
    assert len({cid for cid, _ in chunks}) == len(chunks)


def test_folder_chunks_refuse_a_path_that_is_no_folder(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="missing"):
        folder_chunks(tmp_path / "missing")
    (tmp_path / "file.txt").write_text("w1 w2")
    with pytest.raises(NotADirectoryError, match=r"file\.txt"):
        folder_chunks(tmp_path / "file.txt")


def test_warm_is_resumable_and_its_kv_is_served(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    model = save_tiny_checkpoint(tmp_path / "model")
    write_texts(tmp_path / "texts")
    monkeypatch.setenv("CHUNKCACHE_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("CHUNKCACHE_STORE_HOST_BYTES", "100000")
    args = ["warm", "--folder", str(tmp_path / "texts"), "--model", str(model)]
    args += ["--dtype", "float32", "--chunk-chars", "100", "--prefix", "w1 w2 w3"]
    main([*args, "--max-chunks", "2"])
    assert "2 chunks computed, 0 already stored" in capsys.readouterr().out
    main(args)  # interrupted and restarted: only the rest is computed
    assert "4 chunks computed, 2 already stored" in capsys.readouterr().out

    lm = load_model(model, dtype=torch.float32)
    store = TieredKVStore([DiskTier(tmp_path / "home" / "kv", 10**8)])
    chunks = list(folder_chunks(tmp_path / "texts", chunk_chars=100))
    assert all(store.contains_segment(lm.fingerprint, cid) for cid, _ in chunks)
    tokenize = SegmentTokenizer(lm.tokenizer)
    cid, text = chunks[3]
    request = tokenize([TextSegment("w1 w2 w3"), ChunkSegment(cid, text), TextSegment("w9 w8")])
    out = ChunkEngine(lm, store).prefill(request, "reuse")
    assert out.stats.chunk_hits == 1
    full = ChunkEngine(lm).prefill(request, "full").logits
    assert (out.logits - full).abs().max().item() < 1e-4


def test_chroma_collection_chunks_carry_the_retriever_ids(tmp_path: Path) -> None:
    chromadb = pytest.importorskip("chromadb")
    from chunkcache.core.chunk_ids import chunk_id, chunk_id_for
    from chunkcache.core.store.warm import chroma_chunks

    client = chromadb.PersistentClient(path=str(tmp_path / "chroma"))
    collection = client.create_collection("docs", embedding_function=None)
    collection.add(
        ids=["1", "2"],
        documents=["w5 w6 w7", "w8 w9"],
        metadatas=[{"chunk_id": "my-id"}, {"source": "x"}],
        embeddings=[[0.1, 0.2], [0.3, 0.4]],
    )
    got = dict(chroma_chunks(tmp_path / "chroma", "docs"))
    pinned = chunk_id_for("w5 w6 w7", {"chunk_id": "my-id"})
    assert got == {pinned: "w5 w6 w7", chunk_id("w8 w9"): "w8 w9"}
    with pytest.raises(ValueError, match=r"no collection 'nope' in .* \(it has: docs\)"):
        chroma_chunks(tmp_path / "chroma", "nope")


def test_chroma_chunks_refuse_a_folder_without_a_database(tmp_path: Path) -> None:
    from chunkcache.core.store.warm import chroma_chunks

    (tmp_path / "typo").mkdir()
    with pytest.raises(FileNotFoundError, match="no Chroma database"):
        chroma_chunks(tmp_path / "typo", "docs")
    assert not any((tmp_path / "typo").iterdir())  # Chroma would have made one there
