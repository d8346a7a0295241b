"""`fingerprint()`: the native walk's Python face."""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Literal

from preloop import _native, config
from preloop.fingerprint.slots import HostSlots, coordination_dir

__all__ = ["Fingerprint", "FingerprintMode", "fingerprint"]

FingerprintMode = Literal["content", "metadata"]

Root = str | os.PathLike[str]


@dataclass(frozen=True, slots=True)
class Fingerprint:
    """A fingerprint of declared input roots.

    `digest` (64 hex) covers every root's digest in root order; `roots` maps each
    resolved root to its own digest. `files`/`bytes` count regular files and their
    sizes (content mode: bytes hashed).
    """

    digest: str
    files: int
    bytes: int
    roots: Mapping[str, str]
    mode: FingerprintMode = "content"


def fingerprint(roots: Root | Iterable[Root], *, mode: FingerprintMode = "content") -> Fingerprint:
    """Fingerprints `roots` in `mode` under a host slot.

    Waits for a slot without bound, or `PRELOOP_FINGERPRINT_SLOT_TIMEOUT` seconds
    (then `SlotWaitTimeout`, naming the pids that hold the slots).
    Roots are resolved, de-duplicated and sorted; a missing root or a root inside
    another raises `FingerprintRootError`. A file that changes while it is hashed
    raises `TreeChangedWhileHashing`; other I/O errors raise `OSError` naming the
    path. Blocks (without the GIL) while the host's slots are all held.
    """
    if mode not in ("content", "metadata"):
        raise ValueError(f"fingerprint mode must be 'content' or 'metadata', got {mode!r}")
    if isinstance(roots, str | os.PathLike):
        roots = [roots]
    paths = [os.fspath(r) for r in roots]
    directory = coordination_dir()
    slots = _host_slots(directory)
    timeout: float | None = config.get("PRELOOP_FINGERPRINT_SLOT_TIMEOUT")
    # The slot is taken here rather than inside the native walk so the wait can be
    # bounded and can say who holds the slots; the walk checks that one is held.
    with slots.acquire(timeout):
        digest, files, size, per_root = _native.fingerprint(
            paths, mode, directory, held=slots.native
        )
    return Fingerprint(
        digest=digest,
        files=files,
        bytes=size,
        roots={root: root_digest for root, root_digest, _, _ in per_root},
        mode=mode,
    )


_SLOTS: dict[str, HostSlots] = {}


def _host_slots(directory: os.PathLike[str] | str) -> HostSlots:
    """One `HostSlots` per coordination directory per process: its descriptors stay
    open between walks."""
    key = os.fspath(directory)
    slots = _SLOTS.get(key)
    if slots is None:
        slots = _SLOTS[key] = HostSlots(directory)
    return slots
