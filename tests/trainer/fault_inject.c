/* fault_inject.so — an LD_PRELOAD library that stops its process at a
 * chosen file operation, so that faults_e2e.sh and stop_e2e.sh can crash
 * or stop kpl train at exact points (inside a checkpoint save, a dataset
 * conversion, start-up) with no hook in kpl itself.
 *
 *   KPL_FAULT=OP:SUFFIX:N[:SIG]   before the N-th (1-based) call of OP on a
 *                                 file whose path ends with SUFFIX (or, for
 *                                 "*TEXT", contains TEXT): SIGKILL,
 *                                 or with SIG (TERM or INT) that signal to
 *                                 the whole process group, as a scheduler
 *                                 sends it, and the call goes on; with
 *                                 STOP the process stops itself (SIGSTOP)
 *                                 and the call goes on once it is continued
 *                                 (a rank held at an exact point, for a
 *                                 test to act on the job)
 *
 * OP: write (also pwrite; the path is that of the descriptor), fsync,
 * rename (the old path), link (the old path), mkdir.  Other processes and
 * other calls pass through untouched.
 *
 *   KPL_DELAY=waitpid:MS          every waitpid(2) of the process that
 *                                 loaded the library (not its children)
 *                                 first sleeps MS milliseconds: kpl's
 *                                 loader asks after its processes with one
 *                                 waitpid each per batch, so this makes
 *                                 exactly that rank a straggler, by a fixed
 *                                 time per step (profile_e2e.sh) */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <limits.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

static char op_[16], suffix_[256];
static long at_ = -1, seen_;
static int sig_ = SIGKILL;

static void parse(void)
{
    static int done;
    if (done) return;
    done = 1;
    const char *s = getenv("KPL_FAULT");
    if (!s) return;
    char buf[512];
    if (strlen(s) >= sizeof buf) return;
    strcpy(buf, s);
    char *save = NULL, *op = strtok_r(buf, ":", &save), *suf = strtok_r(NULL, ":", &save);
    char *n = strtok_r(NULL, ":", &save), *sig = strtok_r(NULL, ":", &save);
    if (!op || !suf || !n || strlen(op) >= sizeof op_ || strlen(suf) >= sizeof suffix_) return;
    if (sig && strcmp(sig, "TERM") && strcmp(sig, "INT") && strcmp(sig, "STOP")) return;
    strcpy(op_, op);
    strcpy(suffix_, suf);
    at_ = atol(n);
    if (sig) sig_ = !strcmp(sig, "TERM") ? SIGTERM : !strcmp(sig, "STOP") ? SIGSTOP : SIGINT;
}

static int ends_with(const char *p, const char *suf)
{
    if (suf[0] == '*') return strstr(p, suf + 1) != NULL;
    size_t lp = strlen(p), ls = strlen(suf);
    return lp >= ls && !strcmp(p + lp - ls, suf);
}

static void maybe_die(const char *op, const char *path)
{
    parse();
    if (at_ <= 0 || strcmp(op, op_) || !path || !ends_with(path, suffix_)) return;
    if (++seen_ != at_) return;
    if (sig_ == SIGKILL || sig_ == SIGSTOP) raise(sig_);
    else kill(0, sig_); /* every process of the group, this one included */
}

static void maybe_die_fd(const char *op, int fd)
{
    parse();
    if (at_ <= 0 || strcmp(op, op_)) return;
    char link[64], path[PATH_MAX];
    snprintf(link, sizeof link, "/proc/self/fd/%d", fd);
    ssize_t n = readlink(link, path, sizeof path - 1);
    if (n <= 0) return;
    path[n] = 0;
    maybe_die(op, path);
}

#define NEXT(name, type) ((type)dlsym(RTLD_NEXT, name))

ssize_t write(int fd, const void *buf, size_t n)
{
    maybe_die_fd("write", fd);
    return NEXT("write", ssize_t (*)(int, const void *, size_t))(fd, buf, n);
}

ssize_t pwrite(int fd, const void *buf, size_t n, off_t off)
{
    maybe_die_fd("write", fd);
    return NEXT("pwrite", ssize_t (*)(int, const void *, size_t, off_t))(fd, buf, n, off);
}

ssize_t pwrite64(int fd, const void *buf, size_t n, off_t off)
{
    maybe_die_fd("write", fd);
    return NEXT("pwrite64", ssize_t (*)(int, const void *, size_t, off_t))(fd, buf, n, off);
}

int fsync(int fd)
{
    maybe_die_fd("fsync", fd);
    return NEXT("fsync", int (*)(int))(fd);
}

int rename(const char *from, const char *to)
{
    maybe_die("rename", from);
    return NEXT("rename", int (*)(const char *, const char *))(from, to);
}

int link(const char *from, const char *to)
{
    maybe_die("link", from);
    return NEXT("link", int (*)(const char *, const char *))(from, to);
}

int mkdir(const char *path, mode_t mode)
{
    maybe_die("mkdir", path);
    return NEXT("mkdir", int (*)(const char *, mode_t))(path, mode);
}

/* KPL_DELAY: the delay in ms, or 0; only in the process that loaded us
 * (the loader's children inherit LD_PRELOAD). */
static pid_t main_pid_;
static long delay_ms_;

__attribute__((constructor)) static void delay_parse(void)
{
    main_pid_ = getpid();
    const char *s = getenv("KPL_DELAY");
    if (s && !strncmp(s, "waitpid:", 8)) delay_ms_ = atol(s + 8);
}

pid_t waitpid(pid_t pid, int *status, int options)
{
    if (delay_ms_ > 0 && getpid() == main_pid_) {
        struct timespec d = {delay_ms_ / 1000, (delay_ms_ % 1000) * 1000000L};
        while (nanosleep(&d, &d) != 0 && errno == EINTR) continue; /* the whole delay */
    }
    return NEXT("waitpid", pid_t (*)(pid_t, int *, int))(pid, status, options);
}
