"""capture -> plan -> submit -> local runners -> result: what `preloop run` does.

`Engine(request, events).run()`:

1. loads and validates the workflow (`preloop.workflow`; a bad workflow
   raises `WorkflowError` with `file:line:col` and nothing is captured or
   submitted) and plans it for the event (`--job` keeps that job and the
   jobs it needs);
2. sweeps leftovers of dead captures and job directories, then captures
   the workspace (`preloop.snapshot.capture_workspace`: staged, unstaged and untracked
   files; the source repository is not changed); the object-cache prune runs
   after the capture through the post-capture hook of `preloop.snapshot.prune`;
3. recovers runs in the store whose `preloop run` died on this host
   (`recover_abandoned_runs`), then submits the plan to the store with the
   snapshot's location in the run's `github` context (`preloop.runner.checkout`);
4. runs `local_runners` runners in this process until the run ends (other
   machines' `preloop runner` processes may take jobs of it too), reaping
   expired leases meanwhile;
5. removes the run repository and returns a `RunOutcome`.

`Engine.cancel()` (Ctrl-C) cancels the run in the store, cancels the local
runners (each step's process group is killed and reaped), settles whatever
did not end as cancelled, and returns.
"""

from __future__ import annotations

import functools
import os
import socket
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio

import preloop.snapshot.prune  # noqa: F401  (registers the post-capture prune hook)
from preloop import config
from preloop.actions.reference import Override
from preloop.actions.workflows import loading_for_run
from preloop.control import JobInfo, Lease, Store, open_store
from preloop.errors import PreloopError, UsageError
from preloop.process import CommandFailed, run_command
from preloop.runner import DEFAULT_LABELS, JobEvents, JobResult, Runner, RunnerOptions
from preloop.runner.checkout import (
    SNAPSHOT_CONTEXT_KEY,
    CheckoutTemplates,
    SnapshotLocation,
    sweep_work_dir,
    work_dir,
)
from preloop.runner.job import kill_tracked, tracking_prefix
from preloop.services import (
    ServiceAccess,
    default_branch_ref,
    remove_expired_artifacts,
    run_services,
)
from preloop.snapshot import capture_workspace, sweep_workspace_snapshots
from preloop.snapshot.holders import hold_run_repository, release_run_repository
from preloop.snapshot.owner import ProcessIdentity
from preloop.workflow import Plan, load_workflow, plan, workflow_files

__all__ = [
    "Engine",
    "EngineEvents",
    "JobRecord",
    "RunOutcome",
    "RunRequest",
    "default_store_url",
    "recover_abandoned_runs",
    "resolve_workflow",
]

# github context: host, pid and host-unique run key of the submitting engine
ENGINE_CONTEXT_KEY = "preloop_engine"
_POLL = 0.25  # seconds between store polls while local runners are idle
_REAP_EVERY = 5.0


@dataclass(frozen=True, slots=True)
class RunRequest:
    workspace: Path
    workflow: Path | None = None  # None: the one workflow the event triggers
    event: str = "push"
    job: str | None = None
    local_runners: int | None = None  # None: CPU count; 0: only other machines' runners
    store_url: str | None = None
    state_dir: Path | None = None
    secrets: dict[str, str] = field(default_factory=dict)
    sandbox: bool = False
    sandbox_network: str = "host"  # --sandbox-network: "host" or "none"
    runner_name: str = "local"
    action_overrides: tuple[Override, ...] = ()  # `--action owner/repo=DIR|skip`


@dataclass(slots=True)
class EngineEvents:
    """Progress callbacks (all called from the engine's event loop thread)."""

    on_submitted: Callable[[int, Plan], None] | None = None
    on_job_start: Callable[[Lease], None] | None = None
    on_job_line: Callable[[Lease, str], None] | None = None
    on_job_end: Callable[[Lease, JobResult], None] | None = None
    on_recovered: Callable[[int], None] | None = None  # a dead run's id, cancelled


@dataclass(slots=True)
class JobRecord:
    id: str
    name: str
    kind: str
    status: str
    conclusion: str | None
    outputs: dict[str, Any]
    reason: str | None
    runner: str | None
    duration: float | None
    annotations: list[str]


@dataclass(slots=True)
class RunOutcome:
    run_id: int
    workflow: str
    conclusion: str
    jobs: list[JobRecord]
    interrupted: bool
    state_dir: Path

    @property
    def ok(self) -> bool:
        return self.conclusion == "success" and not self.interrupted

    def to_dict(self) -> dict[str, Any]:
        return {
            "run_id": self.run_id,
            "workflow": self.workflow,
            "conclusion": self.conclusion,
            "interrupted": self.interrupted,
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
                    "duration": j.duration,
                    "annotations": j.annotations,
                }
                for j in self.jobs
            ],
        }


async def _repo_root(workspace: Path) -> Path:
    try:
        res = await run_command(["git", "rev-parse", "--show-toplevel"], cwd=workspace)
    except CommandFailed:
        raise UsageError(
            f"{workspace} is not inside a git repository: run `preloop run` in a repository "
            "with .github/workflows"
        ) from None
    return Path(res.stdout_text().strip())


def default_store_url(state_dir: Path, given: str | None = None) -> str:
    """`given`, else `$PRELOOP_STORE_URL`, else the lite store in `state_dir`."""
    url = given or config.get("PRELOOP_STORE_URL") or None
    return str(url) if url else f"sqlite:///{Path(state_dir).absolute() / 'preloop.db'}"


def resolve_workflow(root: Path, given: Path | None, event: str) -> Path:
    """The workflow file to run: `given`, else the one workflow under
    `.github/workflows` that `event` triggers."""
    if given is not None:
        path = given if given.is_absolute() else Path.cwd() / given
        if not path.is_file():
            raise UsageError(f"{given}: no such workflow file")
        return path
    files = workflow_files(root)
    if not files:
        raise UsageError(f"{root}: no workflow files in .github/workflows; pass one with -f")
    if len(files) == 1:
        return files[0]
    triggered = [p for p in files if load_workflow(p, root=root).triggered_by(event)]
    if len(triggered) == 1:
        return triggered[0]
    names = ", ".join(str(p.relative_to(root)) for p in (triggered or files))
    raise UsageError(
        f"{root}: {len(triggered) or len(files)} workflows "
        f"{'are triggered by ' + repr(event) if triggered else 'exist'} ({names}); "
        "choose one with -f"
    )


def _select_job(p: Plan, job: str) -> Plan:
    """Keeps `job` (a job key, or `caller/inner`) and everything it needs."""
    by_base: dict[str, list[Any]] = {}
    for j in p.jobs:
        by_base.setdefault(j.base_id, []).append(j)
    if job not in by_base:
        known = ", ".join(sorted(b for b in by_base if "/" not in b))
        raise UsageError(f"{p.workflow}: no job {job!r} (jobs: {known})")
    keep: set[str] = set()
    todo = [job]
    while todo:
        base = todo.pop()
        if base in keep:
            continue
        keep.add(base)
        for j in by_base.get(base, []):
            todo.extend(j.needs)
            if j.caller:
                todo.append(j.caller)
            for inner in j.inner_job_ids:
                todo.append(p.job(inner).base_id)
    jobs = tuple(j for j in p.jobs if j.base_id in keep)
    cohorts = tuple(c for c in p.cohorts if c.id in keep)
    return Plan(
        workflow=p.workflow,
        name=p.name,
        event=p.event,
        jobs=jobs,
        cohorts=cohorts,
        concurrency=p.concurrency,
        env=p.env,
        inputs=p.inputs,
    )


def _plan_labels(p: Plan) -> list[str]:
    """Every label the plan's jobs ask for: local runners take all of them."""
    labels: set[str] = set(DEFAULT_LABELS)

    def walk(v: Any) -> None:
        if isinstance(v, str):
            if "${{" not in v:
                labels.add(v.lower())
        elif isinstance(v, dict):
            for x in v.values():
                walk(x)
        elif isinstance(v, (list, tuple)):
            for x in v:
                walk(x)

    for j in p.jobs:
        labels.update(lb.lower() for lb in j.runs_on)
        if j.kind == "deferred":
            deferred = j.spec.get("deferred", {}).get("job", {})
            walk(deferred.get("runs_on"))
            walk(deferred.get("strategy"))
    return sorted(labels)


async def _git(root: Path, *args: str) -> str:
    res = await run_command(["git", *args], cwd=root, check=False)
    return res.stdout_text().strip() if res.ok else ""


class Engine:
    def __init__(self, request: RunRequest, events: EngineEvents | None = None) -> None:
        self.request = request
        self.events = events or EngineEvents()
        self.state_dir = Path(request.state_dir or config.state_dir()).absolute()
        self.run_id: int | None = None
        self.store: Store | None = None
        self._interrupted = False
        self._runners_scope: anyio.CancelScope | None = None
        self._changed = anyio.Event()
        self._durations: dict[str, float] = {}
        self._starts: dict[str, float] = {}
        self._annotations: dict[str, list[str]] = {}

    @property
    def interrupted(self) -> bool:
        return self._interrupted

    def cancel(self) -> None:
        """Ctrl-C: stop everything this engine runs (see the module docstring)."""
        self._interrupted = True
        if self._runners_scope is not None:
            self._runners_scope.cancel()
        self._wake()

    def _wake(self) -> None:
        self._changed.set()
        self._changed = anyio.Event()

    def store_url(self) -> str:
        req = self.request
        url = default_store_url(self.state_dir, req.store_url)
        if req.local_runners == 0 and not url.startswith(("postgresql:", "postgres:")):
            raise UsageError(
                "-j 0 runs nothing locally: it needs a PostgreSQL store (--store "
                "postgresql://...) that `preloop runner` processes serve"
            )
        return url

    async def prepare(self) -> tuple[Path, Plan]:
        req = self.request
        config.validate()  # a bad PRELOOP_* value: exit 2 now, not a traceback later
        if req.local_runners is not None and req.local_runners < 0:
            raise UsageError(f"-j {req.local_runners}: the number of local runners must be >= 0")
        root = await _repo_root(req.workspace)
        path = loading_for_run(
            self.state_dir,
            req.action_overrides,
            lambda: resolve_workflow(root, req.workflow, req.event),
        )
        workflow = await anyio.to_thread.run_sync(
            lambda: loading_for_run(
                self.state_dir, req.action_overrides, lambda: load_workflow(path, root=root)
            )
        )
        branch = await _git(root, "rev-parse", "--abbrev-ref", "HEAD")
        github = {
            "repository": root.name,
            "ref": f"refs/heads/{branch}" if branch and branch != "HEAD" else "",
            "ref_name": branch if branch != "HEAD" else "",
            "actor": os.environ.get("USER", "preloop"),
        }
        planned = plan(workflow, req.event, github=github)
        if req.job is not None:
            planned = _select_job(planned, req.job)
        return root, planned

    async def run(self) -> RunOutcome:
        req = self.request
        root, planned = await self.prepare()
        store_url = self.store_url()
        self.state_dir.mkdir(parents=True, exist_ok=True)
        await anyio.to_thread.run_sync(sweep_workspace_snapshots, self.state_dir)
        await anyio.to_thread.run_sync(sweep_work_dir, self.state_dir)
        await anyio.to_thread.run_sync(remove_expired_artifacts, self.state_dir)
        run_key = f"run-{uuid.uuid4().hex[:16]}"
        # Held before the capture, released after the removal: a crash in
        # between leaves a dead holder that the next sweep or prune cleans.
        holder = hold_run_repository(self.state_dir, run_key)
        try:
            snap = await capture_workspace(self.state_dir, root, run_key)
        except BaseException:
            # A failed capture removed its repository, or left it (a timeout)
            # for the capture sweep: either way this holder has nothing to hold.
            holder.unlink(missing_ok=True)
            raise
        store = await anyio.to_thread.run_sync(open_store, store_url)
        self.store = store
        try:
            for old in await recover_abandoned_runs(store, self.state_dir):
                if self.events.on_recovered is not None:
                    self.events.on_recovered(old)
            location = SnapshotLocation(str(snap.repository), "snapshot", snap.commit)
            gh = {
                "repository": root.name,
                "sha": snap.commit,
                SNAPSHOT_CONTEXT_KEY: location.to_dict(),
                ENGINE_CONTEXT_KEY: {
                    "host": socket.gethostname(),
                    "pid": os.getpid(),
                    # with the pid, so a recycled pid never passes for this engine
                    "start_ticks": ProcessIdentity.current().start_ticks,
                    "run_key": run_key,
                },
            }
            branch = await _git(root, "rev-parse", "--abbrev-ref", "HEAD")
            if branch and branch != "HEAD":
                gh.update(ref=f"refs/heads/{branch}", ref_name=branch)
            gh.update(event_name=req.event, workflow=planned.name)
            gh.setdefault("actor", os.environ.get("USER", "preloop"))
            run_id = await anyio.to_thread.run_sync(lambda: store.submit_run(planned, github=gh))
            self.run_id = run_id
            if self.events.on_submitted is not None:
                self.events.on_submitted(run_id, planned)
            if not self._interrupted:
                default_ref = await anyio.to_thread.run_sync(default_branch_ref, root)
                ref = str(gh.get("ref") or "")
                with run_services(self.state_dir, str(root), ref, default_ref) as services:
                    await self._drive(store, run_id, _plan_labels(planned), services)
            if self._interrupted:
                await settle_cancelled(store, run_id, "cancelled by Ctrl-C")
            info = await anyio.to_thread.run_sync(store.get_run, run_id)
            jobs = await anyio.to_thread.run_sync(store.list_jobs, run_id)
            conclusion = info.conclusion or ("cancelled" if self._interrupted else "failure")
            return RunOutcome(
                run_id=run_id,
                workflow=planned.workflow,
                conclusion=conclusion,
                jobs=[self._record(j) for j in jobs],
                interrupted=self._interrupted,
                state_dir=self.state_dir,
            )
        finally:
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(store.close)
                await anyio.to_thread.run_sync(release_run_repository, self.state_dir, run_key)

    def _record(self, j: JobInfo) -> JobRecord:
        return JobRecord(
            id=j.id,
            name=j.name,
            kind=j.kind,
            status=j.status,
            conclusion=j.conclusion,
            outputs=j.outputs,
            reason=j.reason,
            runner=j.runner,
            duration=self._durations.get(j.id),
            annotations=self._annotations.get(j.id, []),
        )

    def _job_events(self) -> JobEvents:
        # A job of another run (a shared PostgreSQL store) is run, logged and
        # completed like ours, but not shown or summarised as part of our run.
        def start(lease: Lease) -> None:
            if lease.run_id != self.run_id:
                return
            self._starts[lease.job_id] = time.monotonic()
            if self.events.on_job_start is not None:
                self.events.on_job_start(lease)

        def line(lease: Lease, text: str) -> None:
            if lease.run_id == self.run_id and self.events.on_job_line is not None:
                self.events.on_job_line(lease, text)

        def end(lease: Lease, result: JobResult) -> None:
            if lease.run_id == self.run_id:
                began = self._starts.pop(lease.job_id, None)
                if began is not None:
                    self._durations[lease.job_id] = time.monotonic() - began
                self._annotations[lease.job_id] = [a.render() for a in result.annotations]
                if self.events.on_job_end is not None:
                    self.events.on_job_end(lease, result)
            self._wake()

        return JobEvents(on_start=start, on_line=line, on_end=end)

    async def _run_finished(self, store: Store, run_id: int) -> bool:
        info = await anyio.to_thread.run_sync(store.get_run, run_id)
        return info.status == "completed"

    async def _drive(
        self,
        store: Store,
        run_id: int,
        labels: list[str],
        services: ServiceAccess | None = None,
    ) -> None:
        req = self.request
        count = req.local_runners if req.local_runners is not None else (os.cpu_count() or 1)
        done = anyio.Event()
        events = self._job_events()
        templates = CheckoutTemplates(work_dir(self.state_dir))

        async def local_runner(index: int) -> None:
            runner = Runner(
                store,
                RunnerOptions(
                    name=f"{req.runner_name}-{os.getpid()}-{index}",
                    labels=labels,
                    state_dir=self.state_dir,
                    secrets=dict(req.secrets),
                    sandbox=req.sandbox,
                    sandbox_network=req.sandbox_network,
                    run_id=run_id,
                    services=services,
                    action_overrides=req.action_overrides,
                ),
                events,
                templates,
            )
            while not done.is_set():
                lease = await runner.claim()
                if lease is None:
                    changed = self._changed
                    with anyio.move_on_after(_POLL):
                        await changed.wait()
                    continue
                await runner.run_lease(lease)

        async def watch() -> None:
            last_reap = time.monotonic()
            while not await self._run_finished(store, run_id):
                if time.monotonic() - last_reap > _REAP_EVERY:
                    await anyio.to_thread.run_sync(store.expire_leases)
                    last_reap = time.monotonic()
                changed = self._changed
                with anyio.move_on_after(_POLL):
                    await changed.wait()
            done.set()
            self._wake()

        try:
            with anyio.CancelScope() as scope:
                self._runners_scope = scope
                if self._interrupted:
                    scope.cancel()
                async with anyio.create_task_group() as tg:
                    for i in range(count):
                        tg.start_soon(local_runner, i)
                    await watch()
        finally:
            self._runners_scope = None
            templates.close()


async def settle_cancelled(store: Store, run_id: int, reason: str) -> None:
    """Cancels run `run_id` and ends every job of it that did not end (no
    runner of ours is left to run them)."""
    with anyio.CancelScope(shield=True):
        await anyio.to_thread.run_sync(store.cancel_run, run_id)
        for _ in range(100):
            info = await anyio.to_thread.run_sync(store.get_run, run_id)
            if info.status == "completed":
                return
            jobs = await anyio.to_thread.run_sync(store.list_jobs, run_id)
            open_jobs = [
                j
                for j in jobs
                if j.status not in ("completed", "expanded", "folding") and j.kind != "caller"
            ]
            if not open_jobs:
                return
            for j in open_jobs:
                settle = functools.partial(
                    store.settle_job, run_id, j.id, "cancelled", reason=reason
                )
                try:
                    await anyio.to_thread.run_sync(settle)
                except PreloopError:
                    continue


async def recover_abandoned_runs(store: Store, state_dir: Path) -> list[int]:
    """Runs whose `preloop run` died (its pid on this host is gone) without
    ending them: their leftover step processes are killed, the runs cancelled
    with every open job, and their run repositories in `state_dir` removed.
    Called when `preloop run` starts, so a crash never leaves a run that the
    next run's runners would pick up."""
    host = socket.gethostname()
    recovered: list[int] = []
    # Every unfinished run, however old: reading one context row each, not its jobs.
    runs = await anyio.to_thread.run_sync(functools.partial(store.list_runs, None, unfinished=True))
    for run in runs:
        ctx = await anyio.to_thread.run_sync(store.run_context, run.id)
        owner = (ctx.get("github") or {}).get(ENGINE_CONTEXT_KEY)
        if not isinstance(owner, dict) or owner.get("host") != host:
            continue
        engine = ProcessIdentity(int(owner.get("pid", 0)), int(owner.get("start_ticks", 0)))
        if engine.is_alive():
            continue
        run_key = owner.get("run_key")
        if run_key:
            # By the run's host-unique key: run ids repeat across stores, and
            # another store's live run 1 must not lose its steps here.
            kill = functools.partial(kill_tracked, tracking_prefix(str(run_key)), prefix=True)
            await anyio.to_thread.run_sync(kill)
        await settle_cancelled(store, run.id, "its `preloop run` process died")
        snapshot = (ctx.get("github") or {}).get(SNAPSHOT_CONTEXT_KEY) or {}
        repo = Path(str(snapshot.get("repository", "")))
        if repo.is_absolute() and repo.parent == Path(state_dir).absolute() / "snapshots":
            await anyio.to_thread.run_sync(release_run_repository, state_dir, repo.name)
        recovered.append(run.id)
    return recovered
