"""Per-namespace capture permits, namespace recording, post-capture hooks and
the `preloop snapshot` / `preloop sweep` commands."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import anyio
import pytest

from preloop import config
from preloop.errors import ConfigError, UsageError
from preloop.snapshot import (
    CaptureLimits,
    NamespacePermits,
    capture_workspace,
    layout,
    register_after_capture,
    unregister_after_capture,
)
from preloop.snapshot.permits import namespace_from_url, validate_namespace
from preloop.snapshot.work import CaptureFaults
from snapshot_support import FakeGit, git, make_repo


def test_permits_cap_one_namespace_without_holding_back_others() -> None:
    permits = NamespacePermits(limit=2)

    async def main() -> None:
        release = anyio.Event()
        inside: list[str] = []
        third_entered = anyio.Event()

        async def holder(ns: str, name: str, entered: anyio.Event | None = None) -> None:
            async with permits.hold(ns):
                inside.append(name)
                if entered is not None:
                    entered.set()
                await release.wait()

        async with anyio.create_task_group() as tg:
            tg.start_soon(holder, "acme", "a1")
            tg.start_soon(holder, "acme", "a2")
            await anyio.wait_all_tasks_blocked()
            tg.start_soon(holder, "acme", "a3", third_entered)
            other_entered = anyio.Event()
            tg.start_soon(holder, "other", "o1", other_entered)
            await other_entered.wait()  # another namespace is not held back
            await anyio.wait_all_tasks_blocked()
            assert sorted(inside) == ["a1", "a2", "o1"]
            assert permits.in_use("acme") == 2 and permits.in_use("other") == 1
            release.set()
            await third_entered.wait()
        assert sorted(inside) == ["a1", "a2", "a3", "o1"]
        assert permits.in_use("acme") == 0

    anyio.run(main)


def test_captures_of_one_namespace_queue_on_the_permit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With one permit per namespace, a second capture of the namespace waits
    until the first (hanging in git) ends; a capture of another namespace runs."""
    fake = FakeGit(tmp_path, monkeypatch)
    ws = make_repo(tmp_path / "ws", {"f.txt": "f\n"})
    other = make_repo(tmp_path / "other", {"o.txt": "o\n"})
    state = tmp_path / "state"
    permits = NamespacePermits(limit=1)
    fake.hang_on(r" add --all.*$")  # only the first capture's add hangs, see below
    order: list[str] = []

    async def main() -> None:
        hung = anyio.Event()

        async def first() -> None:
            async def gate() -> None:
                await fake.wait_for_hang()
                hung.set()
                monkeypatch.delenv("PRELOOP_FAKE_GIT_HANG")
                await other_done.wait()
                assert permits.in_use("acme") == 1
                order.append("first-expires")

            with pytest.raises(Exception, match="capture deadline"):
                await capture_workspace(
                    state,
                    ws,
                    "first",
                    namespace="acme",
                    permits=permits,
                    limits=CaptureLimits(timeout=600),
                    faults=CaptureFaults(deadline_gate=gate),
                )

        async def second() -> None:
            await hung.wait()
            await capture_workspace(state, ws, "second", namespace="acme", permits=permits)
            order.append("second")

        other_done = anyio.Event()

        async def other_ns() -> None:
            await hung.wait()
            snap = await capture_workspace(state, other, "other", namespace="beta", permits=permits)
            assert snap.namespace == "beta"
            order.append("other")
            other_done.set()

        async with anyio.create_task_group() as tg:
            tg.start_soon(first)
            tg.start_soon(second)
            tg.start_soon(other_ns)

    try:
        anyio.run(main)
    finally:
        fake.close()
    assert order == ["other", "first-expires", "second"]


def test_namespace_is_recorded_and_defaults_to_the_origin_owner(tmp_path: Path) -> None:
    ws = make_repo(tmp_path / "ws", {"f.txt": "f\n"})
    state = tmp_path / "state"
    plain = anyio.run(lambda: capture_workspace(state, ws, "n1"))
    assert plain.namespace == "default"
    git("remote", "add", "origin", "git@github.com:acme-corp/app.git", cwd=ws)
    owned = anyio.run(lambda: capture_workspace(state, ws, "n2"))
    assert owned.namespace == "acme-corp"
    assert git("config", "preloop.namespace", cwd=owned.repository).strip() == "acme-corp"
    explicit = anyio.run(lambda: capture_workspace(state, ws, "n3", namespace="tenant-7"))
    assert git("config", "preloop.namespace", cwd=explicit.repository).strip() == "tenant-7"
    with pytest.raises(UsageError, match="namespace"):
        anyio.run(lambda: capture_workspace(state, ws, "n4", namespace="bad/ns"))
    assert not layout.run_repository(state, "n4").exists()


def test_namespace_parsing() -> None:
    assert namespace_from_url("https://github.com/octo/repo.git") == "octo"
    assert namespace_from_url("https://x:y@gitlab.example.com/group/sub/repo") == "group"
    assert namespace_from_url("git@github.com:octo/repo.git") == "octo"
    assert namespace_from_url("/srv/git/repo.git") == "default"
    assert namespace_from_url(None) == "default"
    with pytest.raises(UsageError):
        validate_namespace("")


def test_permit_knob() -> None:
    env = {"PRELOOP_SNAPSHOT_CONCURRENCY_PER_NAMESPACE": "2"}
    bad = {"PRELOOP_SNAPSHOT_CONCURRENCY_PER_NAMESPACE": "0"}
    assert config.get("PRELOOP_SNAPSHOT_CONCURRENCY_PER_NAMESPACE", env) == 2
    assert config.get("PRELOOP_SNAPSHOT_CONCURRENCY_PER_NAMESPACE", {}) == 4
    with pytest.raises(ConfigError, match="PRELOOP_SNAPSHOT_CONCURRENCY_PER_NAMESPACE"):
        config.get("PRELOOP_SNAPSHOT_CONCURRENCY_PER_NAMESPACE", {**env, **bad})


def test_after_capture_hooks_run_outside_the_lock(tmp_path: Path) -> None:
    from preloop.snapshot.locks import try_acquire_cache_lock

    ws = make_repo(tmp_path / "ws", {"f.txt": "f\n"})
    state = tmp_path / "state"
    seen: list[tuple[str, bool, str]] = []

    def hook(state_dir: Path, key: str) -> None:
        lock = try_acquire_cache_lock(state_dir, key)
        seen.append((key, lock is not None, threading.current_thread().name))
        if lock is not None:
            lock.release()

    def failing(state_dir: Path, key: str) -> None:
        raise RuntimeError("hook failure must not fail the capture")

    register_after_capture(failing)
    register_after_capture(hook)
    try:
        snap = anyio.run(lambda: capture_workspace(state, ws, "h1", after_capture=hook))
    finally:
        unregister_after_capture(hook)
        unregister_after_capture(failing)
    assert [(k, free) for k, free, _ in seen] == [(snap.cache_key, True)] * 2
    assert all(name != threading.main_thread().name for _, _, name in seen)


PRELOOP = [sys.executable, "-m", "preloop"]


def test_cli_snapshot_and_sweep(tmp_path: Path) -> None:
    ws = make_repo(tmp_path / "ws", {"f.txt": "f\n"})
    (ws / "u.txt").write_text("u\n")
    state = tmp_path / "state"
    r = subprocess.run(
        [*PRELOOP, "snapshot", "--state-dir", str(state), "--run-id", "cli-1", "--json", str(ws)],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["run_id"] == "cli-1" and doc["repository"] == str(state / "snapshots/cli-1")
    assert (
        git("rev-parse", "refs/heads/snapshot", cwd=state / "snapshots/cli-1").strip()
        == doc["commit"]
    )
    plain = subprocess.run(
        [*PRELOOP, "snapshot", "--state-dir", str(state), "--run-id", "cli-2"],
        capture_output=True,
        text=True,
        cwd=ws,
    )
    assert plain.returncode == 0, plain.stderr
    assert plain.stdout.splitlines()[0].split() == ["run", "cli-2"]
    assert plain.stdout.splitlines()[2].split() == ["commit", doc["commit"]]
    again = subprocess.run(
        [*PRELOOP, "snapshot", "--state-dir", str(state), "--run-id", "cli-1", str(ws)],
        capture_output=True,
        text=True,
    )
    assert again.returncode == 1
    assert again.stderr.startswith("preloop: error: run cli-1 already has a snapshot")
    assert len(again.stderr.splitlines()) == 1
    bad = subprocess.run(
        [*PRELOOP, "snapshot", "--state-dir", str(state), "--run-id", "../x", str(ws)],
        capture_output=True,
        text=True,
    )
    assert bad.returncode == 2 and "run id" in bad.stderr
    # A leftover of a dead capture: an orphan staging directory.
    orphan = layout.staging_dir(state) / "dead-0123abcd"
    orphan.mkdir()
    swept = subprocess.run(
        [*PRELOOP, "sweep", "--state-dir", str(state), "--json"], capture_output=True, text=True
    )
    assert swept.returncode == 0, swept.stderr
    assert json.loads(swept.stdout)["removed"] == [str(orphan)]
    assert not orphan.exists()


def test_cli_without_git_is_one_clear_line(tmp_path: Path) -> None:
    empty = tmp_path / "empty-path"
    empty.mkdir()
    ws = make_repo(tmp_path / "ws", {"f.txt": "f\n"})
    r = subprocess.run(
        [*PRELOOP, "snapshot", "--state-dir", str(tmp_path / "state"), str(ws)],
        capture_output=True,
        text=True,
        env={**os.environ, "PATH": str(empty)},
    )
    assert r.returncode == 1
    assert r.stderr.endswith("git is not on PATH: install git\n")
    assert len(r.stderr.splitlines()) == 1
