"""GitHub's template features: `${{ insert }}` in mappings, matrix vector
items that evaluate to arrays (spliced), expression matrix keys (evaluated
when the job starts); validated like GitHub's parser, run on both stores."""

from __future__ import annotations

from pathlib import Path

import pytest
from tests.actions_support import JS_ACTION, publish_action
from tests.run_support import make_repo, results, run_engine, workflow

from preloop.workflow import load_workflow, plan
from preloop.workflow.templates import WHOLE, evaluate_data, is_insert, mapping_items, overlay

pytest_plugins = ["preloop.testing.control_fixtures"]

WORKFLOW = """\
on: push
jobs:
  gen:
    runs-on: ubuntu-latest
    outputs:
      env: ${{ steps.s.outputs.env }}
      axis: ${{ steps.s.outputs.axis }}
    steps:
      - id: s
        run: |
          echo 'env={"FROM_NEEDS":"yes","N":3}' >> "$GITHUB_OUTPUT"
          echo 'axis=flavour' >> "$GITHUB_OUTPUT"
  use:
    needs: gen
    runs-on: ubuntu-latest
    env:
      A: a
      ${{ insert }}: ${{ fromJSON(needs.gen.outputs.env) }}
    strategy:
      matrix:
        ${{ needs.gen.outputs.axis }}: [a, "${{ fromJSON('[\\"b\\", \\"c\\"]') }}"]
    steps:
      - run: echo "leg $A $FROM_NEEDS $N ${{ matrix.flavour }} $S"
        env:
          ${{ insert }}: ${{ fromJSON('{"S":"s1"}') }}
"""


def test_insert_spliced_vector_and_expression_key_run(tmp_path: Path, store_url: str) -> None:
    repo = make_repo(tmp_path / "repo", workflow(WORKFLOW))
    outcome, h = run_engine(repo, store_url, tmp_path / "state")
    r = results(outcome)
    legs = sorted(k for k in r if k.startswith("use#"))
    assert legs == ["use#0", "use#1", "use#2"] and all(r[k] == "success" for k in legs), r
    text = h.all_text()
    for v in ("a", "b", "c"):
        assert f"leg a yes 3 {v} s1" in text


INSERT_ELSEWHERE = """\
on: push
env:
  WA: wf
  ${{ insert }}: ${{ fromJSON('{"WI":"wi","OVER":"from-wf"}') }}
jobs:
  make:
    runs-on: ubuntu-latest
    outputs:
      plain: p
      ${{ insert }}: ${{ fromJSON(steps.s.outputs.more) }}
    steps:
      - id: s
        run: echo 'more={"extra":"e1","other":"o2"}' >> "$GITHUB_OUTPUT"
      - id: g
        uses: acme/greet@v1
        with:
          greeting: Hi
          ${{ insert }}: ${{ fromJSON('{"who":"inserted"}') }}
      - uses: ./.github/actions/comp
        with:
          ${{ insert }}: ${{ fromJSON(format('{{"word":"{0}"}}', steps.g.outputs.message)) }}
  use:
    needs: make
    runs-on: ubuntu-latest
    env:
      OVER: from-job
      ${{ insert }}: ${{ fromJSON('{"JI":"ji"}') }}
    steps:
      - run: echo "envs=$WA-$WI-$OVER-$JI"
      - run: echo "outs=$P-$E-$O"
        env:
          P: ${{ needs.make.outputs.plain }}
          E: ${{ needs.make.outputs.extra }}
          O: ${{ needs.make.outputs.other }}
"""

COMPOSITE = """\
name: comp
inputs:
  word: {required: true}
runs:
  using: composite
  steps:
    - run: echo "comp word=${{ inputs.word }}"
      shell: bash
"""


def test_insert_in_step_with_and_job_outputs_runs(
    tmp_path: Path, store_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`${{ insert }}` in a `uses` step's `with:` (a JavaScript action's
    INPUT_*, a composite action's inputs), in job `outputs`, and in both
    workflow and job `env` (each keeps its insertion; the job's names win)."""
    remotes = tmp_path / "remotes"
    publish_action(remotes, "acme/greet", JS_ACTION)
    monkeypatch.setenv("PRELOOP_ACTIONS_URL", f"file://{remotes}")
    monkeypatch.delenv("PRELOOP_ACTION_OVERRIDES", raising=False)
    files = {**workflow(INSERT_ELSEWHERE), ".github/actions/comp/action.yml": COMPOSITE}
    repo = make_repo(tmp_path / "repo", files)
    outcome, h = run_engine(repo, store_url, tmp_path / "state")
    assert results(outcome) == {"make": "success", "use": "success"}, h.all_text()
    assert any("main: Hi inserted" in line for line in h.lines["make"]), h.lines["make"]
    assert "comp word=Hi inserted" in h.lines["make"], h.lines["make"]
    assert "outs=p-e1-o2" in h.lines["use"], h.lines["use"]
    assert "envs=wf-wi-from-job-ji" in h.lines["use"], h.lines["use"]


def test_static_parts_plan_without_needs(tmp_path: Path) -> None:
    wf = tmp_path / ".github" / "workflows" / "w.yml"
    wf.parent.mkdir(parents=True)
    wf.write_text(
        """\
on: push
jobs:
  m:
    runs-on: x
    strategy:
      matrix:
        ${{ github.event_name == 'push' && 'os' || 'no' }}: [linux, "${{ fromJSON('[1, 2]') }}"]
        include:
          - ${{ insert }}: ${{ fromJSON('{"extra":true}') }}
    steps: [{run: echo}]
"""
    )
    p = plan(load_workflow(wf), "push")
    assert [j.matrix for j in p.jobs] == [
        {"os": "linux", "extra": True},
        {"os": 1, "extra": True},
        {"os": 2, "extra": True},
    ]


def test_helpers() -> None:
    assert is_insert("${{ insert }}") and is_insert("${{insert}}") and not is_insert("insert")
    ctx = {"inputs": {"k": "key", "more": [2, 3]}}
    data = {"${{ inputs.k }}": [1, "${{ inputs.more }}", "x-${{ inputs.k }}"]}
    assert evaluate_data(data, ctx, splice=True) == {"key": [1, 2, 3, "x-key"]}
    assert evaluate_data(data, ctx) == {"key": [1, [2, 3], "x-key"]}
    items = list(
        mapping_items(
            {"A": "1", "${{ insert }}": "${{ x }}", "${{ k }}": "v"},
            lambda v: {"${{ x }}": {"B": 2}, "${{ k }}": "K"}[v],
        )
    )
    assert items == [("A", "1", False), ("B", 2, True), ("K", "v", False)]
    ins = "${{ insert }}"
    merged = overlay({"A": "1", ins: "x", "B": "2"}, {"A": "3", ins: "y", WHOLE: "z"})
    assert list(merged.items()) == [
        (ins, "x"),
        ("B", "2"),
        ("A", "3"),
        (ins + " ", "y"),
        (WHOLE, "z"),
    ]


CALLEE = """\
on:
  workflow_call:
    inputs:
      flag: {type: boolean, required: true}
      who: {type: string, default: nobody}
    secrets:
      token: {required: true}
jobs:
  speak:
    runs-on: ubuntu-latest
    steps:
      - run: echo "who=${{ inputs.who }} flag=${{ inputs.flag == true }} token-len=${#T}"
        env:
          T: ${{ secrets.token }}
"""

CALLERS = """\
on: push
jobs:
  setup:
    runs-on: ubuntu-latest
    outputs:
      inputs: ${{ steps.o.outputs.inputs }}
      bad: ${{ steps.o.outputs.bad }}
      partial: ${{ steps.o.outputs.partial }}
    steps:
      - id: o
        run: |
          echo 'inputs={"flag":true,"who":"from-needs"}' >> "$GITHUB_OUTPUT"
          echo 'bad={"nope":1}' >> "$GITHUB_OUTPUT"
          echo 'partial={"who":"w"}' >> "$GITHUB_OUTPUT"
  static:
    uses: ./.github/workflows/callee.yml
    with:
      ${{ insert }}: ${{ fromJSON('{"flag":true,"who":"static"}') }}
    secrets:
      ${{ insert }}: ${{ fromJSON(format('{{"token":"t-{0}"}}', secrets.MINE)) }}
  late:
    needs: setup
    uses: ./.github/workflows/callee.yml
    with:
      ${{ insert }}: ${{ fromJSON(needs.setup.outputs.inputs) }}
    secrets: inherit
  undeclared:
    needs: setup
    uses: ./.github/workflows/callee.yml
    with:
      flag: true
      ${{ insert }}: ${{ fromJSON(needs.setup.outputs.bad) }}
    secrets: inherit
  missing:
    needs: setup
    uses: ./.github/workflows/callee.yml
    with:
      ${{ insert }}: ${{ fromJSON(needs.setup.outputs.partial) }}
    secrets: inherit
"""


def test_insert_in_a_reusable_callers_with_and_secrets(tmp_path: Path, store_url: str) -> None:
    files = {
        ".github/workflows/ci.yml": CALLERS,
        ".github/workflows/callee.yml": CALLEE,
    }
    repo = make_repo(tmp_path / "repo", files)
    outcome, h = run_engine(
        repo, store_url, tmp_path / "state", secrets={"MINE": "m1", "token": "inherited"}
    )
    r = results(outcome)
    assert r["static/speak"] == "success" and r["late/speak"] == "success", h.all_text()
    assert "who=static flag=true token-len=4" in h.lines["static/speak"]
    assert "who=from-needs flag=true token-len=9" in h.lines["late/speak"]
    assert r["undeclared"] == "failure", r
    undeclared = next(j for j in outcome.jobs if j.id == "undeclared")
    assert "input 'nope' is not declared" in str(undeclared.reason), undeclared.reason
    assert r["missing"] == "failure", r
    missing = next(j for j in outcome.jobs if j.id == "missing")
    assert "requires input 'flag'" in str(missing.reason), missing.reason
