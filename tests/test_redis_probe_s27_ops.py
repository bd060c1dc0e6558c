"""The Redis tier against servers an operator meets: full under ``noeviction``, a read-only
replica, a password it was not given, and a port where no Redis listens."""

from __future__ import annotations

import logging
import socketserver
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from test_store_support import FP, make_variant, same_kv

from chunkcache.core.errors import UsageError
from chunkcache.core.store import MemoryTier, TieredKVStore
from chunkcache.core.store.redis_server import REDIS_SERVER, redis_server
from chunkcache.core.store.redis_tier import RedisTier
from chunkcache.core.store.settings import StoreSettings

pytestmark = pytest.mark.skipif(
    REDIS_SERVER is None, reason="redis-server is not installed (apt-get install redis-server)"
)

TIER_LOG = "chunkcache.core.store.redis_tier"
PASSWORD = "s3cret-Pw-27"


@pytest.fixture
def url(tmp_path: Path) -> Iterator[str]:
    with redis_server(tmp_path) as (running, _):
        yield running


def tier_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    records = [r for r in caplog.records if r.name == TIER_LOG]
    return [r.getMessage() for r in records if r.levelno >= logging.WARNING]


def test_a_full_noeviction_server_is_one_warning_and_loses_no_local_entry(
    url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Redis at its ``maxmemory`` under the default ``noeviction`` refuses every write (the
    put script, and the touch a hit runs): each is counted, the requests go on from the local
    tier, what Redis held is still served, and the log gets one warning, not one a request."""
    caplog.set_level(logging.DEBUG, logger=TIER_LOG)
    client = redis.Redis.from_url(url)
    tier = RedisTier(url, 10**8, retry_after_s=3600)
    store = TieredKVStore([MemoryTier("host", 10**6), tier], write_through=True)
    first = make_variant("first")
    store.put(FP, first)
    store.flush()
    client.config_set("maxmemory", int(client.info("memory")["used_memory"]) - 1000)
    variants = [make_variant(f"s{i}", seed=i) for i in range(8)]
    for variant in variants:
        store.put(FP, variant)
    store.flush()
    reader = TieredKVStore([RedisTier(url, 10**8, retry_after_s=3600)])
    for _ in range(3):
        assert same_kv(reader.exact(FP, "first", "root"), first)  # touch refused, still served
    assert all(same_kv(store.exact(FP, v.segment_id, "root"), v) for v in variants)
    assert reader.exact(FP, "s0", "root") is None
    assert tier.up and tier.num_errors == len(variants)
    warnings = tier_warnings(caplog)
    assert len(warnings) == 2, warnings  # one from each process's tier
    assert all("maxmemory" in w for w in warnings)


def test_a_read_only_replica_warns_once_and_serves_reads(
    url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """``redis_url`` naming a replica: writes fail (``READONLY``), reads are served."""
    caplog.set_level(logging.DEBUG, logger=TIER_LOG)
    client = redis.Redis.from_url(url)
    writer = TieredKVStore([RedisTier(url, 10**8, retry_after_s=3600)])
    kept = make_variant("kept")
    writer.put(FP, kept)
    client.config_set("replica-read-only", "yes")
    client.execute_command("REPLICAOF", "127.0.0.1", "1")  # a primary that is never there
    tier = RedisTier(url, 10**8, retry_after_s=3600)
    store = TieredKVStore([MemoryTier("host", 10**6), tier], write_through=True)
    for i in range(5):
        store.put(FP, make_variant(f"s{i}", seed=i))
    store.flush()
    assert same_kv(TieredKVStore([tier]).exact(FP, "kept", "root"), kept)
    assert tier.up and tier.num_errors >= 5
    assert len(tier_warnings(caplog)) == 1


class _NotRedis(socketserver.BaseRequestHandler):
    """A server of another protocol that keeps the connection (memcached answers so)."""

    def handle(self) -> None:
        while self.request.recv(65536):
            self.request.sendall(b"ERROR\r\n")


@pytest.fixture
def not_redis() -> Iterator[str]:
    server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), _NotRedis)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"redis://127.0.0.1:{server.server_address[1]}/0"
    finally:
        server.shutdown()
        server.server_close()


def test_a_port_that_does_not_speak_redis_is_a_down_tier(
    not_redis: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A ``redis_url`` at, say, memcached's port: the tier is down (probed again after
    ``retry_after_s``), not up and failing, and warning, at every call of every request."""
    caplog.set_level(logging.DEBUG, logger=TIER_LOG)
    tier = RedisTier(not_redis, 10**8, retry_after_s=3600)
    store = TieredKVStore([MemoryTier("host", 10**6), tier], write_through=True)
    for i in range(3):
        variant = make_variant(f"s{i}", seed=i)
        store.put(FP, variant)
        store.flush()
        assert same_kv(store.exact(FP, f"s{i}", "root"), variant)
        assert store.variants(FP, f"other{i}") == []
    assert not tier.up and tier.num_errors == 1
    (warning,) = tier_warnings(caplog)
    assert "down" in warning and "Redis server" in warning


@pytest.mark.parametrize("given", ["none", "wrong", "wrong-user"])
def test_a_login_the_server_refuses_is_a_clear_down_tier_without_the_password(
    url: str, given: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    redis.Redis.from_url(url).config_set("requirepass", PASSWORD)
    host = url.removeprefix("redis://")
    wrong = "wrong-" + PASSWORD
    bad = {
        "none": url,
        "wrong": f"redis://:{wrong}@{host}",
        "wrong-user": f"redis://bob:{PASSWORD}@{host}",
    }
    tier = RedisTier(bad[given], 10**8, retry_after_s=3600)
    store = TieredKVStore([MemoryTier("host", 10**6), tier], write_through=True)
    store.put(FP, make_variant("a"))
    store.flush()
    assert store.exact(FP, "a", "root") is not None and not tier.up
    (warning,) = tier_warnings(caplog)
    assert "password" in warning and "redis_url" in warning
    logged = "\n".join(r.getMessage() for r in caplog.records)
    assert PASSWORD not in logged and wrong not in logged
    good = RedisTier(f"redis://:{PASSWORD}@{host}", 10**8, retry_after_s=3600)
    assert good.up and TieredKVStore([good]).variants(FP, "a") == []


@pytest.mark.parametrize(
    ("secret_url", "shown_url"),
    [
        (f"redis://:{PASSWORD}@cache:6379/0", "redis://:***@cache:6379/0"),
        (f"rediss://app:{PASSWORD}@cache:6380/1", "rediss://app:***@cache:6380/1"),
        (
            f"redis://cache:6379/0?password={PASSWORD}&db=2",
            "redis://cache:6379/0?password=***&db=2",
        ),
        (f"unix:///run/redis.sock?password={PASSWORD}", "unix:///run/redis.sock?password=***"),
        ("redis://cache:6379/0", "redis://cache:6379/0"),
    ],
)
def test_printed_settings_never_show_the_redis_password(secret_url: str, shown_url: str) -> None:
    """Settings printed to debug a deployment, or captured with a traceback's locals by an
    error reporter, keep the password out; the store still connects with it."""
    settings = StoreSettings(redis_url=secret_url)
    for shown in (repr(settings), str(settings)):
        assert PASSWORD not in shown and f"redis_url='{shown_url}'" in shown
    assert settings.redis_url == secret_url


@pytest.mark.parametrize("char", ["/", "?", "#"])
def test_a_password_that_splits_the_url_is_named_not_the_port(char: str) -> None:
    """A generated password holding / ? or # ends the URL's host part early: the error says
    to percent-encode it (it used to blame the port the operator wrote), never quoting it."""
    secret = f"ab{char}{PASSWORD}"
    with pytest.raises(UsageError) as refused:
        StoreSettings(redis_url=f"redis://app:{secret}@cache:6379/0")
    message = str(refused.value)
    assert "percent-encode" in message and "port" not in message and PASSWORD not in message
    encoded = secret.replace(char, {"/": "%2F", "?": "%3F", "#": "%23"}[char])
    assert StoreSettings(redis_url=f"redis://app:{encoded}@cache:6379/0").redis_url
