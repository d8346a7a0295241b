"""A cancelled job keeps why it was cancelled (fail-fast, a concurrency
group, the user), also when it was running and its runner reported the end
without a reason; a run's cancel reason is read from them. Both stores."""

from __future__ import annotations

from pathlib import Path

import pytest

from preloop.control import Store
from preloop.control.cascade import RUN_CANCELLED
from preloop.engine import JobRecord, RunOutcome
from preloop.testing.plans import PlanBuilder
from preloop.workflow.plan import ConcurrencySpec, Plan

GROUP_REASON = "cancelled in progress by concurrency group {!r}"


def reasons(store: Store, run_id: int) -> dict[str, tuple[str | None, str | None]]:
    return {j.id: (j.conclusion, j.reason) for j in store.list_jobs(run_id)}


def outcome(store: Store, run_id: int) -> RunOutcome:
    """The run as `preloop run` reports it."""
    jobs = [
        JobRecord(j.id, j.name, j.kind, j.status, j.conclusion, {}, j.reason, None, None, [])
        for j in store.list_jobs(run_id)
    ]
    run = store.get_run(run_id)
    assert run.conclusion is not None
    return RunOutcome(run_id, "w.yml", run.conclusion, jobs, False, Path("."))


def test_fail_fast_reason_survives_every_completion_path(store: Store) -> None:
    """Running legs told to stop by fail-fast keep the reason whether their
    runner's result comes in a batch (no reason) or is settled."""
    b = PlanBuilder()
    b.matrix("ff", 4, fail_fast=True)
    run_id = store.submit_run(b.plan())
    legs = [store.claim_job("r", []) for _ in range(4)]
    assert all(leg is not None for leg in legs)
    l0, l1, l2, l3 = legs
    assert l0 is not None and l1 is not None and l2 is not None and l3 is not None
    store.complete_job(l0, "failure")
    assert store.heartbeat(l1).cancel_requested
    why = "fail-fast: leg 'ff#0' failed"
    store.complete_and_claim([(l1, "cancelled", {})], "r", [])  # the runner's batch
    store.complete_job(l2, "success")  # a leg that finished before it saw the request
    store.settle_job(run_id, l3.job_id, "cancelled")  # the engine's settle, no reason
    assert reasons(store, run_id) == {
        "ff#0": ("failure", None),
        "ff#1": ("cancelled", why),
        "ff#2": ("cancelled", why),
        "ff#3": ("cancelled", why),
    }
    # An explicit reason given when settling still wins.
    b2 = PlanBuilder()
    b2.matrix("ff", 2, fail_fast=True)
    other = store.submit_run(b2.plan())
    m0, m1 = store.claim_job("r", []), store.claim_job("r", [])
    assert m0 is not None and m1 is not None
    store.complete_job(m0, "failure")
    store.settle_job(other, m1.job_id, "cancelled", reason="cancelled by Ctrl-C")
    assert reasons(store, other)["ff#1"] == ("cancelled", "cancelled by Ctrl-C")


def test_job_group_cancel_in_progress_reason(store: Store) -> None:
    b = PlanBuilder()
    conc = ConcurrencySpec("deploy", cancel_in_progress=True)
    b.job("a", concurrency=conc)
    b.job("b", needs=["gate"], concurrency=conc)
    b.job("gate")
    run_id = store.submit_run(b.plan())
    a = store.claim_job("r", [])
    gate = store.claim_job("r", [])
    assert a is not None and gate is not None and a.job_id == "a"
    store.complete_job(gate, "success")  # b arrives: the running holder a is told to stop
    assert store.heartbeat(a).cancel_requested
    store.complete_and_claim([(a, "success", {})], "r", [])
    assert reasons(store, run_id)["a"] == ("cancelled", GROUP_REASON.format("deploy"))


def _wf_plan(name: str, group: str, cancel: bool) -> Plan:
    b = PlanBuilder(concurrency=ConcurrencySpec(group, cancel_in_progress=cancel))
    b.job("only", name=name)
    b.job("more", needs=["only"])
    return b.plan(name)


def test_workflow_group_cancel_in_progress_is_the_runs_reason(store: Store) -> None:
    """A run cancelled by a newer run of its workflow-level group says so,
    not "cancelled by the user"."""
    r1 = store.submit_run(_wf_plan("one", "wf", True))
    first = store.claim_job("r", [])
    assert first is not None and first.run_id == r1
    store.submit_run(_wf_plan("two", "wf", True))
    assert store.heartbeat(first).cancel_requested
    store.complete_and_claim([(first, "cancelled", {})], "r", [])
    why = GROUP_REASON.format("wf")
    assert reasons(store, r1) == {"only": ("cancelled", why), "more": ("cancelled", RUN_CANCELLED)}
    assert store.get_run(r1).conclusion == "cancelled"
    assert outcome(store, r1).cancel_reason == why


def test_pending_run_replaced_in_its_group_says_so(store: Store) -> None:
    store.submit_run(_wf_plan("one", "hold", False))
    r2 = store.submit_run(_wf_plan("two", "hold", False))
    store.submit_run(_wf_plan("three", "hold", False))  # replaces r2 as the pending run
    why = "replaced by a newer run in concurrency group 'hold'"
    assert reasons(store, r2) == {"only": ("cancelled", why), "more": ("cancelled", why)}
    assert outcome(store, r2).cancel_reason == why


def test_user_cancel_reason_on_running_and_queued_jobs(store: Store) -> None:
    b = PlanBuilder()
    b.job("a")
    b.job("b", needs=["a"])
    run_id = store.submit_run(b.plan())
    a = store.claim_job("r", [])
    assert a is not None
    assert store.cancel_run(run_id)
    store.complete_and_claim([(a, "cancelled", {})], "r", [])
    user = "cancelled by the user (preloop cancel)"
    assert reasons(store, run_id) == {"a": ("cancelled", user), "b": ("cancelled", RUN_CANCELLED)}
    assert outcome(store, run_id).cancel_reason == user
    # Another cause given by the caller (the engine's Ctrl-C, a dead `preloop run`).
    other = store.submit_run(b.plan())
    assert store.cancel_run(other, "its `preloop run` process died")
    assert outcome(store, other).cancel_reason == "its `preloop run` process died"


@pytest.mark.parametrize(
    ("run_group", "job_group"),
    [
        # pre-commit's pattern: a push's group is its run's own.
        ("ci-${{ github.head_ref || github.run_id }}", "job-${{ github.run_id }}"),
        # It was `ci-` for both runs: the number is given as the run is stored.
        ("ci-${{ github.run_number }}", "job-${{ github.run_attempt }}-${{ github.run_number }}"),
    ],
)
def test_a_group_that_uses_the_run_id_or_number_is_each_runs_own(
    store: Store, tmp_path: Path, run_group: str, job_group: str
) -> None:
    """A group using `github.run_id` (or `run_number`, `run_attempt`) is
    evaluated once the run is stored: with cancel-in-progress, another run
    never cancels it; a job's group can use them too."""
    from preloop.workflow import load_workflow, plan

    wf = tmp_path / "w.yml"
    wf.write_text(
        "on: push\n"
        "concurrency:\n"
        f"  group: {run_group}\n"
        "  cancel-in-progress: true\n"
        "jobs:\n"
        "  a:\n"
        "    runs-on: x\n"
        "    concurrency:\n"
        f"      group: {job_group}\n"
        "      cancel-in-progress: true\n"
        "    steps: [{run: echo}]\n"
    )
    planned = plan(load_workflow(wf), "push", github={"ref": "refs/heads/main"})
    assert planned.concurrency is not None and planned.concurrency.group is None
    github = {"ref": "refs/heads/main", "repository": "o/r"}
    first = store.submit_run(planned, github=github)
    lease = store.claim_job("r", ["x"])
    assert lease is not None and lease.run_id == first
    second = store.submit_run(planned, github=github)
    assert not store.heartbeat(lease).cancel_requested
    assert not store.get_run(first).cancel_requested
    store.complete_job(lease, "success")
    other = store.claim_job("r", ["x"])
    assert other is not None and other.run_id == second
    store.complete_job(other, "success")
    assert store.get_run(first).conclusion == store.get_run(second).conclusion == "success"
