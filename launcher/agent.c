/*
 * agent.c — `kplrun --agent`: what mpirun starts for each rank.  It gives
 * the command the KPL_* environment, binds it to its GPU's NUMA node, runs
 * it in a process group of its own, and turns its output into lines that
 * kplrun can merge: "[rN] text" for every line, "\001bar N text" for
 * progress-bar frames, and at the end "\001exit RANK HOST PID STATUS SIGNAL
 * SECONDS".  They go to kplrun over its TCP channel (--channel; each line
 * tagged '1' for stdout or '2' for stderr), or without one to the agent's
 * own stdout and stderr, which mpirun forwards.  Every line also goes to
 * LOG_DIR/rank-NNNNN.log (appended to on a restart of the job, after a
 * line that says which restart and why).  SIGTERM (mpirun tearing the job down) stops the
 * command's whole process group (TERM, then KILL after KILL_AFTER s).  Open MPI
 * 4.1 follows its SIGTERM with SIGKILL within a millisecond, so a guard
 * process in the command's group finishes that job when the agent is
 * killed first (run_guard).  SIGUSR1 and SIGUSR2 (kplrun's first Ctrl-C
 * and first SIGTERM, forwarded by mpirun) become SIGINT and SIGTERM for the
 * command's group, with no deadline: the command (kpl train) stops at its
 * next agreed step, checkpoints and exits 130 or 143, and kplrun keeps the
 * deadline (--stop-timeout).
 */
#define _GNU_SOURCE
#include "launcher_impl.h"

#include <arpa/inet.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <netinet/in.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/signalfd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

/* Seconds between the SIGTERM of a torn-down rank's group and its SIGKILL.
 * A scheduler that stops a job by signalling every process of it (SLURM's
 * scancel, a time limit) tears mpirun and the agents down at once; kpl
 * train then needs one step and a checkpoint to stop on its own (exit 143).
 * Longer would keep a rank that waits for a dead peer (a failed job) alive
 * that much longer after kplrun has said why the job ended. */
#define KILL_AFTER 10

typedef struct {
    int rank, fd;        /* fd: where the lines go (our stdout or stderr) */
    bool is_out;         /* the command's stdout: progress-bar frames possible */
    char chan;           /* on kplrun's channel: '1' (stdout) or '2' (stderr) before each line */
    char buf[65536];     /* what was read, up to the last newline */
    size_t len;
    char out[65536];     /* what goes to fd, written once per read */
    size_t olen;
    char last_bar[1024];
} stream;

static FILE *logf;

/* Removes ANSI escape sequences (the bar's "\033[K") in place. */
static void strip_ansi(char *s)
{
    char *o = s;
    for (char *p = s; *p;) {
        if (p[0] == '\033' && p[1] == '[') {
            p += 2;
            while (*p && !((*p >= 'A' && *p <= 'Z') || (*p >= 'a' && *p <= 'z'))) p++;
            if (*p) p++;
            continue;
        }
        *o++ = *p++;
    }
    *o = 0;
}

/* Relayed output is best effort: a closed terminal must not stop the
 * rank (its own exit status and the report still reach kplrun). */
static void write_all(int fd, const char *s, size_t n)
{
    (void)kpl__write_all(fd, s, n, "output");
}

static void flush_out(stream *s)
{
    write_all(s->fd, s->out, s->olen);
    s->olen = 0;
}

/* Queues bytes for the stream's descriptor. */
static void put(stream *s, const char *p, size_t n)
{
    if (s->olen + n > sizeof s->out) flush_out(s);
    if (n > sizeof s->out) {
        write_all(s->fd, p, n);
        return;
    }
    memcpy(s->out + s->olen, p, n);
    s->olen += n;
}

/* One finished line: what a terminal would show of it (the text after its
 * last carriage return, escapes removed), prefixed. */
static void emit_line(stream *s, char *line)
{
    char pre[48];
    if (s->last_bar[0]) { /* the bar's line ends: it is gone from a terminal too */
        int m = snprintf(pre, sizeof pre, "\001bar %d \n", s->rank);
        put(s, pre, (size_t)m);
    }
    char *cr = strrchr(line, '\r');
    char *vis = cr ? cr + 1 : line;
    strip_ansi(vis);
    size_t len = strlen(vis);
    int m = s->chan ? snprintf(pre, sizeof pre, "%c[r%d] ", s->chan, s->rank)
                    : snprintf(pre, sizeof pre, "[r%d] ", s->rank);
    put(s, pre, (size_t)m);
    put(s, vis, len);
    put(s, "\n", 1);
    if (logf) {
        fwrite(vis, 1, len, logf);
        fputc('\n', logf);
    }
    s->last_bar[0] = 0;
}

/* A line still open after carriage returns is a progress bar: its latest
 * frame goes to kplrun (not to the log). */
static void emit_bar(stream *s)
{
    if (!s->is_out || !s->len) return;
    char tmp[sizeof s->buf + 1];
    memcpy(tmp, s->buf, s->len);
    tmp[s->len] = 0;
    char *cr = strrchr(tmp, '\r');
    if (!cr) return;
    char *vis = cr + 1;
    strip_ansi(vis);
    if (!*vis || !strcmp(vis, s->last_bar)) return;
    snprintf(s->last_bar, sizeof s->last_bar, "%s", vis);
    char out[1100];
    int n = snprintf(out, sizeof out, "\001bar %d %.1000s\n", s->rank, vis);
    put(s, out, (size_t)n);
}

/* Reads what is there; false at end of file. */
static bool pump(stream *s, int fd)
{
    ssize_t r = read(fd, s->buf + s->len, sizeof s->buf - 1 - s->len);
    if (r < 0 && (errno == EINTR || errno == EAGAIN)) return true;
    if (r <= 0) {
        if (s->len) { /* a last line without its newline */
            s->buf[s->len] = 0;
            emit_line(s, s->buf);
            s->len = 0;
        }
        flush_out(s);
        return false;
    }
    s->len += (size_t)r;
    char *start = s->buf, *nl;
    while ((nl = memchr(start, '\n', s->len - (size_t)(start - s->buf)))) {
        *nl = 0;
        emit_line(s, start);
        start = nl + 1;
    }
    s->len -= (size_t)(start - s->buf);
    memmove(s->buf, start, s->len);
    if (s->len == sizeof s->buf - 1) { /* a line longer than the buffer: cut it */
        s->buf[s->len] = 0;
        emit_line(s, s->buf);
        s->len = 0;
    }
    emit_bar(s);
    flush_out(s);
    if (logf) fflush(logf);
    return true;
}

/* Waits up to `ms` for `events` on fd. */
static bool wait_fd(int fd, short events, int ms)
{
    struct pollfd p = {fd, events, 0};
    int r;
    while ((r = poll(&p, 1, ms)) < 0 && errno == EINTR) continue;
    return r == 1 && (p.revents & events);
}

/* kplrun's channel ("ADDR,ADDR,...:PORT:TOKEN", launcher_impl.h): the first
 * address that takes the connection within 2 s and greets with
 * "kplrun TOKEN".  A blocking socket, or -1. */
static int channel_connect(const char *spec)
{
    char buf[4096];
    snprintf(buf, sizeof buf, "%s", spec);
    char *tok = strrchr(buf, ':');
    if (!tok) return -1;
    *tok++ = 0;
    char *port = strrchr(buf, ':');
    if (!port) return -1;
    *port++ = 0;
    char want[64];
    snprintf(want, sizeof want, "kplrun %s\n", tok);
    char *save = NULL;
    for (char *ip = strtok_r(buf, ",", &save); ip; ip = strtok_r(NULL, ",", &save)) {
        struct sockaddr_in a;
        memset(&a, 0, sizeof a);
        a.sin_family = AF_INET;
        a.sin_port = htons((uint16_t)atoi(port));
        if (inet_pton(AF_INET, ip, &a.sin_addr) != 1) continue;
        int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
        if (fd < 0) return -1;
        int err = 0;
        socklen_t el = sizeof err;
        bool ok = connect(fd, (struct sockaddr *)&a, sizeof a) == 0 ||
                  (errno == EINPROGRESS && wait_fd(fd, POLLOUT, 2000) &&
                   getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &el) == 0 && err == 0);
        /* the greeting, which may come in pieces */
        char got[64];
        size_t n = 0;
        while (ok && n < strlen(want) && wait_fd(fd, POLLIN, 2000)) {
            ssize_t r = read(fd, got + n, strlen(want) - n);
            if (r <= 0) break;
            n += (size_t)r;
        }
        if (ok && n == strlen(want) && !memcmp(got, want, n)) {
            fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) & ~O_NONBLOCK);
            return fd;
        }
        close(fd);
    }
    return -1;
}

static int env_int(const char *const *names, int def)
{
    for (int i = 0; names[i]; i++) {
        const char *v = getenv(names[i]);
        if (v && *v) return atoi(v);
    }
    return def;
}

/* The driver's directories: KPLRUN_NVIDIA_SYSFS and KPLRUN_NVIDIA_PROC
 * name stand-ins of the same form, for tests. */
static const char *nvidia_sysfs(void)
{
    const char *dir = getenv("KPLRUN_NVIDIA_SYSFS");
    return dir && *dir ? dir : "/sys/bus/pci/drivers/nvidia";
}

static const char *nvidia_proc(void)
{
    const char *dir = getenv("KPLRUN_NVIDIA_PROC");
    return dir && *dir ? dir : "/proc/driver/nvidia/gpus";
}

int kpl__launcher_gpu_count(void)
{
    kpl__gpu g[64];
    return kpl__launcher_visible_gpus(nvidia_sysfs(), nvidia_proc(),
                                      getenv("CUDA_VISIBLE_DEVICES"), g, 64, NULL, 0);
}

/* Binds this process (and so the command) to the CPUs next to the GPU at
 * PCI address `pci` (its local_cpulist, e.g. "0-15,32-47"). */
static void bind_near_gpu(const char *pci)
{
    char path[PATH_MAX + 64], list[4096];
    snprintf(path, sizeof path, "%s/%s/local_cpulist", nvidia_sysfs(), pci);
    FILE *f = fopen(path, "r");
    if (!f) return;
    size_t n = fread(list, 1, sizeof list - 1, f);
    fclose(f);
    list[n] = 0;
    cpu_set_t set;
    CPU_ZERO(&set);
    for (char *p = list; *p && *p != '\n';) {
        char *end;
        long a = strtol(p, &end, 10), b = a;
        if (end == p) break;
        if (*end == '-') b = strtol(end + 1, &end, 10);
        for (long c = a; c <= b && c < CPU_SETSIZE; c++) CPU_SET((int)c, &set);
        p = *end == ',' ? end + 1 : end;
    }
    if (CPU_COUNT(&set) > 0) sched_setaffinity(0, sizeof set, &set);
}

int kpl__launcher_procs(bool session, pid_t id, int sig)
{
    DIR *d = opendir("/proc");
    if (!d) return 0;
    int found = 0;
    pid_t self = getpid();
    struct dirent *e;
    while ((e = readdir(d))) {
        char *end;
        long pid = strtol(e->d_name, &end, 10);
        if (*end || pid <= 0 || pid == self) continue;
        char path[64], buf[512];
        snprintf(path, sizeof path, "/proc/%ld/stat", pid);
        int fd = open(path, O_RDONLY | O_CLOEXEC);
        if (fd < 0) continue;
        ssize_t n = read(fd, buf, sizeof buf - 1);
        close(fd);
        if (n <= 0) continue;
        buf[n] = 0;
        /* "pid (comm) state ppid pgrp session ...": comm may hold spaces and ')' */
        char *p = strrchr(buf, ')'), state;
        long ppid, pgrp, sid;
        if (!p || sscanf(p + 1, " %c %ld %ld %ld", &state, &ppid, &pgrp, &sid) != 4 ||
            (session ? sid : pgrp) != id || state == 'Z')
            continue;
        found++;
        if (sig) kill((pid_t)pid, sig);
        else break; /* one is enough to know */
    }
    closedir(d);
    return found;
}

/* Whether a process other than this one is in process group `group`. */
static bool group_has_others(pid_t group) { return kpl__launcher_procs(false, group, 0) > 0; }

/* The signals the agent hands on to its command's group (TERM and HUP: a
 * teardown; USR1 and USR2: kplrun's stops, as SIGINT and SIGTERM). */
static void handed_on(sigset_t *s)
{
    sigemptyset(s);
    sigaddset(s, SIGTERM);
    sigaddset(s, SIGHUP);
    sigaddset(s, SIGUSR1);
    sigaddset(s, SIGUSR2);
}

/* The guard: a process in the command's group that outlives the agent.
 * An agent killed outright (mpirun sends SIGKILL about a millisecond after
 * its SIGTERM; or the OOM killer) cannot stop the command's children; the
 * guard, told by PR_SET_PDEATHSIG, stops the whole group as the agent
 * would have: TERM, then KILL (itself included) once the others are gone
 * or after KILL_AFTER s.  Signals for the group (the agent's SIGINT and SIGTERM)
 * it ignores; the agent's final SIGKILL of the group ends it. */
static void run_guard(pid_t group, pid_t agent)
{
    sigset_t set;
    handed_on(&set);
    sigaddset(&set, SIGINT);
    sigprocmask(SIG_BLOCK, &set, NULL);
    prctl(PR_SET_PDEATHSIG, SIGHUP);
    int fd = open("/dev/null", O_RDWR);
    for (int i = 0; i < 3 && fd >= 0; i++) dup2(fd, i);
    for (int i = 3; i < 1024; i++) close(i); /* no pipe held open by the guard */
    if (getppid() == agent) {
        int sig = 0;
        while (sigwait(&set, &sig) == 0 && sig != SIGHUP) continue;
    }
    kill(-group, SIGTERM);
    kill(-group, SIGCONT); /* a stopped process acts on SIGTERM once continued */
    for (int i = 0; i < KILL_AFTER * 20 && group_has_others(group); i++) usleep(50000);
    kill(-group, SIGKILL);
    _exit(0);
}

/* What the rank's command learns from its environment (KPL_RANK, ...,
 * KPL_DEVICE, the progress bar), and the CPUs near its GPU.  KPL_DEVICE
 * numbers the GPU as CUDA will in the command: among those
 * CUDA_VISIBLE_DEVICES leaves it (gpus.c). */
static void set_rank_env(int rank, int world, int local, int local_size, bool bar, int columns)
{
    char v[64];
    snprintf(v, sizeof v, "%d", rank), setenv("KPL_RANK", v, 1);
    snprintf(v, sizeof v, "%d", world), setenv("KPL_WORLD_SIZE", v, 1);
    snprintf(v, sizeof v, "%d", local), setenv("KPL_LOCAL_RANK", v, 1);
    snprintf(v, sizeof v, "%d", local_size), setenv("KPL_LOCAL_SIZE", v, 1);
    kpl__gpu gpus[64];
    char note[1200];
    int ngpu = kpl__launcher_visible_gpus(nvidia_sysfs(), nvidia_proc(),
                                          getenv("CUDA_VISIBLE_DEVICES"), gpus, 64, note,
                                          sizeof note);
    if (note[0]) fprintf(stderr, "[r%d] kplrun: %s\n", rank, note);
    if (ngpu > 0) {
        setenv("CUDA_DEVICE_ORDER", "PCI_BUS_ID", 1);
        snprintf(v, sizeof v, "cuda:%d", local % ngpu);
        if (gpus[local % ngpu].pci[0]) bind_near_gpu(gpus[local % ngpu].pci);
    } else {
        snprintf(v, sizeof v, "cpu");
    }
    setenv("KPL_DEVICE", v, 1);
    if (bar && rank == 0) {
        setenv("KPL_PROGRESS", "always", 1);
        snprintf(v, sizeof v, "%d", columns), setenv("COLUMNS", v, 1);
    }
}

/* Which launch of the job this is (kplrun --max-restarts): every launch
 * sets them, so that nothing a rank inherits from elsewhere says that it
 * was restarted.  The reason is only a restart's. */
static void set_restart_env(const char *job_id, int restart, int max_restarts, const char *reason)
{
    char v[32];
    if (job_id) setenv("KPL_JOB_ID", job_id, 1);
    snprintf(v, sizeof v, "%d", restart), setenv("KPL_RESTART_COUNT", v, 1);
    snprintf(v, sizeof v, "%d", max_restarts), setenv("KPL_MAX_RESTARTS", v, 1);
    if (restart > 0 && reason) setenv("KPL_RESTART_REASON", reason, 1);
    else unsetenv("KPL_RESTART_REASON");
}

/* The command, its output into pipes, in a process group of its own, and
 * its guard; the signals the agent handles into a signalfd.  The child's
 * pid, or -1 (said on stderr). */
static pid_t start_command(char **cmd, int rank, sigset_t *mask, int *sfd, int *out, int *err)
{
    /* mpirun may hand down SIGCHLD ignored, which would reap the command
     * behind waitpid's back */
    signal(SIGCHLD, SIG_DFL);
    handed_on(mask);
    sigaddset(mask, SIGCHLD);
    sigprocmask(SIG_BLOCK, mask, NULL);
    signal(SIGINT, SIG_IGN); /* kplrun decides what Ctrl-C means */
    /* mpirun stops reading a rank's output as it tears the job down: the
     * agent must still finish its log and pass the command's end on */
    signal(SIGPIPE, SIG_IGN);
    *sfd = signalfd(-1, mask, SFD_CLOEXEC | SFD_NONBLOCK);
    int po[2], pe[2];
    if (*sfd < 0 || pipe2(po, O_CLOEXEC) != 0 || pipe2(pe, O_CLOEXEC) != 0) {
        fprintf(stderr, "[r%d] kplrun: %s\n", rank, strerror(errno));
        return -1;
    }
    pid_t child = fork();
    if (child == 0) {
        setpgid(0, 0);
        prctl(PR_SET_PDEATHSIG, SIGTERM); /* the agent killed: the command goes too */
        /* A SIGUSR1/2 that mpirun sent to the agent's group before this
         * child left it is pending here: it was the agent's to hand on */
        sigset_t usr;
        sigemptyset(&usr);
        sigaddset(&usr, SIGUSR1);
        sigaddset(&usr, SIGUSR2);
        struct timespec now = {0, 0};
        while (sigtimedwait(&usr, NULL, &now) > 0) continue;
        sigprocmask(SIG_UNBLOCK, mask, NULL);
        signal(SIGINT, SIG_DFL);
        signal(SIGPIPE, SIG_DFL);
        dup2(po[1], STDOUT_FILENO);
        dup2(pe[1], STDERR_FILENO);
        execvp(cmd[0], cmd);
        fprintf(stderr, "kplrun: cannot run %s: %s\n", cmd[0], strerror(errno));
        _exit(127);
    }
    if (child < 0) {
        fprintf(stderr, "[r%d] kplrun: fork: %s\n", rank, strerror(errno));
        return -1;
    }
    setpgid(child, child);
    pid_t agent = getpid(), guard = fork();
    if (guard == 0) {
        if (setpgid(0, child) != 0) _exit(0); /* the command is gone already */
        run_guard(child, agent);
    }
    close(po[1]);
    close(pe[1]);
    *out = po[0], *err = pe[0];
    return child;
}

/* The command's lines to the log and to kplrun, and the signals on to
 * it, until it has exited and its output has ended; its wait status. */
/* *ended: the wall clock when the command was seen to end (kplrun blames
 * the rank that failed first, whatever order the reports arrive in). */
static int relay(pid_t child, int sfd, int out, int err, stream *so, stream *se, double t0,
                 double *ended)
{
    bool out_open = true, err_open = true, exited = false;
    int wstatus = 0;
    double kill_at = 0, drain_until = 0;
    for (;;) {
        struct pollfd p[3] = {{sfd, POLLIN, 0}, {out_open ? out : -1, POLLIN, 0},
                              {err_open ? err : -1, POLLIN, 0}};
        int r = poll(p, 3, 100);
        double now = kpl_seconds() - t0;
        if (r > 0 && (p[1].revents & (POLLIN | POLLHUP))) out_open = pump(so, out);
        if (r > 0 && (p[2].revents & (POLLIN | POLLHUP))) err_open = pump(se, err);
        if (r > 0 && (p[0].revents & POLLIN)) {
            struct signalfd_siginfo si;
            while (read(sfd, &si, sizeof si) == (ssize_t)sizeof si) {
                if (si.ssi_signo == SIGUSR1 || si.ssi_signo == SIGUSR2) {
                    kill(-child, si.ssi_signo == SIGUSR1 ? SIGINT : SIGTERM);
                    kill(-child, SIGCONT);
                } else if (si.ssi_signo == SIGTERM || si.ssi_signo == SIGHUP) {
                    /* A stopped command (SIGSTOP, a debugger let go) would
                     * keep SIGTERM pending until the SIGKILL. */
                    kill(-child, SIGTERM);
                    kill(-child, SIGCONT);
                    if (!kill_at) kill_at = now + KILL_AFTER;
                }
                if (si.ssi_signo != SIGCHLD) break;
            }
        }
        pid_t w = exited ? 0 : waitpid(child, &wstatus, WNOHANG);
        if (w == child || (w < 0 && errno == ECHILD)) {
            exited = true;
            drain_until = now + 0.5;
            *ended = kpl__wall_seconds();
        }
        if (kill_at && now > kill_at) {
            kill(-child, SIGKILL);
            kill_at = 0;
        }
        /* done: the command exited and its output ended (or stray
         * processes of its group still hold the pipes: they go) */
        if (exited && ((!out_open && !err_open) || now > drain_until)) break;
    }
    kill(-child, SIGKILL);
    return wstatus;
}

int kpl__agent_main(int argc, char **argv)
{
    const char *log_dir = "kplrun-logs", *channel = NULL, *job_id = NULL, *reason = NULL;
    bool bar = false;
    int columns = 80, cmd = -1, restart = 0, max_restarts = 0;
    for (int i = 0; i < argc; i++) {
        if (!strcmp(argv[i], "--log-dir") && i + 1 < argc) log_dir = argv[++i];
        else if (!strcmp(argv[i], "--channel") && i + 1 < argc) channel = argv[++i];
        else if (!strcmp(argv[i], "--bar")) bar = true;
        else if (!strcmp(argv[i], "--columns") && i + 1 < argc) columns = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--job-id") && i + 1 < argc) job_id = argv[++i];
        else if (!strcmp(argv[i], "--restart") && i + 1 < argc) restart = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--max-restarts") && i + 1 < argc) max_restarts = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--restart-reason") && i + 1 < argc) reason = argv[++i];
        else if (!strcmp(argv[i], "--")) {
            cmd = i + 1;
            break;
        }
    }
    static const char *const rk[] = {"OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK", NULL};
    static const char *const ws[] = {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", NULL};
    static const char *const lr[] = {"OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", NULL};
    static const char *const ls[] = {"OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS", NULL};
    /* The signals the agent hands on wait from now on (start_command reads
     * them from a descriptor): one that kplrun sends as soon as this agent
     * calls in must not end it. */
    sigset_t early;
    handed_on(&early);
    sigprocmask(SIG_BLOCK, &early, NULL);
    /* mpirun (or its daemon) going away takes the rank with it */
    pid_t parent = getppid();
    prctl(PR_SET_PDEATHSIG, SIGTERM);
    if (getppid() != parent) return 1;
    int rank = env_int(rk, -1), world = env_int(ws, -1);
    if (cmd < 0 || cmd >= argc || rank < 0 || world < 1) {
        fprintf(stderr, "kplrun --agent: runs under mpirun as kplrun's rank wrapper "
                        "(no command after '--', or no rank in the environment)\n");
        return 2;
    }
    char host[256] = "?";
    gethostname(host, sizeof host);
    set_rank_env(rank, world, env_int(lr, rank), env_int(ls, world), bar, columns);
    set_restart_env(job_id, restart, max_restarts, reason);

    /* A restart keeps what the launches before it wrote (the failed rank's
     * last words among them), and says where the new launch begins. */
    char path[PATH_MAX + 32];
    if (kpl__mkdirs(log_dir) == KPL_OK) {
        snprintf(path, sizeof path, "%s/rank-%05d.log", log_dir, rank);
        logf = fopen(path, restart > 0 ? "a" : "w");
    }
    if (logf && restart > 0) {
        fprintf(logf, "kplrun: restart %d/%d%s%s\n", restart, max_restarts, reason ? ": " : "",
                reason ? reason : "");
        fflush(logf);
    }
    if (!logf) fprintf(stderr, "[r%d] kplrun: cannot write %s/rank-%05d.log: %s\n", rank,
                       log_dir, rank, strerror(errno));
    int chan_fd = -1;
    if (channel && (chan_fd = channel_connect(channel)) < 0)
        fprintf(stderr, "[r%d] kplrun: cannot reach kplrun at %s from %s; this rank's output "
                        "goes through mpirun, where lines of different ranks may mix\n",
                rank, channel, host);

    /* Signals arrive through a descriptor, so the loop sees them in order
     * with the output. */
    sigset_t mask;
    int sfd = -1, out = -1, err = -1;
    double t0 = kpl_seconds();
    pid_t child = start_command(argv + cmd, rank, &mask, &sfd, &out, &err);
    if (child < 0) return 1;
    static stream so, se;
    so = (stream){.rank = rank, .fd = STDOUT_FILENO, .is_out = true};
    se = (stream){.rank = rank, .fd = STDERR_FILENO, .is_out = false};
    if (chan_fd >= 0) so.fd = se.fd = chan_fd, so.chan = '1', se.chan = '2';
    double ended = 0;
    int wstatus = relay(child, sfd, out, err, &so, &se, t0, &ended);
    if (so.len) so.buf[so.len] = 0, emit_line(&so, so.buf);
    if (se.len) se.buf[se.len] = 0, emit_line(&se, se.buf);
    flush_out(&so);
    flush_out(&se);
    double secs = kpl_seconds() - t0;
    int status = WIFEXITED(wstatus) ? WEXITSTATUS(wstatus) : 0;
    int sig = WIFSIGNALED(wstatus) ? WTERMSIG(wstatus) : 0;
    if (logf) { /* first: mpirun may kill a torn-down agent any moment now */
        if (sig) fprintf(logf, "kplrun: rank %d was killed by signal %d (%s) after %.1f s\n", rank,
                         sig, strsignal(sig), secs);
        else fprintf(logf, "kplrun: rank %d exited with status %d after %.1f s\n", rank, status,
                     secs);
        fclose(logf);
    }
    char line[512];
    int n = snprintf(line, sizeof line, "\001exit %d %s %d %d %d %.3f %.6f\n", rank, host,
                     (int)child, status, sig, secs, ended);
    write_all(so.fd, line, (size_t)n);
    if (sig) { /* mpirun reports the signal as the rank's own */
        sigprocmask(SIG_UNBLOCK, &mask, NULL);
        signal(sig, SIG_DFL);
        raise(sig);
    }
    return status;
}
