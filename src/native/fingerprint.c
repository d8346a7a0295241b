/* Native tree fingerprints. See fingerprint.h and README "Fingerprints". */
#include "fingerprint.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/vfs.h>
#include <time.h>
#include <unistd.h>

void (*pl_fp_after_read_hook)(const char *path) = NULL;
int64_t pl_fp_recent_ns = PL_FP_RECENT_NS;

#define BUF_SIZE (256 * 1024) /* the walk's one streaming buffer: dents and file bytes */
#define MAX_OPEN_DIRS 64      /* deeper ancestors are reopened through ".." on the way up */

static const char CONTENT_SCHEMA[] = "preloop/tree-digest/v1"; /* + NUL, hashed with it */
static const char METADATA_SCHEMA[] = "preloop/tree-metadata/v1";
static const char ROOTS_SCHEMA[] = "preloop/roots-digest/v1";

typedef struct {
    size_t name_off;
    uint32_t name_len;
    uint32_t lazy; /* listed as a regular file (d_type), not lstat'ed: st_mode only */
    uint64_t d_ino;
    struct stat st;
} entry;

typedef struct {
    int fd;
    uint64_t dev, ino;
    int64_t changed_ns; /* the directory's max(mtime, ctime) when it was opened */
    int64_t old_before; /* files whose ctime is before this are old (see emit_file_lazy) */
    int lazy;           /* its regular files are listed without lstat */
    entry *entries;
    size_t n, next;
    char *names;
    size_t prefix_len; /* length of the relative path of this directory plus '/' */
} fframe;

typedef struct {
    const char *root;
    int mode;
    pl_sha256 tree;
    uint8_t *buf;
    char *rel;
    size_t rel_len, rel_cap;
    fframe *frames;
    size_t depth, frames_cap;
    char *link;
    size_t link_cap;
    uint64_t skip_dev, skip_ino; /* the coordination directory: never fingerprinted */
    uint64_t fs_dev;             /* the device whose filesystem type was checked last */
    int fs_dev_set, fs_local;    /* ... and whether its timestamps come from this host's clock */
    int noatime;                 /* O_NOATIME until it is refused (EPERM: not the owner) */
    pl_fp_result *res;
    pl_fp_error *error;
} fwalk;

static void to_fp_stat(const struct stat *st, pl_fp_stat *o) {
    o->mode = (uint32_t)st->st_mode;
    o->dev = (uint64_t)st->st_dev;
    o->ino = (uint64_t)st->st_ino;
    o->size = (uint64_t)st->st_size;
    o->mtime_ns = (int64_t)st->st_mtim.tv_sec * 1000000000 + st->st_mtim.tv_nsec;
    o->ctime_ns = (int64_t)st->st_ctim.tv_sec * 1000000000 + st->st_ctim.tv_nsec;
}

static int64_t ts_ns(const struct timespec *t) {
    return (int64_t)t->tv_sec * 1000000000 + t->tv_nsec;
}

static int same_stat(const struct stat *a, const struct stat *b) {
    return a->st_mode == b->st_mode && a->st_dev == b->st_dev && a->st_ino == b->st_ino &&
           a->st_size == b->st_size && a->st_mtim.tv_sec == b->st_mtim.tv_sec &&
           a->st_mtim.tv_nsec == b->st_mtim.tv_nsec && a->st_ctim.tv_sec == b->st_ctim.tv_sec &&
           a->st_ctim.tv_nsec == b->st_ctim.tv_nsec;
}

/* root + "/" + the first rel_len bytes of the relative path. */
static char *full_path(const fwalk *w, size_t rel_len) {
    size_t rl = strlen(w->root);
    while (rel_len > 0 && w->rel[rel_len - 1] == '/')
        rel_len--;
    char *p = malloc(rl + rel_len + 2);
    if (!p)
        return NULL;
    memcpy(p, w->root, rl);
    size_t n = rl;
    if (rel_len) {
        if (rl == 0 || w->root[rl - 1] != '/')
            p[n++] = '/';
        memcpy(p + n, w->rel, rel_len);
        n += rel_len;
    }
    p[n] = '\0';
    return p;
}

static int fail_os(fwalk *w, int err, size_t rel_len) {
    w->error->kind = PL_FP_E_OS;
    w->error->err = err;
    w->error->path = full_path(w, rel_len);
    return -1;
}

static int fail_nomem(fwalk *w) {
    w->error->kind = PL_FP_E_NOMEM;
    w->error->err = ENOMEM;
    w->error->path = strdup(w->root);
    return -1;
}

/* `after` NULL: the entry is gone. */
static int fail_changed(fwalk *w, const struct stat *before, const struct stat *after) {
    w->error->kind = PL_FP_E_CHANGED;
    w->error->err = after ? 0 : ENOENT;
    w->error->path = full_path(w, w->rel_len);
    to_fp_stat(before, &w->error->before);
    if (after)
        to_fp_stat(after, &w->error->after);
    return -1;
}

static void put_frame(pl_sha256 *ctx, const void *data, size_t len) {
    uint8_t be[8];
    for (int i = 0; i < 8; i++)
        be[i] = (uint8_t)((uint64_t)len >> (56 - 8 * i));
    pl_sha256_update(ctx, be, 8);
    pl_sha256_update(ctx, data, len);
}

static void put_u64(pl_sha256 *ctx, uint64_t v) {
    uint8_t be[8];
    for (int i = 0; i < 8; i++)
        be[i] = (uint8_t)(v >> (56 - 8 * i));
    put_frame(ctx, be, 8);
}

static const char *kind_name(mode_t m) {
    switch (m & S_IFMT) {
    case S_IFREG:
        return "file";
    case S_IFDIR:
        return "dir";
    case S_IFLNK:
        return "symlink";
    case S_IFIFO:
        return "fifo";
    case S_IFSOCK:
        return "socket";
    case S_IFCHR:
        return "char";
    case S_IFBLK:
        return "block";
    default:
        return "unknown";
    }
}

static int rel_append(fwalk *w, const char *name, size_t len, int slash) {
    size_t need = w->rel_len + len + 2;
    if (need > w->rel_cap) {
        size_t ncap = w->rel_cap ? w->rel_cap : 4096;
        while (ncap < need)
            ncap *= 2;
        char *n = realloc(w->rel, ncap);
        if (!n)
            return -1;
        w->rel = n;
        w->rel_cap = ncap;
    }
    memcpy(w->rel + w->rel_len, name, len);
    w->rel_len += len;
    if (slash)
        w->rel[w->rel_len++] = '/';
    w->rel[w->rel_len] = '\0';
    return 0;
}

/* Raw-byte order of relative paths, a directory compared as if its name ended
 * in '/' (git's tree order): a directory's entries then directly follow it. */
static int entry_cmp(const void *pa, const void *pb, void *names) {
    const entry *a = pa, *b = pb;
    const unsigned char *na = (const unsigned char *)names + a->name_off;
    const unsigned char *nb = (const unsigned char *)names + b->name_off;
    size_t i = 0;
    for (;; i++) {
        int ca = i < a->name_len ? na[i] : (i == a->name_len && S_ISDIR(a->st.st_mode) ? '/' : -1);
        int cb = i < b->name_len ? nb[i] : (i == b->name_len && S_ISDIR(b->st.st_mode) ? '/' : -1);
        if (ca != cb)
            return ca < cb ? -1 : 1;
        if (ca < 0)
            return 0;
    }
}

/* Filesystems whose timestamps are set from this host's clock (CLOCK_REALTIME_COARSE
 * or finer) with nanosecond resolution, and whose d_ino is the inode's st_ino. */
static int local_clock_fs(long type) {
    switch ((unsigned long)type) {
    case 0xEF53UL:     /* ext2/3/4 */
    case 0x58465342UL: /* xfs */
    case 0x9123683EUL: /* btrfs */
    case 0x01021994UL: /* tmpfs */
    case 0xF2F52010UL: /* f2fs */
        return 1;
    default:
        return 0;
    }
}

/* Decides whether the frame's regular files are listed without lstat (content
 * mode, a local-clock filesystem, a directory not changed lately) and takes the
 * time files are compared with. Must run before the directory is listed. */
static int plan_lazy(fwalk *w, fframe *f) {
    f->lazy = 0;
    if (w->mode != PL_FP_CONTENT)
        return 0;
    struct timespec now;
    if (clock_gettime(CLOCK_REALTIME_COARSE, &now) != 0)
        return 0; /* no clock: every file is lstat'ed */
    f->old_before = ts_ns(&now) - pl_fp_recent_ns;
    if (!w->fs_dev_set || w->fs_dev != f->dev) {
        struct statfs sfs;
        if (fstatfs(f->fd, &sfs) != 0)
            return fail_os(w, errno, f->prefix_len);
        w->fs_dev = f->dev;
        w->fs_dev_set = 1;
        w->fs_local = local_clock_fs((long)sfs.f_type);
    }
    /* A directory changed lately likely holds files changed lately, which the lazy
     * path would read twice: the lstat-first path is cheaper there. */
    f->lazy = w->fs_local && f->changed_ns < f->old_before;
    return 0;
}

/* Lists, stats and sorts the top frame's entries. In a lazy frame a regular file
 * (d_type) is not lstat'ed: emit_file_lazy checks it on its open descriptor. */
static int scan_dir(fwalk *w, fframe *f) {
    size_t names_len = 0, names_cap = 0, n = 0, cap = 0;
    char *names = NULL;
    entry *es = NULL;
    if (plan_lazy(w, f) != 0)
        return -1;
    for (;;) {
        ssize_t got = getdents64(f->fd, w->buf, BUF_SIZE);
        if (got < 0) {
            free(names);
            free(es);
            return fail_os(w, errno, f->prefix_len);
        }
        if (got == 0)
            break;
        for (ssize_t pos = 0; pos < got;) {
            struct dirent64 *d = (struct dirent64 *)(w->buf + pos);
            pos += d->d_reclen;
            const char *name = d->d_name;
            if (name[0] == '.' && (name[1] == '\0' || (name[1] == '.' && name[2] == '\0')))
                continue;
            size_t len = strlen(name);
            if (names_len + len + 1 > names_cap || n == cap) {
                size_t nc = names_cap ? names_cap * 2 : 4096;
                while (nc < names_len + len + 1)
                    nc *= 2;
                char *nn = realloc(names, nc);
                entry *ne = n == cap ? realloc(es, (cap ? cap * 2 : 64) * sizeof *es) : es;
                if (nn)
                    names = nn, names_cap = nc;
                if (ne && n == cap)
                    es = ne, cap = cap ? cap * 2 : 64;
                if (!nn || !ne) {
                    free(names);
                    free(es);
                    return fail_nomem(w);
                }
            }
            memcpy(names + names_len, name, len + 1);
            es[n].name_off = names_len;
            es[n].name_len = (uint32_t)len;
            es[n].lazy = f->lazy && d->d_type == DT_REG;
            es[n].d_ino = (uint64_t)d->d_ino;
            names_len += len + 1;
            n++;
        }
    }
    size_t kept = 0;
    for (size_t i = 0; i < n; i++) {
        entry *e = &es[i];
        if (e->lazy) {
            memset(&e->st, 0, sizeof e->st);
            e->st.st_mode = S_IFREG;
            es[kept++] = *e;
            continue;
        }
        if (fstatat(f->fd, names + e->name_off, &e->st, AT_SYMLINK_NOFOLLOW) != 0) {
            if (errno == ENOENT)
                continue; /* removed after the listing: as if removed before it */
            int err = errno;
            size_t save = w->rel_len;
            w->rel_len = f->prefix_len;
            (void)rel_append(w, names + e->name_off, e->name_len, 0);
            fail_os(w, err, w->rel_len);
            w->rel_len = save;
            free(names);
            free(es);
            return -1;
        }
        if (S_ISDIR(e->st.st_mode) && (uint64_t)e->st.st_dev == w->skip_dev &&
            (uint64_t)e->st.st_ino == w->skip_ino)
            continue;
        es[kept++] = *e;
    }
    if (kept > 1)
        qsort_r(es, kept, sizeof *es, entry_cmp, names);
    f->entries = es;
    f->names = names;
    f->n = kept;
    f->next = 0;
    return 0;
}

static void emit_metadata(fwalk *w, const struct stat *st) {
    const char *kind = kind_name(st->st_mode);
    put_frame(&w->tree, kind, strlen(kind));
    put_frame(&w->tree, w->rel, w->rel_len);
    put_u64(&w->tree, (uint64_t)st->st_mode);
    put_u64(&w->tree, (uint64_t)st->st_size);
    put_u64(&w->tree, (uint64_t)((int64_t)st->st_mtim.tv_sec * 1000000000 + st->st_mtim.tv_nsec));
    if (S_ISREG(st->st_mode)) {
        w->res->files++;
        w->res->bytes += (uint64_t)st->st_size;
    }
}

/* Reads the open file from offset `from` to its end into a fresh `file` context.
 * `size` >= 0: a short read that reaches it is the end (the read that would return
 * 0 is skipped; growth after it shows in the fstat). 0 or errno. */
static int read_file(fwalk *w, int fd, int64_t size, int pread_from_start, pl_sha256 *file,
                     uint64_t *total) {
    pl_sha256_init(file);
    *total = 0;
    for (;;) {
        ssize_t got = pread_from_start ? pread(fd, w->buf, BUF_SIZE, (off_t)*total)
                                       : read(fd, w->buf, BUF_SIZE);
        if (got < 0) {
            if (errno == EINTR)
                continue;
            return errno;
        }
        if (got == 0)
            break;
        pl_sha256_update(file, w->buf, (size_t)got);
        *total += (uint64_t)got;
        if ((size_t)got < BUF_SIZE && (size < 0 || *total == (uint64_t)size))
            break;
    }
    if (pl_fp_after_read_hook) {
        char *p = full_path(w, w->rel_len);
        if (p)
            pl_fp_after_read_hook(p);
        free(p);
    }
    return 0;
}

static void put_file(fwalk *w, mode_t mode, uint64_t total, pl_sha256 *file) {
    uint8_t digest[PL_SHA256_DIGEST];
    pl_sha256_final(file, digest);
    uint8_t exec = (mode & S_IXUSR) ? 1 : 0;
    put_frame(&w->tree, "file", 4);
    put_frame(&w->tree, w->rel, w->rel_len);
    put_frame(&w->tree, &exec, 1);
    put_u64(&w->tree, total);
    put_frame(&w->tree, digest, sizeof digest);
    w->res->files++;
    w->res->bytes += total;
}

static int close_checked(fwalk *w, int fd) {
    if (close(fd) != 0 && errno != EINTR)
        return fail_os(w, errno, w->rel_len);
    return 0;
}

/* The check of a read bracketed by `before` and the descriptor's fstat after it:
 * the bytes are the `before` inode's, unchanged to the end of the read. Closes fd. */
static int check_and_put(fwalk *w, int fd, const struct stat *before, uint64_t total,
                         pl_sha256 *file) {
    struct stat after;
    if (fstat(fd, &after) != 0) {
        int err = errno;
        close(fd);
        return fail_os(w, err, w->rel_len);
    }
    if (close_checked(w, fd) != 0)
        return -1;
    if (after.st_nlink == 0) /* unlinked while it was read */
        return fail_changed(w, before, NULL);
    if (!same_stat(before, &after) || total != (uint64_t)before->st_size)
        return fail_changed(w, before, &after);
    put_file(w, before->st_mode, total, file);
    return 0;
}

static int open_file(fwalk *w, int dirfd, const char *name) {
    int flags = O_RDONLY | O_NOFOLLOW | O_CLOEXEC | O_NOCTTY | O_NONBLOCK;
    int fd = openat(dirfd, name, flags | (w->noatime ? O_NOATIME : 0));
    if (fd < 0 && errno == EPERM && w->noatime) { /* O_NOATIME needs the owner */
        w->noatime = 0;
        fd = openat(dirfd, name, flags);
    }
    return fd;
}

/* Hashes one regular file listed and lstat'ed (`before`). The stability check is on
 * the open descriptor: one fstat after the bytes are read, before close, compared
 * with `before`. It proves the opened inode is the listed one (dev, ino, type) and
 * that nothing changed it (size, mode, mtime, ctime) up to the end of the read. */
static int emit_file(fwalk *w, int dirfd, const char *name, const struct stat *before) {
    int fd = open_file(w, dirfd, name);
    if (fd < 0) {
        if (errno == ENOENT || errno == ELOOP)
            return fail_changed(w, before, NULL);
        return fail_os(w, errno, w->rel_len);
    }
    pl_sha256 file;
    uint64_t total;
    int err = read_file(w, fd, (int64_t)before->st_size, 0, &file, &total);
    if (err) {
        close(fd);
        return fail_os(w, err, w->rel_len);
    }
    return check_and_put(w, fd, before, total, &file);
}

static int emit(fwalk *w, int dirfd, const char *name, const struct stat *st);

/* A lazy entry that is not the regular file it was listed as: lstat it now and
 * take it as if it had been lstat'ed at the listing (gone: removed before it). */
static int emit_relisted(fwalk *w, const fframe *f, const char *name, const entry *e) {
    struct stat st;
    if (fstatat(f->fd, name, &st, AT_SYMLINK_NOFOLLOW) != 0) {
        if (errno == ENOENT)
            return 0;
        return fail_os(w, errno, w->rel_len);
    }
    if (S_ISDIR(st.st_mode)) { /* sorted as a file: cannot be walked in order */
        struct stat listed;
        memset(&listed, 0, sizeof listed);
        listed.st_mode = S_IFREG;
        listed.st_dev = (dev_t)f->dev;
        listed.st_ino = (ino_t)e->d_ino;
        return fail_changed(w, &listed, &st);
    }
    return emit(w, f->fd, name, &st);
}

/* Hashes a regular file listed without lstat (a lazy frame): open, read, fstat,
 * close. The fstat after the read proves the file stable when its ctime is older
 * than the frame's `old_before` (taken before the listing, so before the open):
 * nothing changed the inode's bytes or attributes since, in particular not during
 * the read; and it is the listed inode (d_ino), a regular file, still linked. A
 * file changed lately is read a second time on the same descriptor, bracketed by
 * that fstat and another (the lstat-first check, the first fstat as `before`). */
static int emit_file_lazy(fwalk *w, const fframe *f, const char *name, const entry *e) {
    int fd = open_file(w, f->fd, name);
    if (fd < 0) {
        if (errno == ENOENT || errno == ELOOP)
            return emit_relisted(w, f, name, e);
        return fail_os(w, errno, w->rel_len);
    }
    pl_sha256 file;
    uint64_t total;
    int err = read_file(w, fd, -1, 0, &file, &total);
    if (err == EISDIR) { /* replaced by a directory after the listing */
        close(fd);
        return emit_relisted(w, f, name, e);
    }
    if (err) {
        close(fd);
        return fail_os(w, err, w->rel_len);
    }
    struct stat first;
    if (fstat(fd, &first) != 0) {
        err = errno;
        close(fd);
        return fail_os(w, err, w->rel_len);
    }
    if (!S_ISREG(first.st_mode) || (uint64_t)first.st_ino != e->d_ino ||
        (uint64_t)first.st_dev != f->dev) {
        if (close_checked(w, fd) != 0)
            return -1;
        return emit_relisted(w, f, name, e); /* replaced after the listing */
    }
    if (first.st_nlink == 0) {
        close(fd);
        return fail_changed(w, &first, NULL);
    }
    if (ts_ns(&first.st_ctim) < f->old_before && total == (uint64_t)first.st_size) {
        if (close_checked(w, fd) != 0)
            return -1;
        put_file(w, first.st_mode, total, &file);
        return 0;
    }
    err = read_file(w, fd, (int64_t)first.st_size, 1, &file, &total);
    if (err) {
        close(fd);
        return fail_os(w, err, w->rel_len);
    }
    return check_and_put(w, fd, &first, total, &file);
}

static int emit_symlink(fwalk *w, int dirfd, const char *name, const struct stat *before) {
    size_t need = (size_t)before->st_size + 1;
    if (need > w->link_cap) {
        char *n = realloc(w->link, need);
        if (!n)
            return fail_nomem(w);
        w->link = n;
        w->link_cap = need;
    }
    ssize_t got = readlinkat(dirfd, name, w->link, w->link_cap);
    if (got < 0) {
        if (errno == ENOENT || errno == EINVAL)
            return fail_changed(w, before, NULL);
        return fail_os(w, errno, w->rel_len);
    }
    struct stat after;
    if (fstatat(dirfd, name, &after, AT_SYMLINK_NOFOLLOW) != 0) {
        if (errno == ENOENT)
            return fail_changed(w, before, NULL);
        return fail_os(w, errno, w->rel_len);
    }
    if (!same_stat(before, &after) || (uint64_t)got != (uint64_t)before->st_size)
        return fail_changed(w, before, &after);
    put_frame(&w->tree, "symlink", 7);
    put_frame(&w->tree, w->rel, w->rel_len);
    put_frame(&w->tree, w->link, (size_t)got);
    return 0;
}

static int emit(fwalk *w, int dirfd, const char *name, const struct stat *st) {
    if (w->mode == PL_FP_METADATA) {
        emit_metadata(w, st);
        return 0;
    }
    if (S_ISREG(st->st_mode))
        return emit_file(w, dirfd, name, st);
    if (S_ISLNK(st->st_mode))
        return emit_symlink(w, dirfd, name, st);
    const char *kind = kind_name(st->st_mode);
    put_frame(&w->tree, kind, strlen(kind));
    put_frame(&w->tree, w->rel, w->rel_len);
    return 0;
}

static int push_frame(fwalk *w, int fd, const struct stat *st) {
    if (w->depth == w->frames_cap) {
        size_t nc = w->frames_cap ? w->frames_cap * 2 : 64;
        fframe *nf = realloc(w->frames, nc * sizeof *nf);
        if (!nf)
            return -1;
        w->frames = nf;
        w->frames_cap = nc;
    }
    fframe *f = &w->frames[w->depth++];
    memset(f, 0, sizeof *f);
    f->fd = fd;
    f->dev = (uint64_t)st->st_dev;
    f->ino = (uint64_t)st->st_ino;
    int64_t m = ts_ns(&st->st_mtim), c = ts_ns(&st->st_ctim);
    f->changed_ns = m > c ? m : c;
    f->prefix_len = w->rel_len;
    if (w->depth > MAX_OPEN_DIRS) {
        fframe *old = &w->frames[w->depth - 1 - MAX_OPEN_DIRS];
        if (old->fd >= 0) {
            close(old->fd);
            old->fd = -1;
        }
    }
    return 0;
}

/* Pops the top frame, reopening its parent through ".." when the parent's
 * descriptor was closed to bound open descriptors. */
static int pop_frame(fwalk *w) {
    fframe *f = &w->frames[w->depth - 1];
    int rc = 0;
    if (w->depth > 1) {
        fframe *p = &w->frames[w->depth - 2];
        if (p->fd < 0) {
            int fd = openat(f->fd, "..", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
            struct stat st;
            if (fd < 0) {
                rc = fail_os(w, errno, p->prefix_len);
            } else if (fstat(fd, &st) != 0) {
                rc = fail_os(w, errno, p->prefix_len);
                close(fd);
            } else if ((uint64_t)st.st_dev != p->dev || (uint64_t)st.st_ino != p->ino) {
                w->rel_len = p->prefix_len;
                struct stat before = st;
                before.st_dev = (dev_t)p->dev;
                before.st_ino = (ino_t)p->ino;
                rc = fail_changed(w, &before, &st);
                close(fd);
            } else {
                p->fd = fd;
            }
        }
    }
    close(f->fd);
    free(f->entries);
    free(f->names);
    w->depth--;
    return rc;
}

static int walk_dir(fwalk *w, int root_fd, const struct stat *root_st) {
    if (push_frame(w, root_fd, root_st) != 0) {
        close(root_fd);
        return fail_nomem(w);
    }
    if (scan_dir(w, &w->frames[0]) != 0)
        return -1;
    while (w->depth > 0) {
        fframe *f = &w->frames[w->depth - 1];
        if (f->next == f->n) {
            if (pop_frame(w) != 0)
                return -1;
            continue;
        }
        entry *e = &f->entries[f->next++];
        const char *name = f->names + e->name_off;
        w->rel_len = f->prefix_len;
        if (rel_append(w, name, e->name_len, 0) != 0)
            return fail_nomem(w);
        if ((e->lazy ? emit_file_lazy(w, f, name, e) : emit(w, f->fd, name, &e->st)) != 0)
            return -1;
        if (!S_ISDIR(e->st.st_mode))
            continue;
        int fd = openat(f->fd, name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
        if (fd < 0) {
            if (errno == ENOENT || errno == ENOTDIR || errno == ELOOP)
                return fail_changed(w, &e->st, NULL);
            return fail_os(w, errno, w->rel_len);
        }
        struct stat st;
        if (fstat(fd, &st) != 0) {
            int err = errno;
            close(fd);
            return fail_os(w, err, w->rel_len);
        }
        if (st.st_dev != e->st.st_dev || st.st_ino != e->st.st_ino) {
            close(fd);
            return fail_changed(w, &e->st, &st);
        }
        if (rel_append(w, "", 0, 1) != 0) {
            close(fd);
            return fail_nomem(w);
        }
        if (push_frame(w, fd, &st) != 0) {
            close(fd);
            return fail_nomem(w);
        }
        if (scan_dir(w, &w->frames[w->depth - 1]) != 0)
            return -1;
    }
    return 0;
}

static int fingerprint_root(fwalk *w) {
    const char *schema = w->mode == PL_FP_METADATA ? METADATA_SCHEMA : CONTENT_SCHEMA;
    pl_sha256_init(&w->tree);
    pl_sha256_update(&w->tree, schema, strlen(schema) + 1);
    w->rel_len = 0;
    if (rel_append(w, "", 0, 0) != 0)
        return fail_nomem(w);
    struct stat st;
    if (lstat(w->root, &st) != 0)
        return fail_os(w, errno, 0);
    int rc;
    if (S_ISDIR(st.st_mode)) {
        int fd = open(w->root, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
        if (fd < 0)
            return fail_os(w, errno, 0);
        struct stat opened;
        if (fstat(fd, &opened) != 0) {
            int err = errno;
            close(fd);
            return fail_os(w, err, 0);
        }
        rc = walk_dir(w, fd, &opened);
        while (w->depth > 0) { /* after an error: close what is still open */
            fframe *f = &w->frames[--w->depth];
            if (f->fd >= 0)
                close(f->fd);
            free(f->entries);
            free(f->names);
        }
    } else {
        /* A file root is one entry with an empty relative path. */
        char *slash = strrchr(w->root, '/');
        char *parent = slash ? strndup(w->root, slash == w->root ? 1 : (size_t)(slash - w->root)) : strdup(".");
        if (!parent)
            return fail_nomem(w);
        int dfd = open(parent, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
        free(parent);
        if (dfd < 0)
            return fail_os(w, errno, 0);
        rc = emit(w, dfd, slash ? slash + 1 : w->root, &st);
        close(dfd);
    }
    if (rc == 0)
        pl_sha256_final(&w->tree, w->res->digest);
    return rc;
}

int pl_fingerprint(const char *const *roots, size_t nroots, int mode, const char *coordination_dir,
                   int nslots, const pl_slots *held, pl_fp_result *per_root, pl_fp_result *total,
                   pl_fp_error *error) {
    memset(error, 0, sizeof *error);
    memset(total, 0, sizeof *total);
    pl_slot slot;
    int rc = 0;
    if (held) {
        slot.fd = -1;
        slot.dir_dev = held->dir_dev;
        slot.dir_ino = held->dir_ino;
    } else if ((rc = pl_slots_acquire(coordination_dir, nslots, 1, 0, &slot, &error->slots)) != 0) {
        error->kind = PL_FP_E_SLOTS;
        error->err = error->slots.err;
        return -1;
    }
    fwalk w;
    memset(&w, 0, sizeof w);
    w.mode = mode;
    w.error = error;
    w.skip_dev = slot.dir_dev;
    w.skip_ino = slot.dir_ino;
    w.noatime = 1;
    w.buf = malloc(BUF_SIZE);
    if (!w.buf) {
        w.root = nroots ? roots[0] : "";
        rc = fail_nomem(&w);
    }
    for (size_t i = 0; rc == 0 && i < nroots; i++) {
        w.root = roots[i];
        memset(&per_root[i], 0, sizeof per_root[i]);
        w.res = &per_root[i];
        rc = fingerprint_root(&w);
        total->files += per_root[i].files;
        total->bytes += per_root[i].bytes;
    }
    if (slot.fd >= 0)
        close(slot.fd); /* releases the host slot taken above */
    free(w.buf);
    free(w.rel);
    free(w.link);
    free(w.frames);
    if (rc != 0)
        return -1;
    pl_sha256 all;
    pl_sha256_init(&all);
    pl_sha256_update(&all, ROOTS_SCHEMA, sizeof ROOTS_SCHEMA);
    for (size_t i = 0; i < nroots; i++)
        put_frame(&all, per_root[i].digest, PL_SHA256_DIGEST);
    pl_sha256_final(&all, total->digest);
    return 0;
}
