/*
 * loss_scale.c — fp16's dynamic loss scale, one per model (run_impl.h,
 * kpl__loss_scaler): everything the scale is and does, so the step, the
 * update, the report and the checkpoint only ask it.
 */
#include "run_impl.h"

#include <jansson.h>
#include <string.h>

void kpl__scaler_init(kpl__loss_scaler *s, const kpl_recipe *r)
{
    memset(s, 0, sizeof *s);
    s->on = r->precision == KPL_F16;
    s->scale = s->on ? r->loss_scale.init : 1;
    s->growth = r->loss_scale.growth;
    s->backoff = r->loss_scale.backoff;
    s->interval = r->loss_scale.interval;
}

kpl_status kpl__scaler_unscale(kpl__loss_scaler *s, kpl_device *dev, int np,
                               kpl_tensor **params, bool *overflow)
{
    *overflow = false;
    if (!s->on) return KPL_OK;
    /* one pass over the gradients: divided by the scale, and checked
     * (kpl_k_amp_unscale); the flag is read once, after the last */
    kpl_tensor *found = NULL;
    int64_t one = 1;
    double inf = 0;
    KPL_TRY(kpl_tensor_empty(dev, KPL_F32, 1, &one, &found));
    kpl_status st = kpl_k_fill(found, 0);
    for (int i = 0; st >= 0 && i < np; i++) {
        kpl_tensor *g = kpl_grad_get(params[i]);
        if (g) st = kpl_k_amp_unscale(g, 1.0 / s->scale, found);
    }
    if (st >= 0) st = kpl_tensor_get(found, 0, &inf);
    kpl_tensor_release(found);
    KPL_TRY(st);
    if (inf != 0) {
        *overflow = true;
        s->scale *= s->backoff;
        s->good = 0;
        s->skips++;
    } else if (++s->good >= s->interval) {
        s->scale *= s->growth;
        s->good = 0;
    }
    return KPL_OK;
}

void *kpl__scaler_state(const kpl__loss_scaler *s)
{
    return s->on ? json_pack("[fI]", s->scale, (json_int_t)s->good) : NULL;
}

void kpl__scaler_restore(kpl__loss_scaler *s, const void *state)
{
    const json_t *v = state;
    if (!s->on || !json_is_array(v) || json_array_size(v) != 2) return;
    json_t *sc = json_array_get(v, 0), *g = json_array_get(v, 1);
    if (json_is_number(sc) && json_number_value(sc) > 0) s->scale = json_number_value(sc);
    if (json_is_integer(g) && json_integer_value(g) >= 0) s->good = json_integer_value(g);
}
