"""OpenAI-compatible HTTP server (a leaf: nothing in the core imports it).

One worker thread owns the engine and decodes one request at a time, in arrival order; the
asyncio side validates, queues, streams and measures. See :func:`create_app`.
"""

from specdec.server.app import create_app
from specdec.server.config import ServerConfig

__all__ = ["ServerConfig", "create_app"]
