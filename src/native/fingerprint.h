/* Native tree fingerprints (format v1, documented in README "Fingerprints").
 *
 * Content mode hashes every regular file's bytes; metadata mode reads no file.
 * A walk is one thread with one streaming buffer, iterative (any depth), never
 * follows symlinks, and holds one host slot (slots.h) for its whole duration:
 * every caller of the native function is capped, not only the Python face.
 */
#ifndef PRELOOP_FINGERPRINT_H
#define PRELOOP_FINGERPRINT_H

#include <stddef.h>
#include <stdint.h>

#include "sha256.h"
#include "slots.h"

enum { PL_FP_CONTENT = 0, PL_FP_METADATA = 1 };

enum {
    PL_FP_E_OS = 1,      /* errno + path */
    PL_FP_E_CHANGED = 2, /* path changed while it was hashed: before/after below */
    PL_FP_E_SLOTS = 3,   /* taking the host slot failed: see slots */
    PL_FP_E_NOMEM = 4,
};

/* The lstat fields the stability check compares. */
typedef struct {
    uint32_t mode;
    uint64_t dev, ino, size;
    int64_t mtime_ns, ctime_ns;
} pl_fp_stat;

typedef struct {
    int kind;
    int err;
    char *path; /* malloc'd; caller frees */
    pl_fp_stat before, after;
    pl_slots_error slots;
} pl_fp_error;

typedef struct {
    uint8_t digest[PL_SHA256_DIGEST];
    uint64_t files, bytes;
} pl_fp_result;

/* Test hook, NULL in production: called in content mode after a file's bytes
 * were read and before its descriptor is fstat'ed (the stability check); twice
 * for a file that is read twice (see README "Stability check"). */
extern void (*pl_fp_after_read_hook)(const char *path);

/* A file or directory whose ctime (a directory: mtime or ctime) is less than this
 * before its directory was listed is "old": a lazy-listed file whose fstat after the
 * read shows it old was not changed from before its open to the end of its read.
 * Covers clock steps and timestamp granularity; tests lower it. */
#define PL_FP_RECENT_NS ((int64_t)2000000000)
extern int64_t pl_fp_recent_ns;

/* Fingerprints `nroots` absolute, resolved, sorted, non-nested roots.
 * per_root[i] gets root i's digest; *total the digest over all roots (and the
 * summed counts). Takes a slot in `coordination_dir` first (blocking), unless
 * `held` is a handle through which the caller already holds one.
 * 0 ok, -1 with *error filled. Touches no Python object. */
int pl_fingerprint(const char *const *roots, size_t nroots, int mode, const char *coordination_dir,
                   int nslots, const pl_slots *held, pl_fp_result *per_root, pl_fp_result *total,
                   pl_fp_error *error);

#endif
