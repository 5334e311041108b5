/* tensor.c — tensor headers, views, host access and dtype conversions. */
#include "eltwise_math.h"
#include "convert_math.h"
#include "kernels_impl.h"

#include <math.h>
#include <string.h>

char *kpl_shape_str(int ndim, const int64_t *shape, char *buf, size_t len)
{
    size_t n = 0;
    if (len == 0) return buf;
    buf[0] = '\0';
    n += (size_t)snprintf(buf + n, n < len ? len - n : 0, "(");
    for (int i = 0; i < ndim; i++)
        n += (size_t)snprintf(buf + n, n < len ? len - n : 0, "%s%lld",
                              i ? "," : "", (long long)shape[i]);
    if (n < len) snprintf(buf + n, len - n, ")");
    return buf;
}

/* Checks ndim/dims and computes numel and bytes without overflow. */
static kpl_status check_shape(const char *op, kpl_dtype dt, int ndim,
                              const int64_t *shape, int64_t *numel, size_t *bytes)
{
    KPL_CHECK((unsigned)dt < KPL_DTYPE_COUNT, KPL_EDTYPE, "%s: unknown dtype %d", op,
              (int)dt);
    KPL_CHECK(ndim >= 0 && ndim <= KPL_MAX_DIMS, KPL_ESHAPE,
              "%s: %d dims requested, at most %d are supported", op, ndim, KPL_MAX_DIMS);
    KPL_CHECK(ndim == 0 || shape != NULL, KPL_EINVAL, "%s: NULL shape with %d dims", op,
              ndim);
    int64_t n = 1;
    for (int i = 0; i < ndim; i++) {
        KPL_CHECK(shape[i] >= 0, KPL_ESHAPE, "%s: negative size %lld in dim %d", op,
                  (long long)shape[i], i);
        if (shape[i] && n > INT64_MAX / 8 / shape[i]) {
            char b[KPL_SHAPE_BUF];
            return KPL_ERROR(KPL_ENOMEM, "%s: shape %s has too many elements", op,
                             kpl_shape_str(ndim, shape, b, sizeof b));
        }
        n *= shape[i];
    }
    *numel = n;
    *bytes = (size_t)n * kpl_dtype_size(dt);
    return KPL_OK;
}

static _Atomic uint64_t next_serial = 1;
static _Atomic(kpl_tensor_free_hook) free_hook;

void kpl_set_tensor_free_hook(kpl_tensor_free_hook fn) { atomic_store(&free_hook, fn); }
static _Thread_local kpl_host_access_hook tl_host_hook;
static _Thread_local void *tl_host_hook_user;

uint64_t kpl_tensor_serial(const kpl_tensor *t) { return t ? t->serial : 0; }

void kpl_tensor_set_constant(kpl_tensor *t, bool on)
{
    if (!t) return;
    t->storage->constant = on;
    if (!on) kpl__storage_drop_packed(t->storage);
}

bool kpl_tensor_constant(const kpl_tensor *t) { return t && t->storage->constant; }
uint64_t kpl_tensor_serial_next(void)
{
    return atomic_load_explicit(&next_serial, memory_order_relaxed);
}

kpl_host_access_hook kpl_set_host_access_hook(kpl_host_access_hook fn, void *user, void **prev_user)
{
    kpl_host_access_hook prev = tl_host_hook;
    if (prev_user) *prev_user = tl_host_hook_user;
    tl_host_hook = fn;
    tl_host_hook_user = user;
    return prev;
}

static void host_access(const kpl_tensor *t, bool write)
{
    if (tl_host_hook) tl_host_hook(t, write, tl_host_hook_user);
}

static kpl_tensor *header_new(kpl_dtype dt, int ndim, const int64_t *shape,
                              int64_t numel, kpl_storage *s, size_t offset)
{
    kpl_tensor *t = malloc(sizeof *t);
    if (!t) return NULL;
    atomic_init(&t->refcount, 1);
    t->dtype = dt;
    t->ndim = ndim;
    for (int i = 0; i < ndim; i++) t->shape[i] = shape[i];
    t->numel = numel;
    t->storage = s;
    t->offset = offset;
    t->meta = NULL;
    t->meta_free = NULL;
    t->serial = atomic_fetch_add_explicit(&next_serial, 1, memory_order_relaxed);
    return t;
}

kpl_status kpl_tensor_empty(kpl_device *dev, kpl_dtype dt, int ndim,
                            const int64_t *shape, kpl_tensor **out)
{
    KPL_CHECK(dev != NULL && out != NULL, KPL_EINVAL, "tensor_empty: NULL argument");
    int64_t numel = 0;
    size_t bytes = 0;
    KPL_TRY(check_shape("tensor_empty", dt, ndim, shape, &numel, &bytes));
    kpl_storage *s;
    KPL_TRY(kpl_storage_create(dev, bytes, &s));
    kpl_tensor *t = header_new(dt, ndim, shape, numel, s, 0);
    if (!t) {
        kpl_storage_release(s);
        return KPL_ERROR(KPL_ENOMEM, "tensor_empty: no host memory");
    }
    *out = t;
    return KPL_OK;
}

kpl_status kpl_tensor_zeros(kpl_device *dev, kpl_dtype dt, int ndim,
                            const int64_t *shape, kpl_tensor **out)
{
    KPL_TRY(kpl_tensor_empty(dev, dt, ndim, shape, out));
    kpl_status st = kpl_k_fill(*out, 0.0);
    if (st < 0) {
        kpl_tensor_release(*out);
        *out = NULL;
    }
    return st;
}

kpl_status kpl_tensor_from_data(kpl_device *dev, kpl_dtype dt, int ndim,
                                const int64_t *shape, const void *data,
                                kpl_tensor **out)
{
    KPL_CHECK(data != NULL, KPL_EINVAL, "tensor_from_data: NULL data");
    KPL_TRY(kpl_tensor_empty(dev, dt, ndim, shape, out));
    kpl_tensor *t = *out;
    void *h = kpl_storage_host_mutable(t->storage);
    if (!h) {
        kpl_tensor_release(t);
        *out = NULL;
        return kpl_last_status();
    }
    memcpy(h, data, kpl_tensor_nbytes(t));
    return KPL_OK;
}

kpl_status kpl_tensor_from_storage(kpl_storage *s, size_t offset, kpl_dtype dt, int ndim,
                                   const int64_t *shape, kpl_tensor **out)
{
    KPL_CHECK(s != NULL && out != NULL, KPL_EINVAL, "tensor_from_storage: NULL argument");
    int64_t numel = 0;
    size_t bytes = 0;
    KPL_TRY(check_shape("tensor_from_storage", dt, ndim, shape, &numel, &bytes));
    KPL_CHECK(offset <= s->bytes && bytes <= s->bytes - offset, KPL_ERANGE,
              "tensor_from_storage: %zu bytes at offset %zu do not fit a %zu-byte storage",
              bytes, offset, s->bytes);
    kpl_tensor *t = header_new(dt, ndim, shape, numel, s, offset);
    KPL_CHECK(t != NULL, KPL_ENOMEM, "tensor_from_storage: no host memory");
    kpl_storage_retain(s);
    *out = t;
    return KPL_OK;
}

kpl_status kpl_tensor_empty_like(const kpl_tensor *like, kpl_tensor **out)
{
    KPL_CHECK(like != NULL, KPL_EINVAL, "tensor_empty_like: NULL tensor");
    return kpl_tensor_empty(like->storage->dev, like->dtype, like->ndim, like->shape, out);
}

void kpl_tensor_retain(kpl_tensor *t)
{
    if (t) atomic_fetch_add_explicit(&t->refcount, 1, memory_order_relaxed);
}

void kpl_tensor_release(kpl_tensor *t)
{
    if (!t) return;
    if (atomic_fetch_sub_explicit(&t->refcount, 1, memory_order_acq_rel) != 1) return;
    kpl_tensor_free_hook h = atomic_load_explicit(&free_hook, memory_order_acquire);
    if (h) h(t);
    if (t->meta_free) t->meta_free(t->meta);
    kpl_storage_release(t->storage);
    free(t);
}

void kpl_tensor_set_meta(kpl_tensor *t, void *meta, void (*free_fn)(void *meta))
{
    if (!t) return;
    t->meta = meta;
    t->meta_free = free_fn;
}

void *kpl_tensor_meta(const kpl_tensor *t) { return t ? t->meta : NULL; }

int kpl_tensor_refcount(const kpl_tensor *t)
{
    if (!t) return 0;
    return atomic_load_explicit(&((kpl_tensor *)t)->refcount, memory_order_relaxed);
}

/* The accessors take NULL as ops do (the result of a failed op, a batch
 * feature the loader was not asked for): a neutral answer, never a crash;
 * the data accessors also say what was NULL. */
int kpl_tensor_ndim(const kpl_tensor *t) { return t ? t->ndim : 0; }
const int64_t *kpl_tensor_shape(const kpl_tensor *t) { return t ? t->shape : NULL; }
int64_t kpl_tensor_numel(const kpl_tensor *t) { return t ? t->numel : 0; }
size_t kpl_tensor_nbytes(const kpl_tensor *t)
{
    return t ? (size_t)t->numel * kpl_dtype_size(t->dtype) : 0;
}
kpl_dtype kpl_tensor_dtype(const kpl_tensor *t) { return t ? t->dtype : KPL_F32; }
kpl_device *kpl_tensor_device(const kpl_tensor *t) { return t ? t->storage->dev : NULL; }
kpl_storage *kpl_tensor_storage(const kpl_tensor *t) { return t ? t->storage : NULL; }
size_t kpl_tensor_offset(const kpl_tensor *t) { return t ? t->offset : 0; }

int64_t kpl_tensor_dim(const kpl_tensor *t, int axis)
{
    if (!t) return 0;
    if (axis < 0) axis += t->ndim;
    return (axis >= 0 && axis < t->ndim) ? t->shape[axis] : 0;
}

bool kpl_tensor_shares_storage(const kpl_tensor *a, const kpl_tensor *b)
{
    return a && b && a->storage == b->storage;
}

/* NULL for a NULL tensor, with an error that keeps the failure that made
 * it (if any) in view. */
static void *null_tensor(const char *what)
{
    if (kpl_last_status() < 0)
        kpl_error_prefix(kpl_last_status(), "%s: NULL tensor, from a failed op: ", what);
    else
        KPL_ERROR(KPL_EINVAL, "%s: NULL tensor (a batch feature not asked for, or an unset "
                  "result?)", what);
    return NULL;
}

const void *kpl_tensor_host_data(kpl_tensor *t)
{
    if (!t) return null_tensor("tensor_host_data");
    host_access(t, false);
    const char *p = kpl_storage_host_data(t->storage);
    return p ? p + t->offset : NULL;
}

void *kpl_tensor_host_mutable(kpl_tensor *t)
{
    if (!t) return null_tensor("tensor_host_mutable");
    host_access(t, true);
    char *p = kpl_storage_host_mutable(t->storage);
    return p ? p + t->offset : NULL;
}

const void *kpl_tensor_data(kpl_tensor *t)
{
    if (!t) return null_tensor("tensor_data");
    const char *p = kpl_storage_device_data(t->storage);
    return p ? p + t->offset : NULL;
}

void *kpl_tensor_mutable(kpl_tensor *t)
{
    if (!t) return null_tensor("tensor_mutable");
    char *p = kpl_storage_device_mutable(t->storage);
    return p ? p + t->offset : NULL;
}

kpl_status kpl_tensor_to_host(kpl_tensor *t, void *dst, size_t bytes)
{
    KPL_CHECK(t != NULL && dst != NULL, KPL_EINVAL, "tensor_to_host: NULL argument");
    size_t n = kpl_tensor_nbytes(t);
    KPL_CHECK(bytes >= n, KPL_EINVAL,
              "tensor_to_host: destination holds %zu bytes, tensor needs %zu", bytes, n);
    const void *p = kpl_tensor_host_data(t);
    if (!p) return kpl_last_status();
    memcpy(dst, p, n);
    return KPL_OK;
}

kpl_status kpl_tensor_get(kpl_tensor *t, int64_t flat, double *value)
{
    KPL_CHECK(t != NULL && value != NULL, KPL_EINVAL, "tensor_get: NULL argument");
    KPL_CHECK(flat >= 0 && flat < t->numel, KPL_ERANGE,
              "tensor_get: index %lld out of range for %lld elements", (long long)flat,
              (long long)t->numel);
    const char *p = kpl_tensor_host_data(t);
    if (!p) return kpl_last_status();
    switch (t->dtype) {
    case KPL_F32: *value = ((const float *)p)[flat]; break;
    case KPL_F64: *value = ((const double *)p)[flat]; break;
    case KPL_F16: *value = kpl_f16_to_f32(((const uint16_t *)p)[flat]); break;
    case KPL_BF16: *value = kpl_bf16_to_f32(((const uint16_t *)p)[flat]); break;
    case KPL_I32: *value = ((const int32_t *)p)[flat]; break;
    case KPL_I64: *value = (double)((const int64_t *)p)[flat]; break;
    case KPL_U8:
    case KPL_BOOL: *value = ((const uint8_t *)p)[flat]; break;
    default: return KPL_ERROR(KPL_EDTYPE, "tensor_get: invalid dtype");
    }
    return KPL_OK;
}

/* ---- views ------------------------------------------------------------------ */

static kpl_status view_new(kpl_tensor *t, int ndim, const int64_t *shape,
                           size_t offset, int64_t numel, kpl_tensor **out)
{
    kpl_tensor *v = header_new(t->dtype, ndim, shape, numel, t->storage, offset);
    KPL_CHECK(v != NULL, KPL_ENOMEM, "view: no host memory");
    kpl_storage_retain(t->storage);
    *out = v;
    return KPL_OK;
}

kpl_status kpl_tensor_reshape(kpl_tensor *t, int ndim, const int64_t *shape,
                              kpl_tensor **out)
{
    KPL_CHECK(t != NULL && out != NULL, KPL_EINVAL, "reshape: NULL argument");
    KPL_CHECK(ndim >= 0 && ndim <= KPL_MAX_DIMS && (ndim == 0 || shape), KPL_ESHAPE,
              "reshape: %d dims requested, at most %d supported", ndim, KPL_MAX_DIMS);
    int64_t s[KPL_MAX_DIMS];
    int infer = -1;
    int64_t known = 1;
    char b1[KPL_SHAPE_BUF], b2[KPL_SHAPE_BUF];
    for (int i = 0; i < ndim; i++) {
        s[i] = shape[i];
        if (s[i] == -1) {
            KPL_CHECK(infer < 0, KPL_ESHAPE, "reshape: more than one -1 in %s",
                      kpl_shape_str(ndim, shape, b1, sizeof b1));
            infer = i;
        } else {
            KPL_CHECK(s[i] >= 0, KPL_ESHAPE, "reshape: negative size in %s",
                      kpl_shape_str(ndim, shape, b1, sizeof b1));
            known *= s[i];
        }
    }
    if (infer >= 0) {
        KPL_CHECK(known != 0 && t->numel % known == 0, KPL_ESHAPE,
                  "reshape: cannot view %s as %s", KPL_SHAPE(t, b1),
                  kpl_shape_str(ndim, shape, b2, sizeof b2));
        s[infer] = t->numel / known;
        known *= s[infer];
    }
    KPL_CHECK(known == t->numel, KPL_ESHAPE,
              "reshape: cannot view %s (%lld elements) as %s", KPL_SHAPE(t, b1),
              (long long)t->numel, kpl_shape_str(ndim, shape, b2, sizeof b2));
    return view_new(t, ndim, s, t->offset, t->numel, out);
}

static int norm_axis(int axis, int ndim) { return axis < 0 ? axis + ndim : axis; }

kpl_status kpl_tensor_flatten(kpl_tensor *t, int start, int end, kpl_tensor **out)
{
    KPL_CHECK(t != NULL && out != NULL, KPL_EINVAL, "flatten: NULL argument");
    if (t->ndim == 0) return view_new(t, 1, (int64_t[]){1}, t->offset, t->numel, out);
    int s = norm_axis(start, t->ndim), e = norm_axis(end, t->ndim);
    char b[KPL_SHAPE_BUF];
    KPL_CHECK(s >= 0 && e < t->ndim && s <= e, KPL_ESHAPE,
              "flatten: dims %d..%d out of range for %s", start, end, KPL_SHAPE(t, b));
    int64_t shape[KPL_MAX_DIMS];
    int n = 0;
    for (int i = 0; i < s; i++) shape[n++] = t->shape[i];
    int64_t m = 1;
    for (int i = s; i <= e; i++) m *= t->shape[i];
    shape[n++] = m;
    for (int i = e + 1; i < t->ndim; i++) shape[n++] = t->shape[i];
    return view_new(t, n, shape, t->offset, t->numel, out);
}

kpl_status kpl_tensor_squeeze(kpl_tensor *t, int axis, kpl_tensor **out)
{
    KPL_CHECK(t != NULL && out != NULL, KPL_EINVAL, "squeeze: NULL argument");
    int64_t shape[KPL_MAX_DIMS];
    int n = 0;
    char b[KPL_SHAPE_BUF];
    if (axis == -1 && t->ndim != 1) {
        /* -1 squeezes every size-1 dim (a 1-D tensor keeps the meaning of
         * its last dim, which is the same thing). */
        for (int i = 0; i < t->ndim; i++)
            if (t->shape[i] != 1) shape[n++] = t->shape[i];
    } else {
        int a = norm_axis(axis, t->ndim);
        KPL_CHECK(a >= 0 && a < t->ndim, KPL_ESHAPE, "squeeze: axis %d out of range for %s",
                  axis, KPL_SHAPE(t, b));
        KPL_CHECK(t->shape[a] == 1, KPL_ESHAPE,
                  "squeeze: dim %d of %s has size %lld, not 1", axis, KPL_SHAPE(t, b),
                  (long long)t->shape[a]);
        for (int i = 0; i < t->ndim; i++)
            if (i != a) shape[n++] = t->shape[i];
    }
    return view_new(t, n, shape, t->offset, t->numel, out);
}

kpl_status kpl_tensor_unsqueeze(kpl_tensor *t, int axis, kpl_tensor **out)
{
    KPL_CHECK(t != NULL && out != NULL, KPL_EINVAL, "unsqueeze: NULL argument");
    char b[KPL_SHAPE_BUF];
    int a = axis < 0 ? axis + t->ndim + 1 : axis;
    KPL_CHECK(a >= 0 && a <= t->ndim && t->ndim < KPL_MAX_DIMS, KPL_ESHAPE,
              "unsqueeze: axis %d out of range for %s", axis, KPL_SHAPE(t, b));
    int64_t shape[KPL_MAX_DIMS];
    int n = 0;
    for (int i = 0; i < a; i++) shape[n++] = t->shape[i];
    shape[n++] = 1;
    for (int i = a; i < t->ndim; i++) shape[n++] = t->shape[i];
    return view_new(t, n, shape, t->offset, t->numel, out);
}

kpl_status kpl_tensor_narrow(kpl_tensor *t, int64_t start, int64_t length,
                             kpl_tensor **out)
{
    KPL_CHECK(t != NULL && out != NULL, KPL_EINVAL, "narrow: NULL argument");
    char b[KPL_SHAPE_BUF];
    KPL_CHECK(t->ndim >= 1, KPL_ESHAPE, "narrow: a 0-d tensor has no dim 0");
    KPL_CHECK(start >= 0 && length >= 0 && start <= t->shape[0] &&
                  length <= t->shape[0] - start,
              KPL_ERANGE, "narrow: rows [%lld, %lld) out of range for %s",
              (long long)start, (long long)(start + length), KPL_SHAPE(t, b));
    int64_t row = t->shape[0] ? t->numel / t->shape[0] : 0;
    int64_t shape[KPL_MAX_DIMS];
    memcpy(shape, t->shape, sizeof shape);
    shape[0] = length;
    return view_new(t, t->ndim, shape,
                    t->offset + (size_t)(start * row) * kpl_dtype_size(t->dtype),
                    row * length, out);
}

/* ---- copies ----------------------------------------------------------------- */

kpl_status kpl_tensor_to_device(kpl_tensor *t, kpl_device *dev, kpl_tensor **out)
{
    KPL_CHECK(t != NULL && dev != NULL && out != NULL, KPL_EINVAL,
              "to_device: NULL argument");
    KPL_TRY(kpl_tensor_empty(dev, t->dtype, t->ndim, t->shape, out));
    kpl_status st = kpl_k_copy(*out, t);
    if (st < 0) {
        kpl_tensor_release(*out);
        *out = NULL;
    }
    return st;
}

/* The copy plan of out = x permuted by perm; out's shape in `shape`. */
static kpl_status permute_plan(const kpl_tensor *t, const int *perm, kpl_copy_attrs *attrs,
                               int64_t *shape)
{
    char b[KPL_SHAPE_BUF];
    bool seen[KPL_MAX_DIMS] = {0};
    int64_t in_stride[KPL_MAX_DIMS];
    int64_t s = 1;
    for (int i = t->ndim - 1; i >= 0; i--) {
        in_stride[i] = s;
        s *= t->shape[i];
    }
    memset(attrs, 0, sizeof *attrs);
    attrs->plan.ndim = t->ndim;
    attrs->plan.numel = t->numel;
    for (int i = 0; i < t->ndim; i++) {
        int p = perm[i];
        KPL_CHECK(p >= 0 && p < t->ndim && !seen[p], KPL_EINVAL,
                  "permute: perm is not a permutation of the %d dims of %s", t->ndim,
                  KPL_SHAPE(t, b));
        seen[p] = true;
        shape[i] = t->shape[p];
        attrs->plan.shape[i] = t->shape[p];
        attrs->plan.stride[0][i] = in_stride[p];
    }
    return KPL_OK;
}

kpl_status kpl_k_permute(kpl_tensor *out, const kpl_tensor *x, const int *perm)
{
    KPL_CHECK(out != NULL && x != NULL && (perm || x->ndim == 0), KPL_EINVAL,
              "permute: NULL argument");
    kpl_copy_attrs attrs = {0};
    int64_t shape[KPL_MAX_DIMS];
    KPL_TRY(permute_plan(x, perm, &attrs, shape));
    char b1[KPL_SHAPE_BUF], b2[KPL_SHAPE_BUF];
    KPL_CHECK(out->ndim == x->ndim && out->dtype == x->dtype &&
                  !memcmp(out->shape, shape, (size_t)x->ndim * sizeof *shape) &&
                  out->storage->dev == x->storage->dev,
              KPL_ESHAPE, "permute: out %s %s does not hold x %s %s permuted",
              KPL_SHAPE(out, b1), kpl_dtype_name(out->dtype), KPL_SHAPE(x, b2),
              kpl_dtype_name(x->dtype));
    if (x->numel == 0) return KPL_OK;
    kpl_kernel_fn fn;
    KPL_TRY(kpl_kernel_lookup(KPL_KOP_COPY, x->storage->dev->type, x->dtype, &fn));
    kpl_kernel_args args = {.out = out, .in = {x}, .attrs = &attrs};
    return fn(&args);
}

kpl_status kpl_tensor_permute(kpl_tensor *t, const int *perm, kpl_tensor **out)
{
    KPL_CHECK(t != NULL && out != NULL && (perm || t->ndim == 0), KPL_EINVAL,
              "permute: NULL argument");
    kpl_copy_attrs attrs = {0};
    int64_t shape[KPL_MAX_DIMS];
    KPL_TRY(permute_plan(t, perm, &attrs, shape));
    KPL_TRY(kpl_tensor_empty(t->storage->dev, t->dtype, t->ndim, shape, out));
    kpl_status st = kpl_k_permute(*out, t, perm);
    if (st < 0) {
        kpl_tensor_release(*out);
        *out = NULL;
    }
    return st;
}

/* ---- f16 / bf16 ------------------------------------------------------------- */

uint16_t kpl_f32_to_f16(float f) { return kpl_cvt_f32_to_f16(f); }
float kpl_f16_to_f32(uint16_t h) { return kpl_cvt_f16_to_f32(h); }
uint16_t kpl_f32_to_bf16(float f) { return kpl_cvt_f32_to_bf16(f); }
float kpl_bf16_to_f32(uint16_t h) { return kpl_cvt_bf16_to_f32(h); }
