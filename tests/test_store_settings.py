"""StoreSettings: defaults, environment, file, and the store they build."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pydantic import ValidationError
from test_store_support import FP, make_variant, same_kv

from chunkcache.core.cli import main
from chunkcache.core.errors import UsageError
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


@pytest.mark.parametrize("name", ["CHUNKCACHE_STORE_DISKDIR", "chunkcache_store_host_byte"])
def test_a_misspelt_variable_is_refused(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A misspelt DISK_DIR would otherwise put the cache somewhere else."""
    monkeypatch.setenv(name, "/somewhere")
    known = "known: CHUNKCACHE_STORE_DEVICE_BYTES, CHUNKCACHE_STORE_HOST_BYTES"
    with pytest.raises(UsageError, match=f"^unknown setting {name}; {known}, .*_CONFIG$"):
        StoreSettings()
    with pytest.raises(UsageError, match=f"unknown setting {name}"):
        TieredKVStore.from_settings(host_bytes=1000)


def test_known_variables_in_any_case_are_taken(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    config = tmp_path / "store.toml"
    config.write_text("disk_bytes = 7\n")
    monkeypatch.setenv("chunkcache_store_host_bytes", "5")
    monkeypatch.setenv("CHUNKCACHE_STORE_CONFIG", str(config))
    settings = StoreSettings()
    assert (settings.host_bytes, settings.disk_bytes) == (5, 7)
    monkeypatch.setenv("Chunkcache_Store_Config", str(config))  # read as spelt: not read
    with pytest.raises(UsageError, match=r"^unknown setting Chunkcache_Store_Config; "):
        StoreSettings()


def test_a_config_variable_naming_no_file_is_refused(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Its settings would otherwise be silently lost."""
    monkeypatch.setenv("CHUNKCACHE_STORE_CONFIG", str(tmp_path / "missing.toml"))
    with pytest.raises(UsageError, match=r"missing\.toml: not a file"):
        StoreSettings()


def test_warm_with_a_misspelt_variable_is_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    monkeypatch.setenv("CHUNKCACHE_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("CHUNKCACHE_STORE_DISK_DIRR", str(tmp_path))

    def load_model(*args: object, **kwargs: object) -> None:
        raise AssertionError("the misspelt variable should have stopped warm before this")

    monkeypatch.setattr("chunkcache.core.models.load_model", load_model)
    with pytest.raises(SystemExit) as exited:
        main(["warm"])
    assert exited.value.code == 1
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1
    assert err[0].startswith("chunkcache: error: unknown setting CHUNKCACHE_STORE_DISK_DIRR; ")


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
