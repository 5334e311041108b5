/*
 * gradcheck.c — autograd's gradients against central finite differences.
 *
 * The checked function is made scalar by projecting its output on fixed
 * random weights (one backward then checks a random direction of the whole
 * Jacobian).  Order k wraps order k-1: the scalar is the projection of the
 * (k-1)-th gradients, computed with create_graph, so checking it checks
 * that the gradient functions are themselves differentiable.
 */
#include "autograd_impl.h"

#include <math.h>
#include <stdlib.h>

typedef struct {
    kpl_gradcheck_fn fn;
    void *user;
    int n;
    int order;
    uint64_t seed;
} level;

/* sum(t * r) with r uniform in [0.5, 1.5) from `seed`. */
static kpl_tensor *project(kpl_tensor *t, uint64_t seed)
{
    if (!t) return NULL;
    kpl_rng *rng = kpl_rng_create(seed);
    if (!rng) return NULL;
    kpl_tensor *r = kpl_rand(kpl_tensor_device(t), kpl_tensor_dtype(t), kpl_tensor_ndim(t),
                             kpl_tensor_shape(t), rng, 0.5, 1.5);
    kpl_rng_destroy(rng);
    return kpl_sum(kpl_mul(t, r), NULL, 0, false);
}

static kpl_tensor *level_fn(kpl_tensor *const *inputs, const level *L)
{
    if (L->order <= 1) return project(L->fn(inputs, L->user), L->seed);
    level inner = *L;
    inner.order--;
    inner.seed += 7919;
    kpl_tensor *y = level_fn(inputs, &inner);
    if (!y) return NULL;
    kpl_tensor **g = calloc((size_t)L->n, sizeof *g);
    if (!g) return NULL;
    kpl_tensor *total = NULL;
    /* A level that no input reaches is a constant: its gradients are 0. */
    if (!kpl_requires_grad(y)) {
        free(g);
        return kpl_scalar_op(KPL_BIN_MUL, y, 0, false);
    }
    if (kpl_grad(y, NULL, L->n, inputs, true, g) == KPL_OK) {
        for (int i = 0; i < L->n; i++) {
            if (!g[i]) continue;
            kpl_tensor *p = project(g[i], L->seed + 1 + (uint64_t)i);
            total = total ? kpl_add(total, p) : p;
            if (!total) break;
        }
        if (!total) /* no input reaches the gradient: it is constant 0 */
            total = kpl_scalar_op(KPL_BIN_MUL, y, 0, false);
    }
    free(g);
    return total;
}

/* The scalar value of the checked function at the current inputs. */
static kpl_status value(kpl_tensor *const *inputs, const level *L, double *v)
{
    kpl_pool *p = kpl_pool_push();
    KPL_CHECK(p != NULL, KPL_ENOMEM, "gradcheck: no host memory");
    kpl_tensor *y = level_fn(inputs, L);
    kpl_status st = y ? kpl_tensor_get(y, 0, v) : kpl_last_status();
    kpl_pool_pop(p);
    return st < 0 ? st : KPL_OK;
}

kpl_status kpl_gradcheck(kpl_gradcheck_fn fn, void *user, int ninputs,
                         kpl_tensor *const *inputs, int order, double eps, double atol,
                         double rtol)
{
    KPL_CHECK(fn != NULL && ninputs > 0 && inputs != NULL && order >= 1, KPL_EINVAL,
              "gradcheck: bad arguments");
    for (int i = 0; i < ninputs; i++)
        KPL_CHECK(kpl_requires_grad(inputs[i]) && !kpl_tensor_node(inputs[i], NULL),
                  KPL_EINVAL, "gradcheck: input %d is not a parameter (set requires_grad)", i);
    level L = {fn, user, ninputs, order, 1234};
    bool prev = kpl_set_grad_enabled(true);
    kpl_status st = KPL_OK;
    kpl_pool *p = kpl_pool_push();
    kpl_tensor **g = calloc((size_t)ninputs, sizeof *g);
    if (!p || !g) {
        st = KPL_ERROR(KPL_ENOMEM, "gradcheck: no host memory");
        goto out;
    }
    kpl_tensor *y = level_fn(inputs, &L);
    if (!y) {
        st = kpl_last_status();
        goto out;
    }
    if (kpl_requires_grad(y) && (st = kpl_grad(y, NULL, ninputs, inputs, false, g)) < 0)
        goto out; /* (a constant y has zero gradients: g stays NULL) */
    for (int i = 0; i < ninputs && st == KPL_OK; i++) {
        kpl_tensor *x = inputs[i];
        bool f64 = kpl_tensor_dtype(x) == KPL_F64;
        for (int64_t j = 0; j < kpl_tensor_numel(x); j++) {
            void *h = kpl_tensor_host_mutable(x);
            double orig = f64 ? ((double *)h)[j] : ((float *)h)[j], fp, fm;
#define SETX(v) (f64 ? (void)(((double *)h)[j] = (v)) : (void)(((float *)h)[j] = (float)(v)))
            SETX(orig + eps);
            if ((st = value(inputs, &L, &fp)) < 0) break;
            h = kpl_tensor_host_mutable(x);
            SETX(orig - eps);
            if ((st = value(inputs, &L, &fm)) < 0) break;
            h = kpl_tensor_host_mutable(x);
            SETX(orig);
#undef SETX
            double num = (fp - fm) / (2 * eps), ana = 0;
            if (g[i] && (st = kpl_tensor_get(g[i], j, &ana)) < 0) break;
            if (!(fabs(ana - num) <= atol + rtol * fabs(num))) {
                st = KPL_ERROR(KPL_EINVAL,
                               "gradcheck (order %d): input %d element %lld: autograd %.10g, "
                               "finite differences %.10g",
                               order, i, (long long)j, ana, num);
                break;
            }
        }
    }
out:
    free(g);
    kpl_pool_pop(p);
    kpl_set_grad_enabled(prev);
    return st;
}
