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
from dataclasses import dataclass, field
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
    index: dict[Any, int] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        if not self.index:
            self.index.update((k.value, i) for i, (k, _) in enumerate(self.items))

    def get(self, key: str) -> YNode | None:
        i = self.index.get(key)
        return None if i is None else self.items[i][1]

    def key_node(self, key: str) -> YScalar | None:
        i = self.index.get(key)
        return None if i is None else self.items[i][0]


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


_MAYBE_TYPED = frozenset("~nNtTfF0123456789+-.")


def resolve_plain(text: str) -> Any:
    """YAML 1.2 core-schema resolution of a plain scalar."""
    if text and text[0] not in _MAYBE_TYPED:
        return text  # a word: no typed form starts this way
    if _NULL.fullmatch(text):
        return None
    if _TRUE.fullmatch(text):
        return True
    if _FALSE.fullmatch(text):
        return False
    if _INT.fullmatch(text):
        return _number(int(text))
    if _OCT.fullmatch(text):
        return _number(int(text[2:], 8))
    if _HEX.fullmatch(text):
        return _number(int(text[2:], 16))
    if _FLOAT.fullmatch(text):
        return float(text)
    if _INF.fullmatch(text):
        return -math.inf if text.startswith("-") else math.inf
    if _NAN.fullmatch(text):
        return math.nan
    return text


def _number(n: int) -> int | float:
    """An integer as JavaScript (GitHub's parser) holds it: exact up to 2^53,
    a double beyond (infinity past the largest double), never an overflow."""
    if -_SAFE <= n <= _SAFE:
        return n
    try:
        return float(n)
    except OverflowError:
        return math.inf if n > 0 else -math.inf


_SAFE = 2**53
#: YAML aliases may add at most this many values to a document (billion laughs).
MAX_ALIAS_EXPANSION = 100_000
#: Mappings and sequences nest at most this deep (GitHub's reader default;
#: its test data errors-matrix-max-depth.yml refuses the 51st level).
MAX_OBJECT_DEPTH = 50
_EXPLICIT_TAG = re.compile(r"(?:&\S+\s+)?!")
_CORE = "tag:yaml.org,2002:"
_TYPED_SCALARS = {_CORE + "null": type(None), _CORE + "bool": bool, _CORE + "int": int}


class _AliasBomb(Exception):
    """Aliases expand too much, or an alias contains itself."""


class _Converter:
    """yaml.Node -> YNode. An aliased node is converted once and shared (the
    tree is immutable); what aliases add to the expanded document is counted
    as it goes, so a billion-laughs file stops after MAX_ALIAS_EXPANSION
    values instead of expanding."""

    def __init__(self, path: str, errors: list[Diagnostic], text: str) -> None:
        self.path = path
        self.errors = errors
        self.text = text
        self.done: dict[int, tuple[YNode, int]] = {}
        self.active: set[int] = set()
        self.growth = 0
        self.too_deep = False  # reported once, as GitHub stops there

    def convert(self, node: yaml.Node, depth: int = 0) -> tuple[YNode, int]:
        key = id(node)
        hit = self.done.get(key) if self.done else None
        if hit is not None:
            self.growth += hit[1]
            if self.growth > MAX_ALIAS_EXPANSION:
                raise _AliasBomb("they expand too much")
            return hit
        if key in self.active:
            raise _AliasBomb("an alias contains itself")
        line, col = node.start_mark.line + 1, node.start_mark.column + 1
        if depth > 200:
            self.errors.append(Diagnostic(self.path, line, col, "YAML nesting is too deep"))
            return YScalar(None, line, col), 1
        text = self.text
        at = node.start_mark.index
        tagged = text[at : at + 1] in ("!", "&")  # an explicit tag (maybe after an anchor)
        if tagged and (problem := _tag_problem(node, text)) is not None:
            self.errors.append(Diagnostic(self.path, line, col, problem))
        out: YNode
        if isinstance(node, yaml.ScalarNode):
            start, end = node.start_mark.index, node.end_mark.index
            explicit_str = tagged and node.tag == _CORE + "str" and _explicit(node, text)
            if not node.style and not explicit_str:  # plain (C composer: '', Python: None)
                out = YScalar(resolve_plain(node.value), line, col, False, start, end)
            else:
                out = YScalar(node.value, line, col, True, start, end)
            # Not memoised: an alias to a scalar costs what its text costs.
            return out, 1
        if depth >= MAX_OBJECT_DEPTH:  # `depth` collections enclose this one
            if not self.too_deep:
                self.too_deep = True
                self.errors.append(
                    Diagnostic(
                        self.path,
                        line,
                        col,
                        f"Maximum object depth exceeded: GitHub nests at most {MAX_OBJECT_DEPTH}"
                        " mappings and sequences",
                    )
                )
            return YScalar(None, line, col), 1
        self.active.add(key)
        size = 1
        if isinstance(node, yaml.SequenceNode):
            items = []
            for n in node.value:
                y, k = self.convert(n, depth + 1)
                items.append(y)
                size += k
            out = YSeq(tuple(items), line, col)
        else:
            assert isinstance(node, yaml.MappingNode)
            out, size = self.mapping(node, line, col, depth)
        self.active.discard(key)
        self.done[key] = (out, size)
        return out, size

    def mapping(self, node: yaml.MappingNode, line: int, col: int, depth: int) -> tuple[YMap, int]:
        path, errors = self.path, self.errors
        items: list[tuple[YScalar, YNode]] = []
        seen: set[Any] = set()
        size = 1
        for k, v in node.value:
            key, ks = self.convert(k, depth + 1)
            size += ks
            if k.tag == "tag:yaml.org,2002:merge":
                errors.append(
                    Diagnostic(path, key.line, key.column, "YAML merge keys (<<) are not supported")
                )
                continue
            if not isinstance(key, YScalar):
                errors.append(
                    Diagnostic(path, key.line, key.column, "a mapping key must be a scalar")
                )
                continue
            # Keys are names: keep their text (`on`, `1`, `true` are all names).
            key = YScalar(
                k.value if isinstance(k, yaml.ScalarNode) else key.value, key.line, key.column
            )
            value, vs = self.convert(v, depth + 1)
            size += vs
            if key.value in seen:
                errors.append(
                    Diagnostic(path, key.line, key.column, f"'{key.value}' is already defined")
                )
                continue  # the first value stands (and is the one validated)
            seen.add(key.value)
            items.append((key, value))
        return YMap(tuple(items), line, col), size


def _explicit(node: yaml.Node, text: str) -> bool:
    return bool(text) and _EXPLICIT_TAG.match(text, node.start_mark.index) is not None


def _tag_problem(node: yaml.Node, text: str) -> str | None:
    """GitHub's YAML reader takes explicit tags of the core schema only, and a
    typed one (`!!int`) only on a plain scalar of that type."""
    if not _explicit(node, text):
        return None
    tag = node.tag
    if isinstance(node, yaml.ScalarNode):
        if tag == _CORE + "str":
            return None
        if tag in _TYPED_SCALARS or tag == _CORE + "float":
            if node.style:
                return f"the quoted scalar is not valid with the tag '{tag}'"
            value = resolve_plain(node.value)
            ok = (
                isinstance(value, int | float) and not isinstance(value, bool)
                if tag in (_CORE + "int", _CORE + "float")
                else type(value) is _TYPED_SCALARS[tag]
            )
            return None if ok else f"'{node.value}' is not valid with the tag '{tag}'"
    elif tag in (_CORE + "seq", _CORE + "map"):
        return None
    return f"unexpected YAML tag '{tag}'"


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
    try:
        root, _ = _Converter(path, errors, text).convert(node)
    except _AliasBomb as exc:
        errors[:] = [
            Diagnostic(
                path,
                1,
                1,
                f"YAML aliases: {exc} (at most {MAX_ALIAS_EXPANSION} values may come from aliases)",
            )
        ]
        return None, errors
    return root, errors


def plain(node: YNode) -> Any:
    """The node as plain Python data (dicts, lists, scalars)."""
    if isinstance(node, YScalar):
        return node.value
    if isinstance(node, YSeq):
        return [plain(n) for n in node.items]
    return {str(k.value): plain(v) for k, v in node.items}
