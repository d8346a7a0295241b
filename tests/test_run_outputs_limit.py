"""GitHub's 50 MB limit on a run's job outputs holds when jobs of one run
complete at once: the store checks it inside the completion's transaction,
with the run row locked (it used to be a read of the total followed by a
separate completion, so two jobs finishing together could both pass). Every
test runs on both stores, with the limit scaled down."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import pytest
from tests.run_support import make_repo, run_engine, workflow

import preloop.control.types as control_types
from preloop.control import Completion, Lease, Store, open_store
from preloop.runner.logs import read_result
from preloop.testing.plans import PlanBuilder

# Each job's outputs below are ~2000 characters: one fits, two do not.
LIMIT = 3000


@pytest.fixture(autouse=True)
def _small_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(control_types, "RUN_OUTPUTS_MAX_BYTES", LIMIT)


def _two_claimed(store: Store) -> tuple[int, list[Lease]]:
    """Two legs of a three-leg matrix, claimed: their unit does not end when
    they do, so a completion takes the stores' one-statement (fast) path."""
    b = PlanBuilder()
    b.matrix("m", 3)
    run_id = store.submit_run(b.plan())
    leases = store.claim_jobs("r", ["ubuntu-latest"], limit=2)
    assert sorted(lease.job_id for lease in leases) == ["m#0", "m#1"]
    return run_id, leases


def _recorded(store: Store, run_id: int) -> dict[str, tuple[str | None, dict[str, str]]]:
    return {j.id: (j.conclusion, j.outputs) for j in store.list_jobs(run_id)}


def _check_one_refused(store: Store, run_id: int, done: list[Completion]) -> None:
    refused = [d for d in done if d.outputs_refused is not None]
    assert len(refused) == 1, done
    loser = refused[0]
    assert loser.conclusion == "failure"
    assert "would take run" in str(loser.outputs_refused)
    recorded = _recorded(store, run_id)
    assert recorded[loser.job_id] == ("failure", {})
    winner = "m#1" if loser.job_id == "m#0" else "m#0"
    assert recorded[winner][0] == "success" and recorded[winner][1]
    assert store.get_job(run_id, loser.job_id).reason == loser.outputs_refused


def test_two_jobs_reported_in_one_batch(store: Store) -> None:
    """A runner with two slots reports two jobs that finished together in one
    `complete_and_claim`: one of them is refused (the PostgreSQL one-statement
    path hands the batch to the Python cascade, which decides)."""
    run_id, leases = _two_claimed(store)
    results = [(lease, "success", {lease.job_id: "x" * 2000}) for lease in leases]
    done, _ = store.complete_and_claim(results, "r", ["ubuntu-latest"], limit=0)
    _check_one_refused(store, run_id, done)


def test_two_jobs_completed_at_once_from_two_connections(store: Store, store_url: str) -> None:
    """Two runners complete one job each at the same moment: the second
    completion waits for the first's run row and sees its outputs."""
    run_id, leases = _two_claimed(store)
    start = threading.Barrier(2)
    done: list[Completion] = []
    errors: list[BaseException] = []

    def complete(lease: Lease) -> None:
        try:
            with open_store(store_url) as own:
                start.wait()
                done.append(own.complete_job(lease, "success", {lease.job_id: "y" * 2000}))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=complete, args=(lease,)) for lease in leases]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    _check_one_refused(store, run_id, done)


def test_small_outputs_keep_the_one_statement_path(store: Store) -> None:
    """Outputs under the limit cost no extra statement: on PostgreSQL the batch
    stays one call of `preloop_complete_claim` (no fallback)."""
    run_id, leases = _two_claimed(store)
    store.counters.reset()
    done, _ = store.complete_and_claim(
        [(leases[0], "success", {"a": "z" * 100})], "r", ["ubuntu-latest"], limit=0
    )
    assert done[0].outputs_refused is None and done[0].conclusion == "success"
    stats = store.counters.snapshot().statements
    assert not any(op.endswith(".fallback") for op in stats), stats
    if store.dialect == "pg":
        assert stats.get("complete_and_claim") == 1, stats
    assert _recorded(store, run_id)["m#0"] == ("success", {"a": "z" * 100})


def test_two_jobs_finishing_together_in_preloop_run(tmp_path: Path, store_url: str) -> None:
    """End to end: two jobs of one run end at the same moment (each waits for
    the other through two FIFOs), on two local runners."""
    rendezvous = tmp_path / "rv"
    rendezvous.mkdir()
    for name in ("a", "b"):
        os.mkfifo(rendezvous / name)
    # Writing to the other's FIFO blocks until it reads; reading ours, until it writes.
    step = (
        'printf "{me}=%s\\n" "$(head -c 2000 /dev/zero | tr "\\0" {me})" >> "$GITHUB_OUTPUT"\n'
        "echo > {rv}/{other} & cat {rv}/{me} > /dev/null; wait\n"
    )
    jobs = {
        me: {
            "runs-on": "ubuntu-latest",
            "outputs": {me: f"${{{{ steps.s.outputs.{me} }}}}"},
            "steps": [{"id": "s", "run": step.format(me=me, other=other, rv=rendezvous)}],
        }
        for me, other in (("a", "b"), ("b", "a"))
    }
    text = json.dumps({"on": "push", "jobs": jobs})
    state = tmp_path / "state"
    repo = make_repo(tmp_path / "repo", workflow(text))
    outcome, h = run_engine(repo, store_url, state, local_runners=2)
    conclusions = sorted((j.id, j.conclusion) for j in outcome.jobs)
    failed = [j for j in outcome.jobs if j.conclusion == "failure"]
    assert len(failed) == 1, conclusions
    assert failed[0].outputs == {}
    saved = read_result(state, outcome.run_id, failed[0].id)
    assert saved is not None
    assert any("would take run" in a["message"] for a in saved["annotations"]), saved
    assert any("would take run" in line for line in h.lines[failed[0].id])


def test_small_outputs_cost_no_statement_on_the_cascade_path(store: Store) -> None:
    """A job that ends its unit takes the cascade path: on PostgreSQL,
    completing it with outputs under the limit costs the same statements (round
    trips) as without outputs; the check is inside `preloop_settle`. (SQLite is
    in the process: its check is one more statement, and no round trip.)"""
    b = PlanBuilder()
    b.job("a")
    b.job("c", needs=["a"])
    costs = []
    for outputs in (None, {"a": "small"}):
        run_id = store.submit_run(b.plan())
        (lease,) = store.claim_jobs("r", ["ubuntu-latest"], limit=1, run_id=run_id)
        store.counters.reset()
        done = store.complete_job(lease, "success", outputs)
        assert done.outputs_refused is None and done.conclusion == "success"
        costs.append(store.counters.snapshot().statements.get("complete_job"))
        assert _recorded(store, run_id)["a"] == ("success", outputs or {})
    if store.dialect == "pg":
        assert costs[0] == costs[1], costs
