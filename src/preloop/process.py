"""Bounded async command runners (anyio). Every git call in preloop goes through them.

Each child is started in its own process group (`start_new_session=True`). When
the call does not end normally (cancellation by an enclosing deadline, its own
`timeout`, or an exception in the caller's task group) the *whole group* is
SIGKILLed before the child is reaped: killing only the direct child would leave
git's `git-remote-*` and `index-pack` descendants running against the cache.

- `run_command`: all output captured.
- `run_command_capped`: at most `max_output` bytes of each stream kept, the rest
  drained and counted (`stdout_dropped` / `stderr_dropped`).
- `run_command_with_stdin`: feeds bytes to the child's stdin.
- `run_command_status`: output discarded (or sent to given descriptors); the
  exit status and duration only.

On Linux the child is watched through a pidfd and its pipes are read directly
by the event loop (`anyio.wait_readable`): no watcher thread and no transport
objects per child, which costs ~1 ms less per command than `anyio.open_process`
(used where `pidfd_open` is unavailable).

A non-zero exit raises `CommandFailed` when `check=True` (the default); a
`timeout` raises `CommandTimeout`. Both name the command via `display`, which
callers set when the argv holds secrets (e.g. a URL with credentials).
"""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import subprocess
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import IO, Any

import anyio
from anyio.abc import ByteReceiveStream, Process

from preloop.errors import PreloopError

__all__ = [
    "CommandFailed",
    "CommandResult",
    "CommandTimeout",
    "run_command",
    "run_command_capped",
    "run_command_status",
    "run_command_with_stdin",
]

# How long the cleanup path waits for a SIGKILLed child to be reaped. A child in
# uninterruptible sleep (wedged filesystem) may outlive SIGKILL; the caller's own
# bounded cleanup must not hang on it.
_REAP_WAIT = 5.0

# Tests flip this to prove that their assertions detect a runner that kills only
# the direct child. Never change it elsewhere.
_KILL_WHOLE_GROUP = True

_READ_CHUNK = 65536


@dataclass(frozen=True, slots=True)
class CommandResult:
    """How a command ended: exit status (negative: killed by that signal),
    captured output, bytes dropped beyond a cap, wall-clock duration in seconds."""

    argv: tuple[str, ...]
    returncode: int
    stdout: bytes
    stderr: bytes
    duration: float
    stdout_dropped: int = 0
    stderr_dropped: int = 0

    @property
    def ok(self) -> bool:
        return self.returncode == 0

    @property
    def stdout_kept(self) -> int:
        return len(self.stdout)

    @property
    def stderr_kept(self) -> int:
        return len(self.stderr)

    def stdout_text(self) -> str:
        return self.stdout.decode("utf-8", "replace")

    def stderr_text(self) -> str:
        return self.stderr.decode("utf-8", "replace")


class CommandFailed(PreloopError):
    """A command exited non-zero (or was killed by a signal)."""

    def __init__(self, display: str, result: CommandResult, cwd: str | None) -> None:
        self.display = display
        self.result = result
        detail = result.stderr_text().strip().splitlines()
        tail = f": {detail[-1]}" if detail else ""
        where = f" in {cwd}" if cwd else ""
        status = (
            f"was killed by signal {-result.returncode}"
            if result.returncode < 0
            else f"exited with status {result.returncode}"
        )
        super().__init__(f"`{display}`{where} {status}{tail}")


class CommandTimeout(PreloopError):
    """A command ran past its own `timeout`; its process group was killed."""

    def __init__(self, display: str, timeout: float, cwd: str | None) -> None:
        self.display = display
        self.timeout = timeout
        where = f" in {cwd}" if cwd else ""
        super().__init__(
            f"`{display}`{where} did not finish within {timeout:g}s and was killed "
            "with its whole process group"
        )


def _kill_pid_group(pid: int) -> None:
    # Called before the child is reaped, so its pid (= the group id) cannot have
    # been reused: killpg reaches exactly the group we started.
    try:
        if _KILL_WHOLE_GROUP:
            os.killpg(pid, signal.SIGKILL)
        else:
            os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


class _Output:
    """One stream's captured bytes: at most `cap` kept (None: all of them); the
    rest is counted in `dropped`."""

    def __init__(self, cap: int | None) -> None:
        self.cap = cap
        self.chunks: list[bytes] = []
        self.kept = 0
        self.dropped = 0

    def add(self, chunk: bytes) -> None:
        if self.cap is None:
            self.chunks.append(chunk)
            return
        room = self.cap - self.kept
        if room > 0:
            self.chunks.append(chunk[:room])
            self.kept += min(room, len(chunk))
        if len(chunk) > room:
            self.dropped += len(chunk) - max(room, 0)


async def _drain(stream: ByteReceiveStream | None, sink: _Output) -> None:
    if stream is None:
        return
    async for chunk in stream:
        sink.add(chunk)


async def _feed(process: Process, data: bytes) -> None:
    stdin = process.stdin
    if stdin is None:
        return
    try:
        if data:
            await stdin.send(data)
    except (anyio.BrokenResourceError, anyio.ClosedResourceError, BrokenPipeError):
        pass  # the child exited without reading all of it; its status says why
    finally:
        with contextlib.suppress(anyio.BrokenResourceError, anyio.ClosedResourceError):
            await stdin.aclose()


async def _wait_anyio(
    args: list[str],
    popen: dict[str, Any],
    stdin_data: bytes | None,
    timeout: float | None,
    out: _Output,
    err: _Output,
) -> int:
    """Runs the child through `anyio.open_process` (where pidfds are missing) and
    returns its status; TimeoutError after `timeout`, the group killed."""
    # Shielded: a cancellation while the event loop is still connecting the
    # pipes would make it kill only the direct child, leaking the group. The
    # pending cancellation is delivered at the first await inside the `try`.
    with anyio.CancelScope(shield=True):
        process = await anyio.open_process(args, **popen)
    finished = False
    try:
        with anyio.fail_after(timeout) if timeout is not None else contextlib.nullcontext():
            async with anyio.create_task_group() as tg:
                if stdin_data is not None:
                    tg.start_soon(_feed, process, stdin_data)
                tg.start_soon(_drain, process.stdout, out)
                tg.start_soon(_drain, process.stderr, err)
            returncode = await process.wait()
        finished = True
    finally:
        if not finished:
            _kill_pid_group(process.pid)
            with anyio.move_on_after(_REAP_WAIT, shield=True):
                await process.wait()
        with anyio.CancelScope(shield=True):
            for stream in (process.stdin, process.stdout, process.stderr):
                if stream is not None:
                    with contextlib.suppress(Exception):
                        await stream.aclose()
    return returncode


def _pidfd_supported() -> bool:
    try:
        os.close(os.pidfd_open(os.getpid()))
    except (AttributeError, OSError):
        return False
    return True


_PIDFD = _pidfd_supported()


async def _read_fd(fd: int, sink: _Output) -> None:
    """Reads the non-blocking pipe `fd` to EOF into `sink`."""
    while True:
        try:
            chunk = os.read(fd, _READ_CHUNK)
        except BlockingIOError:
            await anyio.wait_readable(fd)
            continue
        if not chunk:
            return
        sink.add(chunk)


async def _write_fd(fd: int, data: bytes) -> None:
    """Writes `data` to the non-blocking pipe `fd`; a reader that went away
    ends it quietly (the child's status says why)."""
    view = memoryview(data)
    try:
        while view:
            try:
                view = view[os.write(fd, view) :]
            except BlockingIOError:
                await anyio.wait_writable(fd)
    except (BrokenPipeError, ConnectionResetError):
        pass


def _reap_later(pid: int) -> None:
    """A SIGKILLed child that did not exit in time (uninterruptible sleep): a
    daemon thread reaps it whenever it does."""

    def reap() -> None:
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, 0)

    threading.Thread(target=reap, name=f"preloop-reap-{pid}", daemon=True).start()


async def _wait_pidfd(
    args: list[str],
    popen: dict[str, Any],
    stdin_data: bytes | None,
    timeout: float | None,
    out: _Output,
    err: _Output,
) -> int:
    """Runs the child watched through a pidfd, its pipes read in the event loop
    (no watcher thread per child), and returns its status; TimeoutError after
    `timeout`, the group killed."""
    # Synchronous: no cancellation can land between the fork and the pidfd.
    child = subprocess.Popen(args, **popen)
    pipes = [f for f in (child.stdin, child.stdout, child.stderr) if f is not None]
    try:
        pidfd = os.pidfd_open(child.pid)
    except BaseException:
        _kill_pid_group(child.pid)
        _reap_later(child.pid)
        for f in pipes:
            f.close()
        raise
    finished = False
    returncode = 0
    try:
        for f in pipes:
            os.set_blocking(f.fileno(), False)
        with anyio.fail_after(timeout) if timeout is not None else contextlib.nullcontext():
            async with anyio.create_task_group() as tg:
                if child.stdin is not None:
                    stdin_fd = child.stdin.fileno()

                    async def feed() -> None:
                        await _write_fd(stdin_fd, stdin_data or b"")
                        assert child.stdin is not None
                        child.stdin.close()

                    tg.start_soon(feed)
                if child.stdout is not None:
                    tg.start_soon(_read_fd, child.stdout.fileno(), out)
                if child.stderr is not None:
                    tg.start_soon(_read_fd, child.stderr.fileno(), err)
            await anyio.wait_readable(pidfd)
        _, status = os.waitpid(child.pid, 0)
        returncode = os.waitstatus_to_exitcode(status)
        finished = True
    finally:
        if not finished:
            # Not reaped yet: the pid (= the group id) cannot have been reused.
            _kill_pid_group(child.pid)
            reaped = False
            with anyio.move_on_after(_REAP_WAIT, shield=True):
                await anyio.wait_readable(pidfd)
                os.waitpid(child.pid, 0)
                reaped = True
            if not reaped:
                _reap_later(child.pid)
        os.close(pidfd)
        for f in pipes:
            with contextlib.suppress(OSError):
                f.close()
    return returncode


_wait = _wait_pidfd if _PIDFD else _wait_anyio


async def _run(
    argv: Sequence[str | os.PathLike[str]],
    *,
    cwd: str | os.PathLike[str] | None,
    env: Mapping[str, str] | None,
    timeout: float | None,
    check: bool,
    display: str | None,
    stdin_data: bytes | None,
    capture: bool,
    max_output: int | None,
    stdout_to: int | IO[Any] | None = None,
    stderr_to: int | IO[Any] | None = None,
) -> CommandResult:
    args = [os.fspath(a) for a in argv]
    shown = display if display is not None else shlex.join(args)
    where = os.fspath(cwd) if cwd is not None else None
    out, err = _Output(max_output), _Output(max_output)
    popen: dict[str, Any] = {
        "stdin": subprocess.PIPE if stdin_data is not None else subprocess.DEVNULL,
        "stdout": subprocess.PIPE if capture else stdout_to,
        "stderr": subprocess.PIPE if capture else stderr_to,
        "cwd": cwd,
        "env": env,
        "start_new_session": True,
    }
    start = time.monotonic()
    try:
        returncode = await _wait(args, popen, stdin_data, timeout, out, err)
    except TimeoutError:
        raise CommandTimeout(shown, timeout or 0.0, where) from None
    result = CommandResult(
        argv=tuple(args),
        returncode=returncode,
        stdout=b"".join(out.chunks),
        stderr=b"".join(err.chunks),
        duration=time.monotonic() - start,
        stdout_dropped=out.dropped,
        stderr_dropped=err.dropped,
    )
    if check and returncode != 0:
        raise CommandFailed(shown, result, where)
    return result


async def run_command(
    argv: Sequence[str | os.PathLike[str]],
    *,
    cwd: str | os.PathLike[str] | None = None,
    env: Mapping[str, str] | None = None,
    timeout: float | None = None,
    check: bool = True,
    display: str | None = None,
) -> CommandResult:
    """Runs `argv` to completion and returns its status and all its output."""
    return await _run(
        argv,
        cwd=cwd,
        env=env,
        timeout=timeout,
        check=check,
        display=display,
        stdin_data=None,
        capture=True,
        max_output=None,
    )


async def run_command_capped(
    argv: Sequence[str | os.PathLike[str]],
    *,
    max_output: int,
    cwd: str | os.PathLike[str] | None = None,
    env: Mapping[str, str] | None = None,
    timeout: float | None = None,
    check: bool = True,
    display: str | None = None,
) -> CommandResult:
    """Like `run_command`, keeping at most `max_output` bytes of stdout and of
    stderr; the rest is read (the child never blocks on a full pipe) and counted
    in `stdout_dropped` / `stderr_dropped`."""
    if max_output < 0:
        raise ValueError(f"max_output must be >= 0, got {max_output}")
    return await _run(
        argv,
        cwd=cwd,
        env=env,
        timeout=timeout,
        check=check,
        display=display,
        stdin_data=None,
        capture=True,
        max_output=max_output,
    )


async def run_command_with_stdin(
    argv: Sequence[str | os.PathLike[str]],
    stdin: bytes,
    *,
    cwd: str | os.PathLike[str] | None = None,
    env: Mapping[str, str] | None = None,
    timeout: float | None = None,
    check: bool = True,
    display: str | None = None,
    max_output: int | None = None,
) -> CommandResult:
    """Runs `argv` with `stdin` as its standard input (closed after it)."""
    return await _run(
        argv,
        cwd=cwd,
        env=env,
        timeout=timeout,
        check=check,
        display=display,
        stdin_data=stdin,
        capture=True,
        max_output=max_output,
    )


async def run_command_status(
    argv: Sequence[str | os.PathLike[str]],
    *,
    cwd: str | os.PathLike[str] | None = None,
    env: Mapping[str, str] | None = None,
    timeout: float | None = None,
    check: bool = False,
    display: str | None = None,
    stdout: int | IO[Any] | None = subprocess.DEVNULL,
    stderr: int | IO[Any] | None = subprocess.DEVNULL,
    stdin: bytes | None = None,
) -> CommandResult:
    """Runs `argv` for its exit status only: output goes to `stdout`/`stderr`
    (default: discarded; None inherits ours), `stdin` (if given) is its
    input. Non-zero is not an error unless `check=True`."""
    return await _run(
        argv,
        cwd=cwd,
        env=env,
        timeout=timeout,
        check=check,
        display=display,
        stdin_data=stdin,
        capture=False,
        max_output=None,
        stdout_to=stdout,
        stderr_to=stderr,
    )
