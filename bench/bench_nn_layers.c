/*
 * bench_nn_layers.c — bench_nn's per-layer rows: every distinct ResNet-50
 * convolution against PyTorch's (conv_layer/...), and DeepLabv3-R18's
 * dilated convolutions against the space-to-batch formulation
 * (dilated_conv/...).
 */
#include "bench_common.h"
#include "bench_nn.h"
#include "trainer.h"

/* ---- per-layer convolutions ------------------------------------------------------- */

typedef struct {
    int64_t c, o, hw; /* input channels, output channels, input plane */
    int k, stride;
} conv_shape;

/* Every distinct convolution of ResNet-50 (torchvision v1.5: stride on the
 * 3x3), batch 8. */
static int r50_shapes(conv_shape *s)
{
    int n = 0;
    s[n++] = (conv_shape){3, 64, 224, 7, 2};
    int64_t in = 64, hw = 56;
    static const int counts[4] = {3, 4, 6, 3};
    for (int st = 0; st < 4; st++) {
        int64_t planes = 64 << st, out = planes * 4;
        for (int b = 0; b < 2 && b < counts[st]; b++) { /* blocks 2.. repeat block 1 */
            int stride = (st > 0 && b == 0) ? 2 : 1;
            s[n++] = (conv_shape){in, planes, hw, 1, 1};
            s[n++] = (conv_shape){planes, planes, hw, 3, stride};
            s[n++] = (conv_shape){planes, out, hw / stride, 1, 1};
            if (b == 0) s[n++] = (conv_shape){in, out, hw, 1, stride};
            hw /= stride;
            in = out;
        }
    }
    /* drop repeats (block 1 of stage 1 reads 64 channels, the others 256) */
    int m = 0;
    for (int i = 0; i < n; i++) {
        bool dup = false;
        for (int j = 0; j < m; j++)
            dup |= !memcmp(&s[i], &s[j], sizeof *s);
        if (!dup) s[m++] = s[i];
    }
    return m;
}

typedef struct {
    int n;
    double ms[64][3];
} torch_layers;

static void layer_line(const char *line, void *ctx)
{
    torch_layers *t = ctx;
    int i;
    double f, d, w;
    if (sscanf(line, "LAYER %d %lf %lf %lf", &i, &f, &d, &w) == 4 && i >= 0 && i < 64) {
        t->ms[i][0] = f;
        t->ms[i][1] = d;
        t->ms[i][2] = w;
        if (i + 1 > t->n) t->n = i + 1;
    }
}

void conv_layers(const char *bench_dir, double rate)
{
    conv_shape s[64];
    int n = r50_shapes(s);
    const int64_t B = 8;
    torch_layers tl;
    for (int i = 0; i < 64; i++)
        tl.ms[i][0] = tl.ms[i][1] = tl.ms[i][2] = NAN;
    tl.n = 0;
    char cmd[4096];
    int len = snprintf(cmd, sizeof cmd, "/usr/bin/python3 %s/torch_conv_layers.py 2 %lld",
                       bench_dir, (long long)B);
    for (int i = 0; i < n; i++)
        len +=
            snprintf(cmd + len, sizeof cmd - (size_t)len, " %lld,%lld,%lld,%d,%d",
                     (long long)s[i].c, (long long)s[i].o, (long long)s[i].hw, s[i].k, s[i].stride);
    bench_run_lines(cmd, layer_line, &tl);

    kpl_set_num_threads(2);
    kpl_device *cpu = kpl_device_cpu();
    kpl_rng *rng = kpl_rng_create(5);
    for (int i = 0; i < n; i++) {
        kpl_conv2d_params p = KPL_CONV2D_PARAMS_INIT;
        p.stride[0] = p.stride[1] = s[i].stride;
        p.padding[0] = p.padding[1] = s[i].k / 2;
        int64_t ohw = (s[i].hw + 2 * (s[i].k / 2) - s[i].k) / s[i].stride + 1;
        int64_t xs[4] = {B, s[i].c, s[i].hw, s[i].hw}, ws[4] = {s[i].o, s[i].c, s[i].k, s[i].k},
                ys[4] = {B, s[i].o, ohw, ohw};
        kpl_tensor *x = NULL, *w = NULL, *y = NULL, *gx = NULL, *gw = NULL;
        if (kpl_tensor_empty(cpu, KPL_F32, 4, xs, &x) < 0 || kpl_k_normal(x, rng, 0, 1) < 0 ||
            kpl_tensor_empty(cpu, KPL_F32, 4, ws, &w) < 0 || kpl_k_normal(w, rng, 0, 0.1) < 0 ||
            kpl_tensor_empty(cpu, KPL_F32, 4, ys, &y) < 0 ||
            kpl_tensor_empty(cpu, KPL_F32, 4, xs, &gx) < 0 ||
            kpl_tensor_empty(cpu, KPL_F32, 4, ws, &gw) < 0)
            die("conv operands");
        double flop = 2.0 * (double)(B * s[i].o * ohw * ohw * s[i].c * s[i].k * s[i].k);
        static const char *dir[3] = {"fwd", "bwd_data", "bwd_weight"};
        for (int d = 0; d < 3; d++) {
            double t[6];
            for (int r = 0; r < 6; r++) {
                double t0 = bench_now();
                kpl_status st = d == 0   ? kpl_k_conv2d(y, x, w, NULL, &p)
                                : d == 1 ? kpl_k_conv2d_bwd_data(gx, y, w, &p)
                                         : kpl_k_conv2d_bwd_weight(gw, NULL, x, y, &p);
                if (st < 0) die("conv");
                t[r] = (bench_now() - t0) * 1e3;
            }
            double ms = bench_median(t + 1, 5), tms = tl.ms[i][d];
            char cas[128], n1[BENCH_NUM_LEN], n2[BENCH_NUM_LEN];
            snprintf(cas, sizeof cas, "resnet50_b8/%lldx%lldx%lld_k%d_s%d/%s", (long long)s[i].c,
                     (long long)s[i].o, (long long)s[i].hw, s[i].k, s[i].stride, dir[d]);
            bench_emit("conv_layer", cas, "GFLOP/s", 1, flop / ms / 1e6,
                       isnan(tms) ? NAN : flop / tms / 1e6, "torch-cpu", NAN,
                       ",\"ms_kpl\":%s,\"fraction_of_matmul\":%s", bench_jnum(n1, ms),
                       bench_jnum(n2, flop / ms / 1e6 / rate));
        }
        kpl_tensor_release(x);
        kpl_tensor_release(w);
        kpl_tensor_release(y);
        kpl_tensor_release(gx);
        kpl_tensor_release(gw);
    }
    kpl_rng_destroy(rng);
}

/* ---- dilated convolutions: oneDNN's against space-to-batch ------------------------- */

/* Times one convolution direction (median of 5 after a warm-up), ms. */
static double conv_ms(int d, kpl_tensor *x, kpl_tensor *w, kpl_tensor *y, kpl_tensor *gx,
                      kpl_tensor *gw, const kpl_conv2d_params *p)
{
    double t[6];
    for (int r = 0; r < 6; r++) {
        double t0 = bench_now();
        kpl_status st = d == 0   ? kpl_k_conv2d(y, x, w, NULL, p)
                        : d == 1 ? kpl_k_conv2d_bwd_data(gx, y, w, p)
                                 : kpl_k_conv2d_bwd_weight(gw, NULL, x, y, p);
        if (st < 0) die("conv");
        t[r] = (bench_now() - t0) * 1e3;
    }
    return bench_median(t + 1, 5);
}

/* DeepLabv3-R18 at output stride 16 on 513 x 513 crops (batch 2): its
 * dilated 3 x 3 convolutions (layer4 at dilation 2, ASPP at 6, 12, 18 on
 * the 33 x 33 map) run as they are (oneDNN's dilated kernels, the
 * chooser's pick), against the space-to-batch formulation's convolution:
 * the input cut into d^2 phase images of ceil(33 / d)^2 cells, an
 * undilated 3 x 3 convolution over all of them (padding 1).  Only that
 * convolution is timed for space-to-batch: its two rearrangements (a
 * permuted copy of x and of y each way) come on top, so a ratio above 1
 * means oneDNN's dilated kernel wins whatever they cost. */
void dilated_cases(void)
{
    static const struct {
        int64_t c, o;
        int d;
    } shapes[] = {{512, 512, 2}, {512, 256, 6}, {512, 256, 12}, {512, 256, 18}};
    const int64_t B = 2, hw = 33;
    kpl_set_num_threads(2);
    kpl_device *cpu = kpl_device_cpu();
    kpl_rng *rng = kpl_rng_create(8);
    static const char *dir[3] = {"fwd", "bwd_data", "bwd_weight"};
    for (size_t i = 0; i < sizeof shapes / sizeof shapes[0]; i++) {
        int d = shapes[i].d;
        int64_t ph = (hw + d - 1) / d; /* a phase image's side */
        kpl_conv2d_params pd = KPL_CONV2D_PARAMS_INIT, ps = KPL_CONV2D_PARAMS_INIT;
        pd.padding[0] = pd.padding[1] = d;
        pd.dilation[0] = pd.dilation[1] = d;
        ps.padding[0] = ps.padding[1] = 1;
        int64_t xs[2][4] = {{B, shapes[i].c, hw, hw}, {B * d * d, shapes[i].c, ph, ph}};
        int64_t ys[2][4] = {{B, shapes[i].o, hw, hw}, {B * d * d, shapes[i].o, ph, ph}};
        int64_t ws[4] = {shapes[i].o, shapes[i].c, 3, 3};
        double ms[2][3];
        for (int v = 0; v < 2; v++) {
            kpl_tensor *x = NULL, *w = NULL, *y = NULL, *gx = NULL, *gw = NULL;
            if (kpl_tensor_empty(cpu, KPL_F32, 4, xs[v], &x) < 0 ||
                kpl_k_normal(x, rng, 0, 1) < 0 || kpl_tensor_empty(cpu, KPL_F32, 4, ws, &w) < 0 ||
                kpl_k_normal(w, rng, 0, 0.1) < 0 ||
                kpl_tensor_empty(cpu, KPL_F32, 4, ys[v], &y) < 0 ||
                kpl_tensor_empty(cpu, KPL_F32, 4, xs[v], &gx) < 0 ||
                kpl_tensor_empty(cpu, KPL_F32, 4, ws, &gw) < 0)
                die("conv operands");
            for (int k = 0; k < 3; k++)
                ms[v][k] = conv_ms(k, x, w, y, gx, gw, v ? &ps : &pd);
            kpl_tensor *ts[] = {x, w, y, gx, gw};
            for (int t = 0; t < 5; t++)
                kpl_tensor_release(ts[t]);
        }
        for (int k = 0; k < 3; k++) {
            char cas[128];
            snprintf(cas, sizeof cas, "deeplab_r18_b2/%lldx%lldx%lld_k3_d%d/%s",
                     (long long)shapes[i].c, (long long)shapes[i].o, (long long)hw, d, dir[k]);
            bench_emit("dilated_conv", cas, "ms", 0, ms[0][k], ms[1][k],
                       "kpl space-to-batch (its convolution alone; the rearrangements not "
                       "counted)",
                       NAN, ",\"phase_images\":%d,\"phase_side\":%lld", d * d, (long long)ph);
        }
    }
    kpl_rng_destroy(rng);
}
