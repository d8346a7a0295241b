"""`preloop status`, `preloop logs`, `preloop cancel`: runs in the store and
their logs under the state directory."""

from __future__ import annotations

import sys
from pathlib import Path

import click
from rich.table import Table

from preloop import config
from preloop.cli.app import cli, emit_json, make_console, state_dir_option
from preloop.control import Store, UnknownRun
from preloop.engine import default_store_url, open_user_store
from preloop.errors import PreloopError
from preloop.runner.logs import job_ids_with_logs, log_path, read_result, run_logs_name

_store_option = click.option(
    "--store", help="Store URL (default: $PRELOOP_STORE_URL, else the lite store)."
)


class _RunId(click.ParamType[int]):
    """A run id: a positive integer that fits the stores' 64-bit ids (a larger
    one names no run, and is said so instead of overflowing the database)."""

    name = "run_id"

    def convert(
        self, value: object, param: click.Parameter | None, ctx: click.Context | None
    ) -> int:
        if isinstance(value, int):
            n = value
        else:
            try:
                n = int(str(value), 10)
            except ValueError:
                self.fail(f"{value!r} is not a run id (a positive integer)", param, ctx)
        if not 0 < n < 2**63:
            self.fail(f"no run {n}: run ids are positive 64-bit integers", param, ctx)
        return n


RUN_ID = _RunId()


def _open(store: str | None, state_dir: Path | None) -> tuple[Store, Path]:
    state = state_dir or config.state_dir()
    return open_user_store(default_store_url(state, store), store), state


@cli.command("status")
@click.argument("run_id", type=RUN_ID, required=False)
@_store_option
@state_dir_option
@click.option("--json", "as_json", is_flag=True, help="Print one JSON document.")
def status_command(
    run_id: int | None, store: str | None, state_dir: Path | None, as_json: bool
) -> None:
    """Recent runs, or the jobs of RUN_ID."""
    db, _ = _open(store, state_dir)
    console = make_console(highlight=False)
    with db:
        if run_id is None:
            runs = db.list_runs()
            if as_json:
                emit_json([_run_dict(r) for r in runs])
                return
            table = Table("run", "workflow", "event", "status", "result")
            for r in runs:
                table.add_row(str(r.id), r.name, r.event, r.status, r.conclusion or "")
            console.print(table)
            return
        info = db.get_run(run_id)
        jobs = db.list_jobs(run_id)
    if as_json:
        emit_json(
            {
                **_run_dict(info),
                "jobs": [
                    {
                        "id": j.id,
                        "name": j.name,
                        "kind": j.kind,
                        "status": j.status,
                        "result": j.conclusion,
                        "outputs": j.outputs,
                        "reason": j.reason,
                        "runner": j.runner,
                    }
                    for j in jobs
                ],
            }
        )
        return
    console.print(
        f"run {info.id} · {info.name} · {info.event} · {info.status}"
        + (f" · {info.conclusion}" if info.conclusion else ""),
        markup=False,
    )
    table = Table("job", "status", "result", "runner", "reason")
    for j in jobs:
        table.add_row(j.name, j.status, j.conclusion or "", j.runner or "", j.reason or "")
    console.print(table)


def _run_dict(r: object) -> dict[str, object]:
    fields = ("id", "workflow", "name", "event", "status", "conclusion", "cancel_requested")
    return {f: getattr(r, f) for f in fields}


@cli.command("logs")
@click.argument("run_id", type=RUN_ID)
@click.argument("job", required=False)
@_store_option
@state_dir_option
@click.option(
    "--summary", is_flag=True, help="Print the step summaries (GITHUB_STEP_SUMMARY) instead."
)
def logs_command(
    run_id: int, job: str | None, store: str | None, state_dir: Path | None, summary: bool
) -> None:
    """The log of JOB of RUN_ID (job id or name), or of every job, prefixed;
    with --summary, the jobs' step summaries (Markdown) instead."""
    db, state = _open(store, state_dir)
    with db:
        try:
            db.get_run(run_id)
            jobs = db.list_jobs(run_id)
            context = db.run_context(run_id)
        except UnknownRun:
            raise PreloopError(f"no run {run_id} in {db.url}: see `preloop status`") from None
        url = db.url
    engine = (context.get("github") or {}).get("preloop_engine") or {}
    key = engine.get("run_key") if isinstance(engine, dict) else None
    name = run_logs_name(state, run_id, str(key) if key else None)
    if name is None:
        # Run ids repeat across stores: the logs here are another store's run.
        raise PreloopError(
            f"run {run_id} of {url} has no logs under {state / 'logs'} (the logs of run "
            f"{run_id} there belong to another store's run; pass this store's --state-dir)"
        )
    have = set(job_ids_with_logs(state, name))
    if job is not None:
        match = [j for j in jobs if job in (j.id, j.name)]
        if not match:
            known = ", ".join(j.id for j in jobs if j.kind == "job")
            raise PreloopError(f"run {run_id} has no job {job!r} (jobs: {known})")
        targets = match[:1]
        if targets[0].id not in have:
            raise PreloopError(
                f"run {run_id} job {targets[0].id!r} has no log under {state / 'logs'} "
                f"(status {targets[0].status}; a runner on another machine keeps its own)"
            )
    else:
        targets = [j for j in jobs if j.id in have]
    if summary:
        shown = 0
        for j in targets:
            result = read_result(state, name, j.id) or {}
            text = str(result.get("summary") or "").strip()
            if text:
                click.echo(f"## {j.name}\n\n{text}\n")
                shown += 1
        if not shown:
            click.echo(f"run {run_id}: no step summaries (nothing written to GITHUB_STEP_SUMMARY)")
        return
    if job is not None:
        sys.stdout.write(log_path(state, name, targets[0].id).read_text(errors="replace"))
        return
    for j in targets:
        for line in log_path(state, name, j.id).read_text(errors="replace").splitlines():
            click.echo(f"[{j.name}] {line}")


@cli.command("cancel")
@click.argument("run_id", type=RUN_ID)
@_store_option
@state_dir_option
def cancel_command(run_id: int, store: str | None, state_dir: Path | None) -> None:
    """Cancel RUN_ID: queued jobs are cancelled, running jobs are told to stop."""
    db, _ = _open(store, state_dir)
    with db:
        changed = db.cancel_run(run_id)
    click.echo(f"run {run_id}: " + ("cancel requested" if changed else "already ended"))
