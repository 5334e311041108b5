/*
 * optim.c — SGD with momentum (PyTorch's formulation), on the compute calls
 * so it runs wherever the parameters live.
 */
#include "trainer.h"

#include <stdlib.h>


struct kpl_sgd {
    int n;
    kpl_tensor *const *params;
    kpl_tensor **velocity; /* created at the first step that sees a gradient */
    double lr, momentum, wd;
    bool nesterov;
};

kpl_status kpl_sgd_create(int n, kpl_tensor *const *params, double lr, double momentum,
                          double weight_decay, bool nesterov, kpl_sgd **out)
{
    *out = NULL;
    KPL_CHECK(n >= 0 && (n == 0 || params), KPL_EINVAL, "sgd: bad parameter list");
    KPL_CHECK(lr >= 0 && momentum >= 0 && weight_decay >= 0, KPL_EINVAL,
              "sgd: lr %g, momentum %g, weight_decay %g must not be negative", lr, momentum,
              weight_decay);
    KPL_CHECK(!nesterov || momentum > 0, KPL_EINVAL, "sgd: nesterov needs momentum > 0");
    kpl_sgd *o = calloc(1, sizeof *o);
    KPL_CHECK(o, KPL_ENOMEM, "sgd: out of memory");
    o->velocity = calloc((size_t)(n ? n : 1), sizeof *o->velocity);
    if (!o->velocity) {
        free(o);
        return KPL_ERROR(KPL_ENOMEM, "sgd: out of memory");
    }
    o->n = n;
    o->params = params;
    o->lr = lr;
    o->momentum = momentum;
    o->wd = weight_decay;
    o->nesterov = nesterov;
    *out = o;
    return KPL_OK;
}

void kpl_sgd_destroy(kpl_sgd *o)
{
    if (!o) return;
    for (int i = 0; i < o->n; i++) kpl_tensor_release(o->velocity[i]);
    free(o->velocity);
    free(o);
}

void kpl_sgd_set_lr(kpl_sgd *o, double lr) { o->lr = lr; }

/* p's .grad becomes g + s x in a fresh tensor (.grad may be shared with
 * the caller); *out receives it. */
static kpl_status grad_plus(kpl_tensor *p, const kpl_tensor *x, double s, kpl_tensor **out)
{
    kpl_tensor *d = NULL;
    KPL_TRY(kpl_tensor_empty_like(p, &d));
    kpl_status st = kpl_k_binary_scalar(d, KPL_BIN_MUL, x, s, false);
    if (st >= 0) st = kpl_k_binary(d, KPL_BIN_ADD, d, kpl_grad_get(p));
    kpl_grad_set(p, d);
    kpl_tensor_release(d);
    *out = kpl_grad_get(p);
    return st;
}

static kpl_status update(kpl_sgd *o, int i)
{
    kpl_tensor *p = o->params[i], *g = kpl_grad_get(p);
    if (!g) return KPL_OK;
    if (o->wd > 0) KPL_TRY(grad_plus(p, p, o->wd, &g)); /* g + wd p */
    kpl_tensor *step = g;
    if (o->momentum > 0) {
        kpl_tensor **v = &o->velocity[i];
        if (!*v) { /* the first step: v = g */
            KPL_TRY(kpl_tensor_empty_like(p, v));
            KPL_TRY(kpl_k_copy(*v, g));
        } else {
            KPL_TRY(kpl_k_binary_scalar(*v, KPL_BIN_MUL, *v, o->momentum, false));
            KPL_TRY(kpl_k_binary(*v, KPL_BIN_ADD, *v, g));
        }
        step = *v;
        if (o->nesterov) KPL_TRY(grad_plus(p, *v, o->momentum, &step)); /* g + momentum v */
    }
    /* p -= lr step, as p + (-lr) step in one pass through a scratch tensor
     * would cost a second one; two passes over the parameter are cheap
     * next to a training step. */
    kpl_tensor *s = NULL;
    KPL_TRY(kpl_tensor_empty_like(p, &s));
    kpl_status st = kpl_k_binary_scalar(s, KPL_BIN_MUL, step, o->lr, false);
    if (st >= 0) st = kpl_k_binary(p, KPL_BIN_SUB, p, s);
    kpl_tensor_release(s);
    return st;
}

kpl_status kpl_sgd_step(kpl_sgd *o)
{
    bool prev = kpl_set_grad_enabled(false);
    kpl_status st = KPL_OK;
    for (int i = 0; i < o->n && st >= 0; i++) st = update(o, i);
    kpl_set_grad_enabled(prev);
    kpl_zero_grad(o->n, o->params);
    return st;
}
