/*
 * bench_fid.c — `bench/run.sh fid`: the Fréchet distance of two sets of
 * 10,000 feature vectors, kpl (trainer/fid.h) next to pytorch-fid's
 * computation in numpy + scipy (tests/trainer/fid_ref.py bench).
 *
 *   bench_fid ROOT WORK_DIR
 *
 * Cases (seconds, lower is better; kpl and the reference alternate for
 * KPL_BENCH_ROUNDS rounds, default 3, which side goes first alternating):
 *  - fid/10kx2/d128: 128 features, the stand-in network's.
 *  - fid/10kx2/d2048: 2048, Inception-v3's pool3.
 * Each side's time is the moments of both sets (kpl: kpl_fid_stats_add of
 * every row, then the moments; numpy: mean and cov) plus the distance
 * (kpl: kpl_fid; scipy: sqrtm of the product, its trace), the features
 * already in memory.  The sets are correlated Gaussians (a diagonal scale
 * plus a rank-32 mixing, different for each set) written once into
 * WORK_DIR as raw f32.  Extra fields: the two parts of each side
 * (kpl_moments_s, kpl_distance_s, ref_moments_s, ref_distance_s), both
 * FIDs and their relative difference (rel_diff).  Both sides run on
 * OpenBLAS with its default threads (all cores) and with
 * OPENBLAS_CORETYPE / OPENBLAS_L2_SIZE unset (../shared/DESIGN.md): this
 * program runs itself again without them, since kpl's side uses OpenBLAS
 * too.
 */
#include "bench_common.h"
#include "trainer.h"

#include <sys/stat.h>
#include <unistd.h>

enum { N = 10000, RANK = 32 };

static void die(const char *what)
{
    fprintf(stderr, "bench_fid: %s: %s\n", what, kpl_last_error());
    exit(1);
}

/* n numbers from kpl's Philox: N(0, 1), or U(0, 1) with `uniform`. */
static double *draw(kpl_rng *rng, int64_t n, bool uniform)
{
    kpl_tensor *t = NULL;
    double *d = malloc((size_t)n * sizeof *d);
    if (!d || kpl_tensor_empty(kpl_device_cpu(), KPL_F32, 1, &n, &t) < 0 ||
        (uniform ? kpl_k_uniform(t, rng, 0, 1) : kpl_k_normal(t, rng, 0, 1)) < 0)
        die("random numbers");
    const float *v = kpl_tensor_host_data(t);
    for (int64_t i = 0; i < n; i++) d[i] = v[i];
    kpl_tensor_release(t);
    return d;
}

/* N rows of mu + s * z + U g (z, g standard normal; U dim x RANK). */
static float *features(int64_t dim, uint64_t seed)
{
    kpl_rng *rng = kpl_rng_create(seed);
    if (!rng) die("out of memory");
    double *mu = draw(rng, dim, false), *s = draw(rng, dim, true), *u = draw(rng, dim * RANK, false);
    double *z = draw(rng, N * dim, false), *g = draw(rng, N * RANK, false);
    float *x = malloc((size_t)(N * dim) * sizeof *x);
    if (!x) die("out of memory");
    for (int64_t r = 0; r < N; r++)
        for (int64_t i = 0; i < dim; i++) {
            double v = 0.5 * mu[i] + (0.5 + s[i]) * z[r * dim + i];
            for (int k = 0; k < RANK; k++) v += u[i * RANK + k] * g[r * RANK + k] / sqrt(RANK);
            x[r * dim + i] = (float)v;
        }
    free(mu);
    free(s);
    free(u);
    free(z);
    free(g);
    kpl_rng_destroy(rng);
    return x;
}

static float *load_or_make(const char *dir, int64_t dim, int set, char *path, size_t len)
{
    snprintf(path, len, "%s/fid_d%lld_%c.f32", dir, (long long)dim, 'a' + set);
    size_t bytes = (size_t)(N * dim) * sizeof(float);
    float *x = malloc(bytes);
    if (!x) die("out of memory");
    FILE *f = fopen(path, "rb");
    if (f && fread(x, 1, bytes, f) == bytes) {
        fclose(f);
        return x;
    }
    if (f) fclose(f);
    free(x);
    fprintf(stderr, "bench_fid: writing %s\n", path);
    x = features(dim, 1000 * (uint64_t)dim + (uint64_t)set + 1);
    f = fopen(path, "wb");
    if (!f || fwrite(x, 1, bytes, f) != bytes || fclose(f) != 0) {
        perror(path);
        exit(1);
    }
    return x;
}

struct ref_result {
    double moments_s, fid_s, fid;
    int ok;
};

static void ref_line(const char *line, void *ctx)
{
    struct ref_result *r = ctx;
    const char *p;
    if (!(p = strstr(line, "\"moments_s\": "))) return;
    r->moments_s = strtod(p + 13, NULL);
    if (!(p = strstr(line, "\"fid_s\": "))) return;
    r->fid_s = strtod(p + 9, NULL);
    if (!(p = strstr(line, "\"fid\": "))) return;
    r->fid = strtod(p + 7, NULL);
    r->ok = 1;
}

/* kpl: the moments of both sets, then the distance. */
static double kpl_side(const float *a, const float *b, int64_t dim, double *moments_s,
                       double *distance_s)
{
    double t0 = bench_now();
    kpl_fid_stats *sa = NULL, *sb = NULL;
    if (kpl_fid_stats_create(dim, &sa) < 0 || kpl_fid_stats_create(dim, &sb) < 0 ||
        kpl_fid_stats_add(sa, a, N) < 0 || kpl_fid_stats_add(sb, b, N) < 0)
        die("statistics");
    double t1 = bench_now(), fid = NAN;
    if (kpl_fid(sa, sb, &fid) < 0) die("kpl_fid");
    double t2 = bench_now();
    *moments_s = t1 - t0;
    *distance_s = t2 - t1;
    kpl_fid_stats_destroy(sa);
    kpl_fid_stats_destroy(sb);
    return fid;
}

/* A FID with 9 digits (bench_jnum keeps 4), or null. */
static const char *fid_num(char buf[32], double v)
{
    if (isfinite(v)) snprintf(buf, 32, "%.9g", v);
    else snprintf(buf, 32, "null");
    return buf;
}

int main(int argc, char **argv)
{
    if (argc != 3) {
        fprintf(stderr, "usage: bench_fid ROOT WORK_DIR\n");
        return 2;
    }
    /* OpenBLAS reads these when it loads: run again without them */
    if (getenv("OPENBLAS_CORETYPE") || getenv("OPENBLAS_L2_SIZE")) {
        unsetenv("OPENBLAS_CORETYPE");
        unsetenv("OPENBLAS_L2_SIZE");
        execv("/proc/self/exe", argv);
        perror("bench_fid: execv");
        return 1;
    }
    int rounds = bench_env_int("KPL_BENCH_ROUNDS", 3, 1, 8);
    static const int64_t dims[2] = {128, 2048};
    for (int c = 0; c < 2; c++) {
        int64_t dim = dims[c];
        char pa[4096], pb[4096], cmd[16384];
        float *a = load_or_make(argv[2], dim, 0, pa, sizeof pa);
        float *b = load_or_make(argv[2], dim, 1, pb, sizeof pb);
        snprintf(cmd, sizeof cmd, "/usr/bin/python3 '%s/tests/trainer/fid_ref.py' bench %lld '%s' "
                 "'%s'", argv[1], (long long)dim, pa, pb);
        double k_all[8], k_mom[8], k_dist[8], r_all[8], r_mom[8], r_dist[8];
        double kfid = NAN, rfid = NAN;
        for (int round = 0; round < rounds; round++) {
            r_all[round] = r_mom[round] = r_dist[round] = NAN;
            for (int side = 0; side < 2; side++) {
                if ((side + round) % 2 == 0) {
                    kfid = kpl_side(a, b, dim, &k_mom[round], &k_dist[round]);
                    k_all[round] = k_mom[round] + k_dist[round];
                } else {
                    struct ref_result r = {0};
                    if (bench_run_lines(cmd, ref_line, &r) == 0 && r.ok) {
                        r_mom[round] = r.moments_s;
                        r_dist[round] = r.fid_s;
                        r_all[round] = r.moments_s + r.fid_s;
                        rfid = r.fid;
                    }
                }
            }
            fprintf(stderr, "bench_fid: d%lld round %d: kpl %.3f s (moments %.3f, distance %.3f), "
                            "numpy+scipy %.3f s (%.3f, %.3f); FID %.6f vs %.6f\n",
                    (long long)dim, round + 1, k_all[round], k_mom[round], k_dist[round],
                    r_all[round], r_mom[round], r_dist[round], kfid, rfid);
        }
        char cas[32], n1[BENCH_NUM_LEN], n2[BENCH_NUM_LEN], n3[BENCH_NUM_LEN], n4[BENCH_NUM_LEN];
        char n7[BENCH_NUM_LEN], rk[BENCH_RANGE_LEN];
        char rr[BENCH_RANGE_LEN], f1[32], f2[32];
        snprintf(cas, sizeof cas, "10kx2/d%lld", (long long)dim);
        double rel = fabs(kfid - rfid) / fabs(rfid);
        bench_emit("fid", cas, "s", 0, bench_median(k_all, rounds), bench_median(r_all, rounds),
                   "numpy-cov+scipy-sqrtm", NAN,
                   ",\"samples\":%d,\"dim\":%lld,\"rounds\":%d,\"kpl_range\":%s,\"ref_range\":%s,"
                   "\"kpl_moments_s\":%s,\"kpl_distance_s\":%s,\"ref_moments_s\":%s,"
                   "\"ref_distance_s\":%s,\"kpl_fid\":%s,\"ref_fid\":%s,\"rel_diff\":%s,"
                   "\"threads\":%ld",
                   N, (long long)dim, rounds, bench_jrange(rk, k_all, rounds),
                   bench_jrange(rr, r_all, rounds), bench_jnum(n1, bench_median(k_mom, rounds)),
                   bench_jnum(n2, bench_median(k_dist, rounds)),
                   bench_jnum(n3, bench_median(r_mom, rounds)),
                   bench_jnum(n4, bench_median(r_dist, rounds)), fid_num(f1, kfid),
                   fid_num(f2, rfid), bench_jnum(n7, rel), sysconf(_SC_NPROCESSORS_ONLN));
        free(a);
        free(b);
    }
    return bench_exit_code();
}
