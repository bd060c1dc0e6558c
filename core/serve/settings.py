"""``chunkcache serve``'s configuration.

Values come from, highest first: keyword arguments (the command line), environment
variables ``CHUNKCACHE_SERVE_<FIELD>`` (e.g. ``CHUNKCACHE_SERVE_API_KEY=...``), then the
defaults below.  A ``CHUNKCACHE_SERVE_*`` variable that names no field is refused (a
misspelt ``API_KEY`` would otherwise leave the server open), as are infinite or NaN
numbers, an empty host, an empty API key, and one with a character other than visible ASCII
(a client could not send it in its ``Authorization`` header).

The KV store has its own settings, :class:`~chunkcache.core.store.settings.StoreSettings`
(``CHUNKCACHE_STORE_*``): servers on one host that share its disk directory and Redis url
reuse each other's chunk KV.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, SecretStr, field_validator
from pydantic_settings import SettingsConfigDict

from chunkcache.core.env_settings import CheckedEnvSettings
from chunkcache.core.urls import check_api_key

ENV_PREFIX = "CHUNKCACHE_SERVE_"


class ServeSettings(CheckedEnvSettings):
    """Where the server listens, what it runs, and the limits it enforces."""

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="forbid")

    host: str = Field(
        default="127.0.0.1", min_length=1, description="interface to listen on (0.0.0.0: all)"
    )
    port: int = Field(default=8000, ge=0, le=65535, description="TCP port (0: any free port)")
    model: str | None = Field(
        default=None, description="checkpoint directory or GGUF file; None: the default model"
    )
    dtype: Literal["bfloat16", "float32", "float16"] = Field(
        default="bfloat16", description="engine dtype (bf16 is ~4x faster on AMX CPUs)"
    )
    backend: Literal["auto", "batching", "local"] = Field(
        default="auto",
        description="batching: continuous batching; local: one prefill or decode step at a "
        "time, unbatched; auto: batching when this install has it",
    )
    api_key: SecretStr | None = Field(
        default=None,
        description="when set, /v1/* requires 'Authorization: Bearer <key>'",
    )
    max_queue: int = Field(
        default=64, ge=1, description="requests waiting beyond the running batch; 429 when full"
    )
    max_batch: int = Field(default=8, ge=1, description="requests decoded together")
    max_body_bytes: int = Field(default=4 * 2**20, ge=1024, description="413 above this")
    max_prompt_chars: int = Field(default=200_000, ge=1, description="400 above this")
    max_tokens_limit: int = Field(
        default=2048, ge=1, description="largest max_tokens a request may ask for (400 above)"
    )
    default_max_tokens: int = Field(
        default=256,
        ge=1,
        description="max_tokens of a request that names none (at most the room its prompt "
        "leaves in the context window)",
    )
    max_conversations: int | None = Field(
        default=None,
        ge=0,
        description="conversations whose KV the engine keeps for their next turn "
        "(None: the engine's default, 32)",
    )
    max_conversation_tokens: int | None = Field(
        default=None,
        ge=0,
        description="KV tokens kept for those conversations in all (None: the engine's "
        "default, 32,768)",
    )
    shutdown_timeout_s: float = Field(
        default=30.0,
        ge=0,
        allow_inf_nan=False,
        description="on SIGTERM/SIGINT, finish in-flight work this long",
    )
    trim_heap_s: float = Field(
        default=0.0,
        ge=0,
        allow_inf_nan=False,
        description="return freed heap memory to the OS this often (glibc; 0: never): "
        "resident memory stays flat under load, at some throughput (docs/serve.md)",
    )
    retry_after_s: float = Field(
        default=1.0,
        gt=0,
        allow_inf_nan=False,
        description="least Retry-After of a 429 (more when the queue is long)",
    )

    def __init__(self, **values: Any) -> None:
        """``values`` over the environment over the defaults; :class:`UsageError` for an
        unknown ``CHUNKCACHE_SERVE_*`` variable or an API key no client could send."""
        super().__init__(**values)
        # Checked here, not in a validator: pydantic's error would quote the key.
        if self.api_key is not None:
            check_api_key(self.api_key.get_secret_value(), f"api_key ({ENV_PREFIX}API_KEY)")

    @field_validator("api_key", mode="before")
    @classmethod
    def _key_not_empty(cls, key: object) -> object:
        if key == "":  # would let in any request with "Authorization: Bearer "
            raise ValueError(f"empty: unset {ENV_PREFIX}API_KEY to serve without a key")
        return key

    def engine_options(self) -> dict[str, int]:
        """The :class:`~chunkcache.core.engine.ChunkEngine` settings set here."""
        names = ("max_conversations", "max_conversation_tokens")
        return {name: getattr(self, name) for name in names if getattr(self, name) is not None}
