"""Host-capped native fingerprints of declared input roots.

- `fingerprint(roots, mode=...)`: the native walk (content or metadata digest, format
  v1 in the README); it takes a host slot itself, so every caller is capped.
- `HostSlots`: the host-wide slot semaphore (at most 4 cooperating walks per host).
- `FingerprintQueue`: one walk at a time per process, from async code.
- `prepare_host_coordination()` / `sandbox_bind_args()`: for sandbox launchers.
"""

from preloop.errors import CoordinationError, FingerprintRootError, TreeChangedWhileHashing
from preloop.fingerprint.digest import Fingerprint, FingerprintMode, fingerprint
from preloop.fingerprint.queue import FingerprintQueue
from preloop.fingerprint.slots import (
    HOST_SLOTS,
    HostSlots,
    Slot,
    SlotWaitTimeout,
    coordination_dir,
    prepare_host_coordination,
    sandbox_bind_args,
)

__all__ = [
    "HOST_SLOTS",
    "CoordinationError",
    "Fingerprint",
    "FingerprintMode",
    "FingerprintQueue",
    "FingerprintRootError",
    "HostSlots",
    "Slot",
    "SlotWaitTimeout",
    "TreeChangedWhileHashing",
    "coordination_dir",
    "fingerprint",
    "prepare_host_coordination",
    "sandbox_bind_args",
]
