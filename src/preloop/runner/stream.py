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
import fcntl
import os
from collections.abc import Callable, Mapping, Sequence

import anyio

from preloop.process import CommandResult, CommandTimeout, run_command_status

__all__ = ["MAX_LINE_BYTES", "LineSplitter", "run_streaming"]

_CHUNK = 65536
_PIPE_SIZE = 1 << 20
_F_SETPIPE_SZ = getattr(fcntl, "F_SETPIPE_SZ", 1031)


#: The longest line handed on in one piece. GitHub's runner keeps a line's
#: bytes in its log but its live console shows at most 1,024 characters of it;
#: preloop splits a longer line into pieces of at most this many bytes (at a
#: UTF-8 character boundary), so no byte is dropped and the memory a step's
#: output needs does not grow with its longest line.
MAX_LINE_BYTES = 1 << 20


class LineSplitter:
    """Turns a byte stream into lines, in time linear in its length.

    Only the new chunk is scanned for newlines (never the pending bytes
    again), and pending bytes are capped at `max_line` (a longer line is
    handed on in `max_line`-byte pieces). Bytes are decoded as UTF-8 with
    replacement of invalid sequences; a piece never ends inside a character."""

    def __init__(self, on_line: Callable[[str], None], max_line: int = MAX_LINE_BYTES) -> None:
        if max_line < 4:
            raise ValueError("max_line must be at least 4 bytes (one UTF-8 character)")
        self._on_line = on_line
        self._max = max_line
        self._parts: list[bytes] = []
        self._size = 0
        self._split = False  # a piece of the current line was handed on

    def _emit(self, raw: bytes | memoryview) -> None:
        self._on_line(str(raw, "utf-8", "replace"))

    def _pending(self, piece: bytes) -> None:
        if not piece:
            return
        self._parts.append(piece)
        self._size += len(piece)
        if self._size <= self._max:
            return
        buf = b"".join(self._parts)
        view = memoryview(buf)  # pieces are decoded from it without a copy
        start = 0
        # Strictly more than max: the byte after the cut is here, so the
        # cut can be moved to a character boundary.
        while len(buf) - start > self._max:
            cut = start + self._max
            # Back off to the start of a UTF-8 character (at most 3 bytes).
            back = cut
            while back > cut - 3 and (buf[back] & 0xC0) == 0x80:
                back -= 1
            if back > start and (buf[back] & 0xC0) != 0x80:
                cut = back
            self._emit(view[start:cut])
            self._split = True
            start = cut
        rest = buf[start:]
        self._parts = [rest] if rest else []
        self._size = len(rest)

    def _end_line(self, piece: bytes) -> None:
        if not self._parts and not self._split and len(piece) <= self._max:
            self._emit(piece)
            return
        self._pending(piece)
        tail = b"".join(self._parts)
        self._parts = []
        self._size = 0
        if tail or not self._split:
            self._emit(tail)
        self._split = False

    def feed(self, data: bytes) -> None:
        if b"\n" not in data:  # part of a long line: no split, no copy
            self._pending(data)
            return
        pieces = data.split(b"\n")
        last = pieces.pop()
        for raw in pieces:
            self._end_line(raw)
        self._pending(last)

    def close(self) -> None:
        if self._parts:
            self._emit(b"".join(self._parts))
        self._parts = []
        self._size = 0
        self._split = False


def _read_available(fd: int, lines: LineSplitter) -> bool:
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
    with contextlib.suppress(OSError):
        # A larger pipe: fewer wake-ups of the reader for chatty steps.
        fcntl.fcntl(read_fd, _F_SETPIPE_SZ, _PIPE_SIZE)
    os.set_blocking(read_fd, False)
    lines = LineSplitter(on_line)
    try:

        async def pump() -> None:
            while True:
                await anyio.wait_readable(read_fd)
                if not _read_available(read_fd, lines):
                    return

        result: CommandResult | None = None
        timed_out: CommandTimeout | None = None
        started: OSError | None = None
        async with anyio.create_task_group() as tg:
            tg.start_soon(pump)
            try:
                result = await run_command_status(
                    argv, cwd=cwd, env=env, timeout=timeout, stdout=write_fd, stderr=write_fd
                )
            except CommandTimeout as exc:
                timed_out = exc
            except OSError as exc:
                # The process could not start (E2BIG, ENOENT): raised to the
                # caller as itself, not inside an exception group.
                started = exc
            finally:
                tg.cancel_scope.cancel()
        if started is not None:
            raise started
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
