"""GitHub's template features: `${{ insert }}` in mappings, matrix vector
items that evaluate to arrays (spliced), expression matrix keys (evaluated
when the job starts); validated like GitHub's parser, run on both stores."""

from __future__ import annotations

from pathlib import Path

import pytest
from tests.actions_support import JS_ACTION, publish_action
from tests.run_support import make_repo, results, run_engine, workflow

from preloop.workflow import PlanError, WorkflowError, load_workflow, plan
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
      extra: ${{ fromJSON(steps.s.outputs.more).extra }}
      other: ${{ fromJSON(steps.s.outputs.more).other }}
    defaults:
      run:
        ${{ insert }}: ${{ fromJSON('{"working-directory":"sub","shell":"bash"}') }}
    steps:
      - id: s
        run: echo 'more={"extra":"e1","other":"o2"}' >> "$GITHUB_OUTPUT"
      - run: echo "marker=$(cat marker.txt) shell=${BASH_VERSION:+bash}"
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


def test_insert_in_step_with_and_defaults_run_runs(
    tmp_path: Path, store_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`${{ insert }}` in a `uses` step's `with:` (a JavaScript action's
    INPUT_*, a composite action's inputs), in a job's `defaults.run`, and in
    both workflow and job `env` (each keeps its insertion; the job's names
    win). Job `outputs` refuse it, as GitHub does (test_insert_placement)."""
    remotes = tmp_path / "remotes"
    publish_action(remotes, "acme/greet", JS_ACTION)
    monkeypatch.setenv("PRELOOP_ACTIONS_URL", f"file://{remotes}")
    monkeypatch.delenv("PRELOOP_ACTION_OVERRIDES", raising=False)
    files = {
        **workflow(INSERT_ELSEWHERE),
        ".github/actions/comp/action.yml": COMPOSITE,
        "sub/marker.txt": "in-sub",
    }
    repo = make_repo(tmp_path / "repo", files)
    outcome, h = run_engine(repo, store_url, tmp_path / "state")
    assert results(outcome) == {"make": "success", "use": "success"}, h.all_text()
    assert any("main: Hi inserted" in line for line in h.lines["make"]), h.lines["make"]
    assert "comp word=Hi inserted" in h.lines["make"], h.lines["make"]
    assert "marker=in-sub shell=bash" in h.lines["make"], h.lines["make"]
    assert "outs=p-e1-o2" in h.lines["use"], h.lines["use"]
    assert "envs=wf-wi-from-job-ji" in h.lines["use"], h.lines["use"]


STRATEGY_INSERT = """\
on:
  workflow_dispatch:
    inputs:
      strategy: {type: string, required: true}
jobs:
  gen:
    runs-on: ubuntu-latest
    outputs:
      strategy: ${{ steps.s.outputs.strategy }}
    steps:
      - id: s
        run: echo 'strategy={"matrix":{"n":[1,2]},"max-parallel":1}' >> "$GITHUB_OUTPUT"
  known:
    runs-on: ubuntu-latest
    strategy:
      ${{ insert }}: ${{ fromJSON(inputs.strategy) }}
      fail-fast: false
    steps:
      - run: echo "known ${{ matrix.os }} ${{ strategy.fail-fast }} ${{ strategy.max-parallel }}"
  later:
    needs: gen
    runs-on: ubuntu-latest
    strategy:
      ${{ insert }}: ${{ fromJSON(needs.gen.outputs.strategy) }}
      fail-fast: false
    steps:
      - run: echo "later ${{ matrix.n }} ${{ strategy.job-index }}/${{ strategy.job-total }}"
  bad:
    needs: gen
    runs-on: ubuntu-latest
    strategy:
      ${{ insert }}: ${{ needs.gen.outputs.strategy }}
    steps: [{run: echo never}]
"""


def test_insert_in_strategy_runs(tmp_path: Path, store_url: str) -> None:
    """`${{ insert }}` directly under `strategy:` (as GitHub takes it): from
    `inputs` it is expanded when planning, from `needs` when the job's needs
    end (as a deferred matrix is), each merged with what is written beside
    it. An insert that is not a mapping (a string here) fails its job with
    the reason."""
    repo = make_repo(tmp_path / "repo", workflow(STRATEGY_INSERT))
    given = '{"matrix":{"os":["l","m"]},"max-parallel":1}'
    outcome, h = run_engine(
        repo,
        store_url,
        tmp_path / "state",
        event="workflow_dispatch",
        inputs={"strategy": given},
    )
    # The deferred job itself (`later`) stays as the place its legs came from.
    r = {k: v for k, v in results(outcome).items() if k != "later"}
    assert {k: v for k, v in r.items() if k != "bad"} == {
        "gen": "success",
        "known#0": "success",
        "known#1": "success",
        "later#0": "success",
        "later#1": "success",
    }, h.all_text()
    assert r["bad"] == "failure", r
    text = h.all_text()
    assert "known l false 1" in text and "known m false 1" in text, text
    assert "later 1 0/2" in text and "later 2 1/2" in text, text
    reason = next(j.reason for j in outcome.jobs if j.id == "bad")
    assert reason is not None and "`${{ insert }}` needs a mapping" in reason, reason
    assert "\n" not in reason, reason


def test_insert_in_strategy_plans(tmp_path: Path) -> None:
    """Known when planning: the cohort takes the inserted `max-parallel` and
    the written `fail-fast`; an inserted non-mapping or unknown key is a
    one-line plan error naming the job."""
    wf = tmp_path / ".github" / "workflows" / "w.yml"
    wf.parent.mkdir(parents=True)
    wf.write_text(STRATEGY_INSERT)
    loaded = load_workflow(wf)
    p = plan(
        loaded,
        "workflow_dispatch",
        inputs={"strategy": '{"matrix":{"a":[1,2,3]},"max-parallel":2}'},
    )
    known = [j for j in p.jobs if j.base_id == "known"]
    assert [j.matrix for j in known] == [{"a": 1}, {"a": 2}, {"a": 3}]
    assert [(c.id, c.max_parallel, c.fail_fast, c.total) for c in p.cohorts] == [
        ("known", 2, False, 3)
    ]
    assert {j.id: j.kind for j in p.jobs if j.base_id != "known"} == {
        "gen": "job",
        "later": "deferred",
        "bad": "deferred",
    }
    for given, message in [
        ('"x"', "needs a mapping"),
        ('{"matrix":{"a":[1]},"bogus":1}', "unknown key 'bogus' in `strategy`"),
        ('{"max-parallel":"x"}', '`max-parallel` is "x", not a finite number'),
    ]:
        with pytest.raises(PlanError) as info:
            plan(loaded, "workflow_dispatch", inputs={"strategy": given})
        assert message in str(info.value) and "job 'known'" in str(info.value)
        assert "\n" not in str(info.value)


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


# Where `${{ insert }}` may stand, as GitHub's parser says (each case was
# checked against @actions/workflow-parser; tests/test_workflow_differential.py
# compares the placements again with node): (job keys, the error's line:col
# or None when accepted). The insert sits on line 6, column 7 (9 or 11 deeper).
INSERT = "${{ insert }}: ${{ fromJSON('{}') }}"
INSERT_PLACEMENTS = [
    (f"    defaults:\n      run:\n        {INSERT}", None),
    (f"    container:\n      image: i\n      {INSERT}", None),
    (f"    container:\n      image: i\n      credentials:\n        {INSERT}", None),
    (f"    services:\n      db:\n        image: i\n        {INSERT}", None),
    (f"    services:\n      db:\n        image: i\n        env:\n          {INSERT}", None),
    (f"    strategy:\n      matrix:\n        a: [1]\n        {INSERT}", None),
    (f"    strategy:\n      {INSERT}\n      fail-fast: false", None),
    (f"    strategy:\n      {INSERT}\n      matrix:\n        a: [1]", None),
    ("    strategy:\n      ${{ insert }}: ${{ fromJSON(steps.s.outputs.x) }}", (6, 22)),
    ("    strategy:\n      ${{ insert }}: ${{ matrix.x }}", (6, 22)),
    (f"    env:\n      {INSERT}", None),
    (f"    outputs:\n      {INSERT}", (6, 7)),
    (f"    defaults:\n      {INSERT}", (6, 7)),
    (f"    services:\n      {INSERT}", (6, 7)),
    (f"    environment:\n      name: e\n      {INSERT}", (7, 7)),
    (f"    concurrency:\n      group: g\n      {INSERT}", (7, 7)),
    (f"    {INSERT}", (5, 5)),
]


@pytest.mark.parametrize(("job_keys", "error_at"), INSERT_PLACEMENTS)
def test_insert_placement_follows_the_schema(
    tmp_path: Path, job_keys: str, error_at: tuple[int, int] | None
) -> None:
    wf = tmp_path / ".github" / "workflows" / "w.yml"
    wf.parent.mkdir(parents=True)
    wf.write_text(
        f"on: push\njobs:\n  a:\n    runs-on: x\n{job_keys}\n    steps: [{{run: echo}}]\n"
    )
    if error_at is None:
        load_workflow(wf)
        return
    with pytest.raises(WorkflowError) as info:
        load_workflow(wf)
    first = info.value.diagnostics[0]
    assert (first.line, first.column) == error_at, info.value


def test_insert_refused_in_a_reusable_callers_with_and_secrets(tmp_path: Path) -> None:
    """GitHub's schema gives a caller's `with:` and `secrets:` mappings no
    context, so neither takes `${{ insert }}` (nor an expression key)."""
    wf = tmp_path / ".github" / "workflows" / "w.yml"
    wf.parent.mkdir(parents=True)
    (wf.parent / "callee.yml").write_text(
        "on:\n  workflow_call:\n    inputs:\n      who: {type: string}\n"
        "jobs:\n  a:\n    runs-on: x\n    steps: [{run: echo}]\n"
    )
    wf.write_text(
        "on: push\njobs:\n  call:\n    uses: ./.github/workflows/callee.yml\n"
        f"    with:\n      {INSERT}\n    secrets:\n      {INSERT}\n"
    )
    with pytest.raises(WorkflowError) as info:
        load_workflow(wf)
    assert [(d.line, d.column) for d in info.value.diagnostics] == [(6, 7), (8, 7)]
    assert "not allowed as a key" in str(info.value)


def test_an_insert_is_checked_once(tmp_path: Path) -> None:
    """An insert's expression is checked where it stands, once (container and
    services values are read twice: their shape, and their templates)."""
    wf = tmp_path / ".github" / "workflows" / "w.yml"
    wf.parent.mkdir(parents=True)
    bad = "${{ insert }}: ${{ fromJSON(foo.x) }}"
    wf.write_text(
        f"on: push\njobs:\n  a:\n    runs-on: x\n    container:\n      image: i\n      {bad}\n"
        f"    services:\n      db:\n        image: i\n        {bad}\n"
        f"    defaults:\n      run:\n        {bad}\n    steps: [{{run: echo}}]\n"
    )
    with pytest.raises(WorkflowError) as info:
        load_workflow(wf)
    assert [(d.line, d.column) for d in info.value.diagnostics] == [(7, 22), (11, 24), (14, 24)]
