"""The tiered chunk-KV store: device/host/disk/Redis tiers, eviction policies, persistence.

``TieredKVStore.from_settings()`` builds the configured store; see docs/store.md.
Importing this package needs torch, safetensors and filelock (the ``engine`` extra); the
Redis tier needs the ``redis`` extra only when it is used.
"""

from chunkcache.core.store.codec import CorruptEntryError, EntryKey, entry_key
from chunkcache.core.store.cost import PrefillCostModel
from chunkcache.core.store.disk import DiskTier
from chunkcache.core.store.metrics import StoreUsage, delta
from chunkcache.core.store.policies import POLICIES, EntryStats, EvictionPolicy, make_policy
from chunkcache.core.store.tier import MemoryTier, Tier
from chunkcache.core.store.tiered import TieredKVStore

__all__ = [
    "POLICIES",
    "CorruptEntryError",
    "DiskTier",
    "EntryKey",
    "EntryStats",
    "EvictionPolicy",
    "MemoryTier",
    "PrefillCostModel",
    "StoreUsage",
    "Tier",
    "TieredKVStore",
    "delta",
    "entry_key",
    "make_policy",
]
