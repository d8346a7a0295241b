"""The services' socket, listening from the start and served from the first connection.

A run's jobs get the services' URL and token in every step's environment, but
most workflows never call them (no artifact, no cache). `ServiceListener`
binds 127.0.0.1 at once, so the URL is valid from the first step, and imports
the HTTP server (aiohttp: ~150 ms, a third of a short `preloop run`) only when
a client first connects; that client waits in the listen backlog meanwhile,
and the server then serves the same socket.
"""

from __future__ import annotations

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

__all__ = ["ServiceListener"]

_log = logging.getLogger(__name__)
_BACKLOG = 512  # as the server's own


class ServiceListener:
    """`url` listens from construction; `start()` watches the socket in a
    thread that starts the HTTP server on the first connection; `stop()`
    stops whichever of the two is running and closes the socket."""

    def __init__(self, storage: ServiceStorage, secret: bytes | None = None) -> None:
        self.storage = storage
        self.secret = secret or secrets.token_bytes(32)
        self.failure: Exception | None = None  # why the server did not start
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            self._sock.bind(("127.0.0.1", 0))
            self._sock.listen(_BACKLOG)
            self._sock.setblocking(False)
        except BaseException:
            self._sock.close()
            raise
        self.port = int(self._sock.getsockname()[1])
        self._wake_r, self._wake_w = os.pipe()
        self._lock = threading.Lock()
        self._stopping = False
        self._server: ServiceServer | None = None
        self._watcher: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/"

    @property
    def serving(self) -> bool:
        """Whether a client has connected and the HTTP server runs."""
        return self._server is not None

    def start(self) -> None:
        self._watcher = threading.Thread(
            target=self._watch, name="preloop-services-listener", daemon=True
        )
        self._watcher.start()

    def _watch(self) -> None:
        with selectors.DefaultSelector() as sel:
            sel.register(self._sock, selectors.EVENT_READ)
            sel.register(self._wake_r, selectors.EVENT_READ)
            ready = {key.fileobj for key, _ in sel.select()}
        with self._lock:
            if self._stopping or self._sock not in ready:
                return
            try:
                from preloop.services.server import ServiceServer

                server = ServiceServer(self.storage, self.secret, sock=self._sock)
                server.start()
            except Exception as exc:
                self.failure = exc
                _log.error("the artifact and cache services did not start: %s", exc)
                self._sock.close()  # the waiting clients get a reset, not a hang
                return
            self._server = server

    def stop(self) -> None:
        with self._lock:
            if self._stopping:
                return
            self._stopping = True
        os.write(self._wake_w, b"x")
        if self._watcher is not None:
            self._watcher.join()
        if self._server is not None:
            self._server.stop()
        self._sock.close()
        os.close(self._wake_r)
        os.close(self._wake_w)
