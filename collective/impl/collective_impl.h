/*
 * collective_impl.h — between the generic communicator (comm.c: checks,
 * the work queue, its executor thread, the watchdog) and the backends
 * (mpi/, ucx/, nccl/).
 *
 * Two kinds of backend sit behind one vtable:
 *  - host backends (mpi, ucx) take host memory and run an operation to
 *    completion on the calling thread (`run`);
 *  - stream backends (nccl) take device memory and only enqueue the
 *    operation on a device stream (`enqueue`), completion being observed
 *    through a marker (`query`, `order`).
 */
#ifndef KPL_COLLECTIVE_IMPL_H
#define KPL_COLLECTIVE_IMPL_H

#include "collective.h"

#include <mpi.h>

typedef enum {
    KPL__COLL_ALLREDUCE,
    KPL__COLL_BROADCAST,
    KPL__COLL_ALLGATHER,
    KPL__COLL_REDUCE_SCATTER,
    KPL__COLL_SEND,
    KPL__COLL_RECV,
    KPL__COLL_BARRIER,
    KPL__COLL_KIND_COUNT
} kpl__coll_kind;

/* "allreduce", "broadcast", ... */
const char *kpl__coll_kind_name(kpl__coll_kind k);

/* One operation, as the backend sees it.  Pointers are host pointers for
 * host backends and device pointers for stream backends. */
typedef struct {
    kpl__coll_kind kind;
    const void *in;
    void *out;     /* == in for in-place operations */
    size_t count;  /* elements: allreduce all; allgather/reduce_scatter per rank; others all */
    kpl_dtype dtype;
    kpl_comm_op op; /* AVG included: the backend divides (integers truncating) */
    int32_t peer;   /* root of broadcast, or the peer of send/recv */
    int32_t tag;    /* send/recv, >= 0 */
    uint64_t seq;   /* collectives: their number on this communicator and
                     * queue, the same on every rank (for message tags) */
} kpl__coll_args;

/* What a backend is set up with.  `comm` is a duplicate of the job's
 * communicator made for this backend alone (bootstrap and, for mpi, its
 * traffic); comm.c frees it after fini. */
typedef struct {
    MPI_Comm comm;
    int32_t rank, size, local_rank, local_size;
    kpl_device *device; /* the communicator's device */
    double timeout;     /* seconds, as configured */
    kpl_comm_hierarchy hierarchy; /* kpl_comm_config's, for the backends that have one */
    int32_t node_ranks;
} kpl__comm_boot;

/* A backend.  Members marked optional may be NULL. */
typedef struct {
    const char *name;
    kpl_device_type device_type; /* the tensors it takes */
    /* Collective and blocking: sets the backend up; *state receives its
     * state.  On failure *state may hold a partial state that fini frees. */
    kpl_status (*init)(const kpl__comm_boot *boot, void **state);
    /* Frees the state (NULL allowed); no operation may be in flight.
     * Called on every rank when the communicator is destroyed. */
    void (*fini)(void *state);

    /* Host backends.  Runs *a to completion: blocking, on the calling
     * thread, which is the executor thread or, for a blocking operation on
     * an idle queue, the caller's thread; never two calls at once.  May
     * return KPL_ETIMEOUT (naming the peer waited for) once kpl_seconds()
     * passes `deadline`; the watchdog (comm.c) enforces the deadline
     * anyway, so a backend stuck in a library call cannot hang the job. */
    kpl_status (*run)(void *state, const kpl__coll_args *a, double deadline);

    /* Stream backends (run == NULL).  enqueue queues *a on the backend's
     * stream, after the work already queued on the device's compute stream,
     * and returns at once with a completion marker in *event (caller's
     * thread, serialised by comm.c).  query tells whether the marked work
     * finished, and returns < 0 if the backend reports an asynchronous
     * error (a peer failed); called by the watchdog thread, concurrently
     * with enqueue.  order makes the device's compute stream wait for the
     * marked work, without blocking the host.  event_free releases a marker
     * (its work may still be running).
     * A failed enqueue leaves *event NULL and says in *busy whether the
     * library may still read or write the operation's memory: it had
     * accepted the operation when a later step failed, and the backend
     * could not see its work end (it aborts its communicator, whose
     * kernels then quit, and waits a little for that).  comm.c then keeps
     * the tensors alive for good, so the caching allocator never hands
     * their memory to anyone else. */
    kpl_status (*enqueue)(void *state, const kpl__coll_args *a, void **event, bool *busy);
    kpl_status (*query)(void *state, void *event, bool *done);
    kpl_status (*order)(void *state, void *event);
    void (*event_free)(void *state, void *event);

    /* Optional: abandons work in flight so the process can end (a timeout
     * or a failed peer); from the watchdog thread, possibly while another
     * thread is inside run/enqueue. */
    void (*cancel)(void *state);

    /* Optional, callable before init (no state): writes into buf a text
     * naming the physical device behind `dev` the same way in every
     * process of a node (a GPU's PCI bus id), whatever its number in this
     * process (CUDA_VISIBLE_DEVICES renumbers).  comm.c compares them to
     * refuse two ranks on one device.  Blocking; thread-safe. */
    kpl_status (*device_id)(kpl_device *dev, char *buf, size_t len);

    /* Optional: the number of nodes its hierarchical allreduce spans, 0
     * when it reduces flat (kpl_comm_hierarchy_nodes).  Thread-safe. */
    int32_t (*hierarchy_nodes)(void *state);
} kpl__comm_backend;

const kpl__comm_backend *kpl__comm_mpi_backend(void);
const kpl__comm_backend *kpl__comm_ucx_backend(void);
/* NULL with the reason in kpl_last_error() when the build has no NCCL. */
const kpl__comm_backend *kpl__comm_nccl_backend(void);

/* A failed MPI call as KPL_ECOMM: "<what>: <MPI's text for err>", what
 * formatted like printf (name the call and the module). */
kpl_status kpl__comm_mpi_error(int err, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

/* The watchdog keeps the deadlines and says who is missing; it needs up to
 * KPL__COMM_ANSWER_WAIT to hear from every rank.  A backend that keeps a
 * deadline itself gets this much later, so that the watchdog's diagnosis
 * comes first and the backend's own timeout only lets the call return. */
#define KPL__COMM_ANSWER_WAIT 2.0
#define KPL__COMM_BACKEND_SLACK (KPL__COMM_ANSWER_WAIT + 0.5)

/* ---- agreeing on the devices before any backend starts (comm.c) ------------------- */

/* What each rank tells the others before a backend is set up, in one
 * MPI_Allgather: backend set-ups are collective (NCCL's starts with an
 * MPI_Comm_dup and an allreduce), so a rank must not start one that some
 * of its peers will never join. */
typedef struct {
    int32_t kind;    /* kpl_device_type; -1: this rank could not open its device */
    int32_t index;   /* N of cuda:N */
    int32_t node;    /* the lowest world rank of this rank's node: equal on one node */
    int32_t gpus;    /* CUDA GPUs this process sees */
    char gpu_id[32]; /* the GPU's PCI bus id when NCCL is to use it, else "" */
} kpl__comm_rank_device;

/* The verdict on every rank's device, the same on every rank (pure; for
 * tests): KPL_OK, or KPL_EDEVICE naming the ranks that could not open
 * their device, the ranks on each kind of device when they differ, or two
 * ranks of a node that would share one GPU under NCCL (which does not
 * support it: it may hang).  `backend` is the configured one: nccl and
 * auto use NCCL when every rank is on CUDA. */
kpl_status kpl__comm_check_devices(const kpl__comm_rank_device *all, int32_t size,
                                   kpl_comm_backend backend);

/* ---- reductions on host memory (reduce.c), for the host backends ------------------ */

/* dst[i] = (a[i] op b[i]) for `count` elements, then divided by `divide`
 * when divide > 1 (the last step of an AVG; integers truncate).  AVG
 * reduces as SUM.  dst may alias a or b.  f32/f64/f16/bf16/i32/i64;
 * f16/bf16 compute in f32 and round to nearest even.  max/min propagate
 * NaN. */
void kpl__comm_reduce(void *dst, const void *a, const void *b, size_t count, kpl_dtype dt,
                      kpl_comm_op op, int32_t divide);
/* out[i] /= n (the AVG of a SUM already in place). */
void kpl__comm_divide(void *out, size_t count, kpl_dtype dt, int32_t n);

/* ---- the communicator's state (comm.c, watchdog.c) ---------------------------------- */

#include <pthread.h>

#define KPL__COMM_HOST_LEN 64

/* One backend in use and its state. */
typedef struct {
    const kpl__comm_backend *be; /* NULL: none for this kind of tensor */
    void *state;
    MPI_Comm mpi; /* its duplicate of the job's communicator */
} kpl__comm_slot;

struct kpl_comm_work {
    kpl__coll_args a;
    const kpl__comm_slot *slot;
    kpl_tensor *keep[2]; /* retained until destroy */
    kpl_status st;
    char msg[1024];
    bool done;
    double issued;      /* when it was queued or enqueued */
    double started;     /* host work: when the backend began it (set when done) */
    double ran;         /* host work: seconds the backend took (set when done) */
    kpl_comm_work *next; /* the host queue */
    /* stream work only */
    void *event;         /* the backend's completion marker */
    bool ordered;        /* the compute stream already waits for it */
    kpl_comm_work *snext; /* stream work not yet seen complete (the watchdog's list) */
    kpl_comm *comm;
};

/* The host operation in progress, for the watchdog and the stall inspector. */
typedef struct {
    kpl__coll_args a;
    double started; /* 0: none */
    bool direct;    /* on the caller's thread: cannot give up before the library returns */
} kpl__comm_running;

struct kpl_comm {
    /* Set by create, read-only afterwards. */
    int32_t rank, size, local_rank, local_size;
    kpl_device *device;
    double timeout, stall_warning;
    kpl_comm_hierarchy hierarchy;
    int32_t node_ranks;
    void (*report)(const char *line, void *user);
    void *report_user;
    bool finalize_mpi; /* kpl initialised MPI */
    bool inspect;      /* MPI runs at MPI_THREAD_MULTIPLE: the watchdog may call it */
    MPI_Comm insp;     /* the stall inspector's queries and answers */
    char (*hosts)[KPL__COMM_HOST_LEN]; /* every rank's host name, for reports */
    kpl__comm_slot host, dev;

    pthread_mutex_t mu; /* guards everything below */
    pthread_cond_t cv_queue; /* the executor: work queued, or the direct call ended */
    pthread_cond_t cv_done;  /* waiters: work finished, or the communicator is stuck */
    pthread_cond_t cv_watch; /* the watchdog: stop */
    pthread_t executor, watchdog;
    bool executor_live, watchdog_live, stop, watch_stop;
    struct kpl__watchdog *wd; /* the watchdog's own state (watchdog.c) */
    kpl_comm_work *head, *tail;  /* host work not yet started */
    kpl__comm_running run;
    uint64_t host_issued, host_done; /* collectives on the host queue */
    double host_done_at;             /* when the last one finished (create: start) */
    uint64_t dev_issued, dev_done;
    kpl_comm_work *streams;          /* stream work in flight */
    bool stuck; /* an operation timed out: the ranks are out of step for good */
    char stuck_msg[1536];
};

/* "allreduce #42 (f32, 1000 elements) on backend mpi, rank 1 of 4" and
 * the like, into buf. */
void kpl__comm_describe(const kpl_comm *c, const kpl__coll_args *a, const char *backend,
                        char *buf, size_t len);
/* Whether an operation kind is a collective (numbered) rather than
 * point-to-point. */
bool kpl__coll_is_collective(kpl__coll_kind k);
/* Polls stream work under c->mu: marks it done (or failed, with the
 * backend's asynchronous error) and returns its status. */
kpl_status kpl__comm_stream_poll(kpl_comm_work *w);
/* A report line through cfg.report or to standard error. */
void kpl__comm_report(const kpl_comm *c, const char *line);
/* Marks the communicator stuck with `msg` (once; under c->mu) and wakes
 * every waiter. */
void kpl__comm_mark_stuck(kpl_comm *c, const char *msg);

/* The watchdog thread (watchdog.c): started by create, stopped by destroy. */
kpl_status kpl__comm_watchdog_start(kpl_comm *c);
void kpl__comm_watchdog_stop(kpl_comm *c);

#endif /* KPL_COLLECTIVE_IMPL_H */
