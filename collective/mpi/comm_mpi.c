/*
 * comm_mpi.c — the mpi backend: Open MPI's blocking collectives on host
 * memory, over the duplicate of the job's communicator that comm.c made for
 * it (MPI_ERRORS_RETURN, so MPI errors become statuses).  f16 and bf16
 * reduce through MPI operations of our own (MPI has no half-precision
 * types) built on reduce.c.
 *
 * The hierarchical allreduce (kpl_comm_config.hierarchy; Horovod's
 * hierarchical allreduce, NCCL's intra-node reduce-scatter + inter-node
 * ring) runs on two communicators split off at init: `node` (the ranks of
 * a node) and `cross` (the ranks with the same place in their nodes, one
 * per node).  A buffer of n elements is cut into as many shards as a
 * node has ranks; MPI_Reduce_scatter over `node` leaves each rank its
 * shard summed over its node, MPI_Allreduce over `cross` sums the shard
 * over the nodes, MPI_Allgatherv over `node` brings the shards together.
 * The link between nodes carries n/L elements per rank instead of n.
 */
#include "collective_impl.h"

#include <limits.h>
#include <stdlib.h>

/* Large allreduces go as a sequence of allreduces of this many bytes: Open
 * MPI's shared-memory allreduce fell from ~7 to ~2.4 GB/s busbw going from
 * 16 to 64 MB in one call here, and kept ~5 GB/s on 1-4 MB pieces of the
 * same 64 MB (bench comm).  Pieces also let AVG divide while the piece is
 * still in cache. */
#define PIECE_BYTES ((size_t)4 << 20)
#define PIECE_ABOVE ((size_t)8 << 20)

typedef struct {
    MPI_Comm comm;
    int32_t size;
    MPI_Op half_ops[2][3]; /* [f16, bf16][sum, max, min] */
    /* the hierarchical allreduce: nodes == 0 when it is off */
    kpl_comm_hierarchy hier;
    int32_t nodes, per_node, node_rank;
    MPI_Comm node, cross;
    int *counts, *displs; /* per_node each: a piece's shards */
    void *shard;          /* this rank's shard of a piece */
    void *recv;           /* a chunk of the ring over `cross` */
    size_t shard_bytes;   /* of each */
} mpi_state;

/* ---- half-precision reductions ------------------------------------------------------ */

#define HALF_OP(name, dt, op)                                                               \
    static void name(void *in, void *inout, int *len, MPI_Datatype *t)                     \
    {                                                                                       \
        (void)t;                                                                            \
        kpl__comm_reduce(inout, in, inout, (size_t)*len, dt, op, 1);                        \
    }
HALF_OP(f16_sum, KPL_F16, KPL_COMM_SUM)
HALF_OP(f16_max, KPL_F16, KPL_COMM_MAX)
HALF_OP(f16_min, KPL_F16, KPL_COMM_MIN)
HALF_OP(bf16_sum, KPL_BF16, KPL_COMM_SUM)
HALF_OP(bf16_max, KPL_BF16, KPL_COMM_MAX)
HALF_OP(bf16_min, KPL_BF16, KPL_COMM_MIN)

static kpl_status mpi_fail(int err, const char *what)
{
    return kpl__comm_mpi_error(err, "MPI %s", what);
}

static void mpi_fini(void *state)
{
    mpi_state *m = state;
    if (!m) return;
    if (m->node != MPI_COMM_NULL) MPI_Comm_free(&m->node);
    if (m->cross != MPI_COMM_NULL) MPI_Comm_free(&m->cross);
    free(m->counts);
    free(m->displs);
    free(m->shard);
    free(m->recv);
    for (int t = 0; t < 2; t++)
        for (int o = 0; o < 3; o++)
            if (m->half_ops[t][o] != MPI_OP_NULL) MPI_Op_free(&m->half_ops[t][o]);
    free(m);
}

/* ---- the hierarchy --------------------------------------------------------------------- */

/* Collective: splits off `node` and `cross` when the layout allows a
 * hierarchy (>= 2 nodes of the same number >= 2 of ranks); every rank
 * comes to the same decision, from the same allreduce. */
static kpl_status hier_init(mpi_state *m, const kpl__comm_boot *boot)
{
    if (boot->hierarchy == KPL_COMM_HIER_OFF || boot->size < 4) return KPL_OK;
    int err = boot->node_ranks > 0
                  ? MPI_Comm_split(m->comm, boot->rank / boot->node_ranks, boot->rank, &m->node)
                  : MPI_Comm_split_type(m->comm, MPI_COMM_TYPE_SHARED, boot->rank,
                                        MPI_INFO_NULL, &m->node);
    if (err != MPI_SUCCESS) return mpi_fail(err, "splitting the nodes off (hierarchy)");
    MPI_Comm_set_errhandler(m->node, MPI_ERRORS_RETURN);
    int per = 0, me = 0;
    MPI_Comm_size(m->node, &per);
    MPI_Comm_rank(m->node, &me);
    int mine[2] = {per, -per}, all[2] = {0, 0}; /* max and -min of the node sizes */
    err = MPI_Allreduce(mine, all, 2, MPI_INT, MPI_MAX, m->comm);
    if (err != MPI_SUCCESS) return mpi_fail(err, "agreeing on the node layout (hierarchy)");
    if (all[0] != -all[1] || per < 2 || boot->size / per < 2) {
        MPI_Comm_free(&m->node); /* uneven nodes, one rank each, or one node: flat */
        return KPL_OK;
    }
    err = MPI_Comm_split(m->comm, me, boot->rank, &m->cross);
    if (err != MPI_SUCCESS) return mpi_fail(err, "splitting the ranks across nodes (hierarchy)");
    MPI_Comm_set_errhandler(m->cross, MPI_ERRORS_RETURN);
    m->counts = calloc((size_t)per, sizeof *m->counts);
    m->displs = calloc((size_t)per, sizeof *m->displs);
    KPL_CHECK(m->counts && m->displs, KPL_ENOMEM, "mpi backend: no memory");
    m->hier = boot->hierarchy;
    m->per_node = per;
    m->node_rank = me;
    m->nodes = boot->size / per;
    return KPL_OK;
}

static int32_t mpi_hierarchy_nodes(void *state) { return ((mpi_state *)state)->nodes; }

static kpl_status mpi_init(const kpl__comm_boot *boot, void **state)
{
    mpi_state *m = calloc(1, sizeof *m);
    KPL_CHECK(m, KPL_ENOMEM, "mpi backend: no memory");
    *state = m;
    m->comm = boot->comm;
    m->size = boot->size;
    m->node = m->cross = MPI_COMM_NULL;
    MPI_User_function *fn[2][3] = {{f16_sum, f16_max, f16_min}, {bf16_sum, bf16_max, bf16_min}};
    for (int t = 0; t < 2; t++)
        for (int o = 0; o < 3; o++) {
            m->half_ops[t][o] = MPI_OP_NULL;
            int err = MPI_Op_create(fn[t][o], 1, &m->half_ops[t][o]);
            if (err != MPI_SUCCESS) return mpi_fail(err, "MPI_Op_create");
        }
    return hier_init(m, boot);
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

/* The allreduce (a SUM, MAX or MIN) of buf's n elements over `cross`
 * as a ring: a reduce-scatter of nodes chunks, then an allgather, with
 * MPI_Sendrecv to the next node and from the previous one.  Each rank
 * sends 2 (nodes - 1) / nodes of the data, and on two nodes both
 * directions of the link carry it at once; Open MPI's own choice for two
 * ranks moved half of that link rate here (bench comm, scale group).
 * Every chunk is reduced on one rank and passed on, so all ranks end
 * with the same bits. */
static int cross_ring(mpi_state *m, char *buf, int n, kpl_dtype dt, kpl_comm_op op)
{
    int nodes = m->nodes, me = 0;
    MPI_Comm_rank(m->cross, &me);
    size_t esize = kpl_dtype_size(dt);
    int right = (me + 1) % nodes, left = (me + nodes - 1) % nodes;
    MPI_Datatype t = mpi_type(dt);
#define CHUNK_AT(c) ((int)((int64_t)n * (c) / nodes))
    for (int s = 0; s < nodes - 1; s++) { /* reduce-scatter */
        int cs = (me - s + nodes) % nodes, cr = (me - s - 1 + 2 * nodes) % nodes;
        int ns = CHUNK_AT(cs + 1) - CHUNK_AT(cs), nr = CHUNK_AT(cr + 1) - CHUNK_AT(cr);
        int err = MPI_Sendrecv(buf + (size_t)CHUNK_AT(cs) * esize, ns, t, right, 0, m->recv, nr, t,
                               left, 0, m->cross, MPI_STATUS_IGNORE);
        if (err != MPI_SUCCESS) return err;
        char *at = buf + (size_t)CHUNK_AT(cr) * esize;
        kpl__comm_reduce(at, at, m->recv, (size_t)nr, dt, op, 1);
    }
    for (int s = 0; s < nodes - 1; s++) { /* allgather: rank me has chunk me + 1 whole */
        int cs = (me + 1 - s + nodes) % nodes, cr = (me - s + nodes) % nodes;
        int ns = CHUNK_AT(cs + 1) - CHUNK_AT(cs), nr = CHUNK_AT(cr + 1) - CHUNK_AT(cr);
        int err = MPI_Sendrecv(buf + (size_t)CHUNK_AT(cs) * esize, ns, t, right, 1,
                               buf + (size_t)CHUNK_AT(cr) * esize, nr, t, left, 1, m->cross,
                               MPI_STATUS_IGNORE);
        if (err != MPI_SUCCESS) return err;
    }
#undef CHUNK_AT
    return MPI_SUCCESS;
}

/* One piece of a hierarchical allreduce: n elements from in (which may
 * be out) into out, through m->shard. */
static int hier_piece(mpi_state *m, const kpl__coll_args *a, const char *in, char *out, size_t n)
{
    MPI_Datatype t = mpi_type(a->dtype);
    MPI_Op op = mpi_op(m, a->dtype, a->op);
    int per = m->per_node, at = 0;
    for (int i = 0; i < per; i++) {
        m->counts[i] = (int)(n / (size_t)per) + (i < (int)(n % (size_t)per));
        m->displs[i] = at;
        at += m->counts[i];
    }
    int mine = m->counts[m->node_rank];
    int err = MPI_Reduce_scatter(in, m->shard, m->counts, t, op, m->node);
    if (err == MPI_SUCCESS) err = cross_ring(m, m->shard, mine, a->dtype, a->op);
    if (err != MPI_SUCCESS) return err;
    if (a->op == KPL_COMM_AVG) kpl__comm_divide(m->shard, (size_t)mine, a->dtype, m->size);
    return MPI_Allgatherv(m->shard, mine, t, out, m->counts, m->displs, t, m->node);
}

/* Allreduce in pieces (see PIECE_BYTES; a hierarchical one in pieces of
 * that per rank of a node); AVG divides each piece. */
static int allreduce(mpi_state *m, const kpl__coll_args *a)
{
    size_t esize = kpl_dtype_size(a->dtype), bytes = a->count * esize;
    bool hier = m->nodes > 0 && (m->hier == KPL_COMM_HIER_ON || bytes >= KPL_COMM_HIER_MIN_BYTES);
    size_t above = hier ? PIECE_ABOVE * (size_t)m->per_node : PIECE_ABOVE;
    size_t piece = bytes > above ? (hier ? PIECE_BYTES * (size_t)m->per_node : PIECE_BYTES) / esize
                                 : a->count;
    if (hier) {
        size_t need = (piece / (size_t)m->per_node + 1) * esize;
        if (need > m->shard_bytes) {
            free(m->shard);
            free(m->recv);
            m->shard = malloc(need), m->recv = malloc(need);
            m->shard_bytes = m->shard && m->recv ? need : 0;
            if (!m->shard_bytes) return MPI_ERR_NO_MEM;
        }
    }
    MPI_Datatype t = mpi_type(a->dtype);
    MPI_Op op = mpi_op(m, a->dtype, a->op);
    for (size_t at = 0; at < a->count; at += piece) {
        size_t n = a->count - at < piece ? a->count - at : piece;
        char *out = (char *)a->out + at * esize;
        const char *src = (const char *)a->in + at * esize;
        if (hier) {
            int err = hier_piece(m, a, src, out, n);
            if (err != MPI_SUCCESS) return err;
            continue;
        }
        const void *in = a->in == a->out ? MPI_IN_PLACE : src;
        int err = MPI_Allreduce(in, out, (int)n, t, op, m->comm);
        if (err != MPI_SUCCESS) return err;
        if (a->op == KPL_COMM_AVG) kpl__comm_divide(out, n, a->dtype, m->size);
    }
    return MPI_SUCCESS;
}

/* Runs the operation with MPI's blocking calls: Open MPI's tuned blocking
 * collectives were 2-100x faster here than its non-blocking ones
 * progressed by MPI_Test (libnbc).  The deadline is kept by the watchdog
 * (comm.c), which gives up on an operation stuck in MPI. */
static kpl_status mpi_run(void *state, const kpl__coll_args *a, double deadline)
{
    (void)deadline;
    mpi_state *m = state;
    KPL_CHECK(a->count <= (size_t)INT_MAX, KPL_ERANGE,
              "mpi backend: %zu elements exceed MPI's int count", a->count);
    int n = (int)a->count, err = MPI_SUCCESS;
    MPI_Datatype t = mpi_type(a->dtype);
    switch (a->kind) {
    case KPL__COLL_ALLREDUCE:
        err = allreduce(m, a);
        break;
    case KPL__COLL_BROADCAST:
        err = MPI_Bcast(a->out, n, t, a->peer, m->comm);
        break;
    case KPL__COLL_ALLGATHER:
        err = MPI_Allgather(a->in, n, t, a->out, n, t, m->comm);
        break;
    case KPL__COLL_REDUCE_SCATTER:
        err = MPI_Reduce_scatter_block(a->in, a->out, n, t, mpi_op(m, a->dtype, a->op), m->comm);
        if (err == MPI_SUCCESS && a->op == KPL_COMM_AVG)
            kpl__comm_divide(a->out, a->count, a->dtype, m->size);
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
    default:
        return KPL_ERROR(KPL_EINVAL, "mpi backend: unknown operation %d", (int)a->kind);
    }
    return err == MPI_SUCCESS ? KPL_OK : mpi_fail(err, kpl__coll_kind_name(a->kind));
}

static const kpl__comm_backend mpi_backend = {
    .name = "mpi",
    .device_type = KPL_DEVICE_CPU,
    .init = mpi_init,
    .fini = mpi_fini,
    .run = mpi_run,
    .hierarchy_nodes = mpi_hierarchy_nodes,
};

const kpl__comm_backend *kpl__comm_mpi_backend(void) { return &mpi_backend; }
