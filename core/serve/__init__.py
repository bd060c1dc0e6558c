"""``chunkcache serve``: an OpenAI-compatible HTTP server over the chunk-cache engine.

See docs/serve.md.  :func:`create_app` builds the FastAPI app over any backend;
:func:`run_server` is what the ``chunkcache serve`` command runs.
"""

from chunkcache.core.serve.app import create_app
from chunkcache.core.serve.server import run_server
from chunkcache.core.serve.settings import ServeSettings

__all__ = ["ServeSettings", "create_app", "run_server"]
