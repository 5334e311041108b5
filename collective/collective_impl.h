/*
 * collective_impl.h — between the generic communicator (comm.c: checks,
 * the work queue and its thread) and the backends (mpi/, later ucx/, nccl/).
 */
#ifndef KPL_COLLECTIVE_IMPL_H
#define KPL_COLLECTIVE_IMPL_H

#include "collective.h"

typedef enum {
    KPL__COLL_ALLREDUCE,
    KPL__COLL_BROADCAST,
    KPL__COLL_ALLGATHER,
    KPL__COLL_REDUCE_SCATTER,
    KPL__COLL_SEND,
    KPL__COLL_RECV,
    KPL__COLL_BARRIER,
} kpl__coll_kind;

/* One queued operation, as the backend sees it.  Counts are elements. */
typedef struct {
    kpl__coll_kind kind;
    const void *in;
    void *out;
    size_t count;  /* allreduce: all; allgather/reduce_scatter: per rank; others: all */
    kpl_dtype dtype;
    kpl_comm_op op; /* AVG arrives as SUM: comm.c divides afterwards */
    int32_t peer;   /* root, or the peer of send/recv */
    int32_t tag;
} kpl__coll_args;

/* A backend.  Members run on the communicator's thread only (one at a
 * time) and block until done.  `deadline` (CLOCK_MONOTONIC seconds) is a
 * hint a backend may honour by returning KPL_ETIMEOUT; the waiting side
 * enforces it regardless (comm.c), so a backend stuck in a library call
 * cannot hang the caller. */
typedef struct {
    const char *name;
    /* Collective: sets up the backend over MPI_COMM_WORLD; fills rank, size
     * and the node-local rank and size. */
    kpl_status (*init)(void **state, int32_t *rank, int32_t *size, int32_t *local_rank,
                       int32_t *local_size);
    void (*fini)(void *state);
    kpl_status (*run)(void *state, const kpl__coll_args *a, double deadline);
    void (*abort)(void *state, int code) __attribute__((noreturn));
} kpl__comm_backend;

const kpl__comm_backend *kpl__comm_mpi_backend(void);

/* Seconds on CLOCK_MONOTONIC. */
double kpl__comm_now(void);

#endif /* KPL_COLLECTIVE_IMPL_H */
