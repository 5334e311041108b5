/*
 * bench_seg_ops.c — bench_seg's `ops` case: the ops kpl fuses for the
 * segmentation and detection models (resize, concat, per-pixel cross
 * entropy, group norm, focal loss) timed alone, forward and forward +
 * backward, against the same calls in PyTorch (bench/torch_segops.py).
 */
#include "bench_common.h"
#include "bench_seg.h"
#include "kernels_impl.h"
#include "trainer.h"
#include "vision.h"

static void die(const char *what)
{
    fprintf(stderr, "bench_seg: %s: %s\n", what, kpl_last_error());
    exit(1);
}

#define OPS_REPS 5
enum { OPS_RESIZE, OPS_CONCAT, OPS_CE, OPS_GN, OPS_FOCAL, OPS_N };
static const char *const ops_names[OPS_N] = {"resize", "concat", "cross_entropy", "group_norm",
                                              "focal"};
static const char *const ops_shapes[OPS_N] = {
    "x8x21x64x64_to_512x512", "2x8x128x64x64_axis1", "x8x21x256x256_ignore255_mean",
    "x8x256x32x32_g32_affine", "x16384x80_alpha0.25_gamma2_sum"};

/* The inputs of every op and what it does, as torch_segops.py's. */
typedef struct {
    kpl_tensor *x, *gy_resize, *a, *b, *gy_cat, *z, *y, *g, *w, *bb, *gy_gn, *lg, *tgt;
} ops_inputs;

/* Labels (i * 7 + i / 97) % classes, every ignore_every-th 255
 * (torch_segops.py's); pool-owned. */
static kpl_tensor *ops_labels(int nd, const int64_t *shape, int64_t classes, int64_t ignore_every)
{
    kpl_tensor *t = kpl_empty(kpl_device_cpu(), KPL_I64, nd, shape);
    if (!t) die("labels");
    int64_t *v = kpl_tensor_host_mutable(t);
    for (int64_t i = 0; i < kpl_tensor_numel(t); i++)
        v[i] = ignore_every && i % ignore_every == 0 ? 255 : (i * 7 + i / 97) % classes;
    return t;
}

static kpl_tensor *ops_leaf(kpl_rng *rng, int nd, const int64_t *shape)
{
    kpl_tensor *t = NULL;
    if (kpl_tensor_empty(kpl_device_cpu(), KPL_F32, nd, shape, &t) < 0 ||
        kpl_k_normal(t, rng, 0, 1) < 0 || kpl_set_requires_grad(t, true) < 0)
        die("inputs");
    return kpl_autorelease(t);
}

static void ops_make(ops_inputs *in, kpl_rng *rng)
{
    kpl_device *cpu = kpl_device_cpu();
    in->x = ops_leaf(rng, 4, (int64_t[]){8, 21, 64, 64});
    in->gy_resize = kpl_randn(cpu, KPL_F32, 4, (int64_t[]){8, 21, 512, 512}, rng, 0, 1);
    in->a = ops_leaf(rng, 4, (int64_t[]){8, 128, 64, 64});
    in->b = ops_leaf(rng, 4, (int64_t[]){8, 128, 64, 64});
    in->gy_cat = kpl_randn(cpu, KPL_F32, 4, (int64_t[]){8, 256, 64, 64}, rng, 0, 1);
    in->z = ops_leaf(rng, 4, (int64_t[]){8, 21, 256, 256});
    in->y = ops_labels(3, (int64_t[]){8, 256, 256}, 21, 20);
    in->g = ops_leaf(rng, 4, (int64_t[]){8, 256, 32, 32});
    in->w = ops_leaf(rng, 1, (int64_t[]){256});
    in->bb = ops_leaf(rng, 1, (int64_t[]){256});
    in->gy_gn = kpl_randn(cpu, KPL_F32, 4, (int64_t[]){8, 256, 32, 32}, rng, 0, 1);
    in->lg = ops_leaf(rng, 2, (int64_t[]){16384, 80});
    /* one-hot rows for every tenth location (class (i * 7 + i / 97) % 80), the rest 0 */
    kpl_tensor *cls = ops_labels(1, (int64_t[]){16384}, 80, 0);
    in->tgt = kpl_empty(cpu, KPL_F32, 2, (int64_t[]){16384, 80});
    if (!in->gy_resize || !in->gy_cat || !in->gy_gn || !in->tgt) die("inputs");
    float *tv = kpl_tensor_host_mutable(in->tgt);
    const int64_t *cv = kpl_tensor_host_data(cls);
    memset(tv, 0, sizeof(float) * 16384 * 80);
    for (int64_t i = 0; i < 16384; i += 10) tv[i * 80 + cv[i]] = 1;
}

/* One run of op k: forward only (bwd false, no gradient recorded) or with
 * the gradients of its inputs; ms. */
static double ops_once(const ops_inputs *in, int k, bool bwd)
{
    kpl_pool *p = kpl_pool_push();
    bool prev = kpl_set_grad_enabled(bwd);
    double t0 = bench_now();
    kpl_tensor *out = NULL, *gy = NULL, *wrt[3] = {NULL, NULL, NULL};
    int nw = 1;
    switch (k) {
    case OPS_RESIZE:
        out = kpl_upsample_bilinear(in->x, 512, 512, false), gy = in->gy_resize, wrt[0] = in->x;
        break;
    case OPS_CONCAT:
        out = kpl_concat(2, (kpl_tensor *[]){in->a, in->b}, 1), gy = in->gy_cat;
        wrt[0] = in->a, wrt[1] = in->b, nw = 2;
        break;
    case OPS_CE:
        out = kpl_cross_entropy(in->z, in->y, KPL_REDUCE_MEAN, 0, 255), wrt[0] = in->z;
        break;
    case OPS_GN:
        out = kpl_group_norm(in->g, 32, in->w, in->bb, 1e-5), gy = in->gy_gn;
        wrt[0] = in->g, wrt[1] = in->w, wrt[2] = in->bb, nw = 3;
        break;
    default:
        out = kpl_sigmoid_focal_loss(in->lg, in->tgt, 0.25, 2, KPL_REDUCE_SUM), wrt[0] = in->lg;
        break;
    }
    kpl_tensor *g[3];
    if (!out || (bwd && kpl_grad(out, gy, nw, wrt, false, g) < 0)) die(ops_names[k]);
    double ms = (bench_now() - t0) * 1e3;
    kpl_set_grad_enabled(prev);
    kpl_pool_pop(p);
    return ms;
}

struct ops_ref {
    double ms[OPS_N][2];
};

static void ops_line(const char *line, void *ctx)
{
    struct ops_ref *r = ctx;
    char name[32];
    double f, b;
    if (sscanf(line, "OP %31s fwd_ms=%lf fwd_bwd_ms=%lf", name, &f, &b) != 3) return;
    for (int k = 0; k < OPS_N; k++)
        if (!strcmp(name, ops_names[k])) r->ms[k][0] = f, r->ms[k][1] = b;
}

/* The fused ops of dense prediction and detection alone against the same
 * calls in PyTorch (torch_segops.py, a fresh process per round),
 * alternating which goes first; rows seg_ops/<op>/<shape>/{fwd,fwd_bwd}. */
void bench_seg_ops(const char *bench_dir, int rounds)
{
    kpl_pool *pool = kpl_pool_push();
    kpl_rng *rng = kpl_rng_create(SEG_SEED);
    ops_inputs in;
    ops_make(&in, rng);
    char cmd[1024];
    snprintf(cmd, sizeof cmd, "env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE /usr/bin/python3 "
             "%s/torch_segops.py %d %d", bench_dir, SEG_THREADS, OPS_REPS);
    double km[64][OPS_N][2], rm[64][OPS_N][2];
    for (int r = 0; r < rounds; r++)
        for (int side = 0; side < 2; side++) {
            if ((side + r) % 2 == 0) {
                for (int k = 0; k < OPS_N; k++)
                    for (int b = 0; b < 2; b++) {
                        double t[OPS_REPS];
                        ops_once(&in, k, b); /* warm-up */
                        for (int i = 0; i < OPS_REPS; i++) t[i] = ops_once(&in, k, b);
                        km[r][k][b] = bench_median(t, OPS_REPS);
                    }
            } else {
                struct ops_ref one;
                for (int k = 0; k < OPS_N; k++) one.ms[k][0] = one.ms[k][1] = NAN;
                if (bench_run_lines(cmd, ops_line, &one) != 0 || isnan(one.ms[OPS_N - 1][1])) {
                    fprintf(stderr, "bench_seg: no OP lines from: %s\n", cmd);
                    bench_ref_failures++;
                }
                memcpy(rm[r], one.ms, sizeof one.ms);
            }
        }
    static const char *const dir[2] = {"fwd", "fwd_bwd"};
    for (int k = 0; k < OPS_N; k++)
        for (int b = 0; b < 2; b++) {
            double kv[64], rv[64];
            for (int r = 0; r < rounds; r++) kv[r] = km[r][k][b], rv[r] = rm[r][k][b];
            char cas[128], kr[BENCH_RANGE_LEN], rr[BENCH_RANGE_LEN];
            snprintf(cas, sizeof cas, "%s/%s/%s", ops_names[k], ops_shapes[k], dir[b]);
            bench_jrange(kr, kv, rounds);
            bench_jrange(rr, rv, rounds);
            bench_emit("seg_ops", cas, "ms", 0, bench_median(kv, rounds),
                       bench_median(rv, rounds),
                       "torch-cpu-f32 (F.interpolate, torch.cat, F.cross_entropy, F.group_norm, "
                       "torchvision sigmoid_focal_loss)",
                       NAN, ",\"threads\":%d,\"rounds\":%d,\"kpl_range\":%s,\"ref_range\":%s",
                       SEG_THREADS, rounds, kr, rr);
        }
    kpl_rng_destroy(rng);
    kpl_pool_pop(pool);
}
