/* Fused 1-bit compression kernels for float32 buffers in CPU memory.
 *
 * Built on first use by lightning_onebit/kernels/native.py (one `cc` call, cached); loaded with ctypes, so the
 * GIL is released while they run. The compression kernels produce exactly the bits of the pure-torch reference
 * (torch_kernels.py): each output element is the same single IEEE operation (a compare, an add of +-scale, a
 * division by P), so the file must be compiled without floating-point contraction or fast-math. The Adam update is
 * correctly rounded throughout (see onebit_frozen_adam_update).
 *
 * Bit layout: bit 1 means y >= 0 (NaN gives 0, as torch.ge), most significant bit first (numpy.packbits order).
 * Segments: `offsets[0] = 0 < offsets[1] < ... < offsets[n_segments] = n`; segment s is [offsets[s], offsets[s+1])
 * and has scale `scales[s]`. Segment boundaries need not be multiples of 8.
 *
 * x86-64 machines with AVX2 take the vector paths (chosen at run time, so one build runs on any x86-64); every other
 * machine takes the scalar loops, which give the same bits.
 */
#include <math.h>
#include <stddef.h>
#include <stdint.h>

#if defined(__x86_64__) || defined(_M_X64)
#define ONEBIT_X86 1
#include <immintrin.h>
#endif

/* Elements processed per block when several passes are fused: small enough that the block is still in L1/L2 when a
 * later pass reads it again. A multiple of 8 (whole bytes of signs). */
#define BLOCK 4096

static inline float signed_scale(float y, float scale) { return y >= 0.0f ? scale : -scale; }

/* x clipped to [-bound, bound]; NaN in x stays NaN, and a NaN bound (0 * inf) leaves x as it is. */
static inline float clip_to(float x, float bound) {
    if (x > bound) return bound;
    if (x < -bound) return -bound;
    return x;
}

/* ------------------------------------------------------------------ scalar reference loops */

static void pack_scalar(const float *y, int64_t n_bytes, uint8_t *packed) {
    for (int64_t j = 0; j < n_bytes; ++j) {
        const float *v = y + 8 * j;
        unsigned b = 0;
        for (int k = 0; k < 8; ++k) b |= (unsigned)(v[k] >= 0.0f) << (7 - k);
        packed[j] = (uint8_t)b;
    }
}

static void subtract_signed_scale_scalar(float *y, int64_t n, float scale) {
    for (int64_t i = 0; i < n; ++i) y[i] = y[i] - signed_scale(y[i], scale);
}

static inline float decoded(const uint8_t *packed, int64_t i, float scale) {
    return ((packed[i >> 3] >> (7 - (i & 7))) & 1) ? scale : -scale;
}

/* out[i - start] (+)= +-scale for the bits i in [start, stop). */
static void decode_scalar(const uint8_t *packed, int64_t start, int64_t stop, float scale, float *out, int accumulate) {
    if (accumulate)
        for (int64_t i = start; i < stop; ++i) out[i - start] = out[i - start] + decoded(packed, i, scale);
    else
        for (int64_t i = start; i < stop; ++i) out[i - start] = decoded(packed, i, scale);
}

/* ------------------------------------------------------------------ AVX2 loops */
#ifdef ONEBIT_X86
__attribute__((target("avx2"))) static void pack_avx2(const float *y, int64_t n_bytes, uint8_t *packed) {
    /* Lanes reversed so that movemask puts element 0 in bit 7 (MSB first). */
    const __m256i reverse = _mm256_setr_epi32(7, 6, 5, 4, 3, 2, 1, 0);
    const __m256 zero = _mm256_setzero_ps();
    int64_t j = 0;
    for (; j + 4 <= n_bytes; j += 4) {
        for (int u = 0; u < 4; ++u) {
            __m256 v = _mm256_permutevar8x32_ps(_mm256_loadu_ps(y + 8 * (j + u)), reverse);
            packed[j + u] = (uint8_t)_mm256_movemask_ps(_mm256_cmp_ps(v, zero, _CMP_GE_OQ));
        }
    }
    pack_scalar(y + 8 * j, n_bytes - j, packed + j);
}

__attribute__((target("avx2"))) static void subtract_signed_scale_avx2(float *y, int64_t n, float scale) {
    const __m256 zero = _mm256_setzero_ps(), pos = _mm256_set1_ps(scale), neg = _mm256_set1_ps(-scale);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 v = _mm256_loadu_ps(y + i);
        __m256 s = _mm256_blendv_ps(neg, pos, _mm256_cmp_ps(v, zero, _CMP_GE_OQ));
        _mm256_storeu_ps(y + i, _mm256_sub_ps(v, s));
    }
    subtract_signed_scale_scalar(y + i, n - i, scale);
}

/* As decode_scalar; the byte-aligned middle is vectorised. */
__attribute__((target("avx2"))) static void decode_avx2(const uint8_t *packed, int64_t start, int64_t stop, float scale,
                                                        float *out, int accumulate) {
    int64_t head = (start + 7) & ~(int64_t)7;
    if (head > stop) head = stop;
    decode_scalar(packed, start, head, scale, out, accumulate);
    const __m256i bit = _mm256_setr_epi32(128, 64, 32, 16, 8, 4, 2, 1);
    const __m256 pos = _mm256_set1_ps(scale), neg = _mm256_set1_ps(-scale);
    int64_t i = head;
    for (; i + 8 <= stop; i += 8) {
        __m256i b = _mm256_set1_epi32(packed[i >> 3]);
        __m256i set = _mm256_cmpeq_epi32(_mm256_and_si256(b, bit), bit);
        __m256 s = _mm256_blendv_ps(neg, pos, _mm256_castsi256_ps(set));
        if (accumulate) s = _mm256_add_ps(_mm256_loadu_ps(out + (i - start)), s);
        _mm256_storeu_ps(out + (i - start), s);
    }
    decode_scalar(packed, i, stop, scale, out + (i - start), accumulate);
}

/* x clipped to [-bound, bound] as clip_to() does: an ordered compare, so NaN in x (or in bound) leaves x as it is. */
__attribute__((target("avx2"))) static inline __m256 clip_to_avx2(__m256 x, __m256 bound) {
    __m256 negative = _mm256_xor_ps(bound, _mm256_set1_ps(-0.0f)); /* -bound, exactly */
    x = _mm256_blendv_ps(x, bound, _mm256_cmp_ps(x, bound, _CMP_GT_OQ));
    return _mm256_blendv_ps(x, negative, _mm256_cmp_ps(x, negative, _CMP_LT_OQ));
}

/* Returns how many leading elements it updated (a multiple of 8); the caller finishes the rest. */
__attribute__((target("avx2"))) static int64_t frozen_adam_update_avx2(float *p, const float *m, const float *v,
                                                                       int64_t n, float decay, int apply_decay,
                                                                       float bias_correction2_sqrt, float eps,
                                                                       float step, float limit, int clip) {
    const __m256 decay_v = _mm256_set1_ps(decay), bc2 = _mm256_set1_ps(bias_correction2_sqrt),
                 eps_v = _mm256_set1_ps(eps), step_v = _mm256_set1_ps(step), limit_v = _mm256_set1_ps(limit);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 q = _mm256_loadu_ps(p + i);
        if (apply_decay) q = _mm256_mul_ps(q, decay_v);
        __m256 d = _mm256_add_ps(_mm256_div_ps(_mm256_sqrt_ps(_mm256_loadu_ps(v + i)), bc2), eps_v);
        __m256 mi = _mm256_loadu_ps(m + i), u;
        if (clip)
            u = _mm256_mul_ps(step_v, clip_to_avx2(_mm256_div_ps(mi, d), limit_v));
        else
            u = _mm256_div_ps(_mm256_mul_ps(step_v, mi), d);
        _mm256_storeu_ps(p + i, _mm256_add_ps(q, u));
    }
    return i;
}

__attribute__((target("avx2"))) static int64_t axpy_avx2(float *p, const float *u, int64_t n, float step) {
    const __m256 step_v = _mm256_set1_ps(step);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(p + i, _mm256_add_ps(_mm256_loadu_ps(p + i), _mm256_mul_ps(step_v, _mm256_loadu_ps(u + i))));
    return i;
}

static int has_avx2(void) {
    static int cached = -1;
    if (cached < 0) {
        __builtin_cpu_init();
        cached = __builtin_cpu_supports("avx2") ? 1 : 0;
    }
    return cached;
}
#endif

static void pack(const float *y, int64_t n_bytes, uint8_t *packed) {
#ifdef ONEBIT_X86
    if (has_avx2()) return pack_avx2(y, n_bytes, packed);
#endif
    pack_scalar(y, n_bytes, packed);
}

static void subtract_signed_scale(float *y, int64_t n, float scale) {
#ifdef ONEBIT_X86
    if (has_avx2()) return subtract_signed_scale_avx2(y, n, scale);
#endif
    subtract_signed_scale_scalar(y, n, scale);
}

static void decode(const uint8_t *packed, int64_t start, int64_t stop, float scale, float *out, int accumulate) {
#ifdef ONEBIT_X86
    if (has_avx2()) return decode_avx2(packed, start, stop, scale, out, accumulate);
#endif
    decode_scalar(packed, start, stop, scale, out, accumulate);
}

/* Calls fn(segment, start, stop) for the parts of the segments that overlap [lo, hi); `*segment` is a cursor that only
 * moves forward, so a sweep over consecutive blocks costs O(n_segments) in total. */
#define FOR_SEGMENT_PARTS(offsets, segment, lo, hi, start, stop, body)             \
    for (int64_t start = (lo); start < (hi);) {                                     \
        while ((offsets)[*(segment) + 1] <= start) ++*(segment);                    \
        int64_t stop = (offsets)[*(segment) + 1] < (hi) ? (offsets)[*(segment) + 1] : (hi); \
        body;                                                                        \
        start = stop;                                                                \
    }

/* ------------------------------------------------------------------ exported kernels */

/* packed <- bits(y >= 0); y <- y - scale_s * sgn(y) per segment. n is a multiple of 8. One pass over y (blocked). */
void onebit_pack_and_subtract(float *y, int64_t n, const int64_t *offsets, const float *scales, uint8_t *packed) {
    int64_t segment = 0;
    for (int64_t lo = 0; lo < n; lo += BLOCK) {
        int64_t hi = lo + BLOCK < n ? lo + BLOCK : n;
        pack(y + lo, (hi - lo) / 8, packed + lo / 8);
        FOR_SEGMENT_PARTS(offsets, &segment, lo, hi, start, stop,
                          subtract_signed_scale(y + start, stop - start, scales[segment]));
    }
}

/* out[i] (+)= scale_s * sgn_i for the n elements encoded by packed. */
void onebit_decode(const uint8_t *packed, int64_t n, const int64_t *offsets, const float *scales, float *out,
                   int accumulate) {
    int64_t segment = 0;
    FOR_SEGMENT_PARTS(offsets, &segment, 0, n, start, stop,
                      decode(packed, start, stop, scales[segment], out + start, accumulate));
}

/* target[i] <- target[i] + (sum_j scale_{j,s} sgn_{j,i}) / n_sources, summing j = 0, 1, ... in order (the order of
 * the torch reference). packed[j] / scales[j] are source j's bits and per-segment scales, all over one segmentation. */
void onebit_add_mean_of_signs(float *target, int64_t n, const int64_t *offsets, const uint8_t *const *packed,
                              const float *const *scales, int64_t n_sources) {
    float sum[BLOCK];
    int64_t segment_cursor = 0;
    const float divisor = (float)n_sources;
    for (int64_t lo = 0; lo < n; lo += BLOCK) {
        int64_t hi = lo + BLOCK < n ? lo + BLOCK : n;
        for (int64_t j = 0; j < n_sources; ++j) {
            int64_t segment = segment_cursor;
            FOR_SEGMENT_PARTS(offsets, &segment, lo, hi, start, stop,
                              decode(packed[j], start, stop, scales[j][segment], sum + (start - lo), j > 0));
            if (j == n_sources - 1) segment_cursor = segment;
        }
        for (int64_t i = lo; i < hi; ++i) target[i] = target[i] + sum[i - lo] / divisor;
    }
}

/* Adam step with frozen variance, in the order of operations of the torch reference
 * (torch_kernels.frozen_adam_update_), each operation correctly rounded, as the reference's (its sqrt is
 * native.sqrt_into's): p <- p * decay (when apply_decay); d = sqrt(v) / bias_correction2_sqrt + eps;
 * p <- p + (step * m) / d, or with clip p <- p + step * clip(m / d, -limit, limit). */
void onebit_frozen_adam_update(float *p, const float *m, const float *v, int64_t n, float decay, int apply_decay,
                               float bias_correction2_sqrt, float eps, float step, float limit, int clip) {
    int64_t i = 0;
#ifdef ONEBIT_X86
    if (has_avx2())
        i = frozen_adam_update_avx2(p, m, v, n, decay, apply_decay, bias_correction2_sqrt, eps, step, limit, clip);
#endif
    for (; i < n; ++i) {
        float q = apply_decay ? p[i] * decay : p[i];
        float d = sqrtf(v[i]) / bias_correction2_sqrt + eps;
        p[i] = q + (clip ? step * clip_to(m[i] / d, limit) : (step * m[i]) / d);
    }
}

/* ------------------------------------------------------------------ 1-bit LAMB, compression stage */

/* One element of the first pass: the averaged gradient reconstructed from the momenta, g = (b1 last - m) / -(1 - b1);
 * the fresh variance f <- b2 f + (1 - b2) g^2; the factor's ratio (sqrt(v) + eps) / (sqrt(f) + eps) with `root` the
 * cached sqrt(v) + eps; the update u0 = (m / bc1) / denominator (cached sqrt(v / bc2) + eps), clipped to
 * [-limit, limit] with clip, u = u0 + wd p. */
#define LAMB_PREPARE_ELEMENT(i)                                                                                      \
    do {                                                                                                             \
        float g = (last[i] * b1 - m[i]) / neg_one_minus_b1;                                                          \
        float f = fresh[i] * b2 + one_minus_b2 * g * g;                                                              \
        fresh[i] = f;                                                                                                \
        float r = root[i] / (sqrtf(f) + eps);                                                                        \
        if (r != r) nan_seen = 1; else if (r > max_ratio) max_ratio = r;                                            \
        float u0 = (m[i] / bc1) / denominator[i];                                                                    \
        if (clip) u0 = clip_to(u0, limit);                                                                           \
        u0_sq += (double)u0 * (double)u0;                                                                            \
        float u = use_wd ? u0 + wd * p[i] : u0;                                                                      \
        u_sq += (double)u * (double)u;                                                                               \
        last[i] = u;                                                                                                 \
    } while (0)

#ifdef ONEBIT_X86
__attribute__((target("avx2"))) static int64_t lamb_prepare_avx2(
    const float *m, float *last, float *fresh, const float *root, const float *denominator, const float *p, int64_t n,
    float b1, float neg_one_minus_b1, float b2, float one_minus_b2, float eps, float bc1, float wd, int use_wd,
    float limit, int clip, float *max_out, int *nan_out, double *u0_sq_out, double *u_sq_out) {
    const __m256 b1_v = _mm256_set1_ps(b1), neg_v = _mm256_set1_ps(neg_one_minus_b1), b2_v = _mm256_set1_ps(b2),
                 omb2_v = _mm256_set1_ps(one_minus_b2), eps_v = _mm256_set1_ps(eps), bc1_v = _mm256_set1_ps(bc1),
                 wd_v = _mm256_set1_ps(wd), limit_v = _mm256_set1_ps(limit);
    __m256 max_v = _mm256_set1_ps(-INFINITY), nan_v = _mm256_setzero_ps();
    __m256d u0_lo = _mm256_setzero_pd(), u0_hi = _mm256_setzero_pd(), u_lo = _mm256_setzero_pd(),
            u_hi = _mm256_setzero_pd();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 mi = _mm256_loadu_ps(m + i);
        __m256 g = _mm256_div_ps(_mm256_sub_ps(_mm256_mul_ps(_mm256_loadu_ps(last + i), b1_v), mi), neg_v);
        __m256 f = _mm256_add_ps(_mm256_mul_ps(_mm256_loadu_ps(fresh + i), b2_v),
                                 _mm256_mul_ps(_mm256_mul_ps(omb2_v, g), g));
        _mm256_storeu_ps(fresh + i, f);
        __m256 r = _mm256_div_ps(_mm256_loadu_ps(root + i), _mm256_add_ps(_mm256_sqrt_ps(f), eps_v));
        nan_v = _mm256_or_ps(nan_v, _mm256_cmp_ps(r, r, _CMP_UNORD_Q));
        max_v = _mm256_max_ps(max_v, r);
        __m256 u0 = _mm256_div_ps(_mm256_div_ps(mi, bc1_v), _mm256_loadu_ps(denominator + i));
        if (clip) u0 = clip_to_avx2(u0, limit_v);
        __m256d a = _mm256_cvtps_pd(_mm256_castps256_ps128(u0)), b = _mm256_cvtps_pd(_mm256_extractf128_ps(u0, 1));
        u0_lo = _mm256_add_pd(u0_lo, _mm256_mul_pd(a, a));
        u0_hi = _mm256_add_pd(u0_hi, _mm256_mul_pd(b, b));
        __m256 u = use_wd ? _mm256_add_ps(u0, _mm256_mul_ps(wd_v, _mm256_loadu_ps(p + i))) : u0;
        a = _mm256_cvtps_pd(_mm256_castps256_ps128(u));
        b = _mm256_cvtps_pd(_mm256_extractf128_ps(u, 1));
        u_lo = _mm256_add_pd(u_lo, _mm256_mul_pd(a, a));
        u_hi = _mm256_add_pd(u_hi, _mm256_mul_pd(b, b));
        _mm256_storeu_ps(last + i, u);
    }
    float lanes[8];
    double sums[4];
    _mm256_storeu_ps(lanes, max_v);
    for (int k = 0; k < 8; ++k) if (lanes[k] > *max_out) *max_out = lanes[k];
    _mm256_storeu_ps(lanes, nan_v);
    for (int k = 0; k < 8; ++k) if (lanes[k] != 0.0f || lanes[k] != lanes[k]) *nan_out = 1;
    _mm256_storeu_pd(sums, _mm256_add_pd(u0_lo, u0_hi));
    *u0_sq_out += (sums[0] + sums[1]) + (sums[2] + sums[3]);
    _mm256_storeu_pd(sums, _mm256_add_pd(u_lo, u_hi));
    *u_sq_out += (sums[0] + sums[1]) + (sums[2] + sums[3]);
    return i;
}
#endif

/* 1-bit LAMB's compression-stage first pass over one tensor (see LAMB_PREPARE_ELEMENT): updates `fresh`, writes u into
 * `last` (its scratch: the previous momentum is not needed after it) and returns in `out`: the largest ratio (NaN if
 * any ratio is NaN), sum u0^2 and sum u^2 (accumulated in double). Every element op is one float32 IEEE op. */
void onebit_lamb_prepare(const float *m, float *last, float *fresh, const float *root, const float *denominator,
                         const float *p, int64_t n, float b1, float neg_one_minus_b1, float b2, float one_minus_b2,
                         float eps, float bc1, float wd, int use_wd, float limit, int clip, double *out) {
    float max_ratio = -INFINITY;
    int nan_seen = 0;
    double u0_sq = 0.0, u_sq = 0.0;
    int64_t i = 0;
#ifdef ONEBIT_X86
    if (has_avx2())
        i = lamb_prepare_avx2(m, last, fresh, root, denominator, p, n, b1, neg_one_minus_b1, b2, one_minus_b2, eps, bc1,
                              wd, use_wd, limit, clip, &max_ratio, &nan_seen, &u0_sq, &u_sq);
#endif
    for (; i < n; ++i) LAMB_PREPARE_ELEMENT(i);
    out[0] = nan_seen ? (double)NAN : (double)max_ratio;
    out[1] = u0_sq;
    out[2] = u_sq;
}

/* p <- p + step * u over one tensor. */
void onebit_lamb_apply(float *p, const float *u, int64_t n, float step) {
    int64_t i = 0;
#ifdef ONEBIT_X86
    if (has_avx2()) i = axpy_avx2(p, u, n, step);
#endif
    for (; i < n; ++i) p[i] = p[i] + step * u[i];
}

/* ------------------------------------------------------------------ correctly rounded square roots */

/* out[i] = sqrt(x[i]): the IEEE square root (correctly rounded on every machine; -fno-math-errno lets the compiler
 * use the instruction). torch's own CPU sqrt is not correctly rounded and depends on the processor. */
void onebit_sqrt_f32(const float *x, int64_t n, float *out) {
    for (int64_t i = 0; i < n; ++i) out[i] = sqrtf(x[i]);
}

void onebit_sqrt_f64(const double *x, int64_t n, double *out) {
    for (int64_t i = 0; i < n; ++i) out[i] = sqrt(x[i]);
}
