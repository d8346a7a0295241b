# C declarations of the native core, declared once for every .pyx that uses them.
from libc.stdint cimport uint64_t


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
