"""`load_workflow(path) -> Workflow`: YAML -> validated, immutable model.

Every problem is collected (nothing stops at the first) and reported as
`path:line:col: message`; loading executes nothing. Local reusable workflows
(`uses: ./.github/workflows/x.yml`) are loaded, validated against their
`on.workflow_call` declaration, and attached to the caller job as `callee`.
"""

from __future__ import annotations

import itertools
import math
import os
import re
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from preloop.actions.workflows import fetch_remote_workflow, planning, skipped_workflow
from preloop.errors import PreloopError
from preloop.workflow import expressions as ex
from preloop.workflow.availability import EVENTS as SCHEMA_EVENTS
from preloop.workflow.availability import allowed_at, child, expression_keys_allowed
from preloop.workflow.cron import is_valid_cron
from preloop.workflow.matrix import MatrixError, expand_matrix, max_parallel_limit
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
from preloop.workflow.permissions import permission_problems
from preloop.workflow.templates import is_insert
from preloop.workflow.uses import (
    is_local,
    local_path_error,
    step_uses_error,
    workflow_uses_error,
)
from preloop.workflow.yamltree import Diagnostic, YMap, YNode, YScalar, YSeq, compose, plain

__all__ = ["MAX_REUSABLE_DEPTH", "WorkflowError", "load_workflow", "workflow_files"]

#: GitHub: reusable workflows nest at most ten levels, the top-level caller included.
MAX_REUSABLE_DEPTH = 10
#: GitHub: at most 50 unique reusable workflows in one workflow's tree of calls.
MAX_REUSABLE_WORKFLOWS = 50
#: GitHub: a value holding `${{ }}` is at most this long (it is one expression).
MAX_EXPRESSION_LENGTH = 21000

#: Every event GitHub's schema knows (its filters and activity types: `availability.EVENTS`).
EVENTS = frozenset(SCHEMA_EVENTS)
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
#: `on.workflow_dispatch.inputs` may declare at most this many inputs (GitHub
#: raised it from 10 to 25 in December 2025).
MAX_DISPATCH_INPUTS = 25

# Mappings whose keys GitHub reads one by one as names once the file has
# parsed (its converters, not its schema): an `${{ insert }}` the schema lets
# through is refused there ("Unexpected type 'InsertExpressionToken'").
_KEYS_READ_AS_NAMES = {
    "concurrency": "`concurrency`",
    "jobs.*.concurrency": "`concurrency`",
    "jobs.*.environment": "`environment`",
    "jobs.*.services": "`services`",
}
_CONTAINER_KEYS = frozenset(["image", "options", "env", "ports", "volumes", "credentials"])
_SERVICE_KEYS = _CONTAINER_KEYS | {"entrypoint", "command"}
_STEP_PATHS = {k: f"jobs.*.steps[].{k}" for k in STEP_KEYS}
_DISPATCH_TYPES = ("boolean", "choice", "number", "environment", "string")
_CALLER_ONLY = CALLER_KEYS - JOB_KEYS
_JOB_ONLY = JOB_KEYS - CALLER_KEYS
RUN_ONLY = ("shell", "working-directory")
USES_ONLY = ("with",)
# Which contexts (and special functions) each value may use comes from GitHub's
# workflow schema: see `availability.allowed_at` (paths like `jobs.*.env`).
_STATUS = frozenset(["success", "failure", "always", "cancelled"])
_SPECIAL_FUNCTIONS = _STATUS | {"hashfiles"}
_JOB_ID = re.compile(r"[A-Za-z_][A-Za-z0-9_-]*")
_LITERAL = re.compile(
    r"\s*(?:'(?:[^']|'')*'|[-+]?(?:0x[0-9a-fA-F]+|[0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)"
    r"|true|false|null)\s*"
)


class WorkflowError(PreloopError):
    """A workflow (or a workflow it calls) is invalid. `diagnostics` lists every
    problem once (a called workflow's, met through two callers, too); the
    message is one `path:line:col: message` line per problem."""

    def __init__(self, diagnostics: list[Diagnostic], primary: str | None = None) -> None:
        # Deduplicated in their order: the sort is stable, and problems at one
        # place keep the order they were found in.
        unique = list(dict.fromkeys(diagnostics))
        self.diagnostics = sorted(unique, key=_order(unique, primary))
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
    path: str | os.PathLike[str],
    *,
    root: str | os.PathLike[str] | None = None,
    jobs: Collection[str] | None = None,
) -> Workflow:
    """Loads and validates one workflow file (and the reusable workflows it
    calls). With `jobs` (`--job` names: job keys or `caller/inner`), only
    those jobs and the jobs they need load the reusable workflows they call
    (a remote one is fetched); another caller is loaded as skipped, so a job
    asked for runs offline whatever the rest of the file calls. Raises
    WorkflowError listing every problem."""
    p = Path(path)
    try:
        repo = Path(root) if root is not None else _repo_root(p)
        asked = None if jobs is None else frozenset(n.split("/", 1)[0].lower() for n in jobs)
        state = _State(repo=repo.resolve(), asked=asked)
        display = _display(p, repo)
        p.resolve(strict=True)
    except (OSError, RuntimeError) as exc:  # RuntimeError: a symlink loop (Python 3.11)
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise WorkflowError([Diagnostic(str(p), 1, 1, f"cannot read workflow: {reason}")]) from None
    with planning():  # the remote workflows it calls resolve once per run
        wf = _load(state, p, depth=1, display=display)
    if state.errors or wf is None:
        raise WorkflowError(state.errors or [Diagnostic(display, 1, 1, "empty workflow")], display)
    return wf


def _needed_by(jobs: YMap, asked: frozenset[str]) -> frozenset[str]:
    """The job keys of `jobs` (lower case) among `asked` and every job they
    need, read from the raw `needs:` (a job the loader will refuse counts
    too: fetching more than needed is harmless)."""
    needs: dict[str, list[str]] = {}
    for k, v in jobs.items:
        node = v.get("needs") if isinstance(v, YMap) else None
        items = node.items if isinstance(node, YSeq) else [node] if node is not None else []
        needs[str(k.value).lower()] = [
            str(n.value).lower() for n in items if isinstance(n, YScalar) and n.value is not None
        ]
    keep: set[str] = set()
    todo = [a for a in asked if a in needs]
    while todo:
        job = todo.pop()
        if job not in keep:
            keep.add(job)
            todo.extend(needs.get(job, []))
    return frozenset(keep)


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
    called: set[Path] = field(default_factory=set)  # every reusable workflow in the tree
    # Repository root of each workflow file fetched from another repository.
    origins: dict[Path, Path] = field(default_factory=dict)
    # The top-level job keys asked for (lower case), None for every job.
    asked: frozenset[str] | None = None


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


class _Using:
    """`with reader.using(...)`: a plain class (cheaper than a generator-based
    context manager; the loader enters one per value)."""

    __slots__ = ("contexts", "functions", "reader", "saved")

    def __init__(
        self, reader: _Reader, contexts: frozenset[str], functions: Mapping[str, int]
    ) -> None:
        self.reader = reader
        self.contexts = contexts
        self.functions = functions

    def __enter__(self) -> None:
        r = self.reader
        self.saved = r.allowed, r.functions
        r.allowed, r.functions = self.contexts, self.functions

    def __exit__(self, *exc: object) -> None:
        self.reader.allowed, self.reader.functions = self.saved


class _Reader:
    def __init__(self, state: _State, path: str, depth: int) -> None:
        self.state = state
        self.path = path
        self.depth = depth
        self.errors: list[Diagnostic] = []
        self.source = ""
        self.allowed: frozenset[str] = ex.CONTEXT_NAMES
        self.functions: Mapping[str, int] = dict.fromkeys(_SPECIAL_FUNCTIONS, 0)
        self.wf_permissions: Any = None
        # Job keys (lower case) whose remote reusable workflows are fetched;
        # None: every job's.
        self.fetching: frozenset[str] | None = None

    def using(self, contexts: frozenset[str], functions: Mapping[str, int] | None = None) -> _Using:
        """Values read inside may use only these contexts and special functions."""
        return _Using(self, contexts, functions or {})

    def at(self, path: str) -> _Using:
        """Values read inside sit at schema path `path` (`jobs.*.env`)."""
        contexts, functions = allowed_at(path)
        return _Using(self, contexts, functions)

    def check_tree(self, node: YNode, path: str) -> None:
        """Checks every template under `node`, each against its own path."""
        with self.at(path):
            if isinstance(node, YScalar):
                if isinstance(node.value, str):
                    self.check_template(node, node.value)
            elif isinstance(node, YSeq):
                for n in node.items:
                    self.check_tree(n, path + "[]")
            else:
                for k, v in node.items:
                    if _is_expression_key(k):
                        self.expression_key(k, v, path)
                    else:
                        self.check_tree(v, child(path, str(k.value)))

    def expression_key(self, key: YScalar, value: YNode, path: str) -> bool:
        """Checks `${{ insert }}` or an expression key `key` (with its value)
        in the mapping at schema path `path`; whether it may stand there.
        Where it may is derived from the schema (`expression_keys_allowed`);
        a few mappings GitHub then reads key by key as names refuse it."""
        if not expression_keys_allowed(path):
            self.err(key, "a template expression (${{ }}) is not allowed as a key here")
            return False
        what = _KEYS_READ_AS_NAMES.get(path)
        if what is not None:
            self.err2(
                key,
                f"the keys of {what} are names: `${{{{ insert }}}}` or an expression key"
                " is not allowed there",
            )
            return False
        with self.at(path):
            if not is_insert(key.value):
                self.check_template(key, str(key.value))
            # An inserted mapping (or an expression key) stands for the
            # mapping's own entries.
            self.check_tree(value, child(path, "*"))
        return True

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

    def keys(
        self,
        m: YMap,
        allowed: frozenset[str],
        what: str,
        path: str | None = None,
        *,
        checked: bool = False,
    ) -> None:
        """Every key of `m` is one of `allowed`; with the mapping's schema
        `path`, `${{ insert }}` and expression keys are checked there instead
        (or skipped when `checked`: `check_tree` already did)."""
        for k, v in m.items:
            if path is not None and _is_expression_key(k):
                if not checked:
                    self.expression_key(k, v, path)
            elif k.value not in allowed:
                self.err(k, f"unknown key '{k.value}' in {what}")

    def string(self, node: YNode | None, what: str, *, allow_empty: bool = True) -> str | None:
        if node is None:
            return None
        # GitHub's parser takes any scalar where a string goes (`run: true`,
        # `name: 3.12`) and reads it as its text.
        if isinstance(node, YScalar) and isinstance(node.value, str | int | float):
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
        if len(text) > MAX_EXPRESSION_LENGTH:
            self.err(
                node, f"the value exceeds GitHub's expression limit of {MAX_EXPRESSION_LENGTH}"
            )
            return
        try:
            segments = ex.template_segments(text)
        except ex.ExpressionError as exc:
            # GitHub places an unclosed `${{` at the start of the value.
            self.err(node, f"invalid expression: {exc.reason}")
            return
        # Where no context is available GitHub folds a lone literal
        # (`${{ 'bash' }}`) into a plain value and refuses any other expression.
        if (
            not self.allowed
            and not self.functions
            and not (len(segments) == 1 and segments[0][0] and _LITERAL.fullmatch(segments[0][1]))
        ):
            if len(segments) == 1 and segments[0][0]:
                # A lone expression is read as one: GitHub names what it uses
                # (no context is available), where its `${{` is.
                before = len(self.errors)
                self.check_expression(node, segments[0][1], 0)
                if len(self.errors) > before:
                    return
            self.err(node, "a template expression (${{ }}) is not allowed here")
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
            only = (
                f"only {', '.join(sorted(self.allowed))}"
                if self.allowed
                else "no context may be used here"
            )
            self.err_at(
                node,
                k,
                f"context '{unavailable[0]}' is not available here ({only}) in expression `{expr}`",
                phase,
            )
            return
        functions = sorted((parsed.functions & _SPECIAL_FUNCTIONS) - set(self.functions))
        if functions:
            self.err_at(
                node, k, f"function {functions[0]}() is not available here: `{expr}`", phase
            )
            return
        for name in sorted(parsed.functions & _SPECIAL_FUNCTIONS):
            if parsed.arity.get(name, 0) > self.functions[name]:
                self.err_at(node, k, f"too many arguments to {name}() here: `{expr}`", phase)
                return

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
            # Any number, as GitHub's parser takes it (its reader test data
            # keeps -1e400 as -Infinity); one that is not positive sets no
            # limit at run time (`planner.job_timeout`, a step's is ignored).
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
            if isinstance(k.value, str) and "${{" in k.value:
                if is_insert(k.value):
                    # `${{ insert }}: ${{ <a mapping> }}` merges that mapping here.
                    if not (isinstance(v, YScalar) and _has_expression(v)):
                        self.err(v, "`${{ insert }}` needs an expression giving a mapping")
                        continue
                else:
                    self.check_template(k, k.value)
            if isinstance(v, YScalar):
                if isinstance(v.value, str):
                    self.check_template(v, v.value)
                # Environment variables are strings (`A: 1` is "1").
                out[str(k.value)] = ex.coerce_string(v.value)
            else:
                self.err(v, f"{what} value '{k.value}' must be a string, not {_kind(v)}")
        return frozen_map(out)

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
        with self.at("name"):
            declared = self.string(m.get("name"), "`name`")
            name = declared or Path(self.path).name
        with self.at("run-name"):
            run_name = self.string(m.get("run-name"), "`run-name`")
        with self.at("defaults.run"):
            defaults = self.defaults(m.get("defaults"))
        with self.at("concurrency"):
            conc = self.concurrency(m.get("concurrency"))
        with self.at("env"):
            env = self.env(m.get("env"), "`env`")
        permissions = self.wf_permissions = self.permissions(m.get("permissions"))
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
            named=declared is not None and declared != "",
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
                with self.at("on.schedule[].cron"):
                    self.schedule(value)
                events[event] = plain(value)
                continue
            if isinstance(value, YMap) and "mapping" not in SCHEMA_EVENTS[event][2]:
                # GitHub runs `create: {tags: [v*]}` (helm/helm's release.yml) on
                # every `create`: its service reads `on` with the loose schema
                # (`workflow-root`, any value under an event), and only its editor
                # parser (the strict one in @actions/workflow-parser) refuses the
                # filters of an event that takes none. Accepted, and ignored.
                value = None
            if value is not None and not isinstance(value, YMap | YSeq):
                self.err(value, f"the filters of event '{event}' must be a mapping")
                continue
            if isinstance(value, YMap) and event != "workflow_call":
                self.event_filters(event, value)
            elif isinstance(value, YSeq):
                self.err(value, f"the filters of event '{event}' must be a mapping, not a list")
            events[event] = plain(value) if value is not None else None
        return events, call, dispatch

    def event_filters(self, event: str, value: YMap) -> None:
        """An event's filters and activity types, as GitHub's schema lists them."""
        filters, types, _ = SCHEMA_EVENTS[event]
        if event != "workflow_dispatch":  # GitHub ignores unknown keys there
            self.keys(value, frozenset(filters), f"event '{event}'")
        for k, v in value.items:
            if k.value == "inputs" or k.value not in filters:
                continue
            if isinstance(v, YScalar) and v.value is None:
                # `tags:` with no value (flake8's and pre-commit's `push: {branches:
                # [main], tags: }`): GitHub's service runs the workflow, the key
                # there with no patterns, so every tag push (`triggers`).
                continue
            items = v.items if isinstance(v, YSeq) else (v,)
            for item in items:
                if not (isinstance(item, YScalar) and isinstance(item.value, str)):
                    self.err(item, f"event '{event}' `{k.value}` must be strings")
                elif "${{" in item.value:
                    # No context here: a lone literal is folded, anything else refused.
                    with self.at(f"on.{event}.{k.value}"):
                        self.check_template(item, item.value)
                elif k.value == "types" and types and item.value not in types:
                    self.err(
                        item,
                        f"unknown activity type '{item.value}' for event '{event}' "
                        f"(one of: {', '.join(types)})",
                    )

    def dispatch_inputs(self, inputs: YMap) -> None:
        allowed = frozenset(["description", "type", "required", "default", "options"])
        if len(inputs.items) > MAX_DISPATCH_INPUTS:
            # GitHub's service limit (its npm parser and schema do not check it).
            extra = inputs.items[MAX_DISPATCH_INPUTS][0]
            self.err2(
                extra,
                f"you may only define up to {MAX_DISPATCH_INPUTS} `inputs` for a"
                f" `workflow_dispatch` event (this is input {MAX_DISPATCH_INPUTS + 1})",
            )
        for k, v in inputs.items:
            if isinstance(v, YScalar) and v.value is None:
                continue  # `x:` declares a string input (GitHub's reader test data)
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
            cron = em.get("cron")
            if cron is None:
                self.err(em, "a `schedule` entry needs `cron`")
            else:
                before = len(self.errors)
                text = self.string(cron, "`cron`", allow_empty=False)
                if text and "${{" in text and len(self.errors) == before:
                    # Only a lone literal is allowed here: GitHub folds it into the value.
                    text = ex.coerce_string(ex.evaluate_template(text, {}))
                if len(self.errors) == before and not is_valid_cron(text or ""):
                    # GitHub checks the syntax once the file has parsed (phase 1).
                    self.err2(
                        cron,
                        f"invalid cron expression '{text}': expected five fields"
                        " '* * * * *' (minute hour day month weekday)",
                    )

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
                    self.check_tree(default, "on.workflow_call.inputs.*.default")
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
                        with self.at("on.workflow_call.outputs.*.value"):
                            self.string(value, f"output '{k.value}' value")
                out[str(k.value)] = d
        return WorkflowCall(
            inputs=frozen_map(sections["inputs"]),
            outputs=frozen_map(sections["outputs"]),
            secrets=frozen_map(sections["secrets"]),
        )

    def defaults(self, node: YNode | None, path: str = "defaults") -> Mapping[str, Any]:
        """`defaults.run` at schema path `path` (`defaults`, `jobs.*.defaults`);
        an `${{ insert }}` kept in it is expanded when the job starts."""
        if node is None:
            return frozen_map(None)
        m = self.mapping(node, "`defaults`")
        if m is None:
            return frozen_map(None)
        self.keys(m, frozenset({"run"}), "`defaults`", path)
        run = m.get("run")
        if run is None:
            return frozen_map(None)
        rm = self.mapping(run, "`defaults.run`")
        if rm is None:
            return frozen_map(None)
        self.keys(rm, frozenset({"shell", "working-directory"}), "`defaults.run`", f"{path}.run")
        out: dict[str, Any] = {}
        for k, v in rm.items:
            if _is_expression_key(k):
                out[str(k.value)] = plain(v)
        for key in ("shell", "working-directory"):
            value = self.string(rm.get(key), f"`defaults.run.{key}`")
            if value is not None:
                out[key] = value
        return frozen_map(out)

    def concurrency(self, node: YNode | None, path: str = "concurrency") -> Concurrency | None:
        if node is None:
            return None
        if isinstance(node, YScalar):
            group = self.string(node, "`concurrency`", allow_empty=False)
            return Concurrency(group=group) if group is not None else None
        m = self.mapping(node, "`concurrency`")
        if m is None:
            return None
        self.keys(m, frozenset({"group", "cancel-in-progress", "queue"}), "`concurrency`", path)
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
        seen: set[str] = set()
        if self.depth == 1 and self.state.asked is not None:
            self.fetching = _needed_by(m, self.state.asked)
        for k, v in m.items:
            job_id = str(k.value)
            if job_id.lower() in seen:
                # GitHub's job ids are case-insensitive: `build` and `BUILD` collide.
                self.err(k, f"'{job_id}' is already defined (job ids ignore case)")
                continue
            seen.add(job_id.lower())
            if not _JOB_ID.fullmatch(job_id):
                self.err(
                    k,
                    f"invalid job id '{job_id}': it must start with a letter or '_' and "
                    "contain only letters, digits, '-' and '_'",
                )
            elif job_id.startswith("__"):
                # GitHub checks this once the file has parsed, as for step ids.
                self.err2(k, f"invalid job id '{job_id}': ids starting with '__' are reserved")
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
        if_ = name = conc = strategy = None
        if (got := m.get("if")) is not None:
            with self.at("jobs.*.if"):
                if_ = self.condition(got)
        if (got := m.get("name")) is not None:
            with self.at("jobs.*.name"):
                name = self.string(got, "`name`")
        if (got := m.get("concurrency")) is not None:
            with self.at("jobs.*.concurrency"):
                conc = self.concurrency(got, "jobs.*.concurrency")
        if (got := m.get("strategy")) is not None:
            with self.at("jobs.*.strategy"):
                strategy = self.strategy(got, job_id)
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
        with self.at("jobs.*.runs-on"):
            runs_on = self.runs_on(m.get("runs-on"), m)
        coe: bool | str = False
        timeout: float | str | None = None
        if (got := m.get("continue-on-error")) is not None:
            with self.at("jobs.*.continue-on-error"):
                coe = self.bool_or_expr(got, "`continue-on-error`", False)
        if (got := m.get("timeout-minutes")) is not None:
            with self.at("jobs.*.timeout-minutes"):
                timeout = self.number_or_expr(got, "`timeout-minutes`")
        if (got := m.get("cancel-timeout-minutes")) is not None:
            with self.at("jobs.*.cancel-timeout-minutes"):
                self.number_or_expr(got, "`cancel-timeout-minutes`")
        for extra in ("container", "services", "environment", "snapshot"):
            if (extra_node := m.get(extra)) is not None:
                self.check_tree(extra_node, f"jobs.*.{extra}")
        env: Mapping[str, Any] = frozen_map(None)
        defaults: Mapping[str, Any] = frozen_map(None)
        if (got := m.get("env")) is not None:
            with self.at("jobs.*.env"):
                env = self.env(got, "`env`")
        if (got := m.get("defaults")) is not None:
            with self.at("jobs.*.defaults.run"):
                defaults = self.defaults(got, "jobs.*.defaults")
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
                if _is_expression_key(k):
                    self.expression_key(k, v, "jobs.*.outputs")
                    continue
                with self.at("jobs.*.outputs.*"):
                    s = self.string(v, f"output '{k.value}'")
                if s is not None:
                    outputs[str(k.value)] = s
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
            services=self.services(m.get("services")),
            environment=plain(e) if (e := m.get("environment")) is not None else None,
        )

    def container(self, node: YNode | None, what: str = "`container`") -> Any:
        if node is None:
            return None
        if isinstance(node, YSeq):
            self.err(node, f"{what} must be an image name or a mapping, not {_kind(node)}")
            return None
        service = what != "`container`"
        if isinstance(node, YMap):
            path = "jobs.*.services.*" if service else "jobs.*.container"
            keys = _SERVICE_KEYS if service else _CONTAINER_KEYS
            self.keys(node, keys, what, path, checked=True)  # see `job`'s check_tree
            if _has_expression(node):
                return plain(node)  # GitHub checks the shape once it is evaluated
            image = node.get("image")
            if image is None:
                self.err2(node, f"{what} needs an `image`")
            elif not (isinstance(image, YScalar) and isinstance(image.value, str)):
                self.err(image, f"{what} `image` must be a non-empty string")
            elif not image.value.strip():
                self.err(image, f"{what} `image` must not be empty")
            creds = node.get("credentials")
            if creds is not None and (cm := self.mapping(creds, f"{what} `credentials`")):
                self.keys(cm, frozenset({"username", "password"}), f"{what} `credentials`")
                for key in ("username", "password"):
                    value = cm.get(key)
                    if value is None:
                        self.err2(cm, f"{what} `credentials` needs a `{key}`")
                    elif not (isinstance(value, YScalar) and isinstance(value.value, str)):
                        self.err(value, f"{what} `credentials.{key}` must be a string")
                    elif not value.value:
                        self.err(value, f"{what} `credentials.{key}` must not be empty")
        elif isinstance(node, YScalar) and node.value == "":
            self.err(node, f"{what} must be a non-empty image name")
        return plain(node)

    def services(self, node: YNode | None) -> Mapping[str, Any]:
        if node is None:
            return frozen_map(None)
        m = self.mapping(node, "`services`")
        if m is None:
            return frozen_map(None)
        for k, v in m.items:
            if not _is_expression_key(k):  # refused by `check_tree`
                self.container(v, f"service '{k.value}'")
        return frozen_map(plain(m))

    def condition(self, node: YNode | None) -> str | None:
        if node is None or (isinstance(node, YScalar) and node.value is None):
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
            group = out["group"] = self.string(g, "`runs-on.group`", allow_empty=False)
            if group is not None and "${{" not in group:
                problem = _runner_group_error(group)
                if problem:
                    self.err2(g, problem)
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
        # GitHub takes `${{ insert }}` (or an expression key) here too: the
        # schema gives `strategy` its contexts, and its converter keeps the
        # mapping whole. What is written beside it is still checked below.
        self.keys(
            m, frozenset({"matrix", "fail-fast", "max-parallel"}), "`strategy`", "jobs.*.strategy"
        )
        fail_fast = self.bool_or_expr(m.get("fail-fast"), "`fail-fast`", True)
        max_parallel: int | str | None = None
        mp = m.get("max-parallel")
        if mp is not None:
            if isinstance(mp, YScalar) and isinstance(mp.value, str) and "${{" in mp.value:
                self.check_template(mp, mp.value)
                max_parallel = mp.value
            elif isinstance(mp, YScalar) and _is_number(mp.value) and math.isfinite(mp.value):
                max_parallel = max_parallel_limit(mp.value)
            else:
                shown = mp.value if isinstance(mp, YScalar) else _kind(mp)
                self.err(mp, f"`max-parallel` must be a finite number, not {shown!r}")
        matrix = self.matrix(m.get("matrix"), job_id)
        return Strategy(
            matrix=matrix,
            fail_fast=fail_fast,
            max_parallel=max_parallel,
            max_parallel_at=(mp.line, mp.column) if mp is not None else (0, 0),
            template=plain(m) if any(_is_expression_key(k) for k, _ in m.items) else None,
        )

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
            self.check_tree(m, "jobs.*.strategy.matrix")
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
            if step.id is not None and _JOB_ID.fullmatch(step.id):
                id_node = n.get("id") if isinstance(n, YMap) else None
                where = id_node if id_node is not None else n
                if step.id.lower() in ids:
                    self.err2(where, f"step id '{step.id}' is used twice in this job")
                elif step.id.startswith("__"):
                    self.err2(
                        where, f"invalid step id '{step.id}': ids starting with '__' are reserved"
                    )
                ids.add(step.id.lower())
            steps.append(step)
        return tuple(steps)

    def step(self, node: YNode) -> Step | None:
        with self.at("jobs.*.steps[]"):
            return self.read_step(node)

    def step_value(self, m: YMap, key: str, what: str, **kw: Any) -> str | None:
        node = m.get(key)
        if node is None:
            return None
        with self.at(_STEP_PATHS[key]):
            return self.string(node, what, **kw)

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
                        with self.at("jobs.*.steps[].with.*"):
                            self.check_template(v, v.value)
                    with_[str(k.value)] = v.value
                else:
                    self.err(v, f"`with` value '{k.value}' must be a string, not {_kind(v)}")
        uses_node = m.get("uses")
        if isinstance(uses_node, YScalar) and isinstance(uses_node.value, str):
            problem = step_uses_error(uses_node.value)
            if problem is not None:
                # Only the form: a local action's action.yml is read when its step runs,
                # as GitHub does (an earlier step may generate it, or put it beside the
                # workspace: `./../action/init`), and only then is its path bounded.
                self.err2(uses_node, f"invalid `uses`: {problem}")
        step_id = self.step_value(m, "id", "step `id`")
        if step_id is not None and not _JOB_ID.fullmatch(step_id):
            id_node = m.get("id")
            assert id_node is not None
            self.err2(  # GitHub checks ids with the other step-id rules (second pass)
                id_node,
                f"invalid step id '{step_id}': it must start with a letter or '_' and contain "
                "only letters, digits, '-' and '_'",
            )
        timeout = if_ = None
        env: Mapping[str, Any] = frozen_map(None)
        coe: bool | str = False
        if (n := m.get("timeout-minutes")) is not None:
            with self.at("jobs.*.steps[].timeout-minutes"):
                timeout = self.number_or_expr(n, "`timeout-minutes`")
        if (n := m.get("if")) is not None:
            with self.at("jobs.*.steps[].if"):
                if_ = self.condition(n)
        if (n := m.get("env")) is not None:
            with self.at("jobs.*.steps[].env"):
                env = self.env(n, "`env`")
        if (n := m.get("continue-on-error")) is not None:
            with self.at("jobs.*.steps[].continue-on-error"):
                coe = self.bool_or_expr(n, "`continue-on-error`", False)
        return Step(
            id=step_id,
            name=self.step_value(m, "name", "step `name`"),
            if_=if_,
            run=self.step_value(m, "run", "`run`"),
            uses=self.step_value(m, "uses", "`uses`", allow_empty=False),
            with_=frozen_map(with_),
            shell=self.step_value(m, "shell", "`shell`"),
            working_directory=self.step_value(m, "working-directory", "`working-directory`"),
            env=env,
            continue_on_error=coe,
            timeout_minutes=timeout,
        )

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
                if _is_expression_key(k):
                    self.expression_key(k, v, "jobs.*.with")  # the schema refuses it
                    continue
                if isinstance(v, YScalar):
                    if isinstance(v.value, str):
                        with self.at("jobs.*.with.*"):
                            self.check_template(v, v.value)
                    with_[str(k.value)] = v.value
                    with_keys[str(k.value)] = v
                else:
                    self.err(v, f"input '{k.value}' must be a scalar, not {_kind(v)}")
        secrets: Mapping[str, Any] | str | None = None
        secret_keys: dict[str, YScalar] = {}
        if (s := m.get("secrets")) is not None:
            if isinstance(s, YScalar) and s.value == "inherit":
                secrets = "inherit"
            elif (sm := self.mapping(s, "`secrets`")) is not None:
                self.check_tree(sm, "jobs.*.secrets")
                secrets = frozen_map({str(k.value): plain(v) for k, v in sm.items})
                secret_keys = {str(k.value): v for k, v in sm.items if isinstance(v, YScalar)}
        callee = None
        skipped = None if uses is None else skipped_workflow(uses)
        if (
            uses is not None
            and self.fetching is not None
            and str(common["id"]).lower() not in self.fetching
        ):
            # Not loaded at all: a local callee may call remote ones in turn.
            skipped = "not asked for (--job): not loaded"
        if uses is not None and skipped is not None:
            return Job(
                **common, uses=uses, with_=frozen_map(with_), secrets=secrets, skipped_call=skipped
            )
        if uses is not None:
            callee = self.callee(uses_node, uses, with_, with_keys, secrets, secret_keys)
        if callee is not None:
            granted = common["permissions"]
            if granted is None:
                granted = self.wf_permissions
            for problem in permission_problems(callee, granted):
                self.errors.append(
                    Diagnostic(
                        self.path,
                        common["line"],
                        common["column"],
                        f"error calling workflow '{uses}': {problem}",
                        phase=1,
                    )
                )
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
        problem = workflow_uses_error(uses)
        local = is_local(uses)
        # `$/` is the calling file's own repository (see preloop.actions.workflows).
        origin = self.state.repo
        if uses.startswith("$/") and self.state.stack:
            origin = self.state.origins.get(self.state.stack[-1], origin)
        if problem is None and local:
            problem = local_path_error(uses, origin)
        if problem is not None:
            self.err2(node, f"invalid `uses`: {problem}")
            return None
        if self.depth + 1 > MAX_REUSABLE_DEPTH:
            self.err2(
                node,
                f"reusable workflows nest at most {MAX_REUSABLE_DEPTH} levels deep "
                f"(calling '{uses}' would be level {self.depth + 1})",
            )
            return None
        if local:
            target, display = (origin / uses[2:].replace("\\", "/")).resolve(), uses[2:]
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
        self.state.called.add(target)
        if len(self.state.called) > MAX_REUSABLE_WORKFLOWS:
            self.err2(
                node,
                f"a workflow may call at most {MAX_REUSABLE_WORKFLOWS} unique reusable workflows "
                f"(nested ones included); '{uses}' is one more",
            )
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
        # An `${{ insert }}` (or expression key) in `with:`/`secrets:` is refused
        # where it stands (the schema gives them no context); what it might
        # have provided is not reported missing on top of that.
        with_inserts = any("${{" in name for name in with_keys)
        for name, key in with_keys.items():
            if "${{" in name:
                continue
            if name not in decl.inputs:
                self.err2(
                    key, f"input '{name}' is not declared by '{uses}' (on.workflow_call.inputs)"
                )
                continue
            kind = decl.inputs[name].get("type")
            value = key.value
            if isinstance(value, str) and "${{" in value:
                continue  # typed when evaluated, as the caller starts
            if (kind == "boolean" and not isinstance(value, bool)) or (
                kind == "number" and not _is_number(value)
            ):
                self.err2(key, f"input '{name}' of '{uses}' is a {kind}, not {value!r}")
        for name, spec in decl.inputs.items():
            required = spec.get("required") is True and not with_inserts
            if required and name not in with_ and "default" not in spec:
                self.err2(node, f"'{uses}' requires input '{name}', which `with` does not provide")
        if secrets != "inherit":
            secret_inserts = any("${{" in name for name in secret_keys)
            for name, key in secret_keys.items():
                if name not in decl.secrets and "${{" not in name:
                    self.err2(key, f"secret '{name}' is not declared by '{uses}'")
            for name, spec in decl.secrets.items():
                if spec.get("required") is True and name not in secret_keys and not secret_inserts:
                    self.err2(
                        node, f"'{uses}' requires secret '{name}', which `secrets` does not pass"
                    )
        return callee


def _runner_group_error(group: str) -> str | None:
    """GitHub's rule for `runs-on.group`: a name, or `organization/<name>` or
    `enterprise/<name>` (also `org/`, `ent/`)."""
    names = group.split("/")
    if len(names) == 1:
        return None
    if len(names) == 2 and names[0] in ("org", "organization", "ent", "enterprise"):
        return None if names[1] else f"invalid runs-on group name '{group}'"
    return (
        f"invalid runs-on group name '{group}': use an 'organization/' or 'enterprise/' "
        "prefix to target one runner group"
    )


def _is_expression_key(key: YScalar) -> bool:
    """`${{ insert }}` or a key that is an expression."""
    return isinstance(key.value, str) and "${{" in key.value


def _has_expression(node: YNode) -> bool:
    if isinstance(node, YScalar):
        return isinstance(node.value, str) and "${{" in node.value
    if isinstance(node, YSeq):
        return any(_has_expression(n) for n in node.items)
    return any(_has_expression(k) or _has_expression(v) for k, v in node.items)


def _is_number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def _kind(node: YNode) -> str:
    if isinstance(node, YScalar):
        return {"null": "null", "boolean": "a boolean", "number": "a number"}.get(
            node.kind, "a string"
        )
    return "a list" if isinstance(node, YSeq) else "a mapping"
