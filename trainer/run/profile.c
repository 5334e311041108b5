/*
 * profile.c — where a run's time goes: the timing parts.  The clock runs
 * for one part at a time (data, compute, exposed communication, optimizer,
 * host collectives, the rest), switched by the regions that step.c and
 * fit.c mark, so the parts of a window of steps add up to its wall time;
 * every report writes them as a `timing` record of metrics.jsonl, with the
 * bucketer's counters, the allocator's peak and the slowest rank.
 */
#define _GNU_SOURCE
#include "trainer_impl.h"

#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- the timing parts ---------------------------------------------------------------------- */

static void tm_switch(kpl__timing *tm, int part, double now)
{
    if (tm->part == KPL__T_PAUSED) return; /* only the next step starts the clock again */
    tm->sum[tm->part] += now - tm->since;
    tm->since = now;
    tm->part = part;
}

kpl__tmark kpl__timing_begin(kpl_trainer *t, int part)
{
    kpl__tmark m = {t->tm.part, kpl_seconds()};
    if (part >= 0) tm_switch(&t->tm, part, m.t0);
    return m;
}

double kpl__timing_end(kpl_trainer *t, kpl__tmark m, const char *span, int model)
{
    (void)span, (void)model;
    double now = kpl_seconds();
    tm_switch(&t->tm, m.prev, now);
    return now;
}

void kpl__timing_pause(kpl_trainer *t)
{
    tm_switch(&t->tm, KPL__T_PAUSED, kpl_seconds());
}

void kpl__timing_step(kpl_trainer *t)
{
    if (t->tm.part == KPL__T_PAUSED) t->tm.part = KPL__T_OTHER, t->tm.since = kpl_seconds();
}

/* ---- the timing record ---------------------------------------------------------------------------- */

/* Every rank's (own step time, peak MB) into all (2 per rank). */
static kpl_status gather(kpl_trainer *t, const double *mine, double *all)
{
    int64_t two = 2, n = 2 * (int64_t)t->world;
    kpl_tensor *in = NULL, *out = NULL;
    kpl__tmark m = kpl__timing_begin(t, KPL__T_SYNC);
    kpl_status st = kpl_tensor_from_data(kpl_device_cpu(), KPL_F64, 1, &two, mine, &in);
    if (st >= 0) st = kpl_tensor_zeros(kpl_device_cpu(), KPL_F64, 1, &n, &out);
    if (st >= 0) st = kpl_comm_allgather(t->comm, in, out);
    if (st >= 0) st = kpl_tensor_to_host(out, all, (size_t)n * sizeof *all);
    kpl_tensor_release(in);
    kpl_tensor_release(out);
    kpl__timing_end(t, m, "host allgather", -1);
    return st;
}

kpl_status kpl__timing_report(kpl_trainer *t)
{
    kpl__timing *tm = &t->tm;
    double now = kpl_seconds();
    tm_switch(tm, tm->part, now); /* the part under way up to now */
    int64_t n = t->step - tm->step0;
    if (n <= 0) return KPL_OK; /* t->step is the same on every rank: all return here */
    double ms = 1e3 / (double)n, part[KPL__T_PARTS], total = 0;
    for (int i = 0; i < KPL__T_PARTS; i++) {
        part[i] = i == KPL__T_PAUSED ? 0 : tm->sum[i] * ms;
        total += part[i];
        tm->sum[i] = 0;
    }
    tm->step0 = t->step;
    /* a rank's own time: its step less its waits for the others (the
     * allreduce it waited for, the host collectives).  In a synchronous
     * job every rank's wall-clock step is the same; this is what differs */
    double mine[2] = {total - part[KPL__T_COMM] - part[KPL__T_SYNC], 0};
    kpl_memory_stats mem = kpl_device_memory_stats(t->dev);
    mine[1] = (double)mem.peak_allocated / 1048576.0;
    kpl_device_reset_peak(t->dev);
    double comm_s = 0, wait_s = 0;
    int64_t bytes = 0, buckets = 0;
    for (int k = 0; k < t->nmodels; k++) {
        if (!t->models[k].ddp) continue;
        kpl_bucketer *b = kpl_ddp_bucketer(t->models[k].ddp);
        kpl_bucketer_stats s = kpl_bucketer_get_stats(b), *s0 = &tm->b0[k];
        comm_s += s.comm_seconds - s0->comm_seconds;
        wait_s += s.wait_seconds - s0->wait_seconds;
        bytes += s.bytes - s0->bytes;
        buckets += kpl_bucketer_num_buckets(b);
        *s0 = s;
    }
    double one[2], *all = one;
    int w = t->comm ? (int)t->world : 1;
    if (w > 1) {
        all = calloc((size_t)(2 * w), sizeof *all);
        KPL_CHECK(all, KPL_ENOMEM, "out of memory");
        kpl_status st = gather(t, mine, all);
        if (st < 0) {
            free(all);
            return st;
        }
    } else {
        one[0] = mine[0], one[1] = mine[1];
    }
    int slow = 0, fast = 0;
    double peak_max = 0;
    for (int r = 0; r < w; r++) {
        if (all[2 * r] > all[2 * slow]) slow = r;
        if (all[2 * r] < all[2 * fast]) fast = r;
        if (all[2 * r + 1] > peak_max) peak_max = all[2 * r + 1];
    }
    double slow_ms = all[2 * slow], fast_ms = all[2 * fast];
    if (all != one) free(all);
    if (t->rank != 0) return KPL_OK;
    json_t *j = json_pack("{s:s, s:I, s:I}", "event", "timing", "step", (json_int_t)t->step,
                          "steps", (json_int_t)n);
    static const struct {
        const char *key;
        int part;
    } keys[] = {{"data_wait_ms", KPL__T_DATA},        {"compute_ms", KPL__T_COMPUTE},
                {"comm_exposed_ms", KPL__T_COMM},     {"optimizer_ms", KPL__T_OPT}};
    json_object_set_new(j, "step_ms", json_real(total));
    for (size_t i = 0; i < sizeof keys / sizeof keys[0]; i++)
        json_object_set_new(j, keys[i].key, json_real(part[keys[i].part]));
    double other = part[KPL__T_OTHER] + part[KPL__T_SYNC];
    json_object_set_new(j, "other_ms", json_real(other));
    json_object_set_new(j, "sync_ms", json_real(part[KPL__T_SYNC]));
    json_object_set_new(j, "comm_ms", json_real(comm_s * ms));
    json_object_set_new(j, "buckets", json_integer(buckets));
    json_object_set_new(j, "bytes_per_step", json_integer(bytes / n));
    json_object_set_new(j, "bucket_wait_ms", json_real(wait_s * ms));
    json_object_set_new(j, "peak_mb", json_real(mine[1]));
    json_object_set_new(j, "peak_mb_max", json_real(peak_max));
    json_object_set_new(j, "slowest_rank", json_integer(slow));
    json_object_set_new(j, "slowest_step_ms", json_real(slow_ms));
    json_object_set_new(j, "fastest_step_ms", json_real(fast_ms));
    kpl__trainer_emit(t, j);
    char tail[96] = "";
    if (w > 1) snprintf(tail, sizeof tail, " | slowest rank %d (%.1f ms)", slow, slow_ms);
    kpl__log_report(&t->log, "timing: %.1f ms/step = data %.1f + compute %.1f + exposed comm %.1f "
                    "+ optimizer %.1f + other %.1f | peak %.0f MB%s", total, part[KPL__T_DATA],
                    part[KPL__T_COMPUTE], part[KPL__T_COMM], part[KPL__T_OPT], other, mine[1],
                    tail);
    return KPL_OK;
}
