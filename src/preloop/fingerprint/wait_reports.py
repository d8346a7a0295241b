"""Logs slot waits that outlast their report time, from one thread per process.

A waiter makes one kernel wait for its whole timeout and so keeps its place in
its slot's FIFO queue; cutting the wait short every few seconds to log who holds
the slots would send it to the back of the queue each time.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["WaitReports"]

_log = logging.getLogger("preloop.fingerprint")


@dataclass
class _Wait:
    start: float
    next_report: float
    every: float
    describe: Callable[[float], str]


class WaitReports:
    """Waits being watched; `watch` starts the reporting thread on first use (again
    in a forked child, which has no threads).

    `watch` wakes the thread only when the new wait is due before the thread's next
    wake-up: contended acquisitions come hundreds a second, and waking a thread (and
    handing it the GIL) for each cost a third of their CPU time, which stretched
    the slot holds and waits of every process on a busy host."""

    def __init__(self) -> None:
        self._reset()
        os.register_at_fork(after_in_child=self._reset)

    def _reset(self) -> None:
        # A fresh lock in a forked child: the parent's may have been held at the fork.
        self._cond = threading.Condition()
        self._waits: dict[int, _Wait] = {}
        self._keys = itertools.count()
        self._thread: threading.Thread | None = None
        # When the thread looks next (monotonic); None while it sleeps until notified.
        self._wake_at: float | None = None
        # The report time of the last wait watched since the thread last looked.
        self._linger: float | None = None

    def watch(self, after: float, every: float, describe: Callable[[float], str]) -> int:
        """Logs `describe(seconds waited)` once `after` seconds pass, then every
        `every` seconds, until `unwatch(key)`."""
        with self._cond:
            # Read under the lock, as the thread reads it, so a wait watched after
            # the thread's look is never due before the wake-up that look planned.
            now = time.monotonic()
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="preloop-slot-wait-reports", daemon=True
                )
                self._thread.start()
            key = next(self._keys)
            self._waits[key] = _Wait(now, now + after, every, describe)
            self._linger = after
            if self._wake_at is None or now + after < self._wake_at:
                self._wake_at = now + after
                self._cond.notify()
        return key

    def unwatch(self, key: int) -> None:
        with self._cond:
            self._waits.pop(key, None)

    def _run(self) -> None:
        cond = self._cond
        while True:
            with cond:
                if cond is not self._cond:
                    return  # reset after a fork in this thread's (copied) process
                now = time.monotonic()
                due = [w for w in self._waits.values() if w.next_report <= now]
                for wait in due:
                    wait.next_report = now + wait.every
                if not due:
                    upcoming = min((w.next_report for w in self._waits.values()), default=None)
                    if upcoming is None and self._linger is not None:
                        # None left, but waits came since the last look and more
                        # likely follow: sleeping until notified would have each of
                        # them wake this thread.
                        upcoming = now + self._linger
                    self._linger = None
                    self._wake_at = upcoming
                    cond.wait(None if upcoming is None else upcoming - now)
                    continue
            for wait in due:  # outside the lock: describing reads the kernel's lock table
                try:
                    _log.warning("%s", wait.describe(now - wait.start))
                except Exception:  # one failed report must not end every later one
                    _log.exception("preloop: could not describe a slot wait")
