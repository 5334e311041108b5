/*
 * cpu_conv.c — 2-D convolution on the CPU: forward, backward-data and
 * backward-weights.  f32 and bf16 run on oneDNN's convolution primitives,
 * cached per problem like matmul's (bf16 only where the CPU has AVX512-BF16
 * or AMX: elsewhere oneDNN would emulate it slower than f32 runs, and
 * kernels/ops_matmul.c computes bf16 in f32 instead); f64 runs on the plain
 * reference loops (cpu_conv_ref.c), which are also what the tests check
 * oneDNN against.  Which kernel serves a problem is timed on its first call
 * (choose): oneDNN's direct kernels, its Winograd ones for 3x3 f32
 * problems, kpl's own loops (cpu_conv_direct.c).
 *
 * Activations a primitive computes in nChw16c or NHWC stay so between the
 * ops that read them (kpl__kept_data, storage.c); weights stay OIHW, a
 * constant's reordered copy kept beside it.
 */
#include "cpu_conv.h"

#include <omp.h>
#include <math.h>
#include <string.h>
#include <time.h>

/* ---- oneDNN (f32, bf16) ------------------------------------------------------------------ */

conv_cache kpl__conv_cc = {.lock = PTHREAD_MUTEX_INITIALIZER};

static _Thread_local kpl_conv_choice last_choice;

kpl_conv_choice kpl__cpu_conv_last(void)
{
    return last_choice;
}

void kpl__cpu_conv_impls(char *buf, size_t len)
{
    const char *name[CACHE_CAP];
    int count[CACHE_CAP], n = 0;
    pthread_mutex_lock(&cc.lock);
    for (int i = 0; i < cc.n; i++) {
        int j = 0;
        while (j < n && strcmp(name[j], cc.e[i].impl)) j++;
        if (j == n) name[n] = cc.e[i].impl, count[n++] = 0;
        count[j]++;
    }
    size_t at = 0;
    if (len) buf[0] = 0;
    for (int k = 0; k < n && at < len; k++) { /* the most used first */
        int best = 0;
        for (int j = 1; j < n; j++)
            if (count[j] > count[best]) best = j;
        int w = snprintf(buf + at, len - at, "%s%s*%d", at ? "," : "", name[best], count[best]);
        at += w > 0 ? (size_t)w : 0;
        count[best] = -1;
    }
    pthread_mutex_unlock(&cc.lock);
}

kpl_algo_cache_stats kpl__cpu_conv_cache_stats(void)
{
    pthread_mutex_lock(&cc.lock);
    kpl_algo_cache_stats s = {cc.hits, cc.misses, (uint64_t)cc.n};
    pthread_mutex_unlock(&cc.lock);
    return s;
}

void kpl__conv_entry_destroy(conv_entry *e)
{
    if (e->prim) dnnl_primitive_destroy(e->prim);
    for (int i = 0; i < 3; i++)
        if (e->reorder[i]) dnnl_primitive_destroy(e->reorder[i]);
    for (int i = 0; i < 2; i++)
        for (int t = 0; t < KPL_KEPT_COUNT; t++)
            if (e->from_kept[i][t]) dnnl_primitive_destroy(e->from_kept[i][t]);
    if (e->acc_in) dnnl_primitive_destroy(e->acc_in);
    memset(e, 0, sizeof *e);
}

/* oneDNN's tags of the kept layouts (kpl_kept). */
static const dnnl_format_tag_t kept_tag[KPL_KEPT_COUNT] = {dnnl_abcd, dnnl_aBcd16b, dnnl_acdb};

/* The reorder between slot i's plain layout and the primitive's own, in
 * the direction the data flows. */
static kpl_status make_reorder(conv_entry *e, int i)
{
    kpl_status st = KPL_OK;
    dnnl_primitive_desc_t rpd = NULL;
    if (dnnl_memory_desc_equal(&e->user[i], &e->inner[i])) return KPL_OK;
    const dnnl_memory_desc_t *from = i < 2 ? &e->user[i] : &e->inner[i];
    const dnnl_memory_desc_t *to = i < 2 ? &e->inner[i] : &e->user[i];
    DNNL_TRY(dnnl_reorder_primitive_desc_create(&rpd, from, cc.engine, to, cc.engine, NULL),
             "reorder pd");
    DNNL_TRY(dnnl_primitive_create(&e->reorder[i], rpd), "reorder");
fail:
    if (rpd) dnnl_primitive_desc_destroy(rpd);
    return st;
}

/* Fills e from one implementation's primitive descriptor: the layouts it
 * chose, the reorders to and from plain, the primitive. */
kpl_status kpl__conv_entry_from_pd(conv_entry *e, const_dnnl_primitive_desc_t pd,
                                const dnnl_query_t q[3])
{
    kpl_status st = KPL_OK;
    for (int i = 0; i < 3; i++) {
        e->inner[i] = *dnnl_primitive_desc_query_md(pd, q[i], 0);
        if ((st = make_reorder(e, i)) < 0) goto fail;
        /* activations (not weights) with channels in blocks of 16 can
         * stay in the kept layout oneDNN chose */
        bool act = e->arg[i] == DNNL_ARG_SRC || e->arg[i] == DNNL_ARG_DST ||
                   e->arg[i] == DNNL_ARG_DIFF_SRC || e->arg[i] == DNNL_ARG_DIFF_DST;
        if (!act || e->user[i].ndims != 4 || e->user[i].dims[1] % 16) continue;
        dnnl_memory_desc_t md[KPL_KEPT_COUNT];
        bool has[KPL_KEPT_COUNT] = {false};
        for (int t = KPL_KEPT_NC16; t < KPL_KEPT_COUNT; t++) {
            has[t] = dnnl_memory_desc_init_by_tag(&md[t], 4, e->user[i].dims,
                                                  e->user[i].data_type, kept_tag[t]) == dnnl_success;
            if (has[t] && dnnl_memory_desc_equal(&md[t], &e->inner[i])) e->kept[i] = t;
        }
        /* an input kept in another layout than inner goes there directly,
         * without being turned plain first */
        for (int t = KPL_KEPT_NC16; i < 2 && t < KPL_KEPT_COUNT; t++) {
            dnnl_primitive_desc_t rpd = NULL;
            if (!has[t] || (int)e->kept[i] == t ||
                dnnl_reorder_primitive_desc_create(&rpd, &md[t], cc.engine, &e->inner[i],
                                                   cc.engine, NULL) != dnnl_success)
                continue;
            e->from_md[i][t] = md[t];
            if (dnnl_primitive_create(&e->from_kept[i][t], rpd) != dnnl_success)
                e->from_kept[i][t] = NULL; /* then the input is turned plain first */
            dnnl_primitive_desc_destroy(rpd);
        }
    }
    if (e->key.a.acc && e->reorder[2]) { /* the addend in a plain out goes in first */
        dnnl_primitive_desc_t rpd = NULL;
        DNNL_TRY(dnnl_reorder_primitive_desc_create(&rpd, &e->user[2], cc.engine, &e->inner[2],
                                                    cc.engine, NULL),
                 "reorder pd");
        dnnl_status_t ds = dnnl_primitive_create(&e->acc_in, rpd);
        dnnl_primitive_desc_destroy(rpd);
        DNNL_TRY(ds, "reorder");
    }
    const dnnl_memory_desc_t *smd = dnnl_primitive_desc_query_md(pd, dnnl_query_scratchpad_md, 0);
    if (smd) e->scratch_md = *smd, e->scratch = dnnl_memory_desc_get_size(smd);
    DNNL_TRY(dnnl_primitive_create(&e->prim, pd), "primitive");
fail:
    if (st < 0) kpl__conv_entry_destroy(e);
    return st;
}

/* The ReLU of KPL_KOP_CONV2D_RELU where it is not a oneDNN post-op
 * (kpl's own loops, the f64 reference), with relu's formula. */
static void relu_in_place(kpl_tensor *out)
{
    int64_t n = out->numel;
    if (out->dtype == KPL_F64) {
        double *y = kpl__data(out);
        KPL_PARALLEL_FOR_IF(i, n, n > 65536, y[i] = y[i] < 0 ? 0 : y[i];);
    } else {
        float *y = kpl__data(out);
        KPL_PARALLEL_FOR_IF(i, n, n > 65536, y[i] = y[i] < 0 ? 0 : y[i];);
    }
}

/* Runs a cached convolution on the call's tensors: reorders in, the
 * primitive, reorder out.  Called with cc.lock held. */
kpl_status kpl__conv_run_entry(const conv_entry *e, const kpl_conv_attrs *a,
                            const kpl_kernel_args *args)
{
    if (e->direct_threads) {
        kpl_status dst = kpl__conv_direct_run(a, args, e->direct_threads);
        if (dst >= 0 && a->relu) relu_in_place(args->out);
        return dst;
    }
    kpl_status st = KPL_OK;
    dnnl_memory_t um[3] = {NULL, NULL, NULL}, im[3] = {NULL, NULL, NULL}, bm = NULL, sm = NULL;
    void *buf[3] = {NULL, NULL, NULL}, *scratch = NULL;
    kpl_device *cpu = kpl_device_cpu();
    /* Operands already in (or allowed to be written in) the primitive's
     * kept layout skip their reorder.  Taken before any plain pointer,
     * as a plain access turns a kept storage plain; never when two
     * operands share a storage. */
    const kpl_tensor *opd[3] = {args->in[0], args->in[1], args->out};
    void *direct[3] = {NULL, NULL, NULL};
    bool shared = opd[0]->storage == opd[1]->storage || opd[0]->storage == opd[2]->storage ||
                  opd[1]->storage == opd[2]->storage;
    void *via_kept[2] = {NULL, NULL}; /* inputs reordered from another kept layout */
    kpl_kept via_tag[2] = {KPL_KEPT_PLAIN, KPL_KEPT_PLAIN};
    /* constant weights (forward, and backward-data: a transposed
     * convolution's forward): reordered once, the copy kept with them */
    kpl_storage *ws = opd[1]->storage;
    bool pack = a->kind != KPL_CONV_BWD_WEIGHT && ws->constant && e->reorder[1] && !shared;
    uint64_t pkey = 0;
    bool packed_hit = false;
    if (pack) {
        pkey = 1469598103934665603ULL ^ (uint64_t)opd[1]->offset;
        const unsigned char *d[2] = {(const void *)&e->inner[1], (const void *)&e->user[1]};
        for (int k = 0; k < 2; k++)
            for (size_t j = 0; j < sizeof(dnnl_memory_desc_t); j++)
                pkey = (pkey ^ d[k][j]) * 1099511628211ULL;
        packed_hit = ws->packed && ws->packed_key == pkey &&
                     ws->packed_bytes == dnnl_memory_desc_get_size(&e->inner[1]);
    }
    for (int i = 0; i < 3 && !shared; i++) {
        if (e->kept[i])
            direct[i] = i < 2 || a->acc ? kpl__kept_data(opd[i], e->kept[i]) /* (the addend's) */
                        : kpl__keepable(opd[2]) ? kpl__kept_out(opd[2]) : NULL;
        if (i < 2 && !direct[i] && (via_tag[i] = kpl__kept(opd[i])) && e->from_kept[i][via_tag[i]])
            via_kept[i] = kpl__kept_data(opd[i], via_tag[i]);
    }
    for (int i = 0; i < 3; i++) {
        if (direct[i]) {
            DNNL_TRY(dnnl_memory_create(&im[i], &e->inner[i], cc.engine, direct[i]), "memory");
            continue;
        }
        if (i == 1 && packed_hit) {
            DNNL_TRY(dnnl_memory_create(&im[i], &e->inner[i], cc.engine, ws->packed), "memory");
            continue;
        }
        if (i < 2 && via_kept[i]) {
            DNNL_TRY(dnnl_memory_create(&um[i], &e->from_md[i][via_tag[i]], cc.engine, via_kept[i]),
                     "memory");
            if ((st = kpl_device_alloc(cpu, dnnl_memory_desc_get_size(&e->inner[i]), "conv2d",
                                       &buf[i])) < 0)
                goto fail;
            DNNL_TRY(dnnl_memory_create(&im[i], &e->inner[i], cc.engine, buf[i]), "memory");
            continue;
        }
        void *user_ptr = i < 2 ? (void *)kpl__cdata(opd[i]) : kpl__data(args->out);
        DNNL_TRY(dnnl_memory_create(&um[i], &e->user[i], cc.engine, user_ptr), "memory");
        if (!e->reorder[i]) continue;
        if ((st = kpl_device_alloc(cpu, dnnl_memory_desc_get_size(&e->inner[i]), "conv2d",
                                   &buf[i])) < 0)
            goto fail;
        DNNL_TRY(dnnl_memory_create(&im[i], &e->inner[i], cc.engine, buf[i]), "memory");
    }
    if (e->acc_in && !direct[2]) {
        dnnl_exec_arg_t r[2] = {{DNNL_ARG_FROM, um[2]}, {DNNL_ARG_TO, im[2]}};
        DNNL_TRY(dnnl_primitive_execute(e->acc_in, cc.stream, 2, r), "reorder");
    }
    for (int i = 0; i < 2; i++)
        if ((e->reorder[i] || via_kept[i]) && !direct[i] && !(i == 1 && packed_hit)) {
            dnnl_exec_arg_t r[2] = {{DNNL_ARG_FROM, um[i]}, {DNNL_ARG_TO, im[i]}};
            DNNL_TRY(dnnl_primitive_execute(via_kept[i] ? e->from_kept[i][via_tag[i]] : e->reorder[i],
                                            cc.stream, 2, r),
                     "reorder");
        }
    if (pack && !packed_hit && buf[1] && !via_kept[1]) { /* keep the reordered weights */
        DNNL_TRY(dnnl_stream_wait(cc.stream), "stream wait");
        kpl__storage_drop_packed(ws);
        ws->packed = buf[1];
        ws->packed_bytes = dnnl_memory_desc_get_size(&e->inner[1]);
        ws->packed_key = pkey;
        buf[1] = NULL;
    }
    dnnl_exec_arg_t ex[5];
    int na = 0;
    for (int i = 0; i < 3; i++) ex[na++] = (dnnl_exec_arg_t){e->arg[i], im[i] ? im[i] : um[i]};
    if (args->in[2]) { /* bias (fwd, read) or its gradient (bwd_weight, written) */
        void *pb = a->kind == KPL_CONV_FWD ? (void *)kpl__cdata(args->in[2])
                                           : kpl__data((kpl_tensor *)args->in[2]);
        DNNL_TRY(dnnl_memory_create(&bm, &e->bias, cc.engine, pb), "memory");
        ex[na++] = (dnnl_exec_arg_t){a->kind == KPL_CONV_FWD ? DNNL_ARG_BIAS : DNNL_ARG_DIFF_BIAS,
                                     bm};
    }
    if (e->scratch) { /* the primitive's working memory, from the cache */
        if (!cc.trial_scratch && (st = kpl_device_alloc(cpu, e->scratch, "conv2d", &scratch)) < 0)
            goto fail;
        DNNL_TRY(dnnl_memory_create(&sm, &e->scratch_md, cc.engine,
                                    cc.trial_scratch ? cc.trial_scratch : scratch),
                 "memory");
        ex[na++] = (dnnl_exec_arg_t){DNNL_ARG_SCRATCHPAD, sm};
    }
    DNNL_TRY(dnnl_primitive_execute(e->prim, cc.stream, na, ex), "execute");
    if (e->reorder[2] && !direct[2]) {
        dnnl_exec_arg_t r[2] = {{DNNL_ARG_FROM, im[2]}, {DNNL_ARG_TO, um[2]}};
        DNNL_TRY(dnnl_primitive_execute(e->reorder[2], cc.stream, 2, r), "reorder");
    }
    DNNL_TRY(dnnl_stream_wait(cc.stream), "stream wait");
    if (direct[2]) kpl__storage_set_kept(args->out, e->kept[2]);
fail:
    for (int i = 0; i < 3; i++) {
        if (um[i]) dnnl_memory_destroy(um[i]);
        if (im[i]) dnnl_memory_destroy(im[i]);
        if (buf[i]) kpl_device_free(cpu, buf[i]);
    }
    if (bm) dnnl_memory_destroy(bm);
    if (sm) dnnl_memory_destroy(sm);
    if (scratch) kpl_device_free(cpu, scratch);
    return st;
}

static kpl_status conv_dnnl(const kpl_conv_attrs *a, const kpl_kernel_args *args,
                           dnnl_data_type_t dt)
{
    conv_key k;
    memset(&k, 0, sizeof k);
    k.dt = dt;
    kpl_conv_attrs_key(&k.a, a);
    k.threads = omp_get_max_threads();
    k.bias = args->in[2] != NULL;
    k.deterministic = kpl_get_deterministic();
    k.layout = kpl_get_kept_layout();
    /* only where it decides something (Winograd's memory bound): other
     * problems share one entry whether their weights are constant or not,
     * so a model file's executor runs eager mode's kernels, bit for bit */
    k.frozen = kpl__conv_winograd_candidate(&k) && a->kind != KPL_CONV_BWD_WEIGHT &&
               args->in[1]->storage->constant;
    /* bf16: oneDNN 2.6's candidates on plain or nChw16c inputs (gemm) win
     * the per-call timing link by link while the chain as a whole loses
     * to every convolution in NHWC: a ResNet-50 b8 step ran 1.16x faster
     * so on two AMX cores (docs/gpu.md, "The AMX CPU against PyTorch"),
     * 1.07x faster with 16% less peak memory on Zen 5's AVX512-BF16
     * (ResNet-18 CIFAR b64 level), so NHWC is the choice for bf16; f32
     * keeps oneDNN's own per implementation. */
    if (k.layout == KPL_LAYOUT_AUTO && dt == dnnl_bf16) k.layout = KPL_LAYOUT_NHWC;
    kpl_status st = KPL_OK;
    pthread_mutex_lock(&cc.lock);
    memcpy(k.only, kpl__conv_only_impl, sizeof k.only);
    conv_entry *e = NULL;
    for (int i = 0; i < cc.n; i++)
        if (!memcmp(&cc.e[i].key, &k, sizeof k)) {
            e = &cc.e[i];
            cc.hits++;
            break;
        }
    if (!e) {
        cc.misses++;
        if (!cc.engine) DNNL_TRY(dnnl_engine_create(&cc.engine, dnnl_cpu, 0), "engine");
        if (!cc.stream)
            DNNL_TRY(dnnl_stream_create(&cc.stream, cc.engine, dnnl_stream_default_flags), "stream");
        conv_entry fresh;
        memset(&fresh, 0, sizeof fresh);
        /* the candidates' timed runs would add into the addend: with
         * KPL_KOP_CONV2D_ACC they run on a scratch output */
        kpl_kernel_args timed = *args;
        if (a->acc && (st = kpl_tensor_empty(kpl_device_cpu(), args->out->dtype, 4,
                                             args->out->shape, &timed.out)) < 0)
            goto fail;
        st = kpl__conv_choose(&k, &timed, k.layout, &fresh);
        if (st < 0 && k.layout != KPL_LAYOUT_AUTO) {
            /* no implementation for the asked layout (this ISA, dtype or
             * problem): oneDNN's own choice */
            kpl_clear_error();
            st = kpl__conv_choose(&k, &timed, KPL_LAYOUT_AUTO, &fresh);
        }
        if (a->acc) kpl_tensor_release(timed.out);
        if (st < 0) goto fail;
        if (cc.n < CACHE_CAP) {
            e = &cc.e[cc.n++];
        } else { /* evict the least recently used */
            e = &cc.e[0];
            for (int i = 1; i < cc.n; i++)
                if (cc.e[i].last_use < e->last_use) e = &cc.e[i];
            kpl__conv_entry_destroy(e);
        }
        *e = fresh;
    }
    e->last_use = ++cc.tick;
    snprintf(last_choice.impl, sizeof last_choice.impl, "%s", e->impl);
    last_choice.kind = a->kind;
    last_choice.dtype = args->out->dtype;
    last_choice.out_kept = e->kept[2];
    /* Execution stays under the lock (see cpu_matmul.c). */
    st = kpl__conv_run_entry(e, a, args);
fail:
    pthread_mutex_unlock(&cc.lock);
    return st;
}

static kpl_status cpu_conv(const kpl_kernel_args *args)
{
    const kpl_conv_attrs *a = args->attrs;
    if (args->out->dtype == KPL_F32) return conv_dnnl(a, args, dnnl_f32);
    if (args->out->dtype == KPL_BF16) return conv_dnnl(a, args, dnnl_bf16);
    kpl__conv_ref_run(a, args);
    if (a->kind == KPL_CONV_FWD && a->relu) relu_in_place(args->out);
    return KPL_OK;
}

void kpl__cpu_register_conv(void)
{
    const kpl_kop kops[3] = {KPL_KOP_CONV2D, KPL_KOP_CONV2D_RELU, KPL_KOP_CONV2D_ACC};
    for (int i = 0; i < 3; i++) {
        kpl_kernel_register(kops[i], KPL_DEVICE_CPU, KPL_F32, cpu_conv);
        kpl_kernel_register(kops[i], KPL_DEVICE_CPU, KPL_F64, cpu_conv);
        if (kpl__cpu_bf16_native()) kpl_kernel_register(kops[i], KPL_DEVICE_CPU, KPL_BF16, cpu_conv);
    }
}
