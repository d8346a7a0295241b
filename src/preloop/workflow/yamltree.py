"""YAML -> a small tree that remembers where every value came from.

PyYAML's C composer gives nodes with marks; this turns them into `YMap`,
`YSeq` and `YScalar` with 1-based line/column, so every validation error can
say `path:line:col`. Plain scalars are resolved with YAML 1.2's core schema,
as GitHub does (`on`, `yes` and `no` stay strings; `true`/`false`, numbers and
`null` are typed); quoted and block scalars are always strings.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

import yaml

__all__ = ["Diagnostic", "YMap", "YNode", "YScalar", "YSeq", "compose", "plain"]

try:
    _Loader: type = yaml.CSafeLoader
except AttributeError:  # pragma: no cover - PyYAML built without libyaml
    _Loader = yaml.SafeLoader


@dataclass(frozen=True, slots=True, order=True)
class Diagnostic:
    """One problem at `path:line:col` (1-based)."""

    path: str
    line: int
    column: int
    message: str
    # 0: the file's own structure (YAML, keys, types, expressions); 1: what
    # relates its parts (needs, cycles, matrices, called workflows). GitHub's
    # parser checks in the same two passes; errors are listed in this order.
    phase: int = 0

    def __str__(self) -> str:
        return f"{self.path}:{self.line}:{self.column}: {self.message}"


@dataclass(frozen=True, slots=True)
class YScalar:
    value: Any  # None, bool, int, float or str
    line: int
    column: int
    quoted: bool = False
    start: int = -1  # character offsets of the scalar in the source text
    end: int = -1

    @property
    def kind(self) -> str:
        return _kind_name(self.value)


@dataclass(frozen=True, slots=True)
class YSeq:
    items: tuple[YNode, ...]
    line: int
    column: int
    kind = "sequence"


@dataclass(frozen=True, slots=True)
class YMap:
    items: tuple[tuple[YScalar, YNode], ...]
    line: int
    column: int
    kind = "mapping"

    def get(self, key: str) -> YNode | None:
        for k, v in self.items:
            if k.value == key:
                return v
        return None

    def key_node(self, key: str) -> YScalar | None:
        for k, _ in self.items:
            if k.value == key:
                return k
        return None


YNode = YScalar | YSeq | YMap


def _kind_name(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "boolean"
    if isinstance(v, int | float):
        return "number"
    return "string"


_NULL = re.compile(r"~|null|Null|NULL|")
_TRUE = re.compile(r"true|True|TRUE")
_FALSE = re.compile(r"false|False|FALSE")
_INT = re.compile(r"[-+]?[0-9]+")
_OCT = re.compile(r"0o[0-7]+")
_HEX = re.compile(r"0x[0-9a-fA-F]+")
_FLOAT = re.compile(r"[-+]?(\.[0-9]+|[0-9]+(\.[0-9]*)?)([eE][-+]?[0-9]+)?")
_INF = re.compile(r"[-+]?\.(inf|Inf|INF)")
_NAN = re.compile(r"\.(nan|NaN|NAN)")


def resolve_plain(text: str) -> Any:
    """YAML 1.2 core-schema resolution of a plain scalar."""
    if _NULL.fullmatch(text):
        return None
    if _TRUE.fullmatch(text):
        return True
    if _FALSE.fullmatch(text):
        return False
    if _INT.fullmatch(text):
        return int(text)
    if _OCT.fullmatch(text):
        return int(text[2:], 8)
    if _HEX.fullmatch(text):
        return int(text[2:], 16)
    if _FLOAT.fullmatch(text):
        return float(text)
    if _INF.fullmatch(text):
        return -math.inf if text.startswith("-") else math.inf
    if _NAN.fullmatch(text):
        return math.nan
    return text


def _convert(node: yaml.Node, path: str, errors: list[Diagnostic], depth: int = 0) -> YNode:
    line, col = node.start_mark.line + 1, node.start_mark.column + 1
    if depth > 200:
        errors.append(Diagnostic(path, line, col, "YAML nesting is too deep"))
        return YScalar(None, line, col)
    if isinstance(node, yaml.ScalarNode):
        start, end = node.start_mark.index, node.end_mark.index
        if not node.style:  # plain (the C composer says '', the Python one None)
            return YScalar(resolve_plain(node.value), line, col, False, start, end)
        return YScalar(node.value, line, col, True, start, end)
    if isinstance(node, yaml.SequenceNode):
        return YSeq(tuple(_convert(n, path, errors, depth + 1) for n in node.value), line, col)
    assert isinstance(node, yaml.MappingNode)
    items: list[tuple[YScalar, YNode]] = []
    seen: set[Any] = set()
    for k, v in node.value:
        key = _convert(k, path, errors, depth + 1)
        if k.tag == "tag:yaml.org,2002:merge":
            errors.append(
                Diagnostic(path, key.line, key.column, "YAML merge keys (<<) are not supported")
            )
            continue
        if not isinstance(key, YScalar):
            errors.append(Diagnostic(path, key.line, key.column, "a mapping key must be a scalar"))
            continue
        # Keys are names: keep their text (`on`, `1`, `true` are all names).
        key = YScalar(
            k.value if isinstance(k, yaml.ScalarNode) else key.value, key.line, key.column
        )
        value = _convert(v, path, errors, depth + 1)
        if key.value in seen:
            errors.append(
                Diagnostic(path, key.line, key.column, f"'{key.value}' is already defined")
            )
            continue  # the first value stands (and is the one validated)
        seen.add(key.value)
        items.append((key, value))
    return YMap(tuple(items), line, col)


def compose(text: str, path: str) -> tuple[YNode | None, list[Diagnostic]]:
    """Parses one YAML document; YAML errors come back as diagnostics."""
    errors: list[Diagnostic] = []
    try:
        node = yaml.compose(text, Loader=_Loader)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        line, col = (mark.line + 1, mark.column + 1) if mark else (1, 1)
        problem = exc.problem or exc.context or "invalid YAML"
        ctx = f" ({exc.context})" if exc.context and exc.problem else ""
        errors.append(Diagnostic(path, line, col, f"YAML syntax error: {problem}{ctx}"))
        return None, errors
    except yaml.YAMLError as exc:
        errors.append(Diagnostic(path, 1, 1, f"YAML syntax error: {exc}"))
        return None, errors
    if node is None:
        return None, errors
    return _convert(node, path, errors), errors


def plain(node: YNode) -> Any:
    """The node as plain Python data (dicts, lists, scalars)."""
    if isinstance(node, YScalar):
        return node.value
    if isinstance(node, YSeq):
        return [plain(n) for n in node.items]
    return {str(k.value): plain(v) for k, v in node.items}
