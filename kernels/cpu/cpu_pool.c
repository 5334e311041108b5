/*
 * cpu_pool.c — pooling on the CPU: max (with indices), the plane
 * gather/scatter pair that max pooling's gradients are made of, and
 * average pooling with its adjoint, and bilinear resizing with its adjoint.
 * One plane (n, c) per OpenMP task (one output row for the resize).
 */
#include "kernels_impl.h"
#include "vision_math.h"
#include "../convert_math.h"

#include <stdlib.h>
#include <string.h>

/* A window's bounds clipped to the input, and the divisor of its average:
 * with count_include_pad the cells of the padded input it covers (a
 * ceil_mode window hanging past the right padding covers fewer than
 * kernel[0] * kernel[1]), else the input cells. */
#define WINDOW(a, oy, ox)                                                  \
    int64_t y0 = (oy) * (a)->p.stride[0] - (a)->p.padding[0];             \
    int64_t x0 = (ox) * (a)->p.stride[1] - (a)->p.padding[1];             \
    int64_t y1 = y0 + (a)->p.kernel[0], x1 = x0 + (a)->p.kernel[1];       \
    int64_t py1 = y1 < (a)->h + (a)->p.padding[0] ? y1 : (a)->h + (a)->p.padding[0]; \
    int64_t px1 = x1 < (a)->w + (a)->p.padding[1] ? x1 : (a)->w + (a)->p.padding[1]; \
    double cnt = (double)((py1 - y0) * (px1 - x0));                        \
    if (y0 < 0) y0 = 0;                                                    \
    if (x0 < 0) x0 = 0;                                                    \
    if (y1 > (a)->h) y1 = (a)->h;                                          \
    if (x1 > (a)->w) x1 = (a)->w;                                          \
    if (!(a)->p.count_include_pad) cnt = (double)((y1 - y0) * (x1 - x0));  \
    (void)cnt;

/* Planes go to the OpenMP team when there are several and enough input
 * elements to pay for waking it. */
static bool parallel(const kpl_pool_attrs *a)
{
    return a->n * a->c > 1 && a->n * a->c * a->h * a->w > 2 * KPL_PAR_GRAIN;
}

/* Bilinear resizing's taps along one side (kpl_lerp_tap), made once per
 * call; NULL when out of memory. */
typedef struct {
    int64_t i0, i1;
    double l;
} lerp_tap;

static lerp_tap *lerp_taps(int64_t in, int64_t out, bool align)
{
    lerp_tap *t = malloc(sizeof *t * (size_t)(out > 0 ? out : 1));
    for (int64_t i = 0; t && i < out; i++) kpl_lerp_tap(i, in, out, align, &t[i].i0, &t[i].i1, &t[i].l);
    return t;
}

/* c ? a : b through the bit patterns (c is 0 or 1): gcc turns a float
 * ?: into a branch, which random data mispredicts half the time. */
static inline float SEL_f32(uint32_t c, float a, float b)
{
    uint32_t ua, ub;
    memcpy(&ua, &a, 4);
    memcpy(&ub, &b, 4);
    ub ^= (ua ^ ub) & (0u - c);
    memcpy(&b, &ub, 4);
    return b;
}
static inline double SEL_f64(uint64_t c, double a, double b)
{
    uint64_t ua, ub;
    memcpy(&ua, &a, 8);
    memcpy(&ub, &b, 8);
    ub ^= (ua ^ ub) & (0u - c);
    memcpy(&b, &ub, 8);
    return b;
}

/* One output row of 2x2 / stride 2 windows (LeNet, VGG) from input rows
 * r0, r1, `base` being r0's offset in its plane: a select tree with no
 * data-dependent branch; ties keep the earlier cell.  Returns whether a
 * NaN was met, so the caller redoes the row by the general rule (the
 * first NaN wins). */
#define DEF_MAX2_ROW(T, tn, UT)                                                                 \
    static int max2_row_##tn(const T *r0, const T *r1, T *yo, int64_t *io, int64_t ow,          \
                             int64_t base, int64_t w)                                           \
    {                                                                                           \
        int nan = 0;                                                                            \
        for (int64_t ox = 0; ox < ow; ox++) {                                                   \
            T a0 = r0[2 * ox], a1 = r0[2 * ox + 1], a2 = r1[2 * ox], a3 = r1[2 * ox + 1];       \
            UT k01 = a1 > a0, k23 = a3 > a2;                                                    \
            T m01 = SEL_##tn(k01, a1, a0), m23 = SEL_##tn(k23, a3, a2);                         \
            UT kk = m23 > m01;                                                                  \
            yo[ox] = SEL_##tn(kk, m23, m01);                                                    \
            io[ox] = base + (int64_t)kk * w + 2 * ox + (int64_t)(k01 ^ ((k01 ^ k23) & (UT)-kk)); \
            nan |= (a0 != a0) | (a1 != a1) | (a2 != a2) | (a3 != a3);                           \
        }                                                                                       \
        return nan;                                                                             \
    }
DEF_MAX2_ROW(float, f32, uint32_t)
DEF_MAX2_ROW(double, f64, uint64_t)

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#include <immintrin.h>
#define KPL_HAVE_MAX2_AVX512 1
/* The f32 row on AVX-512, 16 windows per step: the pairs of each input
 * row split into even and odd lanes by two permutes, the select tree on
 * mask registers, the row's tail through masked loads and stores.  Rows
 * are short (14 windows in LeNet), so a vector loop with a scalar tail
 * would spend its time in the tail. */
__attribute__((target("avx512f"))) static int max2_row_f32_avx512(const float *r0,
                                                                  const float *r1, float *yo,
                                                                  int64_t *io, int64_t ow,
                                                                  int64_t base, int64_t w)
{
    const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26,
                                           28, 30);
    const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
    __mmask16 nan = 0;
    for (int64_t ox = 0; ox < ow; ox += 16) {
        int64_t n = ow - ox < 16 ? ow - ox : 16, n2 = 2 * n;
        __mmask16 m = (__mmask16)((1u << n) - 1);
        __mmask16 mlo = (__mmask16)(n2 >= 16 ? 0xFFFFu : (1u << n2) - 1);
        __mmask16 mhi = (__mmask16)(n2 <= 16 ? 0u : (1u << (n2 - 16)) - 1);
        __m512 p0 = _mm512_maskz_loadu_ps(mlo, r0 + 2 * ox);
        __m512 p1 = _mm512_maskz_loadu_ps(mhi, r0 + 2 * ox + 16);
        __m512 q0 = _mm512_maskz_loadu_ps(mlo, r1 + 2 * ox);
        __m512 q1 = _mm512_maskz_loadu_ps(mhi, r1 + 2 * ox + 16);
        __m512 a0 = _mm512_permutex2var_ps(p0, even, p1), a1 = _mm512_permutex2var_ps(p0, odd, p1);
        __m512 a2 = _mm512_permutex2var_ps(q0, even, q1), a3 = _mm512_permutex2var_ps(q0, odd, q1);
        __mmask16 k01 = _mm512_cmp_ps_mask(a1, a0, _CMP_GT_OQ);
        __mmask16 k23 = _mm512_cmp_ps_mask(a3, a2, _CMP_GT_OQ);
        __m512 m01 = _mm512_mask_blend_ps(k01, a0, a1), m23 = _mm512_mask_blend_ps(k23, a2, a3);
        __mmask16 kk = _mm512_cmp_ps_mask(m23, m01, _CMP_GT_OQ);
        _mm512_mask_storeu_ps(yo + ox, m, _mm512_mask_blend_ps(kk, m01, m23));
        nan |= _mm512_cmp_ps_mask(a0, a1, _CMP_UNORD_Q) | _mm512_cmp_ps_mask(a2, a3, _CMP_UNORD_Q);
        /* plane offset: base + 2 (ox + lane) + (kk ? w + k23 : k01) */
        __mmask16 right = (__mmask16)((kk & k23) | (~kk & k01));
        __m512i off = _mm512_mask_add_epi32(even, right, even, _mm512_set1_epi32(1));
        off = _mm512_mask_add_epi32(off, kk, off, _mm512_set1_epi32((int)w));
        __m512i b = _mm512_set1_epi64(base + 2 * ox);
        __m512i lo = _mm512_cvtepi32_epi64(_mm512_castsi512_si256(off));
        __m512i hi = _mm512_cvtepi32_epi64(_mm512_extracti64x4_epi64(off, 1));
        _mm512_mask_storeu_epi64(io + ox, (__mmask8)m, _mm512_add_epi64(b, lo));
        _mm512_mask_storeu_epi64(io + ox + 8, (__mmask8)(m >> 8), _mm512_add_epi64(b, hi));
    }
    return nan != 0;
}
#endif

/* The row function for the CPU at hand. */
typedef int (*max2_row_fn_f32)(const float *, const float *, float *, int64_t *, int64_t,
                               int64_t, int64_t);
typedef int (*max2_row_fn_f64)(const double *, const double *, double *, int64_t *, int64_t,
                               int64_t, int64_t);

static max2_row_fn_f32 max2_row_for_f32(void)
{
#ifdef KPL_HAVE_MAX2_AVX512
    if (__builtin_cpu_supports("avx512f")) return max2_row_f32_avx512;
#endif
    return max2_row_f32;
}
static max2_row_fn_f64 max2_row_for_f64(void) { return max2_row_f64; }

#define DEF_POOL(T, tn)                                                                            \
    static void max2_##tn(const kpl_pool_attrs *a, const T *x, T *y, int64_t *idx)             \
    {                                                                                          \
        max2_row_fn_##tn row = max2_row_for_##tn();                                            \
        KPL_PARALLEL_FOR_IF(pl, a->n * a->c, parallel(a),                                  \
            const T *xp = x + pl * a->h * a->w;                                                \
            for (int64_t oy = 0; oy < a->oh; oy++) {                                           \
                const T *r0 = xp + 2 * oy * a->w, *r1 = r0 + a->w;                             \
                T *yo = y + (pl * a->oh + oy) * a->ow;                                         \
                int64_t *io = idx + (pl * a->oh + oy) * a->ow;                                 \
                int nan = row(r0, r1, yo, io, a->ow, 2 * oy * a->w, a->w);                     \
                for (int64_t ox = 0; nan && ox < a->ow; ox++) {                                \
                    int64_t cell[4] = {2 * oy * a->w + 2 * ox, 2 * oy * a->w + 2 * ox + 1,    \
                                       (2 * oy + 1) * a->w + 2 * ox,                           \
                                       (2 * oy + 1) * a->w + 2 * ox + 1};                      \
                    int b = 0;                                                                 \
                    for (int k = 1; k < 4; k++) {                                              \
                        T v = xp[cell[k]], best = xp[cell[b]];                                 \
                        if (best == best && (v != v || v > best)) b = k;                       \
                    }                                                                          \
                    yo[ox] = xp[cell[b]];                                                      \
                    io[ox] = cell[b];                                                          \
                }                                                                              \
            });                                                                                \
    }                                                                                          \
    /* Values only (inference: no indices wanted): each output row's window      \
     * rows reduced into a row buffer first (contiguous, vectorised), then its   \
     * windows across it.  The same values as with indices: NaN wins. */       \
    static void max_values_##tn(const kpl_pool_attrs *a, const T *x, T *y)                    \
    {                                                                                          \
        KPL_PARALLEL_FOR_IF(pl, a->n * a->c, parallel(a),                                  \
            T row[a->w <= 16384 ? a->w : 1];                                                   \
            const T *xp = x + pl * a->h * a->w;                                                \
            if (a->w > 16384) { /* too wide for the stack: each window on the input */       \
                for (int64_t oy = 0; oy < a->oh; oy++)                                         \
                    for (int64_t ox = 0; ox < a->ow; ox++) {                                   \
                        WINDOW(a, oy, ox)                                                      \
                        T best = xp[y0 * a->w + x0];                                           \
                        for (int64_t iy = y0; iy < y1; iy++)                                   \
                            for (int64_t ix = x0; ix < x1; ix++) {                             \
                                T v = xp[iy * a->w + ix];                                      \
                                if (best == best && (v != v || v > best)) best = v;            \
                            }                                                                  \
                        y[(pl * a->oh + oy) * a->ow + ox] = best;                              \
                    }                                                                          \
                continue;                                                                      \
            }                                                                                  \
            for (int64_t oy = 0; oy < a->oh; oy++) {                                           \
                int64_t y0 = oy * a->p.stride[0] - a->p.padding[0], y1 = y0 + a->p.kernel[0]; \
                if (y0 < 0) y0 = 0;                                                            \
                if (y1 > a->h) y1 = a->h;                                                      \
                memcpy(row, xp + y0 * a->w, sizeof(T) * (size_t)a->w);                         \
                for (int64_t iy = y0 + 1; iy < y1; iy++) {                                     \
                    const T *r = xp + iy * a->w;                                               \
                    for (int64_t ix = 0; ix < a->w; ix++)                                      \
                        row[ix] = row[ix] == row[ix] && (r[ix] != r[ix] || r[ix] > row[ix])    \
                                      ? r[ix]                                                  \
                                      : row[ix];                                               \
                }                                                                              \
                T *yo = y + (pl * a->oh + oy) * a->ow;                                         \
                for (int64_t ox = 0; ox < a->ow; ox++) {                                       \
                    int64_t x0 = ox * a->p.stride[1] - a->p.padding[1], x1 = x0 + a->p.kernel[1]; \
                    if (x0 < 0) x0 = 0;                                                        \
                    if (x1 > a->w) x1 = a->w;                                                  \
                    T best = row[x0];                                                          \
                    for (int64_t ix = x0 + 1; ix < x1; ix++)                                   \
                        if (best == best && (row[ix] != row[ix] || row[ix] > best)) best = row[ix]; \
                    yo[ox] = best;                                                             \
                }                                                                              \
            });                                                                                \
    }                                                                                          \
    static void max_##tn(const kpl_pool_attrs *a, const T *x, T *y, int64_t *idx)              \
    {                                                                                          \
        if (!idx) {                                                                            \
            max_values_##tn(a, x, y);                                                          \
            return;                                                                            \
        }                                                                                      \
        if (a->p.kernel[0] == 2 && a->p.kernel[1] == 2 && a->p.stride[0] == 2 &&               \
            a->p.stride[1] == 2 && a->p.padding[0] == 0 && a->p.padding[1] == 0 &&             \
            2 * a->oh <= a->h && 2 * a->ow <= a->w) { /* no ceil_mode window hangs over */     \
            max2_##tn(a, x, y, idx);                                                           \
            return;                                                                            \
        }                                                                                      \
        KPL_PARALLEL_FOR_IF(pl, a->n * a->c, parallel(a),                                  \
            const T *xp = x + pl * a->h * a->w;                                                \
            for (int64_t oy = 0; oy < a->oh; oy++)                                             \
                for (int64_t ox = 0; ox < a->ow; ox++) {                                       \
                    WINDOW(a, oy, ox)                                                          \
                    int64_t bi = y0 * a->w + x0;                                               \
                    T best = xp[bi];                                                           \
                    for (int64_t iy = y0; iy < y1; iy++)                                       \
                        for (int64_t ix = x0; ix < x1; ix++) {                                 \
                            T v = xp[iy * a->w + ix];                                          \
                            if (best == best && (v != v || v > best)) {                        \
                                best = v;                                                      \
                                bi = iy * a->w + ix;                                           \
                            }                                                                  \
                        }                                                                      \
                    int64_t o = (pl * a->oh + oy) * a->ow + ox;                                \
                    y[o] = best;                                                               \
                    idx[o] = bi;                                                               \
                });                                                                            \
    }                                                                                          \
    static void avg_##tn(const kpl_pool_attrs *a, const T *x, T *y)                            \
    {                                                                                          \
        KPL_PARALLEL_FOR_IF(pl, a->n * a->c, parallel(a),                                  \
            const T *xp = x + pl * a->h * a->w;                                                \
            for (int64_t oy = 0; oy < a->oh; oy++)                                             \
                for (int64_t ox = 0; ox < a->ow; ox++) {                                       \
                    WINDOW(a, oy, ox)                                                          \
                    double s = 0;                                                              \
                    for (int64_t iy = y0; iy < y1; iy++)                                       \
                        for (int64_t ix = x0; ix < x1; ix++) s += (double)xp[iy * a->w + ix];  \
                    y[(pl * a->oh + oy) * a->ow + ox] = (T)(s / cnt);                          \
                });                                                                            \
    }                                                                                          \
    static void avg_bwd_##tn(const kpl_pool_attrs *a, const T *gy, T *gx)                      \
    {                                                                                          \
        KPL_PARALLEL_FOR_IF(pl, a->n * a->c, parallel(a),                                  \
            T *gp = gx + pl * a->h * a->w;                                                     \
            memset(gp, 0, sizeof(T) * (size_t)(a->h * a->w));                                  \
            for (int64_t oy = 0; oy < a->oh; oy++)                                             \
                for (int64_t ox = 0; ox < a->ow; ox++) {                                       \
                    WINDOW(a, oy, ox)                                                          \
                    T g = (T)((double)gy[(pl * a->oh + oy) * a->ow + ox] / cnt);               \
                    for (int64_t iy = y0; iy < y1; iy++)                                       \
                        for (int64_t ix = x0; ix < x1; ix++) gp[iy * a->w + ix] += g;          \
                });                                                                            \
    }                                                                                          \
    /* Rows then columns, as PyTorch's upsample_bilinear2d; one output row per task. */       \
    static void bilinear_##tn(const kpl_pool_attrs *a, const lerp_tap *ty, const lerp_tap *tx, \
                              const T *x, T *y)                                                \
    {                                                                                          \
        int64_t rows = a->n * a->c * a->oh;                                                    \
        KPL_PARALLEL_FOR_IF(r, rows, rows > 1 && rows * a->ow > 2 * KPL_PAR_GRAIN,             \
            int64_t pl = r / a->oh, oy = r % a->oh;                                            \
            const T *r0 = x + (pl * a->h + ty[oy].i0) * a->w;                                  \
            const T *r1 = x + (pl * a->h + ty[oy].i1) * a->w;                                  \
            T ly = (T)ty[oy].l, my = (T)1 - ly;                                                \
            T *yr = y + r * a->ow;                                                             \
            for (int64_t ox = 0; ox < a->ow; ox++) {                                           \
                T lx = (T)tx[ox].l, mx = (T)1 - lx;                                            \
                int64_t c0 = tx[ox].i0, c1 = tx[ox].i1;                                        \
                yr[ox] = my * (mx * r0[c0] + lx * r0[c1]) + ly * (mx * r1[c0] + lx * r1[c1]);  \
            });                                                                                \
    }                                                                                          \
    /* The adjoint: each plane's gy spread onto its zeroed gx plane, separably: a row of gy \
     * is first spread along x into a row t of w values (2 adds per cell), t then added    \
     * into the two input rows (2 w adds), where the four adds per cell of the direct      \
     * form cost twice as much when upsampling.  Without memory for t, the direct form. */ \
    static void bilinear_bwd_##tn(const kpl_pool_attrs *a, const lerp_tap *ty,                 \
                                  const lerp_tap *tx, const T *gy, T *gx)                      \
    {                                                                                          \
        KPL_PARALLEL_FOR_IF(pl, a->n * a->c, parallel(a),                                  \
            T *gp = gx + pl * a->h * a->w, *t = malloc(sizeof(T) * (size_t)a->w);             \
            memset(gp, 0, sizeof(T) * (size_t)(a->h * a->w));                                  \
            for (int64_t oy = 0; oy < a->oh; oy++) {                                           \
                T *g0 = gp + ty[oy].i0 * a->w, *g1 = gp + ty[oy].i1 * a->w;                    \
                T ly = (T)ty[oy].l, my = (T)1 - ly;                                            \
                const T *gr = gy + (pl * a->oh + oy) * a->ow;                                  \
                if (t) {                                                                       \
                    memset(t, 0, sizeof(T) * (size_t)a->w);                                    \
                    for (int64_t ox = 0; ox < a->ow; ox++) {                                   \
                        T lx = (T)tx[ox].l, g = gr[ox];                                        \
                        t[tx[ox].i0] += ((T)1 - lx) * g;                                       \
                        t[tx[ox].i1] += lx * g;                                                \
                    }                                                                          \
                    for (int64_t ix = 0; ix < a->w; ix++) {                                    \
                        g0[ix] += my * t[ix];                                                  \
                        g1[ix] += ly * t[ix];                                                  \
                    }                                                                          \
                    continue;                                                                  \
                }                                                                              \
                for (int64_t ox = 0; ox < a->ow; ox++) {                                       \
                    T lx = (T)tx[ox].l, mx = (T)1 - lx, g = gr[ox];                            \
                    int64_t c0 = tx[ox].i0, c1 = tx[ox].i1;                                    \
                    g0[c0] += my * mx * g;                                                     \
                    g0[c1] += my * lx * g;                                                     \
                    g1[c0] += ly * mx * g;                                                     \
                    g1[c1] += ly * lx * g;                                                     \
                }                                                                              \
            }                                                                                  \
            free(t););                                                                         \
    }                                                                                          \
    /* Returns the number of out-of-range indices met (they are skipped). */                   \
    static int64_t gather_##tn(const kpl_pool_attrs *a, const T *x, const int64_t *idx, T *y,  \
                               bool scatter)                                                   \
    {                                                                                          \
        int64_t bad = 0, hw = a->h * a->w, ohw = a->oh * a->ow;                                \
        _Pragma("omp parallel for schedule(static) reduction(+ : bad) if (parallel(a))")   \
        for (int64_t pl = 0; pl < a->n * a->c; pl++) {                                         \
            const int64_t *ip = idx + pl * ohw;                                                \
            if (scatter) {                                                                     \
                T *gp = y + pl * hw; /* y is gx here, x is gy */                               \
                memset(gp, 0, sizeof(T) * (size_t)hw);                                         \
                for (int64_t i = 0; i < ohw; i++) {                                            \
                    if (ip[i] < 0 || ip[i] >= hw) { bad++; continue; }                         \
                    gp[ip[i]] += x[pl * ohw + i];                                              \
                }                                                                              \
            } else {                                                                           \
                for (int64_t i = 0; i < ohw; i++) {                                            \
                    if (ip[i] < 0 || ip[i] >= hw) { bad++; y[pl * ohw + i] = 0; continue; }    \
                    y[pl * ohw + i] = x[pl * hw + ip[i]];                                      \
                }                                                                              \
            }                                                                                  \
        }                                                                                      \
        return bad;                                                                            \
    }

DEF_POOL(float, f32)
DEF_POOL(double, f64)

/* ---- max pooling on the kept layouts (nChw16c, NHWC) ----
 * A convolution's output held in a kept layout is pooled as it is (f32,
 * f64, and bf16/f16 compared as f32): value
 * (n, c, y, x) sits at n * ns + (c/16) * cs + (y * w + x) * ps + c % 16
 * (kpl_kept_geom), so each window cell is 16 channels' values side by
 * side and the rule (NaN wins, ties keep the earlier cell) runs on 16
 * lanes at once.  The output is written in the input's layout; the
 * indices (a plane offset per (n, c, oy, ox), as the plain kernel's) in
 * their plain layout.  One task is (n, channel block, output row). */
/* One output row: pl = n * C/16 + channel block.  The lane loops are
 * branch-free `omp simd` loops over plain arrays (GCC's generic vector
 * types came out 10x slower in the AVX2 and AVX-512 clones).  The clones
 * are of this per-task function: GCC's clones of a function holding the
 * parallel loop would all run the outlined body's baseline build. */
#define VROW 32
#define DEF_MAX_BLOCKED(T, P, tn, LD, ST)                                                                  \
    KPL_CLONES static void max_blocked_row_##tn(const kpl_pool_attrs *a, const kpl_kept_geom *gx, \
                                                const kpl_kept_geom *gy, const T *x, T *y,      \
                                                int64_t *idx, int64_t pl, int64_t oy)           \
    {                                                                                           \
        int64_t n = pl / (a->c / 16), cb = pl % (a->c / 16);                                    \
        const T *xp = x + n * gx->ns + cb * gx->cs;                                             \
        const int64_t w = a->w, ps = gx->ps;                                                    \
        for (int64_t ox = 0; ox < a->ow; ox++) {                                                \
            WINDOW(a, oy, ox)                                                                   \
            P best[16];                                                                         \
            int64_t bi[16];                                                                     \
            const T *v0 = xp + (y0 * w + x0) * ps;                                              \
            for (int l = 0; l < 16; l++) best[l] = LD(v0, l), bi[l] = y0 * w + x0;              \
            for (int64_t iy = y0; iy < y1; iy++)                                                \
                for (int64_t ix = x0; ix < x1; ix++) {                                          \
                    const T *v = xp + (iy * w + ix) * ps;                                       \
                    int64_t cell = iy * w + ix;                                                 \
                    if (idx) {                                                                  \
                        _Pragma("omp simd") for (int l = 0; l < 16; l++) {                      \
                            P v_ = LD(v, l);                                                    \
                            int take = (best[l] == best[l]) & ((v_ != v_) | (v_ > best[l]));    \
                            best[l] = take ? v_ : best[l];                                      \
                            bi[l] = take ? cell : bi[l];                                        \
                        }                                                                       \
                    } else {                                                                    \
                        _Pragma("omp simd") for (int l = 0; l < 16; l++) {                      \
                            P v_ = LD(v, l);                                                    \
                            int take = (best[l] == best[l]) & ((v_ != v_) | (v_ > best[l]));    \
                            best[l] = take ? v_ : best[l];                                      \
                        }                                                                       \
                    }                                                                           \
                }                                                                               \
            T *yo = y + n * gy->ns + cb * gy->cs + (oy * a->ow + ox) * gy->ps;                  \
            for (int l = 0; l < 16; l++) yo[l] = ST(best[l]);                                   \
            if (idx) {                                                                          \
                int64_t c0 = cb * 16;                                                           \
                for (int l = 0; l < 16; l++)                                                    \
                    idx[((n * a->c + c0 + l) * a->oh + oy) * a->ow + ox] = bi[l];               \
            }                                                                                   \
        }                                                                                       \
    }                                                                                           \
    /* Values only (no indices, as in inference): the window's cells in the  \
     * outer loops and a run of up to VROW outputs in the inner one, each     \
     * output's 16 lanes kept in acc: the outputs' updates are independent,  \
     * where the loop above chains every cell of a window through one        \
     * register (4x slower at ResNet-50's stem pool).  Cells go in the same   \
     * order per output, from -inf, so the result is the same. */              \
    KPL_CLONES static void max_blocked_vals_row_##tn(const kpl_pool_attrs *a,                   \
                                                     const kpl_kept_geom *gx,                   \
                                                     const kpl_kept_geom *gy, const T *x, T *y, \
                                                     int64_t pl, int64_t oy)                    \
    {                                                                                           \
        int64_t n = pl / (a->c / 16), cb = pl % (a->c / 16);                                    \
        const T *xp = x + n * gx->ns + cb * gx->cs;                                             \
        T *yp = y + n * gy->ns + cb * gy->cs + oy * a->ow * gy->ps;                             \
        const int64_t ps = gx->ps, sx = a->p.stride[1], px = a->p.padding[1];                  \
        P acc[VROW * 16];                                                                       \
        for (int64_t o0 = 0; o0 < a->ow; o0 += VROW) {                                          \
            int64_t m = a->ow - o0 < VROW ? a->ow - o0 : VROW;                                  \
            for (int64_t j = 0; j < m * 16; j++) acc[j] = -(P)INFINITY;                         \
            for (int64_t ky = 0; ky < a->p.kernel[0]; ky++) {                                   \
                int64_t iy = oy * a->p.stride[0] - a->p.padding[0] + ky;                        \
                if (iy < 0 || iy >= a->h) continue;                                             \
                for (int64_t kx = 0; kx < a->p.kernel[1]; kx++)                                 \
                    for (int64_t j = 0; j < m; j++) {                                           \
                        int64_t ix = (o0 + j) * sx - px + kx;                                   \
                        if (ix < 0 || ix >= a->w) continue;                                     \
                        const T *v = xp + (iy * a->w + ix) * ps;                                \
                        P *b = acc + j * 16;                                                    \
                        _Pragma("omp simd") for (int l = 0; l < 16; l++) {                      \
                            P v_ = LD(v, l), b_ = b[l];                                         \
                            int take = (b_ == b_) & ((v_ != v_) | (v_ > b_));                   \
                            b[l] = take ? v_ : b_;                                              \
                        }                                                                       \
                    }                                                                           \
            }                                                                                   \
            for (int64_t j = 0; j < m; j++)                                                     \
                for (int l = 0; l < 16; l++) yp[(o0 + j) * gy->ps + l] = ST(acc[j * 16 + l]);   \
        }                                                                                       \
    }                                                                                           \
    static void max_blocked_##tn(const kpl_pool_attrs *a, kpl_kept tag, const T *x, T *y,       \
                                 int64_t *idx)                                                  \
    {                                                                                           \
        int64_t rows = a->n * (a->c / 16) * a->oh;                                              \
        kpl_kept_geom gx = kpl__kept_geom(tag, a->c, a->h * a->w);                              \
        kpl_kept_geom gy = kpl__kept_geom(tag, a->c, a->oh * a->ow);                            \
        bool par = rows > 1 && a->n * a->c * a->h * a->w > 2 * KPL_PAR_GRAIN;                  \
        if (idx)                                                                                \
            KPL_PARALLEL_FOR_IF(r, rows, par, max_blocked_row_##tn(a, &gx, &gy, x, y, idx,       \
                                                                   r / a->oh, r % a->oh););    \
        else                                                                                    \
            KPL_PARALLEL_FOR_IF(r, rows, par, max_blocked_vals_row_##tn(a, &gx, &gy, x, y,      \
                                                                        r / a->oh, r % a->oh);); \
    }
#define LD_SAME(p, k) ((p)[k])
#define ST_SAME(v) (v)
#define LD_BF16(p, k) kpl_cvt_bf16_to_f32((p)[k])
#define LD_F16(p, k) kpl_cvt_f16_to_f32((p)[k])
DEF_MAX_BLOCKED(float, float, f32, LD_SAME, ST_SAME)
DEF_MAX_BLOCKED(double, double, f64, LD_SAME, ST_SAME)
/* the maximum is one of the values, so rounding it back is exact */
DEF_MAX_BLOCKED(uint16_t, float, bf16, LD_BF16, kpl_cvt_f32_to_bf16)
DEF_MAX_BLOCKED(uint16_t, float, f16, LD_F16, kpl_cvt_f32_to_f16)

/* Max pooling of a kept input into a keepable output: false to run the
 * plain loops (input plain, output not keepable, or shared bytes). */
static bool max_blocked(const kpl_kernel_args *args, const kpl_pool_attrs *a, kpl_dtype dt)
{
    const kpl_tensor *x = args->in[0], *ix = args->in[1];
    kpl_kept tag = kpl__kept(x);
    void *px = kpl__kept_data(x, tag);
    if (!px || !kpl__keepable(args->out) || args->out->storage == x->storage ||
        (ix && ix->storage == x->storage))
        return false;
    int64_t *pi = ix ? kpl__data((kpl_tensor *)ix) : NULL;
    void *po = kpl__kept_out(args->out);
    switch (dt) {
    case KPL_F64: max_blocked_f64(a, tag, px, po, pi); break;
    case KPL_BF16: max_blocked_bf16(a, tag, px, po, pi); break;
    case KPL_F16: max_blocked_f16(a, tag, px, po, pi); break;
    default: max_blocked_f32(a, tag, px, po, pi); break;
    }
    kpl__storage_set_kept(args->out, tag);
    return true;
}

/* Max pooling's gradient (plane_scatter) of a kept gy into a keepable gx,
 * left in gy's layout: the plain kernel's sums lane by lane (each cell
 * from 0, the window positions in order, so the same bits), where a plain
 * gx would turn every later reader of the gradient plain (a U-Net's batch
 * norms meet it with their kept inputs).  f32 and f64; false to run the
 * plain loops. */
#define DEF_SCATTER_KEPT(T, tn)                                                                  \
    static int64_t scatter_kept_##tn(const kpl_pool_attrs *a, kpl_kept tag, const T *gy,       \
                                     const int64_t *idx, T *gx)                                 \
    {                                                                                           \
        kpl_kept_geom gi = kpl__kept_geom(tag, a->c, a->oh * a->ow);                            \
        kpl_kept_geom go = kpl__kept_geom(tag, a->c, a->h * a->w);                              \
        int64_t hw = a->h * a->w, ohw = a->oh * a->ow, nb = a->c / 16, bad = 0;                 \
        _Pragma("omp parallel for schedule(static) reduction(+ : bad) if (parallel(a))")       \
        for (int64_t t = 0; t < a->n * nb; t++) {                                               \
            int64_t n = t / nb, cb = t % nb;                                                    \
            T *gp = gx + n * go.ns + cb * go.cs;                                                \
            const T *yp = gy + n * gi.ns + cb * gi.cs;                                          \
            for (int64_t p = 0; p < hw; p++) memset(gp + p * go.ps, 0, 16 * sizeof(T));         \
            for (int l = 0; l < 16; l++) {                                                      \
                const int64_t *ip = idx + (n * a->c + cb * 16 + l) * ohw;                       \
                for (int64_t i = 0; i < ohw; i++) {                                             \
                    if (ip[i] < 0 || ip[i] >= hw) { bad++; continue; }                         \
                    gp[ip[i] * go.ps + l] += yp[i * gi.ps + l];                                 \
                }                                                                               \
            }                                                                                   \
        }                                                                                       \
        return bad;                                                                             \
    }
DEF_SCATTER_KEPT(float, f32)
DEF_SCATTER_KEPT(double, f64)

/* -1: not taken (plain loops); else the count of indices out of range */
static int64_t scatter_kept(const kpl_kernel_args *args, const kpl_pool_attrs *a, kpl_dtype dt)
{
    const kpl_tensor *gy = args->in[0], *ix = args->in[1];
    kpl_kept tag = kpl__kept(gy);
    if (!tag || (dt != KPL_F32 && dt != KPL_F64) || args->out->storage == gy->storage ||
        ix->storage == args->out->storage || !kpl__keepable(args->out))
        return -1;
    const void *py = kpl__kept_data(gy, tag);
    if (!py) return -1;
    const int64_t *pi = kpl__cdata(ix);
    void *po = kpl__kept_out(args->out);
    int64_t bad = dt == KPL_F64 ? scatter_kept_f64(a, tag, py, pi, po)
                                : scatter_kept_f32(a, tag, py, pi, po);
    kpl__storage_set_kept(args->out, tag);
    return bad;
}

/* f16/bf16: each plane is widened into its thread's f32 buffer, pooled by
 * the f32 loops as a one-plane problem and rounded once into the output
 * (a max or a gather is exact; an average or a scatter's sum rounds once,
 * as the f32 kernel's result cast would). */
static kpl_status pool_half(const kpl_kernel_args *args, const kpl_pool_attrs *a, kpl_dtype dt,
                           const lerp_tap *ty, const lerp_tap *tx)
{
    bool bwd = KPL_POOL_KIND_BWD(a->kind);
    int64_t hw = a->h * a->w, ohw = a->oh * a->ow, planes = a->n * a->c;
    int64_t isz = bwd ? ohw : hw, osz = bwd ? hw : ohw;
    const char *x = kpl__cdata(args->in[0]);
    char *y = kpl__data(args->out);
    int64_t *midx = a->kind == KPL_POOL_MAX && args->in[1] ? kpl__data((kpl_tensor *)args->in[1])
                                                          : NULL;
    const int64_t *gidx = a->kind == KPL_POOL_GATHER || a->kind == KPL_POOL_SCATTER
                              ? kpl__cdata(args->in[1])
                              : NULL;
    kpl_pool_attrs one = *a;
    one.n = one.c = 1;
    int64_t bad = 0, lost = 0;
#pragma omp parallel if (parallel(a)) reduction(+ : bad, lost)
    {
        float *fi = malloc(sizeof(float) * (size_t)(isz ? isz : 1));
        float *fo = malloc(sizeof(float) * (size_t)(osz ? osz : 1));
        lost += !fi || !fo;
#pragma omp for schedule(static)
        for (int64_t pl = 0; pl < planes; pl++) {
            if (!fi || !fo) continue;
            kpl__cpu_widen_half(dt, fi, x + 2 * pl * isz, isz);
            switch (a->kind) {
            case KPL_POOL_MAX: max_f32(&one, fi, fo, midx ? midx + pl * ohw : NULL); break;
            case KPL_POOL_AVG: avg_f32(&one, fi, fo); break;
            case KPL_POOL_AVG_BWD: avg_bwd_f32(&one, fi, fo); break;
            case KPL_POOL_BILINEAR: bilinear_f32(&one, ty, tx, fi, fo); break;
            case KPL_POOL_BILINEAR_BWD: bilinear_bwd_f32(&one, ty, tx, fi, fo); break;
            default:
                bad += gather_f32(&one, fi, gidx + pl * ohw, fo, a->kind == KPL_POOL_SCATTER);
                break;
            }
            kpl__cpu_narrow_half(dt, y + 2 * pl * osz, fo, osz);
        }
        free(fi);
        free(fo);
    }
    KPL_CHECK(lost == 0, KPL_ENOMEM, "pool2d: no memory for a %lld-value plane buffer",
              (long long)(isz > osz ? isz : osz));
    KPL_CHECK(bad == 0, KPL_ERANGE, "%s: %lld indices outside the %lldx%lld plane",
              a->kind == KPL_POOL_SCATTER ? "plane_scatter" : "plane_gather", (long long)bad,
              (long long)a->h, (long long)a->w);
    return KPL_OK;
}

/* Bilinear resizing: its taps, then the loops of its dtype. */
static kpl_status cpu_bilinear(const kpl_kernel_args *args, const kpl_pool_attrs *a, kpl_dtype dt)
{
    lerp_tap *ty = lerp_taps(a->h, a->oh, a->align_corners);
    lerp_tap *tx = lerp_taps(a->w, a->ow, a->align_corners);
    kpl_status st = KPL_OK;
    bool bwd = a->kind == KPL_POOL_BILINEAR_BWD;
    const void *in0 = kpl__cdata(args->in[0]);
    void *out = kpl__data(args->out);
    if (!ty || !tx)
        st = KPL_ERROR(KPL_ENOMEM, "upsample_bilinear: no host memory for %lld taps",
                       (long long)(a->oh + a->ow));
    else if (dt == KPL_BF16 || dt == KPL_F16) st = pool_half(args, a, dt, ty, tx);
    else if (dt == KPL_F64) (bwd ? bilinear_bwd_f64 : bilinear_f64)(a, ty, tx, in0, out);
    else (bwd ? bilinear_bwd_f32 : bilinear_f32)(a, ty, tx, in0, out);
    free(ty);
    free(tx);
    return st;
}

static kpl_status cpu_pool(const kpl_kernel_args *args)
{
    const kpl_pool_attrs *a = args->attrs;
    kpl_dtype hdt = KPL_POOL_KIND_BWD(a->kind) ? args->out->dtype : args->in[0]->dtype;
    if (a->kind == KPL_POOL_BILINEAR || a->kind == KPL_POOL_BILINEAR_BWD)
        return cpu_bilinear(args, a, hdt);
    if (a->kind == KPL_POOL_MAX && max_blocked(args, a, hdt)) return KPL_OK;
    int64_t bad = a->kind == KPL_POOL_SCATTER ? scatter_kept(args, a, hdt) : -1;
    if (bad >= 0) {
        KPL_CHECK(bad == 0, KPL_ERANGE, "plane_scatter: %lld indices outside the %lldx%lld plane",
                  (long long)bad, (long long)a->h, (long long)a->w);
        return KPL_OK;
    }
    if (hdt == KPL_BF16 || hdt == KPL_F16) return pool_half(args, a, hdt, NULL, NULL);
    bool f64 = hdt == KPL_F64;
    const void *in0 = kpl__cdata(args->in[0]);
    void *out = kpl__data(args->out);
    bad = 0;
    switch (a->kind) {
    case KPL_POOL_MAX:
        if (f64) max_f64(a, in0, out, args->in[1] ? kpl__data((kpl_tensor *)args->in[1]) : NULL);
        else max_f32(a, in0, out, args->in[1] ? kpl__data((kpl_tensor *)args->in[1]) : NULL);
        break;
    case KPL_POOL_AVG:
        if (f64) avg_f64(a, in0, out);
        else avg_f32(a, in0, out);
        break;
    case KPL_POOL_AVG_BWD:
        if (f64) avg_bwd_f64(a, in0, out);
        else avg_bwd_f32(a, in0, out);
        break;
    case KPL_POOL_GATHER:
    case KPL_POOL_SCATTER: {
        const int64_t *idx = kpl__cdata(args->in[1]);
        bool sc = a->kind == KPL_POOL_SCATTER;
        bad = f64 ? gather_f64(a, in0, idx, out, sc) : gather_f32(a, in0, idx, out, sc);
        break;
    }
    case KPL_POOL_BILINEAR:
    case KPL_POOL_BILINEAR_BWD: break; /* cpu_bilinear's */
    }
    KPL_CHECK(bad == 0, KPL_ERANGE, "%s: %lld indices outside the %lldx%lld plane",
              a->kind == KPL_POOL_SCATTER ? "plane_scatter" : "plane_gather", (long long)bad,
              (long long)a->h, (long long)a->w);
    return KPL_OK;
}

void kpl__cpu_register_pool(void)
{
    kpl_kernel_register(KPL_KOP_POOL2D, KPL_DEVICE_CPU, KPL_F32, cpu_pool);
    kpl_kernel_register(KPL_KOP_POOL2D, KPL_DEVICE_CPU, KPL_F64, cpu_pool);
    kpl_kernel_register(KPL_KOP_POOL2D, KPL_DEVICE_CPU, KPL_BF16, cpu_pool);
    kpl_kernel_register(KPL_KOP_POOL2D, KPL_DEVICE_CPU, KPL_F16, cpu_pool);
}
