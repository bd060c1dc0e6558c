"""StoreSettings: defaults, environment, file, and the store they build."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pydantic import ValidationError
from test_store_support import FP, make_variant, same_kv

from chunkcache.core.store import DiskTier, MemoryTier, TieredKVStore
from chunkcache.core.store.settings import GiB, StoreSettings


def test_defaults(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("CHUNKCACHE_HOME", str(tmp_path))
    settings = StoreSettings()
    assert (settings.host_bytes, settings.disk_bytes) == (4 * GiB, 32 * GiB)
    assert settings.redis_url is None and settings.policy == "pgdsf"
    assert settings.resolved_disk_dir() == tmp_path / "kv"


def test_environment_beats_file(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    toml = tmp_path / "store.toml"
    toml.write_text('host_bytes = 1000\npolicy = "lfu"\ndisk_dir = "/somewhere"\n')
    monkeypatch.setenv("CHUNKCACHE_STORE_POLICY", "cachecraft")
    settings = StoreSettings.from_file(toml)
    assert (settings.host_bytes, settings.policy) == (1000, "cachecraft")
    assert settings.disk_dir == Path("/somewhere")
    assert StoreSettings.from_file(toml, host_bytes=5).host_bytes == 5


def test_json_file_named_by_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    config = tmp_path / "store.json"
    config.write_text(json.dumps({"disk_bytes": 0, "redis_bytes": 7}))
    monkeypatch.setenv("CHUNKCACHE_STORE_CONFIG", str(config))
    settings = StoreSettings()
    assert (settings.disk_bytes, settings.redis_bytes) == (0, 7)


def test_bad_values_are_refused() -> None:
    with pytest.raises(ValidationError):
        StoreSettings(policy="fifo")  # type: ignore[arg-type]
    with pytest.raises(ValidationError):
        StoreSettings(host_bytes=-1)


def test_from_settings_builds_the_tiers(tmp_path: Path) -> None:
    store = TieredKVStore.from_settings(
        host_bytes=10_000, disk_bytes=10**6, disk_dir=tmp_path, policy="lru"
    )
    assert [type(t) for t in store.tiers] == [MemoryTier, DiskTier]  # no CUDA here
    assert store.policy_name == "lru" and store.write_through
    a = make_variant("a")
    store.put(FP, a)
    store.flush()  # written through to disk in the background
    again = TieredKVStore.from_settings(host_bytes=0, disk_bytes=10**6, disk_dir=tmp_path)
    assert [t.name for t in again.tiers] == ["disk"]
    assert same_kv(again.exact(FP, "a", "root"), a)
    store.close()
    with pytest.raises(ValueError, match="every tier is off"):
        TieredKVStore.from_settings(host_bytes=0, disk_bytes=0, device_bytes=0)
