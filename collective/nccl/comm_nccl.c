/*
 * comm_nccl.c — the nccl backend: NCCL collectives on CUDA memory, queued
 * on a communication stream of the communicator's device so that they
 * overlap the computation queued on the device's compute stream.
 *
 * Streams and events.  The backend owns one non-blocking stream (no
 * implicit ordering with the legacy default stream, which kpl never uses),
 * created at the device's highest priority so that NCCL's blocks are
 * scheduled as soon as backward's kernels free a multiprocessor.  Each
 * operation is ordered after the work already queued on the compute stream
 * (an event recorded there and awaited on ours: the tensors may still be
 * being written), issued on our stream, and followed by a completion event
 * recorded on our stream.  That event is the marker comm.c keeps: query
 * polls it, order makes the compute stream wait for it.  Nothing here waits
 * for the GPU.  Completion events are recycled through a small pool.
 *
 * The communicator is non-blocking (ncclConfig_t.blocking = 0): no NCCL
 * call blocks the host waiting for a peer.  A call may instead return
 * ncclInProgress (NCCL is still connecting to a peer, typically the first
 * time two ranks talk); enqueue then polls ncclCommGetAsyncError, as NCCL
 * requires before any further call or any further work on the stream, for
 * at most the configured timeout.  Between polls it lets go of the lock, so
 * the watchdog can abort the communicator meanwhile.
 *
 * Locking.  Every NCCL call on the communicator is made under `mu`: NCCL
 * communicators are not thread-safe, and even ncclCommGetAsyncError
 * changes the communicator (it completes a finished non-blocking group
 * job), while the watchdog thread calls query concurrently with enqueue on
 * the caller's thread and cancel may come from any thread.  `mu` is held
 * only across calls that return at once, never across a wait, so cancel
 * gets it within one short NCCL call.  Lock order: comm.c's lock, then
 * `mu`; `mu` and `pool_mu` are never held together.
 *
 * AVG.  ncclAvg is valid for every dtype kpl reduces.  For the floating
 * types NCCL scales by 1/size; for the integer types it sums in the integer
 * type and divides the result by the rank count, truncating toward zero (it
 * divides the magnitude and restores the sign) — kpl's rule (reduce.c) —
 * within the same kernel, so nothing more runs on the stream.
 *
 * A world of one rank averages with ncclSum, which is the same there: NCCL
 * 2.28's one-rank kernel for ncclAvg (oneRankReduce, its PreMulSum path)
 * splits the elements into per-block runs of a whole number of 16-byte
 * packs and leaves the rest unwritten (the first GPU run, docs/gpu.md:
 * elements 262144..262146 of 262147 f32 stayed 0), where a one-rank sum is
 * a plain copy.
 *
 * MAX and MIN on floating types follow CUDA's fmax/fmin: a NaN loses to a
 * number, where the host backends (reduce.c) propagate it.
 *
 * Failures after NCCL took an operation.  Once ncclAllReduce & co. return
 * ncclSuccess or ncclInProgress, NCCL's kernels may be queued on our
 * stream, reading and writing the tensors.  If a later step fails (the
 * in-progress wait times out, an asynchronous error, the marker cannot be
 * recorded), the caller is told the operation failed and comm.c would
 * release the tensors to the device's caching allocator, which hands
 * their memory to the next kernel on the compute stream while NCCL may
 * still write it.  So enqueue then aborts the communicator (this rank is
 * out of step with the others for good, and an aborted communicator's
 * kernels quit), waits up to SETTLE_SECONDS for the stream to go idle, and
 * if it does not, says so (*busy): comm.c keeps the tensors for the rest
 * of the process.
 *
 * Point to point.  NCCL has no tags: the sends and receives between two
 * ranks match in the order each rank issues them on this communicator,
 * whatever their tags.  kpl's tag is therefore not used for matching (and
 * cannot be checked): each pair of ranks must issue its sends and receives
 * in the same order, and a send and its receive must agree on the size.
 * Like everything on the communicator they run in issue order on one
 * stream, so a send whose receiver first waits for something this rank has
 * queued later deadlocks on the device (the watchdog reports it).
 */
#include "collective_impl.h"

#include <cuda_runtime.h>
#include <nccl.h>

#include <limits.h>
#include <sched.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define EVENT_POOL 64     /* completion events kept for reuse */
#define SCRATCH_BYTES 64  /* the barrier's device buffer */
#define SETTLE_SECONDS 2.0 /* an aborted communicator's kernels quit within this */

typedef struct {
    int32_t rank, size;
    int device;        /* N of cuda:N; -1 until known */
    double timeout;    /* seconds any wait inside the backend may take */
    kpl_device *dev;
    cudaStream_t compute;     /* the device's compute stream (not ours) */
    cudaStream_t stream;      /* ours: every NCCL operation, then its event */
    cudaEvent_t compute_mark; /* recorded on compute, awaited by stream;
                               * enqueue only (serialised by comm.c) */
    void *scratch;            /* SCRATCH_BYTES of zeros on dev: the barrier */
    bool locks_live;

    pthread_mutex_t mu; /* guards the two below and every NCCL call on comm */
    ncclComm_t comm;    /* NULL before init and after an abort */
    bool aborted;       /* cancel (or a timed-out wait) aborted comm */

    bool broken; /* init failed on some rank: fini aborts, never finalizes */

    pthread_mutex_t pool_mu; /* guards the pool */
    cudaEvent_t pool[EVENT_POOL];
    int npool;
} nccl_state;

/* ---- errors ------------------------------------------------------------------------- */

/* "cudaEventRecord" out of "cudaEventRecord(s->stream, ...)". */
static int call_name_len(const char *call) { return (int)strcspn(call, "("); }

static kpl_status cuda_fail(const nccl_state *s, cudaError_t e, const char *call,
                            const char *file, int line)
{
    /* Clear the runtime's last error of this thread, which would otherwise
     * be reported again by the next kernel launch check in kernels/. */
    (void)cudaGetLastError();
    kpl_status st;
    switch (e) {
    case cudaErrorMemoryAllocation:
        st = KPL_ENOMEM;
        break;
    case cudaErrorNoDevice:
    case cudaErrorInvalidDevice:
    case cudaErrorInsufficientDriver:
    case cudaErrorDevicesUnavailable:
    case cudaErrorECCUncorrectable:
    case cudaErrorIllegalAddress:
    case cudaErrorLaunchFailure:
    case cudaErrorLaunchTimeout:
    case cudaErrorHardwareStackError:
    case cudaErrorIllegalInstruction:
    case cudaErrorMisalignedAddress:
    case cudaErrorInvalidPc:
        st = KPL_EDEVICE; /* the device or its context is unusable */
        break;
    default:
        st = KPL_EBACKEND;
    }
    return kpl_error_at(st, file, line, "nccl backend (rank %d, cuda:%d): %.*s failed: %s (%s)",
                      (int)s->rank, s->device, call_name_len(call), call, cudaGetErrorString(e),
                      cudaGetErrorName(e));
}

static kpl_status nccl_fail(const nccl_state *s, ncclResult_t r, const char *call,
                            const char *file, int line)
{
    /* ncclGetLastError ignores its argument; the text is NCCL's last error
     * in the process, which is this one unless another thread raced us. */
    const char *last = ncclGetLastError(s->comm);
    bool has_last = last && *last;
    kpl_status st = r == ncclSystemError || r == ncclRemoteError ? KPL_ECOMM
                    : r == ncclUnhandledCudaError                ? KPL_EDEVICE
                                                                 : KPL_EBACKEND;
    return kpl_error_at(st, file, line, "nccl backend (rank %d, cuda:%d): %.*s failed: %s%s%s",
                      (int)s->rank, s->device, call_name_len(call), call, ncclGetErrorString(r),
                      has_last ? "; NCCL says: " : "", has_last ? last : "");
}

static kpl_status mpi_fail(int32_t rank, int err, const char *call)
{
    return kpl__comm_mpi_error(err, "nccl backend (rank %d): %s failed while setting up NCCL",
                               (int)rank, call);
}

#define CUDA_TRY(s, call)                                                     \
    do {                                                                      \
        cudaError_t e_ = (call);                                              \
        if (e_ != cudaSuccess) return cuda_fail((s), e_, #call, __FILE__, __LINE__); \
    } while (0)

/* Into the function's `fail:` label; needs `kpl_status st`. */
#define CUDA_GOTO(s, call)                                                    \
    do {                                                                      \
        cudaError_t e_ = (call);                                              \
        if (e_ != cudaSuccess) {                                              \
            st = cuda_fail((s), e_, #call, __FILE__, __LINE__);               \
            goto fail;                                                        \
        }                                                                     \
    } while (0)

#define NCCL_TRY(s, call)                                                     \
    do {                                                                      \
        ncclResult_t r_ = (call);                                             \
        if (r_ != ncclSuccess) return nccl_fail((s), r_, #call, __FILE__, __LINE__); \
    } while (0)

/* ---- the communicator's state ----------------------------------------------------------- */

/* Makes the device current for the calling thread: the CUDA runtime keeps
 * it per thread, and query runs on the watchdog's. */
static kpl_status enter(const nccl_state *s)
{
    CUDA_TRY(s, cudaSetDevice(s->device));
    return KPL_OK;
}

/* With mu held: aborts the communicator so that no kernel of it keeps the
 * GPU spinning; later calls fail with the "aborted" status. */
static void abort_locked(nccl_state *s)
{
    if (s->comm) (void)ncclCommAbort(s->comm);
    s->comm = NULL;
    s->aborted = true;
    (void)cudaGetLastError();
}

/* With mu held: KPL_OK when the communicator can be used, or why not.
 * *pending tells whether a non-blocking NCCL call is still in progress
 * (then no other NCCL call may be made but this query). */
static kpl_status check_locked(nccl_state *s, bool *pending)
{
    *pending = false;
    if (s->aborted)
        return KPL_ERROR(KPL_ECOMM, "nccl backend (rank %d, cuda:%d): the NCCL communicator "
                         "was aborted (a timeout or a failed peer) and takes no more work",
                         (int)s->rank, s->device);
    KPL_CHECK(s->comm, KPL_ESTATE, "nccl backend (rank %d): no NCCL communicator", (int)s->rank);
    ncclResult_t async = ncclSuccess;
    NCCL_TRY(s, ncclCommGetAsyncError(s->comm, &async));
    if (async == ncclInProgress) {
        *pending = true;
        return KPL_OK;
    }
    if (async != ncclSuccess) {
        const char *last = ncclGetLastError(s->comm);
        bool has_last = last && *last;
        return KPL_ERROR(KPL_ECOMM, "nccl backend (rank %d, cuda:%d): NCCL reports an "
                         "asynchronous error: %s%s%s (ncclCommGetAsyncError); a peer failed or "
                         "the network broke, so the ranks are out of step: end the job "
                         "(kpl_comm_abort)", (int)s->rank, s->device, ncclGetErrorString(async),
                         has_last ? "; NCCL says: " : "", has_last ? last : "");
    }
    return KPL_OK;
}

/* Between two polls of something that usually ends within microseconds. */
static void pause_poll(unsigned spin)
{
    if (spin < 32) {
        sched_yield();
        return;
    }
    struct timespec ts = {0, spin < 256 ? 20000L : 1000000L}; /* 20 us, later 1 ms */
    nanosleep(&ts, NULL);
}

/* Polls until the NCCL call `call`, which returned ncclInProgress, has
 * finished on the host.  Gives up at `deadline` (then aborts the
 * communicator: NCCL allows no other call while one is in progress) and
 * when the communicator is aborted meanwhile. */
static kpl_status wait_ready(nccl_state *s, const char *call, double deadline)
{
    for (unsigned spin = 0;; spin++) {
        bool pending = false;
        pthread_mutex_lock(&s->mu);
        kpl_status st = check_locked(s, &pending);
        if (st == KPL_OK && pending && kpl_seconds() >= deadline) {
            abort_locked(s);
            st = KPL_ERROR(KPL_ETIMEOUT, "nccl backend (rank %d, cuda:%d): %s still in progress "
                           "after %.0f s (a peer that never joined?); the NCCL communicator was "
                           "aborted", (int)s->rank, s->device, call, s->timeout);
        }
        pthread_mutex_unlock(&s->mu);
        if (st < 0 || !pending) return st;
        pause_poll(spin);
    }
}

/* Waits until everything queued on the communication stream has finished,
 * watching NCCL for asynchronous errors, until `deadline`. */
static kpl_status drain(nccl_state *s, double deadline)
{
    for (unsigned spin = 0;; spin++) {
        cudaError_t e = cudaStreamQuery(s->stream);
        if (e == cudaSuccess) return KPL_OK;
        if (e != cudaErrorNotReady) return cuda_fail(s, e, "cudaStreamQuery", __FILE__, __LINE__);
        (void)cudaGetLastError();
        bool pending = false;
        pthread_mutex_lock(&s->mu);
        kpl_status st = check_locked(s, &pending);
        pthread_mutex_unlock(&s->mu);
        if (st < 0) return st;
        if (kpl_seconds() >= deadline)
            return KPL_ERROR(KPL_ETIMEOUT, "nccl backend (rank %d, cuda:%d): the communication "
                             "stream did not finish within %.0f s", (int)s->rank, s->device,
                             s->timeout);
        pause_poll(spin);
    }
}

/* ---- completion events -------------------------------------------------------------- */

static kpl_status event_get(nccl_state *s, cudaEvent_t *out)
{
    pthread_mutex_lock(&s->pool_mu);
    cudaEvent_t ev = s->npool > 0 ? s->pool[--s->npool] : NULL;
    pthread_mutex_unlock(&s->pool_mu);
    /* Without timing: cheaper to record and to wait for. */
    if (!ev) CUDA_TRY(s, cudaEventCreateWithFlags(&ev, cudaEventDisableTiming));
    *out = ev;
    return KPL_OK;
}

/* Recycling an event whose work may still run is safe: cudaEventRecord
 * replaces what the event captures, while a cudaStreamWaitEvent already
 * made (order) keeps waiting for what was captured when it was called;
 * and nobody queries a freed marker any more (comm.c drops the work from
 * the watchdog's list, under its lock, before freeing the marker). */
static void event_put(nccl_state *s, cudaEvent_t ev)
{
    pthread_mutex_lock(&s->pool_mu);
    bool kept = s->npool < EVENT_POOL;
    if (kept) s->pool[s->npool++] = ev;
    pthread_mutex_unlock(&s->pool_mu);
    if (!kept) {
        /* Legal while the event's work runs: the release waits for it. */
        (void)cudaEventDestroy(ev);
        (void)cudaGetLastError();
    }
}

/* ---- set-up and tear-down ----------------------------------------------------------- */

static void nccl_fini(void *state)
{
    nccl_state *s = state;
    if (!s) return;
    if (s->device >= 0) (void)cudaSetDevice(s->device);
    if (s->comm && !s->broken && !s->aborted) {
        /* Every rank gets here (comm.c destroys the communicator on all of
         * them), so the collective finalize can complete. */
        double deadline = kpl_seconds() + s->timeout;
        kpl_status st = drain(s, deadline);
        if (st == KPL_OK) {
            /* Non-blocking: in progress until every rank has finalized. */
            pthread_mutex_lock(&s->mu);
            ncclResult_t r = ncclCommFinalize(s->comm);
            pthread_mutex_unlock(&s->mu);
            st = r == ncclSuccess || r == ncclInProgress
                     ? wait_ready(s, "ncclCommFinalize", deadline)
                     : nccl_fail(s, r, "ncclCommFinalize", __FILE__, __LINE__);
        }
        if (st == KPL_OK) {
            /* Blocking whatever the configuration; quick once finalized. */
            pthread_mutex_lock(&s->mu);
            ncclResult_t r = ncclCommDestroy(s->comm);
            s->comm = NULL;
            pthread_mutex_unlock(&s->mu);
            if (r != ncclSuccess) nccl_fail(s, r, "ncclCommDestroy", __FILE__, __LINE__);
        }
    }
    /* A failed set-up, a stuck stream, a failed finalize: abandon the work. */
    if (s->comm) {
        pthread_mutex_lock(&s->mu);
        abort_locked(s);
        pthread_mutex_unlock(&s->mu);
    }
    if (s->scratch) {
        /* The scratch returns to the device's caching allocator, which may
         * hand it to work on the compute stream at once: only when nothing
         * queued here can still write it.  After an abort NCCL's kernels
         * quit soon; if they have not, the 64 bytes are left behind. */
        double until = kpl_seconds() + 1.0;
        cudaError_t e;
        for (unsigned spin = 0; (e = cudaStreamQuery(s->stream)) == cudaErrorNotReady &&
                                kpl_seconds() < until;
             spin++)
            pause_poll(spin);
        if (e == cudaSuccess) kpl_device_free(s->dev, s->scratch);
    }
    for (int i = 0; i < s->npool; i++) (void)cudaEventDestroy(s->pool[i]);
    if (s->compute_mark) (void)cudaEventDestroy(s->compute_mark);
    /* Returns at once; the stream's resources go when its work is done. */
    if (s->stream) (void)cudaStreamDestroy(s->stream);
    (void)cudaGetLastError();
    if (s->locks_live) {
        pthread_mutex_destroy(&s->mu);
        pthread_mutex_destroy(&s->pool_mu);
    }
    free(s);
}

/* NCCL_VERSION_CODE's encoding, back to "2.28.9". */
static void version_parts(int code, int *major, int *minor, int *patch)
{
    bool wide = code >= 10000; /* from 2.9 on: X*10000 + Y*100 + Z */
    *major = wide ? code / 10000 : code / 1000;
    *minor = wide ? code / 100 % 100 : code / 100 % 10;
    *patch = code % 100;
}

/* What each rank sets up on its own: the version check, the streams, the
 * events, the scratch and (rank 0) the unique id. */
static kpl_status setup_local(nccl_state *s, kpl_device *dev, ncclUniqueId *id)
{
    KPL_CHECK(dev && kpl_device_type_of(dev) == KPL_DEVICE_CUDA, KPL_EDEVICE,
              "nccl backend (rank %d): needs a CUDA device, not %s", (int)s->rank,
              dev ? kpl_device_name(dev) : "none");
    s->device = kpl_device_index(dev);

    int have = 0;
    NCCL_TRY(s, ncclGetVersion(&have));
    if (have < NCCL_VERSION_CODE) {
        int a, b, c, x, y, z;
        version_parts(have, &a, &b, &c);
        version_parts(NCCL_VERSION_CODE, &x, &y, &z);
        return KPL_ERROR(KPL_EBACKEND, "nccl backend (rank %d): the NCCL library loaded at run "
                         "time is %d.%d.%d, older than the %d.%d.%d kpl was built with; put "
                         "NCCL >= %d.%d.%d on the library path (LD_LIBRARY_PATH) or rebuild kpl "
                         "against this one", (int)s->rank, a, b, c, x, y, z, x, y, z);
    }

    void *compute = NULL;
    KPL_TRY(kpl_device_native_stream(dev, &compute)); /* also makes dev current */
    KPL_CHECK(compute, KPL_EDEVICE, "nccl backend (rank %d): %s has no compute stream",
              (int)s->rank, kpl_device_name(dev));
    s->compute = (cudaStream_t)compute;
    int least = 0, greatest = 0;
    CUDA_TRY(s, cudaDeviceGetStreamPriorityRange(&least, &greatest));
    CUDA_TRY(s, cudaStreamCreateWithPriority(&s->stream, cudaStreamNonBlocking, greatest));
    CUDA_TRY(s, cudaEventCreateWithFlags(&s->compute_mark, cudaEventDisableTiming));

    /* The caching allocator assumes compute-stream order: the block may
     * still be in use by work queued there, so clear it after that. */
    KPL_TRY(kpl_device_alloc(dev, SCRATCH_BYTES, "nccl barrier", &s->scratch));
    CUDA_TRY(s, cudaEventRecord(s->compute_mark, s->compute));
    CUDA_TRY(s, cudaStreamWaitEvent(s->stream, s->compute_mark, 0));
    CUDA_TRY(s, cudaMemsetAsync(s->scratch, 0, SCRATCH_BYTES, s->stream));

    if (s->rank == 0) NCCL_TRY(s, ncclGetUniqueId(id));
    return KPL_OK;
}

/* Collective: whether every rank got through a stage of the set-up.  A
 * rank's own failure keeps its own message; the others name the first rank
 * that failed.  So no rank goes on to wait for a peer that gave up. */
static kpl_status agree(int32_t rank, MPI_Comm comm, kpl_status mine, const char *stage)
{
    int me = mine < 0 ? (int)rank : INT_MAX, first = INT_MAX;
    int err = MPI_Allreduce(&me, &first, 1, MPI_INT, MPI_MIN, comm);
    if (mine < 0) return mine;
    if (err != MPI_SUCCESS) return mpi_fail(rank, err, "MPI_Allreduce");
    if (first != INT_MAX)
        return KPL_ERROR(KPL_ECOMM, "nccl backend (rank %d): rank %d failed %s (its own error "
                         "says why), so every rank gives up", (int)rank, first, stage);
    return KPL_OK;
}

static kpl_status create_comm(nccl_state *s, const ncclUniqueId *id)
{
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;     /* see the top of the file */
    config.commName = "kpl"; /* in NCCL's logs */
    KPL_TRY(enter(s));       /* NCCL binds the communicator to the current device */
    ncclResult_t r = ncclCommInitRankConfig(&s->comm, (int)s->size, *id, (int)s->rank, &config);
    if (r != ncclSuccess && r != ncclInProgress)
        return nccl_fail(s, r, "ncclCommInitRankConfig", __FILE__, __LINE__);
    return wait_ready(s, "ncclCommInitRankConfig", kpl_seconds() + s->timeout);
}

static kpl_status nccl_init(const kpl__comm_boot *boot, void **state)
{
    /* Every rank takes every collective step below, failed or not, so that
     * no rank waits for a peer that gave up. */
    nccl_state *s = calloc(1, sizeof *s);
    *state = s;
    if (!s)
        return agree(boot->rank, boot->comm, KPL_ERROR(KPL_ENOMEM, "nccl backend: no memory"),
                     "to set up");
    s->rank = boot->rank;
    s->size = boot->size;
    s->timeout = boot->timeout;
    s->dev = boot->device;
    s->device = -1;
    kpl_status st = KPL_OK;
    if (pthread_mutex_init(&s->mu, NULL) != 0) {
        st = KPL_ERROR(KPL_ENOMEM, "nccl backend: cannot create a lock");
    } else if (pthread_mutex_init(&s->pool_mu, NULL) != 0) {
        pthread_mutex_destroy(&s->mu);
        st = KPL_ERROR(KPL_ENOMEM, "nccl backend: cannot create a lock");
    } else {
        s->locks_live = true;
    }

    ncclUniqueId id;
    memset(&id, 0, sizeof id);
    if (st == KPL_OK) st = setup_local(s, boot->device, &id);
    KPL_TRY(agree(s->rank, boot->comm, st, "to set up"));
    int err = MPI_Bcast(&id, (int)sizeof id, MPI_BYTE, 0, boot->comm);
    st = err == MPI_SUCCESS ? create_comm(s, &id)
                            : mpi_fail(s->rank, err, "MPI_Bcast of the ncclUniqueId");
    st = agree(s->rank, boot->comm, st, "to create its NCCL communicator");
    /* A rank whose own communicator came up cannot finalize it with peers
     * that have none: fini aborts it instead. */
    if (st < 0) s->broken = true;
    return st;
}

/* ---- operations ------------------------------------------------------------------------ */

static bool nccl_type(kpl_dtype dt, ncclDataType_t *out)
{
    switch (dt) {
    case KPL_F32: *out = ncclFloat32; return true;
    case KPL_F64: *out = ncclFloat64; return true;
    case KPL_F16: *out = ncclFloat16; return true;
    case KPL_BF16: *out = ncclBfloat16; return true;
    case KPL_I32: *out = ncclInt32; return true;
    case KPL_I64: *out = ncclInt64; return true;
    case KPL_U8:
    case KPL_BOOL: *out = ncclUint8; return true; /* moved, never reduced */
    default: return false;
    }
}

static ncclRedOp_t nccl_op(kpl_comm_op op, int32_t size)
{
    switch (op) {
    case KPL_COMM_AVG: return size == 1 ? ncclSum : ncclAvg; /* see the top of the file */
    case KPL_COMM_MAX: return ncclMax;
    case KPL_COMM_MIN: return ncclMin;
    case KPL_COMM_SUM:
    default: return ncclSum; /* enqueue checked the op */
    }
}

/* With mu held: issues the NCCL call of *a on the communication stream. */
static ncclResult_t issue_locked(const nccl_state *s, const kpl__coll_args *a, ncclDataType_t t,
                                 const char **call)
{
    switch (a->kind) {
    case KPL__COLL_ALLREDUCE: /* in == out: in place, as NCCL defines it */
        *call = "ncclAllReduce";
        return ncclAllReduce(a->in, a->out, a->count, t, nccl_op(a->op, s->size), s->comm,
                             s->stream);
    case KPL__COLL_BROADCAST:
        *call = "ncclBroadcast";
        return ncclBroadcast(a->in, a->out, a->count, t, (int)a->peer, s->comm, s->stream);
    case KPL__COLL_ALLGATHER:
        *call = "ncclAllGather";
        return ncclAllGather(a->in, a->out, a->count, t, s->comm, s->stream);
    case KPL__COLL_REDUCE_SCATTER:
        *call = "ncclReduceScatter";
        return ncclReduceScatter(a->in, a->out, a->count, t, nccl_op(a->op, s->size), s->comm,
                                 s->stream);
    case KPL__COLL_SEND: /* the tag is not matched: see the top of the file */
        *call = "ncclSend";
        return ncclSend(a->in, a->count, t, (int)a->peer, s->comm, s->stream);
    case KPL__COLL_RECV:
        *call = "ncclRecv";
        return ncclRecv(a->out, a->count, t, (int)a->peer, s->comm, s->stream);
    case KPL__COLL_BARRIER: /* a one-byte allreduce of zeros */
        *call = "ncclAllReduce (barrier)";
        return ncclAllReduce(s->scratch, s->scratch, 1, ncclUint8, ncclSum, s->comm, s->stream);
    default: /* enqueue checked the kind */
        *call = kpl__coll_kind_name(a->kind);
        return ncclInvalidArgument;
    }
}

/* An operation NCCL had accepted failed afterwards (its wait for NCCL ran
 * out, NCCL reported an asynchronous error, or its marker could not be
 * recorded): the caller is told it failed while its kernels may be queued
 * and writing the tensors, and this rank is out of step with the others
 * for good.  Aborts the communicator, whose kernels then quit, and waits
 * up to SETTLE_SECONDS for the stream to go idle, asking CUDA only (an
 * aborted communicator takes no NCCL call).  Whether it did: if not, the
 * memory must never be reused (collective_impl.h, enqueue). */
static bool settle_failed(nccl_state *s)
{
    pthread_mutex_lock(&s->mu);
    if (!s->aborted) abort_locked(s);
    pthread_mutex_unlock(&s->mu);
    double until = kpl_seconds() + SETTLE_SECONDS;
    cudaError_t e;
    for (unsigned spin = 0;
         (e = cudaStreamQuery(s->stream)) == cudaErrorNotReady && kpl_seconds() < until; spin++)
        pause_poll(spin);
    (void)cudaGetLastError();
    return e == cudaSuccess;
}

static kpl_status nccl_enqueue(void *state, const kpl__coll_args *a, void **event, bool *busy)
{
    nccl_state *s = state;
    *event = NULL;
    *busy = false;
    const char *kind = kpl__coll_kind_name(a->kind);
    KPL_CHECK((unsigned)a->kind < KPL__COLL_KIND_COUNT, KPL_EINVAL,
              "nccl backend: unknown operation %d", (int)a->kind);
    bool reduces = a->kind == KPL__COLL_ALLREDUCE || a->kind == KPL__COLL_REDUCE_SCATTER;
    ncclDataType_t t = ncclUint8;
    if (a->kind != KPL__COLL_BARRIER) {
        KPL_CHECK(nccl_type(a->dtype, &t) && !(reduces && t == ncclUint8), KPL_EDTYPE,
                  "nccl backend: cannot %s %s tensors", kind, kpl_dtype_name(a->dtype));
    }
    KPL_CHECK(!reduces || (unsigned)a->op <= KPL_COMM_MIN, KPL_EINVAL,
              "nccl backend: unknown reduction %d", (int)a->op);

    KPL_TRY(enter(s));
    cudaEvent_t ev = NULL;
    KPL_TRY(event_get(s, &ev));
    kpl_status st = KPL_OK;
    /* An empty operation has nothing to move on any rank (the counts agree
     * on every rank): only its marker is queued.  accepted: NCCL took the
     * operation (its kernels may be queued from then on). */
    bool empty = a->count == 0 && a->kind != KPL__COLL_BARRIER, pending = false;
    bool accepted = false;
    const char *call = kind;
    /* The inputs may still be being written (and the outputs read) by work
     * already queued on the compute stream: start after it. */
    CUDA_GOTO(s, cudaEventRecord(s->compute_mark, s->compute));
    CUDA_GOTO(s, cudaStreamWaitEvent(s->stream, s->compute_mark, 0));

    pthread_mutex_lock(&s->mu);
    st = check_locked(s, &pending);
    if (st == KPL_OK && pending) /* cannot happen: every enqueue waits its call out */
        st = KPL_ERROR(KPL_ESTATE, "nccl backend (rank %d): an NCCL call is still in progress",
                       (int)s->rank);
    if (st == KPL_OK && !empty) {
        ncclResult_t r = issue_locked(s, a, t, &call);
        accepted = r == ncclSuccess || r == ncclInProgress;
        if (r == ncclInProgress) pending = true;
        else if (r != ncclSuccess) st = nccl_fail(s, r, call, __FILE__, __LINE__);
    }
    pthread_mutex_unlock(&s->mu);
    /* Until the call is done NCCL may not have queued its kernel yet, and
     * the marker must come after it. */
    if (st == KPL_OK && pending) st = wait_ready(s, call, kpl_seconds() + s->timeout);
    if (st < 0) goto fail;
    CUDA_GOTO(s, cudaEventRecord(ev, s->stream));
    *event = ev;
    return KPL_OK;
fail:
    event_put(s, ev);
    if (accepted) *busy = !settle_failed(s);
    return st;
}

static kpl_status nccl_query(void *state, void *event, bool *done)
{
    nccl_state *s = state;
    *done = false;
    KPL_TRY(enter(s));
    /* First NCCL: after an asynchronous error or an abort the kernels quit
     * early, and a completed marker would not mean a completed operation. */
    bool pending = false;
    pthread_mutex_lock(&s->mu);
    kpl_status st = check_locked(s, &pending);
    pthread_mutex_unlock(&s->mu);
    if (st < 0) return st;
    cudaError_t e = cudaEventQuery((cudaEvent_t)event);
    if (e == cudaErrorNotReady) {
        (void)cudaGetLastError(); /* not an error: still running */
        return KPL_OK;
    }
    if (e != cudaSuccess) return cuda_fail(s, e, "cudaEventQuery", __FILE__, __LINE__);
    *done = true;
    return KPL_OK;
}

static kpl_status nccl_order(void *state, void *event)
{
    nccl_state *s = state;
    KPL_TRY(enter(s));
    CUDA_TRY(s, cudaStreamWaitEvent(s->compute, (cudaEvent_t)event, 0));
    return KPL_OK;
}

static void nccl_event_free(void *state, void *event)
{
    nccl_state *s = state;
    if (event) event_put(s, (cudaEvent_t)event);
}

/* From the watchdog (a timeout) or kpl_comm_abort, possibly while the
 * owner is inside enqueue: mu makes the abort wait for an NCCL call in
 * progress, which returns at once (the communicator does not block), and
 * the owner, which checks `aborted` under mu before every NCCL call, then
 * fails cleanly. */
static void nccl_cancel(void *state)
{
    nccl_state *s = state;
    if (!s || !s->locks_live) return;
    pthread_mutex_lock(&s->mu);
    if (!s->aborted && s->comm) {
        if (s->device >= 0) (void)cudaSetDevice(s->device);
        abort_locked(s);
    }
    pthread_mutex_unlock(&s->mu);
}

/* The PCI bus id ("0000:3b:00.0"): the same GPU has the same one in every
 * process, whatever CUDA_VISIBLE_DEVICES makes its number. */
static kpl_status nccl_device_id(kpl_device *dev, char *buf, size_t len)
{
    KPL_CHECK(dev && kpl_device_type_of(dev) == KPL_DEVICE_CUDA && len > 1, KPL_EINVAL,
              "nccl backend: device_id needs a CUDA device");
    int n = kpl_device_index(dev);
    cudaError_t e = cudaDeviceGetPCIBusId(buf, (int)(len < INT_MAX ? len : INT_MAX), n);
    if (e != cudaSuccess) {
        (void)cudaGetLastError();
        buf[0] = '\0';
        return KPL_ERROR(KPL_EDEVICE, "nccl backend: cannot read the PCI bus id of %s: %s (%s)",
                         kpl_device_name(dev), cudaGetErrorString(e), cudaGetErrorName(e));
    }
    return KPL_OK;
}

static const kpl__comm_backend nccl_backend = {
    .name = "nccl",
    .device_type = KPL_DEVICE_CUDA,
    .init = nccl_init,
    .fini = nccl_fini,
    .run = NULL,
    .enqueue = nccl_enqueue,
    .query = nccl_query,
    .order = nccl_order,
    .event_free = nccl_event_free,
    .cancel = nccl_cancel,
    .device_id = nccl_device_id,
};

const kpl__comm_backend *kpl__comm_nccl_backend(void) { return &nccl_backend; }
