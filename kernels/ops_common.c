/*
 * ops_common.c — what the front ends of the compute calls share
 * (ops_impl.h): the one function that checks a call's operands against
 * its spec and words the messages, and the f32 detour of f16/bf16
 * operands.
 *
 * Each call validates its arguments (NULLs, devices, dtypes, shapes) and
 * reports a failure with the op name and the shapes involved, then turns
 * the call into a device-independent kernel description (an element-wise
 * plan, an (outer, red, inner) reduction, padded matmul dims) and
 * dispatches to the kernel registered for (op, device type, dtype).  The
 * kernels themselves (cpu/, cuda/) trust what they get.
 *
 * f16 and bf16 compute natively where a device registers a kernel for them
 * (convolution and matmul: oneDNN on AVX512-BF16 / AMX CPUs, cuDNN and
 * cuBLAS on GPUs; the CPU's element-wise loops); everything else runs in
 * f32 through temporary casts, here, once, for every device.
 */
#include "ops_impl.h"

#include <stdio.h>
#include <string.h>

/* ---- declarative argument checks ------------------------------------------------- */

/* "f32, f64 and i64 are supported" for a dtype set, into buf. */
static const char *dtypes_text(uint32_t set, char *buf, size_t len)
{
    static const kpl_dtype order[] = {KPL_F32, KPL_F64, KPL_F16, KPL_BF16,
                                      KPL_I32, KPL_I64, KPL_U8,  KPL_BOOL};
    int n = 0, total = 0;
    for (size_t i = 0; i < sizeof order / sizeof order[0]; i++) total += !!(set & KPL_DT(order[i]));
    size_t at = 0;
    buf[0] = '\0';
    for (size_t i = 0; i < sizeof order / sizeof order[0] && at < len; i++) {
        if (!(set & KPL_DT(order[i]))) continue;
        const char *sep = n == 0 ? "" : n == total - 1 ? " and " : ", ";
        at += (size_t)snprintf(buf + at, len - at, "%s%s", sep, kpl_dtype_name(order[i]));
        n++;
    }
    if (at < len) snprintf(buf + at, len - at, " %s supported", total == 1 ? "is" : "are");
    return buf;
}

/* The checks of an operand on its own: rank, last dim, dtype. */
kpl_status kpl__ops_check_arg(const char *op, const kpl_arg_spec *a, const char *name,
                              const kpl_tensor *t)
{
    if (!kpl__arg_shape_ok(a, t)) {
        char b[KPL_SHAPE_BUF];
        return KPL_ERROR(KPL_ESHAPE, "%s: '%s' has shape %s; %s", op, name, KPL_SHAPE(t, b),
                         a->shape_is ? a->shape_is : "it has the wrong number of dims");
    }
    if (!kpl__arg_dtype_ok(a, t)) {
        if (!a->dtypes_are && !(a->dtypes & (a->dtypes - 1))) { /* one dtype */
            int want = 0;
            while (!(a->dtypes & KPL_DT(want))) want++;
            return KPL_ERROR(KPL_EDTYPE, "%s: '%s' has dtype %s, expected %s", op, name,
                             kpl_dtype_name(t->dtype), kpl_dtype_name((kpl_dtype)want));
        }
        char b[96];
        return KPL_ERROR(KPL_EDTYPE, "%s: '%s' has dtype %s; %s", op, name,
                         kpl_dtype_name(t->dtype),
                         a->dtypes_are ? a->dtypes_are : dtypes_text(a->dtypes, b, sizeof b));
    }
    return KPL_OK;
}

/* Operand i against the operand its relation fields name (given ones only). */
static kpl_status check_relations(const char *op, const kpl_op_spec *spec,
                                  const kpl_tensor *const *t, int i)
{
    const kpl_arg_spec *a = &spec->arg[i];
    const kpl_tensor *x = t[i], *r;
    if (a->device && (r = t[a->device - 1]) && x->storage->dev != r->storage->dev)
        return KPL_ERROR(KPL_EDEVICE,
                         "%s: '%s' is on %s but '%s' is on %s (copy explicitly with "
                         "kpl_tensor_to_device)",
                         op, a->name, x->storage->dev->name, spec->arg[a->device - 1].name,
                         r->storage->dev->name);
    if (a->dtype && (r = t[a->dtype - 1]) && x->dtype != r->dtype)
        return KPL_ERROR(KPL_EDTYPE, "%s: '%s' has dtype %s, expected %s like '%s'", op,
                         a->name, kpl_dtype_name(x->dtype), kpl_dtype_name(r->dtype),
                         spec->arg[a->dtype - 1].name);
    if (a->shape && (r = t[a->shape - 1]) && !kpl__same_dims(x, r)) {
        char b1[KPL_SHAPE_BUF], b2[KPL_SHAPE_BUF];
        return KPL_ERROR(KPL_ESHAPE, "%s: '%s' has shape %s, expected %s like '%s'", op,
                         a->name, KPL_SHAPE(x, b1), KPL_SHAPE(r, b2),
                         spec->arg[a->shape - 1].name);
    }
    return KPL_OK;
}

/* Operand i's memory against the operands its memory rules name.  An
 * in-place output may be exactly one of its inputs, or disjoint from them;
 * a partial overlap would read values already overwritten. */
static kpl_status check_memory(const char *op, const kpl_op_spec *spec,
                               const kpl_tensor *const *t, int n, int i)
{
    const kpl_arg_spec *a = &spec->arg[i];
    for (int j = 0; j < n; j++) {
        if (!((a->disjoint | a->in_place) & KPL_ARGSET(j))) continue;
        bool disjoint = a->disjoint & KPL_ARGSET(j);
        if (kpl__memory_ok(disjoint, t[i], t[j])) continue;
        if (disjoint)
            return KPL_ERROR(KPL_EINVAL, "%s: '%s' may not alias '%s'", op, a->name,
                             spec->arg[j].name);
        return KPL_ERROR(KPL_EINVAL,
                         "%s: '%s' partially overlaps '%s' (only exact in-place is allowed)", op,
                         a->name, spec->arg[j].name);
    }
    return KPL_OK;
}

kpl_status kpl__ops_check_failed(const char *op, const kpl_op_spec *spec,
                                 const kpl_tensor *const *t)
{
    int n = 0;
    while (n < KPL_OPS_ARGS && spec->arg[n].name) n++;
    for (int i = 0; i < n; i++)
        KPL_CHECK(t[i] || spec->arg[i].optional, KPL_EINVAL, "%s: argument '%s' is NULL", op,
                  spec->arg[i].name);
    for (int i = 0; i < n; i++) {
        if (!t[i]) continue;
        KPL_TRY(kpl__ops_check_arg(op, &spec->arg[i], spec->arg[i].name, t[i]));
        KPL_TRY(check_relations(op, spec, t, i));
    }
    for (int i = 0; i < n; i++)
        if (t[i]) KPL_TRY(check_memory(op, spec, t, n, i));
    /* The inline check found a rule broken that these did not: a bug. */
    KPL_ASSERT(false, "kpl__ops_check and kpl__ops_check_failed disagree");
    return KPL_EINVAL;
}

/* ---- f16 and bf16 through f32 -------------------------------------------------- */

/* A temporary f32 copy of a half tensor (caller releases). */
static kpl_status half_to_f32(const kpl_tensor *t, kpl_tensor **out)
{
    KPL_TRY(kpl_tensor_empty(t->storage->dev, KPL_F32, t->ndim, t->shape, out));
    kpl_status st = kpl_k_cast(*out, t);
    if (st < 0) {
        kpl_tensor_release(*out);
        *out = NULL;
    }
    return st;
}

kpl_status kpl__ops_via_f32(kpl_kop kop, kpl_tensor *out, bool direct, const kpl_tensor *a,
                            const kpl_tensor *b, const kpl_tensor *c, const void *attrs)
{
    const kpl_tensor *in[3] = {a, b, c};
    kpl_tensor *f[3] = {NULL, NULL, NULL}, *of = NULL;
    kpl_status st = KPL_OK;
    for (int i = 0; i < 3; i++)
        if (in[i] && is_half(in[i]->dtype)) {
            KPL_TRY_GOTO(half_to_f32(in[i], &f[i]));
            in[i] = f[i];
        }
    /* An f32 stand-in for a half output, released after the result is cast. */
    if (!direct)
        KPL_TRY_GOTO(kpl_tensor_empty(out->storage->dev, KPL_F32, out->ndim, out->shape, &of));
    KPL_TRY_GOTO(dispatch(kop, KPL_F32, direct ? out : of, in[0], in[1], in[2], attrs));
    st = direct ? KPL_OK : kpl_k_cast(out, of);
fail:
    kpl_tensor_release(of);
    for (int i = 0; i < 3; i++) kpl_tensor_release(f[i]);
    return st;
}
