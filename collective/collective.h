/*
 * collective.h — communication between the ranks of a data-parallel job
 * (MegRay-style): one communicator per job, collectives on tensors, each
 * with an asynchronous form returning a work handle.
 *
 *   MPI_Init_thread(...);                     // or let kpl_comm_create do it
 *   kpl_comm_config cfg = KPL_COMM_CONFIG_INIT;
 *   kpl_comm *comm = NULL;
 *   kpl_comm_create(&cfg, &comm);             // collective: every rank calls it
 *   kpl_comm_allreduce(comm, grad, grad, KPL_COMM_AVG);   // in place
 *   kpl_comm_work *w;
 *   kpl_comm_allreduce_async(comm, bucket, bucket, KPL_COMM_SUM, &w);
 *   ... compute ...
 *   kpl_comm_work_wait(w);                    // then kpl_comm_work_destroy(w)
 *   kpl_comm_destroy(comm);
 *
 * Operations run on a communication thread per communicator, in the order
 * they were issued (every rank must issue the same collectives in the same
 * order), so asynchronous work overlaps the caller's computation.  Every
 * wait has a deadline (cfg.timeout): a peer that never joins gives
 * KPL_ETIMEOUT naming the operation, backend and ranks, never a hang; the
 * caller should then end the job (kpl_comm_abort).
 *
 * Tensors are host (CPU) tensors for the mpi backend, contiguous; `in` and
 * `out` may be the same tensor (in place).
 */
#ifndef KPL_COLLECTIVE_H
#define KPL_COLLECTIVE_H

#include "kernels.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum { KPL_COMM_SUM, KPL_COMM_AVG, KPL_COMM_MAX, KPL_COMM_MIN } kpl_comm_op;

typedef enum {
    KPL_COMM_BACKEND_AUTO, /* nccl for CUDA tensors, mpi for host tensors */
    KPL_COMM_BACKEND_MPI,
    KPL_COMM_BACKEND_UCX,
    KPL_COMM_BACKEND_NCCL,
} kpl_comm_backend;

/* "sum", "avg", "max", "min"; "auto", "mpi", "ucx", "nccl". */
const char *kpl_comm_op_name(kpl_comm_op op);
const char *kpl_comm_backend_name(kpl_comm_backend b);

typedef struct {
    kpl_comm_backend backend;
    double timeout; /* seconds any wait may take before KPL_ETIMEOUT (> 0) */
} kpl_comm_config;
#define KPL_COMM_CONFIG_INIT {KPL_COMM_BACKEND_AUTO, 300.0}

typedef struct kpl_comm kpl_comm;
typedef struct kpl_comm_work kpl_comm_work;

/* Creates the communicator over MPI_COMM_WORLD (initialising MPI with
 * thread support if nobody did; then kpl_comm_destroy finalises it).
 * Collective and blocking.  *out owned by the caller. */
kpl_status kpl_comm_create(const kpl_comm_config *cfg, kpl_comm **out);
/* Stops the communication thread after the queued work and frees comm;
 * collective when it finalises MPI.  NULL is a no-op. */
void kpl_comm_destroy(kpl_comm *comm);
/* Ends the whole job at once (MPI_Abort) with `code`: for a rank that got
 * an error from a collective, so that its peers do not wait forever. */
void kpl_comm_abort(kpl_comm *comm, int code) __attribute__((noreturn));

int32_t kpl_comm_rank(const kpl_comm *comm);
int32_t kpl_comm_size(const kpl_comm *comm);
/* Rank and rank count among the processes of this node. */
int32_t kpl_comm_local_rank(const kpl_comm *comm);
int32_t kpl_comm_local_size(const kpl_comm *comm);

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

/* Blocks until the work is done; returns its status (the message names the
 * operation and backend on failure). */
kpl_status kpl_comm_work_wait(kpl_comm_work *work);
/* Non-blocking: *done tells whether it finished; returns its status when
 * done, KPL_OK otherwise. */
kpl_status kpl_comm_work_test(kpl_comm_work *work, bool *done);
/* Waits if needed, then frees.  NULL is a no-op. */
void kpl_comm_work_destroy(kpl_comm_work *work);

/* ---- the bucketed gradient allreduce (the DDP reducer) ----------------------------- */
/*
 * Parameters are assigned to buckets of about bucket_mb (the first one
 * first_bucket_mb) in reverse registration order (backward produces the
 * last layers' gradients first).  Each bucket is one flat buffer and the
 * gradient of every parameter is a view into it (kpl_bucketer_grad): write
 * or accumulate gradients there, no copies.  When the last gradient of a
 * bucket is marked ready its allreduce (AVG) starts at once, buckets in
 * index order; kpl_bucketer_finish waits for them all.  After the first
 * step the buckets are rebuilt from the order in which gradients became
 * ready on rank 0 (every rank uses the same), so fetch the grad views again
 * after each finish.  A parameter never marked in a step (unused) has its
 * gradient zeroed and reduced at finish, never waited for.
 *
 *   kpl_bucketer_create(comm, n, params, NULL, &b);
 *   kpl_bucketer_broadcast_params(b);            // all ranks start equal
 *   each step:  backward writes kpl_bucketer_grad(b, i), then
 *               kpl_bucketer_mark_ready(b, i) (from the gradient hook);
 *               kpl_bucketer_finish(b); optimizer step.
 */
typedef struct {
    double bucket_mb;       /* > 0 */
    double first_bucket_mb; /* > 0 */
} kpl_bucketer_config;
#define KPL_BUCKETER_CONFIG_INIT {25.0, 1.0}

typedef struct kpl_bucketer kpl_bucketer;

/* params: n host tensors of one floating dtype, in registration order
 * (retained).  Gradients start at zero.  *out owned by the caller. */
kpl_status kpl_bucketer_create(kpl_comm *comm, int n, kpl_tensor *const *params,
                               const kpl_bucketer_config *cfg, kpl_bucketer **out);
void kpl_bucketer_destroy(kpl_bucketer *b);
/* Rank 0's parameter values to every rank (blocking, collective). */
kpl_status kpl_bucketer_broadcast_params(kpl_bucketer *b);
/* Where parameter i's gradient lives (borrowed; valid until the next
 * kpl_bucketer_finish). */
kpl_tensor *kpl_bucketer_grad(kpl_bucketer *b, int i);
/* With sync false (gradient accumulation micro-steps) marking starts no
 * communication and finish reduces nothing; set it true for the last. */
void kpl_bucketer_set_sync(kpl_bucketer *b, bool sync);
/* Gradient i is final for this step; may start its bucket's allreduce. */
kpl_status kpl_bucketer_mark_ready(kpl_bucketer *b, int i);
/* Reduces what is left (unused parameters' gradients zeroed), waits for
 * every bucket, and prepares the next step.  Collective. */
kpl_status kpl_bucketer_finish(kpl_bucketer *b);
int kpl_bucketer_num_buckets(const kpl_bucketer *b);
/* The bucket holding parameter i. */
int kpl_bucketer_bucket_of(const kpl_bucketer *b, int i);

#ifdef __cplusplus
}
#endif
#endif /* KPL_COLLECTIVE_H */
