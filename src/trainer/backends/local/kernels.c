/* Native CPU kernels of the local engine (sampler and training forward); built and loaded by kernels.py
 * (why and how: there).
 *
 * Every reduction below runs in an order fixed by this code and by the lengths of its own inputs (16
 * lanes, then a fixed tree), never by the thread that runs it or by the other rows of a call: a row's
 * results are bit-identical whatever else the call holds. */
#include <stdint.h>
#include <stdlib.h>
#include <math.h>
#include <string.h>

#define LANES 16
/* the largest query-group size (query heads per key/value head) and head size the kernel takes */
#define MAX_G 16
#define MAX_D 256
/* the largest hidden size and MLP width the row kernels take: a row lives on its thread's stack, up to three
 * rows of 64 KB at these bounds, well within the stacks OpenMP threads get */
#define MAX_H 16384
#define MAX_I 16384

/* Sum of 16 lanes in a fixed tree. */
static inline float lane_sum(float *acc) {
    for (int w = LANES / 2; w > 0; w /= 2)
        for (int l = 0; l < w; l++) acc[l] += acc[l + w];
    return acc[0];
}

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

/* a . b over D: 16 lanes of partial sums (one AVX-512 register, or two AVX2 ones, where the CPU has
 * them), then a fixed tree. */
static inline float dot(const float *restrict a, const float *restrict b, int64_t D) {
    int64_t d = 0;
#if defined(__AVX512F__)
    __m512 v = _mm512_setzero_ps();
    for (; d + LANES <= D; d += LANES) v = _mm512_fmadd_ps(_mm512_loadu_ps(a + d), _mm512_loadu_ps(b + d), v);
    float head = _mm512_reduce_add_ps(v);
#elif defined(__AVX2__) && defined(__FMA__)
    __m256 lo = _mm256_setzero_ps(), hi = _mm256_setzero_ps();
    for (; d + LANES <= D; d += LANES) {
        lo = _mm256_fmadd_ps(_mm256_loadu_ps(a + d), _mm256_loadu_ps(b + d), lo);
        hi = _mm256_fmadd_ps(_mm256_loadu_ps(a + d + 8), _mm256_loadu_ps(b + d + 8), hi);
    }
    __m256 s8 = _mm256_add_ps(lo, hi);
    __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
    s4 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    s4 = _mm_add_ss(s4, _mm_movehdup_ps(s4));
    float head = _mm_cvtss_f32(s4);
#else
    float acc[LANES] = {0};
    for (; d + LANES <= D; d += LANES)
        for (int l = 0; l < LANES; l++) acc[l] += a[d + l] * b[d + l];
    float head = lane_sum(acc);
#endif
    float tail = 0.0f;
    for (; d < D; d++) tail += a[d] * b[d];
    return head + tail;
}

/* e^x for x <= 0 (softmax arguments less their maximum), written so that the compiler vectorizes it:
 * x = n ln2 + r with |r| <= ln2 / 2 (Cody-Waite: ln2 split in two so that n ln2 is exact), e^r by its
 * degree-7 Taylor polynomial (relative error < 1e-8 on that interval, below fp32's 6e-8 rounding),
 * times 2^n built from its exponent bits. Below -87, e^x is under fp32's smallest normal number and the
 * argument is clamped there (its weight in a softmax sum is then < 1e-37 of the maximum's). */
static inline float exp_nonpos(float x) {
    const float shift = 12582912.0f; /* 1.5 * 2^23: x log2(e) + shift rounds to an integer */
    x = x < -87.0f ? -87.0f : x;
    float t = x * 1.44269504088896341f + shift;
    float n = t - shift;
    float r = x - n * 0.693145751953125f;
    r = r - n * 1.428606765330187045e-06f;
    float p = 1.0f / 5040.0f;
    p = p * r + 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    int32_t ti, bits;
    memcpy(&ti, &t, sizeof ti);
    bits = (ti - 0x4B400000 + 127) << 23; /* the integer n sits in t's low mantissa bits */
    float two_n;
    memcpy(&two_n, &bits, sizeof two_n);
    return p * two_n;
}

/* x[j] = e^(x[j] - m) in place for j in [0, n) (softmax numerators: every x[j] <= m), and their sum in a
 * fixed order: 16 lanes, their tree, then the tail. */
static inline float exp_sum(float *restrict x, int64_t n, float m) {
    float acc[LANES] = {0};
    int64_t j = 0;
    for (; j + LANES <= n; j += LANES)
        for (int l = 0; l < LANES; l++) {
            x[j + l] = exp_nonpos(x[j + l] - m);
            acc[l] += x[j + l];
        }
    float tail = 0.0f;
    for (; j < n; j++) {
        x[j] = exp_nonpos(x[j] - m);
        tail += x[j];
    }
    return lane_sum(acc) + tail;
}

/* bf16 (stored as its upper 16 bits) to fp32: exact. */
static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* fp32 to bf16, rounding to nearest even as torch's `.to(torch.bfloat16)` does (NaN stays NaN). */
static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* Row `x` (D elements of the kernel's element type) as fp32. */
static inline void load_row(const void *x, int bf16, float *restrict dst, int64_t D) {
    if (bf16) {
        const uint16_t *h = (const uint16_t *)x;
        for (int64_t d = 0; d < D; d++) dst[d] = bf16_to_f32(h[d]);
    } else {
        memcpy(dst, x, sizeof(float) * D);
    }
}

/* Row `x` of H fp32 values to `out` (bf16 rounded to nearest even where `bf16`, else fp32). */
static inline void store_row(const float *restrict x, int bf16, void *out, int64_t H) {
    if (bf16) {
        uint16_t *h = (uint16_t *)out;
        for (int64_t d = 0; d < H; d++) h[d] = f32_to_bf16(x[d]);
    } else {
        memcpy(out, x, sizeof(float) * H);
    }
}

/* RoPE of one fp32 head vector at one position, as model.rope computes it in fp32:
 * x * cos + rotate_half(x) * sin, rotate_half(x) = (-x[D/2:], x[:D/2]); each product and the sum rounded
 * on their own (built with -ffp-contract=off), so the result has the bits torch's three ops give. */
static inline void rope_row(const float *restrict x, const float *restrict c, const float *restrict s,
                            float *restrict out, int64_t D) {
    const int64_t h = D / 2;
    for (int64_t d = 0; d < h; d++) out[d] = x[d] * c[d] + (-x[d + h]) * s[d];
    for (int64_t d = 0; d < h; d++) out[d + h] = x[d + h] * c[d + h] + x[d] * s[d + h];
}

/* The start of decode-attention task (row b, key/value head h): the row's new k and v written into the caches
 * kt, vt [L, D] of that head at index pos, and its G query heads of group h rotated (fp32) into qf [G, D]. */
static inline void task_start(const char *row, int bf16, const float *restrict cos, const float *restrict sin, char *kt,
                              char *vt, int64_t pos, int64_t h, int64_t KV, int64_t G, const int64_t D, float *restrict qf) {
    const size_t el = bf16 ? 2 : 4;
    float xf[MAX_D];
    memcpy(kt + (size_t)(pos * D) * el, row + (size_t)((KV * G + h) * D) * el, D * el);
    memcpy(vt + (size_t)(pos * D) * el, row + (size_t)((KV * G + KV + h) * D) * el, D * el);
    for (int64_t i = 0; i < G; i++) {
        load_row(row + (size_t)((h * G + i) * D) * el, bf16, xf, D);
        rope_row(xf, cos + pos * D, sin + pos * D, qf + i * D, D);
    }
}

/* One (row, key/value head) task of `decode_layer_attention` (see there); returns 1 when out of memory.
 * Inlined with a literal head size at the common sizes, so that every per-key loop over D compiles to
 * straight-line vector code instead of a loop with a run-time trip count. */
static inline int attention_task(int64_t t, const void *qkv, int64_t qkv_row_stride, int bf16, const float *restrict cos,
                                 const float *restrict sin, void *kc, void *vc, const int64_t *restrict pos_B, void *out,
                                 int64_t KV, int64_t G, const int64_t D, int64_t L, float scale) {
    const size_t el = bf16 ? 2 : 4;
    const int64_t b = t / KV, h = t % KV, pos = pos_B[b], n = pos + 1;
    const char *row = (const char *)qkv + (size_t)(b * qkv_row_stride) * el;
    char *kt = (char *)kc + (size_t)(t * L * D) * el;
    char *vt = (char *)vc + (size_t)(t * L * D) * el;
    float *restrict sc = (float *)malloc(sizeof(float) * G * n); /* sc[i * n + j]: query i, position j */
    if (!sc) return 1;
    float qf[MAX_G * MAX_D], xf[MAX_D], kf[MAX_D];
    task_start(row, bf16, cos, sin, kt, vt, pos, h, KV, G, D, qf);
    for (int64_t j = 0; j < n; j++) {
        load_row(kt + (size_t)(j * D) * el, bf16, xf, D);
        rope_row(xf, cos + j * D, sin + j * D, kf, D);
        for (int64_t i = 0; i < G; i++) sc[i * n + j] = dot(qf + i * D, kf, D) * scale;
    }
    float inv_z[MAX_G];
    for (int64_t i = 0; i < G; i++) {
        float *si = sc + i * n;
        float m = si[0];
        for (int64_t j = 1; j < n; j++) m = si[j] > m ? si[j] : m;
        inv_z[i] = 1.0f / exp_sum(si, n, m);
    }
    float o[MAX_G * MAX_D];
    memset(o, 0, sizeof(float) * G * D);
    for (int64_t j = 0; j < n; j++) {
        load_row(vt + (size_t)(j * D) * el, bf16, xf, D);
        for (int64_t i = 0; i < G; i++) {
            const float p = sc[i * n + j];
            float *restrict oi = o + i * D;
            for (int64_t d = 0; d < D; d++) oi[d] += p * xf[d];
        }
    }
    for (int64_t i = 0; i < G; i++) {
        float *restrict oi = o + i * D;
        for (int64_t d = 0; d < D; d++) oi[d] *= inv_z[i];
        store_row(oi, bf16, (char *)out + (size_t)((t * G + i) * D) * el, D);
    }
    free(sc);
    return 0;
}

#if defined(__AVX512F__)
/* Lane sums of 16 vectors at once: lane s of the result is the sum of v[p(s)]'s 16 lanes, p(4k + e) = 4e + k
 * (a 4x4 transpose, its own inverse), each sum in the fixed tree of `dot` (lane l + lane l+8, then + l+4,
 * + l+2, + l+1), hence bit-identical to `_mm512_reduce_add_ps(v[p(s)])`. Four levels of in-register
 * shuffles and adds serve all 16 vectors, where sixteen separate reductions cost four levels each. */
static inline __m512 reduce16(const __m512 *v) {
    __m512 a[8], b[4], c[2];
    for (int m = 0; m < 8; m++) /* lanes 0-7: v[2m] at l + l+8; lanes 8-15: v[2m+1] */
        a[m] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * m], v[2 * m + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_f32x4(v[2 * m], v[2 * m + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    for (int m = 0; m < 4; m++) /* 128-bit block k: v[4m + k] at l + l+4 */
        b[m] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * m], a[2 * m + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                             _mm512_shuffle_f32x4(a[2 * m], a[2 * m + 1], _MM_SHUFFLE(3, 1, 3, 1)));
    for (int m = 0; m < 2; m++) /* block k, elements 2i, 2i+1: v[4(2m + i) + k] at l + l+2 */
        c[m] = _mm512_add_ps(_mm512_shuffle_ps(b[2 * m], b[2 * m + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_ps(b[2 * m], b[2 * m + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    /* block k, element e: v[4e + k] at l + l+1 */
    return _mm512_add_ps(_mm512_shuffle_ps(c[0], c[1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_ps(c[0], c[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

/* 16 bf16 (or fp32) values at x as fp32 (exact). */
static inline __m512 load16(const void *x, int bf16) {
    if (!bf16) return _mm512_loadu_ps(x);
    return _mm512_castsi512_ps(_mm512_slli_epi32(
        _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)x)), 16));
}

/* `attention_task` for head size 64 on AVX-512, with the same arithmetic in the same order (bit-identical
 * results, `test_kernels.py`): keys are scored 16 at a time, their 16-lane partial dot products summed by
 * one `reduce16` per query instead of a horizontal reduction per (key, query), and the weighted sum of
 * values keeps each query's output in registers. RoPE as `rope_row` (products and sums rounded on their
 * own), value accumulation as a product then a sum (no fused multiply-add, as the portable loop). */
static inline int attention_task_d64(int64_t t, const void *qkv, int64_t qkv_row_stride, int bf16,
                                     const float *restrict cos, const float *restrict sin, void *kc, void *vc,
                                     const int64_t *restrict pos_B, void *out, int64_t KV, const int64_t G,
                                     int64_t L, float scale) {
    const int64_t D = 64;
    const size_t el = bf16 ? 2 : 4;
    const int64_t b = t / KV, h = t % KV, pos = pos_B[b], n = pos + 1, npad = (n + 15) & ~(int64_t)15;
    const char *row = (const char *)qkv + (size_t)(b * qkv_row_stride) * el;
    char *kt = (char *)kc + (size_t)(t * L * D) * el;
    char *vt = (char *)vc + (size_t)(t * L * D) * el;
    float *restrict sc = (float *)malloc(sizeof(float) * G * npad); /* sc[i * npad + j]: query i, position j */
    if (!sc) return 1;
    float qf[MAX_G * 64];
    task_start(row, bf16, cos, sin, kt, vt, pos, h, KV, G, D, qf);
    const __m512 vscale = _mm512_set1_ps(scale);
    for (int64_t j0 = 0; j0 < n; j0 += 16) {
        const int64_t m = n - j0 < 16 ? n - j0 : 16;
        __m512 kr[16][4]; /* slot p(jj) (see reduce16) holds key j0 + jj rotated; zero beyond n */
        for (int64_t jj = 0; jj < 16; jj++) {
            const int s = (int)(4 * (jj % 4) + jj / 4);
            if (jj >= m) {
                for (int c = 0; c < 4; c++) kr[s][c] = _mm512_setzero_ps();
                continue;
            }
            const int64_t j = j0 + jj;
            const char *kj = kt + (size_t)(j * D) * el;
            const float *cj = cos + j * D, *sj = sin + j * D;
            const __m512 x0 = load16(kj, bf16), x1 = load16(kj + 16 * el, bf16);
            const __m512 x2 = load16(kj + 32 * el, bf16), x3 = load16(kj + 48 * el, bf16);
            kr[s][0] = _mm512_sub_ps(_mm512_mul_ps(x0, _mm512_loadu_ps(cj)), _mm512_mul_ps(x2, _mm512_loadu_ps(sj)));
            kr[s][1] = _mm512_sub_ps(_mm512_mul_ps(x1, _mm512_loadu_ps(cj + 16)),
                                     _mm512_mul_ps(x3, _mm512_loadu_ps(sj + 16)));
            kr[s][2] = _mm512_add_ps(_mm512_mul_ps(x2, _mm512_loadu_ps(cj + 32)),
                                     _mm512_mul_ps(x0, _mm512_loadu_ps(sj + 32)));
            kr[s][3] = _mm512_add_ps(_mm512_mul_ps(x3, _mm512_loadu_ps(cj + 48)),
                                     _mm512_mul_ps(x1, _mm512_loadu_ps(sj + 48)));
        }
        for (int64_t i = 0; i < G; i++) {
            const float *qi = qf + i * D;
            const __m512 q0 = _mm512_loadu_ps(qi), q1 = _mm512_loadu_ps(qi + 16);
            const __m512 q2 = _mm512_loadu_ps(qi + 32), q3 = _mm512_loadu_ps(qi + 48);
            __m512 acc[16];
            for (int s = 0; s < 16; s++) {
                __m512 v = _mm512_fmadd_ps(q0, kr[s][0], _mm512_setzero_ps());
                v = _mm512_fmadd_ps(q1, kr[s][1], v);
                v = _mm512_fmadd_ps(q2, kr[s][2], v);
                acc[s] = _mm512_fmadd_ps(q3, kr[s][3], v);
            }
            _mm512_storeu_ps(sc + i * npad + j0, _mm512_mul_ps(reduce16(acc), vscale));
        }
    }
    float inv_z[MAX_G];
    for (int64_t i = 0; i < G; i++) {
        float *si = sc + i * npad;
        __m512 mv = _mm512_set1_ps(si[0]); /* the maximum is the same value in any order */
        int64_t j = 0;
        for (; j + 16 <= n; j += 16) mv = _mm512_max_ps(mv, _mm512_loadu_ps(si + j));
        float m = _mm512_reduce_max_ps(mv);
        for (; j < n; j++) m = si[j] > m ? si[j] : m;
        inv_z[i] = 1.0f / exp_sum(si, n, m);
    }
    __m512 o[MAX_G][4];
    for (int64_t i = 0; i < G; i++)
        for (int c = 0; c < 4; c++) o[i][c] = _mm512_setzero_ps();
    for (int64_t j = 0; j < n; j++) {
        const char *vj = vt + (size_t)(j * D) * el;
        const __m512 v0 = load16(vj, bf16), v1 = load16(vj + 16 * el, bf16);
        const __m512 v2 = load16(vj + 32 * el, bf16), v3 = load16(vj + 48 * el, bf16);
        for (int64_t i = 0; i < G; i++) {
            const __m512 p = _mm512_set1_ps(sc[i * npad + j]);
            o[i][0] = _mm512_add_ps(o[i][0], _mm512_mul_ps(p, v0));
            o[i][1] = _mm512_add_ps(o[i][1], _mm512_mul_ps(p, v1));
            o[i][2] = _mm512_add_ps(o[i][2], _mm512_mul_ps(p, v2));
            o[i][3] = _mm512_add_ps(o[i][3], _mm512_mul_ps(p, v3));
        }
    }
    for (int64_t i = 0; i < G; i++) {
        float oi[64];
        const __m512 z = _mm512_set1_ps(inv_z[i]);
        for (int c = 0; c < 4; c++) _mm512_storeu_ps(oi + 16 * c, _mm512_mul_ps(o[i][c], z));
        store_row(oi, bf16, (char *)out + (size_t)((t * G + i) * D) * el, D);
    }
    free(sc);
    return 0;
}
#endif

/* The attention part of one decode layer for all rows, from the layer's stacked q|k|v projection output
 * to the attention output that feeds its o projection:
 *   qkv [B, (KV * G + 2 KV) * D], row b at qkv + b * qkv_row_stride: q heads, then k heads, then v heads
 *       (rows' tokens at rope position pos_B[b], which is also their cache index)
 *   kc, vc [B, KV, L, D]: the key cache holds keys before RoPE, the value cache values; the new token's
 *       k and v are written at index pos_B[b]
 *   cos, sin [max_ctx, D] fp32 RoPE tables
 *   out [B, KV * G * D] = softmax(rope(q) rope(k)^T * scale) v over cache indices [0, pos_B[b]]
 * qkv, caches and out are bf16 when `bf16` is set, else fp32; everything is computed in fp32. Keys are
 * rotated as they are read (the RoPE tables of a few hundred positions stay in cache, and a key cache in
 * the projection's own dtype is exact and, in bf16, half the memory traffic of rotated fp32 keys), to
 * the same bits as rotating them once. The G query heads that share a key/value head read its cache
 * together. Returns 0; -1, with nothing written, when the sizes or a position are beyond what the
 * kernel takes; -2 when memory for the scores ran out. `portable`: the portable loop even where an AVX-512
 * variant exists (the same bits; for tests). */
int decode_layer_attention(const void *qkv, int64_t qkv_row_stride, int bf16, const float *restrict cos,
                           const float *restrict sin, int64_t max_ctx, void *kc, void *vc,
                           const int64_t *restrict pos_B, void *out, int64_t B, int64_t KV, int64_t G, int64_t D,
                           int64_t L, float scale, int portable, int nthreads) {
    if (G < 1 || G > MAX_G || D < 2 || D > MAX_D || D % 2) return -1;
    for (int64_t b = 0; b < B; b++)
        if (pos_B[b] < 0 || pos_B[b] >= L || pos_B[b] >= max_ctx) return -1;
    int failed = 0;
    (void)portable; /* only the AVX-512 build has a second variant */
#pragma omp parallel for schedule(static) num_threads(nthreads) reduction(| : failed)
    for (int64_t t = 0; t < B * KV; t++) {
        int oom;
#if defined(__AVX512F__)
        if (D == 64 && !portable) {
            if (G == 3)
                oom = bf16 ? attention_task_d64(t, qkv, qkv_row_stride, 1, cos, sin, kc, vc, pos_B, out, KV, 3, L, scale)
                           : attention_task_d64(t, qkv, qkv_row_stride, 0, cos, sin, kc, vc, pos_B, out, KV, 3, L, scale);
            else
                oom = attention_task_d64(t, qkv, qkv_row_stride, bf16, cos, sin, kc, vc, pos_B, out, KV, G, L, scale);
            failed |= oom;
            continue;
        }
#endif
        if (D == 64 && bf16)
            oom = attention_task(t, qkv, qkv_row_stride, 1, cos, sin, kc, vc, pos_B, out, KV, G, 64, L, scale);
        else if (D == 64)
            oom = attention_task(t, qkv, qkv_row_stride, 0, cos, sin, kc, vc, pos_B, out, KV, G, 64, L, scale);
        else if (D == 128)
            oom = attention_task(t, qkv, qkv_row_stride, bf16, cos, sin, kc, vc, pos_B, out, KV, G, 128, L, scale);
        else
            oom = attention_task(t, qkv, qkv_row_stride, bf16, cos, sin, kc, vc, pos_B, out, KV, G, D, L, scale);
        failed |= oom;
    }
    return failed ? -2 : 0;
}

/* The residual add and the RMSNorm that sit between a layer's products, one row at a time:
 *   x [B, H] fp32 residual stream, row b at x + b * H; when y is given, x += y first (y [B, H], row
 *       stride y_row_stride, bf16 where y_bf16, else fp32: each sum rounded once in fp32, as torch's
 *       promoting add of a bf16 and an fp32 tensor)
 *   out [B, H] = (x * rsqrt(mean(x^2) + eps)) * w with fp32 weights w [H], as torch's F.rms_norm
 *       computes it in fp32, stored as bf16 (rounded to nearest even, as `.to(torch.bfloat16)`) where
 *       out_bf16, else fp32; rsqrt(mean(x^2) + eps) of each row into rstd_out [B] when given (for the
 *       norm's backward, `rms_norm_backward`).
 * With x_sum given, x is left as it is and x + y goes to x_sum [B, H] instead (x_sum may be x).
 * The sum of squares runs in the fixed order of `dot`. Returns 0; -1 when H exceeds what it takes. */
int residual_rms_norm(float *x, const void *y, int64_t y_row_stride, int y_bf16, const float *restrict w, float eps,
                      void *out, int out_bf16, float *rstd_out, float *x_sum, int64_t B, int64_t H, int nthreads) {
    if (H < 1 || H > MAX_H) return -1;
    const size_t yel = y_bf16 ? 2 : 4, oel = out_bf16 ? 2 : 4;
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t b = 0; b < B; b++) {
        float *xr = (x_sum ? x_sum : x) + b * H; /* may be x itself: not restrict */
        float yf[MAX_H], o[MAX_H];
        if (y) {
            const float *xin = x + b * H;
            load_row((const char *)y + (size_t)(b * y_row_stride) * yel, y_bf16, yf, H);
            for (int64_t d = 0; d < H; d++) xr[d] = xin[d] + yf[d];
        } else if (x_sum) {
            memcpy(xr, x + b * H, sizeof(float) * H);
        }
        const float rstd = 1.0f / sqrtf(dot(xr, xr, H) / (float)H + eps);
        if (rstd_out) rstd_out[b] = rstd;
        for (int64_t d = 0; d < H; d++) o[d] = (xr[d] * rstd) * w[d];
        store_row(o, out_bf16, (char *)out + (size_t)(b * H) * oel, H);
    }
    return 0;
}

/* sigmoid(x) = 1 / (1 + e^-x) from e^-|x| alone (no overflow for large |x|), with one division. */
static inline float sigmoid(float x) {
    const float e = exp_nonpos(x >= 0.0f ? -x : x);
    return (x >= 0.0f ? 1.0f : e) / (1.0f + e);
}

/* SiLU(x) = x sigmoid(x). */
static inline float silu(float x) { return x * sigmoid(x); }

/* The gated MLP's middle, one row at a time: from the stacked gate|up product gu [B, 2 I] (row stride
 * row_stride), out [B, I] = silu(gate) * up. In bf16 each of torch's two ops rounds its result
 * (`F.silu(g) * u` on bf16 tensors): silu(gate) is rounded to bf16 before the product, and the product
 * again; in fp32 each is an fp32 op. */
int silu_mul(const void *gu, int64_t row_stride, int bf16, void *out, int64_t B, int64_t I, int nthreads) {
    if (I < 1 || I > MAX_I) return -1;
    const size_t el = bf16 ? 2 : 4;
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t b = 0; b < B; b++) {
        const char *row = (const char *)gu + (size_t)(b * row_stride) * el;
        float g[MAX_I], u[MAX_I];
        load_row(row, bf16, g, I);
        load_row(row + (size_t)I * el, bf16, u, I);
        for (int64_t i = 0; i < I; i++) {
            float s = silu(g[i]);
            if (bf16) s = bf16_to_f32(f32_to_bf16(s));
            g[i] = s * u[i];
        }
        store_row(g, bf16, (char *)out + (size_t)(b * I) * el, I);
    }
    return 0;
}

/* The backward of `out = (x * rstd) * w` (`residual_rms_norm` without the add, w frozen) for rows x [N, H]
 * fp32 with their rstd [N]: from dy [N, H] (bf16 where dy_bf16, else fp32; row stride dy_row_stride),
 *   dx = rstd * (w dy - xhat * mean(xhat * w dy)),  xhat = x * rstd,
 * into dx [N, H] fp32, plus add [N, H] where given (the residual stream's own gradient). The mean runs in
 * the fixed order of `dot`. */
int rms_norm_backward(const float *restrict x, const float *restrict w, const float *restrict rstd, const void *dy,
                      int64_t dy_row_stride, int dy_bf16, const float *restrict add, float *restrict dx, int64_t N,
                      int64_t H, int nthreads) {
    if (H < 1 || H > MAX_H) return -1;
    const size_t el = dy_bf16 ? 2 : 4;
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t n = 0; n < N; n++) {
        float g[MAX_H], xh[MAX_H];
        const float r = rstd[n];
        load_row((const char *)dy + (size_t)(n * dy_row_stride) * el, dy_bf16, g, H);
        for (int64_t d = 0; d < H; d++) {
            g[d] *= w[d];
            xh[d] = x[n * H + d] * r;
        }
        const float c = dot(xh, g, H) / (float)H;
        if (add)
            for (int64_t d = 0; d < H; d++) dx[n * H + d] = r * (g[d] - xh[d] * c) + add[n * H + d];
        else
            for (int64_t d = 0; d < H; d++) dx[n * H + d] = r * (g[d] - xh[d] * c);
    }
    return 0;
}

/* The training forward's RoPE of q and k, from the stacked q|k|v projection output: rows qkv [N, (nh + 2 kv) D]
 * (bf16 where bf16, else fp32; row stride qkv_row_stride), row n at position pos[n] of its sequence, into fp32
 * q [N, nh, D] and k [N, kv, D] rotated as `model.rope` rotates them (fp32 tables; bit-exact, see `rope_row`),
 * and v [N, kv, D] as fp32. */
int rope_qkv(const void *qkv, int64_t qkv_row_stride, int bf16, const int64_t *restrict pos, const float *restrict cos,
             const float *restrict sin, int64_t max_ctx, float *restrict q, float *restrict k, float *restrict v,
             int64_t N, int64_t nh, int64_t kv, int64_t D, int nthreads) {
    if (D < 2 || D > MAX_D || D % 2) return -1;
    for (int64_t n = 0; n < N; n++)
        if (pos[n] < 0 || pos[n] >= max_ctx) return -1;
    const size_t el = bf16 ? 2 : 4;
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t n = 0; n < N; n++) {
        const char *row = (const char *)qkv + (size_t)(n * qkv_row_stride) * el;
        const float *c = cos + pos[n] * D, *s = sin + pos[n] * D;
        float xf[MAX_D];
        for (int64_t h = 0; h < nh + kv; h++) {
            load_row(row + (size_t)(h * D) * el, bf16, xf, D);
            rope_row(xf, c, s, h < nh ? q + (n * nh + h) * D : k + (n * kv + h - nh) * D, D);
        }
        for (int64_t h = 0; h < kv; h++) load_row(row + (size_t)((nh + kv + h) * D) * el, bf16, v + (n * kv + h) * D, D);
    }
    return 0;
}

/* The backward of `rope_qkv`: from fp32 dq [N, nh, D], dk [N, kv, D], dv [N, kv, D] (each row contiguous) to
 * dqkv [N, (nh + 2 kv) D] in the projection's dtype (bf16 where bf16, else fp32), RoPE's transpose:
 *   dx[:D/2] = dy[:D/2] cos[:D/2] + dy[D/2:] sin[D/2:],  dx[D/2:] = dy[D/2:] cos[D/2:] - dy[:D/2] sin[:D/2],
 * each product and sum rounded in fp32 as autograd's mul / cat / add backward rounds them on fp32 inputs, then
 * once to the dtype (autograd on bf16 inputs would round each of the two terms to bf16 before their sum). */
int rope_qkv_backward(const float *restrict dq, const float *restrict dk, const float *restrict dv,
                      const int64_t *restrict pos, const float *restrict cos, const float *restrict sin, void *dqkv,
                      int bf16, int64_t N, int64_t nh, int64_t kv, int64_t D, int nthreads) {
    if (D < 2 || D > MAX_D || D % 2) return -1;
    const size_t el = bf16 ? 2 : 4;
    const int64_t C = (nh + 2 * kv) * D, half = D / 2;
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t n = 0; n < N; n++) {
        const float *c = cos + pos[n] * D, *s = sin + pos[n] * D;
        char *row = (char *)dqkv + (size_t)(n * C) * el;
        float o[MAX_D];
        for (int64_t h = 0; h < nh + kv; h++) {
            const float *g = h < nh ? dq + (n * nh + h) * D : dk + (n * kv + h - nh) * D;
            for (int64_t d = 0; d < half; d++) {
                o[d] = g[d] * c[d] + g[d + half] * s[d + half];
                o[d + half] = g[d + half] * c[d + half] + (-(g[d] * s[d]));
            }
            store_row(o, bf16, row + (size_t)(h * D) * el, D);
        }
        store_row(dv + n * kv * D, bf16, row + (size_t)((nh + kv) * D) * el, kv * D);
    }
    return 0;
}

/* The backward of `silu_mul`: from gu [N, 2 I] (its forward input) and dm [N, I] (row strides given) to
 * dgu = [dgate | dup] [N, 2 I], contiguous, in the same dtype, with the roundings of autograd's mul and
 * silu backward on tensors of that dtype: s = silu(g) (rounded in bf16), du = dm s, ds = dm u (each rounded),
 * dg = ds sigmoid(g) (1 + g (1 - sigmoid(g))). */
int silu_mul_backward(const void *gu, int64_t gu_row_stride, const void *dm, int64_t dm_row_stride, int bf16,
                      void *dgu, int64_t N, int64_t I, int nthreads) {
    if (I < 1 || I > MAX_I) return -1;
    const size_t el = bf16 ? 2 : 4;
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t n = 0; n < N; n++) {
        const char *row = (const char *)gu + (size_t)(n * gu_row_stride) * el;
        float g[MAX_I], u[MAX_I], d[MAX_I];
        load_row(row, bf16, g, I);
        load_row(row + (size_t)I * el, bf16, u, I);
        load_row((const char *)dm + (size_t)(n * dm_row_stride) * el, bf16, d, I);
        for (int64_t i = 0; i < I; i++) {
            const float sg = sigmoid(g[i]);
            float s = g[i] * sg, ds = d[i] * u[i];
            if (bf16) {
                s = bf16_to_f32(f32_to_bf16(s));
                ds = bf16_to_f32(f32_to_bf16(ds));
            }
            u[i] = d[i] * s;
            g[i] = ds * sg * (1.0f + g[i] * (1.0f - sg));
        }
        char *out = (char *)dgu + (size_t)(n * 2 * I) * el;
        store_row(g, bf16, out, I);
        store_row(u, bf16, out + (size_t)I * el, I);
    }
    return 0;
}

/* Whether this build has AVX-512 (the decode kernel's head-size-64 variant; tests compare it with the
 * portable loop). */
#if defined(__AVX512F__)
int avx512_available(void) { return 1; }
#else
int avx512_available(void) { return 0; }
#endif

/* ---------------------------------------------------------------- the unembedding on AMX tiles
 * fp32 logits of bf16 inputs (fp32 hidden states rounded to bf16) and bf16 weights, as oneDNN computes an
 * fp32 product in its bf16 mode (`model.matmul_inputs`), but from weights stored in bf16: the product
 * reads half the bytes of the fp32 weights that mode converts on every call, and at decode's few rows
 * the unembedding is bound by that read. Every output element sums its 32-wide K chunks in K order on
 * one thread (TDPBF16PS within a chunk), whatever the row count or the other rows: batch invariant. */
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

/* Linux hands AMX state to a process only after it asks (torch's oneDNN asks too; asking twice is fine). */
int amx_available(void) { return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0; }

typedef struct {
    uint8_t palette;
    uint8_t start_row;
    uint8_t reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

/* Tiles 0-3: fp32 accumulators (16 x 16); 4, 5: 16 rows x 32 bf16 of the inputs; 6, 7: 16 K pairs x 16
 * outputs x 2 of the weights (the VNNI layout `head_pack` writes). */
static void tiles_on(void) {
    tile_config c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 8; t++) {
        c.rows[t] = 16;
        c.colsb[t] = 64;
    }
    _tile_loadconfig(&c);
}

/* W [V, K] (V % 16 == 0, K % 32 == 0; bf16 where bf16, else fp32 rounded to bf16) into the blocked layout
 * the tiles load: for each 16 outputs nb and 32-wide K chunk kc, one 1 KB block of 16 K pairs x 16 outputs
 * x 2. */
int head_pack(const void *W, int bf16, int64_t V, int64_t K, uint16_t *restrict out, int nthreads) {
    if (V % 16 || K % 32 || V < 16 || K < 32) return -1;
    const int64_t KC = K / 32;
    const float *Wf = (const float *)W;
    const uint16_t *Wh = (const uint16_t *)W;
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t nb = 0; nb < V / 16; nb++)
        for (int64_t kc = 0; kc < KC; kc++) {
            uint16_t *blk = out + (nb * KC + kc) * 512;
            for (int64_t p = 0; p < 16; p++)
                for (int64_t c = 0; c < 16; c++)
                    for (int64_t e = 0; e < 2; e++) {
                        const int64_t at = (nb * 16 + c) * K + kc * 32 + 2 * p + e;
                        blk[p * 32 + c * 2 + e] = bf16 ? Wh[at] : f32_to_bf16(Wf[at]);
                    }
        }
    return 0;
}

/* One 32-output column pair `np` of Wp (from `head_pack`) times 16 input rows at a (bf16, row stride lda),
 * and, where `two`, the 16 rows after them: fp32 sums in tiles 0, 1 (rows 0-15; outputs 0-15, 16-31) and
 * 2, 3 (rows 16-31), each over the KC 32-wide K chunks in order. */
static inline void tile_pair(const uint16_t *a, int64_t lda, int two, const uint16_t *Wp, int64_t np, int64_t KC) {
    const uint16_t *b0 = Wp + (2 * np) * KC * 512, *b1 = Wp + (2 * np + 1) * KC * 512, *a1 = a + 16 * lda;
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t kc = 0; kc < KC; kc++) {
        _tile_loadd(6, b0 + kc * 512, 64);
        _tile_loadd(7, b1 + kc * 512, 64);
        _tile_loadd(4, a + kc * 32, lda * 2);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        if (two) {
            _tile_loadd(5, a1 + kc * 32, lda * 2);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
        }
    }
}

/* Output column pairs (32 outputs each) per group: a group's weights (HEAD_GROUP x 32 outputs x K bf16, at
 * K = 576 about 0.6 MB) stay in a core's L2 while every 32-row pair of inputs (36 KB at K = 576, L1) runs
 * over them, so neither the weights nor the inputs are read from memory more than once per call. */
#define HEAD_GROUP 16

/* out [M, V] fp32 = bf16(X) [M, K] x Wp^T, Wp from `head_pack`, M % 16 == 0. Threads split the outputs in
 * groups of column pairs (`HEAD_GROUP`); the bf16 inputs are formed once up front. */
int head_logits(const float *restrict X, int64_t M, int64_t K, const uint16_t *restrict Wp, int64_t V, float *out,
                int nthreads) {
    if (M % 16 || V % 32 || K % 32 || M < 16 || K < 32) return -1;
    uint16_t *Xb = (uint16_t *)aligned_alloc(64, (size_t)(M * K) * 2);
    if (!Xb) return -2;
    store_row(X, 1, Xb, M * K);
    const int64_t KC = K / 32, NP = V / 32, MT = M / 16;
#pragma omp parallel num_threads(nthreads)
    {
        tiles_on();
#pragma omp for schedule(static)
        for (int64_t g = 0; g < NP; g += HEAD_GROUP)
        for (int64_t mt = 0; mt < MT; mt += 2)
        for (int64_t np = g; np < g + HEAD_GROUP && np < NP; np++) {
            {
                const int two = mt + 1 < MT;
                tile_pair(Xb + mt * 16 * K, K, two, Wp, np, KC);
                float *o = out + mt * 16 * V + np * 32;
                _tile_stored(0, o, V * 4);
                _tile_stored(1, o + 16, V * 4);
                if (two) {
                    _tile_stored(2, o + 16 * V, V * 4);
                    _tile_stored(3, o + 16 * V + 16, V * 4);
                }
            }
        }
        _tile_release();
    }
    free(Xb);
    return 0;
}

/* out [M, V] = X [M, K] x Wp^T for the sampler's bf16 layer projections: X bf16 (row stride x_row_stride),
 * Wp from `head_pack`, M % 16 == 0, V % 32 == 0; out bf16 (each fp32 sum rounded once to nearest even, as
 * oneDNN's bf16 product rounds its fp32 accumulator). The sums run as `head_logits`' (K chunks in order,
 * one thread per output): a row's outputs do not depend on the other rows. Threads split the column pairs
 * evenly (a layer is a few dozen pairs, too few for `HEAD_GROUP`'s groups to balance over threads); each
 * pair's weights (2 x K / 32 KB) stay in L1/L2 while every 32-row pair of inputs runs over them. */
int amx_linear(const uint16_t *restrict X, int64_t M, int64_t K, int64_t x_row_stride, const uint16_t *restrict Wp,
               int64_t V, uint16_t *restrict out, int nthreads) {
    if (M % 16 || V % 32 || K % 32 || M < 16 || K < 32) return -1;
    const int64_t KC = K / 32, NP = V / 32, MT = M / 16;
#pragma omp parallel num_threads(nthreads)
    {
        tiles_on();
        float c[4][16 * 16] __attribute__((aligned(64)));
#pragma omp for schedule(static)
        for (int64_t np = 0; np < NP; np++)
        for (int64_t mt = 0; mt < MT; mt += 2) {
            const int two = mt + 1 < MT;
            tile_pair(X + mt * 16 * x_row_stride, x_row_stride, two, Wp, np, KC);
            _tile_stored(0, c[0], 64);
            _tile_stored(1, c[1], 64);
            if (two) {
                _tile_stored(2, c[2], 64);
                _tile_stored(3, c[3], 64);
            }
            for (int q = 0; q < (two ? 4 : 2); q++) /* tile q: rows 16 (q / 2), columns 16 (q % 2) of the pair */
                for (int r = 0; r < 16; r++)
                    store_row(c[q] + r * 16, 1, out + (mt * 16 + (q / 2) * 16 + r) * V + np * 32 + (q % 2) * 16, 16);
        }
        _tile_release();
    }
    return 0;
}
#else
int amx_linear(const uint16_t *X, int64_t M, int64_t K, int64_t x_row_stride, const uint16_t *Wp, int64_t V,
               uint16_t *out, int nthreads) {
    (void)X; (void)M; (void)K; (void)x_row_stride; (void)Wp; (void)V; (void)out; (void)nthreads;
    return -3;
}
int amx_available(void) { return 0; }
int head_pack(const void *W, int bf16, int64_t V, int64_t K, uint16_t *out, int nthreads) {
    (void)W; (void)bf16; (void)V; (void)K; (void)out; (void)nthreads;
    return -3;
}
int head_logits(const float *X, int64_t M, int64_t K, const uint16_t *Wp, int64_t V, float *out, int nthreads) {
    (void)X; (void)M; (void)K; (void)Wp; (void)V; (void)out; (void)nthreads;
    return -3;
}
#endif
