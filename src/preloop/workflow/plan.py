"""The `Plan`: what a workflow run will execute, as the scheduler consumes it.

`preloop.workflow.plan(...)` produces a Plan from a loaded workflow;
`preloop.control` stores and schedules it. A Plan is plain data: it
serialises to JSON and back losslessly (`Plan.to_json` / `Plan.from_json`).

Identity and order
- `PlannedJob.id` is unique in the plan. A plain job's id is its workflow key
  (`build`); a matrix leg is `<base_id>#<index>` with `index` its position in
  the expanded matrix (`test#0`, `test#1`); an inner job of a reusable caller is
  `<caller_id>/<inner_key>` (and so `<caller>/<inner>#<i>` for an inner leg).
- `PlannedJob.seq` orders jobs globally: claims are FIFO by `seq`, and a
  max-parallel cohort admits parked legs in `seq` (job-id) order.
- `PlannedJob.base_id` is the job key a `needs:` names (`test` for every leg of
  `test`; `caller/inner` inside a caller). A need on a base id waits for every
  job with that base id (every leg; for a caller, the caller's fold).

Conditions
- `if_expr` is the job's `if:` expression text without `${{ }}` (None means
  `success()`); the scheduler evaluates it with
  `preloop.workflow.expressions.evaluate_if(expr, contexts, status=...)`, where
  `status` is the aggregate of all ancestors ("success", "failure" or
  "cancelled") and `contexts` holds `needs` (direct needs only, GitHub's rule),
  `github`, `inputs`, `vars`.

Kinds
- `job`: runs steps on a runner.
- `caller`: a reusable-workflow caller (`uses: ./.github/workflows/x.yml`). It
  is never claimed; it folds (takes a conclusion and outputs) when every inner
  job (`inner_job_ids`) has ended. Its `outputs` are expressions over the inner
  jobs' results (`jobs.<inner_key>.outputs.<name>`), from the callee's
  `on.workflow_call.outputs`.
- `deferred`: a job whose matrix (`deferred_matrix`, an expression such as
  `fromJSON(needs.setup.outputs.matrix)`) can only be evaluated once its needs
  end. The scheduler evaluates it then and expands the job into legs with
  `expand_deferred(...)` from `preloop.workflow`; an empty expansion skips the
  job, an invalid one fails it with the reason.

Deferred matrices in detail
- `deferred_matrix` is the matrix as written: an expression (no `${{ }}`) when
  the whole matrix is one `${{ ... }}`, otherwise the JSON of the matrix
  mapping with `${{ }}` strings inside (it then starts with `{`, which no
  expression does); for a `strategy` written with `${{ insert }}` from
  `needs`, the JSON of the whole strategy. `spec["deferred"]` carries what
  expansion needs.
- `expand_deferred(job: PlannedJob, contexts: Mapping[str, Any]) ->
  DeferredExpansion(jobs: tuple[PlannedJob, ...], cohort: Cohort | None)`.
  `contexts` holds `needs` (direct needs: result, outputs) and optionally
  `github`/`inputs`/`vars` (default: the plan's). The legs are exactly what
  `plan` makes for a known matrix (`base#i`, names, runs-on, concurrency,
  a caller's inner jobs); their `seq` lie in the block the plan reserved:
  `[job.seq, job.seq + spec["deferred"]["seq_block"])` (no other job's seq
  falls in it). Raises `PlanError` (a PreloopError) with the reason for an
  invalid matrix.

Concurrency
- `ConcurrencySpec.group_expr` is always a single expression (a template such
  as `deploy-${{ needs.a.outputs.env }}` becomes
  `format('deploy-{0}', (needs.a.outputs.env))`), so `evaluate(group_expr,
  contexts)` gives the group.

Reusable callers
- An inner job's `needs` name base ids inside the same caller
  (`caller/inner`); an inner job without needs waits for its caller to start
  (the caller's own needs). The caller's `spec["inputs"]` is its callee's
  `inputs` context as far as known at plan time; inputs that use `needs` are
  listed in `spec["with_pending"]` and kept as written in `spec["with"]`.
  When the caller starts, the scheduler evaluates them
  (`preloop.workflow.planner.caller_inputs`, typed by `spec["decl"]`, in the
  caller's contexts with `spec["scope_inputs"]` as its own `inputs`) and hands
  them to its direct inner jobs (`preloop.control.reusable`).
- An inner job's `spec["secrets_chain"]` lists its enclosing callers,
  outermost first, with what each passes as `secrets:` (a mapping of
  templates, "inherit" or None): the runner gives the job only those.
- A caller's `inner_job_ids` may name a deferred job; once expanded, its legs
  (same `base_id`, same `caller`) stand in for it.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Literal

__all__ = [
    "PLAN_FORMAT_VERSION",
    "TRUE_WHEN_CLEAN",
    "Cohort",
    "ConcurrencySpec",
    "JobKind",
    "Plan",
    "PlannedJob",
    "canonical_if",
    "strategy_context",
]

PLAN_FORMAT_VERSION = 1

JobKind = Literal["job", "caller", "deferred"]

#: `if:` expressions that hold whenever every ancestor succeeded and the run
#: is not being cancelled, whatever the contexts: there the scheduler admits
#: a job that has one in bulk, like a job without `if:` (the cascade's
#: `ready`, the PostgreSQL batch's unit end), instead of evaluating it job by
#: job. The planner stores them in this spelling (`canonical_if`).
TRUE_WHEN_CLEAN = ("success()", "always()", "!cancelled()", "!failure()")


def strategy_context(leg: dict[str, Any] | None) -> dict[str, Any]:
    """A job's `strategy` context: its leg's (`PlannedJob.strategy`), else,
    for a job without a matrix, what GitHub gives every such job: fail-fast
    true, job-index 0, job-total 1, max-parallel 1 (not an empty mapping:
    `strategy.job-total` is 1, `strategy.job-index` 0)."""
    if leg:
        return leg
    return {"fail-fast": True, "job-index": 0, "job-total": 1, "max-parallel": 1}


def canonical_if(expr: str | None) -> str | None:
    """`expr`, or its `TRUE_WHEN_CLEAN` spelling when it is one of those
    (function names are case-insensitive, spaces do not count)."""
    if expr is None:
        return None
    squeezed = "".join(expr.split()).lower()
    return squeezed if squeezed in TRUE_WHEN_CLEAN else expr


@dataclass(frozen=True, slots=True)
class ConcurrencySpec:
    """A `concurrency:` block (job or workflow level).

    `group` is the evaluated group name; when it depends on contexts only
    known at run time (`needs`, step outputs) it is None and `group_expr` holds
    the expression. `queue_max` is GitHub's `queue: max` (up to 100 pending
    waiters instead of 1; a newer pending otherwise replaces an older one).
    """

    group: str | None
    group_expr: str | None = None
    cancel_in_progress: bool = False
    queue_max: bool = False


@dataclass(frozen=True, slots=True)
class Cohort:
    """The legs of one matrix job: `max_parallel` (None = unbounded) caps how
    many run at once; `fail_fast` cancels the other in-progress and queued legs
    when a leg fails (a leg with continue-on-error does not trigger it)."""

    id: str  # the matrix job's base id
    max_parallel: int | None
    fail_fast: bool
    total: int


@dataclass(frozen=True, slots=True)
class PlannedJob:
    """One schedulable unit. See the module docstring for ids, order and kinds."""

    id: str
    seq: int
    base_id: str
    name: str  # display name: `test (linux, 3.12)`, `caller / inner`
    kind: JobKind = "job"
    needs: tuple[str, ...] = ()  # base ids
    if_expr: str | None = None
    runs_on: tuple[str, ...] = ()  # labels, compared case-insensitively
    cohort: str | None = None  # Cohort.id for a matrix leg
    matrix: dict[str, Any] | None = None  # this leg's matrix values
    strategy: dict[str, Any] | None = None  # `strategy` context (job-index, job-total, ...)
    continue_on_error: bool = False
    timeout_minutes: float = 360.0
    concurrency: ConcurrencySpec | None = None
    outputs: dict[str, str] = field(default_factory=dict)  # name -> expression
    caller: str | None = None  # id of the enclosing reusable caller, if any
    inner_job_ids: tuple[str, ...] = ()  # kind == "caller": ids of its inner jobs
    deferred_matrix: str | None = None  # kind == "deferred": the matrix expression
    # Everything the runner needs to execute the job (steps, env, defaults,
    # services, container, ...), as JSON-able data defined by preloop.workflow.
    spec: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["needs"] = list(self.needs)
        d["runs_on"] = list(self.runs_on)
        d["inner_job_ids"] = list(self.inner_job_ids)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> PlannedJob:
        known = {f.name for f in fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"unknown planned-job fields: {sorted(unknown)}")
        conc = d.get("concurrency")
        return cls(
            **{
                **d,
                "needs": tuple(d.get("needs", ())),
                "runs_on": tuple(d.get("runs_on", ())),
                "inner_job_ids": tuple(d.get("inner_job_ids", ())),
                "concurrency": ConcurrencySpec(**conc) if conc is not None else None,
                "outputs": dict(d.get("outputs", {})),
                "spec": dict(d.get("spec", {})),
            }
        )


@dataclass(frozen=True, slots=True)
class Plan:
    """A whole run: its jobs in `seq` order, matrix cohorts, and the
    workflow-level concurrency group (which holds the entire run)."""

    workflow: str  # workflow file path, relative to the repository root
    name: str  # the workflow's `name:` (or its file name)
    event: str
    jobs: tuple[PlannedJob, ...]
    cohorts: tuple[Cohort, ...] = ()
    concurrency: ConcurrencySpec | None = None
    env: dict[str, str] = field(default_factory=dict)
    inputs: dict[str, Any] = field(default_factory=dict)  # workflow_dispatch / call inputs
    github_workflow: str = ""  # `github.workflow`: `name:`, else the file's path
    vars: dict[str, str] = field(default_factory=dict)  # the `vars` context it was planned with
    version: int = PLAN_FORMAT_VERSION

    def job(self, job_id: str) -> PlannedJob:
        for j in self.jobs:
            if j.id == job_id:
                return j
        raise KeyError(job_id)

    def to_dict(self) -> dict[str, Any]:
        return {
            "version": self.version,
            "workflow": self.workflow,
            "name": self.name,
            "event": self.event,
            "jobs": [j.to_dict() for j in self.jobs],
            "cohorts": [asdict(c) for c in self.cohorts],
            "concurrency": asdict(self.concurrency) if self.concurrency else None,
            "env": dict(self.env),
            "inputs": dict(self.inputs),
            "github_workflow": self.github_workflow,
            "vars": dict(self.vars),
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Plan:
        if d.get("version") != PLAN_FORMAT_VERSION:
            raise ValueError(
                f"plan format version {d.get('version')!r} is not {PLAN_FORMAT_VERSION}"
            )
        conc = d.get("concurrency")
        return cls(
            workflow=d["workflow"],
            name=d["name"],
            event=d["event"],
            jobs=tuple(PlannedJob.from_dict(j) for j in d["jobs"]),
            cohorts=tuple(Cohort(**c) for c in d.get("cohorts", ())),
            concurrency=ConcurrencySpec(**conc) if conc else None,
            env=dict(d.get("env", {})),
            inputs=dict(d.get("inputs", {})),
            github_workflow=str(d.get("github_workflow") or ""),
            vars=dict(d.get("vars", {})),
        )

    def to_json(self) -> str:
        # Not sorted: a matrix's keys stay in their written order.
        return json.dumps(self.to_dict(), separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> Plan:
        return cls.from_dict(json.loads(text))
