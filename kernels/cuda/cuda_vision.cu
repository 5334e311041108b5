/*
 * cuda_vision.cu — the detection kernels on CUDA.
 *
 * IoU / GIoU: one thread per output, every pair (N, M) or matched pairs
 * (N), with vision_math.h's formula — the CPU's, so (compiled with
 * --fmad=false, kernels/CMakeLists.txt) the same bits.
 *
 * NMS: the scores come to the host and are sorted there with the CPU's own
 * order (kpl__nms_order: decreasing score, NaN first, ties by index); the
 * boxes (and class ids) are gathered into that order on the device; a
 * kernel marks, for each box i, the later boxes j of its class with
 * IoU(i, j) > threshold, 64 per word (rows of ceil(N / 64) words); the
 * host walks the rows in order, keeping a box unless an earlier kept one
 * marked it — the CPU's greedy loop over precomputed decisions.  The mask
 * is made and read back in blocks of rows of at most 64 MB, so memory
 * stays bounded for large N (the walk only needs earlier rows' results).
 * The kept indices are written to `keep` from the host.
 *
 * ROI Align: one thread per bin, forward (its samples summed in the CPU's
 * order with vision_math.h's steps, so the CPU's bits) and backward
 * (each sample's four weights added into the zeroed input gradient with
 * atomicAdd, f64 included: sm_60 and later).
 *
 * Written without a GPU to run it on (CI has none): tests/kernels/
 * test_cuda.c compares these kernels with the CPU's where a GPU is present.
 */
#include "cuda_impl.h"
#include "../vision_math.h"

#include <float.h>
#include <stdlib.h>

/* ---- IoU / GIoU ---------------------------------------------------------------------- */

template <typename T>
__global__ void box_metric_kernel(const T *a, const T *b, T *out, int64_t n, int64_t m,
                                  bool pairwise, int giou)
{
    KPL_CUDA_FOR(p, pairwise ? n * m : n)
    {
        int64_t i = pairwise ? p / m : p, j = pairwise ? p - i * m : p;
        const T *pa = a + 4 * i, *pb = b + 4 * j;
        out[p] = kpl_box_eval<T>(pa[0], pa[1], pa[2], pa[3],
                                 KPL_BOX_AREA(pa[0], pa[1], pa[2], pa[3]), pb[0], pb[1], pb[2],
                                 pb[3], KPL_BOX_AREA(pb[0], pb[1], pb[2], pb[3]), giou);
    }
}

template <typename T>
static kpl_status metric_launch(kpl_cuda_state *cs, const kpl_box_attrs *a, const void *pa,
                                const void *pb, void *out)
{
    int th = KPL_CUDA_THREADS;
    int64_t total = a->pairwise ? a->n * a->m : a->n;
    box_metric_kernel<T><<<kpl__cuda_blocks(cs, total, th), th, 0, cs->compute>>>(
        (const T *)pa, (const T *)pb, (T *)out, a->n, a->m, a->pairwise,
        a->metric == KPL_BOX_GIOU);
    return KPL_CUDA_LAUNCHED(a->metric == KPL_BOX_GIOU ? "generalized_box_iou" : "box_iou");
}

/* ---- NMS ------------------------------------------------------------------------------ */

#define NMS_BLOCK 64 /* boxes per mask word, threads per block */

/* sorted[k] = boxes[order[k]] (and its class). */
template <typename T>
__global__ void nms_gather_kernel(const T *boxes, const int64_t *cls, const int64_t *order,
                                  int64_t n, T *sorted, int64_t *scls)
{
    KPL_CUDA_FOR(k, n)
    {
        int64_t r = order[k];
        for (int c = 0; c < 4; c++) sorted[4 * k + c] = boxes[4 * r + c];
        if (cls) scls[k] = cls[r];
    }
}

/* Mask rows r0 .. r0 + rows - 1 (row i at (i - r0) * col_blocks), word cb:
 * bit u set when box j = 64 cb + u comes after box i in the sorted order,
 * has its class (with class ids) and IoU(i, j) > thr.  A block is 64 rows
 * by the 64 columns of one word, the columns staged in shared memory;
 * grid (col_blocks, row blocks). */
template <typename T>
__global__ void nms_mask_kernel(const T *sorted, const int64_t *scls, int64_t n, int64_t r0,
                                int64_t rows, int64_t col_blocks, T thr,
                                unsigned long long *mask)
{
    __shared__ T col[NMS_BLOCK][5];
    __shared__ int64_t ccls[NMS_BLOCK];
    int t = threadIdx.x;
    int64_t cb = blockIdx.x, j0 = cb * NMS_BLOCK;
    int64_t i = r0 + (int64_t)blockIdx.y * NMS_BLOCK + t;
    if (j0 + t < n) {
        const T *b = sorted + 4 * (j0 + t);
        col[t][0] = b[0];
        col[t][1] = b[1];
        col[t][2] = b[2];
        col[t][3] = b[3];
        col[t][4] = KPL_BOX_AREA(b[0], b[1], b[2], b[3]);
        ccls[t] = scls ? scls[j0 + t] : 0;
    }
    __syncthreads();
    if (i >= r0 + rows) return;
    unsigned long long bits = 0;
    if (j0 + NMS_BLOCK > i + 1) { /* some column of the word comes after i */
        const T *a = sorted + 4 * i;
        T ax0 = a[0], ay0 = a[1], ax1 = a[2], ay1 = a[3];
        T aa = KPL_BOX_AREA(ax0, ay0, ax1, ay1);
        int64_t ci = scls ? scls[i] : 0;
        int64_t jn = n - j0 < NMS_BLOCK ? n - j0 : NMS_BLOCK;
        for (int u = 0; u < jn; u++) {
            if (j0 + u <= i || ccls[u] != ci) continue;
            if (kpl_box_eval<T>(ax0, ay0, ax1, ay1, aa, col[u][0], col[u][1], col[u][2],
                                col[u][3], col[u][4], 0) > thr)
                bits |= 1ull << u;
        }
    }
    mask[(i - r0) * col_blocks + cb] = bits;
}

/* A CUDA runtime call of nms_typed: on failure its status into `st` and
 * on to the `fail:` label. */
#define CUDA_TRY_GOTO(what, call)                                        \
    do {                                                                 \
        cudaError_t e_ = (call);                                         \
        if (e_ != cudaSuccess) {                                         \
            st = kpl__cuda_fail(e_, (what), __FILE__, __LINE__);         \
            goto fail;                                                   \
        }                                                                \
    } while (0)

/* The threshold in the boxes' dtype (vision_math.h). */
template <typename T> static T nms_threshold(double thr);
template <> float nms_threshold<float>(double thr) { return kpl_nms_threshold_f32(thr); }
template <> double nms_threshold<double>(double thr) { return thr; }

template <typename T>
static kpl_status nms_typed(kpl_cuda_state *cs, kpl_device *dev, const kpl_kernel_args *args,
                            const T *boxes, const int64_t *cls, int64_t *keep)
{
    const kpl_box_attrs *a = (const kpl_box_attrs *)args->attrs;
    const int64_t n = a->n, col_blocks = (n + NMS_BLOCK - 1) / NMS_BLOCK;
    /* rows per block of the mask: 64 MB of it, a multiple of 64, within
     * the grid's y limit */
    int64_t chunk = ((int64_t)64 << 20) / (col_blocks * 8) / NMS_BLOCK * NMS_BLOCK;
    if (chunk < NMS_BLOCK) chunk = NMS_BLOCK;
    if (chunk > (int64_t)65535 * NMS_BLOCK) chunk = (int64_t)65535 * NMS_BLOCK;
    if (chunk > col_blocks * NMS_BLOCK) chunk = col_blocks * NMS_BLOCK;
    const size_t nn = (size_t)n, words = (size_t)chunk * (size_t)col_blocks;
    const int th = KPL_CUDA_THREADS;
    const T thr = nms_threshold<T>(a->thr);
    int64_t *order = (int64_t *)malloc(nn * sizeof(int64_t));
    int64_t *hkeep = (int64_t *)malloc(nn * sizeof(int64_t));
    unsigned long long *removed =
        (unsigned long long *)calloc((size_t)col_blocks, sizeof(unsigned long long));
    unsigned long long *hmask = (unsigned long long *)malloc(words * sizeof(unsigned long long));
    int64_t *d_order = NULL, *scls = NULL, nk = 0;
    T *sorted = NULL;
    unsigned long long *dmask = NULL;
    const void *hscores = NULL;
    kpl_status st = KPL_OK;
    if (!order || !hkeep || !removed || !hmask) {
        st = KPL_ERROR(KPL_ENOMEM, "nms: no host memory for %lld boxes", (long long)n);
        goto fail;
    }
    hscores = kpl_tensor_host_data((kpl_tensor *)args->in[1]);
    if (!hscores) {
        st = kpl_last_status();
        goto fail;
    }
    KPL_TRY_GOTO(kpl__nms_order(hscores, kpl_tensor_dtype(args->in[1]), n, order));
    KPL_TRY_GOTO(kpl_device_alloc(dev, nn * sizeof(int64_t), "nms order", (void **)&d_order));
    KPL_TRY_GOTO(kpl_device_alloc(dev, nn * 4 * sizeof(T), "nms boxes", (void **)&sorted));
    if (cls)
        KPL_TRY_GOTO(kpl_device_alloc(dev, nn * sizeof(int64_t), "nms classes", (void **)&scls));
    KPL_TRY_GOTO(kpl_device_alloc(dev, words * sizeof(unsigned long long), "nms mask",
                                  (void **)&dmask));
    /* From pageable memory: the call returns once `order` is staged. */
    CUDA_TRY_GOTO("writing the nms order",
                  cudaMemcpyAsync(d_order, order, nn * sizeof(int64_t), cudaMemcpyHostToDevice,
                                  cs->compute));
    nms_gather_kernel<T><<<kpl__cuda_blocks(cs, n, th), th, 0, cs->compute>>>(
        boxes, cls, d_order, n, sorted, scls);
    KPL_TRY_GOTO(KPL_CUDA_LAUNCHED("nms gather"));
    for (int64_t r0 = 0; r0 < n; r0 += chunk) {
        int64_t rows = n - r0 < chunk ? n - r0 : chunk;
        dim3 grid((unsigned)col_blocks, (unsigned)((rows + NMS_BLOCK - 1) / NMS_BLOCK));
        nms_mask_kernel<T><<<grid, NMS_BLOCK, 0, cs->compute>>>(sorted, scls, n, r0, rows,
                                                               col_blocks, thr, dmask);
        KPL_TRY_GOTO(KPL_CUDA_LAUNCHED("nms mask"));
        CUDA_TRY_GOTO("reading the nms mask",
                      cudaMemcpyAsync(hmask, dmask,
                                      (size_t)rows * (size_t)col_blocks * sizeof *hmask,
                                      cudaMemcpyDeviceToHost, cs->compute));
        CUDA_TRY_GOTO("reading the nms mask", cudaStreamSynchronize(cs->compute));
        for (int64_t r = 0; r < rows; r++) {
            int64_t i = r0 + r;
            if ((removed[i / NMS_BLOCK] >> (i % NMS_BLOCK)) & 1) continue;
            hkeep[nk++] = order[i];
            const unsigned long long *row = hmask + (size_t)r * (size_t)col_blocks;
            for (int64_t w = i / NMS_BLOCK; w < col_blocks; w++) removed[w] |= row[w];
        }
    }
    CUDA_TRY_GOTO("writing the kept indices",
                  cudaMemcpyAsync(keep, hkeep, (size_t)nk * sizeof(int64_t),
                                  cudaMemcpyHostToDevice, cs->compute));
    CUDA_TRY_GOTO("writing the kept indices", cudaStreamSynchronize(cs->compute)); /* hkeep dies */
    *a->nkeep = nk;
fail:
    /* Device blocks are reused in the compute stream's order, so they may
     * go back while queued work still reads them. */
    kpl_device_free(dev, dmask);
    kpl_device_free(dev, scls);
    kpl_device_free(dev, sorted);
    kpl_device_free(dev, d_order);
    free(hmask);
    free(removed);
    free(hkeep);
    free(order);
    return st;
}

/* ---- ROI Align ---------------------------------------------------------------------- */

#define ROI_ATOMIC_ADD(p, v) atomicAdd((p), (v))

/* One thread per bin (k, c, ph, pw).  Forward: its samples summed in the
 * CPU's order with vision_math.h's steps, so the CPU's bits.  Backward
 * (BWD): the bin's gradient added into the zeroed input gradient at every
 * sample's four cells, atomically. */
template <typename T, bool BWD>
__global__ void roi_align_kernel(const T *in, const T *rois, T *out, int64_t total,
                                 kpl_roi_attrs a)
{
    const int64_t c = a.c, h = a.h, w = a.w, oh = a.p.out_h, ow = a.p.out_w;
    KPL_CUDA_FOR(o, total)
    {
        int64_t pw = o % ow, ph = (o / ow) % oh, ch = (o / (ow * oh)) % c, k = o / (ow * oh * c);
        const T *roi = rois + 5 * k;
        kpl_roi_geom<T> g;
        kpl_roi_geom_set<T>(&g, roi, (T)a.p.spatial_scale, oh, ow, a.p.sampling_ratio, a.p.aligned);
        const int64_t plane = ((int64_t)roi[0] * c + ch) * h * w;
        const T gb = BWD ? in[o] : (T)0;
        T sum = 0;
        for (int64_t iy = 0; iy < g.gh; iy++) {
            kpl_roi_axis<T> ey;
            if (!kpl_roi_axis_at<T>(&ey, KPL_ROI_COORD(T, g.y0, ph, g.bh, iy, g.gh), h)) continue;
            for (int64_t ix = 0; ix < g.gw; ix++) {
                kpl_roi_axis<T> ex;
                if (!kpl_roi_axis_at<T>(&ex, KPL_ROI_COORD(T, g.x0, pw, g.bw, ix, g.gw), w))
                    continue;
                if (BWD)
                    KPL_ROI_SCATTER(ROI_ATOMIC_ADD, out + plane, w, ey, ex, gb, g.count);
                else
                    sum += KPL_ROI_BILINEAR(in + plane, w, ey, ex);
            }
        }
        if (!BWD) out[o] = sum / g.count;
    }
}

template <typename T>
static kpl_status roi_align_launch(kpl_cuda_state *cs, const kpl_roi_attrs *a, const void *in,
                                   const void *rois, void *out)
{
    const int th = KPL_CUDA_THREADS;
    const int64_t bins = a->k * a->c * a->p.out_h * a->p.out_w;
    if (!a->bwd) {
        roi_align_kernel<T, false><<<kpl__cuda_blocks(cs, bins, th), th, 0, cs->compute>>>(
            (const T *)in, (const T *)rois, (T *)out, bins, *a);
        return KPL_CUDA_LAUNCHED("roi_align");
    }
    KPL_CUDA_TRY(cudaMemsetAsync(out, 0, (size_t)(a->n * a->c * a->h * a->w) * sizeof(T),
                                 cs->compute));
    roi_align_kernel<T, true><<<kpl__cuda_blocks(cs, bins, th), th, 0, cs->compute>>>(
        (const T *)in, (const T *)rois, (T *)out, bins, *a);
    return KPL_CUDA_LAUNCHED("roi_align_bwd");
}

static kpl_status cuda_roi_align(const kpl_kernel_args *args)
{
    const kpl_roi_attrs *a = (const kpl_roi_attrs *)args->attrs;
    kpl_cuda_state *cs;
    void *out;
    const void *in[2];
    KPL_TRY(kpl__cuda_pointers(args, 2, &cs, &out, in));
    return kpl_tensor_dtype(args->out) == KPL_F64
               ? roi_align_launch<double>(cs, a, in[0], in[1], out)
               : roi_align_launch<float>(cs, a, in[0], in[1], out);
}

/* ---- dispatch ------------------------------------------------------------------------- */

static kpl_status cuda_box(const kpl_kernel_args *args)
{
    const kpl_box_attrs *a = (const kpl_box_attrs *)args->attrs;
    kpl_cuda_state *cs;
    void *out;
    const void *in[2];
    bool f64 = kpl_tensor_dtype(args->in[0]) == KPL_F64;
    if (!a->nms) {
        KPL_TRY(kpl__cuda_pointers(args, 2, &cs, &out, in));
        return f64 ? metric_launch<double>(cs, a, in[0], in[1], out)
                   : metric_launch<float>(cs, a, in[0], in[1], out);
    }
    KPL_TRY(kpl__cuda_pointers(args, 1, &cs, &out, in));
    const int64_t *cls = NULL;
    if (args->in[2]) {
        cls = (const int64_t *)kpl_tensor_data((kpl_tensor *)args->in[2]);
        if (!cls) return kpl_last_status();
    }
    kpl_device *dev = kpl_tensor_device(args->out);
    return f64 ? nms_typed<double>(cs, dev, args, (const double *)in[0], cls, (int64_t *)out)
               : nms_typed<float>(cs, dev, args, (const float *)in[0], cls, (int64_t *)out);
}

/* ---- the sigmoid focal loss ------------------------------------------------------------ */

/* One thread per element: vision_math.h's formula, as the CPU's loop
 * (q^gamma by gamma's kind, as the CPU's loops are chosen). */
#define FOCAL_POW(q) (g == (T)2 ? (q) * (q) : g == (T)1 ? (q) : g == (T)0 ? (T)1 : exp(g * log(q)))
template <typename T>
__global__ void focal_kernel(kpl_focal_attrs a, const T *z, const T *y, const T *gy, T *out,
                             T tiny)
{
    const T al = (T)a.alpha, g = (T)a.gamma;
    KPL_CUDA_FOR(i, a.n)
    {
        T l, d;
        KPL_FOCAL_ELEM(T, exp, log, FOCAL_POW, z[i], y[i], al, g, tiny, l, d);
        out[i] = a.bwd ? gy[i] * d : l;
    }
}

static kpl_status cuda_focal(const kpl_kernel_args *args)
{
    const kpl_focal_attrs *a = (const kpl_focal_attrs *)args->attrs;
    kpl_cuda_state *cs;
    void *out;
    const void *in[3] = {NULL, NULL, NULL};
    KPL_TRY(kpl__cuda_pointers(args, a->bwd ? 3 : 2, &cs, &out, in));
    int th = KPL_CUDA_THREADS;
    unsigned blocks = kpl__cuda_blocks(cs, a->n, th);
    if (kpl_tensor_dtype(args->in[0]) == KPL_F64)
        focal_kernel<double><<<blocks, th, 0, cs->compute>>>(
            *a, (const double *)in[0], (const double *)in[1], (const double *)in[2],
            (double *)out, DBL_MIN);
    else
        focal_kernel<float><<<blocks, th, 0, cs->compute>>>(
            *a, (const float *)in[0], (const float *)in[1], (const float *)in[2], (float *)out,
            FLT_MIN);
    return KPL_CUDA_LAUNCHED(a->bwd ? "sigmoid_focal_bwd" : "sigmoid_focal");
}

extern "C" void kpl__cuda_register_vision(void)
{
    kpl_kernel_register(KPL_KOP_BOX, KPL_DEVICE_CUDA, KPL_F32, cuda_box);
    kpl_kernel_register(KPL_KOP_BOX, KPL_DEVICE_CUDA, KPL_F64, cuda_box);
    kpl_kernel_register(KPL_KOP_ROI_ALIGN, KPL_DEVICE_CUDA, KPL_F32, cuda_roi_align);
    kpl_kernel_register(KPL_KOP_ROI_ALIGN, KPL_DEVICE_CUDA, KPL_F64, cuda_roi_align);
    kpl_kernel_register(KPL_KOP_FOCAL, KPL_DEVICE_CUDA, KPL_F32, cuda_focal);
    kpl_kernel_register(KPL_KOP_FOCAL, KPL_DEVICE_CUDA, KPL_F64, cuda_focal);
}
