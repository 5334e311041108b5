/*
 * cuda_nn.cu — the neural-network kernels on CUDA besides convolution
 * (cuda_conv.cu): the batch-normalisation forward through cuDNN (its v9
 * library, "legacy" descriptor API); the batch-norm backward, pooling,
 * bilinear resizing, index_select/add and gather/scatter_add as kernels of
 * our own.
 *
 * Pooling is ours because kpl's max pooling is a gather at recorded
 * indices (so that it is differentiable to any order) and cuDNN's max
 * pooling exposes no indices; the average pair is ours for symmetry with
 * it (one thread per output or input element, no atomics for the average
 * adjoint).  The gather at indices and its adjoint (plane_gather /
 * plane_scatter) live with the other index kernels in cuda_index.cu.
 *
 * Written without a GPU to run it on (CI has none): tests/kernels/
 * test_cuda.c compares every kernel here with the CPU's when a GPU is
 * present.
 */
#include "cuda_impl.h"
#include "vision_math.h"

#include <pthread.h>
#include <string.h>

static cudnnDataType_t dnn_type(kpl_dtype dt)
{
    return dt == KPL_F64 ? CUDNN_DATA_DOUBLE : CUDNN_DATA_FLOAT;
}

/* ---- batch norm ------------------------------------------------------------------- */

/* The backward is ours, not cuDNN's: the same arithmetic as
 * kernels/cpu/cpu_norm.c, so the two devices agree to f32 rounding.  Its
 * input gradient gamma inv ((gy - mean(gy)) - (x - mean) inv^2 mean(gy
 * (x - mean))) is the small difference of two nearly equal terms whenever
 * gy is nearly parallel to x - mean (always with two values per channel),
 * so every sum accumulates in double and gx is evaluated in double before
 * its one rounding to T.  (On GPUs with a slow f64 rate that is the price
 * of the right answer.)
 *
 * Channel c's cnt = N*HW values are cut into `split` chunks, one block
 * (c, s) each; three launches: the chunks' sums of x; with the mean, their
 * sums of (x - m)^2, gy and gy (x - m); with the totals, gx (and ggamma,
 * gbeta from block s = 0).  Every block adds the chunks' partial sums in
 * chunk order and `split` depends on the shape alone, so results repeat
 * bit for bit from run to run and from GPU to GPU. */
#define BN_THREADS 256
#define BN_MIN_CHUNK 4096 /* values per block at least, when there are that many */
#define BN_MAX_SPLIT 64

struct bn_geom {
    int64_t n, c, hw, cnt, chunk;
    int split;
};

/* v summed over the block in a fixed tree order, returned to every thread. */
__device__ double bn_block_total(double v, double *sh)
{
    sh[threadIdx.x] = v;
    __syncthreads();
    for (int s = BN_THREADS / 2; s > 0; s >>= 1) {
        if ((int)threadIdx.x < s) sh[threadIdx.x] += sh[threadIdx.x + s];
        __syncthreads();
    }
    double t = sh[0];
    __syncthreads();
    return t;
}

/* Calls f(offset) for this thread's values of chunk s of channel c: values
 * e = s chunk + threadIdx.x + k BN_THREADS, at (n, i) = (e / hw, e % hw). */
template <typename F>
__device__ void bn_walk(const bn_geom &g, int64_t c, int64_t s, F f)
{
    int64_t e = s * g.chunk + threadIdx.x, end = (s + 1) * g.chunk;
    if (end > g.cnt) end = g.cnt;
    if (e >= end) return;
    int64_t n = e / g.hw, i = e - n * g.hw, dn = BN_THREADS / g.hw, di = BN_THREADS - dn * g.hw;
    for (; e < end; e += BN_THREADS) {
        f((n * g.c + c) * g.hw + i);
        n += dn;
        i += di;
        if (i >= g.hw) {
            i -= g.hw;
            n++;
        }
    }
}

/* Quantity k of channel c summed over its chunks' partials (`width` per chunk). */
__device__ double bn_total(const double *part, const bn_geom &g, int64_t c, int width, int k)
{
    double t = 0;
    for (int s = 0; s < g.split; s++) t += part[(c * g.split + s) * width + k];
    return t;
}

template <typename T>
__global__ void bn_bwd_sum_kernel(bn_geom g, const T *x, double *px)
{
    __shared__ double sh[BN_THREADS];
    int64_t c = blockIdx.x, s = blockIdx.y;
    double v = 0;
    bn_walk(g, c, s, [&](int64_t o) { v += (double)x[o]; });
    v = bn_block_total(v, sh);
    if (threadIdx.x == 0) px[c * g.split + s] = v;
}

template <typename T>
__global__ void bn_bwd_moments_kernel(bn_geom g, const T *x, const T *gy, const double *px,
                                      double *pg)
{
    __shared__ double sh[BN_THREADS];
    int64_t c = blockIdx.x, s = blockIdx.y;
    double m = bn_total(px, g, c, 1, 0) / (double)g.cnt, q = 0, sg = 0, sgx = 0;
    bn_walk(g, c, s, [&](int64_t o) {
        double d = (double)x[o] - m, v = (double)gy[o];
        q += d * d;
        sg += v;
        sgx += v * d;
    });
    q = bn_block_total(q, sh);
    sg = bn_block_total(sg, sh);
    sgx = bn_block_total(sgx, sh);
    if (threadIdx.x == 0) {
        double *p = pg + (c * g.split + s) * 3;
        p[0] = q;
        p[1] = sg;
        p[2] = sgx;
    }
}

template <typename T>
__global__ void bn_bwd_gx_kernel(bn_geom g, double eps, const T *x, const T *gy, const T *gamma,
                                 const double *px, const double *pg, T *gx, T *gg, T *gb)
{
    int64_t c = blockIdx.x, s = blockIdx.y;
    double cnt = (double)g.cnt, m = bn_total(px, g, c, 1, 0) / cnt;
    double var = bn_total(pg, g, c, 3, 0) / cnt, tg = bn_total(pg, g, c, 3, 1);
    double tgx = bn_total(pg, g, c, 3, 2), inv = 1.0 / sqrt(var + eps);
    if (s == 0 && threadIdx.x == 0) {
        if (gg) gg[c] = (T)(tgx * inv); /* sum(gy xhat) = inv sum(gy (x - mean)) */
        if (gb) gb[c] = (T)tg;
    }
    if (!gx) return;
    double k = (double)gamma[c] * inv, mg = tg / cnt, kx = inv * inv * tgx / cnt;
    bn_walk(g, c, s, [&](int64_t o) {
        gx[o] = (T)(k * (((double)gy[o] - mg) - ((double)x[o] - m) * kx));
    });
}

template <typename T>
static kpl_status bn_bwd_typed(kpl_cuda_state *cs, const bn_geom &g, double eps, double *part,
                               const void *const *in, void *gx, void *gg, void *gb)
{
    dim3 grid((unsigned)g.c, (unsigned)g.split);
    double *px = part, *pg = part + g.c * g.split;
    const T *x = (const T *)in[0], *gy = (const T *)in[1], *gamma = (const T *)in[2];
    bn_bwd_sum_kernel<T><<<grid, BN_THREADS, 0, cs->compute>>>(g, x, px);
    KPL_TRY(KPL_CUDA_LAUNCHED("batch_norm_bwd sums"));
    bn_bwd_moments_kernel<T><<<grid, BN_THREADS, 0, cs->compute>>>(g, x, gy, px, pg);
    KPL_TRY(KPL_CUDA_LAUNCHED("batch_norm_bwd moments"));
    bn_bwd_gx_kernel<T><<<grid, BN_THREADS, 0, cs->compute>>>(g, eps, x, gy, gamma, px, pg,
                                                              (T *)gx, (T *)gg, (T *)gb);
    return KPL_CUDA_LAUNCHED("batch_norm_bwd gx");
}

__global__ void scale_kernel(void *p, kpl_dtype dt, double s, int64_t n)
{
    KPL_CUDA_FOR(i, n)
    {
        if (dt == KPL_F64) ((double *)p)[i] *= s;
        else ((float *)p)[i] = (float)(((float *)p)[i] * s);
    }
}

static kpl_status cuda_batch_norm_bwd(const kpl_kernel_args *args)
{
    const kpl_bn_attrs *a = (const kpl_bn_attrs *)args->attrs;
    kpl_cuda_state *cs;
    void *out;
    const void *in[3];
    KPL_TRY(kpl__cuda_pointers(args, 3, &cs, &out, in));
    kpl_device *dev = kpl_tensor_device(args->out);
    void *gx = a->gx ? kpl_tensor_mutable(a->gx) : NULL;
    void *gg = a->ggamma ? kpl_tensor_mutable(a->ggamma) : NULL;
    void *gb = a->gbeta ? kpl_tensor_mutable(a->gbeta) : NULL;
    if ((a->gx && !gx) || (a->ggamma && !gg) || (a->gbeta && !gb)) return kpl_last_status();
    bn_geom g;
    g.n = a->n, g.c = a->c, g.hw = a->hw, g.cnt = a->n * a->hw;
    int64_t split = (g.cnt + BN_MIN_CHUNK - 1) / BN_MIN_CHUNK;
    g.split = (int)(split < 1 ? 1 : split > BN_MAX_SPLIT ? BN_MAX_SPLIT : split);
    g.chunk = (g.cnt + g.split - 1) / g.split;
    KPL_CHECK(g.c <= INT32_MAX, KPL_ESHAPE, "batch_norm_bwd: %lld channels exceed the grid",
              (long long)g.c);
    void *part = NULL;
    KPL_TRY(kpl_device_alloc(dev, 4 * (size_t)(g.c * g.split) * sizeof(double),
                             "batch_norm_bwd", &part));
    kpl_status st = kpl_tensor_dtype(args->in[0]) == KPL_F64
                        ? bn_bwd_typed<double>(cs, g, a->eps, (double *)part, in, gx, gg, gb)
                        : bn_bwd_typed<float>(cs, g, a->eps, (double *)part, in, gx, gg, gb);
    kpl_device_free(dev, part);
    return st;
}

static kpl_status cuda_batch_norm(const kpl_kernel_args *args)
{
    const kpl_bn_attrs *a = (const kpl_bn_attrs *)args->attrs;
    if (a->bwd) return cuda_batch_norm_bwd(args);
    kpl_status st = KPL_OK;
    KPL_CHECK(a->eps >= CUDNN_BN_MIN_EPSILON, KPL_EINVAL,
              "batch_norm: eps %g is below cuDNN's minimum %g on CUDA", a->eps,
              (double)CUDNN_BN_MIN_EPSILON);
    KPL_CHECK(a->n <= INT32_MAX && a->c <= INT32_MAX && a->hw <= INT32_MAX, KPL_ESHAPE,
              "batch_norm: dims exceed cuDNN's 32-bit sizes");
    kpl_cuda_state *cs;
    void *out;
    const void *in[3];
    KPL_TRY(kpl__cuda_pointers(args, 3, &cs, &out, in));
    kpl_device *dev = kpl_tensor_device(args->out);
    kpl_dtype dt = kpl_tensor_dtype(args->in[0]);
    size_t es = kpl_dtype_size(dt);
    cudnnHandle_t h;
    KPL_TRY(kpl__cuda_dnn(cs, &h));
    cudnnTensorDescriptor_t xd = NULL, pd = NULL;
    void *scratch = NULL, *mean = NULL, *var = NULL;
    double m = (double)(a->n * a->hw), one_d = 1.0, zero_d = 0.0;
    float one_f = 1.0f, zero_f = 0.0f;
    const void *one = dt == KPL_F64 ? (const void *)&one_d : (const void *)&one_f;
    const void *zero = dt == KPL_F64 ? (const void *)&zero_d : (const void *)&zero_f;
    KPL_CUDNN_TRY(cudnnCreateTensorDescriptor(&xd));
    KPL_CUDNN_TRY(cudnnCreateTensorDescriptor(&pd));
    KPL_CUDNN_TRY(cudnnSetTensor4dDescriptor(xd, CUDNN_TENSOR_NCHW, dnn_type(dt), (int)a->n,
                                             (int)a->c, (int)a->hw, 1));
    KPL_CUDNN_TRY(cudnnDeriveBNTensorDescriptor(pd, xd, CUDNN_BATCHNORM_SPATIAL));
    /* running stats with factor 1 = the batch mean and the unbiased
     * variance; scaled to the biased one below (kpl's contract) */
    mean = a->mean ? kpl_tensor_mutable(a->mean) : NULL;
    var = a->var ? kpl_tensor_mutable(a->var) : NULL;
    if ((a->mean && !mean) || (a->var && !var)) {
        st = kpl_last_status();
        goto fail;
    }
    if (!mean || !var) { /* cuDNN wants both or neither; keep both */
        if ((st = kpl_device_alloc(dev, 2 * (size_t)a->c * es, "batch_norm", &scratch)) < 0)
            goto fail;
        if (!mean) mean = scratch;
        if (!var) var = (char *)scratch + (size_t)a->c * es;
    }
    /* cuDNN blends (1 - factor) of the old contents in, even at factor
     * 1: zero them so stale NaNs cannot leak through 0 * NaN. */
    if (cudaMemsetAsync(mean, 0, (size_t)a->c * es, cs->compute) != cudaSuccess ||
        cudaMemsetAsync(var, 0, (size_t)a->c * es, cs->compute) != cudaSuccess) {
        st = kpl__cuda_fail(cudaGetLastError(), "cudaMemsetAsync", __FILE__, __LINE__);
        goto fail;
    }
    KPL_CUDNN_TRY(cudnnBatchNormalizationForwardTraining(
        h, CUDNN_BATCHNORM_SPATIAL, one, zero, xd, in[0], xd, out, pd, in[1], in[2], 1.0,
        mean, var, a->eps, NULL, NULL));
    if (m > 1) {
        scale_kernel<<<kpl__cuda_blocks(cs, a->c, KPL_CUDA_THREADS), KPL_CUDA_THREADS, 0,
                       cs->compute>>>(var, dt, (m - 1) / m, a->c);
        if ((st = KPL_CUDA_LAUNCHED("batch_norm variance")) < 0) goto fail;
    }
fail:
    if (scratch) kpl_device_free(dev, scratch);
    if (xd) cudnnDestroyTensorDescriptor(xd);
    if (pd) cudnnDestroyTensorDescriptor(pd);
    return st;
}

/* ---- pooling ------------------------------------------------------------------------ */

/* Window bounds clipped to the plane, and the average's divisor: with
 * count_include_pad the cells of the padded plane the window covers (a
 * ceil_mode window hanging past the right padding covers fewer), else the
 * plane's cells (as cpu_pool.c). */
struct window {
    int64_t y0, x0, y1, x1;
    double cnt;
};

__device__ __forceinline__ window pool_window(const kpl_pool_attrs &a, int64_t oy, int64_t ox)
{
    window w;
    w.y0 = oy * a.p.stride[0] - a.p.padding[0];
    w.x0 = ox * a.p.stride[1] - a.p.padding[1];
    w.y1 = w.y0 + a.p.kernel[0];
    w.x1 = w.x0 + a.p.kernel[1];
    int64_t py1 = w.y1 < a.h + a.p.padding[0] ? w.y1 : a.h + a.p.padding[0];
    int64_t px1 = w.x1 < a.w + a.p.padding[1] ? w.x1 : a.w + a.p.padding[1];
    w.cnt = (double)((py1 - w.y0) * (px1 - w.x0));
    if (w.y0 < 0) w.y0 = 0;
    if (w.x0 < 0) w.x0 = 0;
    if (w.y1 > a.h) w.y1 = a.h;
    if (w.x1 > a.w) w.x1 = a.w;
    if (!a.p.count_include_pad) w.cnt = (double)((w.y1 - w.y0) * (w.x1 - w.x0));
    return w;
}

template <typename T>
__global__ void max_pool_kernel(kpl_pool_attrs a, const T *x, T *y, int64_t *idx)
{
    int64_t ohw = a.oh * a.ow;
    KPL_CUDA_FOR(o, a.n * a.c * ohw)
    {
        int64_t pl = o / ohw, r = o % ohw, oy = r / a.ow, ox = r % a.ow;
        window w = pool_window(a, oy, ox);
        const T *xp = x + pl * a.h * a.w;
        int64_t bi = w.y0 * a.w + w.x0;
        T best = xp[bi];
        for (int64_t iy = w.y0; iy < w.y1; iy++)
            for (int64_t ix = w.x0; ix < w.x1; ix++) {
                T v = xp[iy * a.w + ix];
                if (best == best && (v != v || v > best)) { /* NaN wins, first max kept */
                    best = v;
                    bi = iy * a.w + ix;
                }
            }
        y[o] = best;
        idx[o] = bi;
    }
}

template <typename T>
__global__ void avg_pool_kernel(kpl_pool_attrs a, const T *x, T *y)
{
    int64_t ohw = a.oh * a.ow;
    KPL_CUDA_FOR(o, a.n * a.c * ohw)
    {
        int64_t pl = o / ohw, r = o % ohw, oy = r / a.ow, ox = r % a.ow;
        window w = pool_window(a, oy, ox);
        const T *xp = x + pl * a.h * a.w;
        double s = 0;
        for (int64_t iy = w.y0; iy < w.y1; iy++)
            for (int64_t ix = w.x0; ix < w.x1; ix++) s += (double)xp[iy * a.w + ix];
        y[o] = (T)(s / w.cnt);
    }
}

/* The average's adjoint as a gather: each input cell sums the windows
 * that cover it (the output range below), so no two threads write one
 * cell. */
template <typename T>
__global__ void avg_pool_bwd_kernel(kpl_pool_attrs a, const T *gy, T *gx)
{
    int64_t hw = a.h * a.w;
    KPL_CUDA_FOR(i, a.n * a.c * hw)
    {
        int64_t pl = i / hw, r = i % hw, iy = r / a.w, ix = r % a.w;
        int ky = a.p.kernel[0], kx = a.p.kernel[1], sy = a.p.stride[0], sx = a.p.stride[1];
        /* windows oy with oy*sy - pad <= iy < oy*sy - pad + ky */
        int64_t py = iy + a.p.padding[0], px = ix + a.p.padding[1];
        int64_t oy0 = py < ky ? 0 : (py - ky) / sy + 1, oy1 = py / sy;
        int64_t ox0 = px < kx ? 0 : (px - kx) / sx + 1, ox1 = px / sx;
        if (oy1 >= a.oh) oy1 = a.oh - 1;
        if (ox1 >= a.ow) ox1 = a.ow - 1;
        double s = 0;
        for (int64_t oy = oy0; oy <= oy1; oy++)
            for (int64_t ox = ox0; ox <= ox1; ox++) {
                window w = pool_window(a, oy, ox);
                s += (double)gy[(pl * a.oh + oy) * a.ow + ox] / w.cnt;
            }
        gx[i] = (T)s;
    }
}

/* Bilinear resizing (cpu_pool.c's arithmetic): each output cell from its
 * four taps. */
template <typename T>
__global__ void bilinear_kernel(kpl_pool_attrs a, const T *x, T *y)
{
    int64_t ohw = a.oh * a.ow;
    KPL_CUDA_FOR(o, a.n * a.c * ohw)
    {
        int64_t pl = o / ohw, r = o % ohw, y0, y1, x0, x1;
        double lyd, lxd;
        kpl_lerp_tap(r / a.ow, a.h, a.oh, a.align_corners, &y0, &y1, &lyd);
        kpl_lerp_tap(r % a.ow, a.w, a.ow, a.align_corners, &x0, &x1, &lxd);
        T ly = (T)lyd, my = (T)1 - ly, lx = (T)lxd, mx = (T)1 - lx;
        const T *r0 = x + (pl * a.h + y0) * a.w, *r1 = x + (pl * a.h + y1) * a.w;
        y[o] = my * (mx * r0[x0] + lx * r0[x1]) + ly * (mx * r1[x0] + lx * r1[x1]);
    }
}

/* The first output cell along a side whose first tap lies past input cell
 * v (the taps never decrease along a side). */
__device__ int64_t first_tap_past(int64_t v, int64_t in, int64_t out, bool align)
{
    int64_t lo = 0, hi = out;
    while (lo < hi) {
        int64_t mid = lo + (hi - lo) / 2, i0, i1;
        double l;
        kpl_lerp_tap(mid, in, out, align, &i0, &i1, &l);
        if (i0 > v) hi = mid;
        else lo = mid + 1;
    }
    return lo;
}

/* How much output cell o of a side takes from input cell i. */
template <typename T>
__device__ __forceinline__ T tap_weight(int64_t o, int64_t i, int64_t in, int64_t out, bool align)
{
    int64_t i0, i1;
    double l;
    kpl_lerp_tap(o, in, out, align, &i0, &i1, &l);
    T lt = (T)l;
    return (i0 == i ? (T)1 - lt : (T)0) + (i1 == i ? lt : (T)0);
}

/* The adjoint as a gather: each gx cell sums the output cells whose taps
 * reach it (those whose first tap is the cell or the one before), so no
 * two threads write one cell and the sum's order is fixed. */
template <typename T>
__global__ void bilinear_bwd_kernel(kpl_pool_attrs a, const T *gy, T *gx)
{
    int64_t hw = a.h * a.w;
    bool al = a.align_corners;
    KPL_CUDA_FOR(i, a.n * a.c * hw)
    {
        int64_t pl = i / hw, r = i % hw, iy = r / a.w, ix = r % a.w;
        int64_t oy0 = first_tap_past(iy - 2, a.h, a.oh, al), oy1 = first_tap_past(iy, a.h, a.oh, al);
        int64_t ox0 = first_tap_past(ix - 2, a.w, a.ow, al), ox1 = first_tap_past(ix, a.w, a.ow, al);
        const T *gp = gy + pl * a.oh * a.ow;
        T s = 0;
        for (int64_t oy = oy0; oy < oy1; oy++) {
            T wy = tap_weight<T>(oy, iy, a.h, a.oh, al);
            if (wy == (T)0) continue;
            for (int64_t ox = ox0; ox < ox1; ox++)
                s += wy * tap_weight<T>(ox, ix, a.w, a.ow, al) * gp[oy * a.ow + ox];
        }
        gx[i] = s;
    }
}

template <typename T>
static kpl_status pool_typed(kpl_cuda_state *cs, const kpl_pool_attrs &a,
                             const kpl_kernel_args *args, void *out, const void *in0)
{
    int th = KPL_CUDA_THREADS;
    int64_t nout = a.n * a.c * a.oh * a.ow, nin = a.n * a.c * a.h * a.w;
    switch (a.kind) {
    case KPL_POOL_MAX: {
        int64_t *idx = (int64_t *)kpl_tensor_mutable((kpl_tensor *)args->in[1]);
        if (!idx) return kpl_last_status();
        max_pool_kernel<T><<<kpl__cuda_blocks(cs, nout, th), th, 0, cs->compute>>>(
            a, (const T *)in0, (T *)out, idx);
        return KPL_CUDA_LAUNCHED("max_pool2d");
    }
    case KPL_POOL_AVG:
        avg_pool_kernel<T><<<kpl__cuda_blocks(cs, nout, th), th, 0, cs->compute>>>(
            a, (const T *)in0, (T *)out);
        return KPL_CUDA_LAUNCHED("avg_pool2d");
    case KPL_POOL_AVG_BWD:
        avg_pool_bwd_kernel<T><<<kpl__cuda_blocks(cs, nin, th), th, 0, cs->compute>>>(
            a, (const T *)in0, (T *)out);
        return KPL_CUDA_LAUNCHED("avg_pool2d_bwd");
    case KPL_POOL_BILINEAR:
        bilinear_kernel<T><<<kpl__cuda_blocks(cs, nout, th), th, 0, cs->compute>>>(
            a, (const T *)in0, (T *)out);
        return KPL_CUDA_LAUNCHED("upsample_bilinear");
    case KPL_POOL_BILINEAR_BWD:
        bilinear_bwd_kernel<T><<<kpl__cuda_blocks(cs, nin, th), th, 0, cs->compute>>>(
            a, (const T *)in0, (T *)out);
        return KPL_CUDA_LAUNCHED("upsample_bilinear_bwd");
    case KPL_POOL_GATHER:
    case KPL_POOL_SCATTER:
        break; /* cuda_pool sends these to cuda_index.cu */
    }
    return KPL_ERROR(KPL_EINVAL, "pool2d: unknown kind %d", (int)a.kind);
}

static kpl_status cuda_pool(const kpl_kernel_args *args)
{
    const kpl_pool_attrs *a = (const kpl_pool_attrs *)args->attrs;
    if (a->kind == KPL_POOL_GATHER || a->kind == KPL_POOL_SCATTER)
        return kpl__cuda_plane_index(args);
    kpl_cuda_state *cs;
    void *out;
    const void *in[1];
    KPL_TRY(kpl__cuda_pointers(args, 1, &cs, &out, in));
    /* AVG_BWD writes gx: out's dtype is the data type */
    kpl_dtype dt = kpl_tensor_dtype(args->out);
    if (dt == KPL_F64) return pool_typed<double>(cs, *a, args, out, in[0]);
    return pool_typed<float>(cs, *a, args, out, in[0]);
}

extern "C" void kpl__cuda_register_nn(void)
{
    static const kpl_dtype fl[2] = {KPL_F32, KPL_F64};
    for (int i = 0; i < 2; i++) {
        kpl_kernel_register(KPL_KOP_BATCH_NORM, KPL_DEVICE_CUDA, fl[i], cuda_batch_norm);
        kpl_kernel_register(KPL_KOP_POOL2D, KPL_DEVICE_CUDA, fl[i], cuda_pool);
    }
}
