/* bench_nn.h — what bench_nn.c shares with its case files (bench_nn_*.c). */
#ifndef KPL_BENCH_NN_H
#define KPL_BENCH_NN_H

/* One `bench_nn --step` run (or a reference script's) as its RESULT line
 * gives it. */
typedef struct {
    double ms, rss, flops, first; /* first: the first step, algorithm search included */
    double alloc_peak;            /* kpl's allocator peak, MiB */
    char isa[96], impls[256];     /* oneDNN's ISA and the convolutions' kernels */
} step_result;

/* Runs cmd and parses its RESULT line; ms NaN when there is none. */
step_result run_child(const char *cmd);

/* Prints what failed with kpl's last error and exits 1. */
void die(const char *what) __attribute__((noreturn));

/* The per-layer rows (bench_nn_layers.c): ResNet-50's convolutions against
 * PyTorch's (rate: the 2-thread matmul GFLOP/s), DeepLab's dilated ones. */
void conv_layers(const char *bench_dir, double rate);
void dilated_cases(void);

/* The recompute rows (bench_nn_recompute.c). */
void recompute_cases(const char *self, const char *bench_dir, const char *baselines, int rounds);

#endif
