# cython: language_level=3, boundscheck=False, wraparound=False
"""preloop's native core: the C walkers, reached from Python.

Every entry point releases the GIL for the whole of its syscalls and hashing.
"""
import os
import stat as _stat
from time import monotonic as _monotonic

from cpython.bytes cimport PyBytes_FromStringAndSize
from cpython.exc cimport PyErr_CheckSignals
from libc.errno cimport EINTR, errno
from libc.stdlib cimport free, malloc

from native cimport *


cdef object _raise_pl_error(pl_error *error):
    """Raises the OSError subclass for errno with the exact path, and frees it."""
    cdef bytes raw = error.path if error.path != NULL else b""
    free(error.path)
    error.path = NULL
    path = os.fsdecode(raw)
    raise OSError(error.err, os.strerror(error.err), path)


def tree_bytes(path, bint one_file_system=True):
    """Returns (apparent_bytes, allocated_bytes, files, dirs, symlinks) for a tree.

    Counts like `du -s`: symlinks are never followed, a hard-linked inode is
    counted once, an entry that vanishes mid-walk is skipped. Any other error
    raises an OSError subclass naming the exact path.
    """
    cdef bytes root = os.fsencode(path)
    cdef const char *c_root = root
    cdef pl_tree_size size
    cdef pl_error error
    cdef int rc
    cdef int xdev = 1 if one_file_system else 0
    with nogil:
        rc = pl_tree_bytes(c_root, xdev, &size, &error)
    if rc != 0:
        _raise_pl_error(&error)
    return (size.apparent_bytes, size.allocated_bytes, size.files, size.dirs, size.symlinks)



def remove_tree(path):
    """Removes the tree at `path` (bottom-up unlinkat walk without the GIL; symlinks
    never followed, other filesystems left alone) and returns (allocated_bytes,
    apparent_bytes, error): what was really removed, a hard-linked inode counted
    once, and None or the OSError of the first entry that could not be removed
    (the walk goes on past it). A missing path removes nothing."""
    cdef bytes root = os.fsencode(path)
    cdef const char *c_root = root
    cdef pl_tree_size size
    cdef pl_error error
    cdef int rc
    with nogil:
        rc = pl_remove_tree(c_root, &size, &error)
    err = None
    if rc != 0:
        raw = error.path if error.path != NULL else b""
        free(error.path)
        err = OSError(error.err, os.strerror(error.err), os.fsdecode(raw))
    return (size.allocated_bytes, size.apparent_bytes, err)


# ---------------------------------------------------------------- SHA-256

_IMPLS = {"auto": PL_SHA256_AUTO, "portable": PL_SHA256_PORTABLE, "hardware": PL_SHA256_HARDWARE}


cdef int _impl_code(str impl) except -1:
    try:
        return _IMPLS[impl]
    except KeyError:
        raise ValueError(f"unknown SHA-256 implementation {impl!r}: use one of {sorted(_IMPLS)}")


def sha256_hardware_available():
    """True when this CPU has SHA-NI (x86-64) or the ARMv8 SHA-256 instructions."""
    return bool(pl_sha256_hardware_available())


def sha256_default_impl():
    """Name of the path fingerprints use: "sha-ni", "armv8-ce" or "portable"."""
    return pl_sha256_default_name().decode()


def set_sha256_default(str impl):
    """Pins the SHA-256 path fingerprints use ("auto", "portable", "hardware");
    for tests and benchmarks. Raises ValueError when the path is unavailable."""
    if pl_sha256_set_default(_impl_code(impl)) != 0:
        raise ValueError(f"SHA-256 implementation {impl!r} is not available on this CPU")


cdef class Sha256:
    """Streaming SHA-256 on a chosen path ("auto", "portable" or "hardware")."""

    cdef pl_sha256 ctx
    cdef bint done

    def __cinit__(self, str impl="auto"):
        if pl_sha256_init_impl(&self.ctx, _impl_code(impl)) != 0:
            raise ValueError(f"SHA-256 implementation {impl!r} is not available on this CPU")
        self.done = False

    def update(self, const unsigned char[::1] data not None):
        if self.done:
            raise ValueError("update() after digest()")
        cdef size_t n = data.shape[0]
        cdef const unsigned char *p = &data[0] if n else NULL
        if n >= 65536:
            with nogil:
                pl_sha256_update(&self.ctx, p, n)
        else:
            pl_sha256_update(&self.ctx, p, n)

    def digest(self):
        cdef unsigned char out[32]
        if self.done:
            raise ValueError("digest() may be called once")
        self.done = True
        pl_sha256_final(&self.ctx, out)
        return PyBytes_FromStringAndSize(<char *>out, 32)


# ---------------------------------------------------------------- host slots

DEFAULT_COORDINATION_DIR = "/var/tmp/preloop-coordination"
HOST_SLOTS = 4
cdef int _HOST_SLOTS = HOST_SLOTS

_SHARING = (
    "every process sharing the host cap, in every sandbox and for every user, must be able to "
    "open it read-only: directory mode 1777 (at least a+rx), files mode 0666 (at least a+r)"
)


def coordination_dir():
    """The host coordination directory: $PRELOOP_COORDINATION_DIR or the fixed default.
    Never derived from TMPDIR."""
    return os.environ.get("PRELOOP_COORDINATION_DIR") or DEFAULT_COORDINATION_DIR


cdef bytes _dir_bytes(directory):
    """The directory as bytes without trailing slashes (temporary names are siblings)."""
    raw = os.fsencode(directory)
    return raw.rstrip(b"/") or b"/"


cdef object _slots_exception(pl_slots_error *e):
    from preloop.errors import CoordinationError

    cdef bytes raw = e.path if e.path != NULL else b""
    free(e.path)
    e.path = NULL
    path = os.fsdecode(raw)
    reason = os.strerror(e.err) if e.err else ""
    if e.kind == PL_SLOTS_E_SYMLINK:
        msg = (f"coordination path {path} is a symlink; refusing to follow it. Remove it so "
               f"preloop can recreate it as a regular entry ({_SHARING})")
    elif e.kind == PL_SLOTS_E_NOTREG:
        msg = (f"coordination file {path} is not a regular file; remove it so preloop can "
               f"recreate it ({_SHARING})")
    elif e.kind == PL_SLOTS_E_NOTDIR:
        msg = (f"coordination directory {path} is not a directory; remove it so preloop can "
               f"recreate it ({_SHARING})")
    elif e.kind == PL_SLOTS_E_CREATE:
        msg = (f"cannot create coordination entry {path}: {reason}. Its parent directory must exist and be writable "
               f"to create it (or run prepare_host_coordination() as a user who can); "
               f"{_SHARING}")
    elif e.kind == PL_SLOTS_E_LOCK:
        msg = f"cannot lock coordination file {path}: {reason}; {_SHARING}"
    elif e.kind == PL_SLOTS_E_NOMEM:
        return MemoryError()
    else:
        msg = f"cannot open coordination entry {path} read-only: {reason}; {_SHARING}"
    return CoordinationError(msg, path)


cdef bint _interrupted(pl_slots_error *e) except -1:
    """True (after running Python's signal handlers) when a wait was interrupted."""
    if e.kind == PL_SLOTS_E_LOCK and e.err == EINTR:
        free(e.path)
        e.path = NULL
        PyErr_CheckSignals()
        return True
    return False


def slots_prepare(directory, int nslots=HOST_SLOTS):
    """Creates or adopts the coordination directory and its files (never truncating
    or unlinking existing ones); returns nothing. Raises CoordinationError."""
    cdef bytes d = _dir_bytes(directory)
    cdef const char *c_dir = d
    cdef pl_slots_error e
    cdef int rc
    with nogil:
        rc = pl_slots_prepare(c_dir, nslots, &e)
    if rc != 0:
        raise _slots_exception(&e)


def slots_acquire(directory, int nslots=HOST_SLOTS, bint blocking=True, long pid=0):
    """Takes a host slot: returns (fd, slot index), or None when not blocking and every
    slot is taken. Closing fd releases the slot. `pid` (tests) picks the full-cap slot."""
    cdef bytes d = _dir_bytes(directory)
    cdef const char *c_dir = d
    cdef pl_slots_error e
    cdef pl_slot s
    cdef int rc
    cdef int block = 1 if blocking else 0
    if nslots < 1:
        raise ValueError(f"slots must be >= 1, got {nslots}")
    while True:
        with nogil:
            rc = pl_slots_acquire(c_dir, nslots, block, pid, &s, &e)
        if rc == 0:
            return (s.fd, s.slot)
        if rc == 1:
            return None
        if not _interrupted(&e):
            raise _slots_exception(&e)


cdef class SlotSet:
    """The descriptors of one coordination directory, kept open between acquisitions
    (see slots.h): an uncontended take+give is a few flock calls. Fork-safe: a child
    re-opens on first use and never drops its parent's locks."""

    cdef pl_slots h
    cdef bint ready
    cdef readonly object directory
    cdef readonly int nslots

    def __cinit__(self, directory, int nslots=HOST_SLOTS):
        if nslots < 1:
            raise ValueError(f"slots must be >= 1, got {nslots}")
        cdef bytes d = _dir_bytes(directory)
        self.ready = False
        if pl_slots_init(&self.h, d, nslots) != 0:
            raise MemoryError()
        self.ready = True
        self.directory = directory
        self.nslots = nslots

    def __dealloc__(self):
        if self.ready:
            pl_slots_destroy(&self.h)

    @property
    def holding(self):
        """Slots held through this set now (in this process)."""
        return self.h.holding

    def take(self, bint blocking=True, double timeout=-1.0, long pid=0):
        """Takes a slot: (fd, index, cached), or None when not blocking and every slot
        is held, or when blocking and `timeout` seconds (>= 0) passed first. Never
        waits when not blocking, not even for admission. `pid` (tests) picks the slot
        a full-cap waiter prefers."""
        cdef pl_slot s
        cdef pl_slots_error e
        cdef int rc
        cdef long ms = -1 if timeout < 0 else <long>(timeout * 1000.0)
        cdef int block = 1 if blocking else 0
        started = _monotonic() if timeout > 0 else 0.0
        while True:
            if not blocking:
                rc = pl_slots_take(&self.h, 0, 0, pid, &s, &e)
            else:
                with nogil:
                    rc = pl_slots_take(&self.h, block, ms, pid, &s, &e)
            if rc == PL_SLOTS_TAKEN:
                return (s.fd, s.slot, s.cached != 0)
            if rc == PL_SLOTS_BUSY or rc == PL_SLOTS_TIMEOUT:
                return None
            if not _interrupted(&e):
                raise _slots_exception(&e)
            if timeout >= 0:  # a signal ran its handlers: wait out the rest
                ms = max(0, <long>((timeout - (_monotonic() - started)) * 1000.0))

    def give(self, int fd, int index, bint cached):
        """Releases a slot `take` returned."""
        cdef pl_slot s
        s.fd = fd
        s.slot = index
        s.cached = 1 if cached else 0
        if pl_slots_give(&self.h, &s) != 0:
            raise OSError(errno, os.strerror(errno))


# ---------------------------------------------------------------- fingerprint

cdef object _stat_dict(pl_fp_stat *s):
    return {
        "type": _stat.filemode(s.mode)[0].replace("-", "f"),
        "dev": s.dev,
        "ino": s.ino,
        "size": s.size,
        "mode": oct(s.mode),
        "mtime_ns": s.mtime_ns,
        "ctime_ns": s.ctime_ns,
    }


def _resolve_roots(roots):
    """Resolves, de-duplicates and byte-sorts roots; refuses a missing root or one
    inside another root."""
    from preloop.errors import FingerprintRootError

    if isinstance(roots, (str, bytes, os.PathLike)):
        roots = [roots]
    resolved = set()
    for root in roots:
        raw = os.fsencode(root)
        try:
            real = os.path.realpath(raw, strict=True)
        except OSError as exc:
            name = os.fsdecode(raw)
            raise FingerprintRootError(
                f"fingerprint root {name} cannot be used: {exc.strerror}; "
                "declare roots that exist", name) from None
        resolved.add(real)
    if not resolved:
        raise FingerprintRootError("no fingerprint roots given; pass at least one path", "")
    ordered = sorted(resolved)
    for i in range(1, len(ordered)):
        for j in range(i):
            outer = ordered[j].rstrip(b"/") + b"/"
            if ordered[i].startswith(outer):
                inner = os.fsdecode(ordered[i])
                raise FingerprintRootError(
                    f"fingerprint root {inner} lies inside root {os.fsdecode(ordered[j])}; "
                    "declare only the outer one", inner)
    return ordered


def fingerprint(roots, str mode="content", directory=None, SlotSet held=None):
    """Fingerprints roots under a host slot (blocking in the kernel for one), or under
    the slot the caller holds through `held` (which must hold one).

    Returns (digest, files, bytes, [(root, digest, files, bytes), ...]) with hex
    digests and roots as resolved str paths, in byte order.
    """
    from preloop.errors import TreeChangedWhileHashing

    cdef int c_mode
    if mode == "content":
        c_mode = PL_FP_CONTENT
    elif mode == "metadata":
        c_mode = PL_FP_METADATA
    else:
        raise ValueError(f"fingerprint mode must be 'content' or 'metadata', got {mode!r}")
    cdef const pl_slots *c_held = NULL
    if held is not None:
        if held.h.holding <= 0:
            raise ValueError("fingerprint(held=...) needs a SlotSet that holds a slot")
        c_held = &held.h
    ordered = _resolve_roots(roots)
    cdef bytes d = _dir_bytes(directory if directory is not None else coordination_dir())
    cdef const char *c_dir = d
    cdef size_t n = len(ordered)
    cdef const char **c_roots = <const char **>malloc(n * sizeof(char *))
    cdef pl_fp_result *per = <pl_fp_result *>malloc(n * sizeof(pl_fp_result))
    cdef pl_fp_result total
    cdef pl_fp_error e
    cdef int rc
    cdef size_t i
    if c_roots == NULL or per == NULL:
        free(c_roots)
        free(per)
        raise MemoryError()
    try:
        for i in range(n):
            c_roots[i] = <bytes>ordered[i]
        while True:
            with nogil:
                rc = pl_fingerprint(c_roots, n, c_mode, c_dir, _HOST_SLOTS, c_held, per, &total, &e)
            if rc == 0:
                break
            if e.kind == PL_FP_E_SLOTS:
                if _interrupted(&e.slots):
                    continue
                raise _slots_exception(&e.slots)
            raw = e.path if e.path != NULL else b""
            free(e.path)
            e.path = NULL
            path = os.fsdecode(raw)
            if e.kind == PL_FP_E_CHANGED:
                after = None if e.err else _stat_dict(&e.after)
                raise TreeChangedWhileHashing(path, _stat_dict(&e.before), after)
            if e.kind == PL_FP_E_NOMEM:
                raise MemoryError()
            raise OSError(e.err, os.strerror(e.err), path)
        roots_out = [
            (os.fsdecode(ordered[i]), (<bytes>per[i].digest[:32]).hex(), per[i].files, per[i].bytes)
            for i in range(n)
        ]
        return ((<bytes>total.digest[:32]).hex(), total.files, total.bytes, roots_out)
    finally:
        free(c_roots)
        free(per)


# ---------------------------------------------------------------- test hooks

_after_read_callback = None
_full_scan_callback = None


cdef void _after_read_trampoline(const char *path) noexcept nogil:
    with gil:
        try:
            _after_read_callback(os.fsdecode(path))
        except BaseException:
            pass


cdef void _full_scan_trampoline(const char *path) noexcept nogil:
    with gil:
        try:
            _full_scan_callback(os.fsdecode(path))
        except BaseException:
            pass


def set_test_hooks(after_read=None, full_scan=None, recent_ns=None):
    """Test-only: `after_read(path)` runs after a file's bytes were read and before its
    descriptor's fstat (the stability check); `full_scan(slot_path)` runs after a scan found every slot taken,
    before blocking on `slot_path`; `recent_ns` replaces how long before a directory's
    listing a change counts as recent (fingerprint.h PL_FP_RECENT_NS). None (the
    default) removes a hook or restores the default."""
    global _after_read_callback, _full_scan_callback, pl_fp_recent_ns
    _after_read_callback = after_read
    _full_scan_callback = full_scan
    pl_fp_recent_ns = PL_FP_RECENT_NS if recent_ns is None else recent_ns
    _install_hooks(after_read is not None, full_scan is not None)


cdef void _install_hooks(bint after_read, bint full_scan) noexcept:
    global pl_fp_after_read_hook, pl_slots_full_hook
    if after_read:
        pl_fp_after_read_hook = _after_read_trampoline
    else:
        pl_fp_after_read_hook = NULL
    if full_scan:
        pl_slots_full_hook = _full_scan_trampoline
    else:
        pl_slots_full_hook = NULL
