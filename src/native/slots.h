/* Host-wide slot semaphore: at most N cooperating holders per host.
 *
 * One fixed directory holds `admission` and `slot-0..N-1`. A slot is held by an
 * exclusive flock(2) on a descriptor opened O_RDONLY|O_NOFOLLOW|O_CLOEXEC, so a
 * read-only bind mount (a sandbox) shares the same locks and closing the
 * descriptor, or dying, releases the slot. Waiting blocks in the kernel.
 *
 * At full cap the waiter blocks on slot `pid % N` (or the next slot with the
 * shortest queue of waiters), so waiters spread over the slots. Admission, taken
 * only when free and never waited for, orders that choice; a waiter that raced
 * another to the same queue and ended up behind it moves, once, to a shorter one.
 */
#ifndef PRELOOP_SLOTS_H
#define PRELOOP_SLOTS_H

#include <pthread.h>
#include <stdint.h>
#include <sys/types.h>

/* What went wrong, so the caller can say which sharing mode a path needs. */
enum {
    PL_SLOTS_OK = 0,
    PL_SLOTS_E_SYMLINK = 1,  /* a coordination path is a symlink: refused */
    PL_SLOTS_E_NOTREG = 2,   /* a coordination file is not a regular file */
    PL_SLOTS_E_NOTDIR = 3,   /* the coordination directory is not a directory */
    PL_SLOTS_E_OPEN = 4,     /* read-only open failed (errno in err) */
    PL_SLOTS_E_CREATE = 5,   /* cold-start creation or publication failed */
    PL_SLOTS_E_LOCK = 6,     /* flock failed; EINTR means interrupted: retry */
    PL_SLOTS_E_NOMEM = 7,
};

typedef struct {
    int kind;
    int err;    /* errno */
    char *path; /* malloc'd; caller frees */
} pl_slots_error;

/* A held slot. dev/ino identify the directory. `cached` slots are held through
 * the handle's own descriptor (release with pl_slots_give); others own `fd`
 * (closing it releases the slot). */
typedef struct {
    int fd;
    int slot;
    int cached;
    uint64_t dir_dev, dir_ino;
} pl_slot;

/* The descriptors of one coordination directory, kept open between acquisitions
 * (directory, admission, one per slot) so an uncontended acquire+release is a few
 * flock calls. Fork-safe: a child process re-opens on first use (a pthread_atfork
 * handler bumps a generation), never unlocking or reusing its parent's locks. */
typedef struct {
    char *dir;
    int nslots;
    unsigned long generation; /* of the process that opened the descriptors */
    int dirfd, admfd;
    int *slotfd;
    unsigned char *held; /* slots this handle holds through slotfd[i] */
    long holding;        /* slots held now through this handle (cached or not) */
    uint64_t dir_dev, dir_ino;
    pthread_mutex_t mu;
} pl_slots;

enum {
    PL_SLOTS_TAKEN = 0,  /* got a slot */
    PL_SLOTS_BUSY = 1,   /* non-blocking: every slot is held */
    PL_SLOTS_TIMEOUT = 2 /* blocking with a timeout: it passed first */
};

/* Test hook, NULL in production: called after a scan found every slot taken and
 * admission was released, just before blocking on `slot_path`. */
extern void (*pl_slots_full_hook)(const char *slot_path);

/* Creates or adopts the directory and its files; never truncates or unlinks an
 * existing one. 0 ok, -1 with *error filled. */
int pl_slots_prepare(const char *dir, int nslots, pl_slots_error *error);

/* Takes a slot. `pid` picks the full-cap slot (0: getpid()). With blocking=0
 * returns 1 instead of waiting when every slot is taken. 0 ok, -1 error. */
int pl_slots_acquire(const char *dir, int nslots, int blocking, long pid, pl_slot *out,
                     pl_slots_error *error);

/* A handle for `dir`; opens nothing yet. 0 ok, -1 out of memory. */
int pl_slots_init(pl_slots *h, const char *dir, int nslots);

/* Closes the handle's descriptors. Slots held through it (cached) are released. */
void pl_slots_destroy(pl_slots *h);

/* Takes a slot through the handle: PL_SLOTS_TAKEN, PL_SLOTS_BUSY (blocking=0 and
 * every slot held: never waits, not even for admission), PL_SLOTS_TIMEOUT (blocking,
 * timeout_ms >= 0 elapsed), or -1 with *error (EINTR: a signal; retry). timeout_ms
 * < 0 waits without bound. `pid` picks the slot a full-cap waiter prefers. */
int pl_slots_take(pl_slots *h, int blocking, long timeout_ms, long pid, pl_slot *out,
                  pl_slots_error *error);

/* Releases a slot taken through the handle (LOCK_UN, or close for a waiter's own
 * descriptor). In a forked child the parent's slot is left alone. 0 ok, -1 errno. */
int pl_slots_give(pl_slots *h, const pl_slot *slot);

#endif
