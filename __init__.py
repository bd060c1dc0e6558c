"""chunkcache: reuse the KV cache of retrieved chunks in RAG apps.

The package is split by job: :mod:`chunkcache.core` (ids, ordering, ledgers,
store, engine), :mod:`chunkcache.kernels` (tensor code) and
:mod:`chunkcache.integrations` (LangChain, LlamaIndex, vLLM).
"""

__version__ = "0.1.0"
__all__ = ["__version__"]
