/*
 * kernels_impl.h — private to kernels/ (and to the backends under it).
 *
 * Struct layouts, the error macros every module uses internally, the device
 * backend vtable, the caching allocator, and the attribute structs that the
 * front ends (ops_*.c) hand to the registered kernels.
 */
#ifndef KPL_KERNELS_IMPL_H
#define KPL_KERNELS_IMPL_H

#include "kernels.h"
#include "kpl_config.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#ifdef __cplusplus
extern "C" {
#endif

/* ------------------------------------------------------------------------ */
/* Caching allocator                                                          */
/* ------------------------------------------------------------------------ */

/* Raw memory source behind an allocator (device memory, pinned host...). */
typedef struct {
    kpl_status (*alloc)(void *ctx, size_t bytes, void **out); /* blocking */
    void (*free)(void *ctx, void *ptr);
    void *ctx;
    const char *name; /* for messages: "cpu", "cuda:0", "pinned" */
    bool host_visible; /* host memory (CPU, pinned): poisoned under ASan */
    /* No caching: every block is a segment of its own of exactly the bytes
     * asked for, released when freed, so that a kernel reading or writing
     * past its tensor does so past an allocation compute-sanitizer knows
     * (KPL_CUDA_ALLOC_UNCACHED=1; the GPU kit's sanitizer runs).  Slow. */
    bool uncached;
    /* Plain host pages (the CPU's): the pages of free blocks may be handed
     * back to the OS while the cache holds the block (alloc.c). */
    bool trim;
} kpl_raw_source;
/* The bytes of free blocks a trimming source keeps resident past its
 * high-water mark of allocated bytes; past them the pages of those freed
 * longest ago go back to the OS (KPL_ALLOC_KEEP_MB; alloc.c).  SIZE_MAX
 * keeps all.  The allocators' high-water marks start again from what they
 * hold now.  Returns the previous setting. */
size_t kpl__allocator_set_keep(size_t bytes);
/* KPL_ALLOC_KEEP_MB's value v as bytes: 'all' (SIZE_MAX) or MiB from 0
 * (fractions allowed); false for anything else. */
bool kpl__parse_keep_mb(const char *v, size_t *bytes);
/* Whether a trimming source's segments lend the pages of their free
 * chunks to chunks being handed out that hold none (KPL_ALLOC_LEND, on by
 * default; alloc.c).  Returns the previous setting. */
bool kpl__allocator_set_lend(bool on);

typedef struct kpl_allocator kpl_allocator;

kpl_allocator *kpl__allocator_create(kpl_raw_source src);
void kpl__allocator_destroy(kpl_allocator *a); /* frees every segment */
kpl_status kpl__allocator_alloc(kpl_allocator *a, size_t bytes,
                                const char *what, void **out);
void kpl__allocator_free(kpl_allocator *a, void *ptr);
kpl_memory_stats kpl__allocator_stats(kpl_allocator *a);
/* kpl_device_set_budget / kpl_device_budget for this thread (alloc.c). */
void kpl__allocator_set_budget(kpl_allocator *a, kpl_device *dev, size_t bytes,
                               kpl_release_fn release, void *user);
size_t kpl__allocator_budget(const kpl_allocator *a);
void kpl__allocator_reset_peak(kpl_allocator *a);
void kpl__allocator_empty_cache(kpl_allocator *a);
void kpl__allocator_set_limit(kpl_allocator *a, size_t bytes);
/* The memory recorder (memrec.c) an allocator logs to (NULL: none); its
 * live blocks open the log.  KPL_ESTATE if another one runs. */
kpl_status kpl__allocator_attach(kpl_allocator *a, kpl_memrec *r);
/* A note about the block at ptr, in the log's order (kpl_memrec_note). */
void kpl__allocator_note(kpl_allocator *a, const void *ptr, uint8_t note, uint32_t label);
/* Appends an event to the log: 'B' live at the start (label: the context
 * it was allocated in), 'A' alloc (the allocating thread's context), 'F'
 * free, 'N' a note; under the allocator's lock. */
void kpl__memrec_log(kpl_memrec *r, char type, const void *ptr, size_t size, const char *what,
                     uint8_t note, uint32_t label);

/* ------------------------------------------------------------------------ */
/* Devices                                                                    */
/* ------------------------------------------------------------------------ */

/* One backend per device type.  Every member blocks until done unless said
 * otherwise; all are thread-safe.  Members marked optional may be NULL. */
typedef struct {
    const char *name;
    kpl_device_type type;
    /* Usable device count; 0 when the driver reports none.  `why` receives
     * a static reason when 0 (optional). */
    int (*count)(const char **why);
    /* Prepares device `dev->index` (streams, handles).  Called once. */
    kpl_status (*init)(kpl_device *dev);
    kpl_status (*raw_alloc)(void *dev, size_t bytes, void **out);
    void (*raw_free)(void *dev, void *ptr);
    /* Pinned host memory for transfers (optional). */
    kpl_status (*pinned_alloc)(void *dev, size_t bytes, void **out);
    void (*pinned_free)(void *dev, void *ptr);
    /* Page-locks existing host memory for fast transfers, and undoes it
     * (optional: NULL where host memory needs no pinning). */
    kpl_status (*host_register)(kpl_device *dev, void *ptr, size_t bytes);
    void (*host_unregister)(kpl_device *dev, void *ptr);
    /* Copies between host and device.  copy_d2h returns with the bytes
     * on the host.  copy_h2d returns once the device copy is ordered
     * before every later kernel; from page-locked host memory it may
     * return before the copy has read src (host_fence waits for that). */
    kpl_status (*copy_h2d)(kpl_device *dev, void *dst, const void *src,
                           size_t n);
    kpl_status (*copy_d2h)(kpl_device *dev, void *dst, const void *src,
                           size_t n);
    kpl_status (*copy_d2d)(kpl_device *dev, void *dst, const void *src,
                           size_t n); /* asynchronous on the compute stream */
    /* Waits until no upload queued by copy_h2d still reads host memory, so
     * that memory may be written or handed back (optional: NULL where
     * uploads are synchronous).  Cheap when nothing is in flight. */
    kpl_status (*host_fence)(kpl_device *dev);
    kpl_status (*synchronize)(kpl_device *dev);
    /* Events on the compute stream (optional: NULL means the device runs
     * synchronously and kpl_event_* use host timestamps).  record and query
     * do not block; event_sync does. */
    kpl_status (*event_create)(kpl_device *dev, void **handle);
    void (*event_destroy)(kpl_device *dev, void *handle);
    kpl_status (*event_record)(kpl_device *dev, void *handle);
    kpl_status (*event_sync)(kpl_device *dev, void *handle);
    kpl_status (*event_query)(kpl_device *dev, void *handle, bool *done);
    kpl_status (*event_elapsed)(kpl_device *dev, void *start, void *end, double *ms);
    /* Registers this backend's kernels (called once, at first use). */
    void (*register_kernels)(void);
    /* Counters of the backend's algorithm/primitive caches (thread-safe). */
    kpl_algo_cache_stats (*algo_cache_stats)(void);
    /* The native handle of the compute stream (cudaStream_t), with the
     * device made current for the calling thread (optional: NULL for
     * devices without streams). */
    kpl_status (*native_stream)(kpl_device *dev, void **stream);
} kpl_device_backend;

struct kpl_device {
    const kpl_device_backend *backend;
    kpl_device_type type;
    int index;
    char name[16];
    kpl_allocator *alloc;   /* device memory */
    kpl_allocator *pinned;  /* pinned host memory (NULL for cpu) */
    void *impl;             /* backend state (streams, handles) */
};

const kpl_device_backend *kpl__cpu_backend(void);
#if KPL_HAVE_CUDA
const kpl_device_backend *kpl__cuda_backend(void);
#endif

/* Makes sure kernels of all built backends are registered. */
void kpl__init_once(void);

/* The host_fence of every device opened so far: after it no upload reads
 * host memory any more.  For memory any device may be reading (a wrapped
 * storage's), before it is written or given back. */
kpl_status kpl__host_fence(void);

/* ------------------------------------------------------------------------ */
/* Storage and tensors (C only: CUDA sources use the public accessors)        */
/* ------------------------------------------------------------------------ */
#ifndef __cplusplus
#include <stdatomic.h>

struct kpl_storage {
    atomic_int refcount;
    kpl_device *dev;
    size_t bytes;
    void *host;    /* host copy (== dev_ptr on cpu) */
    void *dev_ptr; /* device copy */
    kpl_mem_state state;
    void (*wrap_release)(void *ctx); /* set: host memory is the caller's (storage_wrap) */
    void *wrap_ctx;
    kpl_storage *parent; /* set: bytes inside the parent's device memory (storage_sub) */
    /* Something a kernel derived from the bytes and keeps with them, valid
     * until they change (CPU allocator memory, keyed by the kernel): a
     * constant's (kpl_tensor_set_constant) convolution weights in their
     * computing layout, or the batch statistics a batch norm's forward
     * computed of its input, for its backward.  Any write access drops it
     * (kpl__storage_drop_packed). */
    bool constant;
    void *packed;
    size_t packed_bytes;
    uint64_t packed_key;
    /* CPU activations kept in a layout of oneDNN's between the ops that
     * read it (docs/precision.md, "Kept layouts"): with `kept` other than
     * KPL_KEPT_PLAIN the bytes hold the (N, C, H, W) tensor of
     * `blk_es`-byte elements as that tag says.  The data accessors turn
     * them plain before anyone else reads or writes them. */
    int kept; /* kpl_kept */
    int blk_es;
    int64_t blk_dims[4];
};

struct kpl_tensor {
    atomic_int refcount;
    kpl_dtype dtype;
    int ndim;
    int64_t shape[KPL_MAX_DIMS]; // (d0, ..., d{ndim-1})
    int64_t numel;
    kpl_storage *storage;
    size_t offset; /* bytes */
    void *meta;    /* owned by a higher layer, see kpl_tensor_set_meta */
    void (*meta_free)(void *meta);
    uint64_t serial; /* kpl_tensor_serial */
};

/* Host bytes of element 0 for kernels' own reads (no host-access hook). */
static inline const void *kpl__host_cdata(const kpl_tensor *t)
{
    const char *p = kpl_storage_host_data(t->storage);
    return p ? p + t->offset : NULL;
}

/* f16/bf16 <-> f32 of n values (cpu_eltwise.c; convert_math.h's rounding,
 * to nearest even): the CPU's half kernels widen blocks or planes into f32
 * buffers, run the f32 loops, and round the result once. */
void kpl__cpu_widen_half(kpl_dtype dt, float *d, const void *s, int64_t n);
void kpl__cpu_narrow_half(kpl_dtype dt, void *d, const float *s, int64_t n);

/* ---- kept layouts (storage.c) ----
 * A CPU activation may stay between ops in the layout the convolution
 * that wrote it computes in: nChw16c (oneDNN's aBcd16b: channels in
 * blocks of 16 innermost, AVX2/AVX-512 direct kernels) or NHWC (acdb: all
 * channels innermost, the AMX and brgemm kernels').  Both hold the same
 * (N, C, H, W) tensor; kernels that understand a tag take the raw bytes
 * through kpl__kept_data, every other access sees plain NCHW. */
typedef enum { KPL_KEPT_PLAIN, KPL_KEPT_NC16, KPL_KEPT_NHWC, KPL_KEPT_COUNT } kpl_kept;
/* Whether `t` may hold, or be written in, a kept layout: a CPU tensor of 4
 * dims whose channels are a multiple of 16 and that covers its whole
 * storage, with kpl_set_blocked_layouts on. */
bool kpl__keepable(const kpl_tensor *t);
/* The layout t's storage holds t in (its own shape and dtype), else
 * KPL_KEPT_PLAIN. */
kpl_kept kpl__kept(const kpl_tensor *t);
/* The raw bytes of `t` when its storage holds it in `tag`, else NULL. */
void *kpl__kept_data(const kpl_tensor *t, kpl_kept tag);
/* The raw bytes of a keepable `t`, about to be overwritten whole in a kept
 * layout (no conversion of what was there). */
void *kpl__kept_out(const kpl_tensor *t);
/* Records that t's storage now holds t in `tag`. */
void kpl__storage_set_kept(const kpl_tensor *t, kpl_kept tag);
/* Where value (n, c, pixel i) of a kept (N, C, H, W) tensor lies: at
 * n * ns + (c / 16) * cs + i * ps + c % 16 elements (c in blocks of 16;
 * in NHWC too, whose channels are a multiple of 16 when kept). */
typedef struct {
    int64_t ns, cs, ps;
} kpl_kept_geom;
static inline kpl_kept_geom kpl__kept_geom(kpl_kept tag, int64_t c, int64_t hw)
{
    return tag == KPL_KEPT_NHWC ? (kpl_kept_geom){hw * c, 16, c}
                                : (kpl_kept_geom){c * hw, 16 * hw, 16};
}
/* Frees a storage's derived copy (see kpl_storage.packed). */
void kpl__storage_drop_packed(kpl_storage *s);
/* Its derived copy when it is the `bytes` bytes kept under `key`, else NULL. */
void *kpl__storage_packed(const kpl_storage *s, uint64_t key, size_t bytes);
/* A new derived copy of `bytes` bytes under `key`, replacing what was
 * there, for the caller to fill; NULL (with the error set) when out of
 * memory.  Dropped by the next write access like any other. */
void *kpl__storage_new_packed(kpl_storage *s, uint64_t key, size_t bytes);

/* Element pointers for kernels (device side of the storage). */
static inline void *kpl__data(const kpl_tensor *t)
{
    return (char *)kpl_storage_device_mutable(t->storage) + t->offset;
}
static inline const void *kpl__cdata(const kpl_tensor *t)
{
    return (const char *)kpl_storage_device_data(t->storage) + t->offset;
}

/* "add: " style formatting of a tensor shape into a caller buffer. */
#define KPL_SHAPE_BUF 96
#define KPL_SHAPE(t, buf) kpl_shape_str((t)->ndim, (t)->shape, (buf), sizeof(buf))
#endif /* !__cplusplus */

/* ------------------------------------------------------------------------ */
/* Kernel attribute structs                                                   */
/* ------------------------------------------------------------------------ */

/* What the front ends (ops_*.c) compute once for both backends: plans,
 * geometry, directions.  A kernel op whose kernels need no more than the
 * checked operands and the call's own parameters passes those instead
 * and has no struct here (docs/graph-autograd.md, "Adding an op"). */

/* An element-wise iteration plan: the output is contiguous with `shape`
 * (collapsed to as few dims as possible); input k reads element
 * sum(idx[d] * stride[k][d]).  After collapsing, the innermost stride of
 * every input is 0 (broadcast) or 1. */
typedef struct {
    int ndim;
    int64_t shape[KPL_MAX_DIMS];
    int64_t stride[3][KPL_MAX_DIMS];
    int64_t numel;
} kpl_ew_plan;

typedef struct {
    kpl_unary_op op;
    double alpha, beta;
} kpl_unary_attrs;

typedef struct {
    kpl_binary_op op;
    kpl_ew_plan plan;
    bool has_scalar;   /* b is `scalar` instead of in[1] */
    bool scalar_first; /* scalar op a */
    double scalar;
} kpl_binary_attrs;

typedef struct {
    kpl_ew_plan plan; /* inputs: cond, a, b */
} kpl_where_attrs;

/* x viewed as (outer, red, inner); out as (outer, inner). */
typedef struct {
    kpl_reduce_op op;
    int64_t outer, red, inner;
    int correction;
} kpl_reduce_attrs;

/* All dims padded to ndim (>= 3: batch..., rows, cols); a batch dim of 1
 * broadcasts.  a_dims/b_dims are the stored (untransposed) layouts. */
typedef struct {
    int ndim;
    int64_t a_dims[KPL_MAX_DIMS];
    int64_t b_dims[KPL_MAX_DIMS];
    int64_t out_dims[KPL_MAX_DIMS];
    bool trans_a, trans_b;
} kpl_matmul_attrs;

typedef struct {
    double value;
} kpl_fill_attrs;

typedef struct {
    double start, step;
} kpl_arange_attrs;

typedef struct {
    int normal; /* 0 uniform(p1, p2), 1 normal(mean p1, std p2) */
    uint64_t seed, offset;
    double p1, p2;
} kpl_random_attrs;

/* Strided gather into a contiguous out; NULL attrs means a flat copy.
 * With `slab` (kpl_k_copy_slab) a 2-D copy instead: `rows` runs of `width`
 * bytes, run r from in + src_off + r src_pitch to out + dst_off + r
 * dst_pitch (bytes). */
typedef struct {
    kpl_ew_plan plan; /* stride[0] = input strides */
    bool slab;
    int64_t rows, width, src_off, src_pitch, dst_off, dst_pitch;
} kpl_copy_attrs;

typedef enum { KPL_CONV_FWD, KPL_CONV_BWD_DATA, KPL_CONV_BWD_WEIGHT } kpl_conv_kind;

/* One convolution problem; in/out are (in[0], in[1], in[2]) =
 *   FWD:        x, w, b (or NULL) -> out y
 *   BWD_DATA:   gy, w             -> out gx
 *   BWD_WEIGHT: x, gy, gb (written, or NULL) -> out gw */
typedef struct {
    kpl_conv_kind kind;
    int64_t n, c, h, w;    /* input */
    int64_t o, kh, kw;     /* weights (o, c / groups, kh, kw) */
    int64_t oh, ow;        /* output */
    kpl_conv2d_params p;
    bool relu;             /* FWD of KPL_KOP_CONV2D_RELU: y = relu(conv) */
    bool acc;              /* FWD of KPL_KOP_CONV2D_ACC: y = conv + y (then relu) */
} kpl_conv_attrs;

/* Copies `src` member by member into a zeroed `dst`: caches compare keys
 * with memcmp, and a struct assignment may carry the source's padding bytes
 * (kind is followed by 4 of them), which are garbage on the caller's stack. */
static inline void kpl_conv_attrs_key(kpl_conv_attrs *dst, const kpl_conv_attrs *src)
{
    memset(dst, 0, sizeof *dst);
    dst->kind = src->kind;
    dst->n = src->n;
    dst->c = src->c;
    dst->h = src->h;
    dst->w = src->w;
    dst->o = src->o;
    dst->kh = src->kh;
    dst->kw = src->kw;
    dst->oh = src->oh;
    dst->ow = src->ow;
    dst->p = src->p; /* seven ints: no padding */
    dst->relu = src->relu;
    dst->acc = src->acc;
}

typedef enum {
    KPL_POOL_MAX,      /* in: x;       out: y, in[1] (written): idx */
    KPL_POOL_GATHER,   /* in: x, idx;  out: y */
    KPL_POOL_SCATTER,  /* in: gy, idx; out: gx */
    KPL_POOL_AVG,      /* in: x;       out: y */
    KPL_POOL_AVG_BWD,  /* in: gy;      out: gx */
    KPL_POOL_BILINEAR, /* in: x;       out: y (p unused, align_corners) */
    KPL_POOL_BILINEAR_BWD /* in: gy;   out: gx */
} kpl_pool_kind;

/* The kinds whose output is the input plane (h, w): the adjoints. */
#define KPL_POOL_KIND_BWD(k) \
    ((k) == KPL_POOL_SCATTER || (k) == KPL_POOL_AVG_BWD || (k) == KPL_POOL_BILINEAR_BWD)

typedef struct {
    kpl_pool_kind kind;
    int64_t n, c, h, w; /* input plane */
    int64_t oh, ow;     /* output plane */
    kpl_pool2d_params p;
    bool align_corners; /* bilinear */
} kpl_pool_attrs;


typedef enum {
    KPL_INDEX_SELECT,     /* in: x, idx;   out (outer, k, inner) */
    KPL_INDEX_ADD,        /* in: g, idx;   out (outer, dim, inner), zeroed, then added */
    KPL_INDEX_GATHER,     /* in: x, idx;   out idx's shape */
    KPL_INDEX_SCATTER_ADD /* in: src, idx; out x's shape, already holding x, added into */
} kpl_index_kind;

/* SELECT, ADD: x viewed as (outer, dim, inner), out as (outer, k, inner);
 * idx is (k).
 * GATHER, SCATTER_ADD: idx (and src) viewed as (outer, k, inner), x as
 * (outer', dim, xinner): the element at idx position (o, j, i) pairs with
 * x's at (o', idx value, i'), where o' and i' are o and i read as
 * coordinates of idx's outer and inner dims and re-flattened over x's.
 * ishape / xshape (ndim dims, `axis` among them) are the two shapes with
 * neighbouring dims merged wherever that keeps this pairing; when at most
 * one outer and one inner dim remain (`simple`, the usual case), o' = o
 * and i' = i. */
typedef struct {
    kpl_index_kind kind;
    int64_t outer, dim, inner, k;
    int64_t xinner;               /* GATHER, SCATTER_ADD: x's elements per step on axis */
    bool simple;
    int ndim, axis;
    int64_t ishape[KPL_MAX_DIMS];
    int64_t xshape[KPL_MAX_DIMS];
    /* GATHER, SCATTER_ADD: on KPL_ERANGE the kernel writes here (host
     * memory) the flat position in idx of the first index out of range,
     * in row-major order, and its value, for ops_index.c to name. */
    int64_t *bad;
} kpl_index_attrs;

/* Batch norm over x viewed as (n, c, hw).  fwd: out y, in x, gamma, beta;
 * mean and var written when not NULL.  bwd: in x, gy, gamma; gx, ggamma,
 * gbeta written when not NULL (`out` is one of them, for dispatch).
 * KPL_KOP_BATCH_NORM_RELU: relu set; its bwd masks gy by relu_y > 0. */
typedef struct {
    bool bwd;
    bool relu;
    const kpl_tensor *relu_y;       /* bwd of the relu form: the forward's output */
    int64_t n, c, hw;
    double eps;
    kpl_tensor *mean, *var;         /* fwd, (C) */
    kpl_tensor *gx, *ggamma, *gbeta; /* bwd */
    /* The CPU kernels' own (cpu_norm.c): (mean, biased variance) per
     * channel in double, written by fwd, read by bwd when not NULL; and
     * whether the kept layouts' sums run in vector registers */
    double *saved;
    bool vec_sums;
} kpl_bn_attrs;

/* Group norm (kpl_k_group_norm, _bwd), checked: x viewed as (n, c, hw) in
 * `groups` groups of c / groups channels.  fwd: out y, in x, gamma, beta.
 * bwd: out gx, in x, gy, gamma; ggamma, gbeta written when not NULL. */
typedef struct {
    bool bwd;
    int64_t n, c, hw;
    int groups;
    double eps;
    kpl_tensor *ggamma, *gbeta; /* bwd */
} kpl_gn_attrs;

/* The box kernels (kpl_k_box_iou, kpl_k_nms): in[0] a or boxes (n, 4).
 * Metric: in[1] b (m, 4); out (n, m) pairwise, else (n).  NMS: in[1]
 * scores (n), in[2] class ids (n) or NULL; out keep (n), the count
 * written to *nkeep (host memory). */
typedef struct {
    bool nms;
    kpl_box_metric metric;
    bool pairwise;
    int64_t n, m;
    double thr;     /* NMS: iou_threshold, >= 0 */
    int64_t *nkeep; /* NMS: written */
} kpl_box_attrs;

/* ROI Align (kpl_k_roi_align, kpl_k_roi_align_bwd), checked: in[1] rois
 * (k, 5) with whole batch indices in [0, n).  Forward: in[0] x (n, c, h,
 * w), out (k, c, out_h, out_w).  Backward: in[0] gy (k, c, out_h, out_w),
 * out gx (n, c, h, w), which the kernel zeroes first. */
typedef struct {
    bool bwd;
    int64_t n, c, h, w, k;
    kpl_roi_align_params p;
} kpl_roi_attrs;

/* Softmax cross entropy (kpl_k_softmax_xent, _bwd), checked: x viewed as
 * (n, c, inner), labels (n, inner) i64.  Forward: in[0] x, in[1] labels,
 * out the losses (n, inner).  Backward: in[0] x, in[1] labels, in[2] gy
 * (n, inner), out gx (n, c, inner).  On KPL_ERANGE the CPU kernel writes
 * into bad (host memory) the flat position of the first label out of
 * range and its value. */
typedef struct {
    bool bwd;
    int64_t n, c, inner;
    int64_t ignore;
    double eps;
    int64_t *bad;
} kpl_xent_attrs;

/* The sigmoid focal loss (kpl_k_sigmoid_focal, _bwd), checked: in[0] z,
 * in[1] y, in[2] gy (backward), out the losses or gz; n elements each. */
typedef struct {
    bool bwd;
    int64_t n;
    double alpha, gamma;
} kpl_focal_attrs;

/* kpl_k_amp_unscale: `out` is the gradient g, scaled in place; found_inf
 * (one f32 element, g's device) is set to 1 when an element of g is not
 * finite (amp_math.h has the per-element step). */
typedef struct {
    double inv_scale;
    kpl_tensor *found_inf;
} kpl_amp_attrs;

/* kpl_k_sgd_update: `out` is the parameter p, in[0] the gradient g; v the
 * momentum buffer (NULL without momentum). */
typedef struct {
    kpl_tensor *v;
    double lr, momentum, wd;
    bool nesterov, first;
} kpl_sgd_attrs;

/* NMS's visiting order, shared by the backends (cpu/cpu_vision.c): the
 * indices 0..n-1 of scores (f32 or f64, host memory) by decreasing score,
 * NaN first, equal scores by lower index.  KPL_ENOMEM only. */
kpl_status kpl__nms_order(const void *scores, kpl_dtype dt, int64_t n, int64_t *order);

/* Row-major index -> element offset for one plan input. */
static inline int64_t kpl__plan_offset(const kpl_ew_plan *p, int k,
                                       int64_t flat)
{
    int64_t off = 0;
    for (int d = p->ndim - 1; d >= 0; d--) {
        int64_t i = flat % p->shape[d];
        flat /= p->shape[d];
        off += i * p->stride[k][d];
    }
    return off;
}

/* Registers the CPU kernels (called from the cpu backend). */
/* Whether oneDNN runs bf16 natively here (AVX512-BF16 or AMX; cpu_isa.c). */
bool kpl__cpu_bf16_native(void);
/* Whether oneDNN's kernels use AVX-512 here (honours ONEDNN_MAX_CPU_ISA,
 * which kpl's own loops follow where they choose by register count). */
bool kpl__cpu_avx512(void);
/* Whether oneDNN's kernels use AMX here (honours ONEDNN_MAX_CPU_ISA). */
bool kpl__cpu_amx(void);
void kpl__cpu_register_eltwise(void);
void kpl__cpu_register_reduce(void);
void kpl__cpu_register_matmul(void);
void kpl__cpu_register_misc(void);
void kpl__cpu_register_conv(void);
void kpl__cpu_register_pool(void);
void kpl__cpu_register_norm(void);
void kpl__cpu_register_group_norm(void); /* called by kpl__cpu_register_norm */
void kpl__cpu_register_index(void);
void kpl__cpu_register_vision(void);
void kpl__cpu_register_loss(void);
kpl_algo_cache_stats kpl__cpu_algo_cache_stats(void);
kpl_algo_cache_stats kpl__cpu_conv_cache_stats(void);
/* What this thread's last CPU convolution in f32/bf16 ran (tests and bench
 * rows say which kernel they measured): oneDNN's implementation name
 * (e.g. "jit:avx512_core", "brg:avx512_core_amx") or "kpl_direct", the
 * direction, and the kept layout (kpl_kept) that implementation leaves
 * its output activation in, KPL_KEPT_PLAIN where none. */
typedef struct {
    char impl[64];
    kpl_conv_kind kind;
    kpl_dtype dtype; /* the dtype it computed in (f32 for bf16 emulated in f32) */
    int out_kept; /* kpl_kept */
} kpl_conv_choice;
kpl_conv_choice kpl__cpu_conv_last(void);
/* The CPU convolutions' cached choices, for bench rows: "impl*N,..." (the
 * implementations in the cache, the most used first, each with its count
 * of problems), at most `len` bytes with the NUL. */
void kpl__cpu_conv_impls(char *buf, size_t len);
/* For tests: the largest oneDNN scratchpad among the convolution
 * candidates built since the last call within the chooser's bound, and in
 * *past_bound (when not NULL) whether one choice found none within it and
 * built them past it (cpu_conv_choose.c); both reset. */
int64_t kpl__cpu_conv_tried_scratch(bool *past_bound);
/* Tests: convolutions chosen after this call consider only the
 * implementations whose name starts with `prefix` ("jit_wino",
 * "kpl_direct"); NULL or "" lifts the restriction.  A problem no such
 * implementation handles fails with KPL_EBACKEND. */
void kpl__cpu_conv_only(const char *prefix);

/* kpl's own f32 convolution loops on plain NCHW (cpu/cpu_conv_direct.c):
 * whether they handle a problem (stride 1, no dilation, one group), and
 * running one with `threads` OpenMP threads; args as the conv2d kernel's. */
bool kpl__conv_direct_supports(const kpl_conv_attrs *a);
/* The bytes kpl__conv_direct_run allocates for a with `threads` threads
 * (padded copies, packed weights, accumulators). */
int64_t kpl__conv_direct_scratch(const kpl_conv_attrs *a, int threads);
/* The f64 reference loops (cpu/cpu_conv_ref.c), any kind; no ReLU. */
void kpl__conv_ref_run(const kpl_conv_attrs *a, const kpl_kernel_args *args);
kpl_status kpl__conv_direct_run(const kpl_conv_attrs *a, const kpl_kernel_args *args,
                                int threads);

/* for (int64_t i = 0; i < n; i++) { body } across OpenMP threads when
 * `cond` holds, else inline: an OpenMP fork costs 0.3-0.4 us even when its
 * `if` clause is false, which would dominate the cost of small ops. */
#define KPL_PARALLEL_FOR_IF(i, n, cond, ...)                       \
    do {                                                           \
        int64_t kpl_n_ = (n);                                      \
        if (!(cond)) {                                             \
            for (int64_t i = 0; i < kpl_n_; i++) { __VA_ARGS__ }   \
        } else {                                                   \
            _Pragma("omp parallel for schedule(static)")           \
            for (int64_t i = 0; i < kpl_n_; i++) { __VA_ARGS__ }   \
        }                                                          \
    } while (0)

/* The same, parallel whenever there is more than one iteration (chunks). */
#define KPL_PARALLEL_FOR(i, n, ...) KPL_PARALLEL_FOR_IF(i, n, kpl_n_ > 1, __VA_ARGS__)

/* A CPU loop compiled three times (baseline x86-64, AVX2+FMA, AVX-512),
 * the dynamic loader picking the one the CPU runs best (a single plain
 * build under AddressSanitizer). */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && \
    !defined(__SANITIZE_ADDRESS__)
#define KPL_CLONES __attribute__((target_clones("default", "arch=x86-64-v3", "arch=x86-64-v4")))
#else
#define KPL_CLONES
#endif

/* Per-thread element threshold under which CPU kernels stay serial:
 * 32768 elements where forking the OpenMP team is cheap, up to 2^20 where
 * it is not (measured once, cpu/cpu_parallel.c). */
int64_t kpl__cpu_par_grain(void);
#define KPL_PAR_GRAIN kpl__cpu_par_grain()

#ifdef __cplusplus
}
#endif
#endif /* KPL_KERNELS_IMPL_H */
