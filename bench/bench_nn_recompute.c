/*
 * bench_nn_recompute.c — bench_nn's `recompute` rows (KPL_BENCH_NN_ONLY=
 * recompute): ResNet-50 training steps with memory.recompute blocks and
 * auto against kpl without it and against torch.utils.checkpoint.
 */
#include "bench_common.h"
#include "bench_nn.h"

/* ResNet-50 f32 training steps with its residual blocks recomputed in the
 * backward: kpl at batch 8 with and without, kpl at batch 16 with, and
 * PyTorch at batch 8 with torch.utils.checkpoint on the same blocks
 * (bench/torch_checkpoint.py), alternating, each in a process of its own
 * (peak RSS is the process's); and kpl at batch 8 with memory.recompute:
 * auto under a budget halfway between the allocator peaks of the first
 * two.  Targets (issue "Memory"): batch 16 with recomputation in no more
 * peak than batch 8 without; recomputation at most 1.35x the step, auto
 * at most 1.5x and under its budget; against PyTorch's checkpointing a
 * lower peak and no slower. */
void recompute_cases(const char *self, const char *bench_dir, const char *baselines, int rounds)
{
    enum { NONE8, REC8, REC16, TORCH8, AUTO8, NRUNS };
    double ms[NRUNS][8], rss[NRUNS][8], apeak[NRUNS][8], budget = NAN;
    char cmd[4096];
    for (int r = 0; r < rounds; r++)
        for (int v = 0; v < NRUNS; v++) {
            if (v == TORCH8)
                snprintf(cmd, sizeof cmd,
                         "/usr/bin/python3 %s/torch_checkpoint.py %s r50 checkpoint 2 8 1 3",
                         bench_dir, baselines);
            else if (v == AUTO8) {
                /* a budget halfway between the allocator's peaks with every
                 * block recomputed and with none (round 0's) */
                if (r == 0) budget = floor((apeak[NONE8][0] + apeak[REC8][0]) / 2);
                snprintf(cmd, sizeof cmd, "%s --step resnet50 8 1 3 f32 budget=%.0f", self, budget);
            } else
                snprintf(cmd, sizeof cmd, "%s --step resnet50 %d 1 3 f32%s", self,
                         v == REC16 ? 16 : 8, v == NONE8 ? "" : " recompute");
            step_result k = run_child(cmd);
            ms[v][r] = k.ms;
            rss[v][r] = k.rss;
            apeak[v][r] = k.alloc_peak;
        }
    double m[NRUNS], p[NRUNS];
    char rg[NRUNS][2][BENCH_RANGE_LEN];
    for (int v = 0; v < NRUNS; v++) {
        m[v] = bench_median(ms[v], rounds);
        p[v] = bench_median(rss[v], rounds);
        bench_jrange(rg[v][0], ms[v], rounds);
        bench_jrange(rg[v][1], rss[v], rounds);
    }
    bench_emit("recompute", "resnet50_b8/step_ms_blocks_vs_none", "ms", 0, m[REC8], m[NONE8],
               "kpl without recomputation", 1 / 1.35, ",\"ms_kpl\":%s,\"ms_ref\":%s", rg[REC8][0],
               rg[NONE8][0]);
    bench_emit("recompute", "resnet50_b8/peak_rss_blocks_vs_none", "MiB", 0, p[REC8], p[NONE8],
               "kpl without recomputation", NAN, ",\"rss_kpl\":%s,\"rss_ref\":%s", rg[REC8][1],
               rg[NONE8][1]);
    bench_emit("recompute", "resnet50_b16_blocks_vs_b8_none/peak_rss", "MiB", 0, p[REC16], p[NONE8],
               "kpl b8 without recomputation", 1.0, ",\"rss_kpl\":%s,\"rss_ref\":%s,\"ms_b16\":%s",
               rg[REC16][1], rg[NONE8][1], rg[REC16][0]);
    bench_emit("recompute", "resnet50_b8/peak_rss_vs_torch_checkpoint", "MiB", 0, p[REC8],
               p[TORCH8], "torch-cpu torch.utils.checkpoint", 1.0, ",\"rss_kpl\":%s,\"rss_ref\":%s",
               rg[REC8][1], rg[TORCH8][1]);
    double ap = 0;
    for (int r = 0; r < rounds; r++)
        ap = apeak[AUTO8][r] > ap ? apeak[AUTO8][r] : ap;
    bench_emit("recompute", "resnet50_b8/step_ms_auto_vs_none", "ms", 0, m[AUTO8], m[NONE8],
               "kpl without recomputation", 1 / 1.5,
               ",\"ms_kpl\":%s,\"ms_ref\":%s,\"budget_mib\":%.0f", rg[AUTO8][0], rg[NONE8][0],
               budget);
    bench_emit("recompute", "resnet50_b8/alloc_peak_auto_vs_budget", "MiB", 0, ap, budget,
               "memory.budget_mb", 1.0,
               ",\"alloc_peak_none_mib\":%.0f,\"alloc_peak_blocks_mib\":%.0f,\"rss_kpl\":%s",
               bench_median(apeak[NONE8], rounds), bench_median(apeak[REC8], rounds), rg[AUTO8][1]);
    bench_emit("recompute", "resnet50_b8/step_ms_vs_torch_checkpoint", "ms", 0, m[REC8], m[TORCH8],
               "torch-cpu torch.utils.checkpoint", 1.0, ",\"ms_kpl\":%s,\"ms_ref\":%s", rg[REC8][0],
               rg[TORCH8][0]);
}
