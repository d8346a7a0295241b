/* Host slot semaphore. See slots.h for the contract. */
#include "slots.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

void (*pl_slots_full_hook)(const char *slot_path) = NULL;

#define DIR_MODE 01777
#define FILE_MODE 0666

/* Places in one slot's FIFO queue of waiters (one queue file each); a waiter that
 * finds all of them taken races for the slot as every waiter once did. */
#define QUEUE_DEPTH 8

static unsigned long tmp_counter;

static int fail(pl_slots_error *e, int kind, int err, const char *a, const char *b) {
    e->kind = kind;
    e->err = err;
    size_t la = strlen(a), lb = b ? strlen(b) : 0;
    e->path = malloc(la + lb + 2);
    if (e->path) {
        memcpy(e->path, a, la);
        if (b) {
            e->path[la] = '/';
            memcpy(e->path + la + 1, b, lb);
        }
        e->path[la + (b ? lb + 1 : 0)] = '\0';
    }
    return -1;
}

/* A name no other process or thread uses: pid, a process counter and the clock. */
static char *tmp_name(const char *prefix) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    unsigned long n = __atomic_fetch_add(&tmp_counter, 1, __ATOMIC_RELAXED);
    size_t len = strlen(prefix) + 80;
    char *s = malloc(len);
    if (s)
        snprintf(s, len, "%s.tmp-%ld-%lu-%ld", prefix, (long)getpid(), n, (long)ts.tv_nsec);
    return s;
}

/* Coordination file k: -1 admission, [0, nslots) slot-k, then the queue files
 * slot-<i>.queue-<l> of each slot (QUEUE_DEPTH per slot). */
static char *slot_name(int k, int nslots) {
    char *s = malloc(48);
    if (s) {
        if (k < 0)
            snprintf(s, 48, "admission");
        else if (k < nslots)
            snprintf(s, 48, "slot-%d", k);
        else
            snprintf(s, 48, "slot-%d.queue-%d", (k - nslots) / QUEUE_DEPTH,
                     (k - nslots) % QUEUE_DEPTH);
    }
    return s;
}

/* Every coordination file: admission, the slots and their queue files. */
static int file_count(int nslots) { return nslots * (1 + QUEUE_DEPTH); }

/* Creates `name` in dirfd with mode 0666 regardless of umask, by a temporary
 * file and a no-replace link: a contender never sees it with narrower bits. */
static int publish_file(int dirfd, const char *dir, const char *name, pl_slots_error *e) {
    char base[64];
    snprintf(base, sizeof base, ".%s", name);
    char *tmp = tmp_name(base);
    if (!tmp)
        return fail(e, PL_SLOTS_E_NOMEM, ENOMEM, dir, name);
    int fd = openat(dirfd, tmp, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
    if (fd < 0) {
        int err = errno;
        free(tmp);
        return fail(e, PL_SLOTS_E_CREATE, err, dir, name);
    }
    int rc = 0;
    if (fchmod(fd, FILE_MODE) != 0) {
        rc = fail(e, PL_SLOTS_E_CREATE, errno, dir, name);
    } else if (linkat(dirfd, tmp, dirfd, name, 0) != 0 && errno != EEXIST) {
        rc = fail(e, PL_SLOTS_E_CREATE, errno, dir, name);
    }
    close(fd);
    if (unlinkat(dirfd, tmp, 0) != 0 && rc == 0)
        rc = fail(e, PL_SLOTS_E_CREATE, errno, dir, tmp);
    free(tmp);
    return rc;
}

/* Makes sure coordination file k exists as a regular file. An existing file is
 * adopted as it is: never truncated, never replaced. */
static int ensure_file(int dirfd, const char *dir, int k, int nslots, pl_slots_error *e) {
    char *name = slot_name(k, nslots);
    if (!name)
        return fail(e, PL_SLOTS_E_NOMEM, ENOMEM, dir, NULL);
    struct stat st;
    int rc = 0;
    if (fstatat(dirfd, name, &st, AT_SYMLINK_NOFOLLOW) == 0) {
        if (S_ISLNK(st.st_mode))
            rc = fail(e, PL_SLOTS_E_SYMLINK, ELOOP, dir, name);
        else if (!S_ISREG(st.st_mode))
            rc = fail(e, PL_SLOTS_E_NOTREG, EINVAL, dir, name);
    } else if (errno == ENOENT) {
        rc = publish_file(dirfd, dir, name, e);
    } else {
        rc = fail(e, PL_SLOTS_E_OPEN, errno, dir, name);
    }
    free(name);
    return rc;
}

/* Admission and the slots, which the cap needs; with `queues` also the queue
 * files, which only order waiters: a directory that cannot get them (a read-only
 * mount of one made by an older version) still caps, without the FIFO. */
static int ensure_files(int dirfd, const char *dir, int nslots, int queues, pl_slots_error *e) {
    for (int k = -1; k < nslots; k++)
        if (ensure_file(dirfd, dir, k, nslots, e) != 0)
            return -1;
    for (int k = nslots; queues && k < file_count(nslots); k++) {
        if (ensure_file(dirfd, dir, k, nslots, e) != 0) {
            if (e->kind == PL_SLOTS_E_SYMLINK || e->kind == PL_SLOTS_E_NOTREG)
                return -1;
            free(e->path);
            memset(e, 0, sizeof *e);
            break;
        }
    }
    return 0;
}

static void remove_tmp_dir(const char *tmp, int nslots) {
    int fd = open(tmp, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    if (fd >= 0) {
        for (int k = -1; k < file_count(nslots); k++) {
            char *name = slot_name(k, nslots);
            if (name)
                (void)unlinkat(fd, name, 0);
            free(name);
        }
        close(fd);
    }
    (void)rmdir(tmp);
}

/* Cold start: builds a complete directory under a temporary name with its final
 * modes, then publishes it with a no-replace rename. A loser removes its copy. */
static int publish_dir(const char *dir, int nslots, pl_slots_error *e) {
    char *tmp = tmp_name(dir);
    if (!tmp)
        return fail(e, PL_SLOTS_E_NOMEM, ENOMEM, dir, NULL);
    if (mkdir(tmp, 0700) != 0) {
        int err = errno;
        free(tmp);
        return fail(e, PL_SLOTS_E_CREATE, err, dir, NULL);
    }
    int rc = 0;
    int fd = -1;
    if (chmod(tmp, DIR_MODE) != 0) {
        rc = fail(e, PL_SLOTS_E_CREATE, errno, dir, NULL);
    } else if ((fd = open(tmp, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC)) < 0) {
        rc = fail(e, PL_SLOTS_E_CREATE, errno, dir, NULL);
    } else if (ensure_files(fd, tmp, nslots, 1, e) != 0) {
        rc = -1;
    } else if (renameat2(AT_FDCWD, tmp, AT_FDCWD, dir, RENAME_NOREPLACE) == 0) {
        close(fd);
        free(tmp);
        return 0;
    } else if (errno != EEXIST && errno != ENOTEMPTY) {
        rc = fail(e, PL_SLOTS_E_CREATE, errno, dir, NULL);
    }
    if (fd >= 0)
        close(fd);
    remove_tmp_dir(tmp, nslots);
    free(tmp);
    return rc; /* 0 here: another process published first; use theirs */
}

static int open_dir(const char *dir, int nslots, int create, pl_slots_error *e) {
    for (int attempt = 0;; attempt++) {
        int fd = open(dir, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
        if (fd >= 0)
            return fd;
        int err = errno;
        if (err == ENOENT && create && attempt < 8) {
            if (publish_dir(dir, nslots, e) != 0)
                return -1;
            continue;
        }
        struct stat st;
        if ((err == ELOOP || err == ENOTDIR) && lstat(dir, &st) == 0) {
            if (S_ISLNK(st.st_mode))
                return fail(e, PL_SLOTS_E_SYMLINK, ELOOP, dir, NULL);
            return fail(e, PL_SLOTS_E_NOTDIR, ENOTDIR, dir, NULL);
        }
        return fail(e, PL_SLOTS_E_OPEN, err, dir, NULL);
    }
}

/* Opens a coordination file read-only, refusing symlinks and non-regular files.
 * O_NONBLOCK keeps a FIFO planted there from blocking the open. */
static int open_lock_file(int dirfd, const char *dir, const char *name, pl_slots_error *e) {
    int fd = openat(dirfd, name, O_RDONLY | O_NOFOLLOW | O_CLOEXEC | O_NONBLOCK | O_NOCTTY);
    if (fd < 0) {
        if (errno == ELOOP)
            return fail(e, PL_SLOTS_E_SYMLINK, ELOOP, dir, name);
        return fail(e, PL_SLOTS_E_OPEN, errno, dir, name);
    }
    struct stat st;
    if (fstat(fd, &st) != 0) {
        int err = errno;
        close(fd);
        return fail(e, PL_SLOTS_E_OPEN, err, dir, name);
    }
    if (!S_ISREG(st.st_mode)) {
        close(fd);
        return fail(e, PL_SLOTS_E_NOTREG, EINVAL, dir, name);
    }
    return fd;
}

int pl_slots_prepare(const char *dir, int nslots, pl_slots_error *error) {
    memset(error, 0, sizeof *error);
    int fd = open_dir(dir, nslots, 1, error);
    if (fd < 0)
        return -1;
    int rc = ensure_files(fd, dir, nslots, 1, error);
    close(fd);
    return rc;
}

static int lock_error(pl_slots_error *e, int err, const char *dir, const char *name) {
    return fail(e, PL_SLOTS_E_LOCK, err, dir, name);
}

/* ------------------------------------------------------------ timed waits
 *
 * flock(2) has no timeout. A bounded wait arms a per-thread POSIX timer that
 * signals this thread (SIGEV_THREAD_ID) at the deadline and every 10 ms after it,
 * so the blocked flock returns EINTR; the handler does nothing. The wait still
 * blocks in the kernel: nothing polls before the deadline. */

#define WAKE_SIGNAL (SIGRTMAX - 5)
#define WAKE_REPEAT_NS 10000000L

static void wake_handler(int sig) { (void)sig; }

static pthread_once_t wake_once = PTHREAD_ONCE_INIT;

static void install_wake_handler(void) {
    struct sigaction old;
    if (sigaction(WAKE_SIGNAL, NULL, &old) != 0)
        return;
    /* Someone else's handler interrupts the wait as well as ours would. */
    if (!(old.sa_flags & SA_SIGINFO) && (old.sa_handler == SIG_DFL || old.sa_handler == SIG_IGN)) {
        struct sigaction sa;
        memset(&sa, 0, sizeof sa);
        sa.sa_handler = wake_handler;
        sigemptyset(&sa.sa_mask);
        sa.sa_flags = 0; /* no SA_RESTART: the blocked flock must return EINTR */
        (void)sigaction(WAKE_SIGNAL, &sa, NULL);
    }
}

static long now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (long)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static long remaining(long deadline) {
    long left = deadline - now_ms();
    return left > 0 ? left : 0;
}

/* flock(fd, LOCK_EX) within timeout_ms (< 0: unbounded). 0 ok; -1 with errno
 * ETIMEDOUT, EINTR (another signal: the caller checks for it and retries) or the
 * flock error. */
static int timed_lock(int fd, long timeout_ms) {
    if (timeout_ms < 0)
        return flock(fd, LOCK_EX);
    if (flock(fd, LOCK_EX | LOCK_NB) == 0)
        return 0;
    if (errno != EWOULDBLOCK)
        return -1;
    if (timeout_ms == 0) {
        errno = ETIMEDOUT;
        return -1;
    }
    (void)pthread_once(&wake_once, install_wake_handler);
    long deadline = now_ms() + timeout_ms;
    struct sigevent sev;
    memset(&sev, 0, sizeof sev);
    sev.sigev_notify = SIGEV_THREAD_ID;
    sev.sigev_signo = WAKE_SIGNAL;
#ifdef sigev_notify_thread_id
    sev.sigev_notify_thread_id = gettid();
#else
    sev._sigev_un._tid = gettid();
#endif
    timer_t timer;
    if (timer_create(CLOCK_MONOTONIC, &sev, &timer) != 0)
        return -1;
    sigset_t wake, old;
    sigemptyset(&wake);
    sigaddset(&wake, WAKE_SIGNAL);
    int masked = pthread_sigmask(SIG_UNBLOCK, &wake, &old) == 0;
    struct itimerspec its;
    memset(&its, 0, sizeof its);
    its.it_value.tv_sec = timeout_ms / 1000;
    its.it_value.tv_nsec = (timeout_ms % 1000) * 1000000L;
    its.it_interval.tv_nsec = WAKE_REPEAT_NS;
    int rc, err = 0;
    if (timer_settime(timer, 0, &its, NULL) != 0) {
        rc = -1;
        err = errno;
    } else {
        rc = flock(fd, LOCK_EX);
        if (rc != 0) {
            err = errno;
            if (err == EINTR && now_ms() >= deadline)
                err = ETIMEDOUT;
        }
    }
    (void)timer_delete(timer);
    if (masked)
        (void)pthread_sigmask(SIG_SETMASK, &old, NULL);
    errno = err;
    return rc;
}

/* ------------------------------------------------------------ handles */

/* Bumped in every forked child: a handle opened under another generation belongs
 * to the parent, whose locks its descriptors (shared open file descriptions) carry. */
static unsigned long generation = 1;
static pthread_once_t atfork_once = PTHREAD_ONCE_INIT;

static void bump_generation(void) { __atomic_add_fetch(&generation, 1, __ATOMIC_RELAXED); }
static void install_atfork(void) { (void)pthread_atfork(NULL, NULL, bump_generation); }

int pl_slots_init(pl_slots *h, const char *dir, int nslots) {
    memset(h, 0, sizeof *h);
    (void)pthread_once(&atfork_once, install_atfork);
    h->dirfd = h->admfd = -1;
    h->nslots = nslots;
    h->dir = strdup(dir);
    h->slotfd = malloc((size_t)nslots * sizeof *h->slotfd);
    h->held = calloc((size_t)nslots, 1);
    if (!h->dir || !h->slotfd || !h->held) {
        free(h->dir);
        free(h->slotfd);
        free(h->held);
        h->dir = NULL;
        h->slotfd = NULL;
        h->held = NULL;
        return -1;
    }
    for (int i = 0; i < nslots; i++)
        h->slotfd[i] = -1;
    pthread_mutex_init(&h->mu, NULL);
    return 0;
}

static void close_fds(pl_slots *h) {
    if (h->dirfd >= 0)
        close(h->dirfd);
    if (h->admfd >= 0)
        close(h->admfd);
    for (int i = 0; i < h->nslots; i++) {
        if (h->slotfd[i] >= 0)
            close(h->slotfd[i]);
        h->slotfd[i] = -1;
        h->held[i] = 0;
    }
    h->dirfd = h->admfd = -1;
    h->generation = 0;
}

void pl_slots_destroy(pl_slots *h) {
    if (!h->dir)
        return;
    close_fds(h);
    pthread_mutex_destroy(&h->mu);
    free(h->dir);
    free(h->slotfd);
    free(h->held);
    memset(h, 0, sizeof *h);
}

/* Opens the directory, admission and every slot file (creating what is missing).
 * Called with h->mu held. */
static int open_handle(pl_slots *h, pl_slots_error *e) {
    h->dirfd = open_dir(h->dir, h->nslots, 1, e);
    if (h->dirfd < 0)
        return -1;
    struct stat dst;
    if (fstat(h->dirfd, &dst) != 0) {
        int err = errno;
        close_fds(h);
        return fail(e, PL_SLOTS_E_OPEN, err, h->dir, NULL);
    }
    h->dir_dev = (uint64_t)dst.st_dev;
    h->dir_ino = (uint64_t)dst.st_ino;
    char name[32];
    for (int i = -1; i < h->nslots; i++) {
        if (i < 0)
            snprintf(name, sizeof name, "admission");
        else
            snprintf(name, sizeof name, "slot-%d", i);
        int fd = open_lock_file(h->dirfd, h->dir, name, e);
        if (fd < 0 && e->kind == PL_SLOTS_E_OPEN && e->err == ENOENT) {
            /* A directory made by hand or an older run: add the missing files. */
            free(e->path);
            memset(e, 0, sizeof *e);
            if (ensure_files(h->dirfd, h->dir, h->nslots, 0, e) == 0)
                fd = open_lock_file(h->dirfd, h->dir, name, e);
        }
        if (fd < 0) {
            close_fds(h);
            return -1;
        }
        if (i < 0)
            h->admfd = fd;
        else
            h->slotfd[i] = fd;
    }
    h->generation = __atomic_load_n(&generation, __ATOMIC_RELAXED);
    return 0;
}

/* Locks the handle's mutex (held only for bookkeeping, never across a wait) and
 * opens the descriptors on first use, or again in a forked child. */
static int enter(pl_slots *h, pl_slots_error *e) {
    unsigned long gen = __atomic_load_n(&generation, __ATOMIC_RELAXED);
    if (h->generation != 0 && h->generation != gen) {
        /* A forked child: the inherited descriptors share the parent's open file
         * descriptions and locks. Drop them without unlocking; the mutex may have
         * been held by a thread that does not exist here. */
        pthread_mutex_init(&h->mu, NULL);
        h->holding = 0;
        close_fds(h);
    }
    int rc = pthread_mutex_lock(&h->mu);
    if (rc != 0)
        return lock_error(e, rc, h->dir, NULL);
    if (h->dirfd < 0 && open_handle(h, e) != 0) {
        pthread_mutex_unlock(&h->mu);
        return -1;
    }
    return 0;
}

/* A slot's waiters form a FIFO queue. Place l of slot i is the queue file
 * slot-<i>.queue-<l>, held (flock) by the waiter standing there. The waiter at
 * place l > 0 waits for place l - 1, then moves up into it and lets its own go,
 * so the one behind follows; the waiter at place 0 waits for the slot and lets
 * place 0 go once it holds the slot. Every waiter blocks on a lock only the one
 * ahead of it releases: flock wakes every waiter of a lock and the fastest wins,
 * but here each lock has one waiter, so none starves.
 *
 * Waiters also mark the places they stand on with an OFD read lock on byte l of
 * the slot file (byte QUEUE_DEPTH when no place was left), which flock never
 * sees: scanners leave a free slot with marks to its waiters, and a newcomer
 * joins behind the last marked place of the slot with the shortest queue. */

/* True when a waiter holds a mark on fd's slot at byte `from` or after it.
 * Marks held through fd itself do not count. */
static int marked_from(int fd, int from) {
    struct flock fl;
    memset(&fl, 0, sizeof fl);
    fl.l_type = F_WRLCK;
    fl.l_whence = SEEK_SET;
    fl.l_start = from;
    fl.l_len = 0;
    if (fcntl(fd, F_OFD_GETLK, &fl) != 0)
        return 0; /* cannot tell: behave as before marks existed */
    return fl.l_type != F_UNLCK;
}

static int has_waiter(int fd) { return marked_from(fd, 0); }

/* The place after the last marked one: the length of the slot's queue, counting
 * gaps a waiter is moving up from. QUEUE_DEPTH + 1 when it overflowed. */
static int queue_tail(int fd) {
    int l = 0;
    while (l <= QUEUE_DEPTH && marked_from(fd, l))
        l++;
    return l;
}

/* Sets (F_RDLCK) or clears (F_UNLCK) marks on `len` bytes from `from` of the
 * slot file (len 0: to the end, every mark). */
static int mark(int fd, short type, int from, int len) {
    struct flock fl;
    memset(&fl, 0, sizeof fl);
    fl.l_type = type;
    fl.l_whence = SEEK_SET;
    fl.l_start = from;
    fl.l_len = len;
    return fcntl(fd, F_OFD_SETLK, &fl);
}

/* Opens place `level` of `slot`'s queue; a missing file is created when the
 * directory allows it. -1 with *e when it cannot be opened. */
static int open_place(pl_slots *h, int slot, int level, pl_slots_error *e) {
    char name[48];
    snprintf(name, sizeof name, "slot-%d.queue-%d", slot, level);
    int fd = open_lock_file(h->dirfd, h->dir, name, e);
    if (fd < 0 && e->kind == PL_SLOTS_E_OPEN && e->err == ENOENT) {
        free(e->path);
        memset(e, 0, sizeof *e);
        int k = h->nslots + slot * QUEUE_DEPTH + level;
        if (ensure_file(h->dirfd, h->dir, k, h->nslots, e) == 0)
            fd = open_lock_file(h->dirfd, h->dir, name, e);
    }
    return fd;
}

/* Takes a place at the end of the queue of the slot fd opens, marking it, with
 * h->mu held: the place's descriptor (*level set), or -1 with *level set to
 * QUEUE_DEPTH when none is left or the queue files are missing (the waiter then
 * races for the slot, marked), or -2 with *e on an error. */
static int join_queue(pl_slots *h, int slot, int fd, int *level, pl_slots_error *e) {
    int l = queue_tail(fd);
    while (l < QUEUE_DEPTH) {
        int qfd = open_place(h, slot, l, e);
        if (qfd < 0) {
            if (e->kind == PL_SLOTS_E_SYMLINK || e->kind == PL_SLOTS_E_NOTREG)
                return -2;
            free(e->path);
            memset(e, 0, sizeof *e);
            break; /* no queue files here: race as before */
        }
        if (flock(qfd, LOCK_EX | LOCK_NB) == 0) {
            if (mark(fd, F_RDLCK, l, 1) != 0) {
                int err = errno;
                close(qfd);
                lock_error(e, err, h->dir, "queue mark");
                return -2;
            }
            *level = l;
            return qfd;
        }
        int err = errno;
        close(qfd);
        if (err != EWOULDBLOCK) {
            lock_error(e, err, h->dir, "queue");
            return -2;
        }
        l++; /* a newcomer took it a moment ago and is about to mark it */
    }
    *level = QUEUE_DEPTH;
    if (mark(fd, F_RDLCK, QUEUE_DEPTH, 1) != 0) {
        lock_error(e, errno, h->dir, "queue mark");
        return -2;
    }
    return -1;
}

/* Waits at place `level` (qfd) until this waiter holds the slot through fd:
 * moves up one place at a time, then takes the slot and lets place 0 go. 0 ok,
 * -1 with errno (ETIMEDOUT when the deadline passed). Closes qfd in every case. */
static int wait_in_queue(pl_slots *h, int slot, int fd, int qfd, int level, long deadline,
                         pl_slots_error *e) {
    while (qfd >= 0 && level > 0) {
        int ahead = open_place(h, slot, level - 1, e);
        if (ahead < 0) {
            close(qfd);
            errno = e->err ? e->err : ENOENT;
            return -1;
        }
        if (timed_lock(ahead, deadline < 0 ? -1 : remaining(deadline)) != 0) {
            int err = errno;
            close(ahead);
            close(qfd);
            errno = err;
            return -1;
        }
        /* Mark the new place before letting the old one go, so the queue never
         * looks shorter than it is to a newcomer. */
        (void)mark(fd, F_RDLCK, level - 1, 1);
        close(qfd);
        (void)mark(fd, F_UNLCK, level, 1);
        qfd = ahead;
        level--;
    }
    int rc = timed_lock(fd, deadline < 0 ? -1 : remaining(deadline));
    int err = errno;
    if (qfd >= 0)
        close(qfd); /* the next waiter moves up to place 0 and waits for the slot */
    errno = err;
    return rc;
}

/* One pass over the slots this handle does not hold, with h->mu held: the index
 * taken (marked held), -1 when none is free to take, -2 with *e on an error. */
static int scan(pl_slots *h, pl_slots_error *e) {
    for (int i = 0; i < h->nslots; i++) {
        if (h->held[i])
            continue;
        if (flock(h->slotfd[i], LOCK_EX | LOCK_NB) != 0) {
            if (errno == EWOULDBLOCK)
                continue;
            int err = errno;
            char name[32];
            snprintf(name, sizeof name, "slot-%d", i);
            lock_error(e, err, h->dir, name);
            return -2;
        }
        /* Free, but a waiter parked on it is about to be woken: leave it to them,
         * or they could wait forever behind processes that release and rescan. */
        if (has_waiter(h->slotfd[i])) {
            (void)flock(h->slotfd[i], LOCK_UN);
            continue;
        }
        h->held[i] = 1;
        __atomic_add_fetch(&h->holding, 1, __ATOMIC_RELAXED);
        return i;
    }
    return -1;
}

/* True when nobody holds slot `s`. A slot this handle holds is not free:
 * probing it through the handle's own descriptor would drop it. */
static int slot_free(pl_slots *h, int s) {
    if (h->held[s] || flock(h->slotfd[s], LOCK_EX | LOCK_NB) != 0)
        return 0;
    (void)flock(h->slotfd[s], LOCK_UN);
    return 1;
}

/* Waiters who will hold slot `s` before a newcomer joining the end of its
 * queue: the queue's length, less its first waiter when the slot is free (that
 * one is about to hold it). */
static int waiters_ahead(pl_slots *h, int s) {
    int tail = queue_tail(h->slotfd[s]);
    if (tail > 0 && slot_free(h, s))
        tail--;
    return tail;
}

/* The slot to queue on at full cap: the one with the fewest waiters ahead,
 * ties to the first from `pid % N` on, so waiters spread over the slots.
 * `skip` (or -1) is left out; *ahead (when not NULL) is set to its waiters
 * ahead. -1 when no slot is left. */
static int shortest_queue(pl_slots *h, long pid, int skip, int *ahead) {
    int slot = -1, best = QUEUE_DEPTH + 2;
    for (int k = 0; k < h->nslots && best > 0; k++) {
        int s = (int)((pid + k) % h->nslots);
        if (s == skip)
            continue;
        int n = waiters_ahead(h, s);
        if (n < best) {
            best = n;
            slot = s;
        }
    }
    if (ahead)
        *ahead = best;
    return slot;
}

/* Opens a descriptor of the waiter's own on `slot` (its lock conflicts with
 * this process's other holders of the slot, which the cached descriptor's would
 * not) and joins the slot's queue: the descriptor, with *qfd and *level set as
 * join_queue sets them, or -1 with *e. */
static int open_and_join(pl_slots *h, int slot, int *qfd, int *level, pl_slots_error *e) {
    char name[32];
    snprintf(name, sizeof name, "slot-%d", slot);
    int fd = open_lock_file(h->dirfd, h->dir, name, e);
    if (fd < 0)
        return -1;
    *qfd = join_queue(h, slot, fd, level, e);
    if (*qfd == -2) {
        *qfd = -1;
        close(fd);
        return -1;
    }
    return fd;
}

int pl_slots_take(pl_slots *h, int blocking, long timeout_ms, long pid, pl_slot *out,
                  pl_slots_error *error) {
    memset(error, 0, sizeof *error);
    out->fd = -1;
    out->slot = -1;
    out->cached = 0;
    long deadline = timeout_ms >= 0 ? now_ms() + timeout_ms : -1;
    if (enter(h, error) != 0)
        return -1;
    out->dir_dev = h->dir_dev;
    out->dir_ino = h->dir_ino;
    char name[32];
    /* Fast path: LOCK_NB alone decides who gets a free slot, so an uncontended
     * acquire is one flock and one lock query. */
    int got = scan(h, error);
    if (got != -1 || !blocking) {
        pthread_mutex_unlock(&h->mu);
        if (got >= 0) {
            out->fd = h->slotfd[got];
            out->slot = got;
            out->cached = 1;
            return PL_SLOTS_TAKEN;
        }
        return got == -2 ? -1 : PL_SLOTS_BUSY;
    }
    /* Admission orders the choice of where to park, so two waiters do not pick
     * the same place; it is taken only if free, never waited for. Waiting on it
     * would be a second queue (flock wakes every waiter and the fastest wins) in
     * which one waiter could lose every race, and a preempted scanner holding it
     * would stall every waiter; without it two waiters may at worst share a queue
     * position. */
    int admitted = flock(h->admfd, LOCK_EX | LOCK_NB) == 0;
    if (!admitted && errno != EWOULDBLOCK) {
        int err = errno;
        pthread_mutex_unlock(&h->mu);
        return lock_error(error, err, h->dir, "admission");
    }
    /* Full cap. Queue on slot pid % N, or on the next slot with a shorter queue
     * of waiters, so waiters spread over the slots. */
    if (pid <= 0)
        pid = (long)getpid();
    int slot = shortest_queue(h, pid, -1, NULL);
    snprintf(name, sizeof name, "slot-%d", slot);
    int qfd = -1, level = 0;
    int fd = open_and_join(h, slot, &qfd, &level, error);
    if (fd >= 0 && qfd >= 0 && level > 0) {
        /* Waiters choosing at once (admission is not waited for) see the same
         * shortest queue and join it one behind the other while another queue is
         * shorter. One that ended up with more waiters ahead than another queue
         * has moves there, once: it has not waited yet, and the place it leaves is
         * taken up by whoever queued behind it. */
        int ahead = level - slot_free(h, slot), other_ahead;
        int other = ahead > 0 ? shortest_queue(h, pid, slot, &other_ahead) : -1;
        if (other >= 0 && other_ahead < ahead) {
            (void)mark(fd, F_UNLCK, 0, 0);
            close(qfd);
            close(fd);
            qfd = -1;
            slot = other;
            snprintf(name, sizeof name, "slot-%d", slot);
            fd = open_and_join(h, slot, &qfd, &level, error);
        }
    }
    if (fd >= 0) {
        /* A slot freed between the first scan and joining the queue has nobody
         * queued on it: take it rather than wait a whole hold on the chosen one.
         * From here on, the mark keeps the chosen slot for this waiter. */
        got = scan(h, error);
        if (got != -1) {
            if (qfd >= 0)
                close(qfd);
            close(fd);
            if (admitted)
                (void)flock(h->admfd, LOCK_UN);
            pthread_mutex_unlock(&h->mu);
            if (got == -2)
                return -1;
            out->fd = h->slotfd[got];
            out->slot = got;
            out->cached = 1;
            return PL_SLOTS_TAKEN;
        }
    }
    if (admitted)
        (void)flock(h->admfd, LOCK_UN);
    pthread_mutex_unlock(&h->mu);
    if (fd < 0)
        return -1;
    if (pl_slots_full_hook) {
        size_t len = strlen(h->dir) + strlen(name) + 2;
        char *p = malloc(len);
        if (p) {
            snprintf(p, len, "%s/%s", h->dir, name);
            pl_slots_full_hook(p);
            free(p);
        }
    }
    if (wait_in_queue(h, slot, fd, qfd, level, deadline, error) != 0) {
        int err = errno;
        close(fd);
        if (err == ETIMEDOUT)
            return PL_SLOTS_TIMEOUT;
        if (error->kind != 0)
            return -1;
        return lock_error(error, err, h->dir, name);
    }
    (void)mark(fd, F_UNLCK, 0, 0); /* holding now, not waiting */
    __atomic_add_fetch(&h->holding, 1, __ATOMIC_RELAXED);
    out->fd = fd;
    out->slot = slot;
    out->cached = 0;
    return PL_SLOTS_TAKEN;
}

int pl_slots_give(pl_slots *h, const pl_slot *slot) {
    unsigned long gen = __atomic_load_n(&generation, __ATOMIC_RELAXED);
    if (!slot->cached) {
        /* Our own descriptor: closing it releases the slot. In a forked child the
         * close only drops the child's reference; the parent keeps its lock. */
        if (h->generation == gen)
            __atomic_sub_fetch(&h->holding, 1, __ATOMIC_RELAXED);
        return close(slot->fd);
    }
    if (h->generation != gen)
        return 0; /* the parent's lock, on a shared description: not ours to drop */
    if (pthread_mutex_lock(&h->mu) != 0)
        return -1;
    int rc = 0;
    if (slot->slot >= 0 && slot->slot < h->nslots && h->held[slot->slot] &&
        h->slotfd[slot->slot] == slot->fd) {
        rc = flock(slot->fd, LOCK_UN);
        h->held[slot->slot] = 0;
        __atomic_sub_fetch(&h->holding, 1, __ATOMIC_RELAXED);
    }
    pthread_mutex_unlock(&h->mu);
    return rc;
}

int pl_slots_acquire(const char *dir, int nslots, int blocking, long pid, pl_slot *out,
                     pl_slots_error *error) {
    pl_slots h;
    if (pl_slots_init(&h, dir, nslots) != 0) {
        memset(error, 0, sizeof *error);
        out->fd = -1;
        return fail(error, PL_SLOTS_E_NOMEM, ENOMEM, dir, NULL);
    }
    int rc = pl_slots_take(&h, blocking, -1, pid, out, error);
    if (rc == PL_SLOTS_TAKEN && out->cached) {
        /* Hand the held descriptor to the caller: closing it releases the slot. */
        h.slotfd[out->slot] = -1;
        h.held[out->slot] = 0;
        out->cached = 0;
    }
    pl_slots_destroy(&h);
    return rc;
}
