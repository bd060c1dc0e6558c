"""Logit quality of each engine system of ``chunkcache bench rag``, against full prefill.

The LangChain path returns text only, so :class:`RecordingBackend` notes every
request (segments, policy, ratio) the app sent the system's backend, without changing
it.  After the system's timed replay, :class:`RagQualityScorer` runs a seeded sample
of those requests again on a separately loaded float32 copy of the model:

- ``full``: a full prefill of the same prompt, its greedy answer of ``answer_tokens``
  and its log-probs along it (cached by prompt: the systems of one layout share most
  prompts);
- the system: the same prompt prefilled with the request's policy and ratio, reading
  the system's KV store *as the run left it* (read-only, its bfloat16 KV cast to
  float32), then teacher-forced along full's answer.

Metrics as in ``bench engine`` (:func:`~chunkcache.core.bench.quality.along_answer`):
first-token and teacher-forced KL and top-1 agreement.  Float32 because bfloat16
rounding would otherwise dominate the KL (DESIGN, facts checked).  The scoring engine
differs from the run's in three ways: the store also holds variants stored after the
request (its own fresh chunks become exact prefix hits: they were exact then too);
variants evicted since are computed afresh; and it has no conversation memory, so past
turns the run read from it come from the store's exact variants or are computed.
Reused KV keeps its bfloat16 rounding: ``prefix`` (exact reuse only) shows that floor,
a teacher-forced KL of ~2e-4 on the quick run (``reuse`` in the plain layout: 7e-3).

Cost, quick run (8-token answers, one thread, a busy 2-core machine): 209 s of 1,058 s,
about 6 s per request for the ``full`` systems (their references, computed first) and
0.3-2 s per request for the others, which mostly find full's reference cached.
"""

from __future__ import annotations

import random
import statistics
import time
from collections import OrderedDict
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import replace
from typing import Any

import torch

from chunkcache.core.bench.policies import ReadOnlyStore
from chunkcache.core.bench.quality import Reference, along_answer, full_reference
from chunkcache.core.bench.scoring import forced_log_probs
from chunkcache.core.engine import ChunkEngine, TokenSegment
from chunkcache.core.generation import Backend, GenerationChunk, GenerationRequest
from chunkcache.core.kv_store import KVStore, KVVariant
from chunkcache.core.models import LoadedModel
from chunkcache.core.tokenization import SegmentTokenizer

QUALITY_FIELDS = ("first_kl", "first_top1", "tf_kl", "tf_top1")
NOT_SCORED = {
    "hf": "hf generate: transformers' generate tokenizes the prompt whole, not per segment, "
    "and exposes no KV to score",
    "vllm": "vLLM: its OpenAI API returns top-k log-probs only",
}
# Float32 log-probs along a 32-token answer take ~6 MB; 64 prompts bound the cache.
MAX_REFERENCES = 64


class RecordingBackend:
    """A :class:`Backend` that notes each request and passes it on unchanged.

    Other attributes (``engine``, ``model_name``, ...) are the wrapped backend's, so
    :class:`~chunkcache.core.cache.ChunkCache` treats it as the backend itself.
    """

    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        self.requests: list[GenerationRequest] = []

    def render_chat(self, messages: Sequence[Mapping[str, str]]) -> str:
        return self.backend.render_chat(messages)

    def stream(self, request: GenerationRequest) -> Iterator[GenerationChunk]:
        self.requests.append(request)
        return self.backend.stream(request)

    def __getattr__(self, name: str) -> Any:
        if name == "backend":  # not set yet: no recursion
            raise AttributeError(name)
        return getattr(self.backend, name)


class CastStore(ReadOnlyStore):
    """A read-only view of a store another copy of the model filled: lookups go to
    ``fingerprint`` (that copy's) and the KV comes back cast to ``dtype``."""

    def __init__(self, base: KVStore, fingerprint: str, dtype: torch.dtype) -> None:
        super().__init__(base)
        self.fingerprint = fingerprint
        self.dtype = dtype

    def exact(self, fingerprint: str, segment_id: str, context: str) -> KVVariant | None:
        variant = self.base.exact(self.fingerprint, segment_id, context)
        return None if variant is None else self._cast(variant)

    def variants(self, fingerprint: str, segment_id: str) -> list[KVVariant]:
        return [self._cast(v) for v in self.base.variants(self.fingerprint, segment_id)]

    def _cast(self, variant: KVVariant) -> KVVariant:
        return replace(variant, k=variant.k.to(self.dtype), v=variant.v.to(self.dtype))


def sample_requests(count: int, size: int | None, seed: int) -> list[int]:
    """A seeded sample of ``size`` request indices out of ``count``, in order (all if
    ``size`` is None or not smaller); the same for every system of a workload."""
    if size is None or size >= count:
        return list(range(count))
    if size < 0:
        raise ValueError(f"the quality sample size must be >= 0, got {size}")
    return sorted(random.Random(f"quality/{seed}").sample(range(count), size))


class RagQualityScorer:
    """Scores recorded requests against ``full`` on ``lm`` (load it in float32)."""

    def __init__(self, lm: LoadedModel, answer_tokens: int) -> None:
        if lm.tokenizer is None:
            raise ValueError("quality scoring needs a model loaded with its tokenizer")
        self.lm = lm
        self.answer_tokens = answer_tokens
        self.tokenize = SegmentTokenizer(lm.tokenizer)
        self.references: OrderedDict[tuple[int, ...], Reference] = OrderedDict()

    def score(
        self, request: GenerationRequest, store: KVStore, fingerprint: str
    ) -> dict[str, float]:
        """One request's :data:`QUALITY_FIELDS` against ``full``; ``store`` is the system's
        (read, never written), filled by the model of ``fingerprint``."""
        segments = self.tokenize(request.segments)
        reference = self.reference(tuple(t for s in segments for t in s.ids), segments)
        if request.policy == "full":
            return along_answer(reference, reference.log)
        engine = ChunkEngine(self.lm, CastStore(store, fingerprint, self.lm.dtype))
        prefilled = engine.prefill(
            segments, request.policy, request.recompute_ratio, reserve=self.answer_tokens
        )
        log = forced_log_probs(self.lm, prefilled.logits, prefilled.kv, reference.answer)
        return along_answer(reference, log)

    def reference(self, ids: tuple[int, ...], segments: Sequence[TokenSegment]) -> Reference:
        """Full's answer on the prompt of token ``ids``, computed once per prompt."""
        if ids in self.references:
            self.references.move_to_end(ids)
            return self.references[ids]
        reference = full_reference(self.lm, segments, self.answer_tokens)
        self.references[ids] = reference
        while len(self.references) > MAX_REFERENCES:
            self.references.popitem(last=False)
        return reference

    def score_system(
        self,
        requests: Sequence[GenerationRequest],
        chosen: Sequence[int],
        store: KVStore,
        fingerprint: str,
    ) -> dict[str, Any]:
        """The chosen requests' scores, their means and the scoring time."""
        started = time.perf_counter()
        rows = [self.score(requests[i], store, fingerprint) for i in chosen]
        seconds = time.perf_counter() - started
        return {
            "dtype": str(self.lm.dtype).removeprefix("torch."),
            "answer_tokens": self.answer_tokens,
            "scored_requests": list(chosen),
            "scoring_s": seconds,
            "mean": {f: statistics.fmean(r[f] for r in rows) for f in QUALITY_FIELDS}
            if rows
            else None,
            "per_request": rows,
        }


def quality_figures(quality: dict[str, Any] | None) -> dict[str, Any]:
    """A system's figures from its :meth:`RagQualityScorer.score_system` result (or its
    ``{"n/a": reason}``): ``<field>_vs_full`` means (None if not scored) and the detail."""
    if quality is None:
        return {}
    mean = quality.get("mean") or {}
    return {
        **{f"{field}_vs_full": mean.get(field) for field in QUALITY_FIELDS},
        "logit_quality": quality,
    }
