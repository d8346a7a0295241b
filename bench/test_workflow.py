"""Workflow model benchmarks, side by side with GitHub's own TypeScript
implementations (`@actions/workflow-parser`, `@actions/expressions`, timed
inside node by tests/js/bench_oracle.mjs) and reported as ratios.

- parse + validate + plan a 256-leg matrix workflow;
- parse + validate + plan a 500-job DAG;
- expression evaluations per second (parse + evaluate, no parse cache).

Run: `pytest bench/test_workflow.py --benchmark-only`.
"""

from __future__ import annotations

import json
import random
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from preloop.workflow import expressions as ex
from preloop.workflow import load_workflow, plan

ROOT = Path(__file__).resolve().parent.parent
ORACLE = ROOT / "tests" / "js" / "bench_oracle.mjs"
HAVE_NODE = shutil.which("node") is not None and (ROOT / "node_modules" / "@actions").is_dir()


def matrix_workflow() -> str:
    xs = ", ".join(str(i) for i in range(16))
    return f"""on: push
jobs:
  test:
    name: test
    runs-on: ${{{{ matrix.os }}}}
    concurrency: t-${{{{ matrix.x }}}}-${{{{ matrix.y }}}}
    strategy:
      max-parallel: 8
      matrix:
        os: [linux]
        x: [{xs}]
        y: [{xs}]
    steps:
      - uses: actions/checkout@v4
      - run: echo ${{{{ matrix.x }}}} ${{{{ matrix.y }}}}
        env:
          X: ${{{{ matrix.x }}}}
"""


def dag_workflow(n: int = 500) -> str:
    r = random.Random(500)
    lines = ["on: push", "jobs:"]
    for i in range(n):
        lines.append(f"  j{i}:")
        if i:
            needs = sorted({f"j{r.randrange(i)}" for _ in range(r.randint(1, 3))})
            lines.append(f"    needs: [{', '.join(needs)}]")
            lines.append("    if: ${{ success() && github.event_name == 'push' }}")
        lines.append("    runs-on: ubuntu-latest")
        lines.append("    steps:")
        lines.append(f"      - run: echo {i}")
    return "\n".join(lines) + "\n"


def node_seconds(payload: dict[str, Any]) -> float | None:
    if not HAVE_NODE:
        return None
    proc = subprocess.run(
        ["node", str(ORACLE)],
        input=json.dumps(payload),
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
    )
    return float(json.loads(proc.stdout)["seconds_per_repeat"])


def report(benchmark: Any, node: float | None, **extra: Any) -> None:
    ours = benchmark.stats.stats.mean
    benchmark.extra_info.update(extra)
    benchmark.extra_info["preloop_seconds"] = ours
    if node is not None:
        benchmark.extra_info["node_seconds"] = node
        benchmark.extra_info["preloop_vs_github_ts"] = round(ours / node, 2)


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    (tmp_path / ".github" / "workflows").mkdir(parents=True)
    return tmp_path


@pytest.mark.parametrize("kind", ["matrix256", "dag500"])
def test_parse_and_plan(benchmark: Any, repo: Path, kind: str) -> None:
    text = matrix_workflow() if kind == "matrix256" else dag_workflow()
    path = repo / ".github" / "workflows" / "w.yml"
    path.write_text(text)

    def run() -> int:
        ex.parse.cache_clear()
        return len(plan(load_workflow(path), "push").jobs)

    jobs = benchmark(run)
    assert jobs == (256 if kind == "matrix256" else 500)
    report(benchmark, node_seconds({"kind": "workflow", "content": text, "repeat": 5}), jobs=jobs)


EXPRESSIONS = [
    "github.event_name == 'push' && contains(github.ref, 'main')",
    "matrix.os == 'linux' || startsWith(matrix.node, '2')",
    "format('{0}-{1}-{2}', github.repository, matrix.os, matrix.node)",
    "fromJSON(needs.setup.outputs.matrix).include[0].os",
    "join(needs.*.result, ',')",
    "!contains(needs.*.result, 'cancelled') && needs.build.result != 'failure'",
    "toJSON(matrix)",
    "github.event.pull_request.labels.*.name",
    "contains(github.event.pull_request.labels.*.name, 'ci:full')",
    "endsWith(github.head_ref, '-wip') == false",
    "(matrix.node >= 18) && (matrix.node < 22)",
    "env.CI == 'true' && vars.DEPLOY",
]


def test_expression_evaluations_per_second(benchmark: Any) -> None:
    context = {
        "github": {
            "event_name": "push",
            "ref": "refs/heads/main",
            "head_ref": "feature-wip",
            "repository": "o/r",
            "event": {"pull_request": {"labels": [{"name": "ci:full"}, {"name": "bug"}]}},
        },
        "matrix": {"os": "linux", "node": 20},
        "needs": {
            "setup": {"result": "success", "outputs": {"matrix": '{"include":[{"os":"a"}]}'}},
            "build": {"result": "success", "outputs": {}},
        },
        "env": {"CI": "true"},
        "vars": {"DEPLOY": "yes"},
    }
    # Distinct texts, so every evaluation also parses (the cache is cleared).
    exprs = [f"{e} || {i} == {i + 1}" for i in range(84) for e in EXPRESSIONS]

    def run() -> None:
        ex.parse.cache_clear()
        for e in exprs:
            ex.evaluate(e, context)

    benchmark(run)
    node = node_seconds({"kind": "expressions", "exprs": exprs, "context": context, "repeat": 5})
    report(
        benchmark,
        node,
        expressions=len(exprs),
        evaluations_per_second=round(len(exprs) / benchmark.stats.stats.mean),
    )
