"""capture -> plan -> submit -> local runners -> result: what `preloop run` does.

`Engine(request, events).run_all()` (`run()` returns the first run's outcome):

1. checks the event name, reads the event's ref and changed paths from git
   (`preloop.workflow.changes`), loads and validates every workflow (`-f`:
   that one, and a bad one raises `WorkflowError` with `file:line:col`, nothing
   captured or submitted; without `-f` the valid workflows go on and the
   invalid ones are reported as `InvalidWorkflow`, a failure of the whole, as
   GitHub fails an invalid workflow beside the push's others; with nothing
   valid to run the errors are raised), keeps those the event triggers after
   their filters (`preloop.workflow.triggers`; the others are reported as
   `SkippedWorkflow`, none at all is `NothingTriggered`), checks `--input`s,
   builds the payload, and plans each one, narrowed by `--job` / `--matrix`
   (`preloop.workflow.selection`);
2. opens the store and recovers its runs whose `preloop run` died on this
   host (`recover_abandoned_runs`); sweeps leftovers of dead captures, job
   directories and run repositories whose holder died, except those the
   store's other unfinished runs reference (`run_repositories_in_use`: a
   same-host runner may still run them); then captures the workspace
   (`preloop.snapshot.capture_workspace`: staged, unstaged and untracked files;
   the source repository is not changed); the object-cache prune runs after
   the capture through the post-capture hook of `preloop.snapshot.prune`;
3. submits one run per plan (as GitHub starts one run per workflow) with the
   snapshot's location in each run's `github` context (`preloop.runner.checkout`);
4. runs `local_runners` runners in this process until every run ends (other
   machines' `preloop runner` processes may take jobs too), reaping expired
   leases meanwhile; a job whose `runs-on` is another OS (`windows-*`,
   `macos-*`) ends `skipped` with the reason unless `--platform L=host`;
5. removes the run repository and returns a `RunsOutcome` (one `RunOutcome`
   per run).

`Engine.cancel()` (Ctrl-C) cancels the run in the store, cancels the local
runners (each step's process group is killed and reaped), settles whatever
did not end as cancelled, and returns.
"""

from __future__ import annotations

import contextlib
import functools
import os
import socket
import time
import uuid
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import anyio

import preloop.snapshot.prune  # noqa: F401  (registers the post-capture prune hook)
from preloop import config
from preloop.actions.reference import Override, is_checkout
from preloop.actions.workflows import PlanRun
from preloop.control import JobInfo, Lease, Store, StoreError, open_store
from preloop.control.cascade import RUN_CANCELLED
from preloop.control.urls import check_store_url
from preloop.control.wakeups import RUNS
from preloop.errors import PreloopError, UsageError
from preloop.process import CommandFailed, run_command
from preloop.runner import JobEvents, JobResult, Runner, RunnerOptions
from preloop.runner.checkout import (
    SNAPSHOT_CONTEXT_KEY,
    CheckoutTemplates,
    SnapshotLocation,
    snapshot_branches,
    snapshot_tags,
    sweep_work_dir,
    work_dir,
)
from preloop.runner.follow import follow_elsewhere
from preloop.runner.job import kill_tracked, tracking_prefix
from preloop.runner.worker import idle_wait, wait_for_work
from preloop.services import (
    SERVICES_CONTEXT_KEY,
    ServiceAccess,
    preload_server,
    remove_expired_artifacts,
    run_services,
    scope_access,
    services_scope,
)
from preloop.services.storage import artifact_run_name
from preloop.snapshot import capture_workspace, sweep_workspace_snapshots
from preloop.snapshot.bundles import SnapshotBundles
from preloop.snapshot.holders import (
    hold_run_repository,
    keep_run_repositories,
    release_run_repository,
)
from preloop.snapshot.owner import ProcessIdentity
from preloop.snapshot.restore import restore_snapshot
from preloop.snapshot.transport import Published, publish_snapshot, snapshot_transport
from preloop.workflow import Plan, PlanError, WorkflowError, load_workflow, plan, workflow_files
from preloop.workflow.changes import LocalEvent, event_facts
from preloop.workflow.event_inputs import (
    check_inputs,
    default_action,
    load_payload,
    local_event_payload,
)
from preloop.workflow.expressions import coerce_string
from preloop.workflow.github_context import (
    default_branch_ref,
    event_github_context,
    workflow_github_context,
)
from preloop.workflow.loader import EVENTS
from preloop.workflow.selection import (
    foreign_platform,
    known_jobs,
    leg_not_selected,
    runs_on_labels,
    select_jobs,
    select_legs,
)
from preloop.workflow.triggers import check_event_name, evaluate_trigger

__all__ = [
    "Engine",
    "EngineEvents",
    "InvalidWorkflow",
    "JobRecord",
    "NothingTriggered",
    "RunOutcome",
    "RunRequest",
    "RunsOutcome",
    "Selection",
    "SkippedWorkflow",
    "default_store_url",
    "recover_abandoned_runs",
    "run_repositories_in_use",
]

# github context: host, pid and host-unique run key of the submitting engine
ENGINE_CONTEXT_KEY = "preloop_engine"
_POLL = 0.25  # seconds between store polls while local runners are idle
_LISTEN_POLL = 5.0  # the same while PostgreSQL wake-ups are live (a fallback)
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
    jobs: tuple[str, ...] = ()  # with `job`: run only these (and what they need)
    # run only the legs with one of these values for each key (`matrix_filter`)
    matrix: dict[str, tuple[str, ...]] = field(default_factory=dict)
    inputs: dict[str, str] = field(default_factory=dict)  # --input NAME=VALUE
    vars: dict[str, str] = field(default_factory=dict)  # --var NAME=VALUE: the `vars` context
    event_path: Path | None = None  # a JSON payload for github.event
    ref: str | None = None  # the ref the event is about (default: the current branch)
    base: str | None = None  # changes are counted from the merge base with this
    # A push's old remote commit (github.event.before; zeros: a new ref), when
    # known (the pre-push hook); default: the merge base the changes count from.
    before: str | None = None
    platforms: dict[str, str] = field(default_factory=dict)  # runs-on label -> "host"
    # `preloop rerun`: the ended run to run again (on its own snapshot and
    # plan; the workspace and the selection fields above are not read), and
    # whether every job runs again rather than the failed ones and dependents.
    rerun: int | None = None
    rerun_all_jobs: bool = False


_NO_SELECTED_JOB = "has none of the --job jobs"


class NothingTriggered(PlanError):
    """The event triggers no workflow (each one's reason is in the message)."""


@dataclass(frozen=True, slots=True)
class SkippedWorkflow:
    path: str  # relative to the repository
    reason: str


@dataclass(frozen=True, slots=True)
class InvalidWorkflow:
    """A workflow file that failed validation while others were run (GitHub
    too starts the valid workflows of a push and fails the invalid one)."""

    path: str  # relative to the repository
    problems: tuple[str, ...]  # `path:line:col: message`, as `WorkflowError` lists them

    def to_dict(self) -> dict[str, Any]:
        return {"path": self.path, "problems": list(self.problems)}


@dataclass(slots=True)
class Selection:
    """What `preloop run` will run: one plan per triggered workflow."""

    root: Path
    plans: list[Plan]
    reasons: list[str]  # why each plan's workflow is triggered
    skipped: list[SkippedWorkflow]
    event: LocalEvent
    github: dict[str, Any]
    payload: dict[str, Any]
    default_ref: str  # the repository's default branch (`refs/heads/...`)
    invalid: list[InvalidWorkflow] = field(default_factory=list)  # not run


@dataclass(slots=True)
class EngineEvents:
    """Progress callbacks (all called from the engine's event loop thread)."""

    on_submitted: Callable[[int, Plan], None] | None = None
    on_job_start: Callable[[Lease], None] | None = None
    on_job_line: Callable[[Lease, str], None] | None = None
    on_job_end: Callable[[Lease, JobResult], None] | None = None
    on_recovered: Callable[[int], None] | None = None  # a dead run's id, cancelled
    on_selected: Callable[[Selection], None] | None = None  # before the capture
    # A re-run submitted: (its id, the run it re-runs, the workflow's name, its jobs)
    on_rerun: Callable[[int, int, str, list[JobInfo]], None] | None = None


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
    name: str = ""  # the workflow's display name
    interrupted_by: str = "Ctrl-C"  # what interrupted it: Ctrl-C, or SIGTERM

    @property
    def ok(self) -> bool:
        return self.conclusion == "success" and not self.interrupted

    @property
    def cancel_reason(self) -> str | None:
        """Why a cancelled run was cancelled: Ctrl-C, `preloop cancel`, a
        concurrency group, fail-fast (None unless it concluded cancelled)."""
        if self.conclusion != "cancelled":
            return None
        if self.interrupted:
            return f"cancelled by {self.interrupted_by}"
        # The cascade stores the cause with every job it cancels; a runner
        # that stopped a job on its own says only "cancelled", a job gated
        # after the cancellation only that the run was.
        generic = ("cancelled", RUN_CANCELLED)
        reasons = [
            j.reason
            for j in self.jobs
            if j.conclusion == "cancelled" and j.reason and j.reason not in generic
        ]
        for key in ("concurrency group", "fail-fast"):
            for r in reasons:
                if key in r:
                    return r
        return reasons[0] if reasons else "cancelled (no reason was recorded)"

    def to_dict(self) -> dict[str, Any]:
        return {
            "run_id": self.run_id,
            "workflow": self.workflow,
            "name": self.name,
            "cancel_reason": self.cancel_reason,
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


@dataclass(slots=True)
class RunsOutcome:
    """Every run one `preloop run` started (one per triggered workflow)."""

    runs: list[RunOutcome]
    skipped: list[SkippedWorkflow]
    interrupted: bool
    invalid: list[InvalidWorkflow] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return (
            bool(self.runs)
            and all(r.ok for r in self.runs)
            and not self.invalid
            and not self.interrupted
        )

    @property
    def conclusion(self) -> str:
        order = ("failure", "cancelled", "success")
        # An invalid workflow is a failed run on GitHub.
        found = {r.conclusion for r in self.runs} | ({"failure"} if self.invalid else set())
        return next((c for c in order if c in found), "success")

    def to_dict(self) -> dict[str, Any]:
        return {
            "conclusion": self.conclusion,
            "interrupted": self.interrupted,
            "runs": [r.to_dict() for r in self.runs],
            "skipped_workflows": [{"path": s.path, "reason": s.reason} for s in self.skipped],
            "invalid_workflows": [w.to_dict() for w in self.invalid],
        }


def _every_problem(errors: list[tuple[Path, WorkflowError]]) -> WorkflowError:
    """One error listing every invalid workflow's problems, the first file's first."""
    return WorkflowError([d for _, exc in errors for d in exc.diagnostics])


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
    """`given`, else `$PRELOOP_STORE_URL`, else the lite store in `state_dir`.
    A URL the user gave is checked first (a typo is an error, never a file)."""
    if given:
        return check_store_url(given, "--store", state_dir)
    env = config.get("PRELOOP_STORE_URL") or None
    if env:
        return check_store_url(str(env), "PRELOOP_STORE_URL", state_dir)
    return f"sqlite:///{Path(state_dir).absolute() / 'preloop.db'}"


def open_user_store(url: str, given: str | None) -> Store:
    """`open_store(url)`, its error naming where the URL came from."""
    try:
        return open_store(url)
    except StoreError as exc:
        from_env = bool(config.get("PRELOOP_STORE_URL"))
        origin = "--store" if given else "PRELOOP_STORE_URL" if from_env else None
        raise StoreError(f"{exc} (from {origin})" if origin else str(exc)) from None


def _may_call_services(plans: list[Plan]) -> bool:
    """Whether a job may run an action, which may call the artifact or cache
    service: a step with `uses:` other than `actions/checkout` (which preloop
    does itself), or a job whose steps are not known yet (a deferred matrix).
    A `run:` step that calls them itself still gets them, only without the
    server imported ahead."""
    for p in plans:
        for job in p.jobs:
            if job.kind == "caller":
                continue  # its inner jobs are in the plan
            steps = job.spec.get("steps")
            if not isinstance(steps, list):
                return True
            for step in steps:
                uses = step.get("uses") if isinstance(step, Mapping) else None
                if uses and not is_checkout(str(uses)):
                    return True
    return False


class Engine:
    def __init__(self, request: RunRequest, events: EngineEvents | None = None) -> None:
        self.request = request
        self.events = events or EngineEvents()
        self.state_dir = Path(request.state_dir or config.state_dir()).absolute()
        self.run_ids: list[int] = []
        self.store: Store | None = None
        # The snapshot's bundles in the store (the `store` transport), once published.
        self.published: Published | None = None
        self._interrupted = False
        self._interrupted_by = "Ctrl-C"
        self._runners_scope: anyio.CancelScope | None = None
        self._changed = anyio.Event()
        self._durations: dict[tuple[int, str], float] = {}
        self._starts: dict[tuple[int, str], float] = {}
        self._annotations: dict[tuple[int, str], list[str]] = {}
        self._reasons: dict[tuple[int, str], str] = {}
        # The jobs planned at submit; a job not among them is a leg of a
        # matrix computed at run time.
        self._planned: set[tuple[int, str]] = set()
        # Host-unique: names the run's snapshot, processes and action
        # resolutions (plan time and job time resolve a ref once, alike).
        self.run_key = f"run-{uuid.uuid4().hex[:16]}"

    @property
    def run_id(self) -> int | None:
        """The first run submitted (None while capturing)."""
        return self.run_ids[0] if self.run_ids else None

    @property
    def interrupted(self) -> bool:
        return self._interrupted

    def cancel(self, by: str = "Ctrl-C") -> None:
        """Ctrl-C (or SIGTERM, `by`): stop everything this engine runs (see
        the module docstring)."""
        if not self._interrupted:
            self._interrupted_by = by
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

    async def prepare(self) -> Selection:
        """Validates the request and chooses what to run (nothing is captured)."""
        req = self.request
        self._validate()
        check_event_name(req.event, EVENTS)
        root = await _repo_root(req.workspace)
        payload = load_payload(req.event_path) if req.event_path is not None else None
        return await anyio.to_thread.run_sync(self._select, root, payload)

    def _select(self, root: Path, payload: dict[str, Any] | None) -> Selection:
        req = self.request
        event = req.event
        if req.workflow is not None:
            given = req.workflow if req.workflow.is_absolute() else Path.cwd() / req.workflow
            if not given.is_file():
                raise UsageError(f"{req.workflow}: no such workflow file")
            paths = [given]
        else:
            paths = workflow_files(root)
            if not paths:
                raise UsageError(
                    f"{root}: no workflow files in .github/workflows; pass one with -f"
                )
        errors: list[tuple[Path, WorkflowError]] = []
        chosen: list[tuple[Any, str]] = []
        skipped: list[SkippedWorkflow] = []
        loaded: list[tuple[Path, Any]] = []
        remote = PlanRun(self.state_dir, req.action_overrides, run_key=self.run_key)
        names = [*req.jobs, *([req.job] if req.job else [])]
        # With --job, a remote reusable workflow that no job asked for needs
        # is not fetched: the job runs offline whatever else the file calls.
        load = functools.partial(load_workflow, root=root, jobs=names or None)
        try:
            for path in paths:
                try:
                    loaded.append((path, remote.load(functools.partial(load, path))))
                except WorkflowError as exc:
                    errors.append((path, exc))
        finally:
            remote.close()  # the workflows are read: their files may be pruned
        # The file asked for, or nothing valid: the errors are the answer. Else
        # the valid workflows run and the invalid ones are reported, as GitHub
        # starts a push's other workflows and fails the invalid one.
        if errors and (req.workflow is not None or not loaded):
            raise _every_problem(errors)
        invalid = [
            InvalidWorkflow(_relative(path, root), tuple(str(d) for d in exc.diagnostics))
            for path, exc in errors
        ]
        action = payload.get("action") if payload is not None else default_action(event)
        local = event_facts(
            root,
            event,
            ref=req.ref,
            base=req.base,
            action=action if isinstance(action, str) else None,
            paths=any(_filters_paths(wf, event) for _, wf in loaded),
        )
        for path, wf in loaded:
            rel = _relative(path, root)
            if event == "workflow_call":
                skipped.append(SkippedWorkflow(rel, "workflow_call runs only from a caller"))
                continue
            trig = evaluate_trigger(wf, local.facts)
            if trig.triggered:
                chosen.append((wf, trig.reason))
            else:
                skipped.append(SkippedWorkflow(rel, trig.reason))
        ref = local.facts.ref or "no ref"
        if not chosen:
            if errors:  # nothing valid would run: the invalid ones are the news
                raise _every_problem(errors)
            detail = "; ".join(f"{s.path}: {s.reason}" for s in skipped)
            raise NothingTriggered(f"'{event}' on {ref} triggers no workflow: {detail}")
        # Inputs first: the default payload's `inputs` are the checked ones
        # (defaults applied), as strings, as GitHub's `github.event.inputs`.
        declared: set[str] = set()
        checked: list[dict[str, Any]] = []
        several = len(chosen) > 1 or bool(invalid)
        # A job, input or matrix key asked for may be in an invalid workflow.
        unread = "".join(f"; invalid: {w.path}" for w in invalid)
        for wf, _reason in chosen:
            own = _declared_inputs(wf, event)
            declared |= own
            # One workflow checks every input; several (an invalid one among
            # them, whose inputs are unknown) each take the inputs they declare.
            mine = {k: v for k, v in req.inputs.items() if k in own or not several}
            checked.append(check_inputs(wf, event, mine))
        github = event_github_context(root, event, local)
        default_ref = default_branch_ref(root)
        if payload is None:
            event_inputs: dict[str, str] = {}
            for typed in checked:
                for name, value in typed.items():
                    event_inputs.setdefault(name, coerce_string(value))
            payload = local_event_payload(
                root, event, github, local, default_ref, inputs=event_inputs, before=req.before
            )
        github["event"] = payload
        plans: list[Plan] = []
        reasons: list[str] = []
        all_jobs: set[str] = set()
        for (wf, reason), inputs in zip(chosen, checked, strict=True):
            planned = plan(
                wf,
                event,
                inputs=inputs,
                github=workflow_github_context(github, root, wf.path),
                vars=req.vars,
            )
            all_jobs.update(known_jobs(planned))
            if names:
                narrowed = select_jobs(planned, names)
                if narrowed is None:
                    skipped.append(
                        SkippedWorkflow(_relative(Path(wf.path), root), _NO_SELECTED_JOB)
                    )
                    continue
                planned = narrowed
            plans.append(select_legs(planned, req.matrix))
            reasons.append(reason)
        undeclared = sorted(set(req.inputs) - declared) if several else []
        if undeclared:
            raise UsageError(f"--input {undeclared[0]}: no triggered workflow declares it{unread}")
        if names:
            missing = [n for n in names if n not in {j.base_id for p in plans for j in p.jobs}]
            if missing or not plans:
                # The job may well be in a workflow this event did not trigger: say why not.
                untriggered = (
                    "".join(
                        f"; not triggered: {s.path}: {s.reason}"
                        for s in skipped
                        if s.reason != _NO_SELECTED_JOB
                    )
                    + unread
                )
                raise UsageError(
                    f"no job {missing[0] if missing else names[0]!r} in the triggered "
                    f"workflows (jobs: {', '.join(sorted(all_jobs))}){untriggered}"
                )
        # A matrix computed at run time has keys nobody knows yet: its legs
        # are filtered when leased (`skip_reason`).
        if req.matrix and not any(j.kind == "deferred" for p in plans for j in p.jobs):
            keys = {k for p in plans for j in p.jobs for k in (j.matrix or {})}
            lost = sorted(set(req.matrix) - keys)
            if lost:
                raise UsageError(f"--matrix {lost[0]}: no matrix job to run has that key{unread}")
        return Selection(
            root, plans, reasons, skipped, local, github, payload, default_ref, invalid
        )

    async def run(self) -> RunOutcome:
        """Runs what the event triggers; returns the first run's outcome (see
        `run_all` for every run, and for the invalid workflows not run)."""
        return (await self.run_all()).runs[0]

    async def run_all(self) -> RunsOutcome:
        req = self.request
        if req.rerun is not None:
            return await self._rerun(req.rerun)
        selection = await self.prepare()
        if _may_call_services(selection.plans):
            preload_server()  # served once a step connects: imported meanwhile
        if self.events.on_selected is not None:
            self.events.on_selected(selection)
        root = selection.root
        # The store before the sweeps: its unfinished runs say which run
        # repositories of dead holders a same-host runner may still use.
        store, bundles = await self._open_store()
        run_key = self.run_key
        held = False
        try:
            await self._recover_and_sweep(store)
            # Held before the capture, released after the removal: a crash in
            # between leaves a dead holder that the next sweep or prune cleans.
            holder = hold_run_repository(self.state_dir, run_key)
            # The tags of HEAD's history (the snapshot's parent) and the
            # branches for the jobs' checkouts, listed beside the capture:
            # `--merged` walks the history.
            listing = ThreadPoolExecutor(1, thread_name_prefix="preloop-tags")
            tags = listing.submit(snapshot_tags, root, "HEAD")
            branches = listing.submit(snapshot_branches, root)
            listing.shutdown(wait=False)
            try:
                snap = await capture_workspace(self.state_dir, root, run_key)
            except BaseException:
                # A failed capture removed its repository, or left it (a timeout)
                # for the capture sweep: either way this holder has nothing to hold.
                holder.unlink(missing_ok=True)
                raise
            held = True
            ref = str(selection.github.get("ref") or "")
            # The checkout's names as GitHub's has them: the pushed branch, and
            # the tags in the submitted HEAD's history (versions from git).
            branch = ref.removeprefix("refs/heads/") if ref.startswith("refs/heads/") else ""
            location = SnapshotLocation(
                str(snap.repository),
                "snapshot",
                snap.commit,
                repo_key=snap.cache_key,  # `preloop rerun` finds its objects by it
                tags=await anyio.to_thread.run_sync(tags.result) if snap.parents else (),
                head_branch=branch,
                checkout=snap.parents[0] if snap.on_head else "",
                branches=await anyio.to_thread.run_sync(branches.result),
            )
            payload = selection.github.get("event")
            if req.event_path is None and req.event == "push" and isinstance(payload, dict):
                # A push's `after` (and head commit) is `github.sha`, as on
                # GitHub: the snapshot of a work tree with changes.
                payload["after"] = location.checked_out
                if isinstance(payload.get("head_commit"), dict) and not snap.on_head:
                    payload["head_commit"].update(id=snap.commit, tree_id=snap.tree)
            # The cache scope of the run's jobs, for remote runners' services too.
            default_ref = selection.default_ref
            base = str(selection.github.get("base_ref") or "")
            base_ref = f"refs/heads/{base}" if base else ""  # pull requests only
            if bundles is not None:
                # Runners that do not see this state directory fetch it from the store.
                await anyio.to_thread.run_sync(bundles.release_ended)
                self.published = await publish_snapshot(
                    bundles, snap.repository, snap.cache_key, snap.commit, run_key
                )
                location = replace(location, transport="store", bundles=self.published.chain)
            for planned in selection.plans:
                if self._interrupted:
                    break
                gh = {
                    **workflow_github_context(
                        selection.github, root, planned.workflow, location.checked_out
                    ),
                    "sha": location.checked_out,
                    SNAPSHOT_CONTEXT_KEY: location.to_dict(),
                    SERVICES_CONTEXT_KEY: services_scope(str(root), ref, default_ref, base_ref),
                    ENGINE_CONTEXT_KEY: self._engine_context(),
                    "event_name": req.event,
                    "workflow": planned.github_workflow or planned.name,
                }
                submit = functools.partial(store.submit_run, planned, github=gh)
                run_id = await anyio.to_thread.run_sync(submit)
                self.run_ids.append(run_id)
                self._planned.update((run_id, j.id) for j in planned.jobs)
                if self.events.on_submitted is not None:
                    self.events.on_submitted(run_id, planned)
            if not self._interrupted:
                # One service for every run of this invocation: its tokens are
                # run-scoped. On PostgreSQL it keeps artifacts and caches in
                # the store, shared with remote runners' jobs of the same run.
                with run_services(
                    self.state_dir, str(root), ref, default_ref, base_ref, run_key, store
                ) as services:
                    await self._drive(store, list(self.run_ids), services)
            outcomes = [
                await self._outcome(store, run_id, planned.workflow, planned.name)
                for run_id, planned in zip(self.run_ids, selection.plans, strict=False)
            ]
            return RunsOutcome(outcomes, selection.skipped, self._interrupted, selection.invalid)
        finally:
            await self._close(store, bundles, held)

    async def _rerun(self, old_id: int) -> RunsOutcome:
        """`preloop rerun`: runs the ended run `old_id` again on its snapshot
        (brought back from the object cache), as GitHub's re-run does: with
        `rerun_all_jobs` every job, else the failed and cancelled ones and
        their dependents, the rest kept as they ended. The run number stays,
        `github.run_attempt` counts up; secrets and runner options are this
        invocation's."""
        req = self.request
        self._validate()
        store, bundles = await self._open_store()
        held = False
        try:
            info = await anyio.to_thread.run_sync(store.get_run, old_id)
            # A run whose engine died is cancelled here: then it can be re-run.
            await self._recover_and_sweep(store)
            info = await anyio.to_thread.run_sync(store.get_run, old_id)
            if info.status != "completed":
                raise UsageError(
                    f"run {old_id} is still {info.status}: wait for it to end, or cancel it "
                    f"(`preloop cancel {old_id}`), before re-running it"
                )
            if not req.rerun_all_jobs:
                ended = await anyio.to_thread.run_sync(store.list_jobs, old_id)
                if not any(j.conclusion in ("failure", "cancelled") for j in ended):
                    raise UsageError(
                        f"run {old_id} has no failed or cancelled job: nothing to re-run "
                        "(--all runs every job again)"
                    )
            github = (await anyio.to_thread.run_sync(store.run_context, old_id)).get("github") or {}
            location = SnapshotLocation.from_context(github, f"run {old_id}")
            held = True  # from here a failure may leave the repository: released below
            location = await self._restore(location, f"run {old_id}", bundles)
            scope = github.get(SERVICES_CONTEXT_KEY)
            scope = scope if isinstance(scope, dict) else {}
            before = scope.get("earlier")
            # Its jobs read the artifacts the kept jobs uploaded (on GitHub
            # a re-run is an attempt of the same run, sharing them).
            earlier = (
                *self._artifact_run(store, old_id, github),
                *(str(r) for r in (before if isinstance(before, list) else ())),
            )
            access = scope_access("", b"", scope)
            ref = access.ref or str(github.get("ref") or "")
            default_ref = access.default_ref or "refs/heads/main"
            rerun = functools.partial(
                store.rerun,
                old_id,
                failed_only=not req.rerun_all_jobs,
                latest_only=True,
                github={
                    SNAPSHOT_CONTEXT_KEY: location.to_dict(),
                    ENGINE_CONTEXT_KEY: self._engine_context(),
                    SERVICES_CONTEXT_KEY: services_scope(
                        access.repo, ref, default_ref, access.base_ref, earlier
                    ),
                },
            )
            run_id = await anyio.to_thread.run_sync(rerun)
            self.run_ids.append(run_id)
            jobs = await anyio.to_thread.run_sync(store.list_jobs, run_id)
            self._planned.update((run_id, j.id) for j in jobs)
            if self.events.on_rerun is not None:
                self.events.on_rerun(run_id, old_id, info.name, jobs)
            if not self._interrupted:
                with run_services(
                    self.state_dir,
                    access.repo,
                    ref,
                    default_ref,
                    access.base_ref,
                    self.run_key,
                    store,
                    earlier,
                ) as services:
                    await self._drive(store, [run_id], services)
            outcome = await self._outcome(store, run_id, info.workflow, info.name)
            return RunsOutcome([outcome], [], self._interrupted, [])
        finally:
            await self._close(store, bundles, held)

    async def _open_store(self) -> tuple[Store, SnapshotBundles | None]:
        """The run's store, and its snapshot bundles where runners fetch the
        snapshot from the store (the `store` transport)."""
        url = self.store_url()
        # Before a capture: PRELOOP_SNAPSHOT_TRANSPORT=store on the lite store fails here.
        transport = snapshot_transport("pg" if url.startswith("postgres") else "lite")
        self.state_dir.mkdir(parents=True, exist_ok=True)
        store = await anyio.to_thread.run_sync(open_user_store, url, self.request.store_url)
        self.store = store
        return store, SnapshotBundles(store) if transport == "store" else None

    async def _restore(
        self, location: SnapshotLocation, where: str, bundles: SnapshotBundles | None
    ) -> SnapshotLocation:
        """An ended run's snapshot at `location`, brought back from the
        object cache as this engine's run repository (and, on the `store`
        transport, published again for remote runners): the location of it."""
        if not location.repo_key:
            raise UsageError(
                f"{where} was submitted by an older preloop, which did not record where "
                "its snapshot's objects are: run the workflow again with `preloop run`"
            )
        commits = [location.commit, *([location.checkout] if location.checkout else [])]
        repository = await restore_snapshot(
            self.state_dir, location.repo_key, commits, self.run_key, where
        )
        location = replace(location, repository=str(repository), transport="path", bundles=())
        if bundles is not None:
            await anyio.to_thread.run_sync(bundles.release_ended)
            self.published = await publish_snapshot(
                bundles, repository, location.repo_key, location.commit, self.run_key
            )
            location = replace(location, transport="store", bundles=self.published.chain)
        return location

    def _artifact_run(
        self, store: Store, run_id: int, github: Mapping[str, Any]
    ) -> tuple[str, ...]:
        """How the services name the artifacts of the ended run `run_id`
        (github context `github`): its id in the store on PostgreSQL; on
        disk the directory of that run of that engine, which another store's
        run with the same id may have moved aside (none: nothing to read)."""
        if store.dialect == "pg":
            return (str(run_id),)
        owner = github.get(ENGINE_CONTEXT_KEY)
        key = owner.get("run_key") if isinstance(owner, dict) else None
        name = artifact_run_name(self.state_dir, str(run_id), str(key) if key else None)
        return (name,) if name is not None else ()

    async def _recover_and_sweep(self, store: Store) -> None:
        """Before a run: cancels the runs of dead engines, and sweeps what
        crashed captures, workspaces and expired artifacts left."""
        contexts = await anyio.to_thread.run_sync(store.unfinished_run_contexts)
        recovered = await recover_abandoned_runs(store, self.state_dir, contexts)
        for old in recovered:
            if self.events.on_recovered is not None:
                self.events.on_recovered(old)
        live = {k: v for k, v in contexts.items() if k not in recovered}
        keep_run_repositories(self.state_dir, run_repositories_in_use(live, self.state_dir))
        await anyio.to_thread.run_sync(sweep_workspace_snapshots, self.state_dir)
        await anyio.to_thread.run_sync(sweep_work_dir, self.state_dir)
        await anyio.to_thread.run_sync(remove_expired_artifacts, self.state_dir)
        if store.dialect == "pg":
            await anyio.to_thread.run_sync(remove_expired_artifacts, self.state_dir, store)

    def _validate(self) -> None:
        """A bad PRELOOP_* value or -j: exit 2 now, not a traceback later."""
        config.validate()
        n = self.request.local_runners
        if n is not None and n < 0:
            raise UsageError(f"-j {n}: the number of local runners must be >= 0")

    def _engine_context(self) -> dict[str, Any]:
        """`github.preloop_engine`: who drives the run (a dead one's runs are
        recovered by the next start)."""
        return {
            "host": socket.gethostname(),
            "pid": os.getpid(),
            # with the pid, so a recycled pid never passes for this engine
            "start_ticks": ProcessIdentity.current().start_ticks,
            "run_key": self.run_key,
        }

    async def _outcome(self, store: Store, run_id: int, workflow: str, name: str) -> RunOutcome:
        if self._interrupted:
            await settle_cancelled(store, run_id, f"cancelled by {self._interrupted_by}")
        info = await anyio.to_thread.run_sync(store.get_run, run_id)
        jobs = await anyio.to_thread.run_sync(store.list_jobs, run_id)
        return RunOutcome(
            run_id=run_id,
            workflow=workflow,
            conclusion=info.conclusion or ("cancelled" if self._interrupted else "failure"),
            jobs=[self._record(run_id, j) for j in jobs],
            interrupted=self._interrupted,
            state_dir=self.state_dir,
            name=name,
            interrupted_by=self._interrupted_by,
        )

    async def _close(self, store: Store, bundles: SnapshotBundles | None, held: bool) -> None:
        with anyio.CancelScope(shield=True):
            self.store = None  # the live view's poll stops reading it
            if bundles is not None:
                # The runs ended: their bundles may be evicted. If the store
                # is unreachable now, the reaper releases the hold later.
                with contextlib.suppress(PreloopError):
                    await anyio.to_thread.run_sync(bundles.release, self.run_key)
            await anyio.to_thread.run_sync(store.close)
            if held:
                await anyio.to_thread.run_sync(release_run_repository, self.state_dir, self.run_key)

    def _record(self, run_id: int, j: JobInfo) -> JobRecord:
        key = (run_id, j.id)
        return JobRecord(
            id=j.id,
            name=j.name,
            kind=j.kind,
            status=j.status,
            conclusion=j.conclusion,
            outputs=j.outputs,
            reason=j.reason or self._reasons.get(key),
            runner=j.runner,
            duration=self._durations.get(key),
            annotations=self._annotations.get(key, []),
        )

    def skip_reason(self, lease: Lease, contexts: Mapping[str, Any]) -> str | None:
        """Why a leased job is not run on this host (its `runs-on`, evaluated
        with the job's contexts, names another OS; a leg of a matrix computed
        at run time that `--matrix` does not select), or None."""
        if lease.run_id in self.run_ids and (lease.run_id, lease.job_id) not in self._planned:
            unwanted = leg_not_selected(lease.matrix, self.request.matrix)
            if unwanted is not None:
                return unwanted
        return foreign_platform(
            runs_on_labels(lease.spec.get("runs-on"), contexts), self.request.platforms
        )

    def _job_events(self) -> JobEvents:
        # A job of another run (a shared PostgreSQL store) is run, logged and
        # completed like ours, but not shown or summarised as part of our run.
        def start(lease: Lease) -> None:
            if lease.run_id not in self.run_ids:
                return
            self._starts[(lease.run_id, lease.job_id)] = time.monotonic()
            if self.events.on_job_start is not None:
                self.events.on_job_start(lease)

        def line(lease: Lease, text: str) -> None:
            if lease.run_id in self.run_ids and self.events.on_job_line is not None:
                self.events.on_job_line(lease, text)

        def end(lease: Lease, result: JobResult) -> None:
            if lease.run_id in self.run_ids:
                key = (lease.run_id, lease.job_id)
                began = self._starts.pop(key, None)
                if began is not None:
                    self._durations[key] = time.monotonic() - began
                self._annotations[key] = [a.render() for a in result.annotations]
                if result.reason:
                    self._reasons[key] = result.reason
                if self.events.on_job_end is not None:
                    self.events.on_job_end(lease, result)
            self._wake()

        return JobEvents(on_start=start, on_line=line, on_end=end)

    def _set_duration(self, run_id: int, job_id: str, seconds: float) -> None:
        self._durations[(run_id, job_id)] = seconds

    async def _run_finished(self, store: Store, run_id: int) -> bool:
        info = await anyio.to_thread.run_sync(store.get_run, run_id)
        return info.status == "completed"

    async def _drive(
        self,
        store: Store,
        run_ids: list[int],
        services: ServiceAccess | None = None,
    ) -> None:
        req = self.request
        count = req.local_runners if req.local_runners is not None else (os.cpu_count() or 1)
        done = anyio.Event()
        finished: set[int] = set()
        events = self._job_events()
        templates = CheckoutTemplates(
            work_dir(self.state_dir), store=store, state_dir=self.state_dir
        )

        def options(index: int, run_id: int, capacity: int = 1) -> RunnerOptions:
            return RunnerOptions(
                name=f"{req.runner_name}-{os.getpid()}-{index}",
                # All of the run's jobs, whatever their labels: a reusable
                # workflow's `runs-on: ${{ inputs.os }}` is known only once
                # its caller starts. `skip_reason` leaves another OS's.
                labels=None,
                state_dir=self.state_dir,
                secrets=dict(req.secrets),
                sandbox=req.sandbox,
                sandbox_network=req.sandbox_network,
                run_id=run_id,
                skip=self.skip_reason,
                services=services,
                action_overrides=req.action_overrides,
                idle_poll=_POLL,
                capacity=capacity,
            )

        async def slot_runner(stop: anyio.Event) -> None:
            # One run (the common case): one runner with a slot per local
            # runner claims every free slot in one statement and reports
            # finished jobs with the next claims in one transaction.
            runner = Runner(store, options(0, run_ids[0], count), events, templates)
            await runner.serve(stop)

        async def local_runner(index: int) -> None:
            runners = {
                run_id: Runner(store, options(index, run_id), events, templates)
                for run_id in run_ids
            }
            while not done.is_set():
                lease = None
                changed = self._changed
                token = store.work_token()  # before the claims: no wake-up is missed
                for run_id, runner in runners.items():
                    if run_id not in finished:
                        lease = await runner.claim()
                        if lease is not None:
                            break
                if lease is None:
                    # A change here, a job queued anywhere (pg), or the fallback poll.
                    wait = idle_wait(store, _POLL, _LISTEN_POLL)
                    await wait_for_work(store, token, wait, changed, done)
                    continue
                await runners[lease.run_id].run_lease(lease)

        async def watch() -> None:
            last_reap = time.monotonic()
            while True:
                token = store.work_token(RUNS)  # before the reads: no completion is missed
                for run_id in run_ids:
                    if run_id not in finished and await self._run_finished(store, run_id):
                        finished.add(run_id)
                if len(finished) == len(run_ids):
                    break
                if time.monotonic() - last_reap > _REAP_EVERY:
                    await anyio.to_thread.run_sync(store.expire_leases)
                    last_reap = time.monotonic()
                changed = self._changed
                # A change here, a run completed (pg, by a remote runner), or the poll.
                wait = idle_wait(store, _POLL, _LISTEN_POLL)
                await wait_for_work(store, token, wait, changed, channel=RUNS)
            done.set()
            self._wake()

        slots = len(run_ids) == 1 and count > 1
        slot_stop = anyio.Event()
        try:
            async with anyio.create_task_group() as outer:
                if slots:
                    # Outside the scope Ctrl-C cancels: told to stop, it
                    # cancels its jobs and records them before it returns.
                    outer.start_soon(slot_runner, slot_stop)
                try:
                    with anyio.CancelScope() as scope:
                        self._runners_scope = scope
                        if self._interrupted:
                            scope.cancel()
                        async with anyio.create_task_group() as tg:
                            if not slots:
                                for i in range(count):
                                    tg.start_soon(local_runner, i)
                            if store.dialect == "pg":
                                # Jobs that runners on other machines take are shown too.
                                tg.start_soon(
                                    follow_elsewhere,
                                    store,
                                    run_ids,
                                    f"{req.runner_name}-{os.getpid()}-",
                                    events,
                                    done,
                                    self._set_duration,
                                )
                            await watch()
                finally:
                    slot_stop.set()
        finally:
            self._runners_scope = None
            templates.close()


def _relative(path: Path, root: Path) -> str:
    try:
        return str(Path(path).resolve().relative_to(root.resolve()))
    except ValueError:
        return str(path)


def _filters_paths(wf: Any, event: str) -> bool:
    filters = wf.on.get(event)
    return isinstance(filters, Mapping) and ("paths" in filters or "paths-ignore" in filters)


def _declared_inputs(wf: Any, event: str) -> set[str]:
    if event == "workflow_dispatch":
        return set(wf.workflow_dispatch_inputs)
    return set()


async def settle_cancelled(store: Store, run_id: int, reason: str) -> None:
    """Cancels run `run_id` and ends every job of it that did not end (no
    runner of ours is left to run them)."""
    with anyio.CancelScope(shield=True):
        await anyio.to_thread.run_sync(store.cancel_run, run_id, reason)
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


async def recover_abandoned_runs(
    store: Store, state_dir: Path, contexts: Mapping[int, Mapping[str, Any]] | None = None
) -> list[int]:
    """Runs whose `preloop run` died (its pid on this host is gone) without
    ending them: their leftover step processes are killed, the runs cancelled
    with every open job, and their run repositories in `state_dir` removed.
    Called when `preloop run` starts, so a crash never leaves a run that the
    next run's runners would pick up. `contexts`: `store.unfinished_run_contexts()`
    (read here when not given)."""
    host = socket.gethostname()
    recovered: list[int] = []
    if contexts is None:
        # Every unfinished run, however old: one query, not their jobs.
        contexts = await anyio.to_thread.run_sync(store.unfinished_run_contexts)
    for run_id, ctx in contexts.items():
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
            # Its snapshot bundles are no longer needed (a no-op on the path transport).
            release = functools.partial(SnapshotBundles(store).release, str(run_key))
            await anyio.to_thread.run_sync(release)
        await settle_cancelled(store, run_id, "its `preloop run` process died")
        snapshot = (ctx.get("github") or {}).get(SNAPSHOT_CONTEXT_KEY) or {}
        repo = Path(str(snapshot.get("repository", "")))
        if repo.is_absolute() and repo.parent == Path(state_dir).absolute() / "snapshots":
            await anyio.to_thread.run_sync(release_run_repository, state_dir, repo.name)
        recovered.append(run_id)
    return recovered


def run_repositories_in_use(contexts: Mapping[int, Mapping[str, Any]], state_dir: Path) -> set[str]:
    """The run ids of `state_dir`'s run repositories that the unfinished runs
    with run contexts `contexts` reference (their engine's `run_key`, and the
    repository their snapshot location names): a runner may still check them
    out, whether or not their `preloop run` is alive."""
    snapshots = Path(state_dir).absolute() / "snapshots"
    keys: set[str] = set()
    for ctx in contexts.values():
        github = ctx.get("github") or {}
        owner = github.get(ENGINE_CONTEXT_KEY)
        if isinstance(owner, dict) and owner.get("run_key"):
            keys.add(str(owner["run_key"]))
        location = github.get(SNAPSHOT_CONTEXT_KEY)
        if isinstance(location, dict):
            repo = Path(str(location.get("repository", "")))
            if repo.is_absolute() and repo.parent == snapshots:
                keys.add(repo.name)
    return keys
