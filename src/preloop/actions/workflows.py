"""Remote reusable workflows, resolved through the action cache at plan time.

`owner/repo/.github/workflows/x.yml@ref` is fetched like an action (same
cache, same resolution rules) and loaded as the callee; `$/.github/workflows/
x.yml` names a workflow in the same repository as the calling workflow file
(the workspace for the top-level workflow, the fetched commit for a workflow
that came from another repository). `--action` (through `loading_for_run`) and
`PRELOOP_ACTION_OVERRIDES` entries naming a directory apply here too
(`owner/repo=DIR` reads `DIR/.github/workflows/x.yml`).
"""

from __future__ import annotations

import contextvars
import logging
import os
import threading
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TypeVar

import anyio

from preloop import config
from preloop.actions.cache import ActionCache
from preloop.actions.reference import Override, Overrides, parse_remote
from preloop.errors import PreloopError

__all__ = [
    "RemoteWorkflowError",
    "fetch_remote_workflow",
    "is_workflow_path",
    "loading_for_run",
]

_log = logging.getLogger(__name__)
T = TypeVar("T")

# What the run being planned sets (its state directory, its `--action`
# overrides) for the loader, which knows neither.
_RUN: contextvars.ContextVar[tuple[Path, tuple[Override, ...]] | None] = contextvars.ContextVar(
    "preloop_actions_plan_run", default=None
)


def loading_for_run(state_dir: Path, overrides: tuple[Override, ...], fn: Callable[[], T]) -> T:
    """Calls `fn` (a workflow load) so that the remote reusable workflows it
    fetches use `state_dir`'s action cache and the run's `--action` overrides."""
    token = _RUN.set((state_dir, tuple(overrides)))
    try:
        return fn()
    finally:
        _RUN.reset(token)


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


def fetch_remote_workflow(
    uses: str, *, state_dir: Path | None = None, base_url: str | None = None
) -> tuple[Path, Path]:
    """(workflow file, repository root) of `owner/repo/.github/workflows/x.yml@ref`."""
    ref = parse_remote(uses)
    if ref is None or not is_workflow_path(ref.path):
        raise RemoteWorkflowError(
            f"'{uses}' is not a reusable workflow reference: use "
            "owner/repo/.github/workflows/<file>.yml@ref, ./.github/workflows/<file>.yml or "
            "$/.github/workflows/<file>.yml"
        )
    run = _RUN.get()
    if run is not None and state_dir is None:
        state_dir = run[0]
    override = Overrides.from_env(os.environ, run[1] if run else ()).find(ref)
    if override is not None:
        if override.directory is None:
            raise RemoteWorkflowError(
                f"'{uses}': a reusable workflow cannot be skipped (its jobs are planned); "
                f"override it with {ref.slug}=DIR instead"
            )
        found = override.directory / ref.path
        if not found.is_file():
            raise RemoteWorkflowError(f"'{uses}': the override has no {ref.path} ({found})")
        return found, override.directory
    cache = ActionCache(
        state_dir or config.state_dir(), run_key=f"plan-{uuid.uuid4().hex}", base_url=base_url
    )
    fetched = _run_sync(lambda: cache.fetch(ref, lambda message: _log.warning("%s", message)))
    if not fetched.directory.is_file():
        raise RemoteWorkflowError(
            f"'{uses}': {ref.slug} has no file {ref.path} at {fetched.commit[:12]}"
        )
    return fetched.directory, fetched.root
