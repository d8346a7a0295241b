"""Bounded command runners: output, caps, stdin, status, and the whole process
group killed on cancellation, timeout and caller exceptions (a grandchild's pid
must be gone). Every group-kill test has a twin that disables the group kill and
shows the grandchild survives, so the assertion can fail."""

from __future__ import annotations

import os
import select
import signal
from collections.abc import Awaitable, Callable
from pathlib import Path

import anyio
import pytest

from preloop import process
from preloop.process import (
    CommandFailed,
    CommandResult,
    CommandTimeout,
    run_command,
    run_command_capped,
    run_command_status,
    run_command_with_stdin,
)

# The direct child (sh) starts a grandchild in its group, reports its pid on a
# FIFO, then waits; only a group kill reaches the grandchild.
SPAWN = 'sleep 1000 </dev/null >/dev/null 2>&1 & echo $! > "$1"; wait'

Runner = Callable[[list[str]], Awaitable[CommandResult]]

RUNNERS: dict[str, Runner] = {
    "run_command": lambda argv: run_command(argv),
    "run_command_capped": lambda argv: run_command_capped(argv, max_output=10),
    "run_command_with_stdin": lambda argv: run_command_with_stdin(argv, b"x" * 100),
    "run_command_status": lambda argv: run_command_status(argv),
}


@pytest.fixture(autouse=True, params=["pidfd", "anyio"])
def core(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Every test runs on both cores: the pidfd one (Linux default) and the
    `anyio.open_process` one used where `pidfd_open` is unavailable."""
    if request.param == "anyio":
        monkeypatch.setattr(process, "_wait", process._wait_anyio)
    elif not process._PIDFD:
        pytest.skip("pidfd_open is unavailable here")
    return str(request.param)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            stat = fh.read()
    except FileNotFoundError:
        return False
    return stat[stat.rindex(b")") + 2 : stat.rindex(b")") + 3] != b"Z"


def _exited(pidfd: int, wait: float) -> bool:
    """True once the process behind `pidfd` has exited (bounded wait, no polling)."""
    readable, _, _ = select.select([pidfd], [], [], wait)
    return bool(readable)


async def _cancel_after_spawn(
    tmp_path: Path, start: Callable[[list[str]], Awaitable[object]]
) -> tuple[int, int]:
    """Starts the spawner through `start`, waits for the grandchild pid, cancels.
    Returns the grandchild pid and a pidfd for it."""
    fifo = tmp_path / "grandchild.fifo"
    os.mkfifo(fifo)
    argv = ["sh", "-c", SPAWN, "sh", str(fifo)]
    async with anyio.create_task_group() as tg:

        async def call() -> None:
            await start(argv)

        tg.start_soon(call)
        pid = int(await anyio.to_thread.run_sync(fifo.read_text))
        pidfd = os.pidfd_open(pid)
        tg.cancel_scope.cancel()
    return pid, pidfd


def _check(pid: int, pidfd: int, group_kill: bool) -> None:
    try:
        if group_kill:
            assert _exited(pidfd, 30), f"grandchild {pid} survived the group kill"
            assert not _alive(pid)
        else:
            # Only the direct child was killed: the grandchild still runs, which
            # is exactly what the group-kill assertion above would catch.
            assert not _exited(pidfd, 0)
            assert _alive(pid)
    finally:
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)
        os.close(pidfd)


@pytest.fixture(params=[True, False], ids=["group-kill", "group-kill-disabled"])
def group_kill(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> bool:
    enabled: bool = request.param
    monkeypatch.setattr(process, "_KILL_WHOLE_GROUP", enabled)
    return enabled


@pytest.mark.parametrize("name", sorted(RUNNERS))
def test_cancelled_call_kills_whole_group(tmp_path: Path, name: str, group_kill: bool) -> None:
    pid, pidfd = anyio.run(_cancel_after_spawn, tmp_path, RUNNERS[name])
    _check(pid, pidfd, group_kill)


def test_exception_in_caller_kills_whole_group(tmp_path: Path, group_kill: bool) -> None:
    class Boom(Exception):
        pass

    fifo = tmp_path / "grandchild.fifo"
    os.mkfifo(fifo)
    found: list[int] = []

    async def main() -> None:
        async with anyio.create_task_group() as tg:
            tg.start_soon(run_command, ["sh", "-c", SPAWN, "sh", str(fifo)])
            pid = int(await anyio.to_thread.run_sync(fifo.read_text))
            found.extend([pid, os.pidfd_open(pid)])
            raise Boom

    with pytest.raises(ExceptionGroup) as info:
        anyio.run(main)
    assert info.group_contains(Boom)
    _check(found[0], found[1], group_kill)


def test_own_timeout_kills_whole_group(tmp_path: Path, group_kill: bool) -> None:
    fifo = tmp_path / "grandchild.fifo"
    os.mkfifo(fifo)
    found: list[int] = []

    async def main() -> None:
        async def reader() -> None:
            pid = int(await anyio.to_thread.run_sync(fifo.read_text))
            found.extend([pid, os.pidfd_open(pid)])

        async with anyio.create_task_group() as tg:
            tg.start_soon(reader)
            with pytest.raises(CommandTimeout, match=r"did not finish within 0\.5s"):
                await run_command(["sh", "-c", SPAWN, "sh", str(fifo)], timeout=0.5)

    anyio.run(main)
    _check(found[0], found[1], group_kill)


def test_run_command_captures_output_and_status() -> None:
    result = anyio.run(
        lambda: run_command(["sh", "-c", "printf out; printf err >&2; exit 3"], check=False)
    )
    assert (result.returncode, result.stdout, result.stderr) == (3, b"out", b"err")
    assert result.duration >= 0 and not result.ok


def test_failure_names_command_and_last_stderr_line(tmp_path: Path) -> None:
    with pytest.raises(CommandFailed) as info:
        anyio.run(
            lambda: run_command(
                ["sh", "-c", "echo first >&2; echo 'the reason' >&2; exit 2"],
                cwd=tmp_path,
                display="sh <redacted>",
            )
        )
    message = str(info.value)
    assert "`sh <redacted>`" in message and str(tmp_path) in message
    assert "status 2" in message and message.endswith("the reason")


def test_capped_output_counts_kept_and_dropped() -> None:
    script = "head -c 100000 /dev/zero; head -c 7 /dev/zero >&2"
    result = anyio.run(lambda: run_command_capped(["sh", "-c", script], max_output=1000))
    assert (result.stdout_kept, result.stdout_dropped) == (1000, 99000)
    assert (result.stderr_kept, result.stderr_dropped) == (7, 0)


def test_stdin_is_fed_and_closed() -> None:
    data = os.urandom(300_000)  # larger than a pipe buffer
    result = anyio.run(lambda: run_command_with_stdin(["cat"], data))
    assert result.stdout == data


def test_stdin_child_that_stops_reading_is_not_an_error() -> None:
    result = anyio.run(lambda: run_command_with_stdin(["true"], b"y" * 1_000_000))
    assert result.returncode == 0


def test_status_only() -> None:
    result = anyio.run(lambda: run_command_status(["sh", "-c", "echo hidden; exit 4"]))
    assert (result.returncode, result.stdout) == (4, b"")
    with pytest.raises(CommandFailed):
        anyio.run(lambda: run_command_status(["false"], check=True))
