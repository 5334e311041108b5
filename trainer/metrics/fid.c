/*
 * fid.c — FID and Inception Score (fid.h, docs/fid.md): running feature
 * statistics, the Fréchet distance through symmetric eigendecompositions,
 * the Inception Score, and the statistics' cache file.  The feature
 * network is fid_net.c.
 *
 * Numbers: the sums are doubles, so the covariance (S - n mu mu^T) / (n - 1)
 * loses about log10(mean^2 / variance) digits of 16 to cancellation, which
 * penultimate activations (means and spreads of one order) never notice.
 */
#include "fid.h"
#include "dataio.h" /* kpl_crc32c */

#include <cblas.h>
#include <errno.h>
#include <fcntl.h>
#include <lapacke.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#define MAX_DIM 65536

struct kpl_fid_stats {
    int64_t dim;
    double *sums; /* 1 + dim + dim * dim: count, sum, sum of outer products */
    double *rows; /* ROWS x dim: a batch converted to double for dsyrk */
};

/* Rows converted to double at a time: enough for dsyrk to run at its
 * blocked speed, small beside the dim^2 sums. */
enum { ROWS = 256 };

static size_t sums_len(int64_t dim) { return (size_t)(1 + dim + dim * dim); }

kpl_status kpl_fid_stats_create(int64_t dim, kpl_fid_stats **out)
{
    KPL_CHECK(out, KPL_EINVAL, "fid_stats_create: out is NULL");
    *out = NULL;
    KPL_CHECK(dim >= 1 && dim <= MAX_DIM, KPL_EINVAL,
              "fid_stats_create: dim %lld not in [1, %d]", (long long)dim, MAX_DIM);
    kpl_fid_stats *s = calloc(1, sizeof *s);
    if (s) s->sums = calloc(sums_len(dim), sizeof *s->sums);
    if (s) s->rows = malloc((size_t)(ROWS * dim) * sizeof *s->rows);
    if (!s || !s->sums || !s->rows) {
        kpl_fid_stats_destroy(s);
        return KPL_ERROR(KPL_ENOMEM, "fid_stats_create: out of memory for dim %lld "
                         "(%.1f MiB of sums)", (long long)dim,
                         (double)sums_len(dim) * 8 / (1 << 20));
    }
    s->dim = dim;
    *out = s;
    return KPL_OK;
}

void kpl_fid_stats_destroy(kpl_fid_stats *s)
{
    if (!s) return;
    free(s->sums);
    free(s->rows);
    free(s);
}

void kpl_fid_stats_reset(kpl_fid_stats *s)
{
    if (s) memset(s->sums, 0, sums_len(s->dim) * sizeof *s->sums);
}

int64_t kpl_fid_stats_dim(const kpl_fid_stats *s) { return s ? s->dim : 0; }
int64_t kpl_fid_stats_count(const kpl_fid_stats *s) { return s ? (int64_t)s->sums[0] : 0; }
double *kpl_fid_stats_sums(kpl_fid_stats *s) { return s ? s->sums : NULL; }
size_t kpl_fid_stats_len(const kpl_fid_stats *s) { return s ? sums_len(s->dim) : 0; }

/* The lower triangle from the upper one (dsyrk writes one). */
static void mirror_upper(double *a, int64_t d)
{
    for (int64_t i = 1; i < d; i++)
        for (int64_t j = 0; j < i; j++) a[i * d + j] = a[j * d + i];
}

kpl_status kpl_fid_stats_add(kpl_fid_stats *s, const float *features, int64_t n)
{
    KPL_CHECK(s && (features || n == 0), KPL_EINVAL, "fid_stats_add: NULL argument");
    KPL_CHECK(n >= 0, KPL_EINVAL, "fid_stats_add: n %lld < 0", (long long)n);
    int64_t d = s->dim;
    for (int64_t i = 0; i < n; i++)
        for (int64_t j = 0; j < d; j++)
            KPL_CHECK(isfinite(features[i * d + j]), KPL_EINVAL,
                      "fid_stats_add: feature row %lld column %lld is %g (features must be "
                      "finite; nothing of this batch of %lld was added)", (long long)i,
                      (long long)j, (double)features[i * d + j], (long long)n);
    if (n == 0) return KPL_OK;
    double *sum = s->sums + 1, *outer = s->sums + 1 + d;
    for (int64_t at = 0; at < n; at += ROWS) {
        int64_t m = n - at < ROWS ? n - at : ROWS;
        for (int64_t i = 0; i < m * d; i++) s->rows[i] = features[at * d + i];
        for (int64_t i = 0; i < m; i++)
            for (int64_t j = 0; j < d; j++) sum[j] += s->rows[i * d + j];
        /* outer += rows^T rows, the upper triangle */
        cblas_dsyrk(CblasRowMajor, CblasUpper, CblasTrans, (int)d, (int)m, 1.0, s->rows, (int)d,
                    1.0, outer, (int)d);
    }
    mirror_upper(outer, d);
    s->sums[0] += (double)n;
    return KPL_OK;
}

kpl_status kpl_fid_stats_merge(kpl_fid_stats *a, const kpl_fid_stats *b)
{
    KPL_CHECK(a && b, KPL_EINVAL, "fid_stats_merge: NULL argument");
    KPL_CHECK(a->dim == b->dim, KPL_EINVAL, "fid_stats_merge: dims differ (%lld and %lld)",
              (long long)a->dim, (long long)b->dim);
    size_t len = sums_len(a->dim);
    for (size_t i = 0; i < len; i++) a->sums[i] += b->sums[i];
    return KPL_OK;
}

kpl_status kpl_fid_stats_moments(const kpl_fid_stats *s, double *mu, double *sigma)
{
    KPL_CHECK(s, KPL_EINVAL, "fid_stats_moments: NULL statistics");
    double n = s->sums[0];
    KPL_CHECK(n >= 2, KPL_EINVAL, "fid_stats_moments: %.0f samples: a covariance needs 2 or "
              "more", n);
    int64_t d = s->dim;
    const double *sum = s->sums + 1, *outer = s->sums + 1 + d;
    double *m = mu ? mu : malloc((size_t)d * sizeof *m);
    KPL_CHECK(m, KPL_ENOMEM, "fid_stats_moments: out of memory");
    for (int64_t j = 0; j < d; j++) m[j] = sum[j] / n;
    if (sigma)
        for (int64_t i = 0; i < d; i++)
            for (int64_t j = 0; j < d; j++)
                sigma[i * d + j] = (outer[i * d + j] - n * m[i] * m[j]) / (n - 1);
    if (!mu) free(m);
    return KPL_OK;
}

/* ---- the Fréchet distance ----------------------------------------------------------------- */

static kpl_status check_finite(const double *v, int64_t len, const char *what, int64_t dim)
{
    for (int64_t i = 0; i < len; i++)
        KPL_CHECK(isfinite(v[i]), KPL_EINVAL, "fid: %s[%lld][%lld] is %g (moments must be "
                  "finite)", what, (long long)(dim ? i / dim : i), (long long)(dim ? i % dim : 0),
                  v[i]);
    return KPL_OK;
}

/* Eigenvalues (ascending) into w and, with vectors, the orthonormal
 * eigenvectors into a's columns (row-major), of the symmetric a (its
 * upper triangle is read). */
static kpl_status sym_eig(double *a, int64_t d, double *w, bool vectors)
{
    lapack_int info = LAPACKE_dsyevd(LAPACK_ROW_MAJOR, vectors ? 'V' : 'N', 'U', (lapack_int)d,
                                     a, (lapack_int)d, w);
    KPL_CHECK(info == 0, info == LAPACK_WORK_MEMORY_ERROR ? KPL_ENOMEM : KPL_EBACKEND,
              "fid: LAPACK dsyevd of a %lldx%lld matrix failed (info %d%s)", (long long)d,
              (long long)d, (int)info, info > 0 ? ": no convergence" : "");
    return KPL_OK;
}

/* The sum of the square roots of the eigenvalues of the symmetric m (its
 * upper triangle is read; m is overwritten), negative ones, rounding of
 * zeros of a positive semi-definite matrix, counted as 0. */
static kpl_status sum_sqrt_eig(double *m, int64_t d, double *w, double *sum)
{
    KPL_TRY(sym_eig(m, d, w, false));
    double s = 0;
    for (int64_t j = 0; j < d; j++) s += sqrt(w[j] > 0 ? w[j] : 0);
    *sum = s;
    return KPL_OK;
}

/*
 * Tr (s1 s2)^(1/2): the sum of the square roots of the eigenvalues of s1
 * s2, which equal those of a symmetric positive semi-definite matrix
 * similar to it (docs/fid.md):
 *  - when s1 (or else s2) is positive definite, its Cholesky factor L (s1
 *    = L L^T) gives L^-1 (s1 s2) L = L^T s2 L: a factorisation and two
 *    triangular products, about 3 dim^3 flops before the eigenvalues;
 *  - else (fewer samples than dims, dead features) the eigendecomposition
 *    s1 = V D V^T, with W = V D^(1/2), gives s1^(1/2) s2 s1^(1/2) = V (W^T
 *    s2 W) V^T, whose eigenvalues are those of W^T s2 W; D's negative
 *    entries, rounding of zeros, count as 0.  About 10 dim^3 flops.
 * The eigenvalues of the last symmetric matrix are taken without vectors.
 * Everything runs on BLAS/LAPACK's threads.
 */
static kpl_status trace_sqrt_product(int64_t d, const double *s1, const double *s2, double *tr)
{
    size_t dd = (size_t)(d * d);
    double *v = malloc(dd * sizeof *v), *t = malloc(dd * sizeof *t);
    double *m = malloc(dd * sizeof *m), *w = malloc((size_t)d * sizeof *w);
    kpl_status st = KPL_OK;
    if (!v || !t || !m || !w) {
        st = KPL_ERROR(KPL_ENOMEM, "fid: out of memory for %lldx%lld matrices", (long long)d,
                       (long long)d);
        goto done;
    }
    for (int k = 0; k < 2; k++) {
        const double *a = k ? s2 : s1, *b = k ? s1 : s2;
        memcpy(v, a, dd * sizeof *v);
        lapack_int info = LAPACKE_dpotrf(LAPACK_ROW_MAJOR, 'L', (lapack_int)d, v, (lapack_int)d);
        if (info > 0) continue; /* not positive definite */
        if (info < 0) {
            st = KPL_ERROR(KPL_EBACKEND, "fid: LAPACK dpotrf failed (info %d)", (int)info);
            goto done;
        }
        /* t = L^T b L, lower triangle of v */
        memcpy(t, b, dd * sizeof *t);
        cblas_dtrmm(CblasRowMajor, CblasRight, CblasLower, CblasNoTrans, CblasNonUnit, (int)d,
                    (int)d, 1.0, v, (int)d, t, (int)d);
        cblas_dtrmm(CblasRowMajor, CblasLeft, CblasLower, CblasTrans, CblasNonUnit, (int)d, (int)d,
                    1.0, v, (int)d, t, (int)d);
        st = sum_sqrt_eig(t, d, w, tr);
        goto done;
    }
    memcpy(v, s1, dd * sizeof *v);
    if ((st = sym_eig(v, d, w, true)) < 0) goto done;
    for (int64_t j = 0; j < d; j++) { /* W = V D^(1/2): column j scaled */
        double r = sqrt(w[j] > 0 ? w[j] : 0);
        for (int64_t i = 0; i < d; i++) v[i * d + j] *= r;
    }
    /* m = W^T (s2 W) */
    cblas_dsymm(CblasRowMajor, CblasLeft, CblasUpper, (int)d, (int)d, 1.0, s2, (int)d, v, (int)d,
                0.0, t, (int)d);
    cblas_dgemm(CblasRowMajor, CblasTrans, CblasNoTrans, (int)d, (int)d, (int)d, 1.0, v, (int)d,
                t, (int)d, 0.0, m, (int)d);
    st = sum_sqrt_eig(m, d, w, tr);
done:
    free(v);
    free(t);
    free(m);
    free(w);
    return st;
}

kpl_status kpl_fid_from_moments(int64_t dim, const double *mu1, const double *s1,
                                const double *mu2, const double *s2, double *fid)
{
    KPL_CHECK(mu1 && s1 && mu2 && s2 && fid, KPL_EINVAL, "fid: NULL argument");
    KPL_CHECK(dim >= 1 && dim <= MAX_DIM, KPL_EINVAL, "fid: dim %lld not in [1, %d]",
              (long long)dim, MAX_DIM);
    KPL_TRY(check_finite(mu1, dim, "mu1", 0));
    KPL_TRY(check_finite(mu2, dim, "mu2", 0));
    KPL_TRY(check_finite(s1, dim * dim, "sigma1", dim));
    KPL_TRY(check_finite(s2, dim * dim, "sigma2", dim));
    double diff = 0, tr1 = 0, tr2 = 0, trs = 0;
    for (int64_t i = 0; i < dim; i++) {
        diff += (mu1[i] - mu2[i]) * (mu1[i] - mu2[i]);
        tr1 += s1[i * dim + i];
        tr2 += s2[i * dim + i];
    }
    KPL_TRY(trace_sqrt_product(dim, s1, s2, &trs));
    *fid = diff + tr1 + tr2 - 2 * trs;
    return KPL_OK;
}

kpl_status kpl_fid(const kpl_fid_stats *a, const kpl_fid_stats *b, double *fid)
{
    KPL_CHECK(a && b && fid, KPL_EINVAL, "fid: NULL argument");
    KPL_CHECK(a->dim == b->dim, KPL_EINVAL, "fid: the two statistics have different dims "
              "(%lld and %lld)", (long long)a->dim, (long long)b->dim);
    KPL_CHECK(a->sums[0] >= 2 && b->sums[0] >= 2, KPL_EINVAL, "fid: the %s statistics have %.0f "
              "samples: a covariance needs 2 or more", a->sums[0] < 2 ? "first" : "second",
              a->sums[0] < 2 ? a->sums[0] : b->sums[0]);
    int64_t d = a->dim;
    size_t dd = (size_t)(d * d);
    double *mu = malloc(2 * (size_t)d * sizeof *mu), *sg = malloc(2 * dd * sizeof *sg);
    kpl_status st = mu && sg ? KPL_OK : KPL_ERROR(KPL_ENOMEM, "fid: out of memory");
    if (st >= 0) st = kpl_fid_stats_moments(a, mu, sg);
    if (st >= 0) st = kpl_fid_stats_moments(b, mu + d, sg + dd);
    if (st >= 0) st = kpl_fid_from_moments(d, mu, sg, mu + d, sg + dd, fid);
    free(mu);
    free(sg);
    return st;
}

/* ---- Inception Score ---------------------------------------------------------------------- */

kpl_status kpl_inception_score(const float *probs, int64_t n, int64_t classes, int splits,
                               double *mean, double *std)
{
    KPL_CHECK(probs && mean && std, KPL_EINVAL, "inception_score: NULL argument");
    KPL_CHECK(classes >= 1, KPL_EINVAL, "inception_score: %lld classes", (long long)classes);
    KPL_CHECK(splits >= 1 && n >= splits, KPL_EINVAL,
              "inception_score: %lld rows in %d splits (want splits >= 1 and a row or more in "
              "each)", (long long)n, splits);
    for (int64_t i = 0; i < n; i++) {
        double sum = 0;
        for (int64_t c = 0; c < classes; c++) {
            float p = probs[i * classes + c];
            KPL_CHECK(isfinite(p) && p >= 0, KPL_EINVAL, "inception_score: row %lld class %lld "
                      "is %g (probabilities are finite and >= 0)", (long long)i, (long long)c,
                      (double)p);
            sum += p;
        }
        KPL_CHECK(fabs(sum - 1) <= 1e-3, KPL_EINVAL, "inception_score: row %lld sums to %.6g, "
                  "not 1 (pass softmax probabilities, not logits)", (long long)i, sum);
    }
    double *py = malloc((size_t)classes * sizeof *py), *score = malloc((size_t)splits * sizeof *score);
    if (!py || !score) {
        free(py);
        free(score);
        return KPL_ERROR(KPL_ENOMEM, "inception_score: out of memory");
    }
    for (int k = 0; k < splits; k++) {
        int64_t lo = k * n / splits, hi = (k + 1) * n / splits;
        for (int64_t c = 0; c < classes; c++) py[c] = 0;
        for (int64_t i = lo; i < hi; i++)
            for (int64_t c = 0; c < classes; c++) py[c] += probs[i * classes + c];
        for (int64_t c = 0; c < classes; c++) py[c] /= (double)(hi - lo);
        double kl = 0;
        for (int64_t i = lo; i < hi; i++)
            for (int64_t c = 0; c < classes; c++) {
                double p = probs[i * classes + c];
                if (p > 0) kl += p * (log(p) - log(py[c])); /* py[c] >= p / (hi - lo) > 0 */
            }
        score[k] = exp(kl / (double)(hi - lo));
    }
    double m = 0, v = 0;
    for (int k = 0; k < splits; k++) m += score[k];
    m /= splits;
    for (int k = 0; k < splits; k++) v += (score[k] - m) * (score[k] - m);
    *mean = m;
    *std = sqrt(v / splits);
    free(py);
    free(score);
    return KPL_OK;
}

/* ---- the statistics' file ------------------------------------------------------------------ */
/*
 * Little-endian: "KPLFIDST", u32 version (1), u32 tag bytes (T <= 1023),
 * i64 dim, u32 CRC32C of the sums, u32 CRC32C of the 28 bytes before it;
 * then the tag (T bytes, no NUL) and the 1 + dim + dim^2 sums as f64.
 * The header's CRC covers the tag too (it is extended over it).
 */
#define STATS_MAGIC "KPLFIDST"
enum { STATS_VERSION = 1, STATS_HEADER = 32, TAG_MAX = 1023 };

static void put32(unsigned char *p, uint32_t v)
{
    for (int i = 0; i < 4; i++) p[i] = (unsigned char)(v >> (8 * i));
}

static uint32_t get32(const unsigned char *p)
{
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

static uint32_t header_crc(const unsigned char *h, const char *tag, size_t tlen)
{
    return kpl_crc32c(kpl_crc32c(0, h, 28), tag, tlen);
}

kpl_status kpl_fid_stats_save(const kpl_fid_stats *s, const char *tag, const char *path)
{
    KPL_CHECK(s && path, KPL_EINVAL, "fid_stats_save: NULL argument");
    size_t tlen = tag ? strlen(tag) : 0;
    KPL_CHECK(tlen <= TAG_MAX, KPL_EINVAL, "fid_stats_save: tag of %zu bytes (at most %d)", tlen,
              TAG_MAX);
    size_t bytes = sums_len(s->dim) * sizeof(double);
    unsigned char h[STATS_HEADER];
    memcpy(h, STATS_MAGIC, 8);
    put32(h + 8, STATS_VERSION);
    put32(h + 12, (uint32_t)tlen);
    put32(h + 16, (uint32_t)((uint64_t)s->dim & 0xffffffffu));
    put32(h + 20, (uint32_t)((uint64_t)s->dim >> 32));
    put32(h + 24, kpl_crc32c(0, s->sums, bytes)); /* the host is little-endian (x86, arm64) */
    put32(h + 28, header_crc(h, tag, tlen));
    kpl__afile a;
    KPL_TRY(kpl__afile_open(&a, path));
    kpl_status st = kpl__write_all(a.fd, h, sizeof h, a.tmp);
    if (st >= 0 && tlen) st = kpl__write_all(a.fd, tag, tlen, a.tmp);
    if (st >= 0) st = kpl__write_all(a.fd, s->sums, bytes, a.tmp);
    if (st < 0) {
        kpl__afile_abort(&a);
        return st;
    }
    return kpl__afile_commit(&a);
}

/* Exactly n bytes at the file's position: KPL_EFORMAT for a short file. */
static kpl_status read_exact(int fd, void *buf, size_t n, const char *path, const char *what)
{
    char *p = buf;
    while (n) {
        ssize_t r = read(fd, p, n);
        if (r < 0 && errno == EINTR) continue;
        if (r < 0) return KPL_ERROR(KPL_EIO, "%s: read failed: %s", path, strerror(errno));
        if (r == 0) return KPL_ERROR(KPL_EFORMAT, "%s: truncated (in the %s)", path, what);
        p += r;
        n -= (size_t)r;
    }
    return KPL_OK;
}

kpl_status kpl_fid_stats_load(const char *path, kpl_fid_stats **out, char *tag, size_t len)
{
    KPL_CHECK(path && out, KPL_EINVAL, "fid_stats_load: NULL argument");
    *out = NULL;
    if (tag && len) tag[0] = 0;
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return KPL_ERROR(errno == ENOENT ? KPL_ENOTFOUND : KPL_EIO, "%s: cannot open: %s", path,
                         strerror(errno));
    unsigned char h[STATS_HEADER];
    char t[TAG_MAX + 1];
    kpl_fid_stats *s = NULL;
    kpl_status st = read_exact(fd, h, sizeof h, path, "header");
    if (st < 0) goto done;
    if (memcmp(h, STATS_MAGIC, 8) != 0) {
        st = KPL_ERROR(KPL_EFORMAT, "%s: not a FID statistics file (no KPLFIDST magic)", path);
        goto done;
    }
    uint32_t version = get32(h + 8), tlen = get32(h + 12);
    if (version != STATS_VERSION) {
        st = KPL_ERROR(KPL_EFORMAT, "%s: FID statistics format version %u (this kpl reads %d)",
                       path, version, STATS_VERSION);
        goto done;
    }
    if (tlen > TAG_MAX) {
        st = KPL_ERROR(KPL_EFORMAT, "%s: damaged header (tag of %u bytes)", path, tlen);
        goto done;
    }
    if ((st = read_exact(fd, t, tlen, path, "tag")) < 0) goto done;
    t[tlen] = 0;
    if (get32(h + 28) != header_crc(h, t, tlen)) {
        st = KPL_ERROR(KPL_EFORMAT, "%s: header checksum mismatch: the file is damaged", path);
        goto done;
    }
    int64_t dim = (int64_t)((uint64_t)get32(h + 16) | (uint64_t)get32(h + 20) << 32);
    if (dim < 1 || dim > MAX_DIM) {
        st = KPL_ERROR(KPL_EFORMAT, "%s: dim %lld not in [1, %d]", path, (long long)dim, MAX_DIM);
        goto done;
    }
    struct stat sb;
    size_t bytes = sums_len(dim) * sizeof(double);
    if (fstat(fd, &sb) == 0 && (uint64_t)sb.st_size != STATS_HEADER + tlen + bytes) {
        st = KPL_ERROR(KPL_EFORMAT, "%s: %lld bytes, expected %zu for dim %lld", path,
                       (long long)sb.st_size, STATS_HEADER + tlen + bytes, (long long)dim);
        goto done;
    }
    if ((st = kpl_fid_stats_create(dim, &s)) < 0) goto done;
    if ((st = read_exact(fd, s->sums, bytes, path, "sums")) < 0) goto done;
    if (kpl_crc32c(0, s->sums, bytes) != get32(h + 24)) {
        st = KPL_ERROR(KPL_EFORMAT, "%s: checksum mismatch in the sums: the file is damaged",
                       path);
        goto done;
    }
    if (tag && len) snprintf(tag, len, "%s", t);
    *out = s;
    s = NULL;
done:
    kpl_fid_stats_destroy(s);
    close(fd);
    return st;
}
