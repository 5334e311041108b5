/*
 * bench_detops.c — `bench/run.sh detops`: the detection ops of
 * graph/vision.h next to torchvision's C++ CPU kernels, the ops a
 * detection user calls (bench/torch_detops.py; Debian's
 * python3-torchvision, which scripts/setup.sh installs).
 *
 *   bench_detops BENCH_DIR WORK_DIR
 *
 * Cases (kpl and the reference alternate over KPL_BENCH_ROUNDS rounds,
 * default 5, which goes first alternating too; medians reported; target
 * kpl >= 1.0x torchvision at the same thread count):
 *  - nms/10k_f32_thr0.5/t1: kpl_nms of 10,000 boxes (sides 10-100 px on a
 *    1000 x 1000 field, scores uniform), IoU threshold 0.5, one thread,
 *    against torchvision.ops.nms.  ms, median of 9 runs a round.
 *  - batched_nms/10k_80cls_f32_thr0.5/t1: the same boxes in 80 classes
 *    (uniform), kpl_batched_nms against torchvision.ops.batched_nms.
 *    Both NMS cases check that the two sides keep the same boxes (count
 *    and index sum).
 *  - roi_align_fwd_bwd/...: kpl_roi_align forward and its backward
 *    (kpl_grad with a given output gradient) over x (2, 256, 64, 64) f32
 *    (a stride-8 level of two 512 x 512 images), 256 rois (128 per
 *    image, sides 16-256 px), 7 x 7 bins, sampling_ratio 2, aligned, two
 *    threads; against torchvision.ops.roi_align and its autograd
 *    backward.  ms, median of 5 runs a round; the sums of the outputs and
 *    input gradients agree (checked).
 * The inputs go to the reference through a file in WORK_DIR.
 */
#include "bench_common.h"
#include "autograd.h"
#include "vision.h"

static void die(const char *what)
{
    fprintf(stderr, "bench_detops: %s: %s\n", what, kpl_last_error());
    exit(1);
}

static int rounds;

/* Writes n f32 values of each tensor in turn to path. */
static void write_f32(const char *path, int n, kpl_tensor *const *ts)
{
    FILE *f = fopen(path, "wb");
    if (!f) {
        fprintf(stderr, "bench_detops: cannot write %s\n", path);
        exit(1);
    }
    for (int i = 0; i < n; i++) {
        const void *h = kpl_tensor_host_data(ts[i]);
        if (!h) die("host data");
        fwrite(h, 4, (size_t)kpl_tensor_numel(ts[i]), f);
    }
    fclose(f);
}

/* ---- NMS ------------------------------------------------------------------------------------ */

struct nms_ref {
    double ms, kept, keepsum;
    char impl[32];
};

static void nms_line(const char *line, void *ctx)
{
    struct nms_ref *r = ctx;
    const char *ms = strstr(line, "ms="), *kept = strstr(line, "kept=");
    const char *ks = strstr(line, "keepsum="), *impl = strstr(line, "impl=");
    if ((strncmp(line, "NMS ", 4) && strncmp(line, "BNMS ", 5)) || !ms || !kept || !ks || !impl)
        return;
    r->ms = strtod(ms + 3, NULL);
    r->kept = strtod(kept + 5, NULL);
    r->keepsum = strtod(ks + 8, NULL);
    sscanf(impl + 5, "%31s", r->impl);
}

/* One NMS call of kpl: its ms, the count and index sum of what it kept. */
static double kpl_nms_once(kpl_tensor *boxes, kpl_tensor *scores, kpl_tensor *idxs, double thr,
                           int64_t *kept, double *keepsum)
{
    kpl_pool *p = kpl_pool_push();
    kpl_tensor *keep = NULL;
    double t0 = bench_now();
    kpl_status st = idxs ? kpl_batched_nms(boxes, scores, idxs, thr, &keep)
                         : kpl_nms(boxes, scores, thr, &keep);
    double ms = (bench_now() - t0) * 1e3;
    if (st < 0) die(idxs ? "batched_nms" : "nms");
    *kept = kpl_tensor_numel(keep);
    const int64_t *kv = kpl_tensor_host_data(keep);
    *keepsum = 0;
    for (int64_t i = 0; i < *kept; i++) *keepsum += (double)kv[i];
    kpl_pool_pop(p);
    return ms;
}

/* nms (classes 0) or batched_nms over `classes` classes of 10,000 boxes,
 * one thread, against torchvision's op. */
static void nms_case(const char *bench_dir, const char *work, int classes)
{
    const int64_t n = 10000;
    const double thr = 0.5;
    kpl_set_num_threads(1);
    kpl_rng *rng = kpl_rng_create(7);
    kpl_pool *pool = kpl_pool_push();
    kpl_device *cpu = kpl_device_cpu();
    /* (x, y) uniform on the field, sides uniform in [10, 100), classes
     * uniform in [0, classes) */
    kpl_tensor *u = kpl_rand(cpu, KPL_F32, 2, (int64_t[]){n, 5}, rng, 0, 1);
    kpl_tensor *scores = kpl_rand(cpu, KPL_F32, 1, &n, rng, 0, 1);
    if (!u || !scores) die("inputs");
    kpl_tensor *boxes = kpl_empty(cpu, KPL_F32, 2, (int64_t[]){n, 4});
    kpl_tensor *cls = kpl_empty(cpu, KPL_F32, 1, &n), *idxs = NULL;
    const float *uv = kpl_tensor_host_data(u);
    float *bv = kpl_tensor_host_mutable(boxes), *cv = kpl_tensor_host_mutable(cls);
    for (int64_t i = 0; i < n; i++) {
        bv[4 * i] = uv[5 * i] * 1000, bv[4 * i + 1] = uv[5 * i + 1] * 1000;
        bv[4 * i + 2] = bv[4 * i] + 10 + uv[5 * i + 2] * 90;
        bv[4 * i + 3] = bv[4 * i + 1] + 10 + uv[5 * i + 3] * 90;
        cv[i] = floorf(uv[5 * i + 4] * (float)(classes > 0 ? classes : 1));
    }
    if (classes && !(idxs = kpl_cast(cls, KPL_I64))) die("classes");
    char path[512], cmd[1024], what[8];
    snprintf(what, sizeof what, "%s", classes ? "bnms" : "nms");
    snprintf(path, sizeof path, "%s/detops_%s.f32", work, what);
    write_f32(path, classes ? 3 : 2, (kpl_tensor *[]){boxes, scores, cls});
    snprintf(cmd, sizeof cmd, "/usr/bin/python3 %s/torch_detops.py %s %s %lld %g 1", bench_dir,
             what, path, (long long)n, thr);
    double kms[64], rms[64], keepsum = 0;
    int64_t kept = 0;
    struct nms_ref ref = {NAN, NAN, NAN, "?"};
    for (int r = 0; r < rounds; r++) {
        for (int side = 0; side < 2; side++) {
            if ((side + r) % 2 == 0) {
                double t[9];
                kpl_nms_once(boxes, scores, idxs, thr, &kept, &keepsum); /* warm-up */
                for (int i = 0; i < 9; i++)
                    t[i] = kpl_nms_once(boxes, scores, idxs, thr, &kept, &keepsum);
                kms[r] = bench_median(t, 9);
            } else {
                struct nms_ref one = {NAN, NAN, NAN, "?"};
                if (bench_run_lines(cmd, nms_line, &one) == 0 && isnan(one.ms)) {
                    fprintf(stderr, "bench_detops: no NMS line from: %s\n", cmd);
                    bench_ref_failures++;
                }
                rms[r] = one.ms;
                if (!isnan(one.ms)) ref = one;
            }
        }
        fprintf(stderr, "bench_detops: %s round %d: kpl %.3f ms, torchvision %.3f ms\n", what, r,
                kms[r], rms[r]);
    }
    if (!isnan(ref.kept) && (ref.kept != (double)kept || ref.keepsum != keepsum)) {
        fprintf(stderr,
                "bench_detops: %s kept %lld boxes (index sum %.0f), the reference %g (%.0f)\n", what,
                (long long)kept, keepsum, ref.kept, ref.keepsum);
        exit(1);
    }
    char refname[96], tag[64], kr[BENCH_RANGE_LEN], rr[BENCH_RANGE_LEN];
    snprintf(refname, sizeof refname, "%s %s (C++ CPU kernel)", ref.impl,
             classes ? "batched_nms" : "nms");
    if (classes)
        snprintf(tag, sizeof tag, "10k_%dcls_f32_thr0.5/t1", classes);
    else
        snprintf(tag, sizeof tag, "10k_f32_thr0.5/t1");
    bench_jrange(kr, kms, rounds);
    bench_jrange(rr, rms, rounds);
    bench_emit(classes ? "batched_nms" : "nms", tag, "ms", 0, bench_median(kms, rounds),
               bench_median(rms, rounds), refname, 1.0,
               ",\"threads\":1,\"rounds\":%d,\"kept\":%lld,\"kpl_range\":%s,\"ref_range\":%s",
               rounds, (long long)kept, kr, rr);
    kpl_pool_pop(pool);
    kpl_rng_destroy(rng);
}

/* ---- ROI Align ---------------------------------------------------------------------------- */

struct roi_ref {
    double ms, fwd_ms, sum, gsum;
    char impl[32];
};

static void roi_line(const char *line, void *ctx)
{
    struct roi_ref *r = ctx;
    const char *ms = strstr(line, " ms="), *f = strstr(line, "fwd_ms="), *s = strstr(line, " sum=");
    const char *g = strstr(line, "gsum=");
    if (strncmp(line, "ROI ", 4) || !ms || !f || !s || !g) return;
    r->ms = strtod(ms + 4, NULL);
    r->fwd_ms = strtod(f + 7, NULL);
    r->sum = strtod(s + 5, NULL);
    r->gsum = strtod(g + 5, NULL);
    const char *impl = strstr(line, "impl=");
    if (impl) sscanf(impl + 5, "%31s", r->impl);
}

static double sum_of(kpl_tensor *t)
{
    double s = 0;
    const float *v = kpl_tensor_host_data(t);
    for (int64_t i = 0; i < kpl_tensor_numel(t); i++) s += v[i];
    return s;
}

static void roi_case(const char *bench_dir, const char *work)
{
    const int64_t n = 2, c = 256, h = 64, w = 64, k = 256, oh = 7, ow = 7;
    const int sr = 2, threads = 2;
    const double scale = 1.0 / 8;
    kpl_set_num_threads(threads);
    kpl_rng *rng = kpl_rng_create(11);
    kpl_pool *pool = kpl_pool_push();
    kpl_device *cpu = kpl_device_cpu();
    kpl_tensor *x = NULL;
    if (kpl_tensor_empty(cpu, KPL_F32, 4, (int64_t[]){n, c, h, w}, &x) < 0 ||
        kpl_k_normal(x, rng, 0, 1) < 0 || kpl_set_requires_grad(x, true) < 0)
        die("x");
    kpl_tensor *u = kpl_rand(cpu, KPL_F32, 2, (int64_t[]){k, 4}, rng, 0, 1);
    kpl_tensor *gy = kpl_randn(cpu, KPL_F32, 4, (int64_t[]){k, c, oh, ow}, rng, 0, 1);
    kpl_tensor *rois = kpl_empty(cpu, KPL_F32, 2, (int64_t[]){k, 5});
    if (!u || !gy || !rois) die("inputs");
    const float *uv = kpl_tensor_host_data(u);
    float *rv = kpl_tensor_host_mutable(rois);
    for (int64_t i = 0; i < k; i++) { /* sides 16-256 px inside a 512 x 512 image */
        float sw = 16 + uv[4 * i + 2] * 240, sh = 16 + uv[4 * i + 3] * 240;
        rv[5 * i] = (float)(i % n);
        rv[5 * i + 1] = uv[4 * i] * (512 - sw), rv[5 * i + 2] = uv[4 * i + 1] * (512 - sh);
        rv[5 * i + 3] = rv[5 * i + 1] + sw, rv[5 * i + 4] = rv[5 * i + 2] + sh;
    }
    char path[512], cmd[1024];
    snprintf(path, sizeof path, "%s/detops_roi.f32", work);
    write_f32(path, 3, (kpl_tensor *[]){x, rois, gy});
    snprintf(cmd, sizeof cmd,
             "/usr/bin/python3 %s/torch_detops.py roi %s %lld %lld %lld %lld %lld %lld %lld %d "
             "%.17g 1 %d", bench_dir, path, (long long)n, (long long)c, (long long)h, (long long)w,
             (long long)k, (long long)oh, (long long)ow, sr, scale, threads);
    double kms[64], kfw[64], rms[64], rfw[64], ksum = 0, kgsum = 0;
    struct roi_ref ref = {NAN, NAN, NAN, NAN, "?"};
    for (int r = 0; r < rounds; r++) {
        for (int side = 0; side < 2; side++) {
            if ((side + r) % 2 == 0) {
                double tf[5], tb[5];
                for (int i = 0; i < 6; i++) { /* one warm-up */
                    kpl_pool *p = kpl_pool_push();
                    double t0 = bench_now();
                    bool prev = kpl_set_grad_enabled(false);
                    kpl_tensor *y0 = kpl_roi_align(x, rois, oh, ow, scale, sr, true);
                    kpl_set_grad_enabled(prev);
                    double t1 = bench_now();
                    kpl_tensor *y = kpl_roi_align(x, rois, oh, ow, scale, sr, true), *g = NULL;
                    if (!y0 || !y || kpl_grad(y, gy, 1, &x, false, &g) < 0) die("roi_align");
                    double t2 = bench_now();
                    if (i > 0) tf[i - 1] = (t1 - t0) * 1e3, tb[i - 1] = (t2 - t1) * 1e3;
                    ksum = sum_of(y);
                    kgsum = sum_of(g);
                    kpl_pool_pop(p);
                }
                kfw[r] = bench_median(tf, 5);
                kms[r] = bench_median(tb, 5);
            } else {
                struct roi_ref one = {NAN, NAN, NAN, NAN, "?"};
                if (bench_run_lines(cmd, roi_line, &one) == 0 && isnan(one.ms)) {
                    fprintf(stderr, "bench_detops: no ROI line from: %s\n", cmd);
                    bench_ref_failures++;
                }
                rms[r] = one.ms, rfw[r] = one.fwd_ms;
                if (!isnan(one.ms)) ref = one;
            }
        }
        fprintf(stderr, "bench_detops: roi_align round %d: kpl %.2f ms (fwd %.2f), torchvision "
                "%.2f ms (fwd %.2f)\n", r, kms[r], kfw[r], rms[r], rfw[r]);
    }
    if (!isnan(ref.sum) && (fabs(ref.sum - ksum) > 1e-3 * (fabs(ksum) + 1) * 10 ||
                            fabs(ref.gsum - kgsum) > 1e-3 * (fabs(kgsum) + 1) * 10)) {
        fprintf(stderr, "bench_detops: roi_align sums differ: kpl %g / %g, torch %g / %g\n", ksum,
                kgsum, ref.sum, ref.gsum);
        exit(1);
    }
    char kr[BENCH_RANGE_LEN], rr[BENCH_RANGE_LEN], nf[BENCH_NUM_LEN], nr[BENCH_NUM_LEN];
    char refname[96];
    snprintf(refname, sizeof refname, "%s roi_align forward+backward (C++ CPU kernel)", ref.impl);
    bench_jrange(kr, kms, rounds);
    bench_jrange(rr, rms, rounds);
    bench_emit("roi_align_fwd_bwd", "x2x256x64x64_k256_7x7_sr2/t2", "ms", 0,
               bench_median(kms, rounds), bench_median(rms, rounds), refname, 1.0,
               ",\"threads\":%d,\"rounds\":%d,\"kpl_fwd_ms\":%s,\"ref_fwd_ms\":%s,"
               "\"kpl_range\":%s,\"ref_range\":%s",
               threads, rounds, bench_jnum(nf, bench_median(kfw, rounds)),
               bench_jnum(nr, bench_median(rfw, rounds)), kr, rr);
    kpl_pool_pop(pool);
    kpl_tensor_release(x);
    kpl_rng_destroy(rng);
}

int main(int argc, char **argv)
{
    if (argc != 3) {
        fprintf(stderr, "usage: bench_detops BENCH_DIR WORK_DIR\n");
        return 2;
    }
    rounds = bench_env_int("KPL_BENCH_ROUNDS", 5, 1, 64);
    nms_case(argv[1], argv[2], 0);
    nms_case(argv[1], argv[2], 80);
    roi_case(argv[1], argv[2]);
    return bench_exit_code();
}
