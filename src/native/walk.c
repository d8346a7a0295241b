/* Iterative `du`-style byte walker. See walk.h for the contract. */
#include "walk.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#define DENTS_BUF_SIZE (64 * 1024)
/* Descriptors kept open along the current path; deeper trees reopen by name. */
#define MAX_OPEN_DIRS 64
#define REOPEN_KEEP 32

/* Pending-subdirectory record in the arena: header then name bytes, 8-aligned. */
typedef struct {
    uint64_t dev;
    uint64_t ino;
    uint64_t size, blocks; /* the directory's own, counted when it is removed */
    uint32_t len;
} rec_hdr;

typedef struct {
    int fd;
    uint64_t dev, ino;
    size_t name_off; /* record offset of this dir's own name (in parent's region) */
    size_t pend_start, pend_end, pend_next;
} frame;

typedef struct {
    uint64_t *slots; /* pairs (dev, ino+1); ino+1 == 0 marks empty */
    size_t cap, used;
} inode_set;

typedef struct {
    const char *root;
    int one_fs;
    uint64_t root_dev;
    pl_tree_size *out;
    pl_error *error;
    char *buf;
    char *arena;
    size_t arena_len, arena_cap;
    frame *frames;
    size_t depth, frames_cap; /* depth = number of frames on the stack */
    size_t open_count, lowest_open;
    inode_set links;
    int remove;           /* pl_remove_tree: unlink every entry, count what goes */
    int first_err;        /* removal keeps going after a failure; this is the first */
    char *first_err_path;
} walker;

char *pl_path_join(const char *prefix, const char *name, size_t name_len) {
    size_t plen = strlen(prefix);
    int need_sep = plen > 0 && prefix[plen - 1] != '/';
    char *p = malloc(plen + (size_t)need_sep + name_len + 1);
    if (!p)
        return NULL;
    memcpy(p, prefix, plen);
    if (need_sep)
        p[plen] = '/';
    memcpy(p + plen + need_sep, name, name_len);
    p[plen + need_sep + name_len] = '\0';
    return p;
}

static const char *rec_name(const walker *w, size_t off, uint32_t *len) {
    rec_hdr h;
    memcpy(&h, w->arena + off, sizeof h);
    *len = h.len;
    return w->arena + off + sizeof h;
}

/* Path of frame `upto` (inclusive), plus an optional trailing entry name. */
static char *frame_path(const walker *w, size_t upto, const char *name, size_t name_len) {
    char *path = strdup(w->root);
    for (size_t i = 1; path && i <= upto && i < w->depth; i++) {
        uint32_t len;
        const char *n = rec_name(w, w->frames[i].name_off, &len);
        char *next = pl_path_join(path, n, len);
        free(path);
        path = next;
    }
    if (path && name) {
        char *next = pl_path_join(path, name, name_len);
        free(path);
        path = next;
    }
    return path;
}

static int fail(walker *w, int err, size_t frame_idx, const char *name, size_t name_len) {
    w->error->err = err;
    w->error->path = frame_path(w, frame_idx, name, name_len);
    return -1;
}

static int fail_nomem(walker *w) {
    w->error->err = ENOMEM;
    w->error->path = strdup(w->root);
    return -1;
}

/* Returns 1 if (dev, ino) was new, 0 if seen, -1 on ENOMEM. */
static int inode_set_add(inode_set *s, uint64_t dev, uint64_t ino) {
    if ((s->used + 1) * 2 > s->cap) {
        size_t ncap = s->cap ? s->cap * 2 : 1024;
        uint64_t *ns = calloc(ncap * 2, sizeof *ns);
        if (!ns)
            return -1;
        for (size_t i = 0; i < s->cap; i++) {
            if (s->slots[2 * i + 1] == 0)
                continue;
            size_t j = (size_t)((s->slots[2 * i] * 0x9E3779B97F4A7C15ULL) ^ s->slots[2 * i + 1]) & (ncap - 1);
            while (ns[2 * j + 1] != 0)
                j = (j + 1) & (ncap - 1);
            ns[2 * j] = s->slots[2 * i];
            ns[2 * j + 1] = s->slots[2 * i + 1];
        }
        free(s->slots);
        s->slots = ns;
        s->cap = ncap;
    }
    uint64_t key = ino + 1;
    size_t j = (size_t)((dev * 0x9E3779B97F4A7C15ULL) ^ key) & (s->cap - 1);
    while (s->slots[2 * j + 1] != 0) {
        if (s->slots[2 * j] == dev && s->slots[2 * j + 1] == key)
            return 0;
        j = (j + 1) & (s->cap - 1);
    }
    s->slots[2 * j] = dev;
    s->slots[2 * j + 1] = key;
    s->used++;
    return 1;
}

/* True when (dev, ino) is in the set. */
static int inode_set_has(const inode_set *s, uint64_t dev, uint64_t ino) {
    if (s->used == 0)
        return 0;
    uint64_t key = ino + 1;
    size_t j = (size_t)((dev * 0x9E3779B97F4A7C15ULL) ^ key) & (s->cap - 1);
    while (s->slots[2 * j + 1] != 0) {
        if (s->slots[2 * j] == dev && s->slots[2 * j + 1] == key)
            return 1;
        j = (j + 1) & (s->cap - 1);
    }
    return 0;
}

static int arena_push(walker *w, const struct stat *st, const char *name, size_t len) {
    size_t need = (sizeof(rec_hdr) + len + 1 + 7) & ~(size_t)7; /* names are NUL-terminated */
    if (w->arena_len + need > w->arena_cap) {
        size_t ncap = w->arena_cap ? w->arena_cap : 64 * 1024;
        while (w->arena_len + need > ncap)
            ncap *= 2;
        char *na = realloc(w->arena, ncap);
        if (!na)
            return -1;
        w->arena = na;
        w->arena_cap = ncap;
    }
    rec_hdr h = {(uint64_t)st->st_dev, (uint64_t)st->st_ino, (uint64_t)st->st_size,
                 (uint64_t)st->st_blocks, (uint32_t)len};
    memcpy(w->arena + w->arena_len, &h, sizeof h);
    memcpy(w->arena + w->arena_len + sizeof h, name, len);
    w->arena[w->arena_len + sizeof h + len] = '\0';
    w->arena_len += need;
    return 0;
}

static size_t rec_size(const walker *w, size_t off) {
    uint32_t len;
    (void)rec_name(w, off, &len);
    return (sizeof(rec_hdr) + len + 1 + 7) & ~(size_t)7;
}

/* Counts one stat result. Returns 1 when it is a directory to descend into. */
static int account(walker *w, const struct stat *st) {
    pl_tree_size *o = w->out;
    /* Like `du -x`: a mount point (and all below it) is not counted at all. */
    if (w->one_fs && (uint64_t)st->st_dev != w->root_dev)
        return 0;
    if (S_ISDIR(st->st_mode)) {
        o->dirs++;
        o->apparent_bytes += (uint64_t)st->st_size;
        o->allocated_bytes += (uint64_t)st->st_blocks * 512;
        return 1;
    }
    if (w->remove && st->st_nlink == 1 &&
        inode_set_has(&w->links, (uint64_t)st->st_dev, (uint64_t)st->st_ino))
        return 0; /* the last link of an inode counted when its first link went */
    if (st->st_nlink > 1) {
        int fresh = inode_set_add(&w->links, (uint64_t)st->st_dev, (uint64_t)st->st_ino);
        if (fresh < 0)
            return -1;
        if (!fresh)
            return 0;
    }
    if (S_ISLNK(st->st_mode))
        o->symlinks++;
    else
        o->files++;
    o->apparent_bytes += (uint64_t)st->st_size;
    o->allocated_bytes += (uint64_t)st->st_blocks * 512;
    return 0;
}

/* Removal keeps going past an entry it cannot remove (like `rm -rf`) and reports
 * the first failure with its path. */
static void note_failure(walker *w, int err, size_t frame_idx, const char *name, size_t len) {
    if (w->first_err != 0)
        return;
    w->first_err = err;
    w->first_err_path = frame_path(w, frame_idx, name, len);
}

/* Removal mode, one listed entry: unlinks a non-directory and counts it once
 * removed; returns 1 for a directory to descend into (removed after its
 * contents), 0 otherwise, -1 out of memory. */
static int remove_entry(walker *w, int dirfd, size_t top, const char *name, const struct stat *st) {
    if (S_ISDIR(st->st_mode)) {
        if (w->one_fs && (uint64_t)st->st_dev != w->root_dev) {
            note_failure(w, EXDEV, top, name, strlen(name)); /* a mount point: left alone */
            return 0;
        }
        return 1;
    }
    if (unlinkat(dirfd, name, 0) != 0) {
        if (errno != ENOENT)
            note_failure(w, errno, top, name, strlen(name));
        return 0;
    }
    if (account(w, st) < 0)
        return fail_nomem(w);
    return 0;
}

/* Reads every entry of the top frame, counting them and queueing subdirectories. */
static int scan_top(walker *w) {
    size_t top = w->depth - 1;
    int fd = w->frames[top].fd;
    w->frames[top].pend_start = w->frames[top].pend_next = w->arena_len;
    for (;;) {
        ssize_t n = getdents64(fd, w->buf, DENTS_BUF_SIZE);
        if (n < 0)
            return fail(w, errno, top, NULL, 0);
        if (n == 0)
            break;
        for (ssize_t pos = 0; pos < n;) {
            struct dirent64 *d = (struct dirent64 *)(w->buf + pos);
            pos += d->d_reclen;
            const char *name = d->d_name;
            if (name[0] == '.' && (name[1] == '\0' || (name[1] == '.' && name[2] == '\0')))
                continue;
            struct stat st;
            if (fstatat(fd, name, &st, AT_SYMLINK_NOFOLLOW) != 0) {
                if (errno == ENOENT)
                    continue; /* vanished mid-walk */
                return fail(w, errno, top, name, strlen(name));
            }
            if (w->remove) {
                int rc = remove_entry(w, fd, top, name, &st);
                if (rc < 0)
                    return -1;
                if (rc == 0)
                    continue;
            } else {
                int descend = account(w, &st);
                if (descend < 0)
                    return fail_nomem(w);
                if (!descend)
                    continue;
            }
            if (arena_push(w, &st, name, strlen(name)) != 0)
                return fail_nomem(w);
        }
    }
    w->frames[top].pend_end = w->arena_len;
    return 0;
}

static void close_frame(walker *w, size_t i) {
    if (w->frames[i].fd >= 0) {
        close(w->frames[i].fd);
        w->frames[i].fd = -1;
        w->open_count--;
    }
}

/* Keeps the number of open directory descriptors bounded (root always stays open). */
static void enforce_open_cap(walker *w) {
    size_t keep_from = w->depth >= 2 ? w->depth - 2 : 0;
    if (w->lowest_open < 1)
        w->lowest_open = 1;
    while (w->open_count > MAX_OPEN_DIRS && w->lowest_open < keep_from) {
        close_frame(w, w->lowest_open);
        w->lowest_open++;
    }
}

static int open_child(int parent_fd, const char *name, uint64_t dev, uint64_t ino, int *out_fd) {
    int fd = openat(parent_fd, name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    if (fd < 0)
        return errno;
    struct stat st;
    if (fstat(fd, &st) != 0) {
        int e = errno;
        close(fd);
        return e;
    }
    if ((uint64_t)st.st_dev != dev || (uint64_t)st.st_ino != ino) {
        close(fd); /* replaced mid-walk: treat as vanished */
        return ENOENT;
    }
    *out_fd = fd;
    return 0;
}

/* Reopens frame i from its nearest open ancestor. 0 ok, ENOENT vanished, else errno. */
static int ensure_open(walker *w, size_t i) {
    if (w->frames[i].fd >= 0)
        return 0;
    size_t j = i;
    while (w->frames[j].fd < 0)
        j--;
    for (size_t k = j + 1; k <= i; k++) {
        uint32_t len;
        const char *n = rec_name(w, w->frames[k].name_off, &len);
        int fd;
        int e = open_child(w->frames[k - 1].fd, n, w->frames[k].dev, w->frames[k].ino, &fd);
        if (e != 0) {
            if (e != ENOENT)
                (void)fail(w, e, k, NULL, 0);
            return e;
        }
        w->frames[k].fd = fd;
        w->open_count++;
        if (k - 1 > j && i - (k - 1) > REOPEN_KEEP)
            close_frame(w, k - 1);
    }
    size_t first_open = j + 1;
    while (w->frames[first_open].fd < 0)
        first_open++;
    if (first_open < w->lowest_open)
        w->lowest_open = first_open;
    return 0;
}

static int push_frame(walker *w, int fd, uint64_t dev, uint64_t ino, size_t name_off) {
    if (w->depth == w->frames_cap) {
        size_t ncap = w->frames_cap ? w->frames_cap * 2 : 256;
        frame *nf = realloc(w->frames, ncap * sizeof *nf);
        if (!nf)
            return -1;
        w->frames = nf;
        w->frames_cap = ncap;
    }
    frame *f = &w->frames[w->depth++];
    f->fd = fd;
    f->dev = dev;
    f->ino = ino;
    f->name_off = name_off;
    f->pend_start = f->pend_end = f->pend_next = 0;
    w->open_count++;
    return 0;
}

/* Removal mode: frame `idx` (just popped) is empty now; removes it from its parent
 * and counts it. 0 (a failure is noted, not fatal), -1 on a fatal error. */
static int remove_dir(walker *w, size_t idx) {
    size_t parent = idx - 1;
    int e = ensure_open(w, parent);
    if (e == ENOENT)
        return 0;
    if (e != 0)
        return -1;
    rec_hdr h;
    memcpy(&h, w->arena + w->frames[idx].name_off, sizeof h);
    const char *name = w->arena + w->frames[idx].name_off + sizeof h;
    if (unlinkat(w->frames[parent].fd, name, AT_REMOVEDIR) != 0) {
        if (errno != ENOENT)
            note_failure(w, errno, parent, name, h.len);
        return 0;
    }
    w->out->dirs++;
    w->out->apparent_bytes += h.size;
    w->out->allocated_bytes += h.blocks * 512;
    return 0;
}

static int walk_tree(walker *w, int root_fd, const struct stat *root_st) {
    if (push_frame(w, root_fd, (uint64_t)root_st->st_dev, (uint64_t)root_st->st_ino, 0) != 0) {
        close(root_fd);
        return fail_nomem(w);
    }
    if (scan_top(w) != 0)
        return -1;
    while (w->depth > 0) {
        size_t top = w->depth - 1;
        frame *f = &w->frames[top];
        if (f->pend_next >= f->pend_end) {
            close_frame(w, top);
            w->arena_len = f->pend_start;
            w->depth--;
            if (w->lowest_open > w->depth)
                w->lowest_open = w->depth;
            if (w->remove && top > 0 && remove_dir(w, top) != 0)
                return -1;
            continue;
        }
        size_t off = f->pend_next;
        f->pend_next += rec_size(w, off);
        int e = ensure_open(w, top);
        if (e == ENOENT) {
            f->pend_next = f->pend_end; /* this directory vanished: nothing left to read */
            continue;
        }
        if (e != 0)
            return -1;
        rec_hdr h;
        memcpy(&h, w->arena + off, sizeof h);
        const char *name = w->arena + off + sizeof h;
        int fd;
        e = open_child(w->frames[top].fd, name, h.dev, h.ino, &fd);
        if (e == ENOENT)
            continue;
        if (e != 0)
            return fail(w, e, top, name, h.len);
        if (push_frame(w, fd, h.dev, h.ino, off) != 0) {
            close(fd);
            return fail_nomem(w);
        }
        enforce_open_cap(w);
        if (scan_top(w) != 0)
            return -1;
    }
    return 0;
}

int pl_tree_bytes(const char *root, int one_file_system, pl_tree_size *out, pl_error *error) {
    memset(out, 0, sizeof *out);
    error->err = 0;
    error->path = NULL;
    walker w;
    memset(&w, 0, sizeof w);
    w.root = root;
    w.one_fs = one_file_system;
    w.out = out;
    w.error = error;

    struct stat st;
    if (lstat(root, &st) != 0) {
        error->err = errno;
        error->path = strdup(root);
        return -1;
    }
    w.root_dev = (uint64_t)st.st_dev;
    if (!S_ISDIR(st.st_mode)) {
        int r = account(&w, &st);
        free(w.links.slots);
        return r < 0 ? fail_nomem(&w) : 0;
    }
    int fd = open(root, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    if (fd < 0) {
        error->err = errno;
        error->path = strdup(root);
        return -1;
    }
    out->dirs++;
    out->apparent_bytes += (uint64_t)st.st_size;
    out->allocated_bytes += (uint64_t)st.st_blocks * 512;
    w.buf = malloc(DENTS_BUF_SIZE);
    int rc;
    if (!w.buf) {
        close(fd);
        rc = fail_nomem(&w);
    } else {
        rc = walk_tree(&w, fd, &st);
    }
    for (size_t i = 0; i < w.depth; i++)
        if (w.frames[i].fd >= 0)
            close(w.frames[i].fd);
    free(w.buf);
    free(w.arena);
    free(w.frames);
    free(w.links.slots);
    return rc;
}

int pl_remove_tree(const char *root, pl_tree_size *removed, pl_error *error) {
    memset(removed, 0, sizeof *removed);
    error->err = 0;
    error->path = NULL;
    walker w;
    memset(&w, 0, sizeof w);
    w.root = root;
    w.one_fs = 1;
    w.remove = 1;
    w.out = removed;
    w.error = error;

    struct stat st;
    if (lstat(root, &st) != 0) {
        if (errno == ENOENT)
            return 0; /* nothing to remove */
        error->err = errno;
        error->path = strdup(root);
        return -1;
    }
    w.root_dev = (uint64_t)st.st_dev;
    if (!S_ISDIR(st.st_mode)) {
        if (unlink(root) != 0) {
            if (errno == ENOENT)
                return 0;
            error->err = errno;
            error->path = strdup(root);
            return -1;
        }
        int r = account(&w, &st);
        free(w.links.slots);
        return r < 0 ? fail_nomem(&w) : 0;
    }
    int fd = open(root, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    if (fd < 0) {
        error->err = errno;
        error->path = strdup(root);
        return -1;
    }
    w.buf = malloc(DENTS_BUF_SIZE);
    int rc;
    if (!w.buf) {
        close(fd);
        rc = fail_nomem(&w);
    } else {
        rc = walk_tree(&w, fd, &st);
    }
    for (size_t i = 0; i < w.depth; i++)
        if (w.frames[i].fd >= 0)
            close(w.frames[i].fd);
    if (rc == 0) {
        if (rmdir(root) == 0) {
            removed->dirs++;
            removed->apparent_bytes += (uint64_t)st.st_size;
            removed->allocated_bytes += (uint64_t)st.st_blocks * 512;
        } else if (errno != ENOENT && w.first_err == 0) {
            w.first_err = errno;
            w.first_err_path = strdup(root);
        }
        if (w.first_err != 0) {
            error->err = w.first_err;
            error->path = w.first_err_path;
            w.first_err_path = NULL;
            rc = -1;
        }
    }
    free(w.first_err_path);
    free(w.buf);
    free(w.arena);
    free(w.frames);
    free(w.links.slots);
    return rc;
}
