/*
 * kernels.h — devices, memory, tensors and the math kernels of kpl.
 *
 * This is the lowest layer of kpl: every other module (graph/, autograd/,
 * collective/, dataio/, trainer/) builds on the handles declared here.
 *
 *   status    every fallible call returns kpl_status (0 = OK, < 0 = error);
 *             kpl_last_error() holds the detailed message of the calling
 *             thread's last failure (op, shapes, file:line).
 *   device    "cpu" or "cuda:N".  A device owns a caching allocator; its
 *             counters (allocated / reserved / peak) are public.
 *   storage   a refcounted buffer with a host copy, a device copy and a
 *             state (EMPTY, HOST, DEVICE, SYNCED); the other side is copied
 *             lazily when read.
 *   tensor    dtype + shape (<= 8 dims), contiguous row-major, on one
 *             device.  Views (reshape, flatten, squeeze, unsqueeze, narrow
 *             on dim 0) share storage; everything else copies.
 *   rng       counter-based Philox-4x32-10: a random tensor depends only on
 *             (seed, offset, element index), never on threads or device.
 *   kpl_k_*   destination-passing compute: the caller allocates `out` with
 *             the shape given by the kpl_shape_* helpers, the call checks
 *             shapes/dtypes/devices and dispatches to the kernel registered
 *             for (op, device type, dtype).
 *
 * Example:
 *
 *   kpl_device *cpu;
 *   kpl_tensor *a = NULL, *b = NULL, *c = NULL;
 *   int64_t sa[2] = {2, 3}, sb[1] = {3};
 *   kpl_rng *rng = kpl_rng_create(42);
 *   if (kpl_device_get("cpu", &cpu) < 0) goto fail;
 *   if (kpl_tensor_empty(cpu, KPL_F32, 2, sa, &a) < 0) goto fail;
 *   if (kpl_tensor_empty(cpu, KPL_F32, 1, sb, &b) < 0) goto fail;
 *   kpl_k_uniform(a, rng, -1.0, 1.0);
 *   kpl_k_fill(b, 0.5);
 *   if (kpl_tensor_empty(cpu, KPL_F32, 2, sa, &c) < 0) goto fail;
 *   if (kpl_k_binary(c, KPL_BIN_ADD, a, b) < 0)   // broadcasts b over rows
 *       fprintf(stderr, "%s\n", kpl_last_error());
 *   ...
 *   kpl_tensor_release(c); kpl_tensor_release(b); kpl_tensor_release(a);
 *   kpl_rng_destroy(rng);
 *
 * Thread-safety: tensors and storages are not locked; share them read-only
 * or synchronise yourself.  Device lookup, allocators and the kernel registry
 * are thread-safe.  Kernels parallelise internally with OpenMP
 * (kpl_set_num_threads()).
 */
#ifndef KPL_KERNELS_H
#define KPL_KERNELS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* ------------------------------------------------------------------------ */
/* Version                                                                    */
/* ------------------------------------------------------------------------ */

#define KPL_VERSION_MAJOR 0
#define KPL_VERSION_MINOR 1
#define KPL_VERSION_PATCH 0
#define KPL_VERSION_NUMBER \
    (KPL_VERSION_MAJOR * 10000 + KPL_VERSION_MINOR * 100 + KPL_VERSION_PATCH)

/* "0.1.0": the version of the library actually linked. */
const char *kpl_version(void);
/* A multi-line description of the build: compiler, oneDNN, CUDA, OpenMP. */
const char *kpl_build_info(void);
/* Seconds on the monotonic clock, for timing and deadlines (not a date). */
double kpl_seconds(void);

/* ------------------------------------------------------------------------ */
/* Status and errors                                                          */
/* ------------------------------------------------------------------------ */

/* X(name, value, default message).  Append only: values are never reused. */
#define KPL_STATUS_LIST(X)                                             \
    X(KPL_OK, 0, "success")                                            \
    X(KPL_EINVAL, -1, "invalid argument")                              \
    X(KPL_ESHAPE, -2, "shape mismatch")                                \
    X(KPL_EDTYPE, -3, "unsupported or mismatched dtype")               \
    X(KPL_ENOMEM, -4, "out of memory")                                 \
    X(KPL_EDEVICE, -5, "device unavailable or mismatched")             \
    X(KPL_ENOKERNEL, -6, "no kernel registered")                       \
    X(KPL_EIO, -7, "input/output error")                               \
    X(KPL_EFORMAT, -8, "malformed data")                               \
    X(KPL_ETIMEOUT, -9, "timed out")                                   \
    X(KPL_ECOMM, -10, "communication failure")                         \
    X(KPL_EBACKEND, -11, "backend library error")                      \
    X(KPL_ESTATE, -12, "object in the wrong state for this call")      \
    X(KPL_ERANGE, -13, "value out of range")                           \
    X(KPL_ENOTFOUND, -14, "not found")                                 \
    X(KPL_ECHILD, -15, "a worker process failed")                      \
    X(KPL_ECANCELED, -16, "stopped on request")

typedef enum {
#define KPL_X_(name, value, msg) name = value,
    KPL_STATUS_LIST(KPL_X_)
#undef KPL_X_
} kpl_status_code;

typedef int kpl_status;

/* The symbolic name of a status ("KPL_ESHAPE"); never NULL. */
const char *kpl_status_str(kpl_status st);
/* The default one-line meaning of a status ("shape mismatch"). */
const char *kpl_status_msg(kpl_status st);
/* The detailed message of this thread's last failing call, e.g.
 * "add: shapes (2,3) and (4) cannot be broadcast [kernels/ops_eltwise.c:49]".
 * Valid until the thread's next failing call; "" when nothing failed. */
const char *kpl_last_error(void);
/* The status of this thread's last failing call (KPL_OK if none). */
kpl_status kpl_last_status(void);
/* Forget the last error of this thread. */
void kpl_clear_error(void);
/* For code outside kpl that plugs into it (a task, a module kind): makes
 * a formatted message this thread's last error and returns st (< 0), so
 * that `return kpl_set_error(KPL_EINVAL, "...", ...)` reports like kpl's
 * own failures. */
kpl_status kpl_set_error(kpl_status st, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

/* ------------------------------------------------------------------------ */
/* The error discipline of kpl's own code (STYLE.md), for code outside kpl  */
/* too (a task, a module kind, a plugin), in functions returning kpl_status: */
/*   KPL_CHECK(n > 0, KPL_EINVAL, "crop %d must be positive", n);            */
/*   KPL_TRY(kpl_trainer_backward(t, 0, loss, NULL));                        */
/* ------------------------------------------------------------------------ */

/* Records `st` with a formatted message and "[file:line]" for this thread;
 * returns st so callers can `return kpl_error_at(...)` (KPL_ERROR). */
kpl_status kpl_error_at(kpl_status st, const char *file, int line, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));

#define KPL_ERROR(st, ...) kpl_error_at((st), __FILE__, __LINE__, __VA_ARGS__)

/* Validate an input: on failure set the message and return the status. */
#define KPL_CHECK(cond, st, ...)                      \
    do {                                              \
        if (!(cond)) return KPL_ERROR((st), __VA_ARGS__); \
    } while (0)

/* Propagate a failing status (message already set by the callee). */
#define KPL_TRY(expr)                     \
    do {                                  \
        kpl_status kpl_try_st_ = (expr);  \
        if (kpl_try_st_ < 0) return kpl_try_st_; \
    } while (0)

/* Propagate into a function's `fail:` label; needs `kpl_status st`. */
#define KPL_TRY_GOTO(expr)              \
    do {                                \
        if ((st = (expr)) < 0) goto fail; \
    } while (0)


/* ------------------------------------------------------------------------ */
/* Enums and their names from one list, so the two cannot drift apart:      */
/*   #define KPL_CROP_MODES(X) X(KPL_CROP_NONE, "none") X(KPL_CROP_CENTER, "center") */
/*   typedef enum { KPL_CROP_MODES(KPL_ENUM_VALUE) } kpl_crop_mode;   header */
/*   KPL_ENUM_DECLARE(kpl_crop_mode);                                 header */
/*   KPL_ENUM_DEFINE(kpl_crop_mode, KPL_CROP_MODES)  one of kpl's sources  */
/* declare and define TYPE_names[] (NULL-terminated), TYPE_name(v) ("?"     */
/* out of range) and TYPE_parse(name) (-1 for another name or NULL).        */
/* ------------------------------------------------------------------------ */
#define KPL_ENUM_VALUE(e, s) e,
#define KPL_ENUM_STRING(e, s) s,
#define KPL_ENUM_DECLARE(type)              \
    extern const char *const type##_names[]; \
    const char *type##_name(type v);         \
    int type##_parse(const char *name)
#define KPL_ENUM_DEFINE(type, LIST)                                                       \
    const char *const type##_names[] = {LIST(KPL_ENUM_STRING) NULL};                      \
    const char *type##_name(type v) { return kpl__name_at(type##_names, (int)v); }        \
    int type##_parse(const char *name) { return kpl__name_index(type##_names, name); }

/* ------------------------------------------------------------------------ */
/* Data types                                                                 */
/* ------------------------------------------------------------------------ */

/* X(ENUM, short name, element size in bytes, is floating point).  F64 is
 * beyond DESIGN.md's list: gradient checks in issue 3 need its precision. */
#define KPL_DTYPE_LIST(X)  \
    X(KPL_F32, f32, 4, 1)  \
    X(KPL_F16, f16, 2, 1)  \
    X(KPL_BF16, bf16, 2, 1) \
    X(KPL_I32, i32, 4, 0)  \
    X(KPL_I64, i64, 8, 0)  \
    X(KPL_U8, u8, 1, 0)    \
    X(KPL_BOOL, bool, 1, 0) \
    X(KPL_F64, f64, 8, 1)

typedef enum {
#define KPL_X_(e, n, s, f) e,
    KPL_DTYPE_LIST(KPL_X_)
#undef KPL_X_
    KPL_DTYPE_COUNT
} kpl_dtype;

/* "f32", ... or "invalid" for a value outside the enum. */
const char *kpl_dtype_name(kpl_dtype dt);
/* Bytes per element; 0 for an invalid dtype. */
size_t kpl_dtype_size(kpl_dtype dt);
bool kpl_dtype_is_float(kpl_dtype dt);
/* Parses "f32", "float32", "int64", ... ; KPL_EDTYPE for an unknown name. */
kpl_status kpl_dtype_parse(const char *name, kpl_dtype *out);

/* ------------------------------------------------------------------------ */
/* Threads                                                                    */
/* ------------------------------------------------------------------------ */

/* Number of OpenMP threads used by CPU kernels (and oneDNN).  Default: the
 * OpenMP default (OMP_NUM_THREADS or the core count).  Process-wide. */
void kpl_set_num_threads(int n);
int kpl_get_num_threads(void);

/* Deterministic algorithm choice (PyTorch's cudnn.deterministic with
 * benchmark off).  Off (the default): the first call of each convolution
 * problem times the implementations oneDNN (or cuDNN) offers and keeps the
 * fastest, which may differ from one process to the next and with it the
 * last bits of the results.  On: the library's preferred implementation,
 * untimed (on CUDA: cuDNN's heuristic ranking restricted to its
 * deterministic algorithms, and the index adjoints plane_scatter and
 * scatter_add summed in a fixed order instead of with atomics), so two runs
 * of the same program compute bit-identical numbers, as a resumed training
 * run must.  (ROI Align's backward on CUDA stays atomic.)  Set it before
 * the first convolution; process-wide. */
void kpl_set_deterministic(bool on);
bool kpl_get_deterministic(void);

/* Kept layouts on the CPU (on by default): a convolution whose oneDNN
 * kernel works on channels in blocks of 16 (nChw16c) or on channels
 * innermost (NHWC) leaves its output in that layout, and the ops that can
 * (convolutions, batch norm, max pooling, concat, element-wise ops on
 * equal shapes or with a per-channel operand) read and write it as it is,
 * so the reorders to and from plain NCHW happen only where a tensor meets
 * any other op, which sees it plain as always.  Results are bit-identical
 * either way.
 * Returns the previous setting; process-wide. */
bool kpl_set_blocked_layouts(bool on);

/* Which layout CPU convolutions keep activations in (with blocked layouts
 * on): KPL_LAYOUT_AUTO (the default) times oneDNN's implementations, each
 * on the layout it computes in, and keeps the fastest one's where it is
 * nChw16c (AVX2/AVX-512 direct kernels) or NHWC (AMX and brgemm
 * kernels), except bf16 on AMX, where it asks for NHWC (faster as a
 * whole; docs/precision.md); KPL_LAYOUT_NCHW16C and KPL_LAYOUT_NHWC ask
 * every convolution for that one (where oneDNN has a kernel for it, else
 * its own choice), for tests and benchmarks on any CPU.  The environment
 * variable KPL_LAYOUT (auto, nchw16c, nhwc) sets it at start.  The choice
 * is cached per problem and setting; returns the previous setting;
 * process-wide. */
typedef enum { KPL_LAYOUT_AUTO, KPL_LAYOUT_NCHW16C, KPL_LAYOUT_NHWC } kpl_layout;
kpl_layout kpl_set_kept_layout(kpl_layout layout);
/* The setting in force for the calling thread: its own (below), else the
 * process's. */
kpl_layout kpl_get_kept_layout(void);
/* The calling thread's own setting, overriding the process's for its calls
 * (the graph executor tunes its layout so); -1 (or any value that is no
 * kpl_layout) drops it.  Returns the previous own setting (-1 where
 * none). */
int kpl_set_thread_kept_layout(int layout);

/* TF32 tensor-core math for f32 matmuls and convolutions on CUDA
 * (PyTorch's allow_tf32).  Off (the default): f32 GEMMs and convolutions
 * use full f32 multiplies (cuBLAS CUBLAS_COMPUTE_32F, cuDNN
 * CUDNN_FMA_MATH), so results compare with the CPU's to f32 rounding.  On:
 * cuBLAS may round the inputs of f32 GEMMs to TF32 (10-bit mantissa,
 * CUBLAS_COMPUTE_32F_FAST_TF32) and cuDNN may pick TF32 tensor-core
 * convolutions (CUDNN_DEFAULT_MATH) on Ampere and later GPUs: several times
 * faster, with a relative error near 1e-3 per product.  No effect on the
 * CPU, on f64 or on f16/bf16 (which always use tensor cores with f32
 * accumulation).  Process-wide; read at every call, so it can be changed
 * between steps (a convolution's cached algorithm is kept per setting). */
void kpl_set_tf32(bool on);
bool kpl_get_tf32(void);

/* ------------------------------------------------------------------------ */
/* Devices and their caching allocators                                       */
/* ------------------------------------------------------------------------ */

typedef enum {
    KPL_DEVICE_CPU = 0,
    KPL_DEVICE_CUDA = 1,
    KPL_DEVICE_TYPE_COUNT
} kpl_device_type;

/* A device (MegEngine's CompNode).  Devices are process-wide objects owned
 * by the backend registry: never destroyed, safe to share between threads. */
typedef struct kpl_device kpl_device;

/* Looks up "cpu", "cuda" (= "cuda:0") or "cuda:N".  KPL_EDEVICE with a clear
 * message when the build has no CUDA backend, when no GPU is present, or when
 * N is out of range.  The first call for a device initialises it. */
kpl_status kpl_device_get(const char *name, kpl_device **out);
/* The CPU device; never fails. */
kpl_device *kpl_device_cpu(void);
kpl_device_type kpl_device_type_of(const kpl_device *dev);
int kpl_device_index(const kpl_device *dev);
/* "cpu" or "cuda:N" (static storage). */
const char *kpl_device_name(const kpl_device *dev);
/* Number of usable devices of a type: 1 for cpu, 0..N for cuda (0 when the
 * build has no CUDA backend or the machine no GPU). */
int kpl_device_count(kpl_device_type type);
/* Why kpl_device_count(type) is 0, for a message that must say why a
 * device asked for is missing: on CUDA the runtime's own text of the
 * error cudaGetDeviceCount returned ("CUDA driver version is insufficient
 * for CUDA runtime version", "system not yet initialized" on an HGX node
 * without its fabric manager, ...), or that this build has no backend for
 * the type.  NULL when there are devices.  Static storage; thread-safe. */
const char *kpl_device_unavailable_reason(kpl_device_type type);
/* Whether this build contains a backend for the type. */
bool kpl_device_type_built(kpl_device_type type);
/* Page-locks `bytes` of existing host memory at `ptr` so copies between it
 * and `dev` run at full speed (cudaHostRegister on CUDA; a no-op where host
 * memory needs no pinning), and undoes it.  Blocking.  Memory shared with
 * forked children is pinned after the fork, by the parent (NVIDIA: a
 * child keeps away from registered memory until it execs).  An upload
 * from page-locked memory does not wait for the copy: hand such memory to
 * tensors through kpl_storage_wrap, whose writes and release wait for the
 * uploads still reading it (as the data loader's batch slots do). */
kpl_status kpl_device_pin_host(kpl_device *dev, void *ptr, size_t bytes);
void kpl_device_unpin_host(kpl_device *dev, void *ptr);
/* Waits for all work queued on the device (no-op on cpu): on CUDA a
 * device-wide cudaDeviceSynchronize, so every stream of the device is
 * covered, kpl's compute and copy streams and those of libraries sharing
 * it (the NCCL backend's).  Returns the CUDA index error (KPL_ERANGE) an
 * index kernel met since the last report (see kpl_k_plane_gather). */
kpl_status kpl_device_synchronize(kpl_device *dev);
/* For libraries that queue their own work in order with kpl's (NCCL): the
 * native handle of the device's compute stream (a cudaStream_t on CUDA),
 * after making the device current for the calling thread.  NULL on cpu,
 * whose work is synchronous.  The handle stays valid for the process. */
kpl_status kpl_device_native_stream(kpl_device *dev, void **stream);

/* Events mark a point in a device's work queue (on CUDA: its compute
 * stream), to wait for it or time it.  CPU work is synchronous, so a CPU
 * event is complete once recorded.  An event belongs to one device; it is
 * not thread-safe. */
typedef struct kpl_event kpl_event;

kpl_status kpl_event_create(kpl_device *dev, kpl_event **out);
void kpl_event_destroy(kpl_event *ev); /* accepts NULL */
/* Marks the current end of the device's queue; does not block. */
kpl_status kpl_event_record(kpl_event *ev);
/* Blocks until the work before the last record has finished. */
kpl_status kpl_event_synchronize(kpl_event *ev);
/* Whether that work has finished; does not block.  KPL_ESTATE if the event
 * was never recorded. */
kpl_status kpl_event_query(kpl_event *ev, bool *done);
/* Milliseconds between two recorded, completed events of one device. */
kpl_status kpl_event_elapsed_ms(kpl_event *start, kpl_event *end, double *ms);

/* Memory counters of a device's caching allocator, in bytes. */
typedef struct {
    size_t allocated;       /* in blocks handed out now */
    size_t reserved;        /* obtained from the system/driver now */
    size_t peak_allocated;  /* max of allocated since start or reset */
    size_t peak_reserved;   /* max of reserved since start or reset */
    size_t limit;           /* reserved may not exceed this (0 = none) */
    uint64_t n_alloc;       /* calls to alloc */
    uint64_t n_cache_hit;   /* allocs served from cached blocks */
    uint64_t n_system;      /* segments obtained from the system */
    uint64_t n_trim;        /* free blocks whose pages went back to the system */
    uint64_t n_lend;        /* chunks of pages moved from a free block to a new one */
} kpl_memory_stats;

kpl_memory_stats kpl_device_memory_stats(kpl_device *dev);
/* Sets both peaks to the current values. */
void kpl_device_reset_peak(kpl_device *dev);
/* Returns every fully free cached segment to the system. */
void kpl_device_empty_cache(kpl_device *dev);
/* Caps reserved bytes (0 = no cap).  An allocation past the cap first
 * releases cached segments, then fails with KPL_ENOMEM. */
void kpl_device_set_memory_limit(kpl_device *dev, size_t bytes);
/* A budget for the calling thread's allocations on dev (what
 * memory.recompute: auto holds a step under, graph.h): before an
 * allocation would take dev's allocated bytes past `bytes`, `release(dev,
 * excess, user)` runs on this thread, outside the allocator's lock, to
 * free memory, and runs again as long as it frees some (it returns the
 * bytes it freed; its own allocations are not checked).  When the request
 * still does not fit, the allocation fails with KPL_ENOMEM naming the
 * budget, the request, the bytes allocated and the thread's memory
 * context (the module it ran in).  bytes 0 ends it; other threads'
 * allocations (a loader's) are not checked, though they count.  A thread
 * has one budget: setting one on another device replaces it. */
typedef size_t (*kpl_release_fn)(kpl_device *dev, size_t excess, void *user);
void kpl_device_set_budget(kpl_device *dev, size_t bytes, kpl_release_fn release, void *user);

/* This thread's budget on dev (0: none). */
size_t kpl_device_budget(const kpl_device *dev);

/* An on/off environment variable (KPL_REGENERATE): "1" on, "0" off,
 * unset or empty the default; any other value keeps the default and says
 * so on stderr, naming the variable. */
bool kpl_env_switch(const char *name, bool dflt);

/* ---- memory recording (the memory profile's raw material; memrec.c) ----
 * While a recorder runs on a device, its allocator logs every block handed
 * out or taken back, with the allocating thread's context label, and the
 * notes the layers above add about a block.  Replayed afterwards: the peak
 * of allocated bytes with every block live at it, and the live bytes over
 * time.  One recorder per device at a time. */
typedef struct kpl_memrec kpl_memrec;
/* An interned label (e.g. "conv2d @ layer1.0.conv1"), numbered from 1; 0
 * for NULL or "" (and when no memory is left for more). */
uint32_t kpl_mem_label(const char *text);
const char *kpl_mem_label_text(uint32_t id); /* "" for 0 */
/* The calling thread's context, given to the blocks it allocates (kept
 * with each block whether or not a recorder runs: a block made before the
 * recording still says where it came from); returns the previous one (to
 * restore). */
uint32_t kpl_mem_context_set(uint32_t label);
uint32_t kpl_mem_context(void);
/* Whether any recorder runs (cheap: callers skip building labels). */
bool kpl_memrec_active(void);
typedef enum {
    KPL_MEMNOTE_CREATOR, /* the block's creator is this label (the op that made it) */
    KPL_MEMNOTE_HOLD,    /* a holder keeps it (the label says who and why) */
    KPL_MEMNOTE_RELEASE  /* a holder let it go; with none left it has no reason */
} kpl_memnote;
/* A note about the block that starts at ptr (a storage's allocation); ignored
 * when no recorder runs on dev. */
void kpl_memrec_note(kpl_device *dev, const void *ptr, kpl_memnote kind, uint32_t label);
kpl_status kpl_memrec_start(kpl_device *dev, kpl_memrec **out);
void kpl_memrec_stop(kpl_memrec *r);      /* the log is kept */
void kpl_memrec_destroy(kpl_memrec *r);   /* stops it first */
/* A block live at the peak. */
typedef struct {
    const void *ptr;
    size_t bytes;        /* the allocator's block (rounded; counted as allocated) */
    const char *what;    /* the allocator's tag ("tensor", "conv2d", ...) */
    uint32_t creator;    /* context at allocation, or the last creator note */
    uint32_t reason;     /* the last holder noted, 0 when none holds it */
    bool before;         /* live when the recording started */
} kpl_memrec_block;
/* The peak of allocated bytes while recording (the first moment it was
 * reached) and the blocks live then (*blocks: free() it), which add up to
 * *peak_bytes; *t_peak in seconds from the start (may be NULL). */
kpl_status kpl_memrec_peak(const kpl_memrec *r, kpl_memrec_block **blocks, size_t *n,
                           size_t *peak_bytes, double *t_peak);
/* Calls fn with the allocated bytes at the start (t = 0) and after every
 * allocation and free (t in seconds from the start). */
void kpl_memrec_timeline(const kpl_memrec *r, void (*fn)(void *ctx, double t, size_t bytes),
                         void *ctx);

/* Raw allocation from a device's caching allocator (64-byte aligned).  The
 * pointer is owned by the caller until kpl_device_free().  `what` names the
 * requester for the out-of-memory message (may be NULL).  Thread-safe. */
kpl_status kpl_device_alloc(kpl_device *dev, size_t bytes, const char *what,
                            void **out);
void kpl_device_free(kpl_device *dev, void *ptr);

/* The algorithm/primitive cache of a device type (MegEngine's Algo
 * Chooser): on the CPU, oneDNN primitives keyed by shape, strides,
 * attributes and thread count.  A steady-state training step should only
 * hit.  Counters are process-wide and only grow. */
typedef struct {
    uint64_t hits;
    uint64_t misses;  /* primitives created */
    uint64_t entries; /* held now */
} kpl_algo_cache_stats;

kpl_algo_cache_stats kpl_algo_cache_stats_get(kpl_device_type type);

/* ------------------------------------------------------------------------ */
/* Storage (UnifiedMemory)                                                    */
/* ------------------------------------------------------------------------ */

typedef enum {
    KPL_MEM_EMPTY = 0, /* nothing written yet */
    KPL_MEM_HOST,      /* only the host copy is current */
    KPL_MEM_DEVICE,    /* only the device copy is current */
    KPL_MEM_SYNCED     /* both copies hold the same bytes */
} kpl_mem_state;

typedef struct kpl_storage kpl_storage;

/* A refcounted buffer of `bytes` bytes whose home is `dev`.  For a CPU home
 * there is only a host copy.  For a CUDA home the host copy is ordinary
 * (pageable) memory, allocated on first host access and given back when a
 * device write makes it stale.  Starts with refcount 1 and state EMPTY. */
kpl_status kpl_storage_create(kpl_device *dev, size_t bytes, kpl_storage **out);
/* A CPU storage over `bytes` of caller-owned host memory (state HOST):
 * nothing is copied or freed; when the last reference goes, release(ctx) is
 * called (from the releasing thread).  For zero-copy views of buffers a
 * producer owns, such as the data loader's batch slots. */
kpl_status kpl_storage_wrap(void *host, size_t bytes, void (*release)(void *ctx), void *ctx,
                            kpl_storage **out);
/* A storage over bytes [offset, offset + bytes) of `parent`'s memory (a
 * slot of an arena, as the static graph's memory plan makes them): it
 * keeps the parent alive, frees nothing of its own memory, and is a whole
 * storage to the kernels (it may hold a blocked layout).  Slots of one
 * parent may overlap; the caller keeps their uses apart in time.  The
 * parent must be a plain storage (not wrapped, not itself a slot). */
kpl_status kpl_storage_sub(kpl_storage *parent, size_t offset, size_t bytes, kpl_storage **out);
void kpl_storage_retain(kpl_storage *s);
/* Drops one reference; frees both copies at zero.  Accepts NULL. */
void kpl_storage_release(kpl_storage *s);
size_t kpl_storage_bytes(const kpl_storage *s);
kpl_device *kpl_storage_device(const kpl_storage *s);
kpl_mem_state kpl_storage_state(const kpl_storage *s);
/* Host pointers.  host_data() copies device->host if only the device copy
 * is current (state becomes SYNCED); host_mutable() additionally marks the
 * device copy stale (state HOST).  NULL with an error set on failure. */
const void *kpl_storage_host_data(kpl_storage *s);
void *kpl_storage_host_mutable(kpl_storage *s);
/* Device pointers, mirror images of the above (for a CPU home these are the
 * host pointers). */
const void *kpl_storage_device_data(kpl_storage *s);
void *kpl_storage_device_mutable(kpl_storage *s);

/* ------------------------------------------------------------------------ */
/* Tensors                                                                    */
/* ------------------------------------------------------------------------ */

#define KPL_MAX_DIMS 8

typedef struct kpl_tensor kpl_tensor;

/* kpl_memrec_note about the block holding t's bytes (a view's: its root
 * storage's; none for memory kpl did not allocate). */
void kpl_memrec_note_tensor(const kpl_tensor *t, kpl_memnote kind, uint32_t label);
/* The allocator block holding t's bytes (kpl_memrec_block.ptr), NULL for
 * memory kpl did not allocate. */
const void *kpl_tensor_block(const kpl_tensor *t);

/* All tensor constructors return a tensor with refcount 1 that the caller
 * owns (release with kpl_tensor_release).  Contents of _empty are undefined. */
kpl_status kpl_tensor_empty(kpl_device *dev, kpl_dtype dt, int ndim,
                            const int64_t *shape, kpl_tensor **out);
kpl_status kpl_tensor_zeros(kpl_device *dev, kpl_dtype dt, int ndim,
                            const int64_t *shape, kpl_tensor **out);
/* A tensor whose contents are copied from `data` (host memory, row-major,
 * numel elements of dtype `dt`). */
kpl_status kpl_tensor_from_data(kpl_device *dev, kpl_dtype dt, int ndim,
                                const int64_t *shape, const void *data,
                                kpl_tensor **out);
/* A tensor over `s` starting at byte `offset` (the storage gains a
 * reference; the caller keeps its own).  KPL_ERANGE if it does not fit. */
kpl_status kpl_tensor_from_storage(kpl_storage *s, size_t offset, kpl_dtype dt, int ndim,
                                   const int64_t *shape, kpl_tensor **out);
/* Same device/dtype/shape as `like`, undefined contents. */
kpl_status kpl_tensor_empty_like(const kpl_tensor *like, kpl_tensor **out);

void kpl_tensor_retain(kpl_tensor *t);
/* Drops one reference; frees the tensor (and its storage reference) at
 * zero.  Accepts NULL. */
void kpl_tensor_release(kpl_tensor *t);

/* Every accessor takes NULL (an op's failed result, a batch feature the
 * loader was not asked for): ndim, numel, nbytes, dim and offset 0, shape,
 * device and storage NULL, dtype F32; the data pointers NULL with an error
 * that says so (and keeps the failed op's message). */
int kpl_tensor_ndim(const kpl_tensor *t);
/* Pointer to ndim sizes, valid while the tensor lives. */
const int64_t *kpl_tensor_shape(const kpl_tensor *t);
int64_t kpl_tensor_dim(const kpl_tensor *t, int axis); /* negative axis ok */
int64_t kpl_tensor_numel(const kpl_tensor *t);
size_t kpl_tensor_nbytes(const kpl_tensor *t);
kpl_dtype kpl_tensor_dtype(const kpl_tensor *t);
kpl_device *kpl_tensor_device(const kpl_tensor *t);
kpl_storage *kpl_tensor_storage(const kpl_tensor *t);
/* Byte offset of element 0 inside the storage (non-zero for narrow views). */
size_t kpl_tensor_offset(const kpl_tensor *t);
/* Whether a and b share the same storage. */
bool kpl_tensor_shares_storage(const kpl_tensor *a, const kpl_tensor *b);
/* Writes "(2,3,4)" into buf; returns buf. */
char *kpl_shape_str(int ndim, const int64_t *shape, char *buf, size_t len);

/* Host access to element 0 (see kpl_storage_host_data for the copy rules). */
const void *kpl_tensor_host_data(kpl_tensor *t);
void *kpl_tensor_host_mutable(kpl_tensor *t);
/* Device access; equal to the host pointers for CPU tensors. */
const void *kpl_tensor_data(kpl_tensor *t);
void *kpl_tensor_mutable(kpl_tensor *t);
/* Copies the contents to host memory (`bytes` must be >= nbytes). */
kpl_status kpl_tensor_to_host(kpl_tensor *t, void *dst, size_t bytes);
/* Element `flat` read as double (any dtype; for tests and printing). */
kpl_status kpl_tensor_get(kpl_tensor *t, int64_t flat, double *value);

/* A slot for the layers above kernels/ (graph/ keeps requires_grad, .grad
 * and the producing node of a tensor there).  `free_fn(meta)` runs when the
 * tensor header is freed (not when a view of it is).  Setting replaces the
 * previous meta without freeing it.  Not thread-safe. */
void kpl_tensor_set_meta(kpl_tensor *t, void *meta, void (*free_fn)(void *meta));
void *kpl_tensor_meta(const kpl_tensor *t);
/* The refcount of the tensor header (for tests and debugging). */
int kpl_tensor_refcount(const kpl_tensor *t);
/* A number unique to each tensor header, increasing in order of creation
 * (views get their own), and the number the next header will get: a
 * tracer tells the tensors made since it started from older ones. */
uint64_t kpl_tensor_serial(const kpl_tensor *t);
/* Promises that the bytes of t's storage will not change: kernels may keep
 * copies derived from them with the storage for later calls (a CPU
 * convolution keeps its weights in the layout its kernel computes with,
 * instead of reordering them at every call).  Any write access to the
 * storage drops such copies, so a broken promise costs time, not
 * correctness.  The static graph's executor marks its constants, and an
 * inference graph's parameters while it lives. */
void kpl_tensor_set_constant(kpl_tensor *t, bool on);
bool kpl_tensor_constant(const kpl_tensor *t);
uint64_t kpl_tensor_serial_next(void);
/* This thread's observer of the public host accessors
 * (kpl_tensor_host_data/_host_mutable, and so kpl_tensor_get and
 * _to_host): called before the access, `write` for the mutable one.
 * Kernels' own reads do not call it.  The tracer uses it
 * to catch a traced function that looks at values (a data-dependent
 * branch).  Returns the previous hook (and its argument in *prev_user). */
typedef void (*kpl_host_access_hook)(const kpl_tensor *t, bool write, void *user);
kpl_host_access_hook kpl_set_host_access_hook(kpl_host_access_hook fn, void *user,
                                              void **prev_user);
/* The process's observer of tensor headers being freed, on whatever thread
 * drops the last reference, before the header's memory goes: the tracer
 * forgets a header it mapped, instead of holding a reference to every
 * tensor it sees (which kept a traced forward's every value alive).  One
 * hook for the process (set once; NULL turns it off). */
typedef void (*kpl_tensor_free_hook)(const kpl_tensor *t);
void kpl_set_tensor_free_hook(kpl_tensor_free_hook fn);

/* Views: share storage with `t`, own a new tensor header (release it). */
kpl_status kpl_tensor_reshape(kpl_tensor *t, int ndim, const int64_t *shape,
                              kpl_tensor **out); /* one -1 dim allowed */
kpl_status kpl_tensor_flatten(kpl_tensor *t, int start, int end,
                              kpl_tensor **out);
kpl_status kpl_tensor_squeeze(kpl_tensor *t, int axis, kpl_tensor **out);
/* axis = -1 squeezes every size-1 dim */
kpl_status kpl_tensor_unsqueeze(kpl_tensor *t, int axis, kpl_tensor **out);
kpl_status kpl_tensor_narrow(kpl_tensor *t, int64_t start, int64_t length,
                             kpl_tensor **out); /* along dim 0 */

/* A new tensor on `dev` with the same dtype/shape and copied contents. */
kpl_status kpl_tensor_to_device(kpl_tensor *t, kpl_device *dev,
                                kpl_tensor **out);
/* A new contiguous tensor with dims permuted: out.shape[i] = t.shape[perm[i]]. */
kpl_status kpl_tensor_permute(kpl_tensor *t, const int *perm,
                              kpl_tensor **out);
/* The same into out (x's dtype and device, the permuted shape). */
kpl_status kpl_k_permute(kpl_tensor *out, const kpl_tensor *x, const int *perm);

/* ------------------------------------------------------------------------ */
/* Random numbers                                                             */
/* ------------------------------------------------------------------------ */

/* A Philox-4x32-10 stream: key = seed, counter = offset + block.  Element i
 * of an f32/f16/bf16 fill comes from word i % 4 of block i / 4 (f64: two
 * words per value, block i / 2); a fill then advances the offset by the
 * blocks it used.  So a fill's values depend on (seed, offset, index) only:
 * the same for any thread count and on every device.  Not thread-safe: one
 * rng per thread of control. */
typedef struct kpl_rng kpl_rng;

kpl_rng *kpl_rng_create(uint64_t seed); /* NULL only when out of memory */
void kpl_rng_destroy(kpl_rng *rng);     /* accepts NULL */
uint64_t kpl_rng_seed(const kpl_rng *rng);
uint64_t kpl_rng_offset(const kpl_rng *rng);
/* Reposition the stream (for checkpoint/resume). */
void kpl_rng_set_state(kpl_rng *rng, uint64_t seed, uint64_t offset);
/* Philox-4x32-10 of one counter block (exposed for tests and other
 * modules that need reproducible randomness, e.g. dropout, shuffles). */
void kpl_philox4x32(uint64_t seed, uint64_t counter_hi, uint64_t counter_lo,
                    uint32_t out[4]);

/* ------------------------------------------------------------------------ */
/* Kernel registry                                                            */
/* ------------------------------------------------------------------------ */

/* Kernel ops (append only).  An op here is the unit of dispatch; the
 * element-wise families take their formula as an attribute. */
#define KPL_KOP_LIST(X) \
    X(UNARY, "unary")   \
    X(BINARY, "binary") \
    X(WHERE, "where")   \
    X(REDUCE, "reduce") \
    X(MATMUL, "matmul") \
    X(FILL, "fill")     \
    X(ARANGE, "arange") \
    X(RANDOM, "random") \
    X(CAST, "cast")     \
    X(COPY, "copy")     \
    X(CONV2D, "conv2d") \
    X(CONV2D_RELU, "conv2d_relu") \
    X(POOL2D, "pool2d") \
    X(INDEX, "index")   \
    X(BATCH_NORM, "batch_norm") \
    X(BATCH_NORM_RELU, "batch_norm_relu") \
    X(BOX, "box")       \
    X(ROI_ALIGN, "roi_align") \
    X(AMP_UNSCALE, "amp_unscale") \
    X(XENT, "softmax_xent") \
    X(FOCAL, "sigmoid_focal") \
    X(GROUP_NORM, "group_norm") \
    X(CONV2D_ACC, "conv2d_acc") \
    X(SGD, "sgd")

typedef enum {
#define KPL_X_(e, s) KPL_KOP_##e,
    KPL_KOP_LIST(KPL_X_)
#undef KPL_X_
    KPL_KOP_COUNT
} kpl_kop;

const char *kpl_kop_name(kpl_kop op);

/* Arguments of one kernel invocation.  `attrs` points to the op's
 * attributes: the call's own parameters (a parameter struct of this
 * header, an axis) where the kernels read everything else from the
 * checked operands, or an attribute struct the front end fills (sizes, a
 * direction, a plan; declared in kernels_impl.h for the built-in ops). */
typedef struct {
    kpl_tensor *out;           /* written */
    const kpl_tensor *in[3];   /* read; unused slots NULL */
    const void *attrs;
} kpl_kernel_args;

typedef kpl_status (*kpl_kernel_fn)(const kpl_kernel_args *args);

/* Registers fn for (op, device type, dtype of the first input, or of `out`
 * for ops without inputs); replaces an earlier registration.  Thread-safe. */
kpl_status kpl_kernel_register(kpl_kop op, kpl_device_type dev, kpl_dtype dt,
                               kpl_kernel_fn fn);
/* KPL_ENOKERNEL naming op, device and dtype when nothing is registered. */
kpl_status kpl_kernel_lookup(kpl_kop op, kpl_device_type dev, kpl_dtype dt,
                             kpl_kernel_fn *out);
/* Whether a kernel is registered for (op, device type, dtype). */
bool kpl_kernel_registered(kpl_kop op, kpl_device_type dev, kpl_dtype dt);

/* Whether convolutions and matmuls in `dt` (f16, bf16) run natively on
 * devices of `type`; when not they compute in f32 and round the result
 * (correct, and slower than f32).  f32 and f64 are always native. */
bool kpl_precision_native(kpl_device_type type, kpl_dtype dt);
/* One line on the CPU's math: its model, the ISA extensions kpl and oneDNN
 * use, and whether bf16 / f16 are native, e.g.
 * "AMD EPYC 9R45; avx2 fma avx512f avx512_bf16; oneDNN avx512_core_bf16;
 *  bf16 native, f16 emulated". */
const char *kpl_cpu_math_info(void);

/* ------------------------------------------------------------------------ */
/* Shape helpers (shape inference runs before any allocation)                */
/* ------------------------------------------------------------------------ */

/* numpy broadcasting of two shapes.  KPL_ESHAPE naming `op` and both
 * shapes when they are incompatible. */
kpl_status kpl_shape_broadcast(const char *op, int na, const int64_t *a,
                               int nb, const int64_t *b, int *nout,
                               int64_t *out);
/* The result shape of reducing `axes` (negative allowed, NULL/naxes == 0 =
 * all axes) with or without keepdim. */
kpl_status kpl_shape_reduce(const char *op, int ndim, const int64_t *shape,
                            const int *axes, int naxes, bool keepdim,
                            int *nout, int64_t *out);
/* The result shape of matmul(a, b) with optional transposes of the last two
 * dims; leading (batch) dims broadcast; 1-D operands as in numpy. */
kpl_status kpl_shape_matmul(int na, const int64_t *a, bool trans_a, int nb,
                            const int64_t *b, bool trans_b, int *nout,
                            int64_t *out);

/* ------------------------------------------------------------------------ */
/* Compute (destination-passing)                                              */
/* ------------------------------------------------------------------------ */

/* X(ENUM, name).  Unary element-wise formulas (append only).  Integer
 * dtypes support NEG, ABS, SIGN, SQUARE, RELU; bool/u8 none; the rest are
 * floating point only.  SOFTPLUS is log(1 + e^x), computed as
 * max(x, 0) + log1p(e^-|x|): no overflow, and exact for tiny results. */
#define KPL_UNARY_LIST(X)                                              \
    X(NEG, "neg") X(ABS, "abs") X(EXP, "exp") X(LOG, "log")            \
    X(SQRT, "sqrt") X(RSQRT, "rsqrt") X(SQUARE, "square")              \
    X(RECIPROCAL, "reciprocal") X(SIN, "sin") X(COS, "cos")            \
    X(TANH, "tanh") X(SIGMOID, "sigmoid") X(RELU, "relu")              \
    X(LEAKY_RELU, "leaky_relu") X(GELU, "gelu") X(CLIP, "clip")        \
    X(SIGN, "sign") X(GELU_TANH, "gelu_tanh") X(ERF, "erf")            \
    X(SOFTPLUS, "softplus")

typedef enum {
#define KPL_X_(e, s) KPL_UN_##e,
    KPL_UNARY_LIST(KPL_X_)
#undef KPL_X_
    KPL_UNARY_COUNT
} kpl_unary_op;

/* Binary element-wise formulas with numpy broadcasting.  Comparisons
 * (EQ..GE) write KPL_BOOL; the rest write the input dtype.  RELU_BWD is
 * ReLU's gradient in one pass: a * (b > 0), a the output gradient and b
 * the ReLU's output (append only). */
#define KPL_BINARY_LIST(X)                                                  \
    X(ADD, "add") X(SUB, "sub") X(MUL, "mul") X(DIV, "div") X(POW, "pow")  \
    X(MAXIMUM, "maximum") X(MINIMUM, "minimum") X(EQ, "eq") X(NE, "ne")    \
    X(LT, "lt") X(LE, "le") X(GT, "gt") X(GE, "ge") X(RELU_BWD, "relu_bwd")

typedef enum {
#define KPL_X_(e, s) KPL_BIN_##e,
    KPL_BINARY_LIST(KPL_X_)
#undef KPL_X_
    KPL_BINARY_COUNT
} kpl_binary_op;

const char *kpl_unary_name(kpl_unary_op op);
const char *kpl_binary_name(kpl_binary_op op);
bool kpl_binary_is_compare(kpl_binary_op op);

/* out = op(x).  alpha/beta parameterise LEAKY_RELU (alpha = slope) and CLIP
 * (alpha = lo, beta = hi); ignored by the others.  out may be x (in place).
 * out must have x's shape and dtype, on x's device. */
kpl_status kpl_k_unary(kpl_tensor *out, kpl_unary_op op, const kpl_tensor *x,
                       double alpha, double beta);
/* out = a op b, broadcasting.  out may alias a or b when it has the
 * broadcast shape (in place forms).  a and b must share dtype and device. */
kpl_status kpl_k_binary(kpl_tensor *out, kpl_binary_op op, const kpl_tensor *a,
                        const kpl_tensor *b);
/* out = a op s (or s op a when `scalar_first`): scalar forms. */
kpl_status kpl_k_binary_scalar(kpl_tensor *out, kpl_binary_op op,
                               const kpl_tensor *a, double s,
                               bool scalar_first);
/* out = cond ? a : b, all three broadcast; cond is KPL_BOOL. */
kpl_status kpl_k_where(kpl_tensor *out, const kpl_tensor *cond,
                       const kpl_tensor *a, const kpl_tensor *b);

typedef enum {
    KPL_RED_SUM = 0,
    KPL_RED_MEAN,
    KPL_RED_MAX,
    KPL_RED_MIN,
    KPL_RED_ARGMAX,   /* writes KPL_I64; first index of the extreme */
    KPL_RED_ARGMIN,
    KPL_RED_VAR,      /* unbiased when `correction` = 1 */
    KPL_RED_LOGSUMEXP, /* max + log(sum(exp(x - max))): softmax's denominator */
    KPL_RED_SUMEXP_SUB_MAX, /* sum(exp(x - max)), max not added back */
    KPL_REDUCE_COUNT
} kpl_reduce_op;

const char *kpl_reduce_name(kpl_reduce_op op);

/* out = reduce(x) over `axes` (see kpl_shape_reduce for the shape).  ARGMAX
 * and ARGMIN take exactly one axis (or all axes, then a flat index).
 * correction is the VAR divisor offset (N - correction).  Sums of f32
 * accumulate in f64. */
kpl_status kpl_k_reduce(kpl_tensor *out, kpl_reduce_op op, const kpl_tensor *x,
                        const int *axes, int naxes, bool keepdim,
                        int correction);

/* Softmax cross entropy per position, over the class axis 1 of logits x
 * (N, C, d1, ..., dk) (k >= 0) against int64 labels (N, d1, ..., dk):
 *   out[i] = (1 - eps) (lse_i - x[i, y_i]) + eps (lse_i - mean_c x[i, c]),
 * lse_i = log sum_c exp(x[i, c]), and 0 where y_i == ignore_index
 * (PyTorch's F.cross_entropy with reduction 'none' and label_smoothing
 * eps in [0, 1)).  The backward writes
 *   gx[i, c] = gy[i] (softmax(x_i)[c] - (1 - eps) [c == y_i] - eps / C),
 * 0 where y_i == ignore_index, recomputing the softmax from x.  f32 and
 * f64 (f16/bf16 run in f32, rounded once); sums over the classes in f64.
 * A label outside [0, C) that is not ignore_index is KPL_ERANGE naming its
 * position and value (on CUDA at the next synchronisation, as gather's). */
kpl_status kpl_k_softmax_xent(kpl_tensor *out, const kpl_tensor *x, const kpl_tensor *labels,
                              int64_t ignore_index, double eps);
kpl_status kpl_k_softmax_xent_bwd(kpl_tensor *gx, const kpl_tensor *x, const kpl_tensor *labels,
                                  const kpl_tensor *gy, int64_t ignore_index, double eps);

/* out = op(a) @ op(b) with op = transpose of the last two dims when asked;
 * batch dims broadcast (see kpl_shape_matmul).  f32 and f64. */
kpl_status kpl_k_matmul(kpl_tensor *out, const kpl_tensor *a,
                        const kpl_tensor *b, bool trans_a, bool trans_b);

/* out[:] = value (converted to out's dtype). */
kpl_status kpl_k_fill(kpl_tensor *out, double value);
/* out[i] = start + i * step over the flat index. */
kpl_status kpl_k_arange(kpl_tensor *out, double start, double step);
/* Uniform in [lo, hi) / normal(mean, std); float dtypes.  Advances rng. */
kpl_status kpl_k_uniform(kpl_tensor *out, kpl_rng *rng, double lo, double hi);
kpl_status kpl_k_normal(kpl_tensor *out, kpl_rng *rng, double mean,
                        double std);
/* out = x converted to out's dtype (round to nearest even for f16/bf16,
 * truncation toward zero for float -> int, nonzero -> true for bool). */
kpl_status kpl_k_cast(kpl_tensor *out, const kpl_tensor *x);
/* out = x, same dtype and numel; devices may differ (the one explicit
 * cross-device path). */
kpl_status kpl_k_copy(kpl_tensor *out, const kpl_tensor *x);
/* Concatenation's and slicing's copy along `axis` of two tensors of one
 * device, dtype and number of dims, equal but along axis: with `into`,
 * out[.., offset + i, ..] = x[.., i, ..] for every i < x.shape[axis] (the
 * rest of out kept); without, out = x[.., offset : offset +
 * out.shape[axis], ..].  Any dtype; KPL_ERANGE when the slab passes the
 * larger tensor's end.  A 2-D memory copy (cudaMemcpy2DAsync on CUDA). */
kpl_status kpl_k_copy_slab(kpl_tensor *out, const kpl_tensor *x, int axis, int64_t offset,
                           bool into);
/* out = the k pieces xs concatenated along `axis` (the pieces as
 * kpl_k_copy_slab takes them, their sizes along axis adding up to out's).
 * On the CPU, pieces held in the blocked layout (kpl_set_blocked_layouts)
 * and concatenated along the channels (a U-Net's skip and upsampled maps)
 * are copied as they are and out is left blocked; else slab copies. */
kpl_status kpl_k_concat(kpl_tensor *out, int k, const kpl_tensor *const *xs, int axis);

/* 2-D convolution over NCHW images with OIHW weights (O, C/groups, KH, KW).
 * Padding is symmetric; dilation 1 is a plain convolution. */
typedef struct {
    int stride[2];   /* (h, w) */
    int padding[2];  /* (h, w), zeros added on both sides */
    int dilation[2]; /* (h, w) */
    int groups;
} kpl_conv2d_params;
#define KPL_CONV2D_PARAMS_INIT {{1, 1}, {0, 0}, {1, 1}, 1}

/* The output shape (N, O, OH, OW) of x (N, C, H, W) with w (O, C/g, KH, KW);
 * KPL_ESHAPE naming the shapes when they do not fit (channels, groups, a
 * kernel larger than the padded input, non-positive strides). */
kpl_status kpl_shape_conv2d(const int64_t *x_shape, const int64_t *w_shape,
                            const kpl_conv2d_params *p, int64_t *out_shape);
/* out (N, O, OH, OW) = conv2d(x (N, C, H, W), w, b (O) or NULL).  f32 on
 * oneDNN, f64 on a plain reference loop. */
kpl_status kpl_k_conv2d(kpl_tensor *out, const kpl_tensor *x, const kpl_tensor *w,
                        const kpl_tensor *b, const kpl_conv2d_params *p);
/* relu(conv2d(x, w, b)) in one pass: oneDNN's ReLU post-op, applied to
 * the f32 sums before they are stored (or rounded to bf16/f16), so the
 * values are those of kpl_k_conv2d then KPL_UN_RELU but for the sign of
 * a zero (an output rounding to -0 comes out +0).  Where the device
 * registers KPL_KOP_CONV2D_RELU (the CPU); KPL_EUNSUPPORTED elsewhere,
 * where graph/ composes the two ops. */
kpl_status kpl_k_conv2d_relu(kpl_tensor *out, const kpl_tensor *x, const kpl_tensor *w,
                             const kpl_tensor *b, const kpl_conv2d_params *p);
/* out = conv2d(x, w, b) + out, with relu then relu of that, in one pass:
 * oneDNN's sum post-op (and ReLU's) on the f32 sums before they are stored,
 * so f32 values are those of kpl_k_conv2d then the add (then ReLU) but for
 * the sign of a zero; bf16 rounds once where the composed ops round
 * twice.  out holds the addend on entry (a residual, a shortcut: the
 * inference graph's conv2d_add).  Where the device registers
 * KPL_KOP_CONV2D_ACC (the CPU: f32, f64, bf16 where native);
 * KPL_EUNSUPPORTED elsewhere. */
kpl_status kpl_k_conv2d_acc(kpl_tensor *out, const kpl_tensor *x, const kpl_tensor *w,
                            const kpl_tensor *b, const kpl_conv2d_params *p, bool relu);
/* gx (N, C, H, W) = the gradient of conv2d w.r.t. its input for output
 * gradient gy (N, O, OH, OW): a transposed convolution.  gx's shape says H, W. */
kpl_status kpl_k_conv2d_bwd_data(kpl_tensor *gx, const kpl_tensor *gy, const kpl_tensor *w,
                                 const kpl_conv2d_params *p);
/* gw (O, C/g, KH, KW) = the gradient w.r.t. the weights, from the input x
 * and gy; gb (O) the bias gradient, or NULL. */
kpl_status kpl_k_conv2d_bwd_weight(kpl_tensor *gw, kpl_tensor *gb, const kpl_tensor *x,
                                   const kpl_tensor *gy, const kpl_conv2d_params *p);

/* 2-D pooling windows over NCHW.  Padding is symmetric; padded cells never
 * win a max and count for an average only with count_include_pad.
 * ceil_mode (PyTorch's): the output size rounds up, so a last window may
 * hang over the input's end — as long as it starts inside the input or
 * its left padding; what it hangs past the right padding is no cell at
 * all (not even for count_include_pad).  Fill it with designated
 * initializers ({.kernel = {2, 2}, .stride = {2, 2}}): fields are
 * appended. */
typedef struct {
    int kernel[2];
    int stride[2];
    int padding[2];
    bool count_include_pad;
    bool ceil_mode;
} kpl_pool2d_params;

/* (N, C, OH, OW): OH = (H + 2 padding - kernel) / stride + 1, the division
 * rounding down, or up with ceil_mode (then one less if the last window
 * would start at or past H + padding); likewise OW.  KPL_ESHAPE when a window
 * does not fit or the padding is more than half the window (as PyTorch
 * requires). */
kpl_status kpl_shape_pool2d(const int64_t *x_shape, const kpl_pool2d_params *p,
                            int64_t *out_shape);
/* out = the maximum of each window, idx (KPL_I64, out's shape) = its flat
 * position h * W + w in the input plane (first maximum; NaN wins).  idx
 * may be NULL (inference): the same values, faster on the CPU. */
kpl_status kpl_k_max_pool2d(kpl_tensor *out, kpl_tensor *idx, const kpl_tensor *x,
                            const kpl_pool2d_params *p);
/* out[n, c, i] = x[n, c, idx[n, c, i]] over each (H*W) plane, and its
 * adjoint gx[n, c, idx[n, c, i]] += gy[n, c, i] (gx is zeroed first).
 *
 * Index errors on CUDA.  The index kernels (plane_gather, plane_scatter,
 * index_select, index_add, gather, scatter_add) check every index on the
 * device without waiting for the answer: the call returns KPL_OK (its
 * output unspecified where an index was bad), and the next call that
 * brings bytes to the host from that device (a kpl_tensor_get, a
 * host_data, kpl_k_copy to the CPU) or kpl_device_synchronize fails with
 * KPL_ERANGE naming the op, the first bad index and its position.  On the
 * CPU the call itself fails, as documented per op.
 *
 * Determinism on CUDA.  plane_scatter and scatter_add add with atomics
 * (sums in no fixed order) unless kpl_get_deterministic(), when they, like
 * index_add always, compute each output by one thread summing its
 * contributions in idx's order: the CPU's order, so the CPU's bits. */
kpl_status kpl_k_plane_gather(kpl_tensor *out, const kpl_tensor *x, const kpl_tensor *idx);
kpl_status kpl_k_plane_scatter(kpl_tensor *gx, const kpl_tensor *gy, const kpl_tensor *idx);
/* Average pooling and its adjoint (gx's shape gives the input size). */
kpl_status kpl_k_avg_pool2d(kpl_tensor *out, const kpl_tensor *x, const kpl_pool2d_params *p);
kpl_status kpl_k_avg_pool2d_bwd(kpl_tensor *gx, const kpl_tensor *gy,
                                const kpl_pool2d_params *p);
/* Bilinear resizing of each (H, W) plane, F.interpolate(mode="bilinear"):
 * out (N, C, OH, OW) from x (N, C, H, W), sizes from the tensors.  Output
 * cell i of a side of IN cells reads IN coordinate s = i (IN - 1) / (OUT -
 * 1) with align_corners (0 when OUT is 1), else s = (i + 1/2) IN / OUT -
 * 1/2 clamped at 0; it mixes cells floor(s) and floor(s) + 1 (the last
 * cell twice at the edge) by s's fraction, rows then columns as PyTorch.
 * Coordinates in f64; the mixing in f32 (f64 for f64; f16/bf16 through
 * f32, rounded once).  The adjoint spreads gy (N, C, OH, OW) onto gx (N, C,
 * H, W) with the same weights (gx's shape gives the input size); on CUDA
 * each gx cell sums its own taps, so the result does not depend on
 * thread order. */
kpl_status kpl_k_upsample_bilinear(kpl_tensor *out, const kpl_tensor *x, bool align_corners);
kpl_status kpl_k_upsample_bilinear_bwd(kpl_tensor *gx, const kpl_tensor *gy, bool align_corners);

/* out = x with dim `axis` replaced by the rows idx (KPL_I64, (K)) of it:
 * out.shape[axis] = K; any dtype.  An index outside [0, x.shape[axis]) is
 * KPL_ERANGE naming it. */
kpl_status kpl_k_index_select(kpl_tensor *out, const kpl_tensor *x, int axis,
                              const kpl_tensor *idx);
/* The adjoint: out zeroed, then out[.., idx[k], ..] += g[.., k, ..] along
 * `axis` (float dtypes). */
kpl_status kpl_k_index_add(kpl_tensor *out, const kpl_tensor *g, int axis,
                           const kpl_tensor *idx);

/* torch.gather: out (idx's shape) takes, at each position of idx
 * (KPL_I64, x's rank), x's element whose coordinate along `axis` is the
 * index there and whose other coordinates are the position's own, e.g.
 * out[i][j][k] = x[i][idx[i][j][k]][k] for axis 1.  idx may be smaller
 * than x in the other dims, not larger.  Any dtype.  An index outside
 * [0, x.shape[axis]) is KPL_ERANGE naming the axis, the value and its
 * position in idx (the first such in row-major order); out is then
 * unspecified. */
kpl_status kpl_k_gather(kpl_tensor *out, const kpl_tensor *x, int axis,
                        const kpl_tensor *idx);
/* Its adjoint, torch.Tensor.scatter_add out of place: out (x's shape) = x,
 * then out[i][idx[i][j][k]][k] += src[i][j][k] for axis 1 (likewise for
 * other axes), repeated indices adding up.  src has idx's shape.  f32 and
 * f64.  The same index checks as gather.  On the CPU repeated indices add
 * in idx's order; on CUDA in no fixed order (atomics), so f32 sums may
 * differ in their last bits from run to run, unless kpl_get_deterministic()
 * (see kpl_k_plane_gather). */
kpl_status kpl_k_scatter_add(kpl_tensor *out, const kpl_tensor *x, int axis,
                             const kpl_tensor *idx, const kpl_tensor *src);

/* Batch normalisation with the batch statistics, over x (N, C, ...) per
 * channel: y = (x - mean) / sqrt(var + eps) * gamma + beta, with mean and
 * the biased variance var over every axis but 1 written to mean, var (C)
 * (either may be NULL).  gamma, beta (C). */
kpl_status kpl_k_batch_norm(kpl_tensor *y, kpl_tensor *mean, kpl_tensor *var,
                            const kpl_tensor *x, const kpl_tensor *gamma,
                            const kpl_tensor *beta, double eps);
/* Its gradient for output gradient gy: gx (x's shape), ggamma and gbeta
 * (C); any output may be NULL but not all.  The statistics are those the
 * forward left with x's storage (the CPU's kernels keep them until the
 * storage is next written), else computed again from x: the same values
 * either way. */
kpl_status kpl_k_batch_norm_bwd(kpl_tensor *gx, kpl_tensor *ggamma, kpl_tensor *gbeta,
                                const kpl_tensor *x, const kpl_tensor *gy,
                                const kpl_tensor *gamma, double eps);
/* Batch norm then ReLU in one pass, y = relu(batch_norm(x)): the values
 * of kpl_k_batch_norm followed by kpl_k_unary(RELU), bit for bit, without
 * writing and reading the normalised tensor between them.  Only where the
 * device registers KPL_KOP_BATCH_NORM_RELU (the CPU); KPL_EUNSUPPORTED
 * elsewhere, where graph/ composes the two ops. */
kpl_status kpl_k_batch_norm_relu(kpl_tensor *y, kpl_tensor *mean, kpl_tensor *var,
                                 const kpl_tensor *x, const kpl_tensor *gamma,
                                 const kpl_tensor *beta, double eps);
/* Its gradient: gy masked where the forward's output y is not > 0 (as
 * KPL_BIN_RELU_BWD), then kpl_k_batch_norm_bwd's, in one pass. */
kpl_status kpl_k_batch_norm_relu_bwd(kpl_tensor *gx, kpl_tensor *ggamma, kpl_tensor *gbeta,
                                     const kpl_tensor *x, const kpl_tensor *y,
                                     const kpl_tensor *gy, const kpl_tensor *gamma, double eps);

/* Group norm (Wu and He 2018) of x (N, C, ...) in `groups` groups of C /
 * groups channels: per (sample, group), over its (C / groups) x spatial
 * values, y = (x - mean) / sqrt(var + eps) gamma[c] + beta[c] (biased
 * variance, sums in f64); gamma and beta (C) of x's dtype.  f32 and f64
 * on the CPU (kpl_kernel_registered says where; graph/ runs batch norm's
 * op on a (1, N G, ...) view elsewhere). */
kpl_status kpl_k_group_norm(kpl_tensor *y, const kpl_tensor *x, const kpl_tensor *gamma,
                            const kpl_tensor *beta, int groups, double eps);
/* Its gradient for output gradient gy: gx (x's shape), ggamma and gbeta
 * (C), computing the statistics again from x; ggamma / gbeta may be NULL.
 * The per-sample parts of ggamma and gbeta are added in sample order (the
 * same bits whatever the threads). */
kpl_status kpl_k_group_norm_bwd(kpl_tensor *gx, kpl_tensor *ggamma, kpl_tensor *gbeta,
                                const kpl_tensor *x, const kpl_tensor *gy,
                                const kpl_tensor *gamma, int groups, double eps);

/* Boxes, with torchvision.ops' conventions: an (N, 4) tensor of rows
 * (x0, y0, x1, y1) in pixels, x1 >= x0 and y1 >= y0, f32 or f64; a box's
 * area is (x1 - x0) (y1 - y0) (no +1).  graph/vision.h is their eager API.
 *
 * Checks that `boxes` is (N, 4), f32 or f64, and that every row is a box:
 * its four coordinates finite, x1 >= x0 and y1 >= y0.  KPL_ESHAPE,
 * KPL_EDTYPE or KPL_EINVAL otherwise, the message naming `op`, the
 * argument `name` and the first bad row with its values.  Reads the
 * values on the host: for a CUDA tensor that is a copy to the host and a
 * wait for it. */
kpl_status kpl_k_box_check(const char *op, const char *name, const kpl_tensor *boxes);

typedef enum {
    KPL_BOX_IOU = 0, /* intersection / union; 0 when the union is 0 */
    KPL_BOX_GIOU     /* IoU - (C - union) / C, C the area of the smallest
                      * box enclosing both; the second term is 0 when C is 0 */
} kpl_box_metric;

/* out = the metric of box pairs: with `pairwise`, out (N, M) of every
 * a[i] (N, 4) with every b[j] (M, 4); without, out (N) of a[i] with b[i]
 * (matched pairs, M == N).  a, b and out share dtype and device.  The
 * values are not checked (kpl_k_box_check does that): a NaN coordinate
 * gives NaN.  Bit-identical on every device, and to graph/vision.c's
 * recorded composition of the same formula. */
kpl_status kpl_k_box_iou(kpl_tensor *out, const kpl_tensor *a, const kpl_tensor *b,
                         kpl_box_metric metric, bool pairwise);

/* Greedy non-maximum suppression (torchvision.ops.nms): visit the boxes
 * by decreasing score — equal scores by lower index, NaN scores before
 * every number (as torch.sort) — and keep a box unless its IoU with a box
 * kept before it is greater than iou_threshold (strictly: IoU equal to
 * the threshold does not suppress).  With idxs (N) (KPL_I64 class ids)
 * boxes only suppress boxes of their own class (batched_nms); NULL for
 * one class.  Writes the kept indices in visiting order to the first
 * *nkeep entries of keep (N) (KPL_I64).  boxes (N, 4) are checked as by
 * kpl_k_box_check; scores (N) are f32 or f64; iou_threshold >= 0.
 * Blocking: the count comes back to the host (on CUDA the scores are
 * sorted on the host and the pairwise suppression mask is computed on
 * the GPU, N^2 / 8 bytes in row blocks of at most 64 MB). */
kpl_status kpl_k_nms(kpl_tensor *keep, int64_t *nkeep, const kpl_tensor *boxes,
                     const kpl_tensor *scores, const kpl_tensor *idxs, double iou_threshold);

/* The sigmoid focal loss per element of logits z against targets y (one
 * shape and dtype): out = alpha_t CE (1 - p_t)^gamma, graph/vision.h's
 * kpl_sigmoid_focal_loss with reduction 'none' (alpha < 0: no alpha_t;
 * gamma finite and >= 0).  The backward writes gz = gy d(out)/dz (the
 * targets' gradient is the recorded composition's business).  f32 and
 * f64 (f16/bf16 through f32, rounded once). */
kpl_status kpl_k_sigmoid_focal(kpl_tensor *out, const kpl_tensor *z, const kpl_tensor *y,
                               double alpha, double gamma);
kpl_status kpl_k_sigmoid_focal_bwd(kpl_tensor *gz, const kpl_tensor *z, const kpl_tensor *y,
                                   const kpl_tensor *gy, double alpha, double gamma);

/* ROI Align (He et al. 2017) with torchvision.ops.roi_align's sampling:
 * each roi (batch index, x0, y0, x1, y1), in the coordinates of the image
 * the features were computed from, is scaled by spatial_scale onto the
 * feature map (and shifted by -0.5 with `aligned`, so that pixel centres
 * sit at integer + 0.5); it is cut into out_h x out_w bins; each bin
 * averages gh x gw bilinear samples at the centres of a regular grid over
 * it.  A sample outside [-1, H] x [-1, W] counts as 0; inside, a
 * coordinate below 0 reads row (column) 0 and one past H - 1 (W - 1) the
 * last.  Without `aligned` a roi is at least 1 x 1 feature pixel
 * (torchvision's legacy rule). */
typedef struct {
    int64_t out_h, out_w;  /* bins per roi, >= 1 */
    double spatial_scale;  /* roi coordinate x scale = feature coordinate; finite, > 0 */
    int sampling_ratio;    /* gh = gw = sampling_ratio; <= 0: per roi, ceil(roi side / bins) */
    bool aligned;          /* the -0.5 pixel shift (torchvision's aligned=True) */
} kpl_roi_align_params;

/* Samples per bin side (sampling_ratio, or the adaptive count of a roi)
 * may not exceed this: a bin side spanning more feature pixels than that
 * is a unit mistake (pixels given for a feature map, a wrong scale). */
#define KPL_ROI_ALIGN_MAX_GRID 65536

/* out (K, C, out_h, out_w) = ROI Align of x (N, C, H, W) at rois (K, 5)
 * (x's dtype, f32 or f64, and device).  The rois are checked first (read
 * on the host: for CUDA tensors a copy and a wait): every value finite,
 * the batch index a whole number in [0, N), x1 >= x0 and y1 >= y0, and at
 * most KPL_ROI_ALIGN_MAX_GRID samples per bin side; KPL_EINVAL naming the
 * first bad row and its values otherwise.  Bit-identical on every
 * device. */
kpl_status kpl_k_roi_align(kpl_tensor *out, const kpl_tensor *x, const kpl_tensor *rois,
                           const kpl_roi_align_params *p);
/* Its adjoint (the gradient with respect to x): gx (N, C, H, W), whose
 * shape gives x's, is zeroed, then every bin's gy (K, C, out_h, out_w)
 * value, divided among its samples, is added into the four cells of each
 * sample with their bilinear weights.  The same checks of the rois.  On
 * the CPU the sums run in roi order (deterministic); on CUDA in no fixed
 * order (atomics), so f32 sums may differ in their last bits, in
 * deterministic mode too. */
kpl_status kpl_k_roi_align_bwd(kpl_tensor *gx, const kpl_tensor *gy, const kpl_tensor *rois,
                               const kpl_roi_align_params *p);

/* out = x broadcast to out's shape (numpy rules), same dtype and device. */
kpl_status kpl_k_expand(kpl_tensor *out, const kpl_tensor *x);

/* Loss scaling (torch.cuda.amp.GradScaler's unscale step): multiplies the
 * gradient g in place by inv_scale (finite), and sets found_inf[0] to 1.0
 * if any element of g, as it was before the multiplication, is +-inf or
 * NaN.  found_inf is never cleared here: the caller zeroes it once per
 * step and passes it to every gradient, then reads it once.  g is f32,
 * f16, bf16 or f64; found_inf is an f32 tensor of one element on g's
 * device, not overlapping g.  The product is computed in f32 with
 * inv_scale rounded to f32 (in f64 for f64 gradients), then rounded to
 * g's dtype: the same bits on every device.  Does not block: on CUDA
 * found_inf stays on the device, queued behind the kernel, until the
 * caller reads it. */
kpl_status kpl_k_amp_unscale(kpl_tensor *g, double inv_scale, kpl_tensor *found_inf);

/* One SGD step of parameter p in place, torch.optim.SGD's formula as the
 * element-wise ops compute it one after another (trainer/optim/optim.c's
 * composed form), in one pass: each scalar rounded to p's dtype and every
 * operation rounded on its own (no fused multiply-add), so the same bits:
 *   g' = p * wd + g            (g' = g when wd == 0)
 *   v  = v * momentum + g'     (v = g' when `first`; no v when momentum == 0)
 *   d  = nesterov ? v * momentum + g' : v   (d = g' without momentum)
 *   p  = p - d * lr
 * p, v (NULL without momentum) and g share one shape, dtype (f32 or f64)
 * and device; p and v are written, so neither may share storage with
 * another operand.  Where the device has no such kernel (kpl_kernel_
 * registered(KPL_KOP_SGD, ...): the CPU has it) KPL_ENOKERNEL, and the
 * caller composes the ops. */
kpl_status kpl_k_sgd_update(kpl_tensor *p, kpl_tensor *v, const kpl_tensor *g, double lr,
                            double momentum, double wd, bool nesterov, bool first);

/* f16/bf16 <-> f32 conversions of one value (round to nearest even). */
uint16_t kpl_f32_to_f16(float f);
float kpl_f16_to_f32(uint16_t h);
uint16_t kpl_f32_to_bf16(float f);
float kpl_bf16_to_f32(uint16_t h);

/* Puts a formatted head before this thread's message (which keeps its
 * "[file:line]") and returns st: a caller naming itself in a callee's
 * error, "module layer1.0.conv1 (conv2d): ", "task.gan.fid_network: ". */
kpl_status kpl_error_prefix(kpl_status st, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));

/* CRC32C (Castagnoli, RFC 3720) of n bytes, continuing `crc` (0 to start):
 * the checksum of KPLRecord files, checkpoints and TensorBoard records.
 * SSE4.2 when the CPU has it.  Thread-safe. */
uint32_t kpl_crc32c(uint32_t crc, const void *data, size_t n);

/* ------------------------------------------------------------------------ */
/* For kpl's own modules (built with KPL_INTERNAL): the error discipline of  */
/* STYLE.md, shared by every layer.                                          */
/* ------------------------------------------------------------------------ */
#ifdef KPL_INTERNAL

#include <stdio.h> /* kpl__afile */

/* A slot of an open-addressed table of `cap` (a power of two) entries
 * for pointer p (murmur3's finaliser: addresses differ in few bits). */
static inline size_t kpl__hash_ptr(const void *p, size_t cap)
{
    uint64_t x = (uint64_t)(uintptr_t)p;
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdULL;
    x ^= x >> 33;
    return (size_t)x & (cap - 1);
}


/* All n bytes of buf to fd (short writes and EINTR continued): KPL_EIO
 * naming path and errno otherwise.  The one such helper of every module. */
kpl_status kpl__write_all(int fd, const void *buf, size_t n, const char *path);

/* A file written whole or not at all (files.c): its bytes go to
 * "<path>.tmp"; kpl__afile_commit flushes, fsyncs and renames it over
 * path, so a reader sees the old file or the new one, never a part;
 * kpl__afile_abort, or a commit that fails, removes the temporary.  Write
 * through f (stdio) or fd (write, pwrite), not both.  Errors name the
 * path.  Open while f is not NULL; aborting one that is not open (zeroed,
 * failed, committed) does nothing.  The one such helper of every module. */
typedef struct {
    FILE *f;
    int fd;
    char path[4096], tmp[4104];
} kpl__afile;
kpl_status kpl__afile_open(kpl__afile *a, const char *path);
kpl_status kpl__afile_commit(kpl__afile *a);
void kpl__afile_abort(kpl__afile *a);
/* path's contents become data[0, len), by way of a kpl__afile. */
kpl_status kpl__write_file_atomic(const char *path, const void *data, size_t len);
/* mkdir -p: dir and each missing parent (mode 0777 less the umask).
 * KPL_EIO naming the directory that could not be made, or dir when it
 * exists and is not a directory. */
kpl_status kpl__mkdirs(const char *dir);

/* A lock file that names its holder: an flock(2) on `path` (created if
 * needed) held as long as *fd stays open, the file holding "pid P on host
 * H since TIME".  Taken: KPL_OK, *fd >= 0, and `prev` (may be NULL) the
 * description a holder that died left (empty when the last one released
 * it).  Held by a live process: KPL_OK, *fd == -1, `holder` its
 * description ("another process" while it has not written one yet).
 * KPL_EIO for a file that cannot be opened.  A dead holder's lock is free:
 * the kernel drops it with the process.  One home for every module. */
kpl_status kpl__lockfile_try(const char *path, int *fd, char *holder, size_t holder_len,
                             char *prev, size_t prev_len);
/* Releases a lock of kpl__lockfile_try: clears its description (so the
 * next holder sees a clean release) and closes fd (< 0: nothing). */
void kpl__lockfile_release(int fd);

/* Row i of a row-major (rows, cols) f32 or f64 array `h` (host memory)
 * into out[0..cols) as doubles: what the value checks of boxes and rois
 * read. */
static inline void kpl__host_row(const void *h, kpl_dtype dt, int64_t i, int cols, double *out)
{
    for (int k = 0; k < cols; k++)
        out[k] = dt == KPL_F64 ? ((const double *)h)[i * cols + k]
                               : (double)((const float *)h)[i * cols + k];
}

/* Enum names: each module keeps one NULL-terminated table per enum (the
 * recipe binds to the same table).  index: the position of name, -1 when
 * absent (or NULL); at: names[i], "?" when i is out of range. */
int kpl__name_index(const char *const *names, const char *name);
const char *kpl__name_at(const char *const *names, int i);

/* Invariants (bugs, not inputs): on in release builds. */
void kpl__assert_fail(const char *cond, const char *file, int line,
                      const char *msg) __attribute__((noreturn));
#define KPL_ASSERT(cond, msg) \
    ((cond) ? (void)0 : kpl__assert_fail(#cond, __FILE__, __LINE__, (msg)))

#endif /* KPL_INTERNAL */

#ifdef __cplusplus
}
#endif
#endif /* KPL_KERNELS_H */
