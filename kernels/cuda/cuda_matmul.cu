/*
 * cuda_matmul.cu — MATMUL on CUDA through cuBLAS: f64, f32, f16 and bf16.
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
 * the broadcast pattern.
 *
 * Precision, one cublasGemmStridedBatchedEx per dtype: f64 in f64; f32 in
 * full f32 (CUBLAS_COMPUTE_32F; the handle's math mode is the default, which
 * never rounds f32 inputs to TF32), so results compare with the CPU's,
 * unless kpl_set_tf32(true) asks for CUBLAS_COMPUTE_32F_FAST_TF32 (tensor
 * cores on Ampere and later); f16 and bf16 inputs and outputs with f32
 * compute (tensor cores, f32 accumulation, one rounding of each output;
 * the handle disallows reduced-precision reductions, see cuda_init).
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

/* How cuBLAS takes one dtype. */
typedef struct {
    cudaDataType_t type;         /* of A, B and C */
    cublasComputeType_t compute;
    size_t es;                   /* bytes per element */
} gemm_types;

static bool types_of(kpl_dtype dt, gemm_types *t)
{
    switch (dt) {
    case KPL_F64: *t = {CUDA_R_64F, CUBLAS_COMPUTE_64F, 8}; return true;
    case KPL_F32:
        *t = {CUDA_R_32F, kpl_get_tf32() ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F, 4};
        return true;
    case KPL_F16: *t = {CUDA_R_16F, CUBLAS_COMPUTE_32F, 2}; return true;
    case KPL_BF16: *t = {CUDA_R_16BF, CUBLAS_COMPUTE_32F, 2}; return true;
    default: return false;
    }
}

/* `count` products of the geometry; a, b, c point at the first matrices,
 * sa, sb the strides between matrices in elements (0 broadcasts). */
static cublasStatus_t gemm_batched(cublasHandle_t h, const mm_geom *g, const gemm_types *t,
                                   const void *a, int64_t sa, const void *b, int64_t sb, void *c,
                                   int64_t count)
{
    /* alpha/beta in the compute type: double for 64F, float otherwise */
    const double one_d = 1.0, zero_d = 0.0;
    const float one_f = 1.0f, zero_f = 0.0f;
    bool dbl = t->compute == CUBLAS_COMPUTE_64F;
    return cublasGemmStridedBatchedEx(h, g->opb, g->opa, (int)g->n, (int)g->m, (int)g->k,
                                      dbl ? (const void *)&one_d : (const void *)&one_f, b,
                                      t->type, (int)g->ldb, sb, a, t->type, (int)g->lda, sa,
                                      dbl ? (const void *)&zero_d : (const void *)&zero_f, c,
                                      t->type, (int)g->n, g->m * g->n, (int)count, t->compute,
                                      CUBLAS_GEMM_DEFAULT);
}

static kpl_status matmul_run(kpl_cuda_state *cs, const kpl_matmul_attrs *at, const gemm_types *t,
                             const char *a, const char *b, char *c)
{
    mm_geom g;
    geometry(at, &g);
    const int64_t es = (int64_t)t->es, mat_c = g.m * g.n;
    int64_t sa = uniform_stride(at, at->a_dims, g.mat_a);
    int64_t sb = uniform_stride(at, at->b_dims, g.mat_b);
    if (sa >= 0 && sb >= 0) {
        /* cuBLAS takes the batch count as int: split huge batches. */
        for (int64_t done = 0; done < g.batch; done += INT_MAX) {
            int64_t count = g.batch - done < INT_MAX ? g.batch - done : INT_MAX;
            KPL_CUBLAS_TRY(gemm_batched(cs->blas, &g, t, a + done * sa * es, sa,
                                        b + done * sb * es, sb, c + done * mat_c * es, count));
        }
        return KPL_OK;
    }
    for (int64_t bi = 0; bi < g.batch; bi++) {
        const char *pa = a + batch_offset(at, at->a_dims, g.mat_a, bi) * es;
        const char *pb = b + batch_offset(at, at->b_dims, g.mat_b, bi) * es;
        KPL_CUBLAS_TRY(gemm_batched(cs->blas, &g, t, pa, 0, pb, 0, c + bi * mat_c * es, 1));
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
    gemm_types t;
    kpl_dtype dt = kpl_tensor_dtype(args->in[0]);
    KPL_CHECK(types_of(dt, &t), KPL_EDTYPE, "matmul: no cuda kernel for dtype %s",
              kpl_dtype_name(dt));
    return matmul_run(cs, at, &t, (const char *)in[0], (const char *)in[1], (char *)c);
}

extern "C" void kpl__cuda_register_matmul(void)
{
    static const kpl_dtype dts[] = {KPL_F32, KPL_F64, KPL_F16, KPL_BF16};
    for (size_t i = 0; i < sizeof dts / sizeof dts[0]; i++)
        kpl_kernel_register(KPL_KOP_MATMUL, KPL_DEVICE_CUDA, dts[i], cuda_matmul);
}
