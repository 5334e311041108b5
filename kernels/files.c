/*
 * files.c — what every module does with files, once: CRC32C, a file
 * written whole or not at all, mkdir -p.
 */
#include "kernels_impl.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

static inline uint64_t rd64(const void *p)
{
    uint64_t v;
    memcpy(&v, p, 8);
    return v;
}

/* ---- CRC32C ---------------------------------------------------------------------- */

/* Slicing-by-8 tables for CPUs without SSE4.2; built once. */
static uint32_t crc_table[8][256];
static pthread_once_t crc_once = PTHREAD_ONCE_INIT;
static bool crc_hw;

static void crc_init(void)
{
    for (uint32_t i = 0; i < 256; i++) {
        uint32_t c = i;
        for (int k = 0; k < 8; k++) c = (c >> 1) ^ (0x82F63B78u & (0u - (c & 1)));
        crc_table[0][i] = c;
    }
    for (uint32_t i = 0; i < 256; i++)
        for (int t = 1; t < 8; t++)
            crc_table[t][i] = (crc_table[t - 1][i] >> 8) ^ crc_table[0][crc_table[t - 1][i] & 0xff];
#if defined(__x86_64__)
    __builtin_cpu_init();
    crc_hw = __builtin_cpu_supports("sse4.2");
#endif
}

static uint32_t crc_sw(uint32_t c, const uint8_t *p, size_t n)
{
    while (n >= 8) {
        uint64_t v = rd64(p) ^ c;
        c = crc_table[7][v & 0xff] ^ crc_table[6][(v >> 8) & 0xff] ^
            crc_table[5][(v >> 16) & 0xff] ^ crc_table[4][(v >> 24) & 0xff] ^
            crc_table[3][(v >> 32) & 0xff] ^ crc_table[2][(v >> 40) & 0xff] ^
            crc_table[1][(v >> 48) & 0xff] ^ crc_table[0][v >> 56];
        p += 8;
        n -= 8;
    }
    while (n--) c = (c >> 8) ^ crc_table[0][(c ^ *p++) & 0xff];
    return c;
}

#if defined(__x86_64__)
/* One stream of the crc32 instruction: several GB/s, well above what disks
 * and zstd deliver, so the interleaved three-stream form is not worth its
 * complexity here. */
__attribute__((target("sse4.2"))) static uint32_t crc_hw_run(uint32_t c, const uint8_t *p,
                                                             size_t n)
{
    uint64_t c64 = c;
    while (n >= 8) {
        c64 = __builtin_ia32_crc32di(c64, rd64(p));
        p += 8;
        n -= 8;
    }
    c = (uint32_t)c64;
    while (n--) c = __builtin_ia32_crc32qi(c, *p++);
    return c;
}
#endif

uint32_t kpl_crc32c(uint32_t crc, const void *data, size_t n)
{
    pthread_once(&crc_once, crc_init);
    uint32_t c = ~crc;
#if defined(__x86_64__)
    if (crc_hw) return ~crc_hw_run(c, data, n);
#endif
    return ~crc_sw(c, data, n);
}

/* ---- a file written whole or not at all ----------------------------------------- */

kpl_status kpl__afile_open(kpl__afile *a, const char *path)
{
    a->f = NULL;
    a->fd = -1;
    KPL_CHECK(path && path[0], KPL_EINVAL, "cannot write a file with no name");
    KPL_CHECK((size_t)snprintf(a->path, sizeof a->path, "%s", path) < sizeof a->path &&
                  (size_t)snprintf(a->tmp, sizeof a->tmp, "%s.tmp", path) < sizeof a->tmp,
              KPL_EINVAL, "%s: path too long", path);
    a->fd = open(a->tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    KPL_CHECK(a->fd >= 0, KPL_EIO, "%s: cannot create: %s", a->tmp, strerror(errno));
    a->f = fdopen(a->fd, "wb");
    if (!a->f) {
        int e = errno;
        close(a->fd);
        unlink(a->tmp);
        a->fd = -1;
        return KPL_ERROR(KPL_ENOMEM, "%s: %s", path, strerror(e));
    }
    return KPL_OK;
}

void kpl__afile_abort(kpl__afile *a)
{
    if (!a->f) return; /* not open: zeroed, failed, committed or aborted */
    fclose(a->f);
    unlink(a->tmp);
    a->f = NULL;
    a->fd = -1;
}

kpl_status kpl__afile_commit(kpl__afile *a)
{
    KPL_CHECK(a->f, KPL_EINVAL, "%s: not open for writing", a->path);
    int e = 0;
    if (ferror(a->f) || fflush(a->f) != 0) e = errno ? errno : EIO;
    if (!e && fsync(a->fd) != 0) e = errno;
    if (fclose(a->f) != 0 && !e) e = errno;
    a->f = NULL;
    a->fd = -1;
    if (!e && rename(a->tmp, a->path) != 0) e = errno;
    if (e) {
        unlink(a->tmp);
        return KPL_ERROR(KPL_EIO, "%s: cannot write: %s", a->path, strerror(e));
    }
    return KPL_OK;
}

kpl_status kpl__write_file_atomic(const char *path, const void *data, size_t len)
{
    kpl__afile a;
    KPL_TRY(kpl__afile_open(&a, path));
    /* write(2) itself, not stdio: one call a buffer, as the fault tests
     * (tests/trainer/fault_inject.c) count them */
    kpl_status st = kpl__write_all(a.fd, data, len, a.tmp);
    if (st < 0) {
        kpl__afile_abort(&a);
        return st;
    }
    return kpl__afile_commit(&a);
}

/* ---- mkdir -p --------------------------------------------------------------------- */

kpl_status kpl__mkdirs(const char *dir)
{
    char p[4096];
    size_t n = dir ? strlen(dir) : 0;
    KPL_CHECK(n > 0 && n < sizeof p, KPL_EINVAL, "cannot create directory '%s': %s",
              dir ? dir : "", n ? "path too long" : "no name");
    memcpy(p, dir, n + 1);
    /* every prefix that ends before a slash, then dir itself */
    for (size_t i = 1; i <= n; i++) {
        if ((p[i] != '/' && p[i] != 0) || p[i - 1] == '/') continue;
        char c = p[i];
        p[i] = 0;
        if (mkdir(p, 0777) != 0 && errno != EEXIST) {
            int e = errno;
            return KPL_ERROR(KPL_EIO, "cannot create directory %s%s%s%s: %s", p,
                             c ? " (for " : "", c ? dir : "", c ? ")" : "", strerror(e));
        }
        p[i] = c;
    }
    struct stat sb;
    KPL_CHECK(stat(dir, &sb) == 0, KPL_EIO, "cannot create directory %s: %s", dir,
              strerror(errno));
    KPL_CHECK(S_ISDIR(sb.st_mode), KPL_EIO, "%s exists and is not a directory", dir);
    return KPL_OK;
}
