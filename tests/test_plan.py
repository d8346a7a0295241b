"""Planning: legs, cohorts, concurrency, callers, deferred matrices, JSON round trips, CLI."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from preloop.workflow import (
    Plan,
    PlanError,
    expand_deferred,
    load_workflow,
    plan,
)
from preloop.workflow.expressions import evaluate, evaluate_if
from preloop.workflow.planner import template_expression


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    (tmp_path / ".github" / "workflows").mkdir(parents=True)
    return tmp_path


def write(repo: Path, name: str, text: str) -> Path:
    p = repo / ".github" / "workflows" / name
    p.write_text(textwrap.dedent(text).lstrip("\n"))
    return p


LEAF = "on: workflow_call\njobs:\n  leaf:\n    runs-on: a\n    steps: [{run: b}]\n"


def plan_of(repo: Path, text: str, event: str = "push", **kw: Any) -> Plan:
    return plan(load_workflow(write(repo, "w.yml", text)), event, **kw)


MATRIX = """
name: M
on: [push, workflow_dispatch]
concurrency: ci-${{ github.event_name }}
jobs:
  setup:
    runs-on: ubuntu-latest
    steps: [{run: echo}]
  test:
    needs: setup
    runs-on: ${{ matrix.os }}
    timeout-minutes: ${{ matrix.minutes }}
    continue-on-error: ${{ matrix.experimental }}
    concurrency:
      group: test-${{ matrix.os }}
      cancel-in-progress: true
    strategy:
      fail-fast: false
      max-parallel: 2
      matrix:
        os: [linux, mac]
        minutes: [5]
        include:
          - os: mac
            experimental: true
    steps: [{run: "echo ${{ matrix.os }}"}]
"""


def test_matrix_filters_compare_yaml_values_as_github_does(repo: Path) -> None:
    # YAML reads `py: 3.10` as the number 3.1; GitHub's filter expression
    # `matrix['py'] == 3.1` still matches the string '3.10', and ignores case.
    p = plan_of(
        repo,
        """
        on: push
        jobs:
          t:
            runs-on: x
            strategy:
              matrix:
                os: [ubuntu-latest, windows-latest]
                py: ["3.9", "3.10"]
                exclude:
                  - py: 3.10
                  - os: Windows-Latest
                include:
                  - arch: arm
                    os: macos
            steps: [{run: b}]
        """,
    )
    assert [j.name for j in p.jobs] == ["t (ubuntu-latest, 3.9)", "t (macos, arm)"]
    assert list(p.job("t#1").matrix) == ["os", "arch"]


def test_matrix_legs_cohort_and_evaluated_fields(repo: Path) -> None:
    p = plan_of(repo, MATRIX)
    assert [j.id for j in p.jobs] == ["setup", "test#0", "test#1"]
    assert [j.seq for j in p.jobs] == [0, 1, 2]
    leg0, leg1 = p.job("test#0"), p.job("test#1")
    assert leg0.base_id == leg1.base_id == "test"
    assert leg0.name == "test (linux, 5)"
    assert leg1.name == "test (mac, 5)"  # as GitHub names it: not what `include` adds
    assert leg0.needs == ("setup",)
    assert leg0.runs_on == ("linux",) and leg1.runs_on == ("mac",)
    assert leg0.timeout_minutes == 5.0
    assert (leg0.continue_on_error, leg1.continue_on_error) == (False, True)
    assert leg1.strategy == {"fail-fast": False, "job-index": 1, "job-total": 2, "max-parallel": 2}
    assert leg1.matrix == {"os": "mac", "minutes": 5, "experimental": True}
    assert leg0.concurrency is not None and leg0.concurrency.group == "test-linux"
    assert leg0.concurrency.cancel_in_progress is True
    assert p.cohorts[0].id == "test" and p.cohorts[0].max_parallel == 2
    assert p.cohorts[0].fail_fast is False and p.cohorts[0].total == 2
    assert p.concurrency is not None and p.concurrency.group == "ci-push"
    assert leg0.spec["steps"][0]["run"] == "echo ${{ matrix.os }}"
    assert Plan.from_json(p.to_json()) == p


def test_event_must_trigger_the_workflow(repo: Path) -> None:
    with pytest.raises(PlanError, match="not triggered by 'release'"):
        plan_of(repo, MATRIX, event="release")


def test_dispatch_inputs_defaults_and_typed(repo: Path) -> None:
    p = plan_of(
        repo,
        """
        on:
          workflow_dispatch:
            inputs:
              level: {type: string, default: low}
              debug: {type: boolean, default: false}
        jobs:
          a:
            if: inputs.debug
            runs-on: ${{ inputs.level }}-runner
            steps: [{run: echo}]
        """,
        event="workflow_dispatch",
        inputs={"debug": "true"},
    )
    assert p.inputs == {"level": "low", "debug": True}
    assert p.job("a").runs_on == ("low-runner",)
    assert evaluate_if(p.job("a").if_expr, {"inputs": p.inputs}) is True


def test_concurrency_on_needs_is_deferred_as_an_expression(repo: Path) -> None:
    p = plan_of(
        repo,
        """
        on: push
        jobs:
          a:
            runs-on: x
            outputs: {env: "${{ steps.s.outputs.env }}"}
            steps: [{run: echo}]
          b:
            needs: a
            runs-on: x
            concurrency:
              group: deploy-${{ needs.a.outputs.env }}-{x}'s
              queue: max
            steps: [{run: echo}]
        """,
    )
    conc = p.job("b").concurrency
    assert conc is not None and conc.group is None and conc.queue_max is True
    assert conc.group_expr == "format('deploy-{0}-{{x}}''s', (needs.a.outputs.env))"
    ctx = {"needs": {"a": {"outputs": {"env": "prod"}}}}
    assert evaluate(conc.group_expr, ctx) == "deploy-prod-{x}'s"


def test_template_expression() -> None:
    assert template_expression("${{ a.b }}") == "a.b"
    assert template_expression("x ${{ 1 }} y ${{ 'z' }}") == "format('x {0} y {1}', (1), ('z'))"


CALLEE = """
on:
  workflow_call:
    inputs:
      who: {type: string, required: true}
      n: {type: number, default: 2}
    outputs:
      greeting:
        value: ${{ jobs.hello.outputs.text }}
jobs:
  prep:
    runs-on: linux
    steps: [{run: echo}]
  hello:
    needs: prep
    name: Hello ${{ inputs.who }}
    runs-on: linux
    strategy:
      matrix:
        n: [1, 2]
    outputs:
      text: ${{ steps.s.outputs.text }}
    steps:
      - id: s
        run: echo "text=hi" >> "$GITHUB_OUTPUT"
"""


def test_reusable_caller_with_inner_jobs(repo: Path) -> None:
    write(repo, "callee.yml", CALLEE)
    p = plan_of(
        repo,
        """
        on: push
        jobs:
          first:
            runs-on: x
            steps: [{run: echo}]
          call:
            needs: first
            name: Greeter
            uses: ./.github/workflows/callee.yml
            with: {who: "${{ github.event_name }}"}
          after:
            needs: call
            runs-on: x
            steps: [{run: echo}]
        """,
    )
    ids = [j.id for j in p.jobs]
    assert ids == ["first", "call", "call/prep", "call/hello#0", "call/hello#1", "after"]
    call = p.job("call")
    assert call.kind == "caller" and call.needs == ("first",)
    assert call.inner_job_ids == ("call/prep", "call/hello#0", "call/hello#1")
    assert call.outputs == {"greeting": "${{ jobs.hello.outputs.text }}"}
    assert call.spec["inputs"] == {"n": 2, "who": "push"}
    prep, hello = p.job("call/prep"), p.job("call/hello#1")
    assert prep.caller == "call" and prep.name == "Greeter / prep" and prep.needs == ()
    assert hello.base_id == "call/hello" and hello.needs == ("call/prep",)
    assert hello.name == "Greeter / Hello push"
    assert hello.cohort == "call/hello"
    assert p.job("after").needs == ("call",)
    assert Plan.from_json(p.to_json()) == p


def test_nested_callers(repo: Path) -> None:
    write(
        repo,
        "inner.yml",
        LEAF,
    )
    write(
        repo,
        "mid.yml",
        "on: workflow_call\njobs:\n  deep:\n    uses: ./.github/workflows/inner.yml\n",
    )
    p = plan_of(repo, "on: push\njobs:\n  top:\n    uses: ./.github/workflows/mid.yml\n")
    assert [(j.id, j.kind, j.caller) for j in p.jobs] == [
        ("top", "caller", None),
        ("top/deep", "caller", "top"),
        ("top/deep/leaf", "job", "top/deep"),
    ]
    assert p.job("top").inner_job_ids == ("top/deep",)
    assert p.job("top/deep/leaf").name == "top / deep / leaf"


DEFERRED = """
on: push
jobs:
  setup:
    runs-on: x
    outputs:
      matrix: ${{ steps.m.outputs.matrix }}
    steps: [{id: m, run: echo}]
  build:
    needs: setup
    runs-on: ${{ matrix.os }}
    strategy:
      max-parallel: 1
      matrix: ${{ fromJSON(needs.setup.outputs.matrix) }}
    steps: [{run: "echo ${{ matrix.os }}"}]
  after:
    needs: build
    runs-on: x
    steps: [{run: echo}]
"""


def test_deferred_matrix_expands_once_needs_are_known(repo: Path) -> None:
    p = plan_of(repo, DEFERRED)
    build = p.job("build")
    assert build.kind == "deferred"
    assert build.deferred_matrix == "fromJSON(needs.setup.outputs.matrix)"
    assert p.job("after").seq > build.seq + 255  # a seq block is reserved for the legs
    p2 = Plan.from_json(p.to_json())
    needs = {"setup": {"result": "success", "outputs": {"matrix": '{"os":["linux","mac"]}'}}}
    out = expand_deferred(p2.job("build"), {"needs": needs})
    assert [(j.id, j.seq, j.runs_on, j.name) for j in out.jobs] == [
        ("build#0", build.seq, ("linux",), "build (linux)"),
        ("build#1", build.seq + 1, ("mac",), "build (mac)"),
    ]
    assert out.jobs[0].needs == ("setup",) and out.jobs[0].kind == "job"
    assert out.cohort is not None and (out.cohort.max_parallel, out.cohort.total) == (1, 2)


def test_deferred_matrix_empty_and_invalid(repo: Path) -> None:
    job = plan_of(repo, DEFERRED).job("build")
    empty = expand_deferred(job, {"needs": {"setup": {"outputs": {"matrix": '{"include":[]}'}}}})
    assert empty.jobs == () and empty.cohort is None
    with pytest.raises(PlanError, match="build"):
        expand_deferred(job, {"needs": {"setup": {"outputs": {"matrix": "{bad"}}}})
    with pytest.raises(PlanError, match="no values"):
        expand_deferred(job, {"needs": {"setup": {"outputs": {"matrix": '{"os":[]}'}}}})


def test_deferred_matrix_inside_reusable_workflow(repo: Path) -> None:
    write(
        repo,
        "callee.yml",
        """
        on:
          workflow_call:
            inputs:
              targets: {type: string, required: true}
        jobs:
          gen:
            runs-on: x
            outputs: {m: "${{ steps.s.outputs.m }}"}
            steps: [{id: s, run: echo}]
          run:
            needs: gen
            runs-on: x
            strategy:
              matrix:
                t: ${{ fromJSON(needs.gen.outputs.m) }}
                mode: ["${{ inputs.targets }}"]
            steps: [{run: echo}]
        """,
    )
    p = plan_of(
        repo,
        "on: push\njobs:\n  c:\n    uses: ./.github/workflows/callee.yml\n"
        "    with: {targets: fast}\n",
    )
    deferred = p.job("c/run")
    assert deferred.kind == "deferred" and deferred.caller == "c"
    assert deferred.deferred_matrix is not None and deferred.deferred_matrix.startswith("{")
    assert p.job("c").inner_job_ids == ("c/gen", "c/run")
    out = expand_deferred(deferred, {"needs": {"gen": {"outputs": {"m": "[1, 2]"}}}})
    assert [(j.id, j.base_id, j.caller, j.matrix, j.name) for j in out.jobs] == [
        ("c/run#0", "c/run", "c", {"t": 1, "mode": "fast"}, "c / run (1, fast)"),
        ("c/run#1", "c/run", "c", {"t": 2, "mode": "fast"}, "c / run (2, fast)"),
    ]
    assert out.jobs[0].needs == ("c/gen",)


def test_deferred_caller_matrix(repo: Path) -> None:
    write(
        repo,
        "callee.yml",
        LEAF,
    )
    p = plan_of(
        repo,
        """
        on: push
        jobs:
          gen:
            runs-on: x
            steps: [{run: echo}]
          fan:
            needs: gen
            strategy:
              matrix:
                n: ${{ fromJSON(needs.gen.outputs.n) }}
            uses: ./.github/workflows/callee.yml
        """,
    )
    out = expand_deferred(p.job("fan"), {"needs": {"gen": {"outputs": {"n": "[7, 8]"}}}})
    assert [(j.id, j.kind, j.caller) for j in out.jobs] == [
        ("fan#0", "caller", None),
        ("fan#0/leaf", "job", "fan#0"),
        ("fan#1", "caller", None),
        ("fan#1/leaf", "job", "fan#1"),
    ]
    assert out.jobs[0].inner_job_ids == ("fan#0/leaf",)


def test_static_matrix_error_at_plan_time(repo: Path) -> None:
    text = """
    on:
      workflow_dispatch:
        inputs:
          list: {type: string, default: "[]"}
    jobs:
      a:
        runs-on: x
        strategy:
          matrix:
            v: ${{ fromJSON(inputs.list) }}
        steps: [{run: echo}]
    """
    with pytest.raises(PlanError, match=r"w.yml:6:3: job 'a': invalid matrix: .*no values"):
        plan_of(repo, text, event="workflow_dispatch")
    p = plan_of(repo, text, event="workflow_dispatch", inputs={"list": "[1, 2]"})
    assert [j.id for j in p.jobs] == ["a#0", "a#1"]


# --- property: plans round-trip through JSON ---------------------------------

_names = st.sampled_from(["a", "b", "c", "build", "test", "lint", "deploy", "x-1", "_y"])


@st.composite
def workflows(draw: st.DrawFn) -> str:
    ids = draw(st.lists(_names, min_size=1, max_size=6, unique=True))
    lines = ["on: [push, workflow_dispatch]", "jobs:"]
    for i, job_id in enumerate(ids):
        lines.append(f"  {job_id}:")
        earlier = ids[:i]
        has_needs = bool(earlier) and draw(st.booleans())
        if has_needs:
            needs = draw(st.lists(st.sampled_from(earlier), min_size=1, unique=True))
            lines.append(f"    needs: [{', '.join(needs)}]")
            earlier = needs
        if draw(st.booleans()):
            lines.append("    if: ${{ github.event_name == 'push' || failure() }}")
        kind = draw(st.sampled_from(["job", "job", "caller", "deferred"]))
        if kind == "caller":
            lines.append("    uses: ./.github/workflows/callee.yml")
            lines.append(f"    with: {{who: {job_id}}}")
            continue
        if kind == "deferred" and earlier:
            if not has_needs:
                lines.append(f"    needs: [{earlier[0]}]")
            lines += ["    strategy:", "      matrix: ${{ fromJSON(needs.X.outputs.m) }}"]
            lines[-1] = lines[-1].replace("needs.X", f"needs.{earlier[0]}")
        lines.append("    runs-on: " + draw(st.sampled_from(["linux", "[self-hosted, gpu]"])))
        if kind == "job" and draw(st.booleans()):
            vec = draw(st.lists(st.integers(0, 9), min_size=1, max_size=4, unique=True))
            lines += ["    strategy:", f"      max-parallel: {draw(st.integers(1, 3))}"]
            lines += ["      matrix:", f"        v: {vec}", "        w: [x, 'y z']"]
            if draw(st.booleans()):
                lines.append(f"        include: [{{v: {vec[0]}, extra: true}}]")
        if draw(st.booleans()):
            lines += ["    concurrency:", "      group: g-${{ github.event_name }}"]
        lines += ["    env: {K: v}", "    steps:", "      - run: echo ${{ matrix.v }}"]
    return "\n".join(lines) + "\n"


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(text=workflows())
def test_random_workflows_round_trip_through_json(repo: Path, text: str) -> None:
    write(repo, "callee.yml", CALLEE)
    p = plan(load_workflow(write(repo, "r.yml", text)), "push")
    again = Plan.from_json(p.to_json())
    assert again == p
    assert again.to_json() == p.to_json()
    seqs = [j.seq for j in p.jobs]
    assert seqs == sorted(set(seqs))
    ids = {j.base_id for j in p.jobs}
    assert all(n in ids for j in p.jobs for n in j.needs)
    taken = set(seqs)
    for j in again.jobs:
        if j.kind != "deferred":
            continue
        needs = {n.rsplit("/", 1)[-1]: {"outputs": {"m": '{"v": [1, 2]}'}} for n in j.needs}
        out = expand_deferred(j, {"needs": needs})
        assert [leg.id for leg in out.jobs] == [f"{j.id}#0", f"{j.id}#1"]
        block = range(j.seq, j.seq + j.spec["deferred"]["seq_block"])
        assert all(leg.seq in block for leg in out.jobs)
        assert not (taken - {j.seq}) & set(block)


# --- CLI ------------------------------------------------------------------------


def run_cli(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "preloop", "plan", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        check=False,
    )


def test_cli_prints_stages_for_every_triggered_workflow(repo: Path) -> None:
    write(repo, "m.yml", MATRIX)
    write(repo, "release.yml", "on: release\njobs:\n  r:\n    runs-on: x\n    steps: [{run: b}]\n")
    res = run_cli(repo)
    assert res.returncode == 0, res.stderr
    assert res.stdout.splitlines() == [
        ".github/workflows/m.yml (M) on push: 3 jobs in 2 stages",
        "  triggered: on: push",
        "  concurrency: ci-push",
        "  stage 1:",
        "    setup  [runs-on: ubuntu-latest]",
        "  stage 2:",
        "    test (linux, 5)  [runs-on: linux]",
        "    test (mac, 5)  [runs-on: mac]",
        ".github/workflows/release.yml: not triggered: not triggered by 'push' (its events: "
        "release)",
        "(ref unknown; changed paths unknown: not a git repository)",
    ]
    res = run_cli(repo, "--event", "release", "--json")
    assert res.returncode == 0, res.stderr
    plans = json.loads(res.stdout)
    assert [p["workflow"] for p in plans] == [".github/workflows/release.yml"]
    assert Plan.from_dict(plans[0]).job("r").runs_on == ("x",)


def test_cli_file_and_errors(repo: Path) -> None:
    write(repo, "d.yml", DEFERRED)
    res = run_cli(repo, "-f", ".github/workflows/d.yml")
    assert res.returncode == 0, res.stderr
    assert "    build  [matrix deferred: fromJSON(needs.setup.outputs.matrix)]" in res.stdout
    write(repo, "bad.yml", "on: push\njobs:\n  a:\n    needs: nope\n    steps: [{}]\n")
    res = run_cli(repo, "-f", ".github/workflows/bad.yml")
    assert res.returncode == 1 and res.stdout == ""
    assert res.stderr.splitlines() == [
        "preloop: error: .github/workflows/bad.yml:4:5: the job has no `runs-on` "
        "(which runner labels it needs)",
        "preloop: error: .github/workflows/bad.yml:5:13: a step needs `run` (a command) or "
        "`uses` (an action)",
        "preloop: error: .github/workflows/bad.yml:3:3: the workflow must contain at least one "
        "job with no dependencies",
        "preloop: error: .github/workflows/bad.yml:4:12: job 'a' needs unknown job 'nope'",
    ]
    res = run_cli(repo, "-f", "missing.yml")
    assert res.returncode == 1 and "missing.yml:1:1: cannot read workflow" in res.stderr
    # A file given with -f that the event does not trigger: named, with what to do.
    write(repo, "release.yml", "on: release\njobs:\n  r:\n    runs-on: x\n    steps: [{run: b}]\n")
    res = run_cli(repo, "-f", ".github/workflows/release.yml")
    assert res.returncode == 2 and res.stdout == ""
    assert res.stderr.splitlines() == [
        "preloop: error: .github/workflows/release.yml: not triggered by 'push' (its events: "
        "release); plan another event with --event EVENT"
    ]


def git(cwd: Path, *args: str) -> str:
    env_args = ["-c", "user.email=t@example.com", "-c", "user.name=t"]
    out = subprocess.run(["git", *env_args, *args], cwd=cwd, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_local_github_context_from_git(repo: Path) -> None:
    from preloop.workflow.github_context import local_github_context

    assert local_github_context(repo) == {"workspace": str(repo.resolve())}  # not a repo yet
    git(repo, "init", "-q", "-b", "feature/x")
    git(repo, "commit", "-q", "--allow-empty", "-m", "one")
    git(repo, "remote", "add", "origin", "https://github.com/acme/widget.git")
    ctx = local_github_context(repo)
    assert ctx["sha"] == git(repo, "rev-parse", "HEAD")
    assert (ctx["ref"], ctx["ref_name"], ctx["ref_type"]) == (
        "refs/heads/feature/x",
        "feature/x",
        "branch",
    )
    assert (ctx["repository"], ctx["repository_owner"]) == ("acme/widget", "acme")
    git(repo, "tag", "v1")
    git(repo, "checkout", "-q", "--detach")
    assert local_github_context(repo)["ref"] == "refs/tags/v1"
    # A clone of a local path names no GitHub repository.
    for local in ("/srv/git/myproj", "file:///srv/git/myproj.git", "../myproj"):
        git(repo, "remote", "set-url", "origin", local)
        assert "repository" not in local_github_context(repo), local
    git(repo, "remote", "set-url", "origin", "git@github.com:acme/widget.git")
    assert local_github_context(repo)["repository"] == "acme/widget"


def test_cli_uses_the_repository_for_github_context(repo: Path) -> None:
    git(repo, "init", "-q", "-b", "main")
    git(repo, "commit", "-q", "--allow-empty", "-m", "one")
    write(
        repo,
        "c.yml",
        "on: push\nconcurrency: ci-${{ github.ref_name }}\njobs:\n"
        "  a:\n    runs-on: x\n    steps: [{run: echo}]\n",
    )
    res = run_cli(repo / ".github", "--json")  # from a subdirectory
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)[0]["concurrency"]["group"] == "ci-main"


def test_cli_plans_a_pull_request_with_the_runs_github_context(repo: Path) -> None:
    # What `preloop run --event pull_request` evaluates: its merge ref, the
    # head and base branches and the default payload's number.
    git(repo, "init", "-q", "-b", "main")
    git(repo, "commit", "-q", "--allow-empty", "-m", "one")
    git(repo, "checkout", "-q", "-b", "feature")
    write(
        repo,
        "c.yml",
        "on: [push, pull_request]\n"
        "concurrency: ${{ github.head_ref || github.ref }}-${{ github.event.pull_request.number }}"
        "\njobs:\n  a:\n    name: a ${{ github.ref }} ${{ github.base_ref }}\n"
        "    runs-on: x\n    steps: [{run: echo}]\n",
    )
    res = run_cli(repo, "--json", "--event", "pull_request", "--base", "main")
    assert res.returncode == 0, res.stderr
    doc = json.loads(res.stdout)[0]
    assert doc["concurrency"]["group"] == "feature-1"
    assert [j["name"] for j in doc["jobs"]] == ["a refs/pull/1/merge main"]
    res = run_cli(repo, "--json")  # a push of the branch
    assert json.loads(res.stdout)[0]["concurrency"]["group"] == "refs/heads/feature-"
    # The footer names the base a pull request's ref is (not `ref refs/heads/main`).
    res = run_cli(repo, "--event", "pull_request", "--base", "main")
    assert res.stdout.splitlines()[-1].startswith("(pull request into refs/heads/main; ")
    assert run_cli(repo).stdout.splitlines()[-1].startswith("(ref refs/heads/feature; ")


def test_cli_shows_a_run_scoped_group_evaluated_with_a_run_id_placeholder(repo: Path) -> None:
    # `head_ref || run_id` (sphinx's lint.yml) is evaluated as the run is
    # stored; the plan shows its value with `<run id>` standing in, not the
    # rewritten `format(...)` expression.
    git(repo, "init", "-q", "-b", "main")
    git(repo, "commit", "-q", "--allow-empty", "-m", "one")
    git(repo, "checkout", "-q", "-b", "feature")
    write(
        repo,
        "c.yml",
        "name: Lint\non: [push, pull_request]\n"
        "concurrency:\n  group: ${{ github.workflow }}-${{ github.head_ref || github.run_id }}\n"
        "jobs:\n  a:\n    runs-on: x\n    steps: [{run: echo}]\n",
    )
    res = run_cli(repo, "--event", "pull_request", "--base", "main")
    assert res.returncode == 0, res.stderr
    assert "  concurrency: Lint-feature" in res.stdout.splitlines(), res.stdout
    res = run_cli(repo)
    assert "  concurrency: Lint-<run id>" in res.stdout.splitlines(), res.stdout
    write(
        repo,
        "c.yml",
        "name: Lint\non: [push]\n"
        "concurrency:\n  group: n-${{ github.run_number }}.${{ github.run_attempt }}\n"
        "jobs:\n  a:\n    runs-on: x\n    steps: [{run: echo}]\n",
    )
    res = run_cli(repo)
    assert "  concurrency: n-<run number>.<run attempt>" in res.stdout.splitlines(), res.stdout


def test_scalars_where_strings_go_are_read_as_their_text(repo: Path) -> None:
    # GitHub's parser takes `run: true` or `name: 3.10` (read as 3.1, as YAML
    # has it) where a string goes (tests/js/workflow_oracle.mjs reports none).
    p = plan_of(
        repo,
        """
        name: 7
        on: push
        concurrency: false
        jobs:
          a:
            name: 3.10
            runs-on: true
            steps:
              - name: false
                run: true
        """,
    )
    (job,) = p.jobs
    assert (p.name, job.name, job.runs_on) == ("7", "3.1", ("true",))
    assert job.spec["steps"][0]["run"] == "true" and job.spec["steps"][0]["name"] == "false"
    assert p.concurrency is not None and p.concurrency.group == "false"


def test_ifs_that_hold_on_clean_ancestry_are_stored_in_one_spelling(repo: Path) -> None:
    """`always()`, `success()`, `!cancelled()` and `!failure()`, however
    spelt, reach the scheduler as `TRUE_WHEN_CLEAN` (which it admits in bulk
    when the ancestry is clean); any other `if:` is stored as written."""
    p = plan_of(
        repo,
        """
        on: push
        jobs:
          a: {runs-on: x, steps: [{run: b}]}
          b: {needs: a, if: "${{ Always( ) }}", runs-on: x, steps: [{run: b}]}
          c: {needs: a, if: "! cancelled()", runs-on: x, steps: [{run: b}]}
          d: {needs: a, if: "SUCCESS()", runs-on: x, steps: [{run: b}]}
          e: {needs: a, if: "!failure()", runs-on: x, steps: [{run: b}]}
          f: {needs: a, if: "always() && github.ref == 'refs/heads/x y'", runs-on: x,
              steps: [{run: b}]}
          g: {needs: a, if: "failure()", runs-on: x, steps: [{run: b}]}
        """,
    )
    ifs = {j.id: j.if_expr for j in p.jobs}
    assert ifs == {
        "a": None,
        "b": "always()",
        "c": "!cancelled()",
        "d": "success()",
        "e": "!failure()",
        "f": "always() && github.ref == 'refs/heads/x y'",
        "g": "failure()",
    }
