"""Problem matchers: GitHub's `::add-matcher::` / `::remove-matcher::`.

A step registers a matcher file (`{"problemMatcher": [{"owner", "severity"?,
"fromPath"?, "pattern": [{"regexp", "file"?, "line"?, "column"?, "severity"?,
"code"?, "message"?, "fromPath"?, "loop"?}, ...]}]}`), as setup-python does
for Python tracebacks and linter wrappers do for flake8 or mypy; from then
on, to the end of the job, every output line a matcher matches is also an
annotation. This follows GitHub's runner (`IssueMatcher.cs`,
`OutputManager.cs`, `AddMatcherCommandExtension`): the newest matcher is
tried first, one that matches resets the others' multi-line state, a
multi-line matcher's last pattern may `loop`, an issue without a message or
with a severity other than error/warning/notice is no issue, and a file is
kept (relative to the workspace) only when it exists under it.
"""

from __future__ import annotations

import json
import os
import re
import stat
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["IssueMatch", "MatcherError", "ProblemMatchers", "StepMatchers", "load_matchers"]

_FIELDS = ("file", "line", "column", "severity", "code", "message", "fromPath")


class MatcherError(ValueError):
    """A matcher file GitHub's runner would refuse (the step fails)."""


def _get(obj: Mapping[str, Any], key: str) -> Any:
    """`obj[key]`, the key matched without regard to case, as the runner's
    JSON reader does."""
    if key in obj:
        return obj[key]
    lowered = key.lower()
    for k, v in obj.items():
        if isinstance(k, str) and k.lower() == lowered:
            return v
    return None


@dataclass(frozen=True, slots=True)
class _Pattern:
    regex: re.Pattern[str]
    groups: Mapping[str, int]
    loop: bool


@dataclass(frozen=True, slots=True)
class MatcherConfig:
    owner: str
    severity: str
    from_path: str
    patterns: tuple[_Pattern, ...]


@dataclass(frozen=True, slots=True)
class IssueMatch:
    """What a matched line says, GitHub's `IssueMatch`."""

    file: str | None = None
    line: str | None = None
    column: str | None = None
    severity: str | None = None
    code: str | None = None
    message: str | None = None
    from_path: str | None = None


def _index(value: Any, name: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise MatcherError(f"The property '{name}' must be a number")
    return value


def _parse_matcher(raw: Any) -> MatcherConfig:
    if not isinstance(raw, Mapping):
        raise MatcherError("A problem matcher must be an object")
    owner = _get(raw, "owner") or ""
    severity = _get(raw, "severity") or ""
    if not isinstance(owner, str) or not owner:
        raise MatcherError("Owner must not be empty")
    if not isinstance(severity, str) or severity.upper() not in ("", "ERROR", "WARNING", "NOTICE"):
        raise MatcherError(f"Matcher '{owner}' contains unexpected default severity '{severity}'")
    raw_patterns = _get(raw, "pattern")
    if isinstance(raw_patterns, Mapping):
        raw_patterns = [raw_patterns]
    if not isinstance(raw_patterns, list) or not raw_patterns:
        raise MatcherError(f"Matcher '{owner}' does not contain any patterns")
    tracked: set[str] = set()
    patterns: list[_Pattern] = []
    for i, p in enumerate(raw_patterns):
        if not isinstance(p, Mapping):
            raise MatcherError(f"Matcher '{owner}': a pattern must be an object")
        first, last = i == 0, i == len(raw_patterns) - 1
        loop = bool(_get(p, "loop"))
        if loop and (first or not last):
            raise MatcherError("Only the last pattern in a multiline matcher may set 'loop'")
        groups = {f: idx for f in _FIELDS if (idx := _index(_get(p, f), f)) is not None}
        if loop and "message" not in groups:
            raise MatcherError("The loop pattern must set 'message'")
        try:
            # .NET's ECMAScript option: \d, \w and \s are ASCII
            regex = re.compile(str(_get(p, "regexp") or ""), re.ASCII)
        except re.error as exc:
            raise MatcherError(f"Matcher '{owner}': invalid regexp: {exc}") from None
        for name, idx in groups.items():
            if name in tracked:
                raise MatcherError(f"The property '{name}' is set twice")
            if idx < 0 or idx > regex.groups:
                raise MatcherError(f"The property '{name}' is set to {idx} which is out of range")
            tracked.add(name)
        patterns.append(_Pattern(regex, groups, loop))
    if "message" not in tracked:
        raise MatcherError("At least one pattern must set 'message'")
    from_path = _get(raw, "fromPath") or ""
    return MatcherConfig(owner, severity, str(from_path), tuple(patterns))


# A matcher file is a few KB; a step names it, so preloop reads no more.
MAX_MATCHER_FILE = 1 << 20
# Output lines longer than this are not matched (see `StepMatchers.match`).
MAX_MATCHED_LINE = 1 << 16
# GitHub's OutputManager strips these before matching.
_COLOR = re.compile(r"\x1b\[[0-9;]*m?")


def _read_matcher_file(path: Path) -> str:
    """The text of a matcher file a step named: a regular file of at most
    MAX_MATCHER_FILE bytes, opened without blocking (a FIFO or a device a
    step names must not stall the job's output, nor fill memory)."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise MatcherError(f"{path}: not a regular file")
        if st.st_size > MAX_MATCHER_FILE:
            raise MatcherError(f"{path}: {st.st_size} bytes, more than a matcher file has")
        with os.fdopen(fd, "rb", closefd=False) as f:
            return f.read(MAX_MATCHER_FILE + 1).decode("utf-8-sig")
    finally:
        os.close(fd)


def load_matchers(path: Path, *, validate: bool = True) -> list[MatcherConfig]:
    """The matchers of a matcher file; MatcherError when GitHub's runner
    would refuse it (unreadable, not JSON, an invalid matcher, duplicate
    owners). Without `validate` (`remove-matcher`, which only wants the
    owners, as GitHub's reads them) only the JSON and owners are checked."""
    try:
        data = json.loads(_read_matcher_file(path))
    except (OSError, ValueError, RecursionError) as exc:
        raise MatcherError(f"{path}: {exc}") from None
    raw = _get(data, "problemMatcher") if isinstance(data, Mapping) else None
    if raw is not None and not isinstance(raw, list):
        raise MatcherError(f"{path}: `problemMatcher` must be a list")
    if not validate:
        return [
            MatcherConfig(owner=str(_get(m, "owner") or ""), severity="", from_path="", patterns=())
            for m in raw or []
            if isinstance(m, Mapping)
        ]
    configs = [_parse_matcher(m) for m in raw or []]
    owners: set[str] = set()
    for c in configs:
        if c.owner.lower() in owners:
            raise MatcherError(f"Duplicate owner name '{c.owner}'")
        owners.add(c.owner.lower())
    return configs


class _Matcher:
    """One matcher's per-step state (GitHub's `IssueMatcher`)."""

    def __init__(self, config: MatcherConfig) -> None:
        self.config = config
        self.owner = config.owner
        self._state: list[IssueMatch | None] = []
        self.reset()

    def reset(self) -> None:
        self._state = [None] * (len(self.config.patterns) - 1)

    def _build(self, running: IssueMatch | None, pattern: _Pattern, m: re.Match[str]) -> IssueMatch:
        def value(name: str) -> str | None:
            idx = pattern.groups.get(name)
            return None if idx is None else (m.group(idx) or "")

        def pick(name: str, have: str | None) -> str | None:
            return have if have is not None else value(name)

        r = running or IssueMatch()
        return IssueMatch(
            file=pick("file", r.file),
            line=pick("line", r.line),
            column=pick("column", r.column),
            severity=pick("severity", r.severity),
            code=pick("code", r.code),
            message=pick("message", r.message),
            from_path=pick("fromPath", r.from_path),
        )

    def _final(self, match: IssueMatch) -> IssueMatch:
        severity = match.severity or self.config.severity or match.severity
        from_path = match.from_path or self.config.from_path or match.from_path
        return IssueMatch(
            match.file, match.line, match.column, severity, match.code, match.message, from_path
        )

    def match(self, line: str) -> IssueMatch | None:
        patterns = self.config.patterns
        if len(patterns) == 1:
            m = patterns[0].regex.search(line)
            return self._final(self._build(None, patterns[0], m)) if m else None
        for i in range(len(patterns) - 1, -1, -1):
            running = self._state[i - 1] if i > 0 else None
            if i != 0 and running is None:
                continue
            pattern = patterns[i]
            last = i == len(patterns) - 1
            m = pattern.regex.search(line)
            if m is not None:
                if last:
                    self.reset()
                    if pattern.loop:
                        self._state[i - 1] = running
                    return self._final(self._build(running, pattern, m))
                self._state[i] = self._build(running, pattern, m)
            elif last:
                self._state[i - 1] = None
            else:
                self._state[i] = None
        return None


class ProblemMatchers:
    """The matchers a job's steps registered: they apply to the rest of the
    job, the newest first."""

    def __init__(self) -> None:
        self.configs: list[MatcherConfig] = []

    def add(self, configs: list[MatcherConfig]) -> None:
        owners = {c.owner.lower() for c in configs}
        self.configs = [*configs, *(c for c in self.configs if c.owner.lower() not in owners)]

    def remove(self, owners: list[str]) -> None:
        gone = {o.lower() for o in owners}
        self.configs = [c for c in self.configs if c.owner.lower() not in gone]


class StepMatchers:
    """The job's matchers as one step's output sees them: multi-line state
    starts afresh with each step, as GitHub's per-step OutputManager does."""

    def __init__(
        self,
        registry: ProblemMatchers,
        workspace: Path | None,
        host_path: Callable[[Path], Path] | None = None,
    ) -> None:
        self.registry = registry
        self.workspace = workspace
        # Where a path the step sees is on the host (the sandbox's own /tmp).
        self._host_path = host_path or (lambda path: path)
        self._matchers = [_Matcher(c) for c in registry.configs]

    @property
    def active(self) -> bool:
        return bool(self._matchers)

    def resolve(self, data: str) -> Path:
        """A path a step names (a matcher file), on the host: relative ones
        are in the workspace."""
        path = Path(data)
        if not path.is_absolute() and self.workspace is not None:
            path = self.workspace / path
        return self._host_path(path)

    def relative(self, file: str) -> str | None:
        """`file` (a step's absolute path, or one relative to the workspace)
        relative to the workspace when it is inside it, else None."""
        if self.workspace is None:
            return None
        path = Path(os.path.normpath(self.resolve(file)))
        if path != self.workspace and path.is_relative_to(self.workspace):
            return path.relative_to(self.workspace).as_posix()
        return None

    def add(self, path: Path) -> None:
        configs = load_matchers(path)
        if not configs:
            return
        self.registry.add(configs)
        owners = {c.owner.lower() for c in configs}
        kept = [m for m in self._matchers if m.owner.lower() not in owners]
        self._matchers = [_Matcher(c) for c in configs] + kept

    def remove(self, owners: list[str]) -> None:
        self.registry.remove(owners)
        gone = {o.lower() for o in owners}
        self._matchers = [m for m in self._matchers if m.owner.lower() not in gone]

    def match(self, line: str) -> tuple[str, IssueMatch] | None:
        """(level, match) of the first matcher that makes an issue of `line`,
        its colour codes stripped first (GitHub's OutputManager). A line
        longer than MAX_MATCHED_LINE is not matched: Python's `re` has no
        timeout (GitHub's gives a matcher 1 s a line), so a backtracking
        pattern must not meet an unbounded line."""
        if len(line) > MAX_MATCHED_LINE:
            return None
        if "\x1b[" in line:
            line = _COLOR.sub("", line)
        for matcher in self._matchers:
            found = matcher.match(line)
            if found is None:
                continue
            for other in self._matchers:
                if other is not matcher:
                    other.reset()
            if not (found.message or "").strip():
                continue  # GitHub: no issue for an empty message
            severity = (found.severity or "error").lower()
            if severity not in ("error", "warning", "notice"):
                continue
            return severity, found
        return None

    def file_of(self, match: IssueMatch) -> str | None:
        """The issue's file relative to the workspace, when it is a file
        there (GitHub drops a file outside the workflow's repository)."""
        file = match.file or ""
        if not file.strip() or self.workspace is None:
            return None
        if match.from_path and not os.path.isabs(file):
            parent = os.path.dirname(match.from_path)
            if parent:
                file = os.path.join(parent, file)
        inside = self.relative(file)
        return inside if inside is not None and (self.workspace / inside).is_file() else None
