"""Executes claimed jobs: a checkout of the run's snapshot per job, then its
steps with GitHub's semantics (`preloop.runner.job`), each step's process
group killed on timeout or cancellation, optionally under bubblewrap.

- `execute_job(spec, contexts, host, log=...)`: the steps of one job;
- `Runner`: claim -> checkout -> execute -> complete, with heartbeats;
- logs and results under `<state>/logs/<run_id>/` (`preloop.runner.logs`).
"""

from preloop.runner.checkout import (
    SNAPSHOT_CONTEXT_KEY,
    CheckoutError,
    SnapshotLocation,
    checkout_snapshot,
)
from preloop.runner.commands import Annotation
from preloop.runner.job import (
    SUPPORTED_USES,
    JobControl,
    JobHost,
    JobResult,
    StepResult,
    execute_job,
)
from preloop.runner.masking import Masker
from preloop.runner.sandbox import SandboxUnavailable, bubblewrap_wrapper
from preloop.runner.worker import DEFAULT_LABELS, JobEvents, Runner, RunnerOptions

__all__ = [
    "DEFAULT_LABELS",
    "SNAPSHOT_CONTEXT_KEY",
    "SUPPORTED_USES",
    "Annotation",
    "CheckoutError",
    "JobControl",
    "JobEvents",
    "JobHost",
    "JobResult",
    "Masker",
    "Runner",
    "RunnerOptions",
    "SandboxUnavailable",
    "SnapshotLocation",
    "StepResult",
    "bubblewrap_wrapper",
    "checkout_snapshot",
    "execute_job",
]
