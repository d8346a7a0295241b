"""`preloop status`, `preloop logs`, `preloop cancel`: runs in the store and
their logs under the state directory."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import click
from rich.table import Table

from preloop import config
from preloop.cli.app import cli, emit_json, make_console, state_dir_option
from preloop.control import JobInfo, RunInfo, Store, UnknownRun
from preloop.control.joblogs import JobLogStore
from preloop.control.wakeups import LOGS
from preloop.engine import default_store_url, open_user_store
from preloop.errors import PreloopError, UsageError
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
                run = str(r.id) if r.rerun_of is None else f"{r.id} (re-run of {r.rerun_of})"
                table.add_row(run, r.name, r.event, r.status, r.conclusion or "")
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
    again = "" if info.rerun_of is None else f" (re-run of {info.rerun_of})"
    console.print(
        f"run {info.id}{again} · {info.name} · {info.event} · {info.status}"
        + (f" · {info.conclusion}" if info.conclusion else ""),
        markup=False,
    )
    table = Table("job", "status", "result", "runner", "reason")
    for j in jobs:
        table.add_row(j.name, j.status, j.conclusion or "", j.runner or "", j.reason or "")
    console.print(table)


def _run_dict(r: object) -> dict[str, object]:
    fields = (
        "id",
        "workflow",
        "name",
        "event",
        "status",
        "conclusion",
        "cancel_requested",
        "rerun_of",
    )
    return {f: getattr(r, f) for f in fields}


# How long a follower waits between looks when no wake-up comes (lite, or
# a PostgreSQL listener that is down).
_FOLLOW_POLL = 0.5


@cli.command("logs")
@click.argument("run_id", type=RUN_ID)
@click.argument("job", required=False)
@_store_option
@state_dir_option
@click.option(
    "--summary", is_flag=True, help="Print the step summaries (GITHUB_STEP_SUMMARY) instead."
)
@click.option(
    "-f",
    "--follow",
    is_flag=True,
    help="Keep printing new lines until the job (or, without JOB, the run) has ended.",
)
def logs_command(
    run_id: int,
    job: str | None,
    store: str | None,
    state_dir: Path | None,
    summary: bool,
    follow: bool = False,
) -> None:
    """The log of JOB of RUN_ID (job id or name), or of every job, prefixed;
    with --summary, the jobs' step summaries (Markdown) instead.

    On a PostgreSQL store the logs are read from the store, so this works on
    any machine, for jobs that ran anywhere; on the lite store they are read
    from the state directory."""
    if summary and follow:
        raise UsageError(
            "--summary and --follow do not go together: summaries exist once a job ended"
        )
    db, state = _open(store, state_dir)
    with db:
        try:
            info = db.get_run(run_id)
            jobs = db.list_jobs(run_id)
            context = db.run_context(run_id)
        except UnknownRun:
            raise PreloopError(f"no run {run_id} in {db.url}: see `preloop status`") from None
        target = _target_job(run_id, jobs, job)
        asked = run_id
        if target is None and info.rerun_of is not None:
            for j in jobs:
                if _kept(j, info):
                    click.echo(
                        f"preloop: run {run_id} kept {j.name!r} as it ended in run "
                        f"{info.rerun_of}: `preloop logs {run_id} {j.id}` shows its log",
                        err=True,
                    )
        while target is not None and info.rerun_of is not None and _kept(target, info):
            # Its log is the run's it was kept from (GitHub shows a re-run's
            # kept jobs with the earlier attempt's logs).
            run_id = info.rerun_of
            info, jobs = db.get_run(run_id), db.list_jobs(run_id)
            context = db.run_context(run_id)
            target = _target_job(run_id, jobs, target.id)
        if run_id != asked and target is not None:
            click.echo(
                f"preloop: run {asked} kept {target.name!r} as it ended in run {run_id}: "
                "its log there",
                err=True,
            )
        stored = JobLogStore(db)
        in_store = stored.jobs_with_logs(run_id) or set(stored.results(run_id))
        if in_store or (follow and db.dialect == "pg"):
            _logs_from_store(db, stored, run_id, jobs, target, summary, follow)
            return
        if follow:
            _follow_files(db, state, run_id, jobs, target, context)
            return
        url = db.url
    _logs_from_files(state, run_id, jobs, target, context, url, summary)


def _target_job(run_id: int, jobs: list[JobInfo], job: str | None) -> JobInfo | None:
    if job is None:
        return None
    match = [j for j in jobs if job in (j.id, j.name)]
    if not match:
        known = ", ".join(j.id for j in jobs if j.kind == "job")
        raise PreloopError(f"run {run_id} has no job {job!r} (jobs: {known})")
    return match[0]


def _kept(job: JobInfo, run: RunInfo) -> bool:
    """A job of the re-run `run` kept as it ended in the run it re-runs: it
    ended before the re-run began (one it skipped or ran ended after)."""
    return (
        job.kind == "job"
        and job.status == "completed"
        and job.completed_at is not None
        and job.completed_at < run.created_at
    )


def _names(jobs: list[JobInfo]) -> dict[str, str]:
    return {j.id: j.name for j in jobs}


def _print_summaries(
    run_id: int, jobs: list[JobInfo], results: dict[str, dict[str, object]]
) -> None:
    shown = 0
    for j in jobs:
        text = str((results.get(j.id) or {}).get("summary") or "").strip()
        if text:
            click.echo(f"## {j.name}\n\n{text}\n")
            shown += 1
    if not shown:
        click.echo(f"run {run_id}: no step summaries (nothing written to GITHUB_STEP_SUMMARY)")


def _ended(db: Store, run_id: int, target: JobInfo | None) -> bool:
    if target is None:
        return db.get_run(run_id).status == "completed"
    for j in db.list_jobs(run_id):
        if j.id == target.id:
            return j.status == "completed"
    return True


def _logs_from_store(
    db: Store,
    stored: JobLogStore,
    run_id: int,
    jobs: list[JobInfo],
    target: JobInfo | None,
    summary: bool,
    follow: bool,
) -> None:
    only = None if target is None else target.id
    if summary:
        results = stored.results(run_id)
        _print_summaries(run_id, [target] if target else jobs, results)
        return
    names = _names(jobs)
    seen: dict[str, int] = {}

    def show() -> None:
        for batch in stored.read(run_id, only, seen):
            seen[batch.job_id] = batch.seq
            if only is not None:
                sys.stdout.write("".join(f"{line}\n" for line in batch.lines))
            else:
                if batch.job_id not in names:  # a leg expanded since we looked
                    names.update(_names(db.list_jobs(run_id)))
                name = names.get(batch.job_id, batch.job_id)
                sys.stdout.write("".join(f"[{name}] {line}\n" for line in batch.lines))
        sys.stdout.flush()

    if not follow:
        if only is not None and only not in stored.jobs_with_logs(run_id):
            status = target.status if target else ""
            raise PreloopError(f"run {run_id} job {only!r} has no log yet (status {status})")
        show()
        return
    while True:
        token = db.work_token(LOGS)  # before the read: no line is missed
        ended = _ended(db, run_id, target)  # before the read: the last lines are read after
        show()
        if ended:
            return
        if token is None or not db.listening:
            time.sleep(_FOLLOW_POLL)
        else:
            db.wait_work(token, _FOLLOW_POLL * 10, LOGS)


def _logs_from_files(
    state: Path,
    run_id: int,
    jobs: list[JobInfo],
    target: JobInfo | None,
    context: dict[str, Any],
    url: str,
    summary: bool,
) -> None:
    name = _files_name(state, run_id, context, url)
    have = set(job_ids_with_logs(state, name))
    if target is not None:
        if target.id not in have:
            raise PreloopError(
                f"run {run_id} job {target.id!r} has no log under {state / 'logs'} "
                f"(status {target.status}; a runner on another machine keeps its own)"
            )
        targets = [target]
    else:
        targets = [j for j in jobs if j.id in have]
    if summary:
        results = {j.id: read_result(state, name, j.id) or {} for j in targets}
        _print_summaries(run_id, targets, results)
        return
    if target is not None:
        sys.stdout.write(log_path(state, name, target.id).read_text(errors="replace"))
        return
    for j in targets:
        for line in log_path(state, name, j.id).read_text(errors="replace").splitlines():
            click.echo(f"[{j.name}] {line}")


def _files_name(state: Path, run_id: int, context: dict[str, Any], url: str) -> str:
    engine = (context.get("github") or {}).get("preloop_engine") or {}
    key = engine.get("run_key") if isinstance(engine, dict) else None
    name = run_logs_name(state, run_id, str(key) if key else None)
    if name is None:
        # Run ids repeat across stores: the logs here are another store's run.
        raise PreloopError(
            f"run {run_id} of {url} has no logs under {state / 'logs'} (the logs of run "
            f"{run_id} there belong to another store's run; pass this store's --state-dir)"
        )
    return name


def _follow_files(
    db: Store,
    state: Path,
    run_id: int,
    jobs: list[JobInfo],
    target: JobInfo | None,
    context: dict[str, Any],
) -> None:
    """Follows log files of the lite store's runs (its runners are on this host)."""
    names = _names(jobs)
    offsets: dict[str, int] = {}
    while True:
        ended = _ended(db, run_id, target)
        name = _files_name(state, run_id, context, db.url)
        ids = [target.id] if target is not None else job_ids_with_logs(state, name)
        for job_id in ids:
            path = log_path(state, name, job_id)
            try:
                with path.open("rb") as fh:
                    fh.seek(offsets.get(job_id, 0))
                    data = fh.read()
            except FileNotFoundError:
                continue
            complete = data[: data.rfind(b"\n") + 1]  # a line still being written waits
            offsets[job_id] = offsets.get(job_id, 0) + len(complete)
            text = complete.decode(errors="replace")
            if target is not None:
                sys.stdout.write(text)
            else:
                if job_id not in names:
                    names.update(_names(db.list_jobs(run_id)))
                prefix = names.get(job_id, job_id)
                sys.stdout.write("".join(f"[{prefix}] {line}\n" for line in text.splitlines()))
        sys.stdout.flush()
        if ended:
            return
        time.sleep(_FOLLOW_POLL)


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
