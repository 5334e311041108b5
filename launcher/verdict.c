/*
 * verdict.c — what a rank's own words say about a failure, for kplrun's
 * verdict.  A rank that times out in a collective is seldom the culprit:
 * its communicator's report (collective.h) names the ranks that have not
 * joined, and kplrun reads it to name them.
 */
#include "launcher.h"

#include <ctype.h>
#include <signal.h>
#include <sys/wait.h>
#include <stdio.h>
#include <string.h>

/* The operation before `end`: the last "<collective> #<number>" in
 * [line, end), into op. */
static bool find_op(const char *line, const char *end, char *op, size_t len)
{
    static const char *const kinds[] = {"allreduce #", "broadcast #", "allgather #",
                                        "reduce_scatter #", "barrier #", NULL};
    const char *best = NULL;
    size_t best_len = 0;
    for (int i = 0; kinds[i]; i++) {
        size_t kl = strlen(kinds[i]);
        for (const char *p = line; (p = strstr(p, kinds[i])) && p < end; p += kl) {
            /* a whole word: "allreduce #" inside "xallreduce #" is not it */
            bool word = p == line || !(isalnum((unsigned char)p[-1]) || p[-1] == '_');
            if (word && isdigit((unsigned char)p[kl]) && (!best || p > best)) best = p, best_len = kl;
        }
    }
    if (!best) return false;
    size_t n = best_len;
    while (best + n < end && isdigit((unsigned char)best[n])) n++;
    if (n >= len) return false;
    memcpy(op, best, n);
    op[n] = 0;
    return true;
}

/* Appends the ranks an entry of the not-joined list names ("rank 3 is
 * idle, ...", "ranks 1-2: no answer ...") to out->ranks.  False when the
 * entry does not start with a rank. */
static bool add_entry(kpl_launch_stall *out, const char *e, const char *end, int *count)
{
    const char *p;
    size_t n;
    if (end - e > 6 && !strncmp(e, "ranks ", 6)) { /* "ranks 1-2, 5: ..." */
        p = e + 6;
        n = 0;
        while (p + n < end && (isdigit((unsigned char)p[n]) || p[n] == '-' || p[n] == ',' ||
                               p[n] == ' '))
            n++;
        while (n && p[n - 1] == ' ') n--;
        if (!n || !isdigit((unsigned char)p[0])) return false;
        *count += 2; /* two at least */
    } else if (end - e > 5 && !strncmp(e, "rank ", 5)) { /* "rank 3 ..." or "rank 3: ..." */
        p = e + 5;
        n = 0;
        while (p + n < end && isdigit((unsigned char)p[n])) n++;
        if (!n) return false;
        *count += 1;
    } else {
        return false;
    }
    /* a rank number is below 2^30 (kplrun's -np is far smaller): a longer
     * one is no rank, and the line no report */
    long v = 0;
    for (size_t i = 0; i < n && isdigit((unsigned char)p[i]) && v < 1L << 30; i++)
        v = v * 10 + (p[i] - '0');
    if (v >= 1L << 30) return false;
    if (out->first < 0) out->first = (int)v;
    size_t used = strlen(out->ranks);
    if (used + n + 3 >= sizeof out->ranks) return true; /* the first ranks say enough */
    snprintf(out->ranks + used, sizeof out->ranks - used, "%s%.*s", used ? ", " : "", (int)n, p);
    return true;
}

bool kpl_launch_parse_timeout(const char *line, kpl_launch_stall *out)
{
    if (!line || !out) return false;
    memset(out, 0, sizeof *out);
    out->first = -1;
    const char *to = strstr(line, ": timed out after ");
    if (!to || !find_op(line, to, out->op, sizeof out->op)) return false;
    /* Host collectives: "; not joined: ENTRY; ENTRY; joined: ...".  Device
     * collectives: "; not issued yet by RANKS; ..." (then perhaps "; not
     * answering: ENTRY"). */
    const char *seg = strstr(to, "; not joined: "), *end;
    bool issued = false;
    if (seg) {
        seg += strlen("; not joined: ");
        end = strstr(seg, "; joined: ");
        const char *steps = strstr(seg, "; the ranks are out of step");
        if (!end || (steps && steps < end)) end = steps;
        if (!end) end = seg + strlen(seg);
    } else if ((seg = strstr(to, "; not issued yet by "))) {
        seg += strlen("; not issued yet by ");
        end = strchr(seg, ';');
        if (!end) end = seg + strlen(seg);
        issued = true;
    } else {
        return false;
    }
    int count = 0;
    if (issued) {
        char e[300];
        snprintf(e, sizeof e, "%.*s", (int)(end - seg < 290 ? end - seg : 290), seg);
        if (!add_entry(out, e, e + strlen(e), &count)) return false;
    } else {
        /* Entries are separated by "; " and each starts with its rank. */
        for (const char *e = seg; e < end;) {
            const char *next = e;
            for (;;) {
                const char *sc = strstr(next, "; ");
                if (!sc || sc >= end) {
                    next = end;
                    break;
                }
                if (!strncmp(sc + 2, "rank", 4)) {
                    next = sc;
                    break;
                }
                next = sc + 2;
            }
            if (!add_entry(out, e, next, &count)) return false; /* "none", or not a report */
            e = next < end ? next + 2 : end;
        }
    }
    if (!count) return false;
    out->plural = count > 1;
    size_t dn = (size_t)(end - seg);
    if (dn >= sizeof out->detail) dn = sizeof out->detail - 1;
    memcpy(out->detail, seg, dn);
    out->detail[dn] = 0;
    out->device = issued;
    return true;
}

/* ---- the verdict -------------------------------------------------------------------------- */

void kpl_launch_judge(const kpl_launch_end *ends, int np, int mp_rank, int mp_status,
                      int mp_sig, int mpirun_wstatus, bool timed_out, int interrupts,
                      int stop_sig, bool killed, kpl_launch_verdict *v)
{
    memset(v, 0, sizeof *v);
    v->rank = -1;
    int bad = -1, torn = -1;
    for (int r = 0; r < np; r++) {
        const kpl_launch_end *e = &ends[r];
        v->missing += !e->seen;
        if (!e->seen || (!e->status && !e->sig)) continue;
        int *slot = e->sig == SIGTERM || e->status == 128 + SIGTERM ? &torn : &bad;
        if (*slot < 0 || e->at < ends[*slot].at) *slot = r;
    }
    if (bad < 0 && mp_rank < 0) bad = torn;
    int rc = WIFEXITED(mpirun_wstatus) ? WEXITSTATUS(mpirun_wstatus)
                                       : 128 + WTERMSIG(mpirun_wstatus);
    bool stopped = np > 0 && !v->missing;
    for (int r = 0; stopped && r < np; r++)
        stopped = !ends[r].sig && (ends[r].status == 128 + SIGINT || ends[r].status == 128 + SIGTERM) &&
                  ends[r].status == ends[0].status;
    /* after a hard stop, ranks that ended by the stop's signals (or said
     * nothing) were ended by kplrun; a rank that failed otherwise is still
     * the one to name */
    bool by_stop = true;
    for (int r = 0; r < np; r++) {
        const kpl_launch_end *e = &ends[r];
        if (e->seen && (e->status || e->sig) && e->status != 128 + SIGINT &&
            e->status != 128 + SIGTERM && e->sig != SIGINT && e->sig != SIGTERM && e->sig != SIGKILL)
            by_stop = false;
    }
    if (timed_out) {
        v->kind = KPL_VERDICT_TIMEOUT;
        v->exit_code = 124;
    } else if (stopped) {
        v->kind = KPL_VERDICT_STOPPED;
        v->status = v->exit_code = ends[0].status;
        v->interrupted = interrupts > 0;
    } else if (stop_sig && by_stop && (killed || rc != 0 || v->missing)) {
        v->kind = KPL_VERDICT_KILLED;
        v->sig = stop_sig;
        v->interrupted = true;
        v->hard = killed;
        v->exit_code = 128 + stop_sig;
    } else if (bad >= 0 || mp_rank >= 0) {
        v->kind = KPL_VERDICT_RANK;
        v->from_mpirun = bad < 0;
        v->rank = bad >= 0 ? bad : mp_rank;
        v->sig = bad >= 0 ? ends[bad].sig : mp_sig;
        v->status = bad >= 0 ? ends[bad].status : mp_status;
        v->interrupted = interrupts && (v->status == 130 || v->status == 143 ||
                                        v->sig == SIGINT || v->sig == SIGTERM);
        v->exit_code = v->sig ? 128 + v->sig : v->status ? v->status : rc ? rc : 1;
    } else if (rc != 0) {
        v->kind = KPL_VERDICT_MPIRUN;
        v->exit_code = rc;
    } else if (v->missing) {
        v->kind = KPL_VERDICT_SILENT;
        v->exit_code = 1;
    } else {
        v->kind = KPL_VERDICT_OK;
    }
}
