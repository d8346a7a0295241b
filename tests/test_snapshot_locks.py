"""Cache layout, per-entry flock and capture pins, with real processes holding real locks."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import anyio
import pytest

from preloop.errors import UsageError
from preloop.snapshot import layout, locks
from preloop.snapshot.errors import CacheLockTimeout

KEY = layout.cache_key("url:https://example.com/o/r", "r")

HOLDER = """
import sys
from pathlib import Path
from preloop.snapshot.locks import acquire_cache_lock
lock = acquire_cache_lock(Path(sys.argv[1]), sys.argv[2], 5)
print("held", flush=True)
sys.stdin.read()  # hold until the test closes our stdin
"""


def _holder(state: Path) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(state), KEY],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    assert proc.stdout.readline() == "held\n"
    return proc


def test_layout_paths(tmp_path: Path) -> None:
    assert layout.run_repository(tmp_path, "r1") == tmp_path / "snapshots" / "r1"
    staging = layout.staging_path(tmp_path, "r1", "0123abcd")
    assert staging == tmp_path / "snapshots" / ".staging" / "r1-0123abcd"
    assert layout.owner_marker_path(staging).name == "r1-0123abcd.owner"
    assert layout.cache_repository(tmp_path, KEY).name == f"{KEY}.git"
    for path, kind in [
        (layout.cache_repository(tmp_path, KEY), "git"),
        (layout.cache_index_path(tmp_path, KEY), "index"),
        (layout.cache_last_head_path(tmp_path, KEY), "last-head"),
        (layout.cache_lock_path(tmp_path, KEY), "lock"),
        (layout.cache_pin_path(tmp_path, KEY, "12-ab"), "pin"),
    ]:
        parsed = layout.parse_cache_entry_name(path.name)
        assert parsed is not None and parsed.key == KEY and parsed.kind == kind
    assert layout.parse_cache_entry_name("random.txt") is None
    parsed_staging = layout.parse_staging_name("run-7-0123abcd")
    assert parsed_staging == layout.StagingName("run-7", "0123abcd", False)
    with pytest.raises(UsageError, match="run id"):
        layout.run_repository(tmp_path, "../escape")


def test_url_keys_ignore_credentials() -> None:
    a = layout.cache_key_for_url("https://user:s3cret@github.com/o/repo.git")
    b = layout.cache_key_for_url("https://github.com/o/repo")
    assert a == b and "s3cret" not in a and a.startswith("repo-")
    assert layout.strip_url_credentials("https://x:y@h/p") == "https://h/p"


def test_lock_is_exclusive_across_processes_and_bounded(tmp_path: Path) -> None:
    holder = _holder(tmp_path)
    try:
        assert locks.try_acquire_cache_lock(tmp_path, KEY) is None
        with pytest.raises(CacheLockTimeout) as info:
            locks.acquire_cache_lock(tmp_path, KEY, timeout=0.05)
        assert str(layout.cache_lock_path(tmp_path, KEY)) in str(info.value)
    finally:
        assert holder.stdin is not None
        holder.stdin.close()
        holder.wait()
    # The holder exited: the kernel released its lock.
    lock = locks.acquire_cache_lock(tmp_path, KEY, timeout=5)
    assert lock.held
    lock.release()
    lock.release()  # idempotent
    assert not lock.held


def test_async_lock_wait_is_cancellable(tmp_path: Path) -> None:
    async def main() -> None:
        with locks.acquire_cache_lock(tmp_path, KEY, timeout=1):
            with anyio.move_on_after(0.05) as scope:
                await locks.acquire_cache_lock_async(tmp_path, KEY, timeout=60)
            assert scope.cancelled_caught
        lock = await locks.acquire_cache_lock_async(tmp_path, KEY, timeout=1)
        lock.release()

    anyio.run(main)


def test_pins_record_owner_and_drop(tmp_path: Path) -> None:
    with locks.acquire_cache_lock(tmp_path, KEY, timeout=1):
        pin = locks.CachePin.create(tmp_path, KEY, run_id="r1")
    assert locks.list_pins(tmp_path, KEY) == [pin.path]
    info = locks.read_pin(pin.path)
    assert info is not None
    assert info.owner.pid == os.getpid() and info.owner.is_alive() and info.run_id == "r1"
    pin.drop()
    pin.drop()
    assert locks.list_pins(tmp_path, KEY) == []
    assert locks.read_pin(pin.path) is None
    pin.path.write_text("garbage")
    with pytest.raises(ValueError, match="not a preloop cache pin"):
        locks.read_pin(pin.path)
