"""The tiered chunk-KV store: device, host, disk and Redis tiers behind :class:`KVStore`."""
