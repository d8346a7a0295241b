"""A runner: claims jobs from a store and executes them.

`Runner.run_lease(lease)` is one job: check out the run's snapshot into a
fresh per-job directory, execute the steps (`preloop.runner.job`) while a
heartbeat task extends the lease and turns a cancel request (or a lost lease)
into `JobControl.cancel()`, write the log and result under the state
directory, complete the job in the store, and remove the job directory.

`Runner.serve(stop)` is the long-lived loop of `preloop runner`: claim, run,
repeat until `stop` is set; an idle runner polls the store.
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import quote

import anyio

from preloop import config
from preloop.control import Lease, Store, StoreError
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
from preloop.runner.limits import RUN_OUTPUTS_MAX_BYTES, output_bytes
from preloop.runner.logs import JobLog
from preloop.runner.masking import Masker
from preloop.runner.sandbox import bubblewrap_wrapper
from preloop.runner.watchdog import TRACKING_FILE
from preloop.workflow import PlanError, PlannedJob, expand_deferred

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
    labels: Sequence[str]
    state_dir: Path
    secrets: dict[str, str] = field(default_factory=dict)
    sandbox: bool = False
    sandbox_network: str = "host"  # "host" or "none" (see preloop.runner.sandbox)
    # The lease of a claimed job ($PRELOOP_LEASE_SECONDS); unless set, the
    # heartbeat extends it every third of it, at least every 2 s (the
    # heartbeat also brings cancel requests).
    lease_seconds: float = field(default_factory=lambda: float(config.get("PRELOOP_LEASE_SECONDS")))
    heartbeat_interval: float | None = None
    idle_poll: float = 0.5
    # Serve only this run (the local runners of `preloop run`); None serves any.
    run_id: int | None = None
    # `serve` returns after this many jobs (`preloop runner --once`, `--max-jobs`).
    max_jobs: int | None = None

    @property
    def heartbeat_every(self) -> float:
        if self.heartbeat_interval is not None:
            return self.heartbeat_interval
        return max(min(self.lease_seconds / 3, 2.0), 0.1)


T = TypeVar("T")


async def store_call(store: Store, fn: Callable[[], T]) -> T:
    """Runs one store operation: inline on the lite store (a local SQLite
    transaction takes about a millisecond, less than a worker-thread hop on a
    busy machine), in a worker thread on PostgreSQL (network round trips)."""
    if store.dialect == "lite":
        return fn()
    return await anyio.to_thread.run_sync(fn)


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
        self.templates = templates or CheckoutTemplates(work_dir(options.state_dir))
        self.current: JobControl | None = None
        self.jobs_run = 0

    @property
    def labels(self) -> list[str]:
        return sorted({*DEFAULT_LABELS, *(lb.lower() for lb in self.options.labels)})

    async def claim(self) -> Lease | None:
        opts = self.options
        return await store_call(
            self.store,
            lambda: self.store.claim_job(
                opts.name, self.labels, lease_seconds=opts.lease_seconds, run_id=opts.run_id
            ),
        )

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

    async def run_lease(self, lease: Lease, control: JobControl | None = None) -> JobResult:
        """Runs the leased job to its end and completes it in the store."""
        opts = self.options
        control = control or JobControl()
        self.current = control
        where = f"run {lease.run_id} job {lease.job_id!r}"
        job_dir = (
            work_dir(opts.state_dir)
            / f"{os.getpid()}-{lease.run_id}-{quote(lease.job_id, safe='')}-{uuid.uuid4().hex[:8]}"
        )
        log = JobLog(opts.state_dir, lease.run_id, lease.job_id)
        masker = Masker()
        for value in opts.secrets.values():
            masker.add(value)

        def line(text: str) -> None:
            # Lines of steps arrive masked; the runner's own ones (errors
            # quoting a spec or an exception) are masked here.
            log.write(text)
            if self.events.on_line is not None:
                self.events.on_line(lease, text)

        if self.events.on_start is not None:
            self.events.on_start(lease)
        result: JobResult | None = None
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._heartbeat, lease, control)
                try:
                    result = await self._execute(lease, control, job_dir, line, masker, where)
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
                if final.outputs:
                    final = await self._within_run_limit(lease, final, line)
                try:
                    await store_call(
                        self.store,
                        lambda: self.store.complete_job(lease, final.conclusion, final.outputs),
                    )
                except StoreError as exc:
                    line(masker.mask(f"preloop: the result could not be recorded: {exc}"))
                log.save_result(final)
                log.close()
                self.current = None
                self.jobs_run += 1
                # Removed in the background: the next claim need not wait.
                threading.Thread(
                    target=shutil.rmtree, args=(job_dir,), kwargs={"ignore_errors": True}
                ).start()
                if self.events.on_end is not None:
                    self.events.on_end(lease, final)
        return final

    async def _within_run_limit(
        self, lease: Lease, result: JobResult, line: Callable[[str], None]
    ) -> JobResult:
        """`result`, or a failure without outputs when they would take the
        run's outputs over GitHub's 50 MB (an error naming each output)."""
        try:
            used = await store_call(self.store, lambda: self.store.run_outputs_bytes(lease.run_id))
        except StoreError:
            return result  # the completion will report the store's trouble
        size = sum(output_bytes(k, v) for k, v in result.outputs.items())
        if used + size <= RUN_OUTPUTS_MAX_BYTES:
            return result
        names = ", ".join(repr(k) for k in result.outputs)
        why = (
            f"job outputs {names} ({size:,} bytes) would take run {lease.run_id}'s outputs "
            f"over GitHub's limit of {RUN_OUTPUTS_MAX_BYTES:,} bytes ({used:,} used); they "
            "are not passed on: pass large data as an artifact or a file instead"
        )
        line(f"✖ {why}")
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
        masker: Masker,
        where: str,
    ) -> JobResult:
        opts = self.options
        try:
            contexts: dict[str, Any] = await store_call(
                self.store, lambda: self.store.job_context(lease.run_id, lease.job_id)
            )
            github = dict(contexts.get("github") or {})
            location = SnapshotLocation.from_context(github, where)
            github.pop("preloop_snapshot", None)
            engine = github.pop("preloop_engine", None)
            tracking_key = engine.get("run_key") if isinstance(engine, dict) else None
            contexts["github"] = github
            spec = runnable_spec(lease, contexts)
            if "inputs" in spec:
                # An inner job of a reusable workflow sees the caller's inputs.
                contexts["inputs"] = spec["inputs"]
            workspace = job_dir / "workspace"
            temp = job_dir / "temp"
            job_dir.mkdir(parents=True)
            temp.mkdir()
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
            wrap = (
                bubblewrap_wrapper(
                    job_dir, opts.state_dir, workspace=workspace, network=opts.sandbox_network
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
            wrap=wrap,
            tracking_key=str(tracking_key) if tracking_key else None,
            tracking_id=tracking_id,
        )
        # If this process dies mid-job (even SIGKILL), the watchdog kills the steps.
        watchdog.register(tracking_id)
        try:
            return await execute_job(
                spec,
                contexts,
                host,
                log=line,
                secrets=opts.secrets,
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
        async with anyio.create_task_group() as tg:

            async def watch() -> None:
                await stop.wait()
                if self.current is not None:
                    self.current.cancel()

            tg.start_soon(watch)
            limit = self.options.max_jobs
            while not stop.is_set() and (limit is None or self.jobs_run < limit):
                lease = await self.claim()
                if lease is None:
                    with anyio.move_on_after(self.options.idle_poll):
                        await stop.wait()
                    continue
                control = JobControl()
                if stop.is_set():
                    control.cancel()
                await self.run_lease(lease, control)
            tg.cancel_scope.cancel()
