/*
 * cuda_matmul.cu — MATMUL on CUDA through cuBLAS (f32, f64).
 *
 * kpl tensors are row-major, cuBLAS is column-major.  A row-major (r, c)
 * matrix read column-major is its transpose, so C = op(A) op(B) is computed
 * as C^T = op(B)^T op(A)^T: cuBLAS gets B first, then A, with the
 * transposes as stored and the leading dimension of each operand equal to
 * its stored column count; the column-major result (N, M) is the row-major
 * (M, N) C.
 *
 * Batches: when every operand's batch dims either equal the output's or are
 * all 1, one strided-batched call covers them (stride 0 broadcasts);
 * otherwise each output matrix gets its own call with offsets computed from
 * the broadcast pattern.  FP32 GEMMs use full precision (no TF32; see
 * cuda_init), so results compare with the CPU's.
 */
#include "cuda_impl.h"

#include <limits.h>

typedef struct {
    int64_t m, n, k;
    int64_t lda, ldb;           /* stored column counts */
    cublasOperation_t opa, opb; /* as stored */
    int64_t batch;              /* output matrices */
    int64_t mat_a, mat_b;       /* elements per stored matrix */
} mm_geom;

static void geometry(const kpl_matmul_attrs *at, mm_geom *g)
{
    int nd = at->ndim;
    g->m = at->out_dims[nd - 2];
    g->n = at->out_dims[nd - 1];
    g->k = at->trans_a ? at->a_dims[nd - 2] : at->a_dims[nd - 1];
    g->lda = at->a_dims[nd - 1];
    g->ldb = at->b_dims[nd - 1];
    g->opa = at->trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;
    g->opb = at->trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;
    g->batch = 1;
    for (int d = 0; d < nd - 2; d++) g->batch *= at->out_dims[d];
    g->mat_a = at->a_dims[nd - 2] * at->a_dims[nd - 1];
    g->mat_b = at->b_dims[nd - 2] * at->b_dims[nd - 1];
}

/* The single stride of an operand's batch dims (0 = broadcast to all), or
 * -1 when its pattern needs per-matrix offsets. */
static int64_t uniform_stride(const kpl_matmul_attrs *at, const int64_t *dims, int64_t mat)
{
    bool all_one = true, all_same = true;
    for (int d = 0; d < at->ndim - 2; d++) {
        if (dims[d] != 1) all_one = false;
        if (dims[d] != at->out_dims[d]) all_same = false;
    }
    if (all_one) return 0;
    return all_same ? mat : -1;
}

/* Element offset of output matrix `bi`'s operand (broadcast batch dims). */
static int64_t batch_offset(const kpl_matmul_attrs *at, const int64_t *dims, int64_t mat,
                            int64_t bi)
{
    int64_t off = 0, stride = mat;
    for (int d = at->ndim - 3; d >= 0; d--) {
        int64_t idx = bi % at->out_dims[d];
        bi /= at->out_dims[d];
        if (dims[d] != 1) off += idx * stride;
        stride *= dims[d];
    }
    return off;
}

/* One cuBLAS entry point per element type. */
static cublasStatus_t gemm_batched(cublasHandle_t h, const mm_geom *g, const float *a,
                                   int64_t sa, const float *b, int64_t sb, float *c,
                                   int64_t count)
{
    const float one = 1.0f, zero = 0.0f;
    return cublasSgemmStridedBatched(h, g->opb, g->opa, (int)g->n, (int)g->m, (int)g->k, &one,
                                     b, (int)g->ldb, sb, a, (int)g->lda, sa, &zero, c,
                                     (int)g->n, g->m * g->n, (int)count);
}

static cublasStatus_t gemm_batched(cublasHandle_t h, const mm_geom *g, const double *a,
                                   int64_t sa, const double *b, int64_t sb, double *c,
                                   int64_t count)
{
    const double one = 1.0, zero = 0.0;
    return cublasDgemmStridedBatched(h, g->opb, g->opa, (int)g->n, (int)g->m, (int)g->k, &one,
                                     b, (int)g->ldb, sb, a, (int)g->lda, sa, &zero, c,
                                     (int)g->n, g->m * g->n, (int)count);
}

template <typename T>
static kpl_status matmul_typed(kpl_cuda_state *cs, const kpl_matmul_attrs *at, const T *a,
                               const T *b, T *c)
{
    mm_geom g;
    geometry(at, &g);
    int64_t sa = uniform_stride(at, at->a_dims, g.mat_a);
    int64_t sb = uniform_stride(at, at->b_dims, g.mat_b);
    if (sa >= 0 && sb >= 0) {
        /* cuBLAS takes the batch count as int: split huge batches. */
        for (int64_t done = 0; done < g.batch; done += INT_MAX) {
            int64_t count = g.batch - done < INT_MAX ? g.batch - done : INT_MAX;
            KPL_CUBLAS_TRY(gemm_batched(cs->blas, &g, a + done * sa, sa, b + done * sb, sb,
                                        c + done * g.m * g.n, count));
        }
        return KPL_OK;
    }
    for (int64_t bi = 0; bi < g.batch; bi++) {
        const T *pa = a + batch_offset(at, at->a_dims, g.mat_a, bi);
        const T *pb = b + batch_offset(at, at->b_dims, g.mat_b, bi);
        KPL_CUBLAS_TRY(gemm_batched(cs->blas, &g, pa, 0, pb, 0, c + bi * g.m * g.n, 1));
    }
    return KPL_OK;
}

static kpl_status cuda_matmul(const kpl_kernel_args *args)
{
    const kpl_matmul_attrs *at = (const kpl_matmul_attrs *)args->attrs;
    mm_geom g;
    geometry(at, &g);
    KPL_CHECK(g.m <= INT_MAX && g.n <= INT_MAX && g.k <= INT_MAX && g.lda <= INT_MAX &&
                  g.ldb <= INT_MAX,
              KPL_ESHAPE,
              "matmul: dims (%lld x %lld x %lld) exceed cuBLAS's 32-bit sizes on %s",
              (long long)g.m, (long long)g.n, (long long)g.k,
              kpl_device_name(kpl_tensor_device(args->out)));
    kpl_cuda_state *cs;
    void *c;
    const void *in[2];
    KPL_TRY(kpl__cuda_pointers(args, 2, &cs, &c, in));
    const void *a = in[0], *b = in[1];
    switch (kpl_tensor_dtype(args->in[0])) {
    case KPL_F32: return matmul_typed(cs, at, (const float *)a, (const float *)b, (float *)c);
    case KPL_F64: return matmul_typed(cs, at, (const double *)a, (const double *)b, (double *)c);
    default:
        return KPL_ERROR(KPL_EDTYPE, "matmul: no cuda kernel for dtype %s",
                         kpl_dtype_name(kpl_tensor_dtype(args->in[0])));
    }
}

extern "C" void kpl__cuda_register_matmul(void)
{
    kpl_kernel_register(KPL_KOP_MATMUL, KPL_DEVICE_CUDA, KPL_F32, cuda_matmul);
    kpl_kernel_register(KPL_KOP_MATMUL, KPL_DEVICE_CUDA, KPL_F64, cuda_matmul);
}
