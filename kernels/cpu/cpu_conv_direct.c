/*
 * cpu_conv_direct.c — kpl's own f32 convolution loops for plain NCHW
 * tensors (stride 1, no dilation, one group), a candidate of the
 * convolution chooser next to oneDNN's implementations (cpu_conv.c).
 *
 * oneDNN's direct kernels want blocked layouts (nChw8c/16c), so a call on
 * plain tensors pays a reorder in and out, and a layer with few channels
 * fills few lanes of its blocks: LeNet's first layer (1 -> 6 channels)
 * spent as long in the reorder of its 128x6x28x28 output as in the
 * convolution.  These loops read and write NCHW directly and vectorise
 * along output rows instead, 16 columns per vector:
 *
 *  - forward: for each output row and block of up to 8 output channels,
 *    one load of 16 input columns feeds up to 8 FMAs (broadcast weights);
 *    each image is first copied into a zero-padded buffer so every load
 *    is in bounds and the padding costs no test;
 *  - input gradient: the forward loop on gy padded by K - 1 - padding,
 *    with the weights transposed and flipped (stride 1 only);
 *  - weight gradient (and bias gradient in the same pass): for each
 *    (o, c, ky) up to 8 vector accumulators over kx, summed over the
 *    image's rows and a group of images; the lanes are summed in f64 per
 *    group, and the groups' sums are added in order at the end (the same
 *    bits whatever thread ran which group).
 *
 * The chooser times them against oneDNN's candidates on the call's own
 * tensors and keeps the fastest, so they serve only where they win.
 * Vectors are GCC vector extensions, built for AVX-512, AVX2 and baseline
 * x86-64 (KPL_CLONES).  Results match the reference loops to float
 * rounding; lanes past a row's end are computed but never stored, and in
 * the weight gradient they are masked to zero, so a NaN outside the
 * window reaches no gradient.
 */
#include "kernels_impl.h"

#include <math.h>
#include <omp.h>
#include <string.h>

#define VL 16    /* floats per vector */
#define OB 8     /* output channels per forward block */
#define KB 8     /* kx per weight-gradient block */

typedef float v16 __attribute__((vector_size(VL * sizeof(float))));
typedef int32_t vi16 __attribute__((vector_size(VL * sizeof(int32_t))));

/* Unaligned vector load and (partial) store, and the sum of the lanes in
 * f64.  Macros rather than functions: a 64-byte vector passed to or from a
 * function compiled without AVX-512 changes the ABI, and these are
 * expanded inside each clone. */
#define ld(p)                                                                                   \
    ({                                                                                          \
        v16 v_;                                                                                 \
        memcpy(&v_, (p), sizeof v_);                                                            \
        v_;                                                                                     \
    })
#define st(p, v, n)                                                                             \
    do {                                                                                        \
        v16 s_ = (v);                                                                           \
        memcpy((p), &s_, (size_t)(n) * sizeof(float));                                          \
    } while (0)
#define hsum(v)                                                                                 \
    ({                                                                                          \
        v16 h_ = (v);                                                                           \
        double t_ = 0;                                                                          \
        for (int i_ = 0; i_ < VL; i_++) t_ += (double)h_[i_];                                   \
        t_;                                                                                     \
    })

bool kpl__conv_direct_supports(const kpl_conv_attrs *a)
{
    const kpl_conv2d_params *p = &a->p;
    if (p->groups != 1 || p->stride[0] != 1 || p->stride[1] != 1 || p->dilation[0] != 1 ||
        p->dilation[1] != 1)
        return false;
    /* the input gradient pads gy by K - 1 - padding */
    if (a->kind == KPL_CONV_BWD_DATA && (p->padding[0] > a->kh - 1 || p->padding[1] > a->kw - 1))
        return false;
    return a->oh > 0 && a->ow > 0;
}

/* ---- forward (and the input gradient) ------------------------------------------- */

/* One forward problem on plain tensors: x (n, c, h, w) padded by (ph, pw)
 * into (c, hp, wp) per image, weights as blocks of OB output channels,
 * wt[blk][c][kh][kw][OB] (zero past o), y (n, o, oh, ow). */
typedef struct {
    int64_t n, c, h, w, o, kh, kw, oh, ow;
    int64_t ph, pw;   /* zero padding of the input */
    int64_t hp, wp;   /* padded image: hp = oh + kh - 1, wp = vectors x VL + kw - 1 */
} geom;

static void pad_image(const geom *g, const float *x, float *xp)
{
    memset(xp, 0, sizeof(float) * (size_t)(g->c * g->hp * g->wp));
    for (int64_t c = 0; c < g->c; c++)
        for (int64_t iy = 0; iy < g->h; iy++) {
            int64_t py = iy + g->ph;
            if (py < 0 || py >= g->hp) continue;
            memcpy(xp + (c * g->hp + py) * g->wp + g->pw, x + (c * g->h + iy) * g->w,
                   sizeof(float) * (size_t)g->w);
        }
}

/* Output rows of one image for the channel block at wb (OB weights per
 * (c, ky, kx)), channels o0 .. o0 + NO - 1: one function per block size,
 * so the accumulators are exactly the channels there are. */
#define DEF_FWD_BLOCK(NO)                                                                       \
    KPL_CLONES static void fwd_block_##NO(const geom *g, const float *xp, const float *wb,     \
                                          const float *bias, int64_t o0, float *y)             \
    {                                                                                           \
        for (int64_t oy = 0; oy < g->oh; oy++)                                                  \
            for (int64_t xb = 0; xb < g->ow; xb += VL) {                                        \
                v16 acc[NO];                                                                    \
                for (int o = 0; o < NO; o++) acc[o] = (v16){0} + (bias ? bias[o0 + o] : 0);     \
                for (int64_t c = 0; c < g->c; c++)                                              \
                    for (int64_t ky = 0; ky < g->kh; ky++) {                                    \
                        const float *row = xp + (c * g->hp + oy + ky) * g->wp + xb;             \
                        const float *wr = wb + (c * g->kh + ky) * g->kw * OB;                   \
                        for (int64_t kx = 0; kx < g->kw; kx++) {                                \
                            v16 v = ld(row + kx);                                               \
                            for (int o = 0; o < NO; o++) acc[o] += v * wr[kx * OB + o];         \
                        }                                                                       \
                    }                                                                           \
                int64_t nx = g->ow - xb < VL ? g->ow - xb : VL;                                 \
                for (int o = 0; o < NO; o++)                                                    \
                    st(y + ((o0 + o) * g->oh + oy) * g->ow + xb, acc[o], nx);                   \
            }                                                                                   \
    }
DEF_FWD_BLOCK(1)
DEF_FWD_BLOCK(2)
DEF_FWD_BLOCK(3)
DEF_FWD_BLOCK(4)
DEF_FWD_BLOCK(5)
DEF_FWD_BLOCK(6)
DEF_FWD_BLOCK(7)
DEF_FWD_BLOCK(8)

typedef void (*fwd_block_fn)(const geom *, const float *, const float *, const float *, int64_t,
                             float *);
static const fwd_block_fn fwd_blocks[OB + 1] = {
    NULL,        fwd_block_1, fwd_block_2, fwd_block_3, fwd_block_4,
    fwd_block_5, fwd_block_6, fwd_block_7, fwd_block_8,
};

/* y = conv(x, w) + bias over every image, wt as fwd_block reads it. */
static kpl_status fwd_run(const geom *g, const float *x, const float *wt, const float *bias,
                          float *y, int threads)
{
    int64_t nblk = (g->o + OB - 1) / OB, ckk = g->c * g->kh * g->kw;
    size_t xp_bytes = sizeof(float) * (size_t)(g->c * g->hp * g->wp);
    int failed = 0;
#pragma omp parallel num_threads(threads) reduction(| : failed)
    {
        float *xp = NULL;
        if (posix_memalign((void **)&xp, 64, xp_bytes) != 0) {
            failed = 1;
        } else {
            /* dynamic: the calling thread starts at once and takes more
             * images while a sleeping thread wakes */
#pragma omp for schedule(dynamic, 2)
            for (int64_t n = 0; n < g->n; n++) {
                pad_image(g, x + n * g->c * g->h * g->w, xp);
                float *yn = y + n * g->o * g->oh * g->ow;
                for (int64_t b = 0; b < nblk; b++) {
                    int64_t o0 = b * OB, no = g->o - o0 < OB ? g->o - o0 : OB;
                    fwd_blocks[no](g, xp, wt + b * ckk * OB, bias, o0, yn);
                }
            }
            free(xp);
        }
    }
    KPL_CHECK(!failed, KPL_ENOMEM, "conv2d: no host memory for the padded images");
    return KPL_OK;
}

/* The geometry of a forward pass over an input of (c, h, w) padded by
 * (ph, pw) with kh x kw kernels. */
static geom make_geom(int64_t n, int64_t c, int64_t h, int64_t w, int64_t o, int64_t kh,
                      int64_t kw, int64_t ph, int64_t pw)
{
    geom g = {.n = n, .c = c, .h = h, .w = w, .o = o, .kh = kh, .kw = kw, .ph = ph, .pw = pw};
    g.oh = h + 2 * ph - kh + 1;
    g.ow = w + 2 * pw - kw + 1;
    g.hp = g.oh + kh - 1;
    g.wp = (g.ow + VL - 1) / VL * VL + kw - 1;
    return g;
}

/* ---- weight gradient ----------------------------------------------------------------- */

/* The bwd-weight view: x padded as for the forward pass, gy copied into
 * rows of owv = vectors x VL floats with zero tails. */
typedef struct {
    geom g;
    int64_t owv;
} wgeom;

/* Adds one image's products to the vector accumulators acc[o][c][ky][kx]
 * (lane sums are taken once per group of images) for kx in [k0, k0 + NK),
 * and its gy sums to bacc[o] when bacc is not NULL; `tail` masks the
 * lanes of a row's last vector that lie past ow. */
#define DEF_BWDW(NK)                                                                            \
    KPL_CLONES static void bwdw_image_##NK(const wgeom *q, const float *xp, const float *gp,   \
                                           const vi16 *tail, int64_t k0, v16 *acc, v16 *bacc)  \
    {                                                                                           \
        const geom *g = &q->g;                                                                  \
        int64_t owv = q->owv, last = owv - VL;                                                  \
        for (int64_t o = 0; o < g->o; o++) {                                                    \
            const float *go = gp + o * g->oh * owv;                                             \
            if (bacc) {                                                                         \
                v16 s = bacc[o];                                                                \
                for (int64_t i = 0; i < g->oh * owv; i += VL) s += ld(go + i);                 \
                bacc[o] = s;                                                                    \
            }                                                                                   \
            for (int64_t c = 0; c < g->c; c++)                                                  \
                for (int64_t ky = 0; ky < g->kh; ky++) {                                        \
                    v16 *out = acc + ((o * g->c + c) * g->kh + ky) * g->kw + k0;                \
                    v16 a[NK];                                                                  \
                    for (int k = 0; k < NK; k++) a[k] = out[k];                                 \
                    for (int64_t oy = 0; oy < g->oh; oy++) {                                    \
                        const float *grow = go + oy * owv;                                      \
                        const float *xrow = xp + (c * g->hp + oy + ky) * g->wp + k0;            \
                        for (int64_t xb = 0; xb < last; xb += VL) {                             \
                            v16 gv = ld(grow + xb);                                             \
                            for (int k = 0; k < NK; k++) a[k] += gv * ld(xrow + xb + k);        \
                        }                                                                       \
                        v16 gv = ld(grow + last);                                               \
                        for (int k = 0; k < NK; k++)                                            \
                            a[k] += gv * (v16)((vi16)ld(xrow + last + k) & *tail);              \
                    }                                                                           \
                    for (int k = 0; k < NK; k++) out[k] = a[k];                                 \
                }                                                                               \
        }                                                                                       \
    }
DEF_BWDW(1)
DEF_BWDW(2)
DEF_BWDW(3)
DEF_BWDW(4)
DEF_BWDW(5)
DEF_BWDW(6)
DEF_BWDW(7)
DEF_BWDW(8)

typedef void (*bwdw_fn)(const wgeom *, const float *, const float *, const vi16 *, int64_t, v16 *,
                        v16 *);
static const bwdw_fn bwdw_images[KB + 1] = {
    NULL,         bwdw_image_1, bwdw_image_2, bwdw_image_3, bwdw_image_4,
    bwdw_image_5, bwdw_image_6, bwdw_image_7, bwdw_image_8,
};

/* Images are summed in up to CHUNKS fixed groups whose partial sums are
 * added in group order, so the result does not depend on which thread ran
 * which group (groups are handed out dynamically: the calling thread
 * starts at once while a sleeping one wakes). */
#define CHUNKS 16

static kpl_status bwdw_run(const wgeom *q, const float *x, const float *gy, float *gw, float *gb,
                           int threads)
{
    const geom *g = &q->g;
    int64_t nw = g->o * g->c * g->kh * g->kw, stride = nw + g->o;
    int64_t nchunk = g->n < CHUNKS ? g->n : CHUNKS;
    size_t xp_bytes = sizeof(float) * (size_t)(g->c * g->hp * g->wp);
    size_t gp_bytes = sizeof(float) * (size_t)(g->o * g->oh * q->owv);
    size_t acc_bytes = sizeof(v16) * (size_t)stride;
    double *part = calloc((size_t)(nchunk * stride), sizeof(double));
    KPL_CHECK(part, KPL_ENOMEM, "conv2d_bwd_weight: no host memory for partial sums");
    vi16 tail;
    for (int i = 0; i < VL; i++) tail[i] = i < g->ow - (q->owv - VL) ? -1 : 0;
    int failed = 0;
#pragma omp parallel num_threads(threads) reduction(| : failed)
    {
        float *xp = NULL, *gp = NULL;
        v16 *acc = NULL;
        if (posix_memalign((void **)&xp, 64, xp_bytes) != 0 ||
            posix_memalign((void **)&gp, 64, gp_bytes) != 0 ||
            posix_memalign((void **)&acc, 64, acc_bytes) != 0) {
            failed = 1;
        } else {
            memset(gp, 0, gp_bytes);
#pragma omp for schedule(dynamic, 1)
            for (int64_t ch = 0; ch < nchunk; ch++) {
                memset(acc, 0, acc_bytes);
                for (int64_t n = g->n * ch / nchunk; n < g->n * (ch + 1) / nchunk; n++) {
                    pad_image(g, x + n * g->c * g->h * g->w, xp);
                    const float *gyn = gy + n * g->o * g->oh * g->ow;
                    for (int64_t r = 0; r < g->o * g->oh; r++)
                        memcpy(gp + r * q->owv, gyn + r * g->ow, sizeof(float) * (size_t)g->ow);
                    for (int64_t k0 = 0; k0 < g->kw; k0 += KB) {
                        int64_t nk = g->kw - k0 < KB ? g->kw - k0 : KB;
                        bwdw_images[nk](q, xp, gp, &tail, k0, acc, gb && !k0 ? acc + nw : NULL);
                    }
                }
                double *mine = part + ch * stride;
                for (int64_t i = 0; i < stride; i++) mine[i] = hsum(acc[i]);
            }
        }
        free(xp);
        free(gp);
        free(acc);
    }
    if (!failed) {
        for (int64_t i = 0; i < nw + (gb ? g->o : 0); i++) {
            double s = 0;
            for (int64_t ch = 0; ch < nchunk; ch++) s += part[ch * stride + i];
            if (i < nw) gw[i] = (float)s;
            else gb[i - nw] = (float)s;
        }
    }
    free(part);
    KPL_CHECK(!failed, KPL_ENOMEM, "conv2d_bwd_weight: no host memory for the padded images");
    return KPL_OK;
}

/* ---- entry ----------------------------------------------------------------------- */

/* Weights w (o, c, kh, kw) as OB-channel blocks wt[blk][c][kh][kw][OB];
 * `flip` reads them as the input gradient's forward pass needs them:
 * w'(c, o, ky, kx) = w(o, c, kh-1-ky, kw-1-kx), output channels c. */
static float *pack_weights(const float *w, int64_t o, int64_t c, int64_t kh, int64_t kw,
                           bool flip)
{
    int64_t oo = flip ? c : o, cc = flip ? o : c; /* the forward pass's out/in */
    int64_t nblk = (oo + OB - 1) / OB;
    float *wt = calloc((size_t)(nblk * cc * kh * kw * OB), sizeof(float));
    if (!wt) return NULL;
    for (int64_t q = 0; q < oo; q++)
        for (int64_t r = 0; r < cc; r++)
            for (int64_t ky = 0; ky < kh; ky++)
                for (int64_t kx = 0; kx < kw; kx++) {
                    float v = flip ? w[((r * c + q) * kh + kh - 1 - ky) * kw + kw - 1 - kx]
                                   : w[((q * c + r) * kh + ky) * kw + kx];
                    wt[((((q / OB) * cc + r) * kh + ky) * kw + kx) * OB + q % OB] = v;
                }
    return wt;
}

int64_t kpl__conv_direct_scratch(const kpl_conv_attrs *a, int threads)
{
    int64_t ph = a->p.padding[0], pw = a->p.padding[1], f = (int64_t)sizeof(float);
    int64_t nblk = (a->kind == KPL_CONV_BWD_DATA ? a->c : a->o) + OB - 1;
    int64_t wt = nblk / OB * OB * (a->kind == KPL_CONV_BWD_DATA ? a->o : a->c) * a->kh * a->kw * f;
    if (a->kind == KPL_CONV_FWD) {
        geom g = make_geom(a->n, a->c, a->h, a->w, a->o, a->kh, a->kw, ph, pw);
        return wt + threads * g.c * g.hp * g.wp * f;
    }
    if (a->kind == KPL_CONV_BWD_DATA) {
        geom g =
            make_geom(a->n, a->o, a->oh, a->ow, a->c, a->kh, a->kw, a->kh - 1 - ph, a->kw - 1 - pw);
        return wt + threads * g.c * g.hp * g.wp * f;
    }
    /* the weight gradient: per thread the padded image, gy's rows and a
     * vector accumulator per weight; the groups' f64 sums */
    geom g = make_geom(a->n, a->c, a->h, a->w, a->o, a->kh, a->kw, ph, pw);
    int64_t stride = g.o * g.c * g.kh * g.kw + g.o, owv = (a->ow + VL - 1) / VL * VL;
    int64_t nchunk = g.n < CHUNKS ? g.n : CHUNKS;
    return nchunk * stride * (int64_t)sizeof(double) +
           threads * (g.c * g.hp * g.wp * f + g.o * g.oh * owv * f + stride * (int64_t)sizeof(v16));
}

kpl_status kpl__conv_direct_run(const kpl_conv_attrs *a, const kpl_kernel_args *args,
                                int threads)
{
    const float *i0 = kpl__cdata(args->in[0]), *i1 = kpl__cdata(args->in[1]);
    float *out = kpl__data(args->out);
    int64_t ph = a->p.padding[0], pw = a->p.padding[1];
    switch (a->kind) {
    case KPL_CONV_FWD: {
        geom g = make_geom(a->n, a->c, a->h, a->w, a->o, a->kh, a->kw, ph, pw);
        float *wt = pack_weights(i1, a->o, a->c, a->kh, a->kw, false);
        KPL_CHECK(wt, KPL_ENOMEM, "conv2d: no host memory for the packed weights");
        kpl_status st = fwd_run(&g, i0, wt, args->in[2] ? kpl__cdata(args->in[2]) : NULL, out,
                                threads);
        free(wt);
        return st;
    }
    case KPL_CONV_BWD_DATA: { /* i0 = gy (n, o, oh, ow), i1 = w; out = gx (n, c, h, w) */
        geom g = make_geom(a->n, a->o, a->oh, a->ow, a->c, a->kh, a->kw, a->kh - 1 - ph,
                           a->kw - 1 - pw);
        float *wt = pack_weights(i1, a->o, a->c, a->kh, a->kw, true);
        KPL_CHECK(wt, KPL_ENOMEM, "conv2d_bwd_data: no host memory for the packed weights");
        kpl_status st = fwd_run(&g, i0, wt, NULL, out, threads);
        free(wt);
        return st;
    }
    case KPL_CONV_BWD_WEIGHT: { /* i0 = x, i1 = gy; out = gw, in[2] = gb (written) */
        wgeom q = {make_geom(a->n, a->c, a->h, a->w, a->o, a->kh, a->kw, ph, pw), 0};
        q.owv = (a->ow + VL - 1) / VL * VL;
        return bwdw_run(&q, i0, i1, out, args->in[2] ? kpl__data((kpl_tensor *)args->in[2]) : NULL,
                        threads);
    }
    }
    return KPL_ERROR(KPL_EINVAL, "conv2d: unknown direction %d", (int)a->kind);
}
