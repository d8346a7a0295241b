"""Bounded waits on the coordination directory, the descriptors kept per
`HostSlots` (and re-opened after fork), and parked waiters not starved.

Holders are real processes holding real flock locks, synchronised by pipes."""

from __future__ import annotations

import fcntl
import logging
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from preloop import _native
from preloop.fingerprint import HostSlots, Slot, SlotWaitTimeout, prepare_host_coordination

HOLDER = """
    import fcntl, os, sys
    directory, names = sys.argv[1], sys.argv[2].split(",")
    fds = []
    for name in names:
        fd = os.open(os.path.join(directory, name), os.O_RDONLY)
        fcntl.flock(fd, fcntl.LOCK_EX)
        fds.append(fd)
    print("held", flush=True)
    sys.stdin.readline()  # until the test closes our stdin
"""


@pytest.fixture(autouse=True)
def _no_hooks() -> Iterator[None]:
    yield
    _native.set_test_hooks()


def assert_taken(slot: Path) -> None:
    """A descriptor of its own (as another process would have) cannot lock `slot`."""
    probe = os.open(slot, os.O_RDONLY)
    try:
        with pytest.raises(BlockingIOError):
            fcntl.flock(probe, fcntl.LOCK_EX | fcntl.LOCK_NB)
    finally:
        os.close(probe)


class Holder:
    """A process holding exclusive flocks on coordination files until stopped."""

    def __init__(self, directory: Path, names: list[str], prefix: list[str] | None = None):
        self.proc = subprocess.Popen(
            [*(prefix or []), sys.executable, "-c", textwrap.dedent(HOLDER), str(directory),
             ",".join(names)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        assert self.proc.stdout is not None
        assert self.proc.stdout.readline() == "held\n"
        self.pid = self.proc.pid

    def stop(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        assert self.proc.wait(60) == 0


ALL_SLOTS = ["slot-0", "slot-1", "slot-2", "slot-3"]


def in_thread(fn: Callable[[], Any]) -> Any:
    """Runs fn in a thread; a call that blocks instead of returning fails the test."""
    out: list[Any] = []
    errors: list[BaseException] = []

    def call() -> None:
        try:
            out.append(fn())
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=call, daemon=True)
    thread.start()
    thread.join(30)
    assert not thread.is_alive(), "the call blocked"
    if errors:
        raise errors[0]
    return out[0]


def test_try_acquire_does_not_wait_for_a_held_admission_lock(tmp_path: Path) -> None:
    directory = prepare_host_coordination(tmp_path / "c")
    holder = Holder(directory, ["admission"])
    try:
        slot = in_thread(HostSlots(directory).try_acquire)
        assert slot is not None and slot.index == 0
        slot.release()
    finally:
        holder.stop()


def test_try_acquire_returns_none_when_admission_and_slots_are_held(tmp_path: Path) -> None:
    directory = prepare_host_coordination(tmp_path / "c")
    holder = Holder(directory, ["admission", *ALL_SLOTS])
    try:
        assert in_thread(HostSlots(directory).try_acquire) is None
    finally:
        holder.stop()


def test_blocking_acquire_with_free_slots_ignores_a_held_admission(tmp_path: Path) -> None:
    directory = prepare_host_coordination(tmp_path / "c")
    holder = Holder(directory, ["admission"])
    try:
        slot = in_thread(lambda: HostSlots(directory).acquire(timeout=0))
        slot.release()
    finally:
        holder.stop()


@pytest.mark.parametrize("names", [ALL_SLOTS, ["admission", *ALL_SLOTS]], ids=["slots", "all"])
def test_acquire_times_out_naming_the_holder(tmp_path: Path, names: list[str]) -> None:
    directory = prepare_host_coordination(tmp_path / "c")
    holder = Holder(directory, names)
    try:
        with pytest.raises(SlotWaitTimeout) as caught:
            in_thread(lambda: HostSlots(directory, report_after=0.1).acquire(timeout=0.3))
        message = str(caught.value)
        assert "within 0.3 s (PRELOOP_FINGERPRINT_SLOT_TIMEOUT)" in message
        assert f"pid {holder.pid} (" in message
        assert "slot-0" in message
        assert caught.value.path == str(directory)
    finally:
        holder.stop()
    # Nothing was left held: the slots are usable at once.
    slot = HostSlots(directory).try_acquire()
    assert slot is not None
    slot.release()


def test_a_long_wait_logs_who_holds_the_slots(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    directory = prepare_host_coordination(tmp_path / "c")
    holder = Holder(directory, ALL_SLOTS)
    released = threading.Event()

    def release_after_report(record: logging.LogRecord) -> bool:
        if "waiting" in record.getMessage() and not released.is_set():
            released.set()
            threading.Thread(target=holder.stop).start()
        return True

    logger = logging.getLogger("preloop.fingerprint")
    logger.addFilter(release_after_report)
    try:
        with caplog.at_level(logging.WARNING, logger="preloop.fingerprint"):
            slot = in_thread(lambda: HostSlots(directory, report_after=0.1).acquire())
        slot.release()
    finally:
        logger.removeFilter(release_after_report)
        if not released.is_set():
            holder.stop()
    assert released.is_set()
    assert any(f"held by pid {holder.pid} (slot-0, " in r.getMessage() for r in caplog.records)


def test_lock_holders_reads_the_kernel_lock_table(tmp_path: Path) -> None:
    directory = prepare_host_coordination(tmp_path / "c")
    holder = Holder(directory, ["slot-2", "admission"])
    try:
        assert HostSlots(directory).holders() == {
            "admission": [holder.pid],
            "slot-2": [holder.pid],
        }
    finally:
        holder.stop()
    assert HostSlots(directory).holders() == {}


def test_a_free_slot_with_a_parked_waiter_is_left_to_that_waiter(tmp_path: Path) -> None:
    directory = prepare_host_coordination(tmp_path / "c")
    holder = Holder(directory, ["slot-0"])
    mine = [HostSlots(directory).try_acquire() for _ in range(3)]
    assert sorted(s.index for s in mine if s) == [1, 2, 3]
    parked = threading.Event()
    _native.set_test_hooks(full_scan=lambda path: parked.set())
    waiter = HostSlots(directory, pid=4)  # parks on slot-0
    got: list[Slot] = []
    thread = threading.Thread(target=lambda: got.append(waiter.acquire()))
    thread.start()
    assert parked.wait(30)
    holder.stop()  # slot-0 is free now; its waiter may not have woken yet
    # A scanner arriving now must not take slot-0 from the waiter parked on it.
    assert HostSlots(directory).try_acquire() is None
    thread.join(30)
    assert not thread.is_alive()
    assert got[0].index == 0
    for slot in [*mine, *got]:
        assert slot is not None
        slot.release()


def test_a_full_cap_waiter_parks_on_its_slot_while_admission_is_held(tmp_path: Path) -> None:
    """A held admission lock (its holder may be preempted) never makes a waiter
    queue behind it: the waiter parks on its slot and gets it when it is freed."""
    directory = prepare_host_coordination(tmp_path / "c")
    admission = Holder(directory, ["admission"])
    slot_1 = Holder(directory, ["slot-1"])
    others = Holder(directory, ["slot-0", "slot-2", "slot-3"])
    parked = threading.Event()
    paths: list[str] = []

    def on_park(path: str) -> None:
        paths.append(path)
        parked.set()

    _native.set_test_hooks(full_scan=on_park)
    got: list[Slot] = []
    thread = threading.Thread(target=lambda: got.append(HostSlots(directory, pid=5).acquire()))
    thread.start()
    assert parked.wait(30)
    assert paths == [str(directory / "slot-1")]  # 5 % 4
    slot_1.stop()
    thread.join(30)
    assert not thread.is_alive()
    assert got[0].index == 1
    got[0].release()
    others.stop()
    admission.stop()


def test_waiters_spread_over_slots_nobody_waits_on(tmp_path: Path) -> None:
    directory = prepare_host_coordination(tmp_path / "c")
    holder = Holder(directory, ALL_SLOTS)
    paths: list[str] = []
    parked = threading.Semaphore(0)

    def on_park(path: str) -> None:
        paths.append(path)
        parked.release()

    _native.set_test_hooks(full_scan=on_park)
    got: list[Slot] = []
    threads = []
    for _ in range(2):
        # Both prefer slot 1 (pid 5 % 4); the second parks on the next free of waiters.
        t = threading.Thread(target=lambda: got.append(HostSlots(directory, pid=5).acquire()))
        t.start()
        assert parked.acquire(timeout=30)
        threads.append(t)
    assert paths == [str(directory / "slot-1"), str(directory / "slot-2")]
    holder.stop()
    for t in threads:
        t.join(30)
        assert not t.is_alive()
    assert sorted(s.index for s in got) == [1, 2]
    for slot in got:
        slot.release()


def test_forked_child_reopens_and_never_drops_the_parents_slot(tmp_path: Path) -> None:
    directory = prepare_host_coordination(tmp_path / "c")
    slots = HostSlots(directory)
    parents = slots.try_acquire()
    assert parents is not None and parents.index == 0
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: exits with a status the parent checks
        status = 1
        try:
            os.close(r)
            # The inherited descriptor shares the parent's lock: releasing the
            # inherited Slot must not unlock it, and the child takes another slot.
            parents.release()
            child = slots.try_acquire()
            others = [slots.try_acquire() for _ in range(3)]
            status = 0 if child is not None and child.index == 1 and others[2] is None else 2
            os.write(w, b"%d" % (child.index if child else -1))
        finally:
            os._exit(status)
    os.close(w)
    with os.fdopen(r, "rb") as pipe:
        assert pipe.read() == b"1"
    assert os.waitpid(pid, 0)[1] == 0
    # The parent still holds slot 0: a separate process sees it taken.
    assert_taken(directory / "slot-0")
    assert parents.held
    parents.release()
    # After the child exited, its slot is free again, and so is the parent's.
    again = [slots.try_acquire() for _ in range(4)]
    assert sorted(s.index for s in again if s) == [0, 1, 2, 3]
    for slot in again:
        assert slot is not None
        slot.release()


def test_slots_held_through_one_handle_are_distinct_across_threads(tmp_path: Path) -> None:
    slots = HostSlots(tmp_path / "c")
    barrier = threading.Barrier(4)
    got: list[Slot] = []
    lock = threading.Lock()

    def take() -> None:
        barrier.wait()
        slot = slots.acquire()
        with lock:
            got.append(slot)

    threads = [threading.Thread(target=take) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert sorted(s.index for s in got) == [0, 1, 2, 3]
    assert slots.try_acquire() is None
    for slot in got:
        slot.release()


needs_root = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("setpriv") is None,
    reason="needs root and setpriv to act as another user",
)


@needs_root
def test_fingerprint_command_honours_the_timeout_against_another_user(
    public_tmp: Path,
) -> None:
    directory = prepare_host_coordination(public_tmp / "coordination")
    tree = public_tmp / "tree"
    tree.mkdir()
    (tree / "f").write_text("x")
    holder = Holder(
        directory,
        ["admission", *ALL_SLOTS],
        prefix=["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"],
    )
    env = {
        **os.environ,
        "PRELOOP_COORDINATION_DIR": str(directory),
        "PRELOOP_FINGERPRINT_SLOT_TIMEOUT": "0.5",
    }
    try:
        r = subprocess.run(
            [sys.executable, "-m", "preloop", "fingerprint", str(tree)],
            capture_output=True,
            text=True,
            env=env,
            timeout=60,
            check=False,
        )
    finally:
        holder.stop()
    assert r.returncode == 1
    assert r.stdout == ""
    lines = r.stderr.splitlines()
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith(f"preloop: error: no fingerprint slot in {directory} became free")
    assert f"pid {holder.pid} (" in lines[0]


def test_fingerprint_timeout_knob_is_validated(tmp_path: Path) -> None:
    (tmp_path / "f").write_text("x")
    env = {**os.environ, "PRELOOP_FINGERPRINT_SLOT_TIMEOUT": "soon"}
    r = subprocess.run(
        [sys.executable, "-m", "preloop", "fingerprint", str(tmp_path)],
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )
    assert r.returncode == 2
    assert r.stderr.startswith("preloop: error: PRELOOP_FINGERPRINT_SLOT_TIMEOUT: ")


QUEUED = """
    import sys
    from preloop import _native
    from preloop.fingerprint import HostSlots
    _native.set_test_hooks(full_scan=lambda path: print("parked", path, flush=True))
    slot = HostSlots(sys.argv[1], slots=1).acquire()
    print("got", slot.index, flush=True)
    sys.stdin.readline()  # hold until the test says release
"""


def test_a_slots_waiters_are_served_in_the_order_they_queued(tmp_path: Path) -> None:
    """The first waiter is stopped when the slot is freed: the second, awake and
    woken, still does not take the slot ahead of it (flock alone lets the fastest
    waiter win, so a waiter could lose every release)."""
    directory = prepare_host_coordination(tmp_path / "c", slots=1)
    holder = Holder(directory, ["slot-0"])
    first = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(QUEUED), str(directory)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert first.stdout is not None and first.stdin is not None
    try:
        assert first.stdout.readline() == f"parked {directory / 'slot-0'}\n"
        parked = threading.Event()
        _native.set_test_hooks(full_scan=lambda path: parked.set())
        order: list[str] = []

        def second() -> None:
            with HostSlots(directory, slots=1).acquire():
                order.append("second")

        thread = threading.Thread(target=second)
        thread.start()
        assert parked.wait(30)
        first.send_signal(signal.SIGSTOP)
        holder.stop()  # the slot is free; its first waiter cannot run
        first.send_signal(signal.SIGCONT)
        assert first.stdout.readline() == "got 0\n"
        order.append("first")
        first.stdin.write("release\n")
        first.stdin.flush()
        thread.join(30)
        assert not thread.is_alive()
        assert order == ["first", "second"]
    finally:
        first.kill()
        first.wait(30)


def test_a_long_wait_keeps_its_place_while_it_logs(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The holders are logged while the waiter stays queued: a waiter that queued
    behind it before the report still gets the slot after it."""
    directory = prepare_host_coordination(tmp_path / "c", slots=1)
    holder = Holder(directory, ["slot-0"])
    parked = threading.Semaphore(0)
    reported = threading.Event()
    _native.set_test_hooks(full_scan=lambda path: parked.release())

    def on_report(record: logging.LogRecord) -> bool:
        if "waiting" in record.getMessage():
            reported.set()
        return True

    logger = logging.getLogger("preloop.fingerprint")
    logger.addFilter(on_report)
    order: list[str] = []

    def wait(name: str, report_after: float) -> None:
        with HostSlots(directory, slots=1, report_after=report_after).acquire():
            order.append(name)

    try:
        with caplog.at_level(logging.WARNING, logger="preloop.fingerprint"):
            first = threading.Thread(target=wait, args=("first", 1.0))
            first.start()
            assert parked.acquire(timeout=30)
            second = threading.Thread(target=wait, args=("second", 3600.0))
            second.start()
            assert parked.acquire(timeout=30)
            assert reported.wait(30)  # the first waiter logged the holder
            holder.stop()
            for t in (first, second):
                t.join(30)
                assert not t.is_alive()
    finally:
        logger.removeFilter(on_report)
    assert order == ["first", "second"]
    assert any(f"held by pid {holder.pid} (slot-0" in r.getMessage() for r in caplog.records)


MARKER = """
    import fcntl, os, struct, sys
    fd = os.open(sys.argv[1], os.O_RDONLY)
    # A waiter's mark: an OFD read lock on byte 0 of the slot file.
    fcntl.fcntl(fd, fcntl.F_OFD_SETLK, struct.pack("hhqqi", fcntl.F_RDLCK, 0, 0, 1, 0))
    print("marked", flush=True)
    sys.stdin.readline()
"""


def test_choosing_where_to_wait_never_drops_a_slot_the_handle_holds(tmp_path: Path) -> None:
    directory = prepare_host_coordination(tmp_path / "c")
    slots = HostSlots(directory, pid=4)  # prefers slot 0
    mine = [slots.try_acquire() for _ in range(4)]
    assert all(mine)
    marker = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(MARKER), str(directory / "slot-0")],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert marker.stdout is not None and marker.stdin is not None
    parked: list[str] = []
    event = threading.Event()

    def on_park(path: str) -> None:
        parked.append(path)
        event.set()

    try:
        assert marker.stdout.readline() == "marked\n"
        _native.set_test_hooks(full_scan=on_park)
        got: list[Slot] = []
        thread = threading.Thread(target=lambda: got.append(slots.acquire()))
        thread.start()
        assert event.wait(30)
        # Slot 0 (a waiter queued on it, held through this handle) is still held.
        assert_taken(directory / "slot-0")
        assert parked == [str(directory / "slot-1")]  # the shorter queue
        mine[1].release()  # type: ignore[union-attr]
        thread.join(30)
        assert not thread.is_alive()
        assert got[0].index == 1
    finally:
        marker.stdin.close()
        marker.wait(30)
    for slot in [*mine, *got]:
        assert slot is not None
        slot.release()


def test_wait_reports_wake_their_thread_only_for_an_earlier_report() -> None:
    """Contended acquisitions come hundreds a second: each must not wake the
    reporting thread, yet a wait due before the thread's next wake-up is reported
    on time."""
    from preloop.fingerprint.wait_reports import WaitReports

    notified = 0

    class Counting(threading.Condition):
        def notify(self, n: int = 1) -> None:
            nonlocal notified
            notified += 1
            super().notify(n)

    reports = WaitReports()
    reports._cond = Counting()
    for _ in range(1000):
        reports.unwatch(reports.watch(3600.0, 3600.0, lambda waited: "never due"))
    assert notified == 1  # the first, which started the thread
    reported = threading.Event()

    def describe(waited: float) -> str:
        reported.set()
        return f"waited {waited:.1f} s"

    key = reports.watch(0.05, 3600.0, describe)
    try:
        assert reported.wait(30)
    finally:
        reports.unwatch(key)
    assert notified == 2


def test_a_waiter_placed_behind_a_racing_one_moves_to_a_shorter_queue(tmp_path: Path) -> None:
    """Waiters choosing at once see the same shortest queue; the one that ends up
    behind the other moves to a queue with fewer waiters ahead instead of waiting
    a whole extra hold. The race is made by holding slot 0's first place without
    its mark, as a waiter does for a moment between taking a place and marking it."""
    directory = prepare_host_coordination(tmp_path / "c", slots=2)
    holders = {name: Holder(directory, [name]) for name in ("slot-0", "slot-1")}
    racer = Holder(directory, ["slot-0.queue-0"])
    parked: list[str] = []
    parked_once = threading.Event()

    def on_park(path: str) -> None:
        parked.append(path)
        parked_once.set()

    _native.set_test_hooks(full_scan=on_park)
    got: list[Slot] = []
    # pid 2 prefers slot 0 (2 % 2): both queues are empty by their marks.
    waiter = threading.Thread(
        target=lambda: got.append(HostSlots(directory, slots=2, pid=2).acquire())
    )
    try:
        waiter.start()
        assert parked_once.wait(30)
        assert parked == [str(directory / "slot-1")]
        holders.pop("slot-1").stop()
        waiter.join(30)
        assert not waiter.is_alive()
        assert [slot.index for slot in got] == [1]
        got[0].release()
    finally:
        racer.stop()
        for holder in holders.values():
            holder.stop()
        waiter.join(30)


def test_a_wait_report_that_fails_does_not_end_the_later_ones(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Describing a wait reads the kernel's lock table and may fail; the
    reporting thread logs that and goes on reporting the other waits."""
    from preloop.fingerprint.wait_reports import WaitReports

    reports = WaitReports()
    reported = threading.Event()

    def broken(waited: float) -> str:
        raise OSError("the lock table is unreadable")

    def describe(waited: float) -> str:
        reported.set()
        return "still waiting"

    with caplog.at_level(logging.WARNING, logger="preloop.fingerprint"):
        first = reports.watch(0.01, 3600.0, broken)
        try:
            second = reports.watch(0.05, 3600.0, describe)
            try:
                assert reported.wait(30)
            finally:
                reports.unwatch(second)
        finally:
            reports.unwatch(first)
    assert any("could not describe" in r.getMessage() for r in caplog.records)
