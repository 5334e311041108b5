/*
 * fuzz_common.h — what kpl's libFuzzer harnesses share: a scratch
 * directory per process, whole-file writes, splitting an input into parts
 * and removing what a run left behind.
 *
 * Every harness keeps its files under one directory made at its first
 * input, /dev/shm/kpl-fuzz-<name>-XXXXXX (tmpfs: no disk I/O, fsync is
 * free), and removes it when the process exits.  Between inputs a harness
 * removes the files it wrote, so that one input never sees another's.
 */
#ifndef KPL_FUZZ_COMMON_H
#define KPL_FUZZ_COMMON_H

#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <errno.h>
#include <fcntl.h>
#include <ftw.h>
#include <limits.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "kernels.h"

/* ---- scratch directory ---- */

static char fuzz_dir_[PATH_MAX];

static int fuzz_rm_one_(const char *path, const struct stat *sb, int flag, struct FTW *ftw)
{
    (void)sb;
    (void)flag;
    (void)ftw;
    remove(path);
    return 0;
}

/* Removes `path` and everything under it; a missing path is fine. */
static inline void fuzz_rm_tree(const char *path)
{
    nftw(path, fuzz_rm_one_, 16, FTW_DEPTH | FTW_PHYS);
}

/* Removes what is under `dir` but keeps `dir`. */
static inline void fuzz_empty_dir(const char *dir)
{
    fuzz_rm_tree(dir);
    mkdir(dir, 0700);
}

static void fuzz_cleanup_(void)
{
    if (fuzz_dir_[0]) fuzz_rm_tree(fuzz_dir_);
}

/* The process's scratch directory, made on first use (abort if it cannot
 * be: a harness without one would test nothing). */
static inline const char *fuzz_dir(const char *name)
{
    if (fuzz_dir_[0]) return fuzz_dir_;
    const char *base = access("/dev/shm", W_OK) == 0 ? "/dev/shm" : "/tmp";
    snprintf(fuzz_dir_, sizeof fuzz_dir_, "%s/kpl-fuzz-%s-XXXXXX", base, name);
    if (!mkdtemp(fuzz_dir_)) {
        perror("fuzz: mkdtemp");
        abort();
    }
    atexit(fuzz_cleanup_);
    return fuzz_dir_;
}

/* "scratch/name" into out[PATH_MAX]. */
static inline void fuzz_path(char *out, const char *dir, const char *name)
{
    snprintf(out, PATH_MAX, "%s/%s", dir, name);
}

/* Writes n bytes to `path` (created or truncated); aborts on failure. */
static inline void fuzz_write(const char *path, const void *data, size_t n)
{
    int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    if (fd < 0) {
        perror(path);
        abort();
    }
    const uint8_t *p = data;
    while (n > 0) {
        ssize_t w = write(fd, p, n);
        if (w <= 0) {
            perror(path);
            abort();
        }
        p += w;
        n -= (size_t)w;
    }
    close(fd);
}

/* ---- input parts ---- */

typedef struct {
    const uint8_t *p;
    size_t n;
} fuzz_part;

/* Splits data[0..n) at every occurrence of sep (seplen bytes) into at most
 * max parts (the last part keeps any further separators); returns how
 * many.  An input without the separator is one part. */
static inline int fuzz_split(const uint8_t *data, size_t n, const char *sep, size_t seplen,
                             fuzz_part *parts, int max)
{
    int k = 0;
    const uint8_t *p = data, *end = data + n;
    while (k < max - 1) {
        const uint8_t *s = memmem(p, (size_t)(end - p), sep, seplen);
        if (!s) break;
        parts[k++] = (fuzz_part){p, (size_t)(s - p)};
        p = s + seplen;
    }
    parts[k++] = (fuzz_part){p, (size_t)(end - p)};
    return k;
}

/* A NUL-terminated malloc'd copy (embedded NULs end the string early, as
 * they would for a C caller); aborts on OOM. */
static inline char *fuzz_strndup(const uint8_t *p, size_t n)
{
    char *s = malloc(n + 1);
    if (!s) abort();
    memcpy(s, p, n);
    s[n] = 0;
    return s;
}

/* Reads every byte of a view, so that the sanitizers see a view that runs
 * past its buffer; the sum keeps the loads from being optimized away. */
static inline uint32_t fuzz_touch(const void *p, size_t n)
{
    const volatile uint8_t *b = p;
    uint32_t s = 0;
    for (size_t i = 0; i < n; i++) s += b[i];
    return s;
}

/* KPL_FUZZ_VERBOSE=1 in the environment: say why a call refused an
 * input (to check that seeds get as deep as they should). */
static inline kpl_status fuzz_st(kpl_status st, const char *what)
{
    static int verbose = -1;
    if (verbose < 0) verbose = getenv("KPL_FUZZ_VERBOSE") != NULL;
    if (st < 0 && verbose) fprintf(stderr, "%s: %s\n", what, kpl_last_error());
    return st;
}

/* Each input starts from no error. */
static inline void fuzz_reset(void) { kpl_clear_error(); }

#endif /* KPL_FUZZ_COMMON_H */
