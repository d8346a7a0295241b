"""`load_workflow(path) -> Workflow`: YAML -> validated, immutable model.

Every problem is collected (nothing stops at the first) and reported as
`path:line:col: message`; loading executes nothing. Local reusable workflows
(`uses: ./.github/workflows/x.yml`) are loaded, validated against their
`on.workflow_call` declaration, and attached to the caller job as `callee`.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from preloop.actions.reference import UsesError, parse_uses
from preloop.actions.workflows import fetch_remote_workflow
from preloop.errors import PreloopError
from preloop.workflow import expressions as ex
from preloop.workflow.matrix import MatrixError, expand_matrix
from preloop.workflow.model import (
    Concurrency,
    Job,
    Matrix,
    Step,
    Strategy,
    Workflow,
    WorkflowCall,
    frozen_map,
)
from preloop.workflow.yamltree import Diagnostic, YMap, YNode, YScalar, YSeq, compose, plain

__all__ = ["MAX_REUSABLE_DEPTH", "WorkflowError", "load_workflow", "workflow_files"]

#: GitHub: reusable workflows nest at most ten levels, the top-level caller included.
MAX_REUSABLE_DEPTH = 10

EVENTS = frozenset(
    [
        "branch_protection_rule",
        "check_run",
        "check_suite",
        "create",
        "delete",
        "deployment",
        "deployment_status",
        "discussion",
        "discussion_comment",
        "fork",
        "gollum",
        "image_version",
        "issue_comment",
        "issues",
        "label",
        "merge_group",
        "milestone",
        "page_build",
        "project",
        "project_card",
        "project_column",
        "public",
        "pull_request",
        "pull_request_comment",
        "pull_request_review",
        "pull_request_review_comment",
        "pull_request_target",
        "push",
        "registry_package",
        "release",
        "repository_dispatch",
        "schedule",
        "status",
        "watch",
        "workflow_call",
        "workflow_dispatch",
        "workflow_run",
    ]
)
ROOT_KEYS = frozenset(
    [
        "on",
        "name",
        "description",
        "run-name",
        "defaults",
        "env",
        "permissions",
        "concurrency",
        "jobs",
    ]
)
JOB_KEYS = frozenset(
    [
        "needs",
        "if",
        "strategy",
        "name",
        "runs-on",
        "timeout-minutes",
        "cancel-timeout-minutes",
        "continue-on-error",
        "container",
        "services",
        "env",
        "environment",
        "permissions",
        "concurrency",
        "outputs",
        "defaults",
        "steps",
        "snapshot",
    ]
)
CALLER_KEYS = frozenset(
    ["name", "uses", "with", "secrets", "needs", "if", "permissions", "concurrency", "strategy"]
)
STEP_KEYS = frozenset(
    [
        "name",
        "id",
        "if",
        "timeout-minutes",
        "run",
        "continue-on-error",
        "env",
        "working-directory",
        "shell",
        "uses",
        "with",
        "background",
    ]
)
_CONTAINER_KEYS = frozenset(["image", "options", "env", "ports", "volumes", "credentials"])
_DISPATCH_TYPES = ("boolean", "choice", "number", "environment", "string")
_CALLER_ONLY = CALLER_KEYS - JOB_KEYS
_JOB_ONLY = JOB_KEYS - CALLER_KEYS
RUN_ONLY = ("shell", "working-directory")
USES_ONLY = ("with",)
_REF_FILTERS = frozenset(
    ["branches", "branches-ignore", "tags", "tags-ignore", "paths", "paths-ignore"]
)
_TYPES_ONLY = frozenset(["types"])
_PR_FILTERS = (_REF_FILTERS - {"tags", "tags-ignore"}) | _TYPES_ONLY
_EVENT_FILTERS = {
    "push": _REF_FILTERS,
    "pull_request": _PR_FILTERS,
    "pull_request_target": _PR_FILTERS,
    "workflow_dispatch": frozenset(["inputs"]),
    "workflow_run": frozenset(["workflows", "types", "branches", "branches-ignore"]),
}
# Which contexts (and special functions) each kind of value may use: GitHub's
# workflow schema ("Context availability" in the docs).
_PLAN = frozenset(["github", "inputs", "vars"])
_WF_ENV = _PLAN | {"secrets"}
_WF_OUTPUT = _PLAN | {"jobs"}
_STRATEGY = _PLAN | {"needs"}
_JOB_IF = _STRATEGY
_LEG = _STRATEGY | {"strategy", "matrix"}
_JOB_ENV = _LEG | {"secrets"}
_JOB_DEFAULTS = _LEG | {"env"}
_RUNNER = _LEG | {"secrets", "steps", "job", "runner", "env"}
_STEP_IF = _RUNNER - {"secrets"}
_STATUS = frozenset(["success", "failure", "always", "cancelled"])
_SPECIAL_FUNCTIONS = _STATUS | {"hashfiles"}
_JOB_ID = re.compile(r"[A-Za-z_][A-Za-z0-9_-]*")


class WorkflowError(PreloopError):
    """A workflow (or a workflow it calls) is invalid. `diagnostics` lists every
    problem; the message is one `path:line:col: message` line per problem."""

    def __init__(self, diagnostics: list[Diagnostic], primary: str | None = None) -> None:
        self.diagnostics = sorted(diagnostics, key=_order(diagnostics, primary))
        super().__init__("\n".join(str(d) for d in self.diagnostics))


def _order(
    diags: list[Diagnostic], primary: str | None
) -> Callable[[Diagnostic], tuple[int, str, int, int, int]]:
    first_path = primary if primary is not None else (diags[0].path if diags else "")
    return lambda d: (d.path != first_path, d.path, d.phase, d.line, d.column)


def workflow_files(root: str | os.PathLike[str]) -> list[Path]:
    """The workflow files under `<root>/.github/workflows`, sorted."""
    wf = Path(root) / ".github" / "workflows"
    if not wf.is_dir():
        return []
    return sorted(p for p in wf.iterdir() if p.suffix in (".yml", ".yaml") and p.is_file())


def _repo_root(path: Path) -> Path:
    for parent in path.resolve().parents:
        if parent.name == ".github":
            return parent.parent
    return path.resolve().parent


def load_workflow(
    path: str | os.PathLike[str], *, root: str | os.PathLike[str] | None = None
) -> Workflow:
    """Loads and validates one workflow file (and the local reusable workflows
    it calls). Raises WorkflowError listing every problem."""
    p = Path(path)
    repo = Path(root) if root is not None else _repo_root(p)
    state = _State(repo=repo.resolve())
    display = _display(p, repo)
    wf = _load(state, p, depth=1, display=display)
    if state.errors or wf is None:
        raise WorkflowError(state.errors or [Diagnostic(display, 1, 1, "empty workflow")], display)
    return wf


def _display(p: Path, repo: Path) -> str:
    try:
        return str(p.resolve().relative_to(repo.resolve()))
    except ValueError:
        return str(p)


@dataclass
class _State:
    repo: Path
    errors: list[Diagnostic] = field(default_factory=list)
    cache: dict[Path, Workflow | None] = field(default_factory=dict)
    stack: list[Path] = field(default_factory=list)
    # Repository root of each workflow file fetched from another repository.
    origins: dict[Path, Path] = field(default_factory=dict)


def _load(state: _State, p: Path, depth: int, display: str) -> Workflow | None:
    key = p.resolve()
    if key in state.cache:
        return state.cache[key]
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        state.errors.append(Diagnostic(display, 1, 1, f"cannot read workflow: {reason}"))
        state.cache[key] = None
        return None
    state.stack.append(key)
    try:
        wf = _Reader(state, display, depth).read(text)
    finally:
        state.stack.pop()
    state.cache[key] = wf
    return wf


class _Reader:
    def __init__(self, state: _State, path: str, depth: int) -> None:
        self.state = state
        self.path = path
        self.depth = depth
        self.errors: list[Diagnostic] = []
        self.source = ""
        self.allowed: frozenset[str] = ex.CONTEXT_NAMES
        self.functions: frozenset[str] = _SPECIAL_FUNCTIONS

    @contextlib.contextmanager
    def using(
        self, contexts: frozenset[str], functions: frozenset[str] = frozenset()
    ) -> Iterator[None]:
        """Values read inside may use only these contexts and special functions."""
        saved = self.allowed, self.functions
        self.allowed, self.functions = contexts, functions
        try:
            yield
        finally:
            self.allowed, self.functions = saved

    # -- helpers ------------------------------------------------------------
    def err(self, node: YNode | YScalar, message: str) -> None:
        self.errors.append(Diagnostic(self.path, node.line, node.column, message))

    def err2(self, node: YNode | YScalar, message: str) -> None:
        """An error about how parts relate (second pass, see Diagnostic.phase)."""
        self.errors.append(Diagnostic(self.path, node.line, node.column, message, phase=1))

    def mapping(self, node: YNode, what: str) -> YMap | None:
        if isinstance(node, YMap):
            return node
        self.err(node, f"{what} must be a mapping, not {_kind(node)}")
        return None

    def keys(self, m: YMap, allowed: frozenset[str], what: str) -> None:
        for k, _ in m.items:
            if k.value not in allowed:
                self.err(k, f"unknown key '{k.value}' in {what}")

    def string(self, node: YNode | None, what: str, *, allow_empty: bool = True) -> str | None:
        if node is None:
            return None
        if (
            isinstance(node, YScalar)
            and isinstance(node.value, str | int | float)
            and not (isinstance(node.value, bool))
        ):
            text = node.value if isinstance(node.value, str) else ex.coerce_string(node.value)
            if not allow_empty and not text.strip():
                self.err(node, f"{what} must not be empty")
            self.check_template(node, text)
            return text
        self.err(node, f"{what} must be a string, not {_kind(node)}")
        return None

    def check_template(self, node: YNode, text: str) -> None:
        if "${{" not in text:
            return
        try:
            segments = ex.template_segments(text)
        except ex.ExpressionError as exc:
            # GitHub places an unclosed `${{` at the start of the value.
            self.err(node, f"invalid expression: {exc.reason}")
            return
        k = 0
        for is_expr, seg in segments:
            if is_expr:
                self.check_expression(node, seg, k)
                k += 1

    def check_expression(self, node: YNode, expr: str, k: int = -1, phase: int = 0) -> None:
        try:
            parsed = ex.parse(expr)
        except ex.ExpressionError as exc:
            self.err_at(
                node, k, f"invalid expression `{expr}`: {exc.reason} (column {exc.column})", phase
            )
            return
        unknown = sorted(parsed.contexts - ex.CONTEXT_NAMES)
        if unknown:
            self.err_at(
                node, k, f"unrecognized named-value '{unknown[0]}' in expression `{expr}`", phase
            )
            return
        unavailable = sorted(parsed.contexts - self.allowed)
        if unavailable:
            self.err_at(
                node,
                k,
                f"context '{unavailable[0]}' is not available here (only "
                f"{', '.join(sorted(self.allowed))}) in expression `{expr}`",
                phase,
            )
            return
        functions = sorted((parsed.functions & _SPECIAL_FUNCTIONS) - self.functions)
        if functions:
            self.err_at(
                node, k, f"function {functions[0]}() is not available here: `{expr}`", phase
            )

    def err_at(self, node: YNode, k: int, message: str, phase: int = 0) -> None:
        """An error about the k-th `${{` of a scalar, placed where that `${{`
        is in the file (GitHub's convention); k < 0 means the scalar itself."""
        if isinstance(node, YScalar) and k >= 0 and 0 <= node.start < node.end:
            raw = self.source[node.start : node.end]
            at = -1
            for _ in range(k + 1):
                at = raw.find("${{", at + 1)
                if at < 0:
                    break
            if at >= 0:
                index = node.start + at
                line = self.source.count("\n", 0, index) + 1
                col = index - (self.source.rfind("\n", 0, index) + 1) + 1
                self.errors.append(Diagnostic(self.path, line, col, message, phase))
                return
        self.errors.append(Diagnostic(self.path, node.line, node.column, message, phase))

    def bool_or_expr(self, node: YNode | None, what: str, default: bool) -> bool | str:
        if node is None:
            return default
        if isinstance(node, YScalar) and isinstance(node.value, bool):
            return node.value
        if isinstance(node, YScalar) and isinstance(node.value, str) and "${{" in node.value:
            self.check_template(node, node.value)
            return node.value
        self.err(node, f"{what} must be a boolean or an expression, not {_kind(node)}")
        return default

    def number_or_expr(self, node: YNode | None, what: str) -> float | str | None:
        if node is None:
            return None
        if isinstance(node, YScalar) and _is_number(node.value):
            if node.value <= 0:
                self.err(node, f"{what} must be a positive number")
            return float(node.value)
        if isinstance(node, YScalar) and isinstance(node.value, str) and "${{" in node.value:
            self.check_template(node, node.value)
            return node.value
        self.err(node, f"{what} must be a number or an expression, not {_kind(node)}")
        return None

    def env(self, node: YNode | None, what: str) -> Mapping[str, Any]:
        if node is None:
            return frozen_map(None)
        if isinstance(node, YScalar) and isinstance(node.value, str) and "${{" in node.value:
            self.check_template(node, node.value)
            return frozen_map({"${{}}": node.value})
        m = self.mapping(node, what)
        if m is None:
            return frozen_map(None)
        out: dict[str, Any] = {}
        for k, v in m.items:
            if isinstance(v, YScalar):
                if isinstance(v.value, str):
                    self.check_template(v, v.value)
                # Environment variables are strings (`A: 1` is "1").
                out[str(k.value)] = ex.coerce_string(v.value)
            else:
                self.err(v, f"{what} value '{k.value}' must be a string, not {_kind(v)}")
        return frozen_map(out)

    def check_all_templates(self, node: YNode) -> None:
        if isinstance(node, YScalar):
            if isinstance(node.value, str):
                self.check_template(node, node.value)
        elif isinstance(node, YSeq):
            for n in node.items:
                self.check_all_templates(n)
        else:
            for _, v in node.items:
                self.check_all_templates(v)

    # -- workflow -----------------------------------------------------------
    def read(self, text: str) -> Workflow | None:
        self.source = text
        root, yaml_errors = compose(text, self.path)
        self.errors.extend(yaml_errors)
        if root is None:
            if not yaml_errors:
                self.errors.append(Diagnostic(self.path, 1, 1, "the workflow file is empty"))
            self.state.errors.extend(self.errors)
            return None
        wf = self.workflow(root)
        self.state.errors.extend(self.errors)
        return None if self.errors else wf

    def workflow(self, root: YNode) -> Workflow | None:
        m = self.mapping(root, "a workflow")
        if m is None:
            return None
        self.keys(m, ROOT_KEYS, "the workflow")
        on_node = m.get("on")
        on: dict[str, Any] = {}
        call: WorkflowCall | None = None
        dispatch: Mapping[str, Mapping[str, Any]] = frozen_map(None)
        if on_node is None:
            self.err(m, "the workflow has no `on:` (which events trigger it)")
        else:
            on, call, dispatch = self.on(on_node)
        with self.using(frozenset()):
            name = self.string(m.get("name"), "`name`") or Path(self.path).name
        with self.using(_PLAN):
            run_name = self.string(m.get("run-name"), "`run-name`")
            defaults = self.defaults(m.get("defaults"))
            conc = self.concurrency(m.get("concurrency"))
        with self.using(_WF_ENV):
            env = self.env(m.get("env"), "`env`")
        permissions = self.permissions(m.get("permissions"))
        jobs_node = m.get("jobs")
        jobs: tuple[Job, ...] = ()
        if jobs_node is None:
            self.err(m, "the workflow has no `jobs:`")
        else:
            jobs = self.jobs(jobs_node)
        return Workflow(
            path=self.path,
            name=name,
            on=frozen_map(on),
            jobs=jobs,
            run_name=run_name,
            env=env,
            defaults_run=defaults,
            concurrency=conc,
            permissions=permissions,
            workflow_call=call,
            workflow_dispatch_inputs=dispatch,
        )

    def on(
        self, node: YNode
    ) -> tuple[dict[str, Any], WorkflowCall | None, Mapping[str, Mapping[str, Any]]]:
        events: dict[str, Any] = {}
        call: WorkflowCall | None = None
        dispatch: Mapping[str, Mapping[str, Any]] = frozen_map(None)
        items: list[tuple[YScalar, YNode | None]] = []
        if isinstance(node, YScalar):
            items = [(node, None)]
        elif isinstance(node, YSeq):
            for n in node.items:
                if isinstance(n, YScalar):
                    items.append((n, None))
                else:
                    self.err(n, f"an event name must be a string, not {_kind(n)}")
        else:
            items = list(node.items)
        for k, v in items:
            event = k.value
            if not isinstance(event, str) or event not in EVENTS:
                self.err(k, f"unknown event '{event}'")
                continue
            value = None if v is None or (isinstance(v, YScalar) and v.value is None) else v
            if event == "workflow_call":
                call = self.workflow_call(value)
            if event == "workflow_dispatch" and isinstance(value, YMap):
                inputs = value.get("inputs")
                if isinstance(inputs, YMap):
                    self.dispatch_inputs(inputs)
                    dispatch = frozen_map({str(ik.value): plain(iv) for ik, iv in inputs.items})
            if event == "schedule" and value is not None:
                self.schedule(value)
                events[event] = plain(value)
                continue
            if value is not None and not isinstance(value, YMap | YSeq):
                self.err(value, f"the filters of event '{event}' must be a mapping")
                continue
            if isinstance(value, YMap) and event != "workflow_call":
                self.keys(value, _EVENT_FILTERS.get(event, _TYPES_ONLY), f"event '{event}'")
            events[event] = plain(value) if value is not None else None
        return events, call, dispatch

    def dispatch_inputs(self, inputs: YMap) -> None:
        allowed = frozenset(["description", "type", "required", "default", "options"])
        for k, v in inputs.items:
            if isinstance(v, YScalar) and v.value is None:
                continue
            dm = self.mapping(v, f"input '{k.value}'")
            if dm is None:
                continue
            self.keys(dm, allowed, f"input '{k.value}'")
            t = dm.get("type")
            if t is not None and not (isinstance(t, YScalar) and t.value in _DISPATCH_TYPES):
                self.err(t, f"input '{k.value}' type must be one of {', '.join(_DISPATCH_TYPES)}")

    def schedule(self, node: YNode) -> None:
        if not isinstance(node, YSeq):
            self.err(node, f"`schedule` must be a list of {{cron: ...}}, not {_kind(node)}")
            return
        for entry in node.items:
            em = self.mapping(entry, "a `schedule` entry")
            if em is None:
                continue
            self.keys(em, frozenset(["cron"]), "a `schedule` entry")
            if em.get("cron") is None:
                self.err(em, "a `schedule` entry needs `cron`")
            else:
                self.string(em.get("cron"), "`cron`", allow_empty=False)

    def permissions(self, node: YNode | None) -> Any:
        if node is None:
            return None
        if isinstance(node, YScalar):
            if node.value not in ("read-all", "write-all"):
                self.err(node, "`permissions` must be read-all, write-all or a mapping")
            return node.value
        m = self.mapping(node, "`permissions`")
        if m is not None:
            for k, v in m.items:
                if not (isinstance(v, YScalar) and v.value in ("read", "write", "none")):
                    self.err(v, f"permission '{k.value}' must be read, write or none")
        return plain(node)

    def workflow_call(self, node: YNode | None) -> WorkflowCall:
        if node is None:
            return WorkflowCall()
        m = self.mapping(node, "`on.workflow_call`")
        if m is None:
            return WorkflowCall()
        self.keys(m, frozenset({"inputs", "outputs", "secrets"}), "`on.workflow_call`")
        sections: dict[str, dict[str, Any]] = {"inputs": {}, "outputs": {}, "secrets": {}}
        allowed = {
            "inputs": frozenset({"description", "type", "required", "default"}),
            "outputs": frozenset({"description", "value"}),
            "secrets": frozenset({"description", "required"}),
        }
        for section, out in sections.items():
            sec = m.get(section)
            if sec is None or (isinstance(sec, YScalar) and sec.value is None):
                continue
            sm = self.mapping(sec, f"`on.workflow_call.{section}`")
            if sm is None:
                continue
            for k, v in sm.items:
                if isinstance(v, YScalar) and v.value is None:
                    out[str(k.value)] = {}
                    continue
                dm = self.mapping(v, f"`on.workflow_call.{section}.{k.value}`")
                if dm is None:
                    continue
                self.keys(dm, allowed[section], f"`on.workflow_call.{section}.{k.value}`")
                d = {str(dk.value): plain(dv) for dk, dv in dm.items}
                if section == "inputs" and (default := dm.get("default")) is not None:
                    with self.using(_PLAN):
                        self.check_all_templates(default)
                if section == "inputs":
                    t = d.get("type")
                    if t not in ("boolean", "number", "string"):
                        where = dm.get("type") or dm
                        self.err(
                            where, f"input '{k.value}' needs a type: boolean, number or string"
                        )
                if section == "outputs":
                    value = dm.get("value")
                    if value is None:
                        self.err(dm, f"output '{k.value}' has no `value`")
                    else:
                        with self.using(_WF_OUTPUT):
                            self.string(value, f"output '{k.value}' value")
                out[str(k.value)] = d
        return WorkflowCall(
            inputs=frozen_map(sections["inputs"]),
            outputs=frozen_map(sections["outputs"]),
            secrets=frozen_map(sections["secrets"]),
        )

    def defaults(self, node: YNode | None) -> Mapping[str, Any]:
        if node is None:
            return frozen_map(None)
        m = self.mapping(node, "`defaults`")
        if m is None:
            return frozen_map(None)
        self.keys(m, frozenset({"run"}), "`defaults`")
        run = m.get("run")
        if run is None:
            return frozen_map(None)
        rm = self.mapping(run, "`defaults.run`")
        if rm is None:
            return frozen_map(None)
        self.keys(rm, frozenset({"shell", "working-directory"}), "`defaults.run`")
        out = {}
        for key in ("shell", "working-directory"):
            value = self.string(rm.get(key), f"`defaults.run.{key}`")
            if value is not None:
                out[key] = value
        return frozen_map(out)

    def concurrency(self, node: YNode | None) -> Concurrency | None:
        if node is None:
            return None
        if isinstance(node, YScalar):
            group = self.string(node, "`concurrency`", allow_empty=False)
            return Concurrency(group=group) if group is not None else None
        m = self.mapping(node, "`concurrency`")
        if m is None:
            return None
        self.keys(m, frozenset({"group", "cancel-in-progress", "queue"}), "`concurrency`")
        g = m.get("group")
        if g is None:
            self.err(m, "`concurrency` needs a `group`")
            return None
        group = self.string(g, "`concurrency.group`", allow_empty=False)
        cancel = self.bool_or_expr(m.get("cancel-in-progress"), "`cancel-in-progress`", False)
        queue = m.get("queue")
        queue_max = False
        if queue is not None:
            if isinstance(queue, YScalar) and queue.value in ("max", "single"):
                queue_max = queue.value == "max"
            else:
                self.err(queue, "`concurrency.queue` must be `single` or `max`")
        if group is None:
            return None
        return Concurrency(group=group, cancel_in_progress=cancel, queue_max=queue_max)

    # -- jobs ---------------------------------------------------------------
    def jobs(self, node: YNode) -> tuple[Job, ...]:
        m = self.mapping(node, "`jobs`")
        if m is None:
            return ()
        if not m.items:
            self.err(m, "`jobs` is empty: a workflow needs at least one job")
            return ()
        jobs: list[Job] = []
        need_nodes: dict[str, list[YScalar]] = {}
        for k, v in m.items:
            job_id = str(k.value)
            if not _JOB_ID.fullmatch(job_id):
                self.err(
                    k,
                    f"invalid job id '{job_id}': it must start with a letter or '_' and "
                    "contain only letters, digits, '-' and '_'",
                )
            job = self.job(k, v, need_nodes)
            if job is not None:
                jobs.append(job)
        self.check_needs(m, jobs, need_nodes)
        return tuple(jobs)

    def check_needs(self, m: YMap, jobs: list[Job], need_nodes: dict[str, list[YScalar]]) -> None:
        ids = {j.id for j in jobs}
        if jobs and all(j.needs for j in jobs):
            # GitHub's rule, reported where GitHub reports it.
            self.err2(m, "the workflow must contain at least one job with no dependencies")
        for job in jobs:
            for n in need_nodes.get(job.id, []):
                if n.value not in ids:
                    self.err2(n, f"job '{job.id}' needs unknown job '{n.value}'")
        # Cycles: depth-first search over the known edges.
        graph = {j.id: [n for n in j.needs if n in ids] for j in jobs}
        color: dict[str, int] = {}
        reported: set[frozenset[str]] = set()

        def visit(start: str) -> None:
            stack: list[tuple[str, int]] = [(start, 0)]
            path: list[str] = []
            while stack:
                node, i = stack.pop()
                if i == 0:
                    color[node] = 1
                    path.append(node)
                edges = graph[node]
                if i < len(edges):
                    stack.append((node, i + 1))
                    nxt = edges[i]
                    if color.get(nxt, 0) == 0:
                        stack.append((nxt, 0))
                    elif color[nxt] == 1:
                        cycle = [*path[path.index(nxt) :], nxt]
                        key = frozenset(cycle)
                        if key not in reported:
                            reported.add(key)
                            # Every edge of the cycle, as GitHub reports it.
                            text = "dependency cycle: " + " -> ".join(cycle)
                            for src, dst in itertools.pairwise(cycle):
                                for n in need_nodes.get(src, []):
                                    if n.value == dst:
                                        self.err2(n, text)
                else:
                    color[node] = 2
                    path.pop()

        for j in jobs:
            if color.get(j.id, 0) == 0:
                visit(j.id)

    def job(self, key: YScalar, node: YNode, need_nodes: dict[str, list[YScalar]]) -> Job | None:
        job_id = str(key.value)
        m = self.mapping(node, f"job '{job_id}'")
        if m is None:
            return None
        # Runner job or reusable-workflow caller? GitHub decides by the first
        # key that only one of them has; `uses` decides when none does.
        is_caller = m.get("uses") is not None
        for k, _ in m.items:
            if k.value in _CALLER_ONLY:
                is_caller = True
                break
            if k.value in _JOB_ONLY:
                is_caller = False
                break
        if is_caller:
            for k, _ in m.items:
                if k.value not in CALLER_KEYS:
                    if k.value in JOB_KEYS:
                        self.err(
                            k,
                            f"job '{job_id}' calls a reusable workflow and may not have "
                            f"'{k.value}' (allowed: {', '.join(sorted(CALLER_KEYS))})",
                        )
                    else:
                        self.err(k, f"unknown key '{k.value}' in job '{job_id}'")
        else:
            for k, _ in m.items:
                if k.value in _CALLER_ONLY:
                    self.err(
                        k,
                        f"job '{job_id}' runs steps on a runner and may not have "
                        f"'{k.value}' (a reusable-workflow call is a job of its own)",
                    )
                elif k.value not in JOB_KEYS:
                    self.err(k, f"unknown key '{k.value}' in job '{job_id}'")
        needs: list[str] = []
        needs_node = m.get("needs")
        if needs_node is not None:
            nodes: list[YNode] = (
                list(needs_node.items) if isinstance(needs_node, YSeq) else [needs_node]
            )
            for n in nodes:
                if isinstance(n, YScalar) and isinstance(n.value, str) and n.value:
                    needs.append(n.value)
                    need_nodes.setdefault(job_id, []).append(n)
                else:
                    self.err(n, f"`needs` must name jobs (strings), not {_kind(n)}")
        with self.using(_JOB_IF, _STATUS):
            if_ = self.condition(m.get("if"))
        with self.using(_LEG):
            name = self.string(m.get("name"), "`name`")
            conc = self.concurrency(m.get("concurrency"))
        with self.using(_STRATEGY):
            strategy = self.strategy(m.get("strategy"), job_id)
        common: dict[str, Any] = dict(
            id=job_id,
            name=name,
            needs=tuple(needs),
            if_=if_,
            strategy=strategy,
            concurrency=conc,
            permissions=self.permissions(m.get("permissions")),
            line=key.line,
            column=key.column,
        )
        if is_caller:
            return self.caller(m, common)
        with self.using(_LEG):
            runs_on = self.runs_on(m.get("runs-on"), m)
            coe = self.bool_or_expr(m.get("continue-on-error"), "`continue-on-error`", False)
            timeout = self.number_or_expr(m.get("timeout-minutes"), "`timeout-minutes`")
            for extra in ("container", "services", "environment"):
                if (extra_node := m.get(extra)) is not None:
                    self.check_all_templates(extra_node)
        with self.using(_JOB_ENV):
            env = self.env(m.get("env"), "`env`")
        with self.using(_JOB_DEFAULTS):
            defaults = self.defaults(m.get("defaults"))
        steps_node = m.get("steps")
        steps: tuple[Step, ...] = ()
        if steps_node is None:
            self.err2(m, f"job '{job_id}' has no `steps`")
        else:
            steps = self.steps(steps_node)
        outputs: dict[str, str] = {}
        out_node = m.get("outputs")
        if out_node is not None and (om := self.mapping(out_node, "`outputs`")) is not None:
            for k, v in om.items:
                with self.using(_RUNNER):
                    s = self.string(v, f"output '{k.value}'")
                if s is not None:
                    outputs[str(k.value)] = s
        services = m.get("services")
        if services is not None:
            self.mapping(services, "`services`")
        return Job(
            **common,
            runs_on=runs_on,
            continue_on_error=coe,
            timeout_minutes=timeout if timeout is not None else 360.0,
            outputs=frozen_map(outputs),
            env=env,
            defaults_run=defaults,
            steps=steps,
            container=self.container(m.get("container")),
            services=frozen_map(plain(services))
            if isinstance(services, YMap)
            else frozen_map(None),
            environment=plain(e) if (e := m.get("environment")) is not None else None,
        )

    def container(self, node: YNode | None) -> Any:
        if node is None:
            return None
        if isinstance(node, YSeq):
            self.err(node, f"`container` must be an image name or a mapping, not {_kind(node)}")
            return None
        if isinstance(node, YMap):
            self.keys(node, _CONTAINER_KEYS, "`container`")
        return plain(node)

    def condition(self, node: YNode | None) -> str | None:
        if node is None:
            return None
        if isinstance(node, YScalar) and isinstance(node.value, bool | int | float):
            return ex.coerce_string(node.value)
        text = self.string(node, "`if`")
        if text is None or not text.strip():
            return None
        text = text.strip()
        assert isinstance(node, YScalar)
        if "${{" in text:  # already checked by self.string
            try:
                segs = ex.template_segments(text)
            except ex.ExpressionError:
                return text
            if len(segs) == 1 and segs[0][0]:
                return segs[0][1]
            return text
        # A bare condition is checked in GitHub's second pass (when `if:` is
        # converted), unlike a `${{ }}` template.
        self.check_expression(node, text, phase=1)
        return text

    def runs_on(self, node: YNode | None, job: YMap) -> Any:
        if node is None:
            self.err(job, "the job has no `runs-on` (which runner labels it needs)")
            return None
        if isinstance(node, YScalar):
            return self.string(node, "`runs-on`", allow_empty=False)
        if isinstance(node, YSeq):
            labels = []
            for n in node.items:
                s = self.string(n, "a `runs-on` label", allow_empty=False)
                if s is not None:
                    labels.append(s)
            return tuple(labels)
        self.keys(node, frozenset({"group", "labels"}), "`runs-on`")
        out: dict[str, Any] = {}
        if (g := node.get("group")) is not None:
            out["group"] = self.string(g, "`runs-on.group`")
        if (lab := node.get("labels")) is not None:
            if isinstance(lab, YSeq):
                out["labels"] = [self.string(n, "a `runs-on` label") for n in lab.items]
            else:
                out["labels"] = [self.string(lab, "`runs-on.labels`")]
        return frozen_map(out)

    def strategy(self, node: YNode | None, job_id: str) -> Strategy | None:
        if node is None:
            return None
        m = self.mapping(node, "`strategy`")
        if m is None:
            return None
        self.keys(m, frozenset({"matrix", "fail-fast", "max-parallel"}), "`strategy`")
        fail_fast = self.bool_or_expr(m.get("fail-fast"), "`fail-fast`", True)
        max_parallel: int | str | None = None
        mp = m.get("max-parallel")
        if mp is not None:
            if isinstance(mp, YScalar) and isinstance(mp.value, str) and "${{" in mp.value:
                self.check_template(mp, mp.value)
                max_parallel = mp.value
            elif (
                isinstance(mp, YScalar)
                and _is_number(mp.value)
                and float(mp.value).is_integer()
                and mp.value > 0
            ):
                max_parallel = int(mp.value)
            else:
                shown = mp.value if isinstance(mp, YScalar) else _kind(mp)
                self.err(mp, f"`max-parallel` must be a positive integer, not {shown!r}")
        matrix = self.matrix(m.get("matrix"), job_id)
        return Strategy(matrix=matrix, fail_fast=fail_fast, max_parallel=max_parallel)

    def matrix(self, node: YNode | None, job_id: str) -> Matrix | None:
        if node is None:
            return None
        if isinstance(node, YScalar) and isinstance(node.value, str) and "${{" in node.value:
            self.check_template(node, node.value)
            return Matrix(template=node.value)
        m = self.mapping(node, "`strategy.matrix`")
        if m is None:
            return None
        if _has_expression(m):
            self.check_all_templates(m)
            return Matrix(template=plain(m))
        vectors: list[tuple[str, tuple[Any, ...]]] = []
        include: tuple[Mapping[str, Any], ...] = ()
        exclude: tuple[Mapping[str, Any], ...] = ()
        ok = True
        for k, v in m.items:
            key = str(k.value)
            if key in ("include", "exclude"):
                entries = []
                if not isinstance(v, YSeq):
                    self.err(v, f"matrix `{key}` must be a list of mappings, not {_kind(v)}")
                    ok = False
                    continue
                for e in v.items:
                    if isinstance(e, YMap):
                        entries.append(frozen_map(plain(e)))
                    else:
                        self.err(e, f"a matrix `{key}` entry must be a mapping, not {_kind(e)}")
                        ok = False
                if key == "include":
                    include = tuple(entries)
                else:
                    exclude = tuple(entries)
            elif isinstance(v, YSeq):
                if not v.items:
                    self.err(v, f"matrix vector '{key}' has no values")
                    ok = False
                vectors.append((key, tuple(plain(x) for x in v.items)))
            else:
                self.err(v, f"matrix vector '{key}' must be a list of values, not {_kind(v)}")
                ok = False
        matrix = Matrix(vectors=tuple(vectors), include=include, exclude=exclude)
        if ok:
            try:
                expand_matrix(matrix)
            except MatrixError as exc:
                where: YNode = m
                if exc.where[0] == "exclude":
                    ex_node = m.get("exclude")
                    if isinstance(ex_node, YSeq):
                        where = ex_node.items[exc.where[1]]
                self.err2(where, f"job '{job_id}': {exc}")
        return matrix

    def steps(self, node: YNode) -> tuple[Step, ...]:
        if not isinstance(node, YSeq):
            self.err(node, f"`steps` must be a list of steps, not {_kind(node)}")
            return ()
        steps = []
        ids: set[str] = set()
        for n in node.items:
            step = self.step(n)
            if step is None:
                continue
            if step.id is not None:
                if step.id in ids:
                    self.err2(n, f"step id '{step.id}' is used twice in this job")
                ids.add(step.id)
            steps.append(step)
        return tuple(steps)

    def step(self, node: YNode) -> Step | None:
        with self.using(_RUNNER, frozenset({"hashfiles"})):
            return self.read_step(node)

    def read_step(self, node: YNode) -> Step | None:
        m = self.mapping(node, "a step")
        if m is None:
            return None
        self.keys(m, STEP_KEYS, "a step")
        run_k, uses_k = m.key_node("run"), m.key_node("uses")
        if run_k is not None and uses_k is not None:
            later = run_k if (run_k.line, run_k.column) > (uses_k.line, uses_k.column) else uses_k
            self.err(later, "a step has either `run` or `uses`, not both")
        elif run_k is None and uses_k is None:
            self.err(m, "a step needs `run` (a command) or `uses` (an action)")
        elif run_k is not None:
            for key in USES_ONLY:
                if (k := m.key_node(key)) is not None:
                    self.err(k, f"a `run` step may not have '{key}'")
        else:
            for key in RUN_ONLY:
                if (k := m.key_node(key)) is not None:
                    self.err(k, f"a `uses` step may not have '{key}'")
        with_: dict[str, Any] = {}
        if (w := m.get("with")) is not None and (wm := self.mapping(w, "`with`")) is not None:
            for k, v in wm.items:
                if isinstance(v, YScalar):
                    if isinstance(v.value, str):
                        self.check_template(v, v.value)
                    with_[str(k.value)] = v.value
                else:
                    self.err(v, f"`with` value '{k.value}' must be a string, not {_kind(v)}")
        uses_node = m.get("uses")
        if isinstance(uses_node, YScalar) and isinstance(uses_node.value, str):
            self.local_action(uses_node, uses_node.value)
        step_id = self.string(m.get("id"), "step `id`")
        if step_id is not None and not _JOB_ID.fullmatch(step_id):
            id_node = m.get("id")
            assert id_node is not None
            self.err(
                id_node,
                f"invalid step id '{step_id}': it must start with a letter or '_' and contain "
                "only letters, digits, '-' and '_'",
            )
        timeout = self.number_or_expr(m.get("timeout-minutes"), "`timeout-minutes`")
        with self.using(_STEP_IF, _SPECIAL_FUNCTIONS):
            if_ = self.condition(m.get("if"))
        return Step(
            id=step_id,
            name=self.string(m.get("name"), "step `name`"),
            if_=if_,
            run=self.string(m.get("run"), "`run`"),
            uses=self.string(m.get("uses"), "`uses`", allow_empty=False),
            with_=frozen_map(with_),
            shell=self.string(m.get("shell"), "`shell`"),
            working_directory=self.string(m.get("working-directory"), "`working-directory`"),
            env=self.env(m.get("env"), "`env`"),
            continue_on_error=self.bool_or_expr(
                m.get("continue-on-error"), "`continue-on-error`", False
            ),
            timeout_minutes=timeout,
        )

    def local_action(self, node: YScalar, uses: str) -> None:
        """A step's `uses` must name an action (`./dir`, `owner/repo[/path]@ref`,
        `docker://image`). A local action's action.yml is read when its step
        runs, as GitHub does (an earlier step may generate it)."""
        if "${{" in uses:
            return
        try:
            parse_uses(uses)
        except UsesError as exc:
            self.err2(node, str(exc))

    # -- reusable workflows -------------------------------------------------
    def caller(self, m: YMap, common: dict[str, Any]) -> Job | None:
        uses_node = m.get("uses")
        if uses_node is None:
            self.err(m, f"job '{common['id']}' calls a reusable workflow but has no `uses`")
            return None
        uses = self.string(uses_node, "`uses`", allow_empty=False)
        with_node = m.get("with")
        with_: dict[str, Any] = {}
        with_keys: dict[str, YScalar] = {}
        if with_node is not None and (wm := self.mapping(with_node, "`with`")) is not None:
            for k, v in wm.items:
                if isinstance(v, YScalar):
                    if isinstance(v.value, str):
                        with self.using(_LEG):
                            self.check_template(v, v.value)
                    with_[str(k.value)] = v.value
                    with_keys[str(k.value)] = k
                else:
                    self.err(v, f"input '{k.value}' must be a scalar, not {_kind(v)}")
        secrets: Mapping[str, Any] | str | None = None
        secret_keys: dict[str, YScalar] = {}
        if (s := m.get("secrets")) is not None:
            if isinstance(s, YScalar) and s.value == "inherit":
                secrets = "inherit"
            elif (sm := self.mapping(s, "`secrets`")) is not None:
                with self.using(_LEG | {"secrets"}):
                    self.check_all_templates(sm)
                secrets = frozen_map({str(k.value): plain(v) for k, v in sm.items})
                secret_keys = {str(k.value): k for k, _ in sm.items}
        callee = None
        if uses is not None:
            callee = self.callee(uses_node, uses, with_, with_keys, secrets, secret_keys)
        return Job(**common, uses=uses, with_=frozen_map(with_), secrets=secrets, callee=callee)

    def callee(
        self,
        node: YNode,
        uses: str,
        with_: dict[str, Any],
        with_keys: dict[str, YScalar],
        secrets: Mapping[str, Any] | str | None,
        secret_keys: dict[str, YScalar],
    ) -> Workflow | None:
        local = uses.startswith(("./", "$/"))
        if local and "@" in uses:
            self.err2(node, f"a local reusable workflow takes no `@ref`: '{uses}'")
            return None
        if self.depth + 1 > MAX_REUSABLE_DEPTH:
            self.err2(
                node,
                f"reusable workflows nest at most {MAX_REUSABLE_DEPTH} levels deep "
                f"(calling '{uses}' would be level {self.depth + 1})",
            )
            return None
        if local:
            # `$/` is the calling file's own repository (see preloop.actions.workflows).
            origin = self.state.repo
            if uses.startswith("$/") and self.state.stack:
                origin = self.state.origins.get(self.state.stack[-1], origin)
            target, display = (origin / uses[2:]).resolve(), uses[2:]
        else:
            try:
                found, root = fetch_remote_workflow(uses)
            except PreloopError as exc:
                self.err2(node, f"reusable workflow '{uses}': {exc}")
                return None
            target, display = found.resolve(), uses
            self.state.origins[target] = root
        if not target.is_file():
            self.err2(node, f"reusable workflow '{uses}' does not exist ({target})")
            return None
        if target in self.state.stack:
            self.err2(node, f"reusable workflow '{uses}' calls itself (directly or indirectly)")
            return None
        before = len(self.state.errors)
        callee = _load(self.state, target, self.depth + 1, display)
        if callee is None:
            if len(self.state.errors) == before and target not in self.state.cache:
                self.err2(node, f"reusable workflow '{uses}' could not be loaded")
            return None
        if callee.workflow_call is None:
            self.err2(node, f"'{uses}' is not a reusable workflow: it has no `on: workflow_call`")
            return None
        decl = callee.workflow_call
        for name, key in with_keys.items():
            if name not in decl.inputs:
                self.err2(
                    key, f"input '{name}' is not declared by '{uses}' (on.workflow_call.inputs)"
                )
        for name, spec in decl.inputs.items():
            if spec.get("required") is True and name not in with_ and "default" not in spec:
                self.err2(node, f"'{uses}' requires input '{name}', which `with` does not provide")
        if secrets != "inherit":
            for name, key in secret_keys.items():
                if name not in decl.secrets:
                    self.err2(key, f"secret '{name}' is not declared by '{uses}'")
            for name, spec in decl.secrets.items():
                if spec.get("required") is True and name not in secret_keys:
                    self.err2(
                        node, f"'{uses}' requires secret '{name}', which `secrets` does not pass"
                    )
        return callee


def _has_expression(node: YNode) -> bool:
    if isinstance(node, YScalar):
        return isinstance(node.value, str) and "${{" in node.value
    if isinstance(node, YSeq):
        return any(_has_expression(n) for n in node.items)
    return any(_has_expression(v) for _, v in node.items)


def _is_number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def _kind(node: YNode) -> str:
    if isinstance(node, YScalar):
        return {"null": "null", "boolean": "a boolean", "number": "a number"}.get(
            node.kind, "a string"
        )
    return "a list" if isinstance(node, YSeq) else "a mapping"
