/*
 * console.c — what `kpl train` and `kpl eval` print: the trainer's log
 * events (kpl_log_fn) on the terminal.  Rank 0's lines go to stdout (or
 * another stream: `kpl data fid-net` keeps stdout for its JSON line), with
 * a progress bar on a terminal (or when kplrun draws it: KPL_PROGRESS),
 * plain report lines on a pipe; every rank's warnings and errors go to
 * stderr as "kpl[rank]: warning: ...".
 */
#include "cli.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <unistd.h>

void kpl__console_init(kpl__console *c, kpl_progress_mode mode)
{
    memset(c, 0, sizeof *c);
    c->out = stdout;
    /* log.progress auto: a terminal decides, unless the launcher says
     * (kplrun draws rank 0's bar on its own terminal: KPL_PROGRESS=always
     * with the width in COLUMNS) */
    const char *env = getenv("KPL_PROGRESS");
    if (mode == KPL_PROGRESS_AUTO && env && !strcmp(env, "always")) mode = KPL_PROGRESS_ALWAYS;
    if (mode == KPL_PROGRESS_AUTO && env && !strcmp(env, "never")) mode = KPL_PROGRESS_NEVER;
    c->bar = mode == KPL_PROGRESS_ALWAYS || (mode == KPL_PROGRESS_AUTO && isatty(1));
    c->width = 100;
    struct winsize ws;
    const char *cols = getenv("COLUMNS");
    if (c->bar && ioctl(1, TIOCGWINSZ, &ws) == 0 && ws.ws_col >= 40) c->width = ws.ws_col;
    else if (c->bar && cols && atoi(cols) >= 40) c->width = atoi(cols);
}

/* A bar line on the screen is wiped before other text goes out. */
static void clear_bar(kpl__console *c)
{
    if (!c->bar_drawn) return;
    fputs("\r\033[K", c->out);
    c->bar_drawn = false;
}

void kpl__console_end(kpl__console *c)
{
    clear_bar(c);
    fflush(c->out);
}

static void draw(kpl__console *c, const kpl_log_event *e)
{
    char right[160], left[48];
    double eta = e->eta > 0 && e->eta < 1e7 ? e->eta : 0;
    int eh = (int)(eta / 3600), em = (int)(eta / 60) % 60, es = (int)eta % 60;
    snprintf(left, sizeof left, "epoch %lld/%lld ", (long long)e->epoch + 1, (long long)e->epochs);
    snprintf(right, sizeof right, " %lld/%lld loss %.4f lr %.4g %.0f img/s ETA %d:%02d:%02d",
             (long long)e->step, (long long)e->steps, e->loss, e->lr, e->images_per_sec, eh, em,
             es);
    int room = c->width - 1 - (int)strlen(left) - (int)strlen(right) - 2;
    char bar[256];
    if (room > 200) room = 200;
    if (room < 10) room = 0;
    int fill = e->steps > 0 ? (int)((double)room * (double)e->step / (double)e->steps) : 0;
    for (int i = 0; i < room; i++) bar[i] = i < fill ? '=' : i == fill ? '>' : ' ';
    bar[room] = 0;
    fprintf(c->out, "\r%s%s%s%s%s\033[K", left, room ? "[" : "", bar, room ? "]" : "", right);
    fflush(c->out);
    c->bar_drawn = true;
}

void kpl__console_log(void *ctx, const kpl_log_event *e)
{
    kpl__console *c = ctx;
    switch (e->kind) {
    case KPL_LOG_WARN:
    case KPL_LOG_ERROR:
        clear_bar(c);
        fflush(c->out);
        fprintf(stderr, "kpl[%d]: %s%s\n", (int)e->rank,
                e->kind == KPL_LOG_WARN ? "warning: " : "error: ", e->text);
        return;
    case KPL_LOG_PROGRESS:
        if (e->rank == 0 && c->bar) draw(c, e);
        return;
    case KPL_LOG_REPORT:
        if (c->bar) return; /* the bar says it */
        /* fall through */
    case KPL_LOG_INFO:
    case KPL_LOG_RESULT:
        /* every rank says where its step profile went: kplrun merges them */
        if (e->rank != 0 && (e->kind != KPL_LOG_INFO || strncmp(e->text, "profile: steps ", 15)))
            return;
        clear_bar(c);
        fprintf(c->out, "%s\n", e->text);
        fflush(c->out);
        return;
    }
}
