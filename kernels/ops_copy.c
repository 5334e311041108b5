/*
 * ops_copy.c — the front end of the calls that write a tensor whole from
 * little or from another one: kpl_k_fill, kpl_k_arange, the random fills
 * (kpl_rng: Philox counters), kpl_k_cast, kpl_k_copy (the one explicit
 * transfer between devices) and kpl_k_expand (a broadcast copy).
 */
#include "ops_impl.h"

#include <stdlib.h>
#include <string.h>

/* ---- fills ------------------------------------------------------------------------- */

enum { FILL_OUT };
static const kpl_op_spec fill_spec = {{[FILL_OUT] = {.name = "out"}}};
static const kpl_op_spec arange_spec = {{
    [FILL_OUT] = {"out", .dtypes = KPL_DT(KPL_F32) | KPL_DT(KPL_F64) | KPL_DT(KPL_I32) |
                                   KPL_DT(KPL_I64)},
}};
static const kpl_op_spec random_spec = {{[FILL_OUT] = {"out", .dtypes = KPL_DT_FLOAT}}};

kpl_status kpl_k_fill(kpl_tensor *out, double value)
{
    KPL_TRY(kpl__ops_check("fill", &fill_spec, (const kpl_tensor *[]){out}));
    if (out->numel == 0) return KPL_OK;
    kpl_fill_attrs attrs = {value};
    return dispatch(KPL_KOP_FILL, out->dtype, out, NULL, NULL, NULL, &attrs);
}

kpl_status kpl_k_arange(kpl_tensor *out, double start, double step)
{
    KPL_TRY(kpl__ops_check("arange", &arange_spec, (const kpl_tensor *[]){out}));
    if (out->numel == 0) return KPL_OK;
    kpl_arange_attrs attrs = {start, step};
    return dispatch(KPL_KOP_ARANGE, out->dtype, out, NULL, NULL, NULL, &attrs);
}

/* ---- random fills ------------------------------------------------------------------ */

struct kpl_rng {
    uint64_t seed, offset;
};

kpl_rng *kpl_rng_create(uint64_t seed)
{
    kpl_rng *r = calloc(1, sizeof *r);
    if (r) r->seed = seed;
    return r;
}
void kpl_rng_destroy(kpl_rng *rng) { free(rng); }
uint64_t kpl_rng_seed(const kpl_rng *rng) { return rng->seed; }
uint64_t kpl_rng_offset(const kpl_rng *rng) { return rng->offset; }
void kpl_rng_set_state(kpl_rng *rng, uint64_t seed, uint64_t offset)
{
    rng->seed = seed;
    rng->offset = offset;
}

static kpl_status random_fill(const char *name, kpl_tensor *out, kpl_rng *rng, int normal,
                              double p1, double p2)
{
    KPL_TRY(kpl__ops_check(name, &random_spec, (const kpl_tensor *[]){out}));
    CHECK_ARG(name, rng, "rng");
    if (out->numel == 0) return KPL_OK;
    kpl_random_attrs attrs = {normal, rng->seed, rng->offset, p1, p2};
    KPL_TRY(dispatch(KPL_KOP_RANDOM, out->dtype, out, NULL, NULL, NULL, &attrs));
    int64_t per = out->dtype == KPL_F64 ? 2 : 4;
    rng->offset += (uint64_t)((out->numel + per - 1) / per);
    return KPL_OK;
}

kpl_status kpl_k_uniform(kpl_tensor *out, kpl_rng *rng, double lo, double hi)
{
    KPL_CHECK(lo <= hi, KPL_EINVAL, "uniform: lo %g is greater than hi %g", lo, hi);
    return random_fill("uniform", out, rng, 0, lo, hi);
}

kpl_status kpl_k_normal(kpl_tensor *out, kpl_rng *rng, double mean, double std)
{
    KPL_CHECK(std >= 0, KPL_EINVAL, "normal: negative std %g", std);
    return random_fill("normal", out, rng, 1, mean, std);
}

/* ---- casts and copies -------------------------------------------------------------- */

enum { CP_X, CP_OUT };
static const kpl_op_spec cast_spec = {{
    [CP_X] = {.name = "x"},
    [CP_OUT] = {"out", .device = KPL_AS(CP_X), .shape = KPL_AS(CP_X), .in_place = KPL_ARGSET(CP_X)},
}};
/* Across devices too, and between shapes of as many elements. */
static const kpl_op_spec copy_spec = {{
    [CP_X] = {.name = "x"},
    [CP_OUT] = {"out", .dtype = KPL_AS(CP_X), .in_place = KPL_ARGSET(CP_X)},
}};
static const kpl_op_spec slab_spec = {{
    [CP_X] = {.name = "x"},
    [CP_OUT] = {"out", .device = KPL_AS(CP_X), .dtype = KPL_AS(CP_X), .disjoint = KPL_ARGSET(CP_X)},
}};
static const kpl_op_spec expand_spec = {{
    [CP_X] = {.name = "x"},
    [CP_OUT] = {"out", .device = KPL_AS(CP_X), .dtype = KPL_AS(CP_X), .disjoint = KPL_ARGSET(CP_X)},
}};

kpl_status kpl_k_cast(kpl_tensor *out, const kpl_tensor *x)
{
    KPL_TRY(kpl__ops_check("cast", &cast_spec, (const kpl_tensor *[]){x, out}));
    KPL_CHECK(out->dtype == x->dtype || out->storage != x->storage, KPL_EINVAL,
              "cast: 'out' may not alias 'x' across dtypes");
    if (x->numel == 0 || (out == x)) return KPL_OK;
    return dispatch(KPL_KOP_CAST, x->dtype, out, x, NULL, NULL, NULL);
}

/* A copy between two devices, the one explicit transfer path. */
static kpl_status copy_across(kpl_tensor *out, const kpl_tensor *x)
{
    kpl_device *od = out->storage->dev, *xd = x->storage->dev;
    size_t bytes = kpl_tensor_nbytes(x);
    kpl_tensor *xm = (kpl_tensor *)x;
    if (od->type != KPL_DEVICE_CPU && xd->type == KPL_DEVICE_CPU) {
        void *dst = kpl_tensor_mutable(out);
        const void *src = kpl__host_cdata(xm);
        if (!dst || !src) return kpl_last_status();
        return od->backend->copy_h2d(od, dst, src, bytes);
    }
    if (od->type == KPL_DEVICE_CPU && xd->type != KPL_DEVICE_CPU) {
        const void *src = kpl__cdata(xm);
        char *dst = kpl_storage_host_mutable(out->storage);
        if (!dst || !src) return kpl_last_status();
        dst += out->offset;
        return xd->backend->copy_d2h(xd, dst, src, bytes);
    }
    /* GPU to another GPU: through the source's host copy. */
    const void *src = kpl__host_cdata(xm);
    void *dst = kpl_tensor_mutable(out);
    if (!dst || !src) return kpl_last_status();
    return od->backend->copy_h2d(od, dst, src, bytes);
}

/* A copy of a tensor held in a kept layout into a keepable out of its
 * shape: the bytes as they are, out left in that layout (a plain copy
 * would turn x plain first and leave out plain, breaking the chain of
 * kept layouts, e.g. at the executor's residual addend).  False when it
 * does not apply (nothing done). */
static bool copy_kept(kpl_tensor *out, const kpl_tensor *x)
{
    kpl_kept tag = kpl__kept(x);
    if (!tag || out->storage == x->storage || out->dtype != x->dtype || !kpl__keepable(out))
        return false;
    for (int d = 0; d < 4; d++)
        if (out->shape[d] != x->shape[d]) return false;
    const char *src = kpl__kept_data(x, tag);
    char *dst = kpl__kept_out(out);
    size_t bytes = kpl_tensor_nbytes(x), chunk = 1 << 20;
    int64_t chunks = (int64_t)((bytes + chunk - 1) / chunk);
    KPL_PARALLEL_FOR_IF(c, chunks, chunks > 1,
        size_t o = (size_t)c * chunk;
        memcpy(dst + o, src + o, bytes - o < chunk ? bytes - o : chunk);
    );
    kpl__storage_set_kept(out, tag);
    return true;
}

kpl_status kpl_k_copy(kpl_tensor *out, const kpl_tensor *x)
{
    KPL_TRY(kpl__ops_check("copy", &copy_spec, (const kpl_tensor *[]){x, out}));
    char b1[KPL_SHAPE_BUF], b2[KPL_SHAPE_BUF];
    KPL_CHECK(out->numel == x->numel, KPL_ESHAPE,
              "copy: 'out' %s and 'x' %s differ in element count", KPL_SHAPE(out, b1),
              KPL_SHAPE(x, b2));
    if (x->numel == 0) return KPL_OK;
    if (out->storage->dev != x->storage->dev) return copy_across(out, x);
    if (out->storage == x->storage && out->offset == x->offset) return KPL_OK;
    if (copy_kept(out, x)) return KPL_OK;
    return dispatch(KPL_KOP_COPY, x->dtype, out, x, NULL, NULL, NULL);
}

/* A slab of channels of a tensor held in a kept layout into a keepable
 * out, left in that layout: concat_kept (below) undone, as concatenation's
 * gradient takes each piece's slab of gy (a U-Net's skip and upsampled
 * maps), which a plain copy would turn plain first.  nChw16c: per image,
 * the slab's blocks are one run; NHWC: per pixel, its channels are.  False
 * when it does not apply (nothing done). */
static bool slab_kept(kpl_tensor *out, const kpl_tensor *x, int axis, int64_t offset)
{
    kpl_kept tag = kpl__kept(x);
    if (!tag || axis != 1 || x->ndim != 4 || offset % 16 || out->storage == x->storage ||
        out->storage->dev->type != KPL_DEVICE_CPU || !kpl__keepable(out))
        return false;
    const char *src = kpl__kept_data(x, tag);
    if (!src) return false;
    size_t es = kpl_dtype_size(x->dtype);
    int64_t n = x->shape[0], hw = x->shape[2] * x->shape[3], xc = x->shape[1];
    int64_t oc = out->shape[1];
    char *dst = kpl__kept_out(out);
    if (tag == KPL_KEPT_NHWC) {
        KPL_PARALLEL_FOR_IF(img, n, n > 1 && out->numel > 2 * KPL_PAR_GRAIN,
            for (int64_t p = 0; p < hw; p++)
                memcpy(dst + (size_t)((img * hw + p) * oc) * es,
                       src + (size_t)((img * hw + p) * xc + offset) * es, (size_t)oc * es);
        );
    } else {
        size_t plane = (size_t)hw * 16 * es;
        int64_t ocb = oc / 16, xcb = xc / 16;
        KPL_PARALLEL_FOR_IF(img, n, n > 1 && out->numel > 2 * KPL_PAR_GRAIN,
            memcpy(dst + (size_t)(img * ocb) * plane, src + (size_t)(img * xcb + offset / 16) * plane,
                   (size_t)ocb * plane);
        );
    }
    kpl__storage_set_kept(out, tag);
    return true;
}

kpl_status kpl_k_copy_slab(kpl_tensor *out, const kpl_tensor *x, int axis, int64_t offset,
                           bool into)
{
    const char *op = into ? "copy_slab (into)" : "copy_slab";
    KPL_TRY(kpl__ops_check(op, &slab_spec, (const kpl_tensor *[]){x, out}));
    char b1[KPL_SHAPE_BUF], b2[KPL_SHAPE_BUF];
    KPL_CHECK(out->ndim == x->ndim && axis >= 0 && axis < x->ndim, KPL_ESHAPE,
              "%s: 'out' %s and 'x' %s with axis %d", op, KPL_SHAPE(out, b1), KPL_SHAPE(x, b2),
              axis);
    for (int d = 0; d < x->ndim; d++)
        KPL_CHECK(d == axis || out->shape[d] == x->shape[d], KPL_ESHAPE,
                  "%s: 'out' %s and 'x' %s differ outside axis %d", op, KPL_SHAPE(out, b1),
                  KPL_SHAPE(x, b2), axis);
    const kpl_tensor *big = into ? out : x, *part = into ? x : out;
    KPL_CHECK(offset >= 0 && offset + part->shape[axis] <= big->shape[axis], KPL_ERANGE,
              "%s: [%lld, %lld) along axis %d passes the %lld of %s", op, (long long)offset,
              (long long)(offset + part->shape[axis]), axis, (long long)big->shape[axis],
              into ? "'out'" : "'x'");
    if (part->numel == 0) return KPL_OK;
    if (!into && slab_kept(out, x, axis, offset)) return KPL_OK;
    int64_t inner = 1, es = (int64_t)kpl_dtype_size(x->dtype);
    for (int d = axis + 1; d < x->ndim; d++) inner *= x->shape[d];
    kpl_copy_attrs a = {.slab = true, .rows = part->numel / (part->shape[axis] * inner),
                        .width = part->shape[axis] * inner * es};
    int64_t off = offset * inner * es, big_pitch = big->shape[axis] * inner * es;
    a.dst_off = into ? off : 0;
    a.dst_pitch = into ? big_pitch : a.width;
    a.src_off = into ? 0 : off;
    a.src_pitch = into ? a.width : big_pitch;
    return dispatch(KPL_KOP_COPY, x->dtype, out, x, NULL, NULL, &a);
}

#define KPL_CONCAT_MAX 8 /* pieces the kept-layout path takes at once */

/* Pieces held in one kept layout along the channels into a keepable out,
 * left in that layout.  nChw16c: per image, each piece's channel blocks
 * are one run of bytes, placed after the previous pieces' blocks; NHWC:
 * per pixel, each piece's channels are a run placed after the previous
 * pieces'.  False when it does not apply (nothing done). */
static bool concat_kept(kpl_tensor *out, int k, const kpl_tensor *const *xs, int axis)
{
    if (axis != 1 || out->ndim != 4 || out->storage->dev->type != KPL_DEVICE_CPU ||
        !kpl__keepable(out) || k > KPL_CONCAT_MAX || k < 1)
        return false;
    const char *src[KPL_CONCAT_MAX];
    int64_t c = 0, c0[KPL_CONCAT_MAX];
    kpl_kept tag = kpl__kept(xs[0]);
    for (int i = 0; i < k; i++) {
        const kpl_tensor *x = xs[i];
        if (x->storage == out->storage || x->dtype != out->dtype || x->ndim != 4 ||
            x->shape[0] != out->shape[0] || x->shape[2] != out->shape[2] ||
            x->shape[3] != out->shape[3] || !(src[i] = kpl__kept_data(x, tag)))
            return false;
        c0[i] = c;
        c += x->shape[1];
    }
    if (c != out->shape[1]) return false;
    size_t es = kpl_dtype_size(out->dtype);
    int64_t n = out->shape[0], hw = out->shape[2] * out->shape[3];
    char *dst = kpl__kept_out(out);
    if (tag == KPL_KEPT_NHWC) {
        KPL_PARALLEL_FOR_IF(t, n * k, n * k > 1 && out->numel > 2 * KPL_PAR_GRAIN,
            int64_t img = t / k, i = t % k, xc = xs[i]->shape[1];
            for (int64_t p = 0; p < hw; p++)
                memcpy(dst + (size_t)((img * hw + p) * c + c0[i]) * es,
                       src[i] + (size_t)((img * hw + p) * xc) * es, (size_t)xc * es);
        );
    } else {
        size_t plane = (size_t)hw * 16 * es;
        int64_t ocb = c / 16;
        KPL_PARALLEL_FOR_IF(t, n * k, n * k > 1 && out->numel > 2 * KPL_PAR_GRAIN,
            int64_t img = t / k, i = t % k, xcb = xs[i]->shape[1] / 16;
            memcpy(dst + (size_t)(img * ocb + c0[i] / 16) * plane,
                   src[i] + (size_t)(img * xcb) * plane, (size_t)xcb * plane);
        );
    }
    kpl__storage_set_kept(out, tag);
    return true;
}

kpl_status kpl_k_concat(kpl_tensor *out, int k, const kpl_tensor *const *xs, int axis)
{
    KPL_CHECK(out && xs && k >= 1, KPL_EINVAL, "concat: NULL argument or no pieces");
    for (int i = 0; i < k; i++) KPL_CHECK(xs[i], KPL_EINVAL, "concat: piece %d is NULL", i);
    if (concat_kept(out, k, xs, axis)) return KPL_OK;
    int64_t off = 0;
    for (int i = 0; i < k; i++) {
        KPL_TRY(kpl_k_copy_slab(out, xs[i], axis, off, true));
        off += xs[i]->shape[axis];
    }
    return KPL_OK;
}

kpl_status kpl_k_expand(kpl_tensor *out, const kpl_tensor *x)
{
    KPL_TRY(kpl__ops_check("expand", &expand_spec, (const kpl_tensor *[]){x, out}));
    int n;
    int64_t shape[KPL_MAX_DIMS];
    KPL_TRY(kpl_shape_broadcast("expand", x->ndim, x->shape, out->ndim, out->shape, &n, shape));
    KPL_TRY(same_shape("expand", out, "out", n, shape));
    if (out->numel == 0) return KPL_OK;
    /* A strided gather whose broadcast dims have stride 0. */
    kpl_copy_attrs attrs = {0};
    kpl__ops_plan_build(&attrs.plan, out->ndim, out->shape, 1, &x);
    return dispatch(KPL_KOP_COPY, x->dtype, out, x, NULL, NULL, &attrs);
}
