"""What GitHub's runner provides besides running steps: a tool cache, artifacts, the actions cache.

- `preloop.services.toolcache`: the shared tool cache (`$RUNNER_TOOL_CACHE`,
  default `<state>/toolcache`) laid out from the host's toolchains, so
  `setup-python` & co. find them, and each job's own tool cache over it,
  whose Pythons are throwaway virtual environments;
- `preloop.services.server`: the artifact (v4) and cache (v2 twirp and the
  older REST) HTTP services on 127.0.0.1, started by `preloop run` for its run
  (`run_services`) and stopped with it; `preloop.services.listener` binds
  their socket at once and starts the server when a step first connects;
- `preloop.services.storage`: where artifacts and caches live, behind the
  `ServiceStorage` interface: on this host's disk with the lite store, in the
  store itself on PostgreSQL (`preloop.services.store_storage`), so that the
  jobs of one run share them whichever machine runs them.

A remote `preloop runner` starts its own service on its loopback over the
store (`ServiceEndpoint`); the run's cache scope (repository, ref, default
branch) travels in the run's github context under `SERVICES_CONTEXT_KEY`,
and each job's token carries its run and job, so a job sees its own run's
artifacts on whichever runner it lands.

`job_environment(...)` is the one function the runner calls to give a job
what these services need (`RUNNER_TOOL_CACHE`, `ACTIONS_RUNTIME_TOKEN`,
`ACTIONS_RESULTS_URL`, `ACTIONS_CACHE_URL`, `ACTIONS_CACHE_SERVICE_V2`): every
step of the job, `run:` steps and actions alike, inherits it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from preloop import config
from preloop.services.listener import ServiceListener
from preloop.services.storage import LocalStorage, ServiceStorage
from preloop.services.tokens import Claims, mint
from preloop.services.toolcache import (
    default_tool_cache,
    job_tool_cache,
    refresh_now_and_then,
)

if TYPE_CHECKING:
    from preloop.control.store import Store

__all__ = [
    "SERVICES_CONTEXT_KEY",
    "ServiceAccess",
    "ServiceEndpoint",
    "job_environment",
    "open_storage",
    "preload_server",
    "remove_expired_artifacts",
    "run_services",
    "runner_services",
    "scope_access",
    "services_scope",
]


@dataclass(frozen=True, slots=True)
class ServiceAccess:
    """How the jobs of one run reach its services: the URL, the signing
    secret (tokens are minted per job), and the cache scope of the run."""

    url: str
    secret: bytes
    repo: str
    ref: str
    default_ref: str
    base_ref: str = ""  # a pull request's base branch (refs/heads/...), else ""
    earlier: tuple[str, ...] = ()  # the runs a re-run re-runs: their artifacts are read too


#: The run's service scope in its github context: {"repo", "ref",
#: "default_ref", "base_ref"} and, for a re-run, "earlier" (`services_scope`).
SERVICES_CONTEXT_KEY = "preloop_services"


def services_scope(
    repo: str, ref: str, default_ref: str, base_ref: str = "", earlier: tuple[str, ...] = ()
) -> dict[str, Any]:
    """What `preloop run` stores under `SERVICES_CONTEXT_KEY` for remote
    runners; `earlier`: the runs a re-run re-runs, newest first."""
    scope: dict[str, Any] = {
        "repo": repo,
        "ref": ref,
        "default_ref": default_ref,
        "base_ref": base_ref,
    }
    if earlier:
        scope["earlier"] = list(earlier)
    return scope


def scope_access(url: str, secret: bytes, scope: Mapping[str, Any]) -> ServiceAccess:
    """The `ServiceAccess` of a run whose service scope is `scope`."""
    earlier = scope.get("earlier")
    return ServiceAccess(
        url,
        secret,
        str(scope.get("repo") or ""),
        str(scope.get("ref") or ""),
        str(scope.get("default_ref") or ""),
        str(scope.get("base_ref") or ""),
        tuple(str(r) for r in earlier) if isinstance(earlier, list) else (),
    )


@dataclass(frozen=True, slots=True)
class ServiceEndpoint:
    """A service that serves any run (a remote runner's): its URL and secret.
    The run's scope comes from each job's context (`access`)."""

    url: str
    secret: bytes

    def access(self, github: Mapping[str, Any]) -> ServiceAccess:
        """The access of the run whose github context is `github`: the scope
        `preloop run` stored, else (a run submitted otherwise) the context's
        repository and ref, with main as the default branch."""
        scope = github.get(SERVICES_CONTEXT_KEY)
        if not isinstance(scope, Mapping):
            scope = {
                "repo": github.get("repository") or "",
                "ref": github.get("ref") or "",
                "default_ref": "refs/heads/main",
            }
        return scope_access(self.url, self.secret, scope)


def job_environment(
    state_dir: Path,
    access: ServiceAccess | None,
    run_id: str,
    job_id: str,
    tool_cache: Path | None = None,
    *,
    lay_out: bool = True,
) -> dict[str, str]:
    """The environment variables a job of run `run_id` needs for the runner's
    services. Refreshes the shared tool cache from the host's toolchains
    first (`refresh_now_and_then`), then lays out the job's own tool cache
    over it at `tool_cache` (`job_tool_cache`: its Pythons are fresh virtual
    environments, so what the job installs goes with it; what its setup
    actions download there is moved into the shared cache when it ends, by
    `adopt_job_tools`). Without `tool_cache` the job is given the shared one.
    With `lay_out` false (`job_uses_tool_cache` said no) `tool_cache` is
    made an empty directory and nothing is refreshed or laid out.
    Without `access` (a runner given no service) only the tool cache is
    provided."""
    shared = default_tool_cache(state_dir)
    if tool_cache is not None and not lay_out:
        tool_cache.mkdir(parents=True)
        root = tool_cache
    else:
        refresh_now_and_then(shared)
        root = shared if tool_cache is None else job_tool_cache(shared, tool_cache)
    env = {"RUNNER_TOOL_CACHE": str(root)}
    if access is not None:
        claims = Claims(
            str(run_id),
            job_id,
            access.repo,
            access.ref,
            access.default_ref,
            access.base_ref,
            access.earlier,
        )
        env.update(
            ACTIONS_RUNTIME_TOKEN=mint(access.secret, claims),
            ACTIONS_RESULTS_URL=access.url,
            ACTIONS_RUNTIME_URL=access.url,
            ACTIONS_CACHE_URL=access.url,
            ACTIONS_CACHE_SERVICE_V2="true",
        )
    return env


def open_storage(
    state_dir: Path, store: Store | None = None, run_key: str | None = None
) -> ServiceStorage:
    """The storage of the jobs' services: in `store` when it is PostgreSQL
    (shared by every runner of the fleet), else on this state directory's
    disk for the runs with the unique key `run_key` (one `preloop run`)."""
    cap = int(config.get("PRELOOP_ACTIONS_CACHE_MAX_BYTES"))
    if store is not None and store.dialect == "pg":
        from preloop.services.store_storage import StoreStorage

        return StoreStorage(store, state_dir, cap)
    return LocalStorage(state_dir, cap, run_key=run_key)


def remove_expired_artifacts(state_dir: Path, store: Store | None = None) -> list[str]:
    """Removes the artifacts of runs older than PRELOOP_ARTIFACT_RETENTION_DAYS,
    and what uploads of dead services left a day ago or earlier (on this
    state directory's disk, or in `store` when it is PostgreSQL)."""
    days = int(config.get("PRELOOP_ARTIFACT_RETENTION_DAYS"))
    storage = open_storage(state_dir, store)
    try:
        storage.sweep_abandoned_uploads()
        return storage.remove_expired_artifacts(days)
    finally:
        storage.close()


def preload_server() -> None:
    """Starts importing the HTTP server (aiohttp: ~150 ms of imports) in a
    daemon thread, for a run whose steps will likely call it but that has git
    and the store to wait for first: the import overlaps those waits instead
    of delaying the first call. Importing it again (the listener, at the first
    connection) waits for this import to finish, as any import of a module
    being imported does."""
    import threading

    def load() -> None:
        # A failure is `_serving`'s to report, if the run gets that far.
        with contextlib.suppress(Exception):
            import preloop.services.server  # noqa: F401

    threading.Thread(target=load, name="preloop-preload-server", daemon=True).start()


@contextlib.contextmanager
def _serving(storage: ServiceStorage) -> Iterator[ServiceListener]:
    """The services on a socket that listens at once; the HTTP server starts
    when a step first connects (a run that never calls them never imports it).
    A server that cannot start is logged and its callers are turned away at
    once: their steps fail, the run goes on."""
    try:
        server = ServiceListener(storage)
        try:
            server.start()
            yield server
        finally:
            server.stop()
    finally:
        storage.close()


@contextlib.contextmanager
def run_services(
    state_dir: Path,
    repo: str,
    ref: str,
    default_ref: str,
    base_ref: str = "",
    run_key: str | None = None,
    store: Store | None = None,
    earlier: tuple[str, ...] = (),
) -> Iterator[ServiceAccess]:
    """Starts the artifact and cache services for one run on 127.0.0.1 and
    stops them when the block ends. Jobs read the caches of `ref`, then of
    `base_ref` (a pull request's base branch), then of `default_ref`. With a
    PostgreSQL `store` they keep artifacts and caches in it (so remote
    runners' jobs of the run share them); else on this host's disk, where
    `run_key` (`github.preloop_engine.run_key`) tells the runs' artifacts
    from those of another store's runs with the same ids. A re-run's jobs
    read the artifacts of the runs it re-runs (`earlier`) after its own."""
    with _serving(open_storage(state_dir, store, run_key)) as server:
        yield ServiceAccess(server.url, server.secret, repo, ref, default_ref, base_ref, earlier)


@contextlib.contextmanager
def runner_services(state_dir: Path, store: Store) -> Iterator[ServiceEndpoint]:
    """The services of a remote `preloop runner`: on its own 127.0.0.1, over
    the store, for any run; stopped when the block ends."""
    from preloop.services.store_storage import StoreStorage

    cap = int(config.get("PRELOOP_ACTIONS_CACHE_MAX_BYTES"))
    storage = StoreStorage(store, state_dir, cap)
    storage.sweep_abandoned_uploads()
    storage.remove_expired_artifacts(int(config.get("PRELOOP_ARTIFACT_RETENTION_DAYS")))
    with _serving(storage) as server:
        yield ServiceEndpoint(server.url, server.secret)
