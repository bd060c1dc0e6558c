"""Chunk ids: stable content hashes that every process on every machine agrees on."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import unicodedata

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from chunkcache.core.chunk_ids import (
    CHUNK_ID_METADATA_KEY,
    chunk_id,
    chunk_id_for,
    chunk_id_of,
    chunk_key,
    normalize_text,
    validate_chunk_id,
)
from chunkcache.core.errors import ChunkCacheError, InvalidChunkError

# Golden values: if one of these changes, every cache on disk is orphaned.
GOLDEN = {
    ("hello world", ""): "aa2b272e0007adbdfa8bb32120defe03",
    ("hello world", "tenant-a"): "108678e57b9794283ae96dee0cbd13a8",
    ("Caf\u00e9 \u2014 \u65e5\u672c", ""): "363e33c00def64ccd871b3dff06acaf3",
}


def _is_id(value: str) -> bool:
    return len(value) == 32 and all(c in "0123456789abcdef" for c in value)


@pytest.mark.parametrize(("text", "namespace"), sorted(GOLDEN))
def test_golden_values(text: str, namespace: str) -> None:
    assert chunk_id(text, namespace=namespace) == GOLDEN[(text, namespace)]


def test_golden_matches_the_documented_construction() -> None:
    # The id is BLAKE2b-128 over tag, namespace length (8 bytes BE), namespace, NFC text.
    digest = hashlib.blake2b(digest_size=16)
    digest.update(b"chunkcache/chunk-id/v1\x00")
    digest.update((8).to_bytes(8, "big"))
    digest.update(b"tenant-a")
    digest.update(b"hello world")
    assert chunk_id("hello world", namespace="tenant-a") == digest.hexdigest()


def test_same_ids_in_another_process() -> None:
    texts = [text for text, _ in GOLDEN] + ["e\u0301", "\U0001f600 \u05e9\u05dc\u05d5\u05dd"]
    script = (
        "import json, sys\n"
        "from chunkcache.core.chunk_ids import chunk_id\n"
        "texts = json.loads(sys.stdin.read())\n"
        "print(json.dumps([chunk_id(t) for t in texts]))\n"
    )
    # A different hash seed must not matter: ids never depend on hash().
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    out = subprocess.run(
        [sys.executable, "-c", script],
        input=json.dumps(texts),
        capture_output=True,
        text=True,
        check=True,
        env=env,
        timeout=60,
    )
    assert json.loads(out.stdout) == [chunk_id(t) for t in texts]


@given(st.text(min_size=1).filter(lambda t: t.strip()), st.text(max_size=20))
@settings(max_examples=60, deadline=None)
def test_always_32_lowercase_hex(text: str, namespace: str) -> None:
    value = chunk_id(text, namespace=namespace)
    assert _is_id(value)
    assert validate_chunk_id(value) == value
    assert chunk_id(text, namespace=namespace) == value


def test_nfc_and_nfd_forms_give_the_same_id() -> None:
    text = "Caf\u00e9 cr\u00e8me br\u00fbl\u00e9e, \uac00\ub098\ub2e4"
    nfd = unicodedata.normalize("NFD", text)
    assert nfd != text
    assert chunk_id(nfd) == chunk_id(text)
    assert normalize_text(nfd) == unicodedata.normalize("NFC", text)


@given(st.text(min_size=1).filter(lambda t: t.strip()))
@settings(max_examples=60, deadline=None)
def test_every_normal_form_of_a_text_shares_its_id(text: str) -> None:
    # NFC and NFD are canonically equivalent, so they must always share an id.
    assert chunk_id(unicodedata.normalize("NFD", text)) == chunk_id(
        unicodedata.normalize("NFC", text)
    )


def test_namespace_changes_the_id() -> None:
    base = chunk_id("the same text")
    assert chunk_id("the same text", namespace="a") != base
    assert chunk_id("the same text", namespace="a") != chunk_id("the same text", namespace="b")


def test_namespace_and_text_cannot_be_shifted_into_each_other() -> None:
    # The namespace is length-prefixed, so moving bytes between it and the text changes the id.
    assert chunk_id("bc", namespace="a") != chunk_id("c", namespace="ab")


def test_different_texts_give_different_ids() -> None:
    assert chunk_id("hello world") != chunk_id("hello world ")
    assert chunk_id("hello world") != chunk_id("Hello world")


@pytest.mark.parametrize("text", ["", " ", "\n\t  \r\n", "\u3000", "\u00a0\u2003"])
def test_empty_or_whitespace_only_text_is_rejected(text: str) -> None:
    with pytest.raises(InvalidChunkError):
        chunk_id(text)


def test_invalid_chunk_error_is_a_value_error_and_a_chunkcache_error() -> None:
    with pytest.raises(ValueError):
        chunk_id("")
    with pytest.raises(ChunkCacheError):
        chunk_id("   ")


@pytest.mark.parametrize("value", [None, b"bytes", 42, 1.5, ["text"], {"text": 1}])
def test_non_str_text_raises_type_error(value: object) -> None:
    with pytest.raises(TypeError):
        chunk_id(value)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        normalize_text(value)  # type: ignore[arg-type]


def test_non_str_namespace_raises_type_error() -> None:
    with pytest.raises(TypeError):
        chunk_id("text", namespace=None)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "text",
    [
        "\ud800",  # lone high surrogate
        "abc\udfffdef",  # lone low surrogate inside text
        "\U0001f600\U0001f468\u200d\U0001f469\u200d\U0001f467",  # emoji, ZWJ sequence
        "\u05e9\u05dc\u05d5\u05dd \u0645\u0631\u062d\u0628\u0627",  # RTL Hebrew/Arabic
        "\u202eevil\u202c",  # bidi override
        "\u200b",  # zero-width space only (not whitespace to Python)
        "a\u200bb\ufeff",  # zero-width space and BOM inside
        "nul\x00inside",
    ],
)
def test_odd_unicode_gives_a_defined_stable_id(text: str) -> None:
    value = chunk_id(text)
    assert _is_id(value)
    assert chunk_id(text) == value


def test_zero_width_characters_are_content() -> None:
    assert chunk_id("ab") != chunk_id("a\u200bb")


def test_surrogate_pair_as_code_points_differs_from_the_real_character() -> None:
    # Two lone surrogates are a different str than the astral character; both get ids.
    assert chunk_id("\ud83d\ude00") != chunk_id("\U0001f600")


def test_one_megabyte_text() -> None:
    text = "All work and no play. " * (1024 * 1024 // 22 + 1)
    assert len(text) >= 1024 * 1024
    value = chunk_id(text)
    assert _is_id(value)
    assert chunk_id(text[:-1]) != value


@pytest.mark.parametrize(
    "value",
    [
        "abc",
        "doc-1:chunk.2",
        "A_Z-09.:",
        "x" * 128,
        "aa2b272e0007adbdfa8bb32120defe03",
    ],
)
def test_validate_chunk_id_accepts_good_ids(value: str) -> None:
    assert validate_chunk_id(value) == value


@pytest.mark.parametrize(
    "value",
    [
        "",
        "x" * 129,
        "has space",
        "abc\n",  # a `$`-anchored regex would let this through
        "\nabc",
        "../../etc/passwd",
        "a/b",
        "caf\u00e9",
        "tab\there",
        "semi;colon",
    ],
)
def test_validate_chunk_id_rejects_bad_ids(value: str) -> None:
    with pytest.raises(InvalidChunkError):
        validate_chunk_id(value)


@pytest.mark.parametrize("value", [None, 5, b"abc", ["abc"]])
def test_validate_chunk_id_rejects_non_str(value: object) -> None:
    with pytest.raises(InvalidChunkError):
        validate_chunk_id(value)


def test_chunk_id_for_keeps_a_metadata_id_that_is_the_texts_own() -> None:
    own = chunk_id("some text", "ns")
    assert chunk_id_for("some text", {CHUNK_ID_METADATA_KEY: own}, namespace="ns") == own


def test_chunk_id_for_scopes_the_text_hash_by_any_other_metadata_id() -> None:
    """Two texts under one caller id (an edited document, per-file chunk numbers) are two
    chunks; one text under two caller ids too; any value works as a caller id."""
    ids = {
        chunk_id_for(text, {CHUNK_ID_METADATA_KEY: label})
        for text in ("first version", "second version")
        for label in ("doc-7", 0, "bad id\n", "")
    }
    assert len(ids) == 8 and all(validate_chunk_id(i) == i for i in ids)
    assert chunk_id_for("text", {"chunk_id": "doc-7"}) == chunk_id_for(
        "text", {"chunk_id": "doc-7"}
    )
    assert chunk_id_for("text", {"chunk_id": 0}) == chunk_id_for("text", {"chunk_id": "0"})
    assert chunk_id_for("text", {"chunk_id": "a"}, "ns") != chunk_id_for("text", {"chunk_id": "a"})


@pytest.mark.parametrize("namespace", ["", "tenant-a"])
def test_an_id_given_back_is_kept(namespace: str) -> None:
    """A retriever's document passed back (as ``chunks=``, or through a second wrapper)
    keeps its id: ids made from a caller's label are recognised as this text's."""
    bound = chunk_id_for("text", {"chunk_id": "doc-7"}, namespace)
    assert chunk_id_for("text", {"chunk_id": bound}, namespace) == bound
    plain = chunk_id_for("text", None, namespace)
    assert chunk_id_for("text", {"chunk_id": plain}, namespace) == plain
    assert chunk_id_for("other text", {"chunk_id": bound}, namespace) != bound


@pytest.mark.parametrize("prefix", ["my doc", "doc-7", "ABCDEF0123456789", "0123456789abcdef0"])
def test_a_label_merely_ending_in_the_texts_hash_is_scoped(prefix: str) -> None:
    """Only ids made here are kept: a caller's label such as ``"my doc-<hash>"`` (not a
    valid id) is hashed like any other label."""
    label = f"{prefix}-{chunk_id('text')}"
    bound = chunk_id_for("text", {"chunk_id": label})
    assert bound != label
    assert validate_chunk_id(bound) == bound


def test_a_chunk_key_binds_the_id_to_its_tokens() -> None:
    assert chunk_key("doc-7", (1, 2, 3)) != chunk_key("doc-7", (1, 2, 4))
    assert chunk_id_of(chunk_key("doc-7", (1, 2, 3))) == "doc-7"
    assert chunk_id_of("a-text-segment-hash") == "a-text-segment-hash"


def test_chunk_id_for_hashes_without_a_metadata_id() -> None:
    for metadata in (None, {}, {"source": "x.txt"}, {"chunk_id": None}):
        assert chunk_id_for("some text", metadata) == chunk_id("some text")
    assert chunk_id_for("some text", None, namespace="ns") == chunk_id("some text", "ns")
