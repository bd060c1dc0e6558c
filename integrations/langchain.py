"""LangChain drop-ins: :class:`ChunkCacheRetriever` (and, with the engine, ``ChunkCacheLLM``).

Wrap any retriever; every document comes back with a stable ``chunk_id``, in an
order that lines shared chunks up as prompt prefixes, minus (or marked with)
the chunks this conversation already has.

>>> from chunkcache.integrations.langchain import ChunkCacheRetriever
>>> retriever = ChunkCacheRetriever(base_retriever=vectorstore.as_retriever())  # doctest: +SKIP
>>> docs = retriever.invoke(  # doctest: +SKIP
...     "How do I parse JSON?", config={"configurable": {"session_id": "user-42"}}
... )
>>> docs[0].metadata["chunk_id"]  # doctest: +SKIP
'3f0c...'

It goes wherever a retriever goes, and reads the conversation from the config it runs with:
in ``create_retrieval_chain``, in ``create_history_aware_retriever`` (it is asked the
rephrased question, in the conversation), in a LangGraph node (the ``thread_id`` is the
conversation, also when the node passes no config).

Wrap the outermost retriever of a pipeline (a wrapper around one that holds wrappers
plans each request once).  Wrappers inside an ``EnsembleRetriever`` alone each plan a
request: one question is counted once per wrapper, and with ``dedupe="drop"`` a later one
leaves out what an earlier one just returned (its vote in the fusion is lost).  Under a
retriever that rewrites texts after the wrapper named them (a
``ContextualCompressionRetriever`` whose compressor splits or extracts), each piece keeps
the ``chunk_id`` of the whole text, which no prompt holds.  ``ContextualCompressionRetriever``
and ``MultiQueryRetriever`` call their base without the caller's config: a wrapper inside
one that is invoked directly sees no conversation (nothing is deduped); inside a chain it
reads the chain's config, and a ``conversation_id=`` keyword passed to a
``ContextualCompressionRetriever`` reaches it.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

from langchain_core.callbacks import (
    AsyncCallbackManagerForRetrieverRun,
    BaseCallbackManager,
    CallbackManagerForRetrieverRun,
)
from langchain_core.documents import Document
from langchain_core.retrievers import BaseRetriever
from langchain_core.runnables import RunnableConfig
from langchain_core.runnables.config import patch_config, run_in_executor
from pydantic import ConfigDict, Field

from chunkcache.core.cache import ChunkCache, default_cache
from chunkcache.core.ledger import DedupeMode
from chunkcache.core.ordering import Ordering
from chunkcache.core.retrieval import RetrievalPlan, plan_retrieval, retrieval_scope
from chunkcache.integrations.langchain_llm import ChunkCacheLLM, config_conversation_id

__all__ = ["ChunkCacheLLM", "ChunkCacheRetriever", "conversation_id_from_config"]


def conversation_id_from_config(config: RunnableConfig | None) -> str | None:
    """The conversation id in ``config["configurable"]``: ``conversation_id``,
    ``session_id`` or ``thread_id``, the first one set; one over 200 characters is named by
    its SHA-256, as :class:`ChunkCacheLLM` and ``with_chunk_history`` name it."""
    return config_conversation_id(config)


class ChunkCacheRetriever(BaseRetriever):
    """Wraps a retriever: stable chunk ids, cache-friendly order, conversation dedupe.

    Args:
        base_retriever: the retriever whose documents are returned.
        cache: shared chunk state; the process-wide default when omitted, so an
            LLM wrapper created without ``cache=`` sees the same chunks.
        ordering: ``"tree"`` (default; follow earlier orders, then frequency),
            ``"frequency"`` (CRAFT §4.2) or ``"retriever"`` (unchanged).
        dedupe: ``"mark"`` (default; keep seen chunks, set
            ``metadata["seen_in_conversation"]``), ``"drop"`` (leave them out: only
            safe when earlier turns' chunks stay in the prompt, see
            :func:`chunkcache.integrations.langchain_history.with_chunk_history`)
            or ``"off"``.
        k: number of documents to ask the base retriever for (forwarded as ``k``); a base
            retriever that takes no ``k`` has its results cut to the first ``k``.

    The base retriever is called with the caller's config (its ``configurable``, tags and
    limits), under the wrapper's run.

    The conversation id comes from ``config["configurable"]`` (``conversation_id``,
    ``session_id`` or ``thread_id``) or a ``conversation_id=`` keyword; without
    one, nothing is deduped.

    Wrapping a retriever that already is (or contains) a wrapper on the same cache is
    safe: the outermost wrapper plans each request once, the inner ones pass their
    base's documents through (see :mod:`chunkcache.core.retrieval`).
    """

    model_config = ConfigDict(arbitrary_types_allowed=True)

    base_retriever: BaseRetriever
    cache: ChunkCache = Field(default_factory=default_cache)
    ordering: Ordering = "tree"
    dedupe: DedupeMode = "mark"
    k: int | None = Field(default=None, ge=1)

    def invoke(
        self, input: str, config: RunnableConfig | None = None, **kwargs: Any
    ) -> list[Document]:
        # langchain-core does not pass the caller's config to _get_relevant_documents,
        # so it is read here (as EnsembleRetriever does): the conversation id, and the
        # config the base retriever is called with.
        kwargs.setdefault("conversation_id", conversation_id_from_config(config))
        return super().invoke(input, config, caller_config=config, **kwargs)

    async def ainvoke(
        self, input: str, config: RunnableConfig | None = None, **kwargs: Any
    ) -> list[Document]:
        kwargs.setdefault("conversation_id", conversation_id_from_config(config))
        return await super().ainvoke(input, config, caller_config=config, **kwargs)

    def _get_relevant_documents(
        self,
        query: str,
        *,
        run_manager: CallbackManagerForRetrieverRun,
        conversation_id: str | None = None,
        caller_config: RunnableConfig | None = None,
        **kwargs: Any,
    ) -> list[Document]:
        k, base_kwargs = self._base_kwargs(
            kwargs, _takes_k(self.base_retriever, asynchronous=False)
        )
        with retrieval_scope(self.cache, conversation_id) as scope:
            documents = self.base_retriever.invoke(
                query, _child_config(caller_config, run_manager.get_child()), **base_kwargs
            )
        return self._arrange(documents[:k], scope.conversation_id)

    async def _aget_relevant_documents(
        self,
        query: str,
        *,
        run_manager: AsyncCallbackManagerForRetrieverRun,
        conversation_id: str | None = None,
        caller_config: RunnableConfig | None = None,
        **kwargs: Any,
    ) -> list[Document]:
        base = self.base_retriever
        native = _has_native_async(base)
        k, base_kwargs = self._base_kwargs(kwargs, _takes_k(base, asynchronous=native))
        with retrieval_scope(self.cache, conversation_id) as scope:
            if native:
                config = _child_config(caller_config, run_manager.get_child())
                documents = await base.ainvoke(query, config, **base_kwargs)
            else:
                # langchain-core would run the sync method in a thread too, but drop the
                # keywords (k) it cannot pass to its default async method: do it here.
                config = _child_config(caller_config, run_manager.get_sync().get_child())
                documents = await run_in_executor(None, base.invoke, query, config, **base_kwargs)
        return self._arrange(documents[:k], scope.conversation_id)

    def _base_kwargs(
        self, kwargs: dict[str, Any], takes_k: bool
    ) -> tuple[int | None, dict[str, Any]]:
        """The ``k`` to cut the results to (the call's unless None, else ours) and the
        keywords for the base retriever: the call's, and ``k`` if the base can take it (a
        ``k`` it cannot take would raise TypeError, or be dropped, in langchain-core)."""
        rest = dict(kwargs)
        call_k = rest.pop("k", None)
        k = self.k if call_k is None else call_k
        if k is not None and takes_k:
            rest["k"] = k
        return k, rest

    def _arrange(self, documents: list[Document], conversation_id: str | None) -> list[Document]:
        plan = plan_retrieval(
            [(doc.page_content, doc.metadata) for doc in documents],
            self.cache,
            conversation_id=conversation_id,
            ordering=self.ordering,
            dedupe=self.dedupe,
        )
        if plan is None:  # an outer wrapper on this cache plans the request
            return documents
        return _documents_from_plan(documents, plan, mark_seen=self.dedupe == "mark")


def _child_config(config: RunnableConfig | None, callbacks: BaseCallbackManager) -> RunnableConfig:
    """The caller's config (its ``configurable``, tags, limits) for the base retriever, with
    the wrapper's run as the parent of the base's."""
    return patch_config(config, callbacks=callbacks)


def _has_native_async(retriever: BaseRetriever) -> bool:
    """Whether ``retriever`` has an async path of its own (else langchain-core runs its sync
    ``_get_relevant_documents`` in a thread)."""
    cls = type(retriever)
    return (
        cls.ainvoke is not BaseRetriever.ainvoke
        or cls._aget_relevant_documents is not BaseRetriever._aget_relevant_documents
    )


def _takes_k(retriever: BaseRetriever, *, asynchronous: bool) -> bool:
    """Whether ``k`` can be passed to ``retriever``: it overrides ``(a)invoke`` (which takes
    ``**kwargs``), or its ``_(a)get_relevant_documents`` names ``k`` or takes ``**kwargs``.
    A ``k`` it cannot take raises TypeError in langchain-core."""
    cls = type(retriever)
    if asynchronous:
        overridden = cls.ainvoke is not BaseRetriever.ainvoke
        return overridden or _names_k(cls._aget_relevant_documents)
    return cls.invoke is not BaseRetriever.invoke or _names_k(cls._get_relevant_documents)


@functools.lru_cache(maxsize=256)
def _names_k(method: Callable[..., Any]) -> bool:
    parameters = inspect.signature(method).parameters.values()
    return any(p.name == "k" or p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters)


def _documents_from_plan(
    documents: list[Document], plan: RetrievalPlan, *, mark_seen: bool
) -> list[Document]:
    """Copies of the planned documents, in plan order, with chunkcache metadata."""
    arranged = []
    for chunk in plan.chunks:
        source = documents[chunk.source_index]
        metadata = {
            **(source.metadata or {}),
            "chunk_id": chunk.chunk_id,
            "retriever_rank": chunk.retriever_rank,
        }
        if mark_seen:
            metadata["seen_in_conversation"] = chunk.seen_in_conversation
        arranged.append(
            source.model_copy(update={"metadata": metadata, "id": source.id or chunk.chunk_id})
        )
    return arranged
