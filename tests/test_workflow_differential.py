"""Differential test: our validation against GitHub's `@actions/workflow-parser`.

Generated invalid workflows (a valid workflow plus one to three mutations:
unknown keys, wrong types, bad steps, caller keys, needs errors, cycles,
expression errors, YAML errors) and hand-written ones are parsed by both.
Wherever GitHub's parser reports an error we must report one too, and our
first error (in file order) must be at the line:col of its first. We are
stricter in places (empty matrix vectors, exclude keys that are not vectors',
undeclared reusable-workflow inputs): the service's parser (actions/runner
src/Sdk/WorkflowParser) reports those, the npm one does not.
node runs once for the whole batch (tests/js/workflow_oracle.mjs).

Documented exceptions (the generator avoids them):
- YAML syntax errors: the two YAML libraries word and place some syntax
  errors differently (PyYAML reports where it noticed the problem, the `yaml`
  package sometimes where the offending construct began). Tabs and unclosed
  flow collections are compared; other syntax errors are only checked to be
  errors on both sides.
- Filters under an event that takes none (`create: {tags: [v*]}`): the npm
  parser reads `on` with the strict schema of GitHub's editors, the service
  with the loose one and runs such a workflow on every event of the kind
  (helm/helm's release.yml does this); we accept it as the service does
  (test_filters_under_an_event_that_takes_none_are_only_refused_by_the_editor).
"""

from __future__ import annotations

import json
import random
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from preloop.workflow import WorkflowError, load_workflow

ROOT = Path(__file__).resolve().parent.parent
ORACLE = ROOT / "tests" / "js" / "workflow_oracle.mjs"

pytestmark = pytest.mark.skipif(
    shutil.which("node") is None or not (ROOT / "node_modules" / "@actions").is_dir(),
    reason="needs node and `npm ci` (the CI installs both)",
)

CALLEE = """on:
  workflow_call:
    inputs:
      who: {type: string, required: false}
jobs:
  inner:
    runs-on: linux
    steps: [{run: echo}]
"""


def q(r: random.Random, s: str) -> str:
    """A scalar, sometimes quoted (positions must agree either way)."""
    k = r.randrange(4)
    if k == 0:
        return f'"{s}"'
    if k == 1:
        return f"'{s}'"
    return s


class Job:
    """A job as (key, block) pairs plus a list of steps (each a list of lines)."""

    def __init__(self) -> None:
        self.keys: list[tuple[str, str]] = []
        self.steps: list[list[str]] | None = []
        self.steps_value: str | None = None

    def set(self, key: str, block: str, r: random.Random | None = None) -> None:
        at = r.randrange(len(self.keys) + 1) if r else len(self.keys)
        self.keys.insert(at, (key, block))

    def drop(self, key: str) -> None:
        self.keys = [(k, b) for k, b in self.keys if k != key]

    def render(self) -> list[str]:
        out = [f"{k}: {b}" if not b.startswith("\n") else f"{k}:{b}" for k, b in self.keys]
        if self.steps_value is not None:
            out.append(f"steps: {self.steps_value}")
        elif self.steps is not None:
            out.append("steps:")
            for step in self.steps:
                out.append("  - " + step[0])
                out.extend("    " + line for line in step[1:])
        return "\n".join(out).split("\n")


class Doc:
    extra = False  # also use EXTRA_MUTATIONS (issue 14's false accepts)

    def __init__(self, r: random.Random) -> None:
        self.r = r
        self.root: list[str] = [f"on: {r.choice(['push', '[push, pull_request]'])}"]
        if r.random() < 0.3:
            self.root.append("name: " + q(r, "CI"))
        if r.random() < 0.3:
            self.root.append("env:\n  A: " + q(r, "1"))
        self.jobs: dict[str, Job] = {}
        ids = r.sample(["build", "test", "lint", "deploy", "docs"], r.randrange(1, 4))
        for i, job_id in enumerate(ids):
            job = Job()
            if i and r.random() < 0.5:
                job.set("needs", ids[r.randrange(i)])
            job.set("runs-on", q(r, r.choice(["ubuntu-latest", "self-hosted"])))
            if r.random() < 0.3:
                job.set("timeout-minutes", "10")
            if r.random() < 0.3:
                job.set("strategy", "\n  matrix:\n    os: [a, b]")
            assert job.steps is not None
            job.steps.append(["run: " + q(r, "echo hi")])
            if r.random() < 0.5:
                job.steps.append(["uses: actions/checkout@v4", "with:", "  fetch-depth: 0"])
            self.jobs[job_id] = job

    def render(self) -> str:
        out = list(self.root)
        out.append("jobs:")
        for job_id, job in self.jobs.items():
            out.append(f"  {job_id}:")
            out.extend("    " + line for line in job.render())
        return "\n".join(out) + "\n"

    def job(self) -> Job:
        return self.jobs[self.r.choice(list(self.jobs))]

    def add_step(self, job: Job, lines: list[str]) -> None:
        if job.steps is not None and job.steps_value is None:
            job.steps.append(lines)

    def mutate(self) -> None:
        r = self.r
        k = r.randrange(32 + len(EXTRA_MUTATIONS)) if self.extra else r.randrange(32)
        job = self.job()
        if k == 0:
            self.root[0] = "on: " + r.choice(["pushh", "[push, nope]"])
        elif k == 1:
            self.root.insert(r.randrange(len(self.root) + 1), "bogus: 1")
        elif k == 2:
            job.set("colour", "red", r)
        elif k == 3:
            self.add_step(job, ["name: " + q(r, "nothing")])
        elif k == 4:
            self.add_step(job, ["run: echo", "uses: actions/checkout@v4"])
        elif k == 5:
            self.add_step(job, ["uses: x/y@v1", "run: echo"])
        elif k == 6:
            self.add_step(job, ["run: echo", "with: {a: b}"])
        elif k == 7:
            self.add_step(job, ["uses: x/y@v1", "shell: bash"])
        elif k == 8:
            job.drop("needs")
            job.set("needs", r.choice(["nope", "[nope]", "{a: 1}"]), r)
        elif k == 9 and len(self.jobs) >= 2:
            a, b = r.sample(list(self.jobs), 2)
            self.jobs[a].drop("needs")
            self.jobs[b].drop("needs")
            self.jobs[a].set("needs", b, r)
            self.jobs[b].set("needs", a, r)
        elif k == 10:
            job.steps_value = q(r, "hello")
        elif k == 11:
            job.set("env", "[A]", r)
        elif k == 12:
            job.drop("timeout-minutes")
            job.set("timeout-minutes", q(r, "soon"), r)
        elif k == 13:
            job.set("continue-on-error", q(r, "maybe"), r)
        elif k == 14:
            job.set("if", r.choice(["${{ 1 + }}", "${{ hashFiles('x') }}", "steps.a.outcome"]), r)
        elif k == 15:
            self.add_step(job, ["run: " + q(r, "echo ${{ foo.bar }}")])
        elif k == 16:
            self.add_step(job, ["run: echo ${{ github.ref"])
        elif k == 17:
            call = Job()
            call.steps = None
            call.set("uses", "./.github/workflows/callee.yml")
            extra = r.choice([("runs-on", "x"), ("timeout-minutes", "3"), ("env", "{A: b}")])
            call.set(*extra, r)
            self.jobs["call"] = call
        elif k == 18:
            job.drop("runs-on")
        elif k == 19:
            job.set("concurrency", "\n  cancel-in-progress: true", r)
        elif k == 20:
            job.drop("strategy")
            job.set("strategy", "\n  fail-fast: " + q(r, "nope") + "\n  matrix:\n    os: linux", r)
        elif k == 21:
            job.set("runs-on", "dup", r)
        elif k == 22 and r.random() < 0.5:
            job.drop("runs-on")
            job.set("runs-on", r.choice(["${{ steps.a.outputs.b }}", "${{ env.X }}"]), r)
        elif k == 22:
            self.root.insert(1, "defaults:\n  run:\n    shelll: bash")
        elif k == 23:
            self.root[0] = "on:\n  push:\n    branchez: main"
        elif k == 24:
            self.root[0] = "on:\n  schedule:\n    - " + r.choice(["crn: x", "cron: [x]", "3"])
        elif k == 25:
            job.set("permissions", r.choice(["bogus", "{contents: maybe}", "[x]"]), r)
        elif k == 26:
            job.set("container", r.choice(["[x]", "3", "{image: x, bogus: 1}"]), r)
        elif k == 27:
            job.set("outputs", r.choice(["[a]", "{a: [b]}"]), r)
        elif k == 28:
            self.add_step(job, ["run: echo", "env: " + r.choice(["3", "[a]", "{A: [1]}"])])
        elif k == 29:
            self.add_step(job, ["uses: " + r.choice(['""', "[x]"])])
        elif k == 30:
            self.add_step(job, ["run: echo", "timeout-minutes: " + q(r, "x")])
        elif k >= 32:
            EXTRA_MUTATIONS[k - 32](self, job)
        else:
            job.set("strategy", r.choice(["3", "\n  matrix: 3", "\n  matrix:\n    include: 3"]), r)


def _dup_job_id(doc: Doc, job: Job) -> None:
    key = next(iter(doc.jobs))
    twin = Job()
    twin.set("runs-on", "x")
    assert twin.steps is not None
    twin.steps.append(["run: echo"])
    doc.jobs[key.upper()] = twin


def _reserved_job_id(doc: Doc, job: Job) -> None:
    twin = Job()
    twin.set("runs-on", "x")
    assert twin.steps is not None
    twin.steps.append(["run: echo"])
    doc.jobs["__reserved"] = twin


EXTRA_MUTATIONS = [
    _dup_job_id,
    _reserved_job_id,
    lambda doc, job: job.set("container", "\n  options: --cpus 1", doc.r),
    lambda doc, job: job.set("services", "\n  db:\n    image: ''", doc.r),
    lambda doc, job: job.set("container", "\n  image: i\n  credentials:\n    user: u", doc.r),
    lambda doc, job: (job.drop("runs-on"), job.set("runs-on", "\n  group: asdf/g", doc.r)),
    lambda doc, job: doc.root.__setitem__(0, "on:\n  pull_request:\n    types: [bogus]"),
    lambda doc, job: doc.root.__setitem__(0, "on:\n  merge_group:\n    tags: [v1]"),
    lambda doc, job: doc.add_step(job, ["id: __x", "run: echo"]),
    lambda doc, job: doc.add_step(job, ["uses: ${{ matrix.a }}"]),
    lambda doc, job: doc.root.insert(1, "defaults:\n  run:\n    shell: ${{ github.sha }}"),
    lambda doc, job: job.set("environment", "\n  name: e\n  url: ${{ secrets.URL }}", doc.r),
    lambda doc, job: doc.root.__setitem__(
        0,
        "on:\n  schedule:\n    - cron: '0 3 * * 1'\n    - cron: "
        + q(doc.r, doc.r.choice(["61 * * * *", "not a cron", "0 0 * * 7", "5-1 0 1 1 1"])),
    ),
]


def ours(repo: Path, text: str) -> list[tuple[int, int, str]]:
    path = repo / ".github" / "workflows" / "w.yml"
    path.write_text(text)
    try:
        load_workflow(path)
    except WorkflowError as exc:
        return [(d.line, d.column, d.message) for d in exc.diagnostics if d.path.endswith("w.yml")]
    return []


def theirs(texts: list[str]) -> list[list[dict[str, Any]]]:
    files = [{"name": ".github/workflows/w.yml", "content": t} for t in texts]
    proc = subprocess.run(
        ["node", str(ORACLE)],
        input=json.dumps(files),
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
    )
    result: list[list[dict[str, Any]]] = json.loads(proc.stdout)
    return result


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    (tmp_path / ".github" / "workflows").mkdir(parents=True)
    (tmp_path / ".github" / "workflows" / "callee.yml").write_text(CALLEE)
    return tmp_path


# Hand-written invalid workflows, one per file (tabs and all).
HAND_WRITTEN = [
    p.read_text() for p in sorted((ROOT / "tests" / "data" / "invalid_workflows").glob("*.yml"))
]


def compare(repo: Path, texts: list[str]) -> tuple[int, list[str]]:
    expected = theirs(texts)
    problems = []
    checked = 0
    for text, their_errors in zip(texts, expected, strict=True):
        if not their_errors:
            continue
        checked += 1
        mine = ours(repo, text)
        first = min((e["line"], e["column"]) for e in their_errors)
        if not mine:
            problems.append(f"we accept what GitHub rejects {their_errors}:\n{text}")
        elif mine[0][:2] != first:
            problems.append(f"first error {mine[0]} != GitHub's {their_errors}:\n{text}")
    return checked, problems


def test_generated_invalid_workflows_match_github_parser(repo: Path) -> None:
    r = random.Random(6)
    texts = []
    for _ in range(200):
        doc = Doc(r)
        for _ in range(r.choice([1, 1, 2, 3])):
            doc.mutate()
        texts.append(doc.render())
    checked, problems = compare(repo, texts)
    assert not problems, "\n\n".join(problems[:5]) + f"\n({len(problems)} total)"
    assert checked > 150  # the mutations really are errors GitHub reports


def test_generated_issue14_invalid_workflows_match_github_parser(repo: Path) -> None:
    r = random.Random(14)
    texts = []
    for _ in range(150):
        doc = Doc(r)
        doc.extra = True
        doc.mutate()
        while r.random() < 0.3:
            doc.mutate()
        texts.append(doc.render())
    checked, problems = compare(repo, texts)
    assert not problems, "\n\n".join(problems[:5]) + f"\n({len(problems)} total)"
    assert checked > 100


def test_hand_written_invalid_workflows_match_github_parser(repo: Path) -> None:
    checked, problems = compare(repo, HAND_WRITTEN)
    assert not problems, "\n\n".join(problems)
    assert checked == len(HAND_WRITTEN)


def enrich(doc: Doc) -> Doc:
    """Valid features real workflows use (issue 14's false rejects among them):
    per-key contexts, event filters, containers, runs-on groups, insert,
    expression matrix keys and spliced vector items."""
    r = doc.r
    if r.random() < 0.4:
        doc.root[0] = "on:\n" + r.choice(
            [
                "  merge_group:\n    branches: [main]\n    types: [checks_requested]",
                "  image_version:\n    names: [img]\n    versions: ['1.*']",
                "  pull_request:\n    types: [opened, ready_for_review]\n    paths: ['**.py']",
                "  workflow_run:\n    workflows: [CI]\n    types: [completed]",
                "  release:\n    types: [published]\n  registry_package:",
                "  workflow_dispatch:\n    inputs:\n      level: {type: choice, options: [a, b]}",
            ]
        )
    for job in doc.jobs.values():
        k = r.randrange(10)
        if k == 0:
            job.set(
                "environment",
                "\n  name: github-pages\n  url: ${{ steps.deployment.outputs.page_url }}",
                r,
            )
        elif k == 1:
            job.set(
                "container",
                "\n  image: ghcr.io/o/i:1\n  credentials:\n    username: ${{ github.actor }}"
                "\n    password: ${{ secrets.GHCR }}\n  env:\n    T: ${{ secrets.T }}",
                r,
            )
        elif k == 2:
            job.set(
                "services",
                "\n  db:\n    image: postgres:16\n    credentials:\n      username: u"
                "\n      password: ${{ secrets.DB }}\n    ports: ['5432:5432']",
                r,
            )
        elif k == 3:
            job.drop("runs-on")
            group = r.choice(["my-group", "organization/g", "enterprise/g"])
            job.set("runs-on", f"\n  group: {group}\n  labels: [linux]", r)
        elif k == 4:
            job.set("env", '\n  A: a\n  ${{ insert }}: ${{ fromJSON(\'{"B":"b"}\') }}', r)
        elif k == 5:
            job.drop("strategy")
            job.set(
                "strategy",
                "\n  matrix:\n    ${{ github.event_name == 'push' && 'os' || 'x' }}: "
                '[linux, "${{ fromJSON(\'[\\"mac\\"]\') }}"]',
                r,
            )
        elif k == 6:
            job.set("defaults", "\n  run:\n    working-directory: ${{ github.workspace }}", r)
        elif k == 7:
            # `${{ insert }}` wherever the schema gives the mapping a context.
            insert = "${{ insert }}: ${{ fromJSON('{}') }}"
            key, block = r.choice(
                [
                    ("defaults", f"\n  run:\n    {insert}"),
                    ("container", f"\n  image: i\n  {insert}"),
                    ("container", f"\n  image: i\n  env:\n    {insert}"),
                    ("container", f"\n  image: i\n  credentials:\n    {insert}"),
                    ("services", f"\n  db:\n    image: i\n    {insert}"),
                    ("services", f"\n  db:\n    image: i\n    env:\n      {insert}"),
                    ("strategy", f"\n  matrix:\n    a: [1]\n    {insert}"),
                    ("strategy", f"\n  {insert}\n  fail-fast: false"),
                ]
            )
            job.drop(key)
            job.set(key, block, r)
    return doc


def test_valid_workflows_are_valid_for_both(repo: Path) -> None:
    r = random.Random(7)
    texts = [Doc(r).render() for _ in range(40)]
    texts += [enrich(Doc(r)).render() for _ in range(60)]
    for text, errs in zip(texts, theirs(texts), strict=True):
        assert errs == [], text
        assert ours(repo, text) == [], text


# Cron fields: forms valid in every field, forms valid in some, and invalid ones.
_CRON_ANY = ["*", "1", "5", "*/5", "1-5", "1-5/2", "1,3", "+3", "0x3", "1.5", "06", "3-3"]
_CRON_SOME = ["0", "7", "12", "23", "24", "31", "59", "jan", "MAR-dec", "mon", "Sun-sat", "jan/2"]
_CRON_BAD = [
    "60", "5-1", "*/0", "*/60", "1/2/3", "1,,2", "-1", "a", "1e1", "*-5", "5-*", "sat-sun", "",
]  # fmt: skip


def _cron(r: random.Random) -> str:
    if r.random() < 0.1:
        fields = [r.choice(_CRON_ANY) for _ in range(r.choice([4, 6]))]
    else:
        pools = [_CRON_ANY] * 8 + [_CRON_SOME] * 3 + [_CRON_BAD]
        fields = [r.choice(r.choice(pools)) for _ in range(5)]
    text = r.choice([" ", " ", " ", "  "]).join(fields)
    return text if r.random() < 0.9 else r.choice([" ", ""]) + text + r.choice([" ", "\t", ""])


def test_cron_expressions_match_github_parser(repo: Path) -> None:
    """Every `cron` GitHub's parser refuses we refuse, at the same line:col,
    and no other (its JavaScript object lookup also takes `constructor` and
    the like as month and weekday names: that quirk alone is not copied)."""
    r = random.Random(61)
    crons = ["61 * * * *", "not a cron", "0 0 * * 7", "0 0 1 jan mon", "*/15 0-23/2 * * 1-5"]
    crons += [_cron(r) for _ in range(400)]
    body = "".join(f"    - cron: {json.dumps(c)}\n" for c in crons)
    text = f"on:\n  schedule:\n{body}jobs:\n  a:\n    runs-on: x\n    steps: [{{run: echo}}]\n"
    their = sorted((e["line"], e["column"]) for e in theirs([text])[0])
    mine = sorted((line, col) for line, col, _ in ours(repo, text))
    assert mine == their
    assert 50 < len(their) < len(crons) - 50  # both valid and invalid ones were tried


def test_insert_placements_match_github_parser(repo: Path) -> None:
    """tests/test_workflow_templates.py's `${{ insert }}` placements are
    GitHub's: accepted where it accepts, refused at its first line:col."""
    from tests.test_workflow_templates import INSERT_PLACEMENTS

    # A second job: one GitHub fails to convert leaves it the workflow's root.
    steps = "    steps: [{run: echo}]\n  b:\n    runs-on: x\n    steps: [{run: echo}]\n"
    texts = [
        f"on: push\njobs:\n  a:\n    runs-on: x\n{keys}\n{steps}" for keys, _ in INSERT_PLACEMENTS
    ]
    for (_, error_at), errs in zip(INSERT_PLACEMENTS, theirs(texts), strict=True):
        assert (min((e["line"], e["column"]) for e in errs) if errs else None) == error_at, errs


def test_expressions_in_event_filters_match_github_parser(repo: Path) -> None:
    """An event filter has no context: GitHub folds a lone literal and refuses
    any other expression, at the value's line:col; so do we."""
    values = [
        "'${{ github.sha }}'",
        "\"${{ 'main' }}\"",
        "'main-${{ 1 }}'",
        "'release/*'",
        "\"${{ 'v*' }}\"",
    ]
    texts = [
        f"on:\n  push:\n    {key}: [{v}]\njobs:\n  a:\n    runs-on: x\n    steps: [{{run: echo}}]\n"
        for key in ("branches", "tags", "paths")
        for v in values
    ]
    for text, errs in zip(texts, theirs(texts), strict=True):
        their = sorted((e["line"], e["column"]) for e in errs)
        mine = sorted((line, col) for line, col, _ in ours(repo, text))
        assert mine == their, text


def test_filters_under_an_event_that_takes_none_are_only_refused_by_the_editor(
    repo: Path,
) -> None:
    """helm/helm .github/workflows/release.yml, distilled: the npm parser (the
    strict schema GitHub's editors use) refuses `create`'s mapping; GitHub's
    service runs the workflow, and so do we. Should the npm parser come to
    accept it, this exception can go."""
    text = "on:\n  create:\n    tags:\n      - v*\njobs:\n  a:\n    runs-on: x\n"
    text += "    steps: [{run: echo}]\n"
    (errs,) = theirs([text])
    assert [(e["line"], e["column"], e["message"]) for e in errs] == [
        (3, 5, "A mapping was not expected")
    ]
    assert ours(repo, text) == []
