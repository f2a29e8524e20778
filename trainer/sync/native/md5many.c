/*
 * The MD5 of many buffers at once, one buffer per SIMD lane: 16 with AVX-512, 8 with AVX2.
 *
 * Stage-in checks every small object that has no store checksum against its ETag, the MD5 of its
 * content. MD5 is one long chain of dependent 32-bit operations, so a core computes one MD5 at
 * about 600 MB/s (hashlib, OpenSSL's assembly) whatever its vector units: on scenario (a) of
 * bench/bench_transfer.py (2,000 objects, 223 MB) that is 0.4 CPU-s, the whole difference
 * between stage-in with and without the check (bench/notes/transfer-profile.md). Many objects
 * are many independent chains: run side by side in the lanes of a vector register, they cost
 * little more than one (bench/notes/md5many.md has the figures).
 *
 * Why code of our own: the maintained implementation of multi-buffer MD5, Intel's isa-l_crypto,
 * is in neither Debian nor PyPI (the sync image's only sources), and its assembly needs nasm and
 * a build of its own; OpenSSL and AWS-LC have none. This file is plain C with GCC's vector
 * extensions (no assembly): RFC 1321's steps, each applied to a whole vector of lanes. It has
 * no Python API: trainer/sync/md5many.py calls it through ctypes (which lets go of the GIL),
 * checks it against hashlib when it loads it, and uses hashlib where it is absent.
 *
 *   gcc -O2 -fPIC -shared -fvisibility=hidden -o _md5many.so md5many.c    (Dockerfile.sync, Makefile)
 */
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define EXPORT __attribute__((visibility("default")))

#define ROTL(x, s) (((x) << (s)) | ((x) >> (32 - (s))))
#define F(b, c, d) ((d) ^ ((b) & ((c) ^ (d))))
#define G(b, c, d) ((c) ^ ((d) & ((b) ^ (c))))
#define H(b, c, d) ((b) ^ (c) ^ (d))
#define I(b, c, d) ((c) ^ ((b) | ~(d)))
#define STEP(f, a, b, c, d, x, k, s) (a) = (b) + ROTL((a) + f(b, c, d) + (x) + (k), s)

/* One 64-byte block of every lane. T is uint32_t (one lane) or a vector of lanes; w[j] holds
 * word j of each lane's block. */
#define COMPRESS_BODY(T, st, w)                                                                    \
    do {                                                                                           \
        T a = (st)[0], b = (st)[1], c = (st)[2], d = (st)[3];                                      \
        STEP(F, a, b, c, d, w[0], 0xd76aa478u, 7); STEP(F, d, a, b, c, w[1], 0xe8c7b756u, 12); \
        STEP(F, c, d, a, b, w[2], 0x242070dbu, 17); STEP(F, b, c, d, a, w[3], 0xc1bdceeeu, 22); \
        STEP(F, a, b, c, d, w[4], 0xf57c0fafu, 7); STEP(F, d, a, b, c, w[5], 0x4787c62au, 12); \
        STEP(F, c, d, a, b, w[6], 0xa8304613u, 17); STEP(F, b, c, d, a, w[7], 0xfd469501u, 22); \
        STEP(F, a, b, c, d, w[8], 0x698098d8u, 7); STEP(F, d, a, b, c, w[9], 0x8b44f7afu, 12); \
        STEP(F, c, d, a, b, w[10], 0xffff5bb1u, 17); STEP(F, b, c, d, a, w[11], 0x895cd7beu, 22); \
        STEP(F, a, b, c, d, w[12], 0x6b901122u, 7); STEP(F, d, a, b, c, w[13], 0xfd987193u, 12); \
        STEP(F, c, d, a, b, w[14], 0xa679438eu, 17); STEP(F, b, c, d, a, w[15], 0x49b40821u, 22); \
        STEP(G, a, b, c, d, w[1], 0xf61e2562u, 5); STEP(G, d, a, b, c, w[6], 0xc040b340u, 9); \
        STEP(G, c, d, a, b, w[11], 0x265e5a51u, 14); STEP(G, b, c, d, a, w[0], 0xe9b6c7aau, 20); \
        STEP(G, a, b, c, d, w[5], 0xd62f105du, 5); STEP(G, d, a, b, c, w[10], 0x02441453u, 9); \
        STEP(G, c, d, a, b, w[15], 0xd8a1e681u, 14); STEP(G, b, c, d, a, w[4], 0xe7d3fbc8u, 20); \
        STEP(G, a, b, c, d, w[9], 0x21e1cde6u, 5); STEP(G, d, a, b, c, w[14], 0xc33707d6u, 9); \
        STEP(G, c, d, a, b, w[3], 0xf4d50d87u, 14); STEP(G, b, c, d, a, w[8], 0x455a14edu, 20); \
        STEP(G, a, b, c, d, w[13], 0xa9e3e905u, 5); STEP(G, d, a, b, c, w[2], 0xfcefa3f8u, 9); \
        STEP(G, c, d, a, b, w[7], 0x676f02d9u, 14); STEP(G, b, c, d, a, w[12], 0x8d2a4c8au, 20); \
        STEP(H, a, b, c, d, w[5], 0xfffa3942u, 4); STEP(H, d, a, b, c, w[8], 0x8771f681u, 11); \
        STEP(H, c, d, a, b, w[11], 0x6d9d6122u, 16); STEP(H, b, c, d, a, w[14], 0xfde5380cu, 23); \
        STEP(H, a, b, c, d, w[1], 0xa4beea44u, 4); STEP(H, d, a, b, c, w[4], 0x4bdecfa9u, 11); \
        STEP(H, c, d, a, b, w[7], 0xf6bb4b60u, 16); STEP(H, b, c, d, a, w[10], 0xbebfbc70u, 23); \
        STEP(H, a, b, c, d, w[13], 0x289b7ec6u, 4); STEP(H, d, a, b, c, w[0], 0xeaa127fau, 11); \
        STEP(H, c, d, a, b, w[3], 0xd4ef3085u, 16); STEP(H, b, c, d, a, w[6], 0x04881d05u, 23); \
        STEP(H, a, b, c, d, w[9], 0xd9d4d039u, 4); STEP(H, d, a, b, c, w[12], 0xe6db99e5u, 11); \
        STEP(H, c, d, a, b, w[15], 0x1fa27cf8u, 16); STEP(H, b, c, d, a, w[2], 0xc4ac5665u, 23); \
        STEP(I, a, b, c, d, w[0], 0xf4292244u, 6); STEP(I, d, a, b, c, w[7], 0x432aff97u, 10); \
        STEP(I, c, d, a, b, w[14], 0xab9423a7u, 15); STEP(I, b, c, d, a, w[5], 0xfc93a039u, 21); \
        STEP(I, a, b, c, d, w[12], 0x655b59c3u, 6); STEP(I, d, a, b, c, w[3], 0x8f0ccc92u, 10); \
        STEP(I, c, d, a, b, w[10], 0xffeff47du, 15); STEP(I, b, c, d, a, w[1], 0x85845dd1u, 21); \
        STEP(I, a, b, c, d, w[8], 0x6fa87e4fu, 6); STEP(I, d, a, b, c, w[15], 0xfe2ce6e0u, 10); \
        STEP(I, c, d, a, b, w[6], 0xa3014314u, 15); STEP(I, b, c, d, a, w[13], 0x4e0811a1u, 21); \
        STEP(I, a, b, c, d, w[4], 0xf7537e82u, 6); STEP(I, d, a, b, c, w[11], 0xbd3af235u, 10); \
        STEP(I, c, d, a, b, w[2], 0x2ad7d2bbu, 15); STEP(I, b, c, d, a, w[9], 0xeb86d391u, 21); \
        (st)[0] += a; (st)[1] += b; (st)[2] += c; (st)[3] += d;                                    \
    } while (0)

static const uint32_t IV[4] = {0x67452301u, 0xefcdab89u, 0x98badcfeu, 0x10325476u};
static const uint8_t ZERO_BLOCK[64];

/* A buffer in a lane: its whole blocks, read in place, then its last bytes and MD5's padding
 * (0x80, zeros, the length in bits), one or two blocks copied here. */
typedef struct {
    const uint8_t *next;
    size_t whole;
    uint8_t tail[128];
    unsigned tail_blocks, tail_done;
    size_t job;
} lane_t;

static void lane_load(lane_t *ln, const uint8_t *data, size_t len, size_t job) {
    size_t rem = len % 64;
    uint64_t bits = (uint64_t)len * 8;
    ln->next = data;
    ln->whole = len / 64;
    memset(ln->tail, 0, sizeof ln->tail);
    if (rem)
        memcpy(ln->tail, data + ln->whole * 64, rem);
    ln->tail[rem] = 0x80;
    ln->tail_blocks = rem < 56 ? 1 : 2;
    for (int i = 0; i < 8; i++)
        ln->tail[ln->tail_blocks * 64 - 8 + i] = (uint8_t)(bits >> (8 * i));
    ln->tail_done = 0;
    ln->job = job;
}

static inline const uint8_t *lane_block(lane_t *ln) {
    if (ln->whole) {
        const uint8_t *b = ln->next;
        ln->next += 64;
        ln->whole--;
        return b;
    }
    return ln->tail + 64 * ln->tail_done++;
}

static inline int lane_finished(const lane_t *ln) { return !ln->whole && ln->tail_done == ln->tail_blocks; }

static inline uint32_t load_le32(const uint8_t *p) {
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

static void put_digest(uint8_t *out, const uint32_t st[4]) {
    for (int i = 0; i < 4; i++)
        for (int j = 0; j < 4; j++)
            out[4 * i + j] = (uint8_t)(st[i] >> (8 * j));
}

static void compress1(uint32_t st[4], const uint8_t *block) {
    uint32_t w[16];
    for (int j = 0; j < 16; j++)
        w[j] = load_le32(block + 4 * j);
    COMPRESS_BODY(uint32_t, st, w);
}

/* The last buffer left, alone: one lane's work costs a whole vector's, so it goes on here. */
static void finish1(lane_t *ln, uint32_t st[4], uint8_t *out) {
    while (!lane_finished(ln))
        compress1(st, lane_block(ln));
    put_digest(out + 16 * ln->job, st);
}

typedef struct {
    size_t len, job;
} job_t;

static int longest_first(const void *x, const void *y) {
    size_t a = ((const job_t *)x)->len, b = ((const job_t *)y)->len;
    return a < b ? 1 : a > b ? -1 : 0;
}

/* Lanes are refilled as their buffers end, longest buffers first, so that the lanes stay busy
 * until the last few buffers; the very last one finishes in finish1. */
#define DEFINE_MANY(NAME, L, TARGET)                                                               \
    typedef uint32_t NAME##_v __attribute__((vector_size(4 * (L))));                               \
    __attribute__((target(TARGET))) static void NAME##_compress(NAME##_v st[4], const NAME##_v *w) { \
        COMPRESS_BODY(NAME##_v, st, w);                                                            \
    }                                                                                              \
    __attribute__((target(TARGET))) static void NAME(size_t n, const uint8_t *const *data,        \
                                                     const job_t *jobs, uint8_t *out) {            \
        lane_t lanes[L];                                                                           \
        int busy[L];                                                                               \
        NAME##_v st[4], w[16];                                                                     \
        size_t next = 0;                                                                           \
        int nbusy = 0;                                                                             \
        for (int l = 0; l < (L); l++) {                                                            \
            busy[l] = next < n;                                                                    \
            if (busy[l]) {                                                                         \
                lane_load(&lanes[l], data[jobs[next].job], jobs[next].len, jobs[next].job);        \
                next++;                                                                            \
                nbusy++;                                                                           \
            }                                                                                      \
            for (int i = 0; i < 4; i++)                                                            \
                st[i][l] = IV[i];                                                                  \
        }                                                                                          \
        while (nbusy > 1) {                                                                        \
            for (int l = 0; l < (L); l++) {                                                        \
                const uint8_t *b = busy[l] ? lane_block(&lanes[l]) : ZERO_BLOCK;                   \
                for (int j = 0; j < 16; j++)                                                       \
                    w[j][l] = load_le32(b + 4 * j);                                                \
            }                                                                                      \
            NAME##_compress(st, w);                                                                \
            for (int l = 0; l < (L); l++) {                                                        \
                if (!busy[l] || !lane_finished(&lanes[l]))                                         \
                    continue;                                                                      \
                uint32_t one[4] = {st[0][l], st[1][l], st[2][l], st[3][l]};                        \
                put_digest(out + 16 * lanes[l].job, one);                                          \
                if (next < n) {                                                                    \
                    lane_load(&lanes[l], data[jobs[next].job], jobs[next].len, jobs[next].job);    \
                    next++;                                                                        \
                    for (int i = 0; i < 4; i++)                                                    \
                        st[i][l] = IV[i];                                                          \
                } else {                                                                           \
                    busy[l] = 0;                                                                   \
                    nbusy--;                                                                       \
                }                                                                                  \
            }                                                                                      \
        }                                                                                          \
        for (int l = 0; l < (L); l++) {                                                            \
            if (busy[l]) {                                                                         \
                uint32_t one[4] = {st[0][l], st[1][l], st[2][l], st[3][l]};                        \
                finish1(&lanes[l], one, out);                                                      \
            }                                                                                      \
        }                                                                                          \
    }

#if defined(__x86_64__) && defined(__GNUC__)
DEFINE_MANY(md5_many16, 16, "avx512f")
DEFINE_MANY(md5_many8, 8, "avx2")
#define HAVE_LANES 1
#endif

/* Lanes per vector on this CPU: 16 (AVX-512), 8 (AVX2), or 0 (none here: use hashlib). */
EXPORT int kt_md5_lanes(void) {
#ifdef HAVE_LANES
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f"))
        return 16;
    if (__builtin_cpu_supports("avx2"))
        return 8;
#endif
    return 0;
}

/* out[16 * i .. 16 * i + 15] = MD5(data[i][0 .. len[i] - 1]) for i < n, in vectors of `lanes`
 * (16 or 8, at most kt_md5_lanes()). Returns 0, or -1 when this CPU has not those lanes or memory
 * ran out (out is then not written). */
EXPORT int kt_md5_many(size_t n, const uint8_t *const *data, const size_t *len, uint8_t *out, int lanes) {
    job_t *jobs;
    if ((lanes != 16 && lanes != 8) || lanes > kt_md5_lanes())
        return -1;
    jobs = malloc((n ? n : 1) * sizeof *jobs);
    if (!jobs)
        return -1;
    for (size_t i = 0; i < n; i++) {
        jobs[i].len = len[i];
        jobs[i].job = i;
    }
    qsort(jobs, n, sizeof *jobs, longest_first);
#ifdef HAVE_LANES
    if (lanes == 16)
        md5_many16(n, data, jobs, out);
    else
        md5_many8(n, data, jobs, out);
#endif
    free(jobs);
    return 0;
}
