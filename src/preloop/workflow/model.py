"""The validated workflow model: what `load_workflow` returns.

Immutable (frozen dataclasses, tuples, read-only mappings). Values that may
hold `${{ }}` expressions are kept as written (strings with the expression
inside); `preloop.workflow.planner` evaluates them when their contexts are
known. `to_data()` gives plain JSON-able data (used for `PlannedJob.spec`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields, is_dataclass
from types import MappingProxyType
from typing import Any

__all__ = [
    "Concurrency",
    "Job",
    "Matrix",
    "Step",
    "Strategy",
    "Workflow",
    "WorkflowCall",
    "frozen_map",
    "thaw",
    "to_data",
]

EMPTY: Mapping[str, Any] = MappingProxyType({})


def _empty() -> Mapping[str, Any]:
    return EMPTY


def frozen_map(d: Mapping[str, Any] | None) -> Mapping[str, Any]:
    """A read-only deep copy of plain data."""
    if not d:
        return EMPTY
    return MappingProxyType({k: _freeze(v) for k, v in d.items()})


def _freeze(v: Any) -> Any:
    if isinstance(v, Mapping):
        return frozen_map(v)
    if isinstance(v, list | tuple):
        return tuple(_freeze(x) for x in v)
    return v


def thaw(v: Any) -> Any:
    """Plain, mutable JSON-able data from frozen model values."""
    if isinstance(v, Mapping):
        return {str(k): thaw(x) for k, x in v.items()}
    if isinstance(v, list | tuple):
        return [thaw(x) for x in v]
    return v


def to_data(obj: Any) -> Any:
    """A model object (or value) as plain JSON-able data."""
    if is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_data(getattr(obj, f.name)) for f in fields(obj)}
    if isinstance(obj, Mapping):
        return {str(k): to_data(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [to_data(x) for x in obj]
    return obj


@dataclass(frozen=True, slots=True)
class Concurrency:
    """`concurrency:`; `group` may hold expressions; `cancel_in_progress` is a
    bool or an expression string."""

    group: str
    cancel_in_progress: bool | str = False
    queue_max: bool = False


@dataclass(frozen=True, slots=True)
class Matrix:
    """`strategy.matrix`. `vectors` keep their YAML order. A matrix written as
    (or containing) expressions is kept as `template` (plain data with
    `${{ }}` strings) and expanded once its contexts are known."""

    vectors: tuple[tuple[str, tuple[Any, ...]], ...] = ()
    include: tuple[Mapping[str, Any], ...] = ()
    exclude: tuple[Mapping[str, Any], ...] = ()
    template: Any = None  # set when the matrix holds expressions


@dataclass(frozen=True, slots=True)
class Strategy:
    """`strategy`. One written with `${{ insert }}` (or an expression key)
    directly under it is also kept whole as `template` (plain data with
    `${{ }}` strings): the planner evaluates that, once its contexts are
    known, instead of the other fields (which hold what was written)."""

    matrix: Matrix | None = None
    fail_fast: bool | str = True
    max_parallel: int | str | None = None
    max_parallel_at: tuple[int, int] = (0, 0)  # line, column of its value
    template: Any = None  # set when `strategy` itself has an insert or expression key


@dataclass(frozen=True, slots=True)
class Step:
    id: str | None = None
    name: str | None = None
    if_: str | None = None
    run: str | None = None
    uses: str | None = None
    with_: Mapping[str, Any] = field(default_factory=_empty)
    shell: str | None = None
    working_directory: str | None = None
    env: Mapping[str, Any] = field(default_factory=_empty)
    continue_on_error: bool | str = False
    timeout_minutes: float | str | None = None


@dataclass(frozen=True, slots=True)
class WorkflowCall:
    """`on.workflow_call`: declared inputs (name -> {type, required, default,
    description}), outputs (name -> {value, description}) and secrets
    (name -> {required, description})."""

    inputs: Mapping[str, Mapping[str, Any]] = field(default_factory=_empty)
    outputs: Mapping[str, Mapping[str, Any]] = field(default_factory=_empty)
    secrets: Mapping[str, Mapping[str, Any]] = field(default_factory=_empty)


@dataclass(frozen=True, slots=True)
class Job:
    """One `jobs.<id>` entry: a runner job (`steps`) or a reusable-workflow
    caller (`uses`, with `callee` loaded and validated)."""

    id: str
    name: str | None = None
    needs: tuple[str, ...] = ()
    if_: str | None = None
    runs_on: Any = None  # str | list[str] | {group, labels}, may hold expressions
    strategy: Strategy | None = None
    continue_on_error: bool | str = False
    timeout_minutes: float | str = 360.0
    outputs: Mapping[str, str] = field(default_factory=_empty)
    env: Mapping[str, Any] = field(default_factory=_empty)
    defaults_run: Mapping[str, Any] = field(default_factory=_empty)
    concurrency: Concurrency | None = None
    steps: tuple[Step, ...] = ()
    container: Any = None
    services: Mapping[str, Any] = field(default_factory=_empty)
    environment: Any = None
    permissions: Any = None
    uses: str | None = None
    with_: Mapping[str, Any] = field(default_factory=_empty)
    secrets: Mapping[str, Any] | str | None = None  # mapping or "inherit"
    callee: Workflow | None = None
    # Why a remote reusable workflow is not called (`--action ...=skip`): the
    # caller is planned as a job that ends skipped with this reason.
    skipped_call: str | None = None
    line: int = 0
    column: int = 0

    @property
    def is_caller(self) -> bool:
        return self.uses is not None


@dataclass(frozen=True, slots=True)
class Workflow:
    path: str
    name: str
    on: Mapping[str, Any]  # event name -> its filters (None when bare)
    jobs: tuple[Job, ...]
    run_name: str | None = None
    env: Mapping[str, Any] = field(default_factory=_empty)
    defaults_run: Mapping[str, Any] = field(default_factory=_empty)
    concurrency: Concurrency | None = None
    permissions: Any = None
    workflow_call: WorkflowCall | None = None
    workflow_dispatch_inputs: Mapping[str, Mapping[str, Any]] = field(default_factory=_empty)
    named: bool = False  # `name:` is written (else `name` is the file's name)

    @property
    def github_workflow(self) -> str:
        """`github.workflow`: the workflow's `name:`, or without one the
        file's path in the repository, as GitHub gives it."""
        return self.name if self.named else self.path

    def job(self, job_id: str) -> Job:
        for j in self.jobs:
            if j.id == job_id:
                return j
        raise KeyError(job_id)

    def triggered_by(self, event: str) -> bool:
        return event in self.on
