/*
 * comm_mpi.c — the mpi backend: Open MPI's collectives on host memory, called
 * from the communication thread.  A private duplicate of MPI_COMM_WORLD with
 * MPI_ERRORS_RETURN keeps kpl's traffic apart from the user's and turns MPI
 * errors into statuses.  f16 and bf16 reductions use MPI operations of our
 * own (MPI has no half-precision types).
 */
#include "collective_impl.h"

#include <limits.h>
#include <mpi.h>
#include <stdlib.h>

typedef struct {
    MPI_Comm comm;
    bool finalize; /* we initialised MPI */
    MPI_Op half_ops[2][3]; /* [f16, bf16][sum, max, min] */
} mpi_state;

/* ---- half-precision reductions ------------------------------------------------------ */

#define HALF_OP(name, to32, from32, expr)                                                  \
    static void name(void *in, void *inout, int *len, MPI_Datatype *dt)                  \
    {                                                                                      \
        (void)dt;                                                                          \
        const uint16_t *a = in;                                                            \
        uint16_t *b = inout;                                                               \
        for (int i = 0; i < *len; i++) {                                                   \
            float x = to32(a[i]), y = to32(b[i]);                                          \
            b[i] = from32(expr);                                                           \
        }                                                                                  \
    }
HALF_OP(f16_sum, kpl_f16_to_f32, kpl_f32_to_f16, x + y)
HALF_OP(f16_max, kpl_f16_to_f32, kpl_f32_to_f16, x > y || x != x ? x : y)
HALF_OP(f16_min, kpl_f16_to_f32, kpl_f32_to_f16, x < y || x != x ? x : y)
HALF_OP(bf16_sum, kpl_bf16_to_f32, kpl_f32_to_bf16, x + y)
HALF_OP(bf16_max, kpl_bf16_to_f32, kpl_f32_to_bf16, x > y || x != x ? x : y)
HALF_OP(bf16_min, kpl_bf16_to_f32, kpl_f32_to_bf16, x < y || x != x ? x : y)

static kpl_status mpi_fail(int err, const char *what)
{
    char s[MPI_MAX_ERROR_STRING];
    int n = 0;
    MPI_Error_string(err, s, &n);
    return KPL_ERROR(KPL_ECOMM, "MPI %s: %s", what, s);
}

static void mpi_fini(void *state)
{
    mpi_state *m = state;
    for (int t = 0; t < 2; t++)
        for (int o = 0; o < 3; o++)
            if (m->half_ops[t][o] != MPI_OP_NULL) MPI_Op_free(&m->half_ops[t][o]);
    if (m->comm != MPI_COMM_NULL) MPI_Comm_free(&m->comm);
    if (m->finalize) MPI_Finalize();
    free(m);
}

static kpl_status mpi_init(void **state, int32_t *rank, int32_t *size, int32_t *local_rank,
                           int32_t *local_size)
{
    mpi_state *m = calloc(1, sizeof *m);
    KPL_CHECK(m, KPL_ENOMEM, "mpi backend: no memory");
    m->comm = MPI_COMM_NULL;
    for (int t = 0; t < 2; t++)
        for (int o = 0; o < 3; o++) m->half_ops[t][o] = MPI_OP_NULL;
    *state = m;
    int inited = 0, level = 0;
    MPI_Initialized(&inited);
    if (!inited) {
        int err = MPI_Init_thread(NULL, NULL, MPI_THREAD_MULTIPLE, &level);
        if (err != MPI_SUCCESS) return mpi_fail(err, "MPI_Init_thread");
        m->finalize = true;
    } else {
        MPI_Query_thread(&level);
    }
    /* Every MPI call of kpl happens on the communication thread. */
    KPL_CHECK(level >= MPI_THREAD_SERIALIZED, KPL_EBACKEND,
              "mpi backend: MPI runs at thread level %d; kpl calls MPI from its communication "
              "thread and needs MPI_THREAD_SERIALIZED or MPI_THREAD_MULTIPLE "
              "(MPI_Init_thread)", level);
    int err = MPI_Comm_dup(MPI_COMM_WORLD, &m->comm);
    if (err != MPI_SUCCESS) return mpi_fail(err, "MPI_Comm_dup");
    MPI_Comm_set_errhandler(m->comm, MPI_ERRORS_RETURN);
    int r, s, lr, ls;
    MPI_Comm_rank(m->comm, &r);
    MPI_Comm_size(m->comm, &s);
    MPI_Comm local;
    err = MPI_Comm_split_type(m->comm, MPI_COMM_TYPE_SHARED, r, MPI_INFO_NULL, &local);
    if (err != MPI_SUCCESS) return mpi_fail(err, "MPI_Comm_split_type");
    MPI_Comm_rank(local, &lr);
    MPI_Comm_size(local, &ls);
    MPI_Comm_free(&local);
    MPI_User_function *fn[2][3] = {{f16_sum, f16_max, f16_min}, {bf16_sum, bf16_max, bf16_min}};
    for (int t = 0; t < 2; t++)
        for (int o = 0; o < 3; o++) MPI_Op_create(fn[t][o], 1, &m->half_ops[t][o]);
    *rank = r;
    *size = s;
    *local_rank = lr;
    *local_size = ls;
    return KPL_OK;
}

static MPI_Datatype mpi_type(kpl_dtype dt)
{
    switch (dt) {
    case KPL_F32: return MPI_FLOAT;
    case KPL_F64: return MPI_DOUBLE;
    case KPL_I32: return MPI_INT32_T;
    case KPL_I64: return MPI_INT64_T;
    case KPL_F16:
    case KPL_BF16: return MPI_UINT16_T;
    default: return MPI_UINT8_T;
    }
}

static MPI_Op mpi_op(const mpi_state *m, kpl_dtype dt, kpl_comm_op op)
{
    int o = op == KPL_COMM_MAX ? 1 : op == KPL_COMM_MIN ? 2 : 0;
    if (dt == KPL_F16) return m->half_ops[0][o];
    if (dt == KPL_BF16) return m->half_ops[1][o];
    return o == 1 ? MPI_MAX : o == 2 ? MPI_MIN : MPI_SUM;
}

/* Runs the operation with MPI's blocking calls: Open MPI's tuned blocking
 * collectives were 2-100x faster here than its non-blocking ones
 * progressed by MPI_Test (libnbc; bench comm).  The deadline is kept by
 * the waiting side (comm.c), which gives up on an operation stuck in MPI. */
static kpl_status mpi_run(void *state, const kpl__coll_args *a, double deadline)
{
    (void)deadline;
    mpi_state *m = state;
    KPL_CHECK(a->count <= (size_t)INT_MAX, KPL_ERANGE,
              "mpi backend: %zu elements exceed MPI's int count", a->count);
    int n = (int)a->count, err = MPI_SUCCESS;
    MPI_Datatype t = mpi_type(a->dtype);
    const void *in = a->in == a->out ? MPI_IN_PLACE : a->in;
    switch (a->kind) {
    case KPL__COLL_ALLREDUCE:
        err = MPI_Allreduce(in, a->out, n, t, mpi_op(m, a->dtype, a->op), m->comm);
        break;
    case KPL__COLL_BROADCAST:
        err = MPI_Bcast(a->out, n, t, a->peer, m->comm);
        break;
    case KPL__COLL_ALLGATHER:
        err = MPI_Allgather(a->in, n, t, a->out, n, t, m->comm);
        break;
    case KPL__COLL_REDUCE_SCATTER:
        err = MPI_Reduce_scatter_block(a->in, a->out, n, t, mpi_op(m, a->dtype, a->op), m->comm);
        break;
    case KPL__COLL_SEND:
        err = MPI_Send(a->in, n, t, a->peer, a->tag, m->comm);
        break;
    case KPL__COLL_RECV:
        err = MPI_Recv(a->out, n, t, a->peer, a->tag, m->comm, MPI_STATUS_IGNORE);
        break;
    case KPL__COLL_BARRIER:
        err = MPI_Barrier(m->comm);
        break;
    }
    return err == MPI_SUCCESS ? KPL_OK : mpi_fail(err, "operation");
}

__attribute__((noreturn)) static void mpi_abort(void *state, int code)
{
    mpi_state *m = state;
    MPI_Abort(m && m->comm != MPI_COMM_NULL ? m->comm : MPI_COMM_WORLD, code);
    abort(); /* MPI_Abort does not return; if it did, still end */
}

static const kpl__comm_backend mpi_backend = {
    .name = "mpi",
    .init = mpi_init,
    .fini = mpi_fini,
    .run = mpi_run,
    .abort = mpi_abort,
};

const kpl__comm_backend *kpl__comm_mpi_backend(void) { return &mpi_backend; }
