/*
 * cuda_index.cu — the index kernels on CUDA: plane_gather / plane_scatter
 * (max pooling's gather and its adjoint), index_select / index_add, and
 * gather / scatter_add.
 *
 * Index checks never wait for the GPU: a kernel that meets an index out of
 * range writes it into the device's record of deferred checks
 * (cuda_impl.h), and the next device-to-host copy or kpl_device_synchronize
 * reports it (kernels.h, at kpl_k_plane_gather).
 *
 * Sums.  The adjoints add several contributions into one element when
 * indices repeat (overlapping pooling windows, repeated rows or labels):
 *   - index_add always, and plane_scatter and scatter_add under
 *     kpl_get_deterministic(), compute each output element in one thread
 *     that adds its contributions in the order of their positions in idx,
 *     starting from zero (plane_scatter, index_add) or from x
 *     (scatter_add): the order of the CPU's loops, hence the CPU's bits,
 *     run after run.  The contributions are grouped by target first (a
 *     counting sort: counts, a prefix sum, a fill, each group then sorted
 *     by position), which costs a few passes and memory of the order of
 *     the targets and the indices;
 *   - otherwise plane_scatter and scatter_add add with atomicAdd into the
 *     zeroed (or x-holding) output, one pass, the order of the additions
 *     left to the hardware, so f32 results may differ in their last bits
 *     from run to run.  That is the fast path of a training step: the
 *     grouping costs about four extra passes over memory the size of the
 *     gradient.  index_add's grouping is over its (few) index values only,
 *     so it is cheap enough to be the one path.
 * ROI Align's backward (cuda_vision.cu) still adds with atomics in every
 * mode.
 *
 * Written without a GPU to run it on (CI has none): tests/kernels/
 * test_cuda.c compares every path here with the CPU's when a GPU is
 * present.
 */
#include "cuda_impl.h"

#include <cub/device/device_scan.cuh>

#include <string.h>

/* ---- deferred checks ---------------------------------------------------------------- */

/* The record and ticket of one checking call. */
struct check_ref {
    kpl_cuda_check_rec *rec;
    unsigned long long ticket;
    __device__ __forceinline__ void fail(int64_t p) const
    {
        kpl_cuda_check_fail(rec, ticket, (unsigned long long)p);
    }
};

/* Starts the check of one call whose indices are `idx_t`. */
static kpl_status check_start(kpl_cuda_state *cs, const char *op, int64_t range,
                              const kpl_tensor *idx_t, const char *where, check_ref *out)
{
    kpl_cuda_check_desc d;
    memset(&d, 0, sizeof d);
    d.op = op;
    d.range = range;
    d.ndim = kpl_tensor_ndim(idx_t);
    memcpy(d.shape, kpl_tensor_shape(idx_t), (size_t)d.ndim * sizeof(int64_t));
    snprintf(d.where, sizeof d.where, "%s", where);
    return kpl__cuda_check_begin(cs, &d, &out->rec, &out->ticket);
}

/* ---- grouping contributions by target (the deterministic sums) --------------------------- */

/* Counts and positions as I: int32_t when they fit, else int64_t. */
template <typename I> __device__ __forceinline__ I atom_inc(I *p);
template <> __device__ __forceinline__ int32_t atom_inc<int32_t>(int32_t *p)
{
    return atomicAdd((int *)p, 1);
}
template <> __device__ __forceinline__ int64_t atom_inc<int64_t>(int64_t *p)
{
    return (int64_t)atomicAdd((unsigned long long *)p, 1ull);
}

/* pass 0 counts the items per key (and checks them), pass 1 files them:
 * `off` holds each key's start after the scan, its end after the fill. */
template <typename I, typename Key>
__global__ void group_kernel(Key key, int64_t nitems, I *off, I *items, int pass)
{
    KPL_CUDA_FOR(i, nitems)
    {
        int64_t k = key(i, pass == 0);
        if (k < 0) continue;
        if (pass == 0) atom_inc<I>(off + k);
        else items[atom_inc<I>(off + k)] = (I)i;
    }
}

/* Sorts items[b, e) ascending: insertion sort for the usual short runs,
 * heapsort (no recursion, no extra memory) for long ones. */
template <typename I>
__device__ void sort_run(I *v, int64_t b, int64_t e)
{
    int64_t n = e - b;
    v += b;
    if (n <= 32) {
        for (int64_t i = 1; i < n; i++) {
            I x = v[i];
            int64_t j = i;
            for (; j > 0 && v[j - 1] > x; j--) v[j] = v[j - 1];
            v[j] = x;
        }
        return;
    }
    for (int64_t s = n / 2 - 1;; s--) { /* heapify, then pop */
        for (int64_t r = s;;) {
            int64_t c = 2 * r + 1;
            if (c >= n) break;
            if (c + 1 < n && v[c + 1] > v[c]) c++;
            if (v[r] >= v[c]) break;
            I t = v[r];
            v[r] = v[c];
            v[c] = t;
            r = c;
        }
        if (s == 0) break;
    }
    for (int64_t m = n - 1; m > 0; m--) {
        I t = v[0];
        v[0] = v[m];
        v[m] = t;
        for (int64_t r = 0;;) {
            int64_t c = 2 * r + 1;
            if (c >= m) break;
            if (c + 1 < m && v[c + 1] > v[c]) c++;
            if (v[r] >= v[c]) break;
            I u = v[r];
            v[r] = v[c];
            v[c] = u;
            r = c;
        }
    }
}

/* Key k's run of items: [b, e). */
template <typename I>
__device__ __forceinline__ void run_of(const I *off, int64_t k, int64_t *b, int64_t *e)
{
    *b = k == 0 ? 0 : (int64_t)off[k - 1];
    *e = (int64_t)off[k];
}

template <typename I>
__global__ void sort_runs_kernel(const I *off, I *items, int64_t nkeys)
{
    KPL_CUDA_FOR(k, nkeys)
    {
        int64_t b, e;
        run_of(off, k, &b, &e);
        sort_run(items, b, e);
    }
}

/* The groups of one call: device blocks from the caching allocator, given
 * back in stream order by group_free. */
template <typename I>
struct groups {
    I *off = nullptr;   /* (nkeys): each key's end */
    I *items = nullptr; /* (nitems): item numbers, grouped by key */
};

template <typename I>
static void group_free(kpl_device *dev, groups<I> *g)
{
    kpl_device_free(dev, g->off);
    kpl_device_free(dev, g->items);
}

/* Groups items 0..nitems-1 by key(i) in [0, nkeys) (negative: skipped),
 * each group sorted when `sorted` (else the consumer sorts it). */
template <typename I, typename Key>
static kpl_status group_by(kpl_cuda_state *cs, kpl_device *dev, const Key &key, int64_t nitems,
                           int64_t nkeys, bool sorted, groups<I> *g)
{
    const int th = KPL_CUDA_THREADS;
    void *temp = NULL;
    size_t temp_bytes = 0;
    kpl_status st;
    KPL_TRY_GOTO(kpl_device_alloc(dev, (size_t)nkeys * sizeof(I), "index grouping", (void **)&g->off));
    KPL_TRY_GOTO(kpl_device_alloc(dev, (size_t)(nitems > 0 ? nitems : 1) * sizeof(I),
                                  "index grouping", (void **)&g->items));
    if (cudaMemsetAsync(g->off, 0, (size_t)nkeys * sizeof(I), cs->compute) != cudaSuccess) {
        st = kpl__cuda_fail(cudaGetLastError(), "cudaMemsetAsync", __FILE__, __LINE__);
        goto fail;
    }
    group_kernel<I, Key><<<kpl__cuda_blocks(cs, nitems, th), th, 0, cs->compute>>>(
        key, nitems, g->off, g->items, 0);
    KPL_TRY_GOTO(KPL_CUDA_LAUNCHED("index grouping (count)"));
    {
        cudaError_t e = cub::DeviceScan::ExclusiveSum(NULL, temp_bytes, g->off, nkeys, cs->compute);
        if (e == cudaSuccess) {
            KPL_TRY_GOTO(kpl_device_alloc(dev, temp_bytes ? temp_bytes : 1, "index grouping",
                                          &temp));
            e = cub::DeviceScan::ExclusiveSum(temp, temp_bytes, g->off, nkeys, cs->compute);
        }
        if (e != cudaSuccess) {
            st = kpl__cuda_fail(e, "cub::DeviceScan::ExclusiveSum", __FILE__, __LINE__);
            goto fail;
        }
    }
    group_kernel<I, Key><<<kpl__cuda_blocks(cs, nitems, th), th, 0, cs->compute>>>(
        key, nitems, g->off, g->items, 1);
    KPL_TRY_GOTO(KPL_CUDA_LAUNCHED("index grouping (fill)"));
    if (sorted) {
        sort_runs_kernel<I><<<kpl__cuda_blocks(cs, nkeys, th), th, 0, cs->compute>>>(
            g->off, g->items, nkeys);
        KPL_TRY_GOTO(KPL_CUDA_LAUNCHED("index grouping (sort)"));
    }
    kpl_device_free(dev, temp);
    return KPL_OK;
fail:
    kpl_device_free(dev, temp);
    group_free(dev, g);
    return st;
}

/* ---- plane_gather / plane_scatter ----------------------------------------------------- */

template <typename T>
__global__ void plane_gather_kernel(kpl_pool_attrs a, const T *x, const int64_t *idx, T *y,
                                    check_ref chk)
{
    int64_t hw = a.h * a.w, ohw = a.oh * a.ow;
    KPL_CUDA_FOR(o, a.n * a.c * ohw)
    {
        int64_t k = idx[o];
        if (k < 0 || k >= hw) {
            chk.fail(o);
            y[o] = 0;
        } else {
            y[o] = x[(o / ohw) * hw + k];
        }
    }
}

/* The fast adjoint: gx is zeroed first; windows may overlap, hence the
 * atomics. */
template <typename T>
__global__ void plane_scatter_kernel(kpl_pool_attrs a, const T *gy, const int64_t *idx, T *gx,
                                     check_ref chk)
{
    int64_t hw = a.h * a.w, ohw = a.oh * a.ow;
    KPL_CUDA_FOR(o, a.n * a.c * ohw)
    {
        int64_t k = idx[o];
        if (k < 0 || k >= hw) chk.fail(o);
        else atomicAdd(&gx[(o / ohw) * hw + k], gy[o]);
    }
}

/* Output position o's target cell (plane * hw + index), -1 if bad. */
struct plane_key {
    const int64_t *idx;
    int64_t ohw, hw;
    check_ref chk;
    __device__ __forceinline__ int64_t operator()(int64_t o, bool check) const
    {
        int64_t k = idx[o];
        if (k < 0 || k >= hw) {
            if (check) chk.fail(o);
            return -1;
        }
        return (o / ohw) * hw + k;
    }
};

/* The deterministic adjoint: each cell sums its outputs in their order. */
template <typename T, typename I>
__global__ void plane_sum_kernel(const T *gy, const I *off, I *items, T *gx, int64_t ncells)
{
    KPL_CUDA_FOR(k, ncells)
    {
        int64_t b, e;
        run_of(off, k, &b, &e);
        sort_run(items, b, e);
        T s = 0;
        for (int64_t j = b; j < e; j++) s += gy[items[j]];
        gx[k] = s;
    }
}

template <typename T, typename I>
static kpl_status plane_scatter_grouped(kpl_cuda_state *cs, kpl_device *dev,
                                        const kpl_pool_attrs &a, const T *gy, const int64_t *idx,
                                        T *gx, check_ref chk)
{
    int64_t ohw = a.oh * a.ow, hw = a.h * a.w, nout = a.n * a.c * ohw, ncells = a.n * a.c * hw;
    groups<I> g;
    KPL_TRY(group_by<I>(cs, dev, plane_key{idx, ohw, hw, chk}, nout, ncells, false, &g));
    plane_sum_kernel<T, I><<<kpl__cuda_blocks(cs, ncells, KPL_CUDA_THREADS), KPL_CUDA_THREADS, 0,
                             cs->compute>>>(gy, g.off, g.items, gx, ncells);
    kpl_status st = KPL_CUDA_LAUNCHED("plane_scatter");
    group_free(dev, &g);
    return st;
}

template <typename T>
static kpl_status plane_typed(kpl_cuda_state *cs, kpl_device *dev, const kpl_pool_attrs &a,
                              const void *in0, const int64_t *idx, void *out, check_ref chk)
{
    const int th = KPL_CUDA_THREADS;
    int64_t nout = a.n * a.c * a.oh * a.ow, ncells = a.n * a.c * a.h * a.w;
    if (a.kind == KPL_POOL_GATHER) {
        plane_gather_kernel<T><<<kpl__cuda_blocks(cs, nout, th), th, 0, cs->compute>>>(
            a, (const T *)in0, idx, (T *)out, chk);
        return KPL_CUDA_LAUNCHED("plane_gather");
    }
    if (kpl_get_deterministic())
        return nout < INT32_MAX
                   ? plane_scatter_grouped<T, int32_t>(cs, dev, a, (const T *)in0, idx, (T *)out, chk)
                   : plane_scatter_grouped<T, int64_t>(cs, dev, a, (const T *)in0, idx, (T *)out,
                                                       chk);
    KPL_CUDA_TRY(cudaMemsetAsync(out, 0, (size_t)ncells * sizeof(T), cs->compute));
    plane_scatter_kernel<T><<<kpl__cuda_blocks(cs, nout, th), th, 0, cs->compute>>>(
        a, (const T *)in0, idx, (T *)out, chk);
    return KPL_CUDA_LAUNCHED("plane_scatter");
}

extern "C" kpl_status kpl__cuda_plane_index(const kpl_kernel_args *args)
{
    const kpl_pool_attrs *a = (const kpl_pool_attrs *)args->attrs;
    kpl_cuda_state *cs;
    void *out;
    const void *in[2];
    KPL_TRY(kpl__cuda_pointers(args, 2, &cs, &out, in));
    kpl_device *dev = kpl_tensor_device(args->out);
    const int64_t *idx = (const int64_t *)in[1];
    const char *op = a->kind == KPL_POOL_GATHER ? "plane_gather" : "plane_scatter";
    char where[64];
    snprintf(where, sizeof where, "of the %lldx%lld plane", (long long)a->h, (long long)a->w);
    check_ref chk;
    KPL_TRY(check_start(cs, op, a->h * a->w, args->in[1], where, &chk));
    /* SCATTER writes gx: out's dtype is the data type either way */
    kpl_status st = kpl_tensor_dtype(args->out) == KPL_F64
                        ? plane_typed<double>(cs, dev, *a, in[0], idx, out, chk)
                        : plane_typed<float>(cs, dev, *a, in[0], idx, out, chk);
    kpl_status ce = kpl__cuda_check_end(cs, chk.ticket, idx);
    return st < 0 ? st : ce;
}

/* ---- index_select / index_add -------------------------------------------------------- */

/* Moves rows of `es` bytes; a bad index writes zeros. */
__global__ void index_select_kernel(kpl_index_attrs a, const char *x, const int64_t *idx,
                                    char *out, size_t es, check_ref chk)
{
    int64_t n = a.outer * a.k * a.inner;
    KPL_CUDA_FOR(i, n)
    {
        int64_t in = i % a.inner, k = (i / a.inner) % a.k, o = i / (a.inner * a.k);
        int64_t j = idx[k];
        if (j < 0 || j >= a.dim) {
            if (in == 0 && o == 0) chk.fail(k);
            memset(out + (size_t)i * es, 0, es);
            continue;
        }
        memcpy(out + (size_t)i * es, x + (size_t)((o * a.dim + j) * a.inner + in) * es, es);
    }
}

/* Index k's row j, -1 if bad. */
struct row_key {
    const int64_t *idx;
    int64_t dim;
    check_ref chk;
    __device__ __forceinline__ int64_t operator()(int64_t k, bool check) const
    {
        int64_t j = idx[k];
        if (j < 0 || j >= dim) {
            if (check) chk.fail(k);
            return -1;
        }
        return j;
    }
};

/* out (outer, dim, inner): each element sums g's rows k of its row j, in
 * increasing k (the groups are sorted), from zero. */
template <typename T, typename I>
__global__ void index_add_kernel(kpl_index_attrs a, const T *g, const I *off, const I *items,
                                 T *out)
{
    KPL_CUDA_FOR(t, a.outer * a.dim * a.inner)
    {
        int64_t in = t % a.inner, j = (t / a.inner) % a.dim, o = t / (a.inner * a.dim);
        int64_t b, e;
        run_of(off, j, &b, &e);
        T s = 0;
        for (int64_t r = b; r < e; r++) s += g[(o * a.k + (int64_t)items[r]) * a.inner + in];
        out[t] = s;
    }
}

template <typename T, typename I>
static kpl_status index_add_typed(kpl_cuda_state *cs, kpl_device *dev, const kpl_index_attrs &a,
                                  const void *g, const int64_t *idx, void *out, check_ref chk)
{
    groups<I> gr;
    KPL_TRY(group_by<I>(cs, dev, row_key{idx, a.dim, chk}, a.k, a.dim, true, &gr));
    int64_t n = a.outer * a.dim * a.inner;
    index_add_kernel<T, I><<<kpl__cuda_blocks(cs, n, KPL_CUDA_THREADS), KPL_CUDA_THREADS, 0,
                             cs->compute>>>(a, (const T *)g, gr.off, gr.items, (T *)out);
    kpl_status st = KPL_CUDA_LAUNCHED("index_add");
    group_free(dev, &gr);
    return st;
}

/* ---- gather / scatter_add ------------------------------------------------------------- */

/* x's flat offset of idx position (o, 0, i); the twin of cpu_index.c's. */
__device__ __forceinline__ int64_t gather_x_base(const kpl_index_attrs &a, int64_t o, int64_t i)
{
    if (a.simple) return o * a.dim * a.xinner + i;
    int64_t xo = 0, xi = 0, m = 1;
    for (int d = a.axis - 1; d >= 0; d--) {
        xo += o % a.ishape[d] * m;
        o /= a.ishape[d];
        m *= a.xshape[d];
    }
    m = 1;
    for (int d = a.ndim - 1; d > a.axis; d--) {
        xi += i % a.ishape[d] * m;
        i /= a.ishape[d];
        m *= a.xshape[d];
    }
    return xo * a.dim * a.xinner + xi;
}

/* One thread per idx position p = (o, j, i): gather reads x at the index
 * into out[p]; scatter_add (Add) adds in[p] there atomically, where out
 * holds x already.  A bad index is recorded and writes nothing (gather:
 * a 0). */
template <typename T, bool Add>
__global__ void index_elem_kernel(kpl_index_attrs a, const T *in, const int64_t *idx, T *out,
                                  check_ref chk)
{
    KPL_CUDA_FOR(p, a.outer * a.k * a.inner)
    {
        int64_t i = p % a.inner, o = p / (a.k * a.inner), v = idx[p];
        if (v < 0 || v >= a.dim) {
            chk.fail(p);
            if constexpr (!Add) out[p] = T(0);
            continue;
        }
        int64_t at = gather_x_base(a, o, i) + v * a.xinner;
        if constexpr (Add) atomicAdd(&out[at], in[p]);
        else out[p] = in[at];
    }
}

template <typename T, bool Add>
static kpl_status index_elem_launch(kpl_cuda_state *cs, const kpl_index_attrs &a, const void *in,
                                    const int64_t *idx, void *out, check_ref chk)
{
    int th = KPL_CUDA_THREADS;
    index_elem_kernel<T, Add><<<kpl__cuda_blocks(cs, a.outer * a.k * a.inner, th), th, 0,
                                cs->compute>>>(a, (const T *)in, idx, (T *)out, chk);
    return KPL_CUDA_LAUNCHED(Add ? "scatter_add" : "gather");
}

/* Position p's target element of x (and out), -1 if bad. */
struct scatter_key {
    kpl_index_attrs a;
    const int64_t *idx;
    check_ref chk;
    __device__ __forceinline__ int64_t operator()(int64_t p, bool check) const
    {
        int64_t v = idx[p];
        if (v < 0 || v >= a.dim) {
            if (check) chk.fail(p);
            return -1;
        }
        return gather_x_base(a, p / (a.k * a.inner), p % a.inner) + v * a.xinner;
    }
};

/* The deterministic scatter_add: each element of out (holding x) adds its
 * positions' src values in increasing position. */
template <typename T, typename I>
__global__ void scatter_sum_kernel(const T *src, const I *off, I *items, T *out, int64_t nx)
{
    KPL_CUDA_FOR(t, nx)
    {
        int64_t b, e;
        run_of(off, t, &b, &e);
        if (b == e) continue;
        sort_run(items, b, e);
        T s = out[t];
        for (int64_t r = b; r < e; r++) s += src[items[r]];
        out[t] = s;
    }
}

template <typename T, typename I>
static kpl_status scatter_add_grouped(kpl_cuda_state *cs, kpl_device *dev,
                                      const kpl_index_attrs &a, int64_t nx, const void *src,
                                      const int64_t *idx, void *out, check_ref chk)
{
    groups<I> g;
    KPL_TRY(group_by<I>(cs, dev, scatter_key{a, idx, chk}, a.outer * a.k * a.inner, nx, false,
                        &g));
    scatter_sum_kernel<T, I><<<kpl__cuda_blocks(cs, nx, KPL_CUDA_THREADS), KPL_CUDA_THREADS, 0,
                               cs->compute>>>((const T *)src, g.off, g.items, (T *)out, nx);
    kpl_status st = KPL_CUDA_LAUNCHED("scatter_add");
    group_free(dev, &g);
    return st;
}

template <typename T>
static kpl_status scatter_add_typed(kpl_cuda_state *cs, kpl_device *dev,
                                    const kpl_index_attrs &a, int64_t nx, const void *src,
                                    const int64_t *idx, void *out, check_ref chk)
{
    if (!kpl_get_deterministic()) return index_elem_launch<T, true>(cs, a, src, idx, out, chk);
    return a.outer * a.k * a.inner < INT32_MAX
               ? scatter_add_grouped<T, int32_t>(cs, dev, a, nx, src, idx, out, chk)
               : scatter_add_grouped<T, int64_t>(cs, dev, a, nx, src, idx, out, chk);
}

/* ---- the index kernel ---------------------------------------------------------------- */

/* in[0]: x (select, gather), g (index_add) or src (scatter_add); in[1]:
 * idx.  ops_index.c has copied x into a scatter_add's out.  Moves (select,
 * gather) go by element size, so one kernel per size serves every dtype. */
static kpl_status cuda_index(const kpl_kernel_args *args)
{
    const kpl_index_attrs *a = (const kpl_index_attrs *)args->attrs;
    kpl_cuda_state *cs;
    void *out;
    const void *in[2];
    KPL_TRY(kpl__cuda_pointers(args, 2, &cs, &out, in));
    kpl_device *dev = kpl_tensor_device(args->out);
    kpl_dtype dt = kpl_tensor_dtype(args->out);
    const int64_t *idx = (const int64_t *)in[1];
    size_t es = kpl_dtype_size(dt);
    bool f64 = dt == KPL_F64;
    static const char *const names[] = {"index_select", "index_add", "gather", "scatter_add"};
    const char *op = names[a->kind];
    if ((a->kind == KPL_INDEX_ADD || a->kind == KPL_INDEX_SCATTER_ADD) && dt != KPL_F32 &&
        dt != KPL_F64)
        return KPL_ERROR(KPL_EDTYPE, "%s: no cuda kernel for dtype %s", op, kpl_dtype_name(dt));
    char where[64] = "";
    if (a->kind == KPL_INDEX_GATHER || a->kind == KPL_INDEX_SCATTER_ADD)
        snprintf(where, sizeof where, "along the indexed axis");
    check_ref chk;
    KPL_TRY(check_start(cs, op, a->dim, args->in[1], where, &chk));
    kpl_status st = KPL_OK;
    int th = KPL_CUDA_THREADS;
    switch (a->kind) {
    case KPL_INDEX_SELECT: {
        int64_t n = a->outer * a->k * a->inner;
        index_select_kernel<<<kpl__cuda_blocks(cs, n, th), th, 0, cs->compute>>>(
            *a, (const char *)in[0], idx, (char *)out, es, chk);
        st = KPL_CUDA_LAUNCHED("index_select");
        break;
    }
    case KPL_INDEX_ADD:
        st = a->k < INT32_MAX
                 ? (f64 ? index_add_typed<double, int32_t>(cs, dev, *a, in[0], idx, out, chk)
                        : index_add_typed<float, int32_t>(cs, dev, *a, in[0], idx, out, chk))
                 : (f64 ? index_add_typed<double, int64_t>(cs, dev, *a, in[0], idx, out, chk)
                        : index_add_typed<float, int64_t>(cs, dev, *a, in[0], idx, out, chk));
        break;
    case KPL_INDEX_GATHER: {
        using u64 = unsigned long long;
        st = es == 1   ? index_elem_launch<uint8_t, false>(cs, *a, in[0], idx, out, chk)
             : es == 2 ? index_elem_launch<uint16_t, false>(cs, *a, in[0], idx, out, chk)
             : es == 4 ? index_elem_launch<uint32_t, false>(cs, *a, in[0], idx, out, chk)
                       : index_elem_launch<u64, false>(cs, *a, in[0], idx, out, chk);
        break;
    }
    case KPL_INDEX_SCATTER_ADD: {
        int64_t nx = kpl_tensor_numel(args->out);
        st = f64 ? scatter_add_typed<double>(cs, dev, *a, nx, in[0], idx, out, chk)
                 : scatter_add_typed<float>(cs, dev, *a, nx, in[0], idx, out, chk);
        break;
    }
    }
    kpl_status ce = kpl__cuda_check_end(cs, chk.ticket, idx);
    return st < 0 ? st : ce;
}

/* ---- softmax cross entropy ------------------------------------------------------------ */

/* One thread per position p = (sample, column): its classes at stride
 * inner, three passes (max, exp-sum in f64, then the loss or gx) as the
 * CPU's loops (cpu/cpu_loss.c).  A label out of range is recorded and its
 * position gets no loss and no gradient. */
template <typename T>
__global__ void xent_kernel(kpl_xent_attrs a, const T *x, const int64_t *y, const T *gy, T *out,
                            check_ref chk)
{
    KPL_CUDA_FOR(p, a.n * a.inner)
    {
        int64_t s = p / a.inner, j = p % a.inner, v = y[p];
        const T *xs = x + s * a.c * a.inner + j;
        bool counts = v != a.ignore;
        if (counts && (v < 0 || v >= a.c)) {
            chk.fail(p);
            counts = false;
        }
        T m = xs[0];
        for (int64_t c = 1; c < a.c; c++) m = xs[c * a.inner] > m ? xs[c * a.inner] : m;
        double sum = 0, sx = 0;
        for (int64_t c = 0; c < a.c; c++) {
            sum += (double)exp(xs[c * a.inner] - m);
            sx += (double)xs[c * a.inner];
        }
        T lse = (T)((double)m + log(sum));
        if (!a.bwd) {
            double l = (double)lse;
            out[p] = counts ? (T)((1 - a.eps) * (l - (double)xs[v * a.inner]) +
                                  a.eps * (l - sx / (double)a.c))
                            : T(0);
            continue;
        }
        const T off = (T)(a.eps / (double)a.c), hit = (T)(1 - a.eps);
        T g = counts ? gy[p] : T(0), *gs = out + s * a.c * a.inner + j;
        for (int64_t c = 0; c < a.c; c++)
            gs[c * a.inner] = g * (exp(xs[c * a.inner] - lse) - off - (c == v ? hit : T(0)));
    }
}

static kpl_status cuda_xent(const kpl_kernel_args *args)
{
    const kpl_xent_attrs *a = (const kpl_xent_attrs *)args->attrs;
    kpl_cuda_state *cs;
    void *out;
    const void *in[3] = {NULL, NULL, NULL};
    KPL_TRY(kpl__cuda_pointers(args, a->bwd ? 3 : 2, &cs, &out, in));
    const int64_t *y = (const int64_t *)in[1];
    char where[64];
    snprintf(where, sizeof where, "of the %lld classes (labels)", (long long)a->c);
    check_ref chk;
    KPL_TRY(check_start(cs, a->bwd ? "softmax_xent_bwd" : "softmax_xent", a->c, args->in[1],
                        where, &chk));
    int th = KPL_CUDA_THREADS;
    unsigned blocks = kpl__cuda_blocks(cs, a->n * a->inner, th);
    if (kpl_tensor_dtype(args->in[0]) == KPL_F64)
        xent_kernel<double><<<blocks, th, 0, cs->compute>>>(
            *a, (const double *)in[0], y, (const double *)in[2], (double *)out, chk);
    else
        xent_kernel<float><<<blocks, th, 0, cs->compute>>>(
            *a, (const float *)in[0], y, (const float *)in[2], (float *)out, chk);
    kpl_status st = KPL_CUDA_LAUNCHED(a->bwd ? "softmax_xent_bwd" : "softmax_xent");
    kpl_status ce = kpl__cuda_check_end(cs, chk.ticket, y);
    return st < 0 ? st : ce;
}

extern "C" void kpl__cuda_register_index(void)
{
    for (int dt = 0; dt < KPL_DTYPE_COUNT; dt++)
        kpl_kernel_register(KPL_KOP_INDEX, KPL_DEVICE_CUDA, (kpl_dtype)dt, cuda_index);
    kpl_kernel_register(KPL_KOP_XENT, KPL_DEVICE_CUDA, KPL_F32, cuda_xent);
    kpl_kernel_register(KPL_KOP_XENT, KPL_DEVICE_CUDA, KPL_F64, cuda_xent);
}
