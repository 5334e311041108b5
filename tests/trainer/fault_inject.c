/* fault_inject.so — an LD_PRELOAD library that kills its process with
 * SIGKILL at a chosen file operation, so that faults_e2e.sh can crash kpl
 * train at exact points inside a checkpoint save (no hook in kpl itself).
 *
 *   KPL_FAULT=OP:SUFFIX:N   before the N-th (1-based) call of OP on a file
 *                           whose path ends with SUFFIX, SIGKILL
 *
 * OP: write (also pwrite; the path is that of the descriptor), fsync,
 * rename (the old path), link (the old path).  Other processes and
 * other calls pass through untouched. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <limits.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/types.h>
#include <unistd.h>

static char op_[16], suffix_[256];
static long at_ = -1, seen_;

static void parse(void)
{
    static int done;
    if (done) return;
    done = 1;
    const char *s = getenv("KPL_FAULT");
    if (!s) return;
    const char *a = strchr(s, ':'), *b = a ? strrchr(s, ':') : NULL;
    if (!a || b == a || (size_t)(a - s) >= sizeof op_ || (size_t)(b - a - 1) >= sizeof suffix_)
        return;
    memcpy(op_, s, (size_t)(a - s));
    memcpy(suffix_, a + 1, (size_t)(b - a - 1));
    at_ = atol(b + 1);
}

static int ends_with(const char *p, const char *suf)
{
    size_t lp = strlen(p), ls = strlen(suf);
    return lp >= ls && !strcmp(p + lp - ls, suf);
}

static void maybe_die(const char *op, const char *path)
{
    parse();
    if (at_ <= 0 || strcmp(op, op_) || !path || !ends_with(path, suffix_)) return;
    if (++seen_ == at_) raise(SIGKILL);
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
