"""Runs one step's process through `preloop.process` and streams its merged
stdout/stderr line by line while it runs.

The child writes into a pipe we read without blocking. When the step's main
process exits, whatever is already in the pipe is read and the stream ends,
even if a background process the step started still holds the pipe open (its
later output is lost, its process group is killed when the job ends).
"""

from __future__ import annotations

import contextlib
import errno
import os
from collections.abc import Callable, Mapping, Sequence

import anyio

from preloop.process import CommandResult, CommandTimeout, run_command_status

__all__ = ["run_streaming"]

_CHUNK = 65536


class _Lines:
    def __init__(self, on_line: Callable[[str], None]) -> None:
        self._on_line = on_line
        self._buf = b""

    def feed(self, data: bytes) -> None:
        self._buf += data
        *complete, self._buf = self._buf.split(b"\n")
        for raw in complete:
            self._on_line(raw.decode("utf-8", "replace"))

    def close(self) -> None:
        if self._buf:
            self._on_line(self._buf.decode("utf-8", "replace"))
            self._buf = b""


def _read_available(fd: int, lines: _Lines) -> bool:
    """Reads what is in the pipe now; False at end of file."""
    while True:
        try:
            data = os.read(fd, _CHUNK)
        except BlockingIOError:
            return True
        except OSError as exc:
            if exc.errno == errno.EINTR:
                continue
            raise
        if not data:
            return False
        lines.feed(data)


async def run_streaming(
    argv: Sequence[str],
    *,
    cwd: str,
    env: Mapping[str, str],
    timeout: float | None,
    on_line: Callable[[str], None],
) -> CommandResult:
    """Runs `argv` (its own process group; killed whole on cancellation or
    `timeout`, which raises `CommandTimeout`) and calls `on_line` for each
    line of its combined output."""
    read_fd, write_fd = os.pipe()
    os.set_blocking(read_fd, False)
    lines = _Lines(on_line)
    try:

        async def pump() -> None:
            while True:
                await anyio.wait_readable(read_fd)
                if not _read_available(read_fd, lines):
                    return

        result: CommandResult | None = None
        timed_out: CommandTimeout | None = None
        async with anyio.create_task_group() as tg:
            tg.start_soon(pump)
            try:
                result = await run_command_status(
                    argv, cwd=cwd, env=env, timeout=timeout, stdout=write_fd, stderr=write_fd
                )
            except CommandTimeout as exc:
                timed_out = exc
            finally:
                tg.cancel_scope.cancel()
        os.close(write_fd)
        write_fd = -1
        _read_available(read_fd, lines)
        lines.close()
        if timed_out is not None:
            raise timed_out
        assert result is not None
        return result
    finally:
        with contextlib.suppress(OSError):
            os.close(read_fd)
        if write_fd >= 0:
            with contextlib.suppress(OSError):
                os.close(write_fd)
