"""`success('a')` / `failure('a', 'b')` in a job's `if:` look at the named
needs only (not every ancestor), on both stores."""

from __future__ import annotations

from pathlib import Path

import pytest
from tests.run_support import make_repo, results, run_engine, workflow

from preloop.control.conditions import ExpressionError, should_run

pytest_plugins = ["preloop.testing.control_fixtures"]

WORKFLOW = """\
on: push
jobs:
  ok:
    runs-on: ubuntu-latest
    steps: [{run: echo ok}]
  bad:
    runs-on: ubuntu-latest
    steps: [{run: exit 1}]
  after-bad:
    needs: bad
    runs-on: ubuntu-latest
    steps: [{run: echo never}]
  ok-succeeded:
    needs: [ok, bad]
    if: success('ok')
    runs-on: ubuntu-latest
    steps: [{run: echo ran-ok-succeeded}]
  all-succeeded:
    needs: [ok, bad]
    if: ${{ success('OK', 'bad') }}
    runs-on: ubuntu-latest
    steps: [{run: echo never}]
  bad-failed:
    needs: [ok, bad]
    if: failure('bad')
    runs-on: ubuntu-latest
    steps: [{run: echo ran-bad-failed}]
  ok-failed:
    needs: [ok, bad]
    if: failure('ok')
    runs-on: ubuntu-latest
    steps: [{run: echo never}]
  skipped-need:
    needs: [ok, after-bad]
    if: failure('after-bad') || success('after-bad')
    runs-on: ubuntu-latest
    steps: [{run: echo never}]
  unknown:
    needs: ok
    if: success('bad')
    runs-on: ubuntu-latest
    steps: [{run: echo never}]
"""


def test_status_functions_look_at_the_named_jobs(tmp_path: Path, store_url: str) -> None:
    repo = make_repo(tmp_path / "repo", workflow(WORKFLOW))
    outcome, h = run_engine(repo, store_url, tmp_path / "state")
    r = results(outcome)
    assert r == {
        "ok": "success",
        "bad": "failure",
        "after-bad": "skipped",
        "ok-succeeded": "success",
        "all-succeeded": "skipped",
        "bad-failed": "success",
        "ok-failed": "skipped",
        "skipped-need": "skipped",
        "unknown": "failure",
    }, r
    assert "ran-ok-succeeded" in h.lines["ok-succeeded"]
    assert "ran-bad-failed" in h.lines["bad-failed"]
    unknown = next(j for j in outcome.jobs if j.id == "unknown")
    assert "'bad' is not one of this job's needs ('ok')" in str(unknown.reason), unknown.reason


NEEDS = {"needs": {"a": {"result": "success"}, "b": {"result": "failure"}}}


@pytest.mark.parametrize(
    ("expr", "status", "expected"),
    [
        ("success('a')", "failure", True),
        ("success('A', 'b')", "failure", False),
        ("failure('b')", "failure", True),
        ("failure('a')", "failure", False),
        ("failure('a') || failure('b')", "failure", True),
        # A cancelled run: both are false, as without arguments.
        ("success('a')", "cancelled", False),
        ("failure('b')", "cancelled", False),
        ("always() && success('a')", "cancelled", False),
        # No arguments: the aggregate status, as before.
        ("success()", "failure", False),
        ("failure()", "failure", True),
    ],
)
def test_should_run_with_named_jobs(expr: str, status: str, expected: bool) -> None:
    assert should_run(expr, NEEDS, status) is expected


def test_a_name_that_is_not_a_need_is_an_error() -> None:
    with pytest.raises(ExpressionError, match="'c' is not one of this job's needs"):
        should_run("success('c')", NEEDS, "success")


def test_named_jobs_inside_a_reusable_workflow_and_a_matrix_need(
    tmp_path: Path, store_url: str
) -> None:
    files = {
        ".github/workflows/ci.yml": """\
on: push
jobs:
  call:
    uses: ./.github/workflows/callee.yml
""",
        ".github/workflows/callee.yml": """\
on: workflow_call
jobs:
  legs:
    runs-on: ubuntu-latest
    strategy:
      matrix:
        n: [1, 2]
    steps: [{run: "test ${{ matrix.n }} = 1"}]
  fine:
    runs-on: ubuntu-latest
    steps: [{run: echo fine}]
  report:
    needs: [legs, fine]
    if: failure('legs') && success('fine')
    runs-on: ubuntu-latest
    steps: [{run: echo ran-report}]
""",
    }
    repo = make_repo(tmp_path / "repo", files)
    outcome, h = run_engine(repo, store_url, tmp_path / "state")
    r = results(outcome)
    assert r["call/report"] == "success", (r, h.all_text())
    assert "ran-report" in h.lines["call/report"]
