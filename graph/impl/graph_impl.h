/* graph_impl.h — private to graph/: the layout of nodes and of the graph
 * data kept in a tensor's meta slot. */
#ifndef KPL_GRAPH_IMPL_H
#define KPL_GRAPH_IMPL_H

#include "graph.h"

#include <stdatomic.h>

#define KPL_NODE_MAX_IN 3

/* What graph/ keeps on a tensor (kernels' meta slot). */
typedef struct {
    bool requires_grad; /* parameter, or result recorded on the tape */
    kpl_tensor *grad;   /* accumulated gradient of a parameter */
    bool grad_buffer;   /* grad is a buffer that backward adds into in place */
    kpl_node *node;     /* producer, NULL for leaves */
    bool node_weak;     /* node not owned: a saved output, which its node owns */
    int out_index;
    kpl_hooks *hooks;   /* parameters' hooks (owned) */
} kpl__tmeta;

struct kpl_node {
    atomic_int refcount;
    kpl_op op;
    kpl_op_attrs attrs;
    int nin;
    struct {
        kpl_node *node;     /* producer of the input (owned), or NULL */
        int out_index;
        kpl_tensor *leaf;   /* the input itself when it is a parameter (owned) */
        bool requires_grad;
        int ndim;
        int64_t shape[KPL_MAX_DIMS];
        kpl_dtype dtype;
        kpl_tensor *saved;  /* the input, kept for the gradient, or NULL */
        bool regen;         /* saved is made again from `node` when the gradient needs it */
    } in[KPL_NODE_MAX_IN];
    int out_ndim;
    int64_t out_shape[KPL_MAX_DIMS];
    kpl_tensor *saved_out;
    bool freed; /* saved tensors released by backward */
    uint32_t mem_label; /* "op @ module" while a memory recorder runs (kpl_mem_label), else 0 */
    kpl_hooks *hooks; /* hooks registered on the node's result (owned) */
    kpl_recompute *region; /* the recomputed region it was recorded in (owned), or NULL */
    size_t region_index;   /* its place in the region's recording order */
    bool dropped;          /* saved tensors let go, waiting for the region's replay */
    bool regenerable;      /* its output can be made again from what it saves (tape.c) */
    bool out_regen;        /* saved_out is made again when the gradient needs it */
    /* a regenerable node's output while it is alive (not owned: its meta
     * clears these as it goes), taken instead of making it again */
    kpl_tensor *live_out;
    const void *live_meta;
};

/* Recomputation (recompute.c): the region this thread records into, the
 * one it replays. */
extern _Thread_local kpl_recompute *kpl__tl_region, *kpl__tl_replay;
/* A node just recorded inside a region (kept in its order) or a replay
 * (its saved tensors handed to the region's node of the same place). */
void kpl__recompute_recorded(kpl_node *n, kpl_tensor *out);
/* A node of a region goes (its place is cleared, its reference dropped). */
void kpl__recompute_forget(kpl_node *n);
/* Random draws inside regions: before a draw from rng, `enter` logs its
 * position (forward) or moves it to the logged one (replay); `leave`
 * moves it back after a replayed draw. */
typedef struct {
    kpl_rng *rng;
    uint64_t seed, offset;
    bool restore;
} kpl__rng_scope;
void kpl__recompute_rng_enter(kpl_rng *rng, kpl__rng_scope *s);
void kpl__recompute_rng_leave(kpl__rng_scope *s);
/* n keeps an alias of out (its output) for the gradient, weakly linked to
 * n so that create_graph gradients computed from it reach n. */
kpl_status kpl__node_save_output(kpl_node *n, kpl_tensor *out);
/* The memory profile's note that n holds (or lets go of) its saved t. */
void kpl__note_saved_tensor(const kpl_node *n, const kpl_tensor *t, bool hold);

kpl__tmeta *kpl__graph_meta(kpl_tensor *t, bool create);

/* Records `out = op(ins)` when grad mode is on and an input requires grad;
 * a no-op otherwise. */
/* The memory profile's note (kpl_memrec): out was made by op in the
 * thread's context. */
void kpl__mem_note_op(kpl_op op, const kpl_tensor *out);
kpl_status kpl__graph_record(kpl_op op, const kpl_op_attrs *attrs, int nin,
                             kpl_tensor *const *ins, kpl_tensor *out);

/* x as op takes it under this thread's autocast dtype (itself, or a
 * recorded cast; NULL passes through). */
kpl_tensor *kpl__autocast(kpl_op op, kpl_tensor *x);
/* Both inputs of a binary op as it takes them (promoted to the wider float
 * dtype when the op is KPL_AUTOCAST_PROMOTE). */
void kpl__autocast_pair(kpl_op op, kpl_tensor **a, kpl_tensor **b);

/* Batch norm with the batch statistics as one recorded op (inputs x,
 * gamma, beta, all given); the batch mean and biased variance go to
 * mean, var (C) when not NULL.  relu: the fused batch_norm_relu op (the
 * caller checked the device has its kernel). */
kpl_tensor *kpl__batch_norm_train(kpl_tensor *x, kpl_tensor *gamma, kpl_tensor *beta,
                                  double eps, kpl_tensor *mean, kpl_tensor *var, bool relu);

/* Group norm as one op (GROUP_NORM) where the device has its kernel for
 * x's dtype (kpl_kernel_registered); gamma and beta (C) required.  Not
 * traced: kpl_group_norm keeps its composition in traces. */
kpl_tensor *kpl__group_norm_fused(kpl_tensor *x, int groups, kpl_tensor *gamma, kpl_tensor *beta,
                                  double eps);
/* Its gradient is kpl_group_norm_bwd (graph.h). */

/* A loss's per-element values reduced (mean, sum) or returned as they are
 * (none); an unknown reduction is KPL_EINVAL. */
kpl_tensor *kpl__reduce_loss(kpl_tensor *per, kpl_reduction red);

/* out = x padded with zero rows, `before` of them first (pad_rows' kernel work). */
kpl_status kpl__pad_rows_into(kpl_tensor *out, kpl_tensor *x, int64_t before);

/* (k) i64 indices from a host array (pool-owned), for index_select. */
kpl_tensor *kpl__index_tensor(kpl_device *dev, int64_t k, const int64_t *v);

#endif
