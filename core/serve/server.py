"""Run ``chunkcache serve``: build the store and the engine backend, serve the app.

The store is :meth:`TieredKVStore.from_settings` (``CHUNKCACHE_STORE_*``): point several
servers at one ``disk_dir`` (and one ``redis_url``) and each reuses the chunk KV the
others computed (RAG-DCache §III, shared KV on disk).  The engine is the continuous-
batching backend when this install has it (``backend="auto"``), else the one-at-a-time
local backend.

SIGTERM / SIGINT: the server stops taking connections, new requests get a 503, requests
in flight run to their end for up to ``shutdown_timeout_s`` (then they are cancelled and
their streams cut), then the backend and the store shut down.
"""

from __future__ import annotations

import importlib
import logging
import math
from types import FrameType
from typing import Any

import uvicorn

from chunkcache.core.serve.app import create_app
from chunkcache.core.serve.settings import ServeSettings
from chunkcache.core.serve.state import ServeState

log = logging.getLogger("chunkcache.serve")


def build_backend(settings: ServeSettings, store: Any) -> Any:
    """The engine backend ``settings`` describe, over ``store``."""
    import torch

    dtype = getattr(torch, settings.dtype)
    if settings.backend != "local":
        try:
            batching = importlib.import_module("chunkcache.core.batching")
        except ImportError:
            if settings.backend == "batching":
                raise
        else:
            return batching.BatchingBackend.default(
                settings.model,
                dtype=dtype,
                store=store,
                engine_options=settings.engine_options(),
                max_queue=settings.max_queue,
                max_batch=settings.max_batch,
            )
    from chunkcache.core.local_backend import LocalBackend

    log.info("chunkcache serve: the local backend, one prefill or decode step at a time")
    return LocalBackend.default(
        settings.model, dtype=dtype, store=store, engine_options=settings.engine_options()
    )


def run_server(settings: ServeSettings) -> None:
    """Serve until SIGTERM/SIGINT, then shut down cleanly (see the module docstring)."""
    from chunkcache.core.store.tiered import TieredKVStore

    store = TieredKVStore.from_settings()
    try:
        backend = build_backend(settings, store)
    except BaseException:
        store.close()
        raise
    app = create_app(backend, settings, store=store)
    _Server(uvicorn_config(app, settings), app.state.serve).run()


def uvicorn_config(app: Any, settings: ServeSettings) -> uvicorn.Config:
    """uvicorn's settings for ``app``.  Its graceful-shutdown timeout is whole seconds, and
    None waits forever: ``shutdown_timeout_s`` is rounded up (0 cancels at once)."""
    return uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        timeout_graceful_shutdown=math.ceil(settings.shutdown_timeout_s),
        log_level="info",
        access_log=False,
    )


class _Server(uvicorn.Server):
    """uvicorn's server, refusing new requests (503) from the moment a signal arrives."""

    def __init__(self, config: uvicorn.Config, state: ServeState) -> None:
        super().__init__(config)
        self.state = state

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self.state.runner.close()
        super().handle_exit(sig, frame)
