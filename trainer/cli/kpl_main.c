/*
 * kpl_main.c — the `kpl` command.
 *
 *   kpl --version | --help
 *   kpl info                 build, devices, memory counters
 *   kpl demo [--threads N] [--device D]
 *                            a small self-checking compute demo
 *   kpl data convert|inspect|verify ...
 *                            KPLRecord datasets (cmd_data.c)
 *   kpl train RECIPE [KEY=VALUE ...] [--resume [FILE]]
 *   kpl eval RECIPE --checkpoint FILE
 *                            training runs (cmd_train.c, ../run/)
 */
#include "cli.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static void usage(FILE *f)
{
    fprintf(f,
            "usage: kpl <command> [options]\n"
            "\n"
            "commands:\n"
            "  train RECIPE.yaml [KEY=VALUE ...] [--resume [FILE]]\n"
            "                         train what a recipe describes (see 'kpl train --help')\n"
            "  eval RECIPE.yaml --checkpoint FILE\n"
            "                         top-1/top-5 of a checkpoint on the recipe's val split\n"
            "  export RECIPE.yaml --checkpoint FILE -o MODEL.kplm\n"
            "                         the inference graph of a checkpoint as a model file\n"
            "  infer MODEL.kplm INPUT...\n"
            "                         run a model file on images or a KPLRecord split\n"
            "  graph RECIPE.yaml --checkpoint FILE | MODEL.kplm [--dot]\n"
            "                         print an inference graph before and after its passes\n"
            "  import onnx MODEL.onnx -o WEIGHTS.kpl | import torch FILE.pth -o WEIGHTS.kpl\n"
            "                         an ONNX model's or a PyTorch checkpoint's weights as a\n"
            "                         checkpoint (model.weights)\n"
            "  info                   build configuration and devices\n"
            "  demo [--threads N] [--device cpu|cuda:N]\n"
            "                         run a small compute demo and check its numbers\n"
            "  data convert|inspect|verify ...\n"
            "                         KPLRecord datasets (see 'kpl data --help')\n"
            "\n"
            "options:\n"
            "  -h, --help             show this help\n"
            "  -V, --version          print the version\n");
}

static int fail(const char *what)
{
    fprintf(stderr, "kpl: %s: %s\n", what, kpl_last_error());
    return 1;
}

static int cmd_info(void)
{
    fputs(kpl_build_info(), stdout);
    printf("devices: cpu");
    int n = kpl_device_count(KPL_DEVICE_CUDA);
    for (int i = 0; i < n; i++) printf(", cuda:%d", i);
    if (kpl_device_type_built(KPL_DEVICE_CUDA) && n == 0)
        printf(" (no CUDA GPU found: %s)", kpl_device_unavailable_reason(KPL_DEVICE_CUDA));
    printf("\ncpu: %s\n", kpl_cpu_math_info());
    return 0;
}

/* A least-squares fit by gradient descent written with the compute calls:
 * recovers known weights from noisy data, so a wrong kernel shows up as a
 * wrong answer. */
static int cmd_demo(int argc, char **argv)
{
    const char *devname = "cpu";
    for (int i = 0; i < argc; i++) {
        if (!strcmp(argv[i], "--threads") && i + 1 < argc) {
            char *end;
            long t = strtol(argv[++i], &end, 10);
            if (*end || t < 1 || t > 1024) {
                fprintf(stderr, "kpl demo: --threads wants a number from 1 to 1024, got '%s'\n",
                        argv[i]);
                return 2;
            }
            kpl_set_num_threads((int)t);
        } else if (!strcmp(argv[i], "--device") && i + 1 < argc) {
            devname = argv[++i];
        } else {
            fprintf(stderr, "kpl demo: unknown option '%s'\n", argv[i]);
            return 2;
        }
    }
    kpl_device *dev;
    if (kpl_device_get(devname, &dev) < 0) return fail("demo");

    enum { N = 4096, D = 64 };
    int64_t sx[2] = {N, D}, sw[2] = {D, 1}, sy[2] = {N, 1};
    kpl_tensor *x = NULL, *w_true = NULL, *y = NULL, *w = NULL, *pred = NULL, *err = NULL,
               *grad = NULL, *loss = NULL, *noise = NULL;
    kpl_rng *rng = kpl_rng_create(7);
    int rc = 1;
    double t0 = kpl_seconds();
    if (!rng) goto out;
#define TRY(e)                              \
    do {                                    \
        if ((e) < 0) {                      \
            rc = fail(#e);                  \
            goto out;                       \
        }                                   \
    } while (0)
    TRY(kpl_tensor_empty(dev, KPL_F32, 2, sx, &x));
    TRY(kpl_tensor_empty(dev, KPL_F32, 2, sw, &w_true));
    TRY(kpl_tensor_empty(dev, KPL_F32, 2, sy, &y));
    TRY(kpl_tensor_empty(dev, KPL_F32, 2, sy, &noise));
    TRY(kpl_tensor_zeros(dev, KPL_F32, 2, sw, &w));
    TRY(kpl_tensor_empty(dev, KPL_F32, 2, sy, &pred));
    TRY(kpl_tensor_empty(dev, KPL_F32, 2, sy, &err));
    TRY(kpl_tensor_empty(dev, KPL_F32, 2, sw, &grad));
    TRY(kpl_tensor_empty(dev, KPL_F32, 0, NULL, &loss)); /* a scalar */
    TRY(kpl_k_normal(x, rng, 0.0, 1.0));
    TRY(kpl_k_uniform(w_true, rng, -1.0, 1.0));
    TRY(kpl_k_normal(noise, rng, 0.0, 0.01));
    TRY(kpl_k_matmul(y, x, w_true, false, false));
    TRY(kpl_k_binary(y, KPL_BIN_ADD, y, noise));

    const double lr = 0.5;
    double first = 0, last = 0;
    int axes_all[2] = {0, 1};
    int steps = 60;
    for (int step = 0; step < steps; step++) {
        TRY(kpl_k_matmul(pred, x, w, false, false));          /* (N,1) */
        TRY(kpl_k_binary(err, KPL_BIN_SUB, pred, y));          /* (N,1) */
        TRY(kpl_k_matmul(grad, x, err, true, false));          /* (D,1) = X^T err */
        TRY(kpl_k_binary_scalar(grad, KPL_BIN_MUL, grad, lr / N, false));
        TRY(kpl_k_binary(w, KPL_BIN_SUB, w, grad));
        TRY(kpl_k_unary(err, KPL_UN_SQUARE, err, 0, 0));
        TRY(kpl_k_reduce(loss, KPL_RED_MEAN, err, axes_all, 2, false, 0));
        double v;
        TRY(kpl_tensor_get(loss, 0, &v));
        if (step == 0) first = v;
        last = v;
        if (step % 10 == 0 || step == steps - 1)
            printf("step %2d  mse %.6f\n", step, v);
    }
    /* Distance of the fit from the true weights. */
    TRY(kpl_k_binary(grad, KPL_BIN_SUB, w, w_true));
    TRY(kpl_k_unary(grad, KPL_UN_ABS, grad, 0, 0));
    TRY(kpl_k_reduce(loss, KPL_RED_MAX, grad, NULL, 0, false, 0));
    double maxerr;
    TRY(kpl_tensor_get(loss, 0, &maxerr));
    kpl_memory_stats ms = kpl_device_memory_stats(dev);
    printf("device %s, %d threads: mse %.4f -> %.6f, max |w - w_true| = %.2e, %.1f ms, "
           "peak %zu bytes\n",
           kpl_device_name(dev), kpl_get_num_threads(), first, last, maxerr,
           (kpl_seconds() - t0) * 1e3, ms.peak_allocated);
    if (!(last < 1e-3 && maxerr < 1e-2)) {
        fprintf(stderr, "kpl demo: the fit did not converge: wrong numbers from a kernel\n");
        rc = 1;
    } else {
        printf("demo OK\n");
        rc = 0;
    }
out:
    kpl_tensor_release(loss);
    kpl_tensor_release(grad);
    kpl_tensor_release(err);
    kpl_tensor_release(pred);
    kpl_tensor_release(w);
    kpl_tensor_release(noise);
    kpl_tensor_release(y);
    kpl_tensor_release(w_true);
    kpl_tensor_release(x);
    kpl_rng_destroy(rng);
    return rc;
}

int main(int argc, char **argv)
{
    if (argc < 2) {
        usage(stderr);
        return 2;
    }
    const char *cmd = argv[1];
    if (!strcmp(cmd, "-h") || !strcmp(cmd, "--help") || !strcmp(cmd, "help")) {
        usage(stdout);
        return 0;
    }
    if (!strcmp(cmd, "-V") || !strcmp(cmd, "--version")) {
        printf("kpl %s\n", kpl_version());
        return 0;
    }
    if (!strcmp(cmd, "info")) return cmd_info();
    if (!strcmp(cmd, "demo")) return cmd_demo(argc - 2, argv + 2);
    if (!strcmp(cmd, "data")) return kpl__cmd_data(argc - 2, argv + 2);
    if (!strcmp(cmd, "train")) return kpl__cmd_train(argc - 2, argv + 2);
    if (!strcmp(cmd, "eval")) return kpl__cmd_eval(argc - 2, argv + 2);
    if (!strcmp(cmd, "export")) return kpl__cmd_export(argc - 2, argv + 2);
    if (!strcmp(cmd, "graph")) return kpl__cmd_graph(argc - 2, argv + 2);
    if (!strcmp(cmd, "infer")) return kpl__cmd_infer(argc - 2, argv + 2);
    if (!strcmp(cmd, "import")) return kpl__cmd_import(argc - 2, argv + 2);
    fprintf(stderr, "kpl: unknown command '%s' (try 'kpl --help')\n", cmd);
    return 2;
}
