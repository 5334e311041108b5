/*
 * clip.c — clipping gradients by their global norm (kpl_clip_grad_norm,
 * torch.nn.utils.clip_grad_norm_): the sums of squares added up on each
 * device, one wait per device.
 */
#include "io_impl.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

/* ---- gradient clipping ---------------------------------------------------------- */

/* Sums of squares of gradients, added up in f64 on their device, so the
 * host waits once per device rather than once per gradient. */
typedef struct {
    kpl_device *dev;
    kpl_tensor *total; /* (), f64, on dev */
    kpl_tensor *part;  /* (), f64: one gradient's sum */
    kpl_tensor *sum;   /* (), the gradient's dtype: its sum as reduced */
} sumsq;

static void sumsq_free(sumsq *s)
{
    kpl_tensor_release(s->sum);
    kpl_tensor_release(s->part);
    kpl_tensor_release(s->total);
    memset(s, 0, sizeof *s);
}

/* Moves the device's total to *host (a sync) and starts over. */
static kpl_status sumsq_flush(sumsq *s, double *host)
{
    if (s->total) {
        double v = 0;
        KPL_TRY(kpl_tensor_get(s->total, 0, &v));
        *host += v;
    }
    sumsq_free(s);
    return KPL_OK;
}

static kpl_status sumsq_add(sumsq *s, kpl_tensor *g, double *host)
{
    kpl_device *dev = kpl_tensor_device(g);
    if (s->dev != dev) {
        KPL_TRY(sumsq_flush(s, host));
        s->dev = dev;
        KPL_TRY(kpl_tensor_zeros(dev, KPL_F64, 0, NULL, &s->total));
        KPL_TRY(kpl_tensor_empty(dev, KPL_F64, 0, NULL, &s->part));
    }
    if (!s->sum || kpl_tensor_dtype(s->sum) != kpl_tensor_dtype(g)) {
        kpl_tensor_release(s->sum);
        s->sum = NULL;
        KPL_TRY(kpl_tensor_empty(dev, kpl_tensor_dtype(g), 0, NULL, &s->sum));
    }
    /* A free function has nowhere to keep scratch between calls; the
     * squares' block goes back to the caching allocator at once and is
     * handed out again for the next gradient of its size. */
    kpl_tensor *sq = NULL;
    KPL_TRY(kpl_tensor_empty_like(g, &sq));
    kpl_status st = kpl_k_unary(sq, KPL_UN_SQUARE, g, 0, 0);
    if (st >= 0) st = kpl_k_reduce(s->sum, KPL_RED_SUM, sq, NULL, 0, false, 0);
    kpl_tensor_release(sq);
    KPL_TRY(st);
    KPL_TRY(kpl_k_cast(s->part, s->sum));
    return kpl_k_binary(s->total, KPL_BIN_ADD, s->total, s->part);
}

/* Whether gradient i is the same memory as an earlier one: autograd may
 * give several parameters one gradient tensor, which must be scaled once. */
static bool seen_before(kpl_tensor *const *params, int i)
{
    const kpl_tensor *g = kpl_grad_get(params[i]);
    for (int j = 0; j < i; j++) {
        const kpl_tensor *h = kpl_grad_get(params[j]);
        if (h && kpl_tensor_storage(h) == kpl_tensor_storage(g) &&
            kpl_tensor_offset(h) == kpl_tensor_offset(g))
            return true;
    }
    return false;
}

kpl_status kpl_clip_grad_norm(int n, kpl_tensor *const *params, double max_norm,
                              double *total_norm)
{
    if (total_norm) *total_norm = 0;
    KPL_CHECK(n >= 0 && (n == 0 || params), KPL_EINVAL, "clip_grad_norm: bad parameter list (%d)",
              n);
    KPL_CHECK(max_norm >= 0, KPL_EINVAL, "clip_grad_norm: max_norm %g must be >= 0", max_norm);
    sumsq s = {0};
    double total2 = 0;
    kpl_status st = KPL_OK;
    for (int i = 0; i < n; i++) {
        kpl_tensor *g = kpl_grad_get(params[i]);
        if (g) KPL_TRY_GOTO(sumsq_add(&s, g, &total2));
    }
    KPL_TRY_GOTO(sumsq_flush(&s, &total2));
    double total = sqrt(total2);
    if (total_norm) *total_norm = total;
    /* An inf or nan norm scales nothing: the caller sees it and skips the
     * step (or lets the loss scaler react) with the gradients as they were. */
    if (max_norm > 0 && isfinite(total) && total > max_norm) {
        double coef = max_norm / (total + 1e-6);
        for (int i = 0; i < n; i++) {
            kpl_tensor *g = kpl_grad_get(params[i]);
            if (g && !seen_before(params, i))
                KPL_TRY_GOTO(kpl_k_binary_scalar(g, KPL_BIN_MUL, g, coef, false));
        }
    }
fail:
    sumsq_free(&s);
    return st;
}
