"""Actions through the engine and the scheduler (lite and PostgreSQL), and the
`preloop run --action` / `preloop actions` / `preloop cache status` commands."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from tests.actions_support import JS_ACTION, git_calls, git_wrapper, publish_action
from tests.run_support import make_repo, results, run_engine, workflow

from preloop.actions.reference import parse_overrides
from preloop.workflow import WorkflowError

pytest_plugins = ["preloop.testing.control_fixtures"]

PRELOOP = [sys.executable, "-m", "preloop"]

WORKFLOW = """\
    on: push
    jobs:
      greet:
        runs-on: ubuntu-latest
        outputs:
          message: ${{ steps.g.outputs.message }}
        steps:
          - uses: actions/checkout@v4
          - id: g
            uses: acme/greet@v1
            with:
              who: jobs
          - uses: acme/setup-thing@v3
      use:
        needs: greet
        runs-on: ubuntu-latest
        steps:
          - run: echo "got=${{ needs.greet.outputs.message }}"
    """


def test_action_outputs_reach_later_jobs_and_a_skip_override(
    tmp_path: Path, store_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    remotes = tmp_path / "remotes"
    publish_action(remotes, "acme/greet", JS_ACTION)
    monkeypatch.setenv("PRELOOP_ACTIONS_URL", f"file://{remotes}")
    monkeypatch.delenv("PRELOOP_ACTION_OVERRIDES", raising=False)
    repo = make_repo(tmp_path / "repo", workflow(WORKFLOW))
    outcome, h = run_engine(
        repo,
        store_url,
        tmp_path / "state",
        action_overrides=parse_overrides(["acme/setup-thing=skip:host has it"], "--action"),
    )
    assert results(outcome) == {"greet": "success", "use": "success"}, h.all_text()
    assert "got=Hello jobs" in h.lines["use"]
    assert "post: P-jobs M-jobs" in h.lines["greet"]
    greet = next(j for j in outcome.jobs if j.id == "greet")
    assert any("skipped by an override: host has it" in str(a) for a in greet.annotations)


def _env(state: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PRELOOP_")}
    env.update(PRELOOP_STATE_DIR=str(state), **extra)
    return env


def test_run_action_option_actions_list_prune_and_cache_status(tmp_path: Path) -> None:
    remotes = tmp_path / "remotes"
    commit = publish_action(remotes, "acme/greet", JS_ACTION)
    repo = make_repo(tmp_path / "repo", workflow(WORKFLOW))
    state = tmp_path / "state"
    env = _env(state, PRELOOP_ACTIONS_URL=f"file://{remotes}")

    def preloop(*args: str, cwd: Path = repo) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [*PRELOOP, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300
        )

    r = preloop("run", "-j", "1", "--action", "acme/setup-thing=skip:host has it")
    assert r.returncode == 0, (r.stdout, r.stderr)
    assert "acme/setup-thing@v3 skipped by an override: host has it" in r.stdout
    # Without the override the unfetchable action fails its step, naming what to do.
    r = preloop("run", "-j", "1")
    assert r.returncode == 1
    assert "use --action acme/setup-thing=DIR (or =skip) for offline work" in r.stdout
    r = preloop("run", "--action", "acme/greet")
    assert r.returncode == 2 and r.stderr.startswith("preloop: error: --action: 'acme/greet'")
    env["PRELOOP_ACTIONS_URL"] = "github.com"
    r = preloop("run")
    assert r.returncode == 2 and r.stderr.startswith("preloop: error: PRELOOP_ACTIONS_URL: ")
    env["PRELOOP_ACTIONS_URL"] = f"file://{remotes}"

    listed = json.loads(preloop("actions", "list", "--json").stdout)
    assert [(e["repository"], e["commit"], e["refs"]) for e in listed["entries"]] == [
        ("acme/greet", commit, ["v1"])
    ]
    status = json.loads(preloop("cache", "status", "--json").stdout)
    assert status["actions"]["entries"] == 1 and status["actions"]["total_bytes"] > 0
    assert "acme/greet" in preloop("actions", "list").stdout
    kept = json.loads(preloop("actions", "prune", "--json").stdout)
    assert kept["removed"] == []  # used just now
    dry = json.loads(preloop("actions", "prune", "--older-than", "0", "--dry-run", "--json").stdout)
    assert [e["commit"] for e in dry["removed"]] == [commit]
    assert json.loads(preloop("actions", "list", "--json").stdout)["entries"]
    gone = json.loads(preloop("actions", "prune", "--older-than", "0", "--json").stdout)
    assert [e["commit"] for e in gone["removed"]] == [commit]
    assert json.loads(preloop("actions", "list", "--json").stdout)["entries"] == []
    r = preloop("actions", "prune", "--older-than", "soon")
    assert r.returncode == 2 and "--older-than" in r.stderr


REUSABLE = {
    ".github/workflows/build.yml": """\
        on:
          workflow_call:
            inputs:
              name: {type: string, required: true}
            outputs:
              said:
                value: ${{ jobs.inner.outputs.said }}
        jobs:
          inner:
            uses: $/.github/workflows/inner.yml
            with:
              name: ${{ inputs.name }}
        """,
    ".github/workflows/inner.yml": """\
        on:
          workflow_call:
            inputs:
              name: {type: string, required: true}
            outputs:
              said:
                value: ${{ jobs.say.outputs.said }}
        jobs:
          say:
            runs-on: ubuntu-latest
            outputs:
              said: ${{ steps.s.outputs.said }}
            steps:
              - id: s
                run: echo "said=remote-${{ inputs.name }}" >> "$GITHUB_OUTPUT"
        """,
}


def test_remote_reusable_workflow_and_its_own_repository(
    tmp_path: Path, store_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    remotes = tmp_path / "remotes"
    publish_action(remotes, "acme/flows", REUSABLE, node_modules=False)
    state = tmp_path / "state"
    monkeypatch.setenv("PRELOOP_ACTIONS_URL", f"file://{remotes}")
    # The run's own state directory holds the fetched workflows, not this one.
    monkeypatch.setenv("PRELOOP_STATE_DIR", str(tmp_path / "elsewhere"))
    repo = make_repo(
        tmp_path / "repo",
        {
            **workflow(
                """\
                on: push
                jobs:
                  call:
                    uses: acme/flows/.github/workflows/build.yml@v1
                    with:
                      name: x
                  mine:
                    uses: $/.github/workflows/local.yml
                  after:
                    needs: [call, mine]
                    runs-on: ubuntu-latest
                    steps:
                      - run: echo "got=${{ needs.call.outputs.said }}"
                """
            ),
            ".github/workflows/local.yml": (
                "on: workflow_call\njobs:\n  l:\n    runs-on: ubuntu-latest\n"
                "    steps:\n      - run: echo local-ran\n"
            ),
        },
    )
    outcome, h = run_engine(repo, store_url, state)
    assert outcome.conclusion == "success", h.all_text()
    assert "got=remote-x" in h.lines["after"]
    assert any("local-ran" in lines for lines in h.lines.values())
    assert (state / "actions" / "repos" / "acme" / "flows").is_dir()
    assert not (tmp_path / "elsewhere").exists()


def test_remote_reusable_workflow_checks_and_failures(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from preloop.workflow import WorkflowError, load_workflow

    remotes = tmp_path / "remotes"
    publish_action(remotes, "acme/flows", REUSABLE, node_modules=False)
    monkeypatch.setenv("PRELOOP_ACTIONS_URL", f"file://{remotes}")
    monkeypatch.setenv("PRELOOP_STATE_DIR", str(tmp_path / "state"))
    files = workflow(
        """\
        on: push
        jobs:
          call:
            uses: acme/flows/.github/workflows/build.yml@v1
            with:
              nme: x
          gone:
            uses: acme/nothing/.github/workflows/x.yml@v1
          gone-too:
            uses: acme/nothing/.github/workflows/x.yml@v1
        """
    )
    repo = make_repo(tmp_path / "repo", files)
    log = tmp_path / "git.log"
    monkeypatch.setenv("PATH", f"{git_wrapper(tmp_path / 'bin', log)}:{os.environ['PATH']}")
    with pytest.raises(WorkflowError) as info:
        load_workflow(repo / ".github" / "workflows" / "ci.yml")
    messages = [d.message for d in info.value.diagnostics]
    # Both callers are told; the remote was asked once (a failure is memoised too).
    gone = [m for m in messages if m.startswith("reusable workflow 'acme/nothing/")]
    assert len(gone) == 2 and gone[0] == gone[1], messages
    assert len(git_calls(log, "clone", "acme/nothing")) == 1
    assert any("input 'nme' is not declared by" in m for m in messages), messages
    assert any("requires input 'name'" in m for m in messages), messages
    assert any(
        m.startswith("reusable workflow 'acme/nothing/.github/workflows/x.yml@v1': action")
        and "offline work" in m
        for m in messages
    ), messages


def _local_flows(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, *, by_env: bool) -> Path:
    """REUSABLE as a local directory standing in for `acme/flows`, with
    nothing to fetch it from (the actions base is offline); `by_env` gives it
    as `PRELOOP_ACTION_OVERRIDES`, else a test passes `--action` itself."""
    local = tmp_path / "flows"
    for rel, text in REUSABLE.items():
        (local / rel).parent.mkdir(parents=True, exist_ok=True)
        (local / rel).write_text(text)
    monkeypatch.setenv("PRELOOP_ACTIONS_URL", f"file://{tmp_path}/offline")
    monkeypatch.setenv("PRELOOP_STATE_DIR", str(tmp_path / "state"))
    if by_env:
        monkeypatch.setenv("PRELOOP_ACTION_OVERRIDES", f"acme/flows={local}")
    else:
        monkeypatch.delenv("PRELOOP_ACTION_OVERRIDES", raising=False)
    return local


CALL_FLOWS = """\
    on: push
    jobs:
      call:
        uses: acme/flows/.github/workflows/build.yml@v1
        with:
          name: x
    """


def test_remote_reusable_workflow_from_an_override(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from preloop.workflow import load_workflow

    _local_flows(tmp_path, monkeypatch, by_env=True)
    repo = make_repo(tmp_path / "repo", workflow(CALL_FLOWS))
    wf = load_workflow(repo / ".github" / "workflows" / "ci.yml")
    inner = next(j for j in wf.jobs if j.id == "call").callee
    assert inner is not None  # and $/ inside it, from the same directory:
    assert next(j for j in inner.jobs if j.id == "inner").callee is not None


def test_action_option_overrides_a_remote_reusable_workflow(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    local = _local_flows(tmp_path, monkeypatch, by_env=False)
    files = workflow(
        """\
        on: push
        jobs:
          call:
            uses: acme/flows/.github/workflows/build.yml@v1
            with:
              name: dev
          after:
            needs: call
            runs-on: ubuntu-latest
            steps:
              - run: echo "got=${{ needs.call.outputs.said }}"
        """
    )
    repo = make_repo(tmp_path / "repo", files)
    outcome, h = run_engine(
        repo,
        f"sqlite:///{tmp_path}/store.db",
        tmp_path / "state",
        action_overrides=parse_overrides([f"acme/flows={local}"], "--action"),
    )
    assert outcome.conclusion == "success", h.all_text()
    assert "got=remote-dev" in h.lines["after"]


def test_plan_and_list_take_action_overrides_as_run_does(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`preloop plan` and `preloop list` read remote reusable workflows too:
    the error for one that cannot be fetched says to use `--action`, so they
    take it (yarl's tox-dev/workflow offline), as `preloop run` does."""
    local = _local_flows(tmp_path, monkeypatch, by_env=False)
    repo = make_repo(tmp_path / "repo", workflow(CALL_FLOWS))
    for command in ("plan", "list"):
        cli = [sys.executable, "-m", "preloop", command]
        offline = subprocess.run(cli, cwd=repo, capture_output=True, text=True, check=False)
        assert offline.returncode != 0 and "--action acme/flows=DIR" in offline.stderr
        given = subprocess.run(
            [*cli, "--action", f"acme/flows={local}"],
            cwd=repo,
            capture_output=True,
            text=True,
            check=False,
        )
        assert given.returncode == 0, given.stderr
        assert "call / inner / say" in given.stdout, given.stdout


def test_a_remote_reusable_workflow_skipped_by_an_override_ends_skipped(
    tmp_path: Path, store_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`--action acme/flows=skip:offline` on a reusable workflow nobody can
    fetch (it was refused: "cannot be skipped"): its caller ends skipped
    with the reason, its dependents see `skipped` and empty outputs, and
    the rest of the run goes on."""
    monkeypatch.setenv("PRELOOP_ACTIONS_URL", f"file://{tmp_path}/offline")
    monkeypatch.delenv("PRELOOP_ACTION_OVERRIDES", raising=False)
    files = workflow(
        """\
        on: push
        jobs:
          call:
            uses: acme/flows/.github/workflows/build.yml@v1
            with:
              name: dev
          test:
            runs-on: ubuntu-latest
            steps: [{run: echo tested}]
          after:
            needs: call
            if: always()
            runs-on: ubuntu-latest
            steps:
              - run: echo "result=${{ needs.call.result }} got=${{ needs.call.outputs.said }}."
        """
    )
    repo = make_repo(tmp_path / "repo", files)
    outcome, h = run_engine(
        repo,
        store_url,
        tmp_path / "state",
        action_overrides=parse_overrides(["acme/flows=skip:offline"], "--action"),
    )
    assert outcome.conclusion == "success", h.all_text()
    assert {j.id: j.conclusion for j in outcome.jobs} == {
        "call": "skipped",
        "test": "success",
        "after": "success",
    }
    call = next(j for j in outcome.jobs if j.id == "call")
    reason = "acme/flows/.github/workflows/build.yml@v1 skipped by an override: offline"
    assert call.reason == reason
    assert "result=skipped got=." in h.lines["after"]


def test_a_job_asked_for_runs_without_fetching_what_other_jobs_call(
    tmp_path: Path, store_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`--job test` (and what it needs) runs offline: a remote reusable
    workflow only another job calls is not fetched; one a needed job calls
    still is (and fails in one line here, offline)."""
    monkeypatch.setenv("PRELOOP_ACTIONS_URL", f"file://{tmp_path}/offline")
    monkeypatch.delenv("PRELOOP_ACTION_OVERRIDES", raising=False)
    files = workflow(
        """\
        on: push
        jobs:
          call:
            uses: acme/flows/.github/workflows/build.yml@v1
          local:
            uses: ./.github/workflows/local.yml
          build:
            runs-on: ubuntu-latest
            steps: [{run: echo built}]
          test:
            needs: [build]
            runs-on: ubuntu-latest
            steps: [{run: echo tested}]
          publish:
            needs: [call, test]
            runs-on: ubuntu-latest
            steps: [{run: echo published}]
        """
    )
    # A local callee calling a remote one in turn (review: it was still fetched).
    files[".github/workflows/local.yml"] = (
        "on: workflow_call\njobs:\n  inner:\n    uses: acme/flows/.github/workflows/build.yml@v1\n"
    )
    repo = make_repo(tmp_path / "repo", files)
    outcome, h = run_engine(repo, store_url, tmp_path / "state", job="test")
    assert outcome.conclusion == "success", h.all_text()
    assert {j.id: j.conclusion for j in outcome.jobs} == {"build": "success", "test": "success"}
    with pytest.raises(WorkflowError, match=r"reusable workflow 'acme/flows/\.github"):
        run_engine(repo, store_url, tmp_path / "state", job="publish")


def test_remote_reusable_workflow_resolves_once_per_run(
    tmp_path: Path, store_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two jobs call one remote workflow@tag, and the tag moves right after the
    first fetch: one resolution, both callers on the first commit; the next
    run re-resolves (one `ls-remote`)."""
    import shutil

    remotes = tmp_path / "remotes"
    publish_action(remotes, "acme/flows", REUSABLE, node_modules=False)
    inner = REUSABLE[".github/workflows/inner.yml"].replace("remote-", "moved-")
    moved = publish_action(
        remotes,
        "acme/flows",
        {".github/workflows/inner.yml": inner},
        tags=(),
        node_modules=False,
    )
    log, move_tag = tmp_path / "git.log", tmp_path / "move-tag"
    move_tag.write_text(
        f"{shutil.which('git')} --git-dir={remotes}/acme/flows.git "
        f"update-ref refs/tags/v1 {moved}\n"
    )
    bin_dir = git_wrapper(tmp_path / "bin", log, after_clone=move_tag)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    monkeypatch.setenv("PRELOOP_ACTIONS_URL", f"file://{remotes}")
    monkeypatch.delenv("PRELOOP_ACTION_OVERRIDES", raising=False)
    repo = make_repo(
        tmp_path / "repo",
        workflow(
            """\
            on: push
            jobs:
              a:
                uses: acme/flows/.github/workflows/build.yml@v1
                with:
                  name: a
              b:
                uses: acme/flows/.github/workflows/build.yml@v1
                with:
                  name: b
              after:
                needs: [a, b]
                runs-on: ubuntu-latest
                steps:
                  - run: echo "got=${{ needs.a.outputs.said }},${{ needs.b.outputs.said }}"
            """
        ),
    )
    state = tmp_path / "state"
    outcome, h = run_engine(repo, store_url, state)
    assert outcome.conclusion == "success", h.all_text()
    assert Path(f"{move_tag}.ran").exists()  # the tag did move after the first fetch
    assert "got=remote-a,remote-b" in h.lines["after"]
    # Resolved once: by the clone that fetched it (a ref never fetched before).
    assert git_calls(log, "ls-remote", "acme/flows") == []
    assert len(git_calls(log, "clone", "acme/flows")) == 1
    outcome, h = run_engine(repo, store_url, state)
    assert outcome.conclusion == "success", h.all_text()
    assert "got=moved-a,moved-b" in h.lines["after"]
    # The next run checks the cached resolution once and fetches the moved tag.
    assert len(git_calls(log, "ls-remote", "acme/flows")) == 1
    assert len(git_calls(log, "clone", "acme/flows")) == 2


def _composite(directory: Path, says: str) -> Path:
    directory.mkdir(parents=True)
    (directory / "action.yml").write_text(
        f"runs:\n  using: composite\n  steps:\n    - run: echo {says}\n      shell: bash\n"
    )
    return directory


def test_action_overrides_by_environment_and_by_ref(tmp_path: Path) -> None:
    """`PRELOOP_ACTION_OVERRIDES` for step actions; `--action owner/repo@ref=DIR`
    wins over `owner/repo=DIR` whatever their order, and `--action` over the
    environment; nothing is fetched."""
    repo = make_repo(
        tmp_path / "repo",
        workflow(
            """\
            on: push
            jobs:
              j:
                runs-on: ubuntu-latest
                steps:
                  - uses: acme/greet@v1
                  - uses: acme/greet@v2
                  - uses: acme/tool@v3
                  - uses: acme/tool/sub@v3
            """
        ),
    )
    plain = _composite(tmp_path / "plain", "plain-greet")
    pinned = _composite(tmp_path / "pinned", "pinned-greet-v2")
    from_env = _composite(tmp_path / "env-greet", "env-greet-v2")
    tool = _composite(tmp_path / "tool", "env-tool")
    _composite(tool / "sub", "env-tool-sub")
    state = tmp_path / "state"
    env = _env(
        state,
        PRELOOP_ACTIONS_URL=f"file://{tmp_path}/offline",
        PRELOOP_ACTION_OVERRIDES=f"acme/tool={tool}; acme/greet@v2={from_env}",
    )
    r = subprocess.run(
        [
            *PRELOOP,
            "run",
            "--action",
            f"acme/greet={plain}",
            "--action",
            f"acme/greet@v2={pinned}",
        ],
        cwd=repo,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, (r.stdout, r.stderr)
    said = [
        line.split()[-1]
        for line in r.stdout.splitlines()
        if line.split()[-1:]
        and line.split()[-1].startswith(("plain-", "pinned-", "env-"))
        and "Run echo" not in line
    ]
    assert said == ["plain-greet", "pinned-greet-v2", "env-tool", "env-tool-sub"], r.stdout
    assert not (state / "actions" / "repos").exists()


def test_a_local_action_symlinked_out_of_the_workspace_fails_its_step(
    tmp_path: Path, store_url: str
) -> None:
    """The loader sees `./link` inside the repository; a step then makes it a
    symlink to a directory outside the workspace. The `uses: ./link` step
    fails with one line and the outside action never runs."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "action.yml").write_text(
        "name: escape\nruns:\n  using: composite\n  steps:\n"
        "    - run: echo escaped-the-workspace\n      shell: bash\n"
    )
    repo = make_repo(
        tmp_path / "repo",
        workflow(
            f"""\
            on: push
            jobs:
              j:
                runs-on: ubuntu-latest
                steps:
                  - run: ln -s {outside} link
                  - uses: ./link
                  - if: always()
                    run: echo after
            """
        ),
    )
    outcome, h = run_engine(repo, store_url, tmp_path / "state")
    assert results(outcome) == {"j": "failure"}, h.all_text()
    text = h.all_text()
    assert "escaped-the-workspace" not in text
    failed = [line for line in h.lines["j"] if "'./link' points outside the job's dir" in line]
    assert len(failed) == 1 and "\n" not in failed[0], text
    assert "after" in h.lines["j"], text


def test_a_local_action_beside_the_workspace_runs(tmp_path: Path, store_url: str) -> None:
    """github/codeql-action's own workflows (.github/workflows/__rust.yml and
    others): a step moves the checkout to `../action`, later steps run
    `uses: ./../action/init`. GitHub's runner joins the path to the workspace;
    so do we, within the job's directory."""
    repo = make_repo(
        tmp_path / "repo",
        workflow(
            """            on: push
            jobs:
              j:
                runs-on: ubuntu-latest
                steps:
                  - run: |
                      mkdir -p ../action/init
                      cd ../action/init
                      echo 'runs: {using: composite, steps: [{run: echo init-beside,' > action.yml
                      echo '  shell: bash}]}' >> action.yml
                  - uses: ./../action/init
            """
        ),
    )
    outcome, h = run_engine(repo, store_url, tmp_path / "state")
    assert results(outcome) == {"j": "success"}, h.all_text()
    assert "init-beside" in h.lines["j"], h.all_text()
