"""Fuzzing: only the documented error types ever escape the expression parser
and evaluator (`ExpressionError`), the workflow loader, YAML included
(`WorkflowError`), and the step protocols (the workflow-command parser never
raises; environment files raise only `EnvFileError`).

A few seconds per test in CI (the `preloop-fuzz` hypothesis profile runs
`PRELOOP_FUZZ_EXAMPLES` examples per test, default 100; a third of that for
the slow generated workflow documents); set
`PRELOOP_FUZZ_EXAMPLES=20000` for a long session.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path
from typing import Any

import yaml
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from preloop.runner.commands import EnvFileError, WorkflowCommandParser, parse_env_file
from preloop.runner.masking import Masker
from preloop.workflow import expressions as ex
from preloop.workflow.loader import WorkflowError, load_workflow

settings.register_profile(
    "preloop-fuzz",
    max_examples=int(os.environ.get("PRELOOP_FUZZ_EXAMPLES", "100")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
    derandomize=os.environ.get("PRELOOP_FUZZ_EXAMPLES") is None,
)
FUZZ = settings.get_profile("preloop-fuzz")
FUZZ_SLOW = settings(FUZZ, max_examples=max(20, FUZZ.max_examples // 3))

# --- expressions ---------------------------------------------------------------

_TOKENS = [
    "(",
    ")",
    "[",
    "]",
    ".",
    "*",
    "!",
    "<",
    "<=",
    ">",
    ">=",
    "==",
    "!=",
    "&&",
    "||",
    ",",
    "null",
    "true",
    "false",
    "NaN",
    "Infinity",
    "-Infinity",
    "0x1F",
    "0o17",
    "0b101",
    "1",
    "-2.5e3",
    "1e400",
    "''",
    "'a''b'",
    "'x'",
    "'",
    "github",
    "matrix",
    "env",
    "steps",
    "needs",
    "inputs",
    "secrets",
    "vars",
    "runner",
    "job",
    "strategy",
    "foo",
    "contains",
    "startsWith",
    "endsWith",
    "format",
    "join",
    "toJSON",
    "fromJSON",
    "hashFiles",
    "case",
    "success",
    "failure",
    "always",
    "cancelled",
    "'{0}{1}'",
    "'{{'",
    "'}}'",
    "'[1,2,{\"a\":null}]'",
    "'{\"a\": [1, 2]}'",
    "'99999999999999999999'",
    " ",
    "\t",
    "\n",
    "$",
    "{",
    "}",
    "@",
    "#",
    "é",
]

expression_text = st.one_of(
    st.lists(st.sampled_from(_TOKENS), max_size=40).map(" ".join),
    st.lists(st.sampled_from(_TOKENS), max_size=40).map("".join),
    st.text(alphabet=st.sampled_from("()[].*!<=>&|,'0123456789abexnul$ {}\\\"-+"), max_size=60),
    st.text(max_size=40),
)

_CONTEXTS: dict[str, Any] = {
    "github": {"event_name": "push", "ref": "refs/heads/main", "event": {"a": [1, {"b": None}]}},
    "matrix": {"os": "linux", "n": 3, "list": [1, "2", None, True]},
    "env": {"A": "1", "B": ""},
    "steps": {"s": {"outputs": {"x": "[1,2]"}, "outcome": "success"}},
    "needs": {"a": {"result": "success", "outputs": {"j": '{"k": [1]}'}}},
    "inputs": {"flag": True},
    "secrets": {"T": "t"},
}


def _hash_files(patterns: list[str]) -> str:
    return "0" * 64


@FUZZ
@given(expression_text)
def test_expressions_raise_only_expression_error(expr: str) -> None:
    with contextlib.suppress(ex.ExpressionError):
        ex.parse(expr)
    with contextlib.suppress(ex.ExpressionError):
        ex.evaluate(expr, _CONTEXTS, hash_files=_hash_files)
    with contextlib.suppress(ex.ExpressionError):
        ex.evaluate_if(expr, _CONTEXTS, status="failure", hash_files=_hash_files)


@FUZZ
@given(st.lists(st.one_of(st.text(max_size=10), expression_text), max_size=4))
def test_templates_raise_only_expression_error(parts: list[str]) -> None:
    text = "".join(f"{p}${{{{ {p} }}}}" if i % 2 else p for i, p in enumerate(parts))
    with contextlib.suppress(ex.ExpressionError):
        ex.evaluate_template(text, _CONTEXTS, hash_files=_hash_files)
    with contextlib.suppress(ex.ExpressionError):
        ex.interpolate(text, _CONTEXTS, hash_files=_hash_files)


# --- workflow loader (YAML included) ----------------------------------------------

_KEYS = [
    "on",
    "name",
    "env",
    "jobs",
    "defaults",
    "concurrency",
    "permissions",
    "run-name",
    "runs-on",
    "steps",
    "needs",
    "if",
    "strategy",
    "matrix",
    "include",
    "exclude",
    "fail-fast",
    "max-parallel",
    "outputs",
    "run",
    "uses",
    "with",
    "shell",
    "id",
    "timeout-minutes",
    "continue-on-error",
    "working-directory",
    "services",
    "container",
    "workflow_call",
    "workflow_dispatch",
    "push",
    "pull_request",
    "inputs",
    "secrets",
    "group",
    "cancel-in-progress",
    "branches",
    "paths",
    "types",
    "build",
    "test",
    "a",
]
_SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-3, 300),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from(
        [
            "ubuntu-latest",
            "${{ matrix.os }}",
            "${{ github.ref",
            "${{ }}",
            "echo hi",
            "./.github/workflows/x.yml",
            "./.github/workflows/ci.yml",
            "actions/checkout@v4",
            "build",
            "test",
            "a",
            "${{ fromJSON(needs.a.outputs.m) }}",
            "bash",
            "{0}",
            "",
        ]
    ),
    st.text(max_size=12),
)
_VALUES = st.recursive(
    _SCALARS,
    lambda children: st.one_of(
        st.lists(children, max_size=4),
        st.dictionaries(
            st.one_of(st.sampled_from(_KEYS), st.text(max_size=6)), children, max_size=5
        ),
    ),
    max_leaves=25,
)
_WORKFLOWS = st.fixed_dictionaries(
    {},
    optional={
        "on": st.one_of(st.sampled_from(["push", "pull_request", "workflow_call"]), _VALUES),
        "env": _VALUES,
        "concurrency": _VALUES,
        "defaults": _VALUES,
        "jobs": st.dictionaries(
            st.one_of(st.sampled_from(["build", "test", "a"]), st.text(max_size=6)),
            st.one_of(
                st.fixed_dictionaries(
                    {"runs-on": _SCALARS, "steps": st.lists(_VALUES, max_size=3)},
                    optional={
                        "needs": _VALUES,
                        "strategy": _VALUES,
                        "if": _SCALARS,
                        "outputs": _VALUES,
                        "uses": _SCALARS,
                        "with": _VALUES,
                    },
                ),
                _VALUES,
            ),
            max_size=3,
        ),
    },
)

_YAML_NOISE = st.text(
    alphabet=st.sampled_from([*list("abc:-[]{}'\"#&*!|>%@`,?\n\t \\0123456789${}."), "é", "\x00"]),
    max_size=120,
)


def _load(text: str) -> None:
    with tempfile.TemporaryDirectory(prefix="preloop-fuzz-") as tmp:
        root = Path(tmp)
        path = root / ".github" / "workflows" / "ci.yml"
        path.parent.mkdir(parents=True)
        path.write_text(text, encoding="utf-8", errors="surrogatepass")
        with contextlib.suppress(WorkflowError):
            load_workflow(path, root=root)


@FUZZ_SLOW
@given(_WORKFLOWS)
def test_loader_raises_only_workflow_error_on_structures(doc: dict[str, Any]) -> None:
    _load(yaml.safe_dump(doc, allow_unicode=True, sort_keys=False))


@FUZZ
@given(_YAML_NOISE, st.sampled_from(["", "on: push\njobs:\n  a:\n", "jobs:\n  a:\n    steps:\n"]))
def test_loader_raises_only_workflow_error_on_raw_yaml(noise: str, head: str) -> None:
    _load(head + noise)


# --- workflow commands and environment files --------------------------------------

_COMMAND_NAMES = [
    "error",
    "warning",
    "notice",
    "debug",
    "group",
    "endgroup",
    "add-mask",
    "set-output",
    "stop-commands",
    "save-state",
    "echo",
    "ERROR",
    "x",
    "",
]
_command_lines = st.one_of(
    st.builds(
        lambda lead, name, props, data: f"{lead}::{name}{props}::{data}",
        st.sampled_from(["", " ", "\t"]),
        st.sampled_from(_COMMAND_NAMES),
        st.one_of(
            st.just(""),
            st.lists(
                st.builds(
                    lambda k, v: f"{k}={v}",
                    st.sampled_from(["file", "line", "col", "title", "name", "endLine", "x"]),
                    st.text(max_size=8),
                ),
                max_size=4,
            ).map(lambda items: " " + ",".join(items)),
        ),
        st.text(max_size=20),
    ),
    st.text(max_size=40),
)


@FUZZ
@given(st.lists(_command_lines, max_size=12), st.lists(st.text(max_size=8), max_size=3))
def test_workflow_command_parser_never_raises(lines: list[str], secrets: list[str]) -> None:
    masker = Masker()
    for s in secrets:
        masker.add(s)
    parser = WorkflowCommandParser(masker, "job", "step")
    for line in lines:
        shown = parser.line(line)
        assert shown is None or isinstance(shown, str)
    for ann in parser.effects.annotations:
        ann.render()


@FUZZ
@given(st.text(alphabet=st.sampled_from([*list("ab=<\n\r EOF"), "é"]), max_size=80))
def test_env_files_raise_only_env_file_error(text: str) -> None:
    with tempfile.TemporaryDirectory(prefix="preloop-fuzz-") as tmp:
        path = Path(tmp) / "GITHUB_OUTPUT"
        path.write_text(text, encoding="utf-8")
        with contextlib.suppress(EnvFileError):
            parse_env_file(path, "GITHUB_OUTPUT")


@FUZZ
@given(
    st.lists(_command_lines.map(lambda s: s.replace("\n", " ")), max_size=12),
    st.lists(st.text(max_size=8), max_size=3),
    st.lists(st.integers(min_value=1, max_value=5), min_size=1, max_size=12),
)
def test_workflow_command_parser_batches_are_line_by_line(
    lines: list[str], secrets: list[str], sizes: list[int]
) -> None:
    """`lines()` (a batch of a step's output, passed through untouched when it
    holds no command, no carriage return and no secret) shows, hides, masks
    and records exactly what `line()` does line by line."""

    def parser() -> WorkflowCommandParser:
        masker = Masker()
        for s in secrets:
            masker.add(s)
        return WorkflowCommandParser(masker, "job", "step")

    one, batched = parser(), parser()
    expected = [shown for shown in map(one.line, lines) if shown is not None]
    got: list[str] = []
    start = 0
    while start < len(lines):
        size = sizes[start % len(sizes)]
        got += batched.lines(lines[start : start + size])
        start += size
    assert got == expected
    assert batched.effects == one.effects


def _masked_by_coverage(text: str, values: frozenset[str]) -> str:
    """What masking must give: each run of characters covered by some
    occurrence of some value (overlapping or adjacent ones) becomes one mask."""
    covered = [False] * len(text)
    for v in values:
        start = text.find(v)
        while start >= 0:
            covered[start : start + len(v)] = [True] * len(v)
            start = text.find(v, start + 1)
    out, i = [], 0
    while i < len(text):
        if covered[i]:
            while i < len(text) and covered[i]:
                i += 1
            out.append("***")
        else:
            out.append(text[i])
            i += 1
    return "".join(out)


@st.composite
def _values_and_text(draw: st.DrawFn) -> tuple[list[str], str]:
    """Values, and a text made of pieces of them (and of other characters):
    overlapping, adjacent and repeated occurrences are the common case, not
    a lucky draw."""
    values = draw(st.lists(st.text(alphabet="ab\"'&<", min_size=1, max_size=6), max_size=4))
    pieces = [*values, *(v[: len(v) // 2] for v in values), *(v[1:] for v in values), "x", "a"]
    text = "".join(draw(st.lists(st.sampled_from(pieces), max_size=20)))
    return values, text


@FUZZ
@given(_values_and_text(), st.booleans())
@example((["<<"], "<<<"), False)
@example((["<<"], "<<<"), True)
@example((["abcd", "cdef"], "xxabcdefyy"), False)
@example((["abcd", "cdef"], "xxabcdefyy"), True)
def test_masking_hides_every_occurrence_and_nothing_else(
    values_and_text: tuple[list[str], str], alternation: bool
) -> None:
    values, text = values_and_text
    masker = Masker()
    if alternation:
        masker.find_limit = 0  # the compiled alternation, as with many secrets
    for v in values:
        masker.add(v)
    assert masker.mask(text) == _masked_by_coverage(text, masker.values)
    assert masker.contains_secret(text) == any(v in text for v in masker.values)
