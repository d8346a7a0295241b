"""Plans from real workflow files (`preloop.workflow.plan`) through both
stores: deferred matrices expanded with `expand_deferred`, inside reusable
workflows and as matrices of reusable callers."""

from __future__ import annotations

import textwrap
from pathlib import Path

from preloop.control import Store
from preloop.testing.plans import drive
from preloop.workflow import load_workflow, plan

CALLEE = """
on:
  workflow_call:
    outputs:
      first: {value: "${{ jobs.run.outputs.v }}"}
jobs:
  gen:
    runs-on: linux
    outputs: {m: "${{ steps.s.outputs.m }}"}
    steps: [{id: s, run: echo}]
  run:
    needs: gen
    runs-on: linux
    outputs: {v: "${{ steps.s.outputs.v }}"}
    strategy:
      matrix:
        t: ${{ fromJSON(needs.gen.outputs.m) }}
    steps: [{id: s, run: echo}]
  after:
    needs: run
    if: always()
    runs-on: linux
    steps: [{run: echo}]
"""

LEAF = "on: workflow_call\njobs:\n  leaf:\n    runs-on: linux\n    steps: [{run: b}]\n"


def write(repo: Path, name: str, text: str) -> Path:
    p = repo / ".github" / "workflows" / name
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(textwrap.dedent(text).lstrip("\n"))
    return p


def test_deferred_matrix_inside_reusable_workflow(store: Store, tmp_path: Path) -> None:
    write(tmp_path, "callee.yml", CALLEE)
    wf = write(
        tmp_path,
        "ci.yml",
        "on: push\njobs:\n  c:\n    uses: ./.github/workflows/callee.yml\n"
        "  report:\n    needs: c\n    runs-on: linux\n"
        "    if: needs.c.outputs.first == 'leg'\n    steps: [{run: echo}]\n",
    )
    p = plan(load_workflow(wf, root=tmp_path), "push")
    run_id = store.submit_run(p)

    def outcome(lease: object) -> tuple[str, dict[str, str]]:
        job_id = lease.job_id  # type: ignore[attr-defined]
        if job_id == "c/gen":
            return "success", {"m": "[1, 2, 3]"}
        if job_id.startswith("c/run#"):
            return "success", {"v": "leg"}
        return "success", {}

    store.counters.reset()
    res = drive(store, p, run_id, outcome, labels=["linux"])
    assert store.counters.snapshot().graph_loads == 0
    assert res.dispatched == ["c/gen", "c/run#0", "c/run#1", "c/run#2", "c/after", "report"]
    caller = store.get_job(run_id, "c")
    assert caller.conclusion == "success" and caller.outputs == {"first": "leg"}
    assert caller.inner_job_ids == ("c/gen", "c/run#0", "c/run#1", "c/run#2", "c/after")
    assert store.get_run(run_id).conclusion == "success"


def test_deferred_matrix_of_reusable_callers(store: Store, tmp_path: Path) -> None:
    write(tmp_path, "callee.yml", LEAF)
    wf = write(
        tmp_path,
        "ci.yml",
        """
        on: push
        jobs:
          gen:
            runs-on: linux
            outputs: {n: "${{ steps.s.outputs.n }}"}
            steps: [{id: s, run: echo}]
          fan:
            needs: gen
            strategy:
              matrix:
                n: ${{ fromJSON(needs.gen.outputs.n) }}
            uses: ./.github/workflows/callee.yml
          done:
            needs: fan
            runs-on: linux
            steps: [{run: echo}]
        """,
    )
    p = plan(load_workflow(wf, root=tmp_path), "push")
    run_id = store.submit_run(p)

    def outcome(lease: object) -> tuple[str, dict[str, str]]:
        job_id = lease.job_id  # type: ignore[attr-defined]
        return "success", ({"n": "[7, 8]"} if job_id == "gen" else {})

    res = drive(store, p, run_id, outcome, labels=["linux"])
    assert res.dispatched == ["gen", "fan#0/leaf", "fan#1/leaf", "done"]
    assert store.get_job(run_id, "fan#0").conclusion == "success"
    assert store.get_job(run_id, "fan").inner_job_ids == ("fan#0", "fan#1")
    assert store.get_run(run_id).conclusion == "success"


def test_matrix_keys_keep_their_written_order(store: Store, tmp_path: Path) -> None:
    """A matrix's keys as written name its legs and order the leg's
    `matrix` (what `toJSON(matrix)` prints), for a matrix known at plan time
    and for one waiting for its needs alike: the store keeps JSON keys in
    their order rather than sorting them."""
    wf = write(
        tmp_path,
        "ci.yml",
        """
        on: push
        jobs:
          gen:
            runs-on: linux
            outputs: {m: "${{ steps.s.outputs.m }}"}
            steps: [{id: s, run: echo}]
          now:
            runs-on: linux
            strategy:
              matrix: {zz: [x], aa: [p], mm: [{zeta: "1", alpha: a}]}
            steps: [{run: echo}]
          later:
            needs: gen
            runs-on: linux
            strategy:
              matrix:
                zz: [x]
                aa: ${{ fromJSON(needs.gen.outputs.m) }}
            steps: [{run: echo}]
        """,
    )
    p = plan(load_workflow(wf, root=tmp_path), "push")
    run_id = store.submit_run(p)
    matrices: dict[str, list[str]] = {}

    def outcome(lease: object) -> tuple[str, dict[str, str]]:
        matrix = lease.matrix  # type: ignore[attr-defined]
        if matrix:
            matrices[lease.name] = list(matrix)  # type: ignore[attr-defined]
            if "mm" in matrix:
                matrices["mm"] = list(matrix["mm"])
        return "success", {"m": '[{"zeta": "2", "alpha": "b"}]'}

    drive(store, p, run_id, outcome, labels=["linux"])
    assert matrices == {
        "now (x, p, 1, a)": ["zz", "aa", "mm"],
        "mm": ["zeta", "alpha"],
        "later (x, 2, b)": ["zz", "aa"],
    }
