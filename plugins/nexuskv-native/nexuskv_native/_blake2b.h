/* BLAKE2b (RFC 7693), unkeyed, with a 16-byte personalisation: just what NexusKV's chained block keys need.
 *
 * Written from RFC 7693 section 3; checked bit for bit against CPython's hashlib.blake2b by the plugin's tests.
 * Header-only so the compiler can inline the compression into the chain loop.
 */
#ifndef NEXUSKV_BLAKE2B_H
#define NEXUSKV_BLAKE2B_H

#include <stdint.h>
#include <string.h>

static const uint64_t b2_iv[8] = {
    0x6a09e667f3bcc908ULL, 0xbb67ae8584caa73bULL, 0x3c6ef372fe94f82bULL, 0xa54ff53a5f1d36f1ULL,
    0x510e527fade682d1ULL, 0x9b05688c2b3e6c1fULL, 0x1f83d9abfb41bd6bULL, 0x5be0cd19137e2179ULL,
};

static const uint8_t b2_sigma[12][16] = {
    {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15}, {14, 10, 4, 8, 9, 15, 13, 6, 1, 12, 0, 2, 11, 7, 5, 3},
    {11, 8, 12, 0, 5, 2, 15, 13, 10, 14, 3, 6, 7, 1, 9, 4}, {7, 9, 3, 1, 13, 12, 11, 14, 2, 6, 5, 10, 4, 0, 15, 8},
    {9, 0, 5, 7, 2, 4, 10, 15, 14, 1, 11, 12, 6, 8, 3, 13}, {2, 12, 6, 10, 0, 11, 8, 3, 4, 13, 7, 5, 15, 14, 1, 9},
    {12, 5, 1, 15, 14, 13, 4, 10, 0, 7, 6, 3, 9, 2, 8, 11}, {13, 11, 7, 14, 12, 1, 3, 9, 5, 0, 15, 4, 8, 6, 2, 10},
    {6, 15, 14, 9, 11, 3, 0, 8, 12, 2, 13, 7, 1, 4, 10, 5}, {10, 2, 8, 4, 7, 6, 1, 5, 15, 11, 9, 14, 3, 12, 13, 0},
    {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15}, {14, 10, 4, 8, 9, 15, 13, 6, 1, 12, 0, 2, 11, 7, 5, 3},
};

static inline uint64_t b2_load64(const uint8_t *p) {
    uint64_t v;
    memcpy(&v, p, 8); /* little-endian hosts only (checked at import) */
    return v;
}

static inline uint64_t b2_rotr(uint64_t x, int n) { return (x >> n) | (x << (64 - n)); }

#define B2_G(a, b, c, d, x, y)                                                                                 \
    do {                                                                                                       \
        a = a + (x) + b;                                                                                       \
        d = b2_rotr(d ^ a, 32);                                                                                \
        c = c + d;                                                                                             \
        b = b2_rotr(b ^ c, 24);                                                                                \
        a = a + (y) + b;                                                                                       \
        d = b2_rotr(d ^ a, 16);                                                                                \
        c = c + d;                                                                                             \
        b = b2_rotr(b ^ c, 63);                                                                                \
    } while (0)

/* One compression of a 128-byte block; `t` counts message bytes so far (this block included). */
static inline void b2_compress(uint64_t h[8], const uint8_t block[128], uint64_t t, int last) {
    uint64_t m[16];
    for (int i = 0; i < 16; i++) m[i] = b2_load64(block + 8 * i);
    uint64_t v0 = h[0], v1 = h[1], v2 = h[2], v3 = h[3], v4 = h[4], v5 = h[5], v6 = h[6], v7 = h[7];
    uint64_t v8 = b2_iv[0], v9 = b2_iv[1], v10 = b2_iv[2], v11 = b2_iv[3];
    uint64_t v12 = b2_iv[4] ^ t, v13 = b2_iv[5], v14 = last ? ~b2_iv[6] : b2_iv[6], v15 = b2_iv[7];
#define B2_ROUND(r)                                                                                            \
    do {                                                                                                       \
        B2_G(v0, v4, v8, v12, m[b2_sigma[r][0]], m[b2_sigma[r][1]]);                                           \
        B2_G(v1, v5, v9, v13, m[b2_sigma[r][2]], m[b2_sigma[r][3]]);                                           \
        B2_G(v2, v6, v10, v14, m[b2_sigma[r][4]], m[b2_sigma[r][5]]);                                          \
        B2_G(v3, v7, v11, v15, m[b2_sigma[r][6]], m[b2_sigma[r][7]]);                                          \
        B2_G(v0, v5, v10, v15, m[b2_sigma[r][8]], m[b2_sigma[r][9]]);                                          \
        B2_G(v1, v6, v11, v12, m[b2_sigma[r][10]], m[b2_sigma[r][11]]);                                        \
        B2_G(v2, v7, v8, v13, m[b2_sigma[r][12]], m[b2_sigma[r][13]]);                                         \
        B2_G(v3, v4, v9, v14, m[b2_sigma[r][14]], m[b2_sigma[r][15]]);                                         \
    } while (0)
    /* unrolled: the message schedule becomes constant indexes, so the 16 words stay in registers */
    B2_ROUND(0); B2_ROUND(1); B2_ROUND(2); B2_ROUND(3); B2_ROUND(4); B2_ROUND(5);
    B2_ROUND(6); B2_ROUND(7); B2_ROUND(8); B2_ROUND(9); B2_ROUND(10); B2_ROUND(11);
#undef B2_ROUND
    h[0] ^= v0 ^ v8; h[1] ^= v1 ^ v9; h[2] ^= v2 ^ v10; h[3] ^= v3 ^ v11;
    h[4] ^= v4 ^ v12; h[5] ^= v5 ^ v13; h[6] ^= v6 ^ v14; h[7] ^= v7 ^ v15;
}

/* The initial state for an unkeyed hash with `outlen`-byte digests and a 16-byte personalisation. */
static inline void b2_init_state(uint64_t h[8], int outlen, const uint8_t person[16]) {
    for (int i = 0; i < 8; i++) h[i] = b2_iv[i];
    h[0] ^= 0x01010000ULL ^ (uint64_t)outlen; /* depth 1, fanout 1, no key */
    h[6] ^= b2_load64(person);
    h[7] ^= b2_load64(person + 8);
}

/* BLAKE2b of `len` bytes from the initial state `h0`; writes the first 16 bytes of the digest to `out`. */
static inline void b2_hash16(const uint64_t h0[8], const uint8_t *msg, size_t len, uint8_t out[16]) {
    uint64_t h[8];
    uint8_t last[128];
    memcpy(h, h0, sizeof h);
    uint64_t t = 0;
    while (len > 128) {
        t += 128;
        b2_compress(h, msg, t, 0);
        msg += 128;
        len -= 128;
    }
    memset(last, 0, sizeof last);
    memcpy(last, msg, len);
    t += len;
    b2_compress(h, last, t, 1);
    memcpy(out, h, 16); /* little-endian: the first two state words are the 16-byte digest */
}

#endif
