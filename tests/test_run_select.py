"""`preloop run` runs what GitHub would: filters, every triggered workflow,
inputs, payloads, job/leg selection and other platforms; lite and PostgreSQL."""

from __future__ import annotations

import json
import os
import platform
import re
import subprocess
import sys
from pathlib import Path

import anyio
import pytest
from tests.run_support import Harness, git, make_repo

from preloop.engine import Engine, NothingTriggered, RunRequest, RunsOutcome
from preloop.errors import UsageError
from preloop.workflow import WorkflowError
from preloop.workflow.event_inputs import split_pairs
from preloop.workflow.selection import matrix_filter

pytest_plugins = ["preloop.testing.control_fixtures"]

WF = ".github/workflows/"


def run_all(repo: Path, store_url: str, state: Path, **kw: object) -> tuple[RunsOutcome, Harness]:
    h = Harness()
    request = RunRequest(
        workspace=repo, store_url=store_url, state_dir=state, local_runners=2, **kw
    )  # type: ignore[arg-type]
    return anyio.run(Engine(request, h.events()).run_all), h


def by_workflow(out: RunsOutcome) -> dict[str, dict[str, str | None]]:
    return {Path(r.workflow).name: {j.id: j.conclusion for j in r.jobs} for r in out.runs}


def job(name: str, run: str = "echo ok", runs_on: str = "ubuntu-latest") -> str:
    return f"  {name}:\n    runs-on: {runs_on}\n    steps:\n      - run: {run}\n"


def test_every_triggered_workflow_runs_and_filtered_ones_never(
    tmp_path: Path, store_url: str
) -> None:
    repo = make_repo(
        tmp_path / "repo",
        {
            WF + "ci.yml": "name: CI\non: push\njobs:\n" + job("test"),
            WF + "lint.yml": "name: Lint\non:\n  push:\n    branches: [main]\njobs:\n"
            + job("lint", "exit 1"),
            WF + "release.yml": "on:\n  push:\n    tags: ['v*']\njobs:\n" + job("publish"),
            WF + "docs.yml": "on:\n  push:\n    paths: ['docs/**']\njobs:\n" + job("docs"),
        },
    )
    out, h = run_all(repo, store_url, tmp_path / "state")
    assert by_workflow(out) == {"ci.yml": {"test": "success"}, "lint.yml": {"lint": "failure"}}
    assert not out.ok and out.conclusion == "failure"
    assert len({r.run_id for r in out.runs}) == 2
    skipped = {s.path: s.reason for s in out.skipped}
    assert skipped[WF + "release.yml"] == "branch 'main': on.push filters tags only"
    assert skipped[WF + "docs.yml"].startswith("none of the 4 changed paths matches on.push.paths")
    assert "publish" not in h.started and "docs" not in h.started

    # A tag push: only the release workflow (ci too: no filter) runs.
    git(repo, "tag", "v1.0")
    out, _ = run_all(repo, store_url, tmp_path / "state", ref="refs/tags/v1.0", jobs=("publish",))
    assert by_workflow(out) == {"release.yml": {"publish": "success"}}
    assert out.ok

    # A job of a workflow the event does not trigger: the error says why not.
    with pytest.raises(UsageError, match=r"no job 'docs'.*not triggered: .*docs.yml: none of"):
        run_all(repo, store_url, tmp_path / "state", jobs=("docs",))


def test_an_event_that_triggers_nothing_says_so(tmp_path: Path, store_url: str) -> None:
    repo = make_repo(tmp_path / "repo", {WF + "ci.yml": "on: pull_request\njobs:\n" + job("a")})
    with pytest.raises(NothingTriggered, match=r"'push' on refs/heads/main triggers no workflow"):
        run_all(repo, store_url, tmp_path / "state")
    with pytest.raises(UsageError, match="did you mean 'pull_request'"):
        run_all(repo, store_url, tmp_path / "state", event="pull_requests")
    out, _ = run_all(repo, store_url, tmp_path / "state", event="pull_request")
    assert out.ok


def test_pull_request_activity_types_filter_with_the_default_payload(
    tmp_path: Path, store_url: str
) -> None:
    """The default pull_request payload is a push to the PR's branch
    (`synchronize`), so `types: [closed]` does not run, as on GitHub; a
    payload with another activity chooses it."""
    repo = make_repo(
        tmp_path / "repo",
        {
            WF + "sync.yml": "on:\n  pull_request:\n    types: [opened, synchronize]\njobs:\n"
            + job("sync"),
            WF + "closed.yml": "on:\n  pull_request:\n    types: [closed]\njobs:\n" + job("closed"),
        },
    )
    out, h = run_all(repo, store_url, tmp_path / "state", event="pull_request")
    assert by_workflow(out) == {"sync.yml": {"sync": "success"}}
    skipped = {s.path: s.reason for s in out.skipped}
    assert skipped[WF + "closed.yml"].startswith(
        "activity 'synchronize' is not in on.pull_request.types ('closed')"
    )
    assert "--eventpath" in skipped[WF + "closed.yml"]
    payload = tmp_path / "closed.json"
    payload.write_text(json.dumps({"action": "closed"}))
    out, h = run_all(repo, store_url, tmp_path / "state", event="pull_request", event_path=payload)
    assert by_workflow(out) == {"closed.yml": {"closed": "success"}}
    assert "sync" not in h.started


DISPATCH = """\
on:
  workflow_dispatch:
    inputs:
      env:
        type: choice
        options: [dev, prod]
        required: true
      dry:
        type: boolean
        default: true
      count:
        type: number
        default: 2
jobs:
  show:
    runs-on: ubuntu-latest
    steps:
      - run: |
          echo "env=${{ inputs.env }} dry=${{ inputs.dry }} count=${{ inputs.count }}"
          echo "event=${{ github.event.inputs.env }} ref=${{ github.ref }}"
          echo "event dry=${{ github.event.inputs.dry }} count=${{ github.event.inputs.count }}"
"""


def test_dispatch_inputs_are_typed_and_checked(tmp_path: Path, store_url: str) -> None:
    repo = make_repo(tmp_path / "repo", {WF + "d.yml": DISPATCH})
    state = tmp_path / "state"
    bad = [
        ({}, "input 'env' is required: pass --input env=VALUE (one of: dev, prod)"),
        ({"env": "qa"}, "input 'env': 'qa' is not one of its options (dev, prod)"),
        ({"env": "dev", "dry": "maybe"}, "input 'dry' is a boolean: 'maybe' is not true/false"),
        ({"env": "dev", "count": "two"}, "input 'count' is a number: 'two' is not a number"),
        ({"env": "dev", "colour": "x"}, "--input colour: no such input"),
    ]
    for inputs, message in bad:
        with pytest.raises(UsageError, match=message.replace("(", r"\(").replace(")", r"\)")):
            run_all(repo, store_url, state, event="workflow_dispatch", inputs=inputs)
    assert not (state / "snapshots").exists() or not any((state / "snapshots").iterdir())
    out, h = run_all(
        repo, store_url, state, event="workflow_dispatch", inputs={"env": "prod", "dry": "False"}
    )
    assert out.ok
    assert "env=prod dry=false count=2" in h.lines["show"]
    assert "event=prod ref=refs/heads/main" in h.lines["show"]
    # github.event.inputs: the checked inputs, defaults applied, as strings.
    assert "event dry=false count=2" in h.lines["show"]


def test_eventpath_and_default_payload(tmp_path: Path, store_url: str) -> None:
    repo = make_repo(
        tmp_path / "repo",
        {
            WF + "e.yml": "on: [push, pull_request]\njobs:\n  show:\n    runs-on: ubuntu-latest\n"
            "    steps:\n      - run: |\n"
            '          echo "head=${{ github.event.head_commit.message }}"\n'
            '          echo "after=${{ github.event.after }} sha=${{ github.sha }}"\n'
            '          echo "pr=${{ github.event.pull_request.title }}"\n'
            '          echo "repo=${{ github.event.repository.name }}"\n'
            '          echo "default=${{ github.event.repository.default_branch }}"\n'
            '          echo "labels=${{ github.event.pull_request.head.label }} '
            '${{ github.event.pull_request.base.label }}"\n'
            '          echo "head=${{ github.head_ref }} base=${{ github.base_ref }}"\n'
        },
    )
    head = git(repo, "rev-parse", "HEAD").strip()
    # origin's default branch is not the pushed one (dorny/paths-filter
    # compares a push with it).
    git(repo, "update-ref", "refs/remotes/origin/trunk", head)
    git(repo, "symbolic-ref", "refs/remotes/origin/HEAD", "refs/remotes/origin/trunk")
    out, h = run_all(repo, store_url, tmp_path / "state")
    assert out.ok
    assert "head=init" in h.lines["show"] and f"after={head} sha={head}" in h.lines["show"]
    assert "repo=repo" in h.lines["show"]
    assert "default=trunk" in h.lines["show"]
    # With changes in the work tree, what is pushed is their snapshot.
    (repo / "new.txt").write_text("changed\n")
    out, h = run_all(repo, store_url, tmp_path / "state")
    after = next(line for line in h.lines["show"] if line.startswith("after="))
    assert after.split()[0].removeprefix("after=") == after.split()[1].removeprefix("sha=")
    assert head not in after
    (repo / "new.txt").unlink()
    out, h = run_all(repo, store_url, tmp_path / "state", event="pull_request")
    assert out.ok and "pr=init" in h.lines["show"]  # the default payload's title
    assert "head=main base=trunk" in h.lines["show"]  # a pull request into the default branch
    assert "labels=local:main local:trunk" in h.lines["show"]
    payload = tmp_path / "event.json"
    payload.write_text(json.dumps({"pull_request": {"title": "Add a feature"}, "action": "opened"}))
    out, h = run_all(repo, store_url, tmp_path / "state", event="pull_request", event_path=payload)
    assert out.ok and "pr=Add a feature" in h.lines["show"]
    payload.write_text("[1, 2]")
    with pytest.raises(UsageError, match="must be a JSON object"):
        run_all(repo, store_url, tmp_path / "state", event_path=payload)


MATRIX = """\
on: push
jobs:
  build:
    runs-on: ubuntu-latest
    steps: [{run: echo build}]
  test:
    needs: build
    strategy:
      matrix:
        python: ['3.11', '3.12', '3.13']
        os: [linux, bsd]
    runs-on: ubuntu-latest
    steps:
      - run: echo "leg ${{ matrix.python }} ${{ matrix.os }}"
  lint:
    runs-on: ubuntu-latest
    steps: [{run: echo lint}]
  other:
    runs-on: ubuntu-latest
    steps: [{run: echo other}]
"""


def test_matrix_legs_and_repeated_jobs(tmp_path: Path, store_url: str) -> None:
    repo = make_repo(tmp_path / "repo", {WF + "m.yml": MATRIX})
    out, _h = run_all(
        repo,
        store_url,
        tmp_path / "state",
        jobs=("test", "lint"),
        matrix={"python": "3.12", "os": "bsd"},
    )
    assert out.ok
    names = sorted(j.name for j in out.runs[0].jobs)
    assert names == ["build", "lint", "test (3.12, bsd)"]
    with pytest.raises(UsageError, match=r"no leg of job 'test' has python=2.7"):
        run_all(repo, store_url, tmp_path / "state", matrix={"python": "2.7"})
    with pytest.raises(UsageError, match="--matrix arch: no matrix job"):
        run_all(repo, store_url, tmp_path / "state", matrix={"arch": "x"})
    with pytest.raises(UsageError, match=r"no job 'nope'.*jobs: build, lint, other, test"):
        run_all(repo, store_url, tmp_path / "state", jobs=("nope",))


def test_a_matrix_key_given_twice_takes_either_value(tmp_path: Path, store_url: str) -> None:
    """`--matrix python=3.11 --matrix python=3.13` runs both legs (it kept
    only the last one, silently); no leg with any of them is an error."""
    repo = make_repo(tmp_path / "repo", {WF + "m.yml": MATRIX})
    wanted = matrix_filter(
        split_pairs("--matrix", ["python=3.11", "os=bsd", "python=3.13", "python=3.11"])
    )
    assert wanted == {"python": ("3.11", "3.13"), "os": ("bsd",)}
    out, _h = run_all(repo, store_url, tmp_path / "state", jobs=("test",), matrix=wanted)
    assert out.ok
    names = sorted(j.name for j in out.runs[0].jobs)
    assert names == ["build", "test (3.11, bsd)", "test (3.13, bsd)"]
    with pytest.raises(UsageError, match=r"no leg of job 'test' has python=2.7 or 3.1 \("):
        run_all(repo, store_url, tmp_path / "state", matrix={"python": ("2.7", "3.1")})


COMPUTED = """\
on: push
jobs:
  setup:
    runs-on: ubuntu-latest
    outputs:
      matrix: ${{ steps.m.outputs.matrix }}
    steps:
      - id: m
        run: echo 'matrix={"os":["bsd","linux","hurd"],"py":["3"]}' >> "$GITHUB_OUTPUT"
  test:
    needs: setup
    strategy:
      matrix: ${{ fromJSON(needs.setup.outputs.matrix) }}
    runs-on: ubuntu-latest
    steps:
      - run: echo "ran ${{ matrix.os }}"
"""


def test_matrix_selection_applies_to_a_matrix_computed_at_run_time(
    tmp_path: Path, store_url: str
) -> None:
    repo = make_repo(tmp_path / "repo", {WF + "c.yml": COMPUTED})
    out, h = run_all(repo, store_url, tmp_path / "state", matrix={"os": "linux"})
    assert out.ok
    jobs = {j.name: j for j in out.runs[0].jobs}
    assert jobs["test (linux, 3)"].conclusion == "success"
    for other in ("bsd", "hurd"):
        leg = jobs[f"test ({other}, 3)"]
        assert leg.conclusion == "skipped"
        assert leg.reason == f"not selected by --matrix os=linux (this leg has os={other})"
    assert "ran linux" in h.all_text()
    assert "ran bsd" not in h.all_text() and "ran hurd" not in h.all_text()
    out, h = run_all(repo, store_url, tmp_path / "state2", matrix={"os": ("linux", "hurd")})
    jobs = {j.name: j for j in out.runs[0].jobs}
    assert [jobs[f"test ({os}, 3)"].conclusion for os in ("linux", "hurd", "bsd")] == [
        "success",
        "success",
        "skipped",
    ]
    assert jobs["test (bsd, 3)"].reason == (
        "not selected by --matrix os=linux --matrix os=hurd (this leg has os=bsd)"
    )


OBJECT_LEGS = """\
on: push
jobs:
  linux:
    strategy:
      matrix:
        PYTHON:
          - {VERSION: "3.13", NOXSESSION: "mypy"}
          - {VERSION: "3.12", NOXSESSION: "tests"}
          - {VERSION: "3.13", NOXSESSION: "tests", RUST_VERSION: "beta"}
    runs-on: ubuntu-latest
    steps:
      - run: echo "ran ${{ matrix.PYTHON.VERSION }} ${{ matrix.PYTHON.NOXSESSION }}"
"""


def test_matrix_selection_of_an_object_value_in_the_workflows_own_form(
    tmp_path: Path, store_url: str
) -> None:
    """bcrypt's legs are objects: `--matrix 'PYTHON={VERSION: "3.12",
    NOXSESSION: tests}'`, as the workflow writes it (its key order, YAML flow
    style) or as JSON in any key order, selects the leg; only the exact
    sorted compact JSON the error message shows did."""
    repo = make_repo(tmp_path / "repo", {WF + "o.yml": OBJECT_LEGS})
    for n, value in enumerate(
        ['{VERSION: "3.12", NOXSESSION: tests}', '{ "VERSION": "3.12", "NOXSESSION": "tests" }']
    ):
        out, h = run_all(repo, store_url, tmp_path / f"state{n}", matrix={"PYTHON": value})
        assert out.ok, h.all_text()
        assert [j.conclusion for j in out.runs[0].jobs] == ["success"], out.runs[0].jobs
        assert "ran 3.12 tests" in h.all_text() and "ran 3.13" not in h.all_text()


PLATFORMS = """\
on: push
jobs:
  build:
    strategy:
      matrix:
        os: [ubuntu-latest, windows-latest, macos-14]
    runs-on: ${{ matrix.os }}
    steps:
      - run: echo "built on ${{ matrix.os }}"
  after:
    needs: build
    if: always()
    runs-on: ubuntu-latest
    steps:
      - run: echo "build ${{ needs.build.result }}"
"""


def test_other_platforms_are_skipped_with_a_reason(tmp_path: Path, store_url: str) -> None:
    repo = make_repo(tmp_path / "repo", {WF + "p.yml": PLATFORMS})
    out, h = run_all(repo, store_url, tmp_path / "state")
    jobs = {j.name: j for j in out.runs[0].jobs}
    assert jobs["build (ubuntu-latest)"].conclusion == "success"
    win = jobs["build (windows-latest)"]
    assert win.conclusion == "skipped"
    assert win.reason == (
        "runs-on windows-latest is a Windows runner; this host runs Linux "
        "(run it here anyway with --platform windows-latest=host)"
    )
    assert jobs["build (macos-14)"].conclusion == "skipped"
    assert "built on windows-latest" not in h.all_text()
    assert out.ok

    out, h = run_all(
        repo, store_url, tmp_path / "state", platforms={"windows-latest": "host"}, matrix={}
    )
    jobs = {j.name: j for j in out.runs[0].jobs}
    assert jobs["build (windows-latest)"].conclusion == "success"
    assert "built on windows-latest" in h.all_text()
    assert jobs["build (macos-14)"].conclusion == "skipped"


ARM = """\
on: push
jobs:
  test:
    strategy:
      matrix:
        os: [ubuntu-latest, ubuntu-24.04-arm]
    runs-on: ${{ matrix.os }}
    steps:
      - run: echo "tested on ${{ matrix.os }} ($RUNNER_ARCH)"
"""


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="an x86-64 host")
def test_an_arm_runner_is_skipped_on_an_x86_host(tmp_path: Path, store_url: str) -> None:
    # msgpack's and pyyaml's matrices have ubuntu-24.04-arm legs: run on this
    # host they would pass as ARM64 builds that never were.
    repo = make_repo(tmp_path / "repo", {WF + "arm.yml": ARM})
    out, h = run_all(repo, store_url, tmp_path / "state")
    jobs = {j.name: j for j in out.runs[0].jobs}
    assert jobs["test (ubuntu-latest)"].conclusion == "success"
    arm = jobs["test (ubuntu-24.04-arm)"]
    assert arm.conclusion == "skipped"
    assert arm.reason == (
        "runs-on ubuntu-24.04-arm is an ARM64 runner; this host is X64 "
        "(run it here anyway with --platform ubuntu-24.04-arm=host)"
    )
    assert "tested on ubuntu-24.04-arm" not in h.all_text()
    out, h = run_all(
        repo, store_url, tmp_path / "state", platforms={"ubuntu-24.04-arm": "host"}, matrix={}
    )
    assert {j.conclusion for j in out.runs[0].jobs} == {"success"}
    assert "tested on ubuntu-24.04-arm" in h.all_text()


RESOLVED_RUNS_ON = """on: push
jobs:
  pick:
    runs-on: ubuntu-latest
    outputs:
      windows: ${{ steps.p.outputs.windows }}
      linux: ${{ steps.p.outputs.linux }}
    steps:
      - id: p
        run: |
          echo windows=windows-2022 >> "$GITHUB_OUTPUT"
          echo linux=ubuntu-22.04 >> "$GITHUB_OUTPUT"
  on-windows:
    needs: pick
    uses: ./.github/workflows/callee.yml
    with:
      os: ${{ needs.pick.outputs.windows }}
  on-linux:
    needs: pick
    uses: ./.github/workflows/callee.yml
    with:
      os: ${{ needs.pick.outputs.linux }}
  top-level:
    needs: pick
    runs-on: ${{ needs.pick.outputs.windows }}
    steps:
      - run: echo "top-level ran"
  named:
    needs: pick
    name: named after ${{ needs.pick.outputs.linux }}
    runs-on: ubuntu-latest
    steps:
      - run: echo "named ran"
"""

CALLEE_RUNS_ON = """on:
  workflow_call:
    inputs:
      os:
        type: string
        required: true
jobs:
  build:
    name: build on ${{ inputs.os }}
    runs-on: ${{ inputs.os }}
    steps:
      - run: echo "built on ${{ inputs.os }}"
"""


def test_runs_on_known_only_at_run_time_is_run_or_skipped_by_its_value(
    tmp_path: Path, store_url: str
) -> None:
    # A label that no workflow writes out (`ubuntu-22.04`, from a job's
    # outputs through a reusable workflow's input) is still this run's to
    # take, and another OS known only then is skipped rather than run here
    # or left queued forever. A name that waited for the inputs is evaluated
    # with them, one that waited for `needs` when its job starts.
    repo = make_repo(
        tmp_path / "repo",
        {WF + "ci.yml": RESOLVED_RUNS_ON, WF + "callee.yml": CALLEE_RUNS_ON},
    )
    h = Harness()
    request = RunRequest(
        workspace=repo, store_url=store_url, state_dir=tmp_path / "state", local_runners=2
    )

    async def bounded() -> RunsOutcome:
        with anyio.fail_after(120):  # the bug left the run queued for ever
            return await Engine(request, h.events()).run_all()

    out = anyio.run(bounded)
    jobs = {j.id: j for j in out.runs[0].jobs}
    assert jobs["on-linux/build"].conclusion == "success"
    assert jobs["on-linux/build"].name == "on-linux / build on ubuntu-22.04"
    assert jobs["on-windows/build"].name == "on-windows / build on windows-2022"
    assert "built on ubuntu-22.04" in h.all_text()
    windows = (
        "runs-on windows-2022 is a Windows runner; this host runs Linux "
        "(run it here anyway with --platform windows-2022=host)"
    )
    assert jobs["on-windows/build"].conclusion == "skipped"
    assert jobs["on-windows/build"].reason == windows
    assert jobs["top-level"].conclusion == "skipped"
    assert jobs["top-level"].reason == windows
    assert "built on windows-2022" not in h.all_text()
    assert "top-level ran" not in h.all_text()
    # A name that uses `needs`, evaluated as the job starts (GitHub's too).
    assert jobs["named"].name == "named after ubuntu-22.04"
    assert "named ran" in h.lines["named"]
    assert out.ok


# --- the command line ------------------------------------------------------------


def cli(repo: Path, state: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PRELOOP_")}
    env["PRELOOP_STATE_DIR"] = str(state)
    return subprocess.run(
        [sys.executable, "-m", "preloop", *args],
        cwd=repo,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_cli_runs_two_workflows_with_one_summary_and_exit_status(tmp_path: Path) -> None:
    repo = make_repo(
        tmp_path / "repo",
        {
            WF + "a.yml": "name: A\non: push\njobs:\n" + job("one"),
            WF + "b.yml": "name: B\non: push\njobs:\n" + job("two", "exit 3"),
            WF + "t.yml": "name: T\non:\n  push:\n    tags: ['v*']\njobs:\n" + job("three"),
        },
    )
    state = tmp_path / "state"
    out = cli(repo, state, "run")
    assert out.returncode == 1, out.stderr
    lines = out.stdout.splitlines()
    assert "not run: .github/workflows/t.yml: branch 'main': on.push filters tags only" in lines
    assert "run 1: A (1 job)" in lines and "run 2: B (1 job)" in lines
    assert "[A / one] ok" in lines and "[B / two] ✗ failure" in lines
    assert lines[-1].startswith("failure in ")
    assert "2 workflow runs (run 1 success, run 2 failure)" in lines[-1]
    doc = json.loads(cli(repo, state, "run", "--json", "--job", "one").stdout)
    assert [r["name"] for r in doc["runs"]] == ["A"] and doc["conclusion"] == "success"

    bad = cli(repo, state, "run", "--event", "pushh")
    assert bad.returncode == 2
    assert bad.stderr == (
        "preloop: error: --event 'pushh' is not a GitHub Actions event; did you mean 'push'?\n"
    )
    none = cli(repo, state, "run", "--event", "release")
    assert (
        none.returncode == 1 and "'release' on refs/heads/main triggers no workflow" in none.stderr
    )
    assert "choose one with -f" not in none.stderr

    plan = cli(repo, state, "plan", "--ref", "refs/tags/v2")
    assert plan.returncode == 0, plan.stderr
    assert "  triggered: tag 'v2' matches on.push.tags 'v*'" in plan.stdout.splitlines()


def test_a_detached_head_decides_paths_and_never_guesses_the_ref(tmp_path: Path) -> None:
    """No branch checked out and no --ref: a branch- or tag-filtered workflow
    is reported not triggered (how to decide it), path filters still apply."""
    repo = make_repo(
        tmp_path / "repo",
        {
            WF + "main.yml": "name: Main\non:\n  push:\n    branches: [main]\njobs:\n"
            + job("onmain", "exit 1"),
            WF + "rel.yml": "name: Rel\non:\n  push:\n    tags: ['v*']\njobs:\n" + job("rel"),
            WF + "docs.yml": "name: Docs\non:\n  push:\n    paths: ['docs/**']\njobs:\n"
            + job("docs", "exit 1"),
            WF + "src.yml": "name: Src\non:\n  push:\n    paths: ['src/**']\njobs:\n" + job("src"),
            "src/a.py": "x\n",
        },
    )
    git(repo, "checkout", "-q", "--detach", "HEAD")
    state = tmp_path / "state"
    out = cli(repo, state, "run")
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    unknown = "ref unknown (detached HEAD): pass --ref REF"
    assert f"not run: {WF}main.yml: {unknown}" in lines
    assert f"not run: {WF}rel.yml: {unknown}" in lines
    assert any(line.startswith(f"not run: {WF}docs.yml: none of the") for line in lines)
    assert "[src] ok" in lines and "run 1: Src (1 job)" in lines
    plan = cli(repo, state, "plan")
    assert plan.returncode == 0, plan.stderr
    plan_lines = plan.stdout.splitlines()
    assert f"{WF}main.yml: not triggered: {unknown}" in plan_lines
    assert f"{WF}rel.yml: not triggered: {unknown}" in plan_lines
    assert "  triggered: 'src/a.py' matches on.push.paths 'src/**'" in plan_lines
    # --ref decides it.
    assert cli(repo, state, "run", "--ref", "main", "--job", "onmain").returncode == 1


def test_cli_list_shows_jobs_legs_and_events(tmp_path: Path) -> None:
    repo = make_repo(
        tmp_path / "repo",
        {
            WF + "m.yml": MATRIX,
            WF + "p.yml": PLATFORMS.replace("on: push", "on: [push, pull_request]"),
        },
    )
    out = cli(repo, tmp_path / "state", "list", "--json")
    assert out.returncode == 0, out.stderr
    rows = json.loads(out.stdout)
    legs = [r["name"] for r in rows if r["job"] == "test"]
    assert len(legs) == 6 and "test (3.12, bsd)" in legs
    win = next(r for r in rows if r["name"] == "build (windows-latest)")
    assert win["events"] == ["pull_request", "push"] and win["skipped"].startswith("runs-on")
    assert {
        r["stage"] for r in rows if r["job"] == "build" and r["workflow"].endswith("m.yml")
    } == {1}
    text = cli(repo, tmp_path / "state", "list")
    assert "build (windows-latest)" in text.stdout and "(not run here)" in text.stdout


def test_cli_list_shows_runs_on_of_a_workflow_it_cannot_plan(tmp_path: Path) -> None:
    # A required dispatch input stops planning: the jobs are listed unexpanded,
    # still with the runs-on they were written with.
    wf = (
        "on:\n  workflow_dispatch:\n    inputs:\n      version:\n        required: true\n"
        "jobs:\n  rel:\n    runs-on: ubuntu-24.04\n    steps:\n      - run: echo\n"
        "  m:\n    runs-on: [self-hosted, '${{ inputs.version }}']\n    steps:\n      - run: echo\n"
    )
    repo = make_repo(tmp_path / "repo", {WF + "rel.yml": wf})
    out = cli(repo, tmp_path / "state", "list", "--json")
    assert out.returncode == 0, out.stderr
    rows = {r["job"]: r for r in json.loads(out.stdout)}
    assert rows["rel"]["stage"] is None and rows["rel"]["runs_on"] == ["ubuntu-24.04"]
    assert rows["m"]["runs_on"] == ["self-hosted", "${{ inputs.version }}"]


BAD = "on: push\njobs:\n" + job("b", "echo ${{ foo( }}")


def test_an_invalid_workflow_is_reported_and_the_others_still_run(
    tmp_path: Path, store_url: str
) -> None:
    """As GitHub starts a push's valid workflows and fails the invalid one:
    every problem is reported, the others run, the whole is a failure. Asked
    for by name (-f), or with nothing valid triggered, it is the error."""
    repo = make_repo(
        tmp_path / "repo",
        {
            WF + "ci.yml": "name: CI\non: push\njobs:\n" + job("test"),
            WF + "bad.yml": BAD,
            WF + "pr.yml": "on: pull_request\njobs:\n" + job("pr"),
        },
    )
    out, h = run_all(repo, store_url, tmp_path / "state")
    assert by_workflow(out) == {"ci.yml": {"test": "success"}}
    assert [w.path for w in out.invalid] == [WF + "bad.yml"]
    (problem,) = out.invalid[0].problems
    assert re.fullmatch(r"\.github/workflows/bad\.yml:6:\d+: invalid expression `foo\(`.*", problem)
    assert not out.ok and out.conclusion == "failure"
    assert out.to_dict()["invalid_workflows"] == [{"path": WF + "bad.yml", "problems": [problem]}]
    assert "b" not in h.started

    with pytest.raises(WorkflowError, match=r"bad\.yml:6:\d+: invalid expression"):
        run_all(repo, store_url, tmp_path / "state", workflow=repo / WF / "bad.yml")
    # Nothing valid triggered (pr.yml is not, on a push): the invalid one is the answer.
    (repo / WF / "ci.yml").unlink()
    with pytest.raises(WorkflowError, match=r"bad\.yml:6:\d+: invalid expression"):
        run_all(repo, store_url, tmp_path / "state")
    # A --job only the invalid workflow has: the error says where it may be.
    (repo / WF / "ci.yml").write_text("name: CI\non: push\njobs:\n" + job("test"))
    with pytest.raises(UsageError, match=r"no job 'b' .*; invalid: \.github/workflows/bad\.yml"):
        run_all(repo, store_url, tmp_path / "state", jobs=("b",))
    with pytest.raises(UsageError, match=r"--matrix os: .*; invalid: \.github/workflows/bad\.yml"):
        run_all(repo, store_url, tmp_path / "state", matrix={"os": "linux"})


def test_cli_reports_an_invalid_workflow_beside_the_valid_ones(tmp_path: Path) -> None:
    repo = make_repo(
        tmp_path / "repo",
        {WF + "ci.yml": "name: CI\non: push\njobs:\n" + job("test"), WF + "bad.yml": BAD},
    )
    state = tmp_path / "state"
    error = r"preloop: error: \.github/workflows/bad\.yml:6:\d+: invalid expression `foo\(`.*"

    run = cli(repo, state, "run")
    assert run.returncode == 1, run.stdout + run.stderr
    assert re.fullmatch(error + "\n", run.stderr)
    lines = run.stdout.splitlines()
    assert "[test] ok" in lines
    assert f"not run: {WF}bad.yml: invalid (1 problem)" in lines
    assert lines[-1].startswith("failure in ") and "· 1 invalid workflow ·" in lines[-1]
    doc = json.loads(cli(repo, state, "run", "--json").stdout)
    assert doc["conclusion"] == "failure" and doc["runs"][0]["name"] == "CI"
    assert [w["path"] for w in doc["invalid_workflows"]] == [WF + "bad.yml"]

    for args in (["plan"], ["plan", "--json"], ["list"], ["list", "--json"]):
        out = cli(repo, state, *args)
        assert out.returncode == 1 and re.fullmatch(error + "\n", out.stderr), (args, out)
        assert "ci.yml" in out.stdout and "bad.yml" not in out.stdout, args
    only = cli(repo, state, "plan", "-f", WF + "bad.yml")
    assert only.returncode == 1 and only.stdout == "" and re.fullmatch(error + "\n", only.stderr)


def test_cli_marks_every_problem_and_shows_a_called_workflows_once(tmp_path: Path) -> None:
    """Each problem is its own `preloop: error:` line, for run and plan alike;
    a called workflow's problem, met through its caller, is shown once."""
    two = BAD + "  c:\n    runs-on: x\n    needs: nowhere\n    steps:\n      - run: echo\n"
    callee = "on: workflow_call\njobs:\n" + job("inner", "echo ${{ bar( }}")
    repo = make_repo(
        tmp_path / "repo",
        {
            WF + "ci.yml": "name: CI\non: push\njobs:\n" + job("test"),
            WF + "two.yml": two,
            WF + "callee.yml": callee,
            WF
            + "caller.yml": "on: push\njobs:\n  call:\n    uses: ./.github/workflows/callee.yml\n",
        },
    )
    state = tmp_path / "state"
    for args in (["run"], ["plan"]):
        out = cli(repo, state, *args)
        assert out.returncode == 1, (args, out)
        errors = out.stderr.splitlines()
        assert all(line.startswith("preloop: error: ") for line in errors), (args, errors)
        assert sum("two.yml" in line for line in errors) == 2, (args, errors)
        assert sum("callee.yml:6:" in line for line in errors) == 1, (args, errors)
        assert len(errors) == 3, (args, errors)


def test_cli_shows_bracketed_matrix_values_as_they_are(tmp_path: Path) -> None:
    """A leg value like `[trio]` (agronholm/anyio's `extras`) is text, not rich
    markup: the summary table, the live lines and `preloop list` show it."""
    wf = (
        "on: push\njobs:\n  test:\n    runs-on: ubuntu-latest\n"
        "    strategy:\n      matrix:\n        extras: ['[trio]']\n"
        "    steps:\n      - run: echo 'extras=${{ matrix.extras }}'\n"
    )
    repo = make_repo(tmp_path / "repo", {WF + "t.yml": wf})
    state = tmp_path / "state"
    out = cli(repo, state, "run")
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    assert "[test ([trio])] extras=[trio]" in lines
    assert any("│ test ([trio]) │ ✓ success │" in line for line in lines), out.stdout
    listed = cli(repo, state, "list")
    assert listed.returncode == 0, listed.stderr
    assert "test ([trio])" in listed.stdout
