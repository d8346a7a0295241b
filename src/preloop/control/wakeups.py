"""Wake-ups: waiting for a queued job without polling the store.

On PostgreSQL a trigger on `jobs` (schema migration 6) sends a NOTIFY on
`JOBS` whenever a job becomes `queued` (inserted queued, released by a
dependency, a concurrency slot, a re-queued lease ...: every path, the
plpgsql functions and the Python cascade alike); a run that completes
sends one on `RUNS` (the submitting `preloop run` waits for it); stored log
lines send one on `LOGS` (`preloop.control.joblogs`). A NOTIFY sent inside a
transaction is delivered at its commit, so a woken runner's claim sees the job.

`Listener` is one dedicated connection per process that LISTENs on it, in a
daemon thread. Waiters take a token (`token()`) *before* they look for work
and then `wait(token, timeout)`: a notification that arrived in between
returns at once, so none is lost between a claim that found nothing and the
wait. A lost listening connection is reopened (and LISTEN issued again) with
bounded backoff, without a traceback; after reconnecting every waiter is
woken, since notifications sent while it was down were missed. Waiters keep
a slow poll as the fallback (the `timeout`), so a listener that cannot
connect costs latency, never a job. While idle the listener sends nothing.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
from collections.abc import Callable
from typing import Any

__all__ = ["JOBS", "LOGS", "RUNS", "Listener"]

#: A job became queued (the runners' wake-up).
JOBS = "preloop_jobs"
#: A run completed (the submitting engine's wake-up).
RUNS = "preloop_runs"
#: Log lines or a result of a job were stored (followers of remote jobs).
LOGS = "preloop_logs"

_log = logging.getLogger(__name__)

# Backoff between attempts to reopen the listening connection.
_RETRY_FIRST = 0.05
_RETRY_MAX = 2.0
# How long one `notifies()` call blocks before the thread checks for close().
_SLICE = 1.0


class Listener:
    """A LISTEN connection in a daemon thread, and the waiters it wakes."""

    def __init__(self, url: str, channels: tuple[str, ...] = (JOBS, RUNS, LOGS)) -> None:
        self.url = url
        self.channels = channels
        self._cond = threading.Condition()
        self._generation = dict.fromkeys(channels, 0)
        self._callbacks: dict[str, set[Callable[[], None]]] = {ch: set() for ch in channels}
        self._closed = False
        self._connected = False
        #: The server pid of the current listening connection (None while down).
        self.backend_pid: int | None = None
        #: How many times the connection was (re)opened and LISTEN issued.
        self.connects = 0
        self._conn: Any = None
        self._thread = threading.Thread(target=self._loop, name="preloop-listen", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------ waiters

    def token(self, channel: str = JOBS) -> int:
        """Take before looking for work; pass to `wait` or `subscribe`."""
        with self._cond:
            return self._generation[channel]

    @property
    def listening(self) -> bool:
        return self._connected

    def wait(self, token: int, timeout: float | None, channel: str = JOBS) -> bool:
        """Blocks until a notification newer than `token` (True) or `timeout`
        seconds (False)."""
        with self._cond:
            return self._cond.wait_for(
                lambda: self._generation[channel] != token or self._closed, timeout=timeout
            )

    def subscribe(
        self, token: int, callback: Callable[[], None], channel: str = JOBS
    ) -> Callable[[], None]:
        """Calls `callback` (from the listener's thread, or at once) on the
        first notification newer than `token`; returns the unsubscribe."""
        with self._cond:
            if self._generation[channel] == token and not self._closed:
                self._callbacks[channel].add(callback)
                return functools.partial(self._callbacks[channel].discard, callback)
        callback()
        return lambda: None

    def wake(self, channel: str | None = None) -> None:
        """Wakes the waiters of `channel` (default: all) in this process, as a
        notification would."""
        callbacks: list[Callable[[], None]] = []
        with self._cond:
            for ch in self.channels if channel is None else (channel,):
                if ch not in self._generation:
                    continue
                self._generation[ch] += 1
                callbacks.extend(self._callbacks[ch])
                self._callbacks[ch] = set()
            self._cond.notify_all()
        for callback in callbacks:
            try:
                callback()
            except Exception:  # a waiter's loop that has ended
                _log.debug("wake-up callback failed", exc_info=True)

    def wait_connected(self, timeout: float, after: int = 0) -> bool:
        """Until the connection has been opened more than `after` times (tests)."""
        with self._cond:
            return self._cond.wait_for(lambda: self.connects > after and self._connected, timeout)

    def close(self) -> None:
        with self._cond:
            self._closed = True
        self.wake()
        conn = self._conn
        if conn is not None:
            with contextlib.suppress(Exception):
                conn.close()
        self._thread.join(timeout=_SLICE + 1)

    # ------------------------------------------------------------ thread

    def _loop(self) -> None:
        import psycopg

        delay = _RETRY_FIRST
        while not self._closed:
            try:
                conn = psycopg.connect(self.url, autocommit=True, connect_timeout=10)
            except Exception as exc:  # server down: the waiters poll meanwhile
                _log.debug("listener cannot connect: %s", exc)
                self._sleep(delay)
                delay = min(delay * 2, _RETRY_MAX)
                continue
            self._conn = conn
            try:
                for channel in self.channels:
                    conn.execute(f'LISTEN "{channel}"')
                with self._cond:
                    self._connected = True
                    self.backend_pid = conn.info.backend_pid
                    self.connects += 1
                # Anything queued while no one listened: look again.
                self.wake()
                delay = _RETRY_FIRST
                while not self._closed:
                    for note in conn.notifies(timeout=_SLICE, stop_after=1):
                        self.wake(note.channel)
            except Exception as exc:  # lost connection (or closed by close())
                _log.debug("listener connection lost: %s", exc)
            finally:
                with self._cond:
                    self._connected = False
                    self.backend_pid = None
                self._conn = None
                with contextlib.suppress(Exception):
                    conn.close()
            if not self._closed:
                self._sleep(delay)
                delay = min(delay * 2, _RETRY_MAX)

    def _sleep(self, seconds: float) -> None:
        with self._cond:
            self._cond.wait_for(lambda: self._closed, timeout=seconds)
