"""Runs one step's process through `preloop.process` and streams its merged
stdout/stderr in batches of lines while it runs.

The child writes into a pipe we read without blocking. When the step's main
process exits, whatever is already in the pipe is read and the stream ends,
even if a background process the step started still holds the pipe open (its
later output is lost, its process group is killed when the job ends).
"""

from __future__ import annotations

import codecs
import contextlib
import errno
import fcntl
import os
from collections.abc import Callable, Mapping, Sequence

import anyio

from preloop.process import CommandResult, CommandTimeout, run_command_status

__all__ = ["MAX_LINE_CHARS", "LineSplitter", "run_streaming"]

_CHUNK = 65536
_PIPE_SIZE = 1 << 20
_F_SETPIPE_SZ = getattr(fcntl, "F_SETPIPE_SZ", 1031)


#: The longest line handed on in one piece, in characters. GitHub's runner
#: keeps a line's bytes in its log but its live console shows at most 1,024
#: characters of it; preloop splits a longer line into pieces of at most this
#: many characters, so no byte is dropped and the memory a step's output
#: needs does not grow with its longest line.
MAX_LINE_CHARS = 1 << 20


class LineSplitter:
    """Turns a byte stream into lines, in time linear in its length, and hands
    them on in batches: `on_lines` gets the lines each `feed` completed, in
    one list (one call per chunk, not per line: a step printing a million
    short lines costs a million list items, not a million calls down the
    pipeline).

    Each chunk is decoded once (UTF-8, invalid bytes replaced; a character
    split across chunks is completed by the next one) and only the new text
    is scanned for newlines, never the pending text again. A line longer than
    `max_line` characters is handed on in pieces of `max_line` characters."""

    def __init__(
        self, on_lines: Callable[[list[str]], None], max_line: int = MAX_LINE_CHARS
    ) -> None:
        if max_line < 1:
            raise ValueError("max_line must be at least 1 character")
        self._on_lines = on_lines
        self._max = max_line
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")
        self._parts: list[str] = []
        self._size = 0
        self._split = False  # a piece of the current line was handed on

    def _pending(self, text: str, out: list[str]) -> None:
        if not text:
            return
        self._parts.append(text)
        self._size += len(text)
        if self._size <= self._max:
            return
        buf = "".join(self._parts)
        start = 0
        while len(buf) - start > self._max:
            out.append(buf[start : start + self._max])
            self._split = True
            start += self._max
        rest = buf[start:]
        self._parts = [rest] if rest else []
        self._size = len(rest)

    def _end_line(self, text: str, out: list[str]) -> None:
        """Ends the pending line with `text`."""
        self._pending(text, out)
        tail = "".join(self._parts)
        self._parts = []
        self._size = 0
        if tail or not self._split:
            out.append(tail)
        self._split = False

    def _text(self, text: str) -> list[str]:
        """The lines `text` completes (pieces of a long line included)."""
        out: list[str] = []
        if "\n" not in text:  # part of a long line
            self._pending(text, out)
            return out
        lines = text.split("\n")
        last = lines.pop()
        if self._parts or self._split:
            self._end_line(lines[0], out)
            lines = lines[1:]
        limit = self._max
        if len(text) <= limit:
            out.extend(lines)  # the common case: no line of this chunk can be too long
        else:
            for line in lines:
                if len(line) <= limit:
                    out.append(line)
                else:
                    self._end_line(line, out)
        self._pending(last, out)
        return out

    def feed(self, data: bytes) -> None:
        out = self._text(self._decoder.decode(data))
        if out:
            self._on_lines(out)

    def close(self) -> None:
        out = self._text(self._decoder.decode(b"", final=True))
        if self._parts:
            out.append("".join(self._parts))
        self._parts = []
        self._size = 0
        self._split = False
        if out:
            self._on_lines(out)


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
    on_lines: Callable[[list[str]], None],
) -> CommandResult:
    """Runs `argv` (its own process group; killed whole on cancellation or
    `timeout`, which raises `CommandTimeout`) and calls `on_lines` with the
    lines of its combined output, in order, a batch per read."""
    read_fd, write_fd = os.pipe()
    with contextlib.suppress(OSError):
        # A larger pipe: fewer wake-ups of the reader for chatty steps.
        fcntl.fcntl(read_fd, _F_SETPIPE_SZ, _PIPE_SIZE)
    os.set_blocking(read_fd, False)
    lines = LineSplitter(on_lines)
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
