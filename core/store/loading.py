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

from collections.abc import Mapping, Sequence

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
