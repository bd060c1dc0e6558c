"""The shared Redis tier: chunk KV shared between machines (DESIGN: Redis for scale-out).

Each entry is one blob (codec.pack: JSON header with checksum and fingerprint, then the
safetensors data) under ``chunkcache:v1:<ns>:<seg>:<ctx>``, every part a hash.  Capacity is
kept by the server: a Lua script stores the blob and, atomically, evicts the least recently
used entries (a global sorted set of access ticks) until the tier's bytes fit again, so any
number of clients on any number of machines share one bounded tier.  Local policies do not
apply here: no client sees the other clients' hits.

Reads are whole entries (every layer's checksum verified at once, codec.decode), never
layer by layer as on disk: a round trip per layer would cost more than it hides.

Redis going away never fails a request: the first connection error logs one warning and
marks the tier down; every call then misses at once, and after ``retry_after_s`` one call
probes the server again.  The first call the server answers after that tells
``up_listeners`` (the tiered store then writes what it could not write meanwhile).  A
connection error (not a timeout) the server answers a ping right after is one request it
refused (a blob over its ``proto-max-bulk-len`` closes the connection): that request
misses, counted, and the tier stays up.  A server that does not answer in the Redis protocol
(``redis_url`` at another service's port) is down the same way.  An entry larger than the
tier is not written.

A failure the server answers (out of memory under ``noeviction``, a read-only replica, a
refused script) misses that call, counted in ``num_errors``; it is logged as a warning the
first time, then at most every :data:`WARN_EVERY_S` per kind, since a full server refuses
every write of every request.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

import redis

from chunkcache.core.kv_store import KVVariant
from chunkcache.core.store import codec
from chunkcache.core.store.codec import CorruptEntryError, EntryKey
from chunkcache.core.store.tier import Evicted, Victim

log = logging.getLogger(__name__)
T = TypeVar("T")
WARN_EVERY_S = 600.0  # a failure that keeps coming back is logged this often

# What an operator can do about a failure; redis-py's messages say what, not why.
_HINTS: tuple[tuple[type[Exception], str], ...] = (
    (redis.AuthenticationError, "Redis refused the login: check user and password in redis_url"),
    (redis.InvalidResponse, "no answer in the Redis protocol: is redis_url a Redis server?"),
    (redis.OutOfMemoryError, "the server is at its maxmemory: keep redis_bytes below it"),
    (redis.ReadOnlyError, "a read-only replica: point redis_url at the primary"),
)

# A clock that is not a number, or gone (a ``maxmemory`` policy evicts any key), restarts
# above the newest tick: from 1, a new or touched entry would be the next victim.
_CLOCK = """
if not tonumber(redis.call('GET', clock)) then
  local newest = redis.call('ZRANGE', lru, -1, -1, 'WITHSCORES')[2]
  redis.call('SET', clock, math.floor(tonumber(newest) or 0))
end
"""

# Checks every key it will write before the first write (a script that fails midway keeps
# what it wrote): a key of the wrong type fails the put untouched; a byte total that is not a
# number, or gone, is rebuilt from the sizes hash.  When every other entry the sorted set
# lists is evicted and the total is still over, the rest is entries Redis evicted from the
# set or the sizes hash: no pick would ever reach them, so they are dropped and recounted.
_PUT = (
    """
local entry, segset, lru, sizes, total, clock = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6]
local blob, ctx, cap = ARGV[1], ARGV[2], tonumber(ARGV[3])
local size = string.len(blob)
if size > cap then return -1 end
local expected = {[segset] = 'set', [lru] = 'zset', [sizes] = 'hash', [total] = 'string',
                  [clock] = 'string'}
for key, kind in pairs(expected) do
  local found = redis.call('TYPE', key)['ok']
  if found ~= 'none' and found ~= kind then
    return redis.error_reply(key .. ' holds a ' .. found .. ', not a ' .. kind)
  end
end
if not tonumber(redis.call('GET', total)) then
  local sum = 0
  for _, v in ipairs(redis.call('HVALS', sizes)) do sum = sum + (tonumber(v) or 0) end
  redis.call('SET', total, sum)
end
"""
    + _CLOCK
    + """
local function drop(victim)
  redis.call('ZREM', lru, victim)
  redis.call('HDEL', sizes, victim)
  redis.call('DEL', victim)
  local cut = string.find(victim, ':[^:]*$')
  if cut then redis.call('SREM', string.sub(victim, 1, cut - 1), string.sub(victim, cut + 1)) end
end
local old = tonumber(redis.call('HGET', sizes, entry) or '0') or 0
redis.call('DECRBY', total, old)
redis.call('SET', entry, blob)
redis.call('SADD', segset, ctx)
redis.call('HSET', sizes, entry, size)
redis.call('ZADD', lru, redis.call('INCR', clock), entry)
local used = redis.call('INCRBY', total, size)
local evicted = 0
while used > cap do
  local victim = redis.call('ZRANGE', lru, 0, 0)[1]
  if victim == entry then
    for _, other in ipairs(redis.call('HKEYS', sizes)) do
      if other ~= entry then drop(other) end
    end
    redis.call('SET', total, size)
    break
  end
  local vsize = tonumber(redis.call('HGET', sizes, victim)) or redis.call('STRLEN', victim)
  drop(victim)
  used = redis.call('DECRBY', total, vsize)
  evicted = evicted + 1
end
return evicted
"""
)

_TOUCH = (
    """
local lru, clock = KEYS[1], KEYS[2]
if redis.call('ZSCORE', lru, ARGV[1]) then
"""
    + _CLOCK
    + """
  redis.call('ZADD', lru, redis.call('INCR', clock), ARGV[1])
end
return 0
"""
)

_REMOVE = """
local vsize = redis.call('HGET', KEYS[3], KEYS[1])
redis.call('DEL', KEYS[1])
redis.call('SREM', KEYS[2], ARGV[1])
redis.call('ZREM', KEYS[4], KEYS[1])
redis.call('HDEL', KEYS[3], KEYS[1])
if vsize then redis.call('DECRBY', KEYS[5], vsize) end
return 0
"""


class RedisTier:
    """Entries in a Redis server at ``url``, at most ``capacity_bytes`` (server-enforced)."""

    self_evicting = True  # the server picks victims; local policies do not apply

    def __init__(
        self,
        url: str,
        capacity_bytes: int,
        name: str = "redis",
        prefix: str = "chunkcache:v1",
        timeout_s: float = 1.0,
        retry_after_s: float = 30.0,
    ) -> None:
        if capacity_bytes < 1:
            raise ValueError(f"{name}: capacity_bytes must be positive")
        self.name = name
        self.capacity_bytes = capacity_bytes
        self.prefix = prefix
        self.retry_after_s = retry_after_s
        self.num_errors = 0
        self.num_evictions = 0
        self._client = redis.Redis.from_url(
            url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s
        )
        self._put = self._client.register_script(_PUT)
        self._touch = self._client.register_script(_TOUCH)
        self._remove = self._client.register_script(_REMOVE)
        self._down_since: float | None = None
        self._lock = threading.Lock()
        self._warned: dict[str, float] = {}  # error kind -> when it was last logged loud
        # called (no arguments, in the calling thread) when the server answers after being down
        self.up_listeners: list[Callable[[], None]] = []
        self._guard(self._client.ping, False)

    @property
    def up(self) -> bool:
        return self._down_since is None

    @property
    def num_bytes(self) -> int:
        """The tier's byte total; 0 while the counter is damaged (the next put rebuilds it)."""
        stored = self._guard(lambda: self._client.get(self._k("bytes")), None)
        try:
            return int(stored or 0)
        except ValueError:
            return 0

    def __len__(self) -> int:
        return int(self._guard(lambda: self._client.hlen(self._k("sizes")), 0))

    def __contains__(self, key: EntryKey) -> bool:
        # A key holding anything but a blob is no entry: a put replaces it.
        return self._guard(lambda: self._client.type(self._entry(key)), b"none") == b"string"

    def entry_keys(self) -> list[EntryKey]:
        return []  # the server chooses victims

    def segment_keys(self, namespace: str, segment: str) -> list[EntryKey]:
        members: set[bytes] = self._guard(
            lambda: self._client.smembers(self._k(namespace, segment)), set()
        )
        return [EntryKey(namespace, segment, m.decode()) for m in members if _is_hash(m)]

    def get(self, key: EntryKey, fingerprint: str) -> KVVariant | None:
        entry = self._entry(key)
        blob = self._guard(lambda: self._client.get(entry), None)
        if blob is None:
            return None
        try:
            data, header = codec.unpack(blob)
            variant = codec.decode(data, header, fingerprint, key)
        except CorruptEntryError:
            self.remove(key)
            raise
        self._guard(lambda: self._touch(keys=[self._k("lru"), self._k("clock")], args=[entry]), 0)
        return variant

    def put(
        self, key: EntryKey, fingerprint: str, variant: KVVariant, victim: Victim, evicted: Evicted
    ) -> bool:
        data, header = codec.encode(fingerprint, variant)
        blob = codec.pack(data, header)
        if len(blob) > self.capacity_bytes:  # it would evict every entry, then itself
            return False
        keys = [self._entry(key), self._k(key.namespace, key.segment)]
        keys += [self._k("lru"), self._k("sizes"), self._k("bytes"), self._k("clock")]
        args: list[bytes | str | int] = [blob, key.context, self.capacity_bytes]
        result = int(self._guard(lambda: self._put(keys=keys, args=args), -1))
        self.num_evictions += max(0, result)
        return result >= 0

    def remove(self, key: EntryKey) -> None:
        keys = [self._entry(key), self._k(key.namespace, key.segment), self._k("sizes")]
        keys += [self._k("lru"), self._k("bytes")]
        self._guard(lambda: self._remove(keys=keys, args=[key.context]), 0)

    def close(self) -> None:
        self._client.close()

    def _k(self, *parts: str) -> str:
        return ":".join((self.prefix, *parts))

    def _entry(self, key: EntryKey) -> str:
        return self._k(key.namespace, key.segment, key.context)

    def _guard(self, call: Callable[[], Any], default: T) -> Any | T:
        """``call()``, or ``default`` when the server is (or just went) away."""
        with self._lock:
            down = self._down_since
            if down is not None and time.monotonic() - down < self.retry_after_s:
                return default
        try:
            result = call()
        except (redis.ConnectionError, redis.TimeoutError, redis.InvalidResponse, OSError) as error:
            self.num_errors += 1
            # A closed connection the server answers a ping right after was this request's
            # alone (too big); after a timeout every request would wait as long: down.
            if not isinstance(error, redis.TimeoutError | TimeoutError) and self._answers():
                self._warn(error)
                return default
            with self._lock:
                if self._down_since is None:
                    log.warning(
                        "Redis tier %s is down (%s%s): using the local tiers",
                        self.name,
                        error,
                        _hint(error),
                    )
                self._down_since = time.monotonic()
            return default
        except redis.RedisError as error:
            self.num_errors += 1
            self._warn(error)
            return default
        with self._lock:
            back = self._down_since is not None
            self._down_since = None
        if back:
            log.warning("Redis tier %s is back", self.name)
            for listener in self.up_listeners:
                listener()
        return result

    def _warn(self, error: Exception) -> None:
        """Log a failure of one call: a warning the first time of its kind, and again after
        :data:`WARN_EVERY_S`; debug in between (``num_errors`` counts every one)."""
        kind, now = type(error).__name__, time.monotonic()
        with self._lock:
            last = self._warned.get(kind)
            loud = last is None or now - last >= WARN_EVERY_S
            if loud:
                self._warned[kind] = now
        level = logging.WARNING if loud else logging.DEBUG
        log.log(level, "Redis tier %s: %s%s", self.name, error, _hint(error))

    def _answers(self) -> bool:
        """Whether the server answers a ping now, after a request failed: a server that
        closes the connection on one oversized request is not down."""
        try:
            return bool(self._client.ping())
        except (redis.RedisError, OSError):
            return False


def _hint(error: Exception) -> str:
    """``"; "`` and what to do about ``error``, or nothing when there is no advice."""
    return next((f"; {hint}" for kind, hint in _HINTS if isinstance(error, kind)), "")


def _is_hash(member: bytes) -> bool:
    """Whether a segment set's member is a context hash (anything else is not ours)."""
    return member.isascii() and member.isalnum()
