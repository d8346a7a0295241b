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
from preloop.cli.app import cli, echo_error, emit_json, make_console, plural
from preloop.cli.secret_args import (
    action_option,
    local_run_options,
    parse_secrets,
    parse_vars,
    sandbox_options,
    secret_options,
    var_options,
)
from preloop.control import JobInfo, Lease
from preloop.engine import (
    Engine,
    EngineEvents,
    InvalidWorkflow,
    RunOutcome,
    RunRequest,
    RunsOutcome,
    Selection,
)
from preloop.errors import UsageError
from preloop.runner import JobResult
from preloop.workflow import Plan
from preloop.workflow.event_inputs import parse_pairs, split_pairs
from preloop.workflow.selection import matrix_filter

__all__ = [
    "annotation_lines",
    "execute",
    "parse_secrets",
    "plural",
    "print_runs_summary",
    "print_summary",
]

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


def annotation_lines(job_name: str, notes: list[str]) -> list[str]:
    """Annotations of a job, identical ones once with a count."""
    counts: dict[str, int] = {}
    for note in notes:
        counts[note] = counts.get(note, 0) + 1
    return [f"  {job_name}: {n}" + (f" (×{c})" if c > 1 else "") for n, c in counts.items()]


def print_summary(console: Console, outcome: RunOutcome, elapsed: float | None = None) -> None:
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
        for text in annotation_lines(job.name, job.annotations):
            console.print(text, markup=False, highlight=False)
        if job.reason and (
            job.conclusion == "failure" or (job.conclusion == "skipped" and "runs-on" in job.reason)
        ):
            console.print(f"  {job.name}: {job.reason}", markup=False, highlight=False)
    why = outcome.cancel_reason
    if why:
        console.print(f"  run {outcome.run_id} {why}", markup=False, highlight=False)
    if elapsed is not None:
        verdict = "interrupted" if outcome.interrupted else outcome.conclusion
        console.print(
            Text.assemble(
                (f"{verdict}", _STYLE.get(verdict, "yellow")),
                f" in {_duration(elapsed)} · logs: preloop logs {outcome.run_id}",
            )
        )


def print_runs_summary(console: Console, outcomes: RunsOutcome, elapsed: float) -> None:
    """Every run's table, the workflows not triggered, and one verdict."""
    if len(outcomes.runs) == 1 and not outcomes.skipped and not outcomes.invalid:
        print_summary(console, outcomes.runs[0], elapsed)
        return
    for outcome in outcomes.runs:
        print_summary(console, outcome)
    for skipped in outcomes.skipped:
        console.print(f"not run: {skipped.path}: {skipped.reason}", markup=False, highlight=False)
    for invalid in outcomes.invalid:
        console.print(_not_run_invalid(invalid), markup=False, highlight=False)
    verdict = "interrupted" if outcomes.interrupted else outcomes.conclusion
    each = ", ".join(f"run {r.run_id} {r.conclusion}" for r in outcomes.runs)
    logs = " / ".join(f"preloop logs {r.run_id}" for r in outcomes.runs)
    bad = f" · {plural(len(outcomes.invalid), 'invalid workflow')}" if outcomes.invalid else ""
    console.print(
        Text.assemble(
            (f"{verdict}", _STYLE.get(verdict, "yellow")),
            f" in {_duration(elapsed)} · {plural(len(outcomes.runs), 'workflow run')}"
            f" ({each}){bad} · logs: {logs}",
        )
    )


def _not_run_invalid(invalid: InvalidWorkflow) -> str:
    return f"not run: {invalid.path}: invalid ({plural(len(invalid.problems), 'problem')})"


class _Progress:
    """Live view (a terminal) or prefixed lines (anything else)."""

    def __init__(self, console: Console, live: bool, quiet: bool) -> None:
        self.console = console
        self.live_mode = live and not quiet
        self.quiet = quiet
        self.jobs: dict[tuple[int, str], dict[str, Any]] = {}
        self.order: list[tuple[int, str]] = []
        self.live: Live | None = None
        self.workflows: dict[int, str] = {}  # run id -> workflow name, when several
        self.silent_after = float(config.get("PRELOOP_SILENT_STEP_NOTICE"))

    def selected(self, selection: Selection) -> None:
        # Every problem of an invalid workflow, at once and on stderr (--json
        # too): the other workflows run meanwhile, the exit status is 1.
        # A called workflow's problem, met through two callers, is shown once.
        if selection.invalid:
            echo_error("\n".join(dict.fromkeys(p for w in selection.invalid for p in w.problems)))
        if self.quiet:
            return
        for skipped in selection.skipped:
            self.console.print(
                f"not run: {skipped.path}: {skipped.reason}", markup=False, highlight=False
            )
        for invalid in selection.invalid:
            self.console.print(_not_run_invalid(invalid), markup=False, highlight=False)

    def submitted(self, run_id: int, plan: Plan) -> None:
        count = 0
        for job in plan.jobs:
            if job.kind == "job" or job.kind == "deferred":
                key = (run_id, job.id)
                self.order.append(key)
                self.jobs[key] = {"name": job.name, "state": "queued", "start": None}
                count += 1
        self.workflows[run_id] = plan.name
        if len(self.workflows) == 2:  # now several: name every job with its workflow
            for (rid, _), entry in self.jobs.items():
                entry["name"] = f"{self.workflows[rid]} / {entry['name']}"
        elif len(self.workflows) > 2:
            for (rid, _), entry in self.jobs.items():
                if rid == run_id:
                    entry["name"] = f"{plan.name} / {entry['name']}"
        if not self.quiet and not self.live_mode:
            self.console.print(f"run {run_id}: {plan.name} ({plural(count, 'job')})", markup=False)
        self._changed()

    def label(self, lease: Lease) -> str:
        return self._label(lease.run_id, lease.name)

    def _label(self, run_id: int, name: str) -> str:
        if len(self.workflows) > 1:
            return f"{self.workflows.get(run_id, run_id)} / {name}"
        return name

    def _changed(self) -> None:
        # A state change shows at once, not at the next periodic refresh: a job
        # shorter than the refresh period would otherwise never appear running.
        # refresh=True matters: lines printed above the panel redraw the last
        # *refreshed* renderable, not the last one passed to update().
        if self.live is not None:
            self.live.update(self.render(), refresh=True)

    def start(self, lease: Lease) -> None:
        key = (lease.run_id, lease.job_id)
        entry = self.jobs.setdefault(key, {"name": lease.name})
        if key not in self.order:
            self.order.append(key)
        now = time.monotonic()
        entry.update(
            name=self.label(lease), state="running", start=now, heard=now, step=None, lease=lease
        )
        self._changed()

    def line(self, lease: Lease, text: str) -> None:
        entry = self.jobs.get((lease.run_id, lease.job_id))
        if entry is not None:
            entry["heard"] = time.monotonic()
            entry["noticed"] = False
            if text.startswith("▶ "):
                entry["step"] = text[2:]
        self._print(f"[{self.label(lease)}] {text}")

    def _print(self, out: str) -> None:
        if self.quiet:
            return
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

    def tick(self) -> None:
        """A still-running line for each job whose step has been silent for
        `PRELOOP_SILENT_STEP_NOTICE` seconds (once per silence)."""
        now = time.monotonic()
        for entry in self.jobs.values():
            if entry.get("state") != "running" or entry.get("noticed"):
                continue
            heard = entry.get("heard") or now
            if now - heard >= self.silent_after:
                entry["noticed"] = True
                step = entry.get("step") or "the job"
                elapsed = _duration(now - (entry.get("start") or now))
                self._print(
                    f"[{entry['name']}] … still running: {step} "
                    f"(no output for {_duration(now - heard)}; job running {elapsed})"
                )

    def end(self, lease: Lease, result: JobResult) -> None:
        key = (lease.run_id, lease.job_id)
        entry = self.jobs.setdefault(key, {"name": lease.name, "start": None})
        start = entry.get("start")
        entry.update(state=result.conclusion, elapsed=time.monotonic() - start if start else None)
        self._changed()
        if not self.quiet and not self.live_mode:
            self.console.print(
                f"[{self.label(lease)}] {_ICON.get(result.conclusion, '?')} {result.conclusion}",
                markup=False,
                highlight=False,
            )

    def observe(self, run_id: int, jobs: list[JobInfo]) -> None:
        """Job states read from the store (the live view's poll)."""
        now = time.monotonic()
        for job in jobs:
            key = (run_id, job.id)
            if job.status == "expanded" or job.kind == "caller":
                # A deferred matrix became its legs; a caller folds its jobs.
                self.jobs.pop(key, None)
                if key in self.order:
                    self.order.remove(key)
                continue
            entry = self.jobs.get(key)
            if entry is None:
                entry = {"name": self._label(run_id, job.name), "state": "queued", "start": None}
                self.jobs[key] = entry
                self.order.append(key)
            if entry["state"] not in ("queued", "running"):
                continue
            if job.status == "running" and entry["state"] == "queued":
                entry.update(name=self._label(run_id, job.name), state="running", start=now)
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

    def rerun(self, run_id: int, old_id: int, name: str, jobs: list[JobInfo]) -> None:
        self.workflows[run_id] = name
        again = [j for j in jobs if j.kind != "caller" and j.status != "completed"]
        kept = [j for j in jobs if j.kind != "caller" and j.status == "completed"]
        self.observe(run_id, jobs)
        if not self.quiet and not self.live_mode:
            self.console.print(
                f"run {run_id}: {name} (re-run of run {old_id}: "
                f"{plural(len(again), 'job')} again, {len(kept)} kept)",
                markup=False,
            )
        self._changed()

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
            on_rerun=self.rerun,
            on_job_start=self.start,
            on_job_line=self.line,
            on_job_end=self.end,
            on_selected=self.selected,
        )


async def _run(engine: Engine, progress: _Progress) -> RunsOutcome | None:
    outcome: RunsOutcome | None = None
    error: Exception | None = None
    with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with anyio.create_task_group() as tg:

            async def on_signal() -> None:
                async for signum in signals:
                    if engine.run_id is None:
                        tg.cancel_scope.cancel()  # still capturing: nothing to cancel in the store
                    # a timeout or a supervisor's SIGTERM is no Ctrl-C: say which
                    engine.cancel("SIGTERM" if signum == signal.SIGTERM else "Ctrl-C")

            async def refresh() -> None:
                assert progress.live is not None
                polled = 0.0
                while True:
                    if time.monotonic() - polled > 1.0 and engine.run_ids:
                        # Jobs other machines' runners run (and skips) show too.
                        polled = time.monotonic()
                        store = engine.store
                        if store is not None:
                            for run_id in list(engine.run_ids):
                                # A display poll only: the engine may be closing
                                # the store as the runs end (sqlite3 or the pg
                                # pool then raise); the next state comes anyway.
                                with contextlib.suppress(Exception):
                                    jobs = await anyio.to_thread.run_sync(store.list_jobs, run_id)
                                    progress.observe(run_id, jobs)
                    progress.live.update(progress.render())
                    await anyio.sleep(0.25)

            async def ticker() -> None:
                while True:
                    await anyio.sleep(min(1.0, progress.silent_after / 4))
                    progress.tick()

            tg.start_soon(on_signal)
            tg.start_soon(ticker)
            if progress.live is not None:
                tg.start_soon(refresh)
            try:
                outcome = await engine.run_all()
            except Exception as exc:  # re-raised bare below, not as an ExceptionGroup
                error = exc
            tg.cancel_scope.cancel()
    if error is not None:
        raise error
    return outcome


_PLATFORM_HELP = "Run jobs with this runs-on label (windows-*, macos-*) on this host anyway."


@cli.command("run")
@click.option(
    "-f",
    "--file",
    "workflow",
    type=click.Path(path_type=Path, dir_okay=False),
    help="Workflow file (default: every .github/workflows file the event triggers).",
)
@click.option("--event", default="push", show_default=True, help="Event that triggers the run.")
@click.option(
    "--job",
    "jobs",
    multiple=True,
    help="Run only this job (and the jobs it needs); repeatable.",
)
@local_run_options
@secret_options
@var_options
@sandbox_options
@action_option
@click.option("--json", "as_json", is_flag=True, help="Print one JSON document at the end.")
@click.option(
    "--input", "inputs", multiple=True, metavar="NAME=VALUE", help="A workflow_dispatch input."
)
@click.option(
    "--eventpath",
    "event_path",
    type=click.Path(path_type=Path, dir_okay=False),
    help="A JSON event payload (github.event); default: one built from the repository.",
)
@click.option(
    "--matrix",
    multiple=True,
    metavar="KEY=VALUE",
    help="Run only the matrix legs with this value; repeatable (a key given twice: either value).",
)
@click.option(
    "--platform",
    "platforms",
    multiple=True,
    metavar="LABEL=host",
    help=_PLATFORM_HELP,
)
@click.option("--ref", help="The ref the event is about (default: the current branch).")
@click.option(
    "--base",
    help="Count changed paths from the merge base with this revision "
    "(default: the upstream, else origin/HEAD).",
)
def run_command(
    workflow: Path | None,
    event: str,
    jobs: tuple[str, ...],
    parallel: int | None,
    store: str | None,
    state_dir: Path | None,
    secret: tuple[str, ...],
    secret_files: tuple[Path, ...],
    variables: tuple[str, ...],
    var_files: tuple[Path, ...],
    sandbox: bool,
    sandbox_network: str,
    actions: tuple[str, ...],
    as_json: bool,
    inputs: tuple[str, ...],
    event_path: Path | None,
    matrix: tuple[str, ...],
    platforms: tuple[str, ...],
    ref: str | None,
    base: str | None,
) -> None:
    """Run the workflows the event triggers on a snapshot of the work tree.

    Like GitHub, every workflow the event triggers (after its branch, tag and
    path filters) is one run; all run in this one invocation. An invalid
    workflow is reported (every problem, on stderr) and not run, and the others
    still run, as on GitHub; with -f, or when nothing valid is triggered, it is
    an error and nothing runs. The snapshot holds staged, unstaged and
    untracked (not ignored) files; the repository itself is not changed. Exit
    status: 0 every run succeeded, 1 a run failed or a workflow is invalid, 130
    interrupted (Ctrl-C cancels the runs and kills every step's process group).
    """
    platform_map = _platform_map(platforms)
    request = RunRequest(
        workspace=Path.cwd(),
        workflow=workflow,
        event=event,
        jobs=jobs,
        local_runners=parallel,
        store_url=store,
        state_dir=state_dir or config.state_dir(),
        secrets=parse_secrets(secret, secret_files),
        sandbox=sandbox,
        sandbox_network=sandbox_network,
        action_overrides=parse_overrides(actions, "--action"),
        inputs=parse_pairs("--input", inputs),
        vars=parse_vars(variables, var_files),
        event_path=event_path,
        matrix=matrix_filter(split_pairs("--matrix", matrix)),
        platforms=platform_map,
        ref=ref,
        base=base,
    )
    # Bad action settings fail here, once, rather than in every job.
    Overrides.from_env(os.environ)
    sys.exit(execute(request, as_json=as_json))


def _platform_map(platforms: tuple[str, ...]) -> dict[str, str]:
    platform_map = parse_pairs("--platform", platforms)
    for label, where in platform_map.items():
        if where.lower() != "host":
            raise UsageError(f"--platform {label}={where}: only LABEL=host is supported")
    return platform_map


@cli.command("rerun")
@click.argument("run_id", type=int)
@click.option(
    "--all",
    "all_jobs",
    is_flag=True,
    help="Run every job again (default: the failed and cancelled jobs and their dependents).",
)
@local_run_options
@secret_options
@sandbox_options
@action_option
@click.option("--platform", "platforms", multiple=True, metavar="LABEL=host", help=_PLATFORM_HELP)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON document at the end.")
def rerun_command(
    run_id: int,
    all_jobs: bool,
    parallel: int | None,
    store: str | None,
    state_dir: Path | None,
    secret: tuple[str, ...],
    secret_files: tuple[Path, ...],
    sandbox: bool,
    sandbox_network: str,
    actions: tuple[str, ...],
    platforms: tuple[str, ...],
    as_json: bool,
) -> None:
    """Run the ended run RUN_ID again, as GitHub's "Re-run failed jobs" (or,
    with --all, "Re-run all jobs").

    The re-run is a new run with the same run number and the next
    `github.run_attempt`: it runs on RUN_ID's snapshot (not the work tree as
    it is now), with its workflow, event, inputs and vars as they were
    planned. Jobs that succeeded, with everything they need, are kept with
    their outputs; the failed, cancelled and skipped-for-failure ones and
    their dependents run again. Secrets are not stored: give them again
    (--secret). The snapshot comes back from this host's object cache; a run
    whose cache entry was pruned cannot be re-run. Exit status as `preloop run`.
    """
    request = RunRequest(
        workspace=Path.cwd(),
        local_runners=parallel,
        store_url=store,
        state_dir=state_dir or config.state_dir(),
        secrets=parse_secrets(secret, secret_files),
        sandbox=sandbox,
        sandbox_network=sandbox_network,
        action_overrides=parse_overrides(actions, "--action"),
        platforms=_platform_map(platforms),
        rerun=run_id,
        rerun_all_jobs=all_jobs,
    )
    Overrides.from_env(os.environ)
    sys.exit(execute(request, as_json=as_json))


def execute(request: RunRequest, *, as_json: bool = False) -> int:
    """Runs `request` with live output and the summary; returns the exit status
    (0 every run succeeded, 1 a run failed, 130 interrupted). `NothingTriggered`
    and other user errors propagate."""
    console = make_console(highlight=False)
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
        return 130
    if as_json:
        document = outcome.to_dict()
        if len(outcome.runs) == 1:  # one run: its fields at the top, as before
            document = {**outcome.runs[0].to_dict(), **document}
        emit_json({**document, "duration": round(elapsed, 3)})
    else:
        print_runs_summary(console, outcome, elapsed)
    if outcome.interrupted:
        return 130
    return 0 if outcome.ok else 1
