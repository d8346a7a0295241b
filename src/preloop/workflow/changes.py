"""What a local event is about, read from git: the ref and the changed paths.

`event_facts(root, event, ref=None, base=None) -> LocalEvent`:

- the ref: `ref` (`main` or `refs/heads/main` for a branch, `refs/tags/v1`
  or `tags/v1` for a tag), else the checked-out branch, else a tag at HEAD;
- the base the changes are counted from: `base` (any revision), else for a
  push the branch's upstream (`@{upstream}`, what a push compares with), else
  `origin/HEAD` (the default branch, what a new branch is compared with);
  for a pull request `origin/HEAD` first. The changed paths are those of the
  work tree (the snapshot: staged, unstaged and untracked-not-ignored files)
  against the merge base of HEAD and that base, deleted files included;
  without any base every file of the work tree counts as changed (a first
  push);
- for pull requests the base branch (what `branches:` filters match) is the
  base's branch name (`origin/main` -> `main`).
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path

from preloop.errors import UsageError
from preloop.workflow.triggers import EventFacts

__all__ = ["LocalEvent", "event_facts", "normalize_ref"]

_EMPTY_TREE = "4b825dc642cb6eb9a060e54bf8d69288fbee4904"


@dataclass(frozen=True, slots=True)
class LocalEvent:
    facts: EventFacts
    head_ref: str | None  # the pushed ref (push) or the head branch ref (pull requests)
    base: str | None  # the revision changes are counted from, as given or found
    merge_base: str | None  # its merge base with HEAD (None: every file counts)
    note: str  # how the changed paths were found, for `preloop plan`


def _git(root: Path, *args: str, check: bool = False) -> str | None:
    try:
        proc = subprocess.run(
            ["git", "-C", str(root), *args], capture_output=True, check=False, timeout=60
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    if proc.returncode != 0:
        if check:
            msg = proc.stderr.decode(errors="replace").strip().splitlines()
            raise UsageError(f"git {' '.join(args)}: {msg[-1] if msg else 'failed'}")
        return None
    return proc.stdout.decode(errors="surrogateescape")


def normalize_ref(ref: str) -> str:
    """`main` -> `refs/heads/main`, `tags/v1` -> `refs/tags/v1`; full refs stay."""
    if ref.startswith("refs/"):
        return ref
    if ref.startswith("tags/"):
        return "refs/" + ref
    if ref.startswith("heads/"):
        return "refs/" + ref
    return "refs/heads/" + ref


def _current_ref(root: Path) -> str | None:
    branch = _git(root, "symbolic-ref", "-q", "HEAD")
    if branch and branch.strip():
        return branch.strip()
    tag = _git(root, "describe", "--tags", "--exact-match", "HEAD")
    if tag and tag.strip():
        return "refs/tags/" + tag.strip()
    return None


def _first_rev(root: Path, candidates: list[str]) -> str | None:
    for rev in candidates:
        if _git(root, "rev-parse", "--verify", "-q", rev + "^{commit}"):
            return rev
    return None


def _changed(root: Path, merge_base: str | None) -> tuple[str, ...]:
    against = merge_base or _EMPTY_TREE
    paths: set[str] = set()
    diff = _git(root, "diff", "--name-only", "-z", "--no-renames", against, "--")
    if diff is None and merge_base is None:
        diff = ""  # an unborn HEAD: nothing tracked yet, untracked files follow
    if diff is None:
        raise UsageError(f"{root}: git diff against {against} failed")
    paths.update(p for p in diff.split("\0") if p)
    untracked = _git(root, "ls-files", "-z", "--others", "--exclude-standard") or ""
    paths.update(p for p in untracked.split("\0") if p)
    return tuple(sorted(paths))


def event_facts(
    root: Path,
    event: str,
    *,
    ref: str | None = None,
    base: str | None = None,
    action: str | None = None,
    paths: bool = True,
) -> LocalEvent:
    """The facts a local `event` on the repository at `root` is about.
    `paths=False` skips listing the changed paths (no workflow filters on
    them): `changed_paths` is then None."""
    root = Path(root)
    head_ref = normalize_ref(ref) if ref else _current_ref(root)
    pull = event in ("pull_request", "pull_request_target")
    if _git(root, "rev-parse", "--git-dir") is None:  # not a repository: nothing is known
        return LocalEvent(
            EventFacts(event, head_ref, None, action), head_ref, None, None, "not a git repository"
        )
    if base is not None:
        if _first_rev(root, [base]) is None:
            raise UsageError(f"--base {base}: no such revision in {root}")
        chosen: str | None = base
    elif pull:
        chosen = _first_rev(root, ["origin/HEAD", "@{upstream}"])
    else:
        chosen = _first_rev(root, ["@{upstream}", "origin/HEAD"])
    merge_base = None
    if chosen is not None:
        out = _git(root, "merge-base", "HEAD", chosen)
        merge_base = out.strip() if out and out.strip() else None
    changed = _changed(root, merge_base) if paths else None
    if not paths:
        note = "changed paths not needed (no path filters)"
    elif chosen is None:
        note = "no upstream or origin/HEAD: every file counts as changed (choose with --base)"
    elif merge_base is None:
        note = f"no merge base with {chosen}: every file counts as changed"
    else:
        note = f"changes since the merge base with {chosen} ({merge_base[:12]})"
    facts_ref = head_ref
    if pull:
        facts_ref = "refs/heads/" + _branch_name(root, chosen) if chosen else "refs/heads/main"
    return LocalEvent(
        facts=EventFacts(event=event, ref=facts_ref, changed_paths=changed, action=action),
        head_ref=head_ref,
        base=chosen,
        merge_base=merge_base,
        note=note,
    )


def _branch_name(root: Path, rev: str) -> str:
    full = (_git(root, "rev-parse", "--symbolic-full-name", rev) or "").strip()
    if full.startswith("refs/remotes/"):
        name = full.removeprefix("refs/remotes/").split("/", 1)
        if len(name) == 2 and name[1] == "HEAD":
            target = (_git(root, "symbolic-ref", "-q", full) or "").strip()
            name = target.removeprefix("refs/remotes/").split("/", 1)
        return name[-1]
    if full.startswith("refs/heads/"):
        return full.removeprefix("refs/heads/")
    return rev
