"""Remote, local and Docker actions in jobs: real node with GitHub's
`@actions/core`, real git remotes (`file://`), no network."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import anyio
import pytest
from tests.actions_support import JS_ACTION, git_calls, git_wrapper, publish_action

from preloop.actions import steps as action_steps
from preloop.actions.cache import ActionCache, ActionFetchError
from preloop.actions.reference import Overrides, parse_overrides, parse_uses
from preloop.actions.steps import ActionSource
from preloop.runner import JobHost, JobResult, execute_job


class Env:
    def __init__(self, tmp_path: Path) -> None:
        self.tmp = tmp_path
        self.remotes = tmp_path / "remotes"
        self.remotes.mkdir()
        self.state = tmp_path / "state"
        self.runs = 0

    @property
    def url(self) -> str:
        return f"file://{self.remotes}"

    def run(
        self,
        steps: list[dict[str, Any]],
        *,
        outputs: dict[str, str] | None = None,
        files: dict[str, str] | None = None,
        overrides: str = "",
        run_key: str | None = None,
        base_url: str | None = None,
        secrets: dict[str, str] | None = None,
    ) -> tuple[JobResult, list[str]]:
        self.runs += 1
        job_dir = self.tmp / f"job{self.runs}"
        ws, temp = job_dir / "ws", job_dir / "temp"
        ws.mkdir(parents=True)
        temp.mkdir()
        for rel, text in (files or {}).items():
            (ws / rel).parent.mkdir(parents=True, exist_ok=True)
            (ws / rel).write_text(textwrap.dedent(text))
        lines: list[str] = []
        source = ActionSource(
            self.state,
            Overrides(parse_overrides([overrides], "test")),
            base_url=base_url or self.url,
        )
        spec = {"job": "build", "steps": steps, "outputs": outputs or {}}
        result = anyio.run(
            lambda: execute_job(
                spec,
                {"github": {"event_name": "push"}},
                JobHost(
                    workspace=ws,
                    temp=temp,
                    run_id=str(self.runs),
                    tracking_key=run_key or f"run{self.runs}",
                    actions=source,
                ),
                log=lines.append,
                secrets=secrets,
            )
        )
        return result, lines


@pytest.fixture
def env(tmp_path: Path) -> Env:
    return Env(tmp_path)


def _steps(result: JobResult) -> list[tuple[str, str]]:
    return [(s.name, s.outcome) for s in result.steps]


def test_javascript_action_protocol(env: Env) -> None:
    publish_action(env.remotes, "acme/greet", JS_ACTION)
    result, lines = env.run(
        [
            {"id": "g", "uses": "acme/greet@v1", "with": {"who": "world", "secret": "hunter2-x"}},
            {"run": 'echo "out=${{ steps.g.outputs.message }} env=$FROM_ACTION"; hello-tool'},
        ],
        outputs={"message": "${{ steps.g.outputs.message }}"},
    )
    assert result.conclusion == "success", lines
    assert _steps(result) == [
        ("Pre Run acme/greet@v1", "success"),
        ("Run acme/greet@v1", "success"),
        ('Run echo "out=Hello world env=$FROM_ACTION"; hello-tool', "success"),  # evaluated
        ("Post Run acme/greet@v1", "success"),
    ]
    text = "\n".join(lines)
    # Pre before main before the next step before post; state flows along.
    order = [
        text.index("pre ran"),
        text.index("main: Hello world state=P-world"),
        text.index("out=Hello world env=exported-world"),
        text.index("post: P-world M-world"),
    ]
    assert order == sorted(order)
    assert "tool-on-path" in lines
    assert "env: acme/greet@v1" in lines
    # setSecret masks the value from then on, in every later line.
    assert "the secret is ***" in lines
    assert "hunter2-x" not in text
    assert result.outputs == {"message": "Hello world"}
    assert "summary for world" in result.summary


def test_required_input_missing_fails_in_the_action_and_post_runs_after_a_failure(
    env: Env,
) -> None:
    deprecating = JS_ACTION["action.yml"].replace(
        'fail:\n            default: "false"',
        'fail:\n            default: "false"\n            deprecationMessage: let it be',
    )
    publish_action(env.remotes, "acme/greet", {**JS_ACTION, "action.yml": deprecating})
    result, lines = env.run(
        [
            {"uses": "acme/greet@v1", "with": {"fail": "true"}},
            {"run": "echo never"},
        ]
    )
    assert result.conclusion == "failure"
    assert _steps(result) == [
        ("Pre Run acme/greet@v1", "success"),
        ("Run acme/greet@v1", "failure"),
        ("Run echo never", "skipped"),
        ("Post Run acme/greet@v1", "success"),
    ]
    # GitHub's runner does not check `required:` (no warning): core.getInput(
    # required) throws in the action itself, and the step fails. A given
    # input the action deprecates warns.
    warnings = [a.message for a in result.annotations if a.level == "warning"]
    assert warnings == ["acme/greet@v1: Input 'fail' has been deprecated with message: let it be"]
    assert any("Error: Input required and not supplied: who" in line for line in lines)
    assert "post: P- " in lines  # main threw before it saved its state


def test_a_failing_javascript_action_is_not_a_process_error(env: Env) -> None:
    # GitHub's runner notes a node action's exit code without an error of its
    # own: `core.setFailed` is the one annotation. A crash that reported
    # nothing still names the step and its exit code.
    publish_action(env.remotes, "acme/greet", JS_ACTION)
    publish_action(
        env.remotes,
        "acme/crash",
        {"action.yml": "runs:\n  using: node20\n  main: m.js\n", "m.js": "process.exit(3)\n"},
    )
    result, lines = env.run(
        [
            {"uses": "acme/greet@v1", "with": {"who": "x", "fail": "true"}},
            {"uses": "acme/crash@v1", "if": "always()"},
        ]
    )
    assert result.conclusion == "failure"
    errors = [a.message for a in result.annotations if a.level == "error"]
    assert errors == ["asked to fail", "Run acme/crash@v1: node exited with exit code 3"], errors
    assert not any(line.startswith("Error: process completed") for line in lines), lines
    assert "Node action run completed with exit code 1" in lines


def test_state_saved_with_the_old_save_state_command_reaches_post(env: Env) -> None:
    # @actions/core before 1.10 writes `::save-state name=x::v` instead of
    # GITHUB_STATE; GitHub passes it to the post step as STATE_x.
    publish_action(
        env.remotes,
        "acme/old",
        {
            "action.yml": "runs:\n  using: node20\n  main: m.js\n  post: p.js\n",
            "m.js": "console.log('::save-state name=key::v1')\n",
            "p.js": "console.log('post state=' + process.env.STATE_key)\n",
        },
    )
    result, lines = env.run([{"uses": "acme/old@v1"}])
    assert result.conclusion == "success", lines
    assert "post state=v1" in lines
    assert not any("::save-state" in line for line in lines)


def test_posts_run_last_first_and_honour_post_if(env: Env) -> None:
    for slug in ("acme/one", "acme/two"):
        publish_action(
            env.remotes,
            slug,
            {
                "action.yml": f"""\
                    runs:
                      using: node20
                      main: main.js
                      post: post.js
                      post-if: {"success()" if slug == "acme/two" else "always()"}
                    """,
                "main.js": f"console.log('main {slug}')\n",
                "post.js": f"console.log('post {slug}')\n",
            },
        )
    result, lines = env.run(
        [{"uses": "acme/one@v1"}, {"uses": "acme/two@v1"}, {"run": "exit 3"}],
    )
    assert result.conclusion == "failure"
    posts = [line for line in lines if line.startswith("post ")]
    # two's post-if: success() is false after the failure; one's always() runs.
    assert posts == ["post acme/one"]
    ok, lines = env.run([{"uses": "acme/one@v1"}, {"uses": "acme/two@v1"}])
    assert ok.conclusion == "success"
    assert [line for line in lines if line.startswith("post ")] == [
        "post acme/two",
        "post acme/one",
    ]


def test_refs_tag_branch_sha_and_a_moved_tag(env: Env) -> None:
    first = publish_action(env.remotes, "acme/ver", _echo_action("one"), tags=("v1",))
    second = publish_action(env.remotes, "acme/ver", _echo_action("two"), tags=())
    # v1 is the first commit, main the second, and the SHA names the first.
    result, lines = env.run(
        [{"uses": "acme/ver@v1"}, {"uses": "acme/ver@main"}, {"uses": f"acme/ver@{first}"}],
        run_key="r1",
    )
    assert result.conclusion == "success", lines
    assert [line for line in lines if line.startswith("version ")] == [
        "version one",
        "version two",
        "version one",
    ]
    cached = sorted(p.name for p in (env.state / "actions" / "repos" / "acme" / "ver").iterdir())
    assert cached == sorted({first, second})
    # Move the tag: the same run keeps its resolution, the next run re-resolves.
    third = publish_action(env.remotes, "acme/ver", _echo_action("three"), tags=("v1",))
    _, lines = env.run([{"uses": "acme/ver@v1"}], run_key="r1")
    assert "version one" in lines
    _, lines = env.run([{"uses": "acme/ver@v1"}], run_key="r2")
    assert "version three" in lines
    # r1 (say a later job of it) keeps its resolution though r2 resolved since.
    _, lines = env.run([{"uses": "acme/ver@v1"}], run_key="r1")
    assert "version one" in lines
    assert (env.state / "actions" / "repos" / "acme" / "ver" / third).is_dir()
    # A tag and a branch of one name: the tag wins, as on GitHub.
    publish_action(env.remotes, "acme/ver", _echo_action("tagged"), tags=("v2",))
    publish_action(env.remotes, "acme/ver", _echo_action("branch"), tags=(), branch="v2")
    _, lines = env.run([{"uses": "acme/ver@v2"}], run_key="r3")
    assert "version tagged" in lines
    # A ref the remote does not have: that step fails, saying so.
    result, lines = env.run([{"uses": "acme/ver@v3"}], run_key="r4")
    assert result.conclusion == "failure"
    assert any(
        line.startswith("✖ Run acme/ver@v3: ") and "has no branch or tag 'v3'" in line
        for line in lines
    ), lines


def _echo_action(version: str) -> dict[str, str]:
    return {
        "action.yml": "runs:\n  using: node20\n  main: main.js\n",
        "main.js": f"console.log('version {version}')\n",
    }


def test_unreachable_remote_with_and_without_a_cached_resolution(env: Env) -> None:
    publish_action(env.remotes, "acme/ver", _echo_action("one"))
    result, _ = env.run([{"uses": "acme/ver@v1"}], run_key="r1")
    assert result.conclusion == "success"
    gone = f"file://{env.tmp}/gone"
    result, lines = env.run(
        [{"uses": "acme/ver@v1"}, {"uses": "acme/other@v1"}, {"run": "echo after"}],
        run_key="r2",
        base_url=gone,
    )
    # The cached resolution is reused with a warning naming it; the action
    # never fetched fails its step only (continue-on-error is not even needed
    # for the warning), with one line saying what to do.
    assert "version one" in lines
    warnings = [a.message for a in result.annotations if a.level == "warning"]
    assert any("acme/ver@v1" in w and "unreachable" in w for w in warnings), warnings
    failed = [
        line for line in lines if line.startswith("✖ Run acme/other@v1: action acme/other@v1")
    ]
    assert len(failed) == 1 and "--action acme/other=DIR (or =skip) for offline work" in failed[0]
    assert _steps(result) == [
        ("Run acme/ver@v1", "success"),
        ("Run acme/other@v1", "failure"),
        ("Run echo after", "skipped"),
    ]


def test_two_runs_fetching_one_action_fetch_once(env: Env, tmp_path: Path) -> None:
    """Two caches (two runs, in two tasks) ask for the same action at once:
    a real `git` wrapper counts the fetches and holds the first one until the
    second is waiting for the lock."""
    publish_action(env.remotes, "acme/ver", _echo_action("one"))
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "fetches"
    gate = tmp_path / "gate"
    os.mkfifo(gate)
    started = tmp_path / "started"
    os.mkfifo(started)
    real_git = subprocess.run(["which", "git"], capture_output=True, text=True).stdout.strip()
    (bin_dir / "git").write_text(
        "#!/bin/sh\n"
        'for a in "$@"; do case "$a" in fetch|clone) echo fetch >> ' + str(log) + "; "
        "echo started > " + str(started) + "; read _ < " + str(gate) + ";; esac; done\n"
        f'exec {real_git} "$@"\n'
    )
    (bin_dir / "git").chmod(0o755)
    old_path = os.environ["PATH"]
    os.environ["PATH"] = f"{bin_dir}:{old_path}"
    try:
        ref = parse_uses("acme/ver@v1")
        assert not isinstance(ref, str)
        caches = [
            ActionCache(env.state, run_key=f"r{i}", base_url=env.url, timeout=60) for i in (1, 2)
        ]
        results: list[str] = []

        async def fetch(cache: ActionCache) -> None:
            got = await cache.fetch(ref, lambda _m: None)  # type: ignore[arg-type]
            results.append(got.commit)

        async def main() -> None:
            async with anyio.create_task_group() as tg:
                tg.start_soon(fetch, caches[0])
                tg.start_soon(fetch, caches[1])
                with anyio.fail_after(60):  # until the first fetch is in git
                    await anyio.to_thread.run_sync(
                        lambda: Path(started).read_text(), abandon_on_cancel=True
                    )
                # The other one waits on the lock, not in git.
                assert log.read_text().count("fetch") == 1
                with open(gate, "w") as fh:
                    fh.write("go\n")

        anyio.run(main)
    finally:
        os.environ["PATH"] = old_path
    assert log.read_text().count("fetch") == 1
    assert len(results) == 2 and results[0] == results[1]
    assert caches[0].fetches + caches[1].fetches == 1


# One process fetching `acme/ver@v1` into the action cache; when it finds the
# repository's lock taken it writes its pid to the `waiting` FIFO (once) and
# goes on waiting with the real flock.
_FETCH_PROCESS = """
import errno, fcntl, os, sys
from pathlib import Path
import anyio
from preloop.actions.cache import ActionCache
from preloop.actions.reference import RemoteRef

state, url, waiting = sys.argv[1:4]
real_flock, told = fcntl.flock, []

def flock(fd, how):
    try:
        return real_flock(fd, how)
    except OSError as exc:
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN) and not told:
            told.append(True)
            with open(waiting, "w") as fh:
                fh.write(f"{os.getpid()}\\n")
        raise

fcntl.flock = flock
cache = ActionCache(Path(state), run_key=f"proc-{os.getpid()}", base_url=url, timeout=120)
got = anyio.run(lambda: cache.fetch(RemoteRef("acme", "ver", "", "v1"), print))
print("commit", got.commit, cache.fetches)
"""


def _fifo_line(fd: int, what: str) -> str:
    """The next line written to a FIFO we hold open read-write (so writers
    never block on opening it), waiting at most a minute."""
    import select

    ready, _, _ = select.select([fd], [], [], 120)
    assert ready, f"nothing came from {what}"
    return os.read(fd, 4096).decode().strip()


def test_two_processes_fetching_one_action_fetch_once(env: Env, tmp_path: Path) -> None:
    """Two real processes fetch the same action at once: the first holds its
    git fetch (a wrapper `git` blocks on a FIFO) until the second is seen
    waiting on the repository's lock; one fetch in all, one commit."""
    commit = publish_action(env.remotes, "acme/ver", _echo_action("one"))
    fifos = {}
    for name in ("started", "gate", "waiting"):
        os.mkfifo(tmp_path / name)
        fifos[name] = os.open(tmp_path / name, os.O_RDWR)
    log = tmp_path / "git.log"
    bin_dir = git_wrapper(
        tmp_path / "bin",
        log,
        before_fetch=f"echo $$ > {tmp_path}/started; read _ < {tmp_path}/gate",
    )
    penv = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    argv = [
        sys.executable,
        "-c",
        _FETCH_PROCESS,
        str(env.state),
        env.url,
        str(tmp_path / "waiting"),
    ]
    procs = [
        subprocess.Popen(argv, env=penv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    try:
        _fifo_line(fifos["started"], "the first fetch")  # one process is in git
        waiter = int(_fifo_line(fifos["waiting"], "the second process"))
        assert waiter in {p.pid for p in procs}
        assert len(git_calls(log, "clone")) == 1
        os.write(fifos["gate"], b"go\n")
        outs = [p.communicate(timeout=300) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for fd in fifos.values():
            os.close(fd)
    assert [p.returncode for p in procs] == [0, 0], outs
    lines = sorted(out.strip().splitlines()[-1] for out, _ in outs)
    # Both got the same commit; only the one not waiting fetched.
    assert lines == [f"commit {commit} 0", f"commit {commit} 1"]
    assert len(git_calls(log, "clone")) + len(git_calls(log, "fetch")) == 1
    waited = next(out for p, (out, _) in zip(procs, outs, strict=True) if p.pid == waiter)
    assert waited.strip().endswith(" 0")


def test_remote_composite_calling_a_javascript_action(env: Env) -> None:
    publish_action(env.remotes, "acme/greet", JS_ACTION)
    publish_action(
        env.remotes,
        "acme/combo",
        {
            "sub/action.yml": """\
                inputs:
                  name: {default: composite}
                outputs:
                  said:
                    value: ${{ steps.inner.outputs.message }}
                runs:
                  using: composite
                  steps:
                    - id: inner
                      uses: acme/greet@v1
                      with:
                        who: ${{ inputs.name }}
                    - run: echo "path=$GITHUB_ACTION_PATH" | sed "s#$HOME##"
                      shell: bash
                """
        },
        node_modules=False,
    )
    result, lines = env.run(
        [{"id": "c", "uses": "acme/combo/sub@v1"}, {"run": "echo said=${{ steps.c.outputs.said }}"}]
    )
    assert result.conclusion == "success", lines
    assert "said=Hello composite" in lines
    # A nested action's post runs at the job's end (GitHub runs no nested pre).
    assert lines[-1] == "post:  M-composite"
    assert any(line.startswith("path=") and line.endswith("/sub") for line in lines)


def test_docker_action_without_a_daemon_fails_that_step(
    env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DOCKER_HOST", f"unix://{env.tmp}/no-docker.sock")
    monkeypatch.setattr(action_steps, "_docker_checked", {})
    publish_action(
        env.remotes,
        "acme/dock",
        {
            "action.yml": "runs:\n  using: docker\n  image: Dockerfile\n",
            "Dockerfile": "FROM alpine:3\n",
        },
        node_modules=False,
    )
    result, lines = env.run(
        [
            {"uses": "docker://alpine:3", "continue-on-error": True},
            {"uses": "acme/dock@v1", "continue-on-error": True},
            {"run": "echo next-ran"},
        ]
    )
    assert result.conclusion == "success"
    failed = [line for line in lines if "no Docker daemon answers" in line]
    assert len(failed) == 2
    assert failed[0].startswith("✖ Run docker://alpine:3: ")
    assert failed[1].startswith("✖ Run acme/dock@v1: acme/dock@v1 is a Docker action")
    assert failed[1].endswith("or use --action acme/dock=skip")
    assert "next-ran" in lines


def test_override_directory_and_skip(env: Env, tmp_path: Path) -> None:
    local = tmp_path / "dev-greet"
    local.mkdir()
    for rel, text in JS_ACTION.items():
        (local / rel).parent.mkdir(parents=True, exist_ok=True)
        (local / rel).write_text(textwrap.dedent(text).replace("main: ", "main: ", 1))
    (local / "node_modules").symlink_to(Path(__file__).resolve().parent.parent / "node_modules")
    (local / "bin" / "hello-tool").chmod(0o755)
    result, lines = env.run(
        [
            {"id": "g", "uses": "acme/greet@v9", "with": {"who": "dev"}},
            {"uses": "acme/setup-thing@v2"},
        ],
        overrides=f"acme/greet={local}; acme/setup-thing=skip:not needed locally",
    )
    assert result.conclusion == "success", lines
    assert any(line.startswith("main: Hello dev") for line in lines)
    notices = [a.message for a in result.annotations if a.level == "notice"]
    assert notices == ["acme/setup-thing@v2 skipped by an override: not needed locally"]
    assert not (env.state / "actions" / "repos").exists()  # nothing was fetched


def test_an_override_with_a_path_applies_to_that_action_of_the_repository_only(
    env: Env,
) -> None:
    """`--action acme/kit/fetch=skip`: asottile/workflows' fast-checkout
    (a custom checkout fetching from github.com) is skipped while another
    action of the same repository runs; a path override wins over the
    repository's, whatever their order."""
    files = {f"{name}/{rel}": text for name in ("fetch", "build") for rel, text in
             _echo_action(name).items()}  # fmt: skip
    publish_action(env.remotes, "acme/kit", files)
    local = env.tmp / "kit-checkout"
    for rel, text in _echo_action("local build").items():
        (local / "build" / rel).parent.mkdir(parents=True, exist_ok=True)
        (local / "build" / rel).write_text(text)
    result, lines = env.run(
        [{"uses": "acme/kit/fetch@v1"}, {"uses": "acme/kit/build@v1"}],
        overrides=f"acme/kit@v1=skip:all of it; acme/kit/build=skip:no; "
        f"acme/kit/build@v1={local}; acme/kit/fetch=skip:fetches from github.com",
    )
    assert result.conclusion == "success", lines
    assert "version local build" in lines and "version fetch" not in lines
    notices = [a.message for a in result.annotations if a.level == "notice"]
    assert notices == ["acme/kit/fetch@v1 skipped by an override: fetches from github.com"]
    (only,) = parse_overrides(["acme/kit/a/b@releases/v2=skip"], "--action")
    assert (only.path, only.ref) == ("a/b", "releases/v2")
    assert only.describe() == "acme/kit/a/b@releases/v2=skip"


TOKEN_ACTION = {
    "action.yml": """\
        name: api
        inputs:
          github-token:
            default: ${{ github.token }}
            required: false
          fallback:
            default: ${{ github.server_url == 'https://github.com' && github.token || '' }}
        runs:
          using: node20
          main: main.js
        """,
    "main.js": """\
        const core = require('@actions/core');
        try {
          const token = core.getInput('github-token', {required: true});
          console.log('token=' + token + ' fallback=' + core.getInput('fallback'));
        } catch (err) {
          core.setFailed(err.message);  // as github-script (and the action templates) do
        }
        """,
}


def test_the_jobs_token_is_the_one_given_and_its_absence_is_named(env: Env) -> None:
    """`--secret GITHUB_TOKEN` is `secrets.GITHUB_TOKEN` and `github.token`
    (it was replaced by an empty one), masked; without one, an action that
    requires an input defaulting to it (github-script's `github-token`)
    fails with @actions/core's words and a hint saying how to give one."""
    publish_action(env.remotes, "acme/api", TOKEN_ACTION)
    steps: list[dict[str, Any]] = [
        {"uses": "acme/api@v1"},
        {"run": 'test "${{ github.token }}" = tok-123 && echo "s=${{ secrets.GITHUB_TOKEN }}"'},
    ]
    result, lines = env.run(steps, secrets={"GITHUB_TOKEN": "tok-123"})
    assert result.conclusion == "success", lines
    assert "token=*** fallback=***" in lines and "s=***" in lines
    result, lines = env.run(steps)
    assert result.conclusion == "failure"
    hints = [line for line in lines if "defaults to the job's token" in line]
    assert len(hints) == 1, lines
    assert hints[0].startswith("acme/api@v1: input 'github-token' defaults to the job's token")
    assert "`--secret GITHUB_TOKEN`" in hints[0]


def test_local_action_is_read_when_its_step_runs(env: Env) -> None:
    result, lines = env.run(
        [
            {
                "run": "mkdir -p gen && printf 'runs:\\n  using: node20\\n  main: m.js\\n' "
                "> gen/action.yml && echo \"console.log('generated ran')\" > gen/m.js"
            },
            {"uses": "./gen"},
            {"uses": "./missing", "if": "failure()"},
        ]
    )
    assert result.conclusion == "success", lines
    assert "generated ran" in lines
    assert _steps(result)[-1][1] == "skipped"
    result, lines = env.run([{"uses": "./missing"}, {"run": "echo after", "if": "always()"}])
    assert result.conclusion == "failure"
    assert _steps(result) == [("Run ./missing", "failure"), ("Run echo after", "success")]
    assert any("has no action.yml" in line for line in lines)


def test_newer_runtime_runs_on_the_newest_node_with_one_warning(env: Env) -> None:
    publish_action(
        env.remotes,
        "acme/new",
        {"action.yml": "runs:\n  using: node24\n  main: m.js\n", "m.js": "console.log('ran')\n"},
    )
    result, _lines = env.run([{"uses": "acme/new@v1"}, {"uses": "acme/new@v1"}])
    assert result.conclusion == "success"
    from preloop.actions.node import find_node

    node = find_node()
    warnings = [a.message for a in result.annotations if a.level == "warning"]
    if node.major >= 24:
        assert warnings == []
    else:
        assert len(warnings) == 1
        assert "node24" in warnings[0] and node.version in warnings[0]


def test_bad_uses_and_bad_overrides_are_one_line_errors(tmp_path: Path) -> None:
    from preloop.actions.reference import UsesError
    from preloop.errors import UsageError

    with pytest.raises(UsesError, match="is not an action reference"):
        parse_uses("actions-checkout")
    with pytest.raises(UsageError, match="not an override"):
        parse_overrides(["acme/greet"], "--action")
    with pytest.raises(UsageError, match="is not a directory"):
        parse_overrides([f"acme/greet={tmp_path}/nope"], "--action")
    with pytest.raises(ActionFetchError):
        cache = ActionCache(tmp_path, run_key="r", base_url=f"file://{tmp_path}/none", timeout=30)
        ref = parse_uses("acme/x@v1")
        anyio.run(lambda: cache.fetch(ref, print))  # type: ignore[arg-type]


def test_no_usable_node_fails_the_step_with_one_line(
    env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    publish_action(env.remotes, "acme/ver", _echo_action("one"))
    monkeypatch.setenv("PRELOOP_NODE", str(env.tmp / "no-node"))
    result, lines = env.run([{"uses": "acme/ver@v1"}, {"run": "echo after", "if": "always()"}])
    assert _steps(result) == [("Run acme/ver@v1", "failure"), ("Run echo after", "success")]
    failed = [line for line in lines if "is not a working node" in line]
    assert len(failed) == 1 and failed[0].startswith(
        "✖ Run acme/ver@v1: acme/ver@v1: PRELOOP_NODE="
    )


def test_composite_required_input_missing_is_no_warning_a_deprecated_one_is(env: Env) -> None:
    """As GitHub's runner (ActionRunner): `required:` is not checked (PyGithub's
    mypy job leaves gh-problem-matcher-wrap's required `run` out, with no
    warning on GitHub); a given input with a `deprecationMessage` warns, as
    does one the action does not declare (for a composite too)."""
    result, lines = env.run(
        [{"uses": "./act", "with": {"old": "x", "extra": "y"}}],
        files={
            "act/action.yml": """\
                inputs:
                  who: {required: true}
                  old: {deprecationMessage: use who}
                runs:
                  using: composite
                  steps:
                    - run: echo "who=[${{ inputs.who }}] old=[${{ inputs.old }}]"
                      shell: bash
                """
        },
    )
    assert result.conclusion == "success"
    assert "who=[] old=[x]" in lines
    warnings = [a.message for a in result.annotations if a.level == "warning"]
    assert warnings == [
        "./act: Input 'old' has been deprecated with message: use who",
        "./act: Unexpected input(s) 'extra', valid inputs are ['old', 'who']",
    ]


def test_a_composite_run_after_a_failure_has_a_status_of_its_own(env: Env) -> None:
    # `if: always()` on the step after a failure: the composite's own steps
    # run (success() inside it is of its steps), as on GitHub.
    result, lines = env.run(
        [{"run": "exit 1"}, {"uses": "./cleanup", "if": "always()"}],
        files={
            "cleanup/action.yml": """\
                runs:
                  using: composite
                  steps:
                    - run: echo "inner step ran"
                      shell: bash
                    - run: echo "inner failure() ${{ failure() }}"
                      shell: bash
                """
        },
    )
    assert result.conclusion == "failure"
    assert "inner step ran" in lines and "inner failure() false" in lines, lines


def test_docker_actions_through_a_daemon(
    env: Env, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fake `docker` on PATH records its calls and stands in for the daemon
    and the container: the argv preloop builds (image, args, `runs.env` and
    INPUT_* passed by name, the workspace mount), and outputs written to
    GITHUB_OUTPUT reaching a later step."""
    calls = tmp_path / "docker-calls"
    calls.mkdir()
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "docker").write_text(
        textwrap.dedent(
            f"""\
            #!/bin/sh
            n=$(ls {calls} | grep -c args)
            printf '%s\\n' "$@" > {calls}/$n.args
            case "$1" in
              info) echo 27.0.1 ;;
              build) echo sha256:0123456789ab ;;
              run)
                env > {calls}/$n.env
                echo "container: who=$INPUT_WHO mode=$MODE args=$*"
                echo "said=$INPUT_WHO/$MODE" >> "$GITHUB_OUTPUT" ;;
              *) echo "fake docker: $1?" >&2; exit 1 ;;
            esac
            """
        )
    )
    (bin_dir / "docker").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    monkeypatch.setattr(action_steps, "_docker_checked", {})
    publish_action(
        env.remotes,
        "acme/dock",
        {
            "action.yml": """\
                inputs:
                  who: {default: nobody}
                runs:
                  using: docker
                  image: Dockerfile
                  args: ["--greet", "${{ inputs.who }}"]
                  env:
                    MODE: strict-${{ inputs.who }}
                """,
            "Dockerfile": "FROM alpine:3\n",
        },
        node_modules=False,
    )
    result, lines = env.run(
        [
            {"id": "d", "uses": "acme/dock@v1", "with": {"who": "docker"}},
            {"uses": "docker://alpine:3", "with": {"args": "echo hi", "entrypoint": "sh"}},
            {"run": "echo got=${{ steps.d.outputs.said }}"},
        ]
    )
    assert result.conclusion == "success", lines
    assert "got=docker/strict-docker" in lines
    argv = [
        (calls / f"{i}.args").read_text().splitlines()
        for i in range(len(list(calls.glob("*.args"))))
    ]
    assert [a[0] for a in argv] == ["info", "build", "run", "run"]
    build, run, plain = argv[1], argv[2], argv[3]
    tag = build[build.index("-t") + 1]
    action_dir = Path(build[-1])
    assert tag.startswith("preloop-action-")
    assert build[build.index("-f") + 1] == str(action_dir / "Dockerfile")
    assert action_dir.parent.parent == env.state / "actions" / "repos" / "acme"
    ws = str(env.tmp / f"job{env.runs}" / "ws")
    # docker run --rm -v WS:WS -v TEMP:TEMP -w WS -e NAME... IMAGE ARGS
    assert run[:5] == ["run", "--rm", "-v", f"{ws}:{ws}", "-v"] and run[6:8] == ["-w", ws]
    assert run[-3:] == [tag, "--greet", "docker"]
    passed = {run[i + 1] for i, a in enumerate(run) if a == "-e"}
    assert {"INPUT_WHO", "MODE", "GITHUB_OUTPUT", "GITHUB_ENV", "GITHUB_WORKSPACE", "CI"} <= passed
    assert "PATH" not in passed and "HOME" not in passed
    run_env = dict(
        line.split("=", 1) for line in (calls / "2.env").read_text().splitlines() if "=" in line
    )
    assert run_env["INPUT_WHO"] == "docker" and run_env["MODE"] == "strict-docker"
    assert run_env["GITHUB_ACTION_REPOSITORY"] == "acme/dock"
    assert plain[-5:] == ["--entrypoint", "sh", "alpine:3", "echo", "hi"]


def test_prune_keeps_actions_a_running_job_uses(env: Env, tmp_path: Path) -> None:
    """`preloop actions prune --older-than 0` while a job is between the main
    and the post of a JavaScript action keeps that action (the job's shared
    lock on its directory); once the job has ended, prune removes it."""
    import json
    import threading

    publish_action(env.remotes, "acme/greet", JS_ACTION)
    for name in ("reached", "gate"):
        os.mkfifo(tmp_path / name)
    reached = os.open(tmp_path / "reached", os.O_RDWR)
    gate = os.open(tmp_path / "gate", os.O_RDWR)
    box: dict[str, tuple[JobResult, list[str]]] = {}
    job = threading.Thread(
        target=lambda: box.setdefault(
            "done",
            env.run(
                [
                    {"uses": "acme/greet@v1", "with": {"who": "pruned"}},
                    {"run": f"echo in-job > {tmp_path}/reached; read _ < {tmp_path}/gate"},
                ]
            ),
        )
    )

    def prune() -> dict[str, Any]:
        cli = [sys.executable, "-m", "preloop", "actions", "prune", "--older-than", "0", "--json"]
        penv = {**os.environ, "PRELOOP_STATE_DIR": str(env.state)}
        r = subprocess.run(cli, env=penv, capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        out: dict[str, Any] = json.loads(r.stdout)
        return out

    job.start()
    try:
        _fifo_line(reached, "the job's second step")
        kept = prune()
        assert kept["removed"] == [] and [e["repository"] for e in kept["busy"]] == ["acme/greet"]
        cached = list((env.state / "actions" / "repos" / "acme" / "greet").iterdir())
        assert len(cached) == 1 and (cached[0] / "post.js").is_file()
    finally:
        os.write(gate, b"go\n")
        job.join(timeout=300)
        os.close(reached)
        os.close(gate)
    result, lines = box["done"]
    assert result.conclusion == "success", lines
    assert "post: P-pruned M-pruned" in lines  # the post step ran from the kept directory
    gone = prune()
    assert [e["repository"] for e in gone["removed"]] == ["acme/greet"] and gone["busy"] == []
    assert list((env.state / "actions" / "repos" / "acme" / "greet").iterdir()) == []
