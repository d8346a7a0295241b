/* The C read floor for the tiny-file benchmark: walk a tree with nftw (no
 * symlinks followed), open, read and close every regular file, print the count.
 * What any hasher must at least do; built by bench/test_fingerprint.py. */
#define _GNU_SOURCE
#include <fcntl.h>
#include <ftw.h>
#include <stdio.h>
#include <unistd.h>

static char buf[256 * 1024];
static long files;

static int visit(const char *path, const struct stat *st, int type, struct FTW *ftw) {
    (void)st;
    (void)ftw;
    if (type != FTW_F)
        return 0;
    int fd = open(path, O_RDONLY | O_NOFOLLOW | O_CLOEXEC);
    if (fd < 0) {
        perror(path);
        return 1;
    }
    ssize_t got;
    while ((got = read(fd, buf, sizeof buf)) > 0)
        ;
    close(fd);
    if (got < 0) {
        perror(path);
        return 1;
    }
    files++;
    return 0;
}

int main(int argc, char **argv) {
    if (argc != 2 || nftw(argv[1], visit, 64, FTW_PHYS) != 0)
        return 1;
    printf("%ld\n", files);
    return 0;
}
