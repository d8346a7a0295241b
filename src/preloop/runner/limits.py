"""GitHub's limits on what jobs pass on, and the kernel's on what a step gets.

- A job's outputs: at most 1 MB in total (`JOB_OUTPUTS_MAX_BYTES`); a run's:
  at most 50 MB (`RUN_OUTPUTS_MAX_BYTES`), as GitHub documents. An output over
  the limit fails its job with an error naming the output, and is not passed
  on to dependent jobs. The run's limit is the store's to check, inside the
  completion's transaction (`preloop.control.types.RUN_OUTPUTS_MAX_BYTES`).
- Linux refuses to start a process whose single argument or environment
  string exceeds 128 KiB, or whose arguments and environment together exceed
  its `ARG_MAX` (`E2BIG`). `explain_e2big` names the largest offender, so the
  step fails with a message saying what to do, not a traceback.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from preloop.control.types import RUN_OUTPUTS_MAX_BYTES

__all__ = [
    "JOB_OUTPUTS_MAX_BYTES",
    "MAX_ARG_STRLEN",
    "RUN_OUTPUTS_MAX_BYTES",
    "explain_e2big",
    "limit_job_outputs",
    "output_bytes",
]

JOB_OUTPUTS_MAX_BYTES = 1024 * 1024
#: Linux's limit on one argument or environment string (32 pages).
MAX_ARG_STRLEN = 32 * 4096


def output_bytes(name: str, value: str) -> int:
    return len(name.encode("utf-8", "replace")) + len(value.encode("utf-8", "replace"))


def limit_job_outputs(
    outputs: Mapping[str, str], limit: int = JOB_OUTPUTS_MAX_BYTES
) -> tuple[dict[str, str], list[str]]:
    """The outputs that fit in `limit` bytes (in declaration order) and one
    error message per output that does not."""
    kept: dict[str, str] = {}
    errors: list[str] = []
    total = 0
    for name, value in outputs.items():
        size = output_bytes(name, value)
        if total + size > limit:
            errors.append(
                f"job output {name!r} ({size:,} bytes) exceeds GitHub's limit of "
                f"{limit:,} bytes for a job's outputs ({total:,} bytes used by the "
                "outputs before it); it is not passed on: pass large data as an artifact "
                "or a file instead"
            )
            continue
        total += size
        kept[name] = value
    return kept, errors


def explain_e2big(argv: Sequence[str], env: Mapping[str, str]) -> str:
    """Why the kernel refused to start `argv` with `env` (E2BIG), naming the
    largest environment variable or argument."""
    sizes = [
        (len(f"{k}={v}".encode("utf-8", "replace")), f"environment variable {k}")
        for k, v in env.items()
    ]
    sizes += [(len(a.encode("utf-8", "replace")), f"argument {i}") for i, a in enumerate(argv)]
    total = sum(s for s, _ in sizes)
    size, what = max(sizes) if sizes else (0, "nothing")
    if size > MAX_ARG_STRLEN:
        why = f"{what} is {size:,} bytes, over Linux's limit of {MAX_ARG_STRLEN:,} bytes per string"
    else:
        why = (
            f"its arguments and environment are {total:,} bytes together, over the system's "
            f"limit (the largest: {what}, {size:,} bytes)"
        )
    return (
        f"the step could not start: {why}; pass large values through a file "
        "(e.g. write it in an earlier step, or use an artifact) instead of `env:`"
    )
