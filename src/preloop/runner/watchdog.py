"""No orphan steps: a watchdog process that kills a runner's steps when the
runner dies, even by SIGKILL.

One watchdog per runner process, started on the first job: a small Python
process (this file run as a script, standard library only) in its own
session, reading a pipe whose only write end the runner holds. The runner
writes `+<tracking id>` when a job starts and `-<tracking id>` when it ended
(its leftovers already killed). When the runner dies, however it dies, the
kernel closes the write end; the watchdog reads EOF and SIGKILLs every
process whose environment carries RUNNER_TRACKING_ID of a job still
registered (repeating until none is left, so children forked meanwhile go
too), then exits. A step cannot hold the pipe open: the write end is
close-on-exec.

The same tracking id is written into the job's directory
(`TRACKING_FILE`): a later runner on the host kills what is left of a dead
runner's jobs by it before sweeping their directories
(`preloop.runner.checkout.sweep_work_dir`).
"""

from __future__ import annotations

import logging
import os
import select
import signal
import subprocess
import sys
import threading
import time

__all__ = ["TRACKING_FILE", "kill_tracked_ids", "register", "unregister"]

_log = logging.getLogger(__name__)

#: In a job directory: the RUNNER_TRACKING_ID of the job's step processes.
TRACKING_FILE = ".preloop-tracking"


def kill_tracked_ids(ids: set[str] | list[str], *, prefix: bool = False) -> int:
    """SIGKILLs every process whose environment holds RUNNER_TRACKING_ID equal
    to one of `ids` (or starting with one when `prefix`), repeating until none
    is left, so children forked meanwhile go too, then waits (at most
    `_EXIT_WAIT` seconds) until they have exited: a caller may then rely on
    their working directories being released. Returns how many were killed.
    Standard library only: the watchdog runs this file as a script."""
    end = b"" if prefix else b"\0"
    needles = [f"\0RUNNER_TRACKING_ID={i}".encode() + end for i in ids if i]
    if not needles:
        return 0
    me = os.getpid()
    # A killed process stays in /proc (environment readable) until it has
    # exited and been reaped, so a later pass sees it again: count each
    # process once, by pid and start time (a recycled pid is a new process).
    killed: set[tuple[int, str]] = set()
    exits: list[int] = []  # pidfds of killed processes: readable once they exited
    try:
        for _ in range(20):
            found = 0
            for entry in os.listdir("/proc"):
                if not entry.isdigit() or int(entry) == me:
                    continue
                try:
                    with open(f"/proc/{entry}/environ", "rb") as fh:
                        environ = b"\0" + fh.read()
                except OSError:
                    continue  # gone, or another user's
                if not any(n in environ for n in needles):
                    continue
                ident = _identity(entry)
                if ident is None or ident in killed:
                    continue  # gone, already dead (a zombie) or already killed by this call
                if _kill(int(entry), ident, exits):
                    killed.add(ident)
                    found += 1
            if not found:
                break
        _wait_exited(exits, _EXIT_WAIT)
    finally:
        for fd in exits:
            os.close(fd)
    return len(killed)


#: How long `kill_tracked_ids` waits for SIGKILLed processes to be gone.
_EXIT_WAIT = 10.0


def _identity(pid: str) -> tuple[int, str] | None:
    """(pid, start time) of a live process; None when gone or a zombie."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            stat = fh.read()
    except OSError:
        return None
    fields = stat[stat.rfind(b")") + 2 :].split()
    if fields[:1] == [b"Z"]:
        return None
    return (int(pid), fields[19].decode() if len(fields) > 19 else "")


def _kill(pid: int, ident: tuple[int, str], exits: list[int]) -> bool:
    """SIGKILLs `pid` if it is still the process `ident`, through a pidfd
    (so a pid recycled meanwhile is never hit) kept in `exits` to wait on."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return False
    except OSError:  # no pidfds (old kernel): a plain kill, not waited for
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            return False
        return True
    if _identity(str(pid)) != ident:  # the pid was recycled before the pidfd was taken
        os.close(fd)
        return False
    try:
        signal.pidfd_send_signal(fd, signal.SIGKILL)
    except ProcessLookupError:
        os.close(fd)
        return False
    exits.append(fd)
    return True


def _wait_exited(fds: list[int], timeout: float) -> None:
    """Waits until every pidfd in `fds` is readable (its process exited)."""
    poller = select.poll()
    for fd in fds:
        poller.register(fd, select.POLLIN)
    pending = len(fds)
    deadline = time.monotonic() + timeout
    while pending:
        left = deadline - time.monotonic()
        if left <= 0:
            return
        for fd, _ in poller.poll(left * 1000):
            poller.unregister(fd)
            pending -= 1


class _Watchdog:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._proc: subprocess.Popen[bytes] | None = None
        self._ids: set[str] = set()
        self._failed = False

    def _spawn(self) -> subprocess.Popen[bytes]:
        env = {k: v for k, v in os.environ.items() if k != "RUNNER_TRACKING_ID"}
        proc = subprocess.Popen(
            [sys.executable, "-I", "-S", os.path.abspath(__file__)],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            env=env,
            start_new_session=True,  # a signal to the runner's group spares it
            close_fds=True,
        )
        return proc

    def _send(self, line: str) -> None:
        if self._failed:
            return
        for _ in range(2):
            proc = self._proc
            if proc is None or proc.poll() is not None:
                try:
                    proc = self._proc = self._spawn()
                except OSError as exc:
                    # E.g. a runner started as another user who may not exec our
                    # interpreter: steps are still killed at job end and by the
                    # next runner's sweep, just not at the moment of a crash.
                    self._failed = True
                    _log.warning("preloop: no step watchdog (%s); continuing without", exc)
                    return
                assert proc.stdin is not None
                for known in self._ids:  # a respawned watchdog learns the current jobs
                    proc.stdin.write(f"+{known}\n".encode())
            assert proc.stdin is not None
            try:
                proc.stdin.write(line.encode() + b"\n")
                proc.stdin.flush()
                return
            except (BrokenPipeError, OSError):
                self._proc = None

    def register(self, tracking_id: str) -> None:
        with self._lock:
            self._send(f"+{tracking_id}")
            self._ids.add(tracking_id)

    def unregister(self, tracking_id: str) -> None:
        with self._lock:
            self._ids.discard(tracking_id)
            if self._proc is not None:
                self._send(f"-{tracking_id}")


_WATCHDOG = _Watchdog()


def register(tracking_id: str) -> None:
    """The steps tagged `tracking_id` die if this process dies before `unregister`."""
    _WATCHDOG.register(tracking_id)


def unregister(tracking_id: str) -> None:
    _WATCHDOG.unregister(tracking_id)


def _main() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal ^C reaches the runner only
    ids: set[str] = set()
    stdin = sys.stdin.buffer
    for raw in stdin:
        line = raw.decode("utf-8", "replace").rstrip("\n")
        if line.startswith("+"):
            ids.add(line[1:])
        elif line.startswith("-"):
            ids.discard(line[1:])
    kill_tracked_ids(ids)  # EOF: the runner is gone


if __name__ == "__main__":
    _main()
