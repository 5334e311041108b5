/* test_util.h — helpers shared by the kernels/ tests. */
#ifndef KPL_TEST_UTIL_H
#define KPL_TEST_UTIL_H

#include "kpl_test.h"

static inline kpl_tensor *tf32(int ndim, const int64_t *shape, const float *data)
{
    kpl_tensor *t = NULL;
    OK(kpl_tensor_from_data(kpl_device_cpu(), KPL_F32, ndim, shape, data, &t));
    return t;
}

static inline kpl_tensor *tnew(kpl_dtype dt, int ndim, const int64_t *shape)
{
    kpl_tensor *t = NULL;
    OK(kpl_tensor_empty(kpl_device_cpu(), dt, ndim, shape, &t));
    return t;
}

/* Random tensor in [lo, hi) from a fixed seed. */
static inline kpl_tensor *trand(kpl_dtype dt, int ndim, const int64_t *shape, uint64_t seed,
                                double lo, double hi)
{
    kpl_tensor *t = tnew(dt, ndim, shape);
    kpl_rng *r = kpl_rng_create(seed);
    OK(kpl_k_uniform(t, r, lo, hi));
    kpl_rng_destroy(r);
    return t;
}

static inline void assert_tensor_close(kpl_tensor *t, const double *ref, double rtol,
                                       double atol, const char *what)
{
    for (int64_t i = 0; i < kpl_tensor_numel(t); i++)
        assert_close(tget(t, i), ref[i], rtol, atol, what, i);
}

/* Groups of tests, defined in the test_*.c files. */
int run_alloc_tests(void);
int run_tensor_tests(void);
int run_ops_tests(void);
int run_conv_tests(void);
int run_copy_rows_tests(void);
int run_bn_saved_tests(void);
int run_sgd_tests(void);

#endif
