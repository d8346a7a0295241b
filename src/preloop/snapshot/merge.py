"""Prebuilt merge capture: the merge of `head` into `base` of a local
repository (`git merge-tree --write-tree`, no work tree touched), committed with
both parents and the fixed snapshot identity. A conflict raises `MergeConflict`
listing the conflicting paths."""

from __future__ import annotations

import time
from pathlib import Path

import anyio

from preloop.snapshot import layout
from preloop.snapshot.cache import ensure_object_cache
from preloop.snapshot.capture import (
    CaptureLimits,
    CaptureState,
    Snapshot,
    create_run_repository,
    publish_verified,
    run_capture,
)
from preloop.snapshot.errors import MergeConflict, SnapshotCaptureTimeout, SnapshotError
from preloop.snapshot.gitcmd import git, git_env
from preloop.snapshot.hooks import AfterCapture
from preloop.snapshot.permits import NamespacePermits, namespace_from_url
from preloop.snapshot.work import CaptureFaults
from preloop.snapshot.workspace import commit_env

__all__ = ["capture_merge"]


async def _resolve(repo: Path, base: str, head: str) -> tuple[Path, Path, str, str, str, str]:
    env = git_env()
    info = await git(
        [
            "rev-parse",
            "--path-format=absolute",
            "--absolute-git-dir",
            "--git-common-dir",
            "--show-object-format",
        ],
        env=env,
        cwd=repo,
        check=False,
    )
    lines = info.stdout_text().split("\n")
    if info.returncode != 0 or len(lines) < 3:
        raise SnapshotError(
            f"{repo} is not a git repository ({info.stderr_text().strip()}): "
            "pass the path of a repository that has both refs"
        )
    oids = []
    for name in (base, head):
        if not name or name.startswith("-"):
            raise SnapshotError(f"{name!r} is not a valid ref in {repo}")
        found = await git(
            ["rev-parse", "--quiet", "--verify", f"{name}^{{commit}}"],
            env=env,
            cwd=repo,
            check=False,
        )
        if found.returncode != 0:
            raise SnapshotError(f"{name} does not name a commit in {repo}: fetch it or fix the ref")
        oids.append(found.stdout_text().strip())
    url = await git(["config", "--get", "remote.origin.url"], env=env, cwd=repo, check=False)
    return (
        Path(lines[0]),
        Path(lines[1]),
        lines[2],
        oids[0],
        oids[1],
        url.stdout_text().strip(),
    )


async def _merge_body(
    cap: CaptureState,
    repo: Path,
    common_dir: Path,
    object_format: str,
    base: tuple[str, str],
    head: tuple[str, str],
) -> Snapshot:
    entry = await ensure_object_cache(
        cap.state_dir,
        common_dir,
        [base[1], head[1]],
        run_id=cap.run_id,
        work=cap.work,
        record_head=False,
    )
    cap.pins.append(entry.pin)
    await cap.work.run(
        "create-repository",
        lambda: create_run_repository(
            cap.staging_repository,
            [entry.objects],
            object_format=object_format,
            run_id=cap.run_id,
            nonce=cap.nonce,
            kind="merge",
            namespace=cap.namespace,
            source=f"{repo} {head[0]} into {base[0]}",
        ),
    )
    entry.pin.drop()
    cache_env = git_env({"GIT_DIR": str(entry.repository)})
    merged = await git(
        ["merge-tree", "--write-tree", "--no-messages", "--name-only", "-z", base[1], head[1]],
        env=cache_env,
        check=False,
    )
    fields = merged.stdout.decode("utf-8", "surrogateescape").split("\0")
    if merged.returncode == 1:
        paths = list(dict.fromkeys(f for f in fields[1:] if f))
        raise MergeConflict(str(repo), base[0], head[0], paths)
    if merged.returncode != 0 or not fields[0]:
        raise SnapshotError(
            f"git merge-tree of {head[0]} into {base[0]} in {repo} failed: "
            f"{merged.stderr_text().strip()}"
        )
    tree = fields[0].strip()
    message = f"preloop merge of {head[0]} into {base[0]}"
    commit_args = ["commit-tree", "--no-gpg-sign", tree, "-p", base[1], "-p", head[1]]
    commit = (
        (await git([*commit_args, "-m", message], env=commit_env(cache_env))).stdout_text().strip()
    )
    await publish_verified(cap, commit, tree, entry.repository)
    return Snapshot(
        run_id=cap.run_id,
        kind="merge",
        repository=cap.run_repository,
        commit=commit,
        tree=tree,
        parents=(base[1], head[1]),
        cache_key=entry.key,
        namespace=cap.namespace,
        source=f"{repo} {head[0]} into {base[0]}",
    )


async def capture_merge(
    state_dir: Path,
    repo: Path,
    base: str,
    head: str,
    run_id: str,
    *,
    namespace: str | None = None,
    limits: CaptureLimits | None = None,
    permits: NamespacePermits | None = None,
    after_capture: AfterCapture | None = None,
    faults: CaptureFaults | None = None,
) -> Snapshot:
    """Snapshots the merge of `head` into `base` (refs or commits of the local
    repository `repo`); `MergeConflict` lists the paths when it does not merge."""
    repo = Path(repo).absolute()
    layout.validate_run_id(run_id)
    limits = limits or CaptureLimits()
    started = time.monotonic()
    try:
        with anyio.fail_after(limits.timeout):
            _git_dir, common_dir, fmt, base_oid, head_oid, url = await _resolve(repo, base, head)
    except TimeoutError:
        raise SnapshotCaptureTimeout(run_id, limits.timeout, []) from None
    if namespace is None:
        namespace = namespace_from_url(url or None)
    return await run_capture(
        state_dir,
        run_id,
        "merge",
        namespace,
        lambda cap: _merge_body(cap, repo, common_dir, fmt, (base, base_oid), (head, head_oid)),
        limits=limits,
        permits=permits,
        after_capture=after_capture,
        faults=faults,
        elapsed=time.monotonic() - started,
    )
