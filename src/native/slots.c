/* Host slot semaphore. See slots.h for the contract. */
#include "slots.h"

#include <errno.h>
#include <fcntl.h>
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

static char *slot_name(int i) {
    char *s = malloc(32);
    if (s) {
        if (i < 0)
            snprintf(s, 32, "admission");
        else
            snprintf(s, 32, "slot-%d", i);
    }
    return s;
}

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

/* Makes sure every coordination file exists as a regular file. Existing files
 * are adopted as they are: never truncated, never replaced. */
static int ensure_files(int dirfd, const char *dir, int nslots, pl_slots_error *e) {
    for (int i = -1; i < nslots; i++) {
        char *name = slot_name(i);
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
        if (rc != 0)
            return rc;
    }
    return 0;
}

static void remove_tmp_dir(const char *tmp, int nslots) {
    int fd = open(tmp, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    if (fd >= 0) {
        for (int i = -1; i < nslots; i++) {
            char *name = slot_name(i);
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
    } else if (ensure_files(fd, tmp, nslots, e) != 0) {
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
    int rc = ensure_files(fd, dir, nslots, error);
    close(fd);
    return rc;
}

static int lock_error(pl_slots_error *e, int err, const char *dir, const char *name) {
    return fail(e, PL_SLOTS_E_LOCK, err, dir, name);
}

int pl_slots_acquire(const char *dir, int nslots, int blocking, long pid, pl_slot *out,
                     pl_slots_error *error) {
    memset(error, 0, sizeof *error);
    out->fd = -1;
    out->slot = -1;
    int dirfd = open_dir(dir, nslots, 1, error);
    if (dirfd < 0)
        return -1;
    struct stat dst;
    if (fstat(dirfd, &dst) != 0) {
        int err = errno;
        close(dirfd);
        return fail(error, PL_SLOTS_E_OPEN, err, dir, NULL);
    }
    out->dir_dev = (uint64_t)dst.st_dev;
    out->dir_ino = (uint64_t)dst.st_ino;

    int adm = open_lock_file(dirfd, dir, "admission", error);
    if (adm < 0 && error->kind == PL_SLOTS_E_OPEN && error->err == ENOENT) {
        /* A directory made by hand or an older run: add the missing files. */
        free(error->path);
        memset(error, 0, sizeof *error);
        if (ensure_files(dirfd, dir, nslots, error) == 0)
            adm = open_lock_file(dirfd, dir, "admission", error);
    }
    if (adm < 0) {
        close(dirfd);
        return -1;
    }
    if (flock(adm, LOCK_EX) != 0) {
        int err = errno;
        close(adm);
        close(dirfd);
        return lock_error(error, err, dir, "admission");
    }
    char name[32];
    for (int i = 0; i < nslots; i++) {
        snprintf(name, sizeof name, "slot-%d", i);
        int fd = open_lock_file(dirfd, dir, name, error);
        if (fd < 0 && error->kind == PL_SLOTS_E_OPEN && error->err == ENOENT) {
            free(error->path);
            memset(error, 0, sizeof *error);
            if (ensure_files(dirfd, dir, nslots, error) == 0)
                fd = open_lock_file(dirfd, dir, name, error);
        }
        if (fd < 0) {
            close(adm);
            close(dirfd);
            return -1;
        }
        if (flock(fd, LOCK_EX | LOCK_NB) == 0) {
            close(adm);
            close(dirfd);
            out->fd = fd;
            out->slot = i;
            return 0;
        }
        int err = errno;
        close(fd);
        if (err != EWOULDBLOCK) {
            close(adm);
            close(dirfd);
            return lock_error(error, err, dir, name);
        }
    }
    close(adm); /* full cap: admission serializes scans only, never waiting */
    if (!blocking) {
        close(dirfd);
        return 1;
    }
    if (pid <= 0)
        pid = (long)getpid();
    int slot = (int)(pid % nslots);
    snprintf(name, sizeof name, "slot-%d", slot);
    int fd = open_lock_file(dirfd, dir, name, error);
    close(dirfd);
    if (fd < 0)
        return -1;
    if (pl_slots_full_hook) {
        size_t len = strlen(dir) + strlen(name) + 2;
        char *p = malloc(len);
        if (p) {
            snprintf(p, len, "%s/%s", dir, name);
            pl_slots_full_hook(p);
            free(p);
        }
    }
    if (flock(fd, LOCK_EX) != 0) {
        int err = errno;
        close(fd);
        return lock_error(error, err, dir, name);
    }
    out->fd = fd;
    out->slot = slot;
    return 0;
}
