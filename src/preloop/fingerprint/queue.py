"""One fingerprint walk at a time per process, for async callers."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from functools import partial

import anyio
import anyio.lowlevel
import anyio.to_thread

from preloop.fingerprint.digest import Fingerprint, FingerprintMode, Root, fingerprint

__all__ = ["FingerprintQueue"]


class FingerprintQueue:
    """Runs fingerprint walks one at a time, each in a worker thread.

    Create one per process and share it: concurrent callers queue instead of
    starting parallel walks (the host cap bounds the machine, this bounds the
    process). A failed request raises for its own caller only. A caller cancelled
    while queued leaves the queue at once; one cancelled while its walk runs waits
    for the walk to finish (a native walk cannot be interrupted), so its host slot
    and queue place are always released.
    """

    def __init__(self) -> None:
        self._lock = anyio.Lock()

    async def fingerprint(
        self, roots: Root | Iterable[Root], *, mode: FingerprintMode = "content"
    ) -> Fingerprint:
        """`preloop.fingerprint.fingerprint` through the queue."""
        async with self._lock:
            result = await anyio.to_thread.run_sync(partial(fingerprint, roots, mode=mode))
        # A caller cancelled during its walk gets the cancellation, not a stale result.
        await anyio.lowlevel.checkpoint_if_cancelled()
        return result

    async def fingerprint_settled(
        self,
        candidates: Sequence[Root | Iterable[Root]],
        *,
        mode: FingerprintMode = "content",
    ) -> list[Fingerprint | Exception]:
        """One result or error per candidate, in order (all-settled), one walk at a time."""
        results: list[Fingerprint | Exception] = []
        for roots in candidates:
            try:
                results.append(await self.fingerprint(roots, mode=mode))
            except Exception as exc:
                results.append(exc)
        return results
