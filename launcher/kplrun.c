/*
 * kplrun.c — kplrun, the launcher:
 *
 *   kplrun -np N [--hostfile F | --host h1:8,h2:8] [--timeout S] [--log-dir D]
 *          [--max-restarts N [--restart-backoff S]] [--dry-run] [--no-ucx]
 *          [--mca K V] [-x VAR] -- COMMAND ...
 *
 * It starts COMMAND as N ranks through Open MPI's mpirun (launcher.h says
 * which options and why), each wrapped by `kplrun --agent` (agent.c), and
 * then owns the console: the ranks' lines arrive prefixed "[rN]", rank 0's
 * progress bar stays on the last line of a terminal, and every rank's
 * output is also in LOG_DIR/rank-NNNNN.log.  When a rank fails, mpirun
 * stops the others; kplrun names the rank, host, status or signal and
 * shows the end of its log.  Ctrl-C and SIGTERM (a scheduler's stop) ask
 * every rank to stop: each rank's command gets the same signal (SIGINT or
 * SIGTERM), so a `kpl train` checkpoints at a step all ranks agree on and
 * exits 130 or 143.  A second signal, or --stop-timeout seconds without
 * the ranks ending, stops them hard.  --timeout asks the same way.
 *
 * --max-restarts N makes kplrun an elastic agent in torchrun's manner: when
 * a launch fails (a rank's non-zero exit or death, mpirun's failure; never
 * a stop or --timeout), kplrun tears it down as above, waits until nothing
 * of it runs on this node, waits --restart-backoff seconds and starts the
 * whole job again, up to N times.  Every launch's ranks learn which one
 * they are (KPL_RESTART_COUNT, KPL_MAX_RESTARTS, KPL_RESTART_REASON) and
 * the job's name (KPL_JOB_ID, the same for every launch), so that a
 * restarted `kpl train` continues its own run from its newest checkpoint.
 */
#define _GNU_SOURCE
#include "launcher_impl.h"

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <glob.h>
#include <ifaddrs.h>
#include <limits.h>
#include <net/if.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/prctl.h>
#include <sys/random.h>
#include <sys/resource.h>
#include <sys/signalfd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define TAIL 20 /* lines of a rank kept for the failure report */

static void usage(FILE *f)
{
    fprintf(f,
            "usage: kplrun -np N [options] -- COMMAND [ARGS...]\n"
            "\n"
            "Runs COMMAND as N ranks through Open MPI's mpirun: per-rank environment\n"
            "(KPL_RANK, KPL_WORLD_SIZE, KPL_LOCAL_RANK, KPL_LOCAL_SIZE, KPL_DEVICE),\n"
            "one rank per GPU bound to the GPU's NUMA node, or ranks bound to cores\n"
            "with OMP_NUM_THREADS = cores per rank; per-rank logs and one console\n"
            "with [rN] prefixes.  If a rank fails, all stop and kplrun says which and why.\n"
            "\n"
            "  -np N, -n N        ranks (default: SLURM_NTASKS, or the hosts' slots)\n"
            "  --host LIST        h1:8,h2:8 (host:slots) or h1,h2\n"
            "  --hostfile F       Open MPI hostfile ('host slots=8') or one name per slot\n"
            "                     (without either: a SLURM allocation, PBS_NODEFILE, or this machine)\n"
            "  --timeout S        stop the job after S seconds (exit status 124)\n"
            "  --stop-timeout S   how long a stop (Ctrl-C, SIGTERM, --timeout) waits for\n"
            "                     the ranks to checkpoint and end before killing them\n"
            "                     (default 60)\n"
            "  --log-dir D        per-rank logs (default kplrun-logs/<time>)\n"
            "  --max-restarts N   when a rank fails, stop the job and start it again, up to\n"
            "                     N times (default 0); a restarted kpl train resumes from\n"
            "                     its run's newest checkpoint\n"
            "  --restart-backoff S  seconds between a failed launch's end and the next\n"
            "                     (default 3)\n"
            "  --dry-run          print the mpirun command and exit\n"
            "  --no-ucx           keep Open MPI's default point-to-point layer\n"
            "  --mca K V, -x VAR  passed to mpirun\n"
            "\n"
            "Ctrl-C (SIGINT) and SIGTERM ask the ranks to stop: each rank gets the same\n"
            "signal, and kpl train checkpoints and exits 130 / 143; a second signal kills\n"
            "them.  A stop or --timeout (counted from the first launch) is never restarted,\n"
            "and one during a restart's back-off ends kplrun.  Each rank gets KPL_JOB_ID\n"
            "(the same for every launch), KPL_RESTART_COUNT (0 on the first launch),\n"
            "KPL_MAX_RESTARTS and, when restarted, KPL_RESTART_REASON.\n"
            "Exit status: 0; the failed rank's status (128 + signal when it was killed;\n"
            "also when restarts are exhausted); 130 / 143 after a stop; 124 after\n"
            "--timeout; 2 for bad usage.\n");
}

/* ---- the console -------------------------------------------------------------------------- */

typedef struct {
    char *line[TAIL];
    size_t cap[TAIL]; /* slots are reused, grown when a line is longer */
    int n, next;
} tail_ring;

typedef kpl_launch_end rank_end; /* one rank's end, from its agent */

typedef struct {
    int np;
    tail_ring *tail;
    rank_end *end;
    /* per rank: the first collective it timed out in, and whom it waited
     * for (its communicator's report); stuck[r] tells whether there is one */
    kpl_launch_stall *stall;
    bool *stuck;
    bool tty;
    char bar[1024];     /* rank 0's latest progress-bar frame */
    /* Two states, not one: whether a frame is on the terminal's last line
     * (so a line must wipe it first), and whether that frame is the latest
     * (settle redraws it otherwise).  A new frame arriving changes only the
     * second: the old one is still on the screen until it is overwritten. */
    bool bar_shown, bar_stale;
    int columns;
    /* mpirun's own boxed messages are held until they end: the ones about
     * a failed rank say what kplrun says better, the rest pass through */
    char box[8192];
    size_t box_len;
    bool in_box;
    /* what mpirun's messages said, when no agent could (a killed agent) */
    int mp_rank, mp_status, mp_sig, mp_pid;
    char mp_host[256];
    /* a host whose Open MPI daemon mpirun lost (a link or node down) */
    char lost_host[256];
    /* mpirun saw a daemon's launcher (ssh, or the daemon itself) exit
     * after the ranks ran, without saying where (lost_host_of says) */
    bool daemon_failed;
    /* per rank: the step profile it wrote ("profile: steps A-B written to
     * PATH", kpl train's profile.steps), NULL: none; merged at the end */
    char **trace;
    /* how far the job got, as its lines said (note_progress), for a restart */
    char progress[96];
    long long ckpt_step; /* -1: no checkpoint seen */
} console;

static void tail_add(tail_ring *t, const char *line)
{
    size_t len = strlen(line) + 1;
    int k = t->next;
    if (len > t->cap[k]) {
        char *p = realloc(t->line[k], len);
        if (!p) return;
        t->line[k] = p;
        t->cap[k] = len;
    }
    memcpy(t->line[k], line, len);
    t->next = (t->next + 1) % TAIL;
    if (t->n < TAIL) t->n++;
}

static void bar_clear(console *c)
{
    if (!c->bar_shown) return;
    fputs("\r\033[K", stdout);
    c->bar_shown = false;
}

static void bar_draw(console *c)
{
    c->bar_stale = false;
    if (!c->tty || !c->bar[0]) return;
    printf("\r%.*s\033[K", c->columns > 1 ? c->columns - 1 : 79, c->bar);
    c->bar_shown = true;
}

/* After a batch of lines: the bar (its latest frame) back under them, all
 * of it out. */
static void settle(console *c)
{
    if (!c->bar_shown || c->bar_stale) bar_draw(c);
    fflush(stdout);
}

/* Text for the terminal: the bar steps aside (settle brings it back). */
static void print_text(console *c, FILE *f, const char *text, const char *end)
{
    bar_clear(c);
    if (f == stderr) fflush(stdout); /* in order with what stdout holds */
    fputs(text, f);
    fputs(end, f);
}

static void print_line(console *c, FILE *f, const char *line) { print_text(c, f, line, "\n"); }

static int line_rank(const char *line)
{
    int r = -1, n = 0;
    if (sscanf(line, "[r%d]%n", &r, &n) == 1 && n > 0) return r;
    return -1;
}

/* Whether any rank's line reached the console (it ran). */
static bool any_rank_spoke(const console *c)
{
    for (int r = 0; r < c->np; r++)
        if (c->tail[r].n) return true;
    return false;
}

/* What an mpirun box says about a failed rank. */
static bool box_about_failure(console *c, const char *box)
{
    const char *keys[] = {"Primary job  terminated normally", "exited with non-zero status",
                          "mpirun noticed that process rank", "MPI_ABORT was invoked",
                          "were killed by signal", NULL};
    bool known = false;
    for (int i = 0; keys[i]; i++) known |= strstr(box, keys[i]) != NULL;
    const char *p;
    int r, pid, sig;
    char host[256];
    if ((p = strstr(box, "mpirun noticed that process rank ")) &&
        sscanf(p, "mpirun noticed that process rank %d with PID %d on node %255s exited on signal %d",
               &r, &pid, host, &sig) == 4) {
        c->mp_rank = r, c->mp_pid = pid, c->mp_sig = sig;
        snprintf(c->mp_host, sizeof c->mp_host, "%s", host);
    }
    int a, b, code;
    /* "ORTE has lost communication with a remote daemon. ... Remote daemon:
     * [[58768,0],1] on node 10.59.220.2": its ranks cannot say how they
     * ended; kplrun says which host went (say_verdict) */
    if (strstr(box, "lost communication with a remote daemon") &&
        (p = strstr(box, "Remote daemon:")) && (p = strstr(p, " on node ")) &&
        sscanf(p, " on node %255s", host) == 1) {
        snprintf(c->lost_host, sizeof c->lost_host, "%s", host);
        known = true;
    }
    /* A daemon's launcher ended with an error: ssh when its connection
     * dropped, or the daemon itself where the launcher execs it (the
     * "ssh" of bench/cluster.sh).  Before any rank ran, that is a failed
     * start and the box says why; after, the daemon's host is gone as
     * surely as above, only mpirun does not say which (lost_host_of). */
    if ((strstr(box, "unable to reliably start one or more daemons") ||
         strstr(box, "daemon has unexpectedly failed after launch")) &&
        any_rank_spoke(c)) {
        c->daemon_failed = true;
        known = true;
    }
    if ((p = strstr(box, "Process name: [[")) && sscanf(p, "Process name: [[%d,%d],%d]", &a, &b, &r) == 3) {
        const char *q = strstr(p, "Exit code:");
        if (q && sscanf(q, "Exit code: %d", &code) == 1 && c->mp_rank < 0)
            c->mp_rank = r, c->mp_status = code;
    }
    return known;
}

/* One line of mpirun's stderr that is not a rank's. */
static void mpirun_line(console *c, const char *line)
{
    bool rule = !strncmp(line, "------------", 12);
    if (rule || c->in_box) {
        size_t l = strlen(line);
        if (c->box_len + l + 2 < sizeof c->box) {
            memcpy(c->box + c->box_len, line, l);
            c->box_len += l;
            c->box[c->box_len++] = '\n';
            c->box[c->box_len] = 0;
        }
        if (rule && c->in_box) { /* the box ends */
            c->in_box = false;
            if (!box_about_failure(c, c->box)) print_text(c, stderr, c->box, "");
            c->box_len = 0;
        } else if (rule) {
            c->in_box = true;
        }
        return;
    }
    if (strstr(line, "more process has sent help message") ||
        strstr(line, "more processes have sent help message") ||
        strstr(line, "orte_base_help_aggregate") || strstr(line, "Forwarding signal"))
        return;
    print_line(c, stderr, line);
}

/* The end of rank r's output, for the verdict. */
static void show_tail(const console *c, const char *dir, int r)
{
    const tail_ring *t = &c->tail[r];
    if (!t->n) return;
    fprintf(stderr, "kplrun: the last lines of rank %d (%s/rank-%05d.log):\n", r, dir, r);
    for (int i = 0; i < t->n; i++) fprintf(stderr, "  %s\n", t->line[(t->next - t->n + i + TAIL) % TAIL]);
}

/* How far the job got, from a rank's line or bar frame (text, without
 * its "[rN] "), when it is one of kpl train's: a report ("epoch 2/5 step
 * 13/469 loss ...") or a bar frame ("epoch 2/5 [==>  ] 13/469 loss ..."),
 * a checkpoint written ("checkpoint DIR/ckpt-0000000010.kpl (...)") or
 * resumed from ("resumed from DIR/ckpt-0000000010.kpl at step 10 ...").
 * A restart's reason says what kplrun saw; other commands' lines leave
 * both unset. */
static void note_progress(console *c, const char *text)
{
    long long e, en, s, sn;
    int n = 0;
    if (sscanf(text, "epoch %lld/%lld %n", &e, &en, &n) == 2 && n > 0) {
        const char *p = text + n;
        if (!strncmp(p, "step ", 5)) p += 5;
        else if (*p == '[' && (p = strchr(p, ']'))) p++;
        if (p && sscanf(p, " %lld/%lld", &s, &sn) == 2)
            snprintf(c->progress, sizeof c->progress, "epoch %lld/%lld step %lld/%lld", e, en, s, sn);
        return;
    }
    const char *k = strstr(text, "/ckpt-");
    if (!k) return;
    if (!strncmp(text, "checkpoint ", 11) && sscanf(k, "/ckpt-%lld.kpl", &s) == 1)
        c->ckpt_step = s;
    else if (!strncmp(text, "resumed from ", 13) && (k = strstr(k, " at step ")) &&
             sscanf(k, " at step %lld", &s) == 1 && s > c->ckpt_step)
        c->ckpt_step = s;
}

/* A rank's "profile: steps A-B written to PATH" (the last one counts). */
static void note_trace(console *c, int r, const char *text)
{
    const char *p = strstr(text, "profile: steps ");
    long long a, b;
    int n = 0;
    if (!p || !c->trace || sscanf(p, "profile: steps %lld-%lld written to %n", &a, &b, &n) != 2 ||
        n == 0 || p[n] != '/')
        return;
    free(c->trace[r]);
    c->trace[r] = strdup(p + n);
}

/* Merges the ranks' step profiles into DIR/profile.trace.json, one track
 * per rank (each rank's events carry its rank as pid).  The files have a
 * fixed layout (trainer/run/profile.c): a header line, one event per line
 * ending with ',' but the last, and a closing "]}" line; so the merge is
 * textual.  A file kplrun cannot read (another host's disk, without a
 * shared file system) is named and left out. */
static void merge_traces(const console *c, const char *dir)
{
    int have = 0;
    for (int r = 0; c->trace && r < c->np; r++) have += c->trace[r] != NULL;
    if (!have) return;
    char path[PATH_MAX];
    if (snprintf(path, sizeof path, "%s/profile.trace.json", dir) >= (int)sizeof path) return;
    kpl__afile af;
    if (kpl__afile_open(&af, path) < 0) {
        fprintf(stderr, "kplrun: %s\n", kpl_last_error());
        return;
    }
    FILE *out = af.f;
    fputs("{\"displayTimeUnit\":\"ms\",\"traceEvents\":[\n", out);
    char *line = NULL, *pend = NULL; /* the previous event line, held for its comma */
    size_t cap = 0;
    int merged = 0;
    for (int r = 0; r < c->np; r++) {
        if (!c->trace[r]) continue;
        FILE *f = fopen(c->trace[r], "r");
        if (!f) {
            fprintf(stderr, "kplrun: the profile of rank %d (%s) cannot be read here: %s\n", r,
                    c->trace[r], strerror(errno));
            continue;
        }
        ssize_t len;
        int k = 0;
        while ((len = getline(&line, &cap, f)) > 0) {
            if (k++ == 0 || !strncmp(line, "]}", 2)) continue; /* header, footer */
            while (len > 0 && (line[len - 1] == '\n' || line[len - 1] == ',')) line[--len] = 0;
            if (!len) continue;
            if (pend) fprintf(out, "%s,\n", pend);
            free(pend);
            pend = strdup(line);
        }
        fclose(f);
        merged++;
    }
    if (pend) fprintf(out, "%s\n", pend);
    fputs("]}\n", out);
    free(pend);
    free(line);
    if (kpl__afile_commit(&af) < 0) {
        fprintf(stderr, "kplrun: %s\n", kpl_last_error());
        return;
    }
    fprintf(stderr, "kplrun: the step profiles of %d rank%s merged into %s (Perfetto, "
            "chrome://tracing)\n", merged, merged == 1 ? "" : "s", path);
}

/* Lines from mpirun's stdout (out) or stderr. */
static void handle_line(console *c, char *line, bool out)
{
    if (out && line[0] == '\001') {
        int r, pid, status, sig, n = 0;
        double secs, ended = 0;
        char host[256];
        if (sscanf(line, "\001bar %d %n", &r, &n) == 1 && n > 0) {
            if (r == 0) { /* a new frame is drawn by settle */
                snprintf(c->bar, sizeof c->bar, "%s", line + n);
                note_progress(c, line + n);
                c->bar_stale = c->bar[0] != 0;
                if (!c->bar[0]) bar_clear(c);
            }
        } else if (sscanf(line, "\001exit %d %255s %d %d %d %lf %lf", &r, host, &pid, &status,
                          &sig, &secs, &ended) >= 6 &&
                   r >= 0 && r < c->np) {
            rank_end *e = &c->end[r];
            e->seen = true;
            snprintf(e->host, sizeof e->host, "%s", host);
            /* when the rank ended by its agent's wall clock: the report of a
             * rank that died first may arrive last (its agent drains the
             * output a stray process holds; a torn-down rank's abort is
             * quicker to say) */
            e->pid = pid, e->status = status, e->sig = sig, e->seconds = secs;
            e->at = ended > 0 ? ended : kpl__wall_seconds();
            if (r == 0) c->bar[0] = 0, bar_clear(c);
        }
        return;
    }
    int r = line_rank(line);
    if (r >= 0 && r < c->np) {
        tail_add(&c->tail[r], line);
        const char *text = strchr(line, ']') + 1;
        note_progress(c, text + (*text == ' '));
        note_trace(c, r, text);
        if (!c->stuck[r]) c->stuck[r] = kpl_launch_parse_timeout(line, &c->stall[r]);
        print_line(c, out ? stdout : stderr, line);
    } else if (out) {
        print_line(c, stdout, line);
    } else {
        mpirun_line(c, line);
    }
}

/* Where a stream of lines comes from: mpirun's standard output or error,
 * or an agent's connection (each line tagged with its channel). */
typedef enum { FROM_MPIRUN_OUT, FROM_MPIRUN_ERR, FROM_AGENT } source;

#define LINE_MAX_BYTES 65536 /* longer lines are cut */

typedef struct {
    int fd;
    bool open;
    source from;
    char *buf; /* grows up to LINE_MAX_BYTES */
    size_t len, cap;
} reader;

/* An agent's line: "1" + a stdout line, "2" + a stderr line, or one of
 * kplrun's "\001" messages. */
static void dispatch(console *c, char *line, source from)
{
    if (from == FROM_MPIRUN_OUT) handle_line(c, line, true);
    else if (from == FROM_MPIRUN_ERR) handle_line(c, line, false);
    else if (line[0] == '\001') handle_line(c, line, true);
    else if (line[0] == '1' || line[0] == '2') handle_line(c, line + 1, line[0] == '1');
}

static void pump(console *c, reader *rd)
{
    if (rd->cap - rd->len < 4096 && rd->cap < LINE_MAX_BYTES) {
        size_t cap = rd->cap ? 2 * rd->cap : 16384;
        char *b = realloc(rd->buf, cap);
        if (b) rd->buf = b, rd->cap = cap;
    }
    ssize_t r = rd->cap > rd->len + 1 ? read(rd->fd, rd->buf + rd->len, rd->cap - 1 - rd->len) : 0;
    if (r < 0 && (errno == EINTR || errno == EAGAIN)) return;
    if (r <= 0) {
        if (rd->len) {
            rd->buf[rd->len] = 0;
            dispatch(c, rd->buf, rd->from);
            rd->len = 0;
        }
        rd->open = false;
        return;
    }
    rd->len += (size_t)r;
    char *start = rd->buf, *nl;
    while ((nl = memchr(start, '\n', rd->len - (size_t)(start - rd->buf)))) {
        *nl = 0;
        dispatch(c, start, rd->from);
        start = nl + 1;
    }
    rd->len -= (size_t)(start - rd->buf);
    memmove(rd->buf, start, rd->len);
    if (rd->len == rd->cap - 1 && rd->cap >= LINE_MAX_BYTES) {
        rd->buf[rd->len] = 0;
        dispatch(c, rd->buf, rd->from);
        rd->len = 0;
    }
}

/* ---- the agents' channel ------------------------------------------------------------------ */

/* The agents send their lines to kplrun over TCP, not through mpirun's
 * output forwarding: Open MPI passes each rank's output on in chunks of up
 * to 4 KB, so under load a line of one rank can be cut by another's (and
 * kplrun's own messages with it).  kplrun listens on every IPv4 address of
 * this host; the agent gets "ADDR,ADDR,...:PORT:TOKEN" (loopback last)
 * and keeps the first connection that greets it with "kplrun TOKEN". */
static int channel_listen(char *spec, size_t len, char *token, size_t tlen)
{
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    if (fd < 0) return -1;
    struct sockaddr_in a;
    memset(&a, 0, sizeof a);
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_ANY);
    socklen_t al = sizeof a;
    struct ifaddrs *ifa = NULL;
    if (bind(fd, (struct sockaddr *)&a, sizeof a) != 0 || listen(fd, 4096) != 0 ||
        getsockname(fd, (struct sockaddr *)&a, &al) != 0 || getifaddrs(&ifa) != 0) {
        close(fd);
        return -1;
    }
    size_t at = 0;
    for (int loop = 0; loop < 2; loop++)
        for (struct ifaddrs *i = ifa; i; i = i->ifa_next) {
            if (!i->ifa_addr || i->ifa_addr->sa_family != AF_INET || !(i->ifa_flags & IFF_UP) ||
                ((i->ifa_flags & IFF_LOOPBACK) != 0) != (loop == 1))
                continue;
            char ip[INET_ADDRSTRLEN];
            inet_ntop(AF_INET, &((struct sockaddr_in *)i->ifa_addr)->sin_addr, ip, sizeof ip);
            if (at + sizeof ip + 2 < len) at += (size_t)snprintf(spec + at, len - at, "%s%s", at ? "," : "", ip);
        }
    freeifaddrs(ifa);
    unsigned long long t = 0;
    if (getrandom(&t, sizeof t, 0) != (ssize_t)sizeof t) t = (unsigned long long)getpid() * 2654435761u ^ (unsigned long long)time(NULL);
    snprintf(token, tlen, "%016llx", t);
    snprintf(spec + at, len - at, ":%d:%s", ntohs(a.sin_port), token);
    return fd;
}

/* ---- start-up ----------------------------------------------------------------------------- */

/* Whether Open MPI has its UCX point-to-point component.  Where its
 * components are files beside mpirun's installation (Debian's
 * lib/<arch>/openmpi/lib/openmpi3, a source build's lib/openmpi), the
 * file answers at once; else ompi_info is asked (about 0.2 s). */
static bool ucx_available(const char *mpirun)
{
    char real[PATH_MAX] = "";
    const char *path = getenv("PATH");
    for (const char *p = path ? path : ""; *p && !real[0];) {
        size_t n = strcspn(p, ":");
        char cand[PATH_MAX];
        snprintf(cand, sizeof cand, "%.*s/%s", (int)n, p, mpirun);
        if (access(cand, X_OK) != 0 || !realpath(cand, real)) real[0] = 0;
        p += n + (p[n] == ':');
    }
    char *slash = strrchr(real, '/'); /* PREFIX/bin/orterun -> PREFIX */
    if (slash) *slash = 0;
    slash = strrchr(real, '/');
    if (slash) {
        *slash = 0;
        static const char *const dirs[] = {"%s/lib/openmpi", "%s/lib64/openmpi",
                                           "%s/lib/*/openmpi/lib/openmpi*", NULL};
        for (int i = 0; dirs[i]; i++) {
            char pat[PATH_MAX + 64];
            snprintf(pat, sizeof pat, dirs[i], real);
            strcat(pat, "/mca_pml_ob1.so");
            glob_t g;
            if (glob(pat, 0, NULL, &g) != 0) continue;
            char ucx[PATH_MAX + 32];
            snprintf(ucx, sizeof ucx, "%s", g.gl_pathv[0]);
            globfree(&g);
            strcpy(strrchr(ucx, '/'), "/mca_pml_ucx.so");
            return access(ucx, R_OK) == 0;
        }
    }
    FILE *p = popen("ompi_info --parsable 2>/dev/null", "r");
    if (!p) return false;
    char line[1024];
    bool yes = false;
    while (fgets(line, sizeof line, p))
        if (!strncmp(line, "mca:pml:ucx:", 12)) yes = true;
    pclose(p);
    return yes;
}

static int die_usage(const char *fmt, const char *arg)
{
    fprintf(stderr, "kplrun: ");
    fprintf(stderr, fmt, arg);
    fprintf(stderr, " (try 'kplrun --help')\n");
    return 2;
}

static bool parse_pos(const char *s, long max, long *v)
{
    char *end;
    errno = 0;
    *v = strtol(s, &end, 10);
    return !errno && end != s && !*end && *v >= 1 && *v <= max;
}

/* A whole number from 0 to max, digits only ("+1", " 1", "1.0" are not). */
static bool parse_count(const char *s, long max, long *v)
{
    if (!*s || strspn(s, "0123456789") != strlen(s)) return false;
    errno = 0;
    *v = strtol(s, NULL, 10);
    return !errno && *v <= max;
}

#define MAX_RESTARTS 10000
#define STR_(x) #x
#define STR(x) STR_(x)

/* kplrun proper; `extra` (argc slots) and `hosts` are main's to free. */
/* ---- kplrun: parse -> hosts -> launch -> spawn -> event loop -> verdict -------------------- */

typedef struct {
    long np;
    double timeout, stop_timeout;
    long max_restarts;      /* --max-restarts: 0, no restarts */
    double restart_backoff; /* seconds between a failed launch's end and the next */
    const char *host_spec, *hostfile, *log_dir;
    bool dry, no_ucx;
    int nextra, cmd; /* extra mpirun arguments; where the command starts */
} options;

/* The command line: -1 to go on, else the exit status. */
static int parse_args(int argc, char **argv, const char **extra, options *o)
{
    memset(o, 0, sizeof *o);
    o->stop_timeout = 60;
    o->restart_backoff = 3;
    o->no_ucx = getenv("KPL_NO_UCX") != NULL;
    o->cmd = -1;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        bool has = i + 1 < argc;
        if (!strcmp(a, "--")) {
            o->cmd = i + 1;
            break;
        } else if (!strcmp(a, "-h") || !strcmp(a, "--help")) {
            usage(stdout);
            return 0;
        } else if (!strcmp(a, "--version")) {
            printf("kplrun (kpl %s)\n", kpl_version());
            return 0;
        } else if ((!strcmp(a, "-np") || !strcmp(a, "-n")) && has) {
            if (!parse_pos(argv[++i], 1 << 20, &o->np)) return die_usage("-np wants a number >= 1, got '%s'", argv[i]);
        } else if (!strcmp(a, "--host") && has) {
            o->host_spec = argv[++i];
        } else if (!strcmp(a, "--hostfile") && has) {
            o->hostfile = argv[++i];
        } else if (!strcmp(a, "--timeout") && has) {
            char *end;
            o->timeout = strtod(argv[++i], &end);
            if (*end || !(o->timeout > 0)) return die_usage("--timeout wants seconds > 0, got '%s'", argv[i]);
        } else if (!strcmp(a, "--stop-timeout") && has) {
            char *end;
            o->stop_timeout = strtod(argv[++i], &end);
            if (*end || !(o->stop_timeout > 0) || o->stop_timeout > 1e6)
                return die_usage("--stop-timeout wants seconds > 0, got '%s'", argv[i]);
        } else if (!strcmp(a, "--log-dir") && has) {
            o->log_dir = argv[++i];
        } else if (!strcmp(a, "--max-restarts") && has) {
            if (!parse_count(argv[++i], MAX_RESTARTS, &o->max_restarts))
                return die_usage("--max-restarts wants a number from 0 to " STR(MAX_RESTARTS)
                                 ", got '%s'", argv[i]);
        } else if (!strcmp(a, "--restart-backoff") && has) {
            char *end;
            o->restart_backoff = strtod(argv[++i], &end);
            if (end == argv[i] || *end || !(o->restart_backoff >= 0) || o->restart_backoff > 1e6)
                return die_usage("--restart-backoff wants seconds >= 0, got '%s'", argv[i]);
        } else if (!strcmp(a, "--dry-run")) {
            o->dry = true;
        } else if (!strcmp(a, "--no-ucx")) {
            o->no_ucx = true;
        } else if (!strcmp(a, "--mca") && i + 2 < argc) {
            extra[o->nextra++] = a, extra[o->nextra++] = argv[++i], extra[o->nextra++] = argv[++i];
        } else if (!strcmp(a, "-x") && has) {
            extra[o->nextra++] = a, extra[o->nextra++] = argv[++i];
        } else {
            return die_usage("unknown option or missing value: '%s'", a);
        }
    }
    if (o->cmd < 0 || o->cmd >= argc) return die_usage("no command: put it after '--'%s", "");
    if (o->host_spec && o->hostfile) return die_usage("give --host or --hostfile, not both%s", "");
    return -1;
}

/* The hosts: given, or the allocation's, or this machine; and the rank
 * count.  -1 to go on, else the exit status. */
static int resolve_hosts(options *o, kpl_hostlist *hosts, const char **where)
{
    kpl_status st = KPL_OK;
    *where = "this machine";
    if (o->host_spec) {
        st = kpl_hosts_parse(o->host_spec, hosts);
        *where = "--host";
    } else if (o->hostfile) {
        st = kpl_hosts_read_file(o->hostfile, hosts);
        *where = o->hostfile;
    } else if (getenv("SLURM_JOB_NODELIST")) {
        const char *t = getenv("SLURM_NTASKS_PER_NODE");
        if (!t) t = getenv("SLURM_TASKS_PER_NODE");
        st = kpl_hosts_from_slurm(getenv("SLURM_JOB_NODELIST"), t, hosts);
        *where = "the SLURM allocation";
        if (!o->np && getenv("SLURM_NTASKS")) o->np = atol(getenv("SLURM_NTASKS"));
    } else if (getenv("PBS_NODEFILE")) {
        st = kpl_hosts_read_file(getenv("PBS_NODEFILE"), hosts);
        *where = "PBS_NODEFILE";
    }
    if (st < 0) {
        fprintf(stderr, "kplrun: %s\n", kpl_last_error());
        return 2;
    }
    if (!o->np && hosts->n) o->np = kpl_hosts_slots(hosts);
    if (!o->np) return die_usage("how many ranks? give -np N%s", "");
    return -1;
}

/* The log directory as an absolute path: agents on other nodes need not
 * start where kplrun did.  And the job's name for its ranks (KPL_JOB_ID):
 * kplrun's start and pid, "20261126-214550-4242", which names a `kpl
 * train`'s default run directory (runs/<name>-<job id>) the same for
 * every launch of the job, and differs between two jobs on one node. */
static void log_dir_of(const options *o, char *dir, size_t len, char *job_id, size_t jlen)
{
    char rel[PATH_MAX], cwd[PATH_MAX], when[32];
    time_t t = time(NULL);
    struct tm tm;
    localtime_r(&t, &tm);
    strftime(when, sizeof when, "%Y%m%d-%H%M%S", &tm);
    snprintf(job_id, jlen, "%s-%ld", when, (long)getpid());
    if (o->log_dir) snprintf(rel, sizeof rel, "%s", o->log_dir);
    else snprintf(rel, sizeof rel, "kplrun-logs/%s", when);
    if (rel[0] != '/' && getcwd(cwd, sizeof cwd)) snprintf(dir, len, "%s/%s", cwd, rel);
    else snprintf(dir, len, "%s", rel);
}

static void console_init(console *c, long np)
{
    memset(c, 0, sizeof *c);
    c->np = (int)np;
    c->mp_rank = -1;
    c->ckpt_step = -1;
    c->tty = isatty(STDOUT_FILENO);
    c->columns = 80;
    struct winsize ws;
    if (c->tty && ioctl(STDOUT_FILENO, TIOCGWINSZ, &ws) == 0 && ws.ws_col >= 20) c->columns = ws.ws_col;
}

static void console_free(console *c)
{
    for (int r = 0; c->tail && r < c->np; r++)
        for (int i = 0; i < TAIL; i++) free(c->tail[r].line[i]);
    free(c->tail);
    free(c->end);
    free(c->stall);
    free(c->stuck);
    for (int r = 0; c->trace && r < c->np; r++) free(c->trace[r]);
    free(c->trace);
}

/* Which launch of the job one is. */
typedef struct {
    const char *job_id;
    int k, n;           /* the k-th restart of at most n; k 0: the first launch */
    const char *reason; /* k >= 1: what failed the launch before */
} launch;

/* The mpirun command line of a launch, and the agents' channel (lfd,
 * token: each launch its own, so that no straggler of the one before
 * counts as an agent of this one) unless --dry-run.  -1 to go on (*mp
 * set), else the exit status. */
static int prepare_launch(const options *o, int argc, char **argv, const char **extra,
                          kpl_hostlist *hosts, const char *dir, const char *where,
                          const console *c, const launch *l, int *lfd, char *token, size_t tlen,
                          char ***mp)
{
    long cores = sysconf(_SC_NPROCESSORS_ONLN);
    char self[PATH_MAX];
    ssize_t sl = readlink("/proc/self/exe", self, sizeof self - 1);
    if (sl <= 0) snprintf(self, sizeof self, "%s", argv[0]);
    else self[sl] = 0;
    kpl_launch_config lc = KPL_LAUNCH_CONFIG_INIT;
    lc.np = (int)o->np;
    lc.hosts = hosts->n ? hosts : NULL;
    /* a host file (checked above) goes to mpirun as it is, with whatever
     * else it says (max_slots, ...) */
    lc.hostfile = o->hostfile                                           ? o->hostfile
                  : !o->host_spec && !getenv("SLURM_JOB_NODELIST") ? getenv("PBS_NODEFILE")
                                                                      : NULL;
    lc.cores_per_node = cores > 0 ? (int)cores : 1;
    lc.gpus_per_node = kpl__launcher_gpu_count();
    lc.as_root = geteuid() == 0;
    lc.ucx = !o->no_ucx && ucx_available(lc.mpirun);
    lc.agent = self;
    lc.log_dir = dir;
    lc.bar = c->tty;
    lc.columns = c->columns;
    /* the agents' channel (not for --dry-run: it is this run's port) */
    char channel[4096];
    *lfd = o->dry ? -1 : channel_listen(channel, sizeof channel, token, tlen);
    if (*lfd >= 0) lc.channel = channel;
    else if (!o->dry) fprintf(stderr, "kplrun: cannot listen for the ranks' output (%s); it comes "
                                      "through mpirun, where lines of different ranks may mix\n",
                              strerror(errno));
    /* a connection per rank */
    struct rlimit rl;
    if (getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur < rl.rlim_max) {
        rl.rlim_cur = rl.rlim_max;
        setrlimit(RLIMIT_NOFILE, &rl);
    }
    lc.nextra = o->nextra;
    lc.extra = extra;
    lc.job_id = l->job_id;
    lc.restart = l->k;
    lc.max_restarts = l->n;
    lc.restart_reason = l->reason;
    int per = 0, threads = 0;
    if (kpl_launch_mpirun_argv(&lc, argc - o->cmd, argv + o->cmd, mp, &per, &threads) < 0) {
        fprintf(stderr, "kplrun: %s\n", kpl_last_error());
        return 2;
    }
    char *line = kpl_launch_argv_string(*mp);
    if (o->dry) {
        printf("%s\n", line ? line : "");
        free(line);
        kpl_launch_free_argv(*mp);
        return 0;
    }
    if (getenv("KPLRUN_VERBOSE")) fprintf(stderr, "kplrun: %s\n", line);
    free(line);
    if (l->k > 0) return -1; /* said at the first launch */
    char place[PATH_MAX + 64];
    if (hosts->n) snprintf(place, sizeof place, "%d host%s from %s", hosts->n, hosts->n > 1 ? "s" : "", where);
    else snprintf(place, sizeof place, "%s", where);
    fprintf(stderr, "kplrun: %ld rank%s on %s (%d per node, %s, %d thread%s each%s); logs in %s\n",
            o->np, o->np > 1 ? "s" : "", place, per,
            lc.gpus_per_node ? "one per GPU"
            : per <= lc.cores_per_node ? "bound to cores"
                                       : "more than cores: not bound",
            threads, threads > 1 ? "s" : "",
            lc.ucx ? ", UCX" : "", dir);
    return -1;
}

/* mpirun, started (one launch of the job) */
typedef struct {
    pid_t pid;     /* mpirun, also its session's id */
    int sfd;       /* signalfd: SIGINT, SIGTERM, SIGHUP, SIGCHLD (for every launch) */
    sigset_t mask; /* those signals, blocked */
    int out, err;  /* mpirun's stdout and stderr */
    double t0;     /* this launch's start */
} job;

/* The signals kplrun handles, blocked into a signalfd once for all the
 * job's launches (and the back-off between them).  false after saying why. */
static bool catch_signals(job *j)
{
    /* A shell starts background jobs with SIGINT ignored, which would
     * throw a `kill -INT` away before signalfd saw it; a SIGHUP ignored
     * (nohup) stays ignored. */
    signal(SIGINT, SIG_DFL);
    sigemptyset(&j->mask);
    sigaddset(&j->mask, SIGINT);
    sigaddset(&j->mask, SIGTERM);
    if (signal(SIGHUP, SIG_IGN) != SIG_IGN) {
        signal(SIGHUP, SIG_DFL);
        sigaddset(&j->mask, SIGHUP);
    }
    sigaddset(&j->mask, SIGCHLD);
    sigprocmask(SIG_BLOCK, &j->mask, NULL);
    j->sfd = signalfd(-1, &j->mask, SFD_CLOEXEC | SFD_NONBLOCK);
    if (j->sfd < 0) fprintf(stderr, "kplrun: %s\n", strerror(errno));
    return j->sfd >= 0;
}

/* Starts mpirun in a session of its own, its output into two pipes.  -1
 * to go on, else the exit status (mp is freed either way). */
static int spawn(char **mp, job *j)
{
    sigset_t mask = j->mask;
    int po[2], pe[2];
    bool made = pipe2(po, O_CLOEXEC) == 0;
    if (!made || pipe2(pe, O_CLOEXEC) != 0) {
        fprintf(stderr, "kplrun: %s\n", strerror(errno));
        if (made) close(po[0]), close(po[1]);
        kpl_launch_free_argv(mp);
        return 1;
    }
    j->t0 = kpl_seconds();
    j->pid = fork();
    if (j->pid == 0) {
        /* mpirun in a session of its own: the terminal's Ctrl-C reaches
         * kplrun alone, which decides; mpirun goes when kplrun dies. */
        setsid();
        prctl(PR_SET_PDEATHSIG, SIGTERM);
        sigprocmask(SIG_UNBLOCK, &mask, NULL);
        dup2(po[1], STDOUT_FILENO);
        dup2(pe[1], STDERR_FILENO);
        execvp(mp[0], mp);
        fprintf(stderr, "kplrun: cannot run %s: %s (install openmpi-bin)\n", mp[0], strerror(errno));
        _exit(127);
    }
    kpl_launch_free_argv(mp);
    if (j->pid < 0) {
        fprintf(stderr, "kplrun: fork: %s\n", strerror(errno));
        return 1;
    }
    close(po[1]);
    close(pe[1]);
    j->out = po[0], j->err = pe[0];
    return -1;
}

/* What the event loop learned. */
typedef struct {
    int interrupts, wstatus;
    bool timed_out;
    int stop_sig; /* SIGINT or SIGTERM: the stop kplrun asked the ranks for, 0: none */
    bool killed;  /* then stopped them hard (a second signal, --stop-timeout) */
} outcome;

/* When the event loop acts on its own: the deadline of a stop the ranks
 * were asked for, and when a hard stop turns into SIGKILL. */
typedef struct {
    double stop_timeout;
    double stop_at; /* 0: no stop asked */
    double hard_at; /* 0: no hard stop under way */
    int pending;    /* a stop (SIGINT, SIGTERM) not handed to mpirun yet */
} deadlines;

/* Asks every rank to stop: mpirun forwards SIGUSR1 / SIGUSR2 to the
 * agents, which hand each rank's command SIGINT / SIGTERM.  Not before
 * the agents are up (hand_on): mpirun forwards a signal to the ranks it
 * has, and one that comes before its handler is set ends it. */
static void ask_stop(deadlines *d, outcome *out, int sig, double t)
{
    if (!out->stop_sig) out->stop_sig = sig;
    d->pending = sig;
    if (!d->stop_at) d->stop_at = t + d->stop_timeout;
}

/* A stop asked for, handed to mpirun once every agent has called in
 * (or, with no channel, some seconds after the start). */
static void hand_on(const job *j, deadlines *d, bool agents_up, double t)
{
    if (!d->pending || !(agents_up || t - j->t0 > 5)) return;
    kill(j->pid, d->pending == SIGINT ? SIGUSR1 : SIGUSR2);
    d->pending = 0;
}

/* Stops every rank now: mpirun's SIGTERM tears the job down (the agents
 * stop their commands' groups), SIGKILL of its session 5 s later. */
static void stop_hard(console *c, const job *j, deadlines *d, outcome *out, const char *why,
                      double t)
{
    out->killed = true;
    d->pending = 0;
    print_line(c, stderr, why);
    kill(j->pid, SIGTERM);
    if (!d->hard_at) d->hard_at = t + 5;
}

/* A signal kplrun received: the first SIGINT (Ctrl-C) or SIGTERM (a
 * scheduler's stop) is handed to every rank, which checkpoints and ends;
 * the next one (or a HUP) stops them hard. */
static void on_signal(console *c, const job *j, outcome *out, double t, deadlines *d)
{
    struct signalfd_siginfo si;
    while (read(j->sfd, &si, sizeof si) == (ssize_t)sizeof si) {
        if (si.ssi_signo == SIGCHLD) continue;
        out->interrupts++;
        bool first = out->interrupts == 1 && !d->stop_at;
        if (first && si.ssi_signo == SIGINT) {
            print_line(c, stderr, "kplrun: interrupt: asking every rank to stop "
                                  "(Ctrl-C again to kill them)");
            ask_stop(d, out, SIGINT, t);
        } else if (first && si.ssi_signo == SIGTERM) {
            char msg[160];
            snprintf(msg, sizeof msg, "kplrun: SIGTERM: asking every rank to checkpoint and stop "
                     "(killed after %g s, or at another signal)", d->stop_timeout);
            print_line(c, stderr, msg);
            ask_stop(d, out, SIGTERM, t);
        } else {
            stop_hard(c, j, d, out, "kplrun: stopping every rank", t);
        }
        break;
    }
}

/* A new agent connection, greeted with the channel's token. */
static void accept_agent(int lfd, const char *token, reader *conn, int *nconn, int *open_conns,
                         long np)
{
    int fd = accept4(lfd, NULL, NULL, SOCK_CLOEXEC);
    if (fd < 0) return;
    if (*nconn >= np) {
        close(fd);
        return;
    }
    char hello[64];
    int n = snprintf(hello, sizeof hello, "kplrun %s\n", token);
    if (write(fd, hello, (size_t)n) == n) {
        conn[(*nconn)++] = (reader){fd, true, FROM_AGENT, NULL, 0, 0};
        (*open_conns)++;
    } else {
        close(fd);
    }
}

/* Until mpirun has ended and every pipe and connection is drained: the
 * ranks' lines to the console, signals, --timeout (`timeout` seconds,
 * which end at `deadline`: the job's, counted from its first launch).
 * 1 when out of memory. */
static int event_loop(console *c, const job *j, int lfd, const char *token, double timeout,
                      double deadline, double stop_timeout, outcome *out)
{
    long np = c->np;
    reader ro = {j->out, true, FROM_MPIRUN_OUT, NULL, 0, 0};
    reader re = {j->err, true, FROM_MPIRUN_ERR, NULL, 0, 0};
    /* the agents' connections; poll: signals, mpirun's two pipes, the
     * listening socket, then the connections */
    reader *conn = calloc((size_t)np + 1, sizeof *conn);
    struct pollfd *p = calloc((size_t)np + 5, sizeof *p);
    int nconn = 0, open_conns = 0;
    if (!conn || !p) {
        fprintf(stderr, "kplrun: out of memory\n");
        kill(j->pid, SIGKILL);
        free(conn);
        free(p);
        return 1;
    }
    bool exited = false;
    deadlines d = {stop_timeout, 0, 0, 0};
    double drain_until = 0;
    while (!exited || ro.open || re.open || open_conns) {
        p[0] = (struct pollfd){j->sfd, POLLIN, 0};
        p[1] = (struct pollfd){ro.open ? ro.fd : -1, POLLIN, 0};
        p[2] = (struct pollfd){re.open ? re.fd : -1, POLLIN, 0};
        p[3] = (struct pollfd){nconn < np ? lfd : -1, POLLIN, 0};
        for (int i = 0; i < nconn; i++) p[4 + i] = (struct pollfd){conn[i].open ? conn[i].fd : -1, POLLIN, 0};
        int r = poll(p, (nfds_t)(4 + nconn), 100);
        if (r > 0 && (p[1].revents & (POLLIN | POLLHUP))) pump(c, &ro);
        if (r > 0 && (p[2].revents & (POLLIN | POLLHUP))) pump(c, &re);
        for (int i = 0; r > 0 && i < nconn; i++)
            if (p[4 + i].revents & (POLLIN | POLLHUP | POLLERR)) {
                pump(c, &conn[i]);
                if (!conn[i].open) close(conn[i].fd), free(conn[i].buf), conn[i].buf = NULL, open_conns--;
            }
        if (r > 0 && (p[3].revents & POLLIN)) accept_agent(lfd, token, conn, &nconn, &open_conns, np);
        settle(c);
        double t = kpl_seconds();
        if (r > 0 && (p[0].revents & POLLIN)) on_signal(c, j, out, t, &d);
        if (timeout > 0 && !out->timed_out && t > deadline) {
            out->timed_out = true;
            char msg[128];
            snprintf(msg, sizeof msg, "kplrun: --timeout %g s reached: stopping every rank",
                     timeout);
            print_line(c, stderr, msg);
            if (!d.stop_at) ask_stop(&d, out, SIGTERM, t);
        }
        hand_on(j, &d, lfd < 0 || nconn >= np, t);
        if (!exited && d.stop_at && !d.hard_at && t > d.stop_at) {
            char msg[128];
            snprintf(msg, sizeof msg, "kplrun: the ranks did not stop within %g s "
                     "(--stop-timeout): killing them", d.stop_timeout);
            stop_hard(c, j, &d, out, msg, t);
        }
        if (d.hard_at && t > d.hard_at) {
            kill(-j->pid, SIGKILL); /* mpirun's session: mpirun and the local ranks */
            d.hard_at = 0;
        }
        if (!exited && waitpid(j->pid, &out->wstatus, WNOHANG) == j->pid) {
            exited = true;
            /* what is still in the pipes comes out; the pipes of a rank
             * that outlives mpirun do not hold kplrun */
            drain_until = t + 2;
        }
        if (exited && t > drain_until) break;
    }
    if (d.hard_at) kill(-j->pid, SIGKILL); /* what a hard stop left of mpirun's session */
    bar_clear(c);
    fflush(stdout);
    for (int i = 0; i < nconn; i++)
        if (conn[i].open) close(conn[i].fd);
    for (int i = 0; i < nconn; i++) free(conn[i].buf);
    free(conn);
    free(p);
    free(ro.buf);
    free(re.buf);
    close(j->out);
    close(j->err);
    return 0;
}

/* The host of a failed daemon (console.daemon_failed) when mpirun did
 * not name it: the host whose ranks, every one of them, never said how
 * they ended (their agents could not reach kplrun), by the host list's
 * slots in order as mpirun maps them; several such hosts are named
 * together.  None: the ranks' own ends are the news. */
static void lost_host_of(console *c, const kpl_hostlist *hosts)
{
    if (!c->daemon_failed || c->lost_host[0] || !hosts) return;
    size_t len = 0;
    for (int i = 0, at = 0; i < hosts->n && at < c->np; i++) {
        int n = hosts->host[i].slots < c->np - at ? hosts->host[i].slots : c->np - at;
        bool silent = n > 0;
        for (int r = at; r < at + n; r++)
            silent &= !c->end[r].seen;
        at += n;
        if (!silent || len + strlen(hosts->host[i].name) + 5 >= sizeof c->lost_host) continue;
        len += (size_t)snprintf(c->lost_host + len, sizeof c->lost_host - len, "%s%s",
                                len ? " or " : "", hosts->host[i].name);
    }
}

/* The verdict (kpl_launch_judge) said in words, with the last lines of
 * the rank to blame (and of the rank it waited for, when it timed out in
 * a collective). */
/* A host lost mid-job (mpirun's notice): its ranks, by the host list's
 * slots in order as mpirun maps them (--map-by slot), or, when the host
 * is not in the list, the ranks that never said how they ended.  Said
 * instead of a verdict that would blame a rank mpirun tore down because
 * of it (or nobody). */
static bool say_lost_host(const console *c, const kpl_launch_verdict *v, const kpl_hostlist *hosts)
{
    if (!c->lost_host[0] || v->kind == KPL_VERDICT_TIMEOUT || v->kind == KPL_VERDICT_KILLED ||
        v->kind == KPL_VERDICT_STOPPED || v->kind == KPL_VERDICT_OK)
        return false;
    if (v->kind == KPL_VERDICT_RANK && !v->from_mpirun && v->sig != SIGTERM &&
        v->status != 128 + SIGTERM)
        return false; /* a rank failed on its own: that is the news */
    int lo = -1, hi = -1; /* its ranks [lo, hi) */
    for (int i = 0, at = 0; hosts && i < hosts->n && at < c->np; i++) {
        int n = hosts->host[i].slots < c->np - at ? hosts->host[i].slots : c->np - at;
        if (!strcmp(hosts->host[i].name, c->lost_host)) lo = at, hi = at + n;
        at += n;
    }
    char ranks[256] = "";
    size_t at = 0;
    int n = 0;
    for (int r = 0; r < c->np && at + 16 < sizeof ranks; r++)
        if (lo >= 0 ? r >= lo && r < hi : !c->end[r].seen)
            at += (size_t)snprintf(ranks + at, sizeof ranks - at, "%s%d", n++ ? ", " : "", r);
    fprintf(stderr, "kplrun: lost host %s: Open MPI's daemon there stopped answering (its network "
            "link or the node failed)%s%s%s; the other ranks were stopped\n", c->lost_host,
            !n ? "" : lo >= 0 ? "; its rank" : "; never heard from: rank", n > 1 ? "s " : n ? " " : "",
            n ? ranks : "");
    return true;
}

static void say_verdict(const console *c, const char *dir, const kpl_launch_verdict *v,
                        double timeout, double t0)
{
    switch (v->kind) {
    case KPL_VERDICT_OK: return;
    case KPL_VERDICT_TIMEOUT:
        fprintf(stderr, "kplrun: the job ran past --timeout %g s and was stopped (%.1f s)\n",
                timeout, kpl_seconds() - t0);
        return;
    case KPL_VERDICT_MPIRUN:
        fprintf(stderr, "kplrun: mpirun failed (exit status %d)%s\n", v->exit_code,
                v->missing == c->np && !any_rank_spoke(c) ? " before any rank ran" : "");
        return;
    case KPL_VERDICT_KILLED:
        if (v->hard)
            fprintf(stderr, "kplrun: stopped by %s: the ranks were killed before they ended on "
                    "their own\n", v->sig == SIGINT ? "SIGINT" : "SIGTERM");
        else if (!v->missing)
            fprintf(stderr, "kplrun: stopped by %s: every rank ended by it (some before they "
                    "could handle it: nothing to keep yet)\n", v->sig == SIGINT ? "SIGINT" : "SIGTERM");
        else
            fprintf(stderr, "kplrun: stopped by %s: it reached mpirun too, which ended before "
                    "%d of the %d ranks said how they ended (their logs in %s say)\n",
                    v->sig == SIGINT ? "SIGINT" : "SIGTERM", v->missing, c->np, dir);
        return;
    case KPL_VERDICT_SILENT:
        fprintf(stderr, "kplrun: %d rank%s ended without a word (killed with mpirun?)\n",
                v->missing, v->missing > 1 ? "s" : "");
        return;
    case KPL_VERDICT_STOPPED:
        fprintf(stderr, "kplrun: stopped by %s: all %d rank%s exited with status %d%s\n",
                v->status == 128 + SIGINT ? "SIGINT" : "SIGTERM", c->np, c->np > 1 ? "s" : "",
                v->status, v->interrupted ? "" : " (the signal reached a rank, not kplrun)");
        return;
    case KPL_VERDICT_RANK: break;
    }
    int r = v->rank;
    const rank_end *e = v->from_mpirun ? NULL : &c->end[r];
    const char *host = e ? e->host : c->mp_host[0] ? c->mp_host : "?";
    int rpid = e ? e->pid : c->mp_pid;
    char what[128];
    if (v->sig) snprintf(what, sizeof what, "was killed by signal %d (%s)", v->sig, strsignal(v->sig));
    else snprintf(what, sizeof what, "exited with status %d", v->status);
    char pidtxt[32] = "";
    if (rpid > 0) snprintf(pidtxt, sizeof pidtxt, " (pid %d)", rpid);
    if (v->interrupted)
        fprintf(stderr, "kplrun: interrupted; rank %d %s\n", r, what);
    else
        fprintf(stderr, "kplrun: rank %d on host %s%s %s after %.1f s; the other ranks "
                        "were stopped\n",
                r, host, pidtxt, what, e ? e->seconds : kpl_seconds() - t0);
    /* A rank that timed out in a collective failed because of the ranks
     * its report says have not joined: those are named, and the first
     * one's last lines shown before the failed rank's. */
    const kpl_launch_stall *st = !v->interrupted && r >= 0 && r < c->np && c->stuck[r] ? &c->stall[r]
                                                                                       : NULL;
    if (st) {
        fprintf(stderr, "kplrun: rank %d timed out waiting for rank%s %s, which ha%s not %s "
                        "%s; %s\n",
                r, st->plural ? "s" : "", st->ranks, st->plural ? "ve" : "s",
                st->device ? "issued" : "joined", st->op, st->detail);
        if (st->first >= 0 && st->first < c->np && st->first != r) show_tail(c, dir, st->first);
    }
    show_tail(c, dir, r);
}

/* ---- restarts ----------------------------------------------------------------------------- */

/* Whether a launch's end is a failure that a restart may mend: a rank's
 * failure, mpirun's, or ranks gone without a word, with no stop asked of
 * kplrun (SIGINT, SIGTERM, SIGHUP, --timeout).  A job all of whose ranks
 * stopped on one signal (KPL_VERDICT_STOPPED) was stopped, whoever sent
 * it: that is never restarted either. */
static bool restartable(const kpl_launch_verdict *v, const outcome *out)
{
    if (out->interrupts || out->timed_out || out->stop_sig) return false;
    return (v->kind == KPL_VERDICT_RANK && !v->interrupted) || v->kind == KPL_VERDICT_MPIRUN ||
           v->kind == KPL_VERDICT_SILENT;
}

/* What failed a launch, in one line for the console, the ranks' logs and
 * the next launch's KPL_RESTART_REASON: who, how, and how far the job got
 * as far as the console saw (note_progress):
 *   "rank 1 on host n7 was killed by signal 9 (Killed); the console last
 *    saw epoch 1/2 step 13/20 and a checkpoint of step 10" */
static void describe_failure(const console *c, const kpl_launch_verdict *v, char *out, size_t len)
{
    int at;
    if (c->lost_host[0]) { /* as say_lost_host said it */
        at = snprintf(out, len, "host %s was lost (Open MPI's daemon there stopped answering)",
                      c->lost_host);
    } else if (v->kind == KPL_VERDICT_RANK) {
        const char *host = !v->from_mpirun ? c->end[v->rank].host : c->mp_host[0] ? c->mp_host : "?";
        if (v->sig)
            at = snprintf(out, len, "rank %d on host %s was killed by signal %d (%s)", v->rank, host,
                          v->sig, strsignal(v->sig));
        else
            at = snprintf(out, len, "rank %d on host %s exited with status %d", v->rank, host,
                          v->status);
    } else if (v->kind == KPL_VERDICT_MPIRUN) {
        at = snprintf(out, len, "mpirun failed with exit status %d", v->exit_code);
    } else {
        at = snprintf(out, len, "%d rank%s ended without a word (killed with mpirun?)", v->missing,
                      v->missing > 1 ? "s" : "");
    }
    if (at < 0 || (size_t)at >= len) return;
    char ckpt[64] = "";
    if (c->ckpt_step >= 0) snprintf(ckpt, sizeof ckpt, "a checkpoint of step %lld", c->ckpt_step);
    if (c->progress[0])
        snprintf(out + at, len - (size_t)at, "; the console last saw %s%s%s", c->progress,
                 ckpt[0] ? " and " : ", no checkpoint", ckpt);
    else if (ckpt[0])
        snprintf(out + at, len - (size_t)at, "; the console last saw %s", ckpt);
    else
        snprintf(out + at, len - (size_t)at, "; the console saw no progress report");
}

static const char *signal_name(int sig)
{
    return sig == SIGINT ? "SIGINT" : sig == SIGTERM ? "SIGTERM" : sig == SIGHUP ? "SIGHUP" : "a signal";
}

/* Seconds a failed launch's processes on this node may take to end after
 * mpirun did (its agents' guards give their commands 10 s after SIGTERM),
 * and then after their SIGKILL. */
#define GONE_WITHIN 15
#define KILLED_WITHIN 5

/* Between a failed launch and the next one.  First, nothing of the failed
 * launch may still run on this node (a rank left over would hold its run
 * directory, its GPU, its cores): kplrun waits until mpirun's session is
 * empty, killing what is left after GONE_WITHIN s.  Then "restart k/N in
 * S s" and the back-off.  A stop (SIGINT, SIGTERM, SIGHUP) or the end of
 * --timeout meanwhile ends kplrun with its status, restarting nothing.
 * -1 to go on, else the exit status. */
static int between_launches(const job *j, const launch *next, double backoff, double timeout,
                            double deadline)
{
    double t0 = kpl_seconds(), go_at = 0;
    bool said = false, killed = false;
    for (;;) {
        double t = kpl_seconds();
        if (!go_at) {
            int left = kpl__launcher_procs(true, j->pid, 0);
            if (left && !killed && t > t0 + GONE_WITHIN) {
                int n = kpl__launcher_procs(true, j->pid, SIGKILL);
                fprintf(stderr, "kplrun: %d process%s of the failed launch still ran %d s after "
                        "mpirun ended: killed\n", n, n == 1 ? "" : "es", GONE_WITHIN);
                killed = true;
            } else if (left && !said && t > t0 + 1) {
                fprintf(stderr, "kplrun: waiting for what is left of the failed launch on this "
                        "node to end\n");
                said = true;
            }
            if (left && killed && t > t0 + GONE_WITHIN + KILLED_WITHIN)
                fprintf(stderr, "kplrun: processes of the failed launch outlived SIGKILL "
                        "(uninterruptible?); restarting anyway\n");
            if (!left || (killed && t > t0 + GONE_WITHIN + KILLED_WITHIN)) {
                fprintf(stderr, "kplrun: restart %d/%d in %g s: %s\n", next->k, next->n, backoff,
                        next->reason);
                go_at = t + backoff;
            }
        }
        if (go_at && t >= go_at) return -1;
        if (timeout > 0 && t > deadline) {
            fprintf(stderr, "kplrun: --timeout %g s reached before the restart: not restarting\n",
                    timeout);
            return 124;
        }
        int ms = go_at ? (int)((go_at - t) * 1000) + 1 : 100;
        struct pollfd p = {j->sfd, POLLIN, 0};
        if (poll(&p, 1, ms < 100 ? ms : 100) <= 0) continue;
        struct signalfd_siginfo si;
        while (read(j->sfd, &si, sizeof si) == (ssize_t)sizeof si) {
            if (si.ssi_signo == SIGCHLD) continue;
            fprintf(stderr, "kplrun: %s %s: not restarting\n", signal_name((int)si.ssi_signo),
                    go_at ? "during the restart's back-off" : "before the restart");
            return 128 + (int)si.ssi_signo;
        }
    }
}

/* One launch of the job, from its mpirun command to its verdict (said).
 * The exit status; *again when it failed as a restart may mend
 * (--max-restarts given), with what failed in reason.  *t_first: the
 * first launch's start, from which --timeout counts. */
static int run_launch(const options *o, int argc, char **argv, const char **extra,
                      kpl_hostlist *hosts, const char *dir, const char *where, const launch *l,
                      job *j, double *t_first, bool *again, char *reason, size_t rlen)
{
    *again = false;
    console c;
    console_init(&c, o->np);
    char token[32], **mp = NULL;
    int lfd = -1;
    int rc = prepare_launch(o, argc, argv, extra, hosts, dir, where, &c, l, &lfd, token,
                            sizeof token, &mp);
    if (rc >= 0) {
        if (lfd >= 0) close(lfd);
        return rc;
    }
    c.tail = calloc((size_t)o->np, sizeof *c.tail);
    c.end = calloc((size_t)o->np, sizeof *c.end);
    c.stall = calloc((size_t)o->np, sizeof *c.stall);
    c.stuck = calloc((size_t)o->np, sizeof *c.stuck);
    c.trace = calloc((size_t)o->np, sizeof *c.trace);
    outcome out = {0, 0, false, 0, false};
    if (!c.tail || !c.end || !c.stall || !c.stuck || !c.trace) {
        fprintf(stderr, "kplrun: out of memory\n");
        kpl_launch_free_argv(mp);
        rc = 1;
    } else if (j->sfd < 0 && !catch_signals(j)) {
        kpl_launch_free_argv(mp);
        rc = 1;
    } else {
        rc = spawn(mp, j);
    }
    if (rc < 0) {
        if (!*t_first) *t_first = j->t0;
        rc = event_loop(&c, j, lfd, token, o->timeout, *t_first + o->timeout, o->stop_timeout, &out)
                 ? 1
                 : -1;
    }
    if (lfd >= 0) close(lfd);
    if (rc < 0) {
        kpl_launch_verdict v;
        kpl_launch_judge(c.end, c.np, c.mp_rank, c.mp_status, c.mp_sig, out.wstatus,
                         out.timed_out, out.interrupts, out.stop_sig, out.killed, &v);
        lost_host_of(&c, hosts);
        if (c.daemon_failed && !c.lost_host[0]) /* its box was held back: say it */
            fprintf(stderr, "kplrun: Open MPI lost a daemon after the ranks started (its launcher, "
                            "ssh or the daemon itself, exited), yet no host's ranks all went "
                            "silent; the ranks' own ends follow\n");
        if (say_lost_host(&c, &v, hosts)) {
            v.exit_code = 1; /* no rank's status to pass on */
        } else {
            say_verdict(&c, dir, &v, o->timeout, *t_first);
        }
        merge_traces(&c, dir);
        rc = v.exit_code;
        if (o->max_restarts > 0 && restartable(&v, &out)) {
            *again = true;
            describe_failure(&c, &v, reason, rlen);
        }
    }
    console_free(&c);
    return rc;
}

static int kplrun(int argc, char **argv, const char **extra, kpl_hostlist *hosts)
{
    options o;
    const char *where = NULL;
    int rc = parse_args(argc, argv, extra, &o);
    if (rc < 0) rc = resolve_hosts(&o, hosts, &where);
    if (rc >= 0) return rc;
    char dir[2 * PATH_MAX + 2], job_id[64];
    log_dir_of(&o, dir, sizeof dir, job_id, sizeof job_id);
    job j;
    memset(&j, 0, sizeof j);
    j.sfd = -1;
    double t_first = 0;
    int n = (int)o.max_restarts;
    char reason[1024] = "", failed[1024];
    for (int k = 0;; k++) {
        launch l = {job_id, k, n, k ? reason : NULL};
        bool again = false;
        rc = run_launch(&o, argc, argv, extra, hosts, dir, where, &l, &j, &t_first, &again, failed,
                        sizeof failed);
        if (!again) break;
        if (k == n) {
            fprintf(stderr, "kplrun: restarts exhausted (%d of %d made): %s; exit status %d\n", k, n,
                    failed, rc);
            break;
        }
        snprintf(reason, sizeof reason, "%s", failed);
        launch next = {job_id, k + 1, n, reason};
        int stop = between_launches(&j, &next, o.restart_backoff, o.timeout, t_first + o.timeout);
        if (stop >= 0) {
            rc = stop;
            break;
        }
    }
    if (j.sfd >= 0) close(j.sfd);
    return rc;
}

int main(int argc, char **argv)
{
    if (argc >= 2 && !strcmp(argv[1], "--agent")) return kpl__agent_main(argc - 2, argv + 2);
    const char **extra = calloc((size_t)argc + 1, sizeof *extra);
    if (!extra) return 1;
    kpl_hostlist hosts = {NULL, 0};
    int rc = kplrun(argc, argv, extra, &hosts);
    free(extra);
    kpl_hosts_free(&hosts);
    return rc;
}
