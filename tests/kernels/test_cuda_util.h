/* test_cuda_util.h — what the test_cuda groups share: the device under
 * test and comparisons of its results with the CPU's.
 *
 * The device is cuda:0.  With KPL_TEST_CUDA_DRYRUN=1 the CPU stands in for
 * it (test_cuda_dryrun, label unit): that runs the test code itself (its
 * shapes, calls and bookkeeping, under ASan in CI) on machines without a
 * GPU; it says nothing about the CUDA kernels, and the checks that only
 * mean something on CUDA (deferred errors, streams, cuDNN caches) are
 * skipped by on_cuda(). */
#ifndef KPL_TEST_CUDA_UTIL_H
#define KPL_TEST_CUDA_UTIL_H

#include "test_util.h"
#include "kernels_impl.h"

#include <stdlib.h>

/* The device under test (test_cuda.c). */
extern kpl_device *gpu;

static inline bool on_cuda(void) { return kpl_device_type_of(gpu) == KPL_DEVICE_CUDA; }

/* A CPU tensor's copy on the device under test (caller releases). */
static inline kpl_tensor *to_gpu(kpl_tensor *t)
{
    kpl_tensor *g = NULL;
    OK(kpl_tensor_to_device(t, gpu, &g));
    return g;
}

/* An empty tensor on the device under test. */
static inline kpl_tensor *gnew(kpl_dtype dt, int ndim, const int64_t *shape)
{
    kpl_tensor *t = NULL;
    OK(kpl_tensor_empty(gpu, dt, ndim, shape, &t));
    return t;
}

/* A CPU copy of a tensor of any device (caller releases). */
static inline kpl_tensor *to_cpu(kpl_tensor *t)
{
    kpl_tensor *h = NULL;
    OK(kpl_tensor_to_device(t, kpl_device_cpu(), &h));
    return h;
}

/* Element i of host memory p of dtype dt as a double (tget without a call
 * per element: the comparisons below read millions). */
static inline double host_value(const void *p, kpl_dtype dt, int64_t i)
{
    switch (dt) {
    case KPL_F32: return ((const float *)p)[i];
    case KPL_F64: return ((const double *)p)[i];
    case KPL_F16: return kpl_f16_to_f32(((const uint16_t *)p)[i]);
    case KPL_BF16: return kpl_bf16_to_f32(((const uint16_t *)p)[i]);
    case KPL_I32: return ((const int32_t *)p)[i];
    case KPL_I64: return (double)((const int64_t *)p)[i];
    default: return ((const uint8_t *)p)[i]; /* u8, bool */
    }
}

/* Asserts that a device result matches a CPU result: |g - c| <= atol +
 * rtol |c| (0, 0 = the same values; NaNs and same-signed infinities
 * match). */
static inline void assert_same(kpl_tensor *g, kpl_tensor *c, double rtol, double atol,
                               const char *what)
{
    assert_int_equal(kpl_tensor_numel(g), kpl_tensor_numel(c));
    assert_int_equal(kpl_tensor_dtype(g), kpl_tensor_dtype(c));
    kpl_tensor *h = to_cpu(g);
    const void *ph = kpl_tensor_host_data(h), *pc = kpl_tensor_host_data(c);
    assert_true(ph && pc);
    kpl_dtype dt = kpl_tensor_dtype(c);
    for (int64_t i = 0; i < kpl_tensor_numel(c); i++)
        assert_close(host_value(ph, dt, i), host_value(pc, dt, i), rtol, atol, what, i);
    kpl_tensor_release(h);
}

/* Asserts the same bytes (bit-identical results, -0.0 and NaN payloads
 * included). */
static inline void assert_bits(kpl_tensor *g, kpl_tensor *c, const char *what)
{
    assert_int_equal(kpl_tensor_nbytes(g), kpl_tensor_nbytes(c));
    kpl_tensor *h = to_cpu(g);
    const unsigned char *a = kpl_tensor_host_data(h), *b = kpl_tensor_host_data(c);
    size_t n = kpl_tensor_nbytes(c), es = kpl_dtype_size(kpl_tensor_dtype(c));
    if (memcmp(a, b, n))
        for (size_t i = 0; i < n; i++)
            if (a[i] != b[i])
                fail_msg("%s: element %zu differs (%.9g vs %.9g)", what, i / es,
                         tget(h, (int64_t)(i / es)), tget(c, (int64_t)(i / es)));
    kpl_tensor_release(h);
}

/* Releases n tensors (NULLs allowed). */
static inline void release_all(kpl_tensor **ts, size_t n)
{
    for (size_t i = 0; i < n; i++) kpl_tensor_release(ts[i]);
}
#define RELEASE(...)                                                                   \
    do {                                                                               \
        kpl_tensor *rel_[] = {__VA_ARGS__};                                            \
        release_all(rel_, sizeof rel_ / sizeof rel_[0]);                               \
    } while (0)

/* Runs the kernel registered for (op, the device under test, dt) on
 * hand-made arguments: reaches kernels that the front end may route
 * elsewhere (f16/bf16 matmul and convolution go through f32 in ops_matmul.c
 * until it dispatches to them). */
static inline kpl_status run_kernel(kpl_kop op, kpl_dtype dt, kpl_tensor *out,
                                    const kpl_tensor *a, const kpl_tensor *b,
                                    const kpl_tensor *c, const void *attrs)
{
    kpl_kernel_fn fn;
    KPL_TRY(kpl_kernel_lookup(op, kpl_device_type_of(gpu), dt, &fn));
    kpl_kernel_args args = {.out = out, .in = {a, b, c}, .attrs = attrs};
    return fn(&args);
}

/* A CPU tensor rounded through dtype dt (f16 or bf16) and back to f32:
 * the exact values a half tensor holds (caller releases both). */
static inline void half_pair(kpl_tensor *x32, kpl_dtype dt, kpl_tensor **half,
                             kpl_tensor **back32)
{
    *half = tnew(dt, kpl_tensor_ndim(x32), kpl_tensor_shape(x32));
    *back32 = tnew(KPL_F32, kpl_tensor_ndim(x32), kpl_tensor_shape(x32));
    OK(kpl_k_cast(*half, x32));
    OK(kpl_k_cast(*back32, *half));
}

/* Whether the comma-separated list names `name` (a whole item). */
static inline bool list_names(const char *list, const char *name)
{
    size_t len = strlen(name);
    for (const char *p = list; (p = strstr(p, name)); p += len)
        if ((p == list || p[-1] == ',') && (p[len] == ',' || !p[len])) return true;
    return false;
}

/* Runs a group's tests, or, when KPL_TEST_ONLY is set (a comma-separated
 * list of test function names and group names: "cuda", "cuda mixed
 * precision", "cuda memory and ordering"), only the tests it names and the
 * whole of the groups it names: the GPU kit runs compute-sanitizer over
 * chosen tests (scripts/gpu/kit.py).  A group none of whose tests is named
 * runs nothing and passes. */
#define RUN_GROUP(name, tests) run_group_only((name), (tests), sizeof(tests) / sizeof((tests)[0]))
static inline int run_group_only(const char *name, const struct CMUnitTest *tests, size_t n)
{
    const char *only = getenv("KPL_TEST_ONLY");
    if (!only || !*only || list_names(only, name))
        return _cmocka_run_group_tests(name, tests, n, NULL, NULL);
    struct CMUnitTest *keep = calloc(n, sizeof *keep);
    if (!keep) return 1;
    size_t k = 0;
    for (size_t i = 0; i < n; i++)
        if (list_names(only, tests[i].name)) keep[k++] = tests[i];
    int fails = k ? _cmocka_run_group_tests(name, keep, k, NULL, NULL) : 0;
    free(keep);
    return fails;
}

/* The groups (test_cuda_mixed.c, test_cuda_memory.c). */
int run_cuda_mixed_tests(void);
int run_cuda_memory_tests(void);

#endif
