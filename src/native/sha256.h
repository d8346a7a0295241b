/* SHA-256 (FIPS 180-4), implemented in the project.
 *
 * Three block functions share one streaming context: x86-64 SHA-NI, ARMv8
 * crypto extensions, and a portable C path. The fastest one the CPU supports
 * (checked at run time) is the default; a context can be pinned to a specific
 * path so tests verify every path on the same machine.
 */
#ifndef PRELOOP_SHA256_H
#define PRELOOP_SHA256_H

#include <stddef.h>
#include <stdint.h>

#define PL_SHA256_DIGEST 32

enum {
    PL_SHA256_AUTO = 0,
    PL_SHA256_PORTABLE = 1,
    PL_SHA256_HARDWARE = 2, /* SHA-NI on x86-64, crypto extensions on ARMv8 */
};

typedef void (*pl_sha256_blocks_fn)(uint32_t state[8], const uint8_t *data, size_t blocks);

typedef struct {
    uint32_t state[8];
    uint64_t total;
    size_t buffered;
    uint8_t buf[64];
    pl_sha256_blocks_fn blocks;
} pl_sha256;

/* 1 when this CPU has the hardware SHA-256 instructions this build can use. */
int pl_sha256_hardware_available(void);

/* Starts a context on `impl`: 0 ok, -1 when that path is unavailable here. */
int pl_sha256_init_impl(pl_sha256 *ctx, int impl);
/* Starts a context on the process default (the hardware path when present). */
void pl_sha256_init(pl_sha256 *ctx);
void pl_sha256_update(pl_sha256 *ctx, const void *data, size_t len);
void pl_sha256_final(pl_sha256 *ctx, uint8_t out[PL_SHA256_DIGEST]);

/* Pins the process default (for tests and benchmarks): 0 ok, -1 unavailable. */
int pl_sha256_set_default(int impl);
/* Name of the default path: "sha-ni", "armv8-ce" or "portable". */
const char *pl_sha256_default_name(void);

#endif
