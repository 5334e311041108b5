/*
 * cuda_conv.cu — 2-D convolution on CUDA through cuDNN (its v9 library,
 * "legacy" descriptor API, which cuDNN 9 still ships and supports): the
 * forward, the data gradient and the weight gradient, in f64, f32, f16 and
 * bf16, with the algorithm of each problem chosen once and cached.
 *
 * Precision.  f64 runs cuDNN's FMA math.  f32 runs FMA math too (full f32
 * products, comparable with the CPU), unless kpl_set_tf32(true) lets it use
 * TF32 tensor cores: that is CUDNN_DEFAULT_MATH, which on Ampere and later
 * GPUs allows TF32 by itself, hence FMA math whenever TF32 is off.  f16 and
 * bf16 tensors run with tensor-op math and f32 accumulation (the
 * convolution descriptor's compute type is float: cuDNN's PSEUDO_HALF and
 * PSEUDO_BFLOAT16 configurations), each output rounded once.  cuDNN runs
 * bf16 convolutions from compute capability 8.0 on; on older GPUs, and for
 * any half problem cuDNN offers no algorithm for, a half convolution runs
 * in f32 through temporaries and is rounded once.  The
 * bias of a half convolution is added (in f32), and its gradient summed (in
 * double), by kernels of our own.  Tensors are NCHW: kpl's tensors are
 * always row-major (kernels.h), so there is no channels-last layout to hand
 * to cuDNN.
 *
 * Algorithm choice (MegEngine's Fastrun, PyTorch's cudnn.benchmark), once
 * per problem: kind, shapes, params, dtype, device, the deterministic and
 * TF32 settings, and the alignment of the three operand pointers (cuDNN's
 * vectorised kernels depend on it: a problem met again at another
 * alignment is another problem, as in PyTorch's cache).
 *   - By default cudnnFind*AlgorithmEx times the algorithms on the call's
 *     own buffers within a workspace budget (half the free memory, at most
 *     1 GiB) and the cache keeps every one that ran, fastest first.
 *   - In deterministic mode (kpl_set_deterministic) nothing is timed:
 *     cudnnGet*Algorithm_v7's heuristic ranking, which depends only on the
 *     problem, the GPU and the cuDNN version, filtered to the algorithms
 *     cuDNN reports as CUDNN_DETERMINISTIC.  So a resumed process picks the
 *     same algorithm as the first one and computes the same bits.
 * A call takes the first algorithm of the ranking whose workspace it can
 * allocate now.  When memory is tighter than at the search, it falls back
 * down the ranking to algorithms whose workspace fits, to one without
 * workspace when cuDNN has one (as PyTorch does), and remembers the
 * fallback for the problem: every failed allocation empties the caching
 * allocator, so retrying it on every step would cost more than the slower
 * algorithm.  (In deterministic mode such a fallback changes the algorithm
 * and with it the last bits; it only happens when memory runs out.)
 *
 * Workspaces come from the device's caching allocator and go back to it
 * after the call: the compute stream orders any later use of their bytes
 * after the cuDNN calls, so a steady step allocates nothing from the
 * driver.
 *
 * Written without a GPU to run it on (CI has none): tests/kernels/
 * test_cuda.c compares every path here with the CPU's when a GPU is
 * present.
 */
#include "../eltwise_math.h"
#include "../convert_math.h"
#include "cuda_impl.h"

#include <pthread.h>
#include <string.h>

/* ---- cuDNN handles ------------------------------------------------------------------ */

/* Guards the lazy creation of the per-device handles. */
static pthread_mutex_t dnn_lock = PTHREAD_MUTEX_INITIALIZER;

extern "C" kpl_status kpl__cuda_dnn(kpl_cuda_state *cs, cudnnHandle_t *out)
{
    kpl_status st = KPL_OK;
    pthread_mutex_lock(&dnn_lock);
    if (!cs->dnn) {
        /* Loading cuDNN costs hundreds of milliseconds and most programs
         * never call it: the handle is made at first use. */
        cudnnHandle_t h = NULL;
        cudnnStatus_t e = cudnnCreate(&h);
        if (e == CUDNN_STATUS_SUCCESS) e = cudnnSetStream(h, cs->compute);
        if (e != CUDNN_STATUS_SUCCESS) {
            if (h) cudnnDestroy(h);
            st = KPL_ERROR(e == CUDNN_STATUS_ALLOC_FAILED ? KPL_ENOMEM : KPL_EBACKEND,
                           "creating the cuDNN handle failed: %s", cudnnGetErrorString(e));
        } else {
            cs->dnn = h;
        }
    }
    if (st == KPL_OK) *out = cs->dnn;
    pthread_mutex_unlock(&dnn_lock);
    return st;
}

/* ---- descriptors -------------------------------------------------------------------- */

static cudnnDataType_t tensor_type(kpl_dtype dt)
{
    switch (dt) {
    case KPL_F64: return CUDNN_DATA_DOUBLE;
    case KPL_F16: return CUDNN_DATA_HALF;
    case KPL_BF16: return CUDNN_DATA_BFLOAT16;
    default: return CUDNN_DATA_FLOAT;
    }
}

/* The math cuDNN may use for a dtype: see the head of the file. */
static cudnnMathType_t allowed_math(kpl_dtype dt, bool tf32)
{
    if (dt == KPL_F16 || dt == KPL_BF16) return CUDNN_TENSOR_OP_MATH;
    if (dt == KPL_F32 && tf32) return CUDNN_DEFAULT_MATH;
    return CUDNN_FMA_MATH;
}

/* The math an algorithm found for `allowed` runs with: its own (cuDNN
 * reports the math each result was measured with), except that FMA stays
 * FMA, whatever a result says, so f32 never slips into TF32. */
static cudnnMathType_t run_math(cudnnMathType_t allowed, cudnnMathType_t found)
{
    return allowed == CUDNN_FMA_MATH ? CUDNN_FMA_MATH : found;
}

/* The descriptors of one convolution call. */
typedef struct {
    cudnnTensorDescriptor_t x, y, b;
    cudnnFilterDescriptor_t w;
    cudnnConvolutionDescriptor_t conv;
} conv_descs;

static void conv_descs_destroy(conv_descs *d)
{
    if (d->x) cudnnDestroyTensorDescriptor(d->x);
    if (d->y) cudnnDestroyTensorDescriptor(d->y);
    if (d->b) cudnnDestroyTensorDescriptor(d->b);
    if (d->w) cudnnDestroyFilterDescriptor(d->w);
    if (d->conv) cudnnDestroyConvolutionDescriptor(d->conv);
    memset(d, 0, sizeof *d);
}

static kpl_status conv_descs_make(const kpl_conv_attrs *a, kpl_dtype dt, cudnnMathType_t math,
                                  conv_descs *d)
{
    kpl_status st = KPL_OK;
    cudnnDataType_t t = tensor_type(dt);
    /* f16/bf16 accumulate in f32 (the PSEUDO_* configurations). */
    cudnnDataType_t compute = dt == KPL_F64 ? CUDNN_DATA_DOUBLE : CUDNN_DATA_FLOAT;
    int g = a->p.groups;
    memset(d, 0, sizeof *d);
    KPL_CUDNN_TRY(cudnnCreateTensorDescriptor(&d->x));
    KPL_CUDNN_TRY(cudnnCreateTensorDescriptor(&d->y));
    KPL_CUDNN_TRY(cudnnCreateTensorDescriptor(&d->b));
    KPL_CUDNN_TRY(cudnnCreateFilterDescriptor(&d->w));
    KPL_CUDNN_TRY(cudnnCreateConvolutionDescriptor(&d->conv));
    KPL_CUDNN_TRY(cudnnSetTensor4dDescriptor(d->x, CUDNN_TENSOR_NCHW, t, (int)a->n, (int)a->c,
                                             (int)a->h, (int)a->w));
    KPL_CUDNN_TRY(cudnnSetTensor4dDescriptor(d->y, CUDNN_TENSOR_NCHW, t, (int)a->n, (int)a->o,
                                             (int)a->oh, (int)a->ow));
    KPL_CUDNN_TRY(cudnnSetTensor4dDescriptor(d->b, CUDNN_TENSOR_NCHW, t, 1, (int)a->o, 1, 1));
    KPL_CUDNN_TRY(cudnnSetFilter4dDescriptor(d->w, t, CUDNN_TENSOR_NCHW, (int)a->o,
                                             (int)(a->c / g), (int)a->kh, (int)a->kw));
    KPL_CUDNN_TRY(cudnnSetConvolution2dDescriptor(d->conv, a->p.padding[0], a->p.padding[1],
                                                  a->p.stride[0], a->p.stride[1],
                                                  a->p.dilation[0], a->p.dilation[1],
                                                  CUDNN_CROSS_CORRELATION, compute));
    KPL_CUDNN_TRY(cudnnSetConvolutionGroupCount(d->conv, g));
    KPL_CUDNN_TRY(cudnnSetConvolutionMathType(d->conv, math));
    return KPL_OK;
fail:
    conv_descs_destroy(d);
    return st;
}

/* ---- the algorithm cache ------------------------------------------------------------- */

/* Compared with memcmp: always built in a zeroed struct (see
 * kpl_conv_attrs_key) and copied with memcpy, never by assignment, so its
 * padding bytes stay zero. */
typedef struct {
    kpl_conv_attrs a;
    int32_t dt, device;
    uint8_t deterministic; /* kpl_get_deterministic() at the search */
    uint8_t tf32;          /* kpl_get_tf32() at the search (f32 only) */
    uint8_t align[3];      /* log2 of the operands' pointer alignment, <= 4 (16 bytes) */
} algo_key;

#define ALGO_MAX 16 /* more than any direction's algorithm count */

typedef struct {
    int algo;         /* cudnnConvolution{Fwd,BwdData,BwdFilter}Algo_t */
    int math;         /* the cudnnMathType_t it runs with */
    size_t workspace; /* bytes */
} algo_choice;

typedef struct {
    algo_key key;
    int n;     /* candidates, best first */
    int first; /* the first candidate not known to miss memory */
    algo_choice c[ALGO_MAX];
} algo_entry;

#define ALGO_CAP 512

static struct {
    pthread_mutex_t lock;
    algo_entry e[ALGO_CAP];
    int n, next; /* next: the slot a full cache overwrites (round robin) */
    uint64_t hits, misses;
} ac = {PTHREAD_MUTEX_INITIALIZER, {}, 0, 0, 0, 0};

static int algo_find(const algo_key *k)
{
    for (int i = 0; i < ac.n; i++)
        if (!memcmp(&ac.e[i].key, k, sizeof *k)) return i;
    return -1;
}

static bool algo_lookup(const algo_key *k, algo_entry *out)
{
    pthread_mutex_lock(&ac.lock);
    int i = algo_find(k);
    if (i >= 0) memcpy(out, &ac.e[i], sizeof *out);
    if (i >= 0) ac.hits++;
    else ac.misses++;
    pthread_mutex_unlock(&ac.lock);
    return i >= 0;
}

static void algo_store(const algo_entry *e)
{
    pthread_mutex_lock(&ac.lock);
    int slot = algo_find(&e->key); /* another thread may have searched too */
    if (slot < 0) slot = ac.n < ALGO_CAP ? ac.n++ : ac.next++ % ALGO_CAP;
    memcpy(&ac.e[slot], e, sizeof *e);
    pthread_mutex_unlock(&ac.lock);
}

/* Later calls of the problem start at candidate `first`. */
static void algo_demote(const algo_key *k, int first)
{
    pthread_mutex_lock(&ac.lock);
    int i = algo_find(k);
    if (i >= 0 && ac.e[i].first < first) ac.e[i].first = first;
    pthread_mutex_unlock(&ac.lock);
}

extern "C" kpl_algo_cache_stats kpl__cuda_conv_cache_stats(void)
{
    pthread_mutex_lock(&ac.lock);
    kpl_algo_cache_stats s = {ac.hits, ac.misses, (uint64_t)ac.n};
    pthread_mutex_unlock(&ac.lock);
    return s;
}

static uint8_t align_log2(const void *p)
{
    uintptr_t u = (uintptr_t)p;
    uint8_t l = 0;
    while (l < 4 && !(u & ((uintptr_t)1 << l))) l++;
    return l;
}

/* Most workspace an algorithm search may try: what the device has free,
 * capped so a search never starves the step that follows. */
static size_t search_budget(void)
{
    size_t free_b = 0, total = 0;
    if (cudaMemGetInfo(&free_b, &total) != cudaSuccess) {
        (void)cudaGetLastError();
        return (size_t)64 << 20;
    }
    size_t cap = (size_t)1 << 30;
    return free_b / 2 < cap ? free_b / 2 : cap;
}

/* Appends the usable results of a search to e, in cuDNN's order (by time
 * for Find, by the heuristic's preference for Get_v7); in deterministic
 * mode only the deterministic ones. */
template <typename Perf>
static void take_results(const Perf *perf, int found, cudnnMathType_t allowed, algo_entry *e)
{
    for (int i = 0; i < found && e->n < ALGO_MAX; i++) {
        if (perf[i].status != CUDNN_STATUS_SUCCESS) continue;
        if (e->key.deterministic && perf[i].determinism != CUDNN_DETERMINISTIC) continue;
        algo_choice *c = &e->c[e->n++];
        c->algo = (int)perf[i].algo;
        c->math = (int)run_math(allowed, perf[i].mathType);
        c->workspace = perf[i].memory;
    }
}

/* The workspace of candidate c, asked of cuDNN with c's math (Get_v7's
 * memory field is not documented as the workspace size). */
static kpl_status ws_size(cudnnHandle_t h, const kpl_conv_attrs *a, const conv_descs *d,
                          algo_choice *c)
{
    kpl_status st = KPL_OK;
    size_t bytes = 0;
    KPL_CUDNN_TRY(cudnnSetConvolutionMathType(d->conv, (cudnnMathType_t)c->math));
    switch (a->kind) {
    case KPL_CONV_FWD:
        KPL_CUDNN_TRY(cudnnGetConvolutionForwardWorkspaceSize(
            h, d->x, d->w, d->conv, d->y, (cudnnConvolutionFwdAlgo_t)c->algo, &bytes));
        break;
    case KPL_CONV_BWD_DATA:
        KPL_CUDNN_TRY(cudnnGetConvolutionBackwardDataWorkspaceSize(
            h, d->w, d->y, d->conv, d->x, (cudnnConvolutionBwdDataAlgo_t)c->algo, &bytes));
        break;
    case KPL_CONV_BWD_WEIGHT:
        KPL_CUDNN_TRY(cudnnGetConvolutionBackwardFilterWorkspaceSize(
            h, d->x, d->y, d->conv, d->w, (cudnnConvolutionBwdFilterAlgo_t)c->algo, &bytes));
        break;
    }
    c->workspace = bytes;
fail:
    return st;
}

/* Deterministic mode: cuDNN's untimed heuristic ranking of the
 * deterministic algorithms, with each one's workspace. */
static kpl_status rank_heuristic(cudnnHandle_t h, const kpl_conv_attrs *a, const conv_descs *d,
                                 cudnnMathType_t allowed, algo_entry *e)
{
    kpl_status st = KPL_OK;
    int found = 0;
    switch (a->kind) {
    case KPL_CONV_FWD: {
        cudnnConvolutionFwdAlgoPerf_t perf[ALGO_MAX];
        KPL_CUDNN_TRY(cudnnGetConvolutionForwardAlgorithm_v7(h, d->x, d->w, d->conv, d->y,
                                                             ALGO_MAX, &found, perf));
        take_results(perf, found, allowed, e);
        break;
    }
    case KPL_CONV_BWD_DATA: {
        cudnnConvolutionBwdDataAlgoPerf_t perf[ALGO_MAX];
        KPL_CUDNN_TRY(cudnnGetConvolutionBackwardDataAlgorithm_v7(h, d->w, d->y, d->conv, d->x,
                                                                  ALGO_MAX, &found, perf));
        take_results(perf, found, allowed, e);
        break;
    }
    case KPL_CONV_BWD_WEIGHT: {
        cudnnConvolutionBwdFilterAlgoPerf_t perf[ALGO_MAX];
        KPL_CUDNN_TRY(cudnnGetConvolutionBackwardFilterAlgorithm_v7(h, d->x, d->y, d->conv,
                                                                    d->w, ALGO_MAX, &found,
                                                                    perf));
        take_results(perf, found, allowed, e);
        break;
    }
    }
    /* Keep the candidates whose workspace cuDNN can state. */
    {
        int k = 0;
        for (int i = 0; i < e->n; i++) {
            algo_choice c = e->c[i];
            if (ws_size(h, a, d, &c) < 0) {
                kpl_clear_error();
                continue;
            }
            e->c[k++] = c;
        }
        e->n = k;
    }
fail:
    return st;
}

/* Default mode: cuDNN's timed search on the call's own buffers (the
 * output is overwritten by the real run afterwards). */
static kpl_status rank_timed(cudnnHandle_t h, kpl_device *dev, const kpl_conv_attrs *a,
                             const conv_descs *d, cudnnMathType_t allowed, const void *in0,
                             const void *in1, void *out, algo_entry *e)
{
    kpl_status st = KPL_OK;
    size_t budget = search_budget();
    void *ws = NULL;
    while (budget >= ((size_t)1 << 20) &&
           kpl_device_alloc(dev, budget, "conv2d search", &ws) < 0) {
        kpl_clear_error();
        budget /= 2;
    }
    if (!ws) budget = 0;
    int found = 0;
    switch (a->kind) {
    case KPL_CONV_FWD: {
        cudnnConvolutionFwdAlgoPerf_t perf[ALGO_MAX];
        KPL_CUDNN_TRY(cudnnFindConvolutionForwardAlgorithmEx(h, d->x, in0, d->w, in1, d->conv,
                                                             d->y, out, ALGO_MAX, &found, perf,
                                                             ws, budget));
        take_results(perf, found, allowed, e);
        break;
    }
    case KPL_CONV_BWD_DATA: {
        cudnnConvolutionBwdDataAlgoPerf_t perf[ALGO_MAX];
        KPL_CUDNN_TRY(cudnnFindConvolutionBackwardDataAlgorithmEx(h, d->w, in1, d->y, in0,
                                                                  d->conv, d->x, out, ALGO_MAX,
                                                                  &found, perf, ws, budget));
        take_results(perf, found, allowed, e);
        break;
    }
    case KPL_CONV_BWD_WEIGHT: {
        cudnnConvolutionBwdFilterAlgoPerf_t perf[ALGO_MAX];
        KPL_CUDNN_TRY(cudnnFindConvolutionBackwardFilterAlgorithmEx(
            h, d->x, in0, d->y, in1, d->conv, d->w, out, ALGO_MAX, &found, perf, ws, budget));
        take_results(perf, found, allowed, e);
        break;
    }
    }
fail:
    /* The compute stream orders the search's kernels before any reuse. */
    if (ws) kpl_device_free(dev, ws);
    return st;
}

/* ---- running one algorithm ------------------------------------------------------------ */

static kpl_status conv_exec(cudnnHandle_t h, const kpl_conv_attrs *a, kpl_dtype dt,
                            const conv_descs *d, const algo_choice *c, void *ws,
                            const void *in0, const void *in1, void *out)
{
    kpl_status st = KPL_OK;
    /* alpha/beta are double for double data, float otherwise (halves too) */
    double one_d = 1.0, zero_d = 0.0;
    float one_f = 1.0f, zero_f = 0.0f;
    const void *one = dt == KPL_F64 ? (const void *)&one_d : (const void *)&one_f;
    const void *zero = dt == KPL_F64 ? (const void *)&zero_d : (const void *)&zero_f;
    KPL_CUDNN_TRY(cudnnSetConvolutionMathType(d->conv, (cudnnMathType_t)c->math));
    switch (a->kind) {
    case KPL_CONV_FWD:
        KPL_CUDNN_TRY(cudnnConvolutionForward(h, one, d->x, in0, d->w, in1, d->conv,
                                              (cudnnConvolutionFwdAlgo_t)c->algo, ws,
                                              c->workspace, zero, d->y, out));
        break;
    case KPL_CONV_BWD_DATA:
        KPL_CUDNN_TRY(cudnnConvolutionBackwardData(h, one, d->w, in1, d->y, in0, d->conv,
                                                   (cudnnConvolutionBwdDataAlgo_t)c->algo, ws,
                                                   c->workspace, zero, d->x, out));
        break;
    case KPL_CONV_BWD_WEIGHT:
        KPL_CUDNN_TRY(cudnnConvolutionBackwardFilter(h, one, d->x, in0, d->y, in1, d->conv,
                                                     (cudnnConvolutionBwdFilterAlgo_t)c->algo,
                                                     ws, c->workspace, zero, d->w, out));
        break;
    }
fail:
    return st;
}

/* Runs the first candidate from e->first on whose workspace can be had
 * now, falling back down the ranking when an allocation fails for memory;
 * a fallback is remembered for the problem. */
static kpl_status conv_run(cudnnHandle_t h, kpl_device *dev, const kpl_conv_attrs *a,
                           kpl_dtype dt, const conv_descs *d, const algo_entry *e,
                           const void *in0, const void *in1, void *out)
{
    size_t failed = SIZE_MAX; /* the smallest workspace that could not be had */
    for (int i = e->first; i < e->n; i++) {
        const algo_choice *c = &e->c[i];
        void *ws = NULL;
        if (c->workspace) {
            if (c->workspace >= failed) continue;
            kpl_status st = kpl_device_alloc(dev, c->workspace, "conv2d workspace", &ws);
            if (st == KPL_ENOMEM) {
                kpl_clear_error();
                failed = c->workspace;
                continue;
            }
            KPL_TRY(st);
        }
        if (i != e->first) algo_demote(&e->key, i);
        kpl_status st = conv_exec(h, a, dt, d, c, ws, in0, in1, out);
        if (ws) kpl_device_free(dev, ws);
        return st;
    }
    return KPL_ERROR(KPL_ENOMEM,
                     "conv2d: no cuDNN algorithm for %lldx%lldx%lldx%lld with %lld filters "
                     "%lldx%lld fits in the memory left on %s (%d candidates, the smallest "
                     "workspace that failed %zu bytes)",
                     (long long)a->n, (long long)a->c, (long long)a->h, (long long)a->w,
                     (long long)a->o, (long long)a->kh, (long long)a->kw, dev->name,
                     e->n - e->first, failed == SIZE_MAX ? (size_t)0 : failed);
}

/* ---- the bias of half convolutions -------------------------------------------------- */

__device__ __forceinline__ float half_ld(uint16_t h, bool bf)
{
    return bf ? kpl_cvt_bf16_to_f32(h) : kpl_cvt_f16_to_f32(h);
}

__device__ __forceinline__ uint16_t half_st(float f, bool bf)
{
    return bf ? kpl_cvt_f32_to_bf16(f) : kpl_cvt_f32_to_f16(f);
}

/* y (n, o, hw) += b (o), in f32 with one rounding. */
__global__ void half_bias_add_kernel(uint16_t *y, const uint16_t *b, int64_t total, int64_t o,
                                     int64_t hw, bool bf)
{
    KPL_CUDA_FOR(i, total) y[i] = half_st(half_ld(y[i], bf) + half_ld(b[(i / hw) % o], bf), bf);
}

#define BIAS_THREADS 256

/* gb[c] = the sum of gy (n, o, hw) over n and hw: one block per channel,
 * summed in double in a fixed order (a deterministic result). */
__global__ void half_bias_grad_kernel(const uint16_t *gy, uint16_t *gb, int64_t n, int64_t o,
                                      int64_t hw, bool bf)
{
    __shared__ double sh[BIAS_THREADS];
    for (int64_t c = blockIdx.x; c < o; c += gridDim.x) {
        double s = 0;
        for (int64_t e = threadIdx.x; e < n * hw; e += BIAS_THREADS) {
            int64_t b = e / hw, i = e - b * hw;
            s += (double)half_ld(gy[(b * o + c) * hw + i], bf);
        }
        sh[threadIdx.x] = s;
        __syncthreads();
        for (int k = BIAS_THREADS / 2; k > 0; k >>= 1) {
            if ((int)threadIdx.x < k) sh[threadIdx.x] += sh[threadIdx.x + k];
            __syncthreads();
        }
        if (threadIdx.x == 0) gb[c] = half_st((float)sh[0], bf);
        __syncthreads(); /* before sh is reused */
    }
}

/* The bias step after the convolution: y += b (forward) or gb = sum(gy)
 * (weight gradient); extra is b or gb. */
static kpl_status conv_bias(kpl_cuda_state *cs, cudnnHandle_t h, const kpl_conv_attrs *a,
                            kpl_dtype dt, const conv_descs *d, void *extra, const void *gy,
                            void *y)
{
    kpl_status st = KPL_OK;
    bool bf = dt == KPL_BF16, half = dt == KPL_F16 || bf;
    int64_t hw = a->oh * a->ow;
    if (half && a->kind == KPL_CONV_FWD) {
        int64_t total = a->n * a->o * hw;
        half_bias_add_kernel<<<kpl__cuda_blocks(cs, total, KPL_CUDA_THREADS), KPL_CUDA_THREADS,
                               0, cs->compute>>>((uint16_t *)y, (const uint16_t *)extra, total,
                                                 a->o, hw, bf);
        return KPL_CUDA_LAUNCHED("conv2d bias");
    }
    if (half) {
        int64_t cap = (int64_t)(cs->sm_count > 0 ? cs->sm_count : 1) * 8;
        unsigned blocks = (unsigned)(a->o < cap ? a->o : cap);
        half_bias_grad_kernel<<<blocks, BIAS_THREADS, 0, cs->compute>>>(
            (const uint16_t *)gy, (uint16_t *)extra, a->n, a->o, hw, bf);
        return KPL_CUDA_LAUNCHED("conv2d bias gradient");
    }
    double one_d = 1.0, zero_d = 0.0;
    float one_f = 1.0f, zero_f = 0.0f;
    const void *one = dt == KPL_F64 ? (const void *)&one_d : (const void *)&one_f;
    const void *zero = dt == KPL_F64 ? (const void *)&zero_d : (const void *)&zero_f;
    if (a->kind == KPL_CONV_FWD)
        KPL_CUDNN_TRY(cudnnAddTensor(h, one, d->b, extra, one, d->y, y));
    else
        KPL_CUDNN_TRY(cudnnConvolutionBackwardBias(h, one, d->y, gy, zero, d->b, extra));
fail:
    return st;
}

/* ---- bf16 before compute capability 8.0: through f32 -------------------------------------- */

/* An f32 tensor of t's shape on t's device, holding t's values when
 * `copy` (NULL for NULL; caller releases). */
static kpl_status f32_twin(const kpl_tensor *t, bool copy, kpl_tensor **out)
{
    *out = NULL;
    if (!t) return KPL_OK;
    KPL_TRY(kpl_tensor_empty(kpl_tensor_device(t), KPL_F32, kpl_tensor_ndim(t),
                             kpl_tensor_shape(t), out));
    kpl_status st = copy ? kpl_k_cast(*out, t) : KPL_OK;
    if (st < 0) {
        kpl_tensor_release(*out);
        *out = NULL;
    }
    return st;
}

static kpl_status conv_via_f32(const kpl_kernel_args *args)
{
    const kpl_conv_attrs *a = (const kpl_conv_attrs *)args->attrs;
    kpl_tensor *t[4] = {NULL, NULL, NULL, NULL}; /* out, in0, in1, in2 in f32 */
    kpl_status st;
    KPL_TRY_GOTO(f32_twin(args->out, false, &t[0]));
    for (int k = 0; k < 3; k++) /* a weight gradient's in[2] is its bias gradient, written */
        KPL_TRY_GOTO(f32_twin(args->in[k], k < 2 || a->kind == KPL_CONV_FWD, &t[k + 1]));
    switch (a->kind) {
    case KPL_CONV_FWD: KPL_TRY_GOTO(kpl_k_conv2d(t[0], t[1], t[2], t[3], &a->p)); break;
    case KPL_CONV_BWD_DATA: KPL_TRY_GOTO(kpl_k_conv2d_bwd_data(t[0], t[1], t[2], &a->p)); break;
    case KPL_CONV_BWD_WEIGHT:
        KPL_TRY_GOTO(kpl_k_conv2d_bwd_weight(t[0], t[3], t[1], t[2], &a->p));
        if (args->in[2]) KPL_TRY_GOTO(kpl_k_cast((kpl_tensor *)args->in[2], t[3]));
        break;
    }
    st = kpl_k_cast(args->out, t[0]);
fail:
    for (int k = 0; k < 4; k++) kpl_tensor_release(t[k]);
    return st;
}

/* ---- the kernel ---------------------------------------------------------------------- */

static kpl_status cuda_conv(const kpl_kernel_args *args)
{
    const kpl_conv_attrs *a = (const kpl_conv_attrs *)args->attrs;
    kpl_status st = KPL_OK;
    KPL_CHECK(a->n <= INT32_MAX && a->c <= INT32_MAX && a->h <= INT32_MAX && a->w <= INT32_MAX &&
                  a->o <= INT32_MAX && a->oh <= INT32_MAX && a->ow <= INT32_MAX,
              KPL_ESHAPE, "conv2d: dims exceed cuDNN's 32-bit sizes");
    kpl_dtype dt = kpl_tensor_dtype(args->out);
    kpl_cuda_state *cs;
    KPL_TRY(kpl__cuda_enter_tensor(args->out, &cs));
    if (dt == KPL_BF16 && cs->cc_major < 8) return conv_via_f32(args);
    void *out;
    const void *in[2];
    KPL_TRY(kpl__cuda_pointers(args, 2, &cs, &out, in));
    kpl_device *dev = kpl_tensor_device(args->out);
    cudnnHandle_t h;
    KPL_TRY(kpl__cuda_dnn(cs, &h));
    void *extra = NULL; /* bias (fwd) or its gradient (bwd_weight) */
    if (args->in[2]) {
        extra = a->kind == KPL_CONV_FWD ? (void *)kpl_tensor_data((kpl_tensor *)args->in[2])
                                        : kpl_tensor_mutable((kpl_tensor *)args->in[2]);
        if (!extra) return kpl_last_status();
    }
    bool tf32 = dt == KPL_F32 && kpl_get_tf32();
    cudnnMathType_t allowed = allowed_math(dt, tf32);
    conv_descs d;
    KPL_TRY(conv_descs_make(a, dt, allowed, &d));
    algo_entry e;
    memset(&e, 0, sizeof e);
    kpl_conv_attrs_key(&e.key.a, a);
    e.key.dt = (int32_t)dt;
    e.key.device = kpl_device_index(dev);
    e.key.deterministic = kpl_get_deterministic();
    e.key.tf32 = tf32;
    e.key.align[0] = align_log2(in[0]);
    e.key.align[1] = align_log2(in[1]);
    e.key.align[2] = align_log2(out);
    algo_key key;
    memcpy(&key, &e.key, sizeof key);
    if (!algo_lookup(&key, &e)) {
        st = key.deterministic ? rank_heuristic(h, a, &d, allowed, &e)
                               : rank_timed(h, dev, a, &d, allowed, in[0], in[1], out, &e);
        if (st < 0) goto fail;
        algo_store(&e); /* an empty ranking too: the answer is remembered */
    }
    if (e.n == 0) {
        /* A half problem cuDNN has no kernel for (a layout or shape its
         * f16/bf16 configurations leave out) still runs, through f32. */
        if (dt == KPL_F16 || dt == KPL_BF16) {
            conv_descs_destroy(&d);
            return conv_via_f32(args);
        }
        st = KPL_ERROR(KPL_EBACKEND,
                       "conv2d: cuDNN offers no %salgorithm for %s %lldx%lldx%lldx%lld with "
                       "%lld filters %lldx%lld",
                       key.deterministic ? "deterministic " : "", kpl_dtype_name(dt),
                       (long long)a->n, (long long)a->c, (long long)a->h, (long long)a->w,
                       (long long)a->o, (long long)a->kh, (long long)a->kw);
        goto fail;
    }
    if ((st = conv_run(h, dev, a, dt, &d, &e, in[0], in[1], out)) < 0) goto fail;
    if (extra) st = conv_bias(cs, h, a, dt, &d, extra, in[1], out);
fail:
    conv_descs_destroy(&d);
    return st;
}

extern "C" void kpl__cuda_register_conv(void)
{
    static const kpl_dtype dts[] = {KPL_F32, KPL_F64, KPL_F16, KPL_BF16};
    for (size_t i = 0; i < sizeof dts / sizeof dts[0]; i++)
        kpl_kernel_register(KPL_KOP_CONV2D, KPL_DEVICE_CUDA, dts[i], cuda_conv);
}
