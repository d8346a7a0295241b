"""Runs `uses:` steps inside a job, the way GitHub's runner does.

`ActionSteps` is created by the job executor (`preloop.runner.job`) and
reuses its process runner, so a JavaScript action's workflow commands,
masking, `GITHUB_OUTPUT`/`GITHUB_ENV`/`GITHUB_PATH`/`GITHUB_STEP_SUMMARY`
and environment are exactly those of a `run:` step.

- Remote actions (`owner/repo[/path]@ref`) come from the action cache
  (`preloop.actions.cache`) unless an override names a local directory or
  `skip`; they are fetched at job start (GitHub's "Set up job"), and a fetch
  that fails fails only the step that uses the action.
- Local actions (`./dir`) are read from the workspace when their step runs.
- JavaScript actions: `pre` (with `pre-if`, default `always()`) at job
  start, `main` as the step, `post` (with `post-if`, default `always()`)
  after all main steps in reverse order; `INPUT_*` from `with:` plus the
  `inputs:` defaults, `STATE_*` from `GITHUB_STATE`, `GITHUB_ACTION_PATH`,
  `GITHUB_ACTION_REPOSITORY`, `GITHUB_ACTION_REF`.
- Composite actions run through the executor's composite runner.
- Docker actions run through `docker` when a daemon answers `docker info`.
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio

from preloop import config
from preloop.actions.cache import ActionCache
from preloop.actions.metadata import (
    ActionMetadata,
    deprecated_input,
    deprecation,
    load_action,
    unexpected_inputs,
)
from preloop.actions.node import NodeRuntime, find_node
from preloop.actions.reference import (
    DockerRef,
    LocalRef,
    Overrides,
    RemoteRef,
    is_checkout,
    parse_uses,
)
from preloop.errors import PreloopError
from preloop.process import CommandFailed, CommandTimeout, run_command
from preloop.workflow import expressions as ex
from preloop.workflow.uses import local_path_error

if TYPE_CHECKING:
    from preloop.runner.commands import Annotation
    from preloop.runner.job import _Execution, _Scope

__all__ = ["ActionSource", "ActionStepError", "ActionSteps"]

#: How long the post steps of a job may take together after its main steps.
POST_STEPS_TIMEOUT = 300.0


class ActionStepError(PreloopError):
    """A `uses:` step that cannot run; fails that step only."""


@dataclass(frozen=True, slots=True)
class ActionSource:
    """Where a runner's actions come from: the action cache in `state_dir`
    (remote `PRELOOP_ACTIONS_URL`, or `base_url`) and the user's overrides."""

    state_dir: Path
    overrides: Overrides = field(default_factory=Overrides)
    base_url: str | None = None

    @classmethod
    def from_env(cls, state_dir: Path | None = None) -> ActionSource:
        return cls(state_dir or config.state_dir(), Overrides.from_env(os.environ))


@dataclass(slots=True)
class _Resolved:
    """A `uses:` made concrete: what runs and how it is named."""

    label: str
    kind: str  # local, remote, docker, skip
    meta: ActionMetadata | None = None
    image: str = ""
    repository: str = ""
    ref: str = ""
    reason: str = ""


@dataclass(slots=True)
class _Post:
    step: Mapping[str, Any]
    name: str
    resolved: _Resolved
    env: dict[str, str]
    inputs: dict[str, str]
    state: dict[str, str]
    condition: str


@dataclass(slots=True)
class _StepActionState:
    resolved: _Resolved | None = None
    error: str | None = None
    state: dict[str, str] = field(default_factory=dict)
    # Inputs whose default, the job's token, was empty (see `token_hint`).
    empty_token: list[str] = field(default_factory=list)


_docker_checked: dict[str, str | None] = {}


async def _docker_problem() -> str | None:
    """None when a Docker daemon answers `docker info`, else why not (once per process)."""
    if "answer" in _docker_checked:
        return _docker_checked["answer"]
    try:
        await run_command(["docker", "info", "--format", "{{.ServerVersion}}"], timeout=20)
        problem = None
    except FileNotFoundError:
        problem = "there is no `docker` command"
    except CommandTimeout:
        problem = "`docker info` did not answer within 20s"
    except CommandFailed as exc:
        lines = [ln for ln in exc.result.stderr_text().splitlines() if ln.strip()]
        problem = f"`docker info` failed: {lines[-1].strip() if lines else exc}"
    except OSError as exc:
        problem = f"`docker` cannot run: {exc}"
    _docker_checked["answer"] = problem
    return problem


def _annotation(level: str, message: str, job: str, step: str = "") -> Annotation:
    # Imported here: preloop.runner imports this module while it initialises.
    from preloop.runner.commands import Annotation

    return Annotation(level, message, job, step)


# An input default naming the job's token (`${{ github.token }}`).
_TOKEN = re.compile(r"\bgithub\.token\b|\bsecrets\.GITHUB_TOKEN\b", re.IGNORECASE)


def input_env_name(name: str) -> str:
    """GitHub's `INPUT_<NAME>`: spaces become `_`, then upper case."""
    return "INPUT_" + name.replace(" ", "_").upper()


class ActionSteps:
    def __init__(self, run: _Execution) -> None:
        self.run = run
        source = run.host.actions or ActionSource.from_env()
        self.overrides = source.overrides
        run_key = run.host.tracking_key or f"run-{run.host.run_id}"
        self.cache = ActionCache(source.state_dir, run_key=run_key, base_url=source.base_url)
        self.per_step: dict[int, tuple[Mapping[str, Any], _StepActionState]] = {}
        self.remote: dict[str, _Resolved | str] = {}
        self.posts: list[_Post] = []
        self.warned: set[str] = set()

    def release(self) -> None:
        """The job is over: the actions it fetched are no longer in use."""
        self.cache.release()

    # -- resolution ----------------------------------------------------------------
    def _state_of(self, step: Mapping[str, Any]) -> _StepActionState:
        entry = self.per_step.get(id(step))
        if entry is None or entry[0] is not step:
            entry = (step, _StepActionState())
            self.per_step[id(step)] = entry
        return entry[1]

    def warn(self, message: str, step: str = "") -> None:
        if message in self.warned:
            return
        self.warned.add(message)
        self.run.log(f"warning: {message}")
        self.run.annotations.append(_annotation("warning", message, self.run.job_key, step))

    async def _remote(self, ref: RemoteRef, label: str) -> _Resolved:
        override = self.overrides.find(ref)
        if override is not None and override.directory is None:
            return _Resolved(label, "skip", reason=override.reason)
        if override is not None and override.directory is not None:
            directory = override.directory / ref.path if ref.path else override.directory
            self.run.log(f"{label}: using the local override {directory}")
            meta = load_action(directory, label)
            return _Resolved(label, "remote", meta, repository=ref.slug, ref=ref.ref)
        fetched = await self.cache.fetch(ref, self.warn)
        # As GitHub's runner says it at a job's start.
        self.run.log(f"Download action repository '{label}' (SHA:{fetched.commit})")
        meta = load_action(fetched.directory, label)
        return _Resolved(label, "remote", meta, repository=ref.slug, ref=ref.ref)

    async def resolve(self, uses: str) -> _Resolved:
        """What `uses` runs now. Remote actions are memoised for the job (an
        earlier failure is repeated, not retried); local ones are read each time."""
        target = parse_uses(uses)
        if isinstance(target, LocalRef):
            # GitHub's runner joins the path to the workspace and goes wherever
            # it leads (`./../action/init`: github/codeql-action checks itself out
            # beside the workspace). Here it may lead anywhere in the job's
            # directory, which holds the workspace and is all a sandboxed step may
            # write, but not out of it (`..` or a symlink an earlier step made).
            workspace = self.run.host.workspace
            outside = local_path_error(uses, workspace, workspace.parent, "the job's directory")
            if outside is not None:
                raise ActionStepError(outside)
            directory = (self.run.host.workspace / target.path).resolve()
            return _Resolved(uses, "local", load_action(directory, uses))
        if isinstance(target, DockerRef):
            return _Resolved(uses, "docker", image=target.image)
        known = self.remote.get(uses)
        if isinstance(known, str):
            raise ActionStepError(known)
        if known is not None:
            return known
        try:
            resolved = await self._remote(target, uses)
        except PreloopError as exc:
            self.remote[uses] = str(exc)
            raise ActionStepError(str(exc)) from None
        self.remote[uses] = resolved
        return resolved

    # -- inputs ----------------------------------------------------------------------
    def inputs(
        self, step: Mapping[str, Any], meta: ActionMetadata, ctx: Mapping[str, Any], name: str
    ) -> dict[str, str]:
        given = self.run.with_inputs(step, ctx)
        label = str(step.get("uses", ""))  # pre and main warn once, naming the action
        values: dict[str, str] = {}
        empty_token: list[str] = []
        for key, decl in meta.inputs.items():
            if key in given:
                values[key] = given[key]
                if message := deprecation(decl):
                    self.warn(f"{label}: {deprecated_input(key, message)}", name)
            elif "default" in decl:
                values[key] = self.run.template(decl["default"], ctx)
                if not values[key] and _TOKEN.search(str(decl["default"])):
                    empty_token.append(key)
            else:
                # `required:` is documentation: GitHub's runner neither warns
                # nor fails (`core.getInput(name, {required: true})` does).
                values[key] = ""
        if message := unexpected_inputs(given, meta.inputs):
            self.warn(f"{label}: {message}", name)
        declared = {k.lower() for k in meta.inputs}
        for key in (k for k in given if k.lower() not in declared):
            values[key] = given[key]
        self._state_of(step).empty_token = empty_token
        return values

    def token_hint(self, step: Mapping[str, Any], errors: Sequence[str]) -> str | None:
        """Why a failed action failed when its `errors` say a required input
        was not supplied (@actions/core's words) and that input defaults to
        the job's token (`${{ github.token }}`, github-script's
        `github-token`), which is empty unless the run was given one."""
        entry = self.per_step.get(id(step))
        if entry is None or entry[0] is not step:
            return None
        keys = [
            k
            for k in entry[1].empty_token
            if any(f"Input required and not supplied: {k}" in e for e in errors)
        ]
        if not keys:
            return None
        return (
            f"{step.get('uses')}: input '{keys[0]}' defaults to the job's token, which is empty "
            "here: preloop has one only when given `--secret GITHUB_TOKEN` "
            "(`GITHUB_TOKEN=$(gh auth token)`; any value does for a step that calls no GitHub API)"
        )

    def action_env(
        self,
        env: Mapping[str, str],
        resolved: _Resolved,
        inputs: Mapping[str, str],
        state: Mapping[str, str],
    ) -> dict[str, str]:
        out = dict(env)
        for key, value in inputs.items():
            out[input_env_name(key)] = value
        for key, value in state.items():
            out[f"STATE_{key}"] = value
        if resolved.meta is not None:
            out["GITHUB_ACTION_PATH"] = str(resolved.meta.directory)
        out["GITHUB_ACTION_REPOSITORY"] = resolved.repository
        out["GITHUB_ACTION_REF"] = resolved.ref
        return out

    # -- node ------------------------------------------------------------------------
    def node_for(self, meta: ActionMetadata, label: str) -> NodeRuntime:
        base = self.run.host.base_env if self.run.host.base_env is not None else os.environ
        try:
            node = find_node(base)
        except PreloopError as exc:
            raise ActionStepError(f"{label}: {exc}") from None
        if node.major < meta.node_major:
            self.warn(
                f"{label} asks for {meta.using}; running it on node {node.version} "
                f"({node.path}), the newest node found"
            )
        return node

    async def run_node(
        self,
        resolved: _Resolved,
        script: str,
        name: str,
        env: dict[str, str],
        inputs: Mapping[str, str],
        state: dict[str, str],
        scope: _Scope,
        timeout: float | None,
    ) -> tuple[dict[str, str], str]:
        meta = resolved.meta
        assert meta is not None
        node = self.node_for(meta, resolved.label)
        entry = meta.directory / script
        if not entry.is_file():
            raise ActionStepError(f"{resolved.label}: {script!r} does not exist in the action")
        penv = self.action_env(env, resolved, inputs, state)
        return await self.run.run_process(
            [node.path, str(entry)],
            name,
            penv,
            scope,
            timeout,
            str(self.run.host.workspace),
            state=state,
            node_action=True,
        )

    # -- job phases --------------------------------------------------------------------
    async def run_pre(self, steps: list[Mapping[str, Any]], scope: _Scope) -> None:
        """GitHub's "Set up job": fetch the remote actions of the job's steps and
        run the `pre` of JavaScript actions (before any main step)."""
        for step in steps:
            uses = step.get("uses")
            if not isinstance(uses, str) or uses.startswith("./") or uses.startswith("docker://"):
                continue
            if is_checkout(uses):
                continue
            state = self._state_of(step)
            try:
                state.resolved = await self.resolve(uses)
            except PreloopError as exc:
                state.error = str(exc)
                continue
            meta = state.resolved.meta
            if meta is None or not meta.is_node or not meta.runs.get("pre"):
                continue
            ctx = self.run.contexts(scope, {**self.run.job_env, **self.run.env_from_files})
            name = f"Pre {self.run.step_name(step, ctx)}"
            condition = str(meta.runs.get("pre-if") or "always()")
            await self._phase(
                step, name, condition, state.resolved, str(meta.runs["pre"]), state.state, scope
            )

    async def _phase(
        self,
        step: Mapping[str, Any],
        name: str,
        condition: str,
        resolved: _Resolved,
        script: str,
        state: dict[str, str],
        scope: _Scope,
        env: dict[str, str] | None = None,
        inputs: dict[str, str] | None = None,
    ) -> None:
        """One pre or post step: its own `if`, log line and step result."""
        run = self.run
        run.enter_step(step, scope)  # GitHub's pre and post steps are the step's action
        run.prepare_step_files()
        env = dict(env if env is not None else {**run.job_env, **run.env_from_files})
        ctx = {**run.contexts(scope, env), "env": env}
        status = "cancelled" if run.control.cancelled else run.status
        try:
            go = ex.evaluate_if(condition, ctx, status=status, hash_files=run.hash_files)
            if inputs is None:
                assert resolved.meta is not None
                inputs = self.inputs(step, resolved.meta, ctx, name)
        except ex.ExpressionError as exc:
            run.log(f"✖ {name}: {exc}")
            run.record(scope, f"__{name}", name, "failure", "failure", {}, 0.0)
            run.status = "failure"
            return
        if not go:
            return
        run.log(f"▶ {name}")
        started = anyio.current_time()
        try:
            _, outcome = await self.run_node(
                resolved, script, name, env, inputs, state, scope, None
            )
        except PreloopError as exc:
            run.log(f"✖ {name}: {exc}")
            run.annotations.append(_annotation("error", str(exc), run.job_key, name))
            outcome = "failure"
        if run.control.cancelled and outcome == "failure":
            outcome = "cancelled"
        if outcome != "success":
            run.log(f"✖ {name}: {outcome}")
            run.status = "failure" if outcome == "failure" else run.status
        run.record(scope, f"__{name}", name, outcome, outcome, {}, anyio.current_time() - started)

    async def run_posts(self, scope: _Scope) -> None:
        """The `post` of every JavaScript action whose main ran, last first."""
        while self.posts:
            post = self.posts.pop()
            await self._phase(
                post.step,
                post.name,
                post.condition,
                post.resolved,
                str(post.resolved.meta.runs["post"]) if post.resolved.meta else "",
                post.state,
                scope,
                env=post.env,
                inputs=post.inputs,
            )

    # -- the step ----------------------------------------------------------------------
    async def run_main(
        self,
        step: Mapping[str, Any],
        name: str,
        env: dict[str, str],
        ctx: Mapping[str, Any],
        scope: _Scope,
        timeout: float | None,
    ) -> tuple[dict[str, str], str]:
        uses = str(step["uses"]).strip()
        state = self._state_of(step)
        if state.error is not None:
            raise ActionStepError(state.error)
        resolved = state.resolved
        if resolved is None or resolved.kind == "local":
            resolved = await self.resolve(uses)
        if resolved.kind == "skip":
            why = f"{uses} skipped by an override" + (
                f": {resolved.reason}" if resolved.reason else ""
            )
            self.run.log(f"notice: {why}")
            self.run.annotations.append(_annotation("notice", why, self.run.job_key, name))
            return {}, "success"
        if resolved.kind == "docker" or (
            resolved.meta is not None and resolved.meta.using == "docker"
        ):
            return await self.run_docker(step, resolved, name, env, ctx, scope, timeout)
        meta = resolved.meta
        assert meta is not None
        if meta.using == "composite":
            return await self.run.run_composite(step, uses, meta, name, env, ctx, scope, timeout)
        inputs = self.inputs(step, meta, ctx, name)
        outputs, outcome = await self.run_node(
            resolved, str(meta.runs["main"]), name, env, inputs, state.state, scope, timeout
        )
        if meta.runs.get("post"):
            self.posts.append(
                _Post(
                    step,
                    f"Post {name}",
                    resolved,
                    dict(env),
                    inputs,
                    state.state,
                    str(meta.runs.get("post-if") or "always()"),
                )
            )
        return outputs, outcome

    # -- docker ------------------------------------------------------------------------
    async def run_docker(
        self,
        step: Mapping[str, Any],
        resolved: _Resolved,
        name: str,
        env: dict[str, str],
        ctx: Mapping[str, Any],
        scope: _Scope,
        timeout: float | None,
    ) -> tuple[dict[str, str], str]:
        problem = await _docker_problem()
        if problem is not None:
            instead = (
                f"use --action {resolved.repository}=skip"
                if resolved.repository
                else "guard the step with an `if:`"
            )
            raise ActionStepError(
                f"{resolved.label} is a Docker action and no Docker daemon answers ({problem}): "
                f"start Docker, or {instead}"
            )
        meta = resolved.meta
        run = self.run
        inputs = self.inputs(step, meta, ctx, name) if meta is not None else {}
        if meta is None:
            image = resolved.image
            args: list[Any] = []
            entrypoint = ""
        else:
            raw = str(meta.runs["image"])
            args = list(meta.runs.get("args") or [])
            entrypoint = str(meta.runs.get("entrypoint") or "")
            if raw.startswith("docker://"):
                image = raw[len("docker://") :]
            else:
                dockerfile = meta.directory / raw
                tag = "preloop-action-" + hashlib.sha256(str(dockerfile).encode()).hexdigest()[:16]
                run.log(f"building {dockerfile}")
                try:
                    await run_command(
                        [
                            "docker",
                            "build",
                            "-q",
                            "-t",
                            tag,
                            "-f",
                            str(dockerfile),
                            str(meta.directory),
                        ],
                        timeout=timeout,
                    )
                except (CommandFailed, CommandTimeout) as exc:
                    raise ActionStepError(f"{resolved.label}: docker build failed: {exc}") from None
                image = tag
        if meta is None:  # `docker://`: `with:` gives args and entrypoint, evaluated
            with_ = run.with_inputs(step, ctx)
            args = with_["args"].split() if "args" in with_ else []
            entrypoint = with_.get("entrypoint", "")
        input_ctx = {**ctx, "inputs": inputs}
        argv_args = [run.template(a, input_ctx) for a in args] if meta is not None else args
        penv = self.action_env(env, resolved, inputs, {})
        if meta is not None:
            penv.update(run.strings(meta.runs.get("env") or {}, input_ctx))
        ws, temp = str(run.host.workspace), str(run.host.temp)
        names = sorted(
            {
                *penv,
                "GITHUB_OUTPUT",
                "GITHUB_ENV",
                "GITHUB_PATH",
                "GITHUB_STEP_SUMMARY",
                "GITHUB_STATE",
            }
            | {k for k in run.process_env({}, {}, scope) if k.startswith(("GITHUB_", "RUNNER_"))}
            | {"CI"}
        )
        names = [n for n in names if n not in ("PATH", "HOME", "GITHUB_ACTION_PATH")]
        argv = ["docker", "run", "--rm", "-v", f"{ws}:{ws}", "-v", f"{temp}:{temp}", "-w", ws]
        for n in names:
            argv += ["-e", n]
        if entrypoint:
            argv += ["--entrypoint", entrypoint]
        argv += [image, *argv_args]
        return await run.run_process(argv, name, penv, scope, timeout, ws)
