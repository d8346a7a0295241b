/* SHA-256 block functions and the streaming context. See sha256.h. */
#include "sha256.h"

#include <string.h>

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#include <immintrin.h>
#define PL_SHA_X86 1
#elif defined(__aarch64__)
#include <arm_neon.h>
#include <sys/auxv.h>
#ifndef HWCAP_SHA2
#define HWCAP_SHA2 (1 << 6)
#endif
#define PL_SHA_ARM 1
#endif

static const uint32_t K[64] = {
    0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4, 0xab1c5ed5,
    0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe, 0x9bdc06a7, 0xc19bf174,
    0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f, 0x4a7484aa, 0x5cb0a9dc, 0x76f988da,
    0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7, 0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967,
    0x27b70a85, 0x2e1b2138, 0x4d2c6dfc, 0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85,
    0xa2bfe8a1, 0xa81a664b, 0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070,
    0x19a4c116, 0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
    0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7, 0xc67178f2,
};

static const uint32_t H0[8] = {
    0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a, 0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19,
};

#define ROR(x, n) (((x) >> (n)) | ((x) << (32 - (n))))

static void blocks_portable(uint32_t state[8], const uint8_t *p, size_t blocks) {
    uint32_t w[64];
    while (blocks--) {
        for (int i = 0; i < 16; i++)
            w[i] = (uint32_t)p[4 * i] << 24 | (uint32_t)p[4 * i + 1] << 16 | (uint32_t)p[4 * i + 2] << 8 |
                   (uint32_t)p[4 * i + 3];
        for (int i = 16; i < 64; i++) {
            uint32_t s0 = ROR(w[i - 15], 7) ^ ROR(w[i - 15], 18) ^ (w[i - 15] >> 3);
            uint32_t s1 = ROR(w[i - 2], 17) ^ ROR(w[i - 2], 19) ^ (w[i - 2] >> 10);
            w[i] = w[i - 16] + s0 + w[i - 7] + s1;
        }
        uint32_t a = state[0], b = state[1], c = state[2], d = state[3];
        uint32_t e = state[4], f = state[5], g = state[6], h = state[7];
        for (int i = 0; i < 64; i++) {
            uint32_t t1 = h + (ROR(e, 6) ^ ROR(e, 11) ^ ROR(e, 25)) + ((e & f) ^ (~e & g)) + K[i] + w[i];
            uint32_t t2 = (ROR(a, 2) ^ ROR(a, 13) ^ ROR(a, 22)) + ((a & b) ^ (a & c) ^ (b & c));
            h = g;
            g = f;
            f = e;
            e = d + t1;
            d = c;
            c = b;
            b = a;
            a = t1 + t2;
        }
        state[0] += a;
        state[1] += b;
        state[2] += c;
        state[3] += d;
        state[4] += e;
        state[5] += f;
        state[6] += g;
        state[7] += h;
        p += 64;
    }
}

#ifdef PL_SHA_X86
/* SHA-NI keeps the state as (ABEF, CDGH) and does two rounds per instruction;
 * the message schedule for group i is msg2(msg1(W[i-4], W[i-3]) + W[i-1:i-2]>>32, W[i-1]). */
__attribute__((target("sha,sse4.1,ssse3"))) static void blocks_shani(uint32_t state[8], const uint8_t *p,
                                                                       size_t blocks) {
    const __m128i bswap = _mm_set_epi64x(0x0c0d0e0f08090a0bULL, 0x0405060700010203ULL);
    __m128i tmp = _mm_loadu_si128((const __m128i *)&state[0]);
    __m128i st1 = _mm_loadu_si128((const __m128i *)&state[4]);
    tmp = _mm_shuffle_epi32(tmp, 0xB1);
    st1 = _mm_shuffle_epi32(st1, 0x1B);
    __m128i st0 = _mm_alignr_epi8(tmp, st1, 8);
    st1 = _mm_blend_epi16(st1, tmp, 0xF0);
    while (blocks--) {
        __m128i save0 = st0, save1 = st1;
        __m128i w[4];
        for (int i = 0; i < 4; i++)
            w[i] = _mm_shuffle_epi8(_mm_loadu_si128((const __m128i *)(p + 16 * i)), bswap);
#pragma GCC unroll 16
        for (int i = 0; i < 16; i++) {
            if (i >= 4)
                w[i & 3] = _mm_sha256msg2_epu32(
                    _mm_add_epi32(_mm_sha256msg1_epu32(w[i & 3], w[(i + 1) & 3]),
                                  _mm_alignr_epi8(w[(i + 3) & 3], w[(i + 2) & 3], 4)),
                    w[(i + 3) & 3]);
            __m128i msg = _mm_add_epi32(w[i & 3], _mm_loadu_si128((const __m128i *)&K[4 * i]));
            st1 = _mm_sha256rnds2_epu32(st1, st0, msg);
            st0 = _mm_sha256rnds2_epu32(st0, st1, _mm_shuffle_epi32(msg, 0x0E));
        }
        st0 = _mm_add_epi32(st0, save0);
        st1 = _mm_add_epi32(st1, save1);
        p += 64;
    }
    tmp = _mm_shuffle_epi32(st0, 0x1B);
    st1 = _mm_shuffle_epi32(st1, 0xB1);
    st0 = _mm_blend_epi16(tmp, st1, 0xF0);
    st1 = _mm_alignr_epi8(st1, tmp, 8);
    _mm_storeu_si128((__m128i *)&state[0], st0);
    _mm_storeu_si128((__m128i *)&state[4], st1);
}

static int hw_detect(void) {
    unsigned a, b, c, d;
    if (__get_cpuid_max(0, NULL) < 7)
        return 0;
    __cpuid_count(7, 0, a, b, c, d);
    int sha = (b >> 29) & 1;
    __cpuid(1, a, b, c, d);
    int sse41 = (c >> 19) & 1, ssse3 = (c >> 9) & 1;
    return sha && sse41 && ssse3;
}
#define HW_BLOCKS blocks_shani
#define HW_NAME "sha-ni"
#elif defined(PL_SHA_ARM)
__attribute__((target("+crypto"))) static void blocks_armce(uint32_t state[8], const uint8_t *p,
                                                             size_t blocks) {
    uint32x4_t st0 = vld1q_u32(&state[0]), st1 = vld1q_u32(&state[4]);
    while (blocks--) {
        uint32x4_t save0 = st0, save1 = st1;
        uint32x4_t w[4];
        for (int i = 0; i < 4; i++)
            w[i] = vreinterpretq_u32_u8(vrev32q_u8(vld1q_u8(p + 16 * i)));
        for (int i = 0; i < 16; i++) {
            if (i >= 4)
                w[i & 3] = vsha256su1q_u32(vsha256su0q_u32(w[i & 3], w[(i + 1) & 3]), w[(i + 2) & 3],
                                           w[(i + 3) & 3]);
            uint32x4_t msg = vaddq_u32(w[i & 3], vld1q_u32(&K[4 * i]));
            uint32x4_t prev0 = st0;
            st0 = vsha256hq_u32(st0, st1, msg);
            st1 = vsha256h2q_u32(st1, prev0, msg);
        }
        st0 = vaddq_u32(st0, save0);
        st1 = vaddq_u32(st1, save1);
        p += 64;
    }
    vst1q_u32(&state[0], st0);
    vst1q_u32(&state[4], st1);
}

static int hw_detect(void) { return (getauxval(AT_HWCAP) & HWCAP_SHA2) != 0; }
#define HW_BLOCKS blocks_armce
#define HW_NAME "armv8-ce"
#endif

#ifdef HW_BLOCKS
static int hw_state = -1; /* -1 unknown; idempotent, so a racy first check is harmless */
int pl_sha256_hardware_available(void) {
    if (hw_state < 0)
        hw_state = hw_detect();
    return hw_state;
}
#else
int pl_sha256_hardware_available(void) { return 0; }
#endif

static pl_sha256_blocks_fn blocks_for(int impl) {
    switch (impl) {
    case PL_SHA256_PORTABLE:
        return blocks_portable;
    case PL_SHA256_HARDWARE:
#ifdef HW_BLOCKS
        return pl_sha256_hardware_available() ? HW_BLOCKS : NULL;
#else
        return NULL;
#endif
    case PL_SHA256_AUTO: {
        pl_sha256_blocks_fn hw = blocks_for(PL_SHA256_HARDWARE);
        return hw ? hw : blocks_portable;
    }
    default:
        return NULL;
    }
}

static int default_impl = PL_SHA256_AUTO;

int pl_sha256_set_default(int impl) {
    if (!blocks_for(impl))
        return -1;
    default_impl = impl;
    return 0;
}

const char *pl_sha256_default_name(void) {
#ifdef HW_BLOCKS
    if (blocks_for(default_impl) == HW_BLOCKS)
        return HW_NAME;
#endif
    return "portable";
}

int pl_sha256_init_impl(pl_sha256 *ctx, int impl) {
    pl_sha256_blocks_fn fn = blocks_for(impl);
    if (!fn)
        return -1;
    memcpy(ctx->state, H0, sizeof H0);
    ctx->total = 0;
    ctx->buffered = 0;
    ctx->blocks = fn;
    return 0;
}

void pl_sha256_init(pl_sha256 *ctx) { (void)pl_sha256_init_impl(ctx, default_impl); }

void pl_sha256_update(pl_sha256 *ctx, const void *data, size_t len) {
    const uint8_t *p = data;
    ctx->total += len;
    if (ctx->buffered) {
        size_t take = 64 - ctx->buffered;
        if (take > len)
            take = len;
        memcpy(ctx->buf + ctx->buffered, p, take);
        ctx->buffered += take;
        p += take;
        len -= take;
        if (ctx->buffered < 64)
            return;
        ctx->blocks(ctx->state, ctx->buf, 1);
        ctx->buffered = 0;
    }
    if (len >= 64) {
        ctx->blocks(ctx->state, p, len / 64);
        p += len & ~(size_t)63;
        len &= 63;
    }
    if (len) {
        memcpy(ctx->buf, p, len);
        ctx->buffered = len;
    }
}

void pl_sha256_final(pl_sha256 *ctx, uint8_t out[PL_SHA256_DIGEST]) {
    uint64_t bits = ctx->total * 8;
    uint8_t pad[72];
    size_t padlen = (ctx->buffered < 56 ? 56 : 120) - ctx->buffered;
    memset(pad, 0, sizeof pad);
    pad[0] = 0x80;
    for (int i = 0; i < 8; i++)
        pad[padlen + (size_t)i] = (uint8_t)(bits >> (56 - 8 * i));
    pl_sha256_update(ctx, pad, padlen + 8);
    for (int i = 0; i < 8; i++) {
        out[4 * i] = (uint8_t)(ctx->state[i] >> 24);
        out[4 * i + 1] = (uint8_t)(ctx->state[i] >> 16);
        out[4 * i + 2] = (uint8_t)(ctx->state[i] >> 8);
        out[4 * i + 3] = (uint8_t)ctx->state[i];
    }
}
