/* detops_test.h — what the tests of graph/vision.h's detection ops share
 * (test_detops.c, test_focal.c: one executable): tolerances against the
 * references, tensors from doubles, expected values, gradients (and
 * ir_text.h's graph dumps). */
#ifndef KPL_DETOPS_TEST_H
#define KPL_DETOPS_TEST_H

#include "kpl_refdata.h"
#include "autograd.h"
#include "ir_text.h"
#include "vision.h"

#include <float.h>
#include <stdio.h>
#include <stdlib.h>

#define RTOL(dt) ((dt) == KPL_F64 ? 1e-10 : 1e-5)
#define ATOL(dt) ((dt) == KPL_F64 ? 1e-12 : 1e-6)

static const kpl_dtype dtypes[2] __attribute__((unused)) = {KPL_F64, KPL_F32};

/* A tensor of dtype dt from doubles, pool-owned. */
static inline kpl_tensor *tensor(kpl_dtype dt, int ndim, const int64_t *shape, const double *v)
{
    int64_t n = 1;
    for (int d = 0; d < ndim; d++) n *= shape[d];
    kpl_tensor *t = NULL;
    if (n == 0)
        OK(kpl_tensor_empty(kpl_device_cpu(), KPL_F64, ndim, shape, &t));
    else
        OK(kpl_tensor_from_data(kpl_device_cpu(), KPL_F64, ndim, shape, v, &t));
    kpl_autorelease(t);
    return dt == KPL_F64 ? t : NN(kpl_cast(t, dt));
}

/* A leaf that requires grad, owned by the caller. */
static inline kpl_tensor *param(kpl_dtype dt, int ndim, const int64_t *shape, const double *v)
{
    kpl_tensor *p = NULL;
    OK(kpl_tensor_to_device(tensor(dt, ndim, shape, v), kpl_device_cpu(), &p));
    OK(kpl_set_requires_grad(p, true));
    return p;
}

static inline void expect_values(kpl_tensor *t, const double *want, int64_t n, double tol,
                          const char *what)
{
    if (!t) fail_msg("%s: %s", what, kpl_last_error());
    assert_int_equal(kpl_tensor_numel(t), n);
    for (int64_t i = 0; i < n; i++) assert_close(tget(t, i), want[i], 0, tol, what, i);
}

/* The gradient of sum(y * gy) with respect to x. */
static inline kpl_tensor *grad_of(kpl_tensor *y, kpl_tensor *gy, kpl_tensor *x)
{
    kpl_tensor *g = NULL;
    OK(kpl_grad(y, gy, 1, &x, false, &g));
    return g;
}

#endif
