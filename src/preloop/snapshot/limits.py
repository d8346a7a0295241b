"""Time limits of one snapshot capture (seed 000, "Aggregate capture timeout").

All values are seconds. They are constants, not knobs: the capture functions
take the deadline as a parameter so tests can shorten it.
"""

from __future__ import annotations

__all__ = [
    "CACHE_LOCK_TIMEOUT",
    "SNAPSHOT_CAPTURE_CLEANUP_GRACE",
    "SNAPSHOT_CAPTURE_CLEANUP_WAIT",
    "SNAPSHOT_CAPTURE_TIMEOUT",
    "STALE_PIN_AGE",
]

# A backstop above a 30-minute transfer plus two 15-minute work commands and
# headroom for pack/fsck/publish: a large repository never trips it, a wedged
# filesystem or a dead lock holder still ends.
SNAPSHOT_CAPTURE_TIMEOUT: float = 90 * 60.0

# Everything done after the deadline fired (enumeration, the wait for blocking
# copies, recursive removals) completes or is abandoned within this budget.
SNAPSHOT_CAPTURE_CLEANUP_GRACE: float = 30.0

# Part of the grace spent waiting for blocking copies (worker threads cannot be
# cancelled); if they do not drain, staging is left for the startup sweep.
SNAPSHOT_CAPTURE_CLEANUP_WAIT: float = 10.0

# How long a capture waits for another holder of a cache entry's lock by default.
# It stays inside the aggregate deadline, which bounds the wait anyway.
CACHE_LOCK_TIMEOUT: float = SNAPSHOT_CAPTURE_TIMEOUT

# A pin older than this can only be a crash leftover: no capture outlives its
# deadline plus the cleanup grace.
STALE_PIN_AGE: float = SNAPSHOT_CAPTURE_TIMEOUT + SNAPSHOT_CAPTURE_CLEANUP_GRACE
