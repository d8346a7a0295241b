"""`preloop plan`: what a workflow run would execute, without running it."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import click

from preloop.cli.app import cli, emit_json
from preloop.errors import UsageError
from preloop.workflow import (
    Plan,
    PlannedJob,
    WorkflowError,
    load_workflow,
    plan,
    workflow_files,
)
from preloop.workflow.github_context import local_github_context
from preloop.workflow.yamltree import Diagnostic

__all__ = ["plan_command", "stages"]


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


def _parse_inputs(pairs: tuple[str, ...]) -> Mapping[str, str]:
    inputs: dict[str, str] = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep or not name:
            raise UsageError(f"--input {pair!r}: expected NAME=VALUE")
        inputs[name] = value
    return inputs


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
@click.option("--json", "as_json", is_flag=True, help="Print the plans as JSON for scripts.")
def plan_command(file: Path | None, event: str, inputs: tuple[str, ...], as_json: bool) -> None:
    """Shows what a run would execute: jobs, matrix legs, and the stages they
    run in. Nothing is executed. Invalid workflows are reported as
    `path:line:col: message`, every problem at once."""
    given = _parse_inputs(inputs)
    # The file's own directory, not its target: a symlink (or a symlink loop,
    # reported by the loader as `file:1:1`) must not break the lookup.
    root = _find_root(Path.cwd() if file is None else file.absolute().parent)
    github = local_github_context(root)
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
    plans: list[Plan] = []
    problems: list[Diagnostic] = []
    for path in paths:
        try:
            wf = load_workflow(path)
        except WorkflowError as exc:
            problems.extend(exc.diagnostics)
            continue
        if not explicit and (not wf.triggered_by(event) or event == "workflow_call"):
            continue
        plans.append(plan(wf, event, inputs=given, github=github))
    if problems:
        raise WorkflowError(problems, str(problems[0].path))
    if not plans:
        raise UsageError(f"no workflow in .github/workflows is triggered by '{event}'")
    if as_json:
        emit_json([p.to_dict() for p in plans])
        return
    for p in plans:
        groups = stages(p)
        count = sum(len(g) for g in groups)
        click.echo(f"{p.workflow} ({p.name}) on {p.event}: {count} jobs in {len(groups)} stages")
        if p.concurrency is not None:
            group = p.concurrency.group or f"${{{{ {p.concurrency.group_expr} }}}}"
            click.echo(f"  concurrency: {group}")
        for i, g in enumerate(groups, 1):
            click.echo(f"  stage {i}:")
            for j in g:
                extra = ""
                if j.kind == "deferred":
                    extra = f"  [matrix deferred: {j.deferred_matrix}]"
                elif j.runs_on:
                    extra = f"  [runs-on: {', '.join(j.runs_on)}]"
                click.echo(f"    {j.name}{extra}")


def _find_root(start: Path) -> Path:
    for d in (start, *start.parents):
        if (d / ".github" / "workflows").is_dir():
            return d
    return Path.cwd()
