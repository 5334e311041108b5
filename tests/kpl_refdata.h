/* kpl_refdata.h — reference numbers from a trusted framework, kept as data
 * files beside the tests (tests/graph/detops_ref.py writes them), and the
 * comparisons of kpl's results with them.
 *
 * File format (little-endian): the line "KPLTREF 1\n"; per tensor a line
 * "NAME NDIM D0 D1 ...\n" followed by D0*D1*... f64 values; the line
 * "end\n" last.  A malformed file fails the test that reads it. */
#ifndef KPL_REFDATA_H
#define KPL_REFDATA_H

#include "kpl_test.h"
#include "graph.h"

#include <stdlib.h>

typedef struct {
    char name[160];
    int ndim;
    int64_t shape[KPL_MAX_DIMS];
    int64_t numel;
    double *v;
} kpl_ref_tensor;

typedef struct {
    int n;
    kpl_ref_tensor *t;
} kpl_ref_file;

/* Reads dir/file (caller frees with kpl_ref_free); fails the test when it
 * cannot. */
static inline kpl_ref_file *kpl_ref_load(const char *dir, const char *file)
{
    char path[512], line[512];
    snprintf(path, sizeof path, "%s/%s", dir, file);
    FILE *f = fopen(path, "rb");
    if (!f) fail_msg("%s: cannot open (run tests/graph/detops_ref.py to make it)", path);
    if (!fgets(line, sizeof line, f) || strcmp(line, "KPLTREF 1\n") != 0)
        fail_msg("%s: not a KPLTREF 1 file", path);
    kpl_ref_file *r = calloc(1, sizeof *r);
    assert_non_null(r);
    for (;;) {
        if (!fgets(line, sizeof line, f)) fail_msg("%s: no 'end' line", path);
        if (!strcmp(line, "end\n")) break;
        r->t = realloc(r->t, (size_t)(r->n + 1) * sizeof *r->t);
        assert_non_null(r->t);
        kpl_ref_tensor *t = &r->t[r->n++];
        memset(t, 0, sizeof *t);
        int used = 0;
        if (sscanf(line, "%159s %d%n", t->name, &t->ndim, &used) != 2 || t->ndim < 0 ||
            t->ndim > KPL_MAX_DIMS)
            fail_msg("%s: bad header line '%s'", path, line);
        t->numel = 1;
        const char *p = line + used;
        for (int d = 0; d < t->ndim; d++) {
            char *end;
            t->shape[d] = strtoll(p, &end, 10);
            if (end == p || t->shape[d] < 0) fail_msg("%s: bad shape in '%s'", path, line);
            t->numel *= t->shape[d];
            p = end;
        }
        t->v = malloc((size_t)(t->numel ? t->numel : 1) * sizeof *t->v);
        assert_non_null(t->v);
        if (fread(t->v, sizeof *t->v, (size_t)t->numel, f) != (size_t)t->numel)
            fail_msg("%s: '%s' is cut short", path, t->name);
    }
    fclose(f);
    return r;
}

static inline void kpl_ref_free(kpl_ref_file *r)
{
    if (!r) return;
    for (int i = 0; i < r->n; i++) free(r->t[i].v);
    free(r->t);
    free(r);
}

/* The tensor called `name` (printf-style), NULL when absent. */
static inline const kpl_ref_tensor *kpl_ref_find(const kpl_ref_file *r, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));
static inline const kpl_ref_tensor *kpl_ref_find(const kpl_ref_file *r, const char *fmt, ...)
{
    char name[160];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(name, sizeof name, fmt, ap);
    va_end(ap);
    for (int i = 0; i < r->n; i++)
        if (!strcmp(r->t[i].name, name)) return &r->t[i];
    return NULL;
}

/* The tensor called `name`; fails the test when it is absent. */
#define KPL_REF(r, ...) kpl_ref_get_((r), kpl_ref_find((r), __VA_ARGS__), #__VA_ARGS__)
static inline const kpl_ref_tensor *kpl_ref_get_(const kpl_ref_file *r, const kpl_ref_tensor *t,
                                                 const char *what)
{
    (void)r;
    if (!t) fail_msg("no reference tensor %s", what);
    return t;
}

/* How many of the file's tensors have a name starting with prefix. */
static inline int kpl_ref_count_prefixed(const kpl_ref_file *r, const char *prefix)
{
    int n = 0;
    for (int i = 0; i < r->n; i++)
        if (!strncmp(r->t[i].name, prefix, strlen(prefix))) n++;
    return n;
}

/* Copies the reference's values into t (an f32 tensor on the CPU, a
 * model's parameter or buffer), failing the test unless the shapes are
 * the same; `name` is t's for the message. */
static inline void kpl_ref_copy_into(kpl_tensor *t, const kpl_ref_tensor *r, const char *name)
{
    if (kpl_tensor_ndim(t) != r->ndim)
        fail_msg("%s: %d dims, the reference's %d", name, kpl_tensor_ndim(t), r->ndim);
    for (int d = 0; d < r->ndim; d++)
        if (kpl_tensor_shape(t)[d] != r->shape[d])
            fail_msg("%s: dim %d is %lld, the reference's %lld", name, d,
                     (long long)kpl_tensor_shape(t)[d], (long long)r->shape[d]);
    float *v = kpl_tensor_host_mutable(t);
    assert_non_null(v);
    for (int64_t j = 0; j < r->numel; j++) v[j] = (float)r->v[j];
}

/* The values as a kpl tensor of dtype dt on the CPU (pool-owned). */
static inline kpl_tensor *kpl_ref_tensor_of(const kpl_ref_tensor *t, kpl_dtype dt)
{
    kpl_tensor *d = NULL;
    OK(kpl_tensor_from_data(kpl_device_cpu(), KPL_F64, t->ndim, t->shape, t->v, &d));
    kpl_autorelease(d);
    return dt == KPL_F64 ? d : NN(kpl_cast(d, dt));
}

/* The same as a leaf that requires grad, owned by the caller. */
static inline kpl_tensor *kpl_ref_param(const kpl_ref_tensor *t, kpl_dtype dt)
{
    kpl_tensor *p = NULL;
    OK(kpl_tensor_to_device(kpl_ref_tensor_of(t, dt), kpl_device_cpu(), &p));
    OK(kpl_set_requires_grad(p, true));
    return p;
}

/* t equals the reference: same shape, and every element within
 * rtol |ref| + atol max|ref| (atol relative to the largest reference
 * value, for elements that are sums cancelling to near 0). */
static inline void kpl_ref_expect(kpl_tensor *t, const kpl_ref_tensor *ref, double rtol,
                                  double atol, const char *what)
{
    if (!t) fail_msg("%s: no result: %s", what, kpl_last_error());
    if (kpl_tensor_ndim(t) != ref->ndim)
        fail_msg("%s: %d dims, the reference %s has %d", what, kpl_tensor_ndim(t), ref->name,
                 ref->ndim);
    for (int d = 0; d < ref->ndim; d++)
        if (kpl_tensor_shape(t)[d] != ref->shape[d])
            fail_msg("%s: dim %d is %lld, the reference's %lld", what, d,
                     (long long)kpl_tensor_shape(t)[d], (long long)ref->shape[d]);
    double scale = 0;
    for (int64_t i = 0; i < ref->numel; i++)
        if (fabs(ref->v[i]) > scale) scale = fabs(ref->v[i]);
    double worst = 0;
    for (int64_t i = 0; i < ref->numel; i++) {
        double got = tget(t, i), err = fabs(got - ref->v[i]) / (fabs(ref->v[i]) + scale * 1e-3);
        if (err > worst) worst = err;
        assert_close(got, ref->v[i], rtol, atol * scale, what, i);
    }
    if (getenv("KPL_REF_VERBOSE"))
        printf("%-40s %-28s max |err| / (|ref| + 1e-3 max|ref|) = %.3g\n", what, ref->name, worst);
}

#endif
