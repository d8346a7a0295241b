"""`preloop runner`: a long-lived runner for other machines (PostgreSQL store).

It claims jobs whose `runs-on` labels it has, checks out the run's snapshot
(fetched from the store into its own object cache unless the submitter's
state directory is at the same path here),
heartbeats its lease, and on SIGTERM/SIGINT cancels its job (killing its
process groups), completes it as cancelled and exits 0. While idle it waits on
PostgreSQL wake-ups and costs the database a few short queries a minute.

Its jobs' artifacts and actions caches go through the store: the runner
serves the artifact and cache services on its own 127.0.0.1 over the store
(`preloop.services.runner_services`), so a job here downloads what a job of
the same run uploaded on another machine.
"""

from __future__ import annotations

import os
import signal
import socket
import time
from pathlib import Path

import anyio
import click

from preloop import config
from preloop.actions.reference import Overrides
from preloop.cli.app import cli, plural
from preloop.cli.secret_args import parse_secrets, sandbox_options, secret_options
from preloop.control import open_store
from preloop.errors import UsageError
from preloop.runner import Runner, RunnerOptions
from preloop.runner.checkout import sweep_work_dir
from preloop.services import runner_services
from preloop.snapshot.bundles import SnapshotBundles
from preloop.snapshot.holders import sweep_abandoned_run_repositories

# The reaper looks again when the earliest lease can have expired, at least
# this long after its last look (and a little after the expiry itself).
_REAP_MIN = 1.0
_REAP_SLACK = 0.5


async def _serve(runner: Runner) -> None:
    stop = anyio.Event()
    with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async with anyio.create_task_group() as tg:

            async def on_signal() -> None:
                async for _ in signals:
                    stop.set()
                    return

            async def reap() -> None:
                # Jobs of runners that died are failed by the store. A job
                # claimed after a look holds a full lease, so sleeping until the
                # earliest expiry (at most one lease) misses none, and an idle
                # fleet costs two short queries per lease length.
                lease = runner.options.lease_seconds
                bundles = SnapshotBundles(runner.store)
                while True:
                    await anyio.to_thread.run_sync(runner.store.expire_leases)
                    # Snapshot bundles held by runs that ended without
                    # releasing them (their `preloop run` died) become evictable.
                    await anyio.to_thread.run_sync(bundles.release_ended)
                    nxt = await anyio.to_thread.run_sync(runner.store.next_lease_expiry)
                    wait = lease if nxt is None else nxt - time.time() + _REAP_SLACK
                    await anyio.sleep(min(max(wait, _REAP_MIN), lease))

            tg.start_soon(on_signal)
            tg.start_soon(reap)
            await runner.serve(stop)
            tg.cancel_scope.cancel()


@cli.command("runner")
@click.option("--store", required=True, help="Store URL: postgresql://... shared with submitters.")
@click.option("--labels", default="", help="Comma-separated extra labels (runs-on).")
@click.option("--name", help="Runner name (default: host-pid).")
@click.option(
    "--state-dir",
    type=click.Path(path_type=Path, file_okay=False),
    help="Where job directories and logs go (default: $PRELOOP_STATE_DIR).",
)
@click.option("--once", is_flag=True, help="Take one job, run it, then exit (autoscalers).")
@click.option(
    "--max-jobs",
    type=click.IntRange(min=1),
    help="Exit after running this many jobs.",
)
@secret_options
@sandbox_options
@click.option(
    "--capacity",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="Jobs run side by side. Free slots are claimed in one statement, and a finished "
    "job is reported together with the next claims in one transaction.",
)
def runner_command(
    store: str,
    labels: str,
    name: str | None,
    state_dir: Path | None,
    secret: tuple[str, ...],
    secret_files: tuple[Path, ...],
    sandbox: bool,
    sandbox_network: str,
    capacity: int,
    once: bool = False,
    max_jobs: int | None = None,
) -> None:
    """Run jobs from a shared store until SIGTERM (then cancel the job and exit 0),
    or until --once / --max-jobs N jobs have run. The lease of a job is
    $PRELOOP_LEASE_SECONDS (heartbeat every third of it)."""
    config.validate()  # a bad PRELOOP_* value: exit 2 now, not in the first job
    if not store.startswith(("postgresql://", "postgres://")):
        raise UsageError(
            f"--store {store!r}: a runner on another machine needs the shared PostgreSQL "
            "store (postgresql://...)"
        )
    Overrides.from_env(os.environ)  # a bad PRELOOP_ACTION_OVERRIDES fails here, not per job
    state = (state_dir or config.state_dir()).absolute()
    state.mkdir(parents=True, exist_ok=True)
    options = RunnerOptions(
        name=name or f"{socket.gethostname()}-{os.getpid()}",
        labels=[lb.strip() for lb in labels.split(",") if lb.strip()],
        state_dir=state,
        secrets=parse_secrets(secret, secret_files),
        sandbox=sandbox,
        sandbox_network=sandbox_network,
        capacity=capacity,
        max_jobs=1 if once else max_jobs,
    )
    sweep_work_dir(state)
    # Run repositories fetched from the store by runners of this host that died.
    sweep_abandoned_run_repositories(state)
    with open_store(store) as db, runner_services(state, db) as endpoint:
        options.service_endpoint = endpoint
        runner = Runner(db, options)
        click.echo(f"runner {options.name}: waiting for jobs ({', '.join(runner.labels or [])})")
        try:
            anyio.run(_serve, runner)
        finally:
            runner.templates.close()
        click.echo(f"runner {options.name}: stopped after {plural(runner.jobs_run, 'job')}")
