"""A runner: claims jobs from a store and executes them.

`Runner.run_lease(lease)` is one job: check out the run's snapshot into a
fresh per-job directory, execute the steps (`preloop.runner.job`) while a
heartbeat task extends the lease and turns a cancel request (or a lost lease)
into `JobControl.cancel()`, write the log and result under the state
directory, complete the job in the store, and remove the job directory.

`Runner.serve(stop)` is the long-lived loop of `preloop runner`: claim, run,
repeat until `stop` is set; an idle runner waits for a wake-up (PostgreSQL
LISTEN/NOTIFY, see preloop.control.wakeups; a slow poll is the fallback) or,
on the lite store, polls.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import os
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import anyio
import anyio.abc

from preloop import config
from preloop.actions.cache import actions_dir
from preloop.actions.node import NodeNotFound, find_node
from preloop.actions.reference import Override, Overrides
from preloop.actions.steps import ActionSource
from preloop.control import Completion, Lease, Store, StoreError
from preloop.control.joblogs import JobLogStore
from preloop.control.reusable import passed_secrets
from preloop.control.wakeups import JOBS
from preloop.errors import PreloopError
from preloop.runner import watchdog
from preloop.runner.checkout import CheckoutTemplates, SnapshotLocation, work_dir
from preloop.runner.commands import Annotation
from preloop.runner.job import (
    JobControl,
    JobHost,
    JobResult,
    execute_job,
    masked_result,
    tracking_prefix,
)
from preloop.runner.logs import JobLog, mark_run
from preloop.runner.masking import Masker
from preloop.runner.sandbox import bubblewrap_wrapper
from preloop.runner.watchdog import TRACKING_FILE
from preloop.runner.workspaces import WorkspaceSlot, safe_dir_name, take_workspace_slot
from preloop.services import (
    SERVICES_CONTEXT_KEY,
    ServiceAccess,
    ServiceEndpoint,
    job_environment,
)
from preloop.services.toolcache import (
    adopt_job_tools,
    default_tool_cache,
    job_uses_tool_cache,
)
from preloop.workflow import PlanError, PlannedJob, expand_deferred
from preloop.workflow import expressions as ex

__all__ = ["DEFAULT_LABELS", "JobEvents", "Runner", "RunnerOptions"]

_log = logging.getLogger(__name__)

#: Labels every preloop runner answers to besides its own: the hosted-runner
#: names workflows use, so that `runs-on: ubuntu-latest` runs here.
DEFAULT_LABELS = (
    "self-hosted",
    "linux",
    "x64",
    "ubuntu-latest",
    "ubuntu-24.04",
    "ubuntu-22.04",
    "ubuntu-20.04",
)


@dataclass(slots=True)
class JobEvents:
    """Callbacks for live progress (the `preloop run` display)."""

    on_start: Callable[[Lease], None] | None = None
    on_line: Callable[[Lease, str], None] | None = None
    on_end: Callable[[Lease, JobResult], None] | None = None


@dataclass(slots=True)
class RunnerOptions:
    name: str
    # The `runs-on` labels it takes jobs for; None takes any job (the local
    # runners of `preloop run`, serving their own run: `skip` decides).
    labels: Sequence[str] | None
    state_dir: Path
    secrets: dict[str, str] = field(default_factory=dict)
    sandbox: bool = False
    sandbox_network: str = "host"  # "host" or "none" (see preloop.runner.sandbox)
    # The lease of a claimed job ($PRELOOP_LEASE_SECONDS); unless set, the
    # heartbeat extends it every third of it, at least every 2 s (the
    # heartbeat also brings cancel requests).
    lease_seconds: float = field(default_factory=lambda: float(config.get("PRELOOP_LEASE_SECONDS")))
    heartbeat_interval: float | None = None
    # An idle runner looks for work again after `idle_poll` seconds; on
    # PostgreSQL, while its wake-up listener is connected, a queued job wakes
    # it at once and `listen_poll` is only the fallback.
    idle_poll: float = 0.5
    listen_poll: float = 30.0
    # Serve only this run (the local runners of `preloop run`); None serves any.
    run_id: int | None = None
    # The run's artifact and cache services (`preloop run`); None: tool cache only.
    services: ServiceAccess | None = None
    # A service for any run (`preloop runner`'s own, over the store): each
    # job gets access scoped by its run's context. Unused when `services` is set.
    service_endpoint: ServiceEndpoint | None = None
    # `--action` overrides; PRELOOP_ACTION_OVERRIDES is added after them.
    action_overrides: tuple[Override, ...] = ()
    # Why a claimed job is not run here (it is completed `skipped`), or None;
    # given the job's contexts (`needs`, `inputs`, `matrix`, ...), with which
    # its `runs-on` is evaluated.
    skip: Callable[[Lease, dict[str, Any]], str | None] | None = None
    # Jobs this runner runs side by side (`serve`): with more than one it
    # claims up to its free slots in one statement and reports finished jobs
    # with its next claims in one transaction (`Store.complete_and_claim`).
    capacity: int = 1
    # `serve` returns after this many jobs (`preloop runner --once`, `--max-jobs`).
    max_jobs: int | None = None

    @property
    def heartbeat_every(self) -> float:
        if self.heartbeat_interval is not None:
            return self.heartbeat_interval
        return max(min(self.lease_seconds / 3, 2.0), 0.1)


T = TypeVar("T")


@dataclass(slots=True)
class _Reported:
    """A finished job waiting for the batch that records it (`_serve_slots`)."""

    lease: Lease
    result: JobResult
    recorded: anyio.Event = field(default_factory=anyio.Event)
    outcome: Completion | BaseException | None = None


def _sandbox_reads(state_dir: Path, overrides: Overrides) -> list[Path]:
    """What a sandboxed job reads from where the sandbox hides the host's
    files (the state directory, `/tmp`, `/var/tmp`): the action cache
    (actions are fetched when the job starts, so it must exist before the
    sandbox binds it), the shared tool cache, which the job's own tool cache
    (in the job's directory, writable) links into, `--action` override
    directories, and the installation `node` runs JavaScript actions from."""
    reads = [actions_dir(state_dir), default_tool_cache(state_dir)]
    for path in reads:
        path.mkdir(parents=True, exist_ok=True)
    hidden = [Path(os.path.realpath(p)) for p in (state_dir, "/tmp", "/var/tmp")]
    extra = [o.directory for o in overrides.entries if o.directory is not None]
    extra += _host_tool_prefixes(reads[1])
    try:
        node = find_node()
    except NodeNotFound:
        pass  # a JavaScript action's step says so
    else:
        # Its installation (`<prefix>/bin/node`): a launcher there may run
        # the binary from the prefix's lib (a Python package's node).
        extra += [Path(node.path).parent.parent, Path(os.path.realpath(node.path)).parent.parent]
    for path in extra:
        real = Path(os.path.realpath(path))
        hidden_here = any(real.is_relative_to(h) for h in hidden)
        if real.exists() and hidden_here and not any(real.is_relative_to(r) for r in reads):
            reads.append(real)
    return reads


def _host_tool_prefixes(tool_cache: Path) -> list[Path]:
    """The installations of the host tools the tool cache links to
    (`<tool>/<version>/<arch>`, a link or a directory of links to binaries):
    `<prefix>` of each `<prefix>/bin/<binary>`, or the linked directory."""
    found: list[Path] = []
    for entry in tool_cache.glob("*/*/*"):
        if entry.is_symlink():
            found.append(Path(os.path.realpath(entry)))
        elif entry.is_dir():
            for binary in (*entry.glob("*"), *entry.glob("bin/*")):
                if binary.is_symlink():
                    found.append(Path(os.path.realpath(binary)).parent.parent)
    return found


async def store_call(store: Store, fn: Callable[[], T]) -> T:
    """Runs one store operation: inline on the lite store (a local SQLite
    transaction takes about a millisecond, less than a worker-thread hop on a
    busy machine), in a worker thread on PostgreSQL (network round trips)."""
    if store.dialect == "lite":
        return fn()
    return await anyio.to_thread.run_sync(fn)


def idle_wait(store: Store, poll: float, listen_poll: float) -> float:
    """How long an idle runner waits before it looks again: `listen_poll`
    while wake-ups are live, `poll` otherwise."""
    return listen_poll if store.listening else poll


async def wait_for_work(
    store: Store,
    token: int | None,
    timeout: float | None,
    *events: anyio.Event,
    channel: str = JOBS,
) -> None:
    """Returns when a job may have been queued since `token` was taken
    (`Store.work_token`, taken before the claim that found nothing: no
    wake-up is lost in between), when one of `events` is set, or after
    `timeout` seconds (the fallback poll). `channel` `RUNS`: a run completed."""
    woke = anyio.Event()
    unsubscribe: Callable[[], None] = lambda: None  # noqa: E731
    if token is not None:
        loop = asyncio.get_running_loop()

        def notified() -> None:
            with contextlib.suppress(RuntimeError):  # the loop has ended
                loop.call_soon_threadsafe(woke.set)

        unsubscribe = store.on_work(token, notified, channel)
    try:
        with anyio.move_on_after(timeout):
            async with anyio.create_task_group() as tg:

                async def until(event: anyio.Event) -> None:
                    await event.wait()
                    tg.cancel_scope.cancel()

                for event in (woke, *events):
                    tg.start_soon(until, event)
    finally:
        unsubscribe()


def runnable_spec(lease: Lease, contexts: dict[str, Any]) -> dict[str, Any]:
    """The step spec of a leased job.

    A leg of a deferred matrix normally carries its own spec (the store
    expands with `expand_deferred`). A leg inserted with the deferred job's
    spec (its `deferred` data, no `steps`; older stores did this) is rebuilt
    here with the same `expand_deferred` and the leg with this lease's id or
    matrix is taken."""
    spec = lease.spec
    if "steps" in spec or "deferred" not in spec:
        return spec
    base = lease.job_id.rsplit("#", 1)[0]
    deferred = PlannedJob(id=base, seq=0, base_id=base, name=lease.name, kind="deferred", spec=spec)
    expansion = expand_deferred(deferred, {"needs": contexts.get("needs") or {}})
    for leg in expansion.jobs:
        if leg.id == lease.job_id or (leg.matrix == lease.matrix and leg.kind == "job"):
            return leg.spec
    raise PlanError(f"run {lease.run_id} job {lease.job_id!r}: its matrix leg is not in the plan")


def _failure_result(reason: str) -> JobResult:
    return JobResult(
        conclusion="failure",
        outputs={},
        steps=[],
        annotations=[Annotation("error", reason)],
        summary="",
        reason=reason,
    )


class Runner:
    def __init__(
        self,
        store: Store,
        options: RunnerOptions,
        events: JobEvents | None = None,
        templates: CheckoutTemplates | None = None,
    ):
        self.store = store
        self.options = options
        self.events = events or JobEvents()
        # Shared by the runners of one process; the owner closes it.
        self.templates = templates or CheckoutTemplates(
            work_dir(options.state_dir), store=store, state_dir=options.state_dir
        )
        self.current: JobControl | None = None
        self.jobs_run = 0
        self._run_keys: dict[int, str | None] = {}
        self._job_logs = JobLogStore(store)
        # The workspace slot of each running job, by its job directory.
        self._slots: dict[Path, WorkspaceSlot] = {}

    @property
    def labels(self) -> list[str] | None:
        if self.options.labels is None:
            return None
        return sorted({*DEFAULT_LABELS, *(lb.lower() for lb in self.options.labels)})

    async def claim(self) -> Lease | None:
        opts = self.options
        return await store_call(
            self.store,
            lambda: self.store.claim_job(
                opts.name, self.labels, lease_seconds=opts.lease_seconds, run_id=opts.run_id
            ),
        )

    def _idle_wait(self) -> float:
        return idle_wait(self.store, self.options.idle_poll, self.options.listen_poll)

    async def _run_key(self, run_id: int) -> str | None:
        """The host-unique key `preloop run` gave run `run_id` (None for runs
        submitted otherwise): its logs are kept under it, since run ids repeat
        across stores sharing a state directory. One read per run."""
        if run_id not in self._run_keys:
            try:
                ctx = await store_call(self.store, lambda: self.store.run_context(run_id))
            except PreloopError:
                return None
            engine = (ctx.get("github") or {}).get("preloop_engine")
            key = engine.get("run_key") if isinstance(engine, dict) else None
            self._run_keys[run_id] = str(key) if key else None
        return self._run_keys[run_id]

    async def _heartbeat(self, lease: Lease, control: JobControl) -> None:
        opts = self.options
        while True:
            await anyio.sleep(opts.heartbeat_every)
            try:
                beat = await store_call(
                    self.store,
                    lambda: self.store.heartbeat(lease, lease_seconds=opts.lease_seconds),
                )
            except StoreError as exc:
                _log.warning(
                    "heartbeat of run %s job %s failed: %s", lease.run_id, lease.job_id, exc
                )
                continue
            if not beat.held or beat.cancel_requested:
                control.cancel()
                return

    async def run_lease(
        self,
        lease: Lease,
        control: JobControl | None = None,
        *,
        report: Callable[[Lease, JobResult], Awaitable[Completion]] | None = None,
    ) -> JobResult:
        """Runs the leased job to its end and completes it in the store (or,
        with `report`, hands the result to `report`, which completes it)."""
        opts = self.options
        control = control or JobControl()
        self.current = control
        where = f"run {lease.run_id} job {lease.job_id!r}"
        slug = safe_dir_name(lease.job_id, "job")  # RUNNER_TEMP is in it
        job_dir = (
            work_dir(opts.state_dir) / f"{os.getpid()}-{lease.run_id}-{slug}-{uuid.uuid4().hex[:8]}"
        )
        run_key = await self._run_key(lease.run_id)
        if run_key is not None:
            try:
                mark_run(opts.state_dir, lease.run_id, run_key)
            except OSError as exc:
                _log.warning("logs of run %s: %s", lease.run_id, exc)
        # On PostgreSQL the lines go to the store too: the submitter and
        # `preloop logs` may be on other machines.
        log = JobLog(
            opts.state_dir,
            lease.run_id,
            lease.job_id,
            self._job_logs if self.store.dialect == "pg" else None,
        )
        masker = Masker()
        for value in opts.secrets.values():
            masker.add(value)

        def line(text: str) -> None:
            # Lines of steps arrive masked; the runner's own ones (errors
            # quoting a spec or an exception) are masked here.
            log.write(text)
            if self.events.on_line is not None:
                self.events.on_line(lease, text)

        def lines(texts: list[str]) -> None:
            # A step's output, a batch per read of its pipe: one write.
            log.write_lines(texts)
            on_line = self.events.on_line
            if on_line is not None:
                for text in texts:
                    on_line(lease, text)

        contexts: dict[str, Any] | None = None
        if "${{" in lease.name:
            lease, contexts = await self._named(lease)
        if self.events.on_start is not None:
            self.events.on_start(lease)
        result: JobResult | None = None
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._heartbeat, lease, control)
                try:
                    if result is None:
                        result = await self._execute(
                            lease, control, job_dir, line, lines, masker, where, contexts
                        )
                except Exception as exc:
                    # A bug or a spec this runner cannot read: the job fails
                    # (it must not read as cancelled, nor stay running).
                    _log.exception("%s failed in the runner", where)
                    line(masker.mask(f"✖ preloop could not run the job: {exc!r}"))
                    result = masked_result(
                        _failure_result(f"{where}: preloop could not run the job: {exc!r}"), masker
                    )
                finally:
                    tg.cancel_scope.cancel()
        finally:
            with anyio.CancelScope(shield=True):
                final = result or JobResult("cancelled", {}, [], [], "", "cancelled")
                # Before the result is recorded: a job that `needs` this one
                # may start as soon as it is, and must find what this one's
                # setup actions downloaded rather than download it again.
                await anyio.to_thread.run_sync(adopt_job_tools, job_dir / "tool")
                try:
                    if report is not None:
                        done = await report(lease, final)
                    else:
                        done = await store_call(
                            self.store,
                            lambda: self.store.complete_job(lease, final.conclusion, final.outputs),
                        )
                except StoreError as exc:
                    line(masker.mask(f"preloop: the result could not be recorded: {exc}"))
                else:
                    if done.outputs_refused is not None:
                        # Checked by the store as it completed the job, atomically
                        # with the other jobs of the run completing.
                        why = masker.mask(done.outputs_refused)
                        line(f"✖ {why}")
                        final = self._outputs_refused(lease, final, why)
                    if done.conclusion != final.conclusion:
                        # The store's word is final (a job told to stop, by
                        # fail-fast or a cancel, stays cancelled): show that.
                        line(f"recorded as {done.conclusion} (was told to stop while it ran)")
                        final = dataclasses.replace(final, conclusion=done.conclusion)
                # In a thread: the last lines may wait on the store.
                await anyio.to_thread.run_sync(log.save_result, final)
                await anyio.to_thread.run_sync(log.close)
                self.current = None
                self.jobs_run += 1
                slot = self._slots.pop(job_dir, None)
                self.templates.remove_later(job_dir, slot.release if slot else None)
                if self.events.on_end is not None:
                    self.events.on_end(lease, final)
        return final

    async def _named(self, lease: Lease) -> tuple[Lease, dict[str, Any] | None]:
        """`lease` with its display name evaluated, as GitHub's runner does
        when the job starts (a `name:` that uses `needs`), and recorded, and
        the job's contexts read for it (kept for the job); `lease` as it is
        when that fails (the job's own evaluation reports it)."""
        try:
            contexts: dict[str, Any] = await store_call(
                self.store, lambda: self.store.job_context(lease.run_id, lease.job_id)
            )
            scope = {**contexts, "inputs": lease.spec.get("inputs", contexts.get("inputs"))}
            name = ex.interpolate(lease.name, scope)
            await store_call(self.store, lambda: self.store.name_job(lease, name))
        except (PreloopError, OSError):
            return lease, None
        return dataclasses.replace(lease, name=name), contexts

    @staticmethod
    def _outputs_refused(lease: Lease, result: JobResult, why: str) -> JobResult:
        """`result` as the store recorded it when it refused the job's outputs
        (they would take the run's over GitHub's 50 MB): a failure without
        them, with an error naming them."""
        return JobResult(
            "failure",
            {},
            result.steps,
            [*result.annotations, Annotation("error", why, lease.job_id)],
            result.summary,
            result.reason or why,
        )

    async def _execute(
        self,
        lease: Lease,
        control: JobControl,
        job_dir: Path,
        line: Callable[[str], None],
        lines: Callable[[list[str]], None],
        masker: Masker,
        where: str,
        contexts: dict[str, Any] | None = None,
    ) -> JobResult:
        """Runs the job; `contexts` are its contexts when already read."""
        opts = self.options
        try:
            if contexts is None:
                contexts = await store_call(
                    self.store, lambda: self.store.job_context(lease.run_id, lease.job_id)
                )
            spec = runnable_spec(lease, contexts)
            if "inputs" in spec:
                # An inner job of a reusable workflow sees the caller's inputs.
                contexts["inputs"] = spec["inputs"]
            # A reusable workflow call an override skipped (planned so) ends
            # skipped on any runner; `opts.skip` is the submitter's own rules.
            skip = spec.get("skipped_call") or None
            if skip is None and opts.skip is not None:
                skip = opts.skip(lease, contexts)
            if skip is not None:
                line(f"skipped: {skip}")
                return JobResult("skipped", {}, [], [], "", skip)
            github = dict(contexts.get("github") or {})
            location = SnapshotLocation.from_context(github, where)
            github.pop("preloop_snapshot", None)
            services = opts.services
            if services is None and opts.service_endpoint is not None:
                services = opts.service_endpoint.access(github)
            github.pop(SERVICES_CONTEXT_KEY, None)
            engine = github.pop("preloop_engine", None)
            tracking_key = engine.get("run_key") if isinstance(engine, dict) else None
            contexts["github"] = github
            secrets = dict(opts.secrets)
            if spec.get("secrets_chain"):
                # ... and only the secrets its callers pass on.
                secrets = await store_call(
                    self.store,
                    lambda: passed_secrets(
                        spec["secrets_chain"],
                        secrets,
                        lambda caller: self.store.job_context(lease.run_id, caller),
                    ),
                )
            temp = job_dir / "temp"
            job_dir.mkdir(parents=True)
            temp.mkdir()
            # The same path in every run (a restored `.venv` names it); given
            # back when the job's directory is removed (run_lease).
            slot = await anyio.to_thread.run_sync(
                take_workspace_slot, work_dir(opts.state_dir), str(github.get("repository") or "")
            )
            self._slots[job_dir] = slot
            workspace = slot.workspace
            # Tagged before any step starts: a later runner kills what is left
            # by this id before it removes the directory (sweep_work_dir).
            tracking_id = (
                tracking_prefix(str(tracking_key) if tracking_key else uuid.uuid4().hex)
                + uuid.uuid4().hex
            )
            (job_dir / TRACKING_FILE).write_text(tracking_id, encoding="utf-8")
            started = time.monotonic()
            await self.templates.checkout(location, workspace, where)
            line(
                f"checked out snapshot {location.commit[:12]} in {time.monotonic() - started:.2f}s"
            )
            # The job's tool cache is in its directory, beside RUNNER_TEMP
            # rather than in it (a step may empty RUNNER_TEMP): removed with
            # the job, and by sweep_work_dir when the runner died.
            service_env = await anyio.to_thread.run_sync(
                functools.partial(
                    job_environment,
                    opts.state_dir,
                    services,
                    str(lease.run_id),
                    lease.job_id,
                    job_dir / "tool",
                    lay_out=job_uses_tool_cache(spec),
                )
            )
            if "ACTIONS_RUNTIME_TOKEN" in service_env:
                masker.add(service_env["ACTIONS_RUNTIME_TOKEN"])  # as GitHub's runner does
            overrides = Overrides.from_env(os.environ, opts.action_overrides)
            sandbox = (
                bubblewrap_wrapper(
                    job_dir,
                    opts.state_dir,
                    workspace=workspace,
                    network=opts.sandbox_network,
                    read_only=_sandbox_reads(opts.state_dir, overrides),
                )
                if opts.sandbox
                else None
            )
        except (PreloopError, OSError) as exc:
            line(masker.mask(f"✖ {exc}"))
            return masked_result(_failure_result(str(exc)), masker)
        host = JobHost(
            workspace=workspace,
            temp=temp,
            run_id=str(lease.run_id),
            runner_name=opts.name,
            sandbox=sandbox,
            base_env={**os.environ, **service_env},
            tool_cache=Path(service_env["RUNNER_TOOL_CACHE"]),
            tracking_key=str(tracking_key) if tracking_key else None,
            actions=ActionSource(opts.state_dir, overrides),
            tracking_id=tracking_id,
            recheckout=functools.partial(self.templates.checkout, location, where=where),
        )
        # If this process dies mid-job (even SIGKILL), the watchdog kills the steps.
        watchdog.register(tracking_id)
        try:
            return await execute_job(
                spec,
                contexts,
                host,
                log=line,
                log_lines=lines,
                secrets=secrets,
                timeout_minutes=lease.timeout_minutes,
                control=control,
                masker=masker,
            )
        finally:
            watchdog.unregister(tracking_id)

    async def serve(self, stop: anyio.Event) -> None:
        """Claims and runs jobs until `stop` is set (or `max_jobs` have run);
        the job running when `stop` is set is cancelled (its process groups
        killed) and completed as cancelled."""
        if self.options.capacity > 1:
            await self._serve_slots(stop)
            return
        async with anyio.create_task_group() as tg:

            async def watch() -> None:
                await stop.wait()
                if self.current is not None:
                    self.current.cancel()

            tg.start_soon(watch)
            limit = self.options.max_jobs
            while not stop.is_set() and (limit is None or self.jobs_run < limit):
                token = self.store.work_token()
                lease = await self.claim()
                if lease is None:
                    await wait_for_work(self.store, token, self._idle_wait(), stop)
                    continue
                control = JobControl()
                if stop.is_set():
                    control.cancel()
                await self.run_lease(lease, control)
            tg.cancel_scope.cancel()

    async def _serve_slots(self, stop: anyio.Event) -> None:
        """`serve` with `capacity` slots: one claim statement fills every free
        slot, each job runs in its own task, and finished jobs are reported
        together with the claims their freed slots allow, in one transaction.
        On `stop` every running job is cancelled and reported, nothing new is
        claimed."""
        opts = self.options
        capacity = opts.capacity
        controls: dict[tuple[int, str], JobControl] = {}
        send, receive = anyio.create_memory_object_stream[_Reported](capacity)
        active = 0
        started = 0  # for `max_jobs`: no claim past it, and serve returns after it
        freed = [anyio.Event()]  # set when a finished job is sent for reporting

        def exhausted() -> bool:
            return opts.max_jobs is not None and started >= opts.max_jobs

        async def report(lease: Lease, result: JobResult) -> Completion:
            # Waits for the batch this result goes out with (run_lease shows
            # the conclusion the store recorded).
            item = _Reported(lease, result)
            await send.send(item)
            freed[0].set()
            await item.recorded.wait()
            if isinstance(item.outcome, Completion) and item.outcome.error is None:
                return item.outcome
            raise StoreError(
                item.outcome.error if isinstance(item.outcome, Completion) else str(item.outcome)
            )

        async def run_one(lease: Lease) -> None:
            key = (lease.run_id, lease.job_id)
            control = controls[key]
            try:
                await self.run_lease(lease, control, report=report)
            finally:
                controls.pop(key, None)

        def start(tg: anyio.abc.TaskGroup, leases: list[Lease]) -> None:
            nonlocal active, started
            for lease in leases:
                started += 1
                control = controls[(lease.run_id, lease.job_id)] = JobControl()
                if stop.is_set():
                    control.cancel()
                active += 1
                tg.start_soon(run_one, lease)

        async with anyio.create_task_group() as tg:

            async def watch() -> None:
                await stop.wait()
                for control in list(controls.values()):
                    control.cancel()

            tg.start_soon(watch)
            while not ((stop.is_set() or exhausted()) and active == 0):
                token = self.store.work_token()
                if not stop.is_set() and not exhausted() and active < capacity:
                    free = capacity - active
                    if opts.max_jobs is not None:
                        free = min(free, opts.max_jobs - started)
                    start(
                        tg,
                        await store_call(
                            self.store,
                            functools.partial(
                                self.store.claim_jobs,
                                opts.name,
                                self.labels,
                                limit=free,
                                lease_seconds=opts.lease_seconds,
                                run_id=opts.run_id,
                            ),
                        ),
                    )
                batch: list[_Reported] = []
                if active == 0 and (stop.is_set() or exhausted()):
                    continue  # told to stop during the claim: nothing to wait for
                if active == capacity or stop.is_set() or exhausted():
                    batch.append(await receive.receive())
                else:
                    # A free slot: a finished job, a wake-up or the fallback poll.
                    await wait_for_work(self.store, token, self._idle_wait(), stop, freed[0])
                    freed[0] = anyio.Event()  # before draining: a later report sets the new one
                while True:
                    try:
                        batch.append(receive.receive_nowait())
                    except anyio.WouldBlock:
                        break
                if not batch:
                    continue
                active -= len(batch)
                limit = 0 if stop.is_set() else capacity - active
                if opts.max_jobs is not None:
                    limit = max(0, min(limit, opts.max_jobs - started))
                results = [(b.lease, b.result.conclusion, b.result.outputs) for b in batch]
                try:
                    done, claimed = await store_call(
                        self.store,
                        functools.partial(
                            self.store.complete_and_claim,
                            results,
                            opts.name,
                            self.labels,
                            limit=limit,
                            lease_seconds=opts.lease_seconds,
                            run_id=opts.run_id,
                        ),
                    )
                except Exception as exc:  # each job's run_lease reports it in its log
                    for b in batch:
                        b.outcome = exc
                        b.recorded.set()
                    continue
                for b, c in zip(batch, done, strict=True):
                    b.outcome = c
                    b.recorded.set()
                start(tg, claimed)
            tg.cancel_scope.cancel()
