/*
 * collective.h — communication between the ranks of a data-parallel job
 * (MegRay-style): one communicator per job, collectives on tensors, each
 * with an asynchronous form returning a work handle.
 *
 *   MPI_Init_thread(..., MPI_THREAD_MULTIPLE, ...);  // or let kpl_comm_create
 *   kpl_comm_config cfg = KPL_COMM_CONFIG_INIT;
 *   kpl_comm *comm = NULL;
 *   kpl_comm_create(&cfg, &comm);             // collective: every rank calls it
 *   kpl_comm_allreduce(comm, grad, grad, KPL_COMM_AVG);   // in place
 *   kpl_comm_work *w;
 *   kpl_comm_allreduce_async(comm, bucket, bucket, KPL_COMM_SUM, &w);
 *   ... compute ...
 *   kpl_comm_work_wait(w);                    // then kpl_comm_work_destroy(w)
 *   kpl_comm_destroy(comm);                   // collective
 *
 * Backends.  Host tensors go to the host backend: `mpi` (Open MPI's
 * collectives) or `ucx` (kpl's ring over UCP).  CUDA tensors go to `nccl`
 * on a communication stream of the communicator's device.  `auto` (the
 * default) is mpi + nccl; naming mpi or ucx sends CUDA tensors nowhere (an
 * error), naming nccl keeps mpi for host tensors.
 *
 * Order.  Every rank must issue the same collectives in the same order.
 * Host operations run in issue order: asynchronous ones on a communication
 * thread (so they overlap the caller's computation), a blocking one on the
 * caller's thread when nothing is queued (no thread hand-over for small
 * messages).  CUDA operations are queued on the device in issue order and
 * never block the host: waiting for one orders the device's compute stream
 * after it.
 *
 * Failure.  Nothing waits forever.  A watchdog thread follows the
 * operation in progress: after cfg.stall_warning seconds it asks every rank
 * what it is doing and reports which ranks have not joined (the stall
 * inspector); after cfg.timeout the operation fails with KPL_ETIMEOUT and a
 * message naming the operation, backend and ranks.  Waits on asynchronous
 * work return that status (end the job then: kpl_comm_abort).  A blocking
 * call cannot return from inside the MPI or NCCL library, so there the
 * watchdog reports and ends the job itself (exit status 124).  A
 * communicator that timed out is broken: later calls fail at once.
 *
 * Differences between backends.  NCCL has no message tags: sends and
 * receives between two ranks match in the order each rank issues them, and
 * the tag is not checked.  NCCL's max/min on floats drop a NaN (CUDA's
 * fmax), the host backends propagate it.  kpl_comm_barrier synchronises the
 * host processes (host backend), not the GPU queues.
 *
 * Tensors are contiguous; `in` and `out` may be the same tensor (in place).
 * A communicator is used by one thread at a time (its own threads aside).
 */
#ifndef KPL_COLLECTIVE_H
#define KPL_COLLECTIVE_H

#include "kernels.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum { KPL_COMM_SUM, KPL_COMM_AVG, KPL_COMM_MAX, KPL_COMM_MIN } kpl_comm_op;

/* auto: nccl for CUDA tensors, mpi for host tensors */
#define KPL_COMM_BACKENDS(X)                                                            \
    X(KPL_COMM_BACKEND_AUTO, "auto") X(KPL_COMM_BACKEND_MPI, "mpi")                      \
    X(KPL_COMM_BACKEND_UCX, "ucx") X(KPL_COMM_BACKEND_NCCL, "nccl")
typedef enum { KPL_COMM_BACKENDS(KPL_ENUM_VALUE) } kpl_comm_backend;

/* How the mpi backend's allreduce spans nodes (kpl_comm_config.hierarchy). */
#define KPL_COMM_HIERARCHIES(X)                                                         \
    X(KPL_COMM_HIER_OFF, "off") X(KPL_COMM_HIER_AUTO, "auto") X(KPL_COMM_HIER_ON, "on")
typedef enum { KPL_COMM_HIERARCHIES(KPL_ENUM_VALUE) } kpl_comm_hierarchy;
/* AUTO takes the hierarchical allreduce from this many bytes up: below it
 * the three steps' latencies cost more than the link time they save. */
#define KPL_COMM_HIER_MIN_BYTES ((size_t)256 << 10)

/* "sum", "avg", "max", "min"; kpl_comm_backend_names (NULL-terminated),
 * _name, _parse (-1 for other names). */
const char *kpl_comm_op_name(kpl_comm_op op);
KPL_ENUM_DECLARE(kpl_comm_backend);
KPL_ENUM_DECLARE(kpl_comm_hierarchy);

typedef struct {
    kpl_comm_backend backend;
    double timeout;       /* seconds any operation may take before KPL_ETIMEOUT (> 0) */
    double stall_warning; /* seconds before the stall inspector reports (0: never) */
    const char *device;   /* "cpu", "cuda:N", or NULL: cuda:(local rank % GPUs) when
                           * the machine has GPUs, else cpu */
    /* Where stall and timeout reports go (one line each, from the watchdog
     * thread); NULL: standard error, prefixed "kpl[rank]". */
    void (*report)(const char *line, void *user);
    void *report_user;
    /* The hierarchical allreduce of the mpi backend (host tensors; NCCL
     * builds its own rings and trees over the nodes, the ucx backend's
     * ring stays flat): reduce-scatter inside each node over shared
     * memory, allreduce of each shard between the ranks that hold it on
     * the other nodes, allgather inside the node.  Each rank then sends
     * 1/(ranks per node) of the data over the link between the nodes,
     * where a flat ring sends all of it from every rank.  OFF (the
     * default): flat, MPI_Allreduce, which Open MPI already runs
     * node-aware enough on ranks placed by node (its recursive halving
     * pairs neighbours first): on the simulated cluster the hierarchical
     * one reached 0.66-0.96x its busbw (docs/collective.md).  AUTO: when the
     * job spans >= 2 nodes with the same number >= 2 of ranks each, for
     * allreduces of KPL_COMM_HIER_MIN_BYTES and more; ON: every allreduce
     * when the layout allows it (it falls back to flat otherwise).
     * kpl_comm_hierarchy_nodes says whether it was taken. */
    kpl_comm_hierarchy hierarchy;
    /* What a node is: 0, the ranks that share memory (the launcher's
     * layout); N > 0, each run of N consecutive ranks (a box split by
     * socket, or one machine standing in for several in tests). */
    int32_t node_ranks;
} kpl_comm_config;
#define KPL_COMM_CONFIG_INIT {KPL_COMM_BACKEND_AUTO, 300.0, 60.0, NULL, NULL, NULL, KPL_COMM_HIER_OFF, 0}

/* Exit status of a job the watchdog ends (a blocking call timed out). */
#define KPL_COMM_TIMEOUT_EXIT 124

typedef struct kpl_comm kpl_comm;
typedef struct kpl_comm_work kpl_comm_work;

/* Creates the communicator over MPI_COMM_WORLD (initialising MPI with
 * MPI_THREAD_MULTIPLE if nobody did; then kpl_comm_destroy finalises it).
 * MPI initialised by the caller must run at MPI_THREAD_SERIALIZED at least;
 * the stall inspector needs MPI_THREAD_MULTIPLE and is off below it.
 * Before any backend starts, the ranks tell each other their devices; it
 * fails on every rank (KPL_EDEVICE, naming the ranks) when a rank could
 * not open its device (that rank keeps its own error), when the ranks
 * are not all on the same kind of device, or when NCCL would drive one
 * GPU from two ranks of a node, which NCCL does not support.
 * Collective and blocking.  *out owned by the caller. */
kpl_status kpl_comm_create(const kpl_comm_config *cfg, kpl_comm **out);
/* Finishes the queued work, stops the threads and frees comm.  Collective.
 * NULL is a no-op. */
void kpl_comm_destroy(kpl_comm *comm);
/* Ends the whole job at once (MPI_Abort) with `code`: for a rank that got
 * an error from a collective, so that its peers do not wait forever. */
void kpl_comm_abort(kpl_comm *comm, int code) __attribute__((noreturn));

int32_t kpl_comm_rank(const kpl_comm *comm);
int32_t kpl_comm_size(const kpl_comm *comm);
/* Rank and rank count among the processes of this node. */
int32_t kpl_comm_local_rank(const kpl_comm *comm);
int32_t kpl_comm_local_size(const kpl_comm *comm);
/* The number of nodes in the hierarchical allreduce's layout (ranks per
 * node = size / that), or 0 when the host backend's allreduce is flat. */
int32_t kpl_comm_hierarchy_nodes(const kpl_comm *comm);
/* The communicator's device (CUDA tensors must live there). */
kpl_device *kpl_comm_device(const kpl_comm *comm);
/* The backend that takes tensors of `type` ("mpi", "ucx", "nccl"), or NULL
 * when this communicator has none for it. */
const char *kpl_comm_backend_for(const kpl_comm *comm, kpl_device_type type);

/* Blocking collectives: the async form followed by a wait.  out and in
 * have the same dtype; shapes as each comment says (numel counts). */
/* out = op over ranks of in (same numel).  AVG divides the sum by the
 * size (integers: truncating). */
kpl_status kpl_comm_allreduce(kpl_comm *comm, kpl_tensor *in, kpl_tensor *out, kpl_comm_op op);
/* t on every rank = t on root. */
kpl_status kpl_comm_broadcast(kpl_comm *comm, kpl_tensor *t, int32_t root);
/* out (size * numel(in)) = in of rank 0, then rank 1, ... */
kpl_status kpl_comm_allgather(kpl_comm *comm, kpl_tensor *in, kpl_tensor *out);
/* out (numel(in) / size) = this rank's block of op over ranks of in. */
kpl_status kpl_comm_reduce_scatter(kpl_comm *comm, kpl_tensor *in, kpl_tensor *out,
                                   kpl_comm_op op);
/* Point to point (tag >= 0); a send matches the peer's recv of the same tag. */
kpl_status kpl_comm_send(kpl_comm *comm, kpl_tensor *t, int32_t peer, int32_t tag);
kpl_status kpl_comm_recv(kpl_comm *comm, kpl_tensor *t, int32_t peer, int32_t tag);
kpl_status kpl_comm_barrier(kpl_comm *comm);

/* Asynchronous forms: queue the operation and return at once with *work
 * (owned by the caller: wait or test, then kpl_comm_work_destroy).  The
 * tensors must stay alive and unchanged (in) / untouched (out) until the
 * work is complete. */
kpl_status kpl_comm_allreduce_async(kpl_comm *comm, kpl_tensor *in, kpl_tensor *out,
                                    kpl_comm_op op, kpl_comm_work **work);
kpl_status kpl_comm_broadcast_async(kpl_comm *comm, kpl_tensor *t, int32_t root,
                                    kpl_comm_work **work);
kpl_status kpl_comm_allgather_async(kpl_comm *comm, kpl_tensor *in, kpl_tensor *out,
                                    kpl_comm_work **work);
kpl_status kpl_comm_reduce_scatter_async(kpl_comm *comm, kpl_tensor *in, kpl_tensor *out,
                                         kpl_comm_op op, kpl_comm_work **work);

/* Host work: blocks until it is done.  CUDA work: orders the device's
 * compute stream after it and returns at once (the host does not wait).
 * Returns its status; the message names the operation, backend and ranks
 * on failure. */
kpl_status kpl_comm_work_wait(kpl_comm_work *work);
/* Non-blocking: *done tells whether it finished (CUDA work: on the device);
 * returns its status when done, KPL_OK otherwise. */
kpl_status kpl_comm_work_test(kpl_comm_work *work, bool *done);
/* Seconds the backend spent on finished host work (from its start on the
 * communication thread to its end); -1 while it runs, and for CUDA work. */
double kpl_comm_work_seconds(kpl_comm_work *work);
/* When finished host work was issued, started by the backend and ended,
 * in kpl_seconds(); KPL_ESTATE while it runs, and for CUDA work (whose
 * device times the host does not see). */
kpl_status kpl_comm_work_times(kpl_comm_work *work, double *issued, double *started,
                               double *ended);
/* Waits if needed, then frees.  NULL is a no-op. */
void kpl_comm_work_destroy(kpl_comm_work *work);

/* ---- the bucketed gradient allreduce (the DDP reducer) ----------------------------- */
/*
 * Parameters are assigned to buckets of about bucket_mb (the first one
 * first_bucket_mb) in reverse registration order (backward produces the
 * last layers' gradients first).  Each bucket is one flat buffer on the
 * parameters' device and the gradient of every parameter is a view into it
 * (kpl_bucketer_grad): write or accumulate gradients there, no copies.
 * When the last gradient of a bucket is marked ready its allreduce (AVG)
 * starts at once, buckets in index order; kpl_bucketer_finish waits for
 * them all.  After the first step the buckets are rebuilt from the order in
 * which gradients became ready on rank 0 (every rank uses the same), so
 * fetch the grad views again after each finish.  A parameter never marked
 * in a step (unused) has its gradient zeroed and reduced at finish, never
 * waited for.  With check_params, the finish after the first synchronised
 * step (when the optimizer has moved the parameters once) first checks
 * that every rank holds bit-identical parameters.
 *
 *   kpl_bucketer_create(comm, n, params, NULL, &b);
 *   kpl_bucketer_broadcast_params(b);            // all ranks start equal
 *   each step:  backward writes kpl_bucketer_grad(b, i), then
 *               kpl_bucketer_mark_ready(b, i) (from the gradient hook);
 *               kpl_bucketer_finish(b); optimizer step.
 *
 * ddp.h's kpl_ddp connects this to autograd.  Not thread-safe: one
 * thread drives a bucketer (backward's ready hooks run on that thread).
 */
typedef struct {
    /* MB per bucket (>= 0).  0, or less than any gradient: one bucket per
     * gradient, the per-tensor allreduce (for comparison; many small
     * allreduces pay the latency many times). */
    double bucket_mb;
    double first_bucket_mb; /* >= 0, the same for the first bucket */
    bool check_params;      /* check the ranks agree after the first step */
    /* The dtype the gradients are summed over the ranks in.  KPL_F32 (the
     * default): the parameters' own dtype, nothing converted.  KPL_BF16
     * or KPL_F16 with f32 parameters: each bucket is cast into a copy of
     * that dtype, summed over the ranks in it (half the bytes to move),
     * cast back to f32 and divided by the rank count in f32.  Per element
     * the average then differs from f32's by at most about size * 2^-8
     * (bf16) or size * 2^-11 (f16) times the mean of the ranks' |g|; f16
     * overflows to +-inf beyond 65504 (docs/collective.md). */
    kpl_dtype grad_dtype;
    /* true: no allreduce starts during backward; finish starts them all
     * and waits (communication not overlapped with computation: for
     * measuring what the overlap gains, or when the backward's threads
     * and the communication fight for too few cores). */
    bool after_backward;
} kpl_bucketer_config;
#define KPL_BUCKETER_CONFIG_INIT {25.0, 1.0, true, KPL_F32, false}

typedef struct kpl_bucketer kpl_bucketer;

/* params: n tensors of one floating dtype on one device, the host or the
 * communicator's GPU, in registration order (retained).  Gradients start
 * at zero.  *out owned by the caller. */
kpl_status kpl_bucketer_create(kpl_comm *comm, int n, kpl_tensor *const *params,
                               const kpl_bucketer_config *cfg, kpl_bucketer **out);
void kpl_bucketer_destroy(kpl_bucketer *b);
/* Rank 0's parameter values to every rank (blocking, collective). */
kpl_status kpl_bucketer_broadcast_params(kpl_bucketer *b);
/* Whether every rank holds bit-identical parameters (blocking,
 * collective): KPL_ESTATE naming the first parameter that differs and the
 * ranks that differ from rank 0. */
kpl_status kpl_bucketer_check_params(kpl_bucketer *b);
/* Where parameter i's gradient lives (borrowed; valid until the next
 * kpl_bucketer_finish). */
kpl_tensor *kpl_bucketer_grad(kpl_bucketer *b, int i);
/* With sync false (gradient accumulation micro-steps) marking starts no
 * communication and finish reduces nothing; set it true for the last. */
void kpl_bucketer_set_sync(kpl_bucketer *b, bool sync);
bool kpl_bucketer_sync(const kpl_bucketer *b);
/* Gradient i is final for this step; may start its bucket's allreduce. */
kpl_status kpl_bucketer_mark_ready(kpl_bucketer *b, int i);
/* Reduces what is left (unused parameters' gradients zeroed), waits for
 * every bucket, and prepares the next step.  Collective. */
kpl_status kpl_bucketer_finish(kpl_bucketer *b);
/* Every gradient back to zero: one fill per bucket (the views stay where
 * they are).  No communication; not while a step's allreduces are in
 * flight (between the first mark_ready and finish). */
kpl_status kpl_bucketer_zero_grads(kpl_bucketer *b);
int kpl_bucketer_num_buckets(const kpl_bucketer *b);
/* The bucket holding parameter i. */
int kpl_bucketer_bucket_of(const kpl_bucketer *b, int i);

/* How much of the communication backward hid: comm_seconds is the
 * backends' time on the bucket allreduces (host backends; CUDA work is not
 * timed), wait_seconds the time finish spent waiting for them, so
 * 1 - wait / comm is the fraction overlapped with computation. */
typedef struct {
    int64_t steps; /* synchronised finishes */
    int64_t bytes; /* gradient bytes reduced (in grad_dtype) */
    double comm_seconds;
    double wait_seconds;
} kpl_bucketer_stats;
kpl_bucketer_stats kpl_bucketer_get_stats(const kpl_bucketer *b);

/* When each bucket of the last synchronised finish moved, in kpl_seconds()
 * (monotonic): for step profiles and timelines. */
typedef struct {
    int64_t bytes;  /* moved (in grad_dtype) */
    double ready;   /* its last gradient was marked ready (or finish began: unused
                     * parameters, after_backward) */
    double issued;  /* its allreduce was handed to the communicator */
    double started; /* the backend began it; CUDA work: = issued */
    double ended;   /* the backend finished it; CUDA work: when finish returned */
} kpl_bucket_timing;
/* The timings of the last synchronised finish, one per bucket in issue
 * order (*n of them; 0 before the first).  The array belongs to the
 * bucketer and is valid until its next finish or destroy. */
const kpl_bucket_timing *kpl_bucketer_timings(const kpl_bucketer *b, int *n);
void kpl_bucketer_reset_stats(kpl_bucketer *b);

#ifdef __cplusplus
}
#endif
#endif /* KPL_COLLECTIVE_H */
