"""What `preloop du` prints, without the command framework: the click command
(`preloop.cli.du`) and the start-up fast path (`preloop.cli.main`, for the
plain `preloop du [--json] [--cross-filesystems] PATH`) both print through
`du_report`, so the two never differ.

The fast path exists because `du` is a start-up benchmark of the tool against
`du -sb` itself: click, pathlib and dataclasses cost ~40 ms of imports, more
than a third of what `du -sb` takes on a 60,000-file tree. This module imports
only the native walker (not `preloop.fs`, whose dataclass costs 15 ms).
"""

from __future__ import annotations

import os
import sys

__all__ = ["FIELDS", "du_report", "fast_du"]

#: `preloop.fs.TreeSize`'s fields, in the order the native walker returns them.
FIELDS = ("apparent_bytes", "allocated_bytes", "files", "dirs", "symlinks")
_FLAGS = {"--json": "as_json", "--cross-filesystems": "cross_filesystems"}


def du_report(path: str, *, as_json: bool, cross_filesystems: bool) -> tuple[int, str]:
    """`(exit code, text)`: the report for stdout (0) or the one-line error
    for stderr (1), each ending with a newline."""
    from preloop import _native

    try:
        sizes = _native.tree_bytes(path, not cross_filesystems)
    except OSError as exc:
        return 1, f"preloop: error: cannot size {exc.filename or path}: {exc.strerror or exc}\n"
    if as_json:
        import json

        document = {"path": path, **dict(zip(FIELDS, sizes, strict=True))}
        return 0, json.dumps(document, indent=2, sort_keys=True) + "\n"
    apparent, allocated, files, dirs, symlinks = sizes
    return 0, (
        f"{apparent}\tapparent bytes\n{allocated}\tallocated bytes\n"
        f"{files}\tfiles\n{dirs}\tdirs\n{symlinks}\tsymlinks\n{path}\n"
    )


def fast_du(args: list[str]) -> int | None:
    """Runs `preloop du ARGS` when ARGS are one path and the command's own
    flags, each at most once, and returns the exit code; None for anything
    else (`--help`, a usage error, a path that looks like an option), which
    the click command answers."""
    path: str | None = None
    flags: dict[str, bool] = {}
    for arg in args:
        if arg in _FLAGS and _FLAGS[arg] not in flags:
            flags[_FLAGS[arg]] = True
        elif arg.startswith("-") or path is not None:
            return None
        else:
            path = arg
    if not path:
        return None
    # As `preloop.cli.app.main` and click answer these on the command's path.
    try:
        code, text = du_report(
            path,
            as_json=flags.get("as_json", False),
            cross_filesystems=flags.get("cross_filesystems", False),
        )
        stream = sys.stdout if code == 0 else sys.stderr
        if stream is not None:  # closed: there is nobody to tell
            stream.write(text)
            stream.flush()
    except KeyboardInterrupt:
        sys.stderr.write("\npreloop: aborted\n")
        return 130
    except BrokenPipeError:
        # The reader is gone: quiet, and nothing left for the exit's flush.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except OSError as exc:
        where = f"{exc.filename}: " if exc.filename else ""
        sys.stderr.write(f"preloop: error: {where}{exc.strerror or exc}\n")
        return 1
    return code
