"""Secret masking: the one place every string leaving a step goes through.

`Masker` holds the values to hide (`--secret` values, `::add-mask::`) and
replaces each occurrence by `***`. As GitHub's runner does (its SecretMasker
with the ValueEncoders registered by the runner's host context), a value is
also hidden in the forms a step is likely to print it in:

- base64 of its UTF-8 bytes at each of the three byte alignments (the value
  embedded in a longer base64 text such as `base64("user:" + password)`);
  only the characters fully determined by the value's bytes are registered,
  so the value is found whatever precedes or follows it;
- JSON string escaping (`"` -> `\\"`, control characters, with and without
  `\\uXXXX` for non-ASCII), URI data escaping (percent-encoding of everything
  but unreserved characters), XML escaping (`&lt;` `&gt;` `&amp;` `&quot;`
  `&apos;`), command-line quoting (`"` -> `\\"`), expression string escaping
  (`'` -> `''`) and the value without surrounding double quotes;
- each line of a multi-line value on its own.

Overlapping or adjacent occurrences are merged and masked as one span, so no
part of a value shows between two masks. `mask_json` masks every string of a
JSON-like document (keys too); the runner applies it to a job's result (step
names, outputs, annotations with all their properties, the summary) before
the result is logged, stored or shown.
"""

from __future__ import annotations

import base64
import heapq
import json
import re
from collections.abc import Iterable, Iterator
from typing import Any
from urllib.parse import quote

__all__ = ["MASK", "Masker", "encoded_forms", "mask_json"]

MASK = "***"

# An encoded form shorter than this is not registered on its own: a two- or
# three-character base64 fragment would mask unrelated text everywhere.
_MIN_ENCODED = 4
_LONG_TEXT = 4096


def _base64_forms(value: str) -> list[str]:
    raw = value.encode("utf-8")
    forms: list[str] = []
    for shift in range(3):
        tail = raw[shift:]
        if len(tail) < 3:
            continue
        text = base64.b64encode(tail).decode("ascii").rstrip("=")
        if len(tail) % 3:
            # The last character also carries bits of whatever follows.
            text = text[:-1]
        forms.append(text)
    return forms


def _xml_escape(value: str) -> str:
    return (
        value.replace("&", "&amp;")
        .replace("<", "&lt;")
        .replace(">", "&gt;")
        .replace('"', "&quot;")
        .replace("'", "&apos;")
    )


def encoded_forms(value: str) -> list[str]:
    """The encodings of `value` that are masked along with it (see the module
    docstring); `value` itself is not included."""
    forms = [
        *_base64_forms(value),
        json.dumps(value)[1:-1],
        json.dumps(value, ensure_ascii=False)[1:-1],
        quote(value, safe="-_.~"),
        _xml_escape(value),
        value.replace('"', '\\"'),
        value.replace("'", "''"),
    ]
    if len(value) > 8 and value.startswith('"') and value.endswith('"'):
        forms.append(value[1:-1])
    return [f for f in forms if f != value and len(f) >= _MIN_ENCODED]


class Masker:
    """Replaces registered values, and their encoded forms, by `***`."""

    #: Up to this many values (forms included) a text is searched value by
    #: value; beyond, with one compiled alternation (see `_occurrences`).
    find_limit = 48

    def __init__(self) -> None:
        self._values: set[str] = set()
        self._originals: set[str] = set()
        self._pattern: re.Pattern[str] | None = None

    def __bool__(self) -> bool:
        return bool(self._values)

    @property
    def values(self) -> frozenset[str]:
        """Every string masked (values and encoded forms)."""
        return frozenset(self._values)

    def add(self, value: str) -> None:
        """Masks `value` from now on, with each of its lines and their encoded forms."""
        if not value or value in self._originals:
            return
        self._originals.add(value)
        parts = {value}
        # Each line of a multi-line value is masked on its own, as GitHub does.
        for line in value.splitlines():
            line = line.strip("\r")
            if line.strip():
                parts.add(line)
        for part in parts:
            if not part.strip():
                continue
            for candidate in (part, *encoded_forms(part)):
                if candidate not in self._values:
                    self._values.add(candidate)
                    self._pattern = None

    def add_all(self, values: Iterable[str]) -> None:
        for value in values:
            self.add(value)

    def contains_secret(self, text: str) -> bool:
        """Whether masking would change `text`."""
        if not self._values:
            return False
        if len(text) > _LONG_TEXT or len(self._values) <= self.find_limit:
            # A substring search per value beats the regex alternation on
            # long text (a step printing megabytes on one line), and with
            # few values needs no alternation compiled at all.
            return any(v in text for v in self._values)
        return self._compiled().search(text) is not None

    def _compiled(self) -> re.Pattern[str]:
        if self._pattern is None:
            ordered = sorted(self._values, key=len, reverse=True)
            self._pattern = re.compile("|".join(re.escape(v) for v in ordered))
        return self._pattern

    def _occurrences(self, text: str) -> Iterator[tuple[int, int]]:
        """`(start, end)` of occurrences of the values in `text`, in order of
        start, covering every character of every occurrence (overlapping ones
        included). Up to `find_limit` values, a `str.find` per value, merged
        as found (a value repeating through a long line is not listed whole
        first): a job's token and its encoded forms are some ten values of
        hundreds of characters, whose alternation takes `re` ~2 ms to
        compile, again after every `add`, for a few lines of output. Beyond,
        the compiled alternation, which finds each start where some value
        occurs (its longest occurrence there)."""
        if len(self._values) <= self.find_limit:

            def found(v: str) -> Iterator[tuple[int, int]]:
                start = text.find(v)
                while start >= 0:
                    yield start, start + len(v)
                    start = text.find(v, start + 1)

            yield from heapq.merge(*(found(v) for v in self._values))
            return
        pattern = self._compiled()
        pos = 0
        while (m := pattern.search(text, pos)) is not None:
            start = m.start()
            end = max(
                (start + len(v) for v in self._values if text.startswith(v, start)),
                default=m.end(),
            )
            yield start, end
            pos = start + 1

    def mask(self, text: str) -> str:
        if not text or not self.contains_secret(text):
            return text  # the usual line: no generator, no merge
        # Overlapping or adjacent occurrences merged into spans: "abcd" and
        # "cdef" hide all of "abcdef".
        spans: list[tuple[int, int]] = []
        for start, end in self._occurrences(text):
            if spans and start <= spans[-1][1]:
                spans[-1] = (spans[-1][0], max(spans[-1][1], end))
            else:
                spans.append((start, end))
        out: list[str] = []
        last = 0
        for start, end in spans:
            out.append(text[last:start])
            out.append(MASK)
            last = end
        out.append(text[last:])
        return "".join(out)


def mask_json(value: Any, masker: Masker) -> Any:
    """`value` (dicts, lists, tuples, strings, scalars) with every string masked."""
    if not masker:
        return value
    if isinstance(value, str):
        return masker.mask(value)
    if isinstance(value, dict):
        return {mask_json(k, masker): mask_json(v, masker) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(mask_json(v, masker) for v in value)
    return value
