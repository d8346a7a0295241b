# cython: language_level=3, boundscheck=False, wraparound=False
"""preloop's native core: the C walkers, reached from Python.

Every entry point releases the GIL for the whole of its syscalls and hashing.
"""
import os

from libc.stdlib cimport free

from native cimport pl_error, pl_tree_size, pl_tree_bytes


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
