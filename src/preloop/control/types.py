"""The scheduler's public values: what claims, heartbeats and completions
hand back, what the queries return, and the errors a caller can catch.
`preloop.control` (and `preloop.control.store`) re-export every name."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from preloop.errors import PreloopError

Conclusion = Literal["success", "failure", "cancelled", "skipped"]


TERMINAL: frozenset[str] = frozenset({"success", "failure", "cancelled", "skipped"})


DEFAULT_LEASE_SECONDS = 60.0

#: GitHub's limit on a run's job outputs (50 MB). The store enforces it when a
#: job completes, inside the completion's transaction with the run row locked,
#: so two jobs of one run completing at once cannot both pass it. Measured as
#: the length of the outputs' stored JSON.
RUN_OUTPUTS_MAX_BYTES = 50 * 1024 * 1024


def run_outputs_refusal(
    run_id: int, outputs: dict[str, Any], size: int, used: int, limit: int
) -> str:
    """Why a job's outputs were refused: they would take run `run_id`'s over `limit`."""
    names = ", ".join(repr(k) for k in outputs)
    return (
        f"job outputs {names} ({size:,} bytes) would take run {run_id}'s outputs over "
        f"GitHub's limit of {limit:,} bytes ({used:,} used); they are not passed on: "
        "pass large data as an artifact or a file instead"
    )


class NonTerminalConclusion(PreloopError):
    """complete_job/settle_job was given a status that does not end a job."""

    exit_code = 2


class UnknownRun(PreloopError):
    """No run or job with that id exists in the store."""


@dataclass(frozen=True, slots=True)
class Lease:
    """A claimed job. The runner heartbeats it and completes it."""

    run_id: int
    job_id: str
    name: str
    token: str
    runner: str
    expires_at: float
    attempt: int
    spec: dict[str, Any]
    matrix: dict[str, Any] | None
    strategy: dict[str, Any] | None
    timeout_minutes: float


@dataclass(frozen=True, slots=True)
class Heartbeat:
    """`held` is False when the lease is gone (job ended or expired);
    `cancel_requested` tells the runner to stop the job."""

    held: bool
    cancel_requested: bool


@dataclass(frozen=True, slots=True)
class Completion:
    run_id: int
    job_id: str
    conclusion: str
    changed: bool  # False for a duplicate completion
    # `complete_and_claim` only: why this result was not recorded (the lease
    # is no longer held, the run is gone); `complete_job` raises instead.
    error: str | None = None
    # Why the job's outputs were refused (they would take the run's outputs
    # over `RUN_OUTPUTS_MAX_BYTES`): it was recorded as a failure without them.
    outputs_refused: str | None = None


#: One runner result for `Store.complete_and_claim`: the lease, its
#: conclusion and its outputs (None: no outputs).
JobResultItem = tuple["Lease", str, "dict[str, Any] | None"]


@dataclass(frozen=True, slots=True)
class RunInfo:
    id: int
    workflow: str
    name: str
    event: str
    status: str
    conclusion: str | None
    cancel_requested: bool
    remaining_jobs: int
    rerun_of: int | None = None  # the run this one re-runs (`Store.rerun`)
    created_at: float = 0.0


@dataclass(frozen=True, slots=True)
class JobInfo:
    run_id: int
    id: str
    name: str
    base_id: str
    kind: str
    status: str
    conclusion: str | None
    outputs: dict[str, Any]
    reason: str | None
    runner: str | None
    cancel_requested: bool
    inner_job_ids: tuple[str, ...]
    completed_at: float | None = None
