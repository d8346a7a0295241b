"""Post-capture hooks: callables run after each *successful* capture, outside
the cache lock and after the pin was dropped (the object-cache prune registers
itself here).

A hook gets `(state_dir, cache_key)` and runs in a worker thread; it is best
effort: an exception is logged and swallowed, never failing the capture. A
capture function's own `after_capture=` argument runs after the registered hooks.
The capture returns once its hooks returned, so a hook with long work (a cache
prune) starts it in the background and returns at once.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from pathlib import Path

import anyio

__all__ = [
    "AfterCapture",
    "register_after_capture",
    "registered_after_capture",
    "run_after_capture",
    "unregister_after_capture",
]

AfterCapture = Callable[[Path, str], object]

_log = logging.getLogger(__name__)
_hooks: list[AfterCapture] = []
_guard = threading.Lock()


def register_after_capture(hook: AfterCapture) -> None:
    """Adds `hook` (once: registering it again is a no-op)."""
    with _guard:
        if hook not in _hooks:
            _hooks.append(hook)


def unregister_after_capture(hook: AfterCapture) -> None:
    """Removes `hook` if registered."""
    with _guard:
        if hook in _hooks:
            _hooks.remove(hook)


def registered_after_capture() -> list[AfterCapture]:
    """The registered hooks, in registration order."""
    with _guard:
        return list(_hooks)


async def run_after_capture(
    state_dir: Path, cache_key: str, extra: AfterCapture | None = None
) -> None:
    """Runs every registered hook, then `extra`, each in a worker thread; errors
    are logged, never raised."""
    hooks = registered_after_capture() + ([extra] if extra is not None else [])
    for hook in hooks:
        try:
            await anyio.to_thread.run_sync(hook, state_dir, cache_key)
        except Exception:
            _log.warning("post-capture hook %r failed for %s", hook, cache_key, exc_info=True)
