"""Loading and validating workflows: one test per validation error, exact line:col."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from preloop.workflow import WorkflowError, load_workflow
from preloop.workflow.loader import MAX_REUSABLE_DEPTH


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    (tmp_path / ".github" / "workflows").mkdir(parents=True)
    return tmp_path


def write(repo: Path, name: str, text: str) -> Path:
    p = repo / ".github" / "workflows" / name
    p.write_text(textwrap.dedent(text).lstrip("\n"))
    return p


CALLABLE = "on: workflow_call\njobs:\n  x:\n    runs-on: a\n    steps: [{run: b}]\n"


def errors(repo: Path, text: str, name: str = "w.yml") -> list[str]:
    path = write(repo, name, text)
    with pytest.raises(WorkflowError) as info:
        load_workflow(path)
    return [str(d) for d in info.value.diagnostics]


def only(repo: Path, text: str) -> str:
    errs = errors(repo, text)
    assert len(errs) == 1, errs
    return errs[0]


def test_valid_workflow_model(repo: Path) -> None:
    path = write(
        repo,
        "ci.yml",
        """
        name: CI
        on:
          push:
            branches: [main]
          workflow_dispatch:
            inputs:
              level: {type: string, default: low}
        env:
          GLOBAL: 1
        defaults:
          run:
            shell: bash
        concurrency:
          group: ci-${{ github.ref }}
          cancel-in-progress: true
        jobs:
          build:
            name: Build it
            runs-on: [self-hosted, linux]
            timeout-minutes: 30
            continue-on-error: ${{ matrix.experimental }}
            outputs:
              digest: ${{ steps.d.outputs.digest }}
            strategy:
              fail-fast: false
              max-parallel: 2
              matrix:
                experimental: [false]
            steps:
              - uses: actions/checkout@v4
                with: {fetch-depth: 0}
              - id: d
                if: github.event_name == 'push'
                run: echo digest=1 >> "$GITHUB_OUTPUT"
                shell: sh
                working-directory: src
                env: {X: "${{ inputs.level }}"}
                timeout-minutes: 5
          test:
            needs: build
            runs-on: ubuntu-latest
            steps:
              - run: echo ok
        """,
    )
    wf = load_workflow(path)
    assert wf.name == "CI"
    assert set(wf.on) == {"push", "workflow_dispatch"}
    assert wf.env["GLOBAL"] == "1"
    assert wf.concurrency is not None and wf.concurrency.cancel_in_progress is True
    build = wf.job("build")
    assert build.runs_on == ("self-hosted", "linux")
    assert build.timeout_minutes == 30.0
    assert build.continue_on_error == "${{ matrix.experimental }}"
    assert build.strategy is not None and build.strategy.max_parallel == 2
    assert build.steps[0].uses == "actions/checkout@v4" and build.steps[0].with_["fetch-depth"] == 0
    step = build.steps[1]
    assert (step.id, step.if_, step.shell, step.working_directory) == (
        "d",
        "github.event_name == 'push'",
        "sh",
        "src",
    )
    assert wf.job("test").needs == ("build",)
    with pytest.raises(TypeError):
        wf.env["X"] = "y"  # type: ignore[index]


def test_yaml_1_2_scalars(repo: Path) -> None:
    path = write(
        repo,
        "w.yml",
        """
        on: push
        jobs:
          a:
            runs-on: x
            strategy:
              matrix:
                v: [yes, no, on, "1", 1, 1.5, true, null]
            steps: [{run: echo}]
        """,
    )
    m = load_workflow(path).job("a").strategy.matrix  # type: ignore[union-attr]
    assert m is not None and m.vectors[0][1] == ("yes", "no", "on", "1", 1, 1.5, True, None)


# --- one test per validation error ------------------------------------------


def test_yaml_syntax_error(repo: Path) -> None:
    err = only(repo, "on: push\njobs:\n  a: [\n")
    assert err.startswith(".github/workflows/w.yml:4:1: YAML syntax error")


def test_unknown_needs_target(repo: Path) -> None:
    err = errors(
        repo,
        """
        on: push
        jobs:
          a:
            runs-on: x
            steps: [{run: echo}]
          b:
            needs: [a, nope]
            runs-on: x
            steps: [{run: echo}]
        """,
    )
    assert err == [".github/workflows/w.yml:7:16: job 'b' needs unknown job 'nope'"]


def test_dependency_cycle_is_named(repo: Path) -> None:
    err = errors(
        repo,
        """
        on: push
        jobs:
          root:
            runs-on: x
            steps: [{run: echo}]
          a:
            needs: [root, c]
            runs-on: x
            steps: [{run: echo}]
          b:
            needs: a
            runs-on: x
            steps: [{run: echo}]
          c:
            needs: b
            runs-on: x
            steps: [{run: echo}]
        """,
    )
    # Every edge of the cycle is reported, as GitHub does.
    assert err == [
        ".github/workflows/w.yml:7:19: dependency cycle: a -> c -> b -> a",
        ".github/workflows/w.yml:11:12: dependency cycle: a -> c -> b -> a",
        ".github/workflows/w.yml:15:12: dependency cycle: a -> c -> b -> a",
    ]


def test_no_job_without_needs(repo: Path) -> None:
    err = errors(
        repo,
        """
        on: push
        jobs:
          a:
            needs: a
            runs-on: x
            steps: [{run: echo}]
        """,
    )
    assert err == [
        ".github/workflows/w.yml:3:3: the workflow must contain at least one job "
        "with no dependencies",
        ".github/workflows/w.yml:4:12: dependency cycle: a -> a",
    ]


def test_invalid_job_id(repo: Path) -> None:
    err = only(
        repo,
        """
        on: push
        jobs:
          1build:
            runs-on: x
            steps: [{run: echo}]
        """,
    )
    assert err.startswith(".github/workflows/w.yml:3:3: invalid job id '1build'")


def test_matrix_vector_without_values(repo: Path) -> None:
    err = only(
        repo,
        """
        on: push
        jobs:
          a:
            runs-on: x
            strategy:
              matrix:
                os: []
            steps: [{run: echo}]
        """,
    )
    assert err == ".github/workflows/w.yml:7:13: matrix vector 'os' has no values"


@pytest.mark.parametrize("value", ["two", "true", "[1]", ".inf"])
def test_max_parallel_not_a_finite_number(repo: Path, value: str) -> None:
    err = only(
        repo,
        f"""
        on: push
        jobs:
          a:
            runs-on: x
            strategy:
              max-parallel: {value}
              matrix:
                os: [a, b]
            steps: [{{run: echo}}]
        """,
    )
    assert err.startswith(".github/workflows/w.yml:6:21: `max-parallel` must be a finite number")


def test_more_than_256_legs(repo: Path) -> None:
    err = only(
        repo,
        """
        on: push
        jobs:
          a:
            runs-on: x
            strategy:
              matrix:
                x: [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16]
                y: [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15]
            steps: [{run: echo}]
        """,
    )
    assert err == (
        ".github/workflows/w.yml:7:9: job 'a': the matrix expands to 272 legs; "
        "at most 256 are allowed"
    )


def test_exclude_key_that_is_no_vector(repo: Path) -> None:
    err = only(
        repo,
        """
        on: push
        jobs:
          a:
            runs-on: x
            strategy:
              matrix:
                os: [linux, mac]
                exclude:
                  - os: windows
                  - sys: linux
            steps: [{run: echo}]
        """,
    )
    assert err == (
        ".github/workflows/w.yml:10:13: job 'a': matrix `exclude` key 'sys' is not one of "
        "the matrix's vectors (os)"
    )


def test_uses_and_run_in_one_step(repo: Path) -> None:
    err = only(
        repo,
        """
        on: push
        jobs:
          a:
            runs-on: x
            steps:
              - run: echo
                uses: actions/checkout@v4
        """,
    )
    assert err == ".github/workflows/w.yml:7:9: a step has either `run` or `uses`, not both"


def test_step_with_neither_run_nor_uses(repo: Path) -> None:
    err = only(
        repo,
        """
        on: push
        jobs:
          a:
            runs-on: x
            steps:
              - name: nothing
        """,
    )
    assert (
        err == ".github/workflows/w.yml:6:9: a step needs `run` (a command) or `uses` (an action)"
    )


def test_caller_job_with_forbidden_keys(repo: Path) -> None:
    write(
        repo,
        "callee.yml",
        "on: workflow_call\njobs:\n  x:\n    runs-on: a\n    steps: [{run: b}]\n",
    )
    errs = errors(
        repo,
        """
        on: push
        jobs:
          call:
            uses: ./.github/workflows/callee.yml
            runs-on: ubuntu-latest
            steps: [{run: echo}]
        """,
    )
    assert [e.split(": job")[0] for e in errs] == [
        ".github/workflows/w.yml:5:5",
        ".github/workflows/w.yml:6:5",
    ]
    assert "calls a reusable workflow and may not have 'runs-on'" in errs[0]


def test_unknown_keys_and_wrong_types(repo: Path) -> None:
    errs = errors(
        repo,
        """
        on: push
        jobs:
          a:
            runs-on: x
            timeout-minutes: soon
            bogus: 1
            env: [A]
            steps:
              - run: echo
                color: red
        """,
    )
    assert errs == [
        ".github/workflows/w.yml:5:22: `timeout-minutes` must be a number or an expression, "
        "not a string",
        ".github/workflows/w.yml:6:5: unknown key 'bogus' in job 'a'",
        ".github/workflows/w.yml:7:10: `env` must be a mapping, not a list",
        ".github/workflows/w.yml:10:9: unknown key 'color' in a step",
    ]


def test_every_error_reported_at_once(repo: Path) -> None:
    errs = errors(
        repo,
        """
        on: pushh
        jobs:
          a:
            needs: zz
            steps:
              - name: x
          -b:
            runs-on: x
            steps: [{run: "${{ 1 + }}"}]
        """,
    )
    # The file's own problems first, then how its parts relate (GitHub's two
    # passes), each in file order.
    assert [e.split(": ", 1)[0] for e in errs] == [
        ".github/workflows/w.yml:1:5",  # unknown event
        ".github/workflows/w.yml:4:5",  # no runs-on (at the job mapping)
        ".github/workflows/w.yml:6:9",  # step with neither
        ".github/workflows/w.yml:7:3",  # invalid job id
        ".github/workflows/w.yml:9:20",  # expression syntax, at its `${{`
        ".github/workflows/w.yml:4:12",  # unknown need
    ]


def test_expression_errors_point_into_the_expression(repo: Path) -> None:
    err = only(
        repo,
        """
        on: push
        jobs:
          a:
            runs-on: x
            if: github.ref == 'x' && nope.y
            steps: [{run: echo}]
        """,
    )
    assert err == (
        ".github/workflows/w.yml:5:9: unrecognized named-value 'nope' in expression "
        "`github.ref == 'x' && nope.y`"
    )


def test_duplicate_key(repo: Path) -> None:
    err = only(
        repo,
        """
        on: push
        jobs:
          a:
            runs-on: x
            runs-on: y
            steps: [{run: echo}]
        """,
    )
    assert err == ".github/workflows/w.yml:5:5: 'runs-on' is already defined"


# --- reusable workflows ------------------------------------------------------

CALLEE = """
on:
  workflow_call:
    inputs:
      who: {type: string, required: true}
      times: {type: number, default: 2}
    secrets:
      token: {required: true}
    outputs:
      greeting:
        value: ${{ jobs.hello.outputs.text }}
jobs:
  hello:
    runs-on: linux
    outputs:
      text: ${{ steps.s.outputs.text }}
    steps:
      - id: s
        run: echo "text=hi ${{ inputs.who }}" >> "$GITHUB_OUTPUT"
"""


def test_reusable_workflow_with_inputs_outputs_secrets(repo: Path) -> None:
    write(repo, "callee.yml", CALLEE)
    path = write(
        repo,
        "w.yml",
        """
        on: push
        jobs:
          call:
            uses: ./.github/workflows/callee.yml
            with: {who: me}
            secrets: {token: "${{ secrets.T }}"}
        """,
    )
    call = load_workflow(path).job("call")
    assert call.is_caller and call.callee is not None
    decl = call.callee.workflow_call
    assert decl is not None
    assert decl.inputs["times"]["default"] == 2
    assert decl.outputs["greeting"]["value"] == "${{ jobs.hello.outputs.text }}"
    assert set(decl.secrets) == {"token"}
    assert call.with_["who"] == "me"


def test_reusable_workflow_input_and_secret_errors(repo: Path) -> None:
    write(repo, "callee.yml", CALLEE)
    errs = errors(
        repo,
        """
        on: push
        jobs:
          call:
            uses: ./.github/workflows/callee.yml
            with:
              whom: me
            secrets:
              other: x
        """,
    )
    assert errs == [
        ".github/workflows/w.yml:4:11: './.github/workflows/callee.yml' requires input 'who', "
        "which `with` does not provide",
        ".github/workflows/w.yml:4:11: './.github/workflows/callee.yml' requires secret 'token', "
        "which `secrets` does not pass",
        ".github/workflows/w.yml:6:13: input 'whom' is not declared by "
        "'./.github/workflows/callee.yml' (on.workflow_call.inputs)",
        ".github/workflows/w.yml:8:14: secret 'other' is not declared by "
        "'./.github/workflows/callee.yml'",
    ]


def test_reusable_workflow_missing_or_not_callable(repo: Path) -> None:
    write(repo, "plain.yml", "on: push\njobs:\n  x:\n    runs-on: a\n    steps: [{run: b}]\n")
    errs = errors(
        repo,
        """
        on: push
        jobs:
          a:
            uses: ./.github/workflows/missing.yml
          b:
            uses: ./.github/workflows/plain.yml
        """,
    )
    assert errs[0].startswith(
        ".github/workflows/w.yml:4:11: reusable workflow './.github/workflows/missing.yml' "
        "does not exist"
    )
    assert errs[1] == (
        ".github/workflows/w.yml:6:11: './.github/workflows/plain.yml' is not a reusable "
        "workflow: it has no `on: workflow_call`"
    )


def test_errors_inside_a_callee_name_the_callee(repo: Path) -> None:
    write(repo, "callee.yml", "on: workflow_call\njobs:\n  x:\n    runs-on: a\n    steps: [{}]\n")
    errs = errors(repo, "on: push\njobs:\n  c:\n    uses: ./.github/workflows/callee.yml\n")
    assert errs == [
        ".github/workflows/callee.yml:5:13: a step needs `run` (a command) or `uses` (an action)"
    ]


def test_reusable_nesting_deeper_than_ten(repo: Path) -> None:
    for i in range(1, MAX_REUSABLE_DEPTH + 1):
        write(
            repo,
            f"l{i}.yml",
            f"on: workflow_call\njobs:\n  j:\n    uses: ./.github/workflows/l{i + 1}.yml\n",
        )
    write(
        repo,
        f"l{MAX_REUSABLE_DEPTH + 1}.yml",
        "on: workflow_call\njobs:\n  x:\n    runs-on: a\n    steps: [{run: b}]\n",
    )
    # The top level plus nine nested callers is fine...
    ok = write(repo, "ok.yml", "on: push\njobs:\n  j:\n    uses: ./.github/workflows/l3.yml\n")
    wf = load_workflow(ok)
    depth = 1
    job = wf.jobs[0]
    while job.callee is not None:
        depth += 1
        job = job.callee.jobs[0]
    assert depth == MAX_REUSABLE_DEPTH
    # ...one more level is not.
    errs = errors(repo, "on: push\njobs:\n  j:\n    uses: ./.github/workflows/l2.yml\n")
    assert errs == [
        ".github/workflows/l10.yml:4:11: reusable workflows nest at most 10 levels deep "
        "(calling './.github/workflows/l11.yml' would be level 11)"
    ]


def test_reusable_workflow_calling_itself(repo: Path) -> None:
    write(
        repo, "loop.yml", "on: workflow_call\njobs:\n  j:\n    uses: ./.github/workflows/loop.yml\n"
    )
    errs = errors(repo, "on: push\njobs:\n  j:\n    uses: ./.github/workflows/loop.yml\n")
    assert errs == [
        ".github/workflows/loop.yml:4:11: reusable workflow './.github/workflows/loop.yml' "
        "calls itself (directly or indirectly)"
    ]


def test_actions_are_checked_for_form_not_presence(repo: Path) -> None:
    # GitHub reads a local action's action.yml when its step runs (an earlier
    # step may generate it): a missing one is no validation error.
    (repo / "tools" / "setup").mkdir(parents=True)
    (repo / "tools" / "setup" / "action.yml").write_text("runs: {using: composite, steps: []}\n")
    errs = errors(
        repo,
        """
        on: push
        jobs:
          a:
            runs-on: x
            steps:
              - uses: ./tools/setup
              - uses: ./tools/missing
              - uses: actions/checkout@v4
              - uses: docker://alpine:3
              - uses: not-an-action
        """,
    )
    assert len(errs) == 1
    assert errs[0].startswith(
        ".github/workflows/w.yml:10:15: invalid `uses`: expected format {org}/{repo}[/path]@ref"
    )


def test_context_availability(repo: Path) -> None:
    errs = errors(
        repo,
        """
        on: push
        env:
          A: ${{ secrets.TOKEN }}
          B: ${{ matrix.os }}
        jobs:
          a:
            runs-on: ${{ steps.x.outputs.label }}
            if: ${{ hashFiles('x') != '' }}
            outputs:
              o: ${{ steps.s.outputs.o }}
            steps:
              - id: s
                if: ${{ failure() || hashFiles('**/*.lock') != '' }}
                run: echo ${{ secrets.TOKEN }} ${{ success() }}
        """,
    )
    assert errs == [
        ".github/workflows/w.yml:4:6: context 'matrix' is not available here (only github, "
        "inputs, secrets, vars) in expression `matrix.os`",
        ".github/workflows/w.yml:7:14: context 'steps' is not available here (only github, "
        "inputs, matrix, needs, strategy, vars) in expression `steps.x.outputs.label`",
        ".github/workflows/w.yml:8:9: function hashfiles() is not available here: "
        "`hashFiles('x') != ''`",
        ".github/workflows/w.yml:14:40: function success() is not available here: `success()`",
    ]
