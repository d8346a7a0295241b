"""Command start-up, whole process against whole process.

Targets (issue 17): `preloop --version` <= 60 ms (beside `python -c pass`, the
interpreter's own floor), and `preloop du` on the 60k-file tree <= 1.2x `du -sb`.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from preloop.testing.trees import MIXED_TREE, cached_tree

PRELOOP = str(Path(sys.executable).with_name("preloop"))


def run(argv: list[str]) -> int:
    subprocess.run(argv, check=True, stdout=subprocess.DEVNULL)
    return 1


@pytest.mark.parametrize(
    "impl, argv",
    [
        ("preloop", [PRELOOP, "--version"]),
        ("python -c pass", [sys.executable, "-c", "pass"]),
    ],
)
def test_version(benchmark: Any, impl: str, argv: list[str]) -> None:
    if not os.access(argv[0], os.X_OK):
        pytest.skip(f"{argv[0]} is not installed")
    benchmark.group = "start-up: preloop --version"
    benchmark.extra_info["impl"] = impl
    benchmark.pedantic(run, args=(argv,), rounds=20, iterations=1, warmup_rounds=2)


@pytest.mark.parametrize("impl", ["preloop", "du -sb"])
def test_du_command(benchmark: Any, impl: str) -> None:
    root = str(cached_tree(MIXED_TREE))
    argv = [PRELOOP, "du", root] if impl == "preloop" else ["du", "-sb", root]
    benchmark.group = "start-up: du of the mixed tree (whole process)"
    benchmark.extra_info["impl"] = impl
    benchmark.pedantic(run, args=(argv,), rounds=10, iterations=1, warmup_rounds=1)
