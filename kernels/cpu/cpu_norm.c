/*
 * cpu_norm.c — batch normalisation, forward and backward, as fused loops
 * over NCHW: one task per channel, rows of H*W contiguous values.
 *
 * Why not oneDNN's batch norm: its forward hands back mean and variance
 * that backward must be given again, and its plain-layout (ncsp) kernels
 * are no faster than these loops; these also serve f64, which the
 * gradient checks need.
 *
 * Statistics: f64 inputs take two passes (mean, then squared deviations),
 * so a large mean does not cancel the variance away; f32, f16 and bf16
 * inputs take one, the sums of x and x^2 in double: the square of a
 * 24-bit mantissa is exact in double, so E[x^2] - mean^2 loses ~1e-16 of
 * E[x^2], which stays below the inputs' own rounding (6e-8 of |mean|)
 * relative to the variance unless |mean| / std passes ~1e4 -- where the
 * f32 values themselves hold the deviations to 1e-4 of std.  The forward
 * leaves its statistics (the doubles it normalised with) on x's storage
 * as its derived copy (kpl_storage.packed), and the backward of the same,
 * unchanged x reads them instead of passing over x again; any write to x
 * drops them, and without them the backward computes the same doubles.
 *
 * Every per-channel sum accumulates in double element by element, and the
 * input gradient is evaluated in double before its one rounding to T.
 * The gradient needs it: gx = gamma inv (gy - mean(gy) - xhat mean(gy xhat))
 * is the small difference of two large terms whenever gy is nearly
 * parallel to xhat — always so with two values per channel (N = 2, 1x1),
 * where the true result is gamma inv (gy0 - gy1) / 2 eps / (var + eps),
 * eps / (var + eps) of either term.  One f32 rounding in the statistics
 * or the terms then costs ~1e-2 relative; in double the cancellation
 * leaves the result accurate to f32 rounding (the bound is held by
 * test_batch_norm_grad_f32_accuracy in tests/autograd/test_losses.c).
 * This is no slower than the f32 loops it replaced: those sums were
 * scalar (a compiler may not reassociate them), these vectorise over
 * explicit lanes (BN_FOLD), and the per-channel loops are built for AVX2
 * and AVX-512 too (KPL_CLONES; kernels/CMakeLists.txt turns off FMA
 * contraction for this file, so every build rounds alike).
 *
 * Under mixed precision x and y are f16/bf16 while gamma, beta and the
 * statistics stay f32: the sums are the same double sums of the widened
 * values, and only y and the input gradient are rounded to 16 bits, so
 * the activations cross memory at half the bytes (no f32 copies of them).
 *
 * KPL_KOP_BATCH_NORM_RELU is the same kernel with the ReLU folded in: the
 * forward rounds y as batch norm does, then applies relu's formula to the
 * rounded value (eltwise_math.h's, so -0 and NaN pass alike); the
 * backward masks gy by y > 0 as it reads it (KPL_BIN_RELU_BWD's product).
 * The results are those of the two ops, bit for bit, one pass over the
 * activations fewer each way.
 */
#include "../eltwise_math.h"
#include "kernels_impl.h"
#include "../convert_math.h"

#include <math.h>
#include <omp.h>
#include <stdatomic.h>
#include <string.h>

/* Partial sums in BN_LANES explicit lanes: value i of a row of hw goes
 * to lane i % BN_LANES, or, in rows shorter than BN_LANES, every value of
 * row n to lane n % BN_LANES.  Independent lanes let the compiler
 * vectorise and pipeline the sums without reassociating anything, so the
 * bits do not depend on the vector width.  ACC(j, k) adds the term of
 * element k of the tensor to lane j; a, c are the attrs and the channel. */
#define BN_LANES 8
#define BN_FOLD(ACC)                                                                      \
    for (int64_t n = 0; n < a->n; n++) {                                                  \
        int64_t o = (n * a->c + c) * a->hw, i = 0;                                        \
        if (a->hw >= BN_LANES) {                                                          \
            for (; i + BN_LANES <= a->hw; i += BN_LANES)                                  \
                for (int j = 0; j < BN_LANES; j++) ACC(j, o + i + j);                     \
            for (int j = 0; i < a->hw; i++, j++) ACC(j, o + i);                           \
        } else {                                                                          \
            for (int j = (int)(n % BN_LANES); i < a->hw; i++) ACC(j, o + i);               \
        }                                                                                 \
    }

static double lanes_total(const double *l)
{
    return ((l[0] + l[1]) + (l[2] + l[3])) + ((l[4] + l[5]) + (l[6] + l[7]));
}

/* The terms of the sums: x; (x - m)^2; gy and gy (x - m).  LD(p, k)
 * reads element k of p as a float or double. */
#define ACC_X(j, k) s[j] += (double)LD(x, k)
#define ACC_X_SQ(j, k)                                                                    \
    do {                                                                                  \
        double v_ = (double)LD(x, k);                                                     \
        s[j] += v_;                                                                       \
        q[j] += v_ * v_;                                                                  \
    } while (0)
#define ACC_SQDEV(j, k)                                                                   \
    do {                                                                                  \
        double d_ = (double)LD(x, k) - m;                                                 \
        q[j] += d_ * d_;                                                                  \
    } while (0)
/* gy, masked by the relu output yp > 0 when `relu` (a constant in each
 * kernel, so the test folds away and the loops stay vector loops). */
#define GY(gp, yp, k, relu)                                                               \
    ((relu) ? (double)(LD(gp, k) * (LD(yp, k) > 0 ? 1.0f : 0.0f)) : (double)LD(gp, k))
/* Stores v rounded to T, through relu's formula when `relu`. */
#define ST_ACT(T, o, k, v, relu)                                                           \
    do {                                                                                  \
        if (relu) {                                                                       \
            T r_ = ST(v);                                                                 \
            (o)[k] = LD(&r_, 0) < 0 ? (T)0 : r_;                                          \
        } else {                                                                          \
            (o)[k] = ST(v);                                                               \
        }                                                                                 \
    } while (0)
#define ACC_GRAD(j, k)                                                                    \
    do {                                                                                  \
        double g_ = GY(gy, ym, k, relu);                                                  \
        sg[j] += g_;                                                                      \
        sgx[j] += g_ * ((double)LD(x, k) - m);                                            \
    } while (0)
/* BN_FOLD(ACC_GRAD) of the relu kernels: the masked gy of a stretch of a
 * row goes to a buffer first, in a loop the compiler vectorises, and the
 * lanes sum it in BN_FOLD's order (value i of a row to lane i % BN_LANES;
 * stretches start at multiples of BN_LANES), so the bits are the same. */
#define BN_STRETCH 256
#define ACC_MASKED(j, t)                                                                  \
    do {                                                                                  \
        sg[j] += gm[t];                                                                   \
        sgx[j] += gm[t] * ((double)LD(x, o + i0 + (t)) - m);                              \
    } while (0)
#define BN_FOLD_MASKED_GRAD                                                               \
    for (int64_t n = 0; n < a->n; n++) {                                                  \
        int64_t o = (n * a->c + c) * a->hw;                                               \
        if (a->hw < BN_LANES) {                                                           \
            for (int64_t i = 0; i < a->hw; i++) ACC_GRAD((int)(n % BN_LANES), o + i);      \
            continue;                                                                     \
        }                                                                                 \
        for (int64_t i0 = 0; i0 < a->hw; i0 += BN_STRETCH) {                              \
            int len = (int)(a->hw - i0 < BN_STRETCH ? a->hw - i0 : BN_STRETCH), t = 0;    \
            double gm[BN_STRETCH];                                                        \
            for (int u = 0; u < len; u++) gm[u] = GY(gy, ym, o + i0 + u, true);           \
            for (; t + BN_LANES <= len; t += BN_LANES)                                    \
                for (int j = 0; j < BN_LANES; j++) ACC_MASKED(j, t + j);                  \
            for (int j = 0; t < len; t++, j++) ACC_MASKED(j, t);                          \
        }                                                                                 \
    }

/* The variance of one pass's sums (x of fewer than 64 bits: see the top). */
static inline double var_of_sums(double sumsq, double cnt, double m)
{
    double v = sumsq / cnt - m * m;
    return v > 0 ? v : 0;
}

/* Mean and biased variance of channel c: those the forward saved, else
 * computed (and saved, in the forward). */
#define BN_STATS(N, T)                                                                    \
    static inline __attribute__((always_inline)) void stats_##N(                          \
        const T *x, const kpl_bn_attrs *a, int64_t c,                                     \
                                 double *mean, double *var)                               \
    {                                                                                     \
        if (a->bwd && a->saved) {                                                         \
            *mean = a->saved[2 * c];                                                      \
            *var = a->saved[2 * c + 1];                                                   \
            return;                                                                       \
        }                                                                                 \
        double cnt = (double)(a->n * a->hw), s[BN_LANES] = {0}, q[BN_LANES] = {0};        \
        double m, v;                                                                      \
        if (sizeof(T) < sizeof(double)) {                                                 \
            BN_FOLD(ACC_X_SQ)                                                             \
            m = lanes_total(s) / cnt;                                                     \
            v = var_of_sums(lanes_total(q), cnt, m);                      \
        } else {                                                                          \
            BN_FOLD(ACC_X)                                                                \
            m = lanes_total(s) / cnt;                                                     \
            BN_FOLD(ACC_SQDEV)                                                            \
            v = lanes_total(q) / cnt;                                                     \
        }                                                                                 \
        *mean = m;                                                                        \
        *var = v;                                                                         \
        if (a->saved) {                                                                   \
            a->saved[2 * c] = m;                                                          \
            a->saved[2 * c + 1] = v;                                                      \
        }                                                                                 \
    }

/* One channel each; the OpenMP loops over channels call them.  N names
 * the variant; T is the dtype of x, y and their gradients, P that of
 * gamma, beta, the statistics and their gradients: f32 and f64
 * throughout, or f16/bf16 activations with f32 parameters and statistics
 * (the mixed-precision form, as autocast runs it).  ST(v) rounds a
 * computed value to T. */
#define BN_KERNELS(N, T, P)                                                               \
    BN_STATS(N, T)                                                                        \
    static inline __attribute__((always_inline)) void fwd_chan_##N(                       \
        const T *x, const P *g, const P *b, T *y, P *mo, P *vo, const kpl_bn_attrs *a,     \
        int64_t c, bool relu)                                                             \
    {                                                                                     \
        double m, v;                                                                      \
        stats_##N(x, a, c, &m, &v);                                                       \
        if (mo) mo[c] = (P)m;                                                             \
        if (vo) vo[c] = (P)v;                                                             \
        double inv = 1.0 / sqrt(v + a->eps);                                              \
        P scale = (P)((double)g[c] * inv), shift = (P)((double)b[c] - m * (double)g[c] * inv); \
        for (int64_t n = 0; n < a->n; n++) {                                              \
            const T *r = x + (n * a->c + c) * a->hw;                                      \
            T *o = y + (n * a->c + c) * a->hw;                                            \
            for (int64_t i = 0; i < a->hw; i++)                                           \
                ST_ACT(T, o, i, LD(r, i) * scale + shift, relu);                          \
        }                                                                                 \
    }                                                                                     \
    static inline __attribute__((always_inline)) void bwd_chan_##N(                       \
        const T *x, const T *gy, const T *ym, const P *g, T *gx, P *gg, P *gb,             \
        const kpl_bn_attrs *a, int64_t c, bool relu)                                      \
    {                                                                                     \
        double m, v, cnt = (double)(a->n * a->hw);                                        \
        stats_##N(x, a, c, &m, &v);                                                       \
        double inv = 1.0 / sqrt(v + a->eps), sg[BN_LANES] = {0}, sgx[BN_LANES] = {0};      \
        if (relu) {                                                                       \
            BN_FOLD_MASKED_GRAD                                                           \
        } else {                                                                          \
            BN_FOLD(ACC_GRAD)                                                             \
        }                                                                                 \
        double tg = lanes_total(sg), tgx = lanes_total(sgx);                              \
        /* sum(gy xhat) = inv sum(gy (x - mean)) */                                       \
        if (gg) gg[c] = (P)(tgx * inv);                                                   \
        if (gb) gb[c] = (P)tg;                                                            \
        if (!gx) return;                                                                  \
        /* gx = gamma inv ((gy - mean(gy)) - (x - mean) inv^2 mean(gy (x - mean))) */     \
        double k = (double)g[c] * inv, mg = tg / cnt, kx = inv * inv * tgx / cnt;         \
        for (int64_t n = 0; n < a->n; n++) {                                              \
            int64_t o0 = (n * a->c + c) * a->hw;                                          \
            const T *r = x + o0, *d = gy + o0, *ry = relu ? ym + o0 : NULL;               \
            T *o = gx + o0;                                                               \
            for (int64_t i = 0; i < a->hw; i++)                                           \
                o[i] = ST(k * ((GY(d, ry, i, relu) - mg) - ((double)LD(r, i) - m) * kx));  \
        }                                                                                 \
    }                                                                                     \
    KPL_CLONES static void fwd_plain_##N(const T *x, const P *g, const P *b, T *y, P *mo,  \
                                         P *vo, const kpl_bn_attrs *a, int64_t c)         \
    {                                                                                     \
        fwd_chan_##N(x, g, b, y, mo, vo, a, c, false);                                    \
    }                                                                                     \
    KPL_CLONES static void fwd_relu_##N(const T *x, const P *g, const P *b, T *y, P *mo,   \
                                        P *vo, const kpl_bn_attrs *a, int64_t c)          \
    {                                                                                     \
        fwd_chan_##N(x, g, b, y, mo, vo, a, c, true);                                     \
    }                                                                                     \
    KPL_CLONES static void bwd_plain_##N(const T *x, const T *gy, const P *g, T *gx,       \
                                         P *gg, P *gb, const kpl_bn_attrs *a, int64_t c)  \
    {                                                                                     \
        bwd_chan_##N(x, gy, NULL, g, gx, gg, gb, a, c, false);                            \
    }                                                                                     \
    KPL_CLONES static void bwd_relu_##N(const T *x, const T *gy, const T *ym, const P *g,  \
                                        T *gx, P *gg, P *gb, const kpl_bn_attrs *a,       \
                                        int64_t c)                                        \
    {                                                                                     \
        bwd_chan_##N(x, gy, ym, g, gx, gg, gb, a, c, true);                               \
    }                                                                                     \
    static void fwd_##N(const kpl_kernel_args *args, const kpl_bn_attrs *a)               \
    {                                                                                     \
        const T *x = kpl__cdata(args->in[0]);                                             \
        const P *g = kpl__cdata(args->in[1]), *b = kpl__cdata(args->in[2]);               \
        T *y = kpl__data(args->out);                                                      \
        P *mo = a->mean ? kpl__data(a->mean) : NULL, *vo = a->var ? kpl__data(a->var) : NULL; \
        if (a->relu)                                                                      \
            KPL_PARALLEL_FOR_IF(c, a->c, a->c > 1, fwd_relu_##N(x, g, b, y, mo, vo, a, c);); \
        else                                                                              \
            KPL_PARALLEL_FOR_IF(c, a->c, a->c > 1, fwd_plain_##N(x, g, b, y, mo, vo, a, c);); \
    }                                                                                     \
    static void bwd_##N(const kpl_kernel_args *args, const kpl_bn_attrs *a)               \
    {                                                                                     \
        const T *x = kpl__cdata(args->in[0]), *gy = kpl__cdata(args->in[1]);             \
        const P *g = kpl__cdata(args->in[2]);                                             \
        T *gx = a->gx ? kpl__data(a->gx) : NULL;                                          \
        P *gg = a->ggamma ? kpl__data(a->ggamma) : NULL;                                  \
        P *gb = a->gbeta ? kpl__data(a->gbeta) : NULL;                                    \
        const T *ym = a->relu ? kpl__cdata(a->relu_y) : NULL;                             \
        if (ym)                                                                           \
            KPL_PARALLEL_FOR_IF(c, a->c, a->c > 1,                                        \
                                bwd_relu_##N(x, gy, ym, g, gx, gg, gb, a, c););           \
        else                                                                              \
            KPL_PARALLEL_FOR_IF(c, a->c, a->c > 1,                                        \
                                bwd_plain_##N(x, gy, g, gx, gg, gb, a, c););              \
    }

/* ---- the kept layouts (nChw16c, NHWC) ----
 * The same sums in the same order, 16 channels at a time: value i of row
 * (n, c) sits at n * ns + (c / 16) * cs + i * ps + c % 16 (kpl_kept_geom:
 * nChw16c ((n * C/16 + c/16) * hw + i) * 16 + c % 16, NHWC (n * hw + i) * C
 * + c), and each channel's values still meet BN_FOLD's lanes in BN_FOLD's
 * order, so the results are bit-identical to the plain kernels'.
 * BLK_FOLD(A, B, TERMS) adds to the lanes' sums A[j][l] and B[j][l]
 * (channel l of the 16) the terms TERMS(a, b, k) adds to a[l], b[l] for
 * the 16 channels' values at offset k.  (The 256 sums live in memory; a
 * lane at a time in registers, over spans of pixels, was slower here:
 * the strided reads defeat the prefetcher.)  x is only f32, f16 or bf16
 * here (f64 is never kept). */
#define BLK_FOLD(A, B, TERMS)                                                             \
    for (int64_t n = 0; n < a->n; n++) {                                                  \
        int64_t o = n * gm->ns + cb * gm->cs, ps = gm->ps, i = 0;                         \
        if (a->hw >= BN_LANES) {                                                          \
            for (; i + BN_LANES <= a->hw; i += BN_LANES)                                  \
                for (int j = 0; j < BN_LANES; j++) TERMS(A[j], B[j], o + (i + j) * ps);   \
            for (int j = 0; i < a->hw; i++, j++) TERMS(A[j], B[j], o + i * ps);           \
        } else {                                                                          \
            for (int j = (int)(n % BN_LANES); i < a->hw; i++) TERMS(A[j], B[j], o + i * ps); \
        }                                                                                 \
    }

static double lanes_total_at(double l[BN_LANES][16], int c)
{
    return ((l[0][c] + l[1][c]) + (l[2][c] + l[3][c])) + ((l[4][c] + l[5][c]) + (l[6][c] + l[7][c]));
}

/* The terms: x and x^2; gy and gy (x - mean). */
#define BTERMS_X_SQ(ra, rb, k)                                                            \
    for (int l = 0; l < 16; l++) {                                                        \
        double v_ = (double)LD(x, (k) + l);                                               \
        ra[l] += v_;                                                                      \
        rb[l] += v_ * v_;                                                                 \
    }
#define BTERMS_GRAD(ra, rb, k)                                                            \
    for (int l = 0; l < 16; l++) {                                                        \
        double g_ = GY(gy, ym, (k) + l, relu);                                            \
        ra[l] += g_;                                                                      \
        rb[l] += g_ * ((double)LD(x, (k) + l) - m[(cb - cb0) * 16 + l]);                  \
    }

/* BLK_FOLD's sums for f32 and bf16, eight channels at a time in GCC's
 * vector types: a lane's sums of 8 channels are one 8-double vector (a
 * zmm on AVX-512, two ymm on AVX2), so both sums of all 8 lanes (16
 * vectors) stay in registers while the loop walks the pixels in order;
 * the two halves of the 16 channels take a pass each.  Each value meets
 * the same operations in the same order as in BLK_FOLD (the vectors only
 * group channels), so the bits are the same.  LDV8_x(p) reads 8 values
 * as floats. */
typedef double v8d __attribute__((vector_size(64)));
typedef float v8f __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));
typedef uint32_t v8u __attribute__((vector_size(32)));
typedef uint16_t v8h __attribute__((vector_size(16)));

/* (macros: a function returning a vector changes ABI with the clone's ISA) */
#define ldv8_float(p)                                                                     \
    ({                                                                                    \
        v8f v_;                                                                           \
        memcpy(&v_, (p), sizeof v_);                                                      \
        v_;                                                                               \
    })
#define ldv8_bf16(p)                                                                      \
    ({                                                                                    \
        v8h h_;                                                                           \
        memcpy(&h_, (p), sizeof h_);                                                      \
        (v8f)(__builtin_convertvector(h_, v8u) << 16);                                    \
    })
#define ldv8_f16(p) (p) /* unused: f16 takes BLK_FOLD */

/* A task takes channel blocks [cb0, cb1), at most GMAX of them: in NHWC a
 * pixel's channels sit side by side, so the blocks of one task share the
 * cache lines a block alone would read half of (bf16: 32 of 64 bytes),
 * and its loops walk pixels outside and blocks inside. */
#define GMAX 8

/* VFOLD(A, B, LDV, TERMS) runs TERMS(va, vb, j, k, LDV) for each block cb
 * of the task, each half h of its 16 channels, each lane j and offset k
 * of the half's 8 values, in BLK_FOLD's order per channel, then adds the
 * lanes' vectors into A[cb - cb0][j][h + l], B[cb - cb0][j][h + l].  Rows
 * go in spans of VSPAN pixels, each span once per block and half while
 * its lines are in L1; inside a span the lane is a constant in each TERMS
 * (unrolled), so the 16 vectors are registers. */
#define VSPAN 64
#define VFOLD(A, B, LDV, TERMS)                                                           \
    do {                                                                                  \
        v8d sa_[GMAX][2][BN_LANES], sb_[GMAX][2][BN_LANES];                               \
        memset(sa_, 0, sizeof sa_);                                                       \
        memset(sb_, 0, sizeof sb_);                                                       \
        for (int64_t n = 0; n < a->n; n++) {                                              \
            int64_t ps = gm->ps, full = a->hw >= BN_LANES ? a->hw / BN_LANES * BN_LANES : 0; \
            for (int64_t i0 = 0; i0 < full; i0 += VSPAN) {                                \
                int64_t end = i0 + VSPAN < full ? i0 + VSPAN : full;                      \
                for (int64_t cb = cb0; cb < cb1; cb++)                                    \
                    for (int h = 0; h < 16; h += 8) {                                     \
                        int64_t o = n * gm->ns + cb * gm->cs + h;                         \
                        v8d va[BN_LANES], vb[BN_LANES];                                   \
                        memcpy(va, sa_[cb - cb0][h / 8], sizeof va);                      \
                        memcpy(vb, sb_[cb - cb0][h / 8], sizeof vb);                      \
                        for (int64_t i = i0; i < end; i += BN_LANES) {                    \
                            _Pragma("GCC unroll 8") for (int j = 0; j < BN_LANES; j++)    \
                                TERMS(va, vb, j, o + (i + j) * ps, LDV);                  \
                        }                                                                 \
                        memcpy(sa_[cb - cb0][h / 8], va, sizeof va);                      \
                        memcpy(sb_[cb - cb0][h / 8], vb, sizeof vb);                      \
                    }                                                                     \
            }                                                                             \
            for (int64_t cb = cb0; cb < cb1; cb++)                                        \
                for (int h = 0; h < 16; h += 8) {                                         \
                    int64_t o = n * gm->ns + cb * gm->cs + h;                             \
                    v8d *ta_ = sa_[cb - cb0][h / 8], *tb_ = sb_[cb - cb0][h / 8];         \
                    if (a->hw >= BN_LANES) { /* the tail: pixel full + j to lane j */     \
                        for (int j = 0; full + j < a->hw; j++)                            \
                            TERMS(ta_, tb_, j, o + (full + j) * ps, LDV);                 \
                    } else { /* a short row: every pixel to lane n % 8 */                 \
                        for (int64_t i = 0; i < a->hw; i++)                               \
                            TERMS(ta_, tb_, (int)(n % BN_LANES), o + i * ps, LDV);        \
                    }                                                                     \
                }                                                                         \
        }                                                                                 \
        for (int64_t cb = cb0; cb < cb1; cb++)                                            \
            for (int j = 0; j < BN_LANES; j++)                                            \
                for (int l = 0; l < 16; l++) {                                            \
                    A[cb - cb0][j][l] += sa_[cb - cb0][l / 8][j][l % 8];                  \
                    B[cb - cb0][j][l] += sb_[cb - cb0][l / 8][j][l % 8];                  \
                }                                                                         \
    } while (0)
#define VTERMS_X_SQ(va, vb, j, k, LDV)                                                    \
    do {                                                                                  \
        v8d d_ = __builtin_convertvector(LDV(x + (k)), v8d);                              \
        va[j] += d_;                                                                      \
        vb[j] += d_ * d_;                                                                 \
    } while (0)
/* gy masked as GY does: the float product with 1 or 0, then widened */
#define VTERMS_GRAD(va, vb, j, k, LDV)                                                    \
    do {                                                                                  \
        v8f g_ = LDV(gy + (k));                                                           \
        if (relu) g_ = g_ * (v8f)((v8i)(LDV(ym + (k)) > 0) & (v8i)one_);                  \
        v8d gd_ = __builtin_convertvector(g_, v8d);                                       \
        va[j] += gd_;                                                                     \
        vb[j] += gd_ * (__builtin_convertvector(LDV(x + (k)), v8d) - mv_[cb - cb0][h / 8]); \
    } while (0)
/* The input gradient, 8 channels a vector: the same operations per value
 * (the double formula, the rounding to float, then to T), pixels outside
 * and the task's blocks inside.  stv8_x(p, v) stores 8 floats as T,
 * rounded as ST rounds. */
#define stv8_float(p, v)                                                                  \
    do {                                                                                  \
        v8f s_ = (v);                                                                     \
        memcpy((p), &s_, sizeof s_);                                                      \
    } while (0)
#define stv8_bf16(p, v)                                                                   \
    do {                                                                                  \
        v8u x_ = (v8u)(v);                                                                \
        v8u nan_ = (v8u)((x_ & 0x7fffffffu) > 0x7f800000u);                               \
        v8u r_ = (x_ + 0x7fffu + ((x_ >> 16) & 1u)) >> 16;                                \
        v8u out_ = (nan_ & ((x_ >> 16) | 0x40u)) | (~nan_ & r_);                          \
        v8h h_ = __builtin_convertvector(out_, v8h);                                      \
        memcpy((p), &h_, sizeof h_);                                                      \
    } while (0)
#define BWRITE_V(LDV, STV)                                                                \
    do {                                                                                  \
        v8d kv_[GMAX][2], mgv_[GMAX][2], kxv_[GMAX][2];                                   \
        for (int64_t l = 0; l < nc; l++) {                                                \
            kv_[l / 16][l % 16 / 8][l % 8] = k[l];                                        \
            mgv_[l / 16][l % 16 / 8][l % 8] = mg[l];                                      \
            kxv_[l / 16][l % 16 / 8][l % 8] = kx[l];                                      \
        }                                                                                 \
        for (int64_t n = 0; n < a->n; n++)                                                \
            for (int64_t i = 0; i < a->hw; i++)                                           \
                for (int64_t cb = cb0; cb < cb1; cb++)                                    \
                    _Pragma("GCC unroll 2") for (int h = 0; h < 2; h++) {                 \
                        int64_t e = n * gm->ns + cb * gm->cs + i * gm->ps + 8 * h;        \
                        int64_t t = cb - cb0;                                             \
                        v8f g_ = LDV(gy + e);                                             \
                        if (relu) g_ = g_ * (v8f)((v8i)(LDV(ym + e) > 0) & (v8i)one_);    \
                        v8d r_ = kv_[t][h] *                                              \
                                 ((__builtin_convertvector(g_, v8d) - mgv_[t][h]) -       \
                                  (__builtin_convertvector(LDV(x + e), v8d) - mv_[t][h]) * \
                                      kxv_[t][h]);                                        \
                        STV(gx + e, __builtin_convertvector(r_, v8f));                    \
                    }                                                                     \
    } while (0)
/* The task's folds and input gradient: VFOLD and BWRITE_V where
 * a->vec_sums (f32, bf16: VEC 1), else BLK_FOLD a block at a time and the
 * scalar loop (and always for f16: VEC 0). */
#define GFOLD_MEM(SA, SB, TERMS)                                                          \
    for (int64_t cb = cb0; cb < cb1; cb++) BLK_FOLD(SA[cb - cb0], SB[cb - cb0], B##TERMS)
#define GFOLD_1(SA, SB, LDV, TERMS)                                                       \
    do {                                                                                  \
        if (a->vec_sums)                                                                  \
            VFOLD(SA, SB, LDV, V##TERMS);                                                 \
        else                                                                              \
            GFOLD_MEM(SA, SB, TERMS);                                                     \
    } while (0)
#define GFOLD_0(SA, SB, LDV, TERMS) GFOLD_MEM(SA, SB, TERMS)
#define BWRITE_1(LDV, STV)                                                                \
    if (a->vec_sums) {                                                                    \
        BWRITE_V(LDV, STV);                                                               \
        return;                                                                           \
    }
#define BWRITE_0(LDV, STV)

#define BN_BLOCKED(N, T, P, VEC)                                                          \
    static inline __attribute__((always_inline)) void bstats_##N(                         \
        const T *x, const kpl_bn_attrs *a, const kpl_kept_geom *gm, int64_t cb0,          \
        int64_t cb1, double *m, double *var)                                              \
    {                                                                                     \
        int64_t nc = (cb1 - cb0) * 16;                                                    \
        double *sv = a->saved ? a->saved + 2 * 16 * cb0 : NULL;                           \
        if (a->bwd && sv) {                                                               \
            for (int64_t l = 0; l < nc; l++) m[l] = sv[2 * l], var[l] = sv[2 * l + 1];    \
            return;                                                                       \
        }                                                                                 \
        double cnt = (double)(a->n * a->hw);                                              \
        double s[GMAX][BN_LANES][16] = {{{0}}}, q[GMAX][BN_LANES][16] = {{{0}}};          \
        GFOLD_##VEC(s, q, ldv8_##N, TERMS_X_SQ);                                          \
        for (int64_t l = 0; l < nc; l++) {                                                \
            m[l] = lanes_total_at(s[l / 16], (int)(l % 16)) / cnt;                        \
            var[l] = var_of_sums(lanes_total_at(q[l / 16], (int)(l % 16)), cnt, m[l]);    \
        }                                                                                 \
        for (int64_t l = 0; l < nc && sv; l++) sv[2 * l] = m[l], sv[2 * l + 1] = var[l];  \
    }                                                                                     \
    static inline __attribute__((always_inline)) void bfwd_blk_##N(                       \
        const T *x, const P *g, const P *b, T *y, P *mo, P *vo, const kpl_bn_attrs *a,     \
        const kpl_kept_geom *gm, int64_t cb0, int64_t cb1, bool relu)                     \
    {                                                                                     \
        double m[GMAX * 16], v[GMAX * 16];                                                \
        P scale[GMAX * 16], shift[GMAX * 16];                                             \
        int64_t nc = (cb1 - cb0) * 16;                                                    \
        bstats_##N(x, a, gm, cb0, cb1, m, v);                                             \
        for (int64_t l = 0; l < nc; l++) {                                                \
            int64_t c = cb0 * 16 + l;                                                     \
            if (mo) mo[c] = (P)m[l];                                                      \
            if (vo) vo[c] = (P)v[l];                                                      \
            double inv = 1.0 / sqrt(v[l] + a->eps);                                       \
            scale[l] = (P)((double)g[c] * inv);                                           \
            shift[l] = (P)((double)b[c] - m[l] * (double)g[c] * inv);                     \
        }                                                                                 \
        if (cb1 - cb0 == 1) { /* one block (nChw16c): its 16 factors stay in registers */ \
            P sc[16], sh[16];                                                             \
            memcpy(sc, scale, sizeof sc);                                                 \
            memcpy(sh, shift, sizeof sh);                                                 \
            for (int64_t n = 0; n < a->n; n++)                                            \
                for (int64_t i = 0; i < a->hw; i++) {                                     \
                    int64_t o = n * gm->ns + cb0 * gm->cs + i * gm->ps;                   \
                    for (int l = 0; l < 16; l++)                                          \
                        ST_ACT(T, y, o + l, LD(x, o + l) * sc[l] + sh[l], relu);          \
                }                                                                         \
            return;                                                                       \
        }                                                                                 \
        for (int64_t n = 0; n < a->n; n++)                                                \
            for (int64_t i = 0; i < a->hw; i++)                                           \
                for (int64_t cb = cb0; cb < cb1; cb++) {                                  \
                    int64_t o = n * gm->ns + cb * gm->cs + i * gm->ps;                    \
                    const P *sc = scale + (cb - cb0) * 16, *sh = shift + (cb - cb0) * 16;  \
                    for (int l = 0; l < 16; l++)                                          \
                        ST_ACT(T, y, o + l, LD(x, o + l) * sc[l] + sh[l], relu);          \
                }                                                                         \
    }                                                                                     \
    static inline __attribute__((always_inline)) void bbwd_blk_##N(                       \
        const T *x, const T *gy, const T *ym, const P *g, T *gx, P *gg, P *gb,             \
        const kpl_bn_attrs *a, const kpl_kept_geom *gm, int64_t cb0, int64_t cb1,         \
        bool relu)                                                                        \
    {                                                                                     \
        int64_t nc = (cb1 - cb0) * 16;                                                    \
        double m[GMAX * 16], v[GMAX * 16], cnt = (double)(a->n * a->hw);                  \
        double sg[GMAX][BN_LANES][16] = {{{0}}}, sgx[GMAX][BN_LANES][16] = {{{0}}};       \
        double k[GMAX * 16], mg[GMAX * 16], kx[GMAX * 16];                                \
        bstats_##N(x, a, gm, cb0, cb1, m, v);                                             \
        v8f one_ = {1, 1, 1, 1, 1, 1, 1, 1};                                              \
        v8d mv_[GMAX][2];                                                                 \
        for (int64_t l = 0; l < nc; l++) mv_[l / 16][l % 16 / 8][l % 8] = m[l];           \
        (void)one_;                                                                       \
        (void)mv_;                                                                        \
        GFOLD_##VEC(sg, sgx, ldv8_##N, TERMS_GRAD);                                       \
        for (int64_t l = 0; l < nc; l++) {                                                \
            int64_t c = cb0 * 16 + l;                                                     \
            double inv = 1.0 / sqrt(v[l] + a->eps);                                       \
            double tg = lanes_total_at(sg[l / 16], (int)(l % 16));                        \
            double tgx = lanes_total_at(sgx[l / 16], (int)(l % 16));                      \
            if (gg) gg[c] = (P)(tgx * inv);                                               \
            if (gb) gb[c] = (P)tg;                                                        \
            k[l] = (double)g[c] * inv, mg[l] = tg / cnt, kx[l] = inv * inv * tgx / cnt;   \
        }                                                                                 \
        if (!gx) return;                                                                  \
        BWRITE_##VEC(ldv8_##N, stv8_##N)                                                  \
        for (int64_t n = 0; n < a->n; n++)                                                \
            for (int64_t i = 0; i < a->hw; i++)                                           \
                for (int64_t cb = cb0; cb < cb1; cb++)                                    \
                    for (int l = 0; l < 16; l++) {                                        \
                        int64_t e = n * gm->ns + cb * gm->cs + i * gm->ps + l;            \
                        int64_t t = (cb - cb0) * 16 + l;                                  \
                        gx[e] = ST(k[t] * ((GY(gy, ym, e, relu) - mg[t]) -                \
                                           ((double)LD(x, e) - m[t]) * kx[t]));           \
                    }                                                                     \
    }                                                                                     \
    KPL_CLONES static void bfwd_plain_##N(const T *x, const P *g, const P *b, T *y, P *mo, \
                                          P *vo, const kpl_bn_attrs *a,                   \
                                          const kpl_kept_geom *gm, int64_t cb0, int64_t cb1) \
    {                                                                                     \
        bfwd_blk_##N(x, g, b, y, mo, vo, a, gm, cb0, cb1, false);                         \
    }                                                                                     \
    KPL_CLONES static void bfwd_relu_##N(const T *x, const P *g, const P *b, T *y, P *mo,  \
                                         P *vo, const kpl_bn_attrs *a,                    \
                                         const kpl_kept_geom *gm, int64_t cb0, int64_t cb1) \
    {                                                                                     \
        bfwd_blk_##N(x, g, b, y, mo, vo, a, gm, cb0, cb1, true);                          \
    }                                                                                     \
    KPL_CLONES static void bbwd_plain_##N(const T *x, const T *gy, const P *g, T *gx,      \
                                          P *gg, P *gb, const kpl_bn_attrs *a,            \
                                          const kpl_kept_geom *gm, int64_t cb0, int64_t cb1) \
    {                                                                                     \
        bbwd_blk_##N(x, gy, NULL, g, gx, gg, gb, a, gm, cb0, cb1, false);                 \
    }                                                                                     \
    KPL_CLONES static void bbwd_relu_##N(const T *x, const T *gy, const T *ym, const P *g, \
                                         T *gx, P *gg, P *gb, const kpl_bn_attrs *a,      \
                                         const kpl_kept_geom *gm, int64_t cb0, int64_t cb1) \
    {                                                                                     \
        bbwd_blk_##N(x, gy, ym, g, gx, gg, gb, a, gm, cb0, cb1, true);                    \
    }                                                                                     \
    static void bfwd_##N(const kpl_kernel_args *args, const kpl_bn_attrs *a,               \
                         const kpl_kept_geom *gm, const T *x, T *y)                       \
    {                                                                                     \
        const P *g = kpl__cdata(args->in[1]), *b = kpl__cdata(args->in[2]);               \
        P *mo = a->mean ? kpl__data(a->mean) : NULL, *vo = a->var ? kpl__data(a->var) : NULL; \
        int64_t ncb = a->c / 16, gs = group_size(gm, ncb), ng = (ncb + gs - 1) / gs;          \
        KPL_PARALLEL_FOR_IF(t, ng, ng > 1, {                                              \
            int64_t cb0 = t * gs, cb1 = cb0 + gs < ncb ? cb0 + gs : ncb;                  \
            if (a->relu)                                                                  \
                bfwd_relu_##N(x, g, b, y, mo, vo, a, gm, cb0, cb1);                       \
            else                                                                          \
                bfwd_plain_##N(x, g, b, y, mo, vo, a, gm, cb0, cb1);                      \
        });                                                                               \
    }                                                                                     \
    static void bbwd_##N(const kpl_kernel_args *args, const kpl_bn_attrs *a,               \
                         const kpl_kept_geom *gm, const T *x, const T *gy, const T *ym,   \
                         T *gx)                                                           \
    {                                                                                     \
        const P *g = kpl__cdata(args->in[2]);                                             \
        P *gg = a->ggamma ? kpl__data(a->ggamma) : NULL;                                  \
        P *gb = a->gbeta ? kpl__data(a->gbeta) : NULL;                                    \
        int64_t ncb = a->c / 16, gs = group_size(gm, ncb), ng = (ncb + gs - 1) / gs;          \
        KPL_PARALLEL_FOR_IF(t, ng, ng > 1, {                                              \
            int64_t cb0 = t * gs, cb1 = cb0 + gs < ncb ? cb0 + gs : ncb;                  \
            if (ym)                                                                       \
                bbwd_relu_##N(x, gy, ym, g, gx, gg, gb, a, gm, cb0, cb1);                 \
            else                                                                          \
                bbwd_plain_##N(x, gy, g, gx, gg, gb, a, gm, cb0, cb1);                    \
        });                                                                               \
    }

/* Channel blocks a task takes: in NHWC enough for each thread to have
 * one, at most GMAX; in nChw16c one (its blocks are apart: walking eight
 * at once made its loops 1.4-1.9x slower, ResNet's 8x256x56x56). */
static int64_t group_size(const kpl_kept_geom *gm, int64_t ncb)
{
    if (gm->ps == 16) return 1;
    int64_t nt = omp_get_max_threads(), g = (ncb + nt - 1) / nt;
    return g < 1 ? 1 : g > GMAX ? GMAX : g;
}

#define LD(p, k) ((p)[k])
#define ST(v) (v)
BN_KERNELS(float, float, float)
BN_BLOCKED(float, float, float, 1)
BN_KERNELS(double, double, double)
#undef LD
#undef ST
/* The rounding of ST is convert_math.h's (to nearest even), as kpl_k_cast's. */
#define LD(p, k) kpl_cvt_bf16_to_f32((p)[k])
#define ST(v) kpl_cvt_f32_to_bf16((float)(v))
BN_KERNELS(bf16, uint16_t, float)
BN_BLOCKED(bf16, uint16_t, float, 1)
#undef LD
#undef ST
#define LD(p, k) kpl_cvt_f16_to_f32((p)[k])
#define ST(v) kpl_cvt_f32_to_f16((float)(v))
BN_KERNELS(f16, uint16_t, float)
BN_BLOCKED(f16, uint16_t, float, 0)
#undef LD
#undef ST

/* The kept form when the activations are held in a kept layout (as a
 * convolution left them) and the outputs may be: returns false to run the
 * plain one. */
static bool run_kept(const kpl_kernel_args *args, const kpl_bn_attrs *a)
{
    kpl_dtype dt = args->in[0]->dtype;
    if (dt == KPL_F64) return false;
    const kpl_tensor *x = args->in[0];
    const kpl_tensor *out = a->bwd ? a->gx : args->out, *gy = a->bwd ? args->in[1] : NULL;
    const kpl_tensor *ry = a->bwd && a->relu ? a->relu_y : NULL;
    kpl_kept tag = kpl__kept(x);
    void *px = kpl__kept_data(x, tag), *pg = gy ? kpl__kept_data(gy, tag) : NULL;
    void *py = ry ? kpl__kept_data(ry, tag) : NULL;
    if (!px || (gy && !pg) || (ry && !py)) return false;
    if (out && (!kpl__keepable(out) || out->storage == x->storage ||
                (gy && out->storage == gy->storage) || (ry && out->storage == ry->storage)))
        return false;
    void *po = out ? kpl__kept_out(out) : NULL;
    kpl_kept_geom gm = kpl__kept_geom(tag, a->c, a->hw);
    if (!a->bwd) {
        switch (dt) {
        case KPL_F32: bfwd_float(args, a, &gm, px, po); break;
        case KPL_BF16: bfwd_bf16(args, a, &gm, px, po); break;
        default: bfwd_f16(args, a, &gm, px, po); break;
        }
    } else {
        switch (dt) {
        case KPL_F32: bbwd_float(args, a, &gm, px, pg, py, po); break;
        case KPL_BF16: bbwd_bf16(args, a, &gm, px, pg, py, po); break;
        default: bbwd_f16(args, a, &gm, px, pg, py, po); break;
        }
    }
    if (out) kpl__storage_set_kept(out, tag);
    return true;
}

/* The statistics' derived copy of x's storage: 2 C doubles after a header
 * naming the view they are of (the key is the kernel's; the header makes
 * a match exact). */
#define BN_SAVED_KEY 0x6b706c2e626e7374ULL /* "kpl.bnst" */
enum { BN_HDR = 5 };

static double *saved_stats(const kpl_kernel_args *args, const kpl_bn_attrs *a)
{
    const kpl_tensor *x = args->in[0];
    kpl_storage *s = x->storage;
    size_t bytes = (size_t)(BN_HDR + 2 * a->c) * sizeof(double);
    double hdr[BN_HDR] = {(double)x->offset, (double)a->n, (double)a->c, (double)a->hw,
                          (double)x->dtype};
    double *p;
    if (a->bwd) {
        p = kpl__storage_packed(s, BN_SAVED_KEY, bytes);
        return p && !memcmp(p, hdr, sizeof hdr) ? p + BN_HDR : NULL;
    }
    /* after the output's write access, which drops a derived copy of an
     * in-place x (whose backward could not read x anyway) */
    if (args->out->storage == s) return NULL;
    if (!(p = kpl__storage_new_packed(s, BN_SAVED_KEY, bytes))) {
        kpl_clear_error(); /* out of memory: the backward computes them again */
        return NULL;
    }
    memcpy(p, hdr, sizeof hdr);
    return p + BN_HDR;
}

/* Whether VFOLD's 16 8-double vectors fit the registers: 16 of AVX-512's
 * 32 zmm (as oneDNN's ISA says, so ONEDNN_MAX_CPU_ISA=AVX2 tests the other
 * fold).  AVX2's 16 ymm would hold half of them; BLK_FOLD, which keeps its
 * sums in memory, was not measured against VFOLD there. */
static bool vec_sums(void)
{
    static atomic_int w = -1;
    int v = atomic_load_explicit(&w, memory_order_relaxed);
    if (v < 0) atomic_store_explicit(&w, v = kpl__cpu_avx512() ? 1 : 0, memory_order_relaxed);
    return v;
}

static kpl_status cpu_batch_norm(const kpl_kernel_args *args)
{
    kpl_bn_attrs la = *(const kpl_bn_attrs *)args->attrs, *a = &la;
    la.saved = saved_stats(args, a);
    la.vec_sums = vec_sums();
    if (run_kept(args, a)) return KPL_OK;
    switch (args->in[0]->dtype) {
    case KPL_F32: (a->bwd ? bwd_float : fwd_float)(args, a); break;
    case KPL_F64: (a->bwd ? bwd_double : fwd_double)(args, a); break;
    case KPL_BF16: (a->bwd ? bwd_bf16 : fwd_bf16)(args, a); break;
    default: (a->bwd ? bwd_f16 : fwd_f16)(args, a); break;
    }
    return KPL_OK;
}

void kpl__cpu_register_norm(void)
{
    const kpl_dtype dts[4] = {KPL_F32, KPL_F64, KPL_BF16, KPL_F16};
    for (int i = 0; i < 4; i++) {
        kpl_kernel_register(KPL_KOP_BATCH_NORM, KPL_DEVICE_CPU, dts[i], cpu_batch_norm);
        kpl_kernel_register(KPL_KOP_BATCH_NORM_RELU, KPL_DEVICE_CPU, dts[i], cpu_batch_norm);
    }
    kpl__cpu_register_group_norm(); /* cpu_group_norm.c */
}
