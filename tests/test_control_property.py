"""Random workflows through both stores against an in-memory oracle of
GitHub's rules: the same final conclusions, no job dispatched before its
needs ended, max-parallel caps and concurrency groups never exceeded."""

from __future__ import annotations

import itertools
import random
import tempfile
from dataclasses import dataclass

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from preloop.control import Store, open_store
from preloop.testing.plans import PlanBuilder, drive
from preloop.workflow.expressions import evaluate_if
from preloop.workflow.plan import ConcurrencySpec, Plan

IFS = [None, None, "always()", "failure()", "success()", "!cancelled()", "!failure()"]


@dataclass(frozen=True)
class Spec:
    name: str
    legs: int  # 0: a plain job
    needs: tuple[str, ...]
    if_expr: str | None
    max_parallel: int | None
    group: str | None
    continue_on_error: bool
    failing: frozenset[int]


@st.composite
def workflows(draw: st.DrawFn) -> list[Spec]:
    n = draw(st.integers(1, 6))
    specs: list[Spec] = []
    for i in range(n):
        legs = draw(st.sampled_from([0, 0, 2, 3]))
        needs = draw(st.sets(st.sampled_from([s.name for s in specs]))) if specs else set()
        specs.append(
            Spec(
                name=f"j{i}",
                legs=legs,
                needs=tuple(sorted(needs)),
                if_expr=draw(st.sampled_from(IFS)),
                max_parallel=draw(st.sampled_from([None, 1, 2])) if legs else None,
                group=draw(st.sampled_from([None, None, "g1", "g2"])),
                continue_on_error=draw(st.booleans()),
                failing=frozenset(draw(st.sets(st.integers(0, max(legs - 1, 0))))),
            )
        )
    return specs


def build(specs: list[Spec], *, queue_max: bool = True, prefix: str = "") -> Plan:
    b = PlanBuilder()
    for s in specs:
        conc = ConcurrencySpec(prefix + s.group, queue_max=queue_max) if s.group else None
        kw = {"if_expr": s.if_expr, "concurrency": conc, "continue_on_error": s.continue_on_error}
        if s.legs:
            b.matrix(s.name, s.legs, needs=s.needs, max_parallel=s.max_parallel, **kw)  # type: ignore[arg-type]
        else:
            b.job(s.name, needs=s.needs, **kw)  # type: ignore[arg-type]
    return b.plan()


def job_ids(s: Spec) -> list[str]:
    return [f"{s.name}#{i}" for i in range(s.legs)] if s.legs else [s.name]


def fails(s: Spec, job_id: str) -> bool:
    index = int(job_id.split("#")[1]) if "#" in job_id else 0
    return index in s.failing


def oracle(specs: list[Spec]) -> dict[str, str]:
    """GitHub's rules, computed over the whole graph in memory."""
    result: dict[str, str] = {}  # unit -> result
    ancestors: dict[str, set[str]] = {}
    out: dict[str, str] = {}
    for s in specs:
        anc = set(s.needs)
        for n in s.needs:
            anc |= ancestors[n]
        ancestors[s.name] = anc
        if any(result[a] == "failure" for a in anc):
            status = "failure"
        elif any(result[a] != "success" for a in anc):
            status = "skipped"
        else:
            status = "success"
        needs_ctx = {n: {"result": result[n], "outputs": {}} for n in s.needs}
        runs = evaluate_if(s.if_expr, {"needs": needs_ctx}, status=status)
        conclusions = []
        for jid in job_ids(s):
            c = ("failure" if fails(s, jid) else "success") if runs else "skipped"
            out[jid] = c
            conclusions.append("success" if c == "failure" and s.continue_on_error else c)
        if "failure" in conclusions:
            result[s.name] = "failure"
        elif "success" in conclusions:
            result[s.name] = "success"
        else:
            result[s.name] = "skipped"
    return out


@settings(
    max_examples=15,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(specs=workflows(), order=st.integers(0, 2**32 - 1))
def test_random_workflows_match_the_oracle(store: Store, specs: list[Spec], order: int) -> None:
    plan = build(specs)
    by_id = {jid: s for s in specs for jid in job_ids(s)}
    store.counters.reset()
    run_id = store.submit_run(plan)
    res = drive(
        store,
        plan,
        run_id,
        lambda lease: "failure" if fails(by_id[lease.job_id], lease.job_id) else "success",
        rng=random.Random(order),
    )
    assert store.counters.snapshot().graph_loads == 0
    got = {j.id: j.conclusion for j in store.list_jobs(run_id)}
    assert got == oracle(specs)
    for s in specs:
        if s.max_parallel is not None:
            assert res.max_running_per_cohort.get(s.name, 0) <= s.max_parallel
    assert all(n <= 1 for n in res.max_running_per_group.values())
    assert store.get_run(run_id).status == "completed"


_EXAMPLES = itertools.count()


def _drive_in_batches(store: Store, plan: Plan, specs: list[Spec], batch: int) -> list[list[str]]:
    """Claims up to `batch` jobs, then reports all of them and claims the next
    in one `complete_and_claim`, until nothing is left: every claim's job ids
    in order, then every job's conclusion, then the run's."""
    by_id = {jid: s for s in specs for jid in job_ids(s)}
    run_id = store.submit_run(plan)
    steps: list[list[str]] = []
    # Only this run's jobs: a failed example leaves its run's in the schema.
    held = store.claim_jobs("r", [], limit=batch, run_id=run_id)
    while held:
        steps.append([lease.job_id for lease in held])
        results = [
            (lease, "failure" if fails(by_id[lease.job_id], lease.job_id) else "success", None)
            for lease in held
        ]
        _, held = store.complete_and_claim(results, "r", [], limit=batch, run_id=run_id)
    steps.append([f"{j.id}={j.conclusion}" for j in store.list_jobs(run_id)])
    run = store.get_run(run_id)
    steps.append([f"{run.status}={run.conclusion}"])
    return steps


def _spec(name: str, legs: int = 0, needs: tuple[str, ...] = (), group: str | None = None) -> Spec:
    return Spec(name, legs, needs, None, None, group, False, frozenset())


@settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(specs=workflows(), batch=st.integers(1, 4))
# One batch ends j0, whose dependents all reach g, and j1, which holds g: one
# after the other, they queue behind j1 and each newer waiter cancels the one
# before; none of them may find g free because j1 ended in the same batch.
@example(
    specs=[
        _spec("j0"),
        _spec("j1", group="g"),
        _spec("j2", legs=2, needs=("j0",), group="g"),
        _spec("j3", needs=("j0",), group="g"),
    ],
    batch=2,
)
def test_both_stores_settle_the_same_batches_alike(
    pg_url: str, specs: list[Spec], batch: int
) -> None:
    """The same batches of results, on lite and on PostgreSQL, with groups
    that keep one waiter (a newer one cancels it): the same claims in the same
    order and the same conclusions. Several jobs of a batch meeting in a group
    is where the stores' paths differ most (PostgreSQL's one-call cascade)."""
    prefix = f"x{next(_EXAMPLES)}-"  # groups outlive runs: each example its own
    plan = build(specs, queue_max=False, prefix=prefix)
    with tempfile.TemporaryDirectory() as tmp, open_store(f"sqlite:///{tmp}/p.db") as lite:
        want = _drive_in_batches(lite, plan, specs, batch)
    with open_store(pg_url) as pg:
        got = _drive_in_batches(pg, plan, specs, batch)
    assert got == want
