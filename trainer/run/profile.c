/*
 * profile.c — where a run's time goes.  Two things share the regions that
 * step.c and fit.c mark:
 *
 *   - the timing parts (always on): the clock runs for one part at a time
 *     (data, compute, exposed communication, optimizer, host collectives,
 *     the rest), so the parts of a window of steps add up to its wall time;
 *     every report writes them as a `timing` record of metrics.jsonl, with
 *     the bucketer's counters, the allocator's peak and the slowest rank;
 *   - the step profiler (profile.steps: [A, B]): during steps A..B each
 *     rank writes the regions, its parameters' gradient-ready times grouped
 *     by module and its buckets' allreduces as a Chrome trace (the Trace
 *     Event Format: Perfetto, chrome://tracing) into
 *     RUN_DIR/profile/rank-NNNNN.trace.json, and says so in one line.
 *
 * The trace file has a fixed layout, because kplrun merges the ranks'
 * files as text: the line {"displayTimeUnit":"ms","traceEvents":[, one
 * event per line, each but the last ending with a comma, and ]} (then a
 * newline).  Events are streamed to RUN_DIR/profile/rank-NNNNN.trace.json.tmp
 * as they happen (memory stays flat however long the window) and the file
 * is renamed into place when the window ends, so a reader never sees half
 * a trace.
 */
#define _GNU_SOURCE
#include "run_impl.h"

#include <errno.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

/* The trace's lanes (thread ids of every rank's process). */
enum { LANE_STEP, LANE_MODULES, LANE_ALLREDUCE };

/* A parameter's ready hook: which model and which module group it counts for. */
typedef struct {
    kpl__prof *p;
    int model, group;
} hook_ctx;

/* A model's parameters grouped by module (the first two parts of the
 * module's dotted path, "layer1.0" for "layer1.0.conv1.weight"). */
typedef struct {
    int n;
    char (*name)[64];
    int *count;      /* parameters in the group */
    int64_t *numel;  /* their elements */
    double *last;    /* the latest ready time in this backward, 0: none yet */
    hook_ctx *ctx;   /* one per trained parameter */
} groups;

struct kpl__prof {
    int64_t first, last;  /* profile.steps */
    int64_t from, step;   /* the first step recorded; the step under way (or the last begun) */
    bool recording, done;
    int32_t rank;
    int64_t wall_us;      /* CLOCK_REALTIME minus kpl_seconds(), in microseconds */
    double step_t0;
    kpl__afile out;       /* the trace while recording (out.f; NULL: none) */
    int hook_model;       /* the model whose backward the hooks time, -1: none */
    groups g[KPL__MAX_MODELS];
    int *order;           /* scratch: the groups of a backward by time */
};

/* ---- the timing parts ---------------------------------------------------------------------- */

static void tm_switch(kpl__timing *tm, int part, double now)
{
    if (tm->part == KPL__T_PAUSED) return; /* only the next step starts the clock again */
    tm->sum[tm->part] += now - tm->since;
    tm->since = now;
    tm->part = part;
}

static void prof_span(kpl_trainer *t, int lane, const char *name, int model, double t0,
                      double t1, const char *args);

kpl__tmark kpl__timing_begin(kpl_trainer *t, int part)
{
    kpl__tmark m = {t->tm.part, kpl_seconds()};
    if (part >= 0) tm_switch(&t->tm, part, m.t0);
    return m;
}

double kpl__timing_end(kpl_trainer *t, kpl__tmark m, const char *span, int model)
{
    double now = kpl_seconds();
    tm_switch(&t->tm, m.prev, now);
    if (span && t->prof && t->prof->recording) prof_span(t, LANE_STEP, span, model, m.t0, now, NULL);
    return now;
}

void kpl__timing_pause(kpl_trainer *t)
{
    tm_switch(&t->tm, KPL__T_PAUSED, kpl_seconds());
}

/* ---- the trace file ------------------------------------------------------------------------- */

static void put_escaped(FILE *f, const char *s)
{
    for (; *s; s++) {
        unsigned char c = (unsigned char)*s;
        if (c == '"' || c == '\\') fprintf(f, "\\%c", c);
        else if (c < 0x20) fprintf(f, "\\u%04x", c);
        else fputc(c, f);
    }
}

/* A time of the kpl_seconds() clock as wall-clock microseconds, printed
 * from integers: a double holding ~1.7e15 us keeps only quarter
 * microseconds, which would let a nested span start before its parent. */
static void put_ts(FILE *f, const kpl__prof *p, double t)
{
    double us = t * 1e6;
    int64_t whole = (int64_t)us;
    int frac = (int)((us - (double)whole) * 1000);
    if (frac < 0) frac = 0;
    if (frac > 999) frac = 999;
    fprintf(f, "%lld.%03d", (long long)(p->wall_us + whole), frac);
}

/* One event line; every event after the metadata starts a new line after
 * a comma, so that each line but the last ends with one. */
static void put_event(kpl__prof *p, char ph, int lane, const char *name, const char *suffix,
                      double t0, double t1, const char *args)
{
    FILE *f = p->out.f;
    fputs(",\n{\"name\":\"", f);
    put_escaped(f, name);
    if (suffix) {
        fputc(' ', f);
        put_escaped(f, suffix);
    }
    fprintf(f, "\",\"ph\":\"%c\",\"pid\":%d,\"tid\":%d,\"ts\":", ph, (int)p->rank, lane);
    put_ts(f, p, t0);
    if (ph == 'X') fprintf(f, ",\"dur\":%.3f", t1 > t0 ? (t1 - t0) * 1e6 : 0.0);
    if (ph == 'i') fputs(",\"s\":\"t\"", f);
    fprintf(f, ",\"args\":{\"step\":%lld%s%s}}", (long long)p->step, args ? "," : "",
            args ? args : "");
}

void kpl__prof_counter(kpl_trainer *t, const char *name, double t_abs, double value)
{
    kpl__prof *p = t->prof;
    if (!p || !p->out.f) return;
    FILE *f = p->out.f; /* no step in args: Perfetto would plot it as a second series */
    fputs(",\n{\"name\":\"", f);
    put_escaped(f, name);
    fprintf(f, "\",\"ph\":\"C\",\"pid\":%d,\"tid\":%d,\"ts\":", (int)p->rank, LANE_STEP);
    put_ts(f, p, t_abs);
    fprintf(f, ",\"args\":{\"value\":%.3f}}", value);
}

static void prof_span(kpl_trainer *t, int lane, const char *name, int model, double t0,
                      double t1, const char *args)
{
    kpl__prof *p = t->prof;
    if (!p->out.f) return;
    const char *suffix = t->nmodels > 1 && model >= 0 && model < t->nmodels ? t->models[model].name
                                                                            : NULL;
    put_event(p, 'X', lane, name, suffix, t0, t1, args);
}

static int64_t realtime_us(void)
{
    struct timespec w;
    clock_gettime(CLOCK_REALTIME, &w);
    return (int64_t)w.tv_sec * 1000000 + w.tv_nsec / 1000;
}

/* CLOCK_REALTIME minus kpl_seconds() in microseconds: one offset for the
 * whole window, so spans keep the monotonic clock's durations and ranks
 * on different hosts line up as far as their clocks agree.  The monotonic
 * reading is taken between two wall-clock ones, and the closest of a few
 * such triples wins: a rank descheduled between two readings would
 * otherwise shift its whole trace by that much. */
static int64_t wall_offset_us(void)
{
    int64_t best = 0, gap = INT64_MAX;
    for (int i = 0; i < 5; i++) {
        int64_t a = realtime_us();
        double mono = kpl_seconds();
        int64_t b = realtime_us();
        if (b - a < gap) gap = b - a, best = a + (b - a) / 2 - (int64_t)(mono * 1e6);
    }
    return best;
}

/* Opens the .tmp file and writes the header and the metadata: the process
 * is the rank (named with its host), the lanes its threads. */
static bool trace_open(kpl_trainer *t)
{
    kpl__prof *p = t->prof;
    char dir[PATH_MAX + 16], abs[PATH_MAX];
    if (!realpath(t->run_dir, abs)) {
        kpl__log_warn(&t->log, "profile: the run directory %s: %s; no trace", t->run_dir,
                      strerror(errno));
        return false;
    }
    snprintf(dir, sizeof dir, "%s/profile", abs);
    if (kpl__mkdirs(dir) < 0) {
        kpl__log_warn(&t->log, "profile: %s; no trace", kpl_last_error());
        return false;
    }
    char path[PATH_MAX + 64];
    snprintf(path, sizeof path, "%s/rank-%05d.trace.json", dir, (int)p->rank);
    if (kpl__afile_open(&p->out, path) < 0) {
        kpl__log_warn(&t->log, "profile: %s; no trace", kpl_last_error());
        return false;
    }
    setvbuf(p->out.f, NULL, _IOFBF, 1 << 16);
    p->wall_us = wall_offset_us();
    char host[256] = "";
    if (gethostname(host, sizeof host - 1) != 0) snprintf(host, sizeof host, "unknown host");
    FILE *f = p->out.f;
    fputs("{\"displayTimeUnit\":\"ms\",\"traceEvents\":[\n", f);
    fprintf(f, "{\"name\":\"process_name\",\"ph\":\"M\",\"pid\":%d,\"tid\":0,\"args\":{\"name\":\"rank %d (",
            (int)p->rank, (int)p->rank);
    put_escaped(f, host);
    fputs(")\"}}", f);
    fprintf(f, ",\n{\"name\":\"process_sort_index\",\"ph\":\"M\",\"pid\":%d,\"tid\":0,"
            "\"args\":{\"sort_index\":%d}}", (int)p->rank, (int)p->rank);
    static const char *const lanes[] = {"step", "backward by module", "allreduce"};
    for (int l = 0; l < 3; l++) {
        fprintf(f, ",\n{\"name\":\"thread_name\",\"ph\":\"M\",\"pid\":%d,\"tid\":%d,"
                "\"args\":{\"name\":\"%s\"}}", (int)p->rank, l, lanes[l]);
        fprintf(f, ",\n{\"name\":\"thread_sort_index\",\"ph\":\"M\",\"pid\":%d,\"tid\":%d,"
                "\"args\":{\"sort_index\":%d}}", (int)p->rank, l, l);
    }
    return true;
}

/* Ends the trace: the closing line, the rename into place, the line that
 * kplrun looks for.  A failure is a warning: the profile watches the run,
 * it does not stop it. */
static void trace_close(kpl_trainer *t)
{
    kpl__prof *p = t->prof;
    p->recording = false;
    p->done = true;
    kpl__memprof_end(t); /* its counter track goes into the trace */
    if (!p->out.f) return;
    fputs("\n]}\n", p->out.f);
    if (kpl__afile_commit(&p->out) < 0) {
        kpl__log_warn(&t->log, "profile: %s", kpl_last_error());
        return;
    }
    kpl__log_info(&t->log, "profile: steps %lld-%lld written to %s", (long long)p->from,
                  (long long)p->step, p->out.path);
}

/* ---- steps ------------------------------------------------------------------------------------ */

void kpl__timing_step(kpl_trainer *t)
{
    double now = kpl_seconds();
    if (t->tm.part == KPL__T_PAUSED) t->tm.part = KPL__T_OTHER, t->tm.since = now;
    kpl__prof *p = t->prof;
    if (!p || p->done) return;
    int64_t s = t->step + 1;
    if (s > p->last) { /* resumed past the window */
        p->done = true;
        return;
    }
    if (s < p->first) return;
    if (!p->recording) {
        if (!trace_open(t)) {
            p->done = true;
            return;
        }
        p->recording = true;
        p->from = s;
        kpl__memprof_begin(t);
    }
    p->step = s;
    p->step_t0 = now;
}

void kpl__timing_step_end(kpl_trainer *t)
{
    kpl__prof *p = t->prof;
    if (!p || !p->recording) return;
    char name[32];
    snprintf(name, sizeof name, "step %lld", (long long)p->step);
    prof_span(t, LANE_STEP, name, -1, p->step_t0, kpl_seconds(), NULL);
    if (t->step >= p->last) trace_close(t);
}

void kpl__prof_flush(kpl_trainer *t)
{
    if (t->prof && t->prof->recording) trace_close(t);
}

void kpl__prof_ended(kpl_trainer *t)
{
    kpl__prof *p = t->prof;
    if (!p || p->from) return;
    kpl__log_warn(&t->log, "profile.steps [%lld, %lld]: the run ended at step %lld without "
                  "training any of those steps%s: no trace written", (long long)p->first,
                  (long long)p->last, (long long)t->step,
                  t->step >= p->last ? " (it resumed past them)" : "");
}

/* ---- backward by module, buckets ---------------------------------------------------------------- */

static kpl_status on_ready(kpl_tensor *param, void *user)
{
    (void)param;
    hook_ctx *h = user;
    if (h->p->hook_model != h->model) return KPL_OK; /* not a step's backward being recorded */
    double now = kpl_seconds();
    double *last = &h->p->g[h->model].last[h->group];
    if (now > *last) *last = now;
    return KPL_OK;
}

void kpl__prof_backward_begin(kpl_trainer *t, int model)
{
    kpl__prof *p = t->prof;
    if (!p || !p->recording) return;
    groups *g = &p->g[model];
    for (int i = 0; i < g->n; i++) g->last[i] = 0;
    p->hook_model = model;
}

/* A span per module group, in the order their last gradients became
 * ready, each from the previous group's last ready time (the first from
 * the backward's start) to its own: the backward's time between two
 * modules' gradients is laid on the later one.  Autograd does not say
 * which op ran for which module, only when each parameter's gradient is
 * complete; for a chain of layers that makes each span its layer's
 * backward (the first one's with the loss's). */
void kpl__prof_backward_end(kpl_trainer *t, int model, double t0)
{
    kpl__prof *p = t->prof;
    if (!p || !p->recording) return;
    p->hook_model = -1;
    groups *g = &p->g[model];
    int n = 0;
    for (int i = 0; i < g->n; i++) {
        if (g->last[i] <= 0) continue; /* no gradient in this backward */
        int j = n++;
        for (; j > 0 && g->last[p->order[j - 1]] > g->last[i]; j--) p->order[j] = p->order[j - 1];
        p->order[j] = i;
    }
    double from = t0;
    for (int k = 0; k < n; k++) {
        int i = p->order[k];
        char args[96];
        snprintf(args, sizeof args, "\"parameters\":%d,\"elements\":%lld", g->count[i],
                 (long long)g->numel[i]);
        prof_span(t, LANE_MODULES, g->name[i], model, from, g->last[i], args);
        from = g->last[i];
    }
}

void kpl__prof_buckets(kpl_trainer *t, int model)
{
    kpl__prof *p = t->prof;
    if (!p || !p->recording || !p->out.f || !t->models[model].ddp) return;
    int n = 0;
    const kpl_bucket_timing *bt = kpl_bucketer_timings(kpl_ddp_bucketer(t->models[model].ddp), &n);
    const char *suffix = t->nmodels > 1 ? t->models[model].name : NULL;
    for (int i = 0; i < n; i++) {
        char name[48], args[160];
        snprintf(name, sizeof name, "issue bucket %d", i);
        snprintf(args, sizeof args, "\"bucket\":%d", i);
        put_event(p, 'i', LANE_ALLREDUCE, name, suffix, bt[i].issued, bt[i].issued, args);
        snprintf(name, sizeof name, "allreduce bucket %d", i);
        snprintf(args, sizeof args, "\"bucket\":%d,\"bytes\":%lld,\"ready_to_start_ms\":%.6f", i,
                 (long long)bt[i].bytes, (bt[i].started - bt[i].ready) * 1e3);
        put_event(p, 'X', LANE_ALLREDUCE, name, suffix, bt[i].started, bt[i].ended, args);
    }
}

/* ---- set-up ------------------------------------------------------------------------------------- */

/* The module group of a parameter's dotted name: its module path (the
 * name without the last part) cut to two parts. */
static void group_of(const char *pname, char *out, size_t len)
{
    const char *end = strrchr(pname, '.');
    if (!end) {
        snprintf(out, len, "(root)");
        return;
    }
    const char *dot = memchr(pname, '.', (size_t)(end - pname));
    if (dot) dot = memchr(dot + 1, '.', (size_t)(end - dot - 1));
    size_t n = (size_t)((dot ? dot : end) - pname);
    snprintf(out, len, "%.*s", (int)n, pname);
}

static kpl_status make_groups(kpl_trainer *t, int k)
{
    kpl__prof *p = t->prof;
    kpl__model *md = &t->models[k];
    groups *g = &p->g[k];
    size_t np = (size_t)(md->np ? md->np : 1);
    g->name = calloc(np, sizeof *g->name);
    g->count = calloc(np, sizeof *g->count);
    g->numel = calloc(np, sizeof *g->numel);
    g->last = calloc(np, sizeof *g->last);
    g->ctx = calloc(np, sizeof *g->ctx);
    KPL_CHECK(g->name && g->count && g->numel && g->last && g->ctx, KPL_ENOMEM, "out of memory");
    for (int i = 0; i < md->np; i++) {
        char name[64];
        group_of(md->pnames[i], name, sizeof name);
        int j = 0;
        while (j < g->n && strcmp(g->name[j], name)) j++;
        if (j == g->n) snprintf(g->name[g->n++], sizeof g->name[0], "%s", name);
        g->count[j]++;
        g->numel[j] += kpl_tensor_numel(md->params[i]);
        g->ctx[i] = (hook_ctx){p, k, j};
        KPL_TRY(kpl_add_ready_hook(md->params[i], on_ready, &g->ctx[i]));
    }
    return KPL_OK;
}

kpl_status kpl__prof_create(kpl_trainer *t)
{
    const int64_t *ps = t->r->profile.steps;
    if (ps[0] <= 0) return KPL_OK;
    kpl__prof *p = calloc(1, sizeof *p);
    KPL_CHECK(p, KPL_ENOMEM, "out of memory");
    /* the trainer owns it from here: hooks may point into it even when a
     * later one fails, so it goes with the trainer, after the models */
    t->prof = p;
    p->first = ps[0], p->last = ps[1];
    p->rank = t->rank;
    p->hook_model = -1;
    int most = 1;
    for (int k = 0; k < t->nmodels; k++) most = t->models[k].np > most ? t->models[k].np : most;
    p->order = calloc((size_t)most, sizeof *p->order);
    KPL_CHECK(p->order, KPL_ENOMEM, "out of memory");
    for (int k = 0; k < t->nmodels; k++) KPL_TRY(make_groups(t, k));
    return KPL_OK;
}

void kpl__prof_destroy(kpl_trainer *t)
{
    kpl__prof *p = t->prof;
    if (!p) return;
    kpl__afile_abort(&p->out); /* never closed (a failed run): drop it */
    kpl_memrec_destroy(t->memprof.rec);
    t->memprof.rec = NULL;
    for (int k = 0; k < KPL__MAX_MODELS; k++) {
        free(p->g[k].name);
        free(p->g[k].count);
        free(p->g[k].numel);
        free(p->g[k].last);
        free(p->g[k].ctx);
    }
    free(p->order);
    free(p);
    t->prof = NULL;
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
    if (t->r->memory.recompute != KPL_RECOMPUTE_NONE) {
        /* memory.recompute: the blocks run again per step (this rank's) */
        uint64_t rc = kpl_recompute_count();
        json_object_set_new(j, "recomputed_per_step",
                            json_real((double)(rc - tm->recomputed0) / (double)n));
        tm->recomputed0 = rc;
    }
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
