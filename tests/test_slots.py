"""The host slot semaphore: real processes, real flock, real bubblewrap."""

from __future__ import annotations

import os
import selectors
import shutil
import signal
import stat
import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from preloop import _native
from preloop.fingerprint import (
    CoordinationError,
    HostSlots,
    Slot,
    coordination_dir,
    prepare_host_coordination,
    sandbox_bind_args,
)

SLOT_NAMES = ["admission", "slot-0", "slot-1", "slot-2", "slot-3"]
QUEUE_NAMES = [f"slot-{i}.queue-{level}" for i in range(4) for level in range(8)]


@pytest.fixture(autouse=True)
def _no_hooks() -> Iterator[None]:
    yield
    _native.set_test_hooks()


def python(code: str, *args: str, **kwargs: object) -> subprocess.Popen[str]:
    """A child Python running `code` with this interpreter and package."""
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        text=True,
        **kwargs,  # type: ignore[call-overload]
    )


def mode_of(path: Path) -> int:
    return stat.S_IMODE(path.lstat().st_mode)


def held(slots: HostSlots, count: int) -> list[Slot]:
    """Takes `count` slots without waiting; fails if any is not free."""
    out = []
    for _ in range(count):
        slot = slots.try_acquire()
        assert slot is not None
        out.append(slot)
    return out


def test_twelve_cold_start_processes_under_umask_077(tmp_path: Path) -> None:
    directory = tmp_path / "coordination"
    gate_r, gate_w = os.pipe()
    children = [
        python(
            """
            import os, sys
            from preloop.fingerprint import HostSlots
            os.umask(0o077)
            gate = int(sys.argv[1])
            assert os.read(gate, 1) == b""  # every child starts when the gate closes
            with HostSlots(sys.argv[2]).acquire() as slot:
                print(slot.index)
            """,
            str(gate_r),
            str(directory),
            pass_fds=(gate_r,),
            stdout=subprocess.PIPE,
        )
        for _ in range(12)
    ]
    os.close(gate_r)
    os.close(gate_w)
    for child in children:
        out, _ = child.communicate(timeout=60)
        assert child.returncode == 0
        assert int(out) in range(4)
    assert sorted(os.listdir(tmp_path)) == ["coordination"]
    assert sorted(os.listdir(directory)) == sorted(SLOT_NAMES + QUEUE_NAMES)
    assert mode_of(directory) == 0o1777
    for name in SLOT_NAMES + QUEUE_NAMES:
        assert mode_of(directory / name) == 0o666
        assert (directory / name).stat().st_size == 0


def test_seven_contenders_hold_at_most_four(tmp_path: Path) -> None:
    directory = tmp_path / "coordination"
    counter = tmp_path / "counter"
    counter.write_text("0 0")
    script = """
        import fcntl, sys
        from preloop.fingerprint import HostSlots

        def bump(delta):
            with open(sys.argv[2], "r+") as f:
                fcntl.flock(f, fcntl.LOCK_EX)
                current, peak = map(int, f.read().split())
                current += delta
                f.seek(0)
                f.truncate()
                f.write(f"{current} {max(peak, current)}")

        with HostSlots(sys.argv[1]).acquire():
            bump(+1)
            print("acquired", flush=True)
            sys.stdin.readline()  # hold until the test says release
            bump(-1)
        """
    children = [
        python(
            script,
            str(directory),
            str(counter),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        )
        for _ in range(7)
    ]
    sel = selectors.DefaultSelector()
    for child in children:
        assert child.stdout is not None
        sel.register(child.stdout, selectors.EVENT_READ, child)
    holders: list[subprocess.Popen[str]] = []

    def next_holder() -> subprocess.Popen[str]:
        for key, _ in sel.select(timeout=60):
            child: subprocess.Popen[str] = key.data
            assert child.stdout is not None
            assert child.stdout.readline() == "acquired\n"
            sel.unregister(child.stdout)
            return child
        raise AssertionError("no contender acquired a slot")

    while len(holders) < 4:
        holders.append(next_holder())
    assert HostSlots(directory).try_acquire() is None
    # Release the first four together, then each later holder as it reports in.
    pending = holders
    done = 0
    while done < 7:
        for child in pending:
            assert child.stdin is not None
            child.stdin.write("release\n")
            child.stdin.close()
            assert child.wait(60) == 0
            done += 1
        pending = [next_holder()] if done < 7 else []
    current, peak = map(int, counter.read_text().split())
    assert (current, peak) == (0, 4)


def test_full_cap_waiter_blocks_on_pid_mod_n_and_is_admitted(tmp_path: Path) -> None:
    directory = tmp_path / "coordination"
    first, second = held(HostSlots(directory, slots=2), 2)
    assert (first.index, second.index) == (0, 1)

    waiting_on: list[str] = []
    scanned = threading.Event()

    def after_full_scan(slot_path: str) -> None:
        waiting_on.append(slot_path)
        scanned.set()

    _native.set_test_hooks(full_scan=after_full_scan)
    waiter = HostSlots(directory, slots=2, pid=7)  # 7 % 2 == 1
    got: list[Slot] = []
    thread = threading.Thread(target=lambda: got.append(waiter.acquire()))
    thread.start()
    assert scanned.wait(30)
    assert waiting_on == [str(directory / "slot-1")]
    second.release()
    thread.join(30)
    assert not thread.is_alive()
    assert got[0].index == 1
    assert first.held
    assert HostSlots(directory, slots=2).try_acquire() is None  # slot 0 is still held
    got[0].release()
    first.release()


def test_sigkilled_holder_frees_its_slot_for_a_kernel_waiter(tmp_path: Path) -> None:
    directory = tmp_path / "coordination"
    holder = python(
        """
        import sys
        from preloop.fingerprint import HostSlots
        slot = HostSlots(sys.argv[1]).acquire()
        print(slot.index, flush=True)
        sys.stdin.readline()
        """,
        str(directory),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    assert holder.stdout is not None
    victim_slot = int(holder.stdout.readline())
    others = held(HostSlots(directory), 3)
    assert victim_slot not in [s.index for s in others]

    scanned = threading.Event()
    _native.set_test_hooks(full_scan=lambda path: scanned.set())
    got: list[Slot] = []
    waiter = HostSlots(directory, pid=victim_slot + 4)
    thread = threading.Thread(target=lambda: got.append(waiter.acquire()))
    thread.start()
    assert scanned.wait(30)
    holder.send_signal(signal.SIGKILL)
    assert holder.wait(30) == -signal.SIGKILL
    thread.join(30)
    assert not thread.is_alive()
    assert got[0].index == victim_slot
    for slot in [*others, *got]:
        slot.release()


def test_existing_private_modes_are_used_as_they_are(tmp_path: Path) -> None:
    directory = tmp_path / "coordination"
    directory.mkdir(mode=0o700)
    for name in SLOT_NAMES:
        (directory / name).touch(mode=0o600)
    (directory / "slot-0").write_bytes(b"not ours to truncate")
    slots = held(HostSlots(directory), 4)
    assert sorted(s.index for s in slots) == [0, 1, 2, 3]
    assert mode_of(directory) == 0o700
    assert mode_of(directory / "slot-0") == 0o600
    assert (directory / "slot-0").read_bytes() == b"not ours to truncate"
    for slot in slots:
        slot.release()


def test_missing_files_in_an_existing_directory_are_added(tmp_path: Path) -> None:
    directory = tmp_path / "coordination"
    directory.mkdir(mode=0o755)
    (directory / "slot-2").write_bytes(b"kept")
    with HostSlots(directory).acquire():
        pass
    assert sorted(os.listdir(directory)) == SLOT_NAMES
    assert (directory / "slot-2").read_bytes() == b"kept"
    assert mode_of(directory / "slot-3") == 0o666


def test_symlinked_slot_file_is_refused(tmp_path: Path) -> None:
    directory = prepare_host_coordination(tmp_path / "coordination")
    (directory / "slot-0").unlink()
    (directory / "slot-0").symlink_to(tmp_path / "elsewhere")
    (tmp_path / "elsewhere").touch()
    with pytest.raises(CoordinationError, match=f"{directory}/slot-0 is a symlink") as caught:
        HostSlots(directory).acquire()
    assert caught.value.path == str(directory / "slot-0")
    assert "files mode 0666" in str(caught.value)
    with pytest.raises(CoordinationError, match="slot-0 is a symlink"):
        prepare_host_coordination(directory)


def test_symlinked_admission_file_is_refused(tmp_path: Path) -> None:
    directory = prepare_host_coordination(tmp_path / "coordination")
    (directory / "admission").unlink()
    (directory / "admission").symlink_to(directory / "slot-3")
    with pytest.raises(CoordinationError, match=f"{directory}/admission is a symlink"):
        HostSlots(directory).try_acquire()


def test_symlinked_directory_is_refused(tmp_path: Path) -> None:
    real = prepare_host_coordination(tmp_path / "real")
    (tmp_path / "coordination").symlink_to(real)
    with pytest.raises(CoordinationError, match=f"{tmp_path}/coordination is a symlink"):
        HostSlots(tmp_path / "coordination").acquire()


def test_non_regular_slot_file_is_refused(tmp_path: Path) -> None:
    directory = prepare_host_coordination(tmp_path / "coordination")
    (directory / "slot-0").unlink()
    os.mkfifo(directory / "slot-0")
    with pytest.raises(CoordinationError, match="slot-0 is not a regular file"):
        HostSlots(directory).try_acquire()


def test_uncreatable_directory_names_path_and_mode(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    with pytest.raises(CoordinationError, match=f"{tmp_path}/file/coordination.*1777"):
        HostSlots(tmp_path / "file" / "coordination").acquire()


def test_prepare_adopts_without_truncating_and_binds_read_only(tmp_path: Path) -> None:
    directory = tmp_path / "coordination"
    assert prepare_host_coordination(directory) == directory
    (directory / "slot-1").write_bytes(b"unused contents")
    inode = (directory / "slot-1").stat().st_ino
    prepare_host_coordination(directory)
    assert (directory / "slot-1").read_bytes() == b"unused contents"
    assert (directory / "slot-1").stat().st_ino == inode
    assert sandbox_bind_args(directory) == ["--ro-bind", str(directory), str(directory)]


def test_directory_comes_from_the_knob_never_tmpdir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("PRELOOP_COORDINATION_DIR", raising=False)
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    assert coordination_dir() == Path("/var/tmp/preloop-coordination")
    assert HostSlots().directory == Path("/var/tmp/preloop-coordination")
    monkeypatch.setenv("PRELOOP_COORDINATION_DIR", str(tmp_path / "c"))
    assert HostSlots().directory == tmp_path / "c"
    assert sandbox_bind_args() == ["--ro-bind", str(tmp_path / "c"), str(tmp_path / "c")]


def python_binds_under_tmp() -> list[str]:
    """Read-only binds that keep this interpreter and package visible in a sandbox
    whose /tmp is private (a checkout or venv may itself live under /tmp)."""
    import preloop

    paths = {sys.prefix, sys.base_prefix, str(Path(preloop.__file__).parent), *sys.path}
    under_tmp = sorted(
        {os.path.realpath(p) for p in paths if p} | {os.path.abspath(p) for p in paths if p},
    )
    under_tmp = [p for p in under_tmp if p.startswith("/tmp/") and os.path.exists(p)]
    outermost = [p for p in under_tmp if not any(p.startswith(q + "/") for q in under_tmp)]
    return [arg for p in outermost for arg in ("--ro-bind", p, p)]


@pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed")
@pytest.mark.parametrize("queues", [True, False], ids=["queues", "older-directory"])
def test_sandboxed_process_shares_the_cap_through_a_read_only_bind(
    tmp_path: Path, queues: bool
) -> None:
    """A waiter inside the sandbox queues on the host's queue files; in a directory
    an older version made (no queue files, and the read-only bind cannot add them)
    it still waits in the kernel and gets the slot."""
    directory = prepare_host_coordination(tmp_path / "coordination")
    if not queues:
        for name in QUEUE_NAMES:
            (directory / name).unlink()
    assert str(directory).startswith("/tmp/")  # hidden by the sandbox's private /tmp
    host = held(HostSlots(directory), 4)
    sandboxed = subprocess.Popen(
        [
            "bwrap",
            "--bind", "/", "/",
            "--tmpfs", "/tmp",
            *python_binds_under_tmp(),
            *sandbox_bind_args(directory),
            "--die-with-parent",
            sys.executable, "-c",
            textwrap.dedent(
                """
                import os, sys
                from preloop.fingerprint import HostSlots
                d = sys.argv[1]
                assert not os.access(d, os.W_OK) or os.statvfs(d).f_flag & os.ST_RDONLY
                slots = HostSlots(d)
                print("busy" if slots.try_acquire() is None else "free", flush=True)
                slot = slots.acquire()
                print("acquired", slot.index, flush=True)
                sys.stdin.readline()
                """
            ),
            str(directory),
        ],
        text=True,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )  # fmt: skip
    assert sandboxed.stdout is not None and sandboxed.stdin is not None
    assert sandboxed.stdout.readline() == "busy\n"
    for slot in host:
        slot.release()
    line = sandboxed.stdout.readline()
    assert line.startswith("acquired ")
    assert sorted(os.listdir(directory)) == sorted(SLOT_NAMES + (QUEUE_NAMES if queues else []))
    # Now the sandbox holds one: the host gets exactly three.
    again = [s for s in (HostSlots(directory).try_acquire() for _ in range(4)) if s]
    assert len(again) == 3
    assert int(line.split()[1]) not in [s.index for s in again]
    sandboxed.stdin.write("done\n")
    sandboxed.stdin.close()
    assert sandboxed.wait(30) == 0
    for slot in again:
        slot.release()


def as_nobody(code: str, *args: str) -> subprocess.CompletedProcess[str]:
    """Runs `code` as the unprivileged user `nobody` (tests run as root)."""
    return subprocess.run(
        ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
         sys.executable, "-c", textwrap.dedent(code), *args],
        capture_output=True,
        text=True,
        timeout=60,
    )  # fmt: skip


needs_root = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("setpriv") is None,
    reason="needs root and setpriv to act as another user",
)


@needs_root
def test_another_user_shares_a_directory_cold_started_under_umask_077(public_tmp: Path) -> None:
    directory = public_tmp / "coordination"
    old = os.umask(0o077)
    try:
        mine = held(HostSlots(directory), 3)
    finally:
        os.umask(old)
    result = as_nobody(
        """
        import sys
        from preloop.fingerprint import HostSlots
        slots = HostSlots(sys.argv[1])
        slot = slots.try_acquire()
        print(slot.index, slots.try_acquire())
        """,
        str(directory),
    )
    assert result.returncode == 0, result.stderr
    index, second = result.stdout.split()
    assert int(index) not in [s.index for s in mine]
    assert second == "None"  # the fourth slot was the last: nobody shares root's cap
    for slot in mine:
        slot.release()


@needs_root
def test_unusable_entry_names_path_and_sharing_mode(public_tmp: Path) -> None:
    directory = public_tmp / "coordination"
    directory.mkdir(mode=0o755)
    for name in SLOT_NAMES:
        (directory / name).touch(mode=0o600)
    result = as_nobody(
        """
        import sys
        from preloop.fingerprint import HostSlots
        HostSlots(sys.argv[1]).acquire()
        """,
        str(directory),
    )
    assert result.returncode != 0
    assert "CoordinationError" in result.stderr
    assert f"cannot open coordination entry {directory}/admission read-only" in result.stderr
    assert "Permission denied" in result.stderr
    assert "files mode 0666" in result.stderr


def test_trailing_slash_names_the_same_directory(tmp_path: Path) -> None:
    directory = tmp_path / "coordination"
    _native.slots_prepare(f"{directory}/")
    assert sorted(os.listdir(tmp_path)) == ["coordination"]
    got = _native.slots_acquire(f"{directory}//", 4, False)
    assert got is not None and got[1] == 0
    os.close(got[0])
