"""Blocking filesystem work of a capture, tracked so the post-deadline cleanup
knows whether it may remove the capture's files.

Copies, writes and removals run in their own threads: a thread blocked on a
wedged filesystem cannot be cancelled, so a deadline only stops *waiting* for
it. `BlockingWork` counts what is still running; the cleanup waits a bounded
time for the count to reach zero and leaves the files alone otherwise ("the
tree is left instead of racing a write"). Captures register their work here
while they run and until it drains, so an in-process sweep never removes a
tree a straggling thread may still write to.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import anyio

__all__ = ["BlockingWork", "CaptureFaults", "is_live", "wait_for_abandoned_work"]

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class CaptureFaults:
    """Fault injection for tests (never set in production).

    - `stall(point)` runs in the worker thread before the blocking step named
      `point` (e.g. `"copy-index"`, `"persist-index"`, `"remove"`); it may block.
    - `deadline_gate()`: when it returns, the aggregate deadline fires at once,
      so a test can expire it exactly while a fake git hangs.
    """

    stall: Callable[[str], None] | None = None
    deadline_gate: Callable[[], Awaitable[None]] | None = None


_registry_guard = threading.Lock()
_registry: dict[str, BlockingWork] = {}


class BlockingWork:
    """The blocking steps of one capture (named by its staging directory)."""

    def __init__(self, name: str, faults: CaptureFaults | None = None) -> None:
        self.name = name
        self._faults = faults or CaptureFaults()
        self._guard = threading.Lock()
        self._running = 0
        self._finished = False
        self._idle = threading.Event()
        self._idle.set()
        with _registry_guard:
            _registry[name] = self

    def _enter(self) -> None:
        with self._guard:
            self._running += 1
            self._idle.clear()

    def _leave(self) -> None:
        with self._guard:
            self._running -= 1
            if self._running:
                return
            finished = self._finished
        # Unregister before signalling idle: whoever waited for idle must find
        # the capture gone.
        if finished:
            self._unregister()
        self._idle.set()

    def _unregister(self) -> None:
        with _registry_guard:
            if _registry.get(self.name) is self:
                del _registry[self.name]

    @property
    def running(self) -> int:
        with self._guard:
            return self._running

    async def run(self, point: str, fn: Callable[..., T], *args: Any) -> T:
        """Runs `fn(*args)` in its own thread and waits for it. Cancelling the
        wait leaves the thread running (and counted) until it returns."""
        box: dict[str, Any] = {}
        done = threading.Event()
        stall = self._faults.stall

        def target() -> None:
            try:
                if stall is not None:
                    stall(point)
                box["result"] = fn(*args)
            except BaseException as exc:
                box["error"] = exc
            finally:
                self._leave()
                done.set()

        self._enter()
        try:
            threading.Thread(target=target, name=f"preloop-{point}", daemon=True).start()
        except BaseException:
            self._leave()
            raise
        await anyio.to_thread.run_sync(done.wait, abandon_on_cancel=True)
        if "error" in box:
            raise box["error"]
        result: T = box["result"]
        return result

    async def wait_idle(self, timeout: float) -> bool:
        """True once no blocking step runs; False if that did not happen within
        `timeout` seconds."""
        if self._idle.is_set():
            return True
        return await anyio.to_thread.run_sync(self._idle.wait, timeout, abandon_on_cancel=True)

    def finish(self) -> None:
        """The capture is over: forget it as soon as its work has drained."""
        with self._guard:
            self._finished = True
            idle = self._running == 0
        if idle:
            self._unregister()


def is_live(staging_name: str) -> bool:
    """True while a capture of this process owns `staging_name` (running, or
    finished with blocking work still in flight)."""
    with _registry_guard:
        return staging_name in _registry


def wait_for_abandoned_work(timeout: float) -> bool:
    """Blocks until every capture of this process that ended with blocking work
    still running has drained; False if some did not within `timeout` seconds."""
    end = time.monotonic() + timeout
    with _registry_guard:
        pending = [w for w in _registry.values() if w._finished]
    return all(work._idle.wait(max(0.0, end - time.monotonic())) for work in pending)
