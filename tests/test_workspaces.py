"""A job's workspace has the same path from run to run (`preloop.runner.
workspaces`): the lowest free slot, held with flock, emptied when taken and
when given back."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from tests.run_support import make_repo, run_engine, workflow

from preloop.runner.checkout import sweep_work_dir, work_dir
from preloop.runner.workspaces import safe_dir_name, take_workspace_slot

pytest_plugins = ["preloop.testing.control_fixtures"]


def test_the_lowest_free_slot_is_taken_and_emptied(tmp_path: Path) -> None:
    first = take_workspace_slot(tmp_path, "acme/widget")
    assert first.workspace == tmp_path / "ws" / "0" / "widget" / "widget"
    second = take_workspace_slot(tmp_path, "acme/widget")
    assert second.workspace == tmp_path / "ws" / "1" / "widget" / "widget"
    # What a job leaves, read-only directories too (Go's module cache), goes.
    first.workspace.mkdir()
    locked = first.workspace / "pkg" / "mod"
    locked.mkdir(parents=True)
    (locked / "f").write_text("x")
    locked.chmod(0o555)
    locked.parent.chmod(0o555)
    first.release()
    first.release()  # once only
    assert not (tmp_path / "ws" / "0").exists()
    again = take_workspace_slot(tmp_path, "")
    assert again.workspace == tmp_path / "ws" / "0" / "workspace" / "workspace"
    again.release()
    second.release()


def test_a_slot_held_by_another_process_is_passed_over(tmp_path: Path) -> None:
    # flock on the slot's lock file, held by a live process (a runner).
    lock = tmp_path / "ws" / "0.lock"
    lock.parent.mkdir(parents=True)
    hold = "import sys; print('held', flush=True); sys.stdin.read()"
    holder = subprocess.Popen(
        ["flock", str(lock), sys.executable, "-c", hold],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"
        slot = take_workspace_slot(tmp_path, "o/r")
        assert slot.workspace.parent.parent.name == "1"
        slot.release()
    finally:
        assert holder.stdin is not None
        holder.stdin.close()
        holder.wait()
    # The holder is gone (a runner that died): its slot is free, and emptied.
    (tmp_path / "ws" / "0" / "left-over").mkdir(parents=True)
    slot = take_workspace_slot(tmp_path, "o/r")
    assert slot.workspace.parent.parent.name == "0"
    assert not (tmp_path / "ws" / "0" / "left-over").exists()
    slot.release()


def test_the_sweep_removes_what_released_slots_moved_aside(tmp_path: Path) -> None:
    """A slot whose contents would not go when released (a step's leftover
    process still writing there) moved them to `ws/.stale-*`; the work
    directory's sweep removes them, but never one a live process works in
    (read-only directories: the test above, as an ordinary user)."""
    ws = work_dir(tmp_path) / "ws"
    left = ws / ".stale-0-0123abcd" / "widget" / "pkg"
    left.mkdir(parents=True)
    (left / "f").write_text("x")
    left.chmod(0o555)
    busy = ws / ".stale-1-4567cdef"
    busy.mkdir()
    slot = take_workspace_slot(work_dir(tmp_path), "acme/widget")
    with subprocess.Popen(["sleep", "60"], cwd=busy) as holder:
        try:
            removed = sweep_work_dir(tmp_path)
        finally:
            holder.kill()
    assert removed == [ws / ".stale-0-0123abcd"]
    assert sorted(p.name for p in ws.iterdir()) == [".stale-1-4567cdef", "0", "0.lock"]
    slot.release()
    assert sweep_work_dir(tmp_path) == [busy]


@pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("setpriv") is None, reason="needs root and setpriv"
)
def test_read_only_directories_a_job_left_are_opened_and_removed(public_tmp: Path) -> None:
    """As an ordinary user (root needs no permission to unlink): a tree with
    read-only directories (Go's module cache: 0555, a file inside) goes."""
    code = (
        "import os, sys; from pathlib import Path; "
        "from preloop.runner.workspaces import clear_tree; "
        "root = Path(sys.argv[1]) / 'ws'; mod = root / 'pkg' / 'mod'; "
        "mod.mkdir(parents=True); (mod / 'f').write_text('x'); "
        "os.symlink('/etc', root / 'link'); "
        "mod.chmod(0o555); mod.parent.chmod(0o500); root.chmod(0o555); "
        "print(clear_tree(root), root.exists())"
    )
    os.chown(public_tmp, 65534, 65534)  # the job's user's own directory
    r = subprocess.run(
        ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
         sys.executable, "-c", code, str(public_tmp)],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["True", "False"]
    assert oct(os.stat("/etc").st_mode & 0o777) == "0o755"  # never through the link


def test_safe_dir_name() -> None:
    assert safe_dir_name("test#0", "job") == "test_0"
    assert safe_dir_name("..", "job") == "job"
    assert safe_dir_name("a b/c%d", "job") == "a_b_c_d"


def test_runs_of_a_repository_work_in_the_same_place(tmp_path: Path, store_url: str) -> None:
    repo = make_repo(
        tmp_path / "repo",
        workflow(
            """\
            on: push
            jobs:
              leg:
                strategy:
                  matrix:
                    k: [a]
                runs-on: ubuntu-latest
                steps:
                  - run: |
                      echo "ws=$GITHUB_WORKSPACE"
                      echo "runner-ws=$RUNNER_WORKSPACE"
                      test "$PWD" = "$GITHUB_WORKSPACE" && echo in-it
            """
        ),
    )
    state = tmp_path / "state"
    seen = []
    for _ in range(2):
        out, h = run_engine(repo, store_url, state, local_runners=1)
        assert out.conclusion == "success"
        lines = next(iter(h.lines.values()))
        assert "in-it" in lines, lines
        ws = next(line.removeprefix("ws=") for line in lines if line.startswith("ws="))
        assert f"runner-ws={os.path.dirname(ws)}" in lines
        seen.append(ws)
    assert seen[0] == seen[1], seen
    # No character a file:// URL would escape (a leg's id has `#`).
    assert Path(seen[0]).name == "repo" and "%" not in seen[0] and "#" not in seen[0]
    assert not Path(seen[0]).exists()  # given back, emptied
