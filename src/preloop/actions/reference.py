"""What a `uses:` names, and the user's local overrides of remote actions.

- `RemoteRef`: `owner/repo@ref` or `owner/repo/path/in/repo@ref` (an action
  or, at job level, a reusable workflow file in another repository).
- `parse_uses(text)`: `./dir` (local), `docker://image`, or a `RemoteRef`;
  anything else is a `UsesError` naming the text and the accepted forms.
- Overrides (`--action owner/repo[/path][@ref]=DIR|skip[:reason]`, and
  `PRELOOP_ACTION_OVERRIDES`, entries separated by `;` or newlines): a
  local directory runs in place of the remote action, `skip` turns every step
  using it into a no-op with a notice.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from preloop.errors import PreloopError, UsageError

__all__ = [
    "FULL_SHA",
    "DockerRef",
    "LocalRef",
    "Override",
    "Overrides",
    "RemoteRef",
    "UsesError",
    "is_checkout",
    "parse_overrides",
    "parse_uses",
]

FULL_SHA = re.compile(r"[0-9a-fA-F]{40}")
_NAME = r"[A-Za-z0-9_.-]+"
_REMOTE = re.compile(rf"({_NAME})/({_NAME})((?:/[^@]+)?)@(.+)")


def is_checkout(uses: str) -> bool:
    """Whether `uses:` names `actions/checkout` (any ref): preloop checks the
    snapshot out itself and never runs that action."""
    return uses.split("@", 1)[0].strip().lower() == "actions/checkout"


class UsesError(PreloopError):
    """A `uses:` value that names no action preloop can find."""


@dataclass(frozen=True, slots=True)
class RemoteRef:
    owner: str
    repo: str
    path: str  # inside the repository, "" for its root
    ref: str

    @property
    def slug(self) -> str:
        """`owner/repo`, as written."""
        return f"{self.owner}/{self.repo}"

    @property
    def key(self) -> tuple[str, str]:
        """GitHub names are case-insensitive: the cache keys on lower case."""
        return self.owner.lower(), self.repo.lower()

    @property
    def is_sha(self) -> bool:
        return FULL_SHA.fullmatch(self.ref) is not None

    def __str__(self) -> str:
        path = f"/{self.path}" if self.path else ""
        return f"{self.owner}/{self.repo}{path}@{self.ref}"


@dataclass(frozen=True, slots=True)
class LocalRef:
    path: str  # relative to the workspace, as written (`./dir`)


@dataclass(frozen=True, slots=True)
class DockerRef:
    image: str


def parse_remote(text: str) -> RemoteRef | None:
    m = _REMOTE.fullmatch(text.strip())
    if m is None or m.group(1) in (".", "..") or m.group(2) in (".", ".."):
        return None
    path = m.group(3).strip("/")
    if any(part in ("", ".", "..") for part in path.split("/")) and path:
        return None
    return RemoteRef(m.group(1), m.group(2), path, m.group(4))


def parse_uses(text: str) -> LocalRef | DockerRef | RemoteRef:
    value = text.strip()
    if value.startswith("./") or value == ".":
        return LocalRef(value)
    if value.startswith("docker://"):
        image = value[len("docker://") :]
        if not image:
            raise UsesError(f"`uses: {value}` names no image")
        return DockerRef(image)
    remote = parse_remote(value)
    if remote is None:
        raise UsesError(
            f"`uses: {value}` is not an action reference: use `owner/repo@ref`, "
            "`owner/repo/path@ref`, `./local/dir` or `docker://image`"
        )
    return remote


@dataclass(frozen=True, slots=True)
class Override:
    """`owner/repo[/path][@ref]=DIR` or `owner/repo[/path][@ref]=skip[:reason]`:
    DIR is a checkout of the repository; with `path`, only the action or
    reusable workflow at that path of it is overridden."""

    owner: str
    repo: str
    ref: str | None
    directory: Path | None  # None: skip
    reason: str = ""
    path: str | None = None  # None: every action and workflow of the repository

    def matches(self, ref: RemoteRef) -> bool:
        return (
            (self.owner.lower(), self.repo.lower()) == ref.key
            and (self.ref is None or self.ref == ref.ref)
            and (self.path is None or self.path == ref.path.strip("/"))
        )

    def describe(self) -> str:
        at = f"@{self.ref}" if self.ref else ""
        path = f"/{self.path}" if self.path else ""
        target = str(self.directory) if self.directory is not None else "skip"
        if self.directory is None and self.reason:
            target += f":{self.reason}"
        return f"{self.owner}/{self.repo}{path}{at}={target}"


_OVERRIDE_KEY = re.compile(rf"({_NAME})/({_NAME})((?:/[^@/]+)+)?(?:@(.+))?")


def _parse_override(entry: str, where: str) -> Override:
    key, sep, target = entry.partition("=")
    m = _OVERRIDE_KEY.fullmatch(key.strip())
    if not sep or m is None or not target.strip():
        raise UsageError(
            f"{where}: {entry!r} is not an override: use owner/repo[/path][@ref]=DIR or "
            "owner/repo[/path][@ref]=skip[:reason]"
        )
    target = target.strip()
    owner, repo, ref = m.group(1), m.group(2), m.group(4)
    path = m.group(3).strip("/") if m.group(3) else None
    if target == "skip" or target.startswith("skip:"):
        return Override(owner, repo, ref, None, target[5:].strip(), path)
    directory = Path(target).expanduser().absolute()
    if not directory.is_dir():
        raise UsageError(f"{where}: {entry!r}: {directory} is not a directory")
    return Override(owner, repo, ref, directory, path=path)


def parse_overrides(entries: Iterable[str], where: str) -> tuple[Override, ...]:
    """Each entry may hold several overrides separated by `;` or newlines."""
    out: list[Override] = []
    for entry in entries:
        for part in re.split(r"[;\n]", entry):
            if part.strip():
                out.append(_parse_override(part.strip(), where))
    return tuple(out)


@dataclass(frozen=True, slots=True)
class Overrides:
    """Overrides in precedence order: the first one matching wins, and an
    override naming a ref beats one that does not."""

    entries: tuple[Override, ...] = ()

    @classmethod
    def from_env(cls, env: Mapping[str, str], extra: Iterable[Override] = ()) -> Overrides:
        raw = env.get("PRELOOP_ACTION_OVERRIDES", "")
        from_env = parse_overrides([raw], "PRELOOP_ACTION_OVERRIDES") if raw.strip() else ()
        # Command-line overrides come first: they win over the environment.
        return cls((*extra, *from_env))

    def find(self, ref: RemoteRef) -> Override | None:
        """The most specific override matching `ref`: one naming the path
        beats one that does not, then one naming the ref; else the first."""
        found = [o for o in self.entries if o.matches(ref)]
        return min(found, key=lambda o: (o.path is None, o.ref is None), default=None)
