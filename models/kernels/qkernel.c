/* Packed-weight matrix products for the CPU: y[M,N] = x[M,K] @ W[N,K]^T where W is stored as
 * MLX stores it, so the served weights are used in place (no copy, no repacking):
 *
 *   - affine quantized: `bits` in {2,3,4,5,6,8}, each row a little-endian bit stream of K values
 *     (uint32 words in memory order), one scale and bias per `group` values, float32 or bfloat16
 *     as a variant stores them (w = q * scale + bias, exactly mx.dequantize);
 *   - bfloat16 dense (bits == 16): tensors a recipe keeps unquantized stay 2 bytes a weight.
 *
 * Six modes (the caller's CPU plan picks one per layer shape and number of rows):
 *   0 FLOAT   every weight dequantized in registers, float32 FMAs (decode rows);
 *   1 INT16   x as 16-bit integers per group, exact int32 products on VNNI (decode rows; vnni_block);
 *   2 BLAS    the weight dequantized in tiles, then cblas_sgemm (prompts);
 *   3 TILES   AMX-BF16 tiles, x split exactly into three bfloat16 parts (prompts, decode batches);
 *   4 PANEL   INT16's x against the weights unpacked once per call into column panels (vpdpwssd);
 *   5 PANEL8  PANEL with x as 8-bit integers per group (vpdpbusd; the engine's prefill).
 * FLOAT, BLAS and TILES compute what MLX computes for the dequantized weight, in float32; INT16,
 * PANEL and PANEL8 round x first (within 1/65024, 1/65024 and 1/254 of each group's largest
 * value) and then multiply exactly.
 *
 * Paths: AVX-512 with VBMI (vpermb + vpmultishiftqb unpack any width from the bit stream in three
 * instructions per 64 weights; Zen 4, Ice Lake and later); AVX2 with FMA for FLOAT, BLAS and the
 * recurrence (a broadcast, a byte shuffle and a variable shift unpack 8 weights of any width; CPUs
 * from Haswell on without VBMI, Zen 1-3 among them); and portable C for everything else (compiled
 * with target clones for AVX2 and the baseline). Work is split over output rows between a small
 * pool of threads; the GIL is released while they run. Beside the products: the
 * GatedDeltaNet recurrence, its depthwise convolution, SiLU, log-sum-exp, and the affine fit a
 * variant's weights are written with (quant/formats.py). */

#define _GNU_SOURCE
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <string.h>
#include <unistd.h>
#include <math.h>
#include <dlfcn.h>
#include <sys/syscall.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define MIXBIT_X86 1
#include <cpuid.h>
#endif

/* Decode rows stream the weights from memory one output row after the other: a software
 * prefetch PREFETCH_ROWS rows ahead took the 0.8B shape's decode step from 92 to 70 ms of
 * kernel time on one core here (the hardware prefetchers alone left it latency-bound). */
#ifndef PREFETCH_ROWS
#define PREFETCH_ROWS 4
#endif
#define ROWS 8       /* input rows sharing one dequantized weight vector */
#ifndef DEQ_TILE_BYTES
#define DEQ_TILE_BYTES (8 << 20) /* the BLAS mode's dequantized tile */
#endif
#define MAX_THREADS 64

typedef struct {
    const float *x;       /* [M, K] */
    const uint8_t *w;     /* [N, K*bits/8] or bf16 [N, K] */
    const void *scales;   /* [N, K/group], float32 or (sbf) bfloat16 */
    const void *biases;   /* [N, K/group], as scales */
    float *out;           /* [M, N] */
    const float *xsum;    /* [M, K/group]: sums of x over each group (affine) */
    const int8_t *x8;     /* [2, M, K]: x as 16-bit integers per group, high then low bytes */
    const float *xscale;  /* [M, K/group]: the unit d of each group's x16 (vnni_block) */
    float *deq_dst;       /* the dequantize path: rows from deq_row0 on, as float32 */
    int64_t deq_row0;
    const void *ctx;      /* other work on the pool (gated_delta_scan) */
    int64_t M, N, K;
    int bits, group;
    int64_t min_block;    /* output rows (or units) a thread takes at a time; 0: 16 */
    void *xparts;         /* the tile path: x as three bfloat16 parts, in B tiles */
    float *gsum;          /* the tile path: the group sums of x, by group [K/group][Mp] */
    int64_t Mp;           /* M padded to whole blocks of rows (tile_rows_padded) */
    const int16_t *x16;   /* the panel path: x [M, K] as 16-bit integers per group (panel_prep_x) */
    const int8_t *xq;     /* the 8-bit panel path: x [M, K] as 8-bit integers per group (panel8_prep_x) */
    int sbf;              /* scales and biases are bfloat16 (as a variant stores them), else float32 */
} Job;

/* Scale or bias i of a job: read as stored, bfloat16 (half the bytes a decode row streams
 * beside its weights) or float32; bfloat16 -> float32 is exact, so the products are the same. */
static inline float sb_at(const Job *j, const void *p, int64_t i) {
    if (j->sbf) {
        const uint32_t u = (uint32_t)((const uint16_t *)p)[i] << 16;
        float f;
        memcpy(&f, &u, 4);
        return f;
    }
    return ((const float *)p)[i];
}
#define SCALE(j, i) sb_at((j), (j)->scales, (i))
#define BIAS(j, i) sb_at((j), (j)->biases, (i))

typedef void (*RowsFn)(const Job *, int64_t, int64_t);

static int have_avx512 = 0, have_vnni = 0, have_amx = 0, have_avx2 = 0;

/* ---------------------------------------------------------------- portable path */

static inline uint32_t extract(const uint8_t *row, int64_t i, int bits) {
    /* value i of a little-endian bit stream of `bits`-wide values */
    int64_t bit = i * bits;
    uint64_t word = 0;
    int64_t byte = bit >> 3;
    int need = ((bit & 7) + bits + 7) >> 3;
    memcpy(&word, row + byte, (size_t)need);
    return (uint32_t)((word >> (bit & 7)) & ((1u << bits) - 1u));
}

__attribute__((target_clones("avx2", "default")))
static void rows_portable(const Job *j, int64_t n0, int64_t n1) {
    const int64_t K = j->K, M = j->M, N = j->N;
    float wbuf[256];
    if (j->bits == 16) {
        const uint16_t *w = (const uint16_t *)j->w;
        for (int64_t n = n0; n < n1; n++) {
            for (int64_t m0 = 0; m0 < M; m0 += ROWS) {
                int64_t mb = M - m0 < ROWS ? M - m0 : ROWS;
                float acc[ROWS] = {0};
                for (int64_t k0 = 0; k0 < K; k0 += 256) {
                    int64_t kb = K - k0 < 256 ? K - k0 : 256;
                    for (int64_t k = 0; k < kb; k++) {
                        uint32_t u = (uint32_t)w[n * K + k0 + k] << 16;
                        memcpy(&wbuf[k], &u, 4);
                    }
                    for (int64_t m = 0; m < mb; m++) {
                        const float *xr = j->x + (m0 + m) * K + k0;
                        float s = 0;
                        for (int64_t k = 0; k < kb; k++) s += wbuf[k] * xr[k];
                        acc[m] += s;
                    }
                }
                for (int64_t m = 0; m < mb; m++) j->out[(m0 + m) * N + n] = acc[m];
            }
        }
        return;
    }
    const int bits = j->bits, g = j->group;
    const int64_t row_bytes = K * bits / 8, ng = K / g;
    for (int64_t n = n0; n < n1; n++) {
        const uint8_t *row = j->w + n * row_bytes;
        for (int64_t m0 = 0; m0 < M; m0 += ROWS) {
            int64_t mb = M - m0 < ROWS ? M - m0 : ROWS;
            float acc[ROWS] = {0};
            for (int64_t gi = 0; gi < ng; gi++) {
                const float s = SCALE(j, n * ng + gi), b = BIAS(j, n * ng + gi);
                for (int k = 0; k < g; k++)
                    wbuf[k] = (float)extract(row, gi * g + k, bits) * s + b;
                for (int64_t m = 0; m < mb; m++) {
                    const float *xr = j->x + (m0 + m) * K + gi * g;
                    float t = 0;
                    for (int k = 0; k < g; k++) t += wbuf[k] * xr[k];
                    acc[m] += t;
                }
            }
            for (int64_t m = 0; m < mb; m++) j->out[(m0 + m) * N + n] = acc[m];
        }
    }
}

/* ---------------------------------------------------------------- AVX-512 path */

#ifdef MIXBIT_X86
#define AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512vbmi,fma")))

AVX512 static inline __m512 bf16_to_f32(const uint16_t *p) {
    __m512i v = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
}

/* The inner loops are written for a constant number of input rows (MB, 1..ROWS) and inlined
 * into one function per MB, so the accumulators live in registers. */

AVX512 static inline __attribute__((always_inline)) void bf16_block(
        const Job *j, int64_t n, const float *xb, float *out, const int MB) {
    const int64_t K = j->K;
    const uint16_t *wr = (const uint16_t *)j->w + n * K;
    __m512 acc[ROWS];
    for (int m = 0; m < MB; m++) acc[m] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 16) {
        if (MB <= 4 && (k & 31) == 0) _mm_prefetch((const char *)(wr + PREFETCH_ROWS * K + k), _MM_HINT_T0);
        __m512 wv = bf16_to_f32(wr + k);
        for (int m = 0; m < MB; m++)
            acc[m] = _mm512_fmadd_ps(wv, _mm512_loadu_ps(xb + m * K + k), acc[m]);
    }
    for (int m = 0; m < MB; m++) out[m * j->N] = _mm512_reduce_add_ps(acc[m]);
}

typedef struct {
    __m512i perm, shift, vmask;
    __m512i widen[4]; /* byte 16t+i of the unpacked chunk to the low byte of dword i */
    __mmask64 lmask;
    int chunk_bytes, gshift;
} Unpack;

/* Values c .. c + 63 of a packed row (c a multiple of 64), one byte each */
AVX512 static inline __attribute__((always_inline)) __m512i unpack64(const Unpack *u, const uint8_t *row,
                                                                     int64_t c) {
    __m512i v = _mm512_maskz_loadu_epi8(u->lmask, row + (c >> 6) * u->chunk_bytes);
    v = _mm512_permutexvar_epi8(u->perm, v);
    v = _mm512_multishift_epi64_epi8(u->shift, v);
    return _mm512_and_si512(v, u->vmask);
}

AVX512 static inline __attribute__((always_inline)) void affine_block(
        const Job *j, const Unpack *u, int64_t n, const float *xb, const float *xs, float *out,
        const int MB) {
    /* sum_g s_g * (q_g . x_g) + sum_g b_g * sum(x_g): the scale is applied once per group and
     * the bias through the group sums of x (computed once per call), so a weight costs one
     * byte-to-dword permute, one conversion and one FMA per input row. One partial sum per row
     * whatever the number of rows (MB), so a row's result never depends on how many rows share
     * the call (a verify step's positions are a decode step's, bit for bit). */
    const int NA = 1;
    const int64_t K = j->K, ng = K / j->group;
    const int64_t row_bytes = K * j->bits / 8;
    const uint8_t *wr = j->w + n * row_bytes;
    const int64_t sr = n * ng; /* this row's groups in scales and biases */
    const int g = j->group;
    __m512 acc[ROWS], part[ROWS][4];
    for (int m = 0; m < MB; m++) acc[m] = _mm512_setzero_ps();
    const int64_t step = g < 64 ? 64 : g;
    for (int64_t c0 = 0; c0 < K; c0 += step) {
        for (int m = 0; m < MB; m++)
            for (int a = 0; a < NA; a++) part[m][a] = _mm512_setzero_ps();
        for (int64_t c = c0; c < c0 + step; c += 64) {
            if (MB <= 4) /* with more rows a chunk is compute enough to hide the memory latency */
                _mm_prefetch((const char *)(wr + PREFETCH_ROWS * row_bytes + (c >> 6) * u->chunk_bytes), _MM_HINT_T0);
            __m512i v = unpack64(u, wr, c);
            if (g >= 64) {
                for (int t = 0; t < 4; t++) {
                    __m512 q = _mm512_cvtepi32_ps(_mm512_maskz_permutexvar_epi8(
                        0x1111111111111111ULL, u->widen[t], v));
                    for (int m = 0; m < MB; m++)
                        part[m][t % NA] = _mm512_fmadd_ps(q, _mm512_loadu_ps(xb + m * K + c + 16 * t),
                                                          part[m][t % NA]);
                }
            } else { /* g == 32: two groups in this chunk of 64 */
                for (int half = 0; half < 2; half++) {
                    for (int t = 2 * half; t < 2 * half + 2; t++) {
                        __m512 q = _mm512_cvtepi32_ps(_mm512_maskz_permutexvar_epi8(
                            0x1111111111111111ULL, u->widen[t], v));
                        for (int m = 0; m < MB; m++)
                            part[m][t % NA] = _mm512_fmadd_ps(
                                q, _mm512_loadu_ps(xb + m * K + c + 16 * t), part[m][t % NA]);
                    }
                    const __m512 s = _mm512_set1_ps(SCALE(j, sr + (c >> 5) + half));
                    for (int m = 0; m < MB; m++)
                        for (int a = 0; a < NA; a++) {
                            acc[m] = _mm512_fmadd_ps(part[m][a], s, acc[m]);
                            part[m][a] = _mm512_setzero_ps();
                        }
                }
            }
        }
        if (g >= 64) {
            const __m512 s = _mm512_set1_ps(SCALE(j, sr + (c0 >> u->gshift)));
            for (int m = 0; m < MB; m++) {
                __m512 t = part[m][0];
                for (int a = 1; a < NA; a++) t = _mm512_add_ps(t, part[m][a]);
                acc[m] = _mm512_fmadd_ps(t, s, acc[m]);
            }
        }
    }
    for (int m = 0; m < MB; m++) {
        float bias = 0;
        const float *xsm = xs + m * ng;
        for (int64_t gi = 0; gi < ng; gi++) bias += BIAS(j, sr + gi) * xsm[gi];
        out[m * j->N] = _mm512_reduce_add_ps(acc[m]) + bias;
    }
}

#define DISPATCH_MB(call)                                                                      \
    switch (mb) {                                                                              \
    case 1: call(1); break; case 2: call(2); break; case 3: call(3); break;                    \
    case 4: call(4); break; case 5: call(5); break; case 6: call(6); break;                    \
    case 7: call(7); break; default: call(8); break;                                           \
    }

AVX512 static void rows_bf16_avx512(const Job *j, int64_t n0, int64_t n1) {
    for (int64_t m0 = 0; m0 < j->M; m0 += ROWS) {
        const int mb = (int)(j->M - m0 < ROWS ? j->M - m0 : ROWS);
        const float *xb = j->x + m0 * j->K;
        for (int64_t n = n0; n < n1; n++) {
            float *out = j->out + m0 * j->N + n;
#define CALL(MB) bf16_block(j, n, xb, out, MB)
            DISPATCH_MB(CALL)
#undef CALL
        }
    }
}

AVX512 static void make_unpack(Unpack *up, const Job *j) {
    const int bits = j->bits;
    /* 64 values of `bits` bits are 8*bits bytes; qword q of the unpack gets bytes q*bits.. and
     * byte i of it the bits from i*bits on: three instructions per 64 weights for every width */
    uint8_t perm_b[64], shift_b[64];
    for (int q = 0; q < 8; q++)
        for (int i = 0; i < 8; i++) {
            perm_b[q * 8 + i] = (uint8_t)(q * bits + i);
            shift_b[q * 8 + i] = (uint8_t)(i * bits);
        }
    up->perm = _mm512_loadu_si512(perm_b);
    up->shift = _mm512_loadu_si512(shift_b);
    up->vmask = _mm512_set1_epi8((char)((1u << bits) - 1u));
    up->lmask = bits == 8 ? ~(__mmask64)0 : (((__mmask64)1 << (8 * bits)) - 1);
    up->chunk_bytes = 8 * bits;
    up->gshift = __builtin_ctz((unsigned)j->group);
    for (int t = 0; t < 4; t++) {
        uint8_t wb[64] = {0};
        for (int i = 0; i < 16; i++) wb[4 * i] = (uint8_t)(16 * t + i);
        up->widen[t] = _mm512_loadu_si512(wb);
    }
}

AVX512 static void rows_affine_avx512(const Job *j, int64_t n0, int64_t n1) {
    Unpack u;
    make_unpack(&u, j);
    for (int64_t m0 = 0; m0 < j->M; m0 += ROWS) {
        const int mb = (int)(j->M - m0 < ROWS ? j->M - m0 : ROWS);
        const float *xb = j->x + m0 * j->K;
        const float *xs = j->xsum + m0 * (j->K / j->group);
        for (int64_t n = n0; n < n1; n++) {
            float *out = j->out + m0 * j->N + n;
#define CALL(MB) affine_block(j, &u, n, xb, xs, out, MB)
            DISPATCH_MB(CALL)
#undef CALL
        }
    }
}

/* ---------------------------------------------------------------- 16-bit activations (VNNI) */

/* Activations as 16-bit integers per group of the weight: x16 = round(x / d) with d = (largest
 * |x| of the group) / 32512, so |x16| <= 32512 and each value is within d / 2 (1 / 65024 of the
 * group's largest) of x; float32 rounds at 2^-24 of each value, bfloat16 (what the reference
 * model computes in) at 2^-9. x16 is split exactly into two signed bytes, x16 = 256 h + l
 * (h in [-127, 127], l in [-128, 127]), and the unpacked weights q (unsigned, at most 8 bits)
 * multiply both with vpdpbusd (u8 x s8, 64 products an instruction, summed exactly in int32):
 * q . x16 = 256 (q . h) + q . l exactly. Per group: float(q . x16) * (scale * d), and the bias
 * through the exact float group sums of x, as in the float path. A weight then costs its unpack
 * (three instructions per 64) and two vpdpbusd per input row, against a byte-to-dword permute,
 * a conversion and an FMA per 16 in the float path. */
#define VNNI __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512vbmi,avx512vnni,fma")))
#define VROWS 8

/* acc + w . x (vpdpbusd, vpdpwssd) in place. With the intrinsics GCC 12 copied every accumulator
 * through another register after each product and spilled some to the stack (8 rows: 16
 * accumulators), and in the panel loop reloaded the weights for every row. */
VNNI static inline __attribute__((always_inline)) __m512i dpbusd(__m512i acc, __m512i w, __m512i x) {
    __asm__("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(w), "vm"(x));
    return acc;
}

VNNI static inline __attribute__((always_inline)) __m512i dpwssd(__m512i acc, __m512i w, __m512i x) {
    __asm__("vpdpwssd %2, %1, %0" : "+v"(acc) : "v"(w), "vm"(x));
    return acc;
}

VNNI static inline __attribute__((always_inline)) void vnni_block(
        const Job *j, const Unpack *u, int64_t n, int64_t m0, float *out, const int MB) {
    const int64_t K = j->K, ng = K / j->group;
    const int g = j->group;
    const int64_t row_bytes = K * j->bits / 8;
    const uint8_t *wr = j->w + n * row_bytes;
    const int64_t sr = n * ng; /* this row's groups in scales and biases */
    const int8_t *xh = j->x8 + m0 * K, *xl = j->x8 + j->M * K + m0 * K;
    const float *xd = j->xscale + m0 * ng, *xs = j->xsum + m0 * ng;
    __m512 acc[VROWS];
    __m512i ih[VROWS], il[VROWS];
    for (int m = 0; m < MB; m++) acc[m] = _mm512_setzero_ps();
    if (g >= 64) {
        for (int64_t gi = 0; gi < ng; gi++) {
            for (int m = 0; m < MB; m++) ih[m] = il[m] = _mm512_setzero_si512();
            for (int64_t c = gi * g; c < (gi + 1) * g; c += 64) {
                if (MB <= 4)
                    _mm_prefetch((const char *)(wr + PREFETCH_ROWS * row_bytes + (c >> 6) * u->chunk_bytes), _MM_HINT_T0);
                __m512i v = unpack64(u, wr, c);
                for (int m = 0; m < MB; m++) {
                    ih[m] = dpbusd(ih[m], v, _mm512_loadu_si512(xh + m * K + c));
                    il[m] = dpbusd(il[m], v, _mm512_loadu_si512(xl + m * K + c));
                }
            }
            const float sg = SCALE(j, sr + gi);
            for (int m = 0; m < MB; m++) {
                __m512i t = _mm512_add_epi32(_mm512_slli_epi32(ih[m], 8), il[m]);
                acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(t), _mm512_set1_ps(sg * xd[m * ng + gi]), acc[m]);
            }
        }
    } else { /* g == 32: a chunk of 64 holds two groups, lanes 0-7 and 8-15 */
        for (int64_t c = 0; c < K; c += 64) {
            const int64_t gi = c >> 5;
            if (MB <= 4)
                _mm_prefetch((const char *)(wr + PREFETCH_ROWS * row_bytes + (c >> 6) * u->chunk_bytes), _MM_HINT_T0);
            __m512i v = unpack64(u, wr, c);
            for (int m = 0; m < MB; m++) {
                __m512i h = dpbusd(_mm512_setzero_si512(), v, _mm512_loadu_si512(xh + m * K + c));
                __m512i l = dpbusd(_mm512_setzero_si512(), v, _mm512_loadu_si512(xl + m * K + c));
                __m512i t = _mm512_add_epi32(_mm512_slli_epi32(h, 8), l);
                __m512 sc = _mm512_insertf32x8(_mm512_set1_ps(SCALE(j, sr + gi) * xd[m * ng + gi]),
                                               _mm256_set1_ps(SCALE(j, sr + gi + 1) * xd[m * ng + gi + 1]), 1);
                acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(t), sc, acc[m]);
            }
        }
    }
    for (int m = 0; m < MB; m++) {
        float bias = 0;
        for (int64_t gi = 0; gi < ng; gi++) bias += BIAS(j, sr + gi) * xs[m * ng + gi];
        out[m * j->N] = _mm512_reduce_add_ps(acc[m]) + bias;
    }
}

VNNI static void rows_affine_vnni(const Job *j, int64_t n0, int64_t n1) {
    Unpack u;
    make_unpack(&u, j);
    for (int64_t m0 = 0; m0 < j->M; m0 += VROWS) {
        const int mb = (int)(j->M - m0 < VROWS ? j->M - m0 : VROWS);
        for (int64_t n = n0; n < n1; n++) {
            float *out = j->out + m0 * j->N + n;
#define CALL(MB) vnni_block(j, &u, n, m0, out, MB)
            DISPATCH_MB(CALL)
#undef CALL
        }
    }
}

/* ---------------------------------------------------------------- AMX tile path (prompts) */

/* For prompt rows on CPUs with AMX (Sapphire Rapids and later): the same function as the float
 * path, sum_g s_g * (q_g . x_g) + b_g * sum(x_g), with the q_g . x_g products on the tile unit
 * (tdpbf16ps: 16 x 16 x 32 multiply-adds an instruction, float32 accumulation). Nothing is
 * rounded on the way in: an unpacked weight q (at most 8 bits) is a bfloat16 exactly, and x is
 * split into three bfloat16 parts, x = hi + mid + lo exactly (8 significant bits each), so every
 * product is exact and only the float32 accumulation rounds, as in the float path and in BLAS.
 * bfloat16 weights are used as they are (one group over all of K, no scale).
 *
 * The weights are the tiles' A operand (16 output columns x 32 k, the unpacked rows as they
 * come), x the B operand (pairs of k by input row, rearranged once per call), so the
 * accumulators hold out^T. A thread takes panels of output columns, unpacks each panel once
 * (at most TILE_PANEL_BYTES, so it stays in L2) and runs every block of 32 input rows against
 * it: four 16 x 16 accumulator tiles per 32 x 32 block, rescaled into float32 after each group.
 * Up to 16 input rows (a decode batch) run as one block of 16 rows: two accumulator tiles, half
 * the tile products and rescaling of a block padded to 32 rows. */
#define AMX __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512dq,avx512vl,avx512vbmi,avx512bf16,fma")))
#define TILE_COLS 32
#define TILE_ROWS 32
#define TILE_PARTS 3
#define TILE_PANEL_BYTES (768 << 10)
#define TILE_MCHUNK 256 /* prompt rows per pass: x's parts stay ~1.5-5 MB */
#define TILE_ACC_BLOCKS 4 /* 32 x 32 float32 sums kept at a time (16 KB, in L1) */

/* AMX needs the CPU's tile unit and the kernel's permission to use its state (Linux 5.16+) */
static int amx_enable(void) {
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !((d >> 24) & 1) || !((d >> 22) & 1))
        return 0; /* AMX-TILE, AMX-BF16 */
    if (!__get_cpuid_count(7, 1, &a, &b, &c, &d) || !((a >> 5) & 1))
        return 0; /* AVX512-BF16 */
    return syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
}

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} TileConfig;

/* Buffers kept per thread, grown as needed and freed when the thread ends: slot 0 for x's parts
 * (at most 3 x TILE_MCHUNK x K x 2 bytes; the BLAS mode's dequantized tile, DEQ_TILE_BYTES) and
 * 1 for its group sums (the calling thread), 2 for
 * the unpacked panel (TILE_PANEL_BYTES or one block of columns) and 3 for the accumulators (every
 * thread); the panel path (rows_panel) uses them the same way for x16, the panel and its scales. A fresh panel per call came from a fresh mapping, and its page faults cost more
 * than the tile products of a decode batch (a 6144 x 1024 layer, 8 rows: 4.5 ms a call). */
#define TILE_SLOTS 4
typedef struct {
    void *buf[TILE_SLOTS];
    size_t cap[TILE_SLOTS];
} TileBufs;

static pthread_key_t tile_key;
static pthread_once_t tile_once = PTHREAD_ONCE_INIT;

static void tile_bufs_free(void *p) {
    TileBufs *t = p;
    for (int i = 0; i < TILE_SLOTS; i++) free(t->buf[i]);
    free(t);
}

static void tile_key_make(void) { pthread_key_create(&tile_key, tile_bufs_free); }

static void *tile_buffer(int slot, size_t bytes) {
    pthread_once(&tile_once, tile_key_make);
    TileBufs *t = pthread_getspecific(tile_key);
    if (!t) {
        t = calloc(1, sizeof *t);
        if (!t || pthread_setspecific(tile_key, t) != 0) {
            free(t);
            return NULL;
        }
    }
    if (t->cap[slot] < bytes) {
        free(t->buf[slot]);
        bytes = (bytes + 4095) & ~(size_t)4095;
        t->buf[slot] = aligned_alloc(4096, bytes);
        t->cap[slot] = t->buf[slot] ? bytes : 0;
    }
    return t->buf[slot];
}

/* M input rows padded to whole blocks: one block of 16 for up to 16 rows, else blocks of
 * TILE_ROWS */
static inline int64_t tile_rows_padded(int64_t M) {
    return M <= 16 ? 16 : (M + TILE_ROWS - 1) / TILE_ROWS * TILE_ROWS;
}

static int64_t tile_panel_blocks(int64_t K) {
    int64_t p = TILE_PANEL_BYTES / (K * 2 * TILE_COLS);
    return p < 1 ? 1 : p;
}

/* ---------------------------------------------------------------- 16-bit activations, weights in column panels (VNNI) */

/* Many rows (a prompt, a decode batch) on VNNI without AMX. The row kernels above reduce every
 * (row, output) pair on its own - a horizontal sum, a scalar scale per group, a scalar bias
 * loop - which at a few rows and more costs more than the products. Here, as in llama.cpp's
 * repacked weights, a thread unpacks PANEL_COLS output columns once per call into a
 * column-interleaved panel: per pair of k, one vector holds the two weights (as 16-bit
 * integers) of 16 columns, so vpdpwssd with x's pair of 16-bit values broadcast adds 32 exact
 * products into 16 int32 accumulators, one per output column; the group's scale (a vector of 16
 * columns) and x's unit d are applied after each group, the bias through x's group sums, all on
 * vectors. x is rounded exactly as in vnni_block (x16 = round(x / d), d = the group's largest
 * |x| / 32512), kept as 16-bit integers: |q x16| <= 255 x 32512, so a group of up to 128 sums
 * exactly in int32 (128 x 8.3e6 < 2^31). */
#define PANEL_COLS 64  /* output columns per panel: 4 vectors of 16 */
#define PANEL_MR 6     /* input rows per register tile: 24 int32 accumulators */
#define PANEL_MCHUNK 512 /* input rows per pass: x16 stays within a few MB */

/* x as integers per group - 16-bit (PANEL: x16 = round(x / d), d = the group's largest |x| /
 * 32512) or 8-bit (PANEL8, `eight`: d = largest |x| / 127) - with their units d and the group
 * sums of x, rows r0..r1 (on the pool); rounded to nearest even, as lrintf */
VNNI static inline __attribute__((always_inline)) void prep_x(const Job *j, int64_t r0, int64_t r1,
                                                              const int eight) {
    const int64_t K = j->K, g = j->group, ng = K / g;
    const float levels = eight ? 127.0f : 32512.0f;
    float *xsum = (float *)j->xsum, *xd = (float *)j->xscale;
    for (int64_t m = r0; m < r1; m++)
        for (int64_t gi = 0; gi < ng; gi++) {
            const float *xg = j->x + m * K + gi * g;
            __m512 s = _mm512_setzero_ps(), a = _mm512_setzero_ps();
            for (int64_t k = 0; k < g; k += 16) {
                const __m512 v = _mm512_loadu_ps(xg + k);
                s = _mm512_add_ps(s, v);
                a = _mm512_max_ps(a, _mm512_abs_ps(v));
            }
            const float amax = _mm512_reduce_max_ps(a);
            xsum[m * ng + gi] = _mm512_reduce_add_ps(s);
            xd[m * ng + gi] = amax / levels;
            const __m512 inv = _mm512_set1_ps(amax > 0 ? levels / amax : 0.0f);
            for (int64_t k = 0; k < g; k += 16) {
                const __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(xg + k), inv));
                if (eight)
                    _mm_storeu_si128((__m128i *)((int8_t *)j->xq + m * K + gi * g + k), _mm512_cvtsepi32_epi8(q));
                else
                    _mm256_storeu_si256((__m256i *)((int16_t *)j->x16 + m * K + gi * g + k),
                                        _mm512_cvtsepi32_epi16(q));
            }
        }
}

VNNI static void panel_prep_x(const Job *j, int64_t r0, int64_t r1) { prep_x(j, r0, r1, 0); }

/* r[i] (16 dwords each) becomes its transpose: r[t] dword i = old r[i] dword t */
VNNI static inline __attribute__((always_inline)) void transpose16(__m512i *r) {
    __m512i t[16], u[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
    for (int a = 0; a < 4; a++) { /* u[4a + b], lane L: rows 4a..4a+3 of column 4L + b */
        u[4 * a + 0] = _mm512_unpacklo_epi64(t[4 * a], t[4 * a + 2]);
        u[4 * a + 1] = _mm512_unpackhi_epi64(t[4 * a], t[4 * a + 2]);
        u[4 * a + 2] = _mm512_unpacklo_epi64(t[4 * a + 1], t[4 * a + 3]);
        u[4 * a + 3] = _mm512_unpackhi_epi64(t[4 * a + 1], t[4 * a + 3]);
    }
    for (int b = 0; b < 4; b++) { /* a 4 x 4 transpose of 128-bit lanes */
        const __m512i v0 = _mm512_shuffle_i32x4(u[b], u[4 + b], 0x44);
        const __m512i v1 = _mm512_shuffle_i32x4(u[b], u[4 + b], 0xEE);
        const __m512i v2 = _mm512_shuffle_i32x4(u[8 + b], u[12 + b], 0x44);
        const __m512i v3 = _mm512_shuffle_i32x4(u[8 + b], u[12 + b], 0xEE);
        r[b] = _mm512_shuffle_i32x4(v0, v2, 0x88);
        r[4 + b] = _mm512_shuffle_i32x4(v0, v2, 0xDD);
        r[8 + b] = _mm512_shuffle_i32x4(v1, v3, 0x88);
        r[12 + b] = _mm512_shuffle_i32x4(v1, v3, 0xDD);
    }
}

/* Columns n0 .. n0 + PANEL_COLS - 1 of W into the panel: dword (p * 4 + c) * 16 + i holds the
 * weights k = 2p, 2p + 1 of column n0 + 16 c + i as two 16-bit integers; their scales and
 * biases as [group][PANEL_COLS] floats. */
VNNI static void panel_pack(const Job *j, const Unpack *u, int64_t n0, int32_t *panel, float *ps) {
    const int64_t K = j->K, ng = K / j->group, row_bytes = K * j->bits / 8;
    uint8_t tmp[16][64] __attribute__((aligned(64)));
    for (int c = 0; c < PANEL_COLS / 16; c++) {
        for (int64_t k0 = 0; k0 < K; k0 += 64) {
            for (int i = 0; i < 16; i++)
                _mm512_store_si512(tmp[i], unpack64(u, j->w + (n0 + 16 * c + i) * row_bytes, k0));
            for (int half = 0; half < 2; half++) {
                __m512i r[16];
                for (int i = 0; i < 16; i++)
                    r[i] = _mm512_cvtepu8_epi16(_mm256_load_si256((const __m256i *)(tmp[i] + 32 * half)));
                transpose16(r);
                const int64_t p0 = k0 / 2 + 16 * half;
                for (int t = 0; t < 16; t++)
                    _mm512_store_si512(panel + ((p0 + t) * 4 + c) * 16, r[t]);
            }
        }
    }
    for (int64_t gi = 0; gi < ng; gi++)
        for (int col = 0; col < PANEL_COLS; col++) {
            ps[gi * PANEL_COLS + col] = SCALE(j, (n0 + col) * ng + gi);
            ps[(ng + gi) * PANEL_COLS + col] = BIAS(j, (n0 + col) * ng + gi);
        }
}

/* rows m0 .. m0 + MB - 1 against one panel: out[m, n0 .. n0 + 63]. `eight` (a constant in each
 * caller): PANEL8's panel and x8 (four k a dword, vpdpbusd), else PANEL's and x16 (two k a dword,
 * vpdpwssd); a dword of x is 4 bytes at k = dword * (4 / bytes a value) either way. */
VNNI static inline __attribute__((always_inline)) void panel_tile(
        const Job *j, const int32_t *panel, const float *ps, int64_t n0, int64_t m0, const int MB,
        const int eight) {
    const int64_t K = j->K, g = j->group, ng = K / g, kpg = g / (eight ? 4 : 2);
    const int64_t xb = eight ? 1 : 2; /* bytes a value of x */
    const uint8_t *xq = (eight ? (const uint8_t *)j->xq : (const uint8_t *)j->x16) + m0 * K * xb;
    const float *xd = j->xscale + m0 * ng, *xs = j->xsum + m0 * ng;
    __m512 f[PANEL_MR][4];
    for (int m = 0; m < MB; m++)
        for (int c = 0; c < 4; c++) f[m][c] = _mm512_setzero_ps();
    for (int64_t gi = 0; gi < ng; gi++) {
        __m512i acc[PANEL_MR][4];
        for (int m = 0; m < MB; m++)
            for (int c = 0; c < 4; c++) acc[m][c] = _mm512_setzero_si512();
        for (int64_t p = gi * kpg; p < (gi + 1) * kpg; p++) {
            const int32_t *wp = panel + p * 64;
            const __m512i w0 = _mm512_load_si512(wp), w1 = _mm512_load_si512(wp + 16),
                          w2 = _mm512_load_si512(wp + 32), w3 = _mm512_load_si512(wp + 48);
            for (int m = 0; m < MB; m++) {
                int32_t dword;
                memcpy(&dword, xq + m * K * xb + 4 * p, 4);
                const __m512i b = _mm512_set1_epi32(dword);
                if (eight) {
                    acc[m][0] = dpbusd(acc[m][0], w0, b);
                    acc[m][1] = dpbusd(acc[m][1], w1, b);
                    acc[m][2] = dpbusd(acc[m][2], w2, b);
                    acc[m][3] = dpbusd(acc[m][3], w3, b);
                } else {
                    acc[m][0] = dpwssd(acc[m][0], w0, b);
                    acc[m][1] = dpwssd(acc[m][1], w1, b);
                    acc[m][2] = dpwssd(acc[m][2], w2, b);
                    acc[m][3] = dpwssd(acc[m][3], w3, b);
                }
            }
        }
        for (int c = 0; c < 4; c++) {
            const __m512 s = _mm512_load_ps(ps + gi * PANEL_COLS + 16 * c);
            for (int m = 0; m < MB; m++)
                f[m][c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[m][c]),
                                          _mm512_mul_ps(s, _mm512_set1_ps(xd[m * ng + gi])), f[m][c]);
        }
    }
    for (int64_t gi = 0; gi < ng; gi++)
        for (int c = 0; c < 4; c++) {
            const __m512 bv = _mm512_load_ps(ps + (ng + gi) * PANEL_COLS + 16 * c);
            for (int m = 0; m < MB; m++)
                f[m][c] = _mm512_fmadd_ps(bv, _mm512_set1_ps(xs[m * ng + gi]), f[m][c]);
        }
    for (int m = 0; m < MB; m++)
        for (int c = 0; c < 4; c++) _mm512_storeu_ps(j->out + (m0 + m) * j->N + n0 + 16 * c, f[m][c]);
}

/* ---------------------------------------------------------------- 8-bit activations, weights in column panels (VNNI) */

/* PANEL's layout with x as 8-bit integers per group, as llama.cpp's CPU kernels quantize their
 * activations (Q8_0/Q8_K): x8 = round(x / d), d = the group's largest |x| / 127, so each value
 * is within d / 2 (1 / 254 of the group's largest) - coarser than INT16's 1 / 65024, hence a
 * setting of its own (generation.cpu_activations = "int8"). vpdpbusd takes four unsigned weight
 * bytes (q < 256) against four signed x bytes: 64 exact products an instruction, twice
 * vpdpwssd's, and the panel holds one byte a weight, half of PANEL's. |q x8| <= 255 x 127, so a
 * group of up to 128 sums exactly in int32. The bias goes through x's float group sums, as in
 * PANEL. */
VNNI static void panel8_prep_x(const Job *j, int64_t r0, int64_t r1) { prep_x(j, r0, r1, 1); }

/* Columns n0 .. n0 + PANEL_COLS - 1 of W into the panel: dword (p * 4 + c) * 16 + i holds the
 * weights k = 4p .. 4p + 3 of column n0 + 16 c + i, one byte each; scales and biases as in
 * panel_pack. */
VNNI static void panel8_pack(const Job *j, const Unpack *u, int64_t n0, int32_t *panel, float *ps) {
    const int64_t K = j->K, ng = K / j->group, row_bytes = K * j->bits / 8;
    for (int c = 0; c < PANEL_COLS / 16; c++)
        for (int64_t k0 = 0; k0 < K; k0 += 64) {
            __m512i r[16];
            for (int i = 0; i < 16; i++) r[i] = unpack64(u, j->w + (n0 + 16 * c + i) * row_bytes, k0);
            transpose16(r); /* r[t] dword i: column 16 c + i, k = k0 + 4t .. k0 + 4t + 3 */
            for (int t = 0; t < 16; t++) _mm512_store_si512(panel + ((k0 / 4 + t) * 4 + c) * 16, r[t]);
        }
    for (int64_t gi = 0; gi < ng; gi++)
        for (int col = 0; col < PANEL_COLS; col++) {
            ps[gi * PANEL_COLS + col] = SCALE(j, (n0 + col) * ng + gi);
            ps[(ng + gi) * PANEL_COLS + col] = BIAS(j, (n0 + col) * ng + gi);
        }
}

/* units are panels of PANEL_COLS output columns: each unpacked once (PANEL8's or PANEL's, by the
 * constant `eight`), every row run against it */
VNNI static inline __attribute__((always_inline)) void panel_rows(const Job *j, int64_t u0, int64_t u1,
                                                                  const int eight) {
    const int64_t K = j->K, ng = K / j->group;
    int32_t *panel = tile_buffer(2, (size_t)(K / (eight ? 4 : 2) * PANEL_COLS) * sizeof(int32_t));
    float *ps = tile_buffer(3, (size_t)(2 * ng * PANEL_COLS) * sizeof(float));
    if (!panel || !ps) abort(); /* a few hundred KB; a worker cannot report it */
    Unpack u;
    make_unpack(&u, j);
    for (int64_t p = u0; p < u1; p++) {
        const int64_t n0 = p * PANEL_COLS;
        if (eight)
            panel8_pack(j, &u, n0, panel, ps);
        else
            panel_pack(j, &u, n0, panel, ps);
        for (int64_t m0 = 0; m0 < j->M; m0 += PANEL_MR) {
            const int mb = (int)(j->M - m0 < PANEL_MR ? j->M - m0 : PANEL_MR);
            switch (mb) {
            case 1: panel_tile(j, panel, ps, n0, m0, 1, eight); break;
            case 2: panel_tile(j, panel, ps, n0, m0, 2, eight); break;
            case 3: panel_tile(j, panel, ps, n0, m0, 3, eight); break;
            case 4: panel_tile(j, panel, ps, n0, m0, 4, eight); break;
            case 5: panel_tile(j, panel, ps, n0, m0, 5, eight); break;
            default: panel_tile(j, panel, ps, n0, m0, 6, eight); break;
            }
        }
    }
}

VNNI static void rows_panel(const Job *j, int64_t u0, int64_t u1) { panel_rows(j, u0, u1, 0); }

VNNI static void rows_panel8(const Job *j, int64_t u0, int64_t u1) { panel_rows(j, u0, u1, 1); }


/* x [M, K] float32 into B tiles of its three bfloat16 parts: tile (part, block of 16 rows, 32-deep
 * slice kb) is 1 KB, its row r holding each input row's pair k = 2r, 2r + 1 (rows from M on are
 * zero). The parts: hi = x with its low 16 bits cleared, mid the same of x - hi, lo = x - hi - mid.
 * Also the group sums of x, by group ([ng][Mp]), for the bias term. Runs on the pool: units are
 * blocks of 16 rows. */
AMX static void tiles_split_x(const Job *j, int64_t b0, int64_t b1) {
    const int64_t K = j->K, M = j->M, Mp = j->Mp, nkb = K / 32, nmb = Mp / 16;
    const int64_t kpg = j->bits == 16 ? nkb : j->group / 32, ng = nkb / kpg;
    uint32_t *xp = (uint32_t *)j->xparts;
    float *xsum_t = j->gsum;
    const __m512i top = _mm512_set1_epi32((int)0xFFFF0000u);
    const __m512i rows = _mm512_mullo_epi32(
        _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0), _mm512_set1_epi32(16));
    for (int64_t mb = b0; mb < b1; mb++) {
        for (int p = 0; p < 3; p++)
            memset(xp + ((p * nmb + mb) * nkb) * 256, 0, (size_t)(nkb * 1024));
        for (int64_t m = mb * 16; m < mb * 16 + 16; m++) {
            if (m >= M) {
                for (int64_t gi = 0; gi < ng; gi++) xsum_t[gi * Mp + m] = 0.0f;
                continue;
            }
            __m512 gsum = _mm512_setzero_ps();
            for (int64_t kb = 0; kb < nkb; kb++) {
                __m512 parts[3][2];
                for (int h = 0; h < 2; h++) {
                    const __m512 v = _mm512_loadu_ps(j->x + m * K + kb * 32 + 16 * h);
                    gsum = _mm512_add_ps(gsum, v);
                    parts[0][h] = _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(v), top));
                    const __m512 r = _mm512_sub_ps(v, parts[0][h]);
                    parts[1][h] = _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(r), top));
                    parts[2][h] = _mm512_sub_ps(r, parts[1][h]);
                }
                for (int p = 0; p < 3; p++) /* exact: each part has at most 8 significant bits */
                    _mm512_i32scatter_epi32(xp + ((p * nmb + mb) * nkb + kb) * 256 + (m & 15), rows,
                                            (__m512i)_mm512_cvtne2ps_pbh(parts[p][1], parts[p][0]), 4);
                if ((kb + 1) % kpg == 0) {
                    xsum_t[(kb / kpg) * Mp + m] = _mm512_reduce_add_ps(gsum);
                    gsum = _mm512_setzero_ps();
                }
            }
        }
    }
}

/* Column blocks cb0..cb1 (TILE_COLS columns each) into A tiles: for each block and 32-deep slice
 * of K, two 1 KB tiles (columns 0-15, 16-31), row i the slice of column i as bfloat16 */
AMX static void tiles_pack(const Job *j, const Unpack *u, int64_t cb0, int64_t cb1, uint16_t *wt) {
    const int64_t K = j->K, nkb = K / 32, ncol = (cb1 - cb0) * TILE_COLS;
    for (int64_t c = 0; c < ncol; c++) {
        const int64_t n = cb0 * TILE_COLS + c;
        uint16_t *col = wt + ((c / TILE_COLS) * nkb * 2 + ((c >> 4) & 1)) * 512 + (c & 15) * 32;
        if (j->bits == 16) {
            const uint16_t *wr = (const uint16_t *)j->w + n * K;
            for (int64_t kb = 0; kb < nkb; kb++)
                _mm512_storeu_si512(col + kb * 1024, _mm512_loadu_si512(wr + kb * 32));
            continue;
        }
        const uint8_t *wr = j->w + n * (K * j->bits / 8);
        for (int64_t c64 = 0; c64 < K; c64 += 64) {
            __m512i v = unpack64(u, wr, c64);
            __m512 f[4];
            for (int t = 0; t < 4; t++)
                f[t] = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm512_extracti32x4_epi32(v, t)));
            /* integers below 256 are bfloat16 exactly */
            _mm512_storeu_si512(col + (c64 / 32) * 1024, (__m512i)_mm512_cvtne2ps_pbh(f[1], f[0]));
            _mm512_storeu_si512(col + (c64 / 32 + 1) * 1024, (__m512i)_mm512_cvtne2ps_pbh(f[3], f[2]));
        }
    }
}

/* One group (kpg slices of 32) of one block of 32 output columns x 32 input rows, into acc
 * ([column][row] float32): q . x on the tiles, then scaled, plus the bias times the group sums */
AMX static inline void tiles_group(const Job *j, const uint16_t *wb, const uint32_t *xp, const float *xsum_t,
                                   float *acc, float *ct, int64_t c0, int64_t m0, int64_t gi, int64_t kpg,
                                   int64_t ng, const int rt) {
    /* rt: input rows in the block, 32 (four accumulator tiles) or 16 (tiles 0 and 2) */
    const int64_t K = j->K, Mp = j->Mp, nkb = K / 32, nmb = Mp / 16, mb = m0 / 16;
    const int affine = j->bits != 16;
    _tile_zero(0);
    _tile_zero(2);
    if (rt == 32) {
        _tile_zero(1);
        _tile_zero(3);
    }
    for (int64_t kb = gi * kpg; kb < (gi + 1) * kpg; kb++) {
        _tile_loadd(4, wb + kb * 1024, 64);
        _tile_loadd(5, wb + kb * 1024 + 512, 64);
        for (int p = 0; p < TILE_PARTS; p++) {
            const uint32_t *xb = xp + ((p * nmb + mb) * nkb + kb) * 256;
            _tile_loadd(6, xb, 64);
            _tile_dpbf16ps(0, 4, 6); /* columns 0-15, rows 0-15 */
            _tile_dpbf16ps(2, 5, 6); /* columns 16-31, rows 0-15 */
            if (rt == 32) {
                _tile_loadd(7, xb + nkb * 256, 64);
                _tile_dpbf16ps(1, 4, 7); /* columns 0-15, rows 16-31 */
                _tile_dpbf16ps(3, 5, 7);
            }
        }
    }
    _tile_stored(0, ct, 64);
    _tile_stored(2, ct + 512, 64);
    if (rt == 32) {
        _tile_stored(1, ct + 256, 64);
        _tile_stored(3, ct + 768, 64);
    }
    for (int t = 0; t < 4; t++) {
        if (rt == 16 && (t & 1)) continue;
        const int h = t >> 1, r16 = (t & 1) * 16;
        const __m512 xs = affine ? _mm512_loadu_ps(xsum_t + gi * Mp + m0 + r16) : _mm512_setzero_ps();
        for (int i = 0; i < 16; i++) {
            const int64_t col = h * 16 + i, n = c0 + col;
            float *ar = acc + col * TILE_ROWS + r16;
            __m512 a = _mm512_loadu_ps(ar), c = _mm512_loadu_ps(ct + t * 256 + i * 16);
            if (affine) {
                a = _mm512_fmadd_ps(c, _mm512_set1_ps(SCALE(j, n * ng + gi)), a);
                a = _mm512_fmadd_ps(xs, _mm512_set1_ps(BIAS(j, n * ng + gi)), a);
            } else {
                a = _mm512_add_ps(a, c);
            }
            _mm512_storeu_ps(ar, a);
        }
    }
}

AMX static void rows_tiles(const Job *j, int64_t u0, int64_t u1) {
    const int64_t K = j->K, M = j->M, Mp = j->Mp, N = j->N, nkb = K / 32;
    const int affine = j->bits != 16;
    const int64_t ng = affine ? K / j->group : 1, kpg = affine ? j->group / 32 : nkb;
    const uint32_t *xp = (const uint32_t *)j->xparts;
    const float *xsum_t = j->gsum;
    const int64_t panel = tile_panel_blocks(K), nb = N / TILE_COLS;
    /* units are panels: a thread's panel is unpacked once and x streamed over it once */
    const int64_t cb0 = u0 * panel, cb1 = u1 * panel < nb ? u1 * panel : nb;
    Unpack u;
    if (affine) make_unpack(&u, j);
    uint16_t *wt = tile_buffer(2, (size_t)(panel * nkb * 2048));
    float *acc = tile_buffer(3, (TILE_ACC_BLOCKS * TILE_ROWS * TILE_COLS + 4 * 256) * sizeof(float));
    if (!wt || !acc) abort(); /* a few hundred KB; a worker cannot report it */
    float *ct = acc + TILE_ACC_BLOCKS * TILE_ROWS * TILE_COLS;
    TileConfig cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) {
        cfg.colsb[t] = 64;
        cfg.rows[t] = 16;
    }
    _tile_loadconfig(&cfg);
    for (int64_t p0 = cb0; p0 < cb1; p0 += panel) {
        const int64_t p1 = p0 + panel < cb1 ? p0 + panel : cb1;
        tiles_pack(j, &u, p0, p1, wt);
        for (int64_t m0 = 0; m0 < Mp; m0 += TILE_ROWS)
            for (int64_t s0 = 0; s0 < p1 - p0; s0 += TILE_ACC_BLOCKS) {
                const int rt = (int)(Mp - m0 < TILE_ROWS ? Mp - m0 : TILE_ROWS);
                const int64_t s1 = s0 + TILE_ACC_BLOCKS < p1 - p0 ? s0 + TILE_ACC_BLOCKS : p1 - p0;
                memset(acc, 0, (size_t)((s1 - s0) * TILE_ROWS * TILE_COLS) * sizeof(float));
                /* group by group over the blocks: a group's x tiles stay in L1 across them */
                for (int64_t gi = 0; gi < ng; gi++)
                    for (int64_t b = s0; b < s1; b++)
                        tiles_group(j, wt + b * nkb * 1024, xp, xsum_t, acc + (b - s0) * TILE_ROWS * TILE_COLS,
                                    ct, (p0 + b) * TILE_COLS, m0, gi, kpg, ng, rt);
                for (int64_t r = 0; r < rt && m0 + r < M; r++)
                    for (int64_t b = s0; b < s1; b++) {
                        const float *ab = acc + (b - s0) * TILE_ROWS * TILE_COLS;
                        float *o = j->out + (m0 + r) * N + (p0 + b) * TILE_COLS;
                        for (int col = 0; col < TILE_COLS; col++) o[col] = ab[col * TILE_ROWS + r];
                    }
            }
    }
    _tile_release();
}
#endif

#ifdef MIXBIT_X86
static void deq_rows_portable(const Job *j, float *dst, int64_t n0, int64_t n1);

/* ---------------------------------------------------------------- AVX2 path */

/* CPUs with AVX2 and FMA but without AVX-512 VBMI (Zen 2 and 3, Intel's client cores): eight
 * values of any width are `bits` whole bytes of the stream, and one broadcast load, a byte
 * shuffle, a variable shift and a mask put value i of them into dword i. The portable path
 * (GCC's vectorizer over `extract`) ran 10-21x slower than a dense float32 product here, so the
 * CPU plan served every layer dense; this one reads large packed layers near memory speed. */
#define AVX2 __attribute__((target("avx2,fma")))
#define ROWS2 4 /* input rows a pass shares: their partial sums fill AVX2's 16 registers */

typedef struct {
    __m256i shuf, shift, mask;
} Unpack8;

AVX2 static void make_unpack8(Unpack8 *u, int bits) {
    /* dword i holds bytes b..b+3 of the 8-byte chunk (b = i*bits/8; bytes past the chunk are
     * zero), shifted right by i*bits mod 8; pshufb indexes within each 128-bit half, and the
     * broadcast chunk sits at bytes 0-7 of both */
    uint8_t sb[32];
    uint32_t sh[8];
    for (int i = 0; i < 8; i++) {
        const int b0 = (i * bits) >> 3;
        for (int t = 0; t < 4; t++)
            sb[(i >> 2) * 16 + (i & 3) * 4 + t] = b0 + t < 8 ? (uint8_t)(b0 + t) : 0x80;
        sh[i] = (uint32_t)((i * bits) & 7);
    }
    u->shuf = _mm256_loadu_si256((const __m256i *)sb);
    u->shift = _mm256_loadu_si256((const __m256i *)sh);
    u->mask = _mm256_set1_epi32((int)((1u << bits) - 1u));
}

/* The 8 values whose `bits` bytes start at p, as floats (reads 8 bytes from p: see row_tail) */
AVX2 static inline __attribute__((always_inline)) __m256 unpack8(const Unpack8 *u, const uint8_t *p) {
    int64_t w;
    memcpy(&w, p, 8);
    __m256i v = _mm256_shuffle_epi8(_mm256_set1_epi64x(w), u->shuf);
    return _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srlv_epi32(v, u->shift), u->mask));
}

AVX2 static inline float hsum256(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

/* unpack8 reads 8 bytes where the last chunk of a row has `bits`: within the matrix for every
 * row but the last, whose bytes are copied into a buffer with room after them */
static const uint8_t *row_tail(const Job *j, int64_t n, uint8_t **buf) {
    const int64_t row_bytes = j->K * j->bits / 8;
    if (n < j->N - 1 || j->bits == 8) return j->w + n * row_bytes;
    if (!*buf) {
        *buf = malloc((size_t)row_bytes + 8);
        if (!*buf) return NULL;
        memcpy(*buf, j->w + n * row_bytes, (size_t)row_bytes);
    }
    return *buf;
}

/* the shapes the AVX-512 path takes: whole 64-value chunks, power-of-two groups from 32 */
static inline int avx512_fits(const Job *j) {
    return j->K % 64 == 0 && (j->bits == 16 || (j->group >= 32 && (j->group & (j->group - 1)) == 0));
}

/* the shapes the AVX2 path takes: bfloat16 rows of whole 16-value steps, affine groups of whole
 * 16-value steps (every recipe's 32, 64, 128) */
static inline int avx2_fits(const Job *j) {
    return j->K % 16 == 0 && (j->bits == 16 || (j->group % 16 == 0 && j->K % j->group == 0));
}

AVX2 static inline __attribute__((always_inline)) void affine_block_avx2(
        const Job *j, const Unpack8 *u, const uint8_t *wr, int64_t n, const float *xb, const float *xs,
        float *out, const int MB) {
    /* as affine_block: the scale once per group, the bias through the group sums of x; two
     * partial sums per row (even and odd eights of a group) whatever the number of rows, so a
     * row's result never depends on how many rows share the call */
    const int64_t K = j->K, ng = K / j->group, row_bytes = K * j->bits / 8;
    const int g = j->group, bits = j->bits;
    const int64_t sr = n * ng; /* this row's groups in scales and biases */
    __m256 acc[ROWS2], p0[ROWS2], p1[ROWS2];
    for (int m = 0; m < MB; m++) acc[m] = _mm256_setzero_ps();
    for (int64_t gi = 0; gi < ng; gi++) {
        const int64_t c0 = gi * g;
        const uint8_t *pc = wr + (c0 >> 3) * bits;
        if (MB <= 2)
            for (int off = 0; off < g * bits / 8; off += 64)
                _mm_prefetch((const char *)(pc + PREFETCH_ROWS * row_bytes + off), _MM_HINT_T0);
        for (int m = 0; m < MB; m++) p0[m] = p1[m] = _mm256_setzero_ps();
        for (int c = 0; c < g; c += 16) {
            const __m256 q0 = unpack8(u, pc + (c >> 3) * bits);
            const __m256 q1 = unpack8(u, pc + ((c >> 3) + 1) * bits);
            for (int m = 0; m < MB; m++) {
                p0[m] = _mm256_fmadd_ps(q0, _mm256_loadu_ps(xb + m * K + c0 + c), p0[m]);
                p1[m] = _mm256_fmadd_ps(q1, _mm256_loadu_ps(xb + m * K + c0 + c + 8), p1[m]);
            }
        }
        const __m256 s = _mm256_set1_ps(SCALE(j, sr + gi));
        for (int m = 0; m < MB; m++) acc[m] = _mm256_fmadd_ps(_mm256_add_ps(p0[m], p1[m]), s, acc[m]);
    }
    for (int m = 0; m < MB; m++) {
        float bias = 0;
        const float *xsm = xs + m * ng;
        for (int64_t gi = 0; gi < ng; gi++) bias += BIAS(j, sr + gi) * xsm[gi];
        out[m * j->N] = hsum256(acc[m]) + bias;
    }
}

AVX2 static inline __attribute__((always_inline)) void bf16_block_avx2(
        const Job *j, int64_t n, const float *xb, float *out, const int MB) {
    const int64_t K = j->K;
    const uint16_t *wr = (const uint16_t *)j->w + n * K;
    __m256 p0[ROWS2], p1[ROWS2];
    for (int m = 0; m < MB; m++) p0[m] = p1[m] = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; k += 16) {
        if (MB <= 2 && (k & 31) == 0) _mm_prefetch((const char *)(wr + PREFETCH_ROWS * K + k), _MM_HINT_T0);
        const __m256i w = _mm256_loadu_si256((const __m256i *)(wr + k));
        const __m256 w0 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm256_castsi256_si128(w)), 16));
        const __m256 w1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm256_extracti128_si256(w, 1)), 16));
        for (int m = 0; m < MB; m++) {
            p0[m] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(xb + m * K + k), p0[m]);
            p1[m] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xb + m * K + k + 8), p1[m]);
        }
    }
    for (int m = 0; m < MB; m++) out[m * j->N] = hsum256(_mm256_add_ps(p0[m], p1[m]));
}

#define DISPATCH_MB2(call)                                                                     \
    switch (mb) {                                                                              \
    case 1: call(1); break; case 2: call(2); break; case 3: call(3); break;                    \
    default: call(4); break;                                                                   \
    }

AVX2 static void rows_bf16_avx2(const Job *j, int64_t n0, int64_t n1) {
    for (int64_t m0 = 0; m0 < j->M; m0 += ROWS2) {
        const int mb = (int)(j->M - m0 < ROWS2 ? j->M - m0 : ROWS2);
        const float *xb = j->x + m0 * j->K;
        for (int64_t n = n0; n < n1; n++) {
            float *out = j->out + m0 * j->N + n;
#define CALL(MB) bf16_block_avx2(j, n, xb, out, MB)
            DISPATCH_MB2(CALL)
#undef CALL
        }
    }
}

AVX2 static void rows_affine_avx2(const Job *j, int64_t n0, int64_t n1) {
    Unpack8 u;
    make_unpack8(&u, j->bits);
    uint8_t *tail = NULL;
    for (int64_t m0 = 0; m0 < j->M; m0 += ROWS2) {
        const int mb = (int)(j->M - m0 < ROWS2 ? j->M - m0 : ROWS2);
        const float *xb = j->x + m0 * j->K;
        const float *xs = j->xsum + m0 * (j->K / j->group);
        for (int64_t n = n0; n < n1; n++) {
            const uint8_t *wr = row_tail(j, n, &tail);
            if (!wr) break; /* no memory for the last row's copy: rows_portable does it below */
            float *out = j->out + m0 * j->N + n;
#define CALL(MB) affine_block_avx2(j, &u, wr, n, xb, xs, out, MB)
            DISPATCH_MB2(CALL)
#undef CALL
        }
    }
    if (n1 == j->N && !tail && j->bits != 8) rows_portable(j, j->N - 1, j->N);
    free(tail);
}

/* gdn_token_avx512 with eight lanes: one token of the gated delta rule for one head */
AVX2 static void gdn_token_avx2(const float *src, float *dst, const float *q, const float *k, const float *v,
                                float gs, float beta, float *y, int64_t Dk, int64_t Dv) {
    const __m256 g = _mm256_set1_ps(gs);
    for (int64_t r = 0; r < Dv; r++) {
        const float *s = src + r * Dk;
        float *o = dst + r * Dk;
        __m256 kv = _mm256_setzero_ps();
        for (int64_t i = 0; i < Dk; i += 8)
            kv = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_loadu_ps(s + i), g), _mm256_loadu_ps(k + i), kv);
        const __m256 u = _mm256_set1_ps((v[r] - hsum256(kv)) * beta);
        __m256 acc = _mm256_setzero_ps();
        for (int64_t i = 0; i < Dk; i += 8) {
            const __m256 n = _mm256_fmadd_ps(_mm256_loadu_ps(k + i), u, _mm256_mul_ps(_mm256_loadu_ps(s + i), g));
            _mm256_storeu_ps(o + i, n);
            acc = _mm256_fmadd_ps(n, _mm256_loadu_ps(q + i), acc);
        }
        y[r] = hsum256(acc);
    }
}

AVX2 static void deq_rows_avx2(const Job *j, float *dst, int64_t n0, int64_t n1) {
    const int64_t K = j->K;
    if (j->bits == 16) {
        const uint16_t *w = (const uint16_t *)j->w;
        for (int64_t n = n0; n < n1; n++)
            for (int64_t k = 0; k < K; k += 8)
                _mm256_storeu_ps(dst + (n - n0) * K + k, _mm256_castsi256_ps(_mm256_slli_epi32(
                    _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(w + n * K + k))), 16)));
        return;
    }
    Unpack8 u;
    make_unpack8(&u, j->bits);
    uint8_t *tail = NULL;
    const int64_t ng = K / j->group;
    const int g = j->group, bits = j->bits;
    for (int64_t n = n0; n < n1; n++) {
        const uint8_t *wr = row_tail(j, n, &tail);
        if (!wr) { deq_rows_portable(j, dst + (n - n0) * K, n, n + 1); continue; }
        float *d = dst + (n - n0) * K;
        for (int64_t gi = 0; gi < ng; gi++) {
            const __m256 s = _mm256_set1_ps(SCALE(j, n * ng + gi)), b = _mm256_set1_ps(BIAS(j, n * ng + gi));
            for (int c = 0; c < g; c += 8) {
                const int64_t k = gi * g + c;
                _mm256_storeu_ps(d + k, _mm256_fmadd_ps(unpack8(&u, wr + (k >> 3) * bits), s, b));
            }
        }
    }
    free(tail);
}

#endif

/* ---------------------------------------------------------------- dispatch */

static RowsFn choose(const Job *j, const char **name) {
#ifdef MIXBIT_X86
    if (j->x8) {
        *name = "avx512-vnni";
        return rows_affine_vnni;
    }
    if (have_avx512 && avx512_fits(j)) {
        *name = "avx512";
        return j->bits == 16 ? rows_bf16_avx512 : rows_affine_avx512;
    }
    if (have_avx2 && avx2_fits(j)) {
        *name = "avx2";
        return j->bits == 16 ? rows_bf16_avx2 : rows_affine_avx2;
    }
#endif
    *name = "portable";
    return rows_portable;
}

/* ---------------------------------------------------------------- dequantize + BLAS path */

/* Rows n0..n1 of W as float32 into dst (row-major, K columns): what mx.dequantize computes, at
 * memory speed for every width (MLX's CPU dequantize took 4 ms for a 3584x1024 4-bit weight
 * and 50 ms at 3 or 5 bits here). Then cblas_sgemm (OpenBLAS, loaded process-wide by
 * models/blas.py) multiplies: for prompts that is faster than any packed kernel. */
static void deq_rows_portable(const Job *j, float *dst, int64_t n0, int64_t n1) {
    const int64_t K = j->K;
    if (j->bits == 16) {
        const uint16_t *w = (const uint16_t *)j->w;
        for (int64_t n = n0; n < n1; n++)
            for (int64_t k = 0; k < K; k++) {
                uint32_t u = (uint32_t)w[n * K + k] << 16;
                memcpy(&dst[(n - n0) * K + k], &u, 4);
            }
        return;
    }
    const int64_t row_bytes = K * j->bits / 8, ng = K / j->group;
    for (int64_t n = n0; n < n1; n++)
        for (int64_t k = 0; k < K; k++) {
            const int64_t gi = k / j->group;
            dst[(n - n0) * K + k] = (float)extract(j->w + n * row_bytes, k, j->bits) *
                                        SCALE(j, n * ng + gi) + BIAS(j, n * ng + gi);
        }
}

#ifdef MIXBIT_X86
AVX512 static void deq_rows_avx512(const Job *j, float *dst, int64_t n0, int64_t n1) {
    const int64_t K = j->K;
    if (j->bits == 16) {
        const uint16_t *w = (const uint16_t *)j->w;
        for (int64_t n = n0; n < n1; n++)
            for (int64_t k = 0; k < K; k += 16)
                _mm512_storeu_ps(dst + (n - n0) * K + k, bf16_to_f32(w + n * K + k));
        return;
    }
    Unpack u;
    make_unpack(&u, j);
    const int64_t row_bytes = K * j->bits / 8, ng = K / j->group;
    for (int64_t n = n0; n < n1; n++) {
        const uint8_t *wr = j->w + n * row_bytes;
        float *d = dst + (n - n0) * K;
        for (int64_t c = 0; c < K; c += 64) {
            __m512i v = unpack64(&u, wr, c);
            for (int t = 0; t < 4; t++) {
                const int64_t gi = (c + 16 * t) >> u.gshift;
                __m512 q = _mm512_cvtepi32_ps(_mm512_maskz_permutexvar_epi8(
                    0x1111111111111111ULL, u.widen[t], v));
                _mm512_storeu_ps(d + c + 16 * t, _mm512_fmadd_ps(q, _mm512_set1_ps(SCALE(j, n * ng + gi)),
                                                                 _mm512_set1_ps(BIAS(j, n * ng + gi))));
            }
        }
    }
}
#endif

static void deq_part(const Job *j, int64_t n0, int64_t n1) {
    /* runs on the pool: rows n0..n1 of the current tile */
    float *dst = j->deq_dst + (n0 - j->deq_row0) * j->K;
#ifdef MIXBIT_X86
    if (have_avx512 && avx512_fits(j)) {
        deq_rows_avx512(j, dst, n0, n1);
        return;
    }
    if (have_avx2 && avx2_fits(j)) {
        deq_rows_avx2(j, dst, n0, n1);
        return;
    }
#endif
    deq_rows_portable(j, dst, n0, n1);
}

typedef void (*SgemmFn)(int, int, int, int, int, int, float, const float *, int, const float *, int,
                        float, float *, int);
static SgemmFn sgemm = NULL;

/* ---------------------------------------------------------------- GatedDeltaNet recurrence */

/* The gated delta rule over T tokens for every (sequence, head), one token after the other with
 * the head's state kept in cache (Dv x Dk floats, 64 KB at Qwen3.5's 128 x 128), reading and
 * writing each state row once per token (mlx-lm's step ops pass over the state four or five
 * times, its Python loop runs once per token):
 *   S = g S;  u = beta (v - S k);  S = S + u k^T;  y = S q      (S: Dv x Dk per head)
 * A decode step is T = 1. Layouts: q, k [B, T, H, Dk]; v, y [B, T, H, Dv]; g, beta [B, T, H];
 * state, state_out [B, H, Dv, Dk]. A padded position carries g = 1, beta = 0 (state unchanged). */
typedef struct {
    const float *q, *k, *v, *g, *beta, *state;
    float *y, *state_out;
    int64_t T, H, Dk, Dv;
} Gdn;

/* one token for one head: src and dst may be the same state */
static void gdn_token_portable(const float *src, float *dst, const float *q, const float *k,
                               const float *v, float g, float beta, float *y, int64_t Dk, int64_t Dv) {
    for (int64_t r = 0; r < Dv; r++) {
        const float *s = src + r * Dk;
        float *o = dst + r * Dk;
        float kv = 0;
        for (int64_t i = 0; i < Dk; i++) kv += s[i] * g * k[i];
        const float u = (v[r] - kv) * beta;
        float acc = 0;
        for (int64_t i = 0; i < Dk; i++) {
            o[i] = s[i] * g + k[i] * u;
            acc += o[i] * q[i];
        }
        y[r] = acc;
    }
}

#ifdef MIXBIT_X86
AVX512 static void gdn_token_avx512(const float *src, float *dst, const float *q, const float *k,
                                    const float *v, float gs, float beta, float *y, int64_t Dk,
                                    int64_t Dv) {
    const __m512 g = _mm512_set1_ps(gs);
    for (int64_t r = 0; r < Dv; r++) {
        const float *s = src + r * Dk;
        float *o = dst + r * Dk;
        __m512 kv = _mm512_setzero_ps();
        for (int64_t i = 0; i < Dk; i += 16)
            kv = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_loadu_ps(s + i), g), _mm512_loadu_ps(k + i), kv);
        const __m512 u = _mm512_set1_ps((v[r] - _mm512_reduce_add_ps(kv)) * beta);
        __m512 acc = _mm512_setzero_ps();
        for (int64_t i = 0; i < Dk; i += 16) {
            __m512 n = _mm512_fmadd_ps(_mm512_loadu_ps(k + i), u, _mm512_mul_ps(_mm512_loadu_ps(s + i), g));
            _mm512_storeu_ps(o + i, n);
            acc = _mm512_fmadd_ps(n, _mm512_loadu_ps(q + i), acc);
        }
        y[r] = _mm512_reduce_add_ps(acc);
    }
}
#endif

/* which gdn_token runs a head of Dk keys: 2 AVX-512, 1 AVX2, 0 portable */
static inline int gdn_simd(int64_t Dk) {
    return have_avx512 && Dk % 16 == 0 ? 2 : have_avx2 && Dk % 8 == 0;
}

static void gdn_part(const Job *j, int64_t u0, int64_t u1) {
    /* units u0..u1: (sequence, head) pairs, u = b * H + h */
    const Gdn *d = j->ctx;
    const int64_t T = d->T, H = d->H, Dk = d->Dk, Dv = d->Dv;
#ifdef MIXBIT_X86
    const int simd = gdn_simd(Dk);
#endif
    for (int64_t u = u0; u < u1; u++) {
        const int64_t b = u / H, h = u % H;
        const float *src = d->state + u * Dv * Dk;
        float *dst = d->state_out + u * Dv * Dk;
        for (int64_t t = 0; t < T; t++) {
            const int64_t i = (b * T + t) * H + h;
#ifdef MIXBIT_X86
            if (simd == 2)
                gdn_token_avx512(src, dst, d->q + i * Dk, d->k + i * Dk, d->v + i * Dv, d->g[i],
                                 d->beta[i], d->y + i * Dv, Dk, Dv);
            else if (simd)
                gdn_token_avx2(src, dst, d->q + i * Dk, d->k + i * Dk, d->v + i * Dv, d->g[i],
                               d->beta[i], d->y + i * Dv, Dk, Dv);
            else
#endif
                gdn_token_portable(src, dst, d->q + i * Dk, d->k + i * Dk, d->v + i * Dv, d->g[i],
                                   d->beta[i], d->y + i * Dv, Dk, Dv);
            src = dst;
        }
    }
}

/* ---------------------------------------------------------------- a whole GatedDeltaNet decode step */

/* One decode step (one token per sequence) of a GatedDeltaNet layer from its projections' outputs
 * to the input of out_proj, in one call: the causal depthwise convolution over the conv state and
 * the new token, its SiLU, q and k L2-normalised (q scaled by Dk^-1/2, as mlx-lm's normalize_qk),
 * the gates g = exp(-exp(A_log) softplus(a + dt_bias)) and beta = sigmoid(b), the delta rule (as
 * gdn_token), and the gated RMSNorm rms_norm(y) w silu(z). Writes the new conv state and the new
 * recurrent state beside y. Units are (sequence, value head) pairs; the q/k channels of a key
 * head shared by several value heads are convolved by each and stored by the first. */
typedef struct {
    const float *qkv, *z, *a, *b, *conv, *w, *A_log, *dt_bias, *state, *norm_w;
    float *y, *conv_out, *state_out;
    int64_t Hk, Hv, Dk, Dv, Kc, C;
    float eps, qk_eps;
} GdnStep;

static inline float silu1(float x) { return x / (1.0f + expf(-x)); }

/* the convolution of channels c0 .. c0 + n - 1 for sequence bi (the same sum order as
 * conv_rows), its SiLU into out[0 .. n-1], and (with `store`) the shifted conv state */
static void gdn_step_conv(const GdnStep *d, int64_t bi, int64_t c0, int64_t n, float *out, int store) {
    const int64_t K = d->Kc, C = d->C;
    const float *cs = d->conv + bi * (K - 1) * C, *x = d->qkv + bi * C;
    float *ns = d->conv_out + bi * (K - 1) * C;
    for (int64_t c = c0; c < c0 + n; c++) {
        float acc = (K > 1 ? cs[c] : x[c]) * d->w[c];
        for (int64_t i = 1; i < K; i++) acc += (i < K - 1 ? cs[i * C + c] : x[c]) * d->w[i * C + c];
        out[c - c0] = silu1(acc);
        if (store) {
            for (int64_t i = 0; i + 1 < K - 1; i++) ns[i * C + c] = cs[(i + 1) * C + c];
            if (K > 1) ns[(K - 2) * C + c] = x[c];
        }
    }
}

static void gdn_step_part(const Job *j, int64_t u0, int64_t u1) {
    const GdnStep *d = j->ctx;
    const int64_t Hk = d->Hk, Hv = d->Hv, Dk = d->Dk, Dv = d->Dv, rep = Hv / Hk;
    float q[512], k[512], v[512], y[512];
#ifdef MIXBIT_X86
    const int simd = gdn_simd(Dk);
#endif
    for (int64_t u = u0; u < u1; u++) {
        const int64_t bi = u / Hv, h = u % Hv, kh = h / rep, first = h % rep == 0;
        gdn_step_conv(d, bi, kh * Dk, Dk, q, first);
        gdn_step_conv(d, bi, Hk * Dk + kh * Dk, Dk, k, first);
        gdn_step_conv(d, bi, 2 * Hk * Dk + h * Dv, Dv, v, 1);
        const float inv = 1.0f / sqrtf((float)Dk), rms_eps = d->qk_eps * inv * inv;
        float sq = 0, sk = 0;
        for (int64_t i = 0; i < Dk; i++) sq += q[i] * q[i], sk += k[i] * k[i];
        const float fq = inv * inv / sqrtf(sq / Dk + rms_eps), fk = inv / sqrtf(sk / Dk + rms_eps);
        for (int64_t i = 0; i < Dk; i++) q[i] *= fq, k[i] *= fk;
        const float x = d->a[bi * Hv + h] + d->dt_bias[h];
        const float softplus = x > 20.0f ? x : log1pf(expf(x));
        const float g = expf(-expf(d->A_log[h]) * softplus);
        const float beta = 1.0f / (1.0f + expf(-d->b[bi * Hv + h]));
        const float *src = d->state + u * Dv * Dk;
        float *dst = d->state_out + u * Dv * Dk;
#ifdef MIXBIT_X86
        if (simd == 2)
            gdn_token_avx512(src, dst, q, k, v, g, beta, y, Dk, Dv);
        else if (simd)
            gdn_token_avx2(src, dst, q, k, v, g, beta, y, Dk, Dv);
        else
#endif
            gdn_token_portable(src, dst, q, k, v, g, beta, y, Dk, Dv);
        float ss = 0;
        for (int64_t r = 0; r < Dv; r++) ss += y[r] * y[r];
        const float norm = 1.0f / sqrtf(ss / Dv + d->eps);
        const float *z = d->z + bi * Hv * Dv + h * Dv;
        float *out = d->y + bi * Hv * Dv + h * Dv;
        for (int64_t r = 0; r < Dv; r++) out[r] = y[r] * norm * d->norm_w[r] * silu1(z[r]);
    }
}

/* ---------------------------------------------------------------- causal depthwise conv */

/* GatedDeltaNet's short convolution (Qwen3.5: kernel 4 over 6,144 channels) of a prompt:
 * y[b, t, c] = sum_i x[b, t + i, c] * w[i, c] for t < T, x holding T + K - 1 positions. MLX's
 * grouped conv1d took 0.65 s a layer for 8 x 300 tokens on one core here. */
typedef struct {
    const float *x, *w;
    float *y;
    int64_t T, Kc, C;
} Conv;

__attribute__((target_clones("avx512f", "avx2", "default")))
static void conv_rows(const Job *j, int64_t r0, int64_t r1) {
    /* rows r = b * T + t of the output */
    const Conv *d = j->ctx;
    const int64_t T = d->T, Kc = d->Kc, C = d->C;
    for (int64_t r = r0; r < r1; r++) {
        const int64_t b = r / T, t = r % T;
        const float *x = d->x + (b * (T + Kc - 1) + t) * C;
        float *restrict y = d->y + r * C;
        for (int64_t c = 0; c < C; c++) y[c] = x[c] * d->w[c];
        for (int64_t i = 1; i < Kc; i++) {
            const float *restrict xi = x + i * C, *restrict wi = d->w + i * C;
            for (int64_t c = 0; c < C; c++) y[c] += xi[c] * wi[c];
        }
    }
}

/* ---------------------------------------------------------------- SiLU */

/* silu(a) or silu(a) * b over n floats, for prompts (the gated RMSNorm of GatedDeltaNet, the
 * MLP's SwiGLU): MLX's Linux CPU build evaluates exp one float at a time (17.7 ms for 256 x
 * 6,144 values here, 0.5 ms for a multiply). exp by range reduction to [-ln2/2, ln2/2] and a
 * degree-6 polynomial (Cephes' expf coefficients), scaled by 2^n: within 2 ulp of expf. */
typedef struct {
    const float *a, *b;
    float *y;
    int64_t n;
} Act;

#define ACT_BLOCK 1024

static void act_scalar(const Act *d, int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; i++) d->y[i] = d->a[i] / (1.0f + expf(-d->a[i])) * (d->b ? d->b[i] : 1.0f);
}

#ifdef MIXBIT_X86
AVX512 static inline __m512 exp_avx512(__m512 x) {
    x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.3762626647949f)), _mm512_set1_ps(-87.3365447504f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500E-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507E-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073E-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894E-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459E-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201E-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(p, n);
}

AVX512 static void act_avx512(const Act *d, int64_t i0, int64_t i1) {
    int64_t i = i0;
    const __m512 one = _mm512_set1_ps(1.0f);
    for (; i + 16 <= i1; i += 16) {
        const __m512 a = _mm512_loadu_ps(d->a + i);
        __m512 y = _mm512_div_ps(a, _mm512_add_ps(one, exp_avx512(_mm512_sub_ps(_mm512_setzero_ps(), a))));
        if (d->b) y = _mm512_mul_ps(y, _mm512_loadu_ps(d->b + i));
        _mm512_storeu_ps(d->y + i, y);
    }
    act_scalar(d, i, i1);
}
#endif

static void act_part(const Job *j, int64_t u0, int64_t u1) {
    /* units of ACT_BLOCK floats */
    const Act *d = j->ctx;
    const int64_t i0 = u0 * ACT_BLOCK, i1 = u1 * ACT_BLOCK < d->n ? u1 * ACT_BLOCK : d->n;
#ifdef MIXBIT_X86
    if (have_avx512) {
        act_avx512(d, i0, i1);
        return;
    }
#endif
    act_scalar(d, i0, i1);
}

/* ---------------------------------------------------------------- log-sum-exp */

/* log(sum(exp(x))) of each row of a float32 [rows, n] matrix: the normalisation mlx-lm applies to
 * every row of logits at every decode step (248,320 values a row for Qwen3.5's vocabulary), where
 * MLX's Linux CPU build spends 9 ms a row on its one-value-at-a-time exp. The row's maximum first,
 * then sum(exp(x - max)) in 32 float32 lanes (the same exp as SiLU's), added in double at the end;
 * a row with a NaN gives NaN, one whose maximum is +-inf what the definition gives. */
typedef struct {
    const float *x;
    float *y;
    int64_t n;
} Lse;

static float lse_scalar(const float *x, int64_t n) {
    float m = -INFINITY;
    for (int64_t i = 0; i < n; i++) {
        if (x[i] != x[i]) return NAN;
        m = x[i] > m ? x[i] : m;
    }
    if (m == -INFINITY || m == INFINITY) {
        double s = 0.0; /* all -inf, or an inf: as the definition gives */
        for (int64_t i = 0; i < n; i++) s += exp((double)x[i]);
        return (float)log(s);
    }
    double s = 0.0;
    for (int64_t i = 0; i < n; i++) s += expf(x[i] - m);
    return m + (float)log(s);
}

#ifdef MIXBIT_X86
AVX512 static float lse_avx512(const float *x, int64_t n) {
    int64_t i = 0;
    __m512 vm = _mm512_set1_ps(-INFINITY);
    __mmask16 nan = 0;
    for (; i + 16 <= n; i += 16) {
        const __m512 v = _mm512_loadu_ps(x + i);
        nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
        vm = _mm512_max_ps(vm, v);
    }
    float m = _mm512_reduce_max_ps(vm);
    for (int64_t t = i; t < n; t++) m = x[t] > m ? x[t] : m;
    if (nan) return NAN;
    if (m == -INFINITY || m == INFINITY) return lse_scalar(x, n);
    const __m512 mv = _mm512_set1_ps(m);
    __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
    i = 0;
    for (; i + 32 <= n; i += 32) {
        acc0 = _mm512_add_ps(acc0, exp_avx512(_mm512_sub_ps(_mm512_loadu_ps(x + i), mv)));
        acc1 = _mm512_add_ps(acc1, exp_avx512(_mm512_sub_ps(_mm512_loadu_ps(x + i + 16), mv)));
    }
    for (; i + 16 <= n; i += 16) acc0 = _mm512_add_ps(acc0, exp_avx512(_mm512_sub_ps(_mm512_loadu_ps(x + i), mv)));
    float lanes[32];
    _mm512_storeu_ps(lanes, acc0);
    _mm512_storeu_ps(lanes + 16, acc1);
    double s = 0.0;
    for (int t = 0; t < 32; t++) s += lanes[t];
    for (; i < n; i++) s += expf(x[i] - m);
    return m + (float)log(s);
}
#endif

static void lse_rows(const Job *j, int64_t r0, int64_t r1) {
    const Lse *d = j->ctx;
    for (int64_t r = r0; r < r1; r++) {
#ifdef MIXBIT_X86
        if (have_avx512) {
            d->y[r] = lse_avx512(d->x + r * d->n, d->n);
            continue;
        }
#endif
        d->y[r] = lse_scalar(d->x + r * d->n, d->n);
    }
}

/* ---------------------------------------------------------------- the affine fit */

/* quant/formats.py's fit of a group's scale and bias (fit_affine there says what and why), the
 * same arithmetic in the same order: float32 throughout, every sum sequential over the group as
 * MLX's CPU reductions run, no contraction into FMAs, round half to even: the same codes, scales
 * and biases bit for bit (tests/test_quant_formats.py), and nothing written out between the steps
 * (tests/bench/fit_bench.py times both). FIT_LANES groups run side by side, one per vector lane, from a
 * transposed copy of their values, so a group's sums keep their order and still vectorize. */
#define FIT_LANES 8
#define FIT_MAX_GROUP 128

typedef struct {
    const float *x;       /* [G, group] */
    uint32_t *packed;     /* [G, group * bits / 32]: MLX's packing, group by group */
    float *scale, *bias;  /* [G]: bfloat16 values, as float32 */
    int64_t groups;
    int group, bits, reach;
} Fit;

static inline float bf16_round(float v) { /* float32 -> bfloat16 -> float32, as MLX rounds */
    uint32_t u;
    memcpy(&u, &v, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u)
        u = 0x7fc00000u;
    else
        u = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
    memcpy(&v, &u, 4);
    return v;
}

#define FOR_L for (int l = 0; l < FIT_LANES; l++)

/* The steps over a group's values, lane by lane (portable C) and with one AVX2 vector for the
 * lanes (GCC's vectorizer turns the portable loops inside out instead: in-order sums over a
 * group, 5x slower); min/max/blend keep the portable branches' results for zeros and ties. */
typedef struct {
    /* err = the squared error of each group coded with bf16(scale), bf16(bias) (rounded in place) */
    void (*score)(const float *xt, int gs, float nmax, float *scale, float *bias, float *err);
    /* q = the nearest codes of every value for (scale, bias), or (range) of (x - lo) * r */
    void (*codes)(const float *xt, int gs, float nmax, const float *scale, const float *bias, float *q);
    void (*range)(const float *xt, int gs, float nmax, const float *lo, const float *r, float *q);
    /* the sums of the least-squares fit of the codes q: sum q, sum q q, sum q x */
    void (*sums)(const float *xt, const float *q, int gs, float *sq, float *sqq, float *sqx);
    /* each group's least and largest value and its sum */
    void (*stats)(const float *xt, int gs, float *lo, float *hi, float *sx);
} FitSteps;

static inline float fit_code(float v, float nmax) {
    v = rintf(v);
    v = v > 0.0f ? v : 0.0f;
    return v < nmax ? v : nmax;
}

static void fit_round_lanes(float *scale, float *bias, float *den) {
    FOR_L {
        scale[l] = bf16_round(scale[l]);
        bias[l] = bf16_round(bias[l]);
        den[l] = scale[l] == 0.0f ? 1.0f : scale[l];
    }
}

static void score_c(const float *restrict xt, int gs, float nmax, float *restrict scale, float *restrict bias,
                    float *restrict err) {
    float den[FIT_LANES];
    fit_round_lanes(scale, bias, den);
    FOR_L err[l] = 0.0f;
    for (int i = 0; i < gs; i++) FOR_L {
        const float x = xt[i * FIT_LANES + l], d = scale[l] * fit_code((x - bias[l]) / den[l], nmax) + bias[l] - x;
        err[l] += d * d;
    }
}

static void codes_c(const float *restrict xt, int gs, float nmax, const float *restrict scale,
                    const float *restrict bias, float *restrict q) {
    for (int i = 0; i < gs; i++) FOR_L {
        const float den = scale[l] == 0.0f ? 1.0f : scale[l];
        q[i * FIT_LANES + l] = fit_code((xt[i * FIT_LANES + l] - bias[l]) / den, nmax);
    }
}

static void range_c(const float *restrict xt, int gs, float nmax, const float *restrict lo,
                    const float *restrict r, float *restrict q) {
    for (int i = 0; i < gs; i++) FOR_L q[i * FIT_LANES + l] = fit_code((xt[i * FIT_LANES + l] - lo[l]) * r[l], nmax);
}

static void sums_c(const float *restrict xt, const float *restrict q, int gs, float *restrict sq,
                   float *restrict sqq, float *restrict sqx) {
    FOR_L sq[l] = sqq[l] = sqx[l] = 0.0f;
    for (int i = 0; i < gs; i++) FOR_L {
        const float c = q[i * FIT_LANES + l];
        sq[l] += c;
        sqq[l] += c * c;
        sqx[l] += c * xt[i * FIT_LANES + l];
    }
}

static void stats_c(const float *restrict xt, int gs, float *restrict lo, float *restrict hi, float *restrict sx) {
    FOR_L {
        lo[l] = hi[l] = xt[l];
        sx[l] = 0.0f;
    }
    for (int i = 0; i < gs; i++) FOR_L {
        const float v = xt[i * FIT_LANES + l];
        lo[l] = v < lo[l] ? v : lo[l];
        hi[l] = v > hi[l] ? v : hi[l];
        sx[l] += v;
    }
}

#ifdef MIXBIT_X86
#define FIT_AVX2 __attribute__((target("avx2")))

FIT_AVX2 static inline __m256 code_avx2(__m256 v, __m256 top) {
    v = _mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    return _mm256_min_ps(_mm256_max_ps(v, _mm256_setzero_ps()), top);
}

FIT_AVX2 static void score_avx2(const float *xt, int gs, float nmax, float *scale, float *bias, float *err) {
    float den_l[FIT_LANES];
    fit_round_lanes(scale, bias, den_l);
    const __m256 s = _mm256_loadu_ps(scale), b = _mm256_loadu_ps(bias), den = _mm256_loadu_ps(den_l);
    const __m256 top = _mm256_set1_ps(nmax);
    __m256 e = _mm256_setzero_ps();
    for (int i = 0; i < gs; i++) {
        const __m256 x = _mm256_loadu_ps(xt + i * FIT_LANES);
        const __m256 c = code_avx2(_mm256_div_ps(_mm256_sub_ps(x, b), den), top);
        const __m256 d = _mm256_sub_ps(_mm256_add_ps(_mm256_mul_ps(s, c), b), x);
        e = _mm256_add_ps(e, _mm256_mul_ps(d, d));
    }
    _mm256_storeu_ps(err, e);
}

FIT_AVX2 static void codes_avx2(const float *xt, int gs, float nmax, const float *scale, const float *bias,
                                float *q) {
    const __m256 s = _mm256_loadu_ps(scale), b = _mm256_loadu_ps(bias), top = _mm256_set1_ps(nmax);
    const __m256 den = _mm256_blendv_ps(s, _mm256_set1_ps(1.0f), _mm256_cmp_ps(s, _mm256_setzero_ps(), _CMP_EQ_OQ));
    for (int i = 0; i < gs; i++)
        _mm256_storeu_ps(q + i * FIT_LANES,
                         code_avx2(_mm256_div_ps(_mm256_sub_ps(_mm256_loadu_ps(xt + i * FIT_LANES), b), den), top));
}

FIT_AVX2 static void range_avx2(const float *xt, int gs, float nmax, const float *lo, const float *r, float *q) {
    const __m256 l = _mm256_loadu_ps(lo), k = _mm256_loadu_ps(r), top = _mm256_set1_ps(nmax);
    for (int i = 0; i < gs; i++)
        _mm256_storeu_ps(q + i * FIT_LANES,
                         code_avx2(_mm256_mul_ps(_mm256_sub_ps(_mm256_loadu_ps(xt + i * FIT_LANES), l), k), top));
}

FIT_AVX2 static void sums_avx2(const float *xt, const float *q, int gs, float *sq, float *sqq, float *sqx) {
    __m256 a = _mm256_setzero_ps(), b = _mm256_setzero_ps(), c = _mm256_setzero_ps();
    for (int i = 0; i < gs; i++) {
        const __m256 v = _mm256_loadu_ps(q + i * FIT_LANES);
        a = _mm256_add_ps(a, v);
        b = _mm256_add_ps(b, _mm256_mul_ps(v, v));
        c = _mm256_add_ps(c, _mm256_mul_ps(v, _mm256_loadu_ps(xt + i * FIT_LANES)));
    }
    _mm256_storeu_ps(sq, a);
    _mm256_storeu_ps(sqq, b);
    _mm256_storeu_ps(sqx, c);
}

FIT_AVX2 static void stats_avx2(const float *xt, int gs, float *lo, float *hi, float *sx) {
    __m256 a = _mm256_loadu_ps(xt), b = a, c = _mm256_setzero_ps();
    for (int i = 0; i < gs; i++) {
        const __m256 v = _mm256_loadu_ps(xt + i * FIT_LANES);
        a = _mm256_min_ps(v, a);
        b = _mm256_max_ps(v, b);
        c = _mm256_add_ps(c, v);
    }
    _mm256_storeu_ps(lo, a);
    _mm256_storeu_ps(hi, b);
    _mm256_storeu_ps(sx, c);
}
#endif

static const FitSteps fit_portable = {score_c, codes_c, range_c, sums_c, stats_c};
static FitSteps fit_steps; /* fit_pick sets it at import */

/* the steps this CPU runs: AVX2 where it has it, unless `portable` */
static void fit_pick(int portable) {
    fit_steps = fit_portable;
#ifdef MIXBIT_X86
    if (!portable && __builtin_cpu_supports("avx2"))
        fit_steps = (FitSteps){score_avx2, codes_avx2, range_avx2, sums_avx2, stats_avx2};
#endif
}

/* the least-squares scale and bias of the codes q (span / nmax and lo where they are degenerate) */
static void fit_solve(const float *xt, const float *q, int gs, float nmax, const float *sx, const float *lo,
                      const float *span, float *scale, float *bias) {
    float sq[FIT_LANES], sqq[FIT_LANES], sqx[FIT_LANES];
    fit_steps.sums(xt, q, gs, sq, sqq, sqx);
    const float n = (float)gs;
    FOR_L {
        float det = n * sqq[l] - sq[l] * sq[l];
        const int ok = det > 0.0f;
        det = ok ? det : 1.0f;
        const float s = (n * sqx[l] - sq[l] * sx[l]) / det, b = (sqq[l] * sx[l] - sq[l] * sqx[l]) / det;
        scale[l] = ok ? s : span[l] / nmax;
        bias[l] = ok ? b : lo[l];
    }
}

static void fit_keep_better(float *be, float *bs, float *bb, const float *e, const float *s, const float *b) {
    FOR_L if (e[l] < be[l]) {
        be[l] = e[l];
        bs[l] = s[l];
        bb[l] = b[l];
    }
}

/* groups g0 .. g0 + FIT_LANES - 1 (`lanes` of them real: the rest repeat the first) */
static void fit_block(const Fit *f, int64_t g0, int lanes) {
    const int gs = f->group, bits = f->bits;
    const float nmax = (float)((1 << bits) - 1);
    float xt[FIT_MAX_GROUP * FIT_LANES], q[FIT_MAX_GROUP * FIT_LANES];
    float lo[FIT_LANES], hi[FIT_LANES], span[FIT_LANES], sx[FIT_LANES], flat[FIT_LANES];
    float be[FIT_LANES], bs[FIT_LANES], bb[FIT_LANES], e[FIT_LANES], s[FIT_LANES], b[FIT_LANES];
    FOR_L {
        const int64_t g = g0 + (l < lanes ? l : 0);
        const float *x = f->x + g * gs;
        for (int i = 0; i < gs; i++) xt[i * FIT_LANES + l] = x[i];
    }
    fit_steps.stats(xt, gs, lo, hi, sx);
    FOR_L { /* mx.quantize's scale and bias: one edge of the group exact, the scale's sign by it */
        const int at_min = fabsf(lo[l]) > fabsf(hi[l]);
        float scale = (hi[l] - lo[l]) / nmax;
        scale = scale > 1e-7f ? scale : 1e-7f;
        scale = at_min ? scale : -scale;
        const float edge = at_min ? lo[l] : hi[l], q0 = rintf(edge / scale);
        bs[l] = q0 != 0.0f ? edge / q0 : scale;
        bb[l] = q0 != 0.0f ? edge : 0.0f;
    }
    FOR_L {
        span[l] = hi[l] - lo[l];
        flat[l] = span[l] <= 0.0f;
        span[l] = flat[l] ? 1.0f : span[l];
    }
    fit_steps.score(xt, gs, nmax, bs, bb, be); /* mx.quantize's own choice */
    fit_steps.codes(xt, gs, nmax, bs, bb, q); /* then the least-squares refit of its codes */
    fit_solve(xt, q, gs, nmax, sx, lo, span, s, b);
    fit_steps.score(xt, gs, nmax, s, b, e);
    fit_keep_better(be, bs, bb, e, s, b);
    for (int k = -f->reach; k <= f->reach && f->reach > 0; k++) { /* ranges around min..max */
        const float steps = (float)((double)nmax + 0.1 * k);
        float r[FIT_LANES];
        FOR_L r[l] = steps / span[l];
        fit_steps.range(xt, gs, nmax, lo, r, q);
        fit_solve(xt, q, gs, nmax, sx, lo, span, s, b);
        fit_steps.score(xt, gs, nmax, s, b, e);
        fit_keep_better(be, bs, bb, e, s, b);
    }
    fit_steps.codes(xt, gs, nmax, bs, bb, q);
    const int words = gs * bits / 32;
    for (int l = 0; l < lanes; l++) { /* each group's codes as a little-endian bit stream */
        uint32_t *w = f->packed + (g0 + l) * words;
        uint64_t acc = 0;
        int have = 0;
        const uint32_t keep = flat[l] ? 0u : 0xffffffffu;
        for (int i = 0; i < gs; i++) {
            acc |= (uint64_t)((uint32_t)q[i * FIT_LANES + l] & keep) << have;
            have += bits;
            if (have >= 32) {
                *w++ = (uint32_t)acc;
                acc >>= 32;
                have -= 32;
            }
        }
        const int64_t g = g0 + l;
        f->scale[g] = flat[l] ? 0.0f : bs[l];
        f->bias[g] = flat[l] ? lo[l] : bb[l];
    }
}

static void fit_part(const Job *j, int64_t u0, int64_t u1) {
    const Fit *f = j->ctx;
    for (int64_t u = u0; u < u1; u++) {
        const int64_t g0 = u * FIT_LANES, left = f->groups - g0;
        fit_block(f, g0, left < FIT_LANES ? (int)left : FIT_LANES);
    }
}

/* ---------------------------------------------------------------- thread pool */

static int n_threads = 1;
static pthread_t workers[MAX_THREADS];
static pthread_mutex_t pool_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t pool_cv = PTHREAD_COND_INITIALIZER;
static pthread_mutex_t run_mu = PTHREAD_MUTEX_INITIALIZER; /* one job at a time */
static atomic_uint_fast64_t generation = 0;
static atomic_int remaining = 0;
static const Job *cur_job;
static RowsFn cur_fn;
static int64_t cur_block;
static atomic_int_fast64_t next_block;
static int pool_started = 0;
static int spin_us = 50;

static double now_us(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e6 + ts.tv_nsec / 1e3;
}

static int64_t cur_lo, cur_hi;

static void work(void) {
    /* output rows in blocks, taken in turn: a thread that started late takes fewer */
    for (;;) {
        int64_t b = atomic_fetch_add(&next_block, 1);
        int64_t n0 = cur_lo + b * cur_block;
        if (n0 >= cur_hi) break;
        int64_t n1 = n0 + cur_block < cur_hi ? n0 + cur_block : cur_hi;
        cur_fn(cur_job, n0, n1);
    }
}

static void *worker_main(void *arg) {
    (void)arg;
    uint64_t seen = 0;
    for (;;) {
        /* spin briefly (decode calls come back to back), then sleep */
        double until = now_us() + spin_us;
        while (atomic_load(&generation) == seen && now_us() < until) {
#ifdef MIXBIT_X86
            _mm_pause();
#endif
        }
        if (atomic_load(&generation) == seen) {
            pthread_mutex_lock(&pool_mu);
            while (atomic_load(&generation) == seen) pthread_cond_wait(&pool_cv, &pool_mu);
            pthread_mutex_unlock(&pool_mu);
        }
        seen = atomic_load(&generation);
        work();
        atomic_fetch_sub(&remaining, 1);
    }
    return NULL;
}

static void start_pool(int threads) {
    if (threads < 1) threads = 1;
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    n_threads = threads;
    for (int i = 1; i < n_threads; i++) {
        if (pthread_create(&workers[i], NULL, worker_main, NULL) != 0) {
            n_threads = i;
            break;
        }
        pthread_detach(workers[i]);
    }
    pool_started = 1;
}

static void run_range(const Job *j, RowsFn fn, int64_t lo, int64_t hi) {
    const int64_t N = hi - lo;
    /* small products (a few thousand rows of work) are not worth waking anyone */
    int64_t work_units = N * j->K * (j->M < ROWS ? j->M : ROWS);
    if (n_threads <= 1 || (work_units < (1 << 18) && !j->xparts && !j->x16 && !j->xq)) { /* tile and panel jobs: N counts panels */
        fn(j, lo, hi);
        return;
    }
    pthread_mutex_lock(&run_mu);
    cur_job = j;
    cur_fn = fn;
    cur_lo = lo;
    cur_hi = hi;
    const int64_t block = N / (n_threads * 8), min_block = j->min_block > 0 ? j->min_block : 16;
    cur_block = block < min_block ? min_block : block;
    atomic_store(&next_block, 0);
    atomic_store(&remaining, n_threads - 1);
    pthread_mutex_lock(&pool_mu);
    atomic_fetch_add(&generation, 1);
    pthread_cond_broadcast(&pool_cv);
    pthread_mutex_unlock(&pool_mu);
    work();
    while (atomic_load(&remaining) > 0) {
#ifdef MIXBIT_X86
        _mm_pause();
#endif
    }
    pthread_mutex_unlock(&run_mu);
}

static void run(const Job *j, RowsFn fn) { run_range(j, fn, 0, j->N); }

/* ---------------------------------------------------------------- Python */

static int get_buf(PyObject *o, Py_buffer *b, int writable, const char *what) {
    int flags = PyBUF_C_CONTIGUOUS | (writable ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(o, b, flags) != 0) {
        PyErr_Format(PyExc_ValueError, "%s: a C-contiguous%s buffer is required", what,
                     writable ? " writable" : "");
        return -1;
    }
    if (!PyBuffer_IsContiguous(b, 'C')) { /* some exporters ignore the flag */
        PyBuffer_Release(b);
        PyErr_Format(PyExc_ValueError, "%s: a C-contiguous buffer is required", what);
        return -1;
    }
    return 0;
}

/* a pass over rows m0 .. m0 + chunk - 1 of a job (fewer at the end): x and out from row m0 on */
static inline Job rows_chunk(const Job *j, int64_t m0, int64_t chunk) {
    Job c = *j;
    c.x = j->x + m0 * j->K;
    c.out = j->out + m0 * j->N;
    c.M = j->M - m0 < chunk ? j->M - m0 : chunk;
    c.min_block = 1;
    return c;
}

static PyObject *py_matmul(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *ox, *ow, *os, *ob, *oo;
    long long M, N, K;
    int bits, group, mode = 0;
    if (!PyArg_ParseTuple(args, "OOOOOLLLii|i", &ox, &ow, &os, &ob, &oo, &M, &N, &K, &bits, &group,
                          &mode))
        return NULL;
    if (mode < 0 || mode > 5)
        return PyErr_Format(PyExc_ValueError, "mode must be 0 (float), 1 (int16), 2 (BLAS), 3 (tiles), 4 "
                            "(int16 panels) or 5 (int8 panels), not %d", mode);
    if ((mode == 4 || mode == 5) && !have_vnni)
        return PyErr_Format(PyExc_RuntimeError, "the panel modes need AVX-512 VNNI, which this CPU does not offer");
    if ((mode == 4 || mode == 5) && (bits == 16 || N % 64 || K % 64 || (group != 32 && group != 64 && group != 128)))
        return PyErr_Format(PyExc_ValueError, "the panel mode needs affine weights, N a multiple of %d, K of 64 "
                            "and a group of 32, 64 or 128 (N=%lld K=%lld bits=%d group=%d)", 64, N, K,
                            bits, group);
    if (mode == 3 && !have_amx)
        return PyErr_Format(PyExc_RuntimeError, "the tile mode needs AMX (amx-tile, amx-bf16), which this CPU "
                            "or kernel does not offer");
    if (mode == 3 && (N % 32 || K % 64 || (bits != 16 && (group < 32 || (group & (group - 1))))))
        return PyErr_Format(PyExc_ValueError, "the tile mode needs N a multiple of 32, K of 64 and a group of "
                            "32, 64 or 128 (N=%lld K=%lld group=%d)", N, K, group);
    if (mode == 2 && !sgemm) {
        sgemm = (SgemmFn)dlsym(RTLD_DEFAULT, "cblas_sgemm");
        if (!sgemm)
            return PyErr_Format(PyExc_RuntimeError, "no cblas_sgemm loaded in this process");
    }
    const int int8 = mode == 1;
    if (M < 1 || N < 1 || K < 1)
        return PyErr_Format(PyExc_ValueError, "bad shape M=%lld N=%lld K=%lld", M, N, K);
    int affine = bits != 16;
    if (affine && !(bits == 2 || bits == 3 || bits == 4 || bits == 5 || bits == 6 || bits == 8))
        return PyErr_Format(PyExc_ValueError, "bits must be 2, 3, 4, 5, 6, 8 or 16, not %d", bits);
    if (affine && (group < 16 || K % group || (K * bits) % 32))
        return PyErr_Format(PyExc_ValueError, "group %d does not divide K=%lld", group, K);
    Py_buffer bx, bw, bs = {0}, bb = {0}, bo;
    if (get_buf(ox, &bx, 0, "x")) return NULL;
    if (get_buf(ow, &bw, 0, "w")) goto fail_x;
    if (affine && get_buf(os, &bs, 0, "scales")) goto fail_w;
    if (affine && get_buf(ob, &bb, 0, "biases")) goto fail_s;
    if (get_buf(oo, &bo, 1, "out")) goto fail_b;
    Py_ssize_t wbytes = affine ? (Py_ssize_t)(N * K * bits / 8) : (Py_ssize_t)(N * K * 2);
    /* scales and biases as float32 or bfloat16 (both the same type) */
    const Py_ssize_t sgroups = affine ? (Py_ssize_t)(N * (K / group)) : 0;
    const int sbf = affine && bs.len == 2 * sgroups;
    if (bx.len != (Py_ssize_t)(M * K * 4) || bw.len != wbytes || bo.len != (Py_ssize_t)(M * N * 4) ||
        (affine && ((bs.len != 4 * sgroups && bs.len != 2 * sgroups) || bb.len != bs.len))) {
        PyErr_Format(PyExc_ValueError,
                     "buffer sizes do not match M=%lld N=%lld K=%lld bits=%d group=%d "
                     "(x %zd, w %zd, out %zd bytes; scales and biases float32 or bfloat16, %zd and %zd bytes)",
                     M, N, K, bits, group, bx.len, bw.len, bo.len, bs.len, bb.len);
        goto fail_o;
    }
    float *xsum = NULL, *xscale = NULL;
    int8_t *x8 = NULL;
    int use_int8 = int8 && affine && have_vnni && K % 64 == 0 && group >= 32 &&
                   (group & (group - 1)) == 0;
    if (affine && mode < 2) {
        const int64_t ng = K / group;
        xsum = PyMem_RawMalloc((size_t)(M * ng) * sizeof(float));
        if (use_int8) {
            xscale = PyMem_RawMalloc((size_t)(M * ng) * sizeof(float));
            x8 = PyMem_RawMalloc((size_t)(2 * M * K)); /* the high bytes [M, K], then the low */
        }
        if (!xsum || (use_int8 && (!xscale || !x8))) {
            PyMem_RawFree(xsum); PyMem_RawFree(xscale); PyMem_RawFree(x8);
            PyErr_NoMemory();
            goto fail_o;
        }
        const float *x = bx.buf;
        for (int64_t m = 0; m < M; m++)
            for (int64_t gi = 0; gi < ng; gi++) {
                const float *xg = x + m * K + gi * group;
                float s = 0, amax = 0;
                for (int k = 0; k < group; k++) {
                    s += xg[k];
                    float a = xg[k] < 0 ? -xg[k] : xg[k];
                    amax = a > amax ? a : amax;
                }
                xsum[m * ng + gi] = s;
                if (use_int8) {
                    /* x16 = round(x / d), |x16| <= 32512 = 127 * 256, as 256 h + l (vnni_block) */
                    const float inv = amax > 0 ? 32512.0f / amax : 0.0f;
                    xscale[m * ng + gi] = amax / 32512.0f;
                    int8_t *h = x8 + m * K + gi * group, *l = x8 + M * K + m * K + gi * group;
                    for (int k = 0; k < group; k++) {
                        long v = lrintf(xg[k] * inv);
                        v = v > 32512 ? 32512 : (v < -32512 ? -32512 : v);
                        const long hi = (v + 128) >> 8;
                        h[k] = (int8_t)hi;
                        l[k] = (int8_t)(v - 256 * hi);
                    }
                }
            }
    }
    Job j = {bx.buf, bw.buf, affine ? bs.buf : NULL, affine ? bb.buf : NULL, bo.buf, xsum, x8,
             xscale, NULL, 0, NULL, M, N, K, bits, group};
    j.sbf = sbf;
#ifdef MIXBIT_X86
    if (mode == 5) {
        /* as mode 4, with x as 8-bit integers */
        const int64_t mc = M < PANEL_MCHUNK ? M : PANEL_MCHUNK, ng = K / group;
        int8_t *xq = tile_buffer(0, (size_t)(mc * K));
        float *xsd = tile_buffer(1, (size_t)(2 * mc * ng) * sizeof(float));
        if (!xq || !xsd) { PyErr_NoMemory(); goto fail_o; }
        Py_BEGIN_ALLOW_THREADS
        for (int64_t m0 = 0; m0 < M; m0 += PANEL_MCHUNK) {
            Job jc = rows_chunk(&j, m0, PANEL_MCHUNK);
            jc.xq = xq;
            jc.xsum = xsd;
            jc.xscale = xsd + mc * ng;
            run_range(&jc, panel8_prep_x, 0, jc.M);
            run_range(&jc, rows_panel8, 0, N / PANEL_COLS);
        }
        Py_END_ALLOW_THREADS
    } else
    if (mode == 4) {
        /* up to PANEL_MCHUNK rows at a time: x16, its units and sums in buffers kept per thread */
        const int64_t mc = M < PANEL_MCHUNK ? M : PANEL_MCHUNK, ng = K / group;
        int16_t *x16 = tile_buffer(0, (size_t)(mc * K) * sizeof(int16_t));
        float *xsd = tile_buffer(1, (size_t)(2 * mc * ng) * sizeof(float));
        if (!x16 || !xsd) { PyErr_NoMemory(); goto fail_o; }
        Py_BEGIN_ALLOW_THREADS
        for (int64_t m0 = 0; m0 < M; m0 += PANEL_MCHUNK) {
            Job jc = rows_chunk(&j, m0, PANEL_MCHUNK);
            jc.x16 = x16;
            jc.xsum = xsd;
            jc.xscale = xsd + mc * ng;
            run_range(&jc, panel_prep_x, 0, jc.M);
            run_range(&jc, rows_panel, 0, N / PANEL_COLS);
        }
        Py_END_ALLOW_THREADS
    } else
    if (mode == 3) {
        /* prompts of up to TILE_MCHUNK rows at a time: x's parts and sums for one chunk, in
         * buffers kept per thread (a fresh mapping per call cost its page faults every time) */
        const int64_t mc = M < TILE_MCHUNK ? M : TILE_MCHUNK;
        const int64_t Mp = tile_rows_padded(mc);
        const int64_t ng = affine ? K / group : 1, panels = tile_panel_blocks(K);
        uint32_t *xp = tile_buffer(0, (size_t)(3 * Mp * K) * sizeof(uint16_t));
        float *xsum_t = tile_buffer(1, (size_t)(ng * Mp) * sizeof(float));
        if (!xp || !xsum_t) { PyErr_NoMemory(); goto fail_o; }
        Py_BEGIN_ALLOW_THREADS
        for (int64_t m0 = 0; m0 < M; m0 += TILE_MCHUNK) {
            Job jc = rows_chunk(&j, m0, TILE_MCHUNK);
            jc.Mp = tile_rows_padded(jc.M);
            jc.xparts = xp;
            jc.gsum = xsum_t;
            run_range(&jc, tiles_split_x, 0, jc.Mp / 16);
            run_range(&jc, rows_tiles, 0, (N / TILE_COLS + panels - 1) / panels);
        }
        Py_END_ALLOW_THREADS
    } else
#endif
    if (mode == 2) {
        /* dequantize tiles of at most DEQ_TILE_BYTES on the pool, multiply each with BLAS; the
         * tile's buffer is kept by the calling thread (a fresh one per call came from a fresh
         * mapping, and its page faults cost ~40% of a prompt's product at 0.8B widths) */
        int64_t tile = DEQ_TILE_BYTES / (4 * K);
        tile = tile < 8 ? 8 : (tile > N ? N : tile);
#ifdef MIXBIT_X86
        j.deq_dst = tile_buffer(0, (size_t)(tile * K) * sizeof(float));
#else
        j.deq_dst = PyMem_RawMalloc((size_t)(tile * K) * sizeof(float));
#endif
        if (!j.deq_dst) { PyErr_NoMemory(); goto fail_o; }
        Py_BEGIN_ALLOW_THREADS
        for (int64_t n0 = 0; n0 < N; n0 += tile) {
            const int64_t nt = N - n0 < tile ? N - n0 : tile;
            j.deq_row0 = n0;
            run_range(&j, deq_part, n0, n0 + nt);
            sgemm(101, 111, 112, (int)M, (int)nt, (int)K, 1.0f, bx.buf, (int)K, j.deq_dst, (int)K,
                  0.0f, (float *)bo.buf + n0, (int)N);
        }
        Py_END_ALLOW_THREADS
#ifndef MIXBIT_X86
        PyMem_RawFree(j.deq_dst);
#endif
    } else {
        const char *name;
        RowsFn fn = choose(&j, &name);
        Py_BEGIN_ALLOW_THREADS
        run(&j, fn);
        Py_END_ALLOW_THREADS
    }
    PyMem_RawFree(xsum);
    PyMem_RawFree(xscale);
    PyMem_RawFree(x8);
    PyBuffer_Release(&bo);
    if (affine) { PyBuffer_Release(&bb); PyBuffer_Release(&bs); }
    PyBuffer_Release(&bw);
    PyBuffer_Release(&bx);
    Py_RETURN_NONE;
fail_o:
    PyBuffer_Release(&bo);
fail_b:
    if (affine) PyBuffer_Release(&bb);
fail_s:
    if (affine) PyBuffer_Release(&bs);
fail_w:
    PyBuffer_Release(&bw);
fail_x:
    PyBuffer_Release(&bx);
    return NULL;
}


/* float32 buffers for the element-wise kernels: objs[i] must hold sizes[i] floats; the ones from
 * `first_out` on are written. Returns how many were acquired (all of them, n, when no error is
 * set); release that many. */
static int float_bufs(PyObject **objs, const Py_ssize_t *sizes, const char **names, int n, int first_out,
                      Py_buffer *bufs) {
    int got = 0;
    for (; got < n; got++) {
        if (get_buf(objs[got], &bufs[got], got >= first_out, names[got])) return got;
        if (bufs[got].len != sizes[got] * 4) {
            PyErr_Format(PyExc_ValueError, "%s: %zd bytes, expected %zd", names[got], bufs[got].len,
                         sizes[got] * 4);
            return got + 1;
        }
    }
    return got;
}

/* `units` pieces of work of `unit_work` each (for the pool's threshold), `min_block` at a time */
static void run_units(const void *ctx, RowsFn fn, int64_t units, int64_t unit_work, int64_t min_block) {
    Job j;
    memset(&j, 0, sizeof j);
    j.ctx = ctx;
    j.M = 1;
    j.N = units;
    j.K = unit_work;
    j.min_block = min_block;
    Py_BEGIN_ALLOW_THREADS
    run(&j, fn);
    Py_END_ALLOW_THREADS
}

static PyObject *release_bufs(Py_buffer *bufs, int got) {
    for (int i = 0; i < got; i++) PyBuffer_Release(&bufs[i]);
    if (PyErr_Occurred()) return NULL;
    Py_RETURN_NONE;
}

static PyObject *py_gated_delta_scan(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *objs[8];
    long long B, T, H, Dk, Dv;
    if (!PyArg_ParseTuple(args, "OOOOOOOOLLLLL", &objs[0], &objs[1], &objs[2], &objs[3], &objs[4], &objs[5],
                          &objs[6], &objs[7], &B, &T, &H, &Dk, &Dv))
        return NULL;
    if (B < 1 || T < 1 || H < 1 || Dk < 1 || Dv < 1)
        return PyErr_Format(PyExc_ValueError, "bad shape B=%lld T=%lld H=%lld Dk=%lld Dv=%lld", B, T, H,
                            Dk, Dv);
    const Py_ssize_t BTH = B * T * H, BH = B * H;
    const Py_ssize_t sizes[8] = {BTH * Dk, BTH * Dk, BTH * Dv, BTH, BTH, BH * Dv * Dk, BTH * Dv, BH * Dv * Dk};
    const char *names[8] = {"q", "k", "v", "g", "beta", "state", "y", "state_out"};
    Py_buffer bufs[8];
    const int got = float_bufs(objs, sizes, names, 8, 6, bufs);
    if (!PyErr_Occurred()) {
        Gdn d = {bufs[0].buf, bufs[1].buf, bufs[2].buf, bufs[3].buf, bufs[4].buf, bufs[5].buf,
                 bufs[6].buf, bufs[7].buf, T, H, Dk, Dv};
        run_units(&d, gdn_part, BH, T * Dk * Dv, 1); /* a head is a lot of work: one by one */
    }
    return release_bufs(bufs, got);
}

static PyObject *py_gdn_decode_step(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *objs[13];
    long long B, Hk, Hv, Dk, Dv, Kc;
    double eps, qk_eps;
    if (!PyArg_ParseTuple(args, "OOOOOOOOOOOOOLLLLLLdd", &objs[0], &objs[1], &objs[2], &objs[3], &objs[4],
                          &objs[5], &objs[6], &objs[7], &objs[8], &objs[9], &objs[10], &objs[11], &objs[12],
                          &B, &Hk, &Hv, &Dk, &Dv, &Kc, &eps, &qk_eps))
        return NULL;
    if (B < 1 || Hk < 1 || Hv < Hk || Hv % Hk || Dk < 1 || Dv < 1 || Dk > 512 || Dv > 512 || Kc < 1)
        return PyErr_Format(PyExc_ValueError, "bad shape B=%lld Hk=%lld Hv=%lld Dk=%lld Dv=%lld K=%lld", B, Hk,
                            Hv, Dk, Dv, Kc);
    const Py_ssize_t C = 2 * Hk * Dk + Hv * Dv, S = B * Hv * Dv * Dk, CS = B * (Kc - 1) * C;
    const Py_ssize_t sizes[13] = {B * C, B * Hv * Dv, B * Hv, B * Hv, CS, Kc * C, Hv, Hv, S, Dv,
                                  B * Hv * Dv, CS, S};
    const char *names[13] = {"qkv", "z", "a", "b", "conv", "w", "A_log", "dt_bias", "state", "norm_w",
                             "y", "conv_out", "state_out"};
    Py_buffer bufs[13];
    /* a kernel of 1 keeps no conv state: its buffers may be empty */
    const int got = float_bufs(objs, sizes, names, 13, 10, bufs);
    if (!PyErr_Occurred()) {
        GdnStep d = {bufs[0].buf, bufs[1].buf, bufs[2].buf, bufs[3].buf, bufs[4].buf, bufs[5].buf, bufs[6].buf,
                     bufs[7].buf, bufs[8].buf, bufs[9].buf, bufs[10].buf, bufs[11].buf, bufs[12].buf,
                     Hk, Hv, Dk, Dv, Kc, C, (float)eps, (float)qk_eps};
        run_units(&d, gdn_step_part, B * Hv, Dk * Dv, 1);
    }
    return release_bufs(bufs, got);
}

static PyObject *py_depthwise_conv(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *objs[3];
    long long B, T, Kc, C;
    if (!PyArg_ParseTuple(args, "OOOLLLL", &objs[0], &objs[1], &objs[2], &B, &T, &Kc, &C)) return NULL;
    if (B < 1 || T < 1 || Kc < 1 || C < 1)
        return PyErr_Format(PyExc_ValueError, "bad shape B=%lld T=%lld K=%lld C=%lld", B, T, Kc, C);
    const Py_ssize_t sizes[3] = {B * (T + Kc - 1) * C, Kc * C, B * T * C};
    const char *names[3] = {"x", "w", "y"};
    Py_buffer bufs[3];
    const int got = float_bufs(objs, sizes, names, 3, 2, bufs);
    if (!PyErr_Occurred()) {
        Conv d = {bufs[0].buf, bufs[1].buf, bufs[2].buf, T, Kc, C};
        run_units(&d, conv_rows, B * T, Kc * C, 4);
    }
    return release_bufs(bufs, got);
}

static PyObject *py_silu(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *oa, *ob, *oy;
    long long n;
    if (!PyArg_ParseTuple(args, "OOOL", &oa, &ob, &oy, &n)) return NULL;
    if (n < 1) return PyErr_Format(PyExc_ValueError, "bad size n=%lld", n);
    const int has_b = ob != Py_None;
    PyObject *objs[3] = {oa, has_b ? ob : oa, oy};
    const Py_ssize_t sizes[3] = {n, n, n};
    const char *names[3] = {"a", "b", "y"};
    Py_buffer bufs[3];
    const int got = float_bufs(objs, sizes, names, 3, 2, bufs);
    if (!PyErr_Occurred()) {
        Act d = {bufs[0].buf, has_b ? bufs[1].buf : NULL, bufs[2].buf, n};
        run_units(&d, act_part, (n + ACT_BLOCK - 1) / ACT_BLOCK, ACT_BLOCK, 8);
    }
    return release_bufs(bufs, got);
}

static PyObject *py_logsumexp(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *objs[2];
    long long rows, n;
    if (!PyArg_ParseTuple(args, "OOLL", &objs[0], &objs[1], &rows, &n)) return NULL;
    if (rows < 1 || n < 1) return PyErr_Format(PyExc_ValueError, "bad shape rows=%lld n=%lld", rows, n);
    const Py_ssize_t sizes[2] = {rows * n, rows};
    const char *names[2] = {"x", "y"};
    Py_buffer bufs[2];
    const int got = float_bufs(objs, sizes, names, 2, 1, bufs);
    if (!PyErr_Occurred()) {
        Lse d = {bufs[0].buf, bufs[1].buf, n};
        run_units(&d, lse_rows, rows, n, 1);
    }
    return release_bufs(bufs, got);
}

static PyObject *py_fit_affine(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *objs[4];
    long long groups;
    int group, bits, reach;
    if (!PyArg_ParseTuple(args, "OOOOLiii", &objs[0], &objs[1], &objs[2], &objs[3], &groups, &group, &bits, &reach))
        return NULL;
    if (groups < 1 || group < 32 || group > FIT_MAX_GROUP || group % 32 || bits < 1 || bits > 8 || reach < 0)
        return PyErr_Format(PyExc_ValueError, "bad fit: groups=%lld group=%d bits=%d reach=%d", groups, group,
                            bits, reach);
    const Py_ssize_t sizes[4] = {groups * group, groups * group * bits / 32, groups, groups};
    const char *names[4] = {"x", "packed", "scales", "biases"};
    Py_buffer bufs[4];
    const int got = float_bufs(objs, sizes, names, 4, 1, bufs);
    if (!PyErr_Occurred()) {
        Fit d = {bufs[0].buf, bufs[1].buf, bufs[2].buf, bufs[3].buf, groups, group, bits, reach};
        run_units(&d, fit_part, (groups + FIT_LANES - 1) / FIT_LANES, FIT_LANES * group * 64, 16);
    }
    return release_bufs(bufs, got);
}

static PyObject *py_info(PyObject *self, PyObject *noargs) {
    (void)self; (void)noargs;
    return Py_BuildValue("{s:s,s:i,s:i,s:O,s:O}", "isa", have_avx512 ? "avx512-vbmi" : have_avx2 ? "avx2" : "portable",
                         "threads", n_threads, "rows_per_pass", ROWS, "vnni",
                         have_vnni ? Py_True : Py_False, "tiles", have_amx ? Py_True : Py_False);
}

static PyObject *py_set_threads(PyObject *self, PyObject *args) {
    (void)self;
    int t;
    if (!PyArg_ParseTuple(args, "i", &t)) return NULL;
    if (pool_started) {
        if (t != n_threads)
            return PyErr_Format(PyExc_RuntimeError, "the pool already runs %d threads", n_threads);
        Py_RETURN_NONE;
    }
    start_pool(t);
    Py_RETURN_NONE;
}

/* The instruction sets the kernels use: at most `level` (0 portable C, 1 AVX2, 2 all this CPU
 * has), so tests check every path a CPU can run */
static void use_isa(int level) {
#ifdef MIXBIT_X86
    have_avx512 = level >= 2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                  __builtin_cpu_supports("avx512vbmi") && __builtin_cpu_supports("avx512vl");
    have_vnni = have_avx512 && __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512dq");
    have_amx = have_avx512 && amx_enable();
    have_avx2 = level >= 1 && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#endif
    fit_pick(level == 0);
}

static PyObject *py_force_portable(PyObject *self, PyObject *args) {
    (void)self;
    int on;
    if (!PyArg_ParseTuple(args, "p", &on)) return NULL;
    use_isa(on ? 0 : 2);
    Py_RETURN_NONE;
}

static PyObject *py_force_isa(PyObject *self, PyObject *args) {
    (void)self;
    const char *name;
    if (!PyArg_ParseTuple(args, "s", &name)) return NULL;
    const int level = !strcmp(name, "portable") ? 0 : !strcmp(name, "avx2") ? 1 : !strcmp(name, "native") ? 2 : -1;
    if (level < 0) return PyErr_Format(PyExc_ValueError, "isa must be portable, avx2 or native, not %s", name);
    use_isa(level);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"matmul", py_matmul, METH_VARARGS,
     "matmul(x, w, scales, biases, out, M, N, K, bits, group, mode=0): out[M,N] = x[M,K] @ W^T "
     "for MLX packed W (bits 2-8, affine, float32 or bfloat16 scales/biases) or bfloat16 W (bits 16). mode 0: "
     "float32 FMAs on the packed weights; 1: activations as 16-bit integers per group, exact integer "
     "products (VNNI, where the CPU has it; else as 0); 2: W dequantized in tiles and multiplied by "
     "cblas_sgemm; 3: AMX tiles; 4: the 16-bit activations of 1 against W unpacked into column panels "
     "(VNNI; many rows); 5: as 4 with activations as 8-bit integers per group (VNNI; many rows)."},
    {"gated_delta_scan", py_gated_delta_scan, METH_VARARGS,
     "gated_delta_scan(q, k, v, g, beta, state, y, state_out, B, T, H, Dk, Dv): the gated delta rule "
     "over T tokens for B sequences of H heads (a decode step is T = 1), float32 buffers."},
    {"gdn_decode_step", py_gdn_decode_step, METH_VARARGS,
     "gdn_decode_step(qkv, z, a, b, conv, w, A_log, dt_bias, state, norm_w, y, conv_out, state_out, B, Hk, "
     "Hv, Dk, Dv, K, eps, qk_eps): one GatedDeltaNet decode step from the projections' outputs to "
     "out_proj's input (conv + SiLU, q/k normalised, gates, delta rule, gated RMSNorm), float32 buffers."},
    {"depthwise_conv", py_depthwise_conv, METH_VARARGS,
     "depthwise_conv(x, w, y, B, T, K, C): y[b, t, c] = sum_i x[b, t + i, c] w[i, c] (x: B x (T + K - 1) "
     "x C, w: K x C, y: B x T x C), float32 buffers."},
    {"silu", py_silu, METH_VARARGS,
     "silu(a, b, y, n): y = silu(a) * b, or silu(a) where b is None, over n float32 values."},
    {"logsumexp", py_logsumexp, METH_VARARGS,
     "logsumexp(x, y, rows, n): y[r] = log(sum(exp(x[r, :]))) over float32 rows of n values."},
    {"fit_affine", py_fit_affine, METH_VARARGS,
     "fit_affine(x, packed, scales, biases, groups, group, bits, reach): quant/formats.py's fitted scale and "
     "bias of each group of x (float32 [groups, group]), the codes packed as MLX packs them (uint32 "
     "[groups, group * bits / 32]), scales and biases as float32 (bfloat16 values)."},
    {"info", py_info, METH_NOARGS, "the instruction set path and thread count in use"},
    {"set_threads", py_set_threads, METH_VARARGS, "start the pool with this many threads (once)"},
    {"force_portable", py_force_portable, METH_VARARGS, "use (or stop using) the portable path"},
    {"force_isa", py_force_isa, METH_VARARGS, "use at most this instruction set: portable, avx2 or native "
     "(what the CPU has); info() says what runs"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_qkernel", NULL, -1, methods};

PyMODINIT_FUNC PyInit__qkernel(void) {
#ifdef MIXBIT_X86
    __builtin_cpu_init();
#endif
    /* MIXBIT_KERNEL_ISA=portable|avx2 caps the instruction sets (to compare paths on one CPU) */
    const char *isa = getenv("MIXBIT_KERNEL_ISA");
    use_isa(isa && !strcmp(isa, "portable") ? 0 : isa && !strcmp(isa, "avx2") ? 1 : 2);
    const char *spin = getenv("MIXBIT_KERNEL_SPIN_US");
    if (spin) spin_us = atoi(spin);
    return PyModule_Create(&module);
}
