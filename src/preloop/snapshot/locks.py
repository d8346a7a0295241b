"""The per-entry cache lock and capture pins of the shared object cache.

- **Lock**: an exclusive `flock(2)` on `<key>.lock`. `ensure_object_cache` holds it
  while it clones or refreshes `<key>.git` and its sidecars; the cache prune takes
  it with `try_acquire_cache_lock` (busy entries are skipped). The lock file is
  never unlinked, so every process locks the same inode. Dying releases it.
- **Pin**: a file `<key>.pin-<id>` recording pid, process start time and creation
  time. A capture creates it *while it holds the lock* and drops it only after
  its run repository's `objects/info/alternates` is written; a prune that sees a
  pin under the lock must not evict the entry. A pin older than
  `limits.STALE_PIN_AGE` can only be a crash leftover.

Both `CacheLock` and `CachePin` are context managers and also have an idempotent
`release()` / `drop()`.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import secrets
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

import anyio

from preloop.snapshot import layout
from preloop.snapshot.errors import CacheLockTimeout
from preloop.snapshot.limits import CACHE_LOCK_TIMEOUT
from preloop.snapshot.owner import ProcessIdentity, read_marker, write_marker

__all__ = [
    "CacheLock",
    "CachePin",
    "PinInfo",
    "acquire_cache_lock",
    "acquire_cache_lock_async",
    "list_pins",
    "list_pins_of",
    "read_pin",
    "try_acquire_cache_lock",
]

# Back-off between lock attempts: short first (the common holder is a quick
# refresh), capped so a waiter notices a release within this interval.
_POLL_FIRST = 0.001
_POLL_MAX = 0.02


class CacheLock:
    """A held exclusive lock on `<key>.lock`; `release()` (or leaving the `with`
    block) unlocks it."""

    __slots__ = ("_fd", "key", "path")

    def __init__(self, path: Path, key: str, fd: int) -> None:
        self.path = path
        self.key = key
        self._fd: int | None = fd

    @property
    def held(self) -> bool:
        return self._fd is not None

    def release(self) -> None:
        """Unlocks; safe to call more than once."""
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)  # closing the only descriptor drops the flock

    def __enter__(self) -> CacheLock:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.release()

    def __del__(self) -> None:
        self.release()

    def __repr__(self) -> str:
        return f"CacheLock({str(self.path)!r}, held={self.held})"


def _open_lock_file(state_dir: Path, key: str) -> tuple[Path, int]:
    path = layout.cache_lock_path(state_dir, key)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)
    return path, fd


def _try_lock(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            return False
        raise
    return True


def try_acquire_cache_lock(state_dir: Path, key: str) -> CacheLock | None:
    """The entry's lock if it is free right now, else None (never waits)."""
    path, fd = _open_lock_file(state_dir, key)
    try:
        if _try_lock(fd):
            return CacheLock(path, key, fd)
    except BaseException:
        os.close(fd)
        raise
    os.close(fd)
    return None


def acquire_cache_lock(state_dir: Path, key: str, timeout: float = CACHE_LOCK_TIMEOUT) -> CacheLock:
    """The entry's lock, waiting at most `timeout` seconds; `CacheLockTimeout`
    (naming the lock file) when it stays busy."""
    path, fd = _open_lock_file(state_dir, key)
    try:
        start = time.monotonic()
        delay = _POLL_FIRST
        while not _try_lock(fd):
            waited = time.monotonic() - start
            if waited >= timeout:
                raise CacheLockTimeout(str(path), timeout)
            time.sleep(min(delay, timeout - waited))
            delay = min(delay * 2, _POLL_MAX)
    except BaseException:
        os.close(fd)
        raise
    return CacheLock(path, key, fd)


async def acquire_cache_lock_async(
    state_dir: Path, key: str, timeout: float = CACHE_LOCK_TIMEOUT
) -> CacheLock:
    """`acquire_cache_lock` for async callers: the wait is cancellable (an
    enclosing deadline ends it) and never blocks the event loop."""
    path, fd = _open_lock_file(state_dir, key)
    try:
        start = time.monotonic()
        delay = _POLL_FIRST
        while not _try_lock(fd):
            waited = time.monotonic() - start
            if waited >= timeout:
                raise CacheLockTimeout(str(path), timeout)
            await anyio.sleep(min(delay, timeout - waited))
            delay = min(delay * 2, _POLL_MAX)
    except BaseException:
        os.close(fd)
        raise
    return CacheLock(path, key, fd)


@dataclass(frozen=True, slots=True)
class PinInfo:
    """What a pin file records."""

    path: Path
    owner: ProcessIdentity
    created: float
    run_id: str | None


class CachePin:
    """A capture's pin `<key>.pin-<id>` on a cache entry. Create it with
    `CachePin.create` while holding the entry's lock; `drop()` removes it."""

    __slots__ = ("key", "path", "pin_id")

    def __init__(self, path: Path, key: str, pin_id: str) -> None:
        self.path = path
        self.key = key
        self.pin_id = pin_id

    @classmethod
    def create(cls, state_dir: Path, key: str, run_id: str | None = None) -> CachePin:
        """Writes a new pin (atomically: temporary name, then rename)."""
        me = ProcessIdentity.current()
        pin_id = f"{me.pid}-{secrets.token_hex(6)}"
        path = layout.cache_pin_path(state_dir, key, pin_id)
        path.parent.mkdir(parents=True, exist_ok=True)
        write_marker(path, {"run_id": run_id})
        return cls(path, key, pin_id)

    def drop(self) -> None:
        """Removes the pin; safe to call more than once."""
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()

    def __enter__(self) -> CachePin:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.drop()

    def __repr__(self) -> str:
        return f"CachePin({str(self.path)!r})"


def list_pins(state_dir: Path, key: str) -> list[Path]:
    """Every pin file of `key`. Raises OSError when the cache directory cannot
    be listed (callers that must fail closed rely on that); a missing cache
    directory means no pins."""
    prefix = layout.cache_pin_prefix(key)
    try:
        names = os.listdir(layout.cache_dir(state_dir))
    except FileNotFoundError:
        return []
    return sorted(layout.cache_dir(state_dir) / n for n in names if n.startswith(prefix))


def list_pins_of(state_dir: Path, keys: Iterable[str]) -> dict[str, list[Path]]:
    """Every pin file of each of `keys`, from one listing of the cache directory
    (a prune checks a batch of locked entries at once). Raises OSError like
    `list_pins`; a missing cache directory means no pins."""
    prefixes = {layout.cache_pin_prefix(key): key for key in keys}
    found: dict[str, list[Path]] = {key: [] for key in prefixes.values()}
    cache = layout.cache_dir(state_dir)
    try:
        names = os.listdir(cache)
    except FileNotFoundError:
        return found
    for name in names:
        cut = name.find(".pin-")
        key = prefixes.get(name[: cut + 5]) if cut > 0 else None
        if key is not None:
            found[key].append(cache / name)
    for pins in found.values():
        pins.sort()
    return found


def read_pin(path: Path) -> PinInfo | None:
    """The pin at `path`; None when it is gone. A pin that exists but cannot be
    parsed raises ValueError (treat it as present)."""
    try:
        found = read_marker(path)
        if found is None:
            return None
        owner, document = found
        created = float(document["created"])
        run_id = document.get("run_id")
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{path}: not a preloop cache pin: {exc}") from None
    return PinInfo(path, owner, created, run_id if isinstance(run_id, str) else None)
