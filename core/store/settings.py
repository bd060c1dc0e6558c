"""The tiered store's configuration, in one place.

Values come from, highest first: keyword arguments, environment variables
``CHUNKCACHE_STORE_<FIELD>`` (e.g. ``CHUNKCACHE_STORE_HOST_BYTES=2147483648``), a TOML or
JSON file (``StoreSettings.from_file(path)``, or the file named by
``CHUNKCACHE_STORE_CONFIG``), then the defaults below.  A capacity of 0 turns its tier off.
A ``CHUNKCACHE_STORE_*`` variable that names no field (a misspelt ``DISK_DIR`` would
otherwise put the cache elsewhere) is refused with :class:`~chunkcache.core.errors.UsageError`,
as are a settings file that does not parse or holds no table of settings, and a ``redis_url``
redis-py would refuse only when the tier connects.  Printed settings (``repr``, ``str``) show
the ``redis_url`` password as ``***``.

Example ``store.toml``::

    host_bytes = 2147483648
    disk_dir = "/var/cache/chunkcache/kv"
    redis_url = "redis://cache.internal:6379/0"
    policy = "pgdsf"
"""

from __future__ import annotations

import contextvars
import json
import os
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Literal
from urllib.parse import parse_qsl, urlencode, urlsplit

from pydantic import Field
from pydantic_settings import (
    BaseSettings,
    InitSettingsSource,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
)

from chunkcache.core.env_settings import CheckedEnvSettings
from chunkcache.core.errors import UsageError
from chunkcache.core.paths import home_subdir, user_path
from chunkcache.core.store.tiered import WRITE_THROUGH_BACKLOG_BYTES

if TYPE_CHECKING:
    from chunkcache.core.store.tier import Tier

GiB = 2**30
REDIS_URL_ENV = "CHUNKCACHE_STORE_REDIS_URL"
_config_file: contextvars.ContextVar[Path | None] = contextvars.ContextVar(
    "chunkcache_store_config", default=None
)


class StoreSettings(CheckedEnvSettings):
    """Tier capacities, where the tiers live, and the eviction policy."""

    model_config = SettingsConfigDict(env_prefix="CHUNKCACHE_STORE_", extra="forbid")
    other_env_names: ClassVar[tuple[str, ...]] = ("CHUNKCACHE_STORE_CONFIG",)

    device_bytes: int = Field(
        default=2 * GiB, ge=0, description="CUDA tier; used only when torch.cuda.is_available()"
    )
    host_bytes: int = Field(default=4 * GiB, ge=0, description="host-memory tier")
    disk_bytes: int = Field(default=32 * GiB, ge=0, description="disk tier")
    disk_dir: Path | None = Field(
        default=None, description="disk tier directory; None: $CHUNKCACHE_HOME/kv"
    )
    redis_url: str | None = Field(
        default=None, description="shared Redis tier, e.g. redis://h:6379/0"
    )
    redis_bytes: int = Field(default=8 * GiB, ge=0, description="Redis tier, enforced server-side")
    redis_timeout_s: float = Field(default=1.0, gt=0, description="Redis socket timeout")
    redis_retry_s: float = Field(
        default=30.0, ge=0, description="probe a down Redis again after this"
    )
    policy: Literal["lru", "lfu", "pgdsf", "cachecraft"] = Field(
        default="pgdsf", description="eviction policy of the local tiers"
    )
    write_through: bool = Field(
        default=True,
        description="also write new variants to disk/Redis in the background, so other "
        "processes and the next start see them",
    )
    write_through_backlog_bytes: int = Field(
        default=WRITE_THROUGH_BACKLOG_BYTES,
        ge=0,
        description="KV that write-throughs waiting for a busy disk/Redis may hold; one "
        "past it is skipped (its entry goes down when evicted)",
    )

    if not TYPE_CHECKING:  # type checkers keep the __init__ typed by the fields

        def __init__(self, **values: Any) -> None:
            """``values`` over the environment over the file over the defaults;
            :class:`UsageError` for an unknown ``CHUNKCACHE_STORE_*`` variable, a settings
            file that cannot be read as settings, or a malformed ``redis_url``."""
            super().__init__(**values)
            # Checked here, not in a validator: pydantic's error would quote the URL's
            # password.
            if self.redis_url:
                _check_redis_url(self.redis_url)

    def __repr_args__(self) -> Iterator[tuple[str | None, Any]]:
        # repr() and str() show the settings; a printed or reported (a traceback's locals)
        # redis_url keeps its password out.
        for name, value in super().__repr_args__():
            if name == "redis_url" and isinstance(value, str):
                value = _masked_url(value)
            yield name, value

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        sources = [init_settings, env_settings]
        path, where = _config_file.get(), None
        if path is None and os.environ.get("CHUNKCACHE_STORE_CONFIG"):
            path = Path(os.environ["CHUNKCACHE_STORE_CONFIG"])
            where = f"CHUNKCACHE_STORE_CONFIG={path}"
            if not path.is_file():  # read as no file at all, its settings silently lost
                raise UsageError(f"{where}: not a file")
        if path is not None:
            sources.append(InitSettingsSource(settings_cls, _read_config(path, where or path)))
        return tuple(sources)

    @classmethod
    def from_file(cls, path: str | Path, **overrides: object) -> StoreSettings:
        """Settings from a ``.toml`` or ``.json`` file, under environment and ``overrides``."""
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(path)
        token = _config_file.set(path)
        try:
            return cls(**overrides)  # type: ignore[arg-type]
        finally:
            _config_file.reset(token)

    def resolved_disk_dir(self) -> Path:
        """The disk tier's directory (created on demand by the tier)."""
        if self.disk_dir is not None:
            return user_path(self.disk_dir)

        return home_subdir("kv")


def _read_config(path: Path, where: str | Path) -> dict[str, Any]:
    """The settings in the ``.json`` (else TOML) file ``path``; :class:`UsageError` naming
    ``where`` (the file, or the variable naming it) when they cannot be read."""
    try:
        data = path.read_bytes()
        if path.suffix == ".json":
            text = data.decode()
            values = json.loads(text) if text.strip() else {}  # empty, as an empty TOML file
        else:
            values = tomllib.loads(data.decode())
    except UnicodeDecodeError as error:
        raise UsageError(f"{where}: not UTF-8 (byte {error.start + 1})") from None
    except (json.JSONDecodeError, tomllib.TOMLDecodeError) as error:
        raise UsageError(f"{where}: {error}") from None
    except OSError as error:
        raise UsageError(f"{where}: {error.strerror}") from None
    if not isinstance(values, dict):
        raise UsageError(
            f'{where}: expected an object of settings (e.g. {{"host_bytes": 1000}}), '
            f"got {type(values).__name__}"
        )
    return values


def _masked_url(url: str) -> str:
    """``url`` with its password (in the user part or a ``password=`` query option, as
    redis-py reads both) shown as ``***``."""
    parts = urlsplit(url)
    user, at, host = parts.netloc.rpartition("@")
    if at and ":" in user:
        user = user.split(":", 1)[0] + ":***"
    query = [(k, "***" if k == "password" else v) for k, v in parse_qsl(parts.query, True)]
    shown = f"{parts.scheme}://{user}{at}{host}{parts.path}"  # unix:// keeps its empty host
    return f"{shown}?{urlencode(query, safe='*')}" if query else shown


def _check_redis_url(url: str) -> None:
    """:class:`UsageError` unless redis-py can connect to ``url``; the message never quotes
    it, which may hold a password."""
    name = f"redis_url ({REDIS_URL_ENV})"
    if not url.startswith(("redis://", "rediss://", "unix://")):
        raise UsageError(
            f"{name} must start with redis://, rediss:// or unix://, like redis://localhost:6379/0"
        )
    parts = urlsplit(url)
    try:
        port = parts.port
    except ValueError:
        port = 0
    if port == 0:  # redis-py takes port 0 as no port at all: 6379
        if "@" in url and "@" not in parts.netloc:
            # '/', '?' or '#' in a password ends the host part early: the password reads
            # as the port
            raise UsageError(f"{name}: percent-encode / ? # in its password (%2F %3F %23)")
        raise UsageError(f"{name} has a port that is not a number in 1-65535")
    try:
        from redis.connection import parse_url
    except ImportError:  # build_tiers says how to install it
        return
    try:
        parse_url(url)  # its query options (db=, timeout=, ...)
    except ValueError as error:
        raise UsageError(f"{name}: {error}") from None


def build_tiers(settings: StoreSettings) -> list[Tier]:
    """The tiers ``settings`` turn on, fastest first: device (CUDA only), host, disk, Redis."""
    import torch

    from chunkcache.core.store.disk import DiskTier
    from chunkcache.core.store.tier import MemoryTier

    tiers: list[Tier] = []
    if settings.device_bytes and torch.cuda.is_available():
        tiers.append(MemoryTier("device", settings.device_bytes, "cuda"))
    if settings.host_bytes:
        tiers.append(MemoryTier("host", settings.host_bytes))
    if settings.disk_bytes:
        tiers.append(DiskTier(settings.resolved_disk_dir(), settings.disk_bytes))
    if settings.redis_url and settings.redis_bytes:
        try:
            from chunkcache.core.store.redis_tier import RedisTier
        except ModuleNotFoundError as error:
            if error.name != "redis":
                raise
            raise UsageError(
                f"{REDIS_URL_ENV} needs redis-py: pip install 'chunkcache[redis]'"
            ) from None
        tiers.append(
            RedisTier(
                settings.redis_url,
                settings.redis_bytes,
                timeout_s=settings.redis_timeout_s,
                retry_after_s=settings.redis_retry_s,
            )
        )
    if not tiers:
        raise ValueError("every tier is off: set a capacity above 0")
    return tiers
