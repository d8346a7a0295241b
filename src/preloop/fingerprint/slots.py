"""The host slot semaphore's Python face and the sandbox-launcher API.

The semaphore itself is native (`src/native/slots.c`): exclusive `flock(2)` on
read-only descriptors of `slot-0..N-1` in one fixed host directory, so processes
in separate mount namespaces (sandboxes with a read-only bind of the directory)
share one cap, and a dead holder's slot is free at once. A slot's waiters queue
in order on `slot-<i>.queue-<l>` (see `slots.c`).
"""

from __future__ import annotations

import os
from pathlib import Path
from types import TracebackType

from preloop import _native, config
from preloop.errors import CoordinationError
from preloop.fingerprint.wait_reports import WaitReports

__all__ = [
    "HOST_SLOTS",
    "HostSlots",
    "Slot",
    "SlotWaitTimeout",
    "coordination_dir",
    "lock_holders",
    "prepare_host_coordination",
    "sandbox_bind_args",
]

_REPORTS = WaitReports()

HOST_SLOTS: int = _native.HOST_SLOTS
"""Cooperating fingerprint walks allowed per host, independent of CPU count."""


def coordination_dir() -> Path:
    """The host coordination directory: `PRELOOP_COORDINATION_DIR` (tests) or
    `/var/tmp/preloop-coordination`. Never derived from TMPDIR or the user."""
    value: Path = config.get("PRELOOP_COORDINATION_DIR")
    return value


class Slot:
    """A held host slot. `release()`, leaving the `with` block, or the process
    dying frees it."""

    __slots__ = ("_cached", "_fd", "_set", "index")

    def __init__(
        self, fd: int, index: int, owner: _native.SlotSet | None = None, cached: bool = False
    ) -> None:
        self._fd = fd
        self.index = index
        self._set = owner
        self._cached = cached

    @property
    def held(self) -> bool:
        return self._fd >= 0

    def release(self) -> None:
        """Frees the slot; a second call does nothing."""
        fd, self._fd = self._fd, -1
        if fd < 0:
            return
        if self._set is None:
            os.close(fd)
        else:
            self._set.give(fd, self.index, self._cached)

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


class SlotWaitTimeout(CoordinationError):
    """No host slot became free within the timeout; the message names who holds them."""


class HostSlots:
    """At most `slots` holders across the host, coordinated through `directory`.

    `acquire()` blocks in the kernel (never polls) and returns a `Slot` to use as a
    context manager; `try_acquire()` returns None instead of waiting, and never
    waits (not even for the admission lock). The directory and its files are
    created on first use (cold-start safe, modes 1777/0666 before they are
    published); existing ones are adopted as they are. Problems raise
    `CoordinationError` naming the path and the sharing mode it needs.

    The descriptors stay open between acquisitions (a forked child re-opens its
    own), so an uncontended acquire+release is a few `flock` calls.

    `pid` chooses the slot a waiter blocks on when every slot is taken
    (`pid % slots`, or the next slot no other waiter is parked on; default this
    process's pid), so tests can steer it. `report_after` is how long a wait
    lasts before it logs which pids hold the slots (then every `report_every`).
    """

    def __init__(
        self,
        directory: str | os.PathLike[str] | None = None,
        slots: int = HOST_SLOTS,
        *,
        pid: int | None = None,
        report_after: float = 3.0,
        report_every: float = 30.0,
    ) -> None:
        if slots < 1:
            raise ValueError(f"slots must be >= 1, got {slots}")
        self.directory = Path(directory) if directory is not None else coordination_dir()
        self.slots = slots
        self._pid = pid or 0
        self._set = _native.SlotSet(self.directory, slots)
        self.report_after = report_after
        self.report_every = report_every

    def acquire(self, timeout: float | None = None) -> Slot:
        """Takes a slot, waiting in the kernel while all are held: without bound
        when `timeout` is None, else raising `SlotWaitTimeout` after `timeout`
        seconds. A wait longer than `report_after` logs the holders' pids (then
        every `report_every`) without leaving its place in the slot's queue."""
        got = self._set.take(False, 0.0, self._pid)
        if got is None:
            key = _REPORTS.watch(self.report_after, self.report_every, self._waiting_text)
            try:
                got = self._set.take(True, -1.0 if timeout is None else timeout, self._pid)
            finally:
                _REPORTS.unwatch(key)
            if got is None:
                raise SlotWaitTimeout(
                    f"no fingerprint slot in {self.directory} became free within {timeout:g} s "
                    f"(PRELOOP_FINGERPRINT_SLOT_TIMEOUT); {self.holders_text()}",
                    str(self.directory),
                )
        return Slot(got[0], got[1], self._set, got[2])

    def _waiting_text(self, waited: float) -> str:
        return (
            f"preloop: waiting {waited:.0f} s for a fingerprint slot in {self.directory}; "
            f"{self.holders_text()}"
        )

    @property
    def native(self) -> _native.SlotSet:
        """The native descriptor set (for `_native.fingerprint(held=...)`)."""
        return self._set

    def try_acquire(self) -> Slot | None:
        """Takes a free slot, or returns None at once when every slot is held."""
        got = self._set.take(False, 0.0, self._pid)
        return None if got is None else Slot(got[0], got[1], self._set, got[2])

    def holders(self) -> dict[str, list[int]]:
        """Pids holding each coordination file's lock (`admission`, `slot-N`), from
        the kernel's lock table (/proc/locks); a file nobody holds is left out."""
        return lock_holders(
            self.directory, ["admission", *(f"slot-{i}" for i in range(self.slots))]
        )

    def holders_text(self) -> str:
        """`held by pid 12 (slot-0), pid 13 (slot-1, admission)` or why it is unknown."""
        try:
            found = self.holders()
        except OSError as exc:
            return f"cannot read the kernel's lock table: {exc.strerror or exc}"
        by_pid: dict[int, list[str]] = {}
        for name, pids in found.items():
            for pid in pids:
                by_pid.setdefault(pid, []).append(name)
        if not by_pid:
            return "no holder is visible in /proc/locks (another pid namespace?)"
        parts = [f"pid {pid} ({', '.join(sorted(names))})" for pid, names in sorted(by_pid.items())]
        return "held by " + ", ".join(parts)

    def __repr__(self) -> str:
        return f"HostSlots(directory={str(self.directory)!r}, slots={self.slots})"


def lock_holders(directory: str | os.PathLike[str], names: list[str]) -> dict[str, list[int]]:
    """Pids holding a granted `flock` lock on each of `names` in `directory`, matched
    by device and inode against /proc/locks. Waiters (`->` lines) are left out."""
    wanted: dict[tuple[int, int, int], str] = {}
    for name in names:
        try:
            st = os.lstat(os.path.join(directory, name))
        except FileNotFoundError:
            continue
        wanted[(os.major(st.st_dev), os.minor(st.st_dev), st.st_ino)] = name
    found: dict[str, list[int]] = {}
    with open("/proc/locks") as table:
        for line in table:
            # "3: FLOCK  ADVISORY  WRITE 1234 00:2d:5678 0 EOF"
            fields = line.split()
            if len(fields) < 6 or fields[1] == "->" or fields[1] != "FLOCK":
                continue
            try:
                major, minor, inode = fields[5].split(":")
                key = (int(major, 16), int(minor, 16), int(inode))
                pid = int(fields[4])
            except ValueError:
                continue
            holder = wanted.get(key)
            if holder is not None and pid > 0 and pid not in found.setdefault(holder, []):
                found[holder].append(pid)
    return found


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
