"""A chunk variant whose metadata is known at once and whose layers are read on first use.

A disk hit (:meth:`DiskTier.open_lazy`) reads only the entry's JSON header; the tensors stay
on disk until someone asks for a layer.  Reused chunk KV is placed layer by layer ahead of
compute (:mod:`chunkcache.core.chunk_placing`), so the placement thread reads layer ``l + 1``
from disk while layer ``l`` computes and the disk read hides behind compute, not only the
copy (Cache-Craft §3.4.2, Algorithm 2).  Each layer's checksum is verified before the layer is
handed out (:func:`codec.check_layer`), so a flipped byte in layer 20 raises
:class:`CorruptEntryError` before layer 20 is placed, never after an answer used it.  A layer
the disk fails to read (``OSError``) raises :class:`LayerReadError`: the tier's I/O error,
not corruption, but a ``CorruptEntryError`` all the same, because the request has no miss to
fall back on by then (the store drops the entry and the engine runs the request again).

Anyone who touches :attr:`k` or :attr:`v` directly (a prefix copy, a non-pipelined placement)
gets the whole variant: every layer not read yet is read first.  When the last layer is in,
:attr:`LazyEvents.complete` receives an ordinary in-memory :class:`KVVariant` of the same
buffers (the store promotes it to the host tier).

Measured (SmolLM2 bf16, 30 layers, entries of 256 tokens, page cache, one thread, 2026-11 on
this shared 2-core machine): reading entries layer by layer costs what reading them whole
does (about 3 ms per MB, mostly blake2b and the copy).  Behind compute those reads compete
for the same two cores, so a pipelined disk hit was not faster than reading whole first
(cacheblend 0.15 with the ratio held, 5 chunks: TTFT medians 1.27 s vs 1.24 s, host hits
1.08 s; noisy under load ~2.9).  The overlap pays where a read waits on I/O or another
device rather than on the CPU that computes.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor

from chunkcache.core.craft import CraftMeta
from chunkcache.core.kv_store import KVVariant, ReuseCount
from chunkcache.core.store import codec
from chunkcache.core.store.codec import CorruptEntryError


class LayerSource(Protocol):
    """Where a lazy variant's layers come from (:class:`~.layer_file.LayerFile`)."""

    def read(self, layer: int, k: Tensor, v: Tensor) -> None:
        """Fill ``k``, ``v`` (``[H_kv, n, D]``) with layer ``layer``, verified."""
        ...

    def close(self) -> None: ...


class LayerReadError(CorruptEntryError):
    """A layer the tier failed to read mid-prefill; ``cause`` is the tier's ``OSError``.

    The engine reruns a request on any :class:`CorruptEntryError`; the store counts this one
    as the tier's I/O error, not as a corrupt entry.
    """

    def __init__(self, layer: int, cause: OSError) -> None:
        super().__init__(f"layer {layer} unreadable: {cause}")
        self.cause = cause


@dataclass(frozen=True)
class LazyEvents:
    """What the store hears from a lazy variant (called on the reading thread)."""

    read: Callable[[float, int], None]  # one layer read: seconds, bytes
    complete: Callable[[KVVariant], None]  # every layer read: the whole variant
    # a layer failed its checksum, or its read (a LayerReadError): the entry is unusable
    failed: Callable[[CorruptEntryError], None]


class LazyKVVariant(KVVariant):
    """A :class:`KVVariant` read from ``source`` layer by layer (see the module docstring).

    ``shape`` is ``[L, H_kv, n, D]``; ``tier`` names the tier it is read from.
    """

    def __init__(
        self,
        segment_id: str,
        context: str,
        start: int,
        exact: bool,
        meta: CraftMeta | None,
        reuse: ReuseCount,
        shape: list[int],
        dtype: torch.dtype,
        source: LayerSource,
        tier: str,
        events: LazyEvents,
    ) -> None:
        for name, value in (
            ("segment_id", segment_id),
            ("context", context),
            ("start", start),
            ("exact", exact),
            ("meta", meta),
            ("reuse", reuse),
        ):
            object.__setattr__(self, name, value)  # a frozen dataclass's fields, k/v aside
        object.__setattr__(self, "tier", tier)
        object.__setattr__(self, "_shape", list(shape))
        # _k, _v: [L, H_kv, n, D], filled as layers are read
        object.__setattr__(self, "_k", torch.empty(shape, dtype=dtype))
        object.__setattr__(self, "_v", torch.empty(shape, dtype=dtype))
        object.__setattr__(self, "_read", [False] * shape[0])
        object.__setattr__(self, "_source", source)
        object.__setattr__(self, "_events", events)
        object.__setattr__(self, "_error", None)
        object.__setattr__(self, "_lock", threading.Lock())

    @classmethod
    def from_header(
        cls,
        header: dict[str, Any],
        reuse: ReuseCount,
        source: LayerSource,
        tier: str,
        events: LazyEvents,
    ) -> LazyKVVariant:
        """The variant a verified codec ``header`` describes, sharing the counter ``reuse``."""
        return cls(
            str(header["segment_id"]),
            str(header["context"]),
            int(header["start"]),
            bool(header["exact"]),
            codec.meta_of(header),
            reuse,
            [int(n) for n in header["shape"]],
            codec.dtype_of(header),
            source,
            tier,
            events,
        )

    tier: str
    _shape: list[int]
    _k: Tensor
    _v: Tensor
    _read: list[bool]
    _source: LayerSource
    _events: LazyEvents
    _error: CorruptEntryError | None
    _lock: threading.Lock

    @property
    def k(self) -> Tensor:
        """Every layer's keys (reads what is not read yet)."""
        return self.layers(slice(None))[0]

    @property
    def v(self) -> Tensor:
        """Every layer's values (reads what is not read yet)."""
        return self.layers(slice(None))[1]

    @property
    def num_tokens(self) -> int:
        return self._shape[2]

    @property
    def num_bytes(self) -> int:
        return 2 * self._k.numel() * self._k.element_size()

    @property
    def layers_read(self) -> int:
        """How many layers were read so far."""
        return sum(self._read)

    @property
    def pending_bytes(self) -> int:
        """Bytes still on disk (k and v of the layers not read yet)."""
        return (len(self._read) - self.layers_read) * self.num_bytes // len(self._read)

    def layers(self, layers: slice) -> tuple[Tensor, Tensor]:
        """k and v of ``layers`` (``[L', H_kv, n, D]``), read and verified first if needed."""
        with self._lock:
            for layer in range(*layers.indices(len(self._read))):
                if not self._read[layer]:
                    self._read_layer(layer)
        return self._k[layers], self._v[layers]

    def __repr__(self) -> str:  # the dataclass repr would read every layer
        return (
            f"LazyKVVariant(segment_id={self.segment_id!r}, context={self.context!r}, "
            f"start={self.start}, exact={self.exact}, shape={self._shape}, tier={self.tier!r}, "
            f"layers_read={self.layers_read})"
        )

    def _fail(self, error: CorruptEntryError) -> None:
        """Every later read raises ``error``; the store drops the entry."""
        object.__setattr__(self, "_error", error)
        self._source.close()
        self._events.failed(error)

    def _read_layer(self, layer: int) -> None:
        if self._error is not None:
            raise self._error
        started = time.perf_counter()
        try:
            self._source.read(layer, self._k[layer], self._v[layer])
        except CorruptEntryError as error:
            self._fail(error)
            raise
        except OSError as failed:  # mid-prefill there is no miss to fall back on
            unreadable = LayerReadError(layer, failed)
            self._fail(unreadable)
            raise unreadable from failed
        self._read[layer] = True
        self._events.read(time.perf_counter() - started, self.num_bytes // len(self._read))
        if all(self._read):
            self._source.close()
            self._events.complete(
                KVVariant(
                    self.segment_id,
                    self.context,
                    self.start,
                    self.exact,
                    self._k,
                    self._v,
                    self.meta,
                    self.reuse,
                )
            )
