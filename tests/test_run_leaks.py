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

import anyio
import pytest
from tests.run_support import make_repo, run_engine, workflow
from tests.test_run_cli import _env

from preloop.control import open_store
from preloop.engine import (
    ENGINE_CONTEXT_KEY,
    recover_abandoned_runs,
    run_repositories_in_use,
    settle_cancelled,
)
from preloop.runner.checkout import SNAPSHOT_CONTEXT_KEY
from preloop.snapshot.holders import (
    hold_run_repository,
    holder_marker_path,
    keep_run_repositories,
    release_run_repository,
    sweep_abandoned_run_repositories,
)
from preloop.workflow import load_workflow, plan

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


@pytest.mark.parametrize("at", ["SnapshotLocation", "release_run_repository"])
def test_preloop_sweep_removes_the_leak_and_prune_evicts_the_entry(tmp_path: Path, at: str) -> None:
    """`SnapshotLocation`: killed between capture and submit;
    `release_run_repository`: killed between the run's end and its cleanup."""
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
    leaked = _crash(_repo(tmp_path / "repo"), state, "SnapshotLocation")
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


def _dead_holder(state: Path, run_id: str) -> tuple[Path, Path]:
    """`snapshots/<run_id>` held by a process that died on this host."""
    repo = state / "snapshots" / run_id
    repo.mkdir(parents=True)
    marker = holder_marker_path(state, run_id)
    marker.parent.mkdir(parents=True, exist_ok=True)
    marker.write_text(json.dumps({"pid": 2**22 + 7, "start_ticks": 1, "host": os.uname()[1]}))
    return repo, marker


def test_run_repositories_in_use_reads_run_key_and_snapshot_location(tmp_path: Path) -> None:
    state = tmp_path / "state"
    contexts = {
        1: {"github": {ENGINE_CONTEXT_KEY: {"run_key": "run-a"}}},
        2: {"github": {SNAPSHOT_CONTEXT_KEY: {"repository": str(state / "snapshots" / "run-b")}}},
        3: {"github": {SNAPSHOT_CONTEXT_KEY: {"repository": "/elsewhere/snapshots/run-c"}}},
        4: {},
    }
    assert run_repositories_in_use(contexts, state) == {"run-a", "run-b"}


def test_an_unfinished_run_keeps_its_repository_from_preloop_run(
    tmp_path: Path, store_url: str
) -> None:
    """A same-host runner may still run a dead submitter's unfinished run from
    its run repository: the next `preloop run` on that store (its start sweep
    and its post-capture prune) keeps it, and sweeps it once the run ended."""
    state = tmp_path / "state"
    repo = _repo(tmp_path / "repo")
    kept, marker = _dead_holder(state, "run-in-use")
    gone, _ = _dead_holder(state, "run-unused")
    text = "on: push\njobs:\n  far:\n    runs-on: [self-hosted, nowhere]\n    steps: [{run: x}]\n"
    (tmp_path / "other.yml").write_text(text)
    github = {
        # Submitted from another host's engine: recovery leaves it alone.
        ENGINE_CONTEXT_KEY: {"host": "another-host", "pid": 1, "run_key": "run-elsewhere"},
        SNAPSHOT_CONTEXT_KEY: {"repository": str(kept), "ref": "snapshot", "commit": "0" * 40},
    }
    with open_store(store_url) as db:
        other = db.submit_run(plan(load_workflow(tmp_path / "other.yml"), "push"), github=github)
        assert set(db.unfinished_run_contexts()) == {other}
    try:
        outcome, _ = run_engine(repo, store_url, state, local_runners=1)
        assert outcome.conclusion == "success"
        assert kept.is_dir() and marker.exists()
        assert not gone.exists()
        with open_store(store_url) as db:
            anyio.run(settle_cancelled, db, other, "test over")
            assert db.unfinished_run_contexts() == {}
        outcome, _ = run_engine(repo, store_url, state, local_runners=1)
        assert outcome.conclusion == "success"
        assert not kept.exists() and not marker.exists()
    finally:
        keep_run_repositories(state, ())


def test_recovery_reads_unfinished_runs_in_one_query(store_url: str, tmp_path: Path) -> None:
    text = "on: push\njobs:\n  a:\n    runs-on: x\n    steps: [{run: x}]\n"
    (tmp_path / "w.yml").write_text(text)
    planned = plan(load_workflow(tmp_path / "w.yml"), "push")
    with open_store(store_url) as db:
        ids = [db.submit_run(planned, github={"n": n}) for n in range(3)]
        db.cancel_run(ids[1])
        anyio.run(settle_cancelled, db, ids[1], "done")
        contexts = db.unfinished_run_contexts()
        assert sorted(contexts) == [ids[0], ids[2]]
        assert contexts[ids[2]]["github"]["n"] == 2
        assert anyio.run(recover_abandoned_runs, db, tmp_path) == []
