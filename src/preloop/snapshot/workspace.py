"""Local workspace capture: a commit holding exactly what `git add -A` in the
workspace would stage, built without changing anything in the workspace.

git runs against the *workspace's own repository* (`GIT_DIR`, `GIT_WORK_TREE`),
so its `.gitignore` files, `info/exclude`, `core.excludesFile`, attributes
(`eol`, filters), `core.autocrlf` and `core.fileMode` apply as they would for
the user, but every write is redirected:

- the index is a private file in the staging directory (`GIT_INDEX_FILE`);
- new objects go to the cache entry (`GIT_OBJECT_DIRECTORY`), the workspace's
  objects are only read (`GIT_ALTERNATE_OBJECT_DIRECTORIES`);
- hooks, auto-gc and signing are off; `GIT_OPTIONAL_LOCKS=0`;
- the private index is split against a shared index in the cache entry, and
  no command run in the workspace's repository writes a shared index (see
  `preloop.snapshot.index`).

The index (see `preloop.snapshot.index`): the first capture seeds it from a
copy of the workspace's index; later ones start from the persisted
`<key>.index` sidecar, fixed up or reset to the workspace index's tracked set,
so only files changed since the last capture are rehashed. `git add -A` then
adds untracked-not-ignored files, drops deleted ones and rehashes changed ones.
Nested repositories that `git add -A` would record as new gitlinks
(unregistered) are dropped; registered submodules stay gitlinks at their
checked-out commit.

Sparse checkout (`core.sparseCheckout`): `git add -A --sparse`, so files
outside the sparse patterns are read like any other, except the entries that
are not checked out (skip-worktree bit), which stay as the index has them.
Those bits then decide what is read, and they are in no tree: a reset keeps
the persisted index's bits on unchanged entries and sets none on new ones, a
fix-up keeps them all, and git clears the bit of a file it finds in the work
tree on every index read, so even an index built from the very same
workspace index can lack a bit that one still has. Every capture therefore
seeds from the workspace index; its index is neither split nor persisted
(nor is the persisted index of captures without sparse checkout touched).

Objects the new tree needs that only the workspace's object store has (staged
blobs, for instance) are copied into the cache (one pack) before publication,
so a run repository only ever depends on its cache entry.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import re
import secrets
import shutil
import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import anyio

from preloop.process import CommandFailed, CommandResult
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
from preloop.snapshot.errors import SnapshotCaptureTimeout, SnapshotError
from preloop.snapshot.gitcmd import git, git_env
from preloop.snapshot.hooks import AfterCapture
from preloop.snapshot.index import (
    EMPTY_TREE,
    HASH_BYTES,
    MAX_FIXUP_PATHS,
    MEMO_NAME,
    SPLIT_INDEX_KEEP,
    IndexBase,
    TreeChange,
    changed_entries,
    copy_if_exists,
    link_if_exists,
    link_shared_index,
    needs_new_shared_index,
    read_trailer,
    remove_if_exists,
    remove_stale_shared_temps,
    shared_index_path,
    split_index_base,
    split_index_write,
)
from preloop.snapshot.permits import NamespacePermits, namespace_from_url
from preloop.snapshot.work import BlockingWork, CaptureFaults

__all__ = [
    "SNAPSHOT_IDENTITY",
    "Repository",
    "capture_workspace",
    "commit_env",
    "inspect_repository",
]

# Fixed identity and date: the same tree on the same parents is the same commit.
# The capture's own commit is dated as its parent was committed instead (the
# same determinism): a job's `git log -1 --format=%ct`, SOURCE_DATE_EPOCH
# taken from it, must not read 1970 (`snapshot_date`).
SNAPSHOT_IDENTITY = {
    "GIT_AUTHOR_NAME": "preloop",
    "GIT_AUTHOR_EMAIL": "preloop@snapshot.invalid",
    "GIT_AUTHOR_DATE": "@0 +0000",
    "GIT_COMMITTER_NAME": "preloop",
    "GIT_COMMITTER_EMAIL": "preloop@snapshot.invalid",
    "GIT_COMMITTER_DATE": "@0 +0000",
}

_EMBEDDED = "warning: adding embedded git repository: "
SNAPSHOT_MESSAGE = "preloop snapshot"


def commit_env(base: dict[str, str]) -> dict[str, str]:
    """`base` plus the fixed snapshot identity and date."""
    return {**base, **SNAPSHOT_IDENTITY}


def snapshot_commit(
    tree: str, parents: tuple[str, ...], encoding: str | None, date: str | None = None
) -> bytes:
    """The body of the commit `git commit-tree <tree> -p <parent>... -m "preloop
    snapshot"` writes under `commit_env` (and `i18n.commitEncoding` = `encoding`),
    byte for byte: git adds the encoding header unless it names UTF-8. `date`
    (`<seconds> <+hhmm>`, as `snapshot_date` reads it) replaces the fixed one
    for author and committer, as `GIT_*_DATE=@<date>` would."""

    def ident(who: str) -> str:
        name = SNAPSHOT_IDENTITY[f"GIT_{who}_NAME"]
        email = SNAPSHOT_IDENTITY[f"GIT_{who}_EMAIL"]
        when = date or SNAPSHOT_IDENTITY[f"GIT_{who}_DATE"].lstrip("@")
        return f"{name} <{email}> {when}"

    lines = [f"tree {tree}", *(f"parent {p}" for p in parents)]
    lines += [f"author {ident('AUTHOR')}", f"committer {ident('COMMITTER')}"]
    if encoding is not None and encoding.lower() not in ("utf-8", "utf8"):
        lines.append(f"encoding {encoding}")
    return ("\n".join(lines) + "\n\n" + SNAPSHOT_MESSAGE + "\n").encode("utf-8", "surrogateescape")


_COMMITTER_DATE = re.compile(rb"^committer [^\n]*> (\d+ [+-]\d{4})$", re.MULTILINE)


def snapshot_date(commit_body: bytes) -> str | None:
    """The committer date of a commit object's body (`git cat-file commit`),
    as `<seconds> <+hhmm>`; None when it has none git would write."""
    header = commit_body.split(b"\n\n", 1)[0]
    found = _COMMITTER_DATE.search(header)
    return found.group(1).decode("ascii") if found else None


def write_loose_object(objects: Path, kind: str, body: bytes, object_format: str) -> str:
    """Writes `body` as a loose object of `kind` into the object directory
    `objects` the way git does (a temporary file in its fan-out directory, then
    a no-replace link, read-only); an object already there is freshened (mtime)
    instead, as git's `write_object_file` does. Returns its id."""
    raw = f"{kind} {len(body)}\0".encode() + body
    oid = hashlib.new(object_format, raw).hexdigest()
    fan_out = objects / oid[:2]
    path = fan_out / oid[2:]
    try:
        os.utime(path)
        return oid
    except FileNotFoundError:
        pass
    except OSError:  # not ours to touch (git then writes and finds it there)
        if os.path.lexists(path):
            return oid
    fan_out.mkdir(exist_ok=True)
    tmp = fan_out / f"tmp_obj_{secrets.token_hex(6)}"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o444)
        try:
            os.write(fd, zlib.compress(raw, 1))
        finally:
            os.close(fd)
        # FileExistsError: written meanwhile by another capture, the same bytes.
        with contextlib.suppress(FileExistsError):
            os.link(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return oid


@dataclass(frozen=True, slots=True)
class Repository:
    """A workspace's repository as git sees it."""

    toplevel: Path
    git_dir: Path
    common_dir: Path
    objects: Path
    object_format: str
    head: str | None
    head_tree: str | None
    origin_url: str | None
    commit_encoding: str | None = None  # i18n.commitEncoding, when set
    sparse_checkout: bool = False  # core.sparseCheckout


async def inspect_repository(workspace: Path) -> Repository:
    """Finds the repository of `workspace` (a work tree or a directory in one).
    The three questions are asked concurrently: they are independent."""
    if not workspace.is_dir():
        raise SnapshotError(f"workspace {workspace} is not a directory: pass a git work tree")
    env = git_env()
    results: dict[str, CommandResult] = {}

    async def ask(name: str, args: list[str]) -> None:
        results[name] = await git(args, env=env, cwd=workspace, check=False)

    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(
                ask,
                "where",
                [
                    "rev-parse",
                    "--path-format=absolute",
                    "--is-inside-work-tree",
                    "--show-toplevel",
                    "--absolute-git-dir",
                    "--git-common-dir",
                    "--git-path",
                    "objects",
                    "--show-object-format",
                    "HEAD^{commit}",
                    "HEAD^{tree}",
                ],
            )
            # Last value of each, as `git config --get` would print it.
            tg.start_soon(
                ask,
                "config",
                [
                    "config",
                    "-z",
                    "--get-regexp",
                    r"^(remote\.origin\.url|i18n\.commitencoding|core\.sparsecheckout)$",
                ],
            )
    except ExceptionGroup as group:  # one failed (git missing?): report it alone
        raise group.exceptions[0] from None
    where, config = results["where"], results["config"]
    values: dict[str, str | None] = {}
    if config.returncode == 0:
        for item in config.stdout.decode("utf-8", "surrogateescape").split("\0"):
            key, newline, value = item.partition("\n")
            if key:
                values[key] = value if newline else None  # None: a key with no `=`
    lines = where.stdout_text().splitlines()
    # The flags print before HEAD is resolved: an unborn HEAD leaves them intact.
    unborn = where.returncode != 0 and "unknown revision" in where.stderr_text()
    if len(lines) < 6 or lines[0] != "true" or (where.returncode != 0 and not unborn):
        raise SnapshotError(
            f"workspace {workspace} is not inside a git work tree "
            f"({where.stderr_text().strip() or 'bare repository'}): "
            "run `git init` there or pass the path of a checkout"
        )
    head_commit: str | None = None
    head_tree: str | None = None
    if not unborn:
        if len(lines) != 8:
            raise SnapshotError(
                f"cannot resolve HEAD of {lines[1]}: {where.stderr_text().strip()}; "
                "run `git fsck` in the repository"
            )
        head_commit, head_tree = lines[6], lines[7]
    origin = values.get("remote.origin.url")
    return Repository(
        toplevel=Path(lines[1]),
        git_dir=Path(lines[2]),
        common_dir=Path(lines[3]),
        objects=Path(lines[4]),
        object_format=lines[5],
        head=head_commit,
        head_tree=head_tree,
        origin_url=origin.strip() if origin is not None else None,
        commit_encoding=values.get("i18n.commitencoding"),
        sparse_checkout=_config_bool(values.get("core.sparsecheckout", "false")),
    )


_CONFIG_INT = re.compile(r"[+-]?(?:0x([0-9a-f]+)|([0-9]+))[kmg]?")


def _config_bool(value: str | None) -> bool:
    """A git boolean as git reads it: a key with no value is true, an empty
    one false, an integer true unless 0. Anything else is false here: git
    refuses it itself, in the capture's first command."""
    if value is None:
        return True
    value = value.strip().lower()
    if value in ("true", "yes", "on"):
        return True
    number = _CONFIG_INT.fullmatch(value)  # strtoimax, base 0, a unit suffix
    return number is not None and (number.group(1) or number.group(2)).strip("0") != ""


def _move_into_place(src: Path, dst: Path) -> None:
    try:
        os.rename(src, dst)
    except OSError as exc:
        if exc.errno != errno.EXDEV:
            raise
        tmp = dst.with_name(f".{dst.name}.tmp")
        shutil.copy2(src, tmp)
        os.rename(tmp, dst)


async def _workspace_index_tree(
    cap: CaptureState, repo: Repository, env: dict[str, str]
) -> str | None:
    """The tree of the workspace's index (written from a copy of it), the
    empty tree without an index, or None when it has unmerged entries."""
    copy = cap.staging / "workspace-index"
    if not await cap.work.run("copy-index", copy_if_exists, repo.git_dir / "index", copy):
        return EMPTY_TREE[repo.object_format]
    result = await git(["write-tree"], env={**env, "GIT_INDEX_FILE": str(copy)}, check=False)
    if result.returncode != 0:
        return None
    return result.stdout_text().strip()


def _existing(toplevel: Path, paths: list[str]) -> list[str]:
    return [p for p in paths if os.path.lexists(toplevel / p)]


async def _ignored(env: dict[str, str], toplevel: Path, paths: list[str]) -> list[str]:
    """Those of `paths` that the workspace's ignore rules ignore now."""
    if not paths:
        return []
    ignored = await git(
        ["check-ignore", "--no-index", "-z", "--stdin"],
        env=env,
        cwd=toplevel,
        stdin="".join(f"{p}\0" for p in paths).encode("utf-8", "surrogateescape"),
        check=False,
    )
    if ignored.returncode not in (0, 1):
        raise SnapshotError(
            f"git check-ignore failed in {toplevel}: {ignored.stderr_text().strip()}"
        )
    return [p for p in ignored.stdout.decode("utf-8", "surrogateescape").split("\0") if p]


async def _fix_up(
    cap: CaptureState, repo: Repository, env: dict[str, str], memo: IndexBase, split: bool
) -> None:
    """Brings the persisted index's tracked set back to the workspace index's
    (see `preloop.snapshot.index`), writing the index only when needed.

    - Paths the last capture added (untracked then) may stay: `git add -A`
      updates or removes them as it would untracked files, unless they are
      ignored now; those are removed after `git add -A` (`_add_all_keeping`
      asks `check-ignore` while `git add -A` runs: same index, one process
      off the critical path).
    - Paths the last capture dropped (deleted then) are restored only if they
      exist again: if they are still missing, `git add -A` would drop them anyway.
    """
    info: list[str] = []
    if memo.dropped:
        back = set(
            await cap.work.run(
                "stat-dropped", _existing, repo.toplevel, [p for _, _, p in memo.dropped]
            )
        )
        info += [f"{mode} {oid}\t{path}\0" for mode, oid, path in memo.dropped if path in back]
    if info:
        await git(
            [*_keep_split(split), "update-index", "-z", "--index-info"],
            env=env,
            stdin="".join(info).encode("utf-8", "surrogateescape"),
        )


def _keep_split(split: bool) -> tuple[str, ...]:
    """The config for a command run in the workspace's repository that writes
    the capture's index (see `preloop.snapshot.index`)."""
    return SPLIT_INDEX_KEEP if split else ()


@dataclass(frozen=True, slots=True)
class _Base:
    """What the capture's index starts from, read in one blocking step: the
    workspace index's checksum and, when there is a persisted index (now
    linked as the capture's index), its checksum and memo (trusted: it names
    the index's shared index, when split, linked beside it)."""

    ws_checksum: str | None
    persisted: bool
    checksum: str | None = None
    memo: IndexBase | None = None

    @property
    def shared_index(self) -> str | None:
        return self.memo.shared_index if self.memo is not None else None


def _keep_link(index: Path) -> None:
    """Gives the index file `index` a second name beside it (`<index>.kept`,
    replaced if there) so that it is not freed when git, or the persist step,
    renames another index over it: freeing a 5 MB file whose writeback is still
    in flight costs 4-8 ms inside that rename (ext4), on the capture's critical
    path. The staging directory's removal frees it at the end. Best effort."""
    kept = index.with_name(index.name + ".kept")
    with contextlib.suppress(FileNotFoundError):
        kept.unlink()
    with contextlib.suppress(OSError):
        os.link(index, kept)


def _read_base(
    ws_index: Path, persisted: Path, index: Path, memo_path: Path, fmt: str, shared_dir: Path
) -> _Base:
    ws_checksum = read_trailer(ws_index, fmt)
    if not link_if_exists(persisted, index):
        return _Base(ws_checksum, False)
    # The persisted index keeps a name in staging: persisting this capture's
    # index over it then frees nothing (see _keep_link).
    with contextlib.suppress(OSError):
        os.link(index, index.with_name("persisted-index.kept"))
    checksum = read_trailer(index, fmt)
    memo = IndexBase.load(memo_path)
    if memo is None or checksum is None or memo.index_checksum != checksum:
        # Unknown: a reset reads it, and if it is split against a shared
        # index that is not beside it, fails and the capture seeds.
        return _Base(ws_checksum, True, checksum, None)
    if memo.shared_index is None:
        return _Base(ws_checksum, True, checksum, memo)
    linked = shared_index_path(index.parent, memo.shared_index)
    if (
        not link_shared_index(shared_dir, index.parent, memo.shared_index)
        # git names a shared index by its trailing checksum and reads it
        # without verifying it: one that is not whole (an unsynced write
        # after a power loss) would fail every command that reads the index.
        or read_trailer(linked, fmt) != memo.shared_index
    ):
        index.unlink()  # its shared index is gone or damaged: seed
        return _Base(ws_checksum, False)
    return _Base(ws_checksum, True, checksum, memo)


async def _prepare_index(
    cap: CaptureState, repo: Repository, env: dict[str, str], base: _Base
) -> tuple[str | None, list[str], str | None]:
    """Fills the capture's index from `base` (see `preloop.snapshot.index`);
    returns the workspace index's tree when it was computed (else None), the
    paths the last capture added, which must leave the index if they are
    ignored now, and the shared index when the index is a split index of ours."""
    shared = base.shared_index
    index = Path(env["GIT_INDEX_FILE"])
    ws_checksum = base.ws_checksum
    if base.persisted:
        memo, checksum = base.memo, base.checksum
        ws_tree: str | None = None
        if memo is not None and checksum is not None and memo.index_checksum == checksum:
            if ws_checksum is not None and memo.ws_index_checksum == ws_checksum:
                ws_tree = memo.ws_tree
            else:
                ws_tree = await _workspace_index_tree(cap, repo, env)
            if ws_tree is not None and ws_tree == memo.ws_tree:
                await _fix_up(cap, repo, env, memo, shared is not None)
                return ws_tree, memo.added, shared
        if ws_tree is None:
            ws_tree = await _workspace_index_tree(cap, repo, env)
        if ws_tree is not None:
            reset = await git(
                [*_keep_split(shared is not None), "read-tree", "--reset", ws_tree],
                env=env,
                check=False,
            )
            if reset.returncode == 0:
                return ws_tree, [], shared
    await cap.work.run("remove-index", remove_if_exists, index)
    await cap.work.run("copy-index", copy_if_exists, repo.git_dir / "index", index)
    return None, [], None


_NO_COMMIT = re.compile(r"^error: '(.+)/' does not have a commit checked out$", re.M)
# A file whose `working-tree-encoding` git cannot convert from (sphinx's
# tests/roots/*/wrongenc.inc: `iso-8859`, no iconv charset): `git add` stops
# there, though its checkout (GitHub's too) only warned. It keeps the entry
# the index had, the committed content.
_NO_ENCODING = re.compile(r"^fatal: failed to encode '(.+)' from \S+ to UTF-8$", re.M)


async def _add_all(env: dict[str, str], toplevel: Path, split: bool, sparse: bool) -> CommandResult:
    """`git add --all`, leaving out nested repositories with no commit yet (git
    refuses to add them at all; with a commit they become gitlinks, which
    `_drop_unregistered_repositories` drops): they are left out of the
    snapshot like every other nested repository that is not a submodule.

    In sparse checkout, `--sparse`: without it git refuses untracked files
    outside the sparse patterns and skips, silently, tracked files there that
    are checked out (no skip-worktree bit). Entries with the bit stay as they
    are either way (`run_diff_files` skips them). Outside sparse checkout it
    would change nothing that matters here (git 2.39's `path_in_sparse_checkout`
    is true for every path; only a pathspec that matches nothing but
    skip-worktree entries stops being an error), so it is left out: the
    command stays as it was, and git before 2.34 does not know the option."""
    excluded: list[str] = []
    while True:
        args = [*_keep_split(split), "add", *(("--sparse",) if sparse else ()), "--all"]
        if excluded:
            args += ["--", ".", *(f":(exclude,literal){p}" for p in excluded)]
        added = await git(args, env=env, cwd=toplevel, check=False)
        stderr = added.stderr_text()
        found = [
            p
            for p in (*_NO_COMMIT.findall(stderr), *_NO_ENCODING.findall(stderr))
            if p not in excluded
        ]
        if added.ok or not found or len(excluded) > 10_000:
            break
        excluded += found
    if not added.ok:
        # The same error as a checked call, naming the command and git's message.
        await git(args, env=env, cwd=toplevel)
    return added


async def _add_all_keeping(
    cap: CaptureState, env: dict[str, str], repo: Repository, recheck: list[str], split: bool
) -> CommandResult:
    """`_add_all`, then drops from the index the nested repositories it added
    as gitlinks (unregistered) and those of `recheck` that are ignored now;
    the ignore check runs alongside `git add -A` (it reads no index)."""
    done: dict[str, object] = {}

    async def add() -> None:
        done["added"] = await _add_all(env, repo.toplevel, split, repo.sparse_checkout)

    async def check() -> None:
        done["ignored"] = await _ignored(env, repo.toplevel, recheck)

    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(add)
            tg.start_soon(check)
    except ExceptionGroup as group:
        raise group.exceptions[0] from None
    added = cast(CommandResult, done["added"])
    drop = cast(list[str], done["ignored"]) + [
        line[len(_EMBEDDED) :]
        for line in added.stderr_text().splitlines()
        if line.startswith(_EMBEDDED)
    ]
    if drop:
        # Mode 0 removes the entry; paths are index paths, never pathspecs.
        zero = "0" * (2 * HASH_BYTES[repo.object_format])
        if split:
            # Keep it split only if `git add` kept it split: on an unsplit
            # index, core.splitIndex=true would write a shared index into the
            # workspace's git directory.
            index = Path(env["GIT_INDEX_FILE"])
            base = await cap.work.run("split-check", split_index_base, index, repo.object_format)
            split = base is not None
        await git(
            [*_keep_split(split), "update-index", "-z", "--index-info"],
            env=env,
            stdin="".join(f"0 {zero}\t{p}\0" for p in drop).encode("utf-8", "surrogateescape"),
        )
    return added


def _not_loose(objects: Path, oids: set[str]) -> set[str]:
    return {o for o in oids if not os.path.exists(objects / o[:2] / o[2:])}


async def copy_missing_objects(
    cache_repository: Path, source_git_dir: Path, oids: set[str], what: str, work: BlockingWork
) -> int:
    """Copies those of `oids` that the cache lacks from the source repository
    (one pack); returns how many. `what` names the snapshot in errors."""
    # Objects git just wrote are loose in the cache: only the others need asking.
    oids = await work.run("stat-objects", _not_loose, cache_repository / "objects", oids)
    if not oids:
        return 0
    cache_env = git_env({"GIT_DIR": str(cache_repository)})
    check = await git(
        ["cat-file", "--batch-check=%(objectname)"],
        env=cache_env,
        stdin="".join(f"{oid}\n" for oid in sorted(oids)).encode(),
    )
    missing = [ln.split()[0] for ln in check.stdout_text().splitlines() if ln.endswith(" missing")]
    if not missing:
        return 0
    try:
        pack = await git(
            ["pack-objects", "--stdout", "--quiet"],
            env=git_env({"GIT_DIR": str(source_git_dir)}),
            stdin="".join(f"{oid}\n" for oid in missing).encode(),
        )
    except CommandFailed as exc:
        raise SnapshotError(
            f"{what} needs {len(missing)} object(s) that neither the cache "
            f"{cache_repository} nor the repository {source_git_dir} has ({exc}); "
            "run `git fsck` in the repository"
        ) from None
    await git(["index-pack", "--stdin"], env=cache_env, stdin=pack.stdout)
    return len(missing)


def _persist(
    index: Path, persisted: Path, memo: IndexBase | None, memo_path: Path, fmt: str
) -> None:
    """Persists the capture's index as `<key>.index` with its memo; a split
    index's shared index is put back into the cache entry first if git
    removed it meanwhile (see `split_index_write`)."""
    shared_dir = memo_path.parent
    shared = split_index_base(index, fmt)
    remove_stale_shared_temps(shared_dir)
    # Removed since this capture linked it into staging: put it back.
    if (
        shared is not None
        and not shared_index_path(shared_dir, shared).exists()
        and not link_shared_index(index.parent, shared_dir, shared)
    ):
        # Nowhere to be found: nothing could read this index; the next seeds.
        remove_if_exists(memo_path)
        remove_if_exists(persisted)
        return
    # The checksum of this capture's own index, not of whatever another
    # capture may have moved into place meanwhile: a memo always describes
    # the index it was written with, else it is not trusted.
    checksum = read_trailer(index, fmt)
    _move_into_place(index, persisted)
    if memo is None and shared is not None:
        memo = IndexBase(index_checksum="", ws_index_checksum=None, ws_tree=None)
    if memo is None or checksum is None:
        remove_if_exists(memo_path)
        return
    memo.index_checksum = checksum
    memo.shared_index = shared
    memo.save(memo_path)


async def _next_memo(
    env: dict[str, str],
    ws_tree: str | None,
    ws_checksum: str | None,
    head_tree: str,
    tree: str,
    head_changes: list[TreeChange],
) -> IndexBase | None:
    """The memo letting the next capture fix up this capture's index: which
    paths it added to (untracked files) or dropped from (deleted files) the
    workspace index's tree. None when that tree is unknown or too much changed."""
    if ws_tree is None:
        return None
    if ws_tree == head_tree:
        changes = [c for c in head_changes if c.status in ("A", "D")]
    else:
        changes = await changed_entries(env, ws_tree, tree, trees=False, only_added_dropped=True)
    changes = [c for c in changes if not c.is_tree]
    if len(changes) > MAX_FIXUP_PATHS:
        return None
    return IndexBase(
        index_checksum="",  # set once the index is persisted
        ws_index_checksum=ws_checksum,
        ws_tree=ws_tree,
        added=[c.path for c in changes if c.status == "A"],
        dropped=[(c.old_mode, c.old_oid, c.path) for c in changes if c.status == "D"],
    )


async def _capture_body(cap: CaptureState, repo: Repository) -> Snapshot:
    state_dir = cap.state_dir
    key = layout.cache_key_for_repository(repo.common_dir)
    entry = await ensure_object_cache(
        state_dir,
        repo.common_dir,
        [repo.head] if repo.head else [],
        key=key,
        run_id=cap.run_id,
        work=cap.work,
    )
    cap.pins.append(entry.pin)
    index = cap.staging / "index"
    persisted = layout.cache_index_path(state_dir, key)
    memo_path = entry.repository / MEMO_NAME
    fmt = repo.object_format

    def stage() -> _Base:
        # One blocking step (one thread hop) for the repository and the index base.
        create_run_repository(
            cap.staging_repository,
            [entry.objects],
            object_format=fmt,
            run_id=cap.run_id,
            nonce=cap.nonce,
            kind="workspace",
            namespace=cap.namespace,
            source=str(repo.toplevel),
        )
        if repo.sparse_checkout:
            return _Base(None, False)  # seeded: see "Sparse checkout" above
        return _read_base(
            repo.git_dir / "index", persisted, index, memo_path, fmt, entry.repository
        )

    base = await cap.work.run("create-repository", stage)
    entry.pin.drop()  # the staging alternates protect the entry from here on

    env = git_env(
        {
            "GIT_DIR": str(repo.git_dir),
            "GIT_WORK_TREE": str(repo.toplevel),
            "GIT_INDEX_FILE": str(index),
            "GIT_OBJECT_DIRECTORY": str(entry.objects),
            "GIT_ALTERNATE_OBJECT_DIRECTORIES": str(repo.objects),
        }
    )
    ws_checksum = base.ws_checksum
    try:
        ws_tree, recheck, shared = await _prepare_index(cap, repo, env, base)
        await _add_all_keeping(cap, env, repo, recheck, shared is not None)
    except CommandFailed:
        if base.shared_index is None:
            raise
        # A split index git could not read or write (its shared index damaged
        # in a way its checksum did not show): this capture seeds instead, so
        # the damage costs time, never a failed capture.
        base = _Base(base.ws_checksum, False)
        ws_tree, recheck, shared = await _prepare_index(cap, repo, env, base)
        await _add_all_keeping(cap, env, repo, recheck, False)
    renew = shared is not None and await cap.work.run(
        "split-share", needs_new_shared_index, index, shared_index_path(index.parent, shared)
    )
    # `git add`'s index gets its second name while write-tree runs (it reads
    # the index, then computes and writes for tens of ms before its rename; if
    # the link came after the rename it would name the new index: no harm).
    written: dict[str, str] = {}

    # write-tree runs in the cache entry: the shared index it may write goes
    # there (see `preloop.snapshot.index`); it needs no work tree. In sparse
    # checkout the index is not split (nor kept): write-tree runs where
    # `git add` ran, whose sparse checkout keeps a sparse index sparse (the
    # cache entry, without one, would expand it).
    tree_env = {k: v for k, v in env.items() if k != "GIT_WORK_TREE"}
    tree_env["GIT_DIR"] = str(entry.repository)
    tree_args = [*split_index_write(renew), "write-tree"]
    if repo.sparse_checkout:
        tree_env, tree_args = env, ["write-tree"]

    async def write_tree() -> None:
        result = await git(tree_args, env=tree_env)
        written["tree"] = result.stdout_text().strip()

    async def read_head(head: str) -> None:
        # Beside write-tree, which keeps one core busy for tens of ms.
        result = await git(["cat-file", "commit", head], env=env, check=False)
        date = snapshot_date(result.stdout) if result.returncode == 0 else None
        if date is not None:
            written["date"] = date

    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(write_tree)
            if repo.head:
                tg.start_soon(read_head, repo.head)
            tg.start_soon(cap.work.run, "keep-index", _keep_link, index)
    except ExceptionGroup as group:
        raise group.exceptions[0] from None
    tree = written["tree"]
    parents = (repo.head,) if repo.head else ()
    # Objects git found in the workspace's store were not written to the cache:
    # copy those the new tree needs (HEAD's are in the cache already). The
    # tree diff and the commit are independent: run them together. The commit
    # is the object `git commit-tree` would write (`snapshot_commit`), written
    # here: a process less.
    head_tree = repo.head_tree or EMPTY_TREE[fmt]
    body = snapshot_commit(tree, parents, repo.commit_encoding, written.get("date"))
    done: dict[str, object] = {}

    def write_commit() -> str:
        oid = write_loose_object(entry.objects, "commit", body, fmt)
        # `git add`'s index, replaced by write-tree's, is freed here, beside
        # the diff process rather than on the critical path (see _keep_link).
        remove_if_exists(index.with_name(index.name + ".kept"))
        return oid

    async def make_commit() -> None:
        done["commit"] = await cap.work.run("write-commit", write_commit)

    async def diff() -> None:
        done["changes"] = await changed_entries(env, head_tree, tree, trees=True)

    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(diff)  # first: the process starts before the thread
            tg.start_soon(make_commit)
    except ExceptionGroup as group:
        raise group.exceptions[0] from None
    commit = str(done["commit"])
    changes = cast(list[TreeChange], done["changes"])
    new_objects = {
        c.new_oid for c in changes if c.status in ("A", "M", "T") and c.new_mode != "160000"
    }
    new_objects.add(commit)
    await copy_missing_objects(
        entry.repository, repo.git_dir, new_objects, f"snapshot of run {cap.run_id}", cap.work
    )
    memo = await _next_memo(env, ws_tree, ws_checksum, head_tree, tree, changes)

    await publish_verified(cap, commit, tree, entry.repository)
    if not repo.sparse_checkout:
        await cap.work.run("persist-index", _persist, index, persisted, memo, memo_path, fmt)
    return Snapshot(
        run_id=cap.run_id,
        kind="workspace",
        repository=cap.run_repository,
        commit=commit,
        tree=tree,
        parents=parents,
        cache_key=key,
        namespace=cap.namespace,
        source=str(repo.toplevel),
        on_head=bool(parents) and tree == repo.head_tree,
    )


async def capture_workspace(
    state_dir: Path,
    workspace: Path,
    run_id: str,
    *,
    namespace: str | None = None,
    limits: CaptureLimits | None = None,
    permits: NamespacePermits | None = None,
    after_capture: AfterCapture | None = None,
    faults: CaptureFaults | None = None,
) -> Snapshot:
    """Captures the work tree at `workspace` (staged, unstaged and
    untracked-not-ignored content) as `refs/heads/snapshot` of the new run
    repository `<state_dir>/snapshots/<run_id>`. The namespace defaults to the
    owner of `remote.origin.url`, else `default`."""
    workspace = Path(workspace).absolute()
    layout.validate_run_id(run_id)
    limits = limits or CaptureLimits()
    started = time.monotonic()
    try:
        with anyio.fail_after(limits.timeout):
            repo = await inspect_repository(workspace)
            if namespace is None:
                namespace = namespace_from_url(repo.origin_url)
    except TimeoutError:
        raise SnapshotCaptureTimeout(run_id, limits.timeout, []) from None
    return await run_capture(
        state_dir,
        run_id,
        "workspace",
        namespace,
        lambda cap: _capture_body(cap, repo),
        limits=limits,
        permits=permits,
        after_capture=after_capture,
        faults=faults,
        elapsed=time.monotonic() - started,
    )
