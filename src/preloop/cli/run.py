"""`preloop run`: the workflow of this repository, on a snapshot of the work tree."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import anyio
import click
from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from preloop import config
from preloop.actions.reference import Overrides, parse_overrides
from preloop.cli.app import cli, emit_json
from preloop.cli.secret_args import parse_secrets, sandbox_options, secret_options
from preloop.control import JobInfo, Lease
from preloop.engine import Engine, EngineEvents, RunOutcome, RunRequest
from preloop.errors import PreloopError
from preloop.runner import JobResult
from preloop.workflow import Plan

__all__ = ["parse_secrets", "print_summary"]

_STYLE = {
    "success": "green",
    "failure": "red",
    "cancelled": "yellow",
    "skipped": "dim",
}
_ICON = {"success": "✓", "failure": "✗", "cancelled": "⊘", "skipped": "-"}


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "—"
    if seconds < 60:
        return f"{seconds:.1f}s"
    return f"{int(seconds // 60)}m{int(seconds % 60):02d}s"


def print_summary(console: Console, outcome: RunOutcome, elapsed: float) -> None:
    table = Table(title=f"run {outcome.run_id} · {outcome.workflow}", title_justify="left")
    table.add_column("job")
    table.add_column("result")
    table.add_column("duration", justify="right")
    for job in outcome.jobs:
        if job.kind == "deferred" and job.status == "expanded":
            continue
        result = job.conclusion or job.status
        style = _STYLE.get(result, "")
        table.add_row(
            job.name,
            Text(f"{_ICON.get(result, '?')} {result}", style=style),
            _duration(job.duration),
        )
    console.print(table)
    for job in outcome.jobs:
        for note in job.annotations:
            console.print(f"  {job.name}: {note}", markup=False, highlight=False)
        if job.conclusion == "failure" and job.reason:
            console.print(f"  {job.name}: {job.reason}", markup=False, highlight=False)
    verdict = "interrupted" if outcome.interrupted else outcome.conclusion
    console.print(
        Text.assemble(
            (f"{verdict}", _STYLE.get(verdict, "yellow")),
            f" in {_duration(elapsed)} · logs: preloop logs {outcome.run_id}",
        )
    )


class _Progress:
    """Live view (a terminal) or prefixed lines (anything else)."""

    def __init__(self, console: Console, live: bool, quiet: bool) -> None:
        self.console = console
        self.live_mode = live and not quiet
        self.quiet = quiet
        self.jobs: dict[str, dict[str, Any]] = {}
        self.order: list[str] = []
        self.live: Live | None = None

    def submitted(self, run_id: int, plan: Plan) -> None:
        for job in plan.jobs:
            if job.kind == "job" or job.kind == "deferred":
                self.order.append(job.id)
                self.jobs[job.id] = {"name": job.name, "state": "queued", "start": None}
        if not self.quiet and not self.live_mode:
            self.console.print(f"run {run_id}: {plan.name} ({len(self.order)} jobs)", markup=False)
        self._changed()

    def _changed(self) -> None:
        # A state change shows at once, not at the next periodic refresh: a job
        # shorter than the refresh period would otherwise never appear running.
        # refresh=True matters: lines printed above the panel redraw the last
        # *refreshed* renderable, not the last one passed to update().
        if self.live is not None:
            self.live.update(self.render(), refresh=True)

    def start(self, lease: Lease) -> None:
        entry = self.jobs.setdefault(lease.job_id, {"name": lease.name})
        if lease.job_id not in self.order:
            self.order.append(lease.job_id)
        entry.update(name=lease.name, state="running", start=time.monotonic())
        self._changed()

    def line(self, lease: Lease, text: str) -> None:
        if self.quiet:
            return
        out = f"[{lease.name}] {text}"
        try:
            if self.live is not None:
                self.live.console.print(out, markup=False, highlight=False)
            else:
                sys.stdout.write(out + "\n")
                sys.stdout.flush()
        except OSError:
            # The reader went away (`preloop run | head`): the run goes on,
            # its log stays complete under the state directory.
            self.quiet = True

    def end(self, lease: Lease, result: JobResult) -> None:
        entry = self.jobs.setdefault(lease.job_id, {"name": lease.name, "start": None})
        start = entry.get("start")
        entry.update(state=result.conclusion, elapsed=time.monotonic() - start if start else None)
        self._changed()
        if not self.quiet and not self.live_mode:
            self.console.print(
                f"[{lease.name}] {_ICON.get(result.conclusion, '?')} {result.conclusion}",
                markup=False,
                highlight=False,
            )

    def observe(self, jobs: list[JobInfo]) -> None:
        """Job states read from the store (the live view's poll)."""
        now = time.monotonic()
        for job in jobs:
            if job.status == "expanded" or job.kind == "caller":
                # A deferred matrix became its legs; a caller folds its jobs.
                self.jobs.pop(job.id, None)
                if job.id in self.order:
                    self.order.remove(job.id)
                continue
            entry = self.jobs.get(job.id)
            if entry is None:
                entry = {"name": job.name, "state": "queued", "start": None}
                self.jobs[job.id] = entry
                self.order.append(job.id)
            if entry["state"] not in ("queued", "running"):
                continue
            if job.status == "running" and entry["state"] == "queued":
                entry.update(name=job.name, state="running", start=now)
            elif job.status == "completed" and job.conclusion:
                start = entry.get("start")
                entry.update(state=job.conclusion, elapsed=now - start if start else None)

    def render(self) -> Group:
        counts = {"queued": 0, "running": 0, "done": 0}
        table = Table.grid(padding=(0, 2))
        now = time.monotonic()
        for jid in self.order:
            entry = self.jobs[jid]
            state = entry["state"]
            if state == "queued":
                counts["queued"] += 1
                continue
            if state == "running":
                counts["running"] += 1
                elapsed = now - entry["start"] if entry.get("start") else None
                table.add_row(Text("⠿ running", style="cyan"), entry["name"], _duration(elapsed))
            else:
                counts["done"] += 1
                table.add_row(
                    Text(f"{_ICON.get(state, '?')} {state}", style=_STYLE.get(state, "")),
                    entry["name"],
                    _duration(entry.get("elapsed")),
                )
        head = Text(
            f"queued {counts['queued']} · running {counts['running']} · done {counts['done']}",
            style="bold",
        )
        return Group(head, table)

    def recovered(self, run_id: int) -> None:
        click.echo(
            f"preloop: run {run_id} was left unfinished by a `preloop run` that died; "
            "its processes were killed and the run cancelled",
            err=True,
        )

    def events(self) -> EngineEvents:
        return EngineEvents(
            on_recovered=self.recovered,
            on_submitted=self.submitted,
            on_job_start=self.start,
            on_job_line=self.line,
            on_job_end=self.end,
        )


async def _run(engine: Engine, progress: _Progress) -> RunOutcome | None:
    outcome: RunOutcome | None = None
    error: Exception | None = None
    with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with anyio.create_task_group() as tg:

            async def on_signal() -> None:
                async for _ in signals:
                    if engine.run_id is None:
                        tg.cancel_scope.cancel()  # still capturing: nothing to cancel in the store
                    engine.cancel()

            async def refresh() -> None:
                assert progress.live is not None
                polled = 0.0
                while True:
                    if time.monotonic() - polled > 1.0 and engine.run_id is not None:
                        # Jobs other machines' runners run (and skips) show too.
                        polled = time.monotonic()
                        store, run_id = engine.store, engine.run_id
                        if store is not None:
                            with contextlib.suppress(PreloopError):
                                jobs = await anyio.to_thread.run_sync(store.list_jobs, run_id)
                                progress.observe(jobs)
                    progress.live.update(progress.render())
                    await anyio.sleep(0.25)

            tg.start_soon(on_signal)
            if progress.live is not None:
                tg.start_soon(refresh)
            try:
                outcome = await engine.run()
            except Exception as exc:  # re-raised bare below, not as an ExceptionGroup
                error = exc
            tg.cancel_scope.cancel()
    if error is not None:
        raise error
    return outcome


@cli.command("run")
@click.option(
    "-f",
    "--file",
    "workflow",
    type=click.Path(path_type=Path, dir_okay=False),
    help="Workflow file (default: the one .github/workflows file the event triggers).",
)
@click.option("--event", default="push", show_default=True, help="Event that triggers the run.")
@click.option("--job", help="Run only this job (and the jobs it needs).")
@click.option(
    "-j",
    "--jobs",
    "parallel",
    type=int,
    help="Local runners (default: CPU count; 0: only `preloop runner` processes).",
)
@click.option("--store", help="Store URL (default: $PRELOOP_STORE_URL, else the lite store).")
@click.option(
    "--state-dir",
    type=click.Path(path_type=Path, file_okay=False),
    help="State directory (default: $PRELOOP_STATE_DIR).",
)
@secret_options
@sandbox_options
@click.option(
    "--action",
    "actions",
    multiple=True,
    metavar="OWNER/REPO[@REF]=DIR|skip[:REASON]",
    help="Run a local directory in place of a remote action, or skip it (repeatable).",
)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON document at the end.")
def run_command(
    workflow: Path | None,
    event: str,
    job: str | None,
    parallel: int | None,
    store: str | None,
    state_dir: Path | None,
    secret: tuple[str, ...],
    secret_files: tuple[Path, ...],
    sandbox: bool,
    sandbox_network: str,
    actions: tuple[str, ...],
    as_json: bool,
) -> None:
    """Run this repository's workflow on a snapshot of the work tree.

    The snapshot holds staged, unstaged and untracked (not ignored) files; the
    repository itself is not changed. Jobs run with GitHub's semantics on N local
    runners. Exit status: 0 success, 1 failure, 130 interrupted (Ctrl-C cancels
    the run and kills every step's process group).
    """
    request = RunRequest(
        workspace=Path.cwd(),
        workflow=workflow,
        event=event,
        job=job,
        local_runners=parallel,
        store_url=store,
        state_dir=state_dir or config.state_dir(),
        secrets=parse_secrets(secret, secret_files),
        sandbox=sandbox,
        sandbox_network=sandbox_network,
        action_overrides=parse_overrides(actions, "--action"),
    )
    # Bad action settings fail here, once, rather than in every job.
    Overrides.from_env(os.environ)
    console = Console(highlight=False)
    progress = _Progress(console, live=console.is_terminal, quiet=as_json)
    engine = Engine(request, progress.events())
    started = time.monotonic()
    if progress.live_mode:
        with Live(progress.render(), console=console, refresh_per_second=4) as live:
            progress.live = live
            outcome = anyio.run(_run, engine, progress)
            live.update(progress.render())
        progress.live = None
    else:
        outcome = anyio.run(_run, engine, progress)
    elapsed = time.monotonic() - started
    if outcome is None:
        click.echo("preloop: interrupted before the run was submitted", err=True)
        sys.exit(130)
    if as_json:
        emit_json({**outcome.to_dict(), "duration": round(elapsed, 3)})
    else:
        print_summary(console, outcome, elapsed)
    if outcome.interrupted:
        sys.exit(130)
    sys.exit(0 if outcome.ok else 1)
