"""Serving an app with the engine loop on the main thread and HTTP on a second one.

PyTorch's CPU kernels (and specdec's own) parallelise through libgomp, which gives every thread
that opens a parallel region a pool of its own. Loading the model opens regions on the main
thread, so an engine loop on any other thread makes a second pool; with more pool workers than
cores libgomp stops letting them spin between regions, and each of the hundreds of regions in a
decode step then waits for sleeping workers to wake. Keeping the engine on the main thread keeps
one pool. The HTTP side (uvicorn, pydantic, the tokenizer) opens no parallel region.
"""

from __future__ import annotations

import logging
import signal
import threading
from types import FrameType

import uvicorn
from fastapi import FastAPI

from specdec.errors import SpecDecError

log = logging.getLogger(__name__)


class ServeError(SpecDecError):
    """The HTTP server did not start (the port is taken, the address is not local, ...)."""


class MainThreadServer:
    """``uvicorn`` on a thread, the app's engine worker on the caller's (main) thread.

    :meth:`run` blocks until :meth:`shutdown`, SIGINT or SIGTERM; the shutdown is uvicorn's
    graceful one (the app's lifespan stops the worker, which ends its running requests)."""

    def __init__(
        self, app: FastAPI, *, host: str, port: int, log_level: str = "info", grace: int = 5
    ) -> None:
        self.worker = app.state.service.worker
        self.server = uvicorn.Server(
            uvicorn.Config(
                app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=grace
            )
        )
        self._failure: BaseException | None = None

    def _http(self) -> None:
        try:
            self.server.run()
        except BaseException as e:  # uvicorn exits with SystemExit when it cannot bind
            self._failure = e
        finally:
            self.worker.stop(0)  # however uvicorn ended, the engine loop ends with it

    def _on_signal(self, sig: int, frame: FrameType | None) -> None:
        self.server.handle_exit(sig, frame)

    def shutdown(self) -> None:
        """Ask for a graceful stop (from any thread)."""
        self.server.should_exit = True

    def run(self) -> None:
        """Serve until stopped; raise :class:`ServeError` when the server could not start."""
        self.worker.keep_on_caller()
        on_main = threading.current_thread() is threading.main_thread()
        handled = (signal.SIGINT, signal.SIGTERM)
        previous = {s: signal.signal(s, self._on_signal) for s in handled} if on_main else {}
        http = threading.Thread(target=self._http, name="specdec-http", daemon=True)
        http.start()
        try:
            self.worker.run_here()
        finally:
            self.shutdown()
            http.join()
            for s, handler in previous.items():
                signal.signal(s, handler)
        if not self.server.started:
            failure = self._failure
            why = "" if failure is None or isinstance(failure, SystemExit) else f" ({failure!r})"
            raise ServeError(
                f"the HTTP server did not start on {self.server.config.host}:"
                f"{self.server.config.port}{why}; see the log above, and pick a free --port"
            )
