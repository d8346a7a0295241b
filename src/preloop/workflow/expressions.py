"""GitHub Actions `${{ }}` expressions: tokenizer, parser and evaluator.

The language is GitHub's (docs: "Evaluate expressions in workflows and
actions"), and where the documentation is silent the behaviour follows
GitHub's own TypeScript engine, `@actions/expressions`, which
`tests/test_expressions_differential.py` runs as an oracle:

- literals `null`, `true`, `false`, numbers (JSON numbers plus hex/octal/binary,
  `NaN`, `Infinity`), `'strings'` with `''` as an escaped quote;
- operators `( ) [ ] . ! < <= > >= == != && ||`; `&&`/`||` return the operand
  that decided the result, not a boolean;
- loose comparison: differing primitive types are coerced to numbers (null 0,
  booleans 0/1, strings parsed, otherwise NaN); strings compare ignoring case;
  arrays and objects are equal only to themselves;
- property access `a.b`, index access `a['b']`, `a[0]`, and the `.*` / `[*]`
  filter that maps the rest of the path over every element;
- context and property names are case-insensitive;
- functions contains, startsWith, endsWith, format, join, toJSON, fromJSON,
  hashFiles, case, and the status functions success, failure, always, cancelled.

Values are plain Python data: None, bool, int/float, str, list, dict (any
Mapping / list / tuple in `contexts` is read as such).

Public API: `evaluate`, `evaluate_if`, `evaluate_template`, `interpolate`,
`uses_status_function`, `parse`, `ExpressionError`.
"""

from __future__ import annotations

import functools
import json
import math
import os
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from decimal import ROUND_HALF_UP, Context, Decimal
from typing import Any, NamedTuple

from preloop.errors import PreloopError

__all__ = [
    "CONTEXT_NAMES",
    "STATUS_FUNCTIONS",
    "ExpressionError",
    "NamedStatus",
    "Parsed",
    "coerce_string",
    "evaluate",
    "evaluate_if",
    "evaluate_template",
    "interpolate",
    "parse",
    "template_segments",
    "truthy",
    "uses_status_function",
]

#: The contexts an expression may name (GitHub's list); a context absent from
#: the mapping given to `evaluate` reads as null.
CONTEXT_NAMES = frozenset(
    {
        "github",
        "env",
        "vars",
        "job",
        "jobs",
        "steps",
        "runner",
        "secrets",
        "strategy",
        "matrix",
        "needs",
        "inputs",
    }
)
STATUS_FUNCTIONS = frozenset({"success", "failure", "always", "cancelled"})

# GitHub's limits (same numbers in @actions/expressions and the runner).
MAX_EXPRESSION_LENGTH = 21000
MAX_PARSER_DEPTH = 50

HashFiles = Callable[[list[str]], str]


class ExpressionError(PreloopError):
    """An expression that cannot be parsed or evaluated.

    `column` (1-based) and `line` (1-based, for multi-line expressions) point
    at the offending token; `reason` is the bare message.
    """

    def __init__(self, reason: str, expression: str, line: int, column: int) -> None:
        self.reason = reason
        self.expression = expression
        self.line = line
        self.column = column
        where = f"line {line} column {column}" if line > 1 else f"column {column}"
        super().__init__(f"{reason} at {where} of expression `{expression}`")


# --------------------------------------------------------------------------- values


class _Filtered(list[Any]):
    """The array a `*` filter produces: further access maps over its items."""


def _is_number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def _is_primitive(v: Any) -> bool:
    return v is None or isinstance(v, str | bool | int | float)


def _is_array(v: Any) -> bool:
    return isinstance(v, list | tuple)


# JavaScript's WhiteSpace + LineTerminator (what Number() and trim() strip).
_JS_SPACE = "\t\n\v\f\r \u00a0\u1680\u2000\u2001\u2002\u2003\u2004\u2005\u2006\u2007\u2008\u2009\u200a\u2028\u2029\u202f\u205f\u3000\ufeff"  # noqa: E501
_DECIMAL = re.compile(r"[+-]?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?", re.ASCII)
_RADIX = re.compile(r"0([xXoObB])([0-9a-fA-F]+)")


def string_to_number(s: str) -> float:
    """JavaScript's `Number(string)`, which GitHub's coercion uses: surrounding
    whitespace ignored, empty means 0, hex/octal/binary prefixes, otherwise NaN."""
    s = s.strip(_JS_SPACE)
    if not s:
        return 0.0
    if _DECIMAL.fullmatch(s):
        return float(s)
    if s in ("Infinity", "+Infinity"):
        return math.inf
    if s == "-Infinity":
        return -math.inf
    m = _RADIX.fullmatch(s)
    if m:
        base = {"x": 16, "o": 8, "b": 2}[m.group(1).lower()]
        try:
            return float(int(m.group(2), base))
        except ValueError:
            return math.nan
    return math.nan


def to_number(v: Any) -> float:
    if v is None:
        return 0.0
    if isinstance(v, bool):
        return 1.0 if v else 0.0
    if isinstance(v, int | float):
        return float(v)
    if isinstance(v, str):
        return string_to_number(v)
    return math.nan


def _js_number_string(x: float) -> str:
    """ECMAScript Number::toString (shortest round-trip digits)."""
    if math.isnan(x):
        return "NaN"
    if x == 0:
        return "0"
    if math.isinf(x):
        return "Infinity" if x > 0 else "-Infinity"
    if x < 0:
        return "-" + _js_number_string(-x)
    if x.is_integer() and x <= 2**53:
        return str(int(x))  # exact; above 2^53 JavaScript prints the shortest digits
    _, digit_tuple, exp = Decimal(repr(x)).as_tuple()
    digits = "".join(map(str, digit_tuple)).rstrip("0") or "0"
    assert isinstance(exp, int)
    n = len(digit_tuple) + exp  # decimal point position
    k = len(digits)
    if k <= n <= 21:
        return digits + "0" * (n - k)
    if 0 < n <= 21:
        return digits[:n] + "." + digits[n:]
    if -6 < n <= 0:
        return "0." + "0" * (-n) + digits
    e = n - 1
    es = f"e+{e}" if e >= 0 else f"e-{-e}"
    return (digits if k == 1 else digits[0] + "." + digits[1:]) + es


_FIFTEEN_PLACES = Decimal("1e-15")
# Up to 21 integer digits plus 15 decimals must fit (the default is 28 digits).
_FIXED_CONTEXT = Context(prec=40, rounding=ROUND_HALF_UP)


def _number_string(x: float | int) -> str:
    """How GitHub renders a number as text: at most 15 decimals, no trailing
    zeros (`+x.toFixed(15)` then ToString, as the TypeScript engine does)."""
    if isinstance(x, int):
        if -(2**53) <= x <= 2**53:
            return str(x)
        x = float(x)
    if math.isnan(x) or math.isinf(x):
        return _js_number_string(x)
    if x.is_integer() and abs(x) < 2**53:
        return str(int(x))
    if abs(x) < 1e21:
        fixed = Decimal(x).quantize(_FIFTEEN_PLACES, context=_FIXED_CONTEXT)
        x = float(fixed)
    return _js_number_string(x)


def coerce_string(v: Any) -> str:
    """GitHub's string conversion: null is '', booleans 'true'/'false', numbers
    without trailing zeros, arrays 'Array', objects 'Object'."""
    if isinstance(v, str):
        return v
    if v is None:
        return ""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int | float):
        return _number_string(v)
    if _is_array(v):
        return "Array"
    if isinstance(v, Mapping):
        return "Object"
    return str(v)


def truthy(v: Any) -> bool:
    """GitHub's truthiness: null, false, 0, NaN and '' are false; everything else true."""
    if v is None:
        return False
    if isinstance(v, bool):
        return v
    if isinstance(v, int | float):
        return not (v == 0 or math.isnan(v))
    if isinstance(v, str):
        return len(v) > 0
    return True


def _upper(s: str) -> str:
    # The dotless ı is kept as is: .NET's ordinal-ignore-case compare does not
    # fold it to I, and GitHub's engines mirror that.
    if "ı" not in s:
        return s.upper()
    return "ı".join(part.upper() for part in s.split("ı"))


# Kinds, for coercion: 0 null, 1 bool, 2 number, 3 string, 4 array, 5 object.
def _kind(v: Any) -> int:
    if v is None:
        return 0
    if isinstance(v, bool):
        return 1
    if isinstance(v, int | float):
        return 2
    if isinstance(v, str):
        return 3
    if _is_array(v):
        return 4
    if isinstance(v, Mapping):
        return 5
    return 3


def _coerce(a: Any, b: Any) -> tuple[int, Any, int, Any]:
    """GitHub's loose-comparison coercion (the JavaScript abstract-equality
    algorithm, except that objects are never converted to primitives)."""
    ka, kb = _kind(a), _kind(b)
    if ka == kb:
        return ka, a, kb, b
    if ka in (0, 1):
        return _coerce(to_number(a), b)
    if kb in (0, 1):
        return _coerce(a, to_number(b))
    if ka == 2 and kb == 3:
        return 2, a, 2, string_to_number(b)
    if ka == 3 and kb == 2:
        return 2, string_to_number(a), 2, b
    return ka, a, kb, b


def loose_equals(a: Any, b: Any) -> bool:
    ka, a, kb, b = _coerce(a, b)
    if ka != kb:
        return False
    if ka == 0:
        return True
    if ka == 2:
        return bool(a == b)  # NaN != NaN
    if ka == 3:
        return _upper(str(a)) == _upper(str(b))
    if ka == 1:
        return bool(a == b)
    return a is b  # arrays and objects: identity


def _greater(a: Any, b: Any) -> bool:
    ka, a, kb, b = _coerce(a, b)
    if ka != kb:
        return False
    if ka == 2:
        return bool(a > b)
    if ka == 3:
        return _upper(str(a)) > _upper(str(b))
    if ka == 1:
        return bool(a and not b)
    return False


def _less(a: Any, b: Any) -> bool:
    ka, a, kb, b = _coerce(a, b)
    if ka != kb:
        return False
    if ka == 2:
        return bool(a < b)
    if ka == 3:
        return _upper(str(a)) < _upper(str(b))
    if ka == 1:
        return bool(not a and b)
    return False


def _get_key(obj: Mapping[str, Any], key: str) -> tuple[bool, Any]:
    """Case-insensitive property lookup; the first matching key wins."""
    lk = key.lower()
    for k in obj:
        if isinstance(k, str) and k.lower() == lk:
            return True, obj[k]
    return False, None


def _index_of(idx: Any) -> tuple[str | None, int | None]:
    """The string key and non-negative integer index an index value denotes."""
    s = coerce_string(idx) if _is_primitive(idx) else None
    f = to_number(idx)
    i = math.floor(f) if math.isfinite(f) and f >= 0 else None
    return s, i


def _access(obj: Any, star: bool, idx: Any) -> Any:
    if star:
        if isinstance(obj, _Filtered):
            out = _Filtered()
            for item in obj:
                if isinstance(item, Mapping):
                    out.extend(item.values())
                elif _is_array(item):
                    out.extend(item)
            return out
        if _is_array(obj):
            return _Filtered(obj)
        if isinstance(obj, Mapping):
            return _Filtered(obj.values())
        return _Filtered()
    s, i = _index_of(idx)
    if isinstance(obj, _Filtered):
        out = _Filtered()
        for item in obj:
            if isinstance(item, Mapping):
                if s is not None:
                    found, v = _get_key(item, s)
                    if found:
                        out.append(v)
            elif _is_array(item) and i is not None and i < len(item):
                out.append(item[i])
        return out
    if _is_array(obj):
        return obj[i] if i is not None and i < len(obj) else None
    if isinstance(obj, Mapping):
        if s is not None:
            found, v = _get_key(obj, s)
            if found:
                return v
        return None
    return None


def index_value(obj: Any, key: Any) -> Any:
    """GitHub's `obj[key]`: keys looked up ignoring case, null when absent.
    Public for the matrix filters, which GitHub evaluates as expressions."""
    return _access(obj, False, key)


# --------------------------------------------------------------------------- json


def _json_ready(v: Any) -> Any:
    """Plain JSON data, numbers rendered the way JavaScript's JSON does."""
    if isinstance(v, float):
        if math.isnan(v) or math.isinf(v):
            return None
        return _JsNum(v)
    if isinstance(v, Mapping):
        return {str(k): _json_ready(x) for k, x in v.items()}
    if _is_array(v):
        return [_json_ready(x) for x in v]
    return v


class _JsNum(float):
    def __repr__(self) -> str:
        return _js_number_string(float(self))


class _JsEncoder(json.JSONEncoder):
    def iterencode(self, o: Any, _one_shot: bool = False) -> Iterator[str]:
        # The C encoder ignores float subclasses' repr; the Python one honours
        # float.__repr__ through `floatstr`, so route numbers through it.
        return json.encoder._make_iterencode(  # type: ignore[attr-defined, no-any-return]
            {},
            self.default,
            json.encoder.py_encode_basestring,
            self.indent,
            lambda f: repr(f) if isinstance(f, _JsNum) else _js_number_string(f),
            self.key_separator,
            self.item_separator,
            self.sort_keys,
            self.skipkeys,
            _one_shot,
        )(o, 0)


def to_json(v: Any) -> str:
    """`toJSON`: pretty-printed with two-space indentation."""
    return "".join(_JsEncoder(indent=2, ensure_ascii=False).iterencode(_json_ready(v)))


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _json_int(s: str) -> int | float:
    f = float(s)
    return int(f) if abs(f) < 2**53 else f


def from_json(text: str) -> Any:
    if not text.strip(_JS_SPACE):
        raise ValueError("empty input")
    return json.loads(text, parse_constant=_reject_constant, parse_int=_json_int)


# --------------------------------------------------------------------------- lexer

_L_PAREN, _R_PAREN, _L_BRACKET, _R_BRACKET, _COMMA, _DOT, _BANG = range(7)
_NE, _EQ, _GT, _GE, _LT, _LE, _AND, _OR, _STAR = range(7, 16)
_NUMBER, _STRING, _IDENT, _TRUE, _FALSE, _NULL, _EOF = range(16, 23)

_BOUNDARY = frozenset("([)],.!><=&|") | frozenset(_JS_SPACE)
_IDENT_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_-]*")
_BOUNDARY_CLASS = re.escape("([)],.!><=&|" + _JS_SPACE)
_WORD = re.compile(f"[^{_BOUNDARY_CLASS}]*")
_NUMBER_WORD = re.compile(f"(?:[^{_BOUNDARY_CLASS}]|\\.)*")


class _Token(NamedTuple):
    kind: int
    lexeme: str
    start: int  # offset in the expression
    value: Any = None


def _position(expr: str, offset: int) -> tuple[int, int]:
    line = expr.count("\n", 0, offset) + 1
    line_start = expr.rfind("\n", 0, offset) + 1
    return line, offset - line_start + 1


def _error(reason: str, expr: str, offset: int) -> ExpressionError:
    line, col = _position(expr, offset)
    return ExpressionError(reason, expr, line, col)


_SINGLE = {"(": _L_PAREN, ")": _R_PAREN, "[": _L_BRACKET, "]": _R_BRACKET, ",": _COMMA, "*": _STAR}
_WITH_EQ = {"!": (_BANG, _NE), "<": (_LT, _LE), ">": (_GT, _GE)}
_DOUBLED = {"=": _EQ, "&": _AND, "|": _OR}
_KEYWORDS: dict[str, tuple[int, Any]] = {
    "true": (_TRUE, True),
    "false": (_FALSE, False),
    "null": (_NULL, None),
    "NaN": (_NUMBER, math.nan),
    "Infinity": (_NUMBER, math.inf),
}
_SPACE_RUN = re.compile(r"[ \r\t\n]+")
# A string literal: `''` is an escaped quote; possessive, so an unterminated
# literal never matches a shorter prefix (GitHub's lexer reads greedily).
_STRING_RE = re.compile(r"'(?:[^']|'')*+'")
_AFTER_DOT_IS_PROPERTY = frozenset([_IDENT, _R_BRACKET, _R_PAREN, _STAR])


def _tokenize(expr: str) -> list[_Token]:
    """GitHub's lexer (the rules of `@actions/expressions`' Lexer)."""
    if len(expr) > MAX_EXPRESSION_LENGTH:
        raise _error(f"Exceeded max expression length {MAX_EXPRESSION_LENGTH}", expr, 0)
    tokens: list[_Token] = []
    append = tokens.append
    n = len(expr)
    i = 0
    prev = _EOF
    while i < n:
        c = expr[i]
        start = i
        if c in " \r\t\n":
            m = _SPACE_RUN.match(expr, i)
            i = m.end() if m else i + 1
            continue
        kind = _SINGLE.get(c)
        if kind is not None:
            append(_Token(kind, c, start))
            i += 1
        elif c in _WITH_EQ:
            if i + 1 < n and expr[i + 1] == "=":
                append(_Token(_WITH_EQ[c][1], c + "=", start))
                i += 2
            else:
                append(_Token(_WITH_EQ[c][0], c, start))
                i += 1
        elif c == "'":
            sm = _STRING_RE.match(expr, i)
            if sm is None:
                raise _error(f"Unexpected symbol: '{expr[start:]}'", expr, start)
            i = sm.end()
            append(_Token(_STRING, sm.group(), start, expr[start + 1 : i - 1].replace("''", "'")))
        elif c == "." and prev in _AFTER_DOT_IS_PROPERTY:
            append(_Token(_DOT, c, start))
            i += 1
        elif c in "-+." or "0" <= c <= "9":
            wm = _NUMBER_WORD.match(expr, i + 1)
            end = wm.end() if wm else i + 1
            lexeme = expr[start:end]
            value = string_to_number(lexeme)
            if math.isnan(value):
                raise _error(f"Unexpected symbol: '{lexeme}'", expr, start)
            append(_Token(_NUMBER, lexeme, start, _literal_number(value)))
            i = end
        elif c in _DOUBLED and i + 1 < n and expr[i + 1] == c:
            append(_Token(_DOUBLED[c], c + c, start))
            i += 2
        else:
            wm = _WORD.match(expr, i + 1)
            end = wm.end() if wm else i + 1
            lexeme = expr[start:end]
            if not _IDENT_RE.fullmatch(lexeme):
                raise _error(f"Unexpected symbol: '{lexeme}'", expr, start)
            keyword = _KEYWORDS.get(lexeme) if prev != _DOT else None
            if keyword is not None:
                append(_Token(keyword[0], lexeme, start, keyword[1]))
            else:
                append(_Token(_IDENT, lexeme, start))
            i = end
        prev = tokens[-1].kind
    tokens.append(_Token(_EOF, "", n))
    return tokens


def _literal_number(value: float) -> int | float:
    negative_zero = value == 0 and math.copysign(1, value) < 0
    if value.is_integer() and abs(value) < 2**53 and not negative_zero:
        return int(value)
    return value


# --------------------------------------------------------------------------- parser

# A compiled node: a function of the evaluation state.
_Node = Callable[["_State"], Any]


#: The status of the jobs named in `success('a', 'b')` / `failure('a')` in a
#: job's `if:` (same values as the aggregate `status`); raises ValueError for a
#: name it does not know. Given by the control plane (`control.conditions`).
NamedStatus = Callable[[Sequence[Any]], str]


@dataclass(slots=True)
class _State:
    contexts: Mapping[str, Any]
    status: str
    hash_files: HashFiles | None
    expr: str
    named: NamedStatus | None = None


@dataclass(frozen=True, slots=True)
class _Func:
    min_args: int
    max_args: int


_FUNCTIONS: dict[str, _Func] = {
    "contains": _Func(2, 2),
    "startswith": _Func(2, 2),
    "endswith": _Func(2, 2),
    "format": _Func(1, 255),
    "join": _Func(1, 2),
    "tojson": _Func(1, 1),
    "fromjson": _Func(1, 1),
    "hashfiles": _Func(1, 255),
    "case": _Func(3, 2**53),
    # A job's `if:` may name jobs (`success('build')`); where arguments are
    # allowed is the schema's business (see `Parsed.arity`).
    "success": _Func(0, 2**53),
    "failure": _Func(0, 2**53),
    "always": _Func(0, 0),
    "cancelled": _Func(0, 0),
}


@dataclass(frozen=True, slots=True)
class Parsed:
    """A parsed expression: its compiled form, the contexts and functions it
    names (lower-case), for static checks such as context availability."""

    text: str
    contexts: frozenset[str]
    functions: frozenset[str]
    root: _Node
    # The most arguments each function is called with.
    arity: Mapping[str, int] = field(default_factory=dict)

    def evaluate(
        self,
        contexts: Mapping[str, Any],
        *,
        status: str = "success",
        hash_files: HashFiles | None = None,
        known_contexts: frozenset[str] | None = None,
        named_status: NamedStatus | None = None,
    ) -> Any:
        allowed = known_contexts if known_contexts is not None else CONTEXT_NAMES
        for name in self.contexts:
            if name not in allowed and not _has_context(contexts, name):
                reason = f"Unrecognized named-value: '{name}'"
                raise _error(reason, self.text, self._offset_of(name))
        state = _State(contexts, status, hash_files, self.text, named_status)
        v = self.root(state)
        return list(v) if isinstance(v, _Filtered) else v

    def _offset_of(self, name: str) -> int:
        m = re.search(rf"(?<![.\w-]){re.escape(name)}(?![\w-])", self.text, re.IGNORECASE)
        return m.start() if m else 0


def _has_context(contexts: Mapping[str, Any], name: str) -> bool:
    return any(isinstance(k, str) and k.lower() == name for k in contexts)


class _Parser:
    def __init__(self, expr: str) -> None:
        self.expr = expr
        self.tokens = _tokenize(expr)
        self.kinds = [t.kind for t in self.tokens]
        self.pos = 0
        self.depth = 0
        self.contexts: set[str] = set()
        self.functions: set[str] = set()
        self.arity: dict[str, int] = {}

    # token helpers -----------------------------------------------------------
    def peek(self) -> _Token:
        return self.tokens[self.pos]

    def at_end(self) -> bool:
        return self.kinds[self.pos] == _EOF

    def check(self, kind: int) -> bool:
        # The EOF token is never asked for, so no separate end check is needed.
        return self.kinds[self.pos] == kind

    def match(self, *kinds: int) -> bool:
        if self.kinds[self.pos] in kinds:
            self.pos += 1
            return True
        return False

    def previous(self) -> _Token:
        return self.tokens[self.pos - 1]

    def fail(self, reason: str, tok: _Token) -> ExpressionError:
        text = tok.lexeme if tok.kind != _EOF else "EOF"
        if tok.kind == _STRING:
            text = str(tok.value)
        return _error(f"{reason}: '{text}'", self.expr, tok.start)

    def incr(self) -> None:
        self.depth += 1
        if self.depth > MAX_PARSER_DEPTH:
            raise self.fail(f"Exceeded max expression depth {MAX_PARSER_DEPTH}", self.peek())

    # grammar -----------------------------------------------------------------
    def parse(self) -> _Node:
        if self.at_end():
            raise _error("Expected an expression", self.expr, 0)
        node = self.expression()
        if not self.at_end():
            raise self.fail("Unexpected symbol", self.peek())
        return node

    def expression(self) -> _Node:
        self.incr()
        try:
            return self.logical(_OR, self.and_expr)
        finally:
            self.depth -= 1

    def and_expr(self) -> _Node:
        return self.logical(_AND, self.equality)

    def logical(self, op: int, operand: Callable[[], _Node]) -> _Node:
        first = operand()
        if not self.check(op):
            return first
        self.incr()
        try:
            args = [first]
            while self.match(op):
                args.append(operand())
        finally:
            self.depth -= 1
        return _make_logical(op == _AND, tuple(args))

    def equality(self) -> _Node:
        node = self.comparison()
        while self.match(_NE, _EQ):
            op = self.previous().kind
            right = self.comparison()
            node = _make_binary(op, node, right)
        return node

    def comparison(self) -> _Node:
        node = self.unary()
        while self.match(_GT, _GE, _LT, _LE):
            op = self.previous().kind
            right = self.unary()
            node = _make_binary(op, node, right)
        return node

    def unary(self) -> _Node:
        if self.match(_BANG):
            self.incr()
            operand = self.unary()
            self.depth -= 1
            return lambda s: not truthy(operand(s))
        return self.index()

    def index(self) -> _Node:
        node, accessible = self.call()
        if not accessible:
            return node
        raised = 0
        while True:
            if self.match(_L_BRACKET):
                if self.match(_STAR):
                    idx: _Node | None = None
                else:
                    idx = self.expression()
                if not self.check(_R_BRACKET):
                    raise self.fail("Unexpected symbol", self.peek())
                self.pos += 1
                self.incr()
                raised += 1
                node = _make_index(node, idx)
            elif self.match(_DOT):
                self.incr()
                raised += 1
                if self.match(_IDENT):
                    node = _make_property(node, self.previous().lexeme)
                elif self.match(_STAR):
                    node = _make_index(node, None)
                else:
                    raise self.fail("Unexpected symbol", self.peek())
            else:
                break
        self.depth -= raised
        return node

    def call(self) -> tuple[_Node, bool]:
        """A primary; the flag says whether `.x` / `[x]` may follow (only after
        a context, a function call or a parenthesised group, GitHub's rule)."""
        if not self.check(_IDENT):
            return self.primary()
        ident = self.peek()
        self.pos += 1
        name = ident.lexeme.lower()
        if not self.match(_L_PAREN):
            self.contexts.add(name)
            return _make_context(name), True
        args: list[_Node] = []
        while not self.match(_R_PAREN):
            args.append(self.expression())
            if not self.check(_R_PAREN):
                if not self.check(_COMMA):
                    raise self.fail("Unexpected symbol", self.peek())
                self.pos += 1
        func = _FUNCTIONS.get(name)
        if func is None:
            raise self.fail("Unrecognized function", ident)
        if len(args) < func.min_args:
            raise self.fail("Too few parameters supplied", ident)
        if len(args) > func.max_args:
            raise self.fail("Too many parameters supplied", ident)
        if name == "case" and len(args) % 2 == 0:
            raise self.fail(
                "Even number of parameters supplied, requires an odd number of parameters",
                ident,
            )
        self.functions.add(name)
        self.arity[name] = max(self.arity.get(name, 0), len(args))
        return _make_call(name, tuple(args), ident.start), True

    def primary(self) -> tuple[_Node, bool]:
        tok = self.peek()
        if tok.kind in (_TRUE, _FALSE, _NULL, _NUMBER, _STRING):
            self.pos += 1
            value = tok.value
            return (lambda s: value), False
        if self.match(_L_PAREN):
            node = self.expression()
            if self.at_end():
                raise self.fail("Unexpected end of expression", self.previous())
            if not self.check(_R_PAREN):
                raise self.fail("Unexpected symbol", self.peek())
            self.pos += 1
            return node, True
        if self.at_end():
            raise self.fail("Unexpected end of expression", self.previous() if self.pos else tok)
        raise self.fail("Unexpected symbol", tok)


def _make_logical(is_and: bool, args: tuple[_Node, ...]) -> _Node:
    if is_and:

        def node(s: _State) -> Any:
            v = None
            for a in args:
                v = a(s)
                if not truthy(v):
                    break
            return v

    else:

        def node(s: _State) -> Any:
            v = None
            for a in args:
                v = a(s)
                if truthy(v):
                    break
            return v

    return node


def _make_binary(op: int, left: _Node, right: _Node) -> _Node:
    if op == _EQ:
        return lambda s: loose_equals(left(s), right(s))
    if op == _NE:
        return lambda s: not loose_equals(left(s), right(s))
    if op == _GT:
        return lambda s: _greater(left(s), right(s))
    if op == _LT:
        return lambda s: _less(left(s), right(s))
    if op == _GE:

        def ge(s: _State) -> bool:
            a, b = left(s), right(s)
            return loose_equals(a, b) or _greater(a, b)

        return ge

    def le(s: _State) -> bool:
        a, b = left(s), right(s)
        return loose_equals(a, b) or _less(a, b)

    return le


def _make_context(name: str) -> _Node:
    def node(s: _State) -> Any:
        c = s.contexts
        if name in c:
            return c[name]
        return _get_key(c, name)[1]

    return node


def _make_property(obj: _Node, key: str) -> _Node:
    def node(s: _State) -> Any:
        o = obj(s)
        if isinstance(o, Mapping) and not isinstance(o, _Filtered):
            return _get_key(o, key)[1]
        return _access(o, False, key)

    return node


def _make_index(obj: _Node, idx: _Node | None) -> _Node:
    if idx is None:
        return lambda s: _access(obj(s), True, None)

    def node(s: _State) -> Any:
        i = idx(s)  # GitHub evaluates the index before the object
        return _access(obj(s), False, i)

    return node


def _make_call(name: str, args: tuple[_Node, ...], offset: int) -> _Node:
    impl = _IMPLS[name]

    def node(s: _State) -> Any:
        values = [a(s) for a in args]
        try:
            return impl(s, values)
        except ExpressionError:
            raise
        except (ValueError, TypeError, OSError, RecursionError) as exc:
            raise _error(f"{name}: {exc}", s.expr, offset) from exc

    return node


# --------------------------------------------------------------------------- functions


def _fn_contains(s: _State, a: list[Any]) -> bool:
    search, item = a
    if _is_primitive(search):
        if _is_primitive(item):
            return coerce_string(item).lower() in coerce_string(search).lower()
        return False
    if _is_array(search):
        return any(loose_equals(item, v) for v in search)
    return False


def _fn_startswith(s: _State, a: list[Any]) -> bool:
    if not (_is_primitive(a[0]) and _is_primitive(a[1])):
        return False
    return _upper(coerce_string(a[0])).startswith(_upper(coerce_string(a[1])))


def _fn_endswith(s: _State, a: list[Any]) -> bool:
    if not (_is_primitive(a[0]) and _is_primitive(a[1])):
        return False
    return _upper(coerce_string(a[0])).endswith(_upper(coerce_string(a[1])))


def _fn_format(s: _State, a: list[Any]) -> str:
    fmt = coerce_string(a[0])
    out: list[str] = []
    i = 0
    n = len(fmt)
    while i < n:
        lb = fmt.find("{", i)
        rb = fmt.find("}", i)
        if lb >= 0 and (rb < 0 or rb > lb):
            if lb + 1 < n and fmt[lb + 1] == "{":  # `{{` is a literal brace
                out.append(fmt[i : lb + 1])
                i = lb + 2
                continue
            if rb > lb + 1:
                j = lb + 1
                while j < n and "0" <= fmt[j] <= "9":
                    j += 1
                if j > lb + 1:
                    arg = int(fmt[lb + 1 : j])
                    if arg + 1 > len(a) - 1:
                        raise ValueError(
                            f"the format string references more arguments than were supplied: {fmt}"
                        )
                    out.append(fmt[i:lb])
                    out.append(coerce_string(a[arg + 1]))
                    i = rb + 1
                    continue
            raise ValueError(f"the format string is invalid: {fmt}")
        if rb >= 0:
            if rb + 1 < n and fmt[rb + 1] == "}":
                out.append(fmt[i : rb + 1])
                i = rb + 2
                continue
            raise ValueError(f"the format string is invalid: {fmt}")
        out.append(fmt[i:])
        break
    return "".join(out)


def _fn_join(s: _State, a: list[Any]) -> str:
    items = a[0]
    if _is_primitive(items):
        return coerce_string(items)
    if _is_array(items):
        sep = coerce_string(a[1]) if len(a) > 1 and _is_primitive(a[1]) else ","
        return sep.join(coerce_string(x) for x in items)
    return ""


def _fn_tojson(s: _State, a: list[Any]) -> str:
    return to_json(a[0])


def _fn_fromjson(s: _State, a: list[Any]) -> Any:
    return from_json(coerce_string(a[0]))


def _fn_case(s: _State, a: list[Any]) -> Any:
    for i in range(0, len(a) - 1, 2):
        if not isinstance(a[i], bool):
            raise ValueError("case predicate must evaluate to a boolean value")
        if a[i]:
            return a[i + 1]
    return a[-1]


def _fn_hashfiles(s: _State, a: list[Any]) -> str:
    patterns = [coerce_string(p) for p in a]
    if s.hash_files is not None:
        return s.hash_files(patterns)
    from preloop.workflow.hashfiles import hash_files

    github = _get_key(s.contexts, "github")[1]
    root = _get_key(github, "workspace")[1] if isinstance(github, Mapping) else None
    return hash_files(str(root) if root else os.getcwd(), patterns)


def _status_of(s: _State, names: list[Any]) -> str:
    """The status `success(...)`/`failure(...)` look at: the named jobs' when
    they name jobs (a job's `if:`), else the aggregate one."""
    return s.named(names) if names and s.named is not None else s.status


_IMPLS: dict[str, Callable[[_State, list[Any]], Any]] = {
    "contains": _fn_contains,
    "startswith": _fn_startswith,
    "endswith": _fn_endswith,
    "format": _fn_format,
    "join": _fn_join,
    "tojson": _fn_tojson,
    "fromjson": _fn_fromjson,
    "case": _fn_case,
    "hashfiles": _fn_hashfiles,
    "success": lambda s, a: _status_of(s, a) == "success",
    "failure": lambda s, a: _status_of(s, a) == "failure",
    "cancelled": lambda s, a: s.status == "cancelled",
    "always": lambda s, a: True,
}


# --------------------------------------------------------------------------- API


@functools.lru_cache(maxsize=8192)
def parse(expr: str) -> Parsed:
    """Parses an expression (text without `${{ }}`); raises ExpressionError."""
    p = _Parser(expr)
    root = p.parse()
    return Parsed(expr, frozenset(p.contexts), frozenset(p.functions), root, p.arity)


def evaluate(
    expr: str,
    contexts: Mapping[str, Any],
    *,
    status: str = "success",
    hash_files: HashFiles | None = None,
    named_status: NamedStatus | None = None,
) -> Any:
    """Evaluates `expr` (without `${{ }}`) over `contexts`.

    `status` is the aggregate job status the status functions consult
    ("success", "failure" or "cancelled"); `hash_files(patterns)` overrides
    how `hashFiles` is computed (default: GitHub's algorithm over the files
    under `github.workspace`, or the current directory); `named_status` gives
    the status of the jobs a job `if:` names in `success('a')`/`failure('a')`.
    """
    return parse(expr).evaluate(
        contexts, status=status, hash_files=hash_files, named_status=named_status
    )


def _unwrap(condition: str) -> str | None:
    """The inner text of a condition that is exactly one `${{ }}`, else None."""
    text = condition.strip()
    if not text.startswith("${{"):
        return None
    segs = template_segments(text)
    if len(segs) == 1 and segs[0][0]:
        return segs[0][1]
    return None


def uses_status_function(condition: str | None) -> bool:
    """Whether `condition` calls success(), failure(), always() or cancelled()."""
    if condition is None or not condition.strip():
        return False
    inner = _unwrap(condition)
    text = inner if inner is not None else condition
    if "${{" in text:
        return any(
            is_expr and bool(parse(seg).functions & STATUS_FUNCTIONS)
            for is_expr, seg in template_segments(text)
        )
    return bool(parse(text).functions & STATUS_FUNCTIONS)


def evaluate_if(
    condition: str | None,
    contexts: Mapping[str, Any],
    *,
    status: str = "success",
    hash_files: HashFiles | None = None,
    named_status: NamedStatus | None = None,
) -> bool:
    """GitHub's `if:` rule: empty means `success()`; a condition that calls no
    status function means `success() && (condition)`; `${{ }}` is optional.
    `named_status`: see `evaluate` (a job's `if:` only)."""
    if condition is None or not condition.strip():
        return status == "success"
    inner = _unwrap(condition)
    text = inner if inner is not None else condition.strip()
    kw: dict[str, Any] = {"status": status, "hash_files": hash_files, "named_status": named_status}
    if "${{" in text:
        # A template with literal text around it is a non-empty string.
        value: Any = interpolate(text, contexts, **kw)
        return status == "success" and truthy(value)
    parsed = parse(text)
    if not parsed.functions & STATUS_FUNCTIONS and status != "success":
        return False
    return truthy(parsed.evaluate(contexts, **kw))


def template_segments(text: str) -> list[tuple[bool, str]]:
    """Splits a string into literal and `${{ }}` parts: `(is_expression, text)`.

    The closing `}}` is the first one outside a string literal. An unclosed
    `${{` raises ExpressionError.
    """
    out: list[tuple[bool, str]] = []
    i = 0
    n = len(text)
    while i < n:
        start = text.find("${{", i)
        if start < 0:
            out.append((False, text[i:]))
            break
        if start > i:
            out.append((False, text[i:start]))
        j = start + 3
        in_string = False
        while j < n:
            c = text[j]
            if c == "'":
                in_string = not in_string  # `''` toggles twice: still correct
            elif not in_string and c == "}" and text.startswith("}}", j):
                break
            j += 1
        if j >= n:
            line, col = _position(text, start)
            raise ExpressionError(
                "The expression is not closed: an unescaped '${{' must end with '}}'",
                text,
                line,
                col,
            )
        inner = text[start + 3 : j].strip()
        if not inner:
            line, col = _position(text, start)
            raise ExpressionError("An expression was expected", text, line, col)
        out.append((True, inner))
        i = j + 2
    return out


def interpolate(
    text: str,
    contexts: Mapping[str, Any],
    *,
    status: str = "success",
    hash_files: HashFiles | None = None,
    named_status: NamedStatus | None = None,
) -> str:
    """Replaces every `${{ }}` in `text` with its value as a string."""
    if "${{" not in text:
        return text
    parts: list[str] = []
    for is_expr, seg in template_segments(text):
        if is_expr:
            v = evaluate(
                seg, contexts, status=status, hash_files=hash_files, named_status=named_status
            )
            parts.append(coerce_string(v))
        else:
            parts.append(seg)
    return "".join(parts)


def evaluate_template(
    text: str,
    contexts: Mapping[str, Any],
    *,
    status: str = "success",
    hash_files: HashFiles | None = None,
) -> Any:
    """A YAML value that may hold expressions: exactly one `${{ }}` keeps its
    type (`${{ fromJSON(x) }}` is an object); anything else is a string."""
    inner = _unwrap(text)
    if inner is not None:
        return evaluate(inner, contexts, status=status, hash_files=hash_files)
    return interpolate(text, contexts, status=status, hash_files=hash_files)


def expressions_in(text: str) -> Sequence[str]:
    """The expressions of every `${{ }}` in `text`."""
    if "${{" not in text:
        return ()
    return [seg for is_expr, seg in template_segments(text) if is_expr]
