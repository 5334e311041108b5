/*
 * ddp.c — data parallelism: the model's parameters get their gradients in
 * the bucketer's buffers, and autograd's ready hooks start the buckets'
 * allreduces during backward (collective/ never sees autograd; this is
 * where the two meet).
 */
#include "ddp.h"
#include "ir.h"

#include <stdio.h>
#include <stdlib.h>

typedef struct {
    struct kpl_ddp *d;
    int i;
} hook_ctx;

struct kpl_ddp {
    kpl_comm *comm;
    kpl_bucketer *b;
    int n;
    kpl_tensor *const *params;
    hook_ctx *ctx; /* one per parameter: the ready hook's user pointer */
};

/* A failure here ends the backward with it (and kpl_ddp_finish still
 * waits for what the buckets have in flight). */
static kpl_status on_ready(kpl_tensor *param, void *user)
{
    (void)param;
    kpl_trace_refuse("ddp: the gradient allreduce runs in the collective layer, outside the "
                     "graph; trace single-process steps");
    hook_ctx *h = user;
    kpl_status st = kpl_bucketer_mark_ready(h->d->b, h->i);
    return st < 0 ? kpl_error_prefix(st, "ddp: marking a gradient ready failed: ") : KPL_OK;
}

kpl_status kpl_ddp_create(kpl_comm *comm, int n, kpl_tensor *const *params, int nbuf,
                          kpl_tensor *const *buffers, const kpl_bucketer_config *cfg,
                          kpl_ddp **out)
{
    KPL_CHECK(comm && out && n >= 1 && params && nbuf >= 0 && (nbuf == 0 || buffers),
              KPL_EINVAL, "ddp_create: bad arguments");
    *out = NULL;
    kpl_ddp *d = calloc(1, sizeof *d);
    KPL_CHECK(d, KPL_ENOMEM, "ddp_create: no memory");
    d->comm = comm;
    d->n = n;
    d->params = params;
    kpl_status st = KPL_OK;
    d->ctx = calloc((size_t)n, sizeof *d->ctx);
    if (!d->ctx) {
        st = KPL_ERROR(KPL_ENOMEM, "ddp_create: no memory");
        goto fail;
    }
    KPL_TRY_GOTO(kpl_bucketer_create(comm, n, params, cfg, &d->b));
    KPL_TRY_GOTO(kpl_bucketer_broadcast_params(d->b));
    for (int i = 0; i < nbuf; i++) KPL_TRY_GOTO(kpl_comm_broadcast(comm, buffers[i], 0));
    for (int i = 0; i < n; i++) {
        d->ctx[i] = (hook_ctx){d, i};
        KPL_TRY_GOTO(kpl_add_ready_hook(params[i], on_ready, &d->ctx[i]));
    }
    *out = d;
    return KPL_OK;
fail:
    kpl_ddp_destroy(d);
    return st;
}

void kpl_ddp_destroy(kpl_ddp *d)
{
    if (!d) return;
    for (int i = 0; d->ctx && i < d->n; i++) {
        if (!d->ctx[i].d) continue; /* no hook added */
        kpl_clear_hooks(d->params[i]);
        /* The buckets go: a .grad still pointing into one keeps its memory
         * alive but is no longer reduced. */
        if (kpl_grad_is_buffer(d->params[i])) kpl_grad_set(d->params[i], NULL);
    }
    kpl_bucketer_destroy(d->b);
    free(d->ctx);
    free(d);
}

kpl_bucketer *kpl_ddp_bucketer(kpl_ddp *d) { return d->b; }

kpl_status kpl_ddp_begin(kpl_ddp *d, bool sync)
{
    KPL_CHECK(d, KPL_EINVAL, "ddp_begin: NULL");
    kpl_bucketer_set_sync(d->b, sync);
    for (int i = 0; i < d->n; i++) {
        kpl_tensor *view = kpl_bucketer_grad(d->b, i);
        if (kpl_grad_get(d->params[i]) == view && kpl_grad_is_buffer(d->params[i])) continue;
        KPL_TRY(kpl_k_fill(view, 0));
        KPL_TRY(kpl_grad_set_buffer(d->params[i], view));
    }
    return KPL_OK;
}

kpl_status kpl_ddp_zero_grad(kpl_ddp *d)
{
    KPL_CHECK(d, KPL_EINVAL, "ddp_zero_grad: NULL");
    return kpl_bucketer_zero_grads(d->b);
}

kpl_status kpl_ddp_finish(kpl_ddp *d)
{
    KPL_CHECK(d, KPL_EINVAL, "ddp_finish: NULL");
    /* Finish even after a hook failed (the backward said so): the other
     * ranks wait for our buckets, and a half-issued step must not leave
     * work in flight. */
    KPL_TRY(kpl_bucketer_finish(d->b));
    /* The first finish rebuilds the buckets: the gradients moved. */
    for (int i = 0; i < d->n; i++) {
        kpl_tensor *view = kpl_bucketer_grad(d->b, i);
        if (kpl_grad_is_buffer(d->params[i]) && kpl_grad_get(d->params[i]) != view)
            KPL_TRY(kpl_grad_set_buffer(d->params[i], view));
    }
    return KPL_OK;
}
