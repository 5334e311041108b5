/*
 * ops_impl.h — private to kernels/: the argument checks and the dispatch
 * that the front ends of the compute calls share (ops.c, ops_vision.c).
 * They run on the host before any kernel and report with the op's name.
 */
#ifndef KPL_OPS_IMPL_H
#define KPL_OPS_IMPL_H

#include "kernels_impl.h"

#define CHECK_ARG(op, t, name) \
    KPL_CHECK((t) != NULL, KPL_EINVAL, "%s: argument '%s' is NULL", (op), (name))

static inline kpl_status same_device(const char *op, const kpl_tensor *a, const char *an,
                                     const kpl_tensor *b, const char *bn)
{
    KPL_CHECK(a->storage->dev == b->storage->dev, KPL_EDEVICE,
              "%s: '%s' is on %s but '%s' is on %s (copy explicitly with "
              "kpl_tensor_to_device)",
              op, an, a->storage->dev->name, bn, b->storage->dev->name);
    return KPL_OK;
}

static inline kpl_status same_shape(const char *op, const kpl_tensor *out, int ndim,
                                    const int64_t *shape)
{
    bool eq = out->ndim == ndim;
    for (int i = 0; eq && i < ndim; i++) eq = out->shape[i] == shape[i];
    if (!eq) {
        char b1[KPL_SHAPE_BUF], b2[KPL_SHAPE_BUF];
        return KPL_ERROR(KPL_ESHAPE, "%s: 'out' has shape %s, the result has shape %s",
                         op, KPL_SHAPE(out, b1), kpl_shape_str(ndim, shape, b2, sizeof b2));
    }
    return KPL_OK;
}

static inline kpl_status want_dtype(const char *op, const kpl_tensor *t, const char *name,
                                    kpl_dtype dt)
{
    KPL_CHECK(t->dtype == dt, KPL_EDTYPE, "%s: '%s' has dtype %s, expected %s", op, name,
              kpl_dtype_name(t->dtype), kpl_dtype_name(dt));
    return KPL_OK;
}

/* An output may be exactly one of its inputs (in place), or disjoint from
 * them; a partial overlap would read values already overwritten. */
static inline kpl_status no_partial_overlap(const char *op, const kpl_tensor *out,
                                            const kpl_tensor *in, const char *name)
{
    if (!in || out->storage != in->storage) return KPL_OK;
    size_t o0 = out->offset, o1 = o0 + kpl_tensor_nbytes(out);
    size_t i0 = in->offset, i1 = i0 + kpl_tensor_nbytes(in);
    if (o1 <= i0 || i1 <= o0) return KPL_OK;
    KPL_CHECK(o0 == i0 && o1 == i1, KPL_EINVAL,
              "%s: 'out' partially overlaps '%s' (only exact in-place is allowed)", op,
              name);
    return KPL_OK;
}

static inline bool is_half(kpl_dtype dt) { return dt == KPL_F16 || dt == KPL_BF16; }

static inline kpl_status dispatch(kpl_kop kop, kpl_dtype dt, kpl_tensor *out,
                                  const kpl_tensor *a, const kpl_tensor *b,
                                  const kpl_tensor *c, const void *attrs)
{
    kpl_kernel_fn fn;
    KPL_TRY(kpl_kernel_lookup(kop, out->storage->dev->type, dt, &fn));
    kpl_kernel_args args = {.out = out, .in = {a, b, c}, .attrs = attrs};
    return fn(&args);
}

#endif /* KPL_OPS_IMPL_H */
