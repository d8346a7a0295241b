"""No leaked run repositories after a crash: a `preloop run` SIGKILLed between
capture and submit, or between its run's end and the cleanup, used to leave
`<state>/snapshots/<run>` for good, and its alternates kept the cache entry
out of eviction forever. Now `preloop sweep`, the next `preloop run` and the
object-cache prune remove it, and the prune then evicts the entry."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from tests.run_support import make_repo, workflow
from tests.test_run_cli import _env

from preloop.snapshot.holders import (
    hold_run_repository,
    holder_marker_path,
    release_run_repository,
    sweep_abandoned_run_repositories,
)

PRELOOP = [sys.executable, "-m", "preloop"]

# Runs the engine in a child that SIGKILLs itself at the named point.
_CRASHING_ENGINE = textwrap.dedent(
    """
    import os, signal, sys
    from pathlib import Path
    import anyio
    import preloop.engine as engine

    def die(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGKILL)

    setattr(engine, sys.argv[1], die)
    request = engine.RunRequest(
        workspace=Path(sys.argv[2]), state_dir=Path(sys.argv[3]), store_url=sys.argv[4],
        local_runners=1,
    )
    anyio.run(engine.Engine(request).run)
    """
)


def _repo(root: Path) -> Path:
    return make_repo(
        root,
        workflow(
            """\
            on: push
            jobs:
              a:
                runs-on: ubuntu-latest
                steps: [{run: echo hi}]
            """
        ),
    )


def _crash(repo: Path, state: Path, at: str) -> Path:
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            _CRASHING_ENGINE,
            at,
            str(repo),
            str(state),
            f"sqlite:///{state / 'preloop.db'}",
        ],
        env=_env(state),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == -9, proc.stderr
    leaked = [p for p in (state / "snapshots").iterdir() if not p.name.startswith(".")]
    assert len(leaked) == 1, leaked
    return leaked[0]


def _cache_entries(state: Path) -> list[str]:
    return sorted(p.name for p in (state / "snapshot-object-cache").glob("*.git"))


@pytest.mark.parametrize("at", ["open_store", "release_run_repository"])
def test_preloop_sweep_removes_the_leak_and_prune_evicts_the_entry(tmp_path: Path, at: str) -> None:
    """`open_store`: killed between capture and submit; `release_run_repository`:
    killed between the run's end and its cleanup."""
    state = tmp_path / "state"
    repo = _repo(tmp_path / "repo")
    leaked = _crash(repo, state, at)
    assert len(_cache_entries(state)) == 1
    # Before the sweep, the leak's alternates protect the entry.
    kept = subprocess.run(
        [*PRELOOP, "cache", "prune", "--dry-run", "--max-bytes", "1", "--json"],
        env=_env(state),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert kept.returncode == 0, kept.stderr
    swept = subprocess.run(
        [*PRELOOP, "sweep", "--json"],
        env=_env(state),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert swept.returncode == 0, swept.stderr
    assert str(leaked) in json.loads(swept.stdout)["removed"]
    assert not leaked.exists()
    pruned = subprocess.run(
        [*PRELOOP, "cache", "prune", "--max-bytes", "1", "--json"],
        env=_env(state),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert pruned.returncode == 0, pruned.stderr
    assert _cache_entries(state) == []


def test_prune_alone_sweeps_the_leak_then_evicts(tmp_path: Path) -> None:
    state = tmp_path / "state"
    leaked = _crash(_repo(tmp_path / "repo"), state, "open_store")
    pruned = subprocess.run(
        [*PRELOOP, "cache", "prune", "--max-bytes", "1"],
        env=_env(state),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert pruned.returncode == 0, pruned.stderr
    assert not leaked.exists() and _cache_entries(state) == []


def test_next_preloop_run_recovers_the_leak(tmp_path: Path) -> None:
    state = tmp_path / "state"
    repo = _repo(tmp_path / "repo")
    leaked = _crash(repo, state, "release_run_repository")
    again = subprocess.run(
        [*PRELOOP, "run", "-j", "1"],
        cwd=repo,
        env=_env(state),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert again.returncode == 0, again.stderr
    assert not leaked.exists()
    assert [p.name for p in (state / "snapshots").iterdir() if not p.name.startswith(".")] == []
    assert list((state / "snapshots" / ".holders").iterdir()) == []


def test_a_live_holder_and_unfinished_runs_keep_their_repository(tmp_path: Path) -> None:
    state = tmp_path / "state"
    repo = state / "snapshots" / "run-live"
    repo.mkdir(parents=True)
    hold_run_repository(state, "run-live")
    assert sweep_abandoned_run_repositories(state) == ([], [])
    assert repo.is_dir()
    # A dead holder whose run a caller still knows as unfinished is kept too.
    dead = state / "snapshots" / "run-dead"
    dead.mkdir()
    marker = holder_marker_path(state, "run-dead")
    marker.write_text(json.dumps({"pid": 2**22 + 7, "start_ticks": 1, "host": os.uname()[1]}))
    assert sweep_abandoned_run_repositories(state, in_use={"run-dead"}) == ([], [])
    removed, errors = sweep_abandoned_run_repositories(state)
    assert removed == [dead, marker] and errors == []
    release_run_repository(state, "run-live")
    assert not repo.exists() and not holder_marker_path(state, "run-live").exists()
