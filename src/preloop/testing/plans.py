"""Plans for scheduler tests and benchmarks, and a driver that plays runners.

`PlanBuilder` builds `preloop.workflow.Plan`s directly (no YAML): plain jobs,
matrix cohorts, reusable callers and deferred matrices, with `seq` assigned
in insertion order. `drive` claims and completes jobs against a store like a
pool of runners would, checking the scheduler's promises as it goes: no job
is dispatched before every job its needs name has ended, a max-parallel
cohort never has more legs running than its cap, a concurrency group never
has two holders running.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import Any

from preloop.control.store import Lease, Store
from preloop.workflow.plan import Cohort, ConcurrencySpec, Plan, PlannedJob

__all__ = ["DriveResult", "PlanBuilder", "drive", "profile_plan"]


@dataclass
class PlanBuilder:
    """Accumulates jobs in seq order."""

    jobs: list[PlannedJob] = field(default_factory=list)
    cohorts: list[Cohort] = field(default_factory=list)
    concurrency: ConcurrencySpec | None = None

    def job(
        self, id: str, *, needs: Iterable[str] = (), if_expr: str | None = None, **kw: Any
    ) -> str:
        base: str = kw.pop("base_id", id)
        self.jobs.append(
            PlannedJob(
                id=id,
                seq=len(self.jobs),
                base_id=base,
                name=kw.pop("name", id),
                needs=tuple(needs),
                if_expr=if_expr,
                **kw,
            )
        )
        return base

    def matrix(
        self,
        base: str,
        legs: int,
        *,
        needs: Iterable[str] = (),
        max_parallel: int | None = None,
        fail_fast: bool = False,
        values: list[dict[str, Any]] | None = None,
        **kw: Any,
    ) -> str:
        self.cohorts.append(Cohort(base, max_parallel, fail_fast, legs))
        for i in range(legs):
            self.job(
                f"{base}#{i}",
                base_id=base,
                needs=needs,
                cohort=base,
                matrix=values[i] if values else {"i": i},
                **kw,
            )
        return base

    def plan(self, name: str = "wf") -> Plan:
        return Plan(
            workflow=f".github/workflows/{name}.yml",
            name=name,
            event="push",
            jobs=tuple(self.jobs),
            cohorts=tuple(self.cohorts),
            concurrency=self.concurrency,
        )


def profile_plan(profile: str, legs: int = 200) -> Plan:
    """The seed's load profiles: `capped` (legs with max-parallel 20 + an
    always-run merge), `group` (legs in one job-level concurrency group, at
    most 100 holding a slot so none exceeds `queue: max`), `merge` (legs + an
    always-run merge)."""
    b = PlanBuilder()
    b.job("setup")
    if profile == "capped":
        b.matrix("leg", legs, needs=["setup"], max_parallel=20)
    elif profile == "group":
        # `queue: max` keeps at most 100 waiters (GitHub's limit): capping the
        # matrix at 100 keeps every leg queued in the group, none replaced.
        conc = ConcurrencySpec("load-group", queue_max=True)
        b.matrix("leg", legs, needs=["setup"], concurrency=conc, max_parallel=min(legs, 100))
    elif profile == "merge":
        b.matrix("leg", legs, needs=["setup"])
    else:
        raise ValueError(f"unknown profile {profile!r}")
    b.job("merge", needs=["leg"], if_expr="always()")
    return b.plan(profile)


Outcome = Callable[[Lease], "str | tuple[str, dict[str, Any]]"]


@dataclass
class DriveResult:
    dispatched: list[str] = field(default_factory=list)
    max_running_per_cohort: dict[str, int] = field(default_factory=dict)
    max_running_per_group: dict[str, int] = field(default_factory=dict)


def drive(
    store: Store,
    plan: Plan,
    run_id: int,
    outcome: Outcome | None = None,
    *,
    labels: Iterable[str] = ("ubuntu-latest",),
    rng: random.Random | None = None,
    check_needs: bool = True,
    max_steps: int = 1_000_000,
) -> DriveResult:
    """Claims everything claimable, completes one running job (the oldest, or
    a random one with `rng`), and repeats until nothing runs or is claimable."""
    labels = list(labels)
    jobs = {j.id: j for j in plan.jobs}
    by_base: dict[str, list[str]] = {}
    for j in plan.jobs:
        by_base.setdefault(j.base_id, []).append(j.id)
    ended: set[str] = set()
    running: list[Lease] = []
    result = DriveResult()
    outcome = outcome or (lambda lease: "success")

    def group_of(job_id: str) -> str | None:
        j = jobs.get(job_id)
        return j.concurrency.group if j is not None and j.concurrency is not None else None

    def cohort_of(job_id: str) -> str | None:
        j = jobs.get(job_id)
        if j is not None:
            return j.cohort
        return job_id.split("#", 1)[0] if "#" in job_id else None

    for _ in range(max_steps):
        while True:
            lease = store.claim_job("driver", labels)
            if lease is None:
                break
            if lease.run_id != run_id:
                running.append(lease)
                continue
            if check_needs:
                planned = jobs.get(lease.job_id)
                needs = planned.needs if planned is not None else ()
                for need in needs:
                    for member in by_base.get(need, []):
                        info = store.get_job(run_id, member)
                        assert info.status in ("completed", "expanded"), (
                            f"{lease.job_id} dispatched before its need {member} ended"
                        )
            result.dispatched.append(lease.job_id)
            running.append(lease)
            cohort = cohort_of(lease.job_id)
            if cohort is not None:
                n = sum(1 for r in running if cohort_of(r.job_id) == cohort)
                result.max_running_per_cohort[cohort] = max(
                    result.max_running_per_cohort.get(cohort, 0), n
                )
            group = group_of(lease.job_id)
            if group is not None:
                n = sum(1 for r in running if group_of(r.job_id) == group)
                result.max_running_per_group[group] = max(
                    result.max_running_per_group.get(group, 0), n
                )
        if not running:
            return result
        lease = running.pop(rng.randrange(len(running)) if rng else 0)
        got = outcome(lease)
        conclusion, outputs = (got, {}) if isinstance(got, str) else got
        store.complete_job(lease, conclusion, outputs)
        ended.add(lease.job_id)
    raise AssertionError("drive did not finish")


def legs_of(plan: Plan, base: str) -> list[PlannedJob]:
    return [j for j in plan.jobs if j.base_id == base]


def with_runs_on(plan: Plan, labels: tuple[str, ...]) -> Plan:
    return replace(plan, jobs=tuple(replace(j, runs_on=labels) for j in plan.jobs))
