/* Built by tests/test_sha256.py for another architecture and run under qemu-user:
 * checks that architecture's hardware path against the portable one. */
#include "sha256.h"
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
/* Compares the hardware and portable paths on lengths 0..300 and a large stream. */
int main(void) {
    printf("hw available: %d default: %s\n", pl_sha256_hardware_available(), pl_sha256_default_name());
    unsigned char *data = malloc(1 << 20);
    for (int i = 0; i < (1 << 20); i++) data[i] = (unsigned char)(i * 2654435761u >> 13);
    int bad = 0;
    for (size_t len = 0; len <= 300; len++) {
        uint8_t a[32], b[32];
        pl_sha256 x, y;
        pl_sha256_init_impl(&x, PL_SHA256_PORTABLE);
        if (pl_sha256_init_impl(&y, PL_SHA256_HARDWARE)) { puts("no hw"); return 2; }
        pl_sha256_update(&x, data, len); pl_sha256_update(&y, data, len);
        pl_sha256_final(&x, a); pl_sha256_final(&y, b);
        bad += memcmp(a, b, 32) != 0;
    }
    uint8_t a[32], b[32];
    pl_sha256 x, y;
    pl_sha256_init_impl(&x, PL_SHA256_PORTABLE); pl_sha256_init_impl(&y, PL_SHA256_HARDWARE);
    pl_sha256_update(&x, data, 1 << 20); pl_sha256_update(&y, data, 1 << 20);
    pl_sha256_final(&x, a); pl_sha256_final(&y, b);
    bad += memcmp(a, b, 32) != 0;
    pl_sha256_init_impl(&y, PL_SHA256_HARDWARE); pl_sha256_update(&y, "abc", 3); pl_sha256_final(&y, b);
    for (int i = 0; i < 32; i++) printf("%02x", b[i]);
    printf("\nmismatches: %d\n", bad);
    return bad != 0;
}
