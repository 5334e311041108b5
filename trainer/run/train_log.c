/*
 * train_log.c — what a training run says and where: every rank to its own
 * log file in the run directory and to the log function the caller gave
 * (kpl train's console: cli/console.c), rank 0 also to metrics.jsonl and
 * TensorBoard.  Nothing here prints.
 */
#include "run_impl.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

double kpl__wall(void)
{
    struct timespec t;
    clock_gettime(CLOCK_REALTIME, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

void kpl__log_init(kpl__runlog *l, int rank, kpl_log_fn fn, void *ctx, bool progress)
{
    memset(l, 0, sizeof *l);
    l->rank = rank;
    l->fn = fn, l->ctx = ctx;
    l->progress = progress && fn && rank == 0; /* one bar: rank 0's */
}

void kpl__log_close(kpl__runlog *l)
{
    if (l->log) fclose(l->log);
    if (l->metrics) fclose(l->metrics);
    kpl_tb_writer_close(l->tb);
    l->log = l->metrics = NULL;
    l->tb = NULL;
}

static void to_file(kpl__runlog *l, const char *tag, const char *msg)
{
    if (!l->log) return;
    time_t t = time(NULL);
    struct tm tm;
    char ts[32];
    localtime_r(&t, &tm);
    strftime(ts, sizeof ts, "%Y-%m-%d %H:%M:%S", &tm);
    fprintf(l->log, "%s %s%s\n", ts, tag, msg);
    fflush(l->log);
}

static void emit(kpl__runlog *l, kpl_log_kind kind, const char *text)
{
    if (!l->fn) return;
    kpl_log_event e;
    memset(&e, 0, sizeof e);
    e.kind = kind, e.rank = l->rank, e.text = text;
    l->fn(l->ctx, &e);
}

/* The one formatter of every line a run says: this rank's log file
 * (tagged by kind) and the log function. */
void kpl__log_v(kpl__runlog *l, kpl_log_kind kind, const char *fmt, va_list ap)
{
    char msg[4096];
    vsnprintf(msg, sizeof msg, fmt, ap);
    to_file(l, kind == KPL_LOG_WARN ? "warning: " : kind == KPL_LOG_ERROR ? "error: " : "", msg);
    emit(l, kind, msg);
}

#define KPL__SAY(l, kind, fmt)        \
    do {                              \
        va_list ap;                   \
        va_start(ap, fmt);            \
        kpl__log_v(l, kind, fmt, ap); \
        va_end(ap);                   \
    } while (0)

void kpl__log_info(kpl__runlog *l, const char *fmt, ...) { KPL__SAY(l, KPL_LOG_INFO, fmt); }
void kpl__log_report(kpl__runlog *l, const char *fmt, ...) { KPL__SAY(l, KPL_LOG_REPORT, fmt); }
void kpl__log_warn(kpl__runlog *l, const char *fmt, ...) { KPL__SAY(l, KPL_LOG_WARN, fmt); }
void kpl__log_error(kpl__runlog *l, const char *fmt, ...) { KPL__SAY(l, KPL_LOG_ERROR, fmt); }

void kpl__log_metrics(kpl__runlog *l, const char *json)
{
    if (!l->metrics) return;
    fprintf(l->metrics, "%s\n", json);
    fflush(l->metrics);
}

void kpl__log_result(kpl__runlog *l, const char *json) { emit(l, KPL_LOG_RESULT, json); }

void kpl__log_progress(kpl__runlog *l, int64_t epoch, int64_t epochs, int64_t step,
                       int64_t steps, double loss, double lr, double img_s, double eta)
{
    if (!l->progress) return;
    kpl_log_event e = {.kind = KPL_LOG_PROGRESS, .rank = l->rank, .epoch = epoch,
                       .epochs = epochs, .step = step, .steps = steps, .loss = loss, .lr = lr,
                       .images_per_sec = img_s, .eta = eta};
    l->fn(l->ctx, &e);
}
