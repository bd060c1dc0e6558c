"""Backends by name: what ``ChunkCache(backend="local" | "http" | "vllm")`` builds.

``local`` runs the engine in this process; ``http`` talks to ``chunkcache serve``;
``vllm`` talks to a vLLM OpenAI-compatible server, whose prefix cache chunkcache's
ordering and layout make hit.  A spec is checked when it is made and built on
first use, so naming a backend costs nothing until a prompt runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

from chunkcache.core.generation import Backend
from chunkcache.core.urls import check_api_key

BackendName = Literal["local", "http", "vllm"]
BACKEND_NAMES: tuple[BackendName, ...] = get_args(BackendName)


@dataclass(frozen=True)
class BackendSpec:
    """A backend by name and the options it needs.

    ``model``: a local model path for ``local`` (default model if None), the served
    model's name for ``vllm`` (required) and ``http`` (optional).  ``base_url``:
    the server's root, e.g. ``http://127.0.0.1:8000`` (``http`` and ``vllm`` only).
    """

    name: BackendName
    base_url: str | None = None
    model: str | None = None
    api_key: str | None = None

    def __post_init__(self) -> None:
        if self.name not in BACKEND_NAMES:
            raise ValueError(f"unknown backend {self.name!r}; choose one of {BACKEND_NAMES}")
        if self.name == "local":
            if self.base_url is not None or self.api_key is not None:
                raise ValueError("the local backend takes no base_url or api_key")
            return
        if not self.base_url:
            raise ValueError(f"backend={self.name!r} needs base_url, e.g. 'http://127.0.0.1:8000'")
        if self.api_key:  # checked now: the backend itself is built on first use
            check_api_key(self.api_key, "api_key")
        if self.name == "vllm" and not self.model:
            raise ValueError("backend='vllm' needs model: the name the vLLM server serves")

    def build(self) -> Backend:
        """Create the backend (loads the model for ``local``)."""
        if self.name == "local":
            from chunkcache.core.local_backend import LocalBackend

            return LocalBackend.default(self.model)
        assert self.base_url is not None
        if self.name == "http":
            from chunkcache.core.http_backend import HttpBackend

            return HttpBackend(self.base_url, api_key=self.api_key, model=self.model)
        from chunkcache.integrations.vllm import VllmBackend

        assert self.model is not None
        return VllmBackend(self.base_url, self.model, api_key=self.api_key)
