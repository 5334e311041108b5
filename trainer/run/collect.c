/*
 * collect.c — collectives a task asks of its trainer (task.h): sums,
 * maxima and minima of host numbers, a broadcast and an all-gather of
 * bytes of any length, over the run's communicator.
 */
#include "run_impl.h"

#include <stdlib.h>
#include <string.h>

kpl_status kpl__trainer_reduce_host(kpl_trainer *t, double *v, int n, kpl_comm_op op)
{
    KPL_CHECK(t && (v || n <= 0), KPL_EINVAL, "trainer %s: NULL argument", kpl_comm_op_name(op));
    if (!t->comm || n <= 0) return KPL_OK;
    int64_t len = n;
    kpl_tensor *x = NULL;
    /* the time a rank waits here for the others is not its own (timing's
     * sync part) */
    kpl__tmark m = kpl__timing_begin(t, KPL__T_SYNC);
    kpl_status st = kpl_tensor_from_data(kpl_device_cpu(), KPL_F64, 1, &len, v, &x);
    if (st >= 0) st = kpl_comm_allreduce(t->comm, x, x, op);
    if (st >= 0) st = kpl_tensor_to_host(x, v, (size_t)n * sizeof *v);
    kpl_tensor_release(x);
    kpl__timing_end(t, m, "host allreduce", -1);
    return st;
}

kpl_status kpl_trainer_sum(kpl_trainer *t, double *v, int n)
{
    return kpl__trainer_reduce_host(t, v, n, KPL_COMM_SUM);
}

kpl_status kpl_trainer_max(kpl_trainer *t, double *v, int n)
{
    return kpl__trainer_reduce_host(t, v, n, KPL_COMM_MAX);
}

kpl_status kpl_trainer_min(kpl_trainer *t, double *v, int n)
{
    return kpl__trainer_reduce_host(t, v, n, KPL_COMM_MIN);
}

/* A CPU byte tensor of len (at least 1) holding data's len bytes. */
static kpl_status bytes_tensor(const void *data, size_t len, size_t cap, kpl_tensor **out)
{
    int64_t n = (int64_t)(cap ? cap : 1);
    KPL_TRY(kpl_tensor_zeros(kpl_device_cpu(), KPL_U8, 1, &n, out));
    uint8_t *p = kpl_tensor_host_mutable(*out);
    if (p && len) memcpy(p, data, len);
    return p ? KPL_OK : kpl_last_status();
}

kpl_status kpl_trainer_broadcast(kpl_trainer *t, void *buf, size_t len, int32_t root)
{
    KPL_CHECK(t && (buf || !len), KPL_EINVAL, "trainer broadcast: NULL argument");
    KPL_CHECK(root >= 0 && root < t->world, KPL_EINVAL,
              "trainer broadcast: root %d is not a rank of [0, %d)", (int)root, (int)t->world);
    if (!t->comm || len == 0) return KPL_OK;
    kpl_tensor *x = NULL;
    KPL_TRY(bytes_tensor(buf, len, len, &x));
    kpl_status st = kpl_comm_broadcast(t->comm, x, root);
    if (st >= 0) memcpy(buf, kpl_tensor_host_data(x), len);
    kpl_tensor_release(x);
    return st;
}

kpl_status kpl_trainer_all_gather(kpl_trainer *t, const void *data, size_t len, void **all,
                                  size_t *lens)
{
    KPL_CHECK(t && (data || !len) && all && lens, KPL_EINVAL, "trainer all_gather: NULL argument");
    *all = NULL;
    int w = t->comm ? t->world : 1;
    int64_t *n = calloc((size_t)w, sizeof *n);
    KPL_CHECK(n, KPL_ENOMEM, "trainer all_gather: out of memory");
    n[0] = (int64_t)len;
    kpl_tensor *mine = NULL, *every = NULL, *in = NULL, *out = NULL;
    kpl_status st = KPL_OK;
    if (w > 1) { /* the lengths first, then every rank's bytes padded to the longest */
        int64_t one = 1, nw = w;
        st = kpl_tensor_from_data(kpl_device_cpu(), KPL_I64, 1, &one, &(int64_t){(int64_t)len}, &mine);
        if (st >= 0) st = kpl_tensor_zeros(kpl_device_cpu(), KPL_I64, 1, &nw, &every);
        if (st >= 0) st = kpl_comm_allgather(t->comm, mine, every);
        if (st >= 0) st = kpl_tensor_to_host(every, n, (size_t)w * sizeof *n);
    }
    size_t most = 0, total = 0;
    for (int r = 0; st >= 0 && r < w; r++) {
        lens[r] = (size_t)n[r];
        most = lens[r] > most ? lens[r] : most;
        total += lens[r];
    }
    uint8_t *joined = st >= 0 && total ? malloc(total) : NULL;
    if (st >= 0 && total && !joined) st = KPL_ERROR(KPL_ENOMEM, "trainer all_gather: %zu bytes", total);
    if (st >= 0 && total && w == 1) memcpy(joined, data, len);
    if (st >= 0 && total && w > 1) {
        int64_t nall = (int64_t)(most * (size_t)w);
        st = bytes_tensor(data, len, most, &in);
        if (st >= 0) st = kpl_tensor_zeros(kpl_device_cpu(), KPL_U8, 1, &nall, &out);
        if (st >= 0) st = kpl_comm_allgather(t->comm, in, out);
        const uint8_t *o = st >= 0 ? kpl_tensor_host_data(out) : NULL;
        size_t at = 0;
        for (int r = 0; o && r < w; at += lens[r], r++)
            memcpy(joined + at, o + (size_t)r * most, lens[r]);
    }
    kpl_tensor_release(mine);
    kpl_tensor_release(every);
    kpl_tensor_release(in);
    kpl_tensor_release(out);
    free(n);
    if (st < 0) {
        free(joined);
        return st;
    }
    *all = joined;
    return KPL_OK;
}
