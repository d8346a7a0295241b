"""`plan(workflow, event) -> Plan` and `expand_deferred(job, contexts)`.

Planning evaluates what is known before anything runs (`github`, `inputs`,
`vars`, and per leg `matrix` / `strategy`): matrices, display names,
`runs-on` labels, concurrency groups, `continue-on-error`, timeouts. What
depends on `needs` is left for the scheduler: a concurrency group becomes
`group_expr`, a matrix makes the job `deferred` (expanded later by
`expand_deferred`), and the runner evaluates steps, `env` and outputs.

`PlannedJob.spec` (what a runner needs), all plain JSON data:
  workflow, job (the job key), steps (list of {id, name, if, run, uses, with,
  shell, working-directory, env, continue-on-error, timeout-minutes}),
  env (workflow env overlaid by job env, templates as written),
  defaults ({shell, working-directory}: workflow defaults overlaid by job's),
  inputs (the `inputs` context), outputs (name -> template),
  continue-on-error / timeout-minutes (as written), container, services,
  environment, permissions; a caller has `with` and `secrets` instead of steps.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from typing import Any

from preloop.errors import PreloopError
from preloop.workflow import expressions as ex
from preloop.workflow.matrix import (
    MAX_MATRIX_LEGS,
    Leg,
    MatrixError,
    default_job_name,
    expand_legs,
    leg_suffix,
    max_parallel_limit,
)
from preloop.workflow.matrix import matrix_from_data as _matrix_from_data
from preloop.workflow.model import (
    Concurrency,
    Job,
    Matrix,
    Step,
    Strategy,
    Workflow,
    WorkflowCall,
    frozen_map,
    thaw,
    to_data,
)
from preloop.workflow.plan import (
    Cohort,
    ConcurrencySpec,
    Plan,
    PlannedJob,
    canonical_if,
    strategy_context,
)
from preloop.workflow.templates import evaluate_data, mapping_items, overlay, template_contexts

__all__ = [
    "DeferredExpansion",
    "PlanError",
    "caller_inputs",
    "expand_deferred",
    "plan",
    "template_expression",
    "typed_caller_input",
]

# Contexts known while planning; anything else (needs, steps, jobs, ...) waits.
_PLAN_CONTEXTS = frozenset({"github", "inputs", "vars"})
_LEG_CONTEXTS = _PLAN_CONTEXTS | {"matrix", "strategy"}


class PlanError(PreloopError):
    """A workflow cannot be planned for this event (or a deferred matrix
    cannot be expanded); the message names the workflow and job."""


@dataclass(frozen=True, slots=True)
class DeferredExpansion:
    """What a deferred job becomes: its legs (seq numbers inside the block the
    plan reserved for it) and the legs' cohort (None for a non-matrix result)."""

    jobs: tuple[PlannedJob, ...]
    cohort: Cohort | None


def template_expression(text: str) -> str:
    """A template (`ci-${{ x }}`) as one expression (`format('ci-{0}', (x))`),
    so that a caller can evaluate it with `evaluate` alone."""
    segs = ex.template_segments(text)
    if len(segs) == 1 and segs[0][0]:
        return segs[0][1]
    fmt: list[str] = []
    args: list[str] = []
    for is_expr, seg in segs:
        if is_expr:
            fmt.append("{" + str(len(args)) + "}")
            args.append(f"({seg})")
        else:
            fmt.append(seg.replace("{", "{{").replace("}", "}}"))
    literal = "'" + "".join(fmt).replace("'", "''") + "'"
    return f"format({', '.join([literal, *args])})"


_template_contexts = template_contexts


# What the `github` context has once a run is stored (Store.submit_run): its
# id, number and attempt. A group or job name using them is evaluated then.
_RUN_SCOPED = re.compile(
    r"github\s*(?:\.\s*run_(?:id|number|attempt)\b|\[\s*'run_(?:id|number|attempt)'\s*\])",
    re.IGNORECASE,
)


def _evaluable(value: Any, available: frozenset[str]) -> bool:
    return _template_contexts(value) <= available


def _eval_data(value: Any, ctx: Mapping[str, Any]) -> Any:
    """Evaluates a matrix as written: templates (a lone `${{ }}` keeps its
    type), expression keys, `${{ insert }}`, array items spliced into vectors."""
    return evaluate_data(value, ctx, splice=True)


def _typed_input(value: Any, kind: Any) -> Any:
    if kind == "boolean" and isinstance(value, str):
        return value.strip().lower() == "true"
    if kind == "number" and isinstance(value, str):
        n = ex.string_to_number(value)
        return int(n) if n.is_integer() else n
    return value


def typed_caller_input(name: str, value: Any, kind: Any) -> Any:
    """A reusable workflow's input as its declared type, as GitHub checks it
    when the caller starts: a boolean takes true/false (or their strings), a
    number a number (or a numeric string); anything becomes a string input.
    Raises PlanError naming the input otherwise."""
    if kind == "boolean":
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.strip().lower() in ("true", "false"):
            return value.strip().lower() == "true"
        raise PlanError(f"input '{name}' is a boolean, not {ex.to_json(value)}")
    if kind == "number":
        if isinstance(value, int | float) and not isinstance(value, bool):
            return value
        n = ex.string_to_number(value) if isinstance(value, str) and value.strip() else math.nan
        if math.isnan(n):
            raise PlanError(f"input '{name}' is a number, not {ex.to_json(value)}")
        return int(n) if n.is_integer() and abs(n) <= 2**53 else n
    if kind == "string" and not isinstance(value, str):
        return ex.coerce_string(value)
    return value


def caller_inputs(spec: Mapping[str, Any], contexts: Mapping[str, Any]) -> dict[str, Any]:
    """A reusable caller's `inputs` for its callee, evaluated when it starts:
    its `with:` (templates over the caller's `needs`, `matrix`, `inputs`, ...)
    typed by the callee's declarations over the declared defaults. `spec` is
    the caller's PlannedJob spec. Raises PlanError or ExpressionError."""
    decl: Mapping[str, Any] = spec.get("decl") or {}
    inputs = dict(spec.get("inputs") or {})

    def value_of(value: Any) -> Any:
        if isinstance(value, str) and "${{" in value:
            return ex.evaluate_template(value, contexts)
        return value

    # `${{ insert }}` (and expression keys) expand here (`mapping_items`).
    for name, value, evaluated in mapping_items(dict(spec.get("with") or {}), value_of):
        if name not in decl:
            raise PlanError(f"input {name!r} is not declared by '{spec.get('uses')}'")
        value = value if evaluated else value_of(value)
        inputs[name] = typed_caller_input(name, value, (decl.get(name) or {}).get("type"))
    _check_required(decl, inputs, spec.get("uses"))
    return inputs


def _check_required(decl: Mapping[str, Any], inputs: Mapping[str, Any], uses: Any) -> None:
    """A required input without a default that `with:` did not give (only
    possible once an `${{ insert }}` has expanded: the loader checks the rest)."""
    for name, spec in decl.items():
        if spec.get("required") is True and "default" not in spec and name not in inputs:
            raise PlanError(f"'{uses}' requires input '{name}', which `with` does not provide")


@dataclass(slots=True)
class _Scope:
    """Where jobs are being planned: the top-level workflow or one caller leg."""

    workflow: Workflow
    prefix: str  # "" or "<caller id>/"
    caller: str | None
    contexts: dict[str, Any]  # github, inputs, vars
    available: frozenset[str]  # which of those are really known
    # The reusable callers around this scope, outermost first: {caller, secrets}
    # (what each passes on: a mapping of templates, "inherit" or None).
    chain: tuple[dict[str, Any], ...] = ()


class _Planner:
    def __init__(self, workflow_path: str, seq: int = 0, *, expanding: bool = False) -> None:
        self.path = workflow_path
        self.seq = seq
        # Expanding a deferred job: a matrix with no legs skips it (GitHub
        # does the same for one known only then) instead of failing the plan.
        self.expanding = expanding
        self.jobs: list[PlannedJob] = []
        self.cohorts: list[Cohort] = []

    def fail(
        self, job: Job, scope: _Scope, message: str, at: tuple[int, int] = (0, 0)
    ) -> PlanError:
        """An error about `job`, placed at `at` (a value's line, column) when
        known, else at the job."""
        line, column = at if at[0] else (job.line, job.column)
        where = f"{scope.workflow.path}:{line}:{column}" if line else self.path
        return PlanError(f"{where}: job '{scope.prefix}{job.id}': {message}")

    def next_seq(self, count: int = 1) -> int:
        s = self.seq
        self.seq += count
        return s

    # -- scopes -------------------------------------------------------------
    def plan_scope(self, scope: _Scope) -> list[str]:
        ids: list[str] = []
        for job in scope.workflow.jobs:
            ids.extend(self.plan_job(job, scope))
        return ids

    def plan_job(self, job: Job, scope: _Scope, matrix_value: Any = None) -> list[str]:
        """Plans one job (all its legs); returns the ids of what it added
        directly to this scope (legs or the job itself)."""
        base = scope.prefix + job.id
        strategy = job.strategy
        if strategy is not None and strategy.template is not None:
            # `strategy` with an insert: evaluated whole, once its contexts are known.
            if not _evaluable(strategy.template, scope.available):
                return [self.plan_deferred(job, scope, strategy.template)]
            strategy, matrix_value = self.resolve_strategy(job, scope, strategy)
            job = replace(job, strategy=strategy)
        matrix = strategy.matrix if strategy else None
        combos: list[Leg] | None = None
        if matrix_value is not None:
            try:
                combos = expand_legs(_matrix_from_data(matrix_value), allow_empty=self.expanding)
            except MatrixError as exc:
                raise self.fail(job, scope, str(exc)) from exc
        elif matrix is not None and matrix.template is not None:
            if not _evaluable(matrix.template, scope.available):
                return [self.plan_deferred(job, scope, matrix.template)]
            try:
                value = _eval_data(matrix.template, scope.contexts)
                combos = expand_legs(_matrix_from_data(value))
            except (ex.ExpressionError, MatrixError) as exc:
                raise self.fail(job, scope, f"invalid matrix: {exc}") from exc
        elif matrix is not None:
            try:
                combos = expand_legs(matrix)
            except MatrixError as exc:
                raise self.fail(job, scope, str(exc)) from exc
        if combos is None:
            return [self.plan_leg(job, scope, base, base, None, None, None)]
        assert strategy is not None
        total = len(combos)
        leg_ctx = {**scope.contexts, "matrix": {}, "strategy": {}}
        fail_fast = self.eval_bool(strategy.fail_fast, leg_ctx, scope, True)
        max_parallel = self.eval_max_parallel(job, strategy, scope)
        self.cohorts.append(
            Cohort(id=base, max_parallel=max_parallel, fail_fast=fail_fast, total=total)
        )
        ids = []
        for i, leg in enumerate(combos):
            strat = {
                "fail-fast": fail_fast,
                "job-index": i,
                "job-total": total,
                "max-parallel": max_parallel if max_parallel is not None else total,
            }
            ids.append(self.plan_leg(job, scope, base, f"{base}#{i}", leg.values, strat, leg.named))
        return ids

    def resolve_strategy(self, job: Job, scope: _Scope, strategy: Strategy) -> tuple[Strategy, Any]:
        """A `strategy` written with an insert, evaluated: (the strategy with
        its fail-fast and max-parallel known, the matrix's value or None).
        Raises PlanError for what GitHub would refuse (an insert that is not
        a mapping, an unknown key, a bad `max-parallel`)."""
        try:
            data = _eval_data(strategy.template, scope.contexts)
        except ex.ExpressionError as exc:
            raise self.fail(job, scope, f"invalid strategy: {exc}") from exc
        unknown = [k for k in data if k not in ("matrix", "fail-fast", "max-parallel")]
        if unknown:
            raise self.fail(job, scope, f"unknown key '{unknown[0]}' in `strategy`")
        fail_fast = data.get("fail-fast", True)
        max_parallel = data.get("max-parallel")
        if max_parallel is not None:
            max_parallel = self.max_parallel_value(job, scope, max_parallel)
        resolved = Strategy(
            fail_fast=fail_fast if isinstance(fail_fast, bool) else ex.truthy(fail_fast),
            max_parallel=max_parallel,
        )
        return resolved, data.get("matrix")

    def eval_max_parallel(self, job: Job, strategy: Strategy, scope: _Scope) -> int | None:
        mp = strategy.max_parallel
        if isinstance(mp, str):
            at = strategy.max_parallel_at
            if not _evaluable(mp, scope.available):
                raise self.fail(
                    job, scope, "`max-parallel` may only use github, inputs and vars", at
                )
            value = ex.evaluate_template(mp, scope.contexts)
            return self.max_parallel_value(job, scope, value, at)
        return mp

    def max_parallel_value(
        self, job: Job, scope: _Scope, value: Any, at: tuple[int, int] = (0, 0)
    ) -> int | None:
        """An evaluated `max-parallel` as its cap (None: none), else PlanError."""
        n = ex.to_number(value)
        if not math.isfinite(n):
            # As GitHub prints values: `Infinity`, a string quoted.
            shown = ex.to_json(value) if isinstance(value, str) else ex.coerce_string(value)
            raise self.fail(job, scope, f"`max-parallel` is {shown}, not a finite number", at)
        return max_parallel_limit(n)

    def eval_bool(self, v: bool | str, ctx: Mapping[str, Any], scope: _Scope, dflt: bool) -> bool:
        if isinstance(v, bool):
            return v
        if _evaluable(v, scope.available | {"matrix", "strategy"}):
            return ex.truthy(ex.evaluate_template(v, ctx))
        return dflt

    # -- one schedulable unit -------------------------------------------------
    def plan_leg(
        self,
        job: Job,
        scope: _Scope,
        base: str,
        job_id: str,
        combo: dict[str, Any] | None,
        strat: dict[str, Any] | None,
        named: dict[str, Any] | None,
    ) -> str:
        ctx = dict(scope.contexts)
        available = scope.available
        if combo is not None:
            ctx["matrix"] = combo
            ctx["strategy"] = strat
            available = available | {"matrix", "strategy"}
        else:
            ctx["matrix"] = None  # as on GitHub: a job without a matrix has none
            ctx["strategy"] = strategy_context(None)
            available = available | {"matrix", "strategy"}

        def known(v: Any) -> bool:
            return _evaluable(v, available)

        try:
            name = self.display_name(job, scope, ctx, named, known)
            conc = self.concurrency(job.concurrency, ctx, known)
        except ex.ExpressionError as exc:
            raise self.fail(job, scope, str(exc)) from exc
        needs = tuple(scope.prefix + n for n in job.needs)
        seq = self.next_seq()
        common: dict[str, Any] = dict(
            id=job_id,
            seq=seq,
            base_id=base,
            name=name,
            needs=needs,
            if_expr=canonical_if(job.if_),
            cohort=base if combo is not None else None,
            matrix=combo,
            strategy=strat,
            concurrency=conc,
            caller=scope.caller,
        )
        if job.is_caller and job.skipped_call is None:
            return self.plan_caller(job, scope, ctx, known, common)
        try:
            runs_on = self.runs_on(job.runs_on, ctx, known)
            coe = self.eval_bool(job.continue_on_error, ctx, scope, False)
            timeout = job.timeout_minutes
            if isinstance(timeout, str):
                timeout = (
                    ex.to_number(ex.evaluate_template(timeout, ctx)) if known(timeout) else 360.0
                )
        except ex.ExpressionError as exc:
            raise self.fail(job, scope, str(exc)) from exc
        wf = scope.workflow
        spec = {
            "workflow": wf.path,
            "job": job.id,
            "name": name,
            "steps": [_step_data(s) for s in job.steps],
            "env": overlay(thaw(wf.env), thaw(job.env)),
            "defaults": {**thaw(wf.defaults_run), **thaw(job.defaults_run)},
            "inputs": thaw(ctx.get("inputs") or {}),
            "outputs": thaw(job.outputs),
            "continue-on-error": job.continue_on_error,
            "timeout-minutes": job.timeout_minutes,
            "runs-on": thaw(job.runs_on),
            "container": thaw(job.container),
            "services": thaw(job.services),
            "environment": thaw(job.environment),
            "permissions": thaw(job.permissions),
        }
        if job.skipped_call is not None:
            # No callee to plan: a job that ends skipped, outputs empty.
            spec.update({"skipped_call": job.skipped_call, "uses": job.uses, "runs-on": None})
            runs_on = ()
        if scope.chain:
            spec["secrets_chain"] = list(scope.chain)
        self.jobs.append(
            PlannedJob(
                **common,
                kind="job",
                runs_on=runs_on,
                continue_on_error=coe,
                timeout_minutes=job_timeout(timeout),
                outputs=dict(thaw(job.outputs)),
                spec=spec,
            )
        )
        return job_id

    def display_name(
        self,
        job: Job,
        scope: _Scope,
        ctx: Mapping[str, Any],
        named: dict[str, Any] | None,
        known: Any,
    ) -> str:
        own = job.name
        if own is not None and "${{" in own:
            # A name that uses expressions is the whole display name (GitHub
            # appends the matrix values only to a plain name).
            # One that uses the run's id or number is evaluated as the job
            # starts (`Runner._named`), with the stored run's `github`.
            evaluable = known(own) and not _RUN_SCOPED.search(own)
            own = ex.interpolate(own, ctx) if evaluable else own
        else:
            own = default_job_name((own or job.id) + (leg_suffix(named) if named else ""))
        own = own or job.id
        if scope.caller is not None:
            caller_name = scope.contexts.get("_caller_name", scope.caller)
            return f"{caller_name} / {own}"
        return own

    def concurrency(
        self, conc: Concurrency | None, ctx: Mapping[str, Any], known: Any
    ) -> ConcurrencySpec | None:
        if conc is None:
            return None
        cancel = conc.cancel_in_progress
        if isinstance(cancel, str):
            cancel = ex.truthy(ex.evaluate_template(cancel, ctx)) if known(cancel) else False
        if "${{" not in conc.group:
            return ConcurrencySpec(conc.group, None, cancel, conc.queue_max)
        # `github.run_id` (run_number, run_attempt) exists once the run is
        # stored: such a group (the common `head_ref || run_id`) is evaluated
        # then (Store.submit_run).
        if known(conc.group) and not _RUN_SCOPED.search(conc.group):
            return ConcurrencySpec(ex.interpolate(conc.group, ctx), None, cancel, conc.queue_max)
        return ConcurrencySpec(None, template_expression(conc.group), cancel, conc.queue_max)

    def runs_on(self, value: Any, ctx: Mapping[str, Any], known: Any) -> tuple[str, ...]:
        if value is None:
            return ()
        if isinstance(value, Mapping):
            value = value.get("labels") or []
        if isinstance(value, str):
            value = [value]
        labels: list[str] = []
        for v in value:
            if isinstance(v, str) and "${{" in v:
                if not known(v):
                    labels.append(v)  # evaluated by the scheduler once needs are known
                    continue
                result = ex.evaluate_template(v, ctx)
                items = result if isinstance(result, list) else [result]
                labels.extend(ex.coerce_string(x) for x in items if ex.coerce_string(x))
            elif v is not None:
                labels.append(str(v))
        return tuple(labels)

    # -- reusable callers ----------------------------------------------------
    def plan_caller(
        self,
        job: Job,
        scope: _Scope,
        ctx: dict[str, Any],
        known: Any,
        common: dict[str, Any],
    ) -> str:
        callee = job.callee
        if callee is None or callee.workflow_call is None:
            raise self.fail(job, scope, f"reusable workflow '{job.uses}' was not loaded")
        decl: WorkflowCall = callee.workflow_call
        inputs: dict[str, Any] = {}
        inputs_known = True
        pending: list[str] = []
        for name, spec in decl.inputs.items():
            if "default" in spec:
                default = spec["default"]
                if isinstance(default, str) and "${{" in default:
                    default = (
                        ex.evaluate_template(default, ctx)
                        if _evaluable(default, _PLAN_CONTEXTS & scope.available)
                        else default
                    )
                inputs[name] = _typed_input(default, spec.get("type"))
        for key, raw in job.with_.items():
            if "${{" in key and not known({key: raw}):
                # `${{ insert }}` or an expression key: expanded as the caller starts
                inputs_known = False
                pending.append(key)
                continue
            entries = mapping_items({key: raw}, lambda v: ex.evaluate_template(v, ctx))
            for name, value, evaluated in entries:
                if not evaluated and isinstance(value, str) and "${{" in value:
                    if known(value):
                        value = ex.evaluate_template(value, ctx)
                    else:
                        inputs_known = False
                        pending.append(name)
                        inputs[name] = value
                        continue
                kind = (decl.inputs.get(name) or {}).get("type")
                try:
                    if name not in decl.inputs:
                        raise PlanError(f"input {name!r} is not declared by '{job.uses}'")
                    inputs[name] = typed_caller_input(name, value, kind)
                except PlanError as exc:
                    raise self.fail(job, scope, str(exc)) from exc
        if inputs_known:
            try:
                _check_required(decl.inputs, inputs, job.uses)
            except PlanError as exc:
                raise self.fail(job, scope, str(exc)) from exc
        caller_id = common["id"]
        inner_scope = _Scope(
            workflow=callee,
            prefix=caller_id + "/",
            caller=caller_id,
            contexts={
                "github": scope.contexts.get("github", {}),
                "vars": scope.contexts.get("vars", {}),
                "inputs": inputs,
                "_caller_name": common["name"],
            },
            available=_PLAN_CONTEXTS if inputs_known else _PLAN_CONTEXTS - {"inputs"},
            chain=(*scope.chain, {"caller": caller_id, "secrets": thaw(job.secrets)}),
        )
        placeholder = len(self.jobs)
        self.jobs.append(PlannedJob(id=caller_id, seq=common["seq"], base_id="", name=""))
        inner_ids = self.plan_scope(inner_scope)
        # One expression each (a template such as `${{ a }}-${{ b }}` included).
        outputs = {k: _output_expression(v.get("value", "")) for k, v in decl.outputs.items()}
        spec = {
            "workflow": scope.workflow.path,
            "job": job.id,
            "name": common["name"],
            "uses": job.uses,
            "callee": callee.path,
            "with": thaw(job.with_),
            "with_pending": pending,
            "inputs": thaw(inputs),
            # What the caller evaluates `with:` in (the inputs of its own scope)
            # and how its callee types the results, for `caller_inputs`.
            "scope_inputs": thaw(scope.contexts.get("inputs") or {}),
            "decl": {
                k: {"type": v.get("type"), "required": "default" not in v and v.get("required")}
                for k, v in decl.inputs.items()
            },
            "secrets": thaw(job.secrets),
            "outputs": outputs,
            "permissions": thaw(job.permissions),
        }
        if scope.chain:
            spec["secrets_chain"] = list(scope.chain)
        self.jobs[placeholder] = PlannedJob(
            **common,
            kind="caller",
            inner_job_ids=tuple(inner_ids),
            outputs=outputs,
            spec=spec,
        )
        return str(caller_id)

    # -- deferred matrices ---------------------------------------------------
    def plan_deferred(self, job: Job, scope: _Scope, template: Any) -> str:
        """A job whose matrix (`template`: the matrix, or the whole strategy
        written with an insert) waits for its needs."""
        base = scope.prefix + job.id
        if isinstance(template, str):
            deferred = template_expression(template)
        else:
            deferred = json.dumps(thaw(template), sort_keys=False, separators=(",", ":"))
        block = MAX_MATRIX_LEGS * (1 + _inner_count(job))
        seq = self.next_seq(block)
        contexts = {k: v for k, v in scope.contexts.items() if k != "_caller_name"}
        spec = {
            "workflow": scope.workflow.path,
            "job": job.id,
            "deferred": {
                "job": to_data(job),
                "workflow": {
                    "path": scope.workflow.path,
                    "name": scope.workflow.name,
                    "env": thaw(scope.workflow.env),
                    "defaults_run": thaw(scope.workflow.defaults_run),
                },
                "prefix": scope.prefix,
                "caller": scope.caller,
                "caller_name": scope.contexts.get("_caller_name"),
                "contexts": thaw(contexts),
                "available": sorted(scope.available),
                "seq_block": block,
                "chain": list(scope.chain),
            },
        }
        name = job.name if job.name and "${{" not in job.name else job.id
        if scope.caller is not None:
            name = f"{scope.contexts.get('_caller_name', scope.caller)} / {name}"
        self.jobs.append(
            PlannedJob(
                id=base,
                seq=seq,
                base_id=base,
                name=name,
                kind="deferred",
                needs=tuple(scope.prefix + n for n in job.needs),
                if_expr=canonical_if(job.if_),
                caller=scope.caller,
                deferred_matrix=deferred,
                timeout_minutes=job_timeout(job.timeout_minutes),
                spec=spec,
            )
        )
        return base


def _output_expression(value: Any) -> str:
    """A callee output's `value` as the caller folds it: a lone `${{ x }}` as
    written, anything else (`${{ a }}-${{ b }}`, a literal) as one expression."""
    text = ex.coerce_string(value)
    segs = ex.template_segments(text)
    if len(segs) == 1 and segs[0][0]:
        return text
    return template_expression(text)


def job_timeout(minutes: float | str) -> float:
    """A job's `timeout-minutes` as run: GitHub's default 360 unless it is a
    positive number (GitHub's parser takes any number, -Infinity included; an
    expression not known yet also counts as the default here)."""
    if isinstance(minutes, str):
        return 360.0
    return float(minutes) if minutes > 0 else 360.0


def _inner_count(job: Job) -> int:
    if job.callee is None:
        return 0
    n = 0
    for inner in job.callee.jobs:
        strategy = inner.strategy
        # A strategy with an insert may bring a matrix too.
        matrix = strategy is not None and (strategy.matrix or strategy.template is not None)
        legs = MAX_MATRIX_LEGS if matrix else 1
        n += legs * (1 + _inner_count(inner))
    return n


def _step_data(step: Step) -> dict[str, Any]:
    return {
        "id": step.id,
        "name": step.name,
        "if": step.if_,
        "run": step.run,
        "uses": step.uses,
        "with": thaw(step.with_),
        "shell": step.shell,
        "working-directory": step.working_directory,
        "env": thaw(step.env),
        "continue-on-error": step.continue_on_error,
        "timeout-minutes": step.timeout_minutes,
    }


def plan(
    workflow: Workflow,
    event: str,
    *,
    inputs: Mapping[str, Any] | None = None,
    github: Mapping[str, Any] | None = None,
    vars: Mapping[str, Any] | None = None,
) -> Plan:
    """The Plan of `workflow` for `event` (see `preloop.workflow.plan`).

    `inputs` are workflow_dispatch inputs (declared defaults fill the rest);
    `github` adds to the `github` context (`event_name` is `event`); `vars`
    is the `vars` context. Raises PlanError when the event does not trigger
    the workflow or something known at plan time cannot be evaluated.
    """
    if not workflow.triggered_by(event):
        events = ", ".join(sorted(workflow.on)) or "none"
        raise PlanError(
            f"{workflow.path}: the workflow is not triggered by '{event}' (its events: {events})"
        )
    given = dict(inputs or {})
    declared = dict(workflow.workflow_dispatch_inputs) if event == "workflow_dispatch" else {}
    if event == "workflow_call" and workflow.workflow_call is not None:
        declared = dict(workflow.workflow_call.inputs)
    all_inputs: dict[str, Any] = {}
    for name, spec in declared.items():
        spec = spec or {}  # `inputs: {x: }` declares x with nothing else
        if name in given:
            all_inputs[name] = _typed_input(given[name], spec.get("type"))
        elif "default" in spec:
            all_inputs[name] = _typed_input(spec["default"], spec.get("type"))
        elif spec.get("required") is True:
            raise PlanError(f"{workflow.path}: input '{name}' is required; pass it with inputs")
    for name, value in given.items():
        all_inputs.setdefault(name, value)
    gh = {"event_name": event, "workflow": workflow.github_workflow, **dict(github or {})}
    contexts: dict[str, Any] = {"github": gh, "inputs": all_inputs, "vars": dict(vars or {})}
    planner = _Planner(workflow.path)
    scope = _Scope(workflow, "", None, contexts, _PLAN_CONTEXTS)
    planner.plan_scope(scope)
    conc = None
    if workflow.concurrency is not None:
        try:
            conc = planner.concurrency(
                workflow.concurrency, contexts, lambda v: _evaluable(v, _PLAN_CONTEXTS)
            )
        except ex.ExpressionError as exc:
            raise PlanError(f"{workflow.path}: workflow concurrency: {exc}") from exc
    return Plan(
        workflow=workflow.path,
        name=workflow.name,
        event=event,
        jobs=tuple(sorted(planner.jobs, key=lambda j: j.seq)),
        cohorts=tuple(planner.cohorts),
        concurrency=conc,
        env=dict(thaw(workflow.env)),
        inputs=all_inputs,
        github_workflow=workflow.github_workflow,
        vars=contexts["vars"],
    )


def expand_deferred(job: PlannedJob, contexts: Mapping[str, Any]) -> DeferredExpansion:
    """Expands a `deferred` job once its needs have ended.

    `contexts` holds at least `needs` (the job's direct needs: result and
    outputs); `github`, `inputs` and `vars` default to the plan's. The legs
    are PlannedJobs exactly as `plan` would have made them had the matrix
    been known (ids `base#i`, a cohort, inner jobs for a caller), with seq
    numbers in `[job.seq, job.seq + spec.deferred.seq_block)`. An empty
    expansion returns no jobs (the scheduler skips the job); an invalid
    matrix raises PlanError with the reason.
    """
    if job.kind != "deferred" or "deferred" not in job.spec:
        raise PlanError(f"job '{job.id}' is not a deferred matrix job")
    d = job.spec["deferred"]
    model = _job_from_data(d["job"])
    wf_data = d["workflow"]
    workflow = Workflow(
        path=wf_data["path"],
        name=wf_data["name"],
        on=frozen_map({}),
        jobs=(model,),
        env=frozen_map(wf_data.get("env")),
        defaults_run=frozen_map(wf_data.get("defaults_run")),
    )
    ctx: dict[str, Any] = {**d["contexts"], **{k: v for k, v in contexts.items()}}
    if d.get("caller_name"):
        ctx["_caller_name"] = d["caller_name"]
    available = frozenset(d["available"]) | {"needs"} | (frozenset(contexts) & _PLAN_CONTEXTS)
    scope = _Scope(workflow, d["prefix"], d["caller"], ctx, available, tuple(d.get("chain") or ()))
    planner = _Planner(workflow.path, seq=job.seq, expanding=True)
    strategy = model.strategy
    assert strategy is not None
    if strategy.template is not None:
        # `strategy` written with an insert: `plan_job` evaluates it whole.
        planner.plan_job(model, scope)
    else:
        assert strategy.matrix is not None
        template = strategy.matrix.template
        try:
            value = _eval_data(template, ctx)
        except ex.ExpressionError as exc:
            raise PlanError(f"job '{job.id}': the matrix cannot be evaluated: {exc}") from exc
        if isinstance(value, str):
            raise PlanError(f"job '{job.id}': the matrix evaluated to a string, not an object")
        planner.plan_job(model, scope, matrix_value=value)
    legs = tuple(sorted(planner.jobs, key=lambda j: j.seq))
    if planner.seq > job.seq + int(d["seq_block"]):
        raise PlanError(f"job '{job.id}': the expansion does not fit the plan's seq block")
    cohort = planner.cohorts[0] if planner.cohorts and legs else None
    return DeferredExpansion(jobs=legs, cohort=cohort)


# -- model from plain data (for deferred jobs) ---------------------------------


def _job_from_data(data: Mapping[str, Any]) -> Job:
    job = _from_data(Job, data)
    assert isinstance(job, Job)
    return job


_NESTED: dict[tuple[type, str], type] = {
    (Job, "strategy"): Strategy,
    (Job, "concurrency"): Concurrency,
    (Job, "callee"): Workflow,
    (Strategy, "matrix"): Matrix,
    (Workflow, "concurrency"): Concurrency,
    (Workflow, "workflow_call"): WorkflowCall,
}
_SEQUENCES: dict[tuple[type, str], type] = {(Job, "steps"): Step, (Workflow, "jobs"): Job}


def _from_data(cls: type, data: Mapping[str, Any]) -> Any:
    """Rebuilds a model object from `to_data` output."""
    kwargs: dict[str, Any] = {}
    for f in fields(cls):
        if f.name not in data:
            continue
        v = data[f.name]
        key = (cls, f.name)
        if v is None:
            kwargs[f.name] = None
        elif key in _NESTED:
            kwargs[f.name] = _from_data(_NESTED[key], v)
        elif key in _SEQUENCES:
            kwargs[f.name] = tuple(_from_data(_SEQUENCES[key], x) for x in v)
        elif cls is Matrix and f.name == "vectors":
            kwargs[f.name] = tuple((k, tuple(vals)) for k, vals in v)
        elif cls is Matrix and f.name in ("include", "exclude"):
            kwargs[f.name] = tuple(frozen_map(e) for e in v)
        elif cls in (Matrix, Strategy) and f.name == "template":
            kwargs[f.name] = v
        elif isinstance(v, Mapping):
            kwargs[f.name] = frozen_map(v)
        elif isinstance(v, list):
            kwargs[f.name] = tuple(v)
        else:
            kwargs[f.name] = v
    return cls(**kwargs)
