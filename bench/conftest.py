"""Benchmark plumbing: side-by-side groups and a ratio table at the end.

Every benchmark sets `benchmark.group` to what is compared (a tree, a
workload) and `benchmark.extra_info["impl"]` to who is measured; the first
implementation named in `BASELINES` found in a group is the reference, and the
terminal summary prints every other implementation's mean time as a ratio of it.
A benchmark that measures two implementations in alternating rounds (so that
the load of a shared machine weighs on both alike) puts its one-line result in
`extra_info["paired"]`, printed after the table. One with
`extra_info["floor only"]` measures the host beside the others (its time is no
rival's) and is left out of the table.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import pytest

# The implementation whose time is the denominator, by preference.
BASELINES = ("preloop",)


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    session = getattr(config, "_benchmarksession", None)
    if session is None or not session.benchmarks:
        return
    groups: dict[str, dict[str, float]] = defaultdict(dict)
    for bench in session.benchmarks:
        if not bench.stats or bench.has_error:
            continue
        if bench.extra_info.get("floor only"):
            continue  # a measurement of the host beside the others, not a rival's time
        impl = bench.extra_info.get("impl", bench.name)
        groups[bench.group or bench.name][impl] = bench.stats.mean
    if not groups:
        return
    tr = terminalreporter
    tr.write_sep("=", "ratios (mean time / preloop's mean time; >1 means preloop is faster)")
    for group, impls in sorted(groups.items()):
        base = next((impls[b] for b in BASELINES if b in impls), None)
        if base is None:
            continue
        parts = []
        for impl, mean in sorted(impls.items(), key=lambda kv: kv[1]):
            parts.append(f"{impl} {mean * 1000:.1f} ms (x{mean / base:.2f})")
        tr.write_line(f"{group}: " + ", ".join(parts))
    paired = [
        f"{bench.group or bench.name}: {bench.extra_info['paired']}"
        for bench in session.benchmarks
        if bench.stats and not bench.has_error and bench.extra_info.get("paired")
    ]
    if paired:
        tr.write_sep("-", "alternating rounds")
        for line in paired:
            tr.write_line(line)
