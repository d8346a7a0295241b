"""What the host took from this machine during a measurement.

On a virtual machine the hypervisor may deschedule a vCPU; every process on
it stalls, a lock holder included, and the stall lands in whatever is being
timed. Benchmarks whose targets are tail latencies or lock holds report the
steal alongside, so a figure over target can be told apart from the host."""

from __future__ import annotations

import os


def steal_ms() -> float | None:
    """CPU time the hypervisor took from this machine's vCPUs so far (the
    `steal` column of /proc/stat, in USER_HZ ticks), None where unknown."""
    try:
        with open("/proc/stat", encoding="ascii") as f:
            fields = f.readline().split()
        return int(fields[8]) * 1000 / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return None


def steal_between(before: float | None, after: float | None) -> float | None:
    """The steal between two `steal_ms` readings (None if either is unknown)."""
    return None if before is None or after is None else after - before
