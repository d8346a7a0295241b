"""Snapshots through the store: publishing a run's snapshot as git bundles
(`preloop run`) and fetching it on a runner that shares only the store.

**Choosing the transport** (`snapshot_transport`): `PRELOOP_SNAPSHOT_TRANSPORT`
is `path` (runners clone the run repository at its path in the submitter's
state directory) or `store`; unset, it is `store` on PostgreSQL and `path`
on the lite store, which is only ever used on one machine.

**Publishing** (`publish_snapshot`): the newest stored bundle of the same
repository whose tip commit the submitter's object cache has, and whose
chain is shorter than `MAX_DEPTH`, is the base; the new bundle is written
thin against the base chain's newest tips, then one transaction checks
that the base chain is still whole, records the new bundle (storing it too
when it fits one chunk: a one-file edit costs one commit) and pins the
chain for the run. A base evicted meanwhile fails that check and the
publication starts over with a full bundle. The bundle is written by hand
(header, then `git pack-objects --thin --shallow`): `git bundle create`
excludes only the objects of the *ancestors* of the tips it is told to
leave out, but a snapshot commit is a sibling of the previous one (both
children of HEAD), and `--shallow` is what makes pack-objects leave out
every object of the tips' trees too, so a one-file edit uploads one blob and
the trees above it. Every tip left out is a prerequisite in the header, and
every prerequisite is in the chain: the chain stays whole.

**Fetching** (`fetch_snapshot`): the runner keeps one bare repository per
submitter repository in its own object cache
(`<state>/snapshot-object-cache/<repo key>.git`, under the entry's lock),
fetches the bundles of the chain whose tip it lacks, root first (each
fetch checks the bundle's prerequisites and connectivity), then makes a run
repository in its own state directory borrowing that entry's objects (the
same layout as a capture's: the object-cache prune sees the reference), held
by this process (`preloop.snapshot.holders`: a dead runner's is swept).
A fetch counts as a use of the entry, and the object-cache cap
(`PRELOOP_SNAPSHOT_OBJECT_CACHE_MAX_BYTES`) is then applied as after a capture.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import secrets
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import anyio

from preloop import config
from preloop.control.blobs import BlobInfo, BlobMissing
from preloop.errors import PreloopError, UsageError
from preloop.process import CommandFailed, run_command_status
from preloop.snapshot import layout
from preloop.snapshot.bundles import BUNDLE_KIND, BundleRow, SnapshotBundles
from preloop.snapshot.cache import init_cache_entry, missing_objects
from preloop.snapshot.capture import SNAPSHOT_REF
from preloop.snapshot.errors import SnapshotError
from preloop.snapshot.gitcmd import BASE_CONFIG, git, git_env
from preloop.snapshot.hooks import run_after_capture
from preloop.snapshot.locks import CachePin, acquire_cache_lock_async
from preloop.snapshot.restore import held_run_repository, object_format_of

__all__ = [
    "MAX_DEPTH",
    "FetchError",
    "Published",
    "fetch_snapshot",
    "publish_snapshot",
    "snapshot_transport",
]

#: A chain this long starts over with a full bundle (a runner new to the
#: repository fetches at most this many bundles).
MAX_DEPTH = 32
#: The newest tips of the base chain a new bundle leaves out.
_NOT_TIPS = 8
_PUBLISH_ATTEMPTS = 3
_BUNDLES_REF = "refs/preloop/bundles"


class FetchError(PreloopError):
    """A run's snapshot could not be fetched from the store."""


def snapshot_transport(dialect: str) -> str:
    """`path` or `store` for a store of `dialect` (`lite` or `pg`), from
    `PRELOOP_SNAPSHOT_TRANSPORT`; `store` on the lite store is a usage error."""
    asked = str(config.get("PRELOOP_SNAPSHOT_TRANSPORT"))
    if dialect != "pg":
        if asked == "store":
            raise UsageError(
                "PRELOOP_SNAPSHOT_TRANSPORT=store needs the PostgreSQL store "
                "(--store postgresql://...); the lite store runs every job on this machine: "
                "unset it or set it to path"
            )
        return "path"
    return asked or "store"


@dataclass(frozen=True, slots=True)
class Published:
    """A snapshot in the store: the chain of bundle digests (root first)
    that brings `commit`, and the bundle this publication uploaded (None:
    a stored chain already brought the commit)."""

    repo_key: str
    commit: str
    chain: tuple[str, ...]
    uploaded: BlobInfo | None


def _object_dirs(git_dir: Path) -> list[Path]:
    dirs = [git_dir / "objects"]
    with contextlib.suppress(OSError):
        text = (git_dir / "objects" / "info" / "alternates").read_text()
        dirs += [Path(line) for line in text.splitlines() if line and not line.startswith("#")]
    return dirs


async def _absent(git_dir: Path, oids: list[str]) -> set[str]:
    """Which of `oids` the repository at `git_dir` (with its alternates) lacks."""
    # Snapshot commits are loose objects of the object cache (captures write
    # them so): a stat each spares a git process on the upload's path.
    dirs = _object_dirs(git_dir)
    oids = [o for o in oids if not any((d / o[:2] / o[2:]).exists() for d in dirs)]
    return set(await missing_objects(git_dir, oids))


async def write_bundle(git_dir: Path, commit: str, not_tips: list[str], dest: Path) -> None:
    """Writes a bundle of `commit` (as `refs/heads/snapshot`) to `dest`,
    without the objects reachable from `not_tips` nor those of their trees;
    `not_tips` are its prerequisites."""
    fmt = object_format_of(commit)
    header = "# v2 git bundle\n" if fmt == "sha1" else f"# v3 git bundle\n@object-format={fmt}\n"
    header += "".join(f"-{t}\n" for t in not_tips)
    header += f"{commit} {SNAPSHOT_REF}\n\n"
    revs = "".join([f"{commit}\n", *(f"^{t}\n" for t in not_tips)])
    argv = [
        "git",
        *BASE_CONFIG,
        "pack-objects",
        "--revs",
        "--stdout",  # --thin packs only go to stdout
        "--thin",
        "--shallow",  # leave out the objects of every excluded tip's tree
        "--delta-base-offset",
        "--quiet",
    ]
    errors = dest.with_name(dest.name + ".err")
    try:
        with open(dest, "wb") as out, open(errors, "wb") as err:
            out.write(header.encode())
            out.flush()
            # The pack goes straight to the file: a full bundle may be large.
            result = await run_command_status(
                argv,
                env=git_env({"GIT_DIR": str(git_dir)}),
                stdin=revs.encode(),
                stdout=out,
                stderr=err,
            )
        if result.returncode != 0:
            detail = errors.read_text(errors="replace").strip().splitlines()
            raise SnapshotError(
                f"git pack-objects of snapshot {commit[:12]} in {git_dir} failed: "
                f"{detail[-1] if detail else f'status {result.returncode}'}"
            )
    finally:
        errors.unlink(missing_ok=True)


def _base(rows: dict[str, BundleRow], absent: set[str]) -> tuple[BundleRow | None, list[BundleRow]]:
    """The newest usable base (its tip present here, its chain whole and
    shorter than `MAX_DEPTH`) and its chain; (None, []) for none."""
    for row in sorted(rows.values(), key=lambda r: r.created_at, reverse=True):
        if row.tip in absent or row.depth + 1 >= MAX_DEPTH:
            continue
        chain = SnapshotBundles.chain(rows, row.digest)
        if chain is not None:
            return row, chain
    return None, []


async def publish_snapshot(
    bundles: SnapshotBundles,
    git_dir: Path,
    repo_key: str,
    commit: str,
    run_key: str,
    *,
    max_bytes: int | None = None,
) -> Published:
    """Publishes `commit` of the run repository `git_dir` (its objects those
    of object-cache entry `repo_key`) as a chain of bundles held for run
    `run_key` (release it with `bundles.release(run_key)`), then keeps the
    stored bundles under `max_bytes` (default `PRELOOP_SNAPSHOT_STORE_MAX_BYTES`)."""
    if max_bytes is None:
        max_bytes = int(config.get("PRELOOP_SNAPSHOT_STORE_MAX_BYTES"))
    for attempt in range(_PUBLISH_ATTEMPTS):
        rows = await anyio.to_thread.run_sync(bundles.stored, repo_key)
        exact = next((r for r in rows.values() if r.tip == commit and not attempt), None)
        exact_chain = SnapshotBundles.chain(rows, exact.digest) if exact else None
        try:
            if exact_chain is not None:
                chain = tuple(r.digest for r in exact_chain)
                await anyio.to_thread.run_sync(bundles.hold, run_key, repo_key, chain)
                return Published(repo_key, commit, chain, None)
            absent = await _absent(git_dir, sorted({r.tip for r in rows.values()}))
            base, base_chain = _base(rows, absent) if attempt == 0 else (None, [])
            held = [r.digest for r in base_chain]
            not_tips = [r.tip for r in base_chain if r.tip not in absent][-_NOT_TIPS:]
            dest = git_dir / f"preloop-bundle-{secrets.token_hex(6)}.tmp"
            try:
                await write_bundle(git_dir, commit, not_tips, dest)
                size = dest.stat().st_size
                data = dest.read_bytes() if size <= bundles.blobs.CHUNK else None
                if data is None:
                    info = await anyio.to_thread.run_sync(bundles.blobs.put_file, dest, BUNDLE_KIND)
                else:
                    digest = hashlib.sha256(data).hexdigest()
                    info = BlobInfo(digest, size, BUNDLE_KIND, time.time())
            finally:
                dest.unlink(missing_ok=True)
            new = BundleRow(
                info.digest,
                repo_key,
                commit,
                base.digest if base else None,
                base.depth + 1 if base else 0,
                time.time(),
            )
            chain = (*held, info.digest)
            # One transaction checks that the base chain is still whole, stores
            # a small bundle, records it and pins the chain: the base may have
            # been evicted while the bundle was written (then: BlobMissing),
            # but never once it is held.
            hold = functools.partial(bundles.hold, run_key, repo_key, chain, new, data)
            await anyio.to_thread.run_sync(hold)
        except BlobMissing:
            # Evicted between the read and the hold: start over (the second
            # attempt builds a full bundle, which depends on nothing stored).
            await anyio.to_thread.run_sync(bundles.release, run_key)
            continue
        await anyio.to_thread.run_sync(bundles.evict, max_bytes)
        return Published(repo_key, commit, chain, info)
    raise SnapshotError(
        f"the snapshot {commit[:12]} could not be stored: its bundles were evicted as it was "
        "being published, again and again; raise PRELOOP_SNAPSHOT_STORE_MAX_BYTES"
    )


# --------------------------------------------------------------------- runner


def _work_area(state_dir: Path) -> Path:
    # Under the host's job directory, named `<pid>-...`: `sweep_work_dir`
    # removes what a dead runner left.
    from preloop.runner.checkout import work_dir

    return work_dir(state_dir) / f"{os.getpid()}-bundles-{secrets.token_hex(6)}"


async def _ensure_entry(state_dir: Path, key: str) -> Path:
    repository = layout.cache_repository(state_dir, key)
    if repository.is_dir():
        return repository
    tmp = layout.cache_tmp_clone_path(state_dir, key, secrets.token_hex(6))
    try:
        await init_cache_entry(tmp)
        os.rename(tmp, repository)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return repository


async def fetch_snapshot(
    bundles: SnapshotBundles,
    state_dir: Path,
    repo_key: str,
    chain: tuple[str, ...],
    commit: str,
    where: str,
) -> str:
    """Brings `commit` into this host's object cache from the bundles of
    `chain` it lacks and returns the name of a run repository
    (`<state>/snapshots/<name>`, branch `snapshot` at `commit`) held by this
    process; `release_run_repository(state_dir, name)` removes it."""
    state_dir = Path(state_dir).absolute()
    try:
        layout.cache_repository(state_dir, repo_key)
    except ValueError:
        raise FetchError(
            f"{where}: the run's snapshot names no valid repository key ({repo_key!r}); "
            "resubmit it with `preloop run`"
        ) from None
    lock = await acquire_cache_lock_async(state_dir, repo_key)
    try:
        repository = await _ensure_entry(state_dir, repo_key)
        fetched = bool(await _absent(repository, [commit]))
        if fetched:
            await _fetch_chain(bundles, state_dir, repository, chain, where)
            if await _absent(repository, [commit]):
                raise FetchError(
                    f"{where}: the run's snapshot bundles do not bring its commit "
                    f"{commit[:12]}: resubmit the run with `preloop run`"
                )
            # The entry's last use, for the object-cache cap's LRU order.
            last = layout.cache_last_head_path(state_dir, repo_key)
            tmp = last.with_name(f".{last.name}.{secrets.token_hex(4)}.tmp")
            tmp.write_text(commit + "\n")
            os.rename(tmp, last)
        pin = CachePin.create(state_dir, repo_key)
    finally:
        lock.release()
    name = f"fetched-{commit[:12]}-{os.getpid()}-{secrets.token_hex(4)}"
    try:
        held_run_repository(state_dir, name, repository, commit, f"store:{repo_key}")
    finally:
        pin.drop()  # the run repository's alternates protect the entry from here on
    if fetched:
        # As after a capture: the object-cache cap (a background prune) applies
        # to a runner's cache too; entries its run repositories use are kept.
        await run_after_capture(state_dir, repo_key)
    return name


async def _fetch_chain(
    bundles: SnapshotBundles,
    state_dir: Path,
    repository: Path,
    chain: tuple[str, ...],
    where: str,
) -> None:
    rows = await anyio.to_thread.run_sync(bundles.rows, list(chain))
    lost = [d for d in chain if d not in rows]
    if lost:
        raise FetchError(
            f"{where}: snapshot bundle {lost[0][:12]} of the run is no longer in the store "
            "(evicted after its run ended?): resubmit the run with `preloop run`"
        )
    absent = await _absent(repository, [rows[d].tip for d in chain])
    area = _work_area(state_dir)
    area.mkdir(parents=True)
    try:
        for digest in chain:
            tip = rows[digest].tip
            if tip not in absent:
                continue
            path = area / f"{digest}.bundle"
            try:
                await anyio.to_thread.run_sync(bundles.blobs.read_to_file, digest, path)
            except BlobMissing as exc:
                raise FetchError(
                    f"{where}: snapshot bundle {digest[:12]} of the run: {exc}: resubmit the "
                    "run with `preloop run`"
                ) from None
            try:
                await git(
                    [
                        "fetch",
                        "--quiet",
                        "--no-tags",
                        "--no-write-fetch-head",
                        path,
                        f"+{SNAPSHOT_REF}:{_BUNDLES_REF}/{tip}",
                    ],
                    env=git_env({"GIT_DIR": str(repository)}),
                )
            except CommandFailed as exc:
                lines = exc.result.stderr_text().strip().splitlines()
                detail = lines[-1] if lines else f"status {exc.result.returncode}"
                raise FetchError(
                    f"{where}: snapshot bundle {digest[:12]} could not be fetched into "
                    f"{repository}: {detail}; remove that directory and retry"
                ) from None
            path.unlink()
    finally:
        shutil.rmtree(area, ignore_errors=True)
