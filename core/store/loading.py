"""CacheBlend's loading controller (§5.1): recompute what the KV loading hides anyway.

Selective recompute of layer l runs while layer l+1's KV loads, so recomputing more tokens
costs no extra time as long as it takes no longer than the load.  The controller picks the
recompute ratio r with T_recompute(r) = T_load, and never less than the ratio below which
quality drops (15% in CacheBlend's Figure 16).  Conversely, for a fixed ratio it picks the
cheapest storage whose load still hides behind the recompute (Figure 10b).

Estimates: T_load of one layer = the layer's bytes / the tier's measured bandwidth
(:meth:`TieredKVStore.load_bandwidth`); T_recompute(r) of one layer = r x tokens x seconds
per token-layer (measured from prefills: prefill seconds / (tokens x layers)).
"""

from __future__ import annotations

import contextvars
import threading
from collections.abc import Callable, Mapping, Sequence

MIN_RECOMPUTE_RATIO = 0.15  # CacheBlend §5.1 / Figure 16


def layer_load_seconds(layer_bytes: int, bandwidth: float) -> float:
    """T_load(LLM, L, device): one layer's KV bytes over the device's bytes per second."""
    if bandwidth <= 0:
        raise ValueError("bandwidth must be positive")
    return layer_bytes / bandwidth


def hidden_recompute_ratio(
    load_s: float,
    num_tokens: int,
    token_layer_s: float,
    min_ratio: float = MIN_RECOMPUTE_RATIO,
    max_ratio: float = 1.0,
) -> float:
    """The recompute ratio whose per-layer recompute of ``num_tokens`` reused tokens takes
    as long as loading one layer (``load_s``), at least ``min_ratio``, at most ``max_ratio``."""
    if num_tokens <= 0 or token_layer_s <= 0:
        return min_ratio
    hidden = load_s / (num_tokens * token_layer_s)
    return min(max_ratio, max(min_ratio, hidden))


def cheapest_hiding_tier(
    tiers: Sequence[str],
    layer_bytes: int,
    bandwidth: Mapping[str, float],
    recompute_s: float,
) -> str | None:
    """Of ``tiers`` (fastest and dearest first), the last whose one-layer load still hides
    behind one layer's recompute (``recompute_s``); None if none does (Figure 10b)."""
    chosen = None
    for name in tiers:
        speed = bandwidth.get(name)
        if speed is not None and layer_load_seconds(layer_bytes, speed) <= recompute_s:
            chosen = name
    return chosen


def controlled_ratio(
    ratio: float, layer_load_s: float, num_reused: int, token_layer_s: float
) -> float:
    """The loading controller for one request (§5.1): ``ratio``, raised to what loading one
    layer (``layer_load_s``) hides anyway, never lowered; 0 (no recompute asked) stays 0."""
    if ratio <= 0 or layer_load_s <= 0:
        return ratio
    return max(ratio, hidden_recompute_ratio(layer_load_s, num_reused, token_layer_s, ratio))


class LayerLoader:
    """Runs ``load(layer)`` for every layer on a background thread, at most ``depth`` layers
    ahead of compute (Cache-Craft Algorithm 2, §3.5: before layer ``i`` computes, layers
    ``i .. i + L_p`` are loaded): layers ``0..depth`` may load before the first layer runs,
    and layer ``l + depth`` while layer ``l`` runs, so even ``depth`` 1 loads layer ``l + 1``
    behind layer ``l``'s compute.

    Use as a context manager; call :meth:`wait` before running each layer.  An error in
    ``load`` is raised from :meth:`wait`.  ``max_lead`` is the most layers ever loaded
    beyond the one computing (never more than ``depth``).  The thread runs in a copy of the
    creating thread's context, so a request's store counts (``StoreMetrics.track``) see the
    reads it makes.
    """

    def __init__(self, load: Callable[[int], None], num_layers: int, depth: int) -> None:
        if not 1 <= depth <= num_layers:
            raise ValueError(f"depth must be in [1, {num_layers}], got {depth}")
        self.load, self.num_layers, self.depth = load, num_layers, depth
        self.loaded = 0  # layers 0..loaded-1 are in place
        self.computing = 0  # the layer compute waits for or runs
        self.max_lead = 0
        self._error: BaseException | None = None
        self._stop = False
        self._cond = threading.Condition()
        context = contextvars.copy_context()
        self._thread = threading.Thread(
            target=context.run, args=(self._run,), name="chunkcache-layer-loader"
        )

    def __enter__(self) -> LayerLoader:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        self._thread.join()

    def wait(self, layer: int) -> None:
        """Block until ``layer`` is loaded; from now on the loader may run ``depth`` ahead."""
        with self._cond:
            self.computing = max(self.computing, layer)
            self._cond.notify_all()
            while self.loaded <= layer and self._error is None:
                self._cond.wait()
            if self.loaded <= layer and self._error is not None:
                raise self._error

    def _run(self) -> None:
        for layer in range(self.num_layers):
            with self._cond:
                while layer > self.computing + self.depth and not self._stop:
                    self._cond.wait()
                if self._stop:
                    return
                self.max_lead = max(self.max_lead, layer - self.computing)
            try:
                self.load(layer)
            except BaseException as error:  # handed to the computing thread
                with self._cond:
                    self._error = error
                    self._cond.notify_all()
                return
            with self._cond:
                self.loaded = layer + 1
                self._cond.notify_all()
