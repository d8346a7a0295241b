"""The README stays true: every knob and every command is documented there."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from preloop import config
from preloop.cli import cli

README = Path(__file__).resolve().parents[1] / "README.md"


def _section(title: str) -> str:
    if not README.exists():
        pytest.skip("README.md is not beside the tests (installed without the source tree)")
    text = README.read_text()
    m = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", text, re.S | re.M)
    assert m, f"README has no '## {title}' section"
    return m.group(1)


def test_every_knob_is_in_the_configuration_table() -> None:
    table = _section("Configuration")
    missing = [name for name in config.KNOBS if f"| `{name}` |" not in table]
    assert not missing, f"README's Configuration table lacks {missing}"


def test_every_command_is_in_the_command_line_section() -> None:
    block = _section("Command line")
    missing = [name for name in cli.commands if f"preloop {name}" not in block]
    assert not missing, f"README's Command line section lacks {missing}"
