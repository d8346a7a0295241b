"""The `on.schedule[].cron` syntax GitHub accepts.

GitHub's parser (`@actions/workflow-parser`) takes five fields separated by
spaces (minute, hour, day of month, month, day of week). Each field is `*`, a
number in the field's range, a month or weekday name (`jan`, `mon`, any case),
a range `a-b` (b not before a), a step `x/n` (n a positive number in range,
x any of the others) or a comma list of those. Numbers are read as JavaScript
reads them (`+"07"`, `+"0x1f"`), because that is what GitHub's check does;
anything else is "Invalid cron expression".

GitHub never runs a schedule more often than every five minutes, but an
interval shorter than that is valid (its parser only warns in editors).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass

from preloop.workflow.expressions import string_to_number

__all__ = ["is_valid_cron"]


@dataclass(frozen=True)
class _Field:
    low: int
    high: int
    names: Mapping[str, int]


_MONTHS = {
    name: i + 1
    for i, name in enumerate(
        ("jan", "feb", "mar", "apr", "may", "jun", "jul", "aug", "sep", "oct", "nov", "dec")
    )
}
_WEEKDAYS = {name: i for i, name in enumerate(("sun", "mon", "tue", "wed", "thu", "fri", "sat"))}

#: minute, hour, day of month, month, day of week.
_FIELDS = (
    _Field(0, 59, {}),
    _Field(0, 23, {}),
    _Field(1, 31, {}),
    _Field(1, 12, _MONTHS),
    _Field(0, 6, _WEEKDAYS),
)

# Only spaces separate fields (a tab is part of a field, and so is invalid).
_SPACES = re.compile(" +")


def is_valid_cron(text: str) -> bool:
    """Whether GitHub accepts `text` as a schedule's `cron`."""
    fields = _SPACES.split(text)
    return len(fields) == len(_FIELDS) and all(
        _valid(value, field) for value, field in zip(fields, _FIELDS, strict=True)
    )


def _number(value: str, field: _Field) -> float:
    named = field.names.get(value.lower())
    return float(named) if named is not None else string_to_number(value)


def _valid(value: str, field: _Field, *, compound: bool = True) -> bool:
    """One field; `compound` false for the operands of `-` and of a step,
    which may not themselves be lists, steps or ranges."""
    if value.lower() in field.names or value == "*":
        return True
    # A list binds loosest, then a step, then a range (`1-5/2,30`).
    if "," in value:
        return compound and all(item and _valid(item, field) for item in value.split(","))
    if "/" in value:
        parts = value.split("/")
        if not compound or len(parts) != 2 or not all(parts):
            return False
        start, step = parts
        n = string_to_number(step)
        if math.isnan(n) or n <= 0:
            return False
        return _valid(start, field) and _valid(step, field, compound=False)
    if "-" in value:
        parts = value.split("-")
        if not compound or len(parts) != 2 or not all(parts):
            return False
        first, last = parts
        return (
            _valid(first, field, compound=False)
            and _valid(last, field, compound=False)
            and _number(last, field) >= _number(first, field)
        )
    n = string_to_number(value)
    return not math.isnan(n) and field.low <= n <= field.high
