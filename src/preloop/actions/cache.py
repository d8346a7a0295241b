"""The action cache: `owner/repo@ref` resolved with git and fetched into `<state>/actions/`.

```
<state>/actions/repos/<owner>/<repo>/<commit>/   the repository's tree at that commit (no .git)
<state>/actions/refs/<owner>/<repo>/<ref>.json   last resolution of a branch/tag: commit, run, time
<state>/actions/locks/<owner>+<repo>.lock        flock: one resolver/fetcher per repository
                                                 (and one pruner)
<state>/actions/tmp/<nonce>/                     a fetch in progress (renamed into repos/ when done)
```

- A ref is resolved once per run (the record names the run: `git ls-remote`
  when an earlier resolution is cached, else the shallow clone that fetches
  it; a tag wins over a branch of the same name, as on GitHub), a full
  commit SHA never. When the remote is unreachable a previous
  resolution is reused with a warning; with none the action cannot run and
  `ActionFetchError` says what to do.
- Fetches are single-flight across processes (the repository's lock file,
  held while resolving and fetching), atomic (a temporary directory renamed
  into place) and bounded (`PRELOOP_ACTIONS_FETCH_TIMEOUT`, through
  `preloop.process`, which kills git's whole process group).
- An action in use is never pruned: the cache that fetched it holds a shared
  flock on its directory (taken under the repository lock, kept until
  `ActionCache.release`, at the job's end); `prune_actions` takes it
  exclusively without waiting and keeps what it cannot lock.
- `PRELOOP_ACTIONS_URL` is the base of the remotes (`<base>/<owner>/<repo>`):
  `https://github.com` by default, any git URL base (`file:///srv/mirrors`).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import shutil
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote, unquote

import anyio

from preloop import config
from preloop.actions.reference import FULL_SHA, RemoteRef
from preloop.errors import PreloopError
from preloop.fs import tree_bytes
from preloop.process import CommandFailed, CommandTimeout, run_command
from preloop.snapshot.gitcmd import git_failure

__all__ = [
    "ActionCache",
    "ActionFetchError",
    "CachedAction",
    "FetchedAction",
    "actions_dir",
    "list_cached_actions",
    "prune_actions",
]

_GIT_ENV = {"GIT_TERMINAL_PROMPT": "0", "GIT_ASKPASS": "true", "LC_ALL": "C"}
_LOCK_POLL_FIRST = 0.005
_LOCK_POLL_MAX = 0.2
#: How many runs' resolutions a ref's record remembers (runs going on at once).
_RUNS_REMEMBERED = 32


class ActionFetchError(PreloopError):
    """An action that could not be resolved or fetched; the message says what to do."""


def actions_dir(state_dir: Path) -> Path:
    return Path(state_dir) / "actions"


@dataclass(frozen=True, slots=True)
class FetchedAction:
    """A remote action ready to run: `root` is the repository's tree, `directory`
    the action's own directory in it (`root/path`)."""

    ref: RemoteRef
    commit: str
    root: Path
    directory: Path


def _git_env() -> dict[str, str]:
    return {**os.environ, **_GIT_ENV}


def _discard(path: Path, tmp_root: Path) -> threading.Thread:
    """Removes `path` off the caller's critical path: renamed out of the action
    at once, deleted by the background thread returned (a crash leaves it
    under tmp/, where `prune_actions` sweeps directories of dead processes)."""
    trash = tmp_root / f"{os.getpid()}-trash-{uuid.uuid4().hex[:12]}"
    os.rename(path, trash)
    thread = threading.Thread(
        target=shutil.rmtree, args=(trash,), kwargs={"ignore_errors": True}, daemon=True
    )
    thread.start()
    return thread


def _detached_head(git_dir: Path) -> str | None:
    """The commit a detached HEAD names (saves a `git rev-parse`), or None
    when HEAD is a branch or cannot be read."""
    try:
        head = (git_dir / "HEAD").read_text(encoding="ascii").strip()
    except (OSError, ValueError):
        return None
    return head.lower() if FULL_SHA.fullmatch(head) else None


class _RepoLock:
    """An exclusive flock on `locks/<owner>+<repo>.lock`; the file is never
    unlinked so every process locks the same inode; dying releases it."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.fd: int | None = None

    async def __aenter__(self) -> _RepoLock:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o666)
        delay = _LOCK_POLL_FIRST
        try:
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except OSError as exc:
                    if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                        raise
                # The holder's fetch is bounded by its own timeout; an
                # enclosing deadline (the step's) ends this wait.
                await anyio.sleep(delay)
                delay = min(delay * 2, _LOCK_POLL_MAX)
        except BaseException:
            os.close(fd)
            raise
        self.fd = fd
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def try_lock(path: Path) -> int | None:
    """The lock's descriptor when it is free, None when another process holds it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o666)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None
    return fd


def _lock_directory(path: Path, how: int) -> int | None:
    """A descriptor of directory `path` flocked with `how` (never waiting), or
    None when a conflicting lock is held or the directory is gone."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError:
        return None
    try:
        fcntl.flock(fd, how | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None
    return fd


class ActionCache:
    """Resolves and fetches remote actions for one run (`run_key` names it, so
    that a branch or tag is resolved once per run)."""

    def __init__(
        self,
        state_dir: Path,
        *,
        run_key: str,
        base_url: str | None = None,
        timeout: float | None = None,
    ) -> None:
        self.root = actions_dir(state_dir)
        self.run_key = run_key
        self.base_url = (base_url or config.get("PRELOOP_ACTIONS_URL")).rstrip("/")
        self.timeout = float(timeout or config.get("PRELOOP_ACTIONS_FETCH_TIMEOUT"))
        self.fetches = 0  # git fetches this object ran (tests, bench)
        self._in_use: dict[Path, int] = {}  # action directory -> its shared flock
        self._discards: list[threading.Thread] = []  # deletions of fetched .git dirs

    def release(self, *, wait: bool = False) -> None:
        """Ends this run's use of the actions it fetched (they may be pruned);
        with `wait`, also waits for the deletions its fetches left running in
        the background (a benchmark counts them; a job does not wait)."""
        fds, self._in_use = list(self._in_use.values()), {}
        for fd in fds:
            os.close(fd)
        threads, self._discards = self._discards, []
        for thread in threads if wait else ():
            thread.join()

    def _use(self, ref: RemoteRef, root: Path) -> None:
        """Marks `root` in use until `release` (called under the repository
        lock, which a pruner holds too: no prune is between its checks)."""
        if root in self._in_use:
            return
        fd = _lock_directory(root, fcntl.LOCK_SH)
        if fd is None:
            raise ActionFetchError(f"action {ref}: {root} cannot be opened and locked for use")
        self._in_use[root] = fd

    def url(self, ref: RemoteRef) -> str:
        return f"{self.base_url}/{ref.owner}/{ref.repo}"

    def _repo_dir(self, ref: RemoteRef) -> Path:
        owner, repo = ref.key
        return self.root / "repos" / owner / repo

    def _record_path(self, ref: RemoteRef) -> Path:
        owner, repo = ref.key
        return self.root / "refs" / owner / repo / f"{quote(ref.ref, safe='')}.json"

    def _read_record(self, ref: RemoteRef) -> dict[str, Any] | None:
        """The last resolution (`commit`, `run`, `resolved_at`) and, under
        `runs`, the commit each recent run resolved the ref to."""
        try:
            data = json.loads(self._record_path(ref).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None
        if isinstance(data, dict) and isinstance(data.get("commit"), str):
            return data
        return None

    def _run_commit(self, record: dict[str, Any] | None) -> str | None:
        """The commit this run already resolved the ref to, if it did (a
        concurrent run resolving it since does not make this run re-resolve)."""
        if record is None:
            return None
        runs = record.get("runs")
        if isinstance(runs, dict) and isinstance(runs.get(self.run_key), str):
            return str(runs[self.run_key])
        return str(record["commit"]) if record.get("run") == self.run_key else None

    def _write_record(self, ref: RemoteRef, commit: str, old: dict[str, Any] | None) -> None:
        path = self._record_path(ref)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}")
        runs = old.get("runs") if old is not None else None
        recent = {k: v for k, v in (runs if isinstance(runs, dict) else {}).items()}
        recent.pop(self.run_key, None)
        recent[self.run_key] = commit  # last in order: the most recent
        recent = dict(list(recent.items())[-_RUNS_REMEMBERED:])
        doc = {"commit": commit, "run": self.run_key, "resolved_at": str(time.time())}
        tmp.write_text(json.dumps({**doc, "runs": recent}), encoding="utf-8")
        os.replace(tmp, path)

    def _cant(self, ref: RemoteRef, what: str) -> ActionFetchError:
        return ActionFetchError(
            f"action {ref}: {what}; check the network or PRELOOP_ACTIONS_URL "
            f"({self.base_url}), or use --action {ref.slug}=DIR (or =skip) for offline work"
        )

    async def _git(self, *args: str, cwd: Path | None = None) -> str:
        result = await run_command(
            ["git", *args], cwd=cwd, env=_git_env(), timeout=self.timeout, check=True
        )
        return result.stdout.decode(errors="replace")

    async def _ls_remote(self, ref: RemoteRef) -> tuple[str | None, bool]:
        """(commit the ref names, whether a tag and a branch share its name)."""
        name = ref.ref
        if name.startswith("refs/"):
            wanted = [f"{name}^{{}}", name]
        else:
            # GitHub's order: a tag wins over a branch of the same name.
            wanted = [f"refs/tags/{name}^{{}}", f"refs/tags/{name}", f"refs/heads/{name}"]
        out = await self._git("ls-remote", self.url(ref), *wanted)
        found: dict[str, str] = {}
        for line in out.splitlines():
            sha, _, refname = line.partition("\t")
            found[refname.strip()] = sha.strip()
        ambiguous = f"refs/tags/{name}" in found and f"refs/heads/{name}" in found
        return next((found[w] for w in wanted if w in found), None), ambiguous

    async def fetch(self, ref: RemoteRef, warn: Callable[[str], None]) -> FetchedAction:
        """The action's tree at the commit `ref` resolves to, fetched if needed."""
        owner, repo = ref.key
        lock = _RepoLock(self.root / "locks" / f"{owner}+{repo}.lock")
        async with lock:
            commit = await self._resolve_and_fetch(ref, warn)
            root = self._repo_dir(ref) / commit
            self._use(ref, root)
        with contextlib.suppress(OSError):
            os.utime(root)  # last use, for `preloop actions prune`
        directory = root / ref.path if ref.path else root
        if not directory.exists():
            raise ActionFetchError(
                f"action {ref}: {ref.slug} has no directory {ref.path!r} at {commit[:12]}"
            )
        return FetchedAction(ref, commit, root, directory)

    async def _resolve_and_fetch(self, ref: RemoteRef, warn: Callable[[str], None]) -> str:
        if ref.is_sha:
            commit = ref.ref.lower()
            if not (self._repo_dir(ref) / commit).is_dir():
                await self._fetch_commit(ref, commit)
            return commit
        record = self._read_record(ref)
        mine = self._run_commit(record)
        if mine is not None and (self._repo_dir(ref) / mine).is_dir():
            return mine
        before = str(record["commit"]) if record is not None else ""
        if (before and (self._repo_dir(ref) / before).is_dir()) or ref.ref.startswith("refs/"):
            # A resolution to check (usually unchanged): `ls-remote` first.
            resolved = await self._check_resolution(ref, before, warn)
        else:
            # Never fetched: resolving is fetching, one shallow clone.
            resolved = await self._clone_by_name(ref)
        self._write_record(ref, resolved, record)
        return resolved

    async def _check_resolution(
        self, ref: RemoteRef, before: str, warn: Callable[[str], None]
    ) -> str:
        """The commit `ref` names now (`ls-remote`), fetched if new; the
        previous resolution `before` (cached) when the remote is unreachable."""
        try:
            resolved, ambiguous = await self._ls_remote(ref)
        except (CommandFailed, CommandTimeout) as exc:
            why = f"{self.url(ref)} is unreachable ({git_failure(exc)})"
            if not before or not (self._repo_dir(ref) / before).is_dir():
                raise self._cant(ref, why) from None
            warn(f"action {ref}: {why}; using {ref.ref} = {before[:12]} as resolved before")
            return before
        if resolved is None:
            raise self._no_such_ref(ref)
        if not (self._repo_dir(ref) / resolved).is_dir():
            if ambiguous or ref.ref.startswith("refs/"):
                await self._fetch_commit(ref, resolved)
            else:
                resolved = await self._clone_by_name(ref)
        return resolved

    def _no_such_ref(self, ref: RemoteRef) -> ActionFetchError:
        return ActionFetchError(
            f"action {ref}: {self.url(ref)} has no branch or tag {ref.ref!r} "
            "(a commit must be given as its full 40-character SHA)"
        )

    async def _clone_by_name(self, ref: RemoteRef) -> str:
        """Resolves and fetches the branch or tag `ref.ref` with one shallow
        clone, as a user would run; returns its commit, now in the cache."""
        try:
            tmp, commit, is_tag = await self._fetch_into_tmp(ref, ref.ref, by_name=True)
        except ActionFetchError:
            # Why: the remote is unreachable, or has no such branch or tag?
            try:
                named, _ = await self._ls_remote(ref)
            except (CommandFailed, CommandTimeout) as exc:
                why = f"{self.url(ref)} is unreachable ({git_failure(exc)})"
                raise self._cant(ref, why) from None
            if named is None:
                raise self._no_such_ref(ref) from None
            raise
        if not is_tag:
            # `git clone --branch` takes a branch over a tag of the same name;
            # GitHub takes the tag.
            try:
                tagged, ambiguous = await self._ls_remote(ref)
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                raise
            if ambiguous and tagged is not None and tagged != commit:
                shutil.rmtree(tmp, ignore_errors=True)
                if not (self._repo_dir(ref) / tagged).is_dir():
                    await self._fetch_commit(ref, tagged)
                return tagged
        if (self._repo_dir(ref) / commit).is_dir():
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            self._publish(ref, tmp, commit)
        return commit

    async def _fetch_into_tmp(
        self, ref: RemoteRef, what: str, *, by_name: bool = False
    ) -> tuple[Path, str, bool]:
        """A shallow copy of `what` (a commit, or with `by_name` a branch or
        tag) in a new directory under tmp/, without its .git; its commit; and
        whether it came detached (a tag: `git clone --branch` detaches a tag's
        HEAD, not a branch's)."""
        tmp = self.root / "tmp" / f"{os.getpid()}-{uuid.uuid4().hex[:12]}"
        tmp.parent.mkdir(parents=True, exist_ok=True)
        url = self.url(ref)
        detached = False
        try:
            self.fetches += 1
            if by_name:
                # One process, as a user's `git clone` (a tag or a branch).
                await self._git(
                    "-c",
                    "advice.detachedHead=false",
                    "clone",
                    "-q",
                    "--depth",
                    "1",
                    "--no-tags",
                    "--branch",
                    what,
                    url,
                    str(tmp),
                )
                commit = _detached_head(tmp / ".git")
                detached = commit is not None
                if commit is None:
                    commit = (await self._git("-C", str(tmp), "rev-parse", "HEAD")).strip()
            else:
                await self._git("init", "-q", str(tmp))
                await self._git(
                    "-C", str(tmp), "fetch", "-q", "--depth", "1", "--no-tags", url, what
                )
                commit = (
                    await self._git("-C", str(tmp), "rev-parse", "FETCH_HEAD^{commit}")
                ).strip()
                await self._git(
                    "-C", str(tmp), "-c", "advice.detachedHead=false", "checkout", "-q", commit
                )
            self._discards.append(_discard(tmp / ".git", self.root / "tmp"))
        except CommandTimeout as exc:
            shutil.rmtree(tmp, ignore_errors=True)
            raise self._cant(ref, f"fetching from {url} timed out ({exc})") from None
        except CommandFailed as exc:
            shutil.rmtree(tmp, ignore_errors=True)
            raise self._cant(
                ref, f"cannot fetch {what!r} from {url} ({git_failure(exc)})"
            ) from None
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return tmp, commit, detached

    def _publish(self, ref: RemoteRef, tmp: Path, commit: str) -> None:
        final = self._repo_dir(ref) / commit
        final.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.rename(tmp, final)
        except OSError as exc:
            shutil.rmtree(tmp, ignore_errors=True)
            if not final.is_dir():
                raise ActionFetchError(f"action {ref}: cannot store it in {final}: {exc}") from None

    async def _fetch_commit(self, ref: RemoteRef, commit: str) -> None:
        tmp, got, _ = await self._fetch_into_tmp(ref, commit)
        if got != commit:  # pragma: no cover - git guarantees it
            shutil.rmtree(tmp, ignore_errors=True)
            raise ActionFetchError(f"action {ref}: fetched {got} instead of {commit}")
        self._publish(ref, tmp, commit)


@dataclass(frozen=True, slots=True)
class CachedAction:
    """One entry of the cache, for `preloop actions list`."""

    owner: str
    repo: str
    commit: str
    path: Path
    bytes: int
    last_use: float
    refs: tuple[str, ...]


def list_cached_actions(state_dir: Path) -> list[CachedAction]:
    root = actions_dir(state_dir)
    refs: dict[tuple[str, str, str], list[str]] = {}
    for record in sorted((root / "refs").glob("*/*/*.json")):
        try:
            commit = json.loads(record.read_text(encoding="utf-8"))["commit"]
        except (OSError, ValueError, KeyError, TypeError):
            continue
        key = (record.parent.parent.name, record.parent.name, str(commit))
        refs.setdefault(key, []).append(unquote(record.name[: -len(".json")]))
    out: list[CachedAction] = []
    for entry in sorted((root / "repos").glob("*/*/*")):
        if not entry.is_dir():
            continue
        owner, repo, commit = entry.parent.parent.name, entry.parent.name, entry.name
        try:
            size = tree_bytes(entry).apparent_bytes
            last_use = entry.stat().st_mtime
        except OSError:
            continue
        out.append(
            CachedAction(
                owner,
                repo,
                commit,
                entry,
                size,
                last_use,
                tuple(refs.get((owner, repo, commit), [])),
            )
        )
    return out


def prune_actions(
    state_dir: Path, *, older_than: float, dry_run: bool = False, now: float | None = None
) -> tuple[list[CachedAction], list[CachedAction]]:
    """Removes cached actions unused for `older_than` seconds (0: all). Returns
    (removed, kept busy): an action a run is using (its directory's shared
    lock is held) or whose repository is being fetched (its lock is held) is
    left alone. Resolution records of removed commits go too."""
    root = actions_dir(state_dir)
    now = time.time() if now is None else now
    removed: list[CachedAction] = []
    busy: list[CachedAction] = []
    for entry in list_cached_actions(state_dir):
        if now - entry.last_use < older_than:
            continue
        fd = try_lock(root / "locks" / f"{entry.owner}+{entry.repo}.lock")
        if fd is None:
            busy.append(entry)
            continue
        trash: Path | None = None
        try:
            use = _lock_directory(entry.path, fcntl.LOCK_EX)
            if use is None:
                busy.append(entry)
                continue
            try:
                if not dry_run:
                    # Out of sight first (atomic), then deleted.
                    trash = root / "tmp" / f"prune-{uuid.uuid4().hex[:12]}"
                    trash.parent.mkdir(parents=True, exist_ok=True)
                    os.rename(entry.path, trash)
                    refs = root / "refs" / entry.owner / entry.repo
                    for name in entry.refs:
                        record = refs / f"{quote(name, safe='')}.json"
                        with contextlib.suppress(FileNotFoundError):
                            record.unlink()
            finally:
                os.close(use)
        finally:
            os.close(fd)
        if trash is not None:
            shutil.rmtree(trash, ignore_errors=True)
        removed.append(entry)
    # Fetches that died half-way.
    for tmp in (root / "tmp").glob("*") if (root / "tmp").is_dir() else []:
        pid = tmp.name.split("-", 1)[0]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists() and not dry_run:
            shutil.rmtree(tmp, ignore_errors=True)
    return removed, busy
