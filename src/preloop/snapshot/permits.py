"""Per-namespace capture permits: at most N captures of one namespace (the
submitting tenant) run at once in a process; other namespaces are not held
back. A permit is held only around the capture itself.

N is `PRELOOP_SNAPSHOT_CONCURRENCY_PER_NAMESPACE` (default 4), read when a
`NamespacePermits` is created. `default_permits()` is the process-wide instance
(one per event loop, because anyio primitives belong to the loop that uses them).
"""

from __future__ import annotations

import asyncio
import re
import threading
import weakref
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio

from preloop import config
from preloop.errors import UsageError

__all__ = [
    "DEFAULT_NAMESPACE",
    "NamespacePermits",
    "default_permits",
    "namespace_from_url",
    "validate_namespace",
]

DEFAULT_NAMESPACE = "default"
_NAMESPACE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}")


def validate_namespace(namespace: str) -> str:
    """Returns `namespace` if usable: 1-100 letters, digits, `.`, `_`, `-`."""
    if not _NAMESPACE.fullmatch(namespace):
        raise UsageError(
            f"namespace {namespace!r} is not valid: use 1-100 letters, digits, '.', '_' or '-', "
            "starting with a letter or digit"
        )
    return namespace


def namespace_from_url(url: str | None) -> str:
    """The owner of a forge URL (`https://host/OWNER/repo`, `git@host:OWNER/repo`),
    or `default` when there is none."""
    if not url:
        return DEFAULT_NAMESPACE
    m = re.match(r"^[A-Za-z][A-Za-z0-9+.-]*://[^/]+/+([^/]+)/+[^/]+", url) or re.match(
        r"^[^/:@]+@[^/:]+:/*([^/]+)/+[^/]+", url
    )
    if not m or not _NAMESPACE.fullmatch(m.group(1)):
        return DEFAULT_NAMESPACE
    return m.group(1)


class NamespacePermits:
    """`hold(namespace)` admits at most `limit` concurrent holders per namespace."""

    def __init__(self, limit: int | None = None) -> None:
        self.limit: int = (
            limit if limit is not None else config.get("PRELOOP_SNAPSHOT_CONCURRENCY_PER_NAMESPACE")
        )
        if self.limit < 1:
            raise ValueError(f"permit limit must be >= 1, got {self.limit}")
        self._semaphores: dict[str, anyio.Semaphore] = {}

    def in_use(self, namespace: str) -> int:
        """How many permits of `namespace` are held right now."""
        semaphore = self._semaphores.get(namespace)
        return 0 if semaphore is None else self.limit - semaphore.value

    @asynccontextmanager
    async def hold(self, namespace: str) -> AsyncIterator[None]:
        """Waits for a permit of `namespace` and holds it for the `async with` body."""
        semaphore = self._semaphores.get(namespace)
        if semaphore is None:
            semaphore = self._semaphores[namespace] = anyio.Semaphore(self.limit)
        async with semaphore:
            yield


_instances_guard = threading.Lock()
_instances: weakref.WeakKeyDictionary[Any, NamespacePermits] = weakref.WeakKeyDictionary()


class _OtherLoops:
    """Key for event loops other than asyncio's (one shared instance)."""


_OTHER = _OtherLoops()


def _loop_key() -> Any:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return _OTHER


def default_permits() -> NamespacePermits:
    """This process's permits for the running event loop."""
    key = _loop_key()
    with _instances_guard:
        permits = _instances.get(key)
        if permits is None:
            permits = _instances[key] = NamespacePermits()
        return permits
