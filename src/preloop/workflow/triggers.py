"""Does this event trigger this workflow? GitHub's event filters, evaluated.

`evaluate_trigger(workflow, facts) -> Trigger` answers for one workflow, with
the reason in words (`preloop plan` and `preloop run` show it):

- the event must be one of the workflow's `on:` events;
- `push`: `branches`/`branches-ignore` apply to a branch ref and
  `tags`/`tags-ignore` to a tag ref. A workflow that filters only one kind of
  ref never runs for the other kind. `paths`/`paths-ignore` apply to branch
  pushes (never to tags) and both filters must pass;
- `pull_request` / `pull_request_target`: `branches`/`branches-ignore` match
  the pull request's base branch, `paths`/`paths-ignore` its changed files;
  `types` is checked when the event payload has an `action`;
- `paths`: the workflow runs when at least one changed path matches;
  `paths-ignore`: it does not run when every changed path is ignored; with no
  changed path at all a path-filtered workflow does not run. When the changed
  paths are unknown (`facts.changed_paths is None`) path filters pass, as on
  GitHub when it cannot compute the diff;
- an unknown ref (`facts.ref is None`: a detached HEAD and no `--ref`): a
  workflow with a branch or tag filter is not triggered (`UNKNOWN_REF_REASON`);
  path filters are still evaluated.

Patterns follow GitHub's filter pattern cheat sheet (`compile_pattern`):
`*` matches anything but `/`, `**` anything (`**/` also nothing), `?` makes
the preceding character optional, `+` repeats it, `[...]` is one character
of a set or `a-z`/`A-Z`/`0-9` range, `\\` escapes, and a leading `!` negates.
In a list the last pattern that matches a value decides: positive includes,
negative excludes (`'*.md', '!README.md', 'README*'` re-includes README.md).
"""

from __future__ import annotations

import difflib
import functools
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from preloop.errors import UsageError
from preloop.workflow.model import Workflow

__all__ = [
    "FILTERED_EVENTS",
    "UNKNOWN_REF_REASON",
    "EventFacts",
    "PatternError",
    "Trigger",
    "check_event_name",
    "compile_pattern",
    "evaluate_trigger",
    "list_matches",
]

#: Events whose `on.<event>` filters are about refs and paths.
FILTERED_EVENTS = frozenset({"push", "pull_request", "pull_request_target"})

#: The filters that need the event's ref.
_REF_FILTER_KEYS = ("branches", "branches-ignore", "tags", "tags-ignore")

#: Why a ref-filtered workflow is not run when the ref is unknown.
UNKNOWN_REF_REASON = "ref unknown (detached HEAD): pass --ref REF"


class PatternError(UsageError):
    """A filter pattern GitHub would refuse (an unclosed `[`, a bad range)."""


@dataclass(frozen=True, slots=True)
class EventFacts:
    """What the triggering event is about.

    `ref` is the pushed ref (`refs/heads/x`, `refs/tags/v1`) for `push`, and
    the base branch ref for pull requests. `changed_paths` are the paths the
    event changes (deleted ones included), None when unknown. `action` is the
    payload's activity type, if any."""

    event: str
    ref: str | None = None
    changed_paths: tuple[str, ...] | None = None
    action: str | None = None


@dataclass(frozen=True, slots=True)
class Trigger:
    """Whether a workflow runs for the event, and why (or why not)."""

    triggered: bool
    reason: str


@functools.lru_cache(maxsize=1024)
def compile_pattern(pattern: str) -> tuple[re.Pattern[str], bool]:
    """One filter pattern as (regex matching a whole value, negative)."""
    negative = pattern.startswith("!")
    body = pattern[1:] if negative else pattern
    out: list[str] = []
    i = 0
    n = len(body)
    while i < n:
        c = body[i]
        if c == "*":
            if body.startswith("**/", i):
                out.append("(?:.*/)?")
                i += 3
            elif body.startswith("**", i):
                out.append(".*")
                i += 2
            else:
                out.append("[^/]*")
                i += 1
        elif c in "?+":
            # The preceding character (or class) zero-or-one / one-or-more;
            # at the very start there is nothing to repeat: a literal.
            out.append(c if out and out[-1] not in ("[^/]*", ".*", "(?:.*/)?") else re.escape(c))
            i += 1
        elif c == "[":
            end = body.find("]", i + 1)
            if end < 0:
                raise PatternError(f"filter pattern {pattern!r}: '[' without a closing ']'")
            inner = body[i + 1 : end]
            if not inner:
                raise PatternError(f"filter pattern {pattern!r}: empty brackets '[]'")
            cls: list[str] = []
            j = 0
            while j < len(inner):
                a = inner[j]
                if j + 2 < len(inner) and inner[j + 1] == "-":
                    b = inner[j + 2]
                    if not _range_ok(a, b):
                        raise PatternError(
                            f"filter pattern {pattern!r}: range {a}-{b} "
                            "(ranges can only include a-z, A-Z and 0-9)"
                        )
                    cls.append(f"{a}-{b}")
                    j += 3
                elif a.isascii() and a.isalnum():
                    cls.append(a)
                    j += 1
                else:
                    raise PatternError(
                        f"filter pattern {pattern!r}: {a!r} in brackets "
                        "(brackets hold letters, digits and ranges)"
                    )
            out.append("[" + "".join(cls) + "]")
            i = end + 1
        elif c == "\\" and i + 1 < n:
            out.append(re.escape(body[i + 1]))
            i += 2
        else:
            out.append(re.escape(c))
            i += 1
    return re.compile("".join(out), re.DOTALL), negative


def _range_ok(a: str, b: str) -> bool:
    return a <= b and any(
        lo <= a <= hi and lo <= b <= hi for lo, hi in (("a", "z"), ("A", "Z"), ("0", "9"))
    )


def list_matches(patterns: Sequence[str], value: str) -> str | None:
    """The pattern that decides `value` against an ordered list: the last one
    that matches it, if positive; None when no pattern includes it."""
    decided: str | None = None
    for pattern in patterns:
        regex, negative = compile_pattern(pattern)
        if regex.fullmatch(value):
            decided = None if negative else pattern
    return decided


def _patterns(filters: Mapping[str, Any], key: str) -> list[str] | None:
    value = filters.get(key)
    if value is None:
        return None
    return [_folded(str(v)) for v in ([value] if isinstance(value, str) else value)]


def _folded(pattern: str) -> str:
    """A pattern as GitHub reads it: a lone literal expression (`${{ 'main' }}`,
    the only one the loader lets through here) folded into its value."""
    if "${{" not in pattern:
        return pattern
    from preloop.workflow import expressions as ex

    return ex.coerce_string(ex.evaluate_template(pattern, {}))


def _fmt(patterns: Iterable[str]) -> str:
    return ", ".join(repr(p) for p in patterns)


def _ref_filter(
    filters: Mapping[str, Any], kind: str, name: str, event: str
) -> tuple[bool, str] | None:
    """(passes, why) for `branches`/`tags` (kind) and their `-ignore`; None
    when the workflow filters neither."""
    include = _patterns(filters, kind)
    ignore = _patterns(filters, f"{kind}-ignore")
    what = "branch" if kind == "branches" else "tag"
    if include is not None:
        hit = list_matches(include, name)
        if hit is None:
            return False, f"{what} {name!r} does not match on.{event}.{kind} ({_fmt(include)})"
        return True, f"{what} {name!r} matches on.{event}.{kind} {hit!r}"
    if ignore is not None:
        hit = list_matches(ignore, name)
        if hit is not None:
            return False, f"{what} {name!r} is in on.{event}.{kind}-ignore ({hit!r})"
        return True, f"{what} {name!r} is not in on.{event}.{kind}-ignore"
    return None


def _paths_filter(
    filters: Mapping[str, Any], changed: tuple[str, ...] | None, event: str
) -> tuple[bool, str] | None:
    include = _patterns(filters, "paths")
    ignore = _patterns(filters, "paths-ignore")
    if include is None and ignore is None:
        return None
    key = "paths" if include is not None else "paths-ignore"
    if changed is None:
        return True, f"changed paths unknown: on.{event}.{key} not evaluated"
    if not changed:
        return False, f"no changed paths (on.{event}.{key} needs at least one)"
    count = f"{len(changed)} changed path{'s' if len(changed) != 1 else ''}"
    if include is not None:
        for path in changed:
            hit = list_matches(include, path)
            if hit is not None:
                return True, f"{path!r} matches on.{event}.paths {hit!r}"
        return False, f"none of the {count} matches on.{event}.paths ({_fmt(include)})"
    assert ignore is not None
    for path in changed:
        if list_matches(ignore, path) is None:
            return True, f"{path!r} is not in on.{event}.paths-ignore"
    return False, f"all {count} are in on.{event}.paths-ignore ({_fmt(ignore)})"


def evaluate_trigger(workflow: Workflow, facts: EventFacts) -> Trigger:
    """Whether `facts.event` triggers `workflow`, with the reason."""
    event = facts.event
    if event not in workflow.on:
        events = ", ".join(sorted(workflow.on)) or "none"
        return Trigger(False, f"not triggered by {event!r} (its events: {events})")
    filters = workflow.on.get(event)
    if not isinstance(filters, Mapping):
        filters = {}
    reasons: list[str] = []
    types = _patterns(filters, "types")
    if types is not None and facts.action is not None:
        if facts.action not in types:
            return Trigger(
                False,
                f"activity {facts.action!r} is not in on.{event}.types ({_fmt(types)}); "
                "the activity is github.event.action (give a payload with "
                "`preloop run --eventpath FILE`)",
            )
        reasons.append(f"activity {facts.action!r} is in on.{event}.types")
    if event in FILTERED_EVENTS and facts.ref is None:
        # No branch checked out and no --ref: a ref filter cannot be decided,
        # and guessing either way would run (or skip) what GitHub would not.
        if any(k in filters for k in _REF_FILTER_KEYS):
            return Trigger(False, UNKNOWN_REF_REASON)
        paths = _paths_filter(filters, facts.changed_paths, event)
        if paths is not None:
            if not paths[0]:
                return Trigger(False, paths[1])
            reasons.append(paths[1])
    elif event in FILTERED_EVENTS and facts.ref is not None:
        ref = facts.ref
        is_tag = ref.startswith("refs/tags/")
        name = ref.removeprefix("refs/tags/") if is_tag else ref.removeprefix("refs/heads/")
        branch = _ref_filter(filters, "branches", name, event) if not is_tag else None
        tag = _ref_filter(filters, "tags", name, event) if is_tag else None
        if event == "push":
            has_branch = any(k in filters for k in ("branches", "branches-ignore"))
            has_tag = any(k in filters for k in ("tags", "tags-ignore"))
            if is_tag and has_branch and not has_tag:
                return Trigger(False, f"tag {name!r}: on.push filters branches only")
            if not is_tag and has_tag and not has_branch:
                return Trigger(False, f"branch {name!r}: on.push filters tags only")
        decided = tag if is_tag else branch
        if decided is not None:
            if not decided[0]:
                return Trigger(False, decided[1])
            reasons.append(decided[1])
        if not (event == "push" and is_tag):  # GitHub never path-filters tag pushes
            paths = _paths_filter(filters, facts.changed_paths, event)
            if paths is not None:
                if not paths[0]:
                    return Trigger(False, paths[1])
                reasons.append(paths[1])
    if not reasons:
        reasons.append(f"on: {event}")
    return Trigger(True, "; ".join(reasons))


def check_event_name(event: str, known: Iterable[str]) -> None:
    """Raises UsageError for a name that is not a GitHub event, naming the
    nearest valid one."""
    names = sorted(known)
    if event in names:
        return
    near = difflib.get_close_matches(event, names, n=1, cutoff=0.5)
    hint = f"; did you mean {near[0]!r}?" if near else f" (events: {', '.join(names)})"
    raise UsageError(f"--event {event!r} is not a GitHub Actions event{hint}")
