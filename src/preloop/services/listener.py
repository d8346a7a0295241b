"""The services' socket, listening from the start and served from the first connection.

A run's jobs get the services' URL and token in every step's environment, but
most workflows never call them (no artifact, no cache). `ServiceListener`
binds 127.0.0.1 at once, so the URL is valid from the first step, and imports
the HTTP server (aiohttp: ~150 ms, a third of a short `preloop run`) only when
a client first connects; that client waits in the listen backlog meanwhile,
and the server then serves the same socket.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import selectors
import socket
import threading
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from preloop.services.server import ServiceServer
    from preloop.services.storage import ServiceStorage

__all__ = ["BACKLOG", "ServiceListener"]

_log = logging.getLogger(__name__)
BACKLOG = 512  # the services' listen backlog, here and once the server serves


class ServiceListener:
    """`url` listens from construction; `start()` watches the socket in a
    thread that starts the HTTP server on the first connection; `stop()`
    stops whichever of the two is running and closes the socket. A server
    that cannot start (`failure`) is logged; the socket stays bound until
    `stop()` and every connection to it is closed at once, so no caller
    waits and no other process can take the port the steps were given."""

    def __init__(self, storage: ServiceStorage, secret: bytes | None = None) -> None:
        self.storage = storage
        self.secret = secret or secrets.token_bytes(32)
        self.failure: Exception | None = None  # why the server did not start
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            self._sock.bind(("127.0.0.1", 0))
            self._sock.listen(BACKLOG)
            self._sock.setblocking(False)
            self._wake_r, self._wake_w = os.pipe()
        except BaseException:
            self._sock.close()
            raise
        self.port = int(self._sock.getsockname()[1])
        self._lock = threading.Lock()
        self._stopping = False
        self._server: ServiceServer | None = None
        self._watcher: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/"

    @property
    def serving(self) -> bool:
        """Whether a client has connected and the HTTP server was started."""
        return self._server is not None

    def start(self) -> None:
        watcher = threading.Thread(
            target=self._watch, name="preloop-services-listener", daemon=True
        )
        watcher.start()
        self._watcher = watcher

    def _wait(self, sel: selectors.BaseSelector) -> bool:
        """Until a client connects (True) or `stop()` wakes the watcher (False)."""
        return any(key.fileobj is self._sock for key, _ in sel.select())

    def _watch(self) -> None:
        try:
            with selectors.DefaultSelector() as sel:
                sel.register(self._sock, selectors.EVENT_READ)
                sel.register(self._wake_r, selectors.EVENT_READ)
                if not self._wait(sel) or self._serve():
                    return
                while self._wait(sel):  # the server failed: turn every caller away
                    with contextlib.suppress(OSError):
                        self._sock.accept()[0].close()
        except Exception as exc:
            # No selector to watch with (out of descriptors): closed, so that
            # callers are refused rather than left waiting in the backlog.
            self._fail(exc)
            self._sock.close()

    def _serve(self) -> bool:
        """Starts the server on the socket (False: stopping, or it failed)."""
        with self._lock:
            if self._stopping:
                return False
            try:
                from preloop.services.server import ServiceServer

                self._server = ServiceServer(self.storage, self.secret, sock=self._sock)
                self._server.start()
            except Exception as exc:
                self._server = None
                self._fail(exc)
                return False
            return True

    def _fail(self, exc: Exception) -> None:
        if self.failure is None:
            self.failure = exc
            _log.error("preloop: the artifact and cache services did not start: %s", exc)

    def stop(self) -> None:
        with self._lock:
            if self._stopping:
                return
            self._stopping = True
        try:
            os.write(self._wake_w, b"x")
            if self._watcher is not None:
                self._watcher.join()
            if self._server is not None:
                self._server.stop()
        finally:
            self._sock.close()
            os.close(self._wake_r)
            os.close(self._wake_w)
