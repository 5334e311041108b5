/*
 * comm_ucx.c — the ucx backend: collectives on host memory over UCP's tag
 * matching, with kpl's own algorithms on top:
 *  - allreduce: a ring reduce-scatter followed by a ring allgather;
 *  - reduce_scatter and allgather: one of those two rings alone;
 *  - broadcast: a chain from the root along the ring;
 *  - barrier: dissemination, log2(size) rounds of empty messages;
 *  - send/recv: one tagged message.
 *
 * The rings are pipelined.  Every step's segment is cut into chunks of
 * CHUNK_BYTES, and chunks, not steps, are the unit of work: a chunk is sent
 * on to the next rank as soon as it has been received and reduced, so the
 * reduction of chunk j overlaps the transfer of chunk j + 1, and step s + 1
 * starts on chunk j while step s is still moving later chunks.  One table
 * (ring_step) describes where each step's data lands, what it is reduced
 * with and where it is sent from; one engine (ring_run) runs any such table.
 *
 * Transports.  Every endpoint reports peer failure
 * (UCP_ERR_HANDLING_MODE_PEER), so a dead rank is an error naming it, never
 * a hang nor a crash.  UCX 1.13 serves such endpoints over shared memory
 * only with its shared-memory failure checks on (MM_ERROR_HANDLING, set here
 * unless the user set it), and never over cma, its single-copy transport: in
 * error mode NONE, UCX aborts the surviving process when a peer dies during
 * a cma transfer.  So between ranks of one node the ring moves large chunks
 * itself: the sender sends a descriptor (address, length), the receiver
 * copies the chunk with process_vm_readv (a failed read, say of a dead
 * peer, is an error like any other) and acks, and only the ack frees the
 * sender's memory.  That is UCX's rendezvous over cma, with one copy instead
 * of the two of UCX's shared-memory FIFO (measured on 2 ranks: 8 GB/s at
 * 16 MB against 4.8).  CMA is used when UCX_TLS allows cma and every rank
 * could read its predecessor's memory at init; otherwise chunks travel as
 * UCX messages.
 *
 * Waiting spins on ucp_worker_progress for SPIN_SECONDS, then sleeps on the
 * worker's event fd (ucp_worker_arm + poll): ranks often share cores, and a
 * spinning rank starves the peer it waits for.  Past the deadline an
 * operation fails naming the step and the rank it waited for.  After any
 * failure the requests still in flight are cancelled (or their endpoint
 * force-closed) before run returns, so UCX never writes into memory the
 * caller has got back.
 */
#define _GNU_SOURCE /* process_vm_readv */
#include "collective_impl.h"

#include <errno.h>
#include <poll.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/uio.h>
#include <ucp/api/ucp.h>
#include <unistd.h>

/* ---- tuning ------------------------------------------------------------------------- */

/* Chunk of a ring step.  On 2 ranks sharing memory 128 KB to 1 MB chunks
 * were all within noise of each other from 4 MB up (bench comm busbw);
 * smaller ones add per-message cost, larger ones pipeline less. */
#define CHUNK_BYTES ((size_t)256 << 10)
/* Ring chunks from this size up travel by direct read over a CMA link;
 * below it one eager message costs less than descriptor, read and ack
 * (a 64 KB allreduce on 2 ranks: 4.2 GB/s eager, 3.5 by CMA). */
#define CMA_MIN_BYTES ((size_t)64 << 10)
/* Receive buffers of an in-place allreduce (its reduce-scatter cannot land
 * on the data it reduces with). */
#define SLOTS 8
/* Receives posted ahead of the oldest one not yet finished, in chunks. */
#define AHEAD 16
/* How long an idle wait spins before it sleeps on the event fd. */
#define SPIN_SECONDS 50e-6
/* Longest single sleep: bounds how late a deadline or a cancel is seen. */
#define POLL_MS 20
/* After a failure, how long to wait for UCX to give cancelled requests back
 * (twice: after cancelling, then after force-closing endpoints). */
#define RECLAIM_SECONDS 0.25
/* UCX's keepalive period (a string in its syntax); see setup_local. */
#define KEEPALIVE_SECONDS "2s"
/* fini: how long to wait for endpoints to close and for the other ranks. */
#define FINI_SECONDS 10.0

/* ---- tags ----------------------------------------------------------------------------- */
/*
 * 64-bit UCP tags, matched exactly:
 *   user send/recv:  0 | sender rank (31 bits) | user tag (32 bits)
 *   collectives:     1 | ack | seq (21 bits) | step (17 bits) | chunk (24 bits)
 * The top bit keeps user messages and collective traffic apart whatever the
 * user's tag.  Within a collective only the ring predecessor (or the barrier
 * partner of a round) sends a rank data, and only its successor sends it
 * acks (CMA links), so seq, step and chunk name every message a rank
 * receives; seq wraps after 2 M collectives, far more than ranks can drift
 * apart.
 */
#define TAG_COLL ((ucp_tag_t)1 << 63)
#define TAG_ACK ((ucp_tag_t)1 << 62)
#define SEQ_BITS 21
#define STEP_BITS 17
#define CHUNK_BITS 24
#define STEP_WARMUP ((1u << STEP_BITS) - 1) /* init's handshake: no collective uses it */
#define MAX_RANKS (1 << 16)                 /* 2 (size - 1) steps must fit STEP_BITS */
#define TAG_ALL ((ucp_tag_t)-1)

static ucp_tag_t coll_tag(uint64_t seq, unsigned step, size_t chunk)
{
    return TAG_COLL | (seq & ((1u << SEQ_BITS) - 1)) << (STEP_BITS + CHUNK_BITS) |
           (ucp_tag_t)step << CHUNK_BITS | (ucp_tag_t)chunk;
}

static ucp_tag_t ack_tag(uint64_t seq, unsigned step, size_t chunk)
{
    return coll_tag(seq, step, chunk) | TAG_ACK;
}

static ucp_tag_t user_tag(int32_t sender, int32_t tag)
{
    return (ucp_tag_t)(uint32_t)sender << 32 | (uint32_t)tag;
}

/* ---- state ---------------------------------------------------------------------------- */

typedef struct ucx_state ucx_state;

/* Another rank. */
typedef struct {
    ucx_state *s;
    int32_t rank;
    ucp_ep_h ep;         /* NULL until first needed */
    ucs_status_t failed; /* UCS_OK, or what UCX reported about the endpoint
                          * (UCS_ERR_CANCELED: abandon() closed it) */
} ucx_peer;

/* One message in flight.  The completion callbacks write st and got. */
typedef struct {
    void *req;       /* the UCP request while one is outstanding */
    ucs_status_t st; /* UCS_INPROGRESS until done */
    size_t got;      /* receives: bytes that arrived */
} xfer;

/* Where a chunk is in its sender's memory (the message of a CMA link). */
typedef struct {
    uint64_t addr, len;
} cma_desc;

/* One chunk of a ring (or one message of the simple operations). */
typedef struct {
    xfer recv, send; /* the chunk, or over a CMA link its descriptor */
    xfer ack_in;     /* CMA out: the next rank's word that it has read the chunk */
    xfer ack_out;    /* CMA in: ours to the previous rank */
    cma_desc out_desc, in_desc;
    int32_t slot;    /* the receive buffer it holds, or -1 */
    bool cma_in, cma_out; /* how it was received / sent on */
    bool done;       /* received and reduced: may be sent on */
} item;

/* One step of a ring, as this rank sees it. */
typedef struct {
    char *data;       /* where the segment is once the step is done; sent from there */
    char *land;       /* where receives land: data, or NULL for the slots */
    const char *mine; /* this rank's contribution to reduce with; NULL: no reduction */
    size_t len;       /* elements */
    size_t nchunks, base; /* its chunks are items[base .. base + nchunks) */
    int32_t divide;   /* the AVG division, fused into the reduction (1: none) */
    int conflict;     /* NO_CONFLICT, or the step whose chunks were sent from where
                       * this step's receives land: chunk j is received only after
                       * that step's chunk j has been sent on */
} ring_step;
#define NO_CONFLICT (-1000)

struct ucx_state {
    int32_t rank, size;
    MPI_Comm comm;
    double timeout;
    bool ready;   /* init completed on every rank */
    bool broken;  /* requests could not be reclaimed after a failure */
    ucp_context_h ctx;
    ucp_worker_h worker;
    int efd;
    ucp_address_t *self_addr; /* until the exchange is over */
    char *addrs;              /* every rank's worker address, back to back */
    int *addr_len, *addr_off;
    ucx_peer *peers;
    int32_t nfailed;
    pid_t *pid;      /* every rank's process */
    int32_t *node;   /* every rank's node: the lowest rank sharing its memory */
    bool cma;        /* ranks of a node read each other's memory (process_vm_readv) */
    uint64_t probe;  /* read by the predecessor at init to prove that it can */
    atomic_bool cancelled;
    /* Reused by every run. */
    ring_step *steps; /* 2 size entries: steps -1 .. 2 (size - 1) - 1 */
    item *items;
    size_t items_cap;
    char *slots;      /* SLOTS x CHUNK_BYTES */
    char *scratch;    /* reduce_scatter's partial sums */
    size_t scratch_cap;
};

/* ---- small helpers ---------------------------------------------------------------------- */

static kpl_status mpi_fail(int err, const char *what)
{
    return kpl__comm_mpi_error(err, "ucx backend: %s", what);
}

static int32_t wrap(int64_t x, int32_t n) { return (int32_t)(((x % n) + n) % n); }

/* Segment k of n elements cut in p: the first n % p segments one longer. */
static size_t seg_off(size_t n, int32_t p, int32_t k)
{
    size_t b = n / (size_t)p, r = n % (size_t)p, kk = (size_t)k;
    return kk * b + (kk < r ? kk : r);
}

static size_t seg_len(size_t n, int32_t p, int32_t k)
{
    return n / (size_t)p + ((size_t)k < n % (size_t)p);
}

static void *grow(void **buf, size_t *cap, size_t need)
{
    if (need <= *cap) return *buf;
    void *p = realloc(*buf, need);
    if (!p) return NULL;
    *buf = p;
    *cap = need;
    return p;
}

/* n items, every request cleared. */
static kpl_status items_get(ucx_state *s, size_t n, item **out)
{
    size_t bytes = (n ? n : 1) * sizeof(item);
    size_t cap = s->items_cap * sizeof(item);
    void *p = s->items;
    KPL_CHECK(grow(&p, &cap, bytes), KPL_ENOMEM, "ucx backend: no memory for %zu chunks", n);
    s->items = p;
    s->items_cap = cap / sizeof(item);
    const xfer fresh = {NULL, UCS_INPROGRESS, 0};
    for (size_t k = 0; k < n; k++)
        s->items[k] = (item){.recv = fresh, .send = fresh, .ack_in = fresh, .ack_out = fresh,
                             .slot = -1};
    *out = s->items;
    return KPL_OK;
}

/* ---- endpoints and messages ----------------------------------------------------------- */

/* UCX's error callback: a peer died or its connection broke.  Runs inside
 * ucp_worker_progress, on the thread in run() or fini(). */
static void ep_failed(void *arg, ucp_ep_h ep, ucs_status_t status)
{
    (void)ep;
    ucx_peer *p = arg;
    if (p->failed == UCS_OK) {
        p->failed = status;
        p->s->nfailed++;
    }
}

static kpl_status peer_failed(const ucx_peer *p)
{
    if (p->failed == UCS_ERR_CANCELED) /* abandon() closed it */
        return KPL_ERROR(KPL_ECOMM, "the connection to rank %d was closed after an earlier "
                         "failure", (int)p->rank);
    return KPL_ERROR(KPL_ECOMM, "the connection to rank %d failed: %s", (int)p->rank,
                     ucs_status_string(p->failed));
}

/* The endpoint to rank r, created on first use. */
static kpl_status peer_ep(ucx_state *s, int32_t r, ucp_ep_h *out)
{
    ucx_peer *p = &s->peers[r];
    if (p->failed != UCS_OK) return peer_failed(p);
    if (!p->ep) {
        ucp_ep_params_t e = {
            .field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS |
                          UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE | UCP_EP_PARAM_FIELD_ERR_HANDLER,
            .address = (const ucp_address_t *)(s->addrs + s->addr_off[r]),
            .err_mode = UCP_ERR_HANDLING_MODE_PEER,
            .err_handler = {ep_failed, p},
        };
        ucs_status_t st = ucp_ep_create(s->worker, &e, &p->ep);
        if (st != UCS_OK) {
            p->ep = NULL;
            return KPL_ERROR(KPL_ECOMM, "cannot connect to rank %d: %s", (int)r,
                             ucs_status_string(st));
        }
    }
    *out = p->ep;
    return KPL_OK;
}

/* The first failed rank, if any (a collective needs them all). */
static kpl_status all_peers_ok(const ucx_state *s)
{
    if (s->nfailed == 0) return KPL_OK;
    for (int32_t r = 0; r < s->size; r++)
        if (s->peers[r].failed != UCS_OK) return peer_failed(&s->peers[r]);
    return KPL_OK;
}

/* Completion callbacks (inside ucp_worker_progress): record, release. */
static void send_done(void *req, ucs_status_t st, void *user)
{
    xfer *x = user;
    x->req = NULL;
    x->st = st;
    ucp_request_free(req);
}

static void recv_done(void *req, ucs_status_t st, const ucp_tag_recv_info_t *info, void *user)
{
    xfer *x = user;
    x->got = st == UCS_OK && info ? info->length : 0;
    x->req = NULL;
    x->st = st;
    ucp_request_free(req);
}

/* Starts a send; x tracks it (immediate completion and errors included). */
static void post_send(ucp_ep_h ep, const void *buf, size_t bytes, ucp_tag_t tag, xfer *x)
{
    ucp_request_param_t p = {
        .op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA |
                        UCP_OP_ATTR_FIELD_DATATYPE | UCP_OP_ATTR_FIELD_MEMORY_TYPE,
        .cb.send = send_done,
        .user_data = x,
        .datatype = ucp_dt_make_contig(1),
        .memory_type = UCS_MEMORY_TYPE_HOST,
    };
    *x = (xfer){NULL, UCS_INPROGRESS, 0};
    ucs_status_ptr_t r = ucp_tag_send_nbx(ep, buf, bytes, tag, &p);
    if (r == NULL) x->st = UCS_OK;
    else if (UCS_PTR_IS_ERR(r)) x->st = UCS_PTR_STATUS(r);
    else if (x->st == UCS_INPROGRESS) x->req = r;
}

/* Starts a receive.  Immediate completion is denied: UCX 1.13 does not
 * report the received length (recv_info) when a receive completes at once,
 * and the length is how a mismatched message is caught. */
static void post_recv(ucx_state *s, void *buf, size_t bytes, ucp_tag_t tag, xfer *x)
{
    ucp_request_param_t p = {
        .op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA |
                        UCP_OP_ATTR_FIELD_DATATYPE | UCP_OP_ATTR_FIELD_MEMORY_TYPE |
                        UCP_OP_ATTR_FLAG_NO_IMM_CMPL,
        .cb.recv = recv_done,
        .user_data = x,
        .datatype = ucp_dt_make_contig(1),
        .memory_type = UCS_MEMORY_TYPE_HOST,
    };
    *x = (xfer){NULL, UCS_INPROGRESS, 0};
    ucs_status_ptr_t r = ucp_tag_recv_nbx(s->worker, buf, bytes, tag, TAG_ALL, &p);
    if (UCS_PTR_IS_ERR(r)) x->st = UCS_PTR_STATUS(r);
    else if (!r) x->st = UCS_ERR_NO_MESSAGE; /* UCX broke NO_IMM_CMPL: never wait for it */
    else if (x->st == UCS_INPROGRESS) x->req = r;
}

/* ---- waiting ---------------------------------------------------------------------------- */

typedef struct {
    double idle_since; /* 0: something happened since the last idle() */
} waiter;

/* Called when a pass found nothing to do: spins for SPIN_SECONDS, then
 * sleeps on the event fd until UCX has news (at most POLL_MS).  *late says
 * the deadline has passed; the caller names what it waited for. */
static kpl_status idle(ucx_state *s, waiter *w, double deadline, bool *late)
{
    *late = false;
    if (atomic_load_explicit(&s->cancelled, memory_order_relaxed))
        return KPL_ERROR(KPL_ECOMM, "cancelled: the job is ending (kpl_comm_abort)");
    double now = kpl_seconds();
    if (now >= deadline) {
        *late = true;
        return KPL_OK;
    }
    if (w->idle_since == 0) {
        w->idle_since = now;
        return KPL_OK;
    }
    if (now - w->idle_since < SPIN_SECONDS) return KPL_OK;
    ucs_status_t st = ucp_worker_arm(s->worker);
    if (st == UCS_ERR_BUSY) return KPL_OK; /* events arrived meanwhile: progress again */
    if (st != UCS_OK)
        return KPL_ERROR(KPL_EBACKEND, "ucp_worker_arm: %s", ucs_status_string(st));
    double left_ms = (deadline - now) * 1e3;
    int ms = left_ms < POLL_MS ? (int)left_ms + 1 : POLL_MS;
    struct pollfd p = {s->efd, POLLIN, 0};
    poll(&p, 1, ms); /* EINTR or a timeout: the caller looks again either way */
    return KPL_OK;
}

static bool in_flight(const item *it, size_t n)
{
    for (size_t k = 0; k < n; k++)
        if (it[k].recv.req || it[k].send.req || it[k].ack_in.req || it[k].ack_out.req)
            return true;
    return false;
}

static void progress_until_reclaimed(ucx_state *s, const item *it, size_t n, double seconds)
{
    double until = kpl_seconds() + seconds;
    while (in_flight(it, n) && kpl_seconds() < until) ucp_worker_progress(s->worker);
}

/* After a failure: takes every request of it[0..n) back from UCX so that the
 * buffers are the caller's again.  Receives can be cancelled; sends cannot
 * (UCP has no send cancel), so if some still hang the endpoints to `peers`
 * are force-closed, which completes them.  Should UCX still hold on, the
 * items and buffers it may write into are left to it (never freed) and the
 * backend refuses further work. */
static void abandon(ucx_state *s, item *it, size_t n, const int32_t *peers, int npeers)
{
    for (size_t k = 0; k < n; k++) {
        if (it[k].recv.req) ucp_request_cancel(s->worker, it[k].recv.req);
        if (it[k].ack_in.req) ucp_request_cancel(s->worker, it[k].ack_in.req);
    }
    progress_until_reclaimed(s, it, n, RECLAIM_SECONDS);
    if (!in_flight(it, n)) return;
    ucp_request_param_t force = {.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS,
                                 .flags = UCP_EP_CLOSE_FLAG_FORCE};
    for (int i = 0; i < npeers; i++) {
        ucx_peer *p = &s->peers[peers[i]];
        if (!p->ep) continue;
        ucs_status_ptr_t r = ucp_ep_close_nbx(p->ep, &force);
        if (UCS_PTR_IS_PTR(r)) ucp_request_free(r);
        p->ep = NULL;
        ep_failed(p, NULL, UCS_ERR_CANCELED);
    }
    progress_until_reclaimed(s, it, n, RECLAIM_SECONDS);
    if (!in_flight(it, n)) return;
    s->broken = true;
    s->items = NULL; /* leaked on purpose, as are the buffers below */
    s->items_cap = 0;
    s->slots = NULL;
    s->scratch = NULL;
    s->scratch_cap = 0;
}

/* Waits for every request of it[0..n); peer[k] is the rank item k talks to.
 * On failure the requests are abandoned. */
static kpl_status wait_items(ucx_state *s, item *it, size_t n, const int32_t *peer,
                             const char *what, double deadline)
{
    waiter w = {0};
    kpl_status st = KPL_OK;
    for (;;) {
        size_t k = 0;
        for (; k < n; k++) {
            const xfer *x[2] = {&it[k].recv, &it[k].send};
            for (int d = 0; d < 2; d++) {
                if (x[d]->st == UCS_OK || x[d]->st == UCS_INPROGRESS) continue;
                st = KPL_ERROR(KPL_ECOMM, "%s: %s rank %d failed: %s", what,
                               d ? "send to" : "receive from", (int)peer[k],
                               ucs_status_string(x[d]->st));
                goto fail;
            }
            if (it[k].recv.st == UCS_INPROGRESS || it[k].send.st == UCS_INPROGRESS) break;
        }
        if (k == n) return KPL_OK;
        if (ucp_worker_progress(s->worker)) {
            w.idle_since = 0;
            continue;
        }
        if (s->peers[peer[k]].failed != UCS_OK) {
            st = peer_failed(&s->peers[peer[k]]);
            goto fail;
        }
        bool late = false;
        KPL_TRY_GOTO(idle(s, &w, deadline, &late));
        if (late) {
            st = KPL_ERROR(KPL_ETIMEOUT, "%s: still waiting for rank %d (%s) at the deadline",
                           what, (int)peer[k],
                           it[k].recv.st == UCS_INPROGRESS ? "its message" : "to take ours");
            goto fail;
        }
    }
fail:
    abandon(s, it, n, peer, (int)n);
    return st;
}

/* ---- the ring engine ---------------------------------------------------------------------- */

typedef struct {
    const char *name;        /* the operation, for messages */
    const char *phase[2];    /* names of steps < split and of the others */
    int split;
    uint64_t seq;
    int32_t prev, next;
    int first;      /* -1: this rank starts with a segment of its own to send; 0: it does not */
    int nsteps;     /* receive steps 0 .. nsteps - 1 */
    int fwd_end;    /* chunks of steps < fwd_end are sent on to `next` */
    bool one_stream; /* broadcast: every message of a link is tagged step 0 */
    bool cma_in, cma_out; /* the links from prev and to next are CMA links */
    kpl_dtype dt;
    kpl_comm_op op;
    size_t esize, chunk; /* chunk: elements */
    ring_step *st;  /* st[t - first] for t in first .. nsteps - 1 */
    size_t total, nsend, rbase; /* items; forwarded ones [0, nsend); received [rbase, total) */
    void *copy_dst;  /* a copy done while the first messages travel (allgather) */
    const void *copy_src;
    size_t copy_bytes;
} ring;

static ring_step *step_of(const ring *g, int t) { return &g->st[t - g->first]; }

/* Chunk counts and item indices once the steps are filled in. */
static kpl_status ring_layout(ring *g)
{
    size_t base = 0;
    for (int t = g->first; t < g->nsteps; t++) {
        ring_step *x = step_of(g, t);
        x->nchunks = (x->len + g->chunk - 1) / g->chunk;
        KPL_CHECK(x->nchunks < ((size_t)1 << CHUNK_BITS), KPL_ERANGE,
                  "%s: %zu elements make more than 2^%d chunks in one ring step", g->name,
                  x->len, CHUNK_BITS);
        x->base = base;
        base += x->nchunks;
    }
    g->total = base;
    g->nsend = g->fwd_end < g->nsteps ? step_of(g, g->fwd_end)->base : base;
    g->rbase = g->nsteps > 0 ? step_of(g, 0)->base : base;
    return KPL_OK;
}

/* A position in the ring's items: step t, chunk j, item k. */
typedef struct {
    int t;
    size_t j, k;
} cursor;

static void skip_empty(const ring *g, cursor *c)
{
    while (c->t < g->nsteps && c->j >= step_of(g, c->t)->nchunks) {
        c->t++;
        c->j = 0;
    }
}

static cursor cursor_at(const ring *g, int t)
{
    cursor c = {t, 0, t < g->nsteps ? step_of(g, t)->base : g->total};
    skip_empty(g, &c);
    return c;
}

static void cursor_next(const ring *g, cursor *c)
{
    c->j++;
    c->k++;
    skip_empty(g, c);
}

static size_t chunk_elems(const ring *g, const cursor *c)
{
    size_t at = c->j * g->chunk, len = step_of(g, c->t)->len;
    return len - at < g->chunk ? len - at : g->chunk;
}

static unsigned tag_step(const ring *g, int t) { return g->one_stream ? 0 : (unsigned)t; }

/* "step 3 of 6 (reduce-scatter), chunk 2 of 5": chunk j of the nchunks
 * that travel in step t. */
static void where(const ring *g, int t, size_t j, size_t nchunks, char *buf, size_t len)
{
    if (g->one_stream)
        snprintf(buf, len, "chunk %zu of %zu", j + 1, nchunks);
    else
        snprintf(buf, len, "step %d of %d (%s), chunk %zu of %zu", t + 1, g->nsteps,
                 g->phase[t >= g->split], j + 1, nchunks);
}

/* What the ring waits for, once nothing moves. */
static kpl_status ring_timeout(const ring *g, const cursor *rp, const cursor *rd, size_t sd)
{
    char w[160];
    if (rd->k < g->total && rd->k < rp->k) {
        where(g, rd->t, rd->j, step_of(g, rd->t)->nchunks, w, sizeof w);
        return KPL_ERROR(KPL_ETIMEOUT, "%s: no data from rank %d at the deadline", w,
                         (int)g->prev);
    }
    /* A send not taken: the one the next receive waits for, or the oldest. */
    int t = NO_CONFLICT;
    size_t j = 0;
    if (rd->k < g->total) {
        t = step_of(g, rd->t)->conflict;
        j = rd->j;
    } else {
        for (int u = g->first; u < g->fwd_end; u++) {
            const ring_step *x = step_of(g, u);
            if (sd >= x->base && sd < x->base + x->nchunks) {
                t = u;
                j = sd - x->base;
            }
        }
    }
    if (t == NO_CONFLICT) return KPL_ERROR(KPL_ETIMEOUT, "stalled at the deadline");
    where(g, t + 1, j, step_of(g, t)->nchunks, w, sizeof w); /* step t's chunks travel in t + 1 */
    return KPL_ERROR(KPL_ETIMEOUT, "%s: rank %d has not taken our data at the deadline", w,
                     (int)g->next);
}

/* Copies `bytes` from address src of rank r's process into dst. */
static kpl_status cma_read(const ucx_state *s, int32_t r, void *dst, uint64_t src, size_t bytes)
{
    size_t done = 0;
    while (done < bytes) {
        struct iovec l = {(char *)dst + done, bytes - done};
        struct iovec f = {(void *)(uintptr_t)(src + done), bytes - done};
        ssize_t n = process_vm_readv(s->pid[r], &l, 1, &f, 1, 0);
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0)
            return KPL_ERROR(KPL_ECOMM, "reading rank %d's memory (process_vm_readv, pid %d): %s",
                             (int)r, (int)s->pid[r], n < 0 ? strerror(errno) : "nothing read");
        done += (size_t)n;
    }
    return KPL_OK;
}

/* Whether item x has left: sent, and over a CMA link read by the next rank
 * (UCS_INPROGRESS until then, or the error). */
static ucs_status_t sent_status(const item *x)
{
    if (x->send.st != UCS_OK || !x->cma_out) return x->send.st;
    return x->ack_in.st;
}

/* A chunk arrived (or, over a CMA link, its descriptor): read it in, ack,
 * reduce. */
static kpl_status ring_recv_done(const ucx_state *s, const ring *g, const cursor *c, item *it,
                                 ucp_ep_h from)
{
    const ring_step *x = step_of(g, c->t);
    size_t n = chunk_elems(g, c), bytes = n * g->esize, at = c->j * g->chunk * g->esize;
    size_t want = it->cma_in ? sizeof(cma_desc) : bytes;
    char w[160];
    where(g, c->t, c->j, x->nchunks, w, sizeof w);
    if (it->recv.st != UCS_OK)
        return KPL_ERROR(KPL_ECOMM, "%s: receive from rank %d failed: %s", w, (int)g->prev,
                         ucs_status_string(it->recv.st));
    if (it->recv.got != want || (it->cma_in && it->in_desc.len != bytes))
        return KPL_ERROR(KPL_ECOMM, "%s: rank %d sent %zu bytes where %zu were expected (do "
                         "all ranks pass the same sizes?)", w, (int)g->prev,
                         it->cma_in ? (size_t)it->in_desc.len : it->recv.got, bytes);
    char *landed = x->land ? x->land + at : s->slots + (size_t)it->slot * CHUNK_BYTES;
    if (it->cma_in) {
        kpl_status st = cma_read(s, g->prev, landed, it->in_desc.addr, bytes);
        if (st < 0) return KPL_ERROR(st, "%s: %s", w, kpl_last_error());
        post_send(from, NULL, 0, ack_tag(g->seq, tag_step(g, c->t), c->j), &it->ack_out);
    }
    if (x->mine) kpl__comm_reduce(x->data + at, landed, x->mine + at, n, g->dt, g->op, x->divide);
    return KPL_OK;
}

/* Where a ring stands: receives posted (rp) and finished (rd), acks of
 * finished receives gone (ad), sends posted (sp) and gone (sd). */
typedef struct {
    item *it;
    ucp_ep_h to, from; /* from: acks, and reports the predecessor's failure */
    cursor rp, rd, sp;
    size_t ad, sd;
    int32_t free_slot[SLOTS], nfree;
} pump;

/* Sends on every chunk that is done, in order. */
static bool pump_sends(ucx_state *s, const ring *g, pump *p)
{
    bool moved = false;
    while (p->sp.k < g->nsend && p->it[p->sp.k].done) {
        const ring_step *x = step_of(g, p->sp.t);
        item *y = &p->it[p->sp.k];
        const char *src = x->data + p->sp.j * g->chunk * g->esize;
        size_t bytes = chunk_elems(g, &p->sp) * g->esize;
        unsigned ts = tag_step(g, p->sp.t + 1); /* step t's chunks travel in step t + 1 */
        y->cma_out = g->cma_out && bytes >= CMA_MIN_BYTES;
        if (y->cma_out) {
            y->out_desc = (cma_desc){(uintptr_t)src, bytes};
            post_recv(s, NULL, 0, ack_tag(g->seq, ts, p->sp.j), &y->ack_in);
            post_send(p->to, &y->out_desc, sizeof y->out_desc, coll_tag(g->seq, ts, p->sp.j),
                      &y->send);
        } else {
            post_send(p->to, src, bytes, coll_tag(g->seq, ts, p->sp.j), &y->send);
        }
        cursor_next(g, &p->sp);
        moved = true;
    }
    return moved;
}

/* Posts receives ahead, in order, each where its data may land. */
static bool pump_recvs(ucx_state *s, const ring *g, pump *p)
{
    bool moved = false;
    size_t es = g->esize;
    while (p->rp.k < g->total && p->rp.k - p->rd.k < AHEAD) {
        const ring_step *x = step_of(g, p->rp.t);
        item *y = &p->it[p->rp.k];
        if (x->conflict != NO_CONFLICT &&
            sent_status(&p->it[step_of(g, x->conflict)->base + p->rp.j]) == UCS_INPROGRESS)
            break; /* still being sent (or read) from there */
        if (!x->land) {
            if (p->nfree == 0) break;
            y->slot = p->free_slot[--p->nfree];
        }
        size_t bytes = chunk_elems(g, &p->rp) * es;
        ucp_tag_t tag = coll_tag(g->seq, tag_step(g, p->rp.t), p->rp.j);
        y->cma_in = g->cma_in && bytes >= CMA_MIN_BYTES;
        if (y->cma_in)
            post_recv(s, &y->in_desc, sizeof y->in_desc, tag, &y->recv);
        else
            post_recv(s, x->land ? x->land + p->rp.j * g->chunk * es
                                 : s->slots + (size_t)y->slot * CHUNK_BYTES,
                      bytes, tag, &y->recv);
        cursor_next(g, &p->rp);
        moved = true;
    }
    return moved;
}

/* Checks the sends and acks that finished; a failed one is an error. */
static kpl_status pump_done(const ring *g, pump *p)
{
    item *it = p->it;
    for (; p->ad < p->rd.k && (!it[p->ad].cma_in || it[p->ad].ack_out.st != UCS_INPROGRESS);
         p->ad++)
        if (it[p->ad].cma_in && it[p->ad].ack_out.st != UCS_OK)
            return KPL_ERROR(KPL_ECOMM, "%s: acknowledging a chunk to rank %d failed: %s",
                             g->name, (int)g->prev, ucs_status_string(it[p->ad].ack_out.st));
    for (ucs_status_t ss; p->sd < p->sp.k && (ss = sent_status(&it[p->sd])) != UCS_INPROGRESS;
         p->sd++) {
        if (ss == UCS_OK) continue;
        cursor c = cursor_at(g, g->first);
        while (c.k < p->sd) cursor_next(g, &c);
        char w[160];
        where(g, c.t + 1, c.j, step_of(g, c.t)->nchunks, w, sizeof w);
        return KPL_ERROR(KPL_ECOMM, "%s: send to rank %d failed: %s", w, (int)g->next,
                         ucs_status_string(ss));
    }
    return KPL_OK;
}

/* Runs a ring table to completion (see the top of the file). */
static kpl_status ring_run(ucx_state *s, ring *g, double deadline)
{
    KPL_TRY(ring_layout(g));
    KPL_TRY(all_peers_ok(s));
    if (g->total == 0) {
        if (g->copy_bytes) memmove(g->copy_dst, g->copy_src, g->copy_bytes);
        return KPL_OK;
    }
    pump p = {0};
    KPL_TRY(items_get(s, g->total, &p.it));
    for (size_t k = 0; k < g->rbase; k++) p.it[k].done = true;
    if (g->nsend) KPL_TRY(peer_ep(s, g->next, &p.to));
    if (g->rbase < g->total) KPL_TRY(peer_ep(s, g->prev, &p.from));
    bool slotted = false;
    for (int t = 0; t < g->nsteps; t++) slotted |= !step_of(g, t)->land;
    if (slotted && !s->slots) {
        s->slots = aligned_alloc(64, SLOTS * CHUNK_BYTES);
        KPL_CHECK(s->slots, KPL_ENOMEM, "%s: no memory for receive buffers", g->name);
    }
    for (int i = 0; i < SLOTS; i++) p.free_slot[p.nfree++] = SLOTS - 1 - i;
    p.rp = p.rd = cursor_at(g, 0);
    p.sp = cursor_at(g, g->first);
    p.ad = p.rd.k;

    bool copied = g->copy_bytes == 0;
    waiter w = {0};
    kpl_status st = KPL_OK;
    for (;;) {
        bool moved = pump_sends(s, g, &p);
        moved |= pump_recvs(s, g, &p);
        if (!copied) { /* while the first messages travel */
            memmove(g->copy_dst, g->copy_src, g->copy_bytes);
            copied = true;
        }
        /* Chunks that arrived, in order: read, reduce, free the slot, and
         * send each on before touching the next. */
        while (p.rd.k < p.rp.k && p.it[p.rd.k].recv.st != UCS_INPROGRESS) {
            item *y = &p.it[p.rd.k];
            KPL_TRY_GOTO(ring_recv_done(s, g, &p.rd, y, p.from));
            if (y->slot >= 0) p.free_slot[p.nfree++] = y->slot;
            y->done = true;
            cursor_next(g, &p.rd);
            pump_sends(s, g, &p);
            pump_recvs(s, g, &p);
            moved = true;
        }
        KPL_TRY_GOTO(pump_done(g, &p));
        if (p.rd.k == g->total && p.ad == g->total && p.sd == g->nsend) return KPL_OK;
        if (ucp_worker_progress(s->worker)) moved = true;
        if (moved) {
            w.idle_since = 0;
            continue;
        }
        KPL_TRY_GOTO(all_peers_ok(s));
        bool late = false;
        KPL_TRY_GOTO(idle(s, &w, deadline, &late));
        if (late) {
            st = ring_timeout(g, &p.rp, &p.rd, p.sd);
            goto fail;
        }
    }
fail:
    abandon(s, p.it, g->total, (int32_t[]){g->prev, g->next}, 2);
    return st;
}

/* ---- the collectives as ring tables ------------------------------------------------------- */

static ring ring_base(ucx_state *s, const kpl__coll_args *a, const char *name)
{
    ring g = {0};
    g.name = name;
    g.seq = a->seq;
    g.prev = wrap(s->rank - 1, s->size);
    g.next = wrap(s->rank + 1, s->size);
    g.dt = a->dtype;
    g.op = a->op;
    g.esize = kpl_dtype_size(a->dtype);
    g.chunk = CHUNK_BYTES / g.esize;
    g.st = s->steps;
    bool local_prev = s->node[g.prev] == s->node[s->rank];
    bool local_next = s->node[g.next] == s->node[s->rank];
    g.cma_in = s->cma && local_prev;
    g.cma_out = s->cma && local_next;
    return g;
}

static ring_step plain_step(char *data, size_t len)
{
    return (ring_step){data, data, NULL, len, 0, 0, 1, NO_CONFLICT};
}

/* Ring reduce-scatter (steps 0 .. P-2) then ring allgather (P-1 .. 2P-3).
 * In step t of the reduce-scatter rank r receives segment r - t - 2 and
 * reduces it with its own, having sent segment r - t - 1 (its own at t = 0,
 * the one it just reduced after); it ends holding segment r whole, divided
 * for AVG.  The allgather then passes the whole segments round.  Out of
 * place, receives land in out and reduce there with in; in place they land
 * in the slots (out holds this rank's contribution until reduced). */
static kpl_status allreduce(ucx_state *s, const kpl__coll_args *a, double deadline)
{
    int32_t P = s->size, r = s->rank;
    size_t n = a->count;
    if (P == 1) {
        if (a->in != a->out) memcpy(a->out, a->in, n * kpl_dtype_size(a->dtype));
        return KPL_OK;
    }
    ring g = ring_base(s, a, "allreduce");
    g.phase[0] = "reduce-scatter";
    g.phase[1] = "allgather";
    g.split = P - 1;
    g.first = -1;
    g.nsteps = 2 * (P - 1);
    g.fwd_end = g.nsteps - 1;
    size_t es = g.esize;
    char *in = (char *)a->in, *out = a->out;
    bool inplace = a->in == a->out;
    int32_t k = wrap(r - 1, P);
    *step_of(&g, -1) = plain_step(in + seg_off(n, P, k) * es, seg_len(n, P, k));
    for (int t = 0; t < P - 1; t++) {
        k = wrap((int64_t)r - t - 2, P);
        size_t off = seg_off(n, P, k) * es;
        ring_step *x = step_of(&g, t);
        *x = plain_step(out + off, seg_len(n, P, k));
        x->land = inplace ? NULL : out + off;
        x->mine = in + off;
        x->divide = t == P - 2 && a->op == KPL_COMM_AVG ? P : 1;
    }
    for (int t = P - 1; t < 2 * (P - 1); t++) {
        k = wrap((int64_t)r - (t - (P - 1)) - 1, P);
        ring_step *x = step_of(&g, t);
        *x = plain_step(out + seg_off(n, P, k) * es, seg_len(n, P, k));
        x->conflict = t - P; /* this segment was sent on in reduce-scatter step t - P + 1 */
    }
    return ring_run(s, &g, deadline);
}

/* The reduce-scatter half alone, on P blocks of `count`: the partial sums
 * travel through two scratch blocks used in turn (a block is received into
 * again only once its chunks have been sent on), the last step lands in out. */
static kpl_status reduce_scatter(ucx_state *s, const kpl__coll_args *a, double deadline)
{
    int32_t P = s->size, r = s->rank;
    size_t n = a->count, es = kpl_dtype_size(a->dtype), block = n * es;
    if (P == 1) {
        memmove(a->out, a->in, block);
        return KPL_OK;
    }
    if (P > 2) {
        void *p = s->scratch;
        KPL_CHECK(grow(&p, &s->scratch_cap, 2 * block), KPL_ENOMEM,
                  "reduce_scatter: no memory for 2 x %zu bytes of partial sums", block);
        s->scratch = p;
    }
    ring g = ring_base(s, a, "reduce_scatter");
    g.phase[0] = g.phase[1] = "reduce-scatter";
    g.split = P;
    g.first = -1;
    g.nsteps = P - 1;
    g.fwd_end = P - 2;
    char *in = (char *)a->in;
    *step_of(&g, -1) = plain_step(in + (size_t)wrap(r - 1, P) * block, n);
    for (int t = 0; t < P - 1; t++) {
        int32_t k = wrap((int64_t)r - t - 2, P);
        bool last = t == P - 2;
        ring_step *x = step_of(&g, t);
        *x = plain_step(last ? a->out : s->scratch + (size_t)(t % 2) * block, n);
        x->mine = in + (size_t)k * block;
        x->divide = last && a->op == KPL_COMM_AVG ? P : 1;
        if (!last && t >= 2) x->conflict = t - 2;
    }
    return ring_run(s, &g, deadline);
}

/* The allgather half alone: segment k of out is rank k's in. */
static kpl_status allgather(ucx_state *s, const kpl__coll_args *a, double deadline)
{
    int32_t P = s->size, r = s->rank;
    size_t es = kpl_dtype_size(a->dtype), block = a->count * es;
    char *out = a->out;
    if (P == 1) {
        memmove(out, a->in, block);
        return KPL_OK;
    }
    ring g = ring_base(s, a, "allgather");
    g.phase[0] = g.phase[1] = "allgather";
    g.split = P;
    g.first = -1;
    g.nsteps = P - 1;
    g.fwd_end = P - 2;
    *step_of(&g, -1) = plain_step((char *)a->in, a->count);
    for (int t = 0; t < P - 1; t++)
        *step_of(&g, t) = plain_step(out + (size_t)wrap((int64_t)r - t - 1, P) * block, a->count);
    if (out + (size_t)r * block != a->in) {
        g.copy_dst = out + (size_t)r * block;
        g.copy_src = a->in;
        g.copy_bytes = block;
    }
    return ring_run(s, &g, deadline);
}

/* A chain root -> root + 1 -> ... -> root - 1, chunk by chunk. */
static kpl_status broadcast(ucx_state *s, const kpl__coll_args *a, double deadline)
{
    int32_t P = s->size, pos = wrap((int64_t)s->rank - a->peer, P);
    if (P == 1) return KPL_OK;
    ring g = ring_base(s, a, "broadcast");
    g.phase[0] = g.phase[1] = "broadcast";
    g.split = 1;
    g.one_stream = true;
    if (pos == 0) {
        g.first = -1;
        g.nsteps = 0;
        g.fwd_end = 0;
        *step_of(&g, -1) = plain_step(a->out, a->count);
    } else {
        g.first = 0;
        g.nsteps = 1;
        g.fwd_end = pos < P - 1 ? 1 : 0;
        *step_of(&g, 0) = plain_step(a->out, a->count);
    }
    return ring_run(s, &g, deadline);
}

/* ---- barrier and point to point ----------------------------------------------------------- */

/* Dissemination: in round k every rank tells rank + 2^k and hears from
 * rank - 2^k; after ceil(log2 P) rounds everyone has heard from everyone. */
static kpl_status barrier(ucx_state *s, const kpl__coll_args *a, double deadline)
{
    KPL_TRY(all_peers_ok(s));
    int32_t P = s->size, r = s->rank;
    unsigned round = 0;
    for (int64_t d = 1; d < P; d *= 2, round++) {
        int32_t peer[2] = {wrap(r - d, P), wrap(r + d, P)};
        ucp_ep_h to, from;
        KPL_TRY(peer_ep(s, peer[1], &to));
        KPL_TRY(peer_ep(s, peer[0], &from)); /* reports the sender's failure */
        item *it = NULL;
        KPL_TRY(items_get(s, 2, &it));
        ucp_tag_t tag = coll_tag(a->seq, round, 0);
        post_recv(s, NULL, 0, tag, &it[0].recv);
        it[0].send.st = UCS_OK;
        post_send(to, NULL, 0, tag, &it[1].send);
        it[1].recv.st = UCS_OK;
        char what[64];
        snprintf(what, sizeof what, "round %u", round + 1);
        KPL_TRY(wait_items(s, it, 2, peer, what, deadline));
    }
    return KPL_OK;
}

static kpl_status send_recv(ucx_state *s, const kpl__coll_args *a, double deadline)
{
    bool send = a->kind == KPL__COLL_SEND;
    size_t bytes = a->count * kpl_dtype_size(a->dtype);
    ucp_ep_h ep;
    KPL_TRY(peer_ep(s, a->peer, &ep)); /* a receive uses it to hear of the peer's failure */
    item *it = NULL;
    KPL_TRY(items_get(s, 1, &it));
    if (send) {
        it->recv.st = UCS_OK;
        post_send(ep, a->in, bytes, user_tag(s->rank, a->tag), &it->send);
    } else {
        it->send.st = UCS_OK;
        post_recv(s, a->out, bytes, user_tag(a->peer, a->tag), &it->recv);
    }
    KPL_TRY(wait_items(s, it, 1, &a->peer, send ? "send" : "recv", deadline));
    KPL_CHECK(send || it->recv.got == bytes, KPL_ECOMM,
              "recv: rank %d sent %zu bytes with tag %d, %zu expected", (int)a->peer,
              it->recv.got, (int)a->tag, bytes);
    return KPL_OK;
}

/* ---- the backend ---------------------------------------------------------------------------- */

static kpl_status ucx_run(void *state, const kpl__coll_args *a, double deadline)
{
    ucx_state *s = state;
    KPL_CHECK(s && s->ready, KPL_ESTATE, "ucx backend: not initialised");
    KPL_CHECK(!s->broken, KPL_ESTATE, "ucx backend: unusable since an earlier failure left "
              "requests in UCX's hands");
    KPL_CHECK(!atomic_load(&s->cancelled), KPL_ECOMM, "cancelled: the job is ending");
    switch (a->kind) {
    case KPL__COLL_ALLREDUCE: return allreduce(s, a, deadline);
    case KPL__COLL_BROADCAST: return broadcast(s, a, deadline);
    case KPL__COLL_ALLGATHER: return allgather(s, a, deadline);
    case KPL__COLL_REDUCE_SCATTER: return reduce_scatter(s, a, deadline);
    case KPL__COLL_SEND:
    case KPL__COLL_RECV: return send_recv(s, a, deadline);
    case KPL__COLL_BARRIER: return barrier(s, a, deadline);
    default: return KPL_ERROR(KPL_EINVAL, "ucx backend: unknown operation %d", (int)a->kind);
    }
}

/* From the watchdog thread, possibly while run() is waiting: run() sees
 * the flag within POLL_MS and fails; ucp_worker_signal is thread-safe. */
static void ucx_cancel(void *state)
{
    ucx_state *s = state;
    if (!s) return;
    atomic_store(&s->cancelled, true);
    if (s->worker) ucp_worker_signal(s->worker);
}

/* Closes every endpoint (flushing, unless the peer failed), then waits for
 * every rank to be done closing before the worker goes: a peer may still
 * need this worker to complete its own close. */
static void close_all(ucx_state *s)
{
    double until = kpl_seconds() + (s->timeout < FINI_SECONDS ? s->timeout : FINI_SECONDS);
    void **reqs = calloc((size_t)s->size, sizeof *reqs);
    int n = 0;
    for (int32_t r = 0; r < s->size; r++) {
        ucx_peer *p = &s->peers[r];
        if (!p->ep) continue;
        bool force = p->failed != UCS_OK || !s->ready || !reqs;
        ucp_request_param_t prm = {.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS,
                                   .flags = force ? UCP_EP_CLOSE_FLAG_FORCE : 0};
        ucs_status_ptr_t q = ucp_ep_close_nbx(p->ep, &prm);
        p->ep = NULL;
        if (!UCS_PTR_IS_PTR(q)) continue;
        if (reqs) reqs[n++] = q;
        else ucp_request_free(q);
    }
    while (n > 0 && kpl_seconds() < until) {
        ucp_worker_progress(s->worker);
        for (int i = 0; i < n;)
            if (ucp_request_check_status(reqs[i]) != UCS_INPROGRESS) {
                ucp_request_free(reqs[i]);
                reqs[i] = reqs[--n];
            } else {
                i++;
            }
    }
    for (int i = 0; i < n; i++) ucp_request_free(reqs[i]); /* released when they end */
    free(reqs);
    /* Only when every rank is known to be here: the state is whole and no
     * peer failed (a dead rank would never join). */
    if (!s->ready || s->nfailed || s->broken) return;
    MPI_Request b;
    if (MPI_Ibarrier(s->comm, &b) != MPI_SUCCESS) return;
    int done = 0;
    while (!done && kpl_seconds() < until) {
        if (!ucp_worker_progress(s->worker)) poll(NULL, 0, 1);
        if (MPI_Test(&b, &done, MPI_STATUS_IGNORE) != MPI_SUCCESS) break;
    }
    /* Not done by then: a rank never came; the request is left to MPI. */
}

static void ucx_fini(void *state)
{
    ucx_state *s = state;
    if (!s) return;
    if (s->worker) {
        if (s->peers) close_all(s);
        if (s->self_addr) ucp_worker_release_address(s->worker, s->self_addr);
        ucp_worker_destroy(s->worker);
    }
    if (s->ctx) ucp_cleanup(s->ctx);
    free(s->items); /* NULL when abandon() left them to UCX */
    free(s->slots);
    free(s->scratch);
    free(s->steps);
    free(s->pid);
    free(s->node);
    free(s->peers);
    free(s->addrs);
    free(s->addr_len);
    free(s->addr_off);
    free(s);
}

/* Every rank learns whether every rank got this far: returns this rank's
 * own failure, or an error naming the first rank that failed. */
static kpl_status agree(MPI_Comm comm, int32_t rank, int32_t size, kpl_status st,
                        const char *stage)
{
    int mine = st < 0 ? (int)rank : (int)size, first = 0;
    int err = MPI_Allreduce(&mine, &first, 1, MPI_INT, MPI_MIN, comm);
    if (st < 0) return st;
    if (err != MPI_SUCCESS) return mpi_fail(err, "MPI_Allreduce");
    if (first < size)
        return KPL_ERROR(KPL_EBACKEND, "ucx backend: rank %d failed to %s", first, stage);
    return KPL_OK;
}

/* Whether UCX_TLS leaves on one of the transports `names` (NULL-ended):
 * unset, a list naming one of them, or an exclusion list (^...) naming
 * none.  A job run with UCX_TLS=tcp,self then really runs on TCP. */
static bool tls_allows(const char *const *names)
{
    const char *t = getenv("UCX_TLS");
    if (!t || !*t) return true;
    bool exclude = *t == '^', named = false;
    if (exclude) t++;
    while (*t) {
        size_t n = strcspn(t, ",");
        for (const char *const *m = names; *m; m++)
            if (n == strlen(*m) && !strncmp(t, *m, n)) named = true;
        t += n + (t[n] == ',');
    }
    return exclude ? !named : named;
}

static const char *const TLS_MM[] = {"posix", "sysv", "mm", "sm", "shm", "all", NULL};
static const char *const TLS_CMA[] = {"cma", "sm", "shm", "all", NULL};

/* This rank's UCP context, worker and event fd. */
static kpl_status setup_local(ucx_state *s, const kpl__comm_boot *b)
{
    ucp_config_t *cfg = NULL;
    ucs_status_t st = ucp_config_read(NULL, NULL, &cfg);
    KPL_CHECK(st == UCS_OK, KPL_EBACKEND, "ucx backend: ucp_config_read: %s",
              ucs_status_string(st));
    /* Endpoints that report peer failure exclude shared memory in UCX 1.13
     * unless its failure checks are on (off by default): without this, ranks
     * of one node would talk over TCP loopback.  A user's own setting wins. */
    bool mm = tls_allows(TLS_MM) && !getenv("UCX_MM_ERROR_HANDLING") &&
              !getenv("UCX_POSIX_ERROR_HANDLING") && !getenv("UCX_SYSV_ERROR_HANDLING");
    if (mm && (st = ucp_config_modify(cfg, "MM_ERROR_HANDLING", "y")) != UCS_OK) {
        ucp_config_release(cfg);
        return KPL_ERROR(KPL_EBACKEND, "ucx backend: ucp_config_modify(MM_ERROR_HANDLING): %s",
                         ucs_status_string(st));
    }
    /* A dead peer that is not in the middle of a transfer shows at UCX's
     * next keepalive round: every KEEPALIVE_SECONDS rather than 20 s. */
    if (!getenv("UCX_KEEPALIVE_INTERVAL") &&
        (st = ucp_config_modify(cfg, "KEEPALIVE_INTERVAL", KEEPALIVE_SECONDS)) != UCS_OK) {
        ucp_config_release(cfg);
        return KPL_ERROR(KPL_EBACKEND, "ucx backend: ucp_config_modify(KEEPALIVE_INTERVAL): %s",
                         ucs_status_string(st));
    }
    ucp_params_t p = {
        .field_mask = UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_ESTIMATED_NUM_EPS |
                      UCP_PARAM_FIELD_ESTIMATED_NUM_PPN | UCP_PARAM_FIELD_NAME,
        .features = UCP_FEATURE_TAG | UCP_FEATURE_WAKEUP,
        .estimated_num_eps = (size_t)b->size,
        .estimated_num_ppn = (size_t)b->local_size,
        .name = "kpl",
    };
    st = ucp_init(&p, cfg, &s->ctx);
    ucp_config_release(cfg);
    if (st != UCS_OK) {
        s->ctx = NULL;
        return KPL_ERROR(KPL_EBACKEND, "ucx backend: ucp_init: %s", ucs_status_string(st));
    }
    /* run() comes from the executor or the caller's thread, never both at once. */
    ucp_worker_params_t w = {.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE,
                             .thread_mode = UCS_THREAD_MODE_SERIALIZED};
    st = ucp_worker_create(s->ctx, &w, &s->worker);
    if (st != UCS_OK) {
        s->worker = NULL;
        return KPL_ERROR(KPL_EBACKEND, "ucx backend: ucp_worker_create: %s",
                         ucs_status_string(st));
    }
    st = ucp_worker_get_efd(s->worker, &s->efd);
    KPL_CHECK(st == UCS_OK, KPL_EBACKEND, "ucx backend: ucp_worker_get_efd: %s",
              ucs_status_string(st));
    size_t len = 0;
    st = ucp_worker_get_address(s->worker, &s->self_addr, &len);
    if (st != UCS_OK) {
        s->self_addr = NULL;
        return KPL_ERROR(KPL_EBACKEND, "ucx backend: ucp_worker_get_address: %s",
                         ucs_status_string(st));
    }
    KPL_CHECK(len <= (size_t)INT32_MAX, KPL_EBACKEND, "ucx backend: worker address of %zu bytes",
              len);
    s->addr_len = calloc((size_t)s->size, sizeof *s->addr_len);
    s->addr_off = calloc((size_t)s->size, sizeof *s->addr_off);
    s->peers = calloc((size_t)s->size, sizeof *s->peers);
    s->steps = calloc(2 * (size_t)s->size, sizeof *s->steps);
    s->pid = calloc((size_t)s->size, sizeof *s->pid);
    s->node = calloc((size_t)s->size, sizeof *s->node);
    KPL_CHECK(s->addr_len && s->addr_off && s->peers && s->steps && s->pid && s->node,
              KPL_ENOMEM, "ucx backend: no memory");
    s->addr_len[s->rank] = (int)len;
    for (int32_t r = 0; r < s->size; r++) s->peers[r] = (ucx_peer){s, r, NULL, UCS_OK};
    return KPL_OK;
}

/* Every rank's worker address, for endpoints made now and later. */
static kpl_status exchange_addresses(ucx_state *s)
{
    int mine = s->addr_len[s->rank];
    int err = MPI_Allgather(&mine, 1, MPI_INT, s->addr_len, 1, MPI_INT, s->comm);
    if (err != MPI_SUCCESS) return mpi_fail(err, "MPI_Allgather of address lengths");
    size_t total = 0;
    for (int32_t r = 0; r < s->size; r++) {
        KPL_CHECK(total + (size_t)s->addr_len[r] <= (size_t)INT32_MAX, KPL_EBACKEND,
                  "ucx backend: worker addresses exceed 2 GB");
        s->addr_off[r] = (int)total;
        total += (size_t)s->addr_len[r];
    }
    s->addrs = malloc(total ? total : 1);
    KPL_TRY(agree(s->comm, s->rank, s->size,
                  s->addrs ? KPL_OK : KPL_ERROR(KPL_ENOMEM, "ucx backend: no memory for %zu "
                                                "bytes of addresses", total),
                  "allocate the address table"));
    err = MPI_Allgatherv(s->self_addr, mine, MPI_BYTE, s->addrs, s->addr_len, s->addr_off,
                         MPI_BYTE, s->comm);
    if (err != MPI_SUCCESS) return mpi_fail(err, "MPI_Allgatherv of addresses");
    ucp_worker_release_address(s->worker, s->self_addr);
    s->self_addr = NULL;
    return KPL_OK;
}

/* Which node every rank is on, their pids, and whether the ranks of a node
 * may read each other's memory: each rank reads its predecessor's probe
 * (ptrace rules, containers and PID namespaces can forbid it, or point a
 * pid at another process); one failure anywhere turns CMA off for all. */
static kpl_status setup_cma(ucx_state *s)
{
    MPI_Comm local;
    int err = MPI_Comm_split_type(s->comm, MPI_COMM_TYPE_SHARED, s->rank, MPI_INFO_NULL, &local);
    if (err != MPI_SUCCESS) return mpi_fail(err, "MPI_Comm_split_type");
    int leader = s->rank;
    err = MPI_Allreduce(MPI_IN_PLACE, &leader, 1, MPI_INT, MPI_MIN, local);
    MPI_Comm_free(&local);
    if (err != MPI_SUCCESS) return mpi_fail(err, "MPI_Allreduce on the node");
    s->probe = 0x6b706c2d636d6100ull ^ (uint64_t)s->rank;
    int64_t mine[3] = {(int64_t)getpid(), leader, (int64_t)(uintptr_t)&s->probe};
    int64_t *all = malloc((size_t)s->size * sizeof mine);
    KPL_TRY(agree(s->comm, s->rank, s->size,
                  all ? KPL_OK : KPL_ERROR(KPL_ENOMEM, "ucx backend: no memory"),
                  "allocate the process table"));
    err = MPI_Allgather(mine, 3, MPI_INT64_T, all, 3, MPI_INT64_T, s->comm);
    if (err != MPI_SUCCESS) {
        free(all);
        return mpi_fail(err, "MPI_Allgather of processes");
    }
    for (int32_t r = 0; r < s->size; r++) {
        s->pid[r] = (pid_t)all[3 * r];
        s->node[r] = (int32_t)all[3 * r + 1];
    }
    int32_t prev = wrap(s->rank - 1, s->size);
    int ok = tls_allows(TLS_CMA);
    if (ok && prev != s->rank && s->node[prev] == s->node[s->rank]) {
        uint64_t v = 0;
        ok = cma_read(s, prev, &v, (uint64_t)all[3 * prev + 2], sizeof v) == KPL_OK &&
             v == (0x6b706c2d636d6100ull ^ (uint64_t)prev);
    }
    free(all);
    err = MPI_Allreduce(MPI_IN_PLACE, &ok, 1, MPI_INT, MPI_LAND, s->comm);
    if (err != MPI_SUCCESS) return mpi_fail(err, "MPI_Allreduce of the CMA probe");
    s->cma = ok;
    return KPL_OK;
}

/* Endpoints to both ring neighbours and one empty message each way, so
 * that an unreachable neighbour shows now, not in the first collective. */
static kpl_status connect_ring(ucx_state *s)
{
    int32_t peer[2] = {wrap(s->rank - 1, s->size), wrap(s->rank + 1, s->size)};
    ucp_ep_h to, from;
    KPL_TRY(peer_ep(s, peer[1], &to));
    KPL_TRY(peer_ep(s, peer[0], &from));
    item *it = NULL;
    KPL_TRY(items_get(s, 2, &it));
    ucp_tag_t tag = coll_tag(0, STEP_WARMUP, 0);
    post_recv(s, NULL, 0, tag, &it[0].recv);
    it[0].send.st = UCS_OK;
    post_send(to, NULL, 0, tag, &it[1].send);
    it[1].recv.st = UCS_OK;
    return wait_items(s, it, 2, peer, "ucx backend: connecting the ring",
                      kpl_seconds() + s->timeout);
}

static kpl_status ucx_init(const kpl__comm_boot *b, void **state)
{
    *state = NULL;
    KPL_CHECK(b->size <= MAX_RANKS, KPL_ERANGE, "ucx backend: %d ranks; at most %d",
              (int)b->size, MAX_RANKS);
    ucx_state *s = calloc(1, sizeof *s);
    kpl_status st = s ? KPL_OK : KPL_ERROR(KPL_ENOMEM, "ucx backend: no memory");
    if (s) {
        *state = s;
        s->rank = b->rank;
        s->size = b->size;
        s->comm = b->comm;
        s->timeout = b->timeout;
        s->efd = -1;
        atomic_init(&s->cancelled, false);
        st = setup_local(s, b);
    }
    KPL_TRY(agree(b->comm, b->rank, b->size, st, "set up UCX"));
    KPL_TRY(exchange_addresses(s));
    KPL_TRY(setup_cma(s));
    st = s->size > 1 ? connect_ring(s) : KPL_OK;
    KPL_TRY(agree(s->comm, s->rank, s->size, st, "connect to its ring neighbours"));
    s->ready = true;
    return KPL_OK;
}

static const kpl__comm_backend ucx_backend = {
    .name = "ucx",
    .device_type = KPL_DEVICE_CPU,
    .init = ucx_init,
    .fini = ucx_fini,
    .run = ucx_run,
    .cancel = ucx_cancel,
};

const kpl__comm_backend *kpl__comm_ucx_backend(void) { return &ucx_backend; }
