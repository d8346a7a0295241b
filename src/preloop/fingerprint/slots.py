"""The host slot semaphore's Python face and the sandbox-launcher API.

The semaphore itself is native (`src/native/slots.c`): exclusive `flock(2)` on
read-only descriptors of `slot-0..N-1` in one fixed host directory, so processes
in separate mount namespaces (sandboxes with a read-only bind of the directory)
share one cap, and a dead holder's slot is free at once.
"""

from __future__ import annotations

import os
from pathlib import Path
from types import TracebackType

from preloop import _native, config

__all__ = [
    "HOST_SLOTS",
    "HostSlots",
    "Slot",
    "coordination_dir",
    "prepare_host_coordination",
    "sandbox_bind_args",
]

HOST_SLOTS: int = _native.HOST_SLOTS
"""Cooperating fingerprint walks allowed per host, independent of CPU count."""


def coordination_dir() -> Path:
    """The host coordination directory: `PRELOOP_COORDINATION_DIR` (tests) or
    `/var/tmp/preloop-coordination`. Never derived from TMPDIR or the user."""
    value: Path = config.get("PRELOOP_COORDINATION_DIR")
    return value


class Slot:
    """A held host slot. Closing its descriptor (`release()`, leaving the `with`
    block, or the process dying) frees it."""

    def __init__(self, fd: int, index: int) -> None:
        self._fd = fd
        self.index = index

    @property
    def held(self) -> bool:
        return self._fd >= 0

    def release(self) -> None:
        """Frees the slot; a second call does nothing."""
        fd, self._fd = self._fd, -1
        if fd >= 0:
            os.close(fd)

    def __enter__(self) -> Slot:
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
        return f"Slot(index={self.index}, held={self.held})"


class HostSlots:
    """At most `slots` holders across the host, coordinated through `directory`.

    `acquire()` blocks in the kernel (never polls) and returns a `Slot` to use as a
    context manager; `try_acquire()` returns None instead of waiting. The directory
    and its files are created on first use (cold-start safe, modes 1777/0666 before
    they are published); existing ones are adopted as they are. Problems raise
    `CoordinationError` naming the path and the sharing mode it needs.

    `pid` chooses the slot a waiter blocks on when every slot is taken
    (`pid % slots`; default this process's pid), so tests can steer it.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str] | None = None,
        slots: int = HOST_SLOTS,
        *,
        pid: int | None = None,
    ) -> None:
        if slots < 1:
            raise ValueError(f"slots must be >= 1, got {slots}")
        self.directory = Path(directory) if directory is not None else coordination_dir()
        self.slots = slots
        self._pid = pid or 0

    def acquire(self) -> Slot:
        """Takes a slot, waiting in the kernel while all are held."""
        got = _native.slots_acquire(self.directory, self.slots, True, self._pid)
        assert got is not None  # a blocking acquire always returns a slot
        return Slot(*got)

    def try_acquire(self) -> Slot | None:
        """Takes a free slot, or returns None at once when every slot is held."""
        got = _native.slots_acquire(self.directory, self.slots, False, self._pid)
        return None if got is None else Slot(*got)

    def __repr__(self) -> str:
        return f"HostSlots(directory={str(self.directory)!r}, slots={self.slots})"


def prepare_host_coordination(
    directory: str | os.PathLike[str] | None = None, slots: int = HOST_SLOTS
) -> Path:
    """Creates or adopts the host coordination directory and its slot files, never
    truncating or unlinking existing ones, and returns its path.

    A sandbox launcher calls this on the host before starting sandboxes, then binds
    the directory read-only into each (`sandbox_bind_args()`): inside, the files
    exist already, so the read-only mount is enough to share the cap.
    """
    path = Path(directory) if directory is not None else coordination_dir()
    _native.slots_prepare(path, slots)
    return path


def sandbox_bind_args(directory: str | os.PathLike[str] | None = None) -> list[str]:
    """bubblewrap arguments binding the coordination directory read-only at the same
    path, e.g. `["--ro-bind", "/var/tmp/preloop-coordination", "/var/tmp/preloop-coordination"]`.

    Put them after any `--tmpfs` covering the directory's parent (a private /tmp
    would otherwise hide it and make the cap per sandbox).
    """
    path = str(Path(directory) if directory is not None else coordination_dir())
    return ["--ro-bind", path, path]
