"""Executes one job's steps in a checkout, with GitHub's step semantics.

`execute_job(spec, contexts, host)` runs `spec["steps"]` (the planner's step
data) one after another and returns a `JobResult`:

- `run:` steps: the script is written to a file under `RUNNER_TEMP` and run
  with the step's shell (`shell:` or `defaults.run.shell`): default
  `bash -e {0}` (`sh -e {0}` without bash), `bash` = `bash --noprofile --norc
  -eo pipefail {0}`, `sh` = `sh -e {0}`, `python` = `python {0}`, or any
  custom template containing `{0}`; in `working-directory` (relative to the
  workspace); with env layered workflow -> job -> `GITHUB_ENV` -> step.
- Step `if` (with `success()` implied), `continue-on-error` (`outcome` is
  what happened, `conclusion` what counts), step `timeout-minutes`; the
  job's `timeout-minutes` bounds all steps (fractions of a minute allowed).
- Environment files per step: `GITHUB_OUTPUT` (step outputs), `GITHUB_ENV`
  and `GITHUB_PATH` (effective from the next step on), `GITHUB_STEP_SUMMARY`
  (collected into the job summary), `GITHUB_STATE`; workflow commands and
  masking (`preloop.runner.commands`).
- `uses: actions/checkout@...` is satisfied by the snapshot checkout (its
  `path:` gets a clone of it; see `checkout_step`); every
  other `uses:` (local `./path` read when the step runs, `owner/repo@ref`
  from the action cache, `docker://image`) runs through `preloop.actions`:
  JavaScript actions with pre/main/post, composite actions as nested steps
  (below), Docker actions through `docker`.
- Every process runs through `preloop.process` in its own process group, so
  a timeout or cancellation (`JobControl.cancel()`) kills the whole group;
  groups a step left running in the background are killed when the job ends.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shlex
import shutil
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio

from preloop import config
from preloop.actions.metadata import (
    ActionMetadata,
    ActionMetadataError,
    deprecated_input,
    deprecation,
    unexpected_inputs,
)
from preloop.actions.reference import UsesError, is_checkout
from preloop.actions.steps import POST_STEPS_TIMEOUT, ActionSource, ActionStepError, ActionSteps
from preloop.errors import PreloopError
from preloop.process import CommandTimeout
from preloop.runner.checkout import CheckoutError, checkout_step
from preloop.runner.commands import (
    Annotation,
    EnvFileError,
    ProblemMatchers,
    WorkflowCommandParser,
    parse_env_file,
    parse_path_file,
)
from preloop.runner.limits import explain_e2big, limit_job_outputs
from preloop.runner.masking import Masker, mask_json
from preloop.runner.sandbox import StepSandbox
from preloop.runner.stream import run_streaming
from preloop.runner.watchdog import kill_tracked_ids
from preloop.services.toolcache import container_python, setup_action_hint, uv_base_bin
from preloop.workflow import expressions as ex
from preloop.workflow.hashfiles import hash_files
from preloop.workflow.plan import strategy_context
from preloop.workflow.selection import runner_arch
from preloop.workflow.step_ids import step_action_names
from preloop.workflow.templates import mapping_items

__all__ = [
    "SUPPORTED_USES",
    "JobControl",
    "JobHost",
    "JobResult",
    "StepResult",
    "execute_job",
    "kill_tracked",
    "masked_result",
    "tracking_prefix",
]

SUPPORTED_USES = (
    "preloop runs `run:` steps, `actions/checkout` (satisfied by the snapshot checkout), "
    "JavaScript, composite and Docker actions (`owner/repo@ref`, `./path`, `docker://image`)"
)

LogLine = Callable[[str], None]
#: Receives a batch of log lines (already masked), in order.
LogLines = Callable[[list[str]], None]


def _line_by_line(log: LogLine) -> LogLines:
    """A `LogLines` that hands each line of a batch to `log`."""

    def log_lines(lines: list[str]) -> None:
        for text in lines:
            log(text)

    return log_lines


@dataclass(frozen=True, slots=True)
class JobHost:
    """Where and how a job runs on this runner.

    `workspace` is the checkout (GITHUB_WORKSPACE); `temp` is RUNNER_TEMP (an
    empty directory); `sandbox` runs steps under bubblewrap (None: as they
    are); `base_env` is the process
    environment steps inherit (default: ours). `tracking_key` identifies the
    run on this host across every store (the submitting engine's run key):
    step processes are tagged with it, never with `run_id`, which another
    store on the same host may also use."""

    workspace: Path
    temp: Path
    run_id: str
    runner_name: str = "preloop"
    sandbox: StepSandbox | None = None
    base_env: Mapping[str, str] | None = None
    tool_cache: Path | None = None
    tracking_key: str | None = None
    # Where `uses: owner/repo@ref` actions come from (default: the action
    # cache of $PRELOOP_STATE_DIR and $PRELOOP_ACTION_OVERRIDES).
    actions: ActionSource | None = None
    # The job's RUNNER_TRACKING_ID when the runner chose it (default: a fresh one).
    tracking_id: str | None = None
    # Puts a fresh checkout of the run's snapshot at a path that does not
    # exist (the runner's copy of its template): `actions/checkout` after a
    # step moved or removed the workspace's checkout fetches it again on
    # GitHub. None: such a checkout step fails, saying so.
    recheckout: Callable[[Path], Awaitable[None]] | None = None


@dataclass(slots=True)
class StepResult:
    id: str
    name: str
    outcome: str  # success, failure, cancelled, skipped
    conclusion: str
    outputs: dict[str, str] = field(default_factory=dict)
    duration: float = 0.0


@dataclass(slots=True)
class JobResult:
    conclusion: str  # success, failure, cancelled
    outputs: dict[str, str]
    steps: list[StepResult]
    annotations: list[Annotation]
    summary: str
    reason: str | None = None

    @classmethod
    def from_dict(cls, doc: dict[str, Any]) -> JobResult:
        """The result `dataclasses.asdict` made of it (a stored result, read back)."""
        return cls(
            conclusion=str(doc.get("conclusion") or "failure"),
            outputs=dict(doc.get("outputs") or {}),
            steps=[StepResult(**s) for s in doc.get("steps") or []],
            annotations=[Annotation(**a) for a in doc.get("annotations") or []],
            summary=str(doc.get("summary") or ""),
            reason=doc.get("reason"),
        )


def masked_result(result: JobResult, masker: Masker) -> JobResult:
    """`result` with every string in it masked: step names and outputs, job
    outputs, annotations (all properties), the summary and the reason. What
    leaves a job (its log JSON, the store, the summary, `--json`) is this."""
    if not masker:
        return result
    m = masker.mask
    return JobResult(
        conclusion=result.conclusion,
        outputs=mask_json(result.outputs, masker),
        steps=[
            StepResult(
                m(s.id),
                m(s.name),
                s.outcome,
                s.conclusion,
                mask_json(s.outputs, masker),
                s.duration,
            )
            for s in result.steps
        ],
        annotations=[a.masked(masker) for a in result.annotations],
        summary=m(result.summary),
        reason=m(result.reason) if result.reason is not None else None,
    )


class JobControl:
    """Lets the job's owner cancel it (a heartbeat saw a cancel request, the
    runner got SIGTERM): the running step's process group is killed and only
    steps whose `if` asks for `always()`/`cancelled()` run after it."""

    def __init__(self) -> None:
        self.cancelled = False
        self._scope: anyio.CancelScope | None = None

    def cancel(self) -> None:
        if self.cancelled:
            return
        self.cancelled = True
        if self._scope is not None:
            self._scope.cancel()


_POWERSHELLS = ("pwsh", "powershell")
_PS_EXIT = r"if ((Test-Path -LiteralPath variable:\LASTEXITCODE)) { exit $LASTEXITCODE }"
#: GitHub's script file extensions by shell command (ScriptHandlerHelpers)
_SCRIPT_SUFFIX = {"bash": ".sh", "sh": ".sh", "python": ".py", "pwsh": ".ps1", "powershell": ".ps1"}

#: why exec(2) or chdir(2) can refuse a step's process before it runs
_NOT_STARTED = frozenset({errno.ENOENT, errno.EACCES, errno.ENOEXEC, errno.ENOTDIR})


def _not_started(exc: OSError, program: str, cwd: str) -> str:
    what = str(exc.filename)
    if what == cwd:
        return f"the step's working directory {cwd!r} is gone: {exc.strerror}"
    if what == program and exc.errno == errno.ENOENT and "/" not in program:
        return f"{program!r} was not found on the step's PATH"
    return f"cannot run {what!r}: {exc.strerror}"


class _StepFailure(PreloopError):
    """A step that could not run (bad shell, missing directory, unsupported uses)."""


def tracking_prefix(tracking_key: str) -> str:
    """The RUNNER_TRACKING_ID prefix of every step process of the run whose
    host-unique key is `tracking_key` (see `JobHost.tracking_key`)."""
    return f"preloop_{tracking_key}_"


def kill_tracked(tracking_id: str, *, prefix: bool = False) -> int:
    """SIGKILLs every process whose environment holds RUNNER_TRACKING_ID=`tracking_id`
    (or one starting with it when `prefix`), repeating until none is left, so
    children forked meanwhile go too. Returns how many were killed."""
    return kill_tracked_ids([tracking_id], prefix=prefix)


#: The github context's name for each step command file (GitHubContext's
#: `env`, `output`, ... from which the runner's GITHUB_ENV, ... come).
_FILE_CONTEXT = {
    "env": "GITHUB_ENV",
    "output": "GITHUB_OUTPUT",
    "path": "GITHUB_PATH",
    "state": "GITHUB_STATE",
    "step_summary": "GITHUB_STEP_SUMMARY",
}


def _str(v: Any) -> str:
    return ex.coerce_string(v)


@dataclass(slots=True)
class _Scope:
    """The steps of the job itself, or of one composite action invocation."""

    steps_ctx: dict[str, Any]
    inputs: Mapping[str, Any]
    action_path: Path | None = None
    prefix: str = ""
    failed: bool = False
    # `github.action` / GITHUB_ACTION of the step running in this scope: the
    # job's step's name (`step_action_names`); a composite's steps have the
    # step that called it's, as on GitHub (only the job's steps set it).
    action: str = ""


# GitHub's images have passwordless `sudo`, and workflows use it (`sudo apt-get
# install -y ...`). A job that runs as root on a host without sudo (a
# container) gets this stand-in: it drops sudo's options and runs the
# command, already root; another user is refused, saying so.
_SUDO = """#!/bin/sh
# preloop's sudo: the job runs as root already
while [ $# -gt 0 ]; do
  case "$1" in
    -u|--user)
      case "$2" in
        root|0|'#0') shift 2;;
        *) echo "sudo: the job runs as root; preloop cannot run a command as $2" >&2; exit 1;;
      esac;;
    -g|--group|-C|-h|-p|-r|-t|-T|-U) shift 2;;
    --) shift; break;;
    -*) shift;;
    *) break;;
  esac
done
[ $# -gt 0 ] || exit 0
exec env "$@"
"""


def _sudo_stand_in(host: JobHost) -> str | None:
    """The directory of the `sudo` stand-in (`_SUDO`) appended to the job's
    PATH, when the job runs unsandboxed as root and its PATH has no sudo."""
    if host.sandbox is not None or os.geteuid() != 0:
        return None
    env = host.base_env if host.base_env is not None else os.environ
    if shutil.which("sudo", path=env.get("PATH", os.defpath)) is not None:
        return None
    where = host.temp / "_runner_sudo"
    where.mkdir(parents=True, exist_ok=True)
    (where / "sudo").write_text(_SUDO, encoding="utf-8")
    (where / "sudo").chmod(0o755)
    return str(where)


class _Execution:
    def __init__(
        self,
        spec: Mapping[str, Any],
        contexts: Mapping[str, Any],
        host: JobHost,
        log: LogLine,
        masker: Masker,
        secrets: Mapping[str, str],
        control: JobControl,
        log_lines: LogLines | None = None,
    ) -> None:
        self.spec = spec
        self.host = host
        self.log_raw = log
        self.log_lines: LogLines = log_lines or _line_by_line(log)
        self.masker = masker
        self.control = control
        self.job_key = str(spec.get("job", ""))
        self.annotations: list[Annotation] = []
        # `::add-matcher::` registrations, for the rest of the job
        self.matchers = ProblemMatchers()
        self.summary_parts: list[str] = []
        self.step_results: list[StepResult] = []
        self.path_prepend: list[str] = []
        self.env_from_files: dict[str, str] = {}
        # The command files of the step about to run (see prepare_step_files).
        self.pending_files: dict[str, Path] | None = None
        self.status = "success"  # the job status the next step's `if` sees
        # GitHub's runner marks every step process with RUNNER_TRACKING_ID and
        # kills what still carries it when the job ends (orphans, daemons
        # that left the step's process group).
        self.tracking_id = host.tracking_id or (
            tracking_prefix(host.tracking_key or uuid.uuid4().hex) + uuid.uuid4().hex
        )
        self.commands_dir = host.temp / "_runner_file_commands"
        self.commands_dir.mkdir(parents=True, exist_ok=True)
        self.sudo_dir = _sudo_stand_in(host)
        for value in secrets.values():
            masker.add(value)
        # GitHub shows `::debug::` lines only with step debug logging on (the
        # ACTIONS_STEP_DEBUG secret or variable), and then tells steps so with
        # RUNNER_DEBUG=1; actions such as setup-python and the artifact client
        # are very talkative at debug level.
        self.step_debug = any(
            str(source.get("ACTIONS_STEP_DEBUG", "")).lower() == "true"
            for source in (secrets, contexts.get("vars") or {}, host.base_env or os.environ)
        )
        github = dict(contexts.get("github") or {})
        github["workspace"] = str(host.workspace)  # the job's checkout, never the source
        github.setdefault("job", self.job_key)
        github.setdefault("run_id", host.run_id)
        github.setdefault("run_number", "1")
        github.setdefault("run_attempt", "1")
        github.setdefault("action", "")
        github.setdefault("server_url", "https://github.com")
        github.setdefault("api_url", "https://api.github.com")
        github.setdefault("graphql_url", "https://api.github.com/graphql")
        github.setdefault("triggering_actor", github.get("actor", ""))
        github.setdefault("retention_days", str(config.get("PRELOOP_ARTIFACT_RETENTION_DAYS")))
        github.setdefault("ref_protected", False)
        github.setdefault("base_ref", "")  # set, empty outside pull requests
        github.setdefault("head_ref", "")
        github.setdefault("workflow_sha", github.get("sha", ""))
        github["event_path"] = str(host.temp / "_github_event.json")
        # GitHub's job token is both: here only a `--secret GITHUB_TOKEN` given.
        github["token"] = str(secrets.get("GITHUB_TOKEN") or "")
        if repository := str(github.get("repository") or ""):
            server = str(github["server_url"]).removeprefix("https://").removeprefix("http://")
            github.setdefault("repositoryUrl", f"git://{server}/{repository}.git")
        self.github = github
        # By identity: the job's step mappings are the same objects throughout.
        job_steps = list(spec.get("steps") or [])
        self.step_actions = {
            id(step): name
            for step, name in zip(job_steps, step_action_names(job_steps), strict=True)
        }
        event = github.get("event") if isinstance(github.get("event"), dict) else {}
        (host.temp / "_github_event.json").write_text(json.dumps(event), encoding="utf-8")
        self.runner_ctx = {
            "os": "Linux",
            "arch": runner_arch(),
            "name": host.runner_name,
            "temp": str(host.temp),
            "tool_cache": str(host.tool_cache or host.temp / "_tool"),
            "environment": "self-hosted",
        }
        self.base: dict[str, Any] = {
            "github": github,
            "inputs": contexts.get("inputs") or {},
            "needs": contexts.get("needs") or {},
            # null in a job without a matrix, as on GitHub (`toJSON(matrix)`)
            "matrix": contexts.get("matrix"),
            "strategy": strategy_context(contexts.get("strategy")),
            "vars": contexts.get("vars") or {},
            "secrets": {"GITHUB_TOKEN": "", **dict(secrets)},
            "runner": self.runner_ctx,
            "job": {"status": "success", "container": {}, "services": {}},
        }
        # Workflow env then job env (the planner merged them), each value a
        # template evaluated once at job start, as GitHub does.
        self.job_env: dict[str, str] = {}
        env_ctx: dict[str, str] = {}
        env_items = mapping_items(
            dict(spec.get("env") or {}), lambda v: self.value(v, {**self.base, "env": env_ctx})
        )
        for name, value, evaluated in env_items:
            ctx = {**self.base, "env": env_ctx}
            env_ctx[name] = _str(value) if evaluated else self.template(value, ctx)
        self.job_env = env_ctx
        # `defaults.run` values are templates evaluated for each step; an
        # `${{ insert }}` among them is expanded once, here, into final values.
        self.defaults: dict[str, Any] = {}
        self.final_defaults: set[str] = set()
        defaults_items = mapping_items(
            dict(spec.get("defaults") or {}), lambda v: self.value(v, {**self.base, "env": env_ctx})
        )
        for name, value, evaluated in defaults_items:
            self.defaults[name] = _str(value) if evaluated else value
            if evaluated:
                self.final_defaults.add(name)
            else:
                self.final_defaults.discard(name)
        self.actions = ActionSteps(self)

    # -- helpers ---------------------------------------------------------------
    def log(self, text: str) -> None:
        self.log_raw(self.masker.mask(text))

    def hash_files(self, patterns: list[str]) -> str:
        return hash_files(str(self.host.workspace), patterns)

    def template(self, value: Any, ctx: Mapping[str, Any]) -> str:
        if isinstance(value, str):
            return _str(ex.evaluate_template(value, ctx, hash_files=self.hash_files))
        if isinstance(value, bool):
            return "true" if value else "false"
        return _str(value)

    def step_default(self, step: Mapping[str, Any], key: str, ctx: Mapping[str, Any]) -> str | None:
        """A run step's `shell` or `working-directory`, else the `defaults.run`
        one, evaluated; None when neither is given."""
        raw = step.get(key)
        if not raw and key in self.final_defaults:
            return str(self.defaults[key]) or None
        raw = raw or self.defaults.get(key)
        return self.template(raw, ctx) if raw else None

    def value(self, value: Any, ctx: Mapping[str, Any]) -> Any:
        if isinstance(value, str):
            return ex.evaluate_template(value, ctx, hash_files=self.hash_files)
        return value

    def strings(self, mapping: Mapping[str, Any], ctx: Mapping[str, Any]) -> dict[str, str]:
        """Each value of a mapping (`with:`, a Docker action's `runs.env`)
        evaluated to a string, `${{ insert }}` and expression keys expanded
        (`mapping_items`)."""
        return {
            key: _str(value) if evaluated else self.template(value, ctx)
            for key, value, evaluated in mapping_items(dict(mapping), lambda v: self.value(v, ctx))
        }

    def with_inputs(self, step: Mapping[str, Any], ctx: Mapping[str, Any]) -> dict[str, str]:
        """A `uses` step's `with:`, evaluated (see `strings`)."""
        return self.strings(step.get("with") or {}, ctx)

    def contexts(self, scope: _Scope, env: Mapping[str, str]) -> dict[str, Any]:
        ctx = dict(self.base)
        ctx["env"] = dict(env)
        ctx["steps"] = scope.steps_ctx
        ctx["job"] = {**self.base["job"], "status": self.status}
        ctx["github"] = {**self.github, "action": scope.action}
        if scope.action_path is not None:
            ctx["inputs"] = scope.inputs
            ctx["github"]["action_path"] = str(scope.action_path)
        return ctx

    def enter_step(self, step: Mapping[str, Any], scope: _Scope) -> None:
        """Makes `step` (a job's step, its pre or post) the one `github.action`
        names in `scope`; a composite's steps keep its caller's."""
        if scope.action_path is None:
            scope.action = self.step_actions.get(id(step), "")

    def process_env(
        self, env: Mapping[str, str], files: Mapping[str, Path], scope: _Scope
    ) -> dict[str, str]:
        base = dict(self.host.base_env if self.host.base_env is not None else os.environ)
        # The store URL may carry database credentials: steps do not inherit it.
        base.pop("PRELOOP_STORE_URL", None)
        gh = self.github
        defaults = {
            "GITHUB_ACTIONS": "true",
            "GITHUB_WORKSPACE": str(self.host.workspace),
            "GITHUB_JOB": self.job_key,
            # a re-run's is its first run's, as GitHub's attempts share one
            "GITHUB_RUN_ID": _str(gh.get("run_id", self.host.run_id)),
            "GITHUB_RUN_NUMBER": _str(gh.get("run_number", "1")),
            "GITHUB_RUN_ATTEMPT": _str(gh.get("run_attempt", "1")),
            "GITHUB_EVENT_NAME": _str(gh.get("event_name", "")),
            "GITHUB_WORKFLOW": _str(gh.get("workflow", "")),
            "GITHUB_WORKFLOW_REF": _str(gh.get("workflow_ref", "")),
            "GITHUB_WORKFLOW_SHA": _str(gh.get("workflow_sha", "")),
            "GITHUB_SHA": _str(gh.get("sha", "")),
            "GITHUB_REF": _str(gh.get("ref", "")),
            "GITHUB_REF_NAME": _str(gh.get("ref_name", "")),
            "GITHUB_REF_TYPE": _str(gh.get("ref_type", "")),
            "GITHUB_REF_PROTECTED": "false",
            # Empty outside pull requests, as on GitHub (set, not missing).
            "GITHUB_BASE_REF": _str(gh.get("base_ref", "")),
            "GITHUB_HEAD_REF": _str(gh.get("head_ref", "")),
            "GITHUB_REPOSITORY_OWNER": _str(gh.get("repository_owner", "")),
            "GITHUB_TRIGGERING_ACTOR": _str(gh.get("triggering_actor", "")),
            "GITHUB_API_URL": _str(gh.get("api_url", "")),
            "GITHUB_GRAPHQL_URL": _str(gh.get("graphql_url", "")),
            "GITHUB_RETENTION_DAYS": _str(gh.get("retention_days", "")),
            "GITHUB_REPOSITORY": _str(gh.get("repository", "")),
            "GITHUB_ACTOR": _str(gh.get("actor", "")),
            "GITHUB_SERVER_URL": _str(gh.get("server_url", "")),
            "GITHUB_ACTION": scope.action,
            "GITHUB_EVENT_PATH": str(gh["event_path"]),
            "RUNNER_OS": "Linux",
            "RUNNER_ARCH": self.runner_ctx["arch"],
            "RUNNER_NAME": self.host.runner_name,
            "RUNNER_TEMP": str(self.host.temp),
            "RUNNER_TOOL_CACHE": self.runner_ctx["tool_cache"],
            "RUNNER_ENVIRONMENT": self.runner_ctx["environment"],
            "RUNNER_WORKSPACE": str(self.host.workspace.parent),
        }
        for name, path in files.items():
            defaults[name] = str(path)
        # A workflow's `env:` (or GITHUB_ENV) may set CI, never GitHub's own
        # GITHUB_* and RUNNER_* variables: the runner's values win. An
        # action's step env names its own GITHUB_ACTION_PATH.
        inherited = {"CI": "true"}
        if scope.action_path is not None:
            inherited["GITHUB_ACTION_PATH"] = str(scope.action_path)
        out = {**base, **inherited, **env, **defaults}
        # GitHub's Linux images put `$HOME/.local/bin` on PATH (their
        # /etc/environment), so what `pip install --user`, `uv tool install`
        # or pipx put there runs by name in the next step.
        sandbox = self.host.sandbox
        home = str(sandbox.home or "") if sandbox is not None else base.get("HOME")
        if home:
            user_bin = os.path.join(home, ".local", "bin")
            host_path = base.get("PATH", os.defpath)
            if user_bin not in host_path.split(os.pathsep) and out.get("PATH") == host_path:
                out["PATH"] = os.pathsep.join([user_bin, host_path]) if host_path else user_bin
        if self.path_prepend:
            out["PATH"] = os.pathsep.join([*reversed(self.path_prepend), out.get("PATH", "")])
        if self.sudo_dir is not None:
            out["PATH"] = os.pathsep.join([out.get("PATH", "") or os.defpath, self.sudo_dir])
        return out

    # -- steps -------------------------------------------------------------------
    async def run_steps(self, steps: list[Mapping[str, Any]], scope: _Scope) -> None:
        for index, step in enumerate(steps):
            await self.run_step(step, index, scope)

    async def run_step(self, step: Mapping[str, Any], index: int, scope: _Scope) -> None:
        step_id = str(step.get("id") or f"__{scope.prefix}{index}")
        self.enter_step(step, scope)
        self.prepare_step_files()
        pre_env = {**self.job_env, **self.env_from_files}
        ctx = self.contexts(scope, pre_env)
        name = self.step_name(step, ctx)
        status = "cancelled" if self.control.cancelled else self.status
        try:
            run_it = ex.evaluate_if(step.get("if"), ctx, status=status, hash_files=self.hash_files)
        except ex.ExpressionError as exc:
            self.log(f"✖ {name}: `if` cannot be evaluated: {exc}")
            self.record(scope, step_id, name, "failure", "failure", {}, 0.0)
            self.status = "failure"
            return
        if not run_it:
            self.record(scope, step_id, name, "skipped", "skipped", {}, 0.0)
            return
        started = time.monotonic()
        self.log(f"▶ {name}")
        outputs: dict[str, str] = {}
        outcome = "success"
        try:
            # The step's `env:` is evaluated as one mapping against the env
            # before it (GitHub's StepsRunner merges it only afterwards):
            # `B: ${{ env.A }}` does not see an `A` of the same block.
            env = dict(pre_env)
            items = mapping_items(dict(step.get("env") or {}), lambda v: self.value(v, ctx))
            for key, value, evaluated in items:
                env[key] = _str(value) if evaluated else self.template(value, ctx)
            step_ctx = {**ctx, "env": env}
            coe = step.get("continue-on-error", False)
            continue_on_error = ex.truthy(self.value(coe, step_ctx))
            minutes = step.get("timeout-minutes")
            timeout = (
                ex.to_number(self.value(minutes, step_ctx)) * 60.0 if minutes is not None else None
            )
            if timeout is not None and not timeout > 0:
                timeout = None  # as GitHub's runner: only a positive timeout applies
            if step.get("uses"):
                outputs, outcome = await self.run_uses(step, name, env, step_ctx, scope, timeout)
            else:
                outputs, outcome = await self.run_script(step, name, env, step_ctx, scope, timeout)
        except (
            ex.ExpressionError,
            _StepFailure,
            EnvFileError,
            ActionStepError,
            ActionMetadataError,
            UsesError,
        ) as exc:
            self.log(f"✖ {name}: {exc}")
            self.annotations.append(Annotation("error", str(exc), self.job_key, name))
            outcome = "failure"
            continue_on_error = ex.truthy(step.get("continue-on-error") is True)
        if self.control.cancelled and outcome == "failure":
            outcome = "cancelled"
        conclusion = "success" if outcome == "failure" and continue_on_error else outcome
        elapsed = time.monotonic() - started
        if outcome != "success":
            suffix = " (continue-on-error)" if conclusion == "success" else ""
            self.log(f"✖ {name}: {outcome}{suffix}")
            if step.get("uses"):
                self.setup_hint(step, scope, pre_env, name)
                errors = [a.message for a in self.annotations if a.step == name]
                if hint := self.actions.token_hint(step, errors):
                    self.log(hint)
                    self.annotations.append(Annotation("error", hint, self.job_key, name))
        self.record(scope, step_id, name, outcome, conclusion, outputs, elapsed)
        if conclusion == "failure":
            scope.failed = True
            self.status = "failure"
        elif conclusion == "cancelled":
            self.status = "cancelled"

    def setup_hint(
        self, step: Mapping[str, Any], scope: _Scope, env: Mapping[str, str], name: str
    ) -> None:
        """A failed setup-python/node/go/java/uv step asking for a version the
        host lacks: say which versions the tool cache has."""
        ctx = self.contexts(scope, env)
        try:
            inputs = self.with_inputs(step, ctx)
        except ex.ExpressionError:
            return
        hint = setup_action_hint(Path(self.runner_ctx["tool_cache"]), str(step["uses"]), inputs)
        if hint:
            self.log(hint)
            self.annotations.append(Annotation("error", hint, self.job_key, name))

    def record(
        self,
        scope: _Scope,
        step_id: str,
        name: str,
        outcome: str,
        conclusion: str,
        outputs: dict[str, str],
        elapsed: float,
    ) -> None:
        if not step_id.startswith("__"):
            # A step without an `id` (its generated one starts with `__`) is
            # not in the steps context, as on GitHub (ExecutionContext.Complete):
            # `toJSON(steps)` and `steps.*.outcome` see only the named ones.
            scope.steps_ctx[step_id] = {
                "outputs": outputs,
                "outcome": outcome,
                "conclusion": conclusion,
            }
        if scope.action_path is None:
            self.step_results.append(
                StepResult(step_id, name, outcome, conclusion, dict(outputs), elapsed)
            )

    def record_interrupted(
        self, step: Mapping[str, Any], index: int, scope: _Scope, outcome: str
    ) -> None:
        name = self.step_name(step, self.contexts(scope, self.job_env))
        self.log(f"✖ {name}: {outcome}")
        step_id = str(step.get("id") or f"__{scope.prefix}{index}")
        self.record(scope, step_id, name, outcome, outcome, {}, 0.0)
        self.status = "cancelled" if outcome == "cancelled" else "failure"

    def step_name(self, step: Mapping[str, Any], ctx: Mapping[str, Any]) -> str:
        raw = step.get("name")
        if raw:
            try:
                return self.template(raw, ctx)
            except ex.ExpressionError:
                return str(raw)
        if step.get("uses"):
            return f"Run {step['uses']}"
        # As GitHub's runner names it: the script evaluated (as written when
        # that fails), its first line.
        script = str(step.get("run") or "")
        with contextlib.suppress(ex.ExpressionError):
            script = self.template(script, ctx)
        first = script.lstrip(" \t\r\n").splitlines()
        return f"Run {first[0]}" if first else "Run"

    def prepare_step_files(self) -> None:
        """Names the command files of the step about to run, before its
        `with:`, `env:` and script are evaluated: GitHub's runner has them in
        the github context too (`${{ github.output }}`, `github.env`,
        `github.path`, `github.state`, `github.step_summary`), the paths its
        GITHUB_OUTPUT etc. name. The step's process creates and takes them
        (run_process); a step that runs none (skipped, a checkout) makes none."""
        files = self.step_files()
        self.pending_files = files
        for key, path in _FILE_CONTEXT.items():
            self.github[key] = str(files[path])

    def step_files(self) -> dict[str, Path]:
        """A step's command files, named (not yet made)."""
        tag = uuid.uuid4().hex[:12]
        return {
            "GITHUB_OUTPUT": self.commands_dir / f"set_output_{tag}",
            "GITHUB_ENV": self.commands_dir / f"set_env_{tag}",
            "GITHUB_PATH": self.commands_dir / f"add_path_{tag}",
            "GITHUB_STEP_SUMMARY": self.commands_dir / f"step_summary_{tag}",
            "GITHUB_STATE": self.commands_dir / f"save_state_{tag}",
        }

    def shell_argv(self, shell: str | None, script: str) -> tuple[list[str], str]:
        """(argv with `{0}` still in it, script file suffix)."""
        if shell is None:
            if shutil.which("bash"):
                return ["bash", "-e", "{0}"], ".sh"
            return ["sh", "-e", "{0}"], ".sh"
        if shell == "bash":
            return ["bash", "--noprofile", "--norc", "-eo", "pipefail", "{0}"], ".sh"
        if shell == "sh":
            return ["sh", "-e", "{0}"], ".sh"
        if shell == "python":
            py = "python" if shutil.which("python") else "python3"
            return [py, "{0}"], ".py"
        if shell in _POWERSHELLS:
            # GitHub's Linux runners have pwsh; a host without it fails the step
            return [shell, "-command", ". '{0}'"], ".ps1"
        if "{0}" in shell:
            argv = shlex.split(shell)
            # the file ends as the built-in shell's would (`bash -el {0}` runs a .sh)
            return argv, _SCRIPT_SUFFIX.get(argv[0], "") if argv else ""
        raise _StepFailure(
            f"shell {shell!r} is not supported: use bash, sh, python, pwsh or a command "
            "template containing {0} (e.g. `perl {0}`)"
        )

    async def run_script(
        self,
        step: Mapping[str, Any],
        name: str,
        env: dict[str, str],
        ctx: Mapping[str, Any],
        scope: _Scope,
        timeout: float | None,
    ) -> tuple[dict[str, str], str]:
        script = self.template(step.get("run") or "", ctx)
        shell = self.step_default(step, "shell", ctx)
        argv_t, suffix = self.shell_argv(shell, script)
        if argv_t and argv_t[0] in _POWERSHELLS:
            # GitHub's ScriptHandlerHelpers.FixUpScriptContents: stop at the
            # first error, end with the last native command's exit code
            script = f"$ErrorActionPreference = 'stop'\n{script}\n{_PS_EXIT}"
        wd = self.step_default(step, "working-directory", ctx)
        cwd = self.host.workspace
        if wd:
            cwd = self.host.workspace / wd
            sandbox = self.host.sandbox
            if not (sandbox.host_path(cwd) if sandbox is not None else cwd).is_dir():
                where = " in the checkout" if cwd.is_relative_to(self.host.workspace) else ""
                raise _StepFailure(
                    f"working-directory {str(cwd)!r} does not exist{where} (step {name!r})"
                )
        script_path = self.host.temp / f"{uuid.uuid4().hex}{suffix}"
        script_path.write_text(script, encoding="utf-8")
        argv = [a.replace("{0}", str(script_path)) for a in argv_t]
        return await self.run_process(argv, name, env, scope, timeout, str(cwd))

    async def run_process(
        self,
        argv: list[str],
        name: str,
        env: dict[str, str],
        scope: _Scope,
        timeout: float | None,
        cwd: str,
        *,
        state: dict[str, str] | None = None,
        node_action: bool = False,
    ) -> tuple[dict[str, str], str]:
        """Runs one step process with the step protocols; `state` (a JavaScript
        action's) receives what it wrote to GITHUB_STATE. A `node_action`
        reports its own failure (`core.setFailed` is `::error::`): its exit
        code is not an error of its own, as on GitHub."""
        files, self.pending_files = self.pending_files or self.step_files(), None
        for path in files.values():
            path.touch()
        penv = self.process_env(env, files, scope)
        penv["RUNNER_TRACKING_ID"] = self.tracking_id
        if self.step_debug:
            penv["RUNNER_DEBUG"] = "1"
        launcher = argv
        if self.host.sandbox is not None:
            # bwrap itself starts in the workspace; the step in `cwd` as the
            # sandbox has it (a directory in its private /tmp, say).
            launcher = self.host.sandbox.wrap(argv, cwd)
            cwd = str(self.host.workspace)
        parser = WorkflowCommandParser(
            self.masker,
            self.job_key,
            name,
            debug=self.step_debug,
            # read as .NET's bool.TryParse does: only "true", any case
            allow_unsecure=penv.get("ACTIONS_ALLOW_UNSECURE_COMMANDS", "").strip().lower()
            == "true",
            matchers=self.matchers,
            workspace=self.host.workspace,
            host_path=self.host.sandbox.host_path if self.host.sandbox is not None else None,
        )

        def on_lines(raws: list[str]) -> None:
            shown = parser.lines(raws)
            if shown:
                self.log_lines(shown)

        outcome = "success"
        try:
            try:
                result = await run_streaming(
                    launcher, cwd=cwd, env=penv, timeout=timeout, on_lines=on_lines
                )
            except OSError as exc:
                if exc.errno in _NOT_STARTED and exc.filename is not None:
                    # A shell (`shell: pwsh`, `shell: perl {0}`) or program
                    # the host lacks, or a workspace an earlier step removed:
                    # the step fails, the job goes on (`if: always()`, posts),
                    # as GitHub's runner fails the step when `which` finds no
                    # shell. Not a crash of the runner.
                    raise _StepFailure(_not_started(exc, launcher[0], cwd)) from None
                if exc.errno != errno.E2BIG:
                    raise
                raise _StepFailure(explain_e2big(launcher, penv)) from None
            if result.returncode != 0:
                outcome = "failure"
                code = (
                    f"killed by signal {-result.returncode}"
                    if result.returncode < 0
                    else f"exit code {result.returncode}"
                )
                if not node_action:
                    self.log(f"Error: process completed with {code}")
                    self.annotations.append(
                        Annotation(
                            "error", f"{name}: process completed with {code}", self.job_key, name
                        )
                    )
                else:
                    # GitHub's runner only notes a JavaScript action's exit
                    # code (NodeScriptActionHandler): the action's own
                    # `::error::` says why. One that said nothing (it crashed
                    # before core.setFailed) still gets the exit code, so the
                    # summary names the failing step.
                    self.log(f"Node action run completed with {code}")
                    if not any(a.level == "error" for a in parser.effects.annotations):
                        self.annotations.append(
                            Annotation(
                                "error", f"{name}: node exited with {code}", self.job_key, name
                            )
                        )
        except CommandTimeout:
            outcome = "failure"
            message = f"the step timed out after {(timeout or 0) / 60:g} minutes and was killed"
            self.log(f"Error: {message}")
            self.annotations.append(Annotation("error", f"{name}: {message}", self.job_key, name))
        effects = parser.effects
        self.annotations.extend(effects.annotations)
        if effects.failed:
            outcome = "failure"  # GitHub's CommandResult: a refused command fails the step
        outputs = dict(effects.outputs)
        outputs.update(parse_env_file(files["GITHUB_OUTPUT"], f"{name}: GITHUB_OUTPUT"))
        # `::set-env` / `::add-path` took effect as they ran; the files after the step
        new_env = {**effects.env, **parse_env_file(files["GITHUB_ENV"], f"{name}: GITHUB_ENV")}
        self.env_from_files.update(new_env)
        new_paths = [*effects.path, *parse_path_file(files["GITHUB_PATH"])]
        self.path_prepend.extend(new_paths)
        self.show_uv_the_base(new_env, new_paths)
        if state is not None:
            state.update(effects.state)
            state.update(parse_env_file(files["GITHUB_STATE"], f"{name}: GITHUB_STATE"))
        summary = files["GITHUB_STEP_SUMMARY"].read_text(encoding="utf-8", errors="replace")
        if summary.strip():
            self.summary_parts.append(self.masker.mask(summary))
        return outputs, outcome

    def show_uv_the_base(self, new_env: Mapping[str, str], new_paths: list[str]) -> None:
        """The tool cache's Pythons are virtual environments over the host's
        (so a job's installs stay its own), and uv, wanting an interpreter that
        is not one (`uv venv`, `uv sync`, tox-uv's `uv venv -p 3.12`), passes
        over them to the next Python on PATH, where GitHub's uv takes the one
        setup-python put first. So when a step sets `pythonLocation` to a
        Python of this job's tool cache and puts its `bin` on PATH, a directory
        of the venv's base interpreter under its names (`uv_base_bin`) goes
        right after the step's entries: the shell still finds the venv's
        python first, uv the base, the version asked for. (Not `UV_PYTHON`: it
        outranks the project's `.venv` for `uv pip`.)"""
        location = new_env.get("pythonLocation")
        base_bin = uv_base_bin(location, self.runner_ctx["tool_cache"]) if location else None
        if base_bin is not None and str(Path(location or "") / "bin") in new_paths:
            # PATH reads path_prepend reversed: before this step's entries is after them
            self.path_prepend.insert(len(self.path_prepend) - len(new_paths), base_bin)

    def kill_leftovers(self) -> None:
        """Kills processes steps left behind (GitHub's orphan cleanup)."""
        kill_tracked(self.tracking_id)

    # -- uses --------------------------------------------------------------------
    async def run_uses(
        self,
        step: Mapping[str, Any],
        name: str,
        env: dict[str, str],
        ctx: Mapping[str, Any],
        scope: _Scope,
        timeout: float | None,
    ) -> tuple[dict[str, str], str]:
        uses = str(step["uses"]).strip()
        if is_checkout(uses):
            try:
                await checkout_step(
                    self.with_inputs(step, ctx),
                    self.host.workspace,
                    self.github,
                    self.log,
                    self.host.recheckout,
                )
            except CheckoutError as exc:
                raise _StepFailure(str(exc)) from None
            return {}, "success"
        return await self.actions.run_main(step, name, env, ctx, scope, timeout)

    async def run_composite(
        self,
        step: Mapping[str, Any],
        uses: str,
        meta: ActionMetadata,
        name: str,
        env: dict[str, str],
        ctx: Mapping[str, Any],
        scope: _Scope,
        timeout: float | None,
    ) -> tuple[dict[str, str], str]:
        """A composite action (local or remote) as nested steps, bounded by the
        step's `timeout-minutes`."""
        if timeout is None:
            return await self._composite(step, uses, meta, name, env, ctx, scope)
        with anyio.move_on_after(timeout):
            return await self._composite(step, uses, meta, name, env, ctx, scope)
        self.log(f"Error: the step timed out after {timeout / 60:g} minutes and was killed")
        return {}, "failure"

    async def _composite(
        self,
        step: Mapping[str, Any],
        uses: str,
        meta: ActionMetadata,
        name: str,
        env: dict[str, str],
        ctx: Mapping[str, Any],
        scope: _Scope,
    ) -> tuple[dict[str, str], str]:
        directory, data = meta.directory, meta.raw
        given = self.with_inputs(step, ctx)
        declared = dict(data.get("inputs") or {})
        inputs: dict[str, Any] = {}
        for key, decl in declared.items():
            decl = decl if isinstance(decl, dict) else {}
            if key in given:
                inputs[key] = given[key]
                if message := deprecation(decl):  # as for every action kind
                    self.actions.warn(f"{uses}: {deprecated_input(key, message)}", name)
            elif "default" in decl:
                inputs[key] = self.template(decl["default"], ctx)
            else:
                inputs[key] = ""  # `required:` is documentation, as on GitHub
        if message := unexpected_inputs(given, declared):
            self.actions.warn(f"{uses}: {message}", name)
        for key, value in given.items():
            inputs.setdefault(key, value)
        inner = _Scope(
            steps_ctx={},
            inputs=inputs,
            action_path=directory,
            prefix=f"{uses}:",
            action=scope.action,
        )
        outer_status = self.status
        if outer_status == "failure":
            # Inside a composite, success() and failure() are of its own steps
            # (GitHub's runner gives it a status of its own): one called with
            # `if: always()` after a failure still runs its steps.
            self.status = "success"
        steps = list(data["runs"].get("steps") or [])
        saved_env = dict(self.job_env)
        self.job_env = dict(env)  # the composite's steps see the calling step's env
        try:
            await self.run_steps(steps, inner)
        finally:
            self.job_env = saved_env
        failed = inner.failed
        self.status = outer_status
        inner_ctx = {**self.contexts(inner, env), "steps": inner.steps_ctx}
        outputs: dict[str, str] = {}
        for key, decl in dict(data.get("outputs") or {}).items():
            value = decl.get("value", "") if isinstance(decl, dict) else decl
            outputs[key] = self.template(value, inner_ctx)
        return outputs, ("failure" if failed else "success")


def _warn_unsupported(spec: Mapping[str, Any], run: _Execution) -> None:
    """`container:` and `services:` need a container engine, which preloop does
    not drive: say so in the log and the summary instead of silently running
    the steps on the host as if they had been honoured. A container of
    Python's official image (`python:3.13`, hypercorn's tox jobs) gets the
    job's tool cache Python of that version first on PATH, as setup-python
    would put it: its `python` and `pip` are that version, and what they
    install stays in the job's venv (not the host's interpreter)."""
    job = str(spec.get("job", ""))
    container = spec.get("container")
    image = container.get("image") if isinstance(container, Mapping) else container
    if isinstance(image, str) and "${{" in image:
        # `container: ${{ matrix.container }}` with '' on some legs: none there.
        with contextlib.suppress(ex.ExpressionError):
            image = run.template(image, run.base)
    if isinstance(container, str):
        container = image
    if container:
        why = (
            f"job {job!r} declares `container:`; preloop runs its steps on this host, "
            "not in that image"
        )
        python = container_python(str(image or ""), Path(run.runner_ctx["tool_cache"]))
        if python is not None and python[1] is not None:
            # As setup-python would: the job's venv of that version first on
            # PATH, the base after it for uv (see show_uv_the_base).
            venv = python[1]
            base_bin = uv_base_bin(str(venv), run.runner_ctx["tool_cache"])
            run.path_prepend.extend([*([base_bin] if base_bin else []), str(venv / "bin")])
            why = (
                f"job {job!r} declares `container:` ({image}); preloop runs its steps on this "
                f"host, with the tool cache's Python {venv.parent.name} first on PATH in place "
                "of that image"
            )
        elif python is not None:
            why += f" (and this host has no Python {python[0]} for it: `preloop toolcache`)"
        run.log(f"warning: {why}")
        run.annotations.append(Annotation("warning", why, run.job_key))
    services = sorted(dict(spec.get("services") or {}))
    if services:
        why = (
            f"job {job!r} declares `services:` ({', '.join(services)}); preloop does not start "
            "service containers: start them yourself before `preloop run`"
        )
        run.log(f"warning: {why}")
        run.annotations.append(Annotation("warning", why, run.job_key))


async def execute_job(
    spec: Mapping[str, Any],
    contexts: Mapping[str, Any],
    host: JobHost,
    *,
    log: LogLine,
    secrets: Mapping[str, str] | None = None,
    timeout_minutes: float = 360.0,
    control: JobControl | None = None,
    masker: Masker | None = None,
    log_lines: LogLines | None = None,
) -> JobResult:
    """Runs the job described by `spec` (a `PlannedJob.spec`) in `host.workspace`.

    `contexts` are the store's job contexts (`github`, `env`, `inputs`,
    `needs`, `matrix`, `strategy`, optionally `vars`). `log` receives every
    log line, already masked; `log_lines`, when given, receives a step's
    output in batches instead. Never raises for a step's failure: the result
    says what happened."""
    control = control or JobControl()
    masker = masker if masker is not None else Masker()
    try:
        run = _Execution(spec, contexts, host, log, masker, dict(secrets or {}), control, log_lines)
    except ex.ExpressionError as exc:
        why = f"job {spec.get('job', '')!r}: env cannot be evaluated: {exc}"
        log(masker.mask(f"✖ {why}"))
        return masked_result(
            JobResult("failure", {}, [], [Annotation("error", why)], "", why), masker
        )
    _warn_unsupported(spec, run)
    scope = _Scope(steps_ctx={}, inputs=contexts.get("inputs") or {})
    reason: str | None = None
    steps = list(spec.get("steps") or [])
    index = 0
    try:
        with anyio.CancelScope(deadline=anyio.current_time() + timeout_minutes * 60.0) as job_scope:
            with anyio.CancelScope() as pre_scope:
                control._scope = pre_scope
                await run.actions.run_pre(steps, scope)
            control._scope = None
            while index < len(steps):
                with anyio.CancelScope() as step_scope:
                    control._scope = step_scope
                    await run.run_step(steps[index], index, scope)
                control._scope = None
                if step_scope.cancelled_caught:
                    # Cancelled mid-step: it counts as cancelled; later steps
                    # whose `if` asks for always()/cancelled() still run.
                    run.record_interrupted(steps[index], index, scope, "cancelled")
                index += 1
        if job_scope.cancelled_caught:
            reason = f"the job exceeded its timeout of {timeout_minutes:g} minutes"
            if index < len(steps):
                run.record_interrupted(steps[index], index, scope, "failure")
            run.log(f"✖ {reason}; its processes were killed")
            run.status = "failure"
        # Post steps of JavaScript actions, after every main step, also after
        # a failure, a cancellation or the job's timeout.
        with anyio.CancelScope(deadline=anyio.current_time() + POST_STEPS_TIMEOUT) as post_scope:
            control._scope = post_scope
            await run.actions.run_posts(scope)
        control._scope = None
    finally:
        control._scope = None
        run.kill_leftovers()
        run.actions.release()  # its actions may be pruned from now on
    if control.cancelled and reason is None:
        conclusion = "cancelled"
        reason = "cancelled"
    else:
        conclusion = "failure" if run.status in ("failure", "cancelled") else "success"
    ctx = run.contexts(scope, {**run.job_env, **run.env_from_files})
    outputs: dict[str, str] = {}
    for entry, template in dict(spec.get("outputs") or {}).items():
        try:  # an entry may be `${{ insert }}` giving several outputs
            values = [
                (key, _str(value) if evaluated else run.template(value, ctx))
                for key, value, evaluated in mapping_items(
                    {entry: template}, lambda v: run.value(v, ctx)
                )
            ]
        except ex.ExpressionError as exc:
            run.log(f"warning: job output {entry!r} cannot be evaluated: {exc}")
            continue
        for key, value in values:
            if masker.contains_secret(value):
                # GitHub does not pass outputs holding a secret to other jobs.
                run.log(f"warning: job output {key!r} holds a secret and was skipped")
                continue
            outputs[key] = value
    outputs, too_big = limit_job_outputs(outputs)
    for why in too_big:
        run.log(f"✖ {why}")
        run.annotations.append(Annotation("error", why, run.job_key))
        conclusion = "failure"
        reason = reason or why
    result = JobResult(
        conclusion=conclusion,
        outputs=outputs,
        steps=run.step_results,
        annotations=run.annotations,
        summary="\n".join(run.summary_parts),
        reason=reason,
    )
    return masked_result(result, masker)
