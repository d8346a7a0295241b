"""Remote reusable workflows, resolved through the action cache at plan time.

`owner/repo/.github/workflows/x.yml@ref` is fetched like an action (same
cache, same resolution rules) and loaded as the callee; `$/.github/workflows/
x.yml` names a workflow in the same repository as the calling workflow file
(the workspace for the top-level workflow, the fetched commit for a workflow
that came from another repository). `--action` (through `PlanRun` /
`loading_for_run`) and `PRELOOP_ACTION_OVERRIDES` entries naming a directory
apply here too (`owner/repo=DIR` reads `DIR/.github/workflows/x.yml`).

A ref is resolved once per run: the engine plans every workflow file of a
run through one `PlanRun` carrying the run's key (the key its jobs resolve
actions with), which memoises each `owner/repo/...@ref`; a workflow loaded
outside a run (`preloop plan`, `load_workflow`) is a run of its own
(`planning`).
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import os
import threading
import uuid
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import TypeVar

import anyio

from preloop import config
from preloop.actions.cache import ActionCache
from preloop.actions.reference import Override, Overrides, RemoteRef, parse_remote
from preloop.errors import PreloopError

__all__ = [
    "PlanRun",
    "RemoteWorkflowError",
    "fetch_remote_workflow",
    "is_workflow_path",
    "loading_for_run",
    "planning",
    "skipped_workflow",
]

_log = logging.getLogger(__name__)
T = TypeVar("T")


class PlanRun:
    """What the run being planned gives the loader, which knows none of it:
    its state directory (whose action cache fetches), its `--action`
    overrides and its run key. A remote workflow's branch or tag is resolved
    once per run: every caller of one `owner/repo/...@ref` gets the same
    commit (memoised here, and the cache's resolution record names the run)."""

    def __init__(
        self,
        state_dir: Path | None = None,
        overrides: tuple[Override, ...] = (),
        *,
        run_key: str | None = None,
        base_url: str | None = None,
    ) -> None:
        self.state_dir = state_dir
        self.overrides = tuple(overrides)
        self.run_key = run_key or f"plan-{uuid.uuid4().hex}"
        self.base_url = base_url
        self._fetched: dict[str, tuple[Path, Path] | PreloopError] = {}
        self._lock = threading.Lock()
        self._cache: ActionCache | None = None

    def close(self) -> None:
        """The loads are over: the fetched workflows may be pruned again."""
        with self._lock:
            if self._cache is not None:
                self._cache.release()

    @contextlib.contextmanager
    def active(self) -> Iterator[PlanRun]:
        """Workflow loads inside the block fetch through this run."""
        token = _RUN.set(self)
        try:
            yield self
        finally:
            _RUN.reset(token)

    def load(self, fn: Callable[[], T]) -> T:
        with self.active():
            return fn()

    def fetch(self, ref: RemoteRef, uses: str) -> tuple[Path, Path]:
        """(workflow file, repository root) of `ref`, fetched once per run (a
        failure too: every caller of it gets the same error)."""
        key = str(ref)
        with self._lock:  # one load at a time asks; a second caller waits for the first
            known = self._fetched.get(key)
            if isinstance(known, PreloopError):
                raise known
            if known is not None:
                return known
            try:
                found = self._fetch(ref, uses)
            except PreloopError as exc:
                self._fetched[key] = exc
                raise
            self._fetched[key] = found
            return found

    def _fetch(self, ref: RemoteRef, uses: str) -> tuple[Path, Path]:
        if self._cache is None:
            self._cache = ActionCache(
                self.state_dir or config.state_dir(), run_key=self.run_key, base_url=self.base_url
            )
        cache = self._cache
        fetched = _run_sync(lambda: cache.fetch(ref, lambda message: _log.warning("%s", message)))
        if not fetched.directory.is_file():
            raise RemoteWorkflowError(
                f"'{uses}': {ref.slug} has no file {ref.path} at {fetched.commit[:12]}"
            )
        return fetched.directory, fetched.root


# The run being planned, for the loader (set by `PlanRun.active`).
_RUN: contextvars.ContextVar[PlanRun | None] = contextvars.ContextVar(
    "preloop_actions_plan_run", default=None
)


def loading_for_run(
    state_dir: Path,
    overrides: tuple[Override, ...],
    fn: Callable[[], T],
    *,
    run_key: str | None = None,
) -> T:
    """Calls `fn` (a workflow load) so that the remote reusable workflows it
    fetches use `state_dir`'s action cache, the run's `--action` overrides and
    one resolution per ref (a run loading several files shares a `PlanRun`)."""
    run = PlanRun(state_dir, overrides, run_key=run_key)
    try:
        return run.load(fn)
    finally:
        run.close()


@contextlib.contextmanager
def planning() -> Iterator[PlanRun]:
    """The active `PlanRun`, or a new one for the block (a top-level workflow
    load outside a run is a run of its own: its callers share resolutions)."""
    current = _RUN.get()
    if current is not None:
        yield current
        return
    run = PlanRun()
    try:
        with run.active():
            yield run
    finally:
        run.close()


class RemoteWorkflowError(PreloopError):
    """A remote reusable workflow that cannot be fetched or is not a workflow file."""


def is_workflow_path(path: str) -> bool:
    return path.startswith(".github/workflows/") and path.endswith((".yml", ".yaml"))


def _run_sync(fn: Callable[[], Awaitable[T]]) -> T:
    """Runs `fn` on its own event loop in a helper thread: the loader is
    synchronous and may be called from inside an event loop's worker thread."""
    box: dict[str, object] = {}

    def target() -> None:
        try:
            box["value"] = anyio.run(fn)
        except BaseException as exc:  # handed to the caller below
            box["error"] = exc

    thread = threading.Thread(target=target, name="preloop-remote-workflow")
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]  # type: ignore[misc]
    return box["value"]  # type: ignore[return-value]


def skipped_workflow(uses: str) -> str | None:
    """The reason a remote reusable workflow is skipped by an override
    (`--action owner/repo=skip[:why]`, through the active `PlanRun` or the
    environment), or None when it is fetched."""
    ref = parse_remote(uses)
    if ref is None or not is_workflow_path(ref.path):
        return None
    run = _RUN.get()
    extra = run.overrides if run is not None else ()
    override = Overrides.from_env(os.environ, extra).find(ref)
    if override is None or override.directory is not None:
        return None
    return f"{uses} skipped by an override" + (f": {override.reason}" if override.reason else "")


def fetch_remote_workflow(
    uses: str, *, state_dir: Path | None = None, base_url: str | None = None
) -> tuple[Path, Path]:
    """(workflow file, repository root) of `owner/repo/.github/workflows/x.yml@ref`,
    through the active `PlanRun` (a one-off run when none is; `state_dir` and
    `base_url` then choose its cache)."""
    ref = parse_remote(uses)
    if ref is None or not is_workflow_path(ref.path):
        raise RemoteWorkflowError(
            f"'{uses}' is not a reusable workflow reference: use "
            "owner/repo/.github/workflows/<file>.yml@ref, ./.github/workflows/<file>.yml or "
            "$/.github/workflows/<file>.yml"
        )
    run = _RUN.get()
    one_off = run is None
    if run is None:
        run = PlanRun(state_dir, base_url=base_url)
    override = Overrides.from_env(os.environ, run.overrides).find(ref)
    if override is not None:
        if override.directory is None:  # the loader asks `skipped_workflow` first
            raise RemoteWorkflowError(f"'{uses}' is skipped by an override")
        found = override.directory / ref.path
        if not found.is_file():
            raise RemoteWorkflowError(f"'{uses}': the override has no {ref.path} ({found})")
        return found, override.directory
    try:
        return run.fetch(ref, uses)
    finally:
        if one_off:
            run.close()
