"""`preloop list`: every workflow's jobs, matrix legs and events (like `act -l`)."""

from __future__ import annotations

import functools
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import click
from rich.table import Table

from preloop.cli.app import cli, emit_json, make_console
from preloop.cli.plan import _find_root, remote_workflows, stages
from preloop.cli.secret_args import action_option
from preloop.errors import UsageError
from preloop.workflow import PlanError, WorkflowError, load_workflow, plan, workflow_files
from preloop.workflow.github_context import local_github_context
from preloop.workflow.loader import EVENTS
from preloop.workflow.selection import foreign_platform
from preloop.workflow.triggers import check_event_name
from preloop.workflow.yamltree import Diagnostic

__all__ = ["list_command"]


def _planning_event(events: list[str], wanted: str | None) -> str | None:
    if wanted is not None:
        return wanted if wanted in events else None
    for e in ("push", "pull_request", "workflow_dispatch"):
        if e in events:
            return e
    return next((e for e in events if e != "workflow_call"), None)


@cli.command("list")
@click.option(
    "-f",
    "--file",
    "file",
    type=click.Path(path_type=Path),
    help="One workflow file (default: every workflow in .github/workflows).",
)
@click.option("--event", help="Only workflows this event triggers (legs planned for it).")
@click.option("--json", "as_json", is_flag=True, help="Print the rows as JSON for scripts.")
@action_option
def list_command(
    file: Path | None, event: str | None, as_json: bool, actions: tuple[str, ...]
) -> None:
    """Lists jobs and matrix legs with their stage, runs-on labels and the
    events of their workflow. Nothing runs; `--job` and `--matrix` of
    `preloop run` take the job ids and matrix values shown here. Invalid
    workflows are reported (every problem, on stderr) after the others' rows,
    with exit status 1."""
    if event is not None:
        check_event_name(event, EVENTS)
    root = _find_root(Path.cwd() if file is None else file.resolve().parent)
    paths = [file] if file is not None else workflow_files(root)
    if not paths:
        raise UsageError(f"no workflows in {root / '.github' / 'workflows'}: pass one with -f FILE")
    github = local_github_context(root)
    rows: list[dict[str, Any]] = []
    problems: list[Diagnostic] = []
    remote = remote_workflows(actions)
    for path in paths:
        try:
            wf = remote.load(functools.partial(load_workflow, path))
        except WorkflowError as exc:
            problems.extend(exc.diagnostics)
            continue
        events = sorted(wf.on)
        if event is not None and event not in events:
            continue
        chosen = _planning_event(events, event)
        planned = None
        if chosen is not None:
            try:
                planned = plan(wf, chosen, github=github)
            except PlanError:
                planned = None  # e.g. a required dispatch input: list the jobs unexpanded
        if planned is None:
            for job in wf.jobs:
                rows.append(
                    _row(
                        wf.path,
                        wf.name,
                        events,
                        None,
                        job.id,
                        job.name or job.id,
                        _written_runs_on(job.runs_on),
                    )
                )
            continue
        for stage, group in enumerate(stages(planned), 1):
            for j in group:
                rows.append(
                    _row(wf.path, wf.name, events, stage, j.base_id, j.name, j.runs_on, j.matrix)
                )
    invalid = WorkflowError(problems) if problems else None
    if invalid is not None and not rows:
        raise invalid
    if as_json:
        emit_json(rows)
    else:
        _print_rows(rows)
    if invalid is not None:  # the valid workflows are listed; the status says not all are
        raise invalid


def _written_runs_on(value: Any) -> tuple[str, ...]:
    """A job's `runs-on` as written, for a workflow that could not be planned
    (a required dispatch input): its labels, expressions unevaluated."""
    if isinstance(value, Mapping):
        value = value.get("labels") or value.get("group") or []
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, (list, tuple)):
        return ()
    return tuple(str(v) for v in value if v is not None)


def _print_rows(rows: list[dict[str, Any]]) -> None:
    table = Table("stage", "job id", "job name", "runs-on", "workflow", "file", "events", box=None)
    for r in rows:
        runs_on = ", ".join(r["runs_on"])
        if r["skipped"]:
            runs_on += " (not run here)"
        table.add_row(
            "" if r["stage"] is None else str(r["stage"]),
            r["job"],
            r["name"],
            runs_on,
            r["workflow_name"],
            r["workflow"],
            ",".join(r["events"]),
        )
    make_console(highlight=False).print(table)


def _row(
    path: str,
    name: str,
    events: list[str],
    stage: int | None,
    job: str,
    display: str,
    runs_on: tuple[str, ...],
    matrix: dict[str, Any] | None = None,
) -> dict[str, Any]:
    return {
        "workflow": path,
        "workflow_name": name,
        "events": events,
        "stage": stage,
        "job": job,
        "name": display,
        "runs_on": list(runs_on),
        "matrix": matrix,
        "skipped": foreign_platform(runs_on, {}),
    }
