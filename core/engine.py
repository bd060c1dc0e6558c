"""The chunk-cache engine: prefill a segmented prompt reusing cached KV, then decode.

One request runs ``plan -> place -> compute -> store``:

1. Exact prefix: the longest run of leading segments whose variant was computed in
   exactly this context (CRAFT's chunk-prefix; system prompt and earlier turns are
   segments too), or the longest token prefix shared with the conversation's last
   sequence (for ``prefix``, only as far as its KV is exact: a turn run under a reuse
   policy may have left it blended), whichever is longer.  Always taken, whatever the
   policy but ``full``.
2. Place: for ``reuse``/``cacheblend``/``cachecraft``, every later chunk with any
   stored variant has its keys moved to their new positions (RoPE shift) and its
   values copied (CacheBlend §3).  The variant computed in exactly this context is
   placed when there is one; else ``cachecraft`` places the variant of lowest CFO and
   counts f_r += 1/CFO on it (Cache-Craft §3.3), the others the most recently used.
   The KV goes in layer by layer (:mod:`chunkcache.core.chunk_placing`), on a background
   thread ahead of compute when the request read entries from a slower tier and the
   model runs off the CPU (``layer_loading=None``).
3. Compute: tokens with no KV run all layers; reused tokens are selectively
   recomputed by the policy (:mod:`chunkcache.core.recompute`).
4. Store: segments computed fresh become variants of their context, and so does the
   exact KV a conversation's past brought (its decoded answer included), so the store
   serves the whole history as a prefix once the conversation is forgotten.

``cachecraft`` (Cache-Craft §3.1-3.3, :mod:`chunkcache.core.craft`) recomputes, on
every layer, the top ``ceil(CFO * |C|)`` tokens of each placed chunk by their stored
attention to the chunk's old context, CFO = alpha * CCI * (1 - beta') with
``CraftConfig.alpha`` (default 1.0).  ``ratio`` caps the recompute at the compute
``cacheblend`` spends at that ratio (its first layer runs every reused row and its
check layers write every row's K/V, so on SmolLM2 0.15 buys 18.3% of the reused
tokens on every one of 30 layers, :func:`~chunkcache.core.recompute.blend_share`):
over the cap, every chunk's count shrinks in proportion; 1.0 is the paper's uncapped
rule.  Chunks it computes fresh get the metadata CFO needs (CCI, per-token scores,
context), read on every 4th layer; variants stored by other policies have none and
score CFO = min(1, alpha), their first tokens recomputed.  Early termination on the
question's focused chunks (Algorithm 1) is behind ``CraftConfig.focus_window``, off by
default.

What each policy computes and buys on SmolLM2, where ``cacheblend``'s TTFT goes, and
what was tried for ``cachecraft``: docs/engine.md.
"""

from __future__ import annotations

import copy
import functools
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from chunkcache.core.batch_step import decode_step
from chunkcache.core.chunk_placing import placing
from chunkcache.core.conversation_memory import ConversationMemory, Past
from chunkcache.core.craft import CraftConfig, CraftMeta
from chunkcache.core.craft_plan import (
    PlacedChunk,
    choose_variant,
    count_reuses,
    craft_recompute,
)
from chunkcache.core.craft_probe import Span
from chunkcache.core.errors import EmptyPromptError, PromptTooLongError
from chunkcache.core.generation import GenerationStats, Policy, SamplingParams, salted_namespace
from chunkcache.core.kv_store import (
    ROOT_CONTEXT,
    KVStore,
    KVVariant,
    MemoryKVStore,
    extend_context,
    holds_segment,
)
from chunkcache.core.model_forward import last_logits
from chunkcache.core.models import LoadedModel
from chunkcache.core.recompute import recompute
from chunkcache.core.sampling import sample_token
from chunkcache.core.store.codec import CorruptEntryError
from chunkcache.core.store.hooks import record_prefill, track_store
from chunkcache.core.store.loading import controlled_ratio
from chunkcache.core.store.metrics import StoreUsage
from chunkcache.kernels.kv import SeqKV

MAX_CORRUPT_RERUNS = 64  # a request meeting more corrupt entries than this fails
# KV tokens remembered across conversations: 4 full windows of the default model, at most
# ~755 MB of bf16 KV on SmolLM2-135M (23,040 B/token) where 32 conversations of 8k tokens
# would hold ~6 GB.  A forgotten conversation's next turn falls back to the store.
MAX_CONVERSATION_TOKENS = 32_768


@dataclass(frozen=True)
class TokenSegment:
    """A prompt segment as tokens: a chunk (``is_chunk``) or plain text."""

    segment_id: str
    ids: tuple[int, ...]
    is_chunk: bool


@dataclass(frozen=True)
class MatchedPrefix:
    """The prefix :meth:`ChunkEngine._take_prefix` copied into a request's KV: exact
    matches of its tokens (a conversation's past may hold approximate KV: ``exact_until``)."""

    length: int  # tokens
    exact_until: int  # the first slot whose KV is only approximate (or the prompt length)
    in_store: int  # tokens whose segments the store holds (the rest came from a conversation)


@dataclass
class Prefilled:
    """A prefilled prompt: its KV, the next-token logits, and where its tokens came from."""

    ids: list[int]
    kv: SeqKV
    logits: Tensor  # [V] float32
    stats: GenerationStats
    exact_until: int  # slots before this hold exactly what a full prefill would compute

    def append(self, token: int) -> None:
        """Record ``token``, whose KV a decode step just wrote after the last slot: exact
        when every slot before it is."""
        if self.exact_until == len(self.ids):
            self.exact_until += 1
        self.ids.append(token)


class ChunkEngine:
    """Prefill with chunk-KV reuse, then decode, on one :class:`LoadedModel`.

    ``craft`` holds the ``cachecraft`` policy's settings (alpha, metadata layers,
    attention sinks, focus window); see the module docstring.  ``layer_loading`` places
    reused chunk KV layer by layer on a background thread ahead of compute: ``None``
    (default) when this request read entries from a slower tier and the model is not on
    the CPU (there the loader would take the compute's cores), ``True`` always, ``False``
    never; pipelined reads from slower tiers also raise the recompute ratio to what they
    hide (:mod:`chunkcache.core.store.loading`).

    :meth:`remember` keeps at most ``max_conversations`` conversations' last sequences (one
    per prompt shape, :mod:`chunkcache.core.conversation_memory`), holding at most
    ``max_conversation_tokens`` KV tokens in all (the least recently used, by a turn that
    read or remembered it, go first; 0 keeps none); a sequence longer than that is not
    kept, and its conversation's next turn takes its prefix from the store.

    Store entries and remembered conversations live in :attr:`namespace`, the model
    fingerprint; :meth:`salted` gives the engine a request with a ``cache_salt`` runs on.
    """

    def __init__(
        self,
        lm: LoadedModel,
        store: KVStore | None = None,
        max_conversations: int = 32,
        craft: CraftConfig | None = None,
        layer_loading: bool | None = None,
        max_conversation_tokens: int = MAX_CONVERSATION_TOKENS,
    ) -> None:
        for name, value in [
            ("max_conversations", max_conversations),
            ("max_conversation_tokens", max_conversation_tokens),
        ]:
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an int >= 0, got {value!r}")
        self.lm = lm
        self.layer_loading = layer_loading
        self.store: KVStore = store if store is not None else MemoryKVStore()
        self.craft = craft if craft is not None else CraftConfig()
        self.conversations = ConversationMemory(max_conversations, max_conversation_tokens)
        self.namespace = lm.fingerprint  # every store key's and remembered conversation's

    def salted(self, cache_salt: str | None) -> ChunkEngine:
        """This engine for requests carrying ``cache_salt``: the same model, store and
        conversation memory, with its entries and conversations under a namespace of the
        salt's own (:func:`~chunkcache.core.generation.salted_namespace`): its requests and
        those of another salt, or of none, never reuse each other's KV.  Itself for None."""
        namespace = salted_namespace(self.lm.fingerprint, cache_salt)
        if namespace == self.namespace:
            return self
        view = copy.copy(self)  # shares the store, the memory and the model: a view, not a copy
        view.namespace = namespace
        return view

    def prefill(
        self,
        segments: Sequence[TokenSegment],
        policy: Policy,
        ratio: float = 0.15,
        conversation_id: str | None = None,
        reserve: int = 0,
    ) -> Prefilled:
        """Prefill ``segments``; ``reserve`` tokens of room are kept for decoding.

        A tiered store reports this request's hits and loads per tier in
        ``stats.extra["store"]`` and learns the prefill's cost per token (PGDSF).  A stored
        layer found corrupt mid-prefill (read lazily from disk) runs the request again.
        """
        started = time.perf_counter()
        run = functools.partial(self._prefill, segments, policy, ratio, conversation_id, reserve)
        # A layer read mid-prefill that fails its checksum raises after the store dropped
        # its entry, so each rerun meets one corrupt entry fewer (a chunk may have many).
        with track_store(self.store) as usage:
            for attempt in range(MAX_CORRUPT_RERUNS + 1):
                try:
                    prefilled, stored = run(usage)
                    break
                except CorruptEntryError:
                    if attempt == MAX_CORRUPT_RERUNS:
                        raise
        stats = prefilled.stats
        stats.extra["store"] = usage.as_dict()
        new_tokens = stats.computed_tokens + stats.recomputed_tokens
        seconds = time.perf_counter() - started
        record_prefill(self.store, self.namespace, stored, stats.reused_tokens, new_tokens, seconds)
        return prefilled

    def _prefill(
        self,
        segments: Sequence[TokenSegment],
        policy: Policy,
        ratio: float,
        conversation_id: str | None,
        reserve: int,
        usage: StoreUsage,
    ) -> tuple[Prefilled, list[tuple[str, str]]]:
        """:meth:`prefill`, also returning the (segment id, context) of the variants stored."""
        started = time.perf_counter()
        ids = [token for segment in segments for token in segment.ids]
        if not ids:
            raise EmptyPromptError("the prompt has no tokens")
        window = self.lm.spec.context_window
        if len(ids) + reserve > window:
            raise PromptTooLongError(
                f"{len(ids)} prompt tokens + {reserve} to generate exceed the model's "
                f"context window of {window}"
            )
        starts, contexts = _layout(segments)
        spans = [
            Span(g.segment_id, a, a + len(g.ids)) for g, a in zip(segments, starts, strict=True)
        ]
        stats = GenerationStats(policy=policy, prompt_tokens=len(ids))
        kv = self.lm.new_kv(len(ids) + reserve)
        kv.extend(len(ids))
        prefix = MatchedPrefix(0, len(ids), 0)
        if policy != "full":
            # A past may hold blended KV; these promise a full prefill's output
            exact_only = policy == "prefix" or (policy == "cacheblend" and ratio >= 1)
            prefix = self._take_prefix(
                segments, ids, conversation_id, kv, exact_only, _reuses(policy)
            )
        exact_until = prefix.exact_until
        exact = min(prefix.length, len(ids) - 1)  # the last token always runs, for its logits
        placed = self._place(segments, spans, contexts, exact, policy) if _reuses(policy) else []
        reused = [slot for p in placed for slot in p.slots]
        slots = torch.arange(len(ids), device=self.lm.device)
        reused_slots = torch.tensor(reused, dtype=torch.long, device=self.lm.device)
        computed = slots[exact:][~torch.isin(slots[exact:], reused_slots)]
        token_ids = torch.tensor(ids, device=self.lm.device)
        metas: dict[int, CraftMeta] = {}
        num_new = computed.numel()
        with placing(self.lm, self.store, usage, placed, kv, self.layer_loading, num_new) as load:
            if load is not None and policy != "reuse":  # loading controller (CacheBlend §5.1)
                ratio = controlled_ratio(ratio, load.layer_load_s, len(reused), load.token_layer_s)
            if load is not None:
                stats.extra["layer_loading"] = load.as_dict(ratio if policy != "reuse" else 0.0)
            if policy == "cachecraft":
                chunks = [i for i, segment in enumerate(segments) if segment.is_chunk]
                hits = {p.span.start for p in placed}
                fresh = [
                    i for i in chunks if spans[i].start >= exact and spans[i].start not in hits
                ]
                outcome = craft_recompute(
                    self.lm,
                    self.craft,
                    spans,
                    chunks,
                    fresh,
                    placed,
                    computed,
                    token_ids,
                    kv,
                    ratio,
                )
                result, metas = outcome.result, outcome.metas
                stats.extra["craft_cfo"] = [round(p.cfo, 4) for p in placed]
                stats.extra["craft_focus_layer"] = outcome.focus_layer
            else:
                ratio = {"reuse": 0.0, "cacheblend": ratio}.get(policy, 1.0)
                result = recompute(self.lm, kv, token_ids, computed, reused_slots, ratio)
        if policy == "cachecraft":  # once computed (a failed or rerun prefill reused nothing),
            count_reuses(placed)  # before this request's puts may evict by f_r
        if result.num_recomputed < len(reused):  # some reused KV kept as is: approximate
            exact_until = min(exact_until, min(reused))
        stats.reused_tokens = exact + len(reused) - result.num_recomputed
        stats.recomputed_tokens = result.num_recomputed
        stats.computed_tokens = computed.numel()
        placed_starts = {p.span.start for p in placed}
        stats.chunk_hits, stats.chunk_misses, stored = self._store(
            segments, starts, contexts, prefix, placed_starts, exact_until, kv, metas
        )
        layers = self.lm.spec.num_layers
        stats.extra["token_layer_share"] = result.token_layers / (len(ids) * layers)
        stats.extra["prefix_tokens"] = exact
        stats.ttft_s = time.perf_counter() - started
        logits = last_logits(self.lm, result.last_hidden)
        return Prefilled(ids, kv, logits, stats, exact_until), stored

    def decode(self, prefilled: Prefilled, params: SamplingParams) -> Iterator[int]:
        """Sample up to ``params.max_tokens`` tokens, extending ``prefilled.kv`` and ``ids``;
        fewer when the context window fills."""
        generator = None if params.seed is None else torch.Generator().manual_seed(params.seed)
        logits = prefilled.logits
        for step in range(params.max_tokens):
            token = sample_token(logits, params, generator)
            yield token
            if step + 1 == params.max_tokens or len(prefilled.ids) >= self.lm.spec.context_window:
                return  # the budget is spent, or the context window is full
            # One row: the batched step's matmul attention beats SDPA's CPU kernel ~2x here.
            logits = decode_step(self.lm, [token], [prefilled.kv])[0]
            prefilled.append(token)

    @property
    def max_conversations(self) -> int:
        """Conversations whose last sequences :meth:`remember` keeps at most."""
        return self.conversations.max_conversations

    @property
    def max_conversation_tokens(self) -> int:
        """KV tokens :meth:`remember` keeps at most, over every conversation."""
        return self.conversations.max_tokens

    def remember(self, conversation_id: str, prefilled: Prefilled) -> None:
        """Keep a conversation's last sequence (its KV's used slots only) so its next turn
        reuses it as a prefix, in place of the sequence it continues; the least recently
        used go over ``max_conversations`` or ``max_conversation_tokens``.  A sequence over
        ``max_conversation_tokens`` on its own is not kept, and the one it continues is
        dropped."""
        length = prefilled.kv.length
        # not copied out when it is too long to be kept
        kv = _trimmed(prefilled.kv) if length <= self.max_conversation_tokens else prefilled.kv
        past = Past(
            tuple(prefilled.ids[:length]),
            kv,
            min(prefilled.exact_until, length),
            prefilled.stats.prompt_tokens,
        )
        self.conversations.keep(self._memory_key(conversation_id), past)

    def remembered(self) -> dict[str, int]:
        """The KV tokens kept for each remembered conversation, least recently used first:
        keyed by conversation id (a salted one's: see :meth:`_memory_key`)."""
        return self.conversations.lengths()

    def _memory_key(self, conversation_id: str) -> str:
        """Where :attr:`conversations` keeps ``conversation_id`` of this namespace: the id
        itself unsalted, else the namespace, NUL, the id.  An unsalted id equal to a salted
        key would need the salt's digest, which only the salt gives: whoever holds the salt
        can send it."""
        if self.namespace == self.lm.fingerprint:
            return conversation_id
        return f"{self.namespace}\x00{conversation_id}"

    def _take_prefix(
        self,
        segments: Sequence[TokenSegment],
        ids: list[int],
        conversation_id: str | None,
        kv: SeqKV,
        exact_only: bool,
        places_chunks: bool,
    ) -> MatchedPrefix:
        """Copy the longest exact prefix, from the store or the conversation's past, into
        ``kv`` (a conversation's past may hold blended KV: its ``exact_until`` carries over,
        or with ``exact_only`` the past is taken up to it only).  A policy that
        ``places_chunks`` takes the past up to a stored chunk it would cover in part."""
        hits: list[KVVariant] = []
        context = ROOT_CONTEXT
        for segment in segments:
            variant = self.store.exact(self.namespace, segment.segment_id, context)
            if variant is None or variant.num_tokens != len(segment.ids):
                break
            hits.append(variant)
            context = extend_context(context, segment.segment_id)
        from_store = sum(variant.num_tokens for variant in hits)
        past, from_past = (
            self.conversations.longest_match(self._memory_key(conversation_id), ids)
            if conversation_id
            else (None, 0)
        )
        if past is not None and exact_only:  # promised exact KV
            from_past = min(from_past, past.exact_until)
        if past is not None and places_chunks:
            from_past = self._before_stored_chunk(segments, from_past)
        if past is not None and from_past > from_store:
            kv.k[:, :, :from_past] = past.kv.k[:, :, :from_past]
            kv.v[:, :, :from_past] = past.kv.v[:, :, :from_past]
            # Past its matched tokens the request computes its own: exact unless the past was not.
            exact_until = past.exact_until if past.exact_until < from_past else len(ids)
            return MatchedPrefix(from_past, exact_until, from_store)
        for variant in hits:
            kv.k[:, :, variant.start : variant.start + variant.num_tokens] = variant.k
            kv.v[:, :, variant.start : variant.start + variant.num_tokens] = variant.v
        return MatchedPrefix(from_store, len(ids), from_store)

    def _before_stored_chunk(self, segments: Sequence[TokenSegment], length: int) -> int:
        """``length`` tokens of a conversation's past, or fewer: back to the start of the
        chunk they end inside when the store holds that chunk.  The past often shares a next
        chunk's first tokens ("Fact 3"), and a chunk the prefix covers in part cannot be
        placed: its whole stored KV is worth more than those few exact tokens."""
        start = 0
        for segment in segments:
            end = start + len(segment.ids)
            if start < length < end:
                holds = holds_segment(self.store, self.namespace, segment.segment_id)
                return start if segment.is_chunk and holds else length
            start = end
        return length

    def _place(
        self,
        segments: Sequence[TokenSegment],
        spans: list[Span],
        contexts: list[str],
        exact: int,
        policy: Policy,
    ) -> list[PlacedChunk]:
        """Choose a stored variant for each chunk after the exact prefix (placed by
        :func:`~chunkcache.core.chunk_placing.placing`): the one computed in exactly this
        request's context when there is one, else the policy's choice."""
        placed: list[PlacedChunk] = []
        last_slot = spans[-1].end - 1
        for i, (segment, span) in enumerate(zip(segments, spans, strict=True)):
            if not segment.is_chunk or span.start < exact:
                continue
            variants = self.store.variants(self.namespace, segment.segment_id)
            variants = [v for v in variants if v.num_tokens == span.num_tokens]
            if not variants:
                continue
            candidates = [v for v in variants if v.context == contexts[i]] or variants
            variant, cfo = candidates[0], 0.0  # the most recently used
            if policy == "cachecraft":  # its reuse (f_r) is counted once the prefill ran
                variant, cfo = choose_variant(candidates, spans[:i], self.craft)
            reused = [slot for slot in range(span.start, span.end) if slot != last_slot]
            placed.append(PlacedChunk(span, variant, cfo, reused))
        return placed

    def _store(
        self,
        segments: Sequence[TokenSegment],
        starts: list[int],
        contexts: list[str],
        prefix: MatchedPrefix,
        placed_starts: set[int],
        exact_until: int,
        kv: SeqKV,
        metas: dict[int, CraftMeta],
    ) -> tuple[int, int, list[tuple[str, str]]]:
        """Store as variants the segments the store lacks: those computed fresh (chunks, and
        text whose KV is exact), and exact ones a conversation's past brought (its decoded
        answer: stored, a later request finds the whole history in the store even once the
        conversation is forgotten).  Returns chunk hits, misses, and the (segment id,
        context) of each variant stored."""
        hits = misses = 0
        fresh: list[tuple[str, str]] = []
        for segment, start, context in zip(segments, starts, contexts, strict=True):
            end = start + len(segment.ids)
            placed = start in placed_starts
            if segment.is_chunk:
                cached = placed or end <= prefix.length
                hits, misses = hits + cached, misses + (not cached)
            is_exact = end <= exact_until
            if placed or end <= prefix.in_store or not (segment.is_chunk or is_exact):
                continue  # in the store already, or approximate text
            if start < prefix.length and not is_exact:
                continue  # an approximate part of the past: stored in its own turn
            variant = KVVariant(
                segment.segment_id,
                context,
                start,
                is_exact,
                kv.k[:, :, start:end].clone(),
                kv.v[:, :, start:end].clone(),
                metas.get(start),
            )
            self.store.put(self.namespace, variant)
            fresh.append((segment.segment_id, context))
        return hits, misses, fresh


def _reuses(policy: Policy) -> bool:
    return policy in ("reuse", "cacheblend", "cachecraft")


def _layout(segments: Sequence[TokenSegment]) -> tuple[list[int], list[str]]:
    """Each segment's first slot and the hash of everything before it."""
    starts, contexts = [], []
    start, context = 0, ROOT_CONTEXT
    for segment in segments:
        starts.append(start)
        contexts.append(context)
        start += len(segment.ids)
        context = extend_context(context, segment.segment_id)
    return starts, contexts


def _trimmed(kv: SeqKV) -> SeqKV:
    """``kv``'s used slots without its spare capacity (copied out when it has some)."""
    if kv.capacity == kv.length:
        return SeqKV(kv.k, kv.v, kv.length)
    return SeqKV(kv.keys().clone(), kv.values().clone(), kv.length)
