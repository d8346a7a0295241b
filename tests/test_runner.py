"""Step execution with real shells: `preloop.runner.execute_job`."""

from __future__ import annotations

import os
import select
import shutil
import subprocess
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import pytest

from preloop.actions.steps import ActionSource
from preloop.runner import JobControl, JobHost, JobResult, execute_job
from preloop.runner.checkout import sweep_work_dir, work_dir
from preloop.runner.commands import EnvFileError, Masker, parse_env_file
from preloop.workflow.step_ids import step_action_names


def _exited(pidfd: int, wait: float = 10.0) -> bool:
    readable, _, _ = select.select([pidfd], [], [], wait)
    return bool(readable)


def run_job(
    tmp_path: Path,
    steps: list[dict[str, Any]],
    *,
    env: dict[str, Any] | None = None,
    outputs: dict[str, str] | None = None,
    contexts: dict[str, Any] | None = None,
    secrets: dict[str, str] | None = None,
    defaults: dict[str, str] | None = None,
    timeout_minutes: float = 360.0,
    files: dict[str, str] | None = None,
    on_line: Callable[[str], None] | None = None,
    control: JobControl | None = None,
    extra_spec: dict[str, Any] | None = None,
    actions: ActionSource | None = None,
    base_env: dict[str, str] | None = None,
) -> tuple[JobResult, list[str]]:
    ws = tmp_path / "ws"
    temp = tmp_path / "temp"
    ws.mkdir(exist_ok=True)
    temp.mkdir(exist_ok=True)
    for rel, text in (files or {}).items():
        (ws / rel).parent.mkdir(parents=True, exist_ok=True)
        (ws / rel).write_text(textwrap.dedent(text))
    lines: list[str] = []

    def log(line: str) -> None:
        lines.append(line)
        if on_line is not None:
            on_line(line)

    spec = {
        "job": "build",
        "steps": steps,
        "env": env or {},
        "outputs": outputs or {},
        "defaults": defaults or {},
        **(extra_spec or {}),
    }
    result = anyio.run(
        lambda: execute_job(
            spec,
            contexts or {"github": {"event_name": "push"}},
            JobHost(
                workspace=ws,
                temp=temp,
                run_id="7",
                actions=actions
                or ActionSource(tmp_path / "state", base_url=f"file://{tmp_path}/no-remotes"),
                base_env=base_env,
            ),
            log=log,
            secrets=secrets,
            timeout_minutes=timeout_minutes,
            control=control,
        )
    )
    return result, lines


def test_run_steps_outputs_and_job_outputs(tmp_path: Path) -> None:
    result, lines = run_job(
        tmp_path,
        [
            {"id": "a", "run": 'echo "x=1" >> "$GITHUB_OUTPUT"\necho hello'},
            {
                "id": "b",
                "run": textwrap.dedent(
                    """\
                    {
                      echo 'multi<<EOF'
                      echo 'line one'
                      echo 'line two'
                      echo 'EOF'
                    } >> "$GITHUB_OUTPUT"
                    echo "got ${{ steps.a.outputs.x }}"
                    """
                ),
            },
        ],
        outputs={"x": "${{ steps.a.outputs.x }}", "m": "${{ steps.b.outputs.multi }}"},
    )
    assert result.conclusion == "success"
    assert result.outputs == {"x": "1", "m": "line one\nline two"}
    assert "hello" in lines and "got 1" in lines
    assert [s.outcome for s in result.steps] == ["success", "success"]


def test_steps_without_an_id_are_not_in_the_steps_context(tmp_path: Path) -> None:
    # GitHub keeps only steps with an `id` in `steps` (ExecutionContext.Complete
    # skips the generated `__` ids): `steps.*.outcome` and `toJSON(steps)` see
    # the named step, not the unnamed one that failed before it.
    result, lines = run_job(
        tmp_path,
        [
            {"run": "exit 3", "continue-on-error": True},
            {"id": "named", "run": "true"},
            {"run": "echo 'keys=${{ join(steps.*.outcome, ',') }}'"},
            {"if": "contains(steps.*.outcome, 'failure')", "run": "echo saw-failure"},
            {"run": "echo 'json=${{ toJSON(steps) }}'"},
        ],
    )
    assert result.conclusion == "success", lines
    assert "keys=success" in lines
    assert "saw-failure" not in lines
    text = "\n".join(lines)
    assert '"named"' in text and "__" not in text.split("json=", 1)[1]


def test_a_shell_the_host_lacks_fails_its_step_not_the_runner(tmp_path: Path) -> None:
    # GitHub fails the step when `which` finds no shell; the job goes on with
    # failure() steps. preloop crashed the job with a FileNotFoundError.
    (tmp_path / "ws").mkdir()
    (tmp_path / "ws" / "noexec").write_text("#!/bin/sh\n")  # not executable
    result, lines = run_job(
        tmp_path,
        [
            {"id": "a", "run": "echo hi", "shell": "no-such-shell-xyz {0}"},
            {"id": "b", "if": "always()", "run": "echo hi", "shell": "./noexec {0}"},
            {"id": "c", "if": "failure()", "run": "echo after-failure"},
        ],
    )
    assert result.conclusion == "failure", lines
    assert [s.outcome for s in result.steps] == ["failure", "failure", "success"]
    errors = [a.message for a in result.annotations if a.level == "error"]
    assert errors == [
        "'no-such-shell-xyz' was not found on the step's PATH",
        "cannot run './noexec': Permission denied",
    ], errors
    assert "after-failure" in lines


def test_a_step_env_value_does_not_see_its_own_block(tmp_path: Path) -> None:
    # GitHub evaluates a step's `env:` as one mapping against the job's env
    # and GITHUB_ENV, then merges it (StepsRunner): `${{ env.A }}` there is
    # the outer A, never the block's own.
    result, lines = run_job(
        tmp_path,
        [
            {"run": 'echo "C=from-file" >> "$GITHUB_ENV"'},
            {
                "env": {"A": "step", "B": "${{ env.A }}|${{ env.C }}", "C": "step-c"},
                "run": 'echo "A=$A B=$B C=$C"',
            },
        ],
        env={"A": "job"},
    )
    assert result.conclusion == "success", lines
    assert "A=step B=job|from-file C=step-c" in lines


def test_set_env_and_add_path_commands_as_on_github(tmp_path: Path) -> None:
    # GitHub refuses `::set-env` / `::add-path` (the step fails) unless
    # ACTIONS_ALLOW_UNSECURE_COMMANDS is true; then they apply from the next
    # step on (NODE_OPTIONS never). preloop printed them and went on.
    result, lines = run_job(
        tmp_path,
        [
            {"id": "refused", "run": 'echo "::set-env name=FOO::bar"', "continue-on-error": True},
            {"run": 'echo "FOO=[$FOO]"'},
            {
                "env": {"ACTIONS_ALLOW_UNSECURE_COMMANDS": "True"},
                "run": 'echo "::set-env name=FOO::bar"\necho "::add-path::/opt/zzz"\n'
                'echo "::set-env name=NODE_OPTIONS::--x"',
            },
            {"run": 'echo "FOO=[$FOO] N=[$NODE_OPTIONS] first=${PATH%%:*}"'},
        ],
    )
    assert result.conclusion == "success", lines
    assert [s.outcome for s in result.steps] == ["failure", "success", "success", "success"]
    assert "FOO=[]" in lines and "FOO=[bar] N=[] first=/opt/zzz" in lines
    errors = [a.message for a in result.annotations if a.level == "error"]
    assert errors[0] == "Unable to process command '::set-env name=FOO::bar' successfully."
    assert errors[1].startswith("The `set-env` command is disabled.")
    assert errors[2] == "Can't update NODE_OPTIONS environment variable using ::set-env:: command."


def test_bash_e_semantics_and_failure_skips_later_steps(tmp_path: Path) -> None:
    result, lines = run_job(
        tmp_path,
        [
            {"id": "a", "run": "false\necho not-reached"},
            {"id": "b", "run": "echo skipped-step"},
            {"id": "c", "if": "failure()", "run": "echo on-failure"},
            {"id": "d", "if": "always()", "run": "echo always"},
            {"id": "e", "if": "success()", "run": "echo never"},
        ],
    )
    assert result.conclusion == "failure"
    assert [s.outcome for s in result.steps] == [
        "failure",
        "skipped",
        "success",
        "success",
        "skipped",
    ]
    assert "not-reached" not in lines and "on-failure" in lines and "always" in lines
    assert any("exit code 1" in line for line in lines)


def test_default_bash_is_not_pipefail_but_shell_bash_is(tmp_path: Path) -> None:
    result, _ = run_job(
        tmp_path,
        [
            {"id": "plain", "run": "false | true"},
            {"id": "strict", "shell": "bash", "run": "false | true", "continue-on-error": True},
        ],
    )
    assert [(s.outcome, s.conclusion) for s in result.steps] == [
        ("success", "success"),
        ("failure", "success"),
    ]
    assert result.conclusion == "success"


def test_shells_python_sh_custom_and_unsupported(tmp_path: Path) -> None:
    result, lines = run_job(
        tmp_path,
        [
            {"run": "import sys\nprint('py', sys.version_info[0])", "shell": "python"},
            {"run": "echo from-sh", "shell": "sh"},
            {"run": "print 'perlish'", "shell": "cat {0}"},
            {"id": "bad", "run": "x", "shell": "cmd", "continue-on-error": True},
        ],
    )
    assert "py 3" in lines and "from-sh" in lines and "print 'perlish'" in lines
    assert result.steps[-1].outcome == "failure"
    assert any("shell 'cmd' is not supported" in line for line in lines)


FAKE_PWSH = """\
    #!/bin/sh
    echo "args: $1 $2"
    f=$(printf '%s' "$2" | sed "s/^[.] '//; s/'$//")
    echo "ext: ${f##*.}"
    cat "$f"
    """


def test_pwsh_runs_as_on_githubs_linux_runners(tmp_path: Path) -> None:
    # GitHub's ubuntu runners have pwsh: `shell: pwsh` is `pwsh -command ". '{0}'"`
    # on a .ps1 file that stops at the first error and exits with the last
    # native command's code. Custom shells get the built-in's extension.
    result, lines = run_job(
        tmp_path,
        [
            {"run": 'chmod +x bin/pwsh; echo "$PWD/bin" >> "$GITHUB_PATH"'},
            {"run": "Write-Output hi", "shell": "pwsh"},
            {"run": 'echo "ext: ${0##*.}"', "shell": "bash -e {0}"},
        ],
        files={"bin/pwsh": FAKE_PWSH},
    )
    assert result.conclusion == "success", lines
    script = lines[lines.index("ext: ps1") + 1 :]
    assert lines[lines.index("ext: ps1") - 1].startswith("args: -command . '")
    assert script[:3] == [
        "$ErrorActionPreference = 'stop'",
        "Write-Output hi",
        r"if ((Test-Path -LiteralPath variable:\LASTEXITCODE)) { exit $LASTEXITCODE }",
    ]
    assert "ext: sh" in lines


def test_env_layering_and_github_env_path_take_effect_in_later_steps(tmp_path: Path) -> None:
    bindir = tmp_path / "ws" / "bin"
    bindir.mkdir(parents=True)
    tool = bindir / "mytool"
    tool.write_text("#!/bin/sh\necho tool-ran\n")
    tool.chmod(0o755)
    result, lines = run_job(
        tmp_path,
        [
            {
                "env": {"LEVEL": "step"},
                "run": textwrap.dedent(
                    """\
                    echo "level=$LEVEL wf=$WF"
                    echo "NEW=fresh" >> "$GITHUB_ENV"
                    echo "$GITHUB_WORKSPACE/bin" >> "$GITHUB_PATH"
                    echo "same-step new=${NEW:-unset}"
                    command -v mytool || echo "same-step no tool"
                    """
                ),
            },
            {"run": 'echo "next new=$NEW level=$LEVEL"\nmytool'},
            {"env": {"NEW": "step-wins"}, "run": 'echo "override $NEW"'},
        ],
        env={"LEVEL": "job", "WF": "${{ github.event_name }}"},
    )
    assert result.conclusion == "success", lines
    assert "level=step wf=push" in lines
    assert "same-step new=unset" in lines and "same-step no tool" in lines
    assert "next new=fresh level=job" in lines and "tool-ran" in lines
    assert "override step-wins" in lines


def test_user_local_bin_is_on_path_as_on_githubs_images(tmp_path: Path) -> None:
    """GitHub's Linux images have `$HOME/.local/bin` on PATH: what `uv tool
    install`, `pip install --user` or pipx put there runs by name in the next
    step (pytest-django's `uv tool install tox`, then `tox`). A PATH that
    has it already, or a step's own PATH, is left as it is."""
    home = tmp_path / "home"
    home.mkdir()
    base = {**os.environ, "HOME": str(home)}
    script = textwrap.dedent(
        """\
        mkdir -p "$HOME/.local/bin"
        printf '#!/bin/sh\\necho user-tool-ran\\n' > "$HOME/.local/bin/usertool"
        chmod +x "$HOME/.local/bin/usertool"
        """
    )
    result, lines = run_job(
        tmp_path,
        [
            {"run": script},
            {"run": "usertool"},
            {"run": 'echo "path=$PATH"'},
            {"env": {"PATH": "/usr/bin:/bin"}, "run": 'echo "own=$PATH"'},
        ],
        base_env=base,
    )
    assert result.conclusion == "success", lines
    assert "user-tool-ran" in lines
    user_bin = str(home / ".local" / "bin")
    # (as root without sudo, PATH ends with the sudo stand-in: see below)
    stand_in = f"{os.pathsep}{tmp_path / 'temp' / '_runner_sudo'}"
    lines = [line.removesuffix(stand_in) for line in lines]
    assert f"path={user_bin}{os.pathsep}{os.environ['PATH']}" in lines
    assert "own=/usr/bin:/bin" in lines
    base["PATH"] = f"/usr/bin{os.pathsep}{user_bin}"
    result, lines = run_job(tmp_path, [{"run": 'echo "path=$PATH"'}], base_env=base)
    lines = [line.removesuffix(stand_in) for line in lines]
    assert f"path=/usr/bin{os.pathsep}{user_bin}" in lines, lines


def _tools_dir(where: Path, names: list[str]) -> str:
    """A PATH directory holding only the host's `names` (symlinks)."""
    where.mkdir(parents=True)
    for name in names:
        found = shutil.which(name)
        assert found is not None, name
        (where / name).symlink_to(found)
    return str(where)


def test_sudo_runs_the_command_when_the_job_is_root_without_sudo(tmp_path: Path) -> None:
    """GitHub's images have passwordless sudo (`sudo apt-get install -y ...`,
    hynek/build-and-inspect-python-package's `sudo apt-get install tree`): a
    job running as root on a host without sudo (a container) gets a stand-in
    at the end of PATH that drops sudo's options and runs the command; a sudo
    on PATH is used as it is, and a job that is not root gets none."""
    tools = _tools_dir(tmp_path / "tools", ["bash", "sh", "env", "id", "echo"])
    base = {**os.environ, "PATH": tools}
    steps: list[dict[str, Any]] = [
        {"run": "sudo -E -H LEVEL=deep sh -c 'echo \"uid=$(id -u) level=$LEVEL\"'"},
        {"run": "sudo -u root -- echo as-root"},
        {"run": "sudo -u nobody id", "continue-on-error": True},
        {"run": "command -v sudo >/dev/null || echo no-sudo"},
    ]
    result, lines = run_job(tmp_path, steps, base_env=base)
    assert result.conclusion == "success", lines
    if os.geteuid() == 0:
        assert "uid=0 level=deep" in lines and "as-root" in lines, lines
        assert any("cannot run a command as nobody" in line for line in lines), lines
        assert [s.outcome for s in result.steps][2] == "failure"
    else:
        assert "no-sudo" in lines, lines
    # A sudo of the host's is the one steps run.
    own = tmp_path / "own"
    own.mkdir()
    (own / "sudo").write_text("#!/bin/sh\necho host-sudo\n")
    (own / "sudo").chmod(0o755)
    base["PATH"] = f"{tools}{os.pathsep}{own}"
    result, lines = run_job(tmp_path, [{"run": "sudo true"}], base_env=base)
    assert result.conclusion == "success" and "host-sudo" in lines, lines


def test_working_directory_and_defaults(tmp_path: Path) -> None:
    result, lines = run_job(
        tmp_path,
        [
            {"run": "pwd"},
            {"run": "pwd", "working-directory": "other"},
            {"id": "missing", "run": "pwd", "working-directory": "nope"},
        ],
        defaults={"working-directory": "sub"},
        files={"sub/a": "", "other/b": ""},
    )
    ws = tmp_path / "ws"
    assert str(ws / "sub") in lines and str(ws / "other") in lines
    assert result.steps[-1].outcome == "failure"
    assert any("working-directory" in line and "does not exist" in line for line in lines)


def test_continue_on_error_outcome_vs_conclusion(tmp_path: Path) -> None:
    result, lines = run_job(
        tmp_path,
        [
            {"id": "flaky", "run": "exit 3", "continue-on-error": True},
            {
                "run": "echo outcome=${{ steps.flaky.outcome }} "
                "conclusion=${{ steps.flaky.conclusion }}"
            },
        ],
    )
    assert result.conclusion == "success"
    assert "outcome=failure conclusion=success" in lines


def test_variables_and_contexts(tmp_path: Path) -> None:
    result, lines = run_job(
        tmp_path,
        [
            {
                "run": 'echo "$CI $GITHUB_ACTIONS $GITHUB_JOB $RUNNER_OS $GITHUB_EVENT_NAME"\n'
                'echo "ws=$GITHUB_WORKSPACE temp=$RUNNER_TEMP"\n'
                'echo "event=$(cat "$GITHUB_EVENT_PATH")"\n'
                "echo 'm=${{ matrix.os }} n=${{ needs.setup.outputs.v }}'\n"
                "echo 'gw=${{ github.workspace }}'"
            }
        ],
        contexts={
            "github": {"event_name": "push", "workspace": "/the/source/repo"},
            "matrix": {"os": "linux"},
            "needs": {"setup": {"result": "success", "outputs": {"v": "42"}}},
        },
    )
    assert result.conclusion == "success"
    assert "true true build Linux push" in lines
    assert f"ws={tmp_path / 'ws'} temp={tmp_path / 'temp'}" in lines
    assert "m=linux n=42" in lines
    assert "event={}" in lines
    assert f"gw={tmp_path / 'ws'}" in lines


def test_githubs_default_variables_are_set_even_when_empty(tmp_path: Path) -> None:
    names = ["GITHUB_BASE_REF", "GITHUB_HEAD_REF", "GITHUB_REF_TYPE", "GITHUB_REPOSITORY_OWNER",
             "GITHUB_API_URL", "RUNNER_ENVIRONMENT"]  # fmt: skip
    show = "".join(f'echo "{n}=${{{n}-unset}}"\n' for n in names)
    github = {"event_name": "pull_request", "base_ref": "main", "head_ref": "fix",
              "ref_type": "branch", "repository_owner": "acme"}  # fmt: skip
    result, lines = run_job(tmp_path, [{"run": show}], contexts={"github": github})
    assert result.conclusion == "success", lines
    assert [line for line in lines if "=" in line and not line.startswith("▶")] == [
        "GITHUB_BASE_REF=main",
        "GITHUB_HEAD_REF=fix",
        "GITHUB_REF_TYPE=branch",
        "GITHUB_REPOSITORY_OWNER=acme",
        "GITHUB_API_URL=https://api.github.com",
        "RUNNER_ENVIRONMENT=self-hosted",
    ]
    result, lines = run_job(tmp_path, [{"run": show}])  # a push: set, and empty
    assert "GITHUB_BASE_REF=" in lines and "GITHUB_HEAD_REF=" in lines, lines


def test_github_event_path_is_in_the_context(tmp_path: Path) -> None:
    """`${{ github.event_path }}` is GITHUB_EVENT_PATH, the event's file."""
    script = (
        'test "${{ github.event_path }}" = "$GITHUB_EVENT_PATH" && echo same=true\n'
        "cat '${{ github.event_path }}'; echo"
    )
    result, lines = run_job(
        tmp_path,
        [{"run": script}],
        contexts={"github": {"event_name": "push", "event": {"ref": "refs/heads/main"}}},
    )
    assert result.conclusion == "success", lines
    assert "same=true" in lines and '{"ref": "refs/heads/main"}' in lines, lines


def test_step_command_files_are_in_the_github_context(tmp_path: Path) -> None:
    """`${{ github.output }}`, `github.env`, `github.path`, `github.state` and
    `github.step_summary` are the step's own command files, as GitHub's
    runner has them (a composite's steps each get theirs)."""
    composite = """\
        outputs:
          y: {value: "${{ steps.i.outputs.y }}"}
        runs:
          using: composite
          steps:
            - id: i
              run: echo "y=2" >> "${{ github.output }}"
              shell: bash
        """
    write = (
        'echo "x=1" >> "${{ github.output }}"\n'
        'echo "FROM_CTX=yes" >> "${{ github.env }}"\n'
        'echo "$PWD/bin" >> "${{ github.path }}"\n'
        'echo "# from the context" >> "${{ github.step_summary }}"\n'
        'test "${{ github.state }}" = "$GITHUB_STATE" && echo state-file\n'
        "mkdir -p bin && printf '#!/bin/sh\\necho tool\\n' > bin/tool && chmod +x bin/tool\n"
    )
    result, lines = run_job(
        tmp_path,
        [
            {"id": "one", "run": write},
            {"run": 'echo "x=${{ steps.one.outputs.x }} env=$FROM_CTX"; tool'},
            {"id": "c", "uses": "./act"},
            {"run": 'echo "y=${{ steps.c.outputs.y }}"'},
        ],
        files={"act/action.yml": composite},
    )
    assert result.conclusion == "success", lines
    assert "state-file" in lines and "x=1 env=yes" in lines and "tool" in lines, lines
    assert "y=2" in lines, lines
    assert result.summary.strip() == "# from the context"


def test_githubs_variables_are_in_the_github_context_and_env_cannot_override_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PRELOOP_ARTIFACT_RETENTION_DAYS", "7")
    show = (
        "echo 'ctx=${{ github.api_url }} ${{ github.graphql_url }} "
        "${{ github.triggering_actor }} ${{ github.retention_days }}'\n"
        'echo "env=$GITHUB_API_URL $GITHUB_SHA $GITHUB_RETENTION_DAYS $RUNNER_OS $CI $MINE"\n'
        'echo "GITHUB_SHA=forged" >> "$GITHUB_ENV"\n'
    )
    result, lines = run_job(
        tmp_path,
        [{"run": show}, {"run": 'echo "after=$GITHUB_SHA"'}],
        contexts={"github": {"sha": "abc123", "actor": "octocat"}},
        # GitHub's runner lets a workflow set CI, and its own variables never.
        env={"GITHUB_API_URL": "x", "GITHUB_SHA": "y", "RUNNER_OS": "z", "CI": "no", "MINE": "1"},
    )
    assert result.conclusion == "success", lines
    assert "ctx=https://api.github.com https://api.github.com/graphql octocat 7" in lines, lines
    assert "env=https://api.github.com abc123 7 Linux no 1" in lines, lines
    assert "after=abc123" in lines, lines


def test_a_run_steps_default_name_is_its_evaluated_first_line(tmp_path: Path) -> None:
    # As GitHub's runner shows it; a secret in it is masked like any line.
    _, lines = run_job(
        tmp_path,
        [
            {"run": "\n  echo leg ${{ matrix.k }}\necho two"},
            {"run": "echo ${{ secrets.TOKEN }}"},
            {"run": "echo ${{ fromJSON('{') }}", "continue-on-error": True},
        ],
        contexts={"matrix": {"k": "y"}},
        secrets={"TOKEN": "hunter2"},
    )
    assert "▶ Run echo leg y" in lines, lines
    assert "▶ Run echo ***" in lines, lines
    assert "▶ Run echo ${{ fromJSON('{') }}" in lines, lines  # as written


def test_workflow_commands_mask_group_annotations(tmp_path: Path) -> None:
    result, lines = run_job(
        tmp_path,
        [
            {
                "run": textwrap.dedent(
                    """\
                    echo "before hunter2"
                    echo "::add-mask::hunter2"
                    echo "after hunter2"
                    echo "::group::Setup"
                    echo "::endgroup::"
                    echo "::error file=a.py,line=3::broken thing"
                    echo "::warning::careful"
                    echo "::error file=$GITHUB_WORKSPACE/src/b.py,line=4::linted"
                    echo "::notice file=/etc/hosts::outside"
                    echo "mysecretvalue appears"
                    echo "# Summary" >> "$GITHUB_STEP_SUMMARY"
                    """
                )
            }
        ],
        secrets={"TOKEN": "mysecretvalue"},
    )
    text = "\n".join(lines)
    assert "before hunter2" in lines and "after ***" in lines
    assert "mysecretvalue" not in text and "*** appears" in lines
    assert "▼ Setup" in lines
    assert [(a.level, a.message, a.file, a.line) for a in result.annotations] == [
        ("error", "broken thing", "a.py", 3),
        ("warning", "careful", None, None),
        # Relative to the workspace, as GitHub's runner makes it.
        ("error", "linted", "src/b.py", 4),
        ("notice", "outside", "/etc/hosts", None),
    ]
    assert "error: src/b.py:4: linted" in lines
    assert result.summary.strip() == "# Summary"


def test_secret_in_step_script_is_masked(tmp_path: Path) -> None:
    result, lines = run_job(
        tmp_path,
        [
            {
                "id": "s",
                "run": "echo 'token: ${{ secrets.TOKEN }}'\n"
                'echo "o=${{ secrets.TOKEN }}" >> $GITHUB_OUTPUT',
            }
        ],
        outputs={"leak": "${{ steps.s.outputs.o }}"},
        secrets={"TOKEN": "s3cr3t-value"},
    )
    assert "token: ***" in lines
    assert "s3cr3t-value" not in "\n".join(lines)
    assert "leak" not in result.outputs  # outputs holding secrets are not passed on


def test_checkout_is_satisfied_and_unfetchable_actions_fail_naming_the_step(tmp_path: Path) -> None:
    result, lines = run_job(
        tmp_path,
        [
            {"uses": "actions/checkout@v4"},
            {"name": "Set up node", "uses": "actions/setup-node@v4"},
            {"run": "echo unreachable"},
        ],
    )
    assert result.conclusion == "failure"
    assert [s.outcome for s in result.steps] == ["success", "failure", "skipped"]
    # No network here: the remote cannot be fetched, which fails that step only,
    # with one line naming the action and what to do.
    msg = [line for line in lines if line.startswith("✖ Set up node: action actions/setup-node@v4")]
    assert msg and "--action actions/setup-node=DIR" in msg[0]


def _git_workspace(tmp_path: Path) -> str:
    """A workspace that is a git checkout with one commit; its commit id."""
    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / "hello.txt").write_text("hi\n")
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@example.com"]
    subprocess.run([*git, "init", "-q", str(ws)], check=True)
    subprocess.run([*git, "-C", str(ws), "add", "-A"], check=True)
    subprocess.run([*git, "-C", str(ws), "commit", "-qm", "one"], check=True)
    out = subprocess.run(["git", "-C", str(ws), "rev-parse", "HEAD"], capture_output=True)
    return out.stdout.decode().strip()


def test_checkout_path_gets_its_own_checkout_and_notes_what_is_not_honoured(
    tmp_path: Path,
) -> None:
    commit = _git_workspace(tmp_path)
    result, lines = run_job(
        tmp_path,
        [
            {
                "uses": "actions/checkout@v4",
                "with": {"path": "sub/src", "ref": "gh-pages", "fetch-depth": 0},
            },
            {"run": "cat hello.txt && git rev-parse HEAD", "working-directory": "sub/src"},
            {"uses": "actions/checkout@v4", "with": {"path": "sub/src", "ref": "main"}},
        ],
        contexts={"github": {"event_name": "push", "repository": "acme/tool", "ref_name": "main"}},
    )
    assert result.conclusion == "success", lines
    assert "hi" in lines and commit in lines
    assert any("ref 'gh-pages' is not checked out" in line for line in lines)
    # `ref:` naming the run's own branch is no news; a second checkout to the
    # same path leaves the first one.
    assert not any("ref 'main'" in line for line in lines)
    assert any("sub/src already holds a checkout" in line for line in lines)


def test_checkout_ref_into_a_path_is_checked_out_as_on_github(tmp_path: Path) -> None:
    """A `ref:` of the run's own repository into a `path:` (the base of a pull
    request beside its head, PyGithub's "Check verbs") is checked out there
    when the snapshot has it, as GitHub's checkout resolves it: a commit or
    tag detached, a branch (`origin/<b>` first) as a local branch tracking
    `origin/<b>`. In the workspace itself the job keeps the snapshot."""
    first = _git_workspace(tmp_path)
    ws = tmp_path / "ws"
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@example.com", "-C", str(ws)]
    subprocess.run([*git, "tag", "v1"], check=True)
    subprocess.run([*git, "update-ref", "refs/remotes/origin/feature", first], check=True)
    (ws / "hello.txt").write_text("head\n")
    subprocess.run([*git, "commit", "-qam", "two"], check=True)
    show = "cat hello.txt; git rev-parse HEAD; git rev-parse --abbrev-ref HEAD"
    steps: list[dict[str, Any]] = []
    for where, ref in (("base", first), ("tag", "v1"), ("br", "feature")):
        steps += [
            {"uses": "actions/checkout@v4", "with": {"path": where, "ref": ref}},
            {"run": f"echo {where}: $({show} | tr '\\n' ' ')", "working-directory": where},
        ]
    steps += [
        {"run": "echo upstream: $(git rev-parse --abbrev-ref @{u})", "working-directory": "br"},
        {"uses": "actions/checkout@v4", "with": {"ref": first}},
        {"run": "echo ws: $(cat hello.txt)"},
    ]
    github = {"event_name": "pull_request", "repository": "acme/tool", "ref_name": "main"}
    result, lines = run_job(tmp_path, steps, contexts={"github": github})
    assert result.conclusion == "success", lines
    assert f"base: hi {first} HEAD" in lines, lines
    assert f"tag: hi {first} HEAD" in lines, lines
    assert f"br: hi {first} feature" in lines and "upstream: origin/feature" in lines, lines
    assert any(f"{first[:12]}) checked out into base" in line for line in lines), lines
    # The workspace keeps the run's files, with a note saying so.
    assert "ws: head" in lines
    assert any(f"ref {first!r} is not checked out" in line for line in lines), lines


@pytest.mark.parametrize(
    ("inputs", "error"),
    [
        (
            {"repository": "other/lib", "path": "lib"},
            "of repository 'other/lib' failed: file:///nowhere/other/lib: fatal: ",
        ),
        ({"repository": "other/lib", "path": "lib", "fetch-depth": "x"}, "fetch-depth 'x' is"),
        ({"repository": "../../x"}, "'../../x' is not an owner/name repository"),
        ({"repository": "o/--upload-pack=touch x"}, "is not an owner/name repository"),
        ({"path": "../outside"}, "path '../outside' is not under the workspace"),
        ({"path": "taken"}, "path 'taken' exists and is not an empty directory"),
        ({"path": "hello.txt"}, "path 'hello.txt' exists and is not an empty directory"),
        ({"path": "hello.txt/sub"}, "actions/checkout into 'hello.txt/sub' failed: "),
    ],
)
def test_checkout_inputs_it_cannot_honour_fail_the_step_in_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, inputs: dict[str, str], error: str
) -> None:
    monkeypatch.setenv("PRELOOP_ACTIONS_URL", "file:///nowhere")
    _git_workspace(tmp_path)
    (tmp_path / "ws" / "taken").mkdir()
    (tmp_path / "ws" / "taken" / "file").write_text("x")
    result, lines = run_job(
        tmp_path,
        [{"name": "Checkout", "uses": "actions/checkout@v4", "with": inputs}],
        contexts={"github": {"event_name": "push", "repository": "acme/tool"}},
    )
    assert result.conclusion == "failure"
    failures = [line for line in lines if line.startswith("✖ Checkout: actions/checkout")]
    assert len(failures) == 1 and error in failures[0], lines
    assert not (tmp_path / "outside").exists() and not (tmp_path / "ws" / "lib").exists()
    assert (tmp_path / "ws" / "hello.txt").exists()  # a refused checkout changes nothing


def _mirror_of_another_repository(mirrors: Path) -> dict[str, str]:
    """`<mirrors>/other/lib.git`: main (two commits, the default), tag v1 on
    its first, dev (v1 and one more); the commit of v1 and of main."""
    work = mirrors.parent / "lib-work"
    subprocess.run(["git", "init", "-q", "-b", "main", str(work)], check=True)

    def git(*args: str) -> str:
        cmd = ["git", "-c", "user.name=t", "-c", "user.email=t@example.com", "-C", str(work)]
        done = subprocess.run([*cmd, *args], capture_output=True, text=True, check=True)
        return done.stdout.strip()

    def commit(name: str, text: str) -> str:
        (work / name).write_text(text + "\n")
        git("add", "-A")
        git("commit", "-qm", text)
        return git("rev-parse", "HEAD")

    commits = {"v1": commit("lib.txt", "one")}
    git("tag", "v1")
    commits["main"] = commit("lib.txt", "two")
    git("checkout", "-qb", "dev", "v1")
    commit("dev.txt", "dev")
    git("checkout", "-q", "main")
    (mirrors / "other").mkdir(parents=True)
    git("clone", "-q", "--bare", str(work), str(mirrors / "other" / "lib.git"))
    return commits


def test_checkout_of_another_repository_fetches_it_from_the_actions_base(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`repository: other/lib` comes from `$PRELOOP_ACTIONS_URL/other/lib`,
    as from github.com: its default branch as a local branch, one commit
    deep; a tag or commit detached; `fetch-depth: 0` with every branch and
    tag; without `path:` in place of the snapshot."""
    _git_workspace(tmp_path)
    commits = _mirror_of_another_repository(tmp_path / "mirrors")
    monkeypatch.setenv("PRELOOP_ACTIONS_URL", f"file://{tmp_path / 'mirrors'}")

    def checkout(**inputs: Any) -> dict[str, Any]:
        return {"uses": "actions/checkout@v4", "with": {"repository": "other/lib", **inputs}}

    def show(path: str) -> dict[str, Any]:
        script = (
            'echo "$(git branch --show-current)|$(git rev-parse HEAD)|'
            "$(git rev-list --count HEAD)|$(git tag | tr '\\n' ' ')|$(cat lib.txt)\""
        )
        return {"run": script, "working-directory": path}

    steps = [
        {"uses": "actions/checkout@v4"},
        checkout(path="lib"),
        show("lib"),
        checkout(path="tagged", ref="v1"),
        show("tagged"),
        checkout(path="full", ref="dev", **{"fetch-depth": "0"}),
        show("full"),
        checkout(path="bysha", ref=commits["v1"], submodules="recursive", lfs="false"),
        show("bysha"),
        {"run": "test -f hello.txt && test -f lib/lib.txt"},
        checkout(),
        {"run": "test ! -e hello.txt && test ! -e lib && cat lib.txt && git branch --show-current"},
    ]
    result, lines = run_job(
        tmp_path, steps, contexts={"github": {"event_name": "push", "repository": "acme/tool"}}
    )
    assert result.conclusion == "success", lines
    main, v1 = commits["main"], commits["v1"]
    assert f"main|{main}|1||two" in lines
    assert f"|{v1}|1|v1 |one" in lines
    dev = [line for line in lines if line.startswith("dev|")]
    assert len(dev) == 1 and dev[0].endswith("|2|v1 |one")
    assert f"|{v1}|1||one" in lines
    # Without `path:`, in place of the snapshot's files.
    assert lines.index("two") > lines.index(f"|{v1}|1||one") and "main" in lines
    assert any(f"actions/checkout: other/lib@refs/heads/main ({main[:12]}) into lib" in line
               for line in lines)  # fmt: skip
    # `submodules:` is honoured (other/lib has none); `lfs: false` is no request.
    assert not any("not honoured" in line for line in lines), lines


def test_checkout_of_another_repository_at_a_ref_it_lacks_fails_in_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _git_workspace(tmp_path)
    _mirror_of_another_repository(tmp_path / "mirrors")
    monkeypatch.setenv("PRELOOP_ACTIONS_URL", f"file://{tmp_path / 'mirrors'}")
    step = {"name": "Lib", "uses": "actions/checkout@v4",
            "with": {"repository": "other/lib", "ref": "nope", "path": "lib"}}  # fmt: skip
    result, lines = run_job(
        tmp_path, [step], contexts={"github": {"event_name": "push", "repository": "acme/tool"}}
    )
    assert result.conclusion == "failure"
    failures = [line for line in lines if line.startswith("✖ Lib: actions/checkout")]
    assert len(failures) == 1 and "it has no branch or tag 'nope'" in failures[0], lines
    assert not (tmp_path / "ws" / "lib").exists()


@pytest.mark.parametrize(
    ("inputs", "error"),
    [
        ({"ref": "refs/heads/-x", "path": "lib"}, "'refs/heads/-x' is not a ref name git takes"),
        ({"ref": "a..b", "path": "lib"}, "'a..b' is not a ref name git takes"),
        ({"path": "hello.txt/sub"}, "actions/checkout into 'hello.txt/sub' failed: "),
        ({"repository": "other/..", "path": "lib"}, "is not an owner/name repository"),
        ({"repository": "lib", "path": "lib"}, "'lib' is not an owner/name repository"),
    ],
)
def test_checkout_of_another_repository_refuses_bad_input_in_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, inputs: dict[str, str], error: str
) -> None:
    """A ref with option or range text, a `path:` under a file, a name that
    is no owner/name: one line each, no traceback, the workspace as it was."""
    _git_workspace(tmp_path)
    _mirror_of_another_repository(tmp_path / "mirrors")
    monkeypatch.setenv("PRELOOP_ACTIONS_URL", f"file://{tmp_path / 'mirrors'}")
    step = {"name": "Lib", "uses": "actions/checkout@v4",
            "with": {"repository": "other/lib", **inputs}}  # fmt: skip
    result, lines = run_job(
        tmp_path, [step], contexts={"github": {"event_name": "push", "repository": "acme/tool"}}
    )
    assert result.conclusion == "failure"
    failures = [line for line in lines if line.startswith("✖ Lib: actions/checkout")]
    assert len(failures) == 1 and error in failures[0], lines
    assert "check the network" not in failures[0] or "hello.txt" in error
    assert not (tmp_path / "ws" / "lib").exists() and (tmp_path / "ws" / "hello.txt").exists()


def test_checkout_of_the_runs_own_repository_is_satisfied(tmp_path: Path) -> None:
    _git_workspace(tmp_path)
    steps = [
        {"uses": "actions/checkout@v4", "with": {"repository": "ACME/Tool.git"}},
        {"uses": "actions/checkout@v4", "with": {"repository": "someone/tool"}},
        {"uses": "actions/checkout@v4", "with": {"repository": "pallets/markupsafe"}},
    ]
    pushed = {"after": "0123abc", "pull_request": {"head": {"sha": "4567def", "ref": "fix"}}}
    github = {"event_name": "push", "repository": "local/tool", "event": pushed}
    for ref in ("0123abc", "4567def", "fix"):
        steps.append({"uses": "actions/checkout@v4", "with": {"ref": ref, "fetch-depth": 0}})
    result, lines = run_job(tmp_path, steps, contexts={"github": github})
    assert result.conclusion == "success", lines
    # Without a GitHub remote the run's repository's real name is unknown: a
    # note, not a failure; the submitted HEAD's refs are the run's own.
    notes = [line for line in lines if line.startswith("actions/checkout: cannot tell")]
    assert len(notes) == 1 and "'pallets/markupsafe'" in notes[0]
    assert not any("is not checked out" in line for line in lines)


def test_checkout_of_a_repository_of_the_same_name_and_another_owner_fetches_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fork's workflow (`acme/tool`, from its remote) checking out
    `upstream/tool` gets upstream's default branch, as on GitHub; its own
    `owner/name` in any case is the snapshot."""
    _git_workspace(tmp_path)
    mirrors = tmp_path / "mirrors"
    _mirror_of_another_repository(mirrors)
    (mirrors / "upstream").mkdir()
    (mirrors / "other" / "lib.git").rename(mirrors / "upstream" / "tool.git")
    monkeypatch.setenv("PRELOOP_ACTIONS_URL", f"file://{mirrors}")
    steps = [
        {"uses": "actions/checkout@v4", "with": {"repository": "upstream/tool", "path": "up"}},
        {"uses": "actions/checkout@v4", "with": {"repository": "Acme/Tool.git", "path": "own"}},
        {"run": "cat up/lib.txt && test -f own/hello.txt && test ! -e own/lib.txt"},
    ]
    result, lines = run_job(
        tmp_path, steps, contexts={"github": {"event_name": "push", "repository": "acme/tool"}}
    )
    assert result.conclusion == "success", lines
    assert "two" in lines


def test_composite_action_inputs_outputs(tmp_path: Path) -> None:
    action = """\
        name: greet
        inputs:
          who:
            required: true
          greeting:
            default: Hello
        outputs:
          said:
            value: ${{ steps.say.outputs.text }}
        runs:
          using: composite
          steps:
            - id: say
              shell: bash
              run: |
                where=$(basename $GITHUB_ACTION_PATH)
                echo "${{ inputs.greeting }}, ${{ inputs.who }} from $where"
                echo "text=${{ inputs.greeting }} ${{ inputs.who }}" >> "$GITHUB_OUTPUT"
        """
    result, lines = run_job(
        tmp_path,
        [
            {"id": "g", "uses": "./.github/actions/greet", "with": {"who": "${{ matrix.x }}"}},
            {"run": "echo 'said=${{ steps.g.outputs.said }}'"},
        ],
        contexts={"github": {}, "matrix": {"x": "world"}},
        files={".github/actions/greet/action.yml": action},
    )
    assert result.conclusion == "success", lines
    assert "Hello, world from greet" in lines and "said=Hello world" in lines


def test_github_action_names_each_step_as_github_does(tmp_path: Path) -> None:
    # GITHUB_ACTION and github.action were empty for every step; GitHub's
    # runner sets them to the step's id, else to the name its workflow parser
    # generates (tools use it to tell steps apart, or to detect a runner).
    action = """\
        runs:
          using: composite
          steps:
            - id: inner
              shell: bash
              run: echo "in composite $GITHUB_ACTION ${{ github.action }}"
        """
    show = 'echo "$GITHUB_ACTION ${{ github.action }}"'
    result, lines = run_job(
        tmp_path,
        [
            {"run": show},
            {"id": "named", "run": show},
            {"run": show},
            {"uses": "actions/checkout@v4"},
            {"uses": "./.github/actions/comp"},
            {"uses": "./.github/actions/comp"},
            {"run": show},
        ],
        files={".github/actions/comp/action.yml": action},
    )
    assert result.conclusion == "success", lines
    shown = [line for line in lines if line.startswith(("__", "named", "in composite"))]
    assert shown == [
        "__run __run",
        "named named",
        "__run_2 __run_2",
        # a composite's steps have the name of the step that called it
        "in composite __self __self",
        "in composite __self_2 __self_2",
        "__run_3 __run_3",
    ]


def test_step_action_names_follow_githubs_id_builder() -> None:
    steps: list[dict[str, Any]] = [
        {"uses": "actions/checkout@v4"},
        {"uses": "actions/checkout@v4"},
        {"uses": "owner/repo.name/sub/dir@main"},
        {"uses": "docker://alpine:3.19"},
        {"uses": "weird"},  # no @ref: a script's name
        {"id": "__run", "run": "true"},  # not a valid id, but taken
        {"run": "true"},
        {"id": "__run_3", "run": "true"},
        {"run": "true"},
    ]
    assert step_action_names(steps) == [
        "__actions_checkout",
        "__actions_checkout_2",
        "__owner_repo_name",
        "__alpine_3_19",
        "__run_2",
        "__run",
        "__run_4",
        "__run_3",
        "__run_5",
    ]


def test_composite_action_failure_fails_the_step(tmp_path: Path) -> None:
    action = """\
        runs:
          using: composite
          steps:
            - run: exit 4
              shell: bash
        """
    result, _ = run_job(
        tmp_path,
        [{"id": "c", "uses": "./act"}, {"if": "failure()", "run": "echo after"}],
        files={"act/action.yml": action},
    )
    assert [s.outcome for s in result.steps] == ["failure", "success"]
    assert result.conclusion == "failure"


def _spawner(marker: str) -> str:
    # A grandchild (sleep) the step leaves running while it waits.
    return f'sleep 1000 &\necho "{marker}=$!"\nwait'


def test_step_timeout_kills_whole_group(tmp_path: Path) -> None:
    pidfds: list[int] = []

    def on_line(line: str) -> None:
        if line.startswith("grandchild="):
            pidfds.append(os.pidfd_open(int(line.split("=")[1])))

    result, lines = run_job(
        tmp_path,
        [
            {"id": "hang", "run": _spawner("grandchild"), "timeout-minutes": 0.02},
            {"if": "failure()", "run": "echo cleanup"},
        ],
        on_line=on_line,
    )
    assert len(pidfds) == 1 and _exited(pidfds[0])
    assert result.steps[0].outcome == "failure" and "cleanup" in lines
    assert any("timed out" in line for line in lines)


def test_job_timeout_kills_whole_group(tmp_path: Path) -> None:
    pidfds: list[int] = []

    def on_line(line: str) -> None:
        if line.startswith("grandchild="):
            pidfds.append(os.pidfd_open(int(line.split("=")[1])))

    result, _ = run_job(
        tmp_path,
        [{"run": _spawner("grandchild")}, {"run": "echo never"}],
        timeout_minutes=0.02,
        on_line=on_line,
    )
    assert len(pidfds) == 1 and _exited(pidfds[0])
    assert result.conclusion == "failure"
    assert result.reason is not None and "timeout" in result.reason


def test_cancel_kills_step_and_runs_always_steps(tmp_path: Path) -> None:
    pidfds: list[int] = []
    control = JobControl()

    def on_line(line: str) -> None:
        if line.startswith("grandchild="):
            pidfds.append(os.pidfd_open(int(line.split("=")[1])))
            control.cancel()

    result, lines = run_job(
        tmp_path,
        [
            {"run": _spawner("grandchild")},
            {"run": "echo normal"},
            {"if": "always()", "run": "echo always-ran"},
            {"if": "cancelled()", "run": "echo cancelled-ran"},
        ],
        on_line=on_line,
        control=control,
    )
    assert len(pidfds) == 1 and _exited(pidfds[0])
    assert result.conclusion == "cancelled"
    assert "normal" not in lines and "always-ran" in lines and "cancelled-ran" in lines


def test_background_process_left_by_a_step_is_killed_at_job_end(tmp_path: Path) -> None:
    pidfds: list[int] = []

    def on_line(line: str) -> None:
        if line.startswith("bg="):
            pidfds.append(os.pidfd_open(int(line.split("=")[1])))

    result, _ = run_job(
        tmp_path,
        [
            {"run": 'sleep 1000 > /dev/null 2>&1 &\necho "bg=$!"'},
            # A daemon that left the step's process group (and session).
            {"run": 'setsid sleep 1000 > /dev/null 2>&1 < /dev/null &\necho "bg=$!"'},
            {"run": "echo third"},
        ],
        on_line=on_line,
    )
    assert result.conclusion == "success"
    assert len(pidfds) == 2 and all(_exited(fd) for fd in pidfds)


def test_env_file_parsing() -> None:
    masker = Masker()
    masker.add("abc")
    assert masker.mask("xabcx") == "x***x"


def test_env_file_unterminated_heredoc(tmp_path: Path) -> None:
    f = tmp_path / "out"
    f.write_text("a=1\nb<<END\nx\n")
    with pytest.raises(EnvFileError, match="not terminated"):
        parse_env_file(f, "GITHUB_OUTPUT")
    f.write_text("a=1\nb<<END\nx\ny\nEND\nc=x=y\n")
    assert parse_env_file(f, "GITHUB_OUTPUT") == {"a": "1", "b": "x\ny", "c": "x=y"}


def test_sweep_work_dir_removes_only_dead_processes_entries(tmp_path: Path) -> None:
    dead = subprocess.run(["sh", "-c", "echo $$"], capture_output=True, text=True, check=True)
    root = work_dir(tmp_path)
    (root / f"{dead.stdout.strip()}-3-build-abc" / "workspace").mkdir(parents=True)
    (root / f"{os.getpid()}-template-def").mkdir()
    (root / "not-a-pid").mkdir()
    removed = sweep_work_dir(tmp_path)
    assert [p.name for p in removed] == [f"{dead.stdout.strip()}-3-build-abc"]
    assert sorted(p.name for p in root.iterdir()) == sorted(
        [f"{os.getpid()}-template-def", "not-a-pid"]
    )


def test_job_env_that_cannot_be_evaluated_fails_the_job(tmp_path: Path) -> None:
    result, lines = run_job(
        tmp_path, [{"run": "echo never"}], env={"X": "${{ fromJSON('not json') }}"}
    )
    assert result.conclusion == "failure" and result.steps == []
    assert result.reason is not None and "env cannot be evaluated" in result.reason
    assert "never" not in lines


def test_container_and_services_are_reported_not_silently_ignored(tmp_path: Path) -> None:
    result, lines = run_job(
        tmp_path,
        [{"run": "echo on-the-host"}],
        extra_spec={
            "container": {"image": "node:20"},
            "services": {"redis": {"image": "redis"}, "db": {"image": "postgres"}},
        },
    )
    assert result.conclusion == "success"
    assert "on-the-host" in lines
    warnings = [a.message for a in result.annotations if a.level == "warning"]
    assert any("`container:`" in w and "'build'" in w for w in warnings)
    assert any("`services:` (db, redis)" in w for w in warnings)
    assert any(line.startswith("warning: job 'build' declares `services:`") for line in lines)


def test_steps_are_tagged_by_the_run_key_and_other_runs_are_spared(tmp_path: Path) -> None:
    """Run ids repeat across stores (every lite store starts at 1): killing the
    leftovers of one run must never reach another run's steps."""
    from preloop.runner.job import kill_tracked, tracking_prefix

    ws, temp = tmp_path / "ws", tmp_path / "temp"
    ws.mkdir()
    temp.mkdir()
    lines: list[str] = []
    result = anyio.run(
        lambda: execute_job(
            {"job": "build", "steps": [{"run": 'echo "id=$RUNNER_TRACKING_ID"'}]},
            {"github": {"event_name": "push"}},
            JobHost(workspace=ws, temp=temp, run_id="1", tracking_key="run-key-a"),
            log=lines.append,
        )
    )
    assert result.conclusion == "success"
    assert any(line.startswith(f"id={tracking_prefix('run-key-a')}") for line in lines), lines

    # A step of another store's run 1, tagged with that run's own key.
    other = subprocess.Popen(
        ["sleep", "1000"],
        env={**os.environ, "RUNNER_TRACKING_ID": tracking_prefix("run-key-b") + "step"},
    )
    pidfd = os.pidfd_open(other.pid)
    try:
        assert kill_tracked(tracking_prefix("run-key-a"), prefix=True) == 0
        assert not _exited(pidfd, 0)
        assert kill_tracked(tracking_prefix("run-key-b"), prefix=True) == 1
        assert _exited(pidfd)
    finally:
        other.kill()
        other.wait()
        os.close(pidfd)


@pytest.mark.parametrize("debug", [False, True])
def test_debug_lines_only_with_step_debug_logging(tmp_path: Path, debug: bool) -> None:
    # GitHub shows `::debug::` only when ACTIONS_STEP_DEBUG is true, and then
    # tells steps with RUNNER_DEBUG=1; real actions log heavily at debug level.
    _, lines = run_job(
        tmp_path,
        [{"run": 'echo "::debug::tool cache probe"\necho "runner debug=${RUNNER_DEBUG:-0}"'}],
        secrets={"ACTIONS_STEP_DEBUG": "true"} if debug else None,
    )
    assert ("debug: tool cache probe" in lines) is debug
    assert f"runner debug={1 if debug else 0}" in lines


def test_snapshot_tags_lists_those_of_heads_history_and_skips_names_json_cannot_carry(
    tmp_path: Path,
) -> None:
    from preloop.runner.checkout import snapshot_tags

    commit = _git_workspace(tmp_path)
    ws = tmp_path / "ws"
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@example.com", "-C", str(ws)]
    subprocess.run([*git, "tag", "light"], check=True)
    subprocess.run([*git, "tag", "-a", "heavy", "-m", "annotated"], check=True)
    subprocess.run([*git, "tag", b"bad\xff"], check=True)  # a refname git takes, not UTF-8
    subprocess.run([*git, "checkout", "-q", "-b", "side"], check=True)
    subprocess.run([*git, "commit", "-q", "--allow-empty", "-m", "side"], check=True)
    subprocess.run([*git, "tag", "elsewhere"], check=True)
    subprocess.run([*git, "checkout", "-q", "-"], check=True)
    heavy = subprocess.run([*git, "rev-parse", "heavy"], capture_output=True, text=True)
    tags = {name: (obj, peeled) for name, obj, peeled in snapshot_tags(ws, "HEAD")}
    assert tags == {"light": (commit, commit), "heavy": (heavy.stdout.strip(), commit)}
    assert snapshot_tags(tmp_path, "HEAD") == ()  # not a repository


def test_a_container_that_evaluates_to_nothing_is_no_container(tmp_path: Path) -> None:
    # urllib3's matrix gives `container: ''` to the legs that need none.
    result, _ = run_job(
        tmp_path,
        [{"run": "echo on-the-host"}],
        extra_spec={"container": "${{ matrix.container }}"},
        contexts={"matrix": {"container": ""}},
    )
    assert result.conclusion == "success"
    assert [a.message for a in result.annotations if a.level == "warning"] == []
    (tmp_path / "other").mkdir()
    result, _ = run_job(
        tmp_path / "other",
        [{"run": "echo on-the-host"}],
        extra_spec={"container": "${{ matrix.container }}"},
        contexts={"matrix": {"container": "python:3.12"}},
    )
    warnings = [a.message for a in result.annotations if a.level == "warning"]
    assert any("`container:`" in w for w in warnings)


_FLAKE8_MATCHER = """\
    {"problemMatcher": [
      {"owner": "flake8-error", "severity": "error", "pattern": [
        {"regexp": "^([^:]*):(\\\\d+):(\\\\d+): ([EF]\\\\d\\\\d\\\\d) (.*)$",
         "file": 1, "line": 2, "column": 3, "code": 4, "message": 5}]},
      {"owner": "flake8-warning", "severity": "warning", "pattern": [
        {"regexp": "^([^:]*):(\\\\d+):(\\\\d+): ([W]\\\\d\\\\d\\\\d) (.*)$",
         "file": 1, "line": 2, "column": 3, "code": 4, "message": 5}]}]}
    """

# setup-python's .github/python.json: a traceback's last frame and its raise
_PYTHON_MATCHER = """\
    {"problemMatcher": [{"owner": "python", "pattern": [
      {"regexp": "^\\\\s*File\\\\s\\\\\\"(.*)\\\\\\",\\\\sline\\\\s(\\\\d+),\\\\sin\\\\s(.*)$",
       "file": 1, "line": 2},
      {"regexp": "^\\\\s*raise\\\\s(.*)\\\\(\\\\'(.*)\\\\'\\\\)$", "message": 2}]}]}
    """


def test_problem_matchers_turn_later_output_into_annotations_as_on_github(
    tmp_path: Path,
) -> None:
    """`::add-matcher::` (liskin/gh-problem-matcher-wrap, setup-python) registers
    matchers for the rest of the job; the command lines are not shown; a
    matched line is logged as it is and becomes an annotation whose file is
    kept relative to the workspace when it exists there; `::remove-matcher
    owner=X::` ends one."""
    result, lines = run_job(
        tmp_path,
        [
            {"run": 'echo "::add-matcher::.github/flake8.json"'},
            {
                "run": textwrap.dedent(
                    """\
                    echo "pkg/mod.py:3:1: F401 'os' imported but unused"
                    echo "gone.py:7:80: W291 trailing whitespace"
                    echo "::add-matcher::$GITHUB_WORKSPACE/.github/python.json"
                    echo '  File "pkg/mod.py", line 9, in main'
                    echo "    raise ValueError('bad value')"
                    echo "::remove-matcher owner=flake8-error::"
                    echo "pkg/mod.py:4:1: E302 expected 2 blank lines"
                    """
                )
            },
        ],
        files={
            ".github/flake8.json": _FLAKE8_MATCHER,
            ".github/python.json": _PYTHON_MATCHER,
            "pkg/mod.py": "import os\n",
        },
    )
    assert result.conclusion == "success"
    assert not any(line.startswith("::") for line in lines)
    assert "pkg/mod.py:3:1: F401 'os' imported but unused" in lines
    assert [(a.level, a.message, a.file, a.line, a.col) for a in result.annotations] == [
        ("error", "'os' imported but unused", "pkg/mod.py", 3, 1),
        ("warning", "trailing whitespace", None, 7, 80),  # no such file: dropped
        ("error", "bad value", "pkg/mod.py", 9, None),
    ]


def test_a_matcher_file_the_runner_cannot_use_fails_its_step(tmp_path: Path) -> None:
    result, lines = run_job(
        tmp_path,
        [
            {"run": 'echo "::add-matcher::bad.json"'},
            {"run": 'echo "::add-matcher::"; echo still running'},
        ],
        files={"bad.json": '{"problemMatcher": [{"owner": "x", "pattern": [{"regexp": "x"}]}]}'},
    )
    assert result.conclusion == "failure"
    assert any("At least one pattern must set 'message'" in a.message for a in result.annotations)
    assert any("Unable to process command '::add-matcher::bad.json'" in line for line in lines)


def test_matcher_files_a_step_names_cannot_stall_or_crash_the_job(tmp_path: Path) -> None:
    """A FIFO, a device or a file whose `problemMatcher` is no list fails
    the step in one line (it stalled the job's output, filled memory, or
    crashed the job); coloured output is matched with its colour codes
    stripped, as GitHub's OutputManager does; `::remove-matcher::FILE` reads
    only the owners (GitHub validates nothing there)."""
    steps: list[dict[str, Any]] = [
        {"run": 'mkfifo fifo.json && echo "::add-matcher::fifo.json"', "continue-on-error": True},
        {"run": 'echo "::add-matcher::/dev/zero"', "continue-on-error": True},
        {"run": 'echo "::add-matcher::list.json"', "continue-on-error": True},
        {
            "run": textwrap.dedent(
                """\
                echo "::add-matcher::.github/flake8.json"
                printf '\\033[1mpkg/mod.py\\033[0m:3:1: F401 unused\\n'
                echo "::remove-matcher::owners-only.json"
                echo "pkg/mod.py:4:1: F402 after removal"
                echo "pkg/mod.py:5:1: W291 still a warning"
                """
            )
        },
    ]
    files = {
        ".github/flake8.json": _FLAKE8_MATCHER,
        "pkg/mod.py": "import os\n",
        "list.json": '{"problemMatcher": 5}',
        "owners-only.json": '{"problemMatcher": [{"owner": "flake8-error"}]}',
    }
    result, lines = run_job(tmp_path, steps, files=files)
    assert result.conclusion == "success", lines
    errors = [a.message for a in result.annotations if a.level == "error"]
    assert any("fifo.json: not a regular file" in e for e in errors), errors
    assert any("/dev/zero: not a regular file" in e for e in errors), errors
    assert any("`problemMatcher` must be a list" in e for e in errors), errors
    found = [(a.level, a.message, a.file, a.line) for a in result.annotations if a.line]
    assert found == [
        ("error", "unused", "pkg/mod.py", 3),
        ("warning", "still a warning", "pkg/mod.py", 5),
    ]


def test_legacy_commands_and_colons_in_properties_parse_as_on_github(tmp_path: Path) -> None:
    """GitHub's runner reads `##[name k=v;k=v]data` anywhere in a line
    (`ActionCommand.TryParse`; setup-python writes `##[add-matcher]`) and, in
    `::name props::data`, takes everything up to the next `::` as the
    properties, single colons included; an unregistered name is output."""
    result, lines = run_job(
        tmp_path,
        [
            {
                "id": "s",
                "run": textwrap.dedent(
                    """\
                    echo "##[add-matcher]$GITHUB_WORKSPACE/m.json"
                    echo "boom: it broke"
                    echo "prefix ##[warning file=a.py;line=2]semi%3Bcolon"
                    echo "::error title=Deprecated: old API,line=5::use the new one"
                    echo "##[set-output name=x]legacy"
                    echo "::echo::on"
                    echo "##[unknown]kept"
                    """
                ),
            }
        ],
        outputs={"x": "${{ steps.s.outputs.x }}"},
        files={
            "m.json": '{"problemMatcher": [{"owner": "boom", "pattern": '
            '[{"regexp": "^boom: (.*)$", "message": 1}]}]}',
            "a.py": "",
        },
    )
    assert result.conclusion == "success"
    assert [(a.level, a.message, a.file, a.line, a.title) for a in result.annotations] == [
        ("error", "it broke", None, None, None),
        ("warning", "semi;colon", "a.py", 2, None),
        ("error", "use the new one", None, 5, "Deprecated: old API"),
    ]
    assert result.outputs == {"x": "legacy"}
    assert "##[unknown]kept" in lines
    assert not any("add-matcher" in line or "::echo" in line for line in lines[1:])


def test_echo_on_shows_command_lines_as_githubs_runner_does(tmp_path: Path) -> None:
    """`::echo::on` makes the runner show the command lines it processes
    (those without OmitEcho: set-output, group, echo itself...; add-mask as
    `::add-mask::***`, issue and debug commands never) until `::echo::off`,
    within the step; a value other than on/off fails the step."""
    result, lines = run_job(
        tmp_path,
        [
            {
                "id": "s",
                "run": textwrap.dedent(
                    """\
                    echo "::set-output name=a::1"
                    echo "::echo::on"
                    echo "::set-output name=b::2"
                    echo "::add-mask::s3cret"
                    echo "::warning::careful"
                    echo "::echo::off"
                    echo "::set-output name=c::3"
                    echo "::add-mask::"
                    """
                ),
            },
            {"run": 'echo "::set-output name=d::4"'},
            {"run": 'echo "::echo::loud"'},
        ],
        outputs={"b": "${{ steps.s.outputs.b }}"},
    )
    assert result.conclusion == "failure"
    assert result.outputs == {"b": "2"}
    commands = [line for line in lines if line.startswith("::")]
    assert commands == ["::set-output name=b::2", "::add-mask::***", "::echo::off"]
    assert [(a.level, a.message) for a in result.annotations] == [
        ("warning", "careful"),
        ("warning", "Can't add secret mask for empty string in ##[add-mask] command."),
        ("error", "Unable to process command '::echo::loud' successfully."),
        ("error", "Invalid echo command value. Possible values can be: 'on', 'off'. "
         "Current value is: 'loud'."),
    ]  # fmt: skip


def test_github_token_is_in_the_github_context_and_is_the_given_secret(tmp_path: Path) -> None:
    """On GitHub `github.token` and `secrets.GITHUB_TOKEN` are the job's token
    (actions default their `token` input to `${{ github.token }}`; a dump of
    `toJSON(github)` shows it, masked). Here: the GITHUB_TOKEN secret given to
    preloop, else empty, and never missing from the context."""
    steps = [
        {"run": "echo same=${{ github.token == secrets.GITHUB_TOKEN }} tok=${{ github.token }}"},
        {"run": "echo has=${{ contains(toJSON(github), '\"token\": ') }}"},
    ]
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    result, lines = run_job(tmp_path / "a", steps, secrets={"GITHUB_TOKEN": "ghs_given0123"})
    assert result.conclusion == "success"
    assert "same=true tok=***" in lines and "has=true" in lines
    result, lines = run_job(tmp_path / "b", steps)
    assert "same=true tok=" in lines and "has=true" in lines


def test_checkout_path_with_another_ref_of_the_run_checks_that_ref_out(tmp_path: Path) -> None:
    """fastapi's regression test checks the pull request's base SHA out into
    `path: base` to run the new tests against the old code: GitHub's checkout
    checks that commit out, so a `path:` checkout gets a ref the run's
    checkout has (a commit of its history, a tag, a branch as a local
    branch); the workspace itself stays the snapshot (noted)."""
    first = _git_workspace(tmp_path)
    ws = tmp_path / "ws"
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@example.com", "-C", str(ws)]
    subprocess.run([*git, "tag", "v1"], check=True)
    subprocess.run([*git, "branch", "old"], check=True)
    (ws / "hello.txt").write_text("changed\n")
    subprocess.run([*git, "commit", "-qam", "two"], check=True)
    event = {"pull_request": {"base": {"sha": first}}}
    show = "cat hello.txt; git rev-parse HEAD; git symbolic-ref -q HEAD || echo detached"
    result, lines = run_job(
        tmp_path,
        [
            {
                "uses": "actions/checkout@v4",
                "with": {"path": "base", "ref": "${{ github.event.pull_request.base.sha }}"},
            },
            {"run": show, "working-directory": "base"},
            {"uses": "actions/checkout@v4", "with": {"path": "tag", "ref": "v1"}},
            {"uses": "actions/checkout@v4", "with": {"path": "br", "ref": "old"}},
            {"run": "git -C tag describe --tags; git -C br branch --show-current"},
            {"uses": "actions/checkout@v4", "with": {"ref": first}},
            {"run": "cat hello.txt"},
        ],
        contexts={"github": {"event_name": "pull_request", "event": event}},
    )
    assert result.conclusion == "success", lines
    base = lines.index(f"▶ Run {show}")
    assert lines[base + 1 : base + 4] == ["hi", first, "detached"]
    assert "v1" in lines and "old" in lines
    assert any(f"ref {first!r} is not checked out" in line for line in lines)
    assert lines[-1] == "changed"
