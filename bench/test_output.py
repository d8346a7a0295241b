"""The step-output line splitter on hostile output, against `cat` into a file.

100 MB of step output, once as one line and once as 100-byte lines, read from
a step (`cat FILE`) through `preloop.runner.stream.run_streaming` and written
to a log file a batch of lines at a time (as `JobLog.write_lines` does),
against `cat FILE > OUT`. Each case runs in its own Python process, which
reports its wall time, its CPU time (user + system, the step's `cat`
included: steadier than wall time on a loaded machine) and its peak RSS
growth (`VmHWM`, reset through `/proc/self/clear_refs` before the run, minus
the RSS before it), so memory is comparable between the two shapes. Targets (issue
15): both within 3x of `cat`'s time, memory independent of line length. A
third case adds what a real step's output goes through besides splitting: the
workflow-command parser and masking (`WorkflowCommandParser.lines`).

    .venv/bin/python -m pytest bench/test_output.py --benchmark-only -s
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

SIZE = 100 * 1024 * 1024
TREES = Path(os.environ.get("PRELOOP_BENCH_TREES", "/var/tmp/preloop-bench-trees"))

_WORKER = r"""
import json, resource, sys, time
import anyio
from preloop.runner.stream import run_streaming
from preloop.runner.commands import WorkflowCommandParser
from preloop.runner.masking import Masker

mode, src, dst = sys.argv[1:4]
def status(field):
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1])  # KiB
    return 0

# Reset the peak-RSS mark (VmHWM) so that only the run's own peak counts.
with open("/proc/self/clear_refs", "w") as fh:
    fh.write("5")
baseline = status("VmRSS")
out = open(dst, "w", encoding="utf-8")
if mode == "parse":
    masker = Masker()
    masker.add("not-in-the-output-secret")
    parser = WorkflowCommandParser(masker, "job", "step")

    def on_lines(texts):
        shown = parser.lines(texts)
        if shown:
            out.write("\n".join(shown) + "\n")
else:
    def on_lines(texts):
        out.write("\n".join(texts) + "\n")

async def main():
    await run_streaming(["cat", src], cwd="/", env={"PATH": "/usr/bin:/bin"}, timeout=None,
                        on_lines=on_lines)

def cpu():
    own = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime

t, c = time.perf_counter(), cpu()
anyio.run(main)
out.close()
elapsed, cpu_seconds = time.perf_counter() - t, cpu() - c
# Peak RSS over the run, relative to what was resident before it (imports).
print(json.dumps({"seconds": elapsed, "cpu_seconds": cpu_seconds,
                  "peak_growth_kib": status("VmHWM") - baseline}))
"""


def _input(shape: str) -> Path:
    TREES.mkdir(parents=True, exist_ok=True)
    path = TREES / f"output-{shape}-{SIZE}.txt"
    if not path.exists() or path.stat().st_size != SIZE:
        tmp = path.with_suffix(".tmp")
        with open(tmp, "wb") as fh:
            if shape == "one-line":
                fh.write(b"x" * (SIZE - 1) + b"\n")
            else:
                line = b"y" * 99 + b"\n"
                fh.write(line * (SIZE // 100))
                fh.write(b"z" * (SIZE % 100 - 1) + b"\n")
        os.replace(tmp, path)
    return path


def _children_cpu() -> float:
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return kids.ru_utime + kids.ru_stime


def _cat(src: Path, dst: Path) -> dict[str, Any]:
    t, c = time.perf_counter(), _children_cpu()
    with open(dst, "wb") as out:
        subprocess.run(["cat", str(src)], stdout=out, check=True)
    return {
        "seconds": time.perf_counter() - t,
        "cpu_seconds": _children_cpu() - c,
        "peak_growth_kib": 0,
    }


def _preloop(mode: str, src: Path, dst: Path) -> dict[str, Any]:
    proc = subprocess.run(
        [sys.executable, "-c", _WORKER, mode, str(src), str(dst)],
        check=True,
        capture_output=True,
        text=True,
    )
    result: dict[str, Any] = json.loads(proc.stdout)
    return result


_RESULTS: dict[tuple[str, str], dict[str, Any]] = {}


@pytest.mark.parametrize("shape", ["one-line", "100-byte-lines"])
@pytest.mark.parametrize("impl", ["cat", "splitter", "splitter+parse+mask"])
def test_output(benchmark: Any, tmp_path: Path, shape: str, impl: str) -> None:
    src = _input(shape)
    dst = tmp_path / "out.txt"
    runs: list[dict[str, Any]] = []

    def once() -> None:
        if impl == "cat":
            runs.append(_cat(src, dst))
        else:
            runs.append(_preloop("split" if impl == "splitter" else "parse", src, dst))

    benchmark.group = f"100 MB of step output, {shape}"
    benchmark.extra_info["impl"] = impl
    benchmark.pedantic(once, rounds=3, iterations=1, warmup_rounds=1)
    assert dst.stat().st_size >= SIZE  # every byte arrived (a long line: in pieces)
    best = min(r["seconds"] for r in runs)
    best_cpu = min(r["cpu_seconds"] for r in runs)
    peak = max(r["peak_growth_kib"] for r in runs)
    benchmark.extra_info["seconds"] = round(best, 3)
    benchmark.extra_info["cpu_seconds"] = round(best_cpu, 3)
    benchmark.extra_info["peak_rss_growth_mib"] = round(peak / 1024, 1)
    _RESULTS[(shape, impl)] = {"seconds": best, "cpu": best_cpu, "peak_mib": peak / 1024}
    base = _RESULTS.get((shape, "cat"))
    ratio = cpu_ratio = ""
    if base and impl != "cat":
        ratio = f" = {best / base['seconds']:.1f}x cat"
        cpu_ratio = f" = {best_cpu / max(base['cpu'], 1e-3):.1f}x cat"
    print(
        f"\n{shape:15} {impl:20} {best:7.3f} s{ratio}; CPU {best_cpu:.3f} s{cpu_ratio}; "
        f"peak RSS growth {peak / 1024:.1f} MiB"
    )
