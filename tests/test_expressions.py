"""Expression cases: each operator, coercion rule, function and error (GitHub's docs)."""

from __future__ import annotations

import hashlib
import math
from pathlib import Path
from typing import Any

import pytest

from preloop.errors import PreloopError
from preloop.workflow.expressions import (
    ExpressionError,
    coerce_string,
    evaluate,
    evaluate_if,
    evaluate_template,
    interpolate,
    uses_status_function,
)

CTX: dict[str, Any] = {
    "github": {"event_name": "push", "ref": "refs/heads/main", "sha": "abc123"},
    "env": {"Greeting": "hello", "EMPTY": ""},
    "matrix": {"os": "ubuntu-latest", "node": 18, "flags": ["a", "b"]},
    "needs": {
        "build": {"result": "success", "outputs": {"matrix": '{"x":[1,2]}', "n": "3"}},
        "lint": {"result": "failure", "outputs": {}},
    },
    "steps": {"s1": {"outputs": {"v": "1"}, "conclusion": "success"}},
}


def ev(expr: str, **kw: Any) -> Any:
    return evaluate(expr, CTX, **kw)


@pytest.mark.parametrize(
    ("expr", "expected"),
    [
        # literals
        ("null", None),
        ("true", True),
        ("false", False),
        ("711", 711),
        ("-9.2", -9.2),
        ("0xff", 255),
        ("-2.99e-2", -0.0299),
        ("'Mona''s'", "Mona's"),
        ("'it''s ''quoted'''", "it's 'quoted'"),
        # logical operators return the deciding operand
        ("1 && 'x'", "x"),
        ("0 && 'x'", 0),
        ("'' || 'fallback'", "fallback"),
        ("null || false", False),
        ("!0", True),
        ("!'a'", False),
        ("(1 == 1) && !(2 == 3)", True),
        # comparisons with coercion (docs table: null->0, bool->0/1, string parsed)
        ("null == 0", True),
        ("false == 0", True),
        ("true == 1", True),
        ("'' == 0", True),
        ("' 12 ' == 12", True),
        ("'0x10' == 16", True),
        ("'abc' == 0", False),
        ("'ABC' == 'abc'", True),
        ("'a' != 'A'", False),
        ("NaN == NaN", False),
        ("'b' > 'A'", True),
        ("2 >= 2", True),
        ("'10' > 9", True),
        ("true > false", True),
        ("null < 1", True),
        ("1 < 'x'", False),
        ("matrix.flags == matrix.flags", True),
        ("fromJSON('[]') == fromJSON('[]')", False),
        ("matrix == 'Object'", False),
        # property / index / filter access, case-insensitive names
        ("GitHub.Event_Name", "push"),
        ("github['event_name']", "push"),
        ("env.greeting", "hello"),
        ("matrix.flags[1]", "b"),
        ("matrix.flags['1']", "b"),
        ("matrix.flags[1.7]", "b"),
        ("matrix.flags[5]", None),
        ("matrix.flags[-1]", None),
        ("github.nope.deeper", None),
        ("needs.*.result", ["success", "failure"]),
        ("needs.*.outputs.n", ["3"]),
        ("matrix.flags.*", ["a", "b"]),
        ("github.sha.*", []),
        ("(matrix).os", "ubuntu-latest"),
        # functions
        ("contains('Hello world', 'WORLD')", True),
        ("contains(matrix.flags, 'A')", True),
        ("contains(needs.*.result, 'failure')", True),
        ("contains(matrix, 'os')", False),
        ("startsWith(github.ref, 'REFS/heads')", True),
        ("endsWith(github.ref, '/main')", True),
        ("startsWith(matrix.flags, 'a')", False),
        ("format('{0} {1} {0}', 'a', 'b')", "a b a"),
        ("format('{{0}} {0}', 1)", "{0} 1"),
        ("format('x')", "x"),
        ("join(matrix.flags)", "a,b"),
        ("join(matrix.flags, ' + ')", "a + b"),
        ("join('abc')", "abc"),
        ("join(matrix)", ""),
        ("toJSON(matrix.flags)", '[\n  "a",\n  "b"\n]'),
        ("toJSON(0.5)", "0.5"),
        ("toJSON('x')", '"x"'),
        ("toJSON(fromJSON('{}'))", "{}"),
        ("fromJSON(needs.build.outputs.matrix).x[1]", 2),
        ("fromJSON('true')", True),
        ("fromJSON(needs.build.outputs.n) == 3", True),
        ("case(false, 'a', true, 'b', 'c')", "b"),
        ("case(false, 'a', 'c')", "c"),
        ("success()", True),
        ("always()", True),
        ("failure()", False),
        ("cancelled()", False),
    ],
)
def test_cases(expr: str, expected: Any) -> None:
    got = ev(expr)
    assert got == expected and type(got) is type(expected), (expr, got)


def test_status_functions_follow_status() -> None:
    assert ev("failure()", status="failure") is True
    assert ev("success()", status="failure") is False
    assert ev("cancelled()", status="cancelled") is True
    assert ev("always()", status="cancelled") is True


@pytest.mark.parametrize(
    ("value", "text"),
    [
        (None, ""),
        (True, "true"),
        (False, "false"),
        (3, "3"),
        (1.5, "1.5"),
        (0.1 + 0.2, "0.3"),  # at most 15 decimals, GitHub's rendering
        (1e21, "1e+21"),
        (1e-7, "1e-7"),
        (-0.0, "0"),
        (math.inf, "Infinity"),
        (math.nan, "NaN"),
        ([1], "Array"),
        ({"a": 1}, "Object"),
    ],
)
def test_string_conversion(value: Any, text: str) -> None:
    assert coerce_string(value) == text


@pytest.mark.parametrize(
    ("expr", "column", "reason"),
    [
        ("1 +", 3, "Unexpected symbol: '+'"),
        ("github.", 8, "Unexpected symbol: 'EOF'"),
        ("foo.bar", 1, "Unrecognized named-value: 'foo'"),
        ("'open", 1, "Unexpected symbol"),
        ("nope()", 1, "Unrecognized function: 'nope'"),
        ("contains('a')", 1, "Too few parameters supplied"),
        ("always(1)", 1, "Too many parameters supplied"),
        ("case(true, 1, false, 2)", 1, "Even number of parameters"),
        ("(1", 2, "Unexpected end of expression"),
        ("a = b", 3, "Unexpected symbol: '='"),
        ("1 & 2", 3, "Unexpected symbol: '&'"),
        ("'x'[0]", 4, "Unexpected symbol: '['"),
        ("1.2.3", 1, "Unexpected symbol: '1.2.3'"),
        ("True", 1, "Unrecognized named-value: 'true'"),
        ("github.ref  ==  ", 13, "Unexpected end of expression: '=='"),
        ("fromJSON('{bad')", 1, "fromjson:"),
        ("fromJSON('')", 1, "fromjson:"),
        ("format('{0}')", 1, "more arguments than were supplied"),
        ("format('{x}', 1)", 1, "format string is invalid"),
        ("format('}', 1)", 1, "format string is invalid"),
        ("case(1, 2, 3)", 1, "case predicate must evaluate to a boolean"),
        ("", 1, "Expected an expression"),
        ("(" * 60 + "1" + ")" * 60, 51, "Exceeded max expression depth"),
    ],
)
def test_errors_name_expression_and_column(expr: str, column: int, reason: str) -> None:
    with pytest.raises(ExpressionError) as info:
        ev(expr)
    err = info.value
    assert isinstance(err, PreloopError)
    assert reason in err.reason
    assert err.column == column
    assert f"column {column}" in str(err) and expr in str(err)


def test_error_on_second_line_reports_line() -> None:
    with pytest.raises(ExpressionError) as info:
        ev("github.ref ==\n  'x' ||| 1")
    assert (info.value.line, info.value.column) == (2, 9)  # the third `|`


def test_unknown_context_check_allows_given_names() -> None:
    assert evaluate("custom.x", {"custom": {"x": 1}}) == 1
    assert evaluate("matrix", {}) is None  # a known context that is absent reads as null


@pytest.mark.parametrize(
    ("cond", "status", "expected"),
    [
        (None, "success", True),
        ("", "failure", False),
        ("github.event_name == 'push'", "success", True),
        ("github.event_name == 'push'", "failure", False),  # implicit success() &&
        ("${{ github.event_name == 'push' }}", "success", True),
        ("  ${{ github.event_name == 'pull_request' }}  ", "success", False),
        ("failure()", "failure", True),
        ("${{ always() }}", "cancelled", True),
        ("failure() || github.event_name == 'push'", "success", True),
        ("!cancelled()", "failure", True),
        ("matrix.flags", "success", True),
        ("env.EMPTY", "success", False),
        ("x-${{ github.event_name }}", "success", True),
    ],
)
def test_evaluate_if(cond: str | None, status: str, expected: bool) -> None:
    assert evaluate_if(cond, CTX, status=status) is expected


def test_uses_status_function() -> None:
    assert uses_status_function("always()")
    assert uses_status_function("${{ Failure() && x }}".replace("x", "true"))
    assert not uses_status_function("github.ref == 'x'")
    assert not uses_status_function(None)
    assert not uses_status_function("contains('success()', 'x')")


def test_interpolate_and_template() -> None:
    assert interpolate("v${{ matrix.node }}-${{ matrix.os }}", CTX) == "v18-ubuntu-latest"
    assert interpolate("a ${{ '}}' }} b", CTX) == "a }} b"
    assert interpolate("no expressions", CTX) == "no expressions"
    assert interpolate("${{ matrix.flags }}/${{ null }}", CTX) == "Array/"
    assert evaluate_template("${{ fromJSON(needs.build.outputs.matrix) }}", CTX) == {"x": [1, 2]}
    assert evaluate_template(" ${{ matrix.node }} ", CTX) == 18
    with pytest.raises(ExpressionError, match="not closed"):
        interpolate("x ${{ matrix.os", CTX)


def test_hash_files_follows_github_algorithm(tmp_path: Path) -> None:
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "a.py").write_bytes(b"A")
    (tmp_path / "src" / "b.txt").write_bytes(b"B")
    (tmp_path / "top.py").write_bytes(b"T")
    ctx = {"github": {"workspace": str(tmp_path)}}

    def combined(*contents: bytes) -> str:
        total = hashlib.sha256()
        for c in contents:
            total.update(hashlib.sha256(c).digest())
        return total.hexdigest()

    assert evaluate("hashFiles('**/*.py')", ctx) == combined(b"A", b"T")
    assert evaluate("hashFiles('src')", ctx) == combined(b"A", b"B")
    assert evaluate("hashFiles('src/**', '!**/*.txt')", ctx) == combined(b"A")
    assert evaluate("hashFiles('*.none')", ctx) == ""
    assert evaluate("hashFiles('x')", ctx, hash_files=lambda p: "|".join(p)) == "x"


@pytest.mark.parametrize(
    ("cond", "expected"),
    [
        (None, False),
        ("always()", True),
        ("success()", False),
        ("failure()", False),
        ("!failure()", True),
    ],
)
def test_other_statuses_make_every_status_function_false(cond: str | None, expected: bool) -> None:
    # The scheduler passes "skipped" when an ancestor was skipped: neither
    # success() nor failure() holds, as on GitHub.
    assert evaluate_if(cond, CTX, status="skipped") is expected
