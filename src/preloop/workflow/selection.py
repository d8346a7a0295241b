"""Narrowing a `Plan` to what the user asked for: jobs, matrix legs, platforms.

- `select_jobs(plan, names)`: the named jobs (job keys, or `caller/inner`)
  and every job they need; None when the plan has none of them.
- `select_legs(plan, wanted)`: only the matrix legs whose values match every
  key given for a key their matrix has (`--matrix KEY=VALUE`; a key given
  more than once takes any of its values); jobs without
  those keys are kept whole. A matrix job with the key but no matching leg is
  an error naming the values it has. A matrix known only at run time
  (`fromJSON(needs.x.outputs.y)`) is filtered when its legs are leased:
  `leg_not_selected(matrix, wanted)` is why such a leg is skipped.
- `foreign_platform(labels, platforms)`: why a job whose `runs-on` names
  another operating system (`windows-*`, `macos-*`) or another architecture
  (`ubuntu-24.04-arm`, `ARM64` on an x86-64 host) is not run here, unless
  `platforms` maps that label to `host`; `runs_on_labels(value, contexts)`
  are a leased job's labels, its templates evaluated.
"""

from __future__ import annotations

import json
import platform
import re
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

import yaml

from preloop.errors import PreloopError, UsageError
from preloop.workflow import expressions as ex
from preloop.workflow.plan import Plan, PlannedJob

__all__ = [
    "FOREIGN_OS",
    "foreign_platform",
    "known_jobs",
    "leg_not_selected",
    "matrix_filter",
    "runner_arch",
    "runs_on_labels",
    "select_jobs",
    "select_legs",
]

#: runs-on label prefixes of GitHub-hosted runners of other operating systems.
FOREIGN_OS = {"windows": "Windows", "macos": "macOS"}

#: runs-on labels naming a runner's architecture: GitHub's hosted
#: `ubuntu-24.04-arm` / `ubuntu-22.04-arm`, a self-hosted runner's `ARM64` / `X64`.
_ARCH_LABEL = re.compile(r"(?:.+-)?(arm|arm64|x64)", re.IGNORECASE)


def runner_arch() -> str:
    """This host's architecture as GitHub's runner names it (`runner.arch`,
    `RUNNER_ARCH`, the `ARM64`/`X64` runs-on labels)."""
    machine = platform.machine().lower()
    return "ARM64" if machine in ("aarch64", "arm64") else "X64"


def _rebuild(p: Plan, jobs: Sequence[PlannedJob]) -> Plan:
    counts: dict[str, int] = {}
    for j in jobs:
        if j.cohort is not None:
            counts[j.cohort] = counts.get(j.cohort, 0) + 1
    cohorts = tuple(
        replace(c, total=counts.get(c.id, 0))
        for c in p.cohorts
        if counts.get(c.id) or any(j.base_id == c.id and j.kind == "deferred" for j in jobs)
    )
    return replace(p, jobs=tuple(jobs), cohorts=cohorts)


def select_jobs(p: Plan, names: Sequence[str]) -> Plan | None:
    """Keeps the named jobs and everything they need; None if none is here."""
    by_base: dict[str, list[PlannedJob]] = {}
    for j in p.jobs:
        by_base.setdefault(j.base_id, []).append(j)
    wanted = [n for n in names if n in by_base]
    if not wanted:
        return None
    keep: set[str] = set()
    todo = list(wanted)
    while todo:
        base = todo.pop()
        if base in keep:
            continue
        keep.add(base)
        for j in by_base.get(base, []):
            todo.extend(j.needs)
            if j.caller:
                todo.append(j.caller)
            for inner in j.inner_job_ids:
                todo.append(p.job(inner).base_id)
    return _rebuild(p, [j for j in p.jobs if j.base_id in keep])


def known_jobs(p: Plan) -> list[str]:
    return sorted({j.base_id for j in p.jobs if "/" not in j.base_id})


def matrix_filter(pairs: Sequence[tuple[str, str]]) -> dict[str, tuple[str, ...]]:
    """`--matrix KEY=VALUE` pairs as each key's wanted values, in order: a key
    given twice (`toxenv=lint`, `toxenv=type`) takes either."""
    wanted: dict[str, tuple[str, ...]] = {}
    for key, value in pairs:
        if value not in wanted.get(key, ()):
            wanted[key] = (*wanted.get(key, ()), value)
    return wanted


def _wanted(wanted: Mapping[str, Sequence[str] | str]) -> dict[str, tuple[str, ...]]:
    """Each key's values; a plain string is the one value (never its letters).
    An object or array value is compared as the leg's is shown (`_text`):
    bcrypt's `--matrix 'PYTHON={VERSION: "3.12", NOXSESSION: tests}'` in the
    workflow's own key order and flow style, or as JSON."""
    return {
        k: tuple(_value(x) for x in ((v,) if isinstance(v, str) else v)) for k, v in wanted.items()
    }


def _value(text: str) -> str:
    if not text.lstrip().startswith(("{", "[")):
        return text
    try:
        parsed = yaml.safe_load(text)
    except yaml.YAMLError:
        return text
    return _text(parsed) if isinstance(parsed, dict | list) else text


def _asked(key: str, values: Sequence[str]) -> str:
    return " ".join(f"--matrix {key}={v}" for v in values)


def select_legs(p: Plan, wanted: Mapping[str, Sequence[str] | str]) -> Plan:
    """Keeps the matrix legs matching `wanted` (see the module docstring)."""
    if not wanted:
        return p
    wanted = _wanted(wanted)
    keep: list[PlannedJob] = []
    offered: dict[str, dict[str, set[str]]] = {}
    kept_by_base: dict[str, int] = {}
    for j in p.jobs:
        matrix = j.matrix or {}
        relevant = {k: v for k, v in wanted.items() if k in matrix}
        if j.kind == "job" and j.matrix is not None and relevant:
            values = offered.setdefault(j.base_id, {})
            ok = True
            for k, v in relevant.items():
                have = _text(matrix[k])
                values.setdefault(k, set()).add(have)
                if have not in v:
                    ok = False
            if not ok:
                continue
            kept_by_base[j.base_id] = kept_by_base.get(j.base_id, 0) + 1
        keep.append(j)
    for base, values in offered.items():
        if not kept_by_base.get(base):
            shown = "; ".join(f"{k}: {', '.join(sorted(v))}" for k, v in sorted(values.items()))
            asked = ", ".join(f"{k}={' or '.join(v)}" for k, v in wanted.items() if k in values)
            raise UsageError(f"{p.workflow}: no leg of job {base!r} has {asked} ({shown})")
    return _rebuild(p, keep)


def leg_not_selected(
    matrix: Mapping[str, Any] | None, wanted: Mapping[str, Sequence[str] | str]
) -> str | None:
    """Why a matrix leg with values `matrix` is not run under `--matrix`
    `wanted` (a value differs for a key its matrix has), or None."""
    if not matrix:
        return None
    wanted = _wanted(wanted)
    differ = [(k, v) for k, v in wanted.items() if k in matrix and _text(matrix[k]) not in v]
    if not differ:
        return None
    asked = " ".join(_asked(k, v) for k, v in differ)
    has = ", ".join(f"{k}={_text(matrix[k])}" for k, _ in differ)
    return f"not selected by {asked} (this leg has {has})"


def _text(value: Any) -> str:
    if isinstance(value, dict | list):
        return json.dumps(value, sort_keys=True, separators=(",", ":"))
    return ex.coerce_string(value)


def foreign_platform(labels: Sequence[str], platforms: Mapping[str, str]) -> str | None:
    """The reason a job with `labels` is not run on this Linux host, or None."""
    host = {k.lower() for k, v in platforms.items() if v.lower() == "host"}
    for label in labels:
        low = label.lower()
        for prefix, name in FOREIGN_OS.items():
            if (low == prefix or low.startswith(prefix + "-")) and low not in host:
                return (
                    f"runs-on {label} is a {name} runner; this host runs Linux "
                    f"(run it here anyway with --platform {label}=host)"
                )
        arch = _ARCH_LABEL.fullmatch(label)
        if arch is not None and low not in host:
            wanted = "X64" if arch[1].lower() == "x64" else "ARM64"
            if wanted != runner_arch():
                return (
                    f"runs-on {label} is an {wanted} runner; this host is {runner_arch()} "
                    f"(run it here anyway with --platform {label}=host)"
                )
    return None


def runs_on_labels(value: Any, contexts: Mapping[str, Any]) -> tuple[str, ...]:
    """The labels of a job's `runs-on` as written (a label, a list, or a
    `group`/`labels` mapping), each template evaluated with the job's
    `contexts` (`needs`, `inputs`, `matrix`, ...); a template that cannot be
    evaluated is left out (the job's own evaluation reports it)."""
    if isinstance(value, Mapping):
        value = value.get("labels") or []
    if isinstance(value, str):
        value = [value]
    labels: list[str] = []
    for v in value if isinstance(value, list) else []:
        if not isinstance(v, str):
            continue
        if "${{" not in v:
            labels.append(v)
            continue
        try:
            result = ex.evaluate_template(v, dict(contexts))
        except PreloopError:
            continue
        items = result if isinstance(result, list) else [result]
        labels.extend(text for text in map(ex.coerce_string, items) if text)
    return tuple(labels)
