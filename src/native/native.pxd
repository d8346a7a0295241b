# C declarations of the native core, declared once for every .pyx that uses them.
from libc.stdint cimport int64_t, uint64_t


cdef extern from "walk.h" nogil:
    ctypedef struct pl_error:
        int err
        char *path

    ctypedef struct pl_tree_size:
        uint64_t apparent_bytes
        uint64_t allocated_bytes
        uint64_t files
        uint64_t dirs
        uint64_t symlinks

    int pl_tree_bytes(const char *root, int one_file_system, pl_tree_size *out, pl_error *error)
    int pl_remove_tree(const char *root, pl_tree_size *removed, pl_error *error)


cdef extern from "sha256.h" nogil:
    ctypedef struct pl_sha256:
        pass

    int PL_SHA256_AUTO
    int PL_SHA256_PORTABLE
    int PL_SHA256_HARDWARE

    int pl_sha256_hardware_available()
    int pl_sha256_init_impl(pl_sha256 *ctx, int impl)
    void pl_sha256_update(pl_sha256 *ctx, const void *data, size_t len)
    void pl_sha256_final(pl_sha256 *ctx, unsigned char *out)
    int pl_sha256_set_default(int impl)
    const char *pl_sha256_default_name()


cdef extern from "slots.h" nogil:
    int PL_SLOTS_E_SYMLINK
    int PL_SLOTS_E_NOTREG
    int PL_SLOTS_E_NOTDIR
    int PL_SLOTS_E_OPEN
    int PL_SLOTS_E_CREATE
    int PL_SLOTS_E_LOCK
    int PL_SLOTS_E_NOMEM

    ctypedef struct pl_slots_error:
        int kind
        int err
        char *path

    ctypedef struct pl_slot:
        int fd
        int slot
        int cached
        uint64_t dir_dev
        uint64_t dir_ino

    ctypedef struct pl_slots:
        long holding
        uint64_t dir_dev
        uint64_t dir_ino

    int PL_SLOTS_TAKEN
    int PL_SLOTS_BUSY
    int PL_SLOTS_TIMEOUT

    void (*pl_slots_full_hook)(const char *slot_path)
    int pl_slots_init(pl_slots *h, const char *dir, int nslots)
    void pl_slots_destroy(pl_slots *h)
    int pl_slots_take(pl_slots *h, int blocking, long timeout_ms, long pid, pl_slot *out,
                      pl_slots_error *error)
    int pl_slots_give(pl_slots *h, const pl_slot *slot)
    int pl_slots_prepare(const char *dir, int nslots, pl_slots_error *error)
    int pl_slots_acquire(const char *dir, int nslots, int blocking, long pid, pl_slot *out,
                         pl_slots_error *error)


cdef extern from "fingerprint.h" nogil:
    int PL_FP_CONTENT
    int PL_FP_METADATA
    int PL_FP_E_OS
    int PL_FP_E_CHANGED
    int PL_FP_E_SLOTS
    int PL_FP_E_NOMEM

    ctypedef struct pl_fp_stat:
        unsigned int mode
        uint64_t dev
        uint64_t ino
        uint64_t size
        int64_t mtime_ns
        int64_t ctime_ns

    ctypedef struct pl_fp_error:
        int kind
        int err
        char *path
        pl_fp_stat before
        pl_fp_stat after
        pl_slots_error slots

    ctypedef struct pl_fp_result:
        unsigned char digest[32]
        uint64_t files
        uint64_t bytes

    void (*pl_fp_after_read_hook)(const char *path)
    int64_t PL_FP_RECENT_NS
    int64_t pl_fp_recent_ns
    int pl_fingerprint(const char *const *roots, size_t nroots, int mode,
                       const char *coordination_dir, int nslots, const pl_slots *held,
                       pl_fp_result *per_root, pl_fp_result *total, pl_fp_error *error)
