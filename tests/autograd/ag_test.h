/* ag_test.h — helpers of the autograd/nn tests. */
#ifndef KPL_AG_TEST_H
#define KPL_AG_TEST_H

#include "kpl_test.h"
#include "autograd.h"

/* An f64 parameter (requires_grad) with values uniform in [lo, hi), owned
 * by the caller. */
static inline kpl_tensor *param(int ndim, const int64_t *shape, uint64_t seed, double lo,
                                double hi)
{
    kpl_tensor *t = NULL;
    OK(kpl_tensor_empty(kpl_device_cpu(), KPL_F64, ndim, shape, &t));
    kpl_rng *r = kpl_rng_create(seed);
    OK(kpl_k_uniform(t, r, lo, hi));
    kpl_rng_destroy(r);
    OK(kpl_set_requires_grad(t, true));
    return t;
}

#endif
