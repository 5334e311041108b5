/* test_fid.c — FID and the Inception Score (trainer/fid.h).
 *
 * The distance against pytorch-fid's formula (scipy.linalg.sqrtm, its eps
 * offset) run by fid_ref.py on the same features: dims 64 and 256, a
 * near-singular case with fewer samples than dims; equal sets; a shift of
 * the mean alone; Gaussians whose FID is known in closed form; statistics
 * merged from halves (the all-reduce path); the Inception Score against
 * numpy and in closed form; the statistics file; bad input.  Then the
 * feature network: made once by `kpl data fid-net` (a short training in
 * that process, the file appearing whole, its run directory gone), its
 * features and probabilities against the model run by hand, the resize
 * and channel paths, Fashion-MNIST's test images classified well above
 * chance, and its errors; the command again on the file it made (reported,
 * not trained), stopped by SIGINT (nothing left at its output), and its
 * usage errors.  The comparisons with scipy are skipped when
 * /usr/bin/python3 lacks it. */
#include "kpl_test.h"
#include "trainer.h"

#include <fcntl.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>
#include <zlib.h>

#define FM "/usr/share/datasets/fashion-mnist"
#define RECIPE KPL_SOURCE_DIR "/recipes/fashion_mnist/cnn.yaml"

static char tmp[256]; /* this run's files */

/* ---- deterministic data ----------------------------------------------------------------- */

/* n numbers from kpl's Philox (the same every run): N(0, 1), or U(0, 1)
 * with `uniform`, into out (float or double: one of the two is NULL). */
static kpl_rng *rng;
static void draw(int64_t n, bool uniform, float *f, double *d)
{
    kpl_tensor *t = NULL;
    OK(kpl_tensor_empty(kpl_device_cpu(), KPL_F32, 1, &n, &t));
    OK(uniform ? kpl_k_uniform(t, rng, 0, 1) : kpl_k_normal(t, rng, 0, 1));
    const float *v = kpl_tensor_host_data(t);
    for (int64_t i = 0; i < n; i++) {
        if (f) f[i] = v[i];
        if (d) d[i] = v[i];
    }
    kpl_tensor_release(t);
}

static void reseed(uint64_t seed)
{
    kpl_rng_destroy(rng);
    rng = kpl_rng_create(seed);
    assert_non_null(rng);
}

/* n rows of x = M z + mu, z ~ N(0, I): a correlated Gaussian whose mixing
 * M (entries N(0, 1 / dim), plus the identity) and mean come from `seed`,
 * and whose samples come from `sample_seed`. */
static float *gaussian_rows(int64_t n, int64_t dim, uint64_t seed, uint64_t sample_seed)
{
    double *m = malloc((size_t)(dim * dim) * sizeof *m), *mu = malloc((size_t)dim * sizeof *mu);
    double *z = malloc((size_t)(n * dim) * sizeof *z);
    float *x = malloc((size_t)(n * dim) * sizeof *x);
    assert_true(m && mu && z && x);
    reseed(seed);
    draw(dim * dim, false, NULL, m);
    draw(dim, false, NULL, mu);
    for (int64_t i = 0; i < dim * dim; i++) m[i] /= sqrt((double)dim);
    for (int64_t i = 0; i < dim; i++) m[i * dim + i] += 1;
    reseed(1000 + sample_seed);
    draw(n * dim, false, NULL, z);
    for (int64_t r = 0; r < n; r++)
        for (int64_t i = 0; i < dim; i++) {
            double v = mu[i];
            for (int64_t j = 0; j < dim; j++) v += m[i * dim + j] * z[r * dim + j];
            x[r * dim + i] = (float)v;
        }
    free(m);
    free(mu);
    free(z);
    return x;
}

/* Statistics of x, added in batches of 100 (several dsyrk calls). */
static kpl_fid_stats *stats_of(const float *x, int64_t n, int64_t dim)
{
    kpl_fid_stats *s = NULL;
    OK(kpl_fid_stats_create(dim, &s));
    for (int64_t at = 0; at < n; at += 100) OK(kpl_fid_stats_add(s, x + at * dim, n - at < 100 ? n - at : 100));
    assert_int_equal(kpl_fid_stats_count(s), n);
    return s;
}

/* ---- the Python reference --------------------------------------------------------------- */

static void write_f32(const char *path, const float *v, int64_t n)
{
    FILE *f = fopen(path, "wb");
    assert_non_null(f);
    assert_int_equal(fwrite(v, sizeof *v, (size_t)n, f), (size_t)n);
    assert_int_equal(fclose(f), 0);
}

static bool have_scipy(void)
{
    static int have = -1;
    if (have < 0)
        have = system("/usr/bin/python3 -c 'import numpy, scipy.linalg' 2>/dev/null") == 0;
    return have;
}

/* Runs fid_ref.py with args; the number after "key": in its output. */
static double ref_value(const char *args, const char *key)
{
    char cmd[2048], line[4096] = "", pat[64];
    snprintf(cmd, sizeof cmd, "/usr/bin/python3 '%s' %s", FID_REF, args);
    FILE *p = popen(cmd, "r");
    assert_non_null(p);
    char *got = fgets(line, sizeof line, p);
    int rc = pclose(p);
    if (!got || rc != 0) fail_msg("%s failed (status %d): %s", cmd, rc, line);
    snprintf(pat, sizeof pat, "\"%s\": ", key);
    const char *at = strstr(line, pat);
    if (!at) fail_msg("%s: no %s in %s", cmd, key, line);
    if (!strncmp(at + strlen(pat), "true", 4)) return 1;
    if (!strncmp(at + strlen(pat), "false", 5)) return 0;
    return strtod(at + strlen(pat), NULL);
}

/* ---- the distance ----------------------------------------------------------------------- */

/* dead: features 0, 3, 6, ... below 3 dead are 0 in every sample of both
 * sets (ReLU units that never fire): both covariances share a null space. */
static void compare_with_scipy(int64_t dim, int64_t na, int64_t nb, int64_t dead,
                               const char *what)
{
    float *a = gaussian_rows(na, dim, 1, 11), *b = gaussian_rows(nb, dim, 2, 22);
    for (int64_t j = 0; j < 3 * dead; j += 3) {
        for (int64_t i = 0; i < na; i++) a[i * dim + j] = 0;
        for (int64_t i = 0; i < nb; i++) b[i * dim + j] = 0;
    }
    kpl_fid_stats *sa = stats_of(a, na, dim), *sb = stats_of(b, nb, dim);
    double fid = 0;
    double t0 = kpl_seconds();
    OK(kpl_fid(sa, sb, &fid));
    double secs = kpl_seconds() - t0;
    char pa[512], pb[512], args[1300];
    snprintf(pa, sizeof pa, "%s/a.f32", tmp);
    snprintf(pb, sizeof pb, "%s/b.f32", tmp);
    write_f32(pa, a, na * dim);
    write_f32(pb, b, nb * dim);
    snprintf(args, sizeof args, "fid %lld '%s' '%s'", (long long)dim, pa, pb);
    double ref = ref_value(args, "fid"), eigh = ref_value(args, "fid_eigh");
    double offset = ref_value(args, "offset");
    print_message("%s: dim %lld, %lld and %lld samples: kpl %.10g (%.3f s), scipy sqrtm %.10g%s, "
                  "numpy eigh %.10g\n", what, (long long)dim, (long long)na, (long long)nb, fid,
                  secs, ref, offset ? " (with pytorch-fid's eps offset)" : "", eigh);
    assert_close(fid, ref, 1e-3, 0, "fid vs scipy", dim);
    /* the same method in numpy: equal but for the square roots of the
     * rounding left in zero eigenvalues (singular covariances) */
    assert_close(fid, eigh, na < dim || dead ? 1e-7 : 1e-9, 0, "fid vs numpy eigh", dim);
    kpl_fid_stats_destroy(sa);
    kpl_fid_stats_destroy(sb);
    free(a);
    free(b);
}

static void test_fid_scipy_64(void **state)
{
    (void)state;
    if (!have_scipy()) KPL_SKIP(KPL_TEST_SKIP_REF, "numpy/scipy for /usr/bin/python3 (python3-scipy)");
    compare_with_scipy(64, 1000, 1000, 0, "two Gaussians");
}

static void test_fid_scipy_256(void **state)
{
    (void)state;
    if (!have_scipy()) KPL_SKIP(KPL_TEST_SKIP_REF, "numpy/scipy for /usr/bin/python3 (python3-scipy)");
    compare_with_scipy(256, 5000, 5000, 0, "two Gaussians");
}

/* Fewer samples than dims: both covariances are singular (rank n - 1). */
static void test_fid_scipy_singular(void **state)
{
    (void)state;
    if (!have_scipy()) KPL_SKIP(KPL_TEST_SKIP_REF, "numpy/scipy for /usr/bin/python3 (python3-scipy)");
    compare_with_scipy(64, 40, 50, 0, "near-singular");
}

/* Dead features: both covariances share a null space, the case
 * pytorch-fid's eps I offset is for (scipy 1.10's sqrtm copes without
 * it here). */
static void test_fid_scipy_dead(void **state)
{
    (void)state;
    if (!have_scipy()) KPL_SKIP(KPL_TEST_SKIP_REF, "numpy/scipy for /usr/bin/python3 (python3-scipy)");
    compare_with_scipy(64, 1000, 1000, 8, "8 dead features");
}

/* The same set twice: 0, up to rounding, on the scale of the traces. */
static void test_fid_equal(void **state)
{
    (void)state;
    int64_t dim = 128, n = 2000;
    float *a = gaussian_rows(n, dim, 3, 33);
    kpl_fid_stats *s1 = stats_of(a, n, dim), *s2 = NULL;
    OK(kpl_fid_stats_create(dim, &s2));
    OK(kpl_fid_stats_add(s2, a, n)); /* one batch: other rounding */
    double *mu = malloc((size_t)dim * sizeof *mu), *sg = malloc((size_t)(dim * dim) * sizeof *sg);
    OK(kpl_fid_stats_moments(s1, mu, sg));
    double scale = 0;
    for (int64_t i = 0; i < dim; i++) scale += 2 * sg[i * dim + i];
    double same = 1, other = 1;
    OK(kpl_fid(s1, s1, &same));
    OK(kpl_fid(s1, s2, &other));
    print_message("equal sets: FID %.3g and %.3g (traces %.4g)\n", same, other, scale);
    assert_true(fabs(same) < 1e-6 * scale);
    assert_true(fabs(other) < 1e-6 * scale);
    free(mu);
    free(sg);
    kpl_fid_stats_destroy(s1);
    kpl_fid_stats_destroy(s2);
    free(a);
}

/* b = a + delta: equal covariances, FID = |delta|^2. */
static void test_fid_shift(void **state)
{
    (void)state;
    int64_t dim = 64, n = 1000;
    float *a = gaussian_rows(n, dim, 4, 44), *b = malloc((size_t)(n * dim) * sizeof *b);
    double want = 0, delta[64];
    for (int64_t j = 0; j < dim; j++) delta[j] = 0.25 * (double)(j % 7) - 0.5, want += delta[j] * delta[j];
    for (int64_t i = 0; i < n * dim; i++) b[i] = (float)(a[i] + delta[i % dim]);
    kpl_fid_stats *sa = stats_of(a, n, dim), *sb = stats_of(b, n, dim);
    double fid = 0;
    OK(kpl_fid(sa, sb, &fid));
    print_message("shifted means: FID %.12g, |delta|^2 %.12g\n", fid, want);
    assert_close(fid, want, 1e-5, 0, "shift", 0);
    kpl_fid_stats_destroy(sa);
    kpl_fid_stats_destroy(sb);
    free(a);
    free(b);
}

/* Commuting covariances: S1 = Q D1 Q^T, S2 = Q D2 Q^T give |mu1 - mu2|^2
 * + sum (sqrt d1 - sqrt d2)^2: positive definite (S1's Cholesky factor),
 * S1 singular (S2's), both singular (the eigendecomposition). */
static void closed_form(bool singular1, bool singular2)
{
    bool singular = singular1 || singular2;
    enum { D = 48 };
    static double q[D * D], s1[D * D], s2[D * D], mu1[D], mu2[D], d1[D], d2[D];
    reseed(5);
    /* Q: Householder reflection I - 2 v v^T / |v|^2 (orthogonal, dense) */
    double v[D], vv = 0, u1[D], u2[D];
    draw(D, false, NULL, v);
    draw(D, false, NULL, mu1);
    draw(D, false, NULL, mu2);
    draw(D, true, NULL, u1);
    draw(D, true, NULL, u2);
    for (int i = 0; i < D; i++) vv += v[i] * v[i];
    for (int i = 0; i < D; i++)
        for (int j = 0; j < D; j++) q[i * D + j] = (i == j) - 2 * v[i] * v[j] / vv;
    double want = 0;
    for (int k = 0; k < D; k++) {
        d1[k] = singular1 && k % 5 == 0 ? 0 : 0.1 + u1[k] * 3;
        d2[k] = singular2 && k % 7 == 0 ? 0 : 0.1 + u2[k] * 3;
        want += (sqrt(d1[k]) - sqrt(d2[k])) * (sqrt(d1[k]) - sqrt(d2[k]));
        want += (mu1[k] - mu2[k]) * (mu1[k] - mu2[k]);
    }
    for (int i = 0; i < D; i++)
        for (int j = 0; j < D; j++) {
            double a = 0, b = 0;
            for (int k = 0; k < D; k++) a += q[i * D + k] * d1[k] * q[j * D + k], b += q[i * D + k] * d2[k] * q[j * D + k];
            s1[i * D + j] = a, s2[i * D + j] = b;
        }
    double fid = 0;
    OK(kpl_fid_from_moments(D, mu1, s1, mu2, s2, &fid));
    print_message("closed form, %s: FID %.15g, expected %.15g\n",
                  singular2 ? "both singular" : singular1 ? "S1 singular" : "positive definite",
                  fid, want);
    /* a zero eigenvalue comes out as rounding, about 1e-16 of the largest,
     * whose square root (1e-8) is the error of each: a few 1e-7 here */
    double tol = singular ? 1e-8 : 1e-12;
    assert_close(fid, want, tol, 0, "closed form", 0);
    /* symmetric in its arguments */
    double back = 0;
    OK(kpl_fid_from_moments(D, mu2, s2, mu1, s1, &back));
    assert_close(back, want, tol, 0, "closed form, swapped", 0);
}

static void test_fid_closed_form(void **state)
{
    (void)state;
    closed_form(false, false);
    closed_form(true, false);
    closed_form(true, true);
}

/* Sums of two halves, added element-wise as the all-reduce adds them,
 * are the sums of the whole. */
static void test_merge_halves(void **state)
{
    (void)state;
    int64_t dim = 32, n = 999, h = 400;
    float *a = gaussian_rows(n, dim, 6, 66), *b = gaussian_rows(n, dim, 7, 77);
    kpl_fid_stats *whole = stats_of(a, n, dim), *lo = stats_of(a, h, dim);
    kpl_fid_stats *hi = stats_of(a + h * dim, n - h, dim), *other = stats_of(b, n, dim);
    kpl_fid_stats *merged = stats_of(a, h, dim);
    size_t len = kpl_fid_stats_len(whole);
    assert_int_equal(len, 1 + 32 + 32 * 32);
    /* the all-reduce path: the raw arrays summed in place */
    double *sl = kpl_fid_stats_sums(lo);
    const double *sh = kpl_fid_stats_sums(hi), *sw = kpl_fid_stats_sums(whole);
    for (size_t i = 0; i < len; i++) sl[i] += sh[i];
    OK(kpl_fid_stats_merge(merged, hi));
    const double *sm = kpl_fid_stats_sums(merged);
    for (size_t i = 0; i < len; i++) {
        assert_close(sl[i], sw[i], 1e-12, 1e-9, "all-reduced sums", (int64_t)i);
        assert_true(sm[i] == sl[i]);
    }
    assert_int_equal(kpl_fid_stats_count(lo), n);
    double f1 = 0, f2 = 0;
    OK(kpl_fid(whole, other, &f1));
    OK(kpl_fid(lo, other, &f2));
    assert_close(f2, f1, 1e-10, 0, "fid of merged halves", 0);
    /* the outer products are symmetric, both triangles kept */
    for (int64_t i = 0; i < dim; i++)
        for (int64_t j = 0; j < dim; j++)
            assert_true(sw[1 + dim + i * dim + j] == sw[1 + dim + j * dim + i]);
    kpl_fid_stats_reset(lo);
    assert_int_equal(kpl_fid_stats_count(lo), 0);
    for (kpl_fid_stats **s = (kpl_fid_stats *[]){whole, lo, hi, other, merged, NULL}; *s; s++)
        kpl_fid_stats_destroy(*s);
    free(a);
    free(b);
}

/* numpy.cov(rowvar=False) of three rows, by hand. */
static void test_moments(void **state)
{
    (void)state;
    const float x[6] = {1, 2, 3, 6, 5, 1};
    kpl_fid_stats *s = NULL;
    OK(kpl_fid_stats_create(2, &s));
    OK(kpl_fid_stats_add(s, x, 3));
    OK(kpl_fid_stats_add(s, x, 0));
    double mu[2], sg[4];
    OK(kpl_fid_stats_moments(s, mu, sg));
    assert_close(mu[0], 3, 1e-15, 0, "mu", 0);
    assert_close(mu[1], 3, 1e-15, 0, "mu", 1);
    /* deviations (-2, -1), (0, 3), (2, -2): sums 8, -2, -2, 14 over n - 1 = 2 */
    const double want[4] = {4, -1, -1, 7};
    for (int i = 0; i < 4; i++) assert_close(sg[i], want[i], 1e-14, 1e-14, "sigma", i);
    OK(kpl_fid_stats_moments(s, NULL, sg));
    kpl_fid_stats_destroy(s);
}

static void test_errors(void **state)
{
    (void)state;
    kpl_fid_stats *a = NULL, *b = NULL, *c = NULL;
    FAILS(kpl_fid_stats_create(0, &a), KPL_EINVAL, "dim 0");
    OK(kpl_fid_stats_create(2, &a));
    OK(kpl_fid_stats_create(3, &b));
    OK(kpl_fid_stats_create(2, &c));
    const float x[6] = {1, 2, 3, 4, 5, 6}, bad[6] = {1, 2, NAN, 4, 5, 6};
    double fid, mu[2], sg[4];
    FAILS(kpl_fid(a, c, &fid), KPL_EINVAL, "the first statistics have 0 samples");
    OK(kpl_fid_stats_add(a, x, 1));
    FAILS(kpl_fid_stats_moments(a, mu, sg), KPL_EINVAL, "1 samples: a covariance needs 2");
    OK(kpl_fid_stats_add(a, x, 3));
    OK(kpl_fid_stats_add(b, x, 2));
    FAILS(kpl_fid(a, b, &fid), KPL_EINVAL, "different dims (2 and 3)");
    FAILS(kpl_fid_stats_merge(a, b), KPL_EINVAL, "dims differ");
    FAILS(kpl_fid(a, c, &fid), KPL_EINVAL, "the second statistics have 0 samples");
    FAILS(kpl_fid_stats_add(c, bad, 3), KPL_EINVAL, "row 1 column 0 is nan");
    assert_int_equal(kpl_fid_stats_count(c), 0); /* nothing of the batch went in */
    FAILS(kpl_fid_stats_add(c, x, -1), KPL_EINVAL, "n -1");
    OK(kpl_fid_stats_moments(a, mu, sg));
    sg[1] = INFINITY;
    FAILS(kpl_fid_from_moments(2, mu, sg, mu, sg, &fid), KPL_EINVAL, "sigma1[0][1] is inf");
    FAILS(kpl_fid_from_moments(0, mu, sg, mu, sg, &fid), KPL_EINVAL, "dim 0");
    /* the Inception Score's input */
    const float p[6] = {0.5f, 0.5f, 1, 0, 0.2f, 0.8f};
    double m, sd;
    FAILS(kpl_inception_score(p, 3, 2, 0, &m, &sd), KPL_EINVAL, "3 rows in 0 splits");
    FAILS(kpl_inception_score(p, 3, 2, 4, &m, &sd), KPL_EINVAL, "3 rows in 4 splits");
    const float q[4] = {0.5f, 0.6f, 1, 0}, r[4] = {1.5f, -0.5f, 1, 0};
    FAILS(kpl_inception_score(q, 2, 2, 1, &m, &sd), KPL_EINVAL, "row 0 sums to 1.1");
    FAILS(kpl_inception_score(r, 2, 2, 1, &m, &sd), KPL_EINVAL, "row 0 class 1 is -0.5");
    kpl_fid_stats_destroy(a);
    kpl_fid_stats_destroy(b);
    kpl_fid_stats_destroy(c);
}

/* ---- the Inception Score ----------------------------------------------------------------- */

static void test_inception_score(void **state)
{
    (void)state;
    /* closed form: parts holding every class equally, each row certain -> classes */
    enum { C = 10 };
    static float p[1003 * C];
    memset(p, 0, sizeof p);
    for (int i = 0; i < 100; i++) p[i * C + i % C] = 1;
    double m = 0, sd = 1;
    OK(kpl_inception_score(p, 100, C, 10, &m, &sd));
    assert_close(m, C, 1e-12, 0, "IS of certain, balanced rows", 0);
    assert_close(sd, 0, 0, 1e-12, "its std", 0);
    for (int i = 0; i < 100; i++) /* the same distribution everywhere -> 1 */
        for (int c = 0; c < C; c++) p[i * C + c] = 1.0f / C;
    OK(kpl_inception_score(p, 100, C, 7, &m, &sd));
    assert_close(m, 1, 1e-6, 0, "IS of equal rows", 0);
    /* against numpy: 1003 rows (parts of 100 and 101), softmax rows with zeros */
    reseed(9);
    for (int i = 0; i < 1003; i++) {
        double e[C], s = 0;
        draw(C, false, NULL, e);
        for (int c = 0; c < C; c++) e[c] = (i + c) % 11 == 0 ? 0 : exp(3 * e[c]), s += e[c];
        for (int c = 0; c < C; c++) p[i * C + c] = (float)(e[c] / s);
    }
    OK(kpl_inception_score(p, 1003, C, 10, &m, &sd));
    print_message("IS of 1003 rows in 10 splits: %.12g +- %.12g\n", m, sd);
    if (!have_scipy()) KPL_SKIP(KPL_TEST_SKIP_REF, "numpy/scipy for /usr/bin/python3 (python3-scipy)");
    char path[512], args[700];
    snprintf(path, sizeof path, "%s/p.f32", tmp);
    write_f32(path, p, 1003 * C);
    snprintf(args, sizeof args, "is %d 10 '%s'", C, path);
    assert_close(m, ref_value(args, "mean"), 1e-10, 0, "IS mean vs numpy", 0);
    assert_close(sd, ref_value(args, "std"), 1e-8, 1e-12, "IS std vs numpy", 0);
}

/* ---- the statistics' file ---------------------------------------------------------------- */

static void damage(const char *path, long at, int byte)
{
    int fd = open(path, O_WRONLY);
    assert_true(fd >= 0);
    unsigned char c = (unsigned char)byte;
    assert_int_equal(pwrite(fd, &c, 1, at), 1);
    close(fd);
}

static void test_stats_file(void **state)
{
    (void)state;
    int64_t dim = 20, n = 300;
    float *a = gaussian_rows(n, dim, 8, 88);
    kpl_fid_stats *s = stats_of(a, n, dim), *t = NULL;
    char path[512], tag[1024];
    snprintf(path, sizeof path, "%s/real.fidstats", tmp);
    OK(kpl_fid_stats_save(s, "fmnist_cnn.kpl crc32c 01234567 dim 20 | train 300", path));
    OK(kpl_fid_stats_load(path, &t, tag, sizeof tag));
    assert_string_equal(tag, "fmnist_cnn.kpl crc32c 01234567 dim 20 | train 300");
    assert_int_equal(kpl_fid_stats_dim(t), dim);
    assert_memory_equal(kpl_fid_stats_sums(s), kpl_fid_stats_sums(t),
                        kpl_fid_stats_len(s) * sizeof(double));
    kpl_fid_stats_destroy(t);
    t = NULL;
    OK(kpl_fid_stats_save(s, NULL, path)); /* replaced; no tag */
    OK(kpl_fid_stats_load(path, &t, tag, sizeof tag));
    assert_string_equal(tag, "");
    kpl_fid_stats_destroy(t);
    t = NULL;
    struct stat sb;
    assert_int_equal(stat(path, &sb), 0);
    assert_int_equal(sb.st_size, 32 + 8 * (1 + 20 + 400));
    damage(path, 32 + 8 * 30 + 3, 0x5a);
    FAILS(kpl_fid_stats_load(path, &t, NULL, 0), KPL_EFORMAT, "checksum mismatch in the sums");
    OK(kpl_fid_stats_save(s, "x", path));
    damage(path, 16, 21); /* dim */
    FAILS(kpl_fid_stats_load(path, &t, NULL, 0), KPL_EFORMAT, "header checksum");
    OK(kpl_fid_stats_save(s, "x", path));
    assert_int_equal(truncate(path, 100), 0);
    FAILS(kpl_fid_stats_load(path, &t, NULL, 0), KPL_EFORMAT, "expected");
    damage(path, 0, 'Q');
    FAILS(kpl_fid_stats_load(path, &t, NULL, 0), KPL_EFORMAT, "no KPLFIDST magic");
    FAILS(kpl_fid_stats_load("/nonexistent/x.fidstats", &t, NULL, 0), KPL_ENOTFOUND, "x.fidstats");
    assert_null(t);
    kpl_fid_stats_destroy(s);
    free(a);
}

/* ---- the feature network ----------------------------------------------------------------- */

static char net_path[512];

/* Fashion-MNIST's first n test images (N, 1, 28, 28) in [0, 1] and labels. */
static void fmnist_test(int n, float *x, int *labels)
{
    gzFile f = gzopen(FM "/t10k-images-idx3-ubyte.gz", "rb");
    assert_non_null(f);
    unsigned char head[16], *px = malloc((size_t)n * 784);
    assert_int_equal(gzread(f, head, 16), 16);
    assert_int_equal(gzread(f, px, (unsigned)n * 784), n * 784);
    gzclose(f);
    for (int i = 0; i < n * 784; i++) x[i] = (float)px[i] / 255;
    f = gzopen(FM "/t10k-labels-idx1-ubyte.gz", "rb");
    assert_non_null(f);
    assert_int_equal(gzread(f, head, 8), 8);
    assert_int_equal(gzread(f, px, (unsigned)n), n);
    gzclose(f);
    for (int i = 0; i < n; i++) labels[i] = px[i];
    free(px);
}

static int count_lines(const char *path, const char *needle)
{
    FILE *f = fopen(path, "r");
    char line[4096];
    int n = 0;
    while (f && fgets(line, sizeof line, f)) n += strstr(line, needle) != NULL;
    if (f) fclose(f);
    return n;
}

/* The first line of a file (empty when there is none). */
static void first_line(const char *path, char *buf, size_t len)
{
    buf[0] = 0;
    FILE *f = fopen(path, "r");
    if (f && !fgets(buf, (int)len, f)) buf[0] = 0;
    if (f) fclose(f);
}

/* `kpl data fid-net ARGS` (a shell command line's tail) with its stdout
 * and stderr in tmp/<name>.out and .err: the exit status. */
static int fid_net_cli(const char *name, const char *args)
{
    char cmd[4096];
    snprintf(cmd, sizeof cmd, "'%s' data fid-net %s > '%s/%s.out' 2> '%s/%s.err'", KPL_CLI, args,
             tmp, name, tmp, name);
    int rc = system(cmd);
    assert_true(WIFEXITED(rc));
    return WEXITSTATUS(rc);
}

static void show(const char *name)
{
    char cmd[1200];
    snprintf(cmd, sizeof cmd, "tail -n 20 '%s/%s.out' '%s/%s.err' >&2", tmp, name, tmp, name);
    int rc = system(cmd);
    (void)rc;
}

/* The names in dir other than `keep` (a run directory, a temporary file),
 * space-separated into buf: "" when there are none. */
static void others_in(const char *dir, const char *keep, char *buf, size_t len)
{
    char cmd[1200];
    snprintf(cmd, sizeof cmd, "ls -A '%s' | grep -vx '%s' | tr '\\n' ' '", dir, keep);
    FILE *p = popen(cmd, "r");
    assert_non_null(p);
    buf[0] = 0;
    if (!fgets(buf, (int)len, p)) buf[0] = 0;
    pclose(p);
}

/* `kpl data fid-net` makes the network: a short training in that process,
 * its final checkpoint at -o (the directories above it made), its run
 * directory gone, one JSON line saying what it is. */
static void test_make(void **state)
{
    (void)state;
    if (access(FM "/t10k-images-idx3-ubyte.gz", R_OK) != 0)
        KPL_SKIP(KPL_TEST_SKIP_REF, "Fashion-MNIST (dataset-fashion-mnist)");
    snprintf(net_path, sizeof net_path, "%s/fid/fmnist_cnn.kpl", tmp);
    /* a short training (CI runs this under ASan too): 10,000 images once */
    char args[1200], err[600], out[2048], left[1024];
    snprintf(args, sizeof args, "--recipe '%s' -o '%s' epochs=1 data.train.limit=10000 "
             "data.val.limit=2000", RECIPE, net_path);
    double t0 = kpl_seconds();
    int rc = fid_net_cli("make", args);
    if (rc != 0) show("make");
    assert_int_equal(rc, 0);
    print_message("feature network made in %.1f s\n", kpl_seconds() - t0);
    snprintf(err, sizeof err, "%s/make.err", tmp);
    assert_int_equal(count_lines(err, "fid: training the feature network"), 1);
    assert_int_equal(count_lines(err, "fid: feature network"), 1); /* "... made in N s" */
    char json[600];
    snprintf(json, sizeof json, "%s/make.out", tmp);
    first_line(json, out, sizeof out);
    assert_non_null(strstr(out, "{\"event\":\"fid-net\""));
    assert_non_null(strstr(out, "\"existed\":false"));
    assert_non_null(strstr(out, "\"dim\":128,\"classes\":10"));
    assert_int_equal(count_lines(json, "\"event\""), 1); /* stdout is the JSON line alone */
    assert_int_equal(count_lines(json, ""), 1);
    assert_int_equal(access(net_path, R_OK), 0);
    char dir[600];
    snprintf(dir, sizeof dir, "%s/fid", tmp);
    others_in(dir, "fmnist_cnn.kpl", left, sizeof left);
    assert_string_equal(left, ""); /* no run directory, no temporary */
}
/* (N, 1, 28, 28) -> (N, 1, 56, 56), each pixel a 2x2 block. */
static float *upscale2(const float *x, int n)
{
    float *y = malloc((size_t)n * 56 * 56 * sizeof *y);
    for (int i = 0; i < n; i++)
        for (int r = 0; r < 56; r++)
            for (int c = 0; c < 56; c++) y[(i * 56 + r) * 56 + c] = x[(i * 28 + r / 2) * 28 + c / 2];
    return y;
}

static kpl_tensor *images(const float *x, int64_t n, int64_t c, int64_t hw)
{
    kpl_tensor *t = NULL;
    int64_t shape[4] = {n, c, hw, hw};
    OK(kpl_tensor_from_data(kpl_device_cpu(), KPL_F32, 4, shape, x, &t));
    return kpl_autorelease(t);
}

static void assert_same_tensor(kpl_tensor *a, kpl_tensor *b, double rtol, double atol,
                               const char *what)
{
    assert_int_equal(kpl_tensor_numel(a), kpl_tensor_numel(b));
    const float *pa = kpl_tensor_host_data(a), *pb = kpl_tensor_host_data(b);
    for (int64_t i = 0; i < kpl_tensor_numel(a); i++) assert_close(pa[i], pb[i], rtol, atol, what, i);
}

static void test_feature_net(void **state)
{
    (void)state;
    if (!net_path[0] || access(net_path, R_OK) != 0) /* test_ensure made it */
        KPL_SKIP(KPL_TEST_SKIP_REF, "the feature network (made from Fashion-MNIST)");
    kpl_feature_net *net = NULL;
    OK(kpl_feature_net_create(RECIPE, net_path, NULL, &net));
    assert_int_equal(kpl_feature_net_dim(net), 128);
    assert_int_equal(kpl_feature_net_classes(net), 10);
    const int64_t *chw = kpl_feature_net_input_shape(net);
    assert_true(chw[0] == 1 && chw[1] == 28 && chw[2] == 28);
    assert_non_null(strstr(kpl_feature_net_id(net), "fmnist_cnn.kpl crc32c "));
    assert_non_null(strstr(kpl_feature_net_id(net), " dim 128"));
    enum { N = 1000, B = 64 };
    float *x = malloc(N * 784 * sizeof *x);
    int *labels = malloc(N * sizeof *labels);
    fmnist_test(N, x, labels);
    kpl_pool *pool = kpl_pool_push();
    kpl_tensor *feat = NULL, *prob = NULL;
    OK(kpl_feature_net_run(net, images(x, B, 1, 28), &feat, &prob));
    assert_int_equal(kpl_tensor_ndim(feat), 2);
    assert_int_equal(kpl_tensor_shape(feat)[0], B);
    assert_int_equal(kpl_tensor_shape(feat)[1], 128);
    assert_int_equal(kpl_tensor_shape(prob)[1], 10);
    /* by hand: the whole model on (x - 0.2860) / 0.3530 gives the logits;
     * the last layer on the features gives them too; probs = softmax */
    float *xn = malloc(B * 784 * sizeof *xn);
    for (int i = 0; i < B * 784; i++) xn[i] = (x[i] - 0.2860f) / 0.3530f;
    kpl_module *m = kpl_feature_net_model(net);
    kpl_tensor *logits = NN(kpl_module_forward(m, images(xn, B, 1, 28)));
    const float *lg = kpl_tensor_host_data(logits), *f = kpl_tensor_host_data(feat);
    const float *pr = kpl_tensor_host_data(prob);
    kpl_module *fc2 = NN(kpl_module_find(m, "fc2"));
    const float *w = kpl_tensor_host_data(kpl_module_get_param(fc2, "weight"));
    const float *bias = kpl_tensor_host_data(kpl_module_get_param(fc2, "bias"));
    for (int i = 0; i < B; i++) {
        double mx = -INFINITY, z = 0;
        for (int c = 0; c < 10; c++) mx = fmax(mx, lg[i * 10 + c]);
        for (int c = 0; c < 10; c++) z += exp(lg[i * 10 + c] - mx);
        for (int c = 0; c < 10; c++) {
            double l = bias[c];
            for (int k = 0; k < 128; k++) l += (double)w[c * 128 + k] * f[i * 128 + k];
            assert_close(l, lg[i * 10 + c], 1e-4, 1e-4, "features x fc2 vs logits", i * 10 + c);
            assert_close(pr[i * 10 + c], exp(lg[i * 10 + c] - mx) / z, 1e-5, 1e-7, "probs", i);
        }
        for (int k = 0; k < 128; k++) assert_true(f[i * 128 + k] >= 0); /* a ReLU's output */
    }
    /* the resize path: 2x2 blocks brought back to 28x28 bilinearly are the
     * same pixels; three equal channels average to the one */
    float *big = upscale2(x, B), *rgb = malloc(B * 3 * 784 * sizeof *rgb);
    for (int i = 0; i < B; i++)
        for (int c = 0; c < 3; c++) memcpy(rgb + (i * 3 + c) * 784, x + i * 784, 784 * sizeof *x);
    kpl_tensor *f2 = NULL, *p2 = NULL, *f3 = NULL;
    OK(kpl_feature_net_run(net, images(big, B, 1, 56), &f2, &p2));
    assert_same_tensor(f2, feat, 1e-5, 1e-5, "features of the 56x56 images");
    assert_same_tensor(p2, prob, 1e-5, 1e-6, "probs of the 56x56 images");
    OK(kpl_feature_net_run(net, images(rgb, B, 3, 28), &f3, NULL));
    assert_same_tensor(f3, feat, 1e-5, 1e-5, "features of 3 equal channels");
    kpl_pool_pop(pool);
    /* real test images are classified well above chance (10%) */
    int right = 0;
    float *probs = malloc(N * 10 * sizeof *probs);
    kpl_fid_stats *s1 = NULL, *s2 = NULL, *noise = NULL;
    OK(kpl_fid_stats_create(128, &s1));
    OK(kpl_fid_stats_create(128, &s2));
    OK(kpl_fid_stats_create(128, &noise));
    reseed(12);
    float *nx = malloc(B * 784 * sizeof *nx);
    for (int at = 0; at < N; at += B) {
        int n = N - at < B ? N - at : B;
        pool = kpl_pool_push();
        OK(kpl_feature_net_run(net, images(x + at * 784, n, 1, 28), &feat, &prob));
        memcpy(probs + at * 10, kpl_tensor_host_data(prob), (size_t)n * 10 * sizeof *probs);
        OK(kpl_fid_stats_add(at < N / 2 ? s1 : s2, kpl_tensor_host_data(feat), n));
        draw(n * 784, true, nx, NULL);
        OK(kpl_feature_net_run(net, images(nx, n, 1, 28), &feat, NULL));
        OK(kpl_fid_stats_add(noise, kpl_tensor_host_data(feat), n));
        kpl_pool_pop(pool);
    }
    for (int i = 0; i < N; i++) {
        int best = 0;
        for (int c = 1; c < 10; c++)
            if (probs[i * 10 + c] > probs[i * 10 + best]) best = c;
        right += best == labels[i];
    }
    double is_mean = 0, is_std = 0, fid_real = 0, fid_noise = 0;
    OK(kpl_inception_score(probs, N, 10, 10, &is_mean, &is_std));
    OK(kpl_fid(s1, s2, &fid_real));
    OK(kpl_fid(s1, noise, &fid_noise));
    print_message("stand-in on %d test images: top-1 %.1f%%, IS %.3f +- %.3f; FID real/real "
                  "%.3f, real/noise %.3f\n", N, 100.0 * right / N, is_mean, is_std, fid_real,
                  fid_noise);
    assert_true(right > N / 2);
    assert_true(is_mean > 3);
    assert_true(fid_noise > 10 * fid_real);
    kpl_fid_stats_destroy(s1);
    kpl_fid_stats_destroy(s2);
    kpl_fid_stats_destroy(noise);
    free(probs);
    free(nx);
    free(big);
    free(rgb);
    free(xn);
    free(x);
    free(labels);
    kpl_feature_net_destroy(net);
}

static void test_feature_net_errors(void **state)
{
    (void)state;
    if (!net_path[0] || access(net_path, R_OK) != 0)
        KPL_SKIP(KPL_TEST_SKIP_REF, "the feature network (made from Fashion-MNIST)");
    kpl_feature_net *net = NULL;
    FAILS(kpl_feature_net_create(RECIPE, "/nonexistent/x.kpl", NULL, &net), KPL_ENOTFOUND,
          "/nonexistent/x.kpl");
    char recipe[512], text[1024];
    /* another hidden size than the checkpoint's */
    snprintf(text, sizeof text, "base: %s\nmodel:\n  hidden: [64]\n", RECIPE);
    kpl_test_write(tmp, "hidden64.yaml", text, recipe, sizeof recipe);
    FAILS(kpl_feature_net_create(recipe, net_path, NULL, &net), KPL_ESHAPE, net_path);
    /* a model that does not end in a linear layer: a ResNet backbone */
    snprintf(text, sizeof text, "base: %s\nmodel:\n  name: resnet\n  depth: 18\n  stem: cifar\n"
             "  num_classes: 0\n", RECIPE);
    kpl_test_write(tmp, "backbone.yaml", text, recipe, sizeof recipe);
    FAILS(kpl_feature_net_create(recipe, net_path, NULL, &net), KPL_EINVAL,
          "not a sequential ending in a linear layer");
    assert_null(net);
    /* a recipe that gives the input size needs no data (its root is not there) */
    snprintf(text, sizeof text, "base: %s\nmodel:\n  input_size: [28, 28]\n  in_channels: 1\n"
             "data:\n  root: /nonexistent\n", RECIPE);
    kpl_test_write(tmp, "sized.yaml", text, recipe, sizeof recipe);
    OK(kpl_feature_net_create(recipe, net_path, NULL, &net));
    kpl_feature_net *ref = NULL;
    OK(kpl_feature_net_create(RECIPE, net_path, NULL, &ref));
    kpl_pool *pool = kpl_pool_push();
    float img[2 * 784];
    for (int i = 0; i < 2 * 784; i++) img[i] = (float)(i % 29) / 28;
    kpl_tensor *fa = NULL, *fb = NULL;
    OK(kpl_feature_net_run(net, images(img, 2, 1, 28), &fa, NULL));
    OK(kpl_feature_net_run(ref, images(img, 2, 1, 28), &fb, NULL));
    assert_same_tensor(fa, fb, 0, 0, "features through either recipe");
    assert_string_equal(kpl_feature_net_id(net), kpl_feature_net_id(ref));
    kpl_pool_pop(pool);
    kpl_feature_net_destroy(ref);
    pool = kpl_pool_push();
    float x[2 * 2 * 28 * 28] = {0};
    kpl_tensor *t = NULL, *feat = NULL;
    int64_t flat[2] = {2, 784};
    OK(kpl_tensor_from_data(kpl_device_cpu(), KPL_F32, 2, flat, x, &t));
    FAILS(kpl_feature_net_run(net, kpl_autorelease(t), &feat, NULL), KPL_EINVAL,
          "got a 2-d f32 tensor");
    FAILS(kpl_feature_net_run(net, images(x, 1, 2, 28), &feat, NULL), KPL_EINVAL,
          "images (1, 2, 28, 28)");
    assert_null(feat);
    kpl_pool_pop(pool);
    kpl_feature_net_destroy(net);
}

/* `kpl data fid-net` again on the file it made: reported, not trained,
 * the file untouched; its usage and recipe errors (exit 2, nothing made). */
static void test_cli(void **state)
{
    (void)state;
    if (!net_path[0] || access(net_path, R_OK) != 0)
        KPL_SKIP(KPL_TEST_SKIP_REF, "the feature network (made from Fashion-MNIST)");
    struct stat before, after;
    assert_int_equal(stat(net_path, &before), 0);
    char args[1200], path[600], out[2048];
    snprintf(args, sizeof args, "--recipe '%s' -o '%s'", RECIPE, net_path);
    int rc = fid_net_cli("again", args);
    if (rc != 0) show("again");
    assert_int_equal(rc, 0);
    snprintf(path, sizeof path, "%s/again.out", tmp);
    first_line(path, out, sizeof out);
    assert_non_null(strstr(out, "\"dim\":128"));
    assert_non_null(strstr(out, "\"classes\":10"));
    assert_non_null(strstr(out, "\"existed\":true"));
    snprintf(path, sizeof path, "%s/again.err", tmp);
    assert_int_equal(count_lines(path, "fid: training"), 0);
    assert_int_equal(stat(net_path, &after), 0);
    assert_true(before.st_ino == after.st_ino && before.st_size == after.st_size &&
                before.st_mtim.tv_sec == after.st_mtim.tv_sec &&
                before.st_mtim.tv_nsec == after.st_mtim.tv_nsec);
    /* usage: an unknown option; run_dir (the command's own) */
    assert_int_equal(fid_net_cli("bogus", "--bogus"), 2);
    snprintf(path, sizeof path, "%s/bogus.err", tmp);
    assert_int_equal(count_lines(path, "unexpected argument '--bogus'"), 1);
    snprintf(args, sizeof args, "-o '%s/bad/net.kpl' run_dir=x", tmp);
    assert_int_equal(fid_net_cli("rundir", args), 2);
    snprintf(path, sizeof path, "%s/rundir.err", tmp);
    assert_int_equal(count_lines(path, "'run_dir=x': the run directory is the command's own"), 1);
    /* a bad override: refused before anything is made */
    snprintf(args, sizeof args, "--recipe '%s' -o '%s/bad/net.kpl' epochs=many", RECIPE, tmp);
    assert_int_equal(fid_net_cli("badov", args), 2);
    snprintf(path, sizeof path, "%s/badov.err", tmp);
    assert_int_equal(count_lines(path, "epochs"), 1);
    snprintf(path, sizeof path, "%s/bad", tmp);
    assert_int_not_equal(access(path, F_OK), 0);
}

/* Waits up to `secs` for pid; its exit status, or -1 (killed) when it
 * did not end. */
static int wait_exit(pid_t pid, double secs)
{
    double t0 = kpl_seconds();
    int status = 0;
    while (waitpid(pid, &status, WNOHANG) == 0) {
        if (kpl_seconds() - t0 > secs) {
            kill(pid, SIGKILL);
            waitpid(pid, &status, 0);
            return -1;
        }
        usleep(50 * 1000);
    }
    return WIFEXITED(status) ? WEXITSTATUS(status) : 256 + WTERMSIG(status);
}

/* A Ctrl-C while `kpl data fid-net` trains: exit 130, and its output as it
 * was before (absent; with --force, the old file byte for byte), its run
 * directory gone. */
static void test_stop(void **state)
{
    (void)state;
    if (!net_path[0] || access(net_path, R_OK) != 0)
        KPL_SKIP(KPL_TEST_SKIP_REF, "the feature network (made from Fashion-MNIST)");
    for (int force = 0; force < 2; force++) {
        char dir[600], out[700], err[700], cmd[2048], left[1024];
        snprintf(dir, sizeof dir, "%s/stop%d", tmp, force);
        snprintf(out, sizeof out, "%s/net.kpl", dir);
        snprintf(err, sizeof err, "%s/stop%d.err", tmp, force);
        assert_int_equal(mkdir(dir, 0755), 0);
        if (force) {
            snprintf(cmd, sizeof cmd, "cp '%s' '%s'", net_path, out);
            assert_int_equal(system(cmd), 0);
        }
        pid_t pid = fork();
        assert_true(pid >= 0);
        if (pid == 0) {
            int fd = open(err, O_WRONLY | O_CREAT | O_TRUNC, 0644);
            int null = open("/dev/null", O_WRONLY);
            if (fd < 0 || null < 0 || dup2(fd, 2) < 0 || dup2(null, 1) < 0) _exit(127);
            /* the whole default recipe (minutes): the stop comes long before its end */
            char *argv[] = {KPL_CLI, "data", "fid-net", "--recipe", RECIPE, "-o", out,
                            force ? "--force" : NULL, NULL};
            execv(KPL_CLI, argv);
            _exit(127);
        }
        /* the handlers are in place once it says it trains */
        double t0 = kpl_seconds();
        while (count_lines(err, "fid: training the feature network") == 0 &&
               kpl_seconds() - t0 < 120 && waitpid(pid, NULL, WNOHANG) == 0)
            usleep(50 * 1000);
        assert_int_equal(count_lines(err, "fid: training the feature network"), 1);
        assert_int_equal(kill(pid, SIGINT), 0);
        int rc = wait_exit(pid, 300);
        if (rc != 130) {
            snprintf(cmd, sizeof cmd, "tail -n 20 '%s' >&2", err);
            int r = system(cmd);
            (void)r;
        }
        assert_int_equal(rc, 130);
        /* "fid: SIGINT: OUT not made (left as it was)" */
        assert_int_equal(count_lines(err, "fid: SIGINT: "), 1);
        if (force) {
            snprintf(cmd, sizeof cmd, "cmp -s '%s' '%s'", net_path, out);
            assert_int_equal(system(cmd), 0);
        } else {
            assert_int_not_equal(access(out, F_OK), 0);
        }
        others_in(dir, "net.kpl", left, sizeof left);
        assert_string_equal(left, "");
    }
}

static int setup(void **state)
{
    (void)state;
    snprintf(tmp, sizeof tmp, "/tmp/kpl_test_fid_XXXXXX");
    return mkdtemp(tmp) ? 0 : -1;
}

static int teardown(void **state)
{
    (void)state;
    char cmd[300];
    kpl_rng_destroy(rng);
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", tmp);
    return system(cmd) == 0 ? 0 : -1;
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        /* first: the tests of the feature network use what it makes */
        cmocka_unit_test(test_make),
        cmocka_unit_test(test_fid_scipy_64),
        cmocka_unit_test(test_fid_scipy_256),
        cmocka_unit_test(test_fid_scipy_singular),
        cmocka_unit_test(test_fid_scipy_dead),
        cmocka_unit_test(test_fid_equal),
        cmocka_unit_test(test_fid_shift),
        cmocka_unit_test(test_fid_closed_form),
        cmocka_unit_test(test_merge_halves),
        cmocka_unit_test(test_moments),
        cmocka_unit_test(test_errors),
        cmocka_unit_test(test_inception_score),
        cmocka_unit_test(test_stats_file),
        cmocka_unit_test(test_feature_net),
        cmocka_unit_test(test_feature_net_errors),
        cmocka_unit_test(test_cli),
        cmocka_unit_test(test_stop),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
