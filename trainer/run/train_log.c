/*
 * train_log.c — what a training run says and where: rank 0 talks to the
 * console (a progress bar on a terminal, plain lines on a pipe), every
 * rank to its own log file in the run directory, rank 0 also to
 * metrics.jsonl and TensorBoard.
 */
#include "trainer_impl.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <time.h>
#include <unistd.h>

double kpl__wall(void)
{
    struct timespec t;
    clock_gettime(CLOCK_REALTIME, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

void kpl__log_init(kpl__runlog *l, int rank, kpl_progress_mode mode)
{
    memset(l, 0, sizeof *l);
    l->rank = rank;
    /* log.progress auto: a terminal decides, unless the launcher says
     * (kplrun draws rank 0's bar on its own terminal: KPL_PROGRESS=always
     * with the width in COLUMNS) */
    const char *env = getenv("KPL_PROGRESS");
    if (mode == KPL_PROGRESS_AUTO && env && !strcmp(env, "always")) mode = KPL_PROGRESS_ALWAYS;
    if (mode == KPL_PROGRESS_AUTO && env && !strcmp(env, "never")) mode = KPL_PROGRESS_NEVER;
    l->bar = rank == 0 &&
             (mode == KPL_PROGRESS_ALWAYS || (mode == KPL_PROGRESS_AUTO && isatty(1)));
    l->width = 100;
    struct winsize ws;
    const char *cols = getenv("COLUMNS");
    if (l->bar && ioctl(1, TIOCGWINSZ, &ws) == 0 && ws.ws_col >= 40) l->width = ws.ws_col;
    else if (l->bar && cols && atoi(cols) >= 40) l->width = atoi(cols);
}

void kpl__log_close(kpl__runlog *l)
{
    kpl__log_bar_end(l);
    if (l->log) fclose(l->log);
    if (l->metrics) fclose(l->metrics);
    kpl_tb_writer_close(l->tb);
    l->log = l->metrics = NULL;
    l->tb = NULL;
}

/* A bar line on the screen is wiped before other text goes out. */
static void clear_bar(kpl__runlog *l)
{
    if (!l->bar_drawn) return;
    fputs("\r\033[K", stdout);
    l->bar_drawn = false;
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

void kpl__log_info(kpl__runlog *l, const char *fmt, ...)
{
    char msg[4096];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    if (l->rank == 0) {
        clear_bar(l);
        printf("%s\n", msg);
        fflush(stdout);
    }
    to_file(l, "", msg);
}

static void to_stderr(kpl__runlog *l, const char *tag, const char *fmt, va_list ap)
{
    char msg[4096];
    vsnprintf(msg, sizeof msg, fmt, ap);
    clear_bar(l);
    fflush(stdout);
    fprintf(stderr, "kpl[%d]: %s%s\n", l->rank, tag, msg);
    to_file(l, tag, msg);
}

void kpl__log_warn(kpl__runlog *l, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    to_stderr(l, "warning: ", fmt, ap);
    va_end(ap);
}

void kpl__log_error(kpl__runlog *l, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    to_stderr(l, "error: ", fmt, ap);
    va_end(ap);
}

void kpl__log_metrics(kpl__runlog *l, const char *json)
{
    if (!l->metrics) return;
    fprintf(l->metrics, "%s\n", json);
    fflush(l->metrics);
}

void kpl__log_bar(kpl__runlog *l, int64_t epoch, int64_t epochs, int64_t step, int64_t steps,
                  double loss, double lr, double img_s, double eta)
{
    if (!l->bar) return;
    char right[160], left[48];
    int eh = (int)(eta / 3600), em = (int)(eta / 60) % 60, es = (int)eta % 60;
    snprintf(left, sizeof left, "epoch %lld/%lld ", (long long)epoch + 1, (long long)epochs);
    snprintf(right, sizeof right, " %lld/%lld loss %.4f lr %.4g %.0f img/s ETA %d:%02d:%02d",
             (long long)step, (long long)steps, loss, lr, img_s, eh, em, es);
    int room = l->width - 1 - (int)strlen(left) - (int)strlen(right) - 2;
    char bar[256];
    if (room > 200) room = 200;
    if (room < 10) room = 0;
    int fill = steps > 0 ? (int)((double)room * (double)step / (double)steps) : 0;
    for (int i = 0; i < room; i++) bar[i] = i < fill ? '=' : i == fill ? '>' : ' ';
    bar[room] = 0;
    printf("\r%s%s%s%s%s\033[K", left, room ? "[" : "", bar, room ? "]" : "", right);
    fflush(stdout);
    l->bar_drawn = true;
}

void kpl__log_bar_end(kpl__runlog *l) { clear_bar(l); }
