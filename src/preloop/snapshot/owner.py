"""Who owns a capture's files: a process named by pid *and* start time, so a
recycled pid is never mistaken for the original owner.

Markers are small JSON files written atomically (temporary name + rename).
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["ProcessIdentity", "pid_exists", "read_marker", "write_marker"]


def _start_ticks(pid: int) -> int | None:
    """Field 22 of /proc/<pid>/stat (start time in clock ticks since boot), or
    None when the process does not exist."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            stat = fh.read()
    except (FileNotFoundError, ProcessLookupError):
        return None
    # The command name (field 2) may contain spaces and parentheses: split after
    # the last ')'.
    fields = stat[stat.rindex(b")") + 2 :].split()
    return int(fields[19])


def pid_exists(pid: int) -> bool:
    """True while some process has `pid` (any user's, zombies included). Where a
    start time was recorded, prefer `ProcessIdentity.is_alive`: pids are reused."""
    return _start_ticks(pid) is not None


@dataclass(frozen=True, slots=True)
class ProcessIdentity:
    """A process: its pid and its start time in clock ticks since boot."""

    pid: int
    start_ticks: int

    @classmethod
    def current(cls) -> ProcessIdentity:
        ticks = _start_ticks(os.getpid())
        if ticks is None:  # /proc is not mounted: the pid alone must do
            ticks = 0
        return cls(os.getpid(), ticks)

    def is_alive(self) -> bool:
        """True while the same process (same pid, same start time) runs."""
        ticks = _start_ticks(self.pid)
        if ticks is None:
            return False
        return self.start_ticks in (0, ticks)


def write_marker(path: Path, extra: dict[str, Any] | None = None) -> ProcessIdentity:
    """Atomically writes a marker naming the current process at `path`."""
    me = ProcessIdentity.current()
    document: dict[str, Any] = {
        "pid": me.pid,
        "start_ticks": me.start_ticks,
        "created": time.time(),
        **(extra or {}),
    }
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    try:
        with open(tmp, "x", encoding="utf-8") as fh:
            json.dump(document, fh)
        os.rename(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        raise
    return me


def read_marker(path: Path) -> tuple[ProcessIdentity, dict[str, Any]] | None:
    """The owner recorded at `path` and the whole document; None when the file
    is absent. A marker that exists but cannot be parsed raises ValueError."""
    try:
        raw = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    try:
        document = json.loads(raw)
        owner = ProcessIdentity(int(document["pid"]), int(document["start_ticks"]))
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{path}: not a preloop owner marker: {exc}") from None
    return owner, document
