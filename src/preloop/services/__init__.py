"""What GitHub's runner provides besides running steps: a tool cache, artifacts, the actions cache.

- `preloop.services.toolcache`: `$RUNNER_TOOL_CACHE` (default `<state>/toolcache`)
  laid out from the host's toolchains, so `setup-python` & co. find them;
- `preloop.services.server`: the artifact (v4) and cache (v2 twirp and the
  older REST) HTTP services on 127.0.0.1, started by `preloop run` for its run
  (`run_services`) and stopped with it;
- `preloop.services.storage`: where artifacts and caches live, behind the
  `ServiceStorage` interface.

`job_environment(...)` is the one function the runner calls to give a job
what these services need (`RUNNER_TOOL_CACHE`, `ACTIONS_RUNTIME_TOKEN`,
`ACTIONS_RESULTS_URL`, `ACTIONS_CACHE_URL`, `ACTIONS_CACHE_SERVICE_V2`): every
step of the job, `run:` steps and actions alike, inherits it.
"""

from __future__ import annotations

import contextlib
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from preloop import config
from preloop.services.storage import LocalStorage, ServiceStorage
from preloop.services.tokens import Claims, mint
from preloop.services.toolcache import default_tool_cache, refresh_tool_cache

__all__ = [
    "ServiceAccess",
    "default_branch_ref",
    "job_environment",
    "open_storage",
    "remove_expired_artifacts",
    "run_services",
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


def job_environment(
    state_dir: Path, access: ServiceAccess | None, run_id: str, job_id: str
) -> dict[str, str]:
    """The environment variables a job of run `run_id` needs for the runner's
    services. Refreshes the tool cache from the host's toolchains first (a few
    `stat`s when nothing changed). Without `access` (a runner on another
    machine) only the tool cache is provided."""
    tool_cache = default_tool_cache(state_dir)
    refresh_tool_cache(tool_cache)
    env = {"RUNNER_TOOL_CACHE": str(tool_cache)}
    if access is not None:
        claims = Claims(
            str(run_id), job_id, access.repo, access.ref, access.default_ref, access.base_ref
        )
        env.update(
            ACTIONS_RUNTIME_TOKEN=mint(access.secret, claims),
            ACTIONS_RESULTS_URL=access.url,
            ACTIONS_RUNTIME_URL=access.url,
            ACTIONS_CACHE_URL=access.url,
            ACTIONS_CACHE_SERVICE_V2="true",
        )
    return env


def default_branch_ref(root: Path) -> str:
    """The ref of `root`'s default branch (caches saved there are readable from
    every ref, as on GitHub): origin's HEAD, else `init.defaultBranch`, else main."""
    for argv in (
        ["git", "symbolic-ref", "-q", "refs/remotes/origin/HEAD"],
        ["git", "config", "init.defaultBranch"],
    ):
        res = subprocess.run(argv, cwd=root, capture_output=True, text=True, check=False)
        name = res.stdout.strip()
        if res.returncode == 0 and name:
            name = name.removeprefix("refs/remotes/origin/").removeprefix("refs/heads/")
            return f"refs/heads/{name}"
    return "refs/heads/main"


def open_storage(state_dir: Path, run_key: str | None = None) -> ServiceStorage:
    """The storage of this state directory (local disk; see `ServiceStorage`)
    for the runs with the unique key `run_key` (one `preloop run`)."""
    cap = int(config.get("PRELOOP_ACTIONS_CACHE_MAX_BYTES"))
    return LocalStorage(state_dir, cap, run_key=run_key)


def remove_expired_artifacts(state_dir: Path) -> list[str]:
    """Removes the artifacts of runs older than PRELOOP_ARTIFACT_RETENTION_DAYS,
    and what uploads of dead services left a day ago or earlier."""
    days = int(config.get("PRELOOP_ARTIFACT_RETENTION_DAYS"))
    storage = LocalStorage(state_dir)
    try:
        storage.sweep_abandoned_uploads()
        return storage.remove_expired_artifacts(days)
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
) -> Iterator[ServiceAccess]:
    """Starts the artifact and cache services for one run on 127.0.0.1 and
    stops them when the block ends. Jobs read the caches of `ref`, then of
    `base_ref` (a pull request's base branch), then of `default_ref`;
    `run_key` (`github.preloop_engine.run_key`) tells the runs' artifacts
    from those of another store's runs with the same ids."""
    from preloop.services.server import ServiceServer  # aiohttp only when serving

    storage = open_storage(state_dir, run_key)
    server = ServiceServer(storage)
    server.start()
    try:
        yield ServiceAccess(server.url, server.secret, repo, ref, default_ref, base_ref)
    finally:
        server.stop()
        close = getattr(storage, "close", None)
        if close is not None:
            close()
