/*
 * cpu_conv.h — what the CPU convolution's two files share: the cache of
 * chosen implementations and running one (cpu_conv.c), and the timed
 * choice among oneDNN's kernels and kpl's loops (cpu_conv_choose.c).
 */
#ifndef KPL_CPU_CONV_H
#define KPL_CPU_CONV_H

#include "kernels_impl.h"

#include <dnnl.h>
#include <dnnl_debug.h>

#define CACHE_CAP 256

typedef struct {
    kpl_conv_attrs a;
    int threads;
    bool bias;
    bool deterministic; /* chosen without timing (kpl_set_deterministic) */
    dnnl_data_type_t dt; /* every operand's: f32 or bf16 */
    kpl_layout layout;   /* kpl_set_kept_layout's setting when chosen */
    char only[24];       /* kpl__cpu_conv_only's prefix when chosen ("" = any) */
    bool frozen;         /* constant weights (inference): Winograd's memory unbounded */
} conv_key;

/* A cached convolution: the primitive runs on the layouts oneDNN chose
 * (blocked, e.g. nChw8c / OIhw8i8o on AVX2, where its direct JIT kernels
 * live; NHWC for AMX's); an activation whose layout is a kept one
 * (nChw16c, NHWC) is read and written so as it is, and every other
 * operand goes through a reorder when the layouts differ.  Slots:
 * 0 and 1 are read, 2 is written — fwd: src, weights, dst; bwd_data:
 * diff_dst, weights, diff_src; bwd_weight: src, diff_dst, diff_weights. */
typedef struct {
    conv_key key;
    dnnl_primitive_t prim;       /* NULL for kpl's own loops */
    int direct_threads;          /* kpl's own loops (cpu_conv_direct.c) with this many */
    dnnl_memory_desc_t user[3], inner[3], bias;
    dnnl_primitive_t reorder[3]; /* NULL when user == inner */
    dnnl_primitive_t acc_in;     /* KPL_KOP_CONV2D_ACC: the addend, plain to inner (or NULL) */
    kpl_kept kept[3];            /* an activation slot's inner layout, when a kept one */
    /* read activation slots held in another kept layout than inner:
     * that layout's desc and the reorder from it (NULL where none) */
    dnnl_memory_desc_t from_md[2][KPL_KEPT_COUNT];
    dnnl_primitive_t from_kept[2][KPL_KEPT_COUNT];
    int arg[3];
    /* the working memory an execution takes (oneDNN's scratchpad, in
     * user mode: from kpl's cache for the call, not kept by the library) */
    dnnl_memory_desc_t scratch_md;
    size_t scratch;
    char impl[64];               /* oneDNN's implementation name, or "kpl_direct" */
    uint64_t last_use;
} conv_entry;

typedef struct {
    pthread_mutex_t lock;
    dnnl_engine_t engine;
    dnnl_stream_t stream;
    conv_entry e[CACHE_CAP];
    int n;
    uint64_t tick, hits, misses;
    /* the largest scratchpad of a candidate built within the bound, and
     * whether a choice had to go past it (kpl__cpu_conv_tried_scratch) */
    int64_t tried_scratch;
    bool past_bound;
    /* while a candidate is timed: its scratchpad, from malloc (cpu_conv_choose.c) */
    void *trial_scratch;
} conv_cache;

/* The one cache (cpu_conv.c); its lock is held while choosing and running.
 * Both files call it cc. */
extern conv_cache kpl__conv_cc;
#define cc kpl__conv_cc

#define DNNL_TRY(call, what)                                                        \
    do {                                                                            \
        dnnl_status_t ds_ = (call);                                                 \
        if (ds_ != dnnl_success) {                                                  \
            st = KPL_ERROR(KPL_EBACKEND, "conv2d: oneDNN %s failed: %s", what,      \
                           dnnl_status2str(ds_));                                   \
            goto fail;                                                              \
        }                                                                           \
    } while (0)

void kpl__conv_entry_destroy(conv_entry *e);
/* Fills e from one implementation's primitive descriptor (q: the queries
 * of its three slots). */
kpl_status kpl__conv_entry_from_pd(conv_entry *e, const_dnnl_primitive_desc_t pd,
                                   const dnnl_query_t q[3]);
/* Runs a cached convolution on the call's tensors; kpl__conv_cc.lock held. */
kpl_status kpl__conv_run_entry(const conv_entry *e, const kpl_conv_attrs *a,
                               const kpl_kernel_args *args);
/* The fastest implementation for k on the call's own tensors, into *out
 * (cpu_conv_choose.c); layout: the kept layout asked for. */
kpl_status kpl__conv_choose(const conv_key *k, const kpl_kernel_args *args, kpl_layout layout,
                            conv_entry *out);
/* Whether Winograd is a candidate for k (3x3, stride 1, f32, not
 * deterministic). */
bool kpl__conv_winograd_candidate(const conv_key *k);
/* kpl__cpu_conv_only's prefix ("" = any), read under the lock. */
extern char kpl__conv_only_impl[24];

#endif
