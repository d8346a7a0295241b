"""`preloop plan`: what a workflow run would execute, without running it."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import click

from preloop.actions.reference import parse_overrides
from preloop.actions.workflows import PlanRun
from preloop.cli.app import cli, emit_json, plural
from preloop.cli.secret_args import action_option, parse_vars, var_options
from preloop.errors import UsageError
from preloop.workflow import (
    Plan,
    PlannedJob,
    WorkflowError,
    load_workflow,
    plan,
    workflow_files,
)
from preloop.workflow.changes import event_facts
from preloop.workflow.event_inputs import (
    check_inputs,
    default_action,
    local_event_payload,
    parse_pairs,
)
from preloop.workflow.expressions import ExpressionError, evaluate
from preloop.workflow.github_context import (
    default_branch_ref,
    event_github_context,
    workflow_github_context,
)
from preloop.workflow.loader import EVENTS
from preloop.workflow.triggers import Trigger, check_event_name, evaluate_trigger
from preloop.workflow.yamltree import Diagnostic

__all__ = ["plan_command", "remote_workflows", "stages"]


def remote_workflows(actions: tuple[str, ...]) -> PlanRun:
    """The loads of this command: remote reusable workflows resolved once,
    with the `--action` overrides (which win over PRELOOP_ACTION_OVERRIDES);
    released when the command ends."""
    run = PlanRun(overrides=parse_overrides(actions, "--action"))
    click.get_current_context().call_on_close(run.close)
    return run


def stages(p: Plan) -> list[list[PlannedJob]]:
    """Jobs grouped into stages: each stage's jobs can run together once the
    stages before it have ended. Callers are folded away (their inner jobs
    appear instead); a deferred matrix job is one entry."""
    by_base: dict[str, list[PlannedJob]] = {}
    for j in p.jobs:
        by_base.setdefault(j.base_id, []).append(j)
    level: dict[str, int] = {}

    def base_level(base: str, trail: frozenset[str] = frozenset()) -> int:
        if base in level:
            return level[base]
        if base in trail:  # cannot happen for a validated workflow
            return 0
        trail = trail | {base}
        members = by_base.get(base, [])
        best = 0
        for j in members:
            if j.kind == "caller":
                inner = [job_level(i, trail) for i in j.inner_job_ids]
                best = max(best, max(inner, default=job_level_needs(j, trail)))
            else:
                best = max(best, job_level(j.id, trail))
        level[base] = best
        return best

    jobs_by_id = {j.id: j for j in p.jobs}

    def job_level_needs(j: PlannedJob, trail: frozenset[str]) -> int:
        needs = j.needs
        if not needs and j.caller is not None:
            return job_level_needs(jobs_by_id[j.caller], trail)
        return max((base_level(n, trail) + 1 for n in needs), default=0)

    def job_level(job_id: str, trail: frozenset[str]) -> int:
        j = jobs_by_id[job_id]
        if j.kind == "caller":
            return base_level(j.base_id, trail)
        return job_level_needs(j, trail)

    out: dict[int, list[PlannedJob]] = {}
    for j in p.jobs:
        if j.kind == "caller":
            continue
        out.setdefault(job_level(j.id, frozenset()), []).append(j)
    return [out[k] for k in sorted(out)]


@cli.command("plan")
@click.option(
    "-f",
    "--file",
    "file",
    type=click.Path(path_type=Path),
    help="The workflow file (default: every workflow in .github/workflows the event triggers).",
)
@click.option("--event", default="push", show_default=True, help="The triggering event.")
@click.option("--input", "inputs", multiple=True, metavar="NAME=VALUE", help="A dispatch input.")
@click.option("--ref", help="The ref the event is about (default: the current branch).")
@click.option(
    "--base", help="Count changed paths from the merge base with this revision (see `run`)."
)
@var_options
@click.option("--json", "as_json", is_flag=True, help="Print the plans as JSON for scripts.")
@action_option
def plan_command(
    file: Path | None,
    event: str,
    inputs: tuple[str, ...],
    ref: str | None,
    base: str | None,
    variables: tuple[str, ...],
    var_files: tuple[Path, ...],
    as_json: bool,
    actions: tuple[str, ...],
) -> None:
    """Shows what a run would execute: which workflows the event triggers and
    why (or why not: branch, tag and path filters), their jobs, matrix legs,
    and the stages they run in. Nothing is executed. Invalid workflows are
    reported as `path:line:col: message`, every problem at once, after the
    valid workflows' plans (exit status 1)."""
    check_event_name(event, EVENTS)
    remote = remote_workflows(actions)
    given = parse_pairs("--input", inputs)
    config_vars = parse_vars(variables, var_files)
    # The file's own directory, not its target: a symlink (or a symlink loop,
    # reported by the loader as `file:1:1`) must not break the lookup.
    root = _find_root(Path.cwd() if file is None else file.absolute().parent)
    local = event_facts(root, event, ref=ref, base=base, action=default_action(event))
    # The run's github context and default payload: what a concurrency group
    # or a name reads (`github.head_ref || github.ref`, the pull request's
    # number) is what `preloop run` would use.
    github = event_github_context(root, event, local)
    github["event"] = local_event_payload(
        root, event, github, local, default_branch_ref(root), inputs=given
    )
    if file is not None:
        paths = [file]
        explicit = True
    else:
        paths = workflow_files(root)
        explicit = False
        if not paths:
            raise UsageError(
                f"no workflows in {root / '.github' / 'workflows'}: pass one with -f FILE"
            )
    plans: list[tuple[Plan, str]] = []
    run_githubs: dict[str, dict[str, Any]] = {}
    skipped: list[tuple[str, str]] = []
    problems: list[Diagnostic] = []
    for path in paths:
        try:
            wf = remote.load(functools.partial(load_workflow, path))
        except WorkflowError as exc:
            problems.extend(exc.diagnostics)
            continue
        trig = evaluate_trigger(wf, local.facts)
        if event == "workflow_call":
            trig = Trigger(False, "workflow_call runs only from a caller")
        if not trig.triggered:
            skipped.append((wf.path, trig.reason))
            if not explicit or event not in wf.on:
                continue
        declared = wf.workflow_dispatch_inputs if event == "workflow_dispatch" else {}
        # Several workflows: each takes the inputs it declares (as a dispatch
        # of that one workflow would); one workflow: every input is checked.
        mine = given if len(paths) == 1 else {k: v for k, v in given.items() if k in declared}
        typed = check_inputs(wf, event, mine) if event in wf.on else dict(given)
        wf_github = workflow_github_context(github, root, wf.path)
        planned = plan(wf, event, inputs=typed, github=wf_github, vars=config_vars)
        plans.append((planned, trig.reason))
        run_githubs[wf.path] = wf_github
    invalid = WorkflowError(problems) if problems else None
    if invalid is not None and not plans:
        raise invalid
    if not plans and explicit and skipped:
        raise UsageError(f"{skipped[0][0]}: {skipped[0][1]}; plan another event with --event EVENT")
    if not plans:
        detail = "; ".join(f"{p}: {r}" for p, r in skipped)
        raise UsageError(f"no workflow in .github/workflows is triggered by '{event}': {detail}")
    untriggered = {name for name, _ in skipped}
    if as_json:
        emit_json(
            [
                {
                    **p.to_dict(),
                    "trigger": {
                        "triggered": not any(s[0] == p.workflow for s in skipped),
                        "reason": why,
                    },
                }
                for p, why in plans
            ]
        )
        if invalid is not None:
            raise invalid
        return
    for p, why in plans:
        groups = stages(p)
        count = sum(len(g) for g in groups)
        click.echo(
            f"{p.workflow} ({p.name}) on {p.event}: {plural(count, 'job')} in "
            f"{plural(len(groups), 'stage')}"
        )
        if p.workflow in untriggered:
            click.echo(f"  not triggered: {why}")
        else:
            click.echo(f"  triggered: {why}")
        if p.concurrency is not None:
            group = p.concurrency.group or _run_scoped_group(p, run_githubs.get(p.workflow, {}))
            click.echo(f"  concurrency: {group}")
        for i, g in enumerate(groups, 1):
            click.echo(f"  stage {i}:")
            for j in g:
                extra = ""
                if j.kind == "deferred":
                    extra = f"  [matrix deferred: {j.deferred_matrix}]"
                elif j.spec.get("skipped_call"):
                    extra = f"  [skipped: {j.spec['skipped_call']}]"
                elif j.runs_on:
                    extra = f"  [runs-on: {', '.join(j.runs_on)}]"
                click.echo(f"    {j.name}{extra}")
    shown = {p.workflow for p, _ in plans}
    for name, reason in skipped:
        if name not in shown:
            click.echo(f"{name}: not triggered: {reason}")
    if local.facts.event in ("push", "pull_request", "pull_request_target"):
        changed = local.facts.changed_paths
        seen = "changed paths unknown" if changed is None else plural(len(changed), "changed path")
        # A pull request's ref here is its base branch (what branch filters
        # match): on cleo's `feature` branch this said `ref refs/heads/main`.
        what = "ref" if local.facts.event == "push" else "pull request into"
        click.echo(f"({what} {local.facts.ref or 'unknown'}; {seen}: {local.note})")
    if invalid is not None:  # the valid workflows are shown; the status says not all are
        raise invalid


def _find_root(start: Path) -> Path:
    for d in (start, *start.parents):
        if (d / ".github" / "workflows").is_dir():
            return d
    return Path.cwd()


def _run_scoped_group(p: Plan, github: dict[str, Any]) -> str:
    """A concurrency group that reads `github.run_id` (run_number,
    run_attempt) is evaluated as the run is stored (Store.submit_run); here
    with `<run id>` (`<run number>`, `<run attempt>`) in its place, so
    `${{ github.workflow }}-${{ github.head_ref || github.run_id }}` reads
    `Lint-feature` for a pull request and `Lint-<run id>` for a push, not as
    the rewritten expression."""
    conc = p.concurrency
    assert conc is not None and conc.group_expr is not None
    run_github = {
        **github,
        "event_name": p.event,
        "workflow": p.github_workflow or p.name,  # as the engine submits it
        "run_id": "<run id>",
        "run_number": "<run number>",
        "run_attempt": "<run attempt>",
    }
    contexts = {"env": p.env, "inputs": p.inputs, "github": run_github, "vars": p.vars}
    try:
        return str(evaluate(conc.group_expr, contexts))
    except ExpressionError:
        return f"${{{{ {conc.group_expr} }}}}"
