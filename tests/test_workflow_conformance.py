"""Conformance with GitHub's workflow parser, case by case.

Each case is a workflow GitHub accepts (expected None) or rejects (expected
`(line, col)` of the first error), written from GitHub's schema
(workflow-v1.0.json), its reader test data (actions/languageservices,
workflow-parser/testdata/reader) and its documentation. Cases marked `ts`
are also checked against `@actions/workflow-parser` with node; the others are
rules GitHub's service applies that the TypeScript parser does not (uses
syntax, YAML tags, credentials, typed reusable-workflow inputs, permissions,
local paths).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import textwrap
import time
from pathlib import Path

import pytest
from tests.run_support import make_repo, results, run_engine, workflow

from preloop.workflow import WorkflowError, load_workflow
from preloop.workflow.uses import local_path_error, step_uses_error, workflow_uses_error

pytest_plugins = ["preloop.testing.control_fixtures"]

ROOT = Path(__file__).resolve().parent.parent
ORACLE = ROOT / "tests" / "js" / "workflow_oracle.mjs"
HAVE_ORACLE = shutil.which("node") is not None and (ROOT / "node_modules" / "@actions").is_dir()

JOB = "    runs-on: x\n    steps: [{run: echo}]\n"


def wf(text: str) -> str:
    return textwrap.dedent(text).lstrip("\n")


# (name, workflow, expected first error (line, col) or None, checked against TS too)
CASES: list[tuple[str, str, tuple[int, int] | None, bool]] = [
    # -- no false rejects: contexts per key, as the schema says ---------------
    (
        "pages-environment-url-uses-steps",
        wf("""
            on: push
            jobs:
              deploy:
                environment:
                  name: github-pages
                  url: ${{ steps.deployment.outputs.page_url }}${{ env.X }}${{ runner.os }}
                runs-on: x
                steps:
                  - id: deployment
                    uses: actions/deploy-pages@v4
            """),
        None,
        True,
    ),
    (
        "container-and-service-credentials-use-secrets-and-env",
        wf("""
            on: push
            jobs:
              a:
                runs-on: x
                container:
                  image: ghcr.io/o/i:${{ matrix.v }}
                  credentials:
                    username: ${{ github.actor }}
                    password: ${{ secrets.GHCR }}${{ env.X }}
                  env:
                    TOKEN: ${{ secrets.T }}
                services:
                  db:
                    image: postgres
                    credentials:
                      username: u
                      password: ${{ secrets.DB }}
                    env:
                      P: ${{ secrets.P }}
                steps: [{run: echo}]
            """),
        None,
        True,
    ),
    (
        "job-defaults-run-may-use-contexts",
        wf("""
            on: push
            jobs:
              a:
                defaults:
                  run:
                    working-directory: ${{ github.workspace }}/sub
            """)
        + JOB,
        None,
        True,
    ),
    (
        "event-filters-from-the-schema",
        wf("""
            on:
              merge_group:
                branches: [main]
                types: [checks_requested]
              image_version:
                names: [img]
                versions: ['1.*']
              registry_package:
                types: [published]
              workflow_run:
                workflows: [CI]
                types: [completed]
                branches-ignore: [x]
              pull_request_target:
                types: [opened, synchronize]
                paths-ignore: [docs/**]
            jobs:
              a:
            """)
        + JOB,
        None,
        True,
    ),
    (
        "null-if",
        wf("""
            on: push
            jobs:
              a:
                if:
            """)
        + JOB
        + "  b:\n    if: null\n"
        + JOB,
        None,
        True,
    ),
    (
        "null-dispatch-inputs",  # reader test data; npm 0.3.61 still refuses it
        wf("""
            on:
              workflow_dispatch:
                inputs:
            jobs:
              a:
            """)
        + JOB,
        None,
        False,
    ),
    (
        "job-if-may-name-jobs-in-status-functions",
        wf("""
            on: push
            jobs:
              a:
                runs-on: x
                steps: [{run: echo}]
              b:
                needs: a
                if: ${{ success('a') || failure('a', 'b') }}
            """)
        + JOB,
        None,
        True,
    ),
    (
        "step-if-status-functions-take-no-arguments",
        wf("""
            on: push
            jobs:
              a:
                runs-on: x
                steps:
                  - run: echo
                    if: ${{ success('a') }}
            """),
        (7, 13),
        True,
    ),
    (
        "a-null-dispatch-input-is-a-string-input",  # reader test data; npm 0.3.61 refuses it
        wf("""
            on:
              workflow_dispatch:
                inputs:
                  x:
            jobs:
              a:
            """)
        + JOB,
        None,
        False,
    ),
    (
        "huge-integers-are-numbers",
        wf("""
            on: push
            jobs:
              a:
                timeout-minutes: 123456789012345678901234567890123456789012345678901234567890
                strategy:
                  matrix:
                    n: [0xFFFFFFFFFFFFFFFFFFFFFFFF, 99999999999999999999999]
                runs-on: x
                steps:
                  - run: echo ${{ 0xFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFF }}
            """),
        None,
        True,
    ),
    (
        "workflow-dispatch-ignores-unknown-keys",  # GitHub's service; TS rejects
        wf("""
            on:
              workflow_dispatch:
                unknown-key: x
            jobs:
              a:
            """)
        + JOB,
        None,
        False,
    ),
    # -- no false rejects: production workflows GitHub runs -------------------
    (
        # github/codeql-action .github/workflows/__rust.yml (and 55 more of its
        # workflows): a step moves the checkout to `../action` and the next ones
        # run `./../action/init`. GitHub's parser checks only the form of a local
        # `uses` (its runner joins the path to the workspace), as the TS one does.
        "step-uses-a-local-action-beside-the-workspace",
        wf("""
            on: push
            jobs:
              a:
                runs-on: x
                steps:
                  - uses: actions/checkout@v6
                  - uses: ./.github/actions/prepare-test
                  - uses: ./../action/init
                    with:
                      languages: rust
                  - uses: ./../action/analyze
            """),
        None,
        True,
    ),
    (
        # nodejs/undici .github/workflows/ci.yml: `max-parallel: 0` on matrix
        # jobs, plain and calling a reusable workflow. GitHub's parser reads any
        # number (a cap only when positive), as the TS one does.
        "max-parallel-zero-is-no-cap",
        wf("""
            on: push
            jobs:
              test:
                strategy:
                  fail-fast: false
                  max-parallel: 0
                  matrix:
                    node-version: ['22', '24']
                    runs-on: [ubuntu-latest, windows-latest]
                uses: ./.github/workflows/callee.yml
                with:
                  s: ${{ matrix.node-version }}
              test-without-intl:
                strategy:
                  max-parallel: 0
                  matrix:
                    node-version: ['22', '24']
                runs-on: ubuntu-latest
                steps: [{run: echo}]
            """),
        None,
        True,
    ),
    (
        # helm/helm .github/workflows/release.yml (its releases since 2022):
        # `create: {tags: [v*]}`. GitHub's service reads `on` with the loose
        # schema (actions/runner src/Sdk/WorkflowParser: `workflow-root`) and
        # runs it on every `create`; only the strict schema of the TS (editor)
        # parser refuses the mapping (test_workflow_differential.py checks that).
        "filters-of-an-event-that-takes-none-are-ignored",
        wf("""
            on:
              create:
                tags:
                  - v*
              delete:
                branches: [main]
              push:
                branches:
                  - main
            jobs:
              a:
            """)
        + JOB,
        None,
        False,
    ),
    (
        # microsoft/playwright .github/workflows/tests_bidi.yml excludes a leg
        # that only some events have; GitHub's parser checks an exclude's keys,
        # not that it matches a combination (nor does the TS one).
        "exclude-that-matches-no-combination",
        wf("""
            on: push
            jobs:
              a:
                strategy:
                  matrix:
                    channel: [bidi-chromium, moz-firefox-nightly]
                    isPullRequest: [false]
                    exclude:
                      - isPullRequest: true
                        channel: bidi-chromium
            """)
        + JOB,
        None,
        True,
    ),
    # -- no false accepts ------------------------------------------------------
    (
        "unknown-activity-type",
        wf("""
            on:
              pull_request:
                types: [opened, bogus]
            jobs:
              a:
            """)
        + JOB,
        (3, 21),
        True,
    ),
    (
        "unknown-event-filter",
        wf("""
            on:
              merge_group:
                tags: [v1]
            jobs:
              a:
            """)
        + JOB,
        (3, 5),
        True,
    ),
    (
        "job-ids-are-case-insensitive",
        wf("""
            on: push
            jobs:
              build:
                runs-on: x
                steps: [{run: echo}]
              BUILD:
            """)
        + JOB,
        (6, 3),
        True,
    ),
    (
        "job-id-reserved-prefix",
        wf("""
            on: push
            jobs:
              __a:
            """)
        + JOB,
        (3, 3),
        True,
    ),
    (
        "step-ids-are-case-insensitive",  # reader test data; npm 0.3.61 does not check
        wf("""
            on: push
            jobs:
              a:
                runs-on: x
                steps:
                  - id: step1
                    run: echo
                  - id: STEP1
                    run: echo
            """),
        (8, 13),
        False,
    ),
    (
        "step-id-reserved-prefix",
        wf("""
            on: push
            jobs:
              a:
                runs-on: x
                steps:
                  - id: __x
                    run: echo
            """),
        (6, 13),
        True,
    ),
    (
        "container-needs-an-image",
        wf("""
            on: push
            jobs:
              a:
                runs-on: x
                container:
                  options: --cpus 1
                steps: [{run: echo}]
            """),
        (6, 7),
        True,
    ),
    (
        "service-image-empty",
        wf("""
            on: push
            jobs:
              a:
                runs-on: x
                services:
                  db:
                    image: ''
                steps: [{run: echo}]
            """),
        (7, 16),
        True,
    ),
    (
        "credentials-unknown-key",
        wf("""
            on: push
            jobs:
              a:
                runs-on: x
                container:
                  image: i
                  credentials:
                    user: u
                steps: [{run: echo}]
            """),
        (8, 9),
        True,
    ),
    (
        "credentials-need-username-and-password",
        wf("""
            on: push
            jobs:
              a:
                runs-on: x
                container:
                  image: i
                  credentials:
                    username: u
                steps: [{run: echo}]
            """),
        (8, 9),
        False,
    ),
    (
        "runs-on-group-prefix",
        wf("""
            on: push
            jobs:
              a:
                runs-on:
                  group: asdf/my-group
                steps: [{run: echo}]
            """),
        (5, 14),
        True,
    ),
    (
        "runs-on-group-empty-name",
        wf("""
            on: push
            jobs:
              a:
                runs-on:
                  group: ent/
                steps: [{run: echo}]
            """),
        (5, 14),
        True,
    ),
    (
        "literal-expressions-where-no-context-is-available",
        wf("""
            name: ${{ 'x' }}
            on: push
            defaults:
              run:
                shell: ${{ 'bash' }}
            jobs:
              a:
                runs-on: x
                steps:
                  - run: echo
                    shell: ${{ 'bash' }}
            """),
        None,
        True,
    ),
    (
        "no-other-expression-where-no-context-is-available",
        wf("""
            name: ${{ 1 == 1 }}
            on: push
            jobs:
              a:
                runs-on: x
                steps:
                  - run: echo
                    shell: a ${{ 'b' }}
            """),
        (1, 7),
        True,
    ),
    (
        "no-expression-in-step-uses",
        wf("""
            on: push
            jobs:
              a:
                runs-on: x
                steps:
                  - uses: ${{ matrix.action }}
            """),
        (6, 15),
        True,
    ),
    (
        "no-expression-in-workflow-defaults",
        wf("""
            on: push
            defaults:
              run:
                shell: ${{ github.event_name }}
            jobs:
              a:
            """)
        + JOB,
        (4, 12),
        True,
    ),
    (
        "expression-length-limit",
        wf("""
            on: push
            jobs:
              a:
                runs-on: x
                steps:
                  - run: echo ${{ github.sha }} """)
        + "x" * 21000
        + "\n",
        (6, 14),
        False,  # reader test data; npm 0.3.61 does not check
    ),
    (
        "step-uses-syntax",
        wf("""
            on: push
            jobs:
              a:
                runs-on: x
                steps:
                  - uses: docker://alpine:3.8
                  - uses: actions/aws/ec2@main
                  - uses: badrepo@v1
            """),
        (8, 15),
        False,
    ),
    (
        "reusable-workflow-leaves-the-repository",
        wf("""
            on: push
            jobs:
              a:
                uses: ./.github/workflows/../../../w.yml
            """),
        (4, 11),
        False,
    ),
    (
        "reusable-workflow-uses-syntax",
        wf("""
            on: push
            jobs:
              a:
                uses: owner/repo@v1
            """),
        (4, 11),
        False,
    ),
    (
        "explicit-unsupported-yaml-tag",
        wf("""
            on: push
            jobs:
              a:
                runs-on: x
                steps:
                  - uses: a/b@v1
                    with:
                      when: !!timestamp 2022-10-26T00:00:00Z
            """),
        (8, 17),
        False,
    ),
    (
        "explicit-tag-on-a-quoted-scalar",
        wf("""
            on: push
            jobs:
              a:
                runs-on: x
                timeout-minutes: !!int "300"
                steps: [{run: echo}]
            """),
        (5, 22),
        False,
    ),
    (
        "billion-laughs",
        "x0: &x0 [a, a, a, a, a, a, a, a, a, a]\n"
        + "".join(f"x{i}: &x{i} [{', '.join([f'*x{i - 1}'] * 10)}]\n" for i in range(1, 10))
        + "on: push\njobs:\n  a:\n    runs-on: x\n    env: {A: *x9}\n    steps: [{run: echo}]\n",
        (1, 1),
        False,
    ),
    (
        "alias-containing-itself",
        "a: &a [1, *a]\non: push\njobs:\n  j:\n" + JOB,
        (1, 1),
        False,
    ),
]

CALLEE = """\
permissions:
  contents: read
on:
  workflow_call:
    inputs:
      flag: {type: boolean}
      n: {type: number}
      s: {type: string}
jobs:
  j:
    permissions:
      actions: write
    runs-on: x
    steps: [{run: echo}]
"""

# Workflows with a local callee (the TypeScript oracle cannot read other files).
CALLER_CASES: list[tuple[str, str, tuple[int, int] | None]] = [
    (
        "typed-inputs-coerce-strings-not-booleans",
        wf("""
            on: push
            permissions: write-all
            jobs:
              call:
                uses: ./.github/workflows/callee.yml
                with:
                  flag: not-a-boolean
                  n: 3
                  s: 3
            """),
        (7, 13),
    ),
    (
        "typed-inputs-number",
        wf("""
            on: push
            permissions: write-all
            jobs:
              call:
                uses: ./.github/workflows/callee.yml
                with:
                  flag: true
                  n: not-a-number
            """),
        (8, 10),
    ),
    (
        "typed-inputs-ok-and-expressions-wait",
        wf("""
            on: push
            permissions: write-all
            jobs:
              call:
                uses: ./.github/workflows/callee.yml
                with:
                  flag: ${{ github.event_name == 'push' }}
                  n: 1.5
                  s: true
            """),
        None,
    ),
    (
        "callee-asks-more-permissions-than-the-caller-job-grants",
        wf("""
            on: push
            permissions: write-all
            jobs:
              call:
                permissions:
                  actions: read
                  contents: read
                uses: ./.github/workflows/callee.yml
            """),
        (4, 3),
    ),
    (
        "callee-asks-more-permissions-than-the-caller-workflow-grants",
        wf("""
            on: push
            permissions: read-all
            jobs:
              call:
                uses: ./.github/workflows/callee.yml
            """),
        (4, 3),
    ),
    (
        "caller-without-permissions-uses-the-repository-default",
        wf("""
            on: push
            jobs:
              call:
                uses: ./.github/workflows/callee.yml
            """),
        None,
    ),
]


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    (tmp_path / ".github" / "workflows").mkdir(parents=True)
    (tmp_path / ".github" / "workflows" / "callee.yml").write_text(CALLEE)
    return tmp_path


def first_error(repo: Path, text: str) -> tuple[int, int, str] | None:
    path = repo / ".github" / "workflows" / "w.yml"
    path.write_text(text)
    try:
        load_workflow(path)
    except WorkflowError as exc:
        d = exc.diagnostics[0]
        assert d.path.endswith("w.yml"), str(exc)
        return d.line, d.column, d.message
    return None


@pytest.mark.parametrize(
    ("text", "expected"), [(c[1], c[2]) for c in CASES], ids=[c[0] for c in CASES]
)
def test_case(repo: Path, text: str, expected: tuple[int, int] | None) -> None:
    got = first_error(repo, text)
    if expected is None:
        assert got is None
    else:
        assert got is not None and got[:2] == expected, got


@pytest.mark.parametrize(
    ("text", "expected"),
    [(c[1], c[2]) for c in CALLER_CASES],
    ids=[c[0] for c in CALLER_CASES],
)
def test_caller_case(repo: Path, text: str, expected: tuple[int, int] | None) -> None:
    got = first_error(repo, text)
    if expected is None:
        assert got is None
    else:
        assert got is not None and got[:2] == expected, got


@pytest.mark.skipif(not HAVE_ORACLE, reason="needs node and `npm ci` (the CI installs both)")
def test_cases_agree_with_githubs_parser() -> None:
    cases = [c for c in CASES if c[3]]
    files = [{"name": ".github/workflows/w.yml", "content": c[1]} for c in cases]
    proc = subprocess.run(
        ["node", str(ORACLE)],
        input=json.dumps(files),
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
    )
    problems = []
    for (name, _, expected, _), errs in zip(cases, json.loads(proc.stdout), strict=True):
        theirs = min(((e["line"], e["column"]) for e in errs), default=None)
        if theirs != expected:
            problems.append(
                f"{name}: GitHub's parser gives {theirs} ({errs}), we expect {expected}"
            )
    assert not problems, "\n".join(problems)


def test_billion_laughs_is_fast_and_small(repo: Path) -> None:
    text = next(c[1] for c in CASES if c[0] == "billion-laughs").replace("range", "")
    deeper = text.replace("on: push", "y: &y [*x9, *x9, *x9, *x9, *x9]\non: push")
    started = time.monotonic()
    assert first_error(repo, deeper) is not None
    assert time.monotonic() - started < 5  # exponential expansion would take minutes


def test_symlink_loop_is_an_error_not_a_traceback(repo: Path) -> None:
    loop = repo / ".github" / "workflows" / "loop.yml"
    os.symlink("loop.yml", loop)
    with pytest.raises(WorkflowError) as info:
        load_workflow(loop)
    (d,) = info.value.diagnostics
    assert (d.line, d.column) == (1, 1) and "cannot read workflow" in d.message


def test_uses_syntax_functions(tmp_path: Path) -> None:
    for ok in ("docker://alpine:3.8", "actions/aws/ec2@main", "./x", "$/x", "a/b@v1", ".\\x"):
        assert step_uses_error(ok) is None, ok
    for bad in ("$$docker://alpine", "...docker://x", "badrepo@invalid", "a/b", "a/b@", "a@b@c"):
        assert step_uses_error(bad) is not None, bad
    for ok in (
        "./.github/workflows/x.yml",
        "o/r/.github/workflows/x.yaml@v1",
        "$/.github/workflows/x.yml",
    ):
        assert workflow_uses_error(ok) is None, ok
    for bad in ("o/r@v1", "./x.yml", "o/r/.github/workflows/x.yml", "./.github/workflows/x.yml@v1"):
        assert workflow_uses_error(bad) is not None, bad
    (tmp_path / "in").mkdir()
    os.symlink("/", tmp_path / "in" / "escape")
    assert local_path_error("./in", tmp_path) is None
    assert local_path_error("./in/../in", tmp_path) is None
    assert local_path_error("./../x", tmp_path) is not None
    assert local_path_error("./in/escape", tmp_path) is not None
    # Bounded by another directory (a job's, around its workspace).
    assert local_path_error("./../x", tmp_path / "in", tmp_path, "the job") is None
    assert local_path_error("./../../x", tmp_path / "in", tmp_path, "the job") == (
        "'./../../x' points outside the job"
    )
    assert local_path_error("./escape", tmp_path / "in", tmp_path, "the job") == (
        "'./escape' points outside the job (through a symlink)"
    )


def test_at_most_50_unique_reusable_workflows(repo: Path) -> None:
    from preloop.workflow.loader import MAX_REUSABLE_WORKFLOWS

    wf_dir = repo / ".github" / "workflows"
    n = MAX_REUSABLE_WORKFLOWS + 1
    for i in range(n):
        (wf_dir / f"c{i}.yml").write_text("on: workflow_call\njobs:\n  j:\n" + JOB)
    jobs = "".join(f"  call{i}:\n    uses: ./.github/workflows/c{i}.yml\n" for i in range(n))
    # The same workflow called twice counts once.
    again = "  again:\n    uses: ./.github/workflows/c0.yml\n"
    assert first_error(repo, "on: push\njobs:\n" + jobs[: jobs.index("  call50:")] + again) is None
    got = first_error(repo, "on: push\njobs:\n" + jobs)
    assert got is not None and got[:2] == (2 + 2 * n, 11), got


def test_huge_numbers_run_on_both_stores(tmp_path: Path, store_url: str) -> None:
    big = "1" * 400
    repo = make_repo(
        tmp_path / "repo",
        workflow(
            f"""\
            on: push
            jobs:
              a:
                runs-on: ubuntu-latest
                timeout-minutes: {big}
                strategy:
                  matrix:
                    n: [0xFFFFFFFFFFFFFFFFFFFFFFFF, 12345678901234567890, {big}]
                steps:
                  - run: echo "n=${{{{ matrix.n }}}} j=${{{{ toJSON(matrix.n) }}}}"
            """
        ),
    )
    outcome, h = run_engine(repo, store_url, tmp_path / "state")
    assert set(results(outcome).values()) == {"success"}, h.all_text()
    text = h.all_text()
    assert "n=12345678901234567000 j=12345678901234567000" in text
    assert "n=7.922816251426434e+28" in text and "n=Infinity" in text


def test_null_dispatch_input_plans(repo: Path) -> None:
    from preloop.workflow import plan

    path = repo / ".github" / "workflows" / "w.yml"
    path.write_text(
        "on:\n  workflow_dispatch:\n    inputs:\n      x:\n      y: ~\njobs:\n  a:\n" + JOB
    )
    wf = load_workflow(path)
    assert plan(wf, "workflow_dispatch", inputs={"x": "v"}).inputs == {"x": "v"}
    assert plan(wf, "workflow_dispatch").inputs == {}


def _nested_matrix(collections: int) -> str:
    """A workflow whose deepest value sits in `collections` nested mappings
    and sequences (root, jobs, a, strategy, matrix, the axis: six, then
    alternately an item mapping and a sequence), as in GitHub's reader test
    data errors-matrix-max-depth.yml."""
    lines = ["on: push", "jobs:", "  a:", "    runs-on: x", "    steps: [{run: echo}]"]
    lines += ["    strategy:", "      matrix:", "        deep:"]
    indent = "          "
    for level in range(7, collections + 1):
        if level % 2:  # a mapping as a sequence item
            lines.append(f"{indent}- k{level}:")
            indent += "    "
        else:  # a sequence as that mapping's value
            indent = indent[:-2]
    if collections % 2:
        lines[-1] += " leaf"  # the innermost mapping's value
    else:
        lines.append(f"{indent}- leaf")  # the innermost sequence's item
    return "\n".join(lines) + "\n"


def test_objects_nest_at_most_50_deep(repo: Path) -> None:
    from preloop.workflow.yamltree import MAX_OBJECT_DEPTH, compose

    for n in (49, 50, 51, 52):
        root, errors = compose(_nested_matrix(n), "w.yml")
        depth, node = 0, root
        while node is not None and not hasattr(node, "value"):
            depth += 1
            node = node.items[-1][1] if hasattr(node, "index") else node.items[-1]
        assert depth == min(n, MAX_OBJECT_DEPTH), (n, depth)
        assert len(errors) == (n > MAX_OBJECT_DEPTH), errors  # reported once
    assert first_error(repo, _nested_matrix(50)) is None
    got = first_error(repo, _nested_matrix(51))
    assert got is not None and "Maximum object depth exceeded" in got[2], got
    # At the 51st collection: the innermost mapping (its key), on the last line.
    last = _nested_matrix(51).splitlines()[-1]
    assert got[:2] == (_nested_matrix(51).count("\n"), last.index("k51") + 1), got


def test_at_most_25_workflow_dispatch_inputs(repo: Path) -> None:
    """GitHub refuses a 26th `workflow_dispatch` input (its service's limit;
    `@actions/workflow-parser` does not check it), at that input's name."""

    def text(n: int) -> str:
        inputs = "".join(f"      in{i}: {{type: string}}\n" for i in range(n))
        return "on:\n  workflow_dispatch:\n    inputs:\n" + inputs + "jobs:\n  a:\n" + JOB

    assert first_error(repo, text(25)) is None
    got = first_error(repo, text(26))
    assert got is not None and got[:2] == (4 + 25, 7), got
    assert "up to 25 `inputs`" in got[2]


def test_max_parallel_expression_error_names_infinity_at_the_value(repo: Path) -> None:
    from preloop.workflow import PlanError, plan

    path = repo / ".github" / "workflows" / "w.yml"
    path.write_text(
        "on: push\njobs:\n  a:\n    runs-on: x\n    strategy:\n"
        "      matrix: {os: [a, b]}\n      max-parallel: ${{ 1e400 }}\n    steps: [{run: echo}]\n"
    )
    with pytest.raises(PlanError) as info:
        plan(load_workflow(path), "push")
    assert str(info.value) == (
        ".github/workflows/w.yml:7:21: job 'a': `max-parallel` is Infinity, not a finite number"
    )


def test_max_parallel_caps_only_when_positive(repo: Path) -> None:
    """GitHub's parser casts `max-parallel` to an integer and caps the legs
    only when it is positive; `strategy.max-parallel` is then the leg count
    (nodejs/undici .github/workflows/ci.yml writes `max-parallel: 0`)."""
    from preloop.workflow import plan

    path = repo / ".github" / "workflows" / "w.yml"
    for written, cap in [("0", None), ("-2", None), ("1.5", 1), ("${{ 0.5 }}", None), ("2", 2)]:
        path.write_text(
            "on: push\njobs:\n  a:\n    runs-on: x\n    strategy:\n"
            f"      matrix: {{os: [a, b, c]}}\n      max-parallel: {written}\n"
            "    steps: [{run: echo}]\n"
        )
        p = plan(load_workflow(path), "push")
        assert [c.max_parallel for c in p.cohorts] == [cap], written
        assert {j.strategy["max-parallel"] for j in p.jobs} == {cap or 3}, written


def test_callee_permissions_are_refused_as_github_says_it(repo: Path) -> None:
    """astral-sh/uv .github/workflows/release.yml: `permissions: {}` at the
    top, a caller job without its own, and a callee whose workflow-level
    `permissions` asks `contents: read`. GitHub refuses it once for the
    callee's workflow-level permissions (its jobs take those) and once per
    job asking more on its own, by job id."""
    (repo / ".github" / "workflows" / "binaries.yml").write_text(
        wf("""
            on: workflow_call
            permissions:
              contents: read
            jobs:
              sdist:
                name: sdist
                runs-on: x
                steps: [{run: echo}]
              macos-x86_64:
                name: x86_64-apple-darwin
                permissions:
                  contents: read
                  id-token: write
                runs-on: x
                steps: [{run: echo}]
            """)
    )
    text = wf("""
        on: workflow_dispatch
        permissions: {}
        jobs:
          build-release-binaries:
            uses: $/.github/workflows/binaries.yml
        """)
    path = repo / ".github" / "workflows" / "w.yml"
    path.write_text(text)
    with pytest.raises(WorkflowError) as info:
        load_workflow(path)
    call = ".github/workflows/w.yml:4:3: error calling workflow '$/.github/workflows/binaries.yml'"
    assert str(info.value).splitlines() == [
        f"{call}: the workflow is requesting 'contents: read', but is only allowed "
        "'contents: none'",
        f"{call}: the nested job 'macos-x86_64' is requesting 'contents: read, id-token: "
        "write', but is only allowed 'contents: none, id-token: none'",
    ]


def test_exclude_matching_no_leg_of_this_event_plans(repo: Path) -> None:
    """microsoft/playwright .github/workflows/tests_bidi.yml: the exclude
    matches a leg only on pull requests; its daily schedule runs both legs."""
    from preloop.workflow import plan

    path = repo / ".github" / "workflows" / "w.yml"
    path.write_text(
        wf("""
            on: [pull_request, schedule, workflow_dispatch]
            jobs:
              test_bidi:
                name: BiDi
                runs-on: ubuntu-24.04
                strategy:
                  fail-fast: false
                  matrix:
                    channel: [bidi-chromium, moz-firefox-nightly]
                    isPullRequest:
                    - ${{ github.event_name == 'pull_request' }}
                    exclude:
                    - isPullRequest: true
                      channel: bidi-chromium
                steps: [{run: echo}]
            """)
    )
    wf_ = load_workflow(path)
    for event, channels in [
        ("schedule", ["bidi-chromium", "moz-firefox-nightly"]),
        ("pull_request", ["moz-firefox-nightly"]),
    ]:
        legs = plan(wf_, event, github={"event_name": event}).jobs
        assert [j.matrix["channel"] for j in legs if j.matrix] == channels, event


def test_matrix_leg_names_as_github_builds_them(repo: Path) -> None:
    """Default leg names as GitHub's JobNameBuilder makes them: the vector
    values' scalars depth first (astral-sh/ruff .github/workflows/
    build-binaries.yml: a matrix of objects), not what an `include` adds to a
    combination (pytest-dev/pytest .github/workflows/test.yml: `build
    (ubuntu-py312)`), all of an `include` entry that fits no combination,
    empty strings and nulls left out, and a name longer than 100 characters
    cut to 97 and `...` (docker/build-push-action .github/workflows/e2e.yml:
    `registry: ''`, and long registry names)."""
    from preloop.workflow import plan

    path = repo / ".github" / "workflows" / "w.yml"
    path.write_text(
        wf("""
            on: push
            jobs:
              windows:
                runs-on: windows-latest
                strategy:
                  matrix:
                    platform:
                      - target: x86_64-pc-windows-msvc
                        arch: x64
                      - target: aarch64-pc-windows-msvc
                        arch: x64
                        extra: [~, [true, 3]]
                steps: [{run: echo}]
              test:
                runs-on: ${{ matrix.os }}
                strategy:
                  matrix:
                    name: [ubuntu-py312, doctesting]
                    include:
                      - name: ubuntu-py312
                        python: "3.12"
                        os: ubuntu-latest
                        use_coverage: true
                      - name: doctesting
                        python: "3.10"
                        os: ubuntu-latest
                steps: [{run: echo}]
              build:
                runs-on: ubuntu-latest
                strategy:
                  matrix:
                    include:
                      - name: Docker Hub
                        registry: ''
                        slug: dockereng/build-push-action-test
                      - name: AWS ECR
                        registry: 175142243308.dkr.ecr.us-east-2.amazonaws.com
                        slug: 175142243308.dkr.ecr.us-east-2.amazonaws.com/sandbox/test
                steps: [{run: echo}]
            """)
    )
    assert [j.name for j in plan(load_workflow(path), "push").jobs] == [
        "windows (x86_64-pc-windows-msvc, x64)",
        "windows (aarch64-pc-windows-msvc, x64, true, 3)",
        "test (ubuntu-py312)",
        "test (doctesting)",
        "build (Docker Hub, dockereng/build-push-action-test)",
        "build (AWS ECR, 175142243308.dkr.ecr.us-east-2.amazonaws.com, "
        "175142243308.dkr.ecr.us-east-2.amaz...",
    ]


# GitHub's reader test data round-to-infinity.yml: numbers beyond a double
# round to +-Infinity and are kept (a timeout that is not positive is no limit
# for a step and the default 360 minutes for a job).
ROUND_TO_INFINITY = """\
on: push
jobs:
  pos:
    runs-on: ubuntu-latest
    timeout-minutes: +{big}
    steps: [{{run: echo pos}}]
  neg:
    runs-on: ubuntu-latest
    timeout-minutes: -{big}
    steps: [{{run: echo neg}}]
  dec:
    runs-on: ubuntu-latest
    timeout-minutes: +{big}.12
    steps: [{{run: echo dec}}]
  nan:
    runs-on: ubuntu-latest
    timeout-minutes: ${{{{ NaN }}}}
    steps: [{{run: echo nan}}]
  steps:
    runs-on: [ubuntu-latest]
    steps:
      - run: echo step-pos
        timeout-minutes: {big}
      - run: echo step-neg
        timeout-minutes: -{big}
      - run: echo step-zero
        timeout-minutes: 0
""".format(big="9" * 400)


def test_round_to_infinity_timeouts_plan_and_run(tmp_path: Path, store_url: str) -> None:
    from preloop.workflow import plan

    repo = make_repo(tmp_path / "repo", workflow(ROUND_TO_INFINITY))
    p = plan(load_workflow(repo / ".github" / "workflows" / "ci.yml"), "push")
    timeouts = {j.id: j.timeout_minutes for j in p.jobs}
    assert timeouts == {
        "pos": float("inf"),
        "neg": 360.0,
        "dec": float("inf"),
        "nan": 360.0,
        "steps": 360.0,
    }
    outcome, h = run_engine(repo, store_url, tmp_path / "state")
    assert set(results(outcome).values()) == {"success"}, h.all_text()
    for word in ("step-pos", "step-neg", "step-zero"):
        assert word in h.lines["steps"], h.all_text()
