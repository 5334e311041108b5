/* status.c — status names, the thread-local error message, version, dtypes. */
#include "kernels_impl.h"

#include <errno.h>
#include <fcntl.h>
#include <omp.h>
#include <stdio.h>
#include <sys/file.h>
#include <unistd.h>
#include <stdarg.h>
#include <string.h>
#include <time.h>

#include <dnnl.h>

/* ---- status ---------------------------------------------------------------- */

const char *kpl_status_str(kpl_status st)
{
    switch (st) {
#define KPL_X_(name, value, msg) \
    case value:                  \
        return #name;
        KPL_STATUS_LIST(KPL_X_)
#undef KPL_X_
    }
    return "KPL_UNKNOWN_STATUS";
}

const char *kpl_status_msg(kpl_status st)
{
    switch (st) {
#define KPL_X_(name, value, msg) \
    case value:                  \
        return msg;
        KPL_STATUS_LIST(KPL_X_)
#undef KPL_X_
    }
    return "unknown status";
}

/* The message of the last failure is per thread: every public call may fail
 * on any thread (data workers, the trainer), and a shared buffer would mix
 * them up. */
static _Thread_local char tl_msg[1024];
static _Thread_local kpl_status tl_status;

kpl_status kpl_error_at(kpl_status st, const char *file, int line,
                      const char *fmt, ...)
{
    char body[896];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(body, sizeof body, fmt, ap);
    va_end(ap);
    /* Keep the path from the module folder on ("kernels/ops_common.c"). */
    const char *short_file = file;
    for (const char *p = file; *p; p++)
        if (p[0] == '/' && p[1]) {
            const char *q = p + 1;
            if (!strncmp(q, "kernels/", 8) || !strncmp(q, "graph/", 6) ||
                !strncmp(q, "autograd/", 9) || !strncmp(q, "collective/", 11) ||
                !strncmp(q, "dataio/", 7) || !strncmp(q, "trainer/", 8) ||
                !strncmp(q, "launcher/", 9))
                short_file = q;
        }
    snprintf(tl_msg, sizeof tl_msg, "%s [%s:%d]", body, short_file, line);
    tl_status = st;
    return st;
}

kpl_status kpl_error_prefix(kpl_status st, const char *fmt, ...)
{
    char head[256], old[sizeof tl_msg];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(head, sizeof head, fmt, ap);
    va_end(ap);
    memcpy(old, tl_msg, sizeof old);
    size_t n = strlen(head);
    if (n >= sizeof tl_msg) n = sizeof tl_msg - 1;
    memcpy(tl_msg, head, n);
    snprintf(tl_msg + n, sizeof tl_msg - n, "%.*s", (int)(sizeof tl_msg - 1 - n), old);
    tl_status = st;
    return st;
}

kpl_status kpl_set_error(kpl_status st, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(tl_msg, sizeof tl_msg, fmt, ap);
    va_end(ap);
    tl_status = st;
    return st;
}

const char *kpl_last_error(void) { return tl_msg; }

/* ---- enum names ----------------------------------------------------------- */

int kpl__name_index(const char *const *names, const char *name)
{
    for (int i = 0; name && names[i]; i++)
        if (!strcmp(names[i], name)) return i;
    return -1;
}

const char *kpl__name_at(const char *const *names, int i)
{
    for (int k = 0; i >= 0 && names[k]; k++)
        if (k == i) return names[k];
    return "?";
}

/* ---- files ---------------------------------------------------------------- */

kpl_status kpl__write_all(int fd, const void *buf, size_t n, const char *path)
{
    const char *p = buf;
    while (n) {
        ssize_t w = write(fd, p, n);
        if (w < 0 && errno == EINTR) continue;
        if (w < 0) return KPL_ERROR(KPL_EIO, "%s: write failed: %s", path, strerror(errno));
        p += w;
        n -= (size_t)w;
    }
    return KPL_OK;
}

/* What the lock file says (at most len - 1 bytes, trailing newline cut). */
static void lockfile_read(int fd, char *buf, size_t len)
{
    if (!buf || !len) return;
    ssize_t n = pread(fd, buf, len - 1, 0);
    buf[n > 0 ? n : 0] = '\0';
    char *nl = strchr(buf, '\n');
    if (nl) *nl = '\0';
}

kpl_status kpl__lockfile_try(const char *path, int *fd, char *holder, size_t holder_len,
                             char *prev, size_t prev_len)
{
    *fd = -1;
    if (holder && holder_len) holder[0] = '\0';
    if (prev && prev_len) prev[0] = '\0';
    int f = open(path, O_RDWR | O_CREAT | O_CLOEXEC, 0644);
    if (f < 0) return KPL_ERROR(KPL_EIO, "cannot open the lock file %s: %s", path, strerror(errno));
    int r;
    while ((r = flock(f, LOCK_EX | LOCK_NB)) != 0 && errno == EINTR) continue;
    if (r != 0) {
        int e = errno;
        if (e == EWOULDBLOCK && holder && holder_len) {
            /* a holder that has just taken it may not have written yet */
            for (int i = 0; i < 20; i++) {
                lockfile_read(f, holder, holder_len);
                if (holder[0]) break;
                usleep(10000);
            }
            if (!holder[0]) snprintf(holder, holder_len, "another process");
        }
        close(f);
        if (e == EWOULDBLOCK) return KPL_OK;
        return KPL_ERROR(KPL_EIO, "cannot lock %s: %s", path, strerror(e));
    }
    lockfile_read(f, prev, prev_len);
    char me[512], host[256] = "?", when[32] = "?";
    gethostname(host, sizeof host - 1);
    host[sizeof host - 1] = '\0';
    time_t now = time(NULL);
    struct tm tm;
    if (localtime_r(&now, &tm)) strftime(when, sizeof when, "%Y-%m-%d %H:%M:%S", &tm);
    int n = snprintf(me, sizeof me, "pid %d on host %s since %s\n", (int)getpid(), host, when);
    kpl_status st = ftruncate(f, 0) == 0 ? kpl__write_all(f, me, (size_t)n, path)
                                         : KPL_ERROR(KPL_EIO, "%s: %s", path, strerror(errno));
    if (st < 0) {
        close(f);
        return st;
    }
    *fd = f;
    return KPL_OK;
}

void kpl__lockfile_release(int fd)
{
    if (fd < 0) return;
    /* a description left behind would only make the next holder say that
     * this one died */
    int rc = ftruncate(fd, 0);
    (void)rc;
    close(fd);
}
kpl_status kpl_last_status(void) { return tl_status; }

void kpl_clear_error(void)
{
    tl_msg[0] = '\0';
    tl_status = KPL_OK;
}

void kpl__assert_fail(const char *cond, const char *file, int line,
                      const char *msg)
{
    fprintf(stderr, "kpl: internal error at %s:%d: %s (%s)\n", file, line,
            msg ? msg : "assertion failed", cond);
    fflush(stderr);
    abort();
}

/* ---- version --------------------------------------------------------------- */

#define KPL_STR2_(x) #x
#define KPL_STR_(x) KPL_STR2_(x)

const char *kpl_version(void)
{
    return KPL_STR_(KPL_VERSION_MAJOR) "." KPL_STR_(KPL_VERSION_MINOR) "." KPL_STR_(
        KPL_VERSION_PATCH);
}

double kpl_seconds(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

static char build_info[512];
static pthread_once_t build_info_once = PTHREAD_ONCE_INIT;

static void build_info_fill(void)
{
    const dnnl_version_t *v = dnnl_version();
    snprintf(build_info, sizeof build_info,
             "kpl %s (%s)\n"
             "compiler: %s\n"
             "OpenMP: %d, max threads %d\n"
             "oneDNN: %d.%d.%d\n"
             "CUDA backend: %s%s\n",
             kpl_version(), KPL_BUILD_TYPE, KPL_C_COMPILER, _OPENMP,
             omp_get_max_threads(), v->major, v->minor, v->patch,
             KPL_HAVE_CUDA ? "built, toolkit " : "not built",
             KPL_HAVE_CUDA ? KPL_CUDA_VERSION : "");
}

const char *kpl_build_info(void)
{
    pthread_once(&build_info_once, build_info_fill);
    return build_info;
}

/* ---- dtypes ---------------------------------------------------------------- */

static const struct {
    const char *name;
    size_t size;
    bool is_float;
} dtype_info[KPL_DTYPE_COUNT] = {
#define KPL_X_(e, n, s, f) [e] = {#n, s, f},
    KPL_DTYPE_LIST(KPL_X_)
#undef KPL_X_
};

const char *kpl_dtype_name(kpl_dtype dt)
{
    return (unsigned)dt < KPL_DTYPE_COUNT ? dtype_info[dt].name : "invalid";
}

size_t kpl_dtype_size(kpl_dtype dt)
{
    return (unsigned)dt < KPL_DTYPE_COUNT ? dtype_info[dt].size : 0;
}

bool kpl_dtype_is_float(kpl_dtype dt)
{
    return (unsigned)dt < KPL_DTYPE_COUNT && dtype_info[dt].is_float;
}

kpl_status kpl_dtype_parse(const char *name, kpl_dtype *out)
{
    static const struct {
        const char *alias;
        kpl_dtype dt;
    } aliases[] = {
        {"float32", KPL_F32}, {"float", KPL_F32},    {"float16", KPL_F16},
        {"half", KPL_F16},    {"bfloat16", KPL_BF16}, {"int32", KPL_I32},
        {"int", KPL_I32},     {"int64", KPL_I64},    {"long", KPL_I64},
        {"uint8", KPL_U8},    {"float64", KPL_F64},  {"double", KPL_F64},
    };
    KPL_CHECK(name != NULL && out != NULL, KPL_EINVAL,
              "dtype_parse: NULL argument");
    for (int i = 0; i < KPL_DTYPE_COUNT; i++)
        if (!strcmp(name, dtype_info[i].name)) {
            *out = (kpl_dtype)i;
            return KPL_OK;
        }
    for (size_t i = 0; i < sizeof aliases / sizeof aliases[0]; i++)
        if (!strcmp(name, aliases[i].alias)) {
            *out = aliases[i].dt;
            return KPL_OK;
        }
    return KPL_ERROR(KPL_EDTYPE,
                     "unknown dtype '%s' (expected one of f32, f16, bf16, i32, "
                     "i64, u8, bool, f64)",
                     name);
}

/* ---- threads --------------------------------------------------------------- */

void kpl_set_num_threads(int n)
{
    if (n > 0) omp_set_num_threads(n);
}

int kpl_get_num_threads(void) { return omp_get_max_threads(); }

/* Read by the algorithm choosers on every cache miss; written once at start
 * (an atomic keeps a late change well-defined). */
static _Atomic bool deterministic;

void kpl_set_deterministic(bool on) { deterministic = on; }
bool kpl_get_deterministic(void) { return deterministic; }

/* Read by the CUDA GEMM and convolution entry points on every call. */
static _Atomic bool tf32;

void kpl_set_tf32(bool on) { tf32 = on; }
bool kpl_get_tf32(void) { return tf32; }
