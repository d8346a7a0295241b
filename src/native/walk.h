/* Iterative directory walker shared by the byte walker (and later walkers).
 *
 * The walk never recurses on the C stack and never follows symlinks. Open
 * directory descriptors are capped, so a 10,000-deep chain does not exhaust
 * RLIMIT_NOFILE: a frame whose descriptor was closed is reopened from its
 * nearest open ancestor by name, checking device and inode at each step.
 */
#ifndef PRELOOP_WALK_H
#define PRELOOP_WALK_H

#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

/* Error report: errno plus the exact path (malloc'd, caller frees). */
typedef struct {
    int err;
    char *path;
} pl_error;

typedef struct {
    uint64_t apparent_bytes;
    uint64_t allocated_bytes;
    uint64_t files;
    uint64_t dirs;
    uint64_t symlinks;
} pl_tree_size;

/* Sum a tree like `du -s`: returns 0, or -1 with *error filled. Safe to call
 * without the GIL: touches no Python object. */
int pl_tree_bytes(const char *root, int one_file_system, pl_tree_size *out, pl_error *error);

/* Removes the tree at `root` (a directory or a single entry) with a GIL-free
 * unlinkat walk, bottom-up, never following symlinks or leaving the filesystem.
 * *removed counts what was really removed, like pl_tree_bytes (a hard-linked
 * inode once). An entry that cannot be removed is skipped and the walk goes on;
 * returns 0, or -1 with *error naming the first failure. A missing root is 0. */
int pl_remove_tree(const char *root, pl_tree_size *removed, pl_error *error);

/* Join a path prefix and a byte name into a fresh malloc'd string (NULL on ENOMEM). */
char *pl_path_join(const char *prefix, const char *name, size_t name_len);

#endif
