"""Put reused chunk KV into a request's merged KV, layer by layer, ahead of compute.

Every placed chunk's keys move to their new positions (a RoPE rotation by the position
shift, CacheBlend §3) and its values are copied, one layer at a time.  Without layer-wise
loading every layer is placed before compute starts.  With it, a background
:class:`~chunkcache.core.store.loading.LayerLoader` places layer ``l + 1 ...`` while layer
``l`` computes, at most the preload depth of Cache-Craft Algorithm 2 (Eq. 16) ahead, and
the merged KV makes each layer wait for its own (:attr:`SeqKV.before_layer`).  Both give
the same bits: each layer is placed by the same operations either way.

A disk hit arrives as a :class:`~chunkcache.core.store.lazy.LazyKVVariant` whose layers
are still on disk: the placement reads each layer (and verifies its checksum) right before
rotating and copying it, so with layer-wise loading the disk read of layer ``l + 1`` runs
in the loader thread while layer ``l`` computes. Such a request is pipelined by default
when the model computes off the CPU (:func:`pipelines_lower_tier_reads`). A layer that
fails its checksum raises ``CorruptEntryError`` from the layer's wait, before that layer
is computed, and so does a layer the disk fails to read (``LayerReadError``); the engine
then runs the request again without the entry.

T_load is this request's measured seconds reading lower tiers (disk, Redis) plus the reads
still pending (their bytes over the tier's measured bandwidth), and T_prefill the store's
profile estimate of the prefill (RAGCache's cost model), so the depth follows what the
request actually loads.  The engine hands both to CacheBlend's loading controller
(§5.1), which raises the recompute ratio to what one layer's load hides.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from chunkcache.core.craft_plan import PlacedChunk
from chunkcache.core.kv_store import KVStore
from chunkcache.core.models import LoadedModel
from chunkcache.core.store.hooks import load_profile, preload_depth
from chunkcache.core.store.lazy import LazyKVVariant
from chunkcache.core.store.loading import LayerLoader
from chunkcache.core.store.metrics import StoreUsage
from chunkcache.core.store.tiered import TieredKVStore
from chunkcache.kernels.kv import SeqKV


@dataclass(frozen=True)
class LoadReport:
    """How one request's chunk KV was placed, and the controller's inputs."""

    depth: int  # layers placed ahead of compute (Cache-Craft Eq. 16)
    load_s: float  # seconds this request spent reading lower tiers, and will (estimated)
    prefill_s: float  # the store's estimate of the prefill's seconds
    layer_load_s: float  # load_s per layer
    token_layer_s: float  # estimated seconds of one token through one layer

    def as_dict(self, ratio: float) -> dict[str, Any]:
        """The report for ``stats.extra``, with the ratio the controller chose."""
        return {
            "depth": self.depth,
            "load_s": round(self.load_s, 6),
            "prefill_s": round(self.prefill_s, 6),
            "ratio": ratio,
        }


def place_layers(lm: LoadedModel, placed: Sequence[PlacedChunk], kv: SeqKV, layers: slice) -> None:
    """Put ``layers`` of every placed chunk's stored KV at the chunk's new slots (the same
    bits whether placed a layer at a time or all at once: the rotation is elementwise)."""
    for p in placed:
        variant, span = p.variant, p.span
        stored_k, stored_v = variant.layers(layers)  # a lazy variant reads them here
        # stored_k: [L', H_kv, n, D] rotated at variant.start..; moved to span.start..
        lm.rope.shift(
            stored_k, span.start - variant.start, out=kv.k[layers, :, span.start : span.end]
        )
        kv.v[layers, :, span.start : span.end].copy_(stored_v)


def pending_seconds(store: KVStore, pending: Sequence[LazyKVVariant]) -> float:
    """Estimated seconds to read the layers of ``pending`` not read yet: their bytes over
    each tier's measured bandwidth (CacheBlend §5.1's T_load; 0 for a tier never read)."""
    if not isinstance(store, TieredKVStore):
        return 0.0
    bandwidth = store.load_bandwidth()
    return sum(v.pending_bytes / bandwidth[v.tier] for v in pending if v.tier in bandwidth)


def pipelines_lower_tier_reads(device: torch.device) -> bool:
    """Whether ``layer_loading=None`` pipelines a request that reads from a lower tier,
    for a model computing on ``device``: only off the CPU.

    On a CPU the loader thread's reads, checksums, rotations and copies take the cores the
    compute needs, so overlapping them hides nothing: the store benchmark measured the
    pipelined disk hit at about 1.3x the TTFT of reading it whole first on a 2-core host
    (docs/benchmarks/store.md).  Beside a GPU the same work runs on otherwise idle cores.
    """
    return device.type != "cpu"


@contextmanager
def placing(
    lm: LoadedModel,
    store: KVStore,
    usage: StoreUsage,
    placed: Sequence[PlacedChunk],
    kv: SeqKV,
    layer_loading: bool | None,
    num_new: int,
) -> Iterator[LoadReport | None]:
    """Place ``placed`` into ``kv`` for the compute inside the ``with``.

    ``layer_loading`` None pipelines when the request read entries from a lower tier or
    still has layers to read from one and the model is not on the CPU
    (:func:`pipelines_lower_tier_reads`), True always, False never (every layer is read and
    placed before compute).  Yields the :class:`LoadReport` when pipelined, else None.
    """
    num_layers = lm.spec.num_layers
    reused = sum(len(p.slots) for p in placed)
    load_s, token_s = load_profile(store, usage, reused, num_new)
    pending = [p.variant for p in placed if isinstance(p.variant, LazyKVVariant)]
    load_s += pending_seconds(store, pending)
    if layer_loading is None:
        lower = load_s > 0 or any(v.pending_bytes for v in pending)
        layer_loading = lower and pipelines_lower_tier_reads(lm.device)
    pipelined = bool(placed) and layer_loading
    if not pipelined:
        place_layers(lm, placed, kv, slice(None))
        yield None
        return
    prefill_s = token_s * num_new
    # No prefill profile yet (a new store): Eq. 16 would read T_prefill = 0 and preload every
    # layer, hiding nothing; load one ahead instead (compute waits if a read is late).
    depth = preload_depth(num_layers, prefill_s, load_s) if prefill_s > 0 else 1

    def load(layer: int) -> None:
        place_layers(lm, placed, kv, slice(layer, layer + 1))

    with LayerLoader(load, num_layers, depth) as loader:
        kv.before_layer = loader.wait
        try:
            yield LoadReport(depth, load_s, prefill_s, load_s / num_layers, token_s / num_layers)
        finally:
            kv.before_layer = None
