/*
 * cpu_conv_choose.c — which implementation serves a CPU convolution
 * problem, timed on its first call (MegEngine's Fastrun): oneDNN's direct
 * kernels, its Winograd ones for 3x3 f32 problems (bounded in memory when
 * training), and kpl's own loops (cpu_conv_direct.c).
 */
#include "cpu_conv.h"

#include <math.h>
#include <string.h>

/* The algorithm choice (MegEngine's Fastrun): every implementation oneDNN
 * offers for the problem (reference loops excepted), each with the
 * reorders its layouts cost, and kpl's own loops on plain tensors (where
 * they apply; with the whole OpenMP team and with one thread) are run on
 * the call's own tensors and the fastest is kept.  Blocked direct kernels
 * win on wide layers (ResNet); kpl's loops on LeNet's narrow ones.  The
 * output is rewritten by the caller's run afterwards.  In deterministic
 * mode the first usable implementation (oneDNN's own preference) is taken
 * untimed, so every process makes the same choice. */
#define MAX_CANDIDATES 6

/* Busy-waits s seconds: a timed run follows some work, as inside a
 * training step, by which time idle OpenMP threads have gone to sleep
 * (OMP_WAIT_POLICY=PASSIVE); back-to-back runs would hide what waking
 * them costs (20-60 us per parallel region on a VM). */
static void busy_wait(double s)
{
    double t0 = kpl_seconds();
    while (kpl_seconds() - t0 < s) {
    }
}

/* Best of the runs after the first (which pays for first touches); the
 * best of two stands for a candidate, as CPU steal on shared machines is
 * bursty.  A candidate whose first run already took CUTOFF times the best
 * time so far cannot win and is not run again: its first run is returned.
 * Without this the first step of ResNet-18 (CIFAR, batch 64) spent 80% of
 * its 100 s timing kpl's plain-layout loops on wide layers three times
 * over. */
#define CUTOFF 4.0

static double time_entry(const conv_entry *e, const kpl_conv_attrs *a,
                         const kpl_kernel_args *args, double best, kpl_status *st)
{
    double t = INFINITY;
    /* its scratchpad from malloc, returned after the trial (a cached block
     * would stay in kpl's cache for a candidate that may lose), its pages
     * faulted in before the clock starts */
    if (e->scratch) {
        cc.trial_scratch = aligned_alloc(64, (e->scratch + 63) & ~(size_t)63);
        if (!cc.trial_scratch) {
            *st = KPL_ERROR(KPL_ENOMEM, "conv2d: no memory for a %zu-byte scratchpad", e->scratch);
            return INFINITY;
        }
        memset(cc.trial_scratch, 0, e->scratch);
    }
    for (int r = 0; r < 3 && *st >= 0; r++) {
        busy_wait(50e-6);
        double t0 = kpl_seconds();
        *st = kpl__conv_run_entry(e, a, args);
        double dt = kpl_seconds() - t0;
        if (r == 0 && dt > CUTOFF * best) {
            t = dt;
            break;
        }
        if (r > 0 && *st >= 0 && dt < t) t = dt;
    }
    free(cc.trial_scratch);
    cc.trial_scratch = NULL;
    return t;
}

/* kpl's loops on the first images of the batch only (two per thread),
 * scaled to the whole batch: on wide layers one run of the whole batch
 * costs seconds, and a loop that far behind the best so far is judged by
 * this estimate alone.  Returns 0 (no estimate) when the batch is too small
 * for a probe to save anything. */
static double probe_direct(const kpl_conv_attrs *a, const kpl_kernel_args *args, int threads,
                           double best, kpl_status *st)
{
    int64_t m = 2 * (int64_t)threads;
    if (best == INFINITY || a->n < 2 * m) return 0;
    kpl_conv_attrs part = *a;
    part.n = m;
    busy_wait(50e-6);
    double t0 = kpl_seconds();
    *st = kpl__conv_direct_run(&part, args, threads);
    return (kpl_seconds() - t0) * (double)a->n / (double)m;
}

/* Seconds one reorder from `from` to `to` takes (best of the runs after
 * the first, as time_entry), on scratch buffers; 0 where it cannot be
 * built.  What kpl's loops, which write plain, cost the consumers of an
 * output the fastest oneDNN kernel would have written in a kept layout:
 * without it a ResNet's stem ran in kpl's loops (50 us faster on its
 * own) and its plain output kept the whole first stage plain, 8 reorders
 * of 65 us per pass (ResNet-18 CIFAR, batch 1, NHWC). */
static double time_reorder(const dnnl_memory_desc_t *from, const dnnl_memory_desc_t *to)
{
    dnnl_primitive_desc_t rpd = NULL;
    dnnl_primitive_t r = NULL;
    dnnl_memory_t m[2] = {NULL, NULL};
    void *buf[2] = {NULL, NULL};
    kpl_device *cpu = kpl_device_cpu();
    double t = INFINITY;
    if (dnnl_reorder_primitive_desc_create(&rpd, from, cc.engine, to, cc.engine, NULL) !=
            dnnl_success ||
        dnnl_primitive_create(&r, rpd) != dnnl_success)
        goto done;
    const dnnl_memory_desc_t *md[2] = {from, to};
    for (int i = 0; i < 2; i++) {
        size_t bytes = dnnl_memory_desc_get_size(md[i]);
        if (kpl_device_alloc(cpu, bytes, "conv2d", &buf[i]) < 0 ||
            dnnl_memory_create(&m[i], md[i], cc.engine, buf[i]) != dnnl_success)
            goto done;
        memset(buf[i], 0, bytes);
    }
    dnnl_exec_arg_t ex[2] = {{DNNL_ARG_FROM, m[0]}, {DNNL_ARG_TO, m[1]}};
    for (int run = 0; run < 3; run++) {
        busy_wait(50e-6);
        double t0 = kpl_seconds();
        if (dnnl_primitive_execute(r, cc.stream, 2, ex) != dnnl_success ||
            dnnl_stream_wait(cc.stream) != dnnl_success)
            break;
        double dt = kpl_seconds() - t0;
        if (run > 0 && dt < t) t = dt;
    }
done:
    kpl_clear_error(); /* a failed scratch allocation only leaves the charge out */
    for (int i = 0; i < 2; i++) {
        if (m[i]) dnnl_memory_destroy(m[i]);
        if (buf[i]) kpl_device_free(cpu, buf[i]);
    }
    if (r) dnnl_primitive_destroy(r);
    if (rpd) dnnl_primitive_desc_destroy(rpd);
    return t == INFINITY ? 0 : t;
}

/* kpl's loops as candidates after oneDNN's (choose): with the team, then
 * with one thread.  One thread does the team's work alone and wins only
 * where forking costs more than the work; if the team's run was cut off,
 * the work is many times the fork and one thread is not tried.  Not where
 * a layout is asked for and the output can be kept in it (the chain is to
 * stay in that layout); a forward output the best kernel keeps in a kept
 * layout costs the loops, which write plain, its reorder (time_reorder).
 * *out and *best as choose keeps them; a candidate that cannot run (out of
 * memory) is skipped. */
static int64_t scratch_limit(const conv_key *k);

static void choose_direct(const conv_key *k, const kpl_kernel_args *args, kpl_layout layout,
                          const conv_entry *base, conv_entry *out, double *best)
{
    const kpl_conv_attrs *a = &k->a;
    if (layout != KPL_LAYOUT_AUTO && a->o % 16 == 0) return;
    double charge = *best < INFINITY && a->kind == KPL_CONV_FWD && out->kept[2]
                        ? time_reorder(&out->user[2], &out->inner[2])
                        : 0;
    for (int nt = k->threads; nt >= 1; nt = nt > 1 ? 1 : 0) {
        /* bounded as Winograd is: the weight gradient's accumulators (a
         * vector per weight and thread) came to 151 MB a thread on
         * DeepLab's 512-channel 3 x 3 layers, and timing them raised the
         * first step's peak RSS by 300 MB though they never won */
        if (!k->frozen && kpl__conv_direct_scratch(a, nt) > scratch_limit(k)) continue;
        kpl_status st = KPL_OK;
        conv_entry cand = *base;
        cand.direct_threads = nt;
        snprintf(cand.impl, sizeof cand.impl, "kpl_direct");
        double t = probe_direct(a, args, nt, *best - charge, &st);
        if (st >= 0 && t <= CUTOFF * *best) t = time_entry(&cand, a, args, *best - charge, &st);
        t += charge;
        if (st < 0) {
            kpl_clear_error();
        } else if (t < *best) {
            if (*best < INFINITY) kpl__conv_entry_destroy(out);
            *out = cand;
            *best = t;
        } else if (t > CUTOFF * *best) {
            return;
        }
    }
}

/* The problem's memory descriptors and geometry, as oneDNN takes them. */
typedef struct {
    dnnl_memory_desc_t usrc, udst, uwei, asrc, adst, awei;
    const dnnl_memory_desc_t *bias; /* NULL without one */
    dnnl_dims_t strides, dil, pad, pad_r;
} conv_mds;

/* The operation descriptor of k's direction with algorithm alg; backward
 * ones also get *hint, the forward's primitive descriptor (freed by the
 * caller).  Winograd's forward is an inference one: it computes the same
 * values, and oneDNN offers jit_fp32_wino_2x3 only there.  The direct
 * forward stays a training one: as an inference one oneDNN lists brgconv
 * first, which deterministic mode (the first kernel, untimed) would then
 * take instead of jit, and which ran the DeepLab recipe's test 1.6x
 * slower on two cores shared with other work. */
static kpl_status op_desc(const conv_key *k, const conv_mds *m, dnnl_alg_kind_t alg,
                          dnnl_convolution_desc_t *d, dnnl_primitive_desc_t *hint)
{
    kpl_status st = KPL_OK;
    dnnl_convolution_desc_t fd;
    bool fwd = k->a.kind == KPL_CONV_FWD;
    DNNL_TRY(dnnl_dilated_convolution_forward_desc_init(
                 fwd ? d : &fd,
                 fwd && alg == dnnl_convolution_winograd ? dnnl_forward_inference
                                                         : dnnl_forward_training,
                 alg,
                 &m->asrc, &m->awei, fwd ? m->bias : NULL, &m->adst, m->strides, m->dil, m->pad,
                 m->pad_r),
             "forward desc");
    if (fwd) return KPL_OK;
    DNNL_TRY(dnnl_primitive_desc_create(hint, &fd, NULL, cc.engine, NULL), "forward pd");
    if (k->a.kind == KPL_CONV_BWD_DATA)
        DNNL_TRY(dnnl_dilated_convolution_backward_data_desc_init(d, alg, &m->asrc, &m->awei,
                                                                  &m->adst, m->strides, m->dil,
                                                                  m->pad, m->pad_r),
                 "backward data desc");
    else
        DNNL_TRY(dnnl_dilated_convolution_backward_weights_desc_init(
                     d, alg, &m->asrc, &m->awei, m->bias, &m->adst, m->strides, m->dil, m->pad,
                     m->pad_r),
                 "backward weights desc");
fail:
    return st;
}

/* The test hook's restriction (kpl__cpu_conv_only): the candidates whose
 * name starts with it, all where empty. */
char kpl__conv_only_impl[sizeof(((conv_key *)0)->only)];

static bool allowed(const conv_key *k, const char *impl)
{
    return !k->only[0] || strncmp(impl, k->only, strlen(k->only)) == 0;
}

/* In training (weights not constant), a candidate's working memory
 * (oneDNN's scratchpad: Winograd's transformed tiles, ~4.5x the activation
 * they come from, and per-thread copies of the transformed weights in the
 * weight gradient; gemm's im2col buffers and per-thread weight gradients)
 * may be at most SCRATCH_MAX times the problem's larger activation, or
 * SCRATCH_FLOOR (oneDNN's Winograd kernels take 6-10 MB whatever the size).
 * Only where no implementation fits is the fastest taken whatever its
 * scratchpad (kpl__conv_choose).  The scratchpad comes from kpl's cache
 * at each execution (user mode; cpu_conv.c), so a chosen one counts in
 * the step's peak wherever its convolution runs near it: with a floor of
 * 32 MB FCOS's head took Winograd kernels of 9-20 MB for 2x faster
 * gradients on 1 MB activations, and its allocator's peak rose 147 ->
 * 166 MB; with 10 MiB, peak RSS growth 222-226 -> 217-220 MB (8 MiB:
 * 210-215, but no Winograd weight gradient at all on small layers, 9-10
 * MB whatever the size) and the step no slower (384-414 ms against
 * 416-417); with 8 MiB ResNet-50 b8 ran no slower (1299-1382 ms against
 * 1245-1818 over three runs each) at 936 MiB against 959-1005 (2-core
 * Xeon, side by side).  The bound was
 * on trying as much as on choosing while oneDNN kept one scratchpad for
 * every primitive, as large as the largest any had been created with,
 * for as long as any primitive lived.  A ResNet-50 (b8) step's timing of a
 * Winograd weight gradient at 512 channels, 7 x 7, which needs 126 MB
 * (160x its activation) and never wins, raised that step's peak RSS by
 * ~100 MB; with only Winograd bounded, at 8x, U-Net's (b8, 128 px)
 * Winograd data gradient on its 32-channel 128 x 128 layer (63 MB, 3.8x)
 * and FCOS's gemm weight gradient on its 512-channel 4 x 4 layer (76 MB,
 * 290x) were timed, lost, and stayed.  Every candidate bounded at 2x:
 * peak RSS growth U-Net 340-346 -> 291-300 MB, DeepLabv3-R18 (513 px, b2)
 * 678-683 -> 650-653, FCOS 266 -> 260-263, steps no slower (U-Net
 * 220-277 against 236-257 ms, ResNet-50 b8 1344-1379 against 1139-1329,
 * DeepLabv3 1464 against 1449, side by side on a 2-core Xeon).  An inference graph's convolutions
 * (constant weights, transformed once) are not bounded: ResNet-50 at
 * batch 32 ran 474-479 ms so against 551 bounded, its peak RSS 1958 MB
 * against 1913 without Winograd. */
#define SCRATCH_MAX 2
#define SCRATCH_FLOOR ((int64_t)10 << 20)

/* The most working memory a training candidate may take (see above). */
static int64_t scratch_limit(const conv_key *k)
{
    const kpl_conv_attrs *a = &k->a;
    int64_t act = a->n * (a->c * a->h * a->w > a->o * a->oh * a->ow ? a->c * a->h * a->w
                                                                    : a->o * a->oh * a->ow);
    act *= (int64_t)sizeof(float);
    return SCRATCH_MAX * act > SCRATCH_FLOOR ? SCRATCH_MAX * act : SCRATCH_FLOOR;
}

/* A candidate's working memory: what oneDNN keeps with the primitive,
 * and the scratchpad each execution takes (user mode: not counted in the
 * former); -1 where it cannot tell. */
static int64_t work_bytes(const_dnnl_primitive_desc_t pd)
{
    int64_t bytes = 0;
    if (dnnl_primitive_desc_query(pd, dnnl_query_memory_consumption_s64, 0, &bytes) !=
        dnnl_success)
        return -1;
    const dnnl_memory_desc_t *smd = dnnl_primitive_desc_query_md(pd, dnnl_query_scratchpad_md, 0);
    return bytes + (smd ? (int64_t)dnnl_memory_desc_get_size(smd) : 0);
}

static bool scratch_ok(const conv_key *k, const_dnnl_primitive_desc_t pd)
{
    if (k->frozen) return true;
    int64_t bytes = work_bytes(pd);
    return bytes >= 0 && bytes <= scratch_limit(k);
}

/* Every implementation oneDNN offers for algorithm alg (reference loops
 * excepted) as a candidate: timed, and kept in *out where fastest (*best
 * its time); in deterministic mode the first usable one, untimed.  An
 * algorithm oneDNN has no kernel for on this CPU or problem (Winograd
 * without AVX-512, say) adds none. */
static kpl_status try_algorithm(const conv_key *k, const kpl_kernel_args *args, const conv_mds *m,
                                dnnl_alg_kind_t alg, const_dnnl_primitive_attr_t attr,
                                const dnnl_query_t q[3], bool bounded, const conv_entry *e,
                                conv_entry *out, double *best)
{
    kpl_status st = KPL_OK;
    dnnl_primitive_desc_t hint = NULL;
    dnnl_primitive_desc_iterator_t it = NULL;
    dnnl_convolution_desc_t d;
    if (op_desc(k, m, alg, &d, &hint) < 0 ||
        dnnl_primitive_desc_iterator_create(&it, &d, attr, cc.engine, hint) != dnnl_success) {
        kpl_clear_error();
        goto fail;
    }
    int tried = 0;
    do {
        dnnl_primitive_desc_t pd = dnnl_primitive_desc_iterator_fetch(it);
        if (!pd) continue;
        const char *impl = NULL;
        dnnl_primitive_desc_query(pd, dnnl_query_impl_info_str, 0, &impl);
        conv_entry cand = *e;
        snprintf(cand.impl, sizeof cand.impl, "%s", impl ? impl : "oneDNN");
        bool usable = strncmp(cand.impl, "ref", 3) != 0 && allowed(k, cand.impl) &&
                      (!(bounded || alg == dnnl_convolution_winograd) || scratch_ok(k, pd));
        if (usable && (st = kpl__conv_entry_from_pd(&cand, pd, q)) >= 0) {
            int64_t bytes = work_bytes(pd);
            if (bounded && bytes > cc.tried_scratch) cc.tried_scratch = bytes;
            if (!bounded) cc.past_bound = true;
            double t = k->deterministic ? 0 : time_entry(&cand, &k->a, args, *best, &st);
            if (t < *best) {
                if (*best < INFINITY) kpl__conv_entry_destroy(out);
                *out = cand;
                *best = t;
            } else {
                kpl__conv_entry_destroy(&cand);
            }
            tried = k->deterministic ? MAX_CANDIDATES : tried + 1;
        }
        dnnl_primitive_desc_destroy(pd);
        if (st < 0) { /* a candidate that fails to build or run is skipped */
            kpl_clear_error();
            st = KPL_OK;
        }
    } while (tried < MAX_CANDIDATES && dnnl_primitive_desc_iterator_next(it) == dnnl_success);
fail:
    if (it) dnnl_primitive_desc_iterator_destroy(it);
    if (hint) dnnl_primitive_desc_destroy(hint);
    return st;
}

/* Winograd (oneDNN's jit_wino_4x3 and jit_fp32_wino_2x3, f32 on AVX-512)
 * is a candidate beside the direct kernels for 3x3 stride-1 undilated
 * convolutions: on ResNet-50's 3x3 layers it ran 1.7-2.1x faster (batch
 * 32, Zen 5), its error against f64 sums measured within 2.3x of the
 * direct kernels' (docs/precision.md).  Timed like the others, so it runs
 * only where it wins; never in deterministic mode (oneDNN's first direct
 * implementation, as before). */
bool kpl__conv_winograd_candidate(const conv_key *k)
{
    const kpl_conv_attrs *a = &k->a;
    return !k->deterministic && k->dt == dnnl_f32 && a->p.groups == 1 && a->kh == 3 &&
           a->kw == 3 && a->p.stride[0] == 1 && a->p.stride[1] == 1 && a->p.dilation[0] == 1 &&
           a->p.dilation[1] == 1;
}

/* Dilated convolutions also try their kernels with NHWC activations where
 * no layout is asked for.  With oneDNN's own choice of layout a training
 * primitive gets no brgconv (it computes in NHWC only), and its dilated
 * problems fall to gemm, which multiplies every tap, padding included:
 * DeepLabv3-R18's ASPP at rates 12 and 18 on its 33 x 33 map (512 -> 256
 * channels, batch 1, two Zen 5 cores) took 6.5 and 6.4 ms in gemm against
 * 3.1 and 2.2 in brgconv, which skips the taps that fall in the padding. */
static bool nhwc_candidate(const conv_key *k, kpl_layout layout)
{
    const kpl_conv_attrs *a = &k->a;
    return !k->deterministic && layout == KPL_LAYOUT_AUTO &&
           (a->p.dilation[0] > 1 || a->p.dilation[1] > 1);
}

kpl_status kpl__conv_choose(const conv_key *k, const kpl_kernel_args *args, kpl_layout layout,
                         conv_entry *out)
{
    kpl_status st = KPL_OK;
    const kpl_conv_attrs *a = &k->a;
    dnnl_primitive_attr_t attr = NULL;
    dnnl_post_ops_t po = NULL;
    int g = a->p.groups;
    dnnl_dims_t src = {a->n, a->c, a->h, a->w}, dst = {a->n, a->o, a->oh, a->ow};
    dnnl_dims_t wei1 = {a->o, a->c, a->kh, a->kw};
    dnnl_dims_t weig = {g, a->o / g, a->c / g, a->kh, a->kw};
    dnnl_dims_t bias = {a->o};
    conv_mds m = {
        .strides = {a->p.stride[0], a->p.stride[1]},
        .dil = {a->p.dilation[0] - 1, a->p.dilation[1] - 1},
        .pad = {a->p.padding[0], a->p.padding[1]},
        /* oneDNN's right padding makes the output size come out exactly. */
        .pad_r = {(a->oh - 1) * a->p.stride[0] + (a->kh - 1) * a->p.dilation[0] + 1 - a->h -
                      a->p.padding[0],
                  (a->ow - 1) * a->p.stride[1] + (a->kw - 1) * a->p.dilation[1] + 1 - a->w -
                      a->p.padding[1]}};
    conv_entry e;
    memset(&e, 0, sizeof e);
    e.key = *k;
    DNNL_TRY(dnnl_memory_desc_init_by_tag(&m.usrc, 4, src, k->dt, dnnl_nchw), "src desc");
    DNNL_TRY(dnnl_memory_desc_init_by_tag(&m.udst, 4, dst, k->dt, dnnl_nchw), "dst desc");
    /* the activations' layout: oneDNN's choice per implementation, or the
     * one kpl_set_kept_layout asks for (where the channels allow it) */
    dnnl_format_tag_t ls = dnnl_format_tag_any, ld = dnnl_format_tag_any;
    if (layout == KPL_LAYOUT_NHWC) ls = ld = dnnl_acdb;
    if (layout == KPL_LAYOUT_NCHW16C) {
        ls = a->c % 16 ? dnnl_format_tag_any : dnnl_aBcd16b;
        ld = a->o % 16 ? dnnl_format_tag_any : dnnl_aBcd16b;
    }
    DNNL_TRY(dnnl_memory_desc_init_by_tag(&m.asrc, 4, src, k->dt, ls), "src desc");
    DNNL_TRY(dnnl_memory_desc_init_by_tag(&m.adst, 4, dst, k->dt, ld), "dst desc");
    if (g == 1) {
        DNNL_TRY(dnnl_memory_desc_init_by_tag(&m.uwei, 4, wei1, k->dt, dnnl_oihw), "weights desc");
        DNNL_TRY(dnnl_memory_desc_init_by_tag(&m.awei, 4, wei1, k->dt, dnnl_format_tag_any),
                 "weights desc");
    } else {
        DNNL_TRY(dnnl_memory_desc_init_by_tag(&m.uwei, 5, weig, k->dt, dnnl_goihw), "weights desc");
        DNNL_TRY(dnnl_memory_desc_init_by_tag(&m.awei, 5, weig, k->dt, dnnl_format_tag_any),
                 "weights desc");
    }
    DNNL_TRY(dnnl_memory_desc_init_by_tag(&e.bias, 1, bias, k->dt, dnnl_x), "bias desc");
    m.bias = k->bias && a->kind != KPL_CONV_BWD_DATA ? &e.bias : NULL;
    dnnl_query_t q[3];
    if (a->kind == KPL_CONV_FWD) {
        e.user[0] = m.usrc, e.user[1] = m.uwei, e.user[2] = m.udst;
        q[0] = dnnl_query_src_md, q[1] = dnnl_query_weights_md, q[2] = dnnl_query_dst_md;
        e.arg[0] = DNNL_ARG_SRC, e.arg[1] = DNNL_ARG_WEIGHTS, e.arg[2] = DNNL_ARG_DST;
    } else if (a->kind == KPL_CONV_BWD_DATA) {
        e.user[0] = m.udst, e.user[1] = m.uwei, e.user[2] = m.usrc;
        q[0] = dnnl_query_diff_dst_md, q[1] = dnnl_query_weights_md, q[2] = dnnl_query_diff_src_md;
        e.arg[0] = DNNL_ARG_DIFF_DST, e.arg[1] = DNNL_ARG_WEIGHTS, e.arg[2] = DNNL_ARG_DIFF_SRC;
    } else {
        e.user[0] = m.usrc, e.user[1] = m.udst, e.user[2] = m.uwei;
        q[0] = dnnl_query_src_md, q[1] = dnnl_query_diff_dst_md, q[2] = dnnl_query_diff_weights_md;
        e.arg[0] = DNNL_ARG_SRC, e.arg[1] = DNNL_ARG_DIFF_DST, e.arg[2] = DNNL_ARG_DIFF_WEIGHTS;
    }
    DNNL_TRY(dnnl_primitive_attr_create(&attr), "attributes");
    DNNL_TRY(dnnl_primitive_attr_set_scratchpad_mode(attr, dnnl_scratchpad_mode_user),
             "scratchpad mode");
    if (a->relu || a->acc) { /* y = relu(conv [+ y]) applied as the sums are stored */
        DNNL_TRY(dnnl_post_ops_create(&po), "post-ops");
        if (a->acc) DNNL_TRY(dnnl_post_ops_append_sum(po, 1.0f), "sum post-op");
        if (a->relu)
            DNNL_TRY(dnnl_post_ops_append_eltwise(po, 1.0f, dnnl_eltwise_relu, 0.0f, 0.0f),
                     "relu post-op");
        DNNL_TRY(dnnl_primitive_attr_set_post_ops(attr, po), "post-ops attribute");
    }
    double best = INFINITY;
    /* every candidate's scratchpad bounded (scratch_limit); only where no
     * implementation fits, the fastest whatever its scratchpad */
    for (int bounded = 1; bounded >= 0 && best == INFINITY; bounded--) {
        if ((st = try_algorithm(k, args, &m, dnnl_convolution_direct, attr, q, bounded, &e, out,
                                &best)) < 0)
            goto fail;
        if (kpl__conv_winograd_candidate(k) &&
            (st = try_algorithm(k, args, &m, dnnl_convolution_winograd, attr, q, bounded, &e, out,
                                &best)) < 0)
            goto fail;
        if (nhwc_candidate(k, layout)) {
            conv_mds mn = m;
            DNNL_TRY(dnnl_memory_desc_init_by_tag(&mn.asrc, 4, src, k->dt, dnnl_acdb), "src desc");
            DNNL_TRY(dnnl_memory_desc_init_by_tag(&mn.adst, 4, dst, k->dt, dnnl_acdb), "dst desc");
            if ((st = try_algorithm(k, args, &mn, dnnl_convolution_direct, attr, q, bounded, &e,
                                    out, &best)) < 0)
                goto fail;
        }
    }
    if (!k->deterministic && k->dt == dnnl_f32 && !a->acc && kpl__conv_direct_supports(a) &&
        allowed(k, "kpl_direct"))
        choose_direct(k, args, layout, &e, out, &best);
    if (best == INFINITY)
        st = KPL_ERROR(KPL_EBACKEND, "conv2d: oneDNN offers no usable implementation");
fail:
    if (attr) dnnl_primitive_attr_destroy(attr);
    if (po) dnnl_post_ops_destroy(po);
    return st;
}

int64_t kpl__cpu_conv_tried_scratch(bool *past_bound)
{
    pthread_mutex_lock(&cc.lock);
    int64_t bytes = cc.tried_scratch;
    if (past_bound) *past_bound = cc.past_bound;
    cc.tried_scratch = 0;
    cc.past_bound = false;
    pthread_mutex_unlock(&cc.lock);
    return bytes;
}

void kpl__cpu_conv_only(const char *prefix)
{
    pthread_mutex_lock(&cc.lock);
    snprintf(kpl__conv_only_impl, sizeof kpl__conv_only_impl, "%s", prefix ? prefix : "");
    pthread_mutex_unlock(&cc.lock);
}
