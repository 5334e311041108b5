/*
 * loader.c — the data pipeline's processes and the shared memory between
 * them.
 *
 *   reader (1 process)      --items + record bytes-->  ring
 *   transformers (N)        --decoded samples------->  batch slots
 *   iterator (the caller)   <--whole batches---------  batch slots
 *
 * One anonymous shared mapping, made before fork, holds everything: a
 * control block (a robust process-shared mutex and futex wake-ups), a
 * queue of items (one per sample: which example, where in the epoch, which
 * batch and index, where its bytes are), a ring of record bodies, and
 * prefetch + 1 batch slots.  The reader walks the rank's order for each
 * epoch (sampler.c), loads chunks through a small cache, copies each
 * record's body into the ring and queues an item.  A transformer takes the
 * oldest item, waits until the slot of its batch is free, decodes and
 * augments straight into the slot, and marks the item done; the ring and
 * queue are released in order.  Slot k serves batch g with g % slots == k;
 * when the consumer drops the batch's tensors, the slot moves on to batch
 * g + slots.
 *
 * A slot holds every sample at the transform's largest size.  With
 * keep_ratio crops samples are smaller and of differing sizes: each is
 * written densely at the start of its area with its size beside it, and
 * the consumer, which owns the slot while it hands it out, lays the batch
 * out padded to (N, C, Hb, Wb) before it makes the tensors (relay).
 *
 * Why it cannot deadlock: items are queued in batch order and taken in
 * queue order, so every item of the batch the consumer waits for was
 * taken before any item of a later batch, and its slot is free (the
 * consumer holds at most the previous batch).  Bounded waits everywhere
 * (100 ms) let every process notice a stop, a failure or a dead parent.
 */
#define _GNU_SOURCE
#include "loader_impl.h"
#include "transform_impl.h"

#include <errno.h>
#include <limits.h>
#include <linux/futex.h>
#include <pthread.h>
#include <stdatomic.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define WAIT_MS 100
#define ALIGN_UP(x, a) (((x) + (a) - 1) / (a) * (a))
#define WHY_BYTES 512 /* a skipped sample's reason, kept in its slot for the consumer */
#define EXIT_REPORTED 3 /* a child's exit status after it put its error in the shared block */

enum { ITEM_FREE, ITEM_READY, ITEM_TAKEN, ITEM_DONE };

typedef struct {
    int64_t g;                   /* batch number since the loader started */
    int64_t epoch, pos, example; /* pos: position in the epoch */
    uint64_t ring_off, ring_end; /* monotonic ring positions of the body */
    uint32_t len;
    int32_t j, bsize, last; /* index in the batch, its size, whether it ends the epoch */
    int32_t state;
} shm_item;

typedef struct {
    int64_t g;          /* the batch this slot is for */
    int64_t epoch, pos; /* of the batch's first sample */
    int32_t size, done, skipped, last;
    int32_t held; /* handed to the consumer and not yet released */
    /* The consumer's, once it has compacted and laid the batch out (so
     * that a retry after a failed hand-out does not do it twice): */
    int32_t laid;
    int64_t n, h, w; /* samples kept, the images' (padded) height and width */
} shm_slot;

/* A wake-up channel: waiters sleep on a futex until the sequence number
 * moves.  Not a pthread condition variable: glibc's keep per-waiter state
 * in the shared object, and a waiter killed inside pthread_cond_wait makes
 * the next broadcast wait for it forever.  A futex keeps its waiters in
 * the kernel, which forgets a dead one. */
typedef struct {
    _Atomic uint32_t seq;
    uint32_t waiters; /* processes inside shm_wait (changed under the lock) */
} shm_event;

typedef struct {
    pthread_mutex_t mu;
    shm_event cv_reader, cv_work, cv_iter;
    int32_t stop;   /* the consumer is shutting the pipeline down */
    int32_t failed; /* a child reported an error (in `error`) */
    char error[1536];
    uint64_t q_prod, q_take, q_free; /* items produced, taken, released */
    uint64_t ring_head, ring_tail;   /* bytes reserved, released (monotonic) */
} shm_ctl;

struct slot_ref {
    kpl_loader *l;
    int idx;
};

struct kpl_loader {
    kpl_loader_config cfg;
    kpl_dataset *ds;
    kpl__xform x;
    kpl__order_params op;
    int64_t epoch_size, epoch_end, batches; /* samples, samples used, batches per epoch */
    int64_t B;
    int nslots;
    uint64_t nitems, ring_bytes;
    int64_t max_boxes;
    /* one slot's areas (byte offsets) */
    size_t img_bytes, mask_bytes;
    size_t o_image, o_label, o_boxes, o_box_labels, o_num_boxes, o_mask, o_example, o_valid;
    size_t o_size, o_orig; /* (B, 2) i64 each: a sample's (h, w) as written, and stored */
    size_t o_why; /* (B, WHY_BYTES): why a sample was skipped */
    size_t slot_bytes;
    int source; /* the `path` or `key` string feature that names an example's source, -1 */
    /* the mapping */
    void *map;
    size_t map_bytes;
    shm_ctl *ctl;
    shm_item *items;
    shm_slot *slots;
    uint8_t *ring, *slot_data;
    kpl_device *pinned;
    /* processes: [0] reader, [1..] workers */
    int nproc;
    pid_t *pids;
    bool *alive;
    pid_t parent;
    /* the consumer's side */
    int64_t g_next, epoch, pos;
    kpl_status dead; /* < 0: failed for good, message in dead_msg */
    char dead_msg[2048];
    int outstanding; /* batches handed out and not released */
    int64_t skipped; /* corrupt samples dropped from the batches handed out */
    uint8_t *relay;  /* keep_ratio: one sample's image, moved aside while the batch is
                      * laid out padded (the consumer's; img_bytes) */
    bool destroyed;
    struct slot_ref *refs;
};

/* ---- shared-memory synchronisation ------------------------------------------------ */

/* Locks the robust mutex.  A process that died holding it leaves the
 * pipeline broken: mark it failed and carry on so everyone can leave. */
static void shm_lock(shm_ctl *c)
{
    int r = pthread_mutex_lock(&c->mu);
    if (r == EOWNERDEAD) {
        pthread_mutex_consistent(&c->mu);
        if (!c->failed) {
            c->failed = 1;
            snprintf(c->error, sizeof c->error, "a pipeline process died holding the lock");
        }
    } else {
        KPL_ASSERT(r == 0, "loader: pthread_mutex_lock failed");
    }
}

static void shm_unlock(shm_ctl *c) { pthread_mutex_unlock(&c->mu); }

/* Wakes every process waiting on e.  Called with the lock held.  The
 * system call is made only when somebody waits: the reader and the
 * transformers signal each other once per sample, mostly to nobody
 * (a third of the loader's futex calls on Fashion-MNIST went that way). */
static void shm_wake(shm_event *e)
{
    atomic_fetch_add_explicit(&e->seq, 1, memory_order_release);
    if (e->waiters) syscall(SYS_futex, &e->seq, FUTEX_WAKE, INT_MAX, NULL, NULL, 0);
}

/* Called with the lock held: releases it, sleeps until e is woken or
 * WAIT_MS pass, takes it again.  A wake between the unlock and the sleep
 * is not lost: the futex sleeps only while the sequence is unchanged, and
 * the waiter is counted before the unlock, so every waker (who holds the
 * lock) sees it. */
static void shm_wait(shm_ctl *c, shm_event *e)
{
    uint32_t seen = atomic_load_explicit(&e->seq, memory_order_acquire);
    e->waiters++;
    shm_unlock(c);
    struct timespec t = {0, WAIT_MS * 1000000L};
    syscall(SYS_futex, &e->seq, FUTEX_WAIT, seen, &t, NULL, 0);
    shm_lock(c);
    e->waiters--;
}

static kpl_status shm_init(shm_ctl *c)
{
    pthread_mutexattr_t ma;
    pthread_mutexattr_init(&ma);
    pthread_mutexattr_setpshared(&ma, PTHREAD_PROCESS_SHARED);
    pthread_mutexattr_setrobust(&ma, PTHREAD_MUTEX_ROBUST);
    int r = pthread_mutex_init(&c->mu, &ma);
    pthread_mutexattr_destroy(&ma);
    KPL_CHECK(r == 0, KPL_EIO, "loader: process-shared lock setup failed: %s", strerror(r));
    return KPL_OK;
}

/* ---- children -------------------------------------------------------------------- */

/* Whether a child should leave: a stop, a failure, or its parent gone. */
static bool child_should_exit(const kpl_loader *l)
{
    return l->ctl->stop || l->ctl->failed || getppid() != l->parent;
}

/* Records a child's error for the consumer (first one wins). */
static void child_fail(kpl_loader *l, const char *stage, const char *msg)
{
    shm_lock(l->ctl);
    if (!l->ctl->failed) {
        l->ctl->failed = 1;
        snprintf(l->ctl->error, sizeof l->ctl->error, "%s (pid %d): %s", stage, (int)getpid(),
                 msg);
    }
    shm_wake(&l->ctl->cv_iter);
    shm_wake(&l->ctl->cv_work);
    shm_wake(&l->ctl->cv_reader);
    shm_unlock(l->ctl);
}

/* The reader's chunk cache: decompressed chunks stay while later positions
 * of the epoch still need them, within a byte budget. */
typedef struct {
    kpl_chunk **chunk;
    int64_t *id, *tick;
    int cap;
    int32_t *where;  /* chunk -> entry, -1 */
    int32_t *uses;   /* chunk -> positions left in this epoch */
    int64_t now;
} chunk_cache;

static kpl_status cache_get(kpl_loader *l, chunk_cache *cc, int64_t c, kpl_chunk **out)
{
    int e = cc->where[c];
    if (e < 0) {
        /* A free entry, else the least recently used one no longer needed,
         * else the least recently used one (read again later if needed). */
        int best = -1, best_idle = -1;
        for (int i = 0; i < cc->cap; i++) {
            if (cc->id[i] < 0) {
                best = i;
                break;
            }
            if (cc->uses[cc->id[i]] == 0 && (best_idle < 0 || cc->tick[i] < cc->tick[best_idle]))
                best_idle = i;
            if (best_idle < 0 && (best < 0 || cc->tick[i] < cc->tick[best])) best = i;
        }
        if (best_idle >= 0 && (best < 0 || cc->id[best] >= 0)) best = best_idle;
        e = best;
        if (cc->id[e] >= 0) cc->where[cc->id[e]] = -1;
        cc->id[e] = -1;
        KPL_TRY(kpl_dataset_read_chunk(l->ds, c, cc->chunk[e]));
        cc->id[e] = c;
        cc->where[c] = e;
    }
    cc->tick[e] = ++cc->now;
    *out = cc->chunk[e];
    return KPL_OK;
}

/* Queues one sample: waits for queue and ring space, copies the body.
 * Returns 1 when the pipeline is stopping. */
static int reader_push(kpl_loader *l, shm_item *it, const uint8_t *body, uint32_t len)
{
    shm_ctl *c = l->ctl;
    uint64_t need = ALIGN_UP((uint64_t)len, 8);
    shm_lock(c);
    for (;;) {
        if (child_should_exit(l)) {
            shm_unlock(c);
            return 1;
        }
        uint64_t start = c->ring_head;
        uint64_t at = start % l->ring_bytes;
        if (at + need > l->ring_bytes) start += l->ring_bytes - at; /* no wrapping inside */
        if (c->q_prod - c->q_free < l->nitems && start + need - c->ring_tail <= l->ring_bytes) {
            it->ring_off = start;
            it->ring_end = start + need;
            c->ring_head = start + need;
            break;
        }
        shm_wait(c, &c->cv_reader);
    }
    shm_unlock(c);
    /* The reserved bytes are ours until the item is released. */
    memcpy(l->ring + it->ring_off % l->ring_bytes, body, len);
    shm_lock(c);
    it->state = ITEM_READY;
    l->items[c->q_prod % l->nitems] = *it;
    c->q_prod++;
    shm_wake(&c->cv_work);
    shm_unlock(c);
    return 0;
}

static kpl_status reader_run(kpl_loader *l)
{
    kpl_status st = KPL_OK;
    int64_t m = l->epoch_size, nc = kpl_dataset_num_chunks(l->ds);
    int64_t *order = malloc((size_t)(m ? m : 1) * sizeof *order);
    int32_t *pc = malloc((size_t)(m ? m : 1) * sizeof *pc);
    int32_t *pr = malloc((size_t)(m ? m : 1) * sizeof *pr);
    size_t max_raw = 1;
    for (int64_t c = 0; c < nc; c++) {
        kpl_chunk_info ci = kpl_dataset_chunk_info(l->ds, c);
        if (ci.raw_bytes > max_raw) max_raw = ci.raw_bytes;
    }
    chunk_cache cc = {0};
    uint8_t *rbuf = NULL; /* example shuffle over stored chunks: one record */
    size_t rcap = 0;
    int64_t cap = (int64_t)(l->cfg.cache_bytes / max_raw);
    if (cap < l->cfg.shuffle_window + 2) cap = l->cfg.shuffle_window + 2;
    if (cap > nc) cap = nc;
    if (cap < 1) cap = 1;
    cc.cap = (int)cap;
    cc.chunk = calloc((size_t)cap, sizeof *cc.chunk);
    cc.id = malloc((size_t)cap * sizeof *cc.id);
    cc.tick = calloc((size_t)cap, sizeof *cc.tick);
    cc.where = malloc((size_t)nc * sizeof *cc.where);
    cc.uses = malloc((size_t)nc * sizeof *cc.uses);
    if (!order || !pc || !pr || !cc.chunk || !cc.id || !cc.tick || !cc.where || !cc.uses) {
        st = KPL_ERROR(KPL_ENOMEM, "reader: no memory for the order of %lld examples",
                       (long long)m);
        goto fail;
    }
    for (int64_t i = 0; i < cap; i++) {
        cc.id[i] = -1;
        if (!(cc.chunk[i] = kpl_chunk_create())) {
            st = KPL_ERROR(KPL_ENOMEM, "reader: no memory for chunk buffers");
            goto fail;
        }
    }
    for (int64_t c = 0; c < nc; c++) cc.where[c] = -1;
    kpl__dataset_advise(l->ds, l->cfg.shuffle != KPL_SHUFFLE_EXAMPLE);

    int64_t g = 0;
    for (int64_t e = l->epoch, p = l->pos;; e++, p = 0) {
        KPL_TRY_GOTO(kpl__order_epoch(l->ds, &l->op, e, order));
        int64_t end = l->epoch_end;
        for (int64_t c = 0; c < nc; c++) cc.uses[c] = 0;
        for (int64_t i = p; i < end; i++) {
            int64_t ch;
            int rec;
            KPL_TRY_GOTO(kpl_dataset_locate(l->ds, order[i], &ch, &rec));
            pc[i] = (int32_t)ch;
            pr[i] = rec;
            cc.uses[ch]++;
        }
        int64_t ahead = p; /* read-ahead hints run one chunk in front */
        for (int64_t i = p; i < end; i++) {
            const uint8_t *body;
            uint32_t len;
            cc.uses[pc[i]]--;
            if (l->cfg.shuffle == KPL_SHUFFLE_EXAMPLE && cc.where[pc[i]] < 0 &&
                !kpl_dataset_chunk_info(l->ds, pc[i]).compressed) {
                /* Random access to a stored chunk: read just the record. */
                KPL_TRY_GOTO(kpl__dataset_read_record(l->ds, order[i], &rbuf, &rcap, &body, &len));
            } else {
                kpl_chunk *chunk;
                KPL_TRY_GOTO(cache_get(l, &cc, pc[i], &chunk));
                kpl__chunk_record_body(chunk, pr[i], &body, &len);
            }
            if (ahead <= i) ahead = i + 1;
            while (ahead < end && cc.where[pc[ahead]] >= 0) ahead++;
            /* (No hint for a record read alone: it would pull in its chunk.) */
            if (ahead < end && (ahead == i + 1 || pc[ahead] != pc[ahead - 1]) &&
                (l->cfg.shuffle != KPL_SHUFFLE_EXAMPLE ||
                 kpl_dataset_chunk_info(l->ds, pc[ahead]).compressed))
                kpl__dataset_willneed(l->ds, pc[ahead]);
            int64_t k = (i - p) / l->B, first = p + k * l->B;
            int64_t bsize = end - first < l->B ? end - first : l->B;
            shm_item it = {.g = g + k, .epoch = e, .pos = i, .example = order[i], .len = len,
                           .j = (int32_t)(i - first), .bsize = (int32_t)bsize,
                           .last = first + bsize >= end};
            if (reader_push(l, &it, body, len)) goto fail; /* stopping: not an error */
        }
        g += (end - p + l->B - 1) / l->B;
    }
fail:
    for (int i = 0; cc.chunk && i < cc.cap; i++) kpl_chunk_destroy(cc.chunk[i]);
    free(cc.chunk);
    free(cc.id);
    free(cc.tick);
    free(cc.where);
    free(cc.uses);
    free(rbuf);
    free(order);
    free(pc);
    free(pr);
    return st;
}

static uint8_t *slot_base(const kpl_loader *l, int idx)
{
    return l->slot_data + (size_t)idx * l->slot_bytes;
}

/* Why example `it` failed, in msg[n]: "example 74 (shard 0, chunk 3,
 * record 12, path 'n01/x.jpg'): " and then the error, which starts with
 * `where` ("example 74"), said once.  values: the parsed record, or NULL. */
static void describe_failure(const kpl_loader *l, const shm_item *it,
                             const kpl_feature_value *values, const char *where, char *msg,
                             size_t n)
{
    char err[1024];
    snprintf(err, sizeof err, "%s", kpl_last_error());
    const char *rest = err;
    size_t wl = strlen(where);
    if (!strncmp(err, where, wl) && (err[wl] == ',' || err[wl] == ':') && err[wl + 1] == ' ')
        rest = err + wl + 2;
    int64_t ch = -1;
    int rec = -1;
    kpl_dataset_locate(l->ds, it->example, &ch, &rec);
    kpl_chunk_info ci = kpl_dataset_chunk_info(l->ds, ch < 0 ? 0 : ch);
    char src[300] = "";
    if (values && l->source >= 0) {
        /* A path is text; an LMDB key may be any bytes: control bytes shown
         * as '?', and a long one cut. */
        const kpl_feature_value *v = &values[l->source];
        const char *name = kpl_dataset_feature(l->ds, l->source)->name;
        size_t k = (size_t)snprintf(src, sizeof src, ", %s '", name);
        const uint8_t *p = v->data;
        for (uint32_t i = 0; i < v->count && k + 6 < sizeof src; i++)
            src[k++] = p[i] < 0x20 || p[i] == 0x7f ? '?' : (char)p[i];
        if (v->count && k + 6 >= sizeof src) src[k++] = '.', src[k++] = '.', src[k++] = '.';
        src[k++] = '\'';
        src[k] = 0;
    }
    snprintf(msg, n, "example %lld (shard %d, chunk %lld, record %d%s): %s",
             (long long)it->example, ci.shard, (long long)ci.chunk_in_shard, rec, src, rest);
}

/* Transforms one item into its batch slot.  *skip: a corrupt sample that
 * skip_corrupt drops; its reason goes to the slot, and the consumer names
 * it when it hands the batch out (a worker may run into the next epoch's
 * samples before the consumer wants them, or ever does). */
static kpl_status work_one(kpl_loader *l, const shm_item *it, kpl__xform_scratch *s,
                           kpl_feature_value *values, bool *skip)
{
    uint8_t *b = slot_base(l, (int)(it->g % l->nslots));
    int64_t j = it->j, mb = l->max_boxes;
    ((int64_t *)(b + l->o_example))[j] = it->example;
    b[l->o_valid + j] = 0;
    *skip = false;
    char where[48];
    snprintf(where, sizeof where, "example %lld", (long long)it->example);
    const uint8_t *body = l->ring + it->ring_off % l->ring_bytes;
    kpl_status st = kpl__record_parse(kpl_dataset_num_features(l->ds),
                                      kpl_dataset_feature(l->ds, 0),
                                      body, it->len, values, where);
    bool parsed = st >= 0;
    if (st >= 0) {
        kpl__sample_out out = {
            .image = b + l->o_image + (size_t)j * l->img_bytes,
            .label = l->x.label >= 0 ? (int64_t *)(b + l->o_label) + j : NULL,
            .boxes = mb ? (float *)(b + l->o_boxes) + j * mb * 4 : NULL,
            .box_labels = mb ? (int64_t *)(b + l->o_box_labels) + j * mb : NULL,
            .num_boxes = mb ? (int64_t *)(b + l->o_num_boxes) + j : NULL,
            .mask = l->mask_bytes ? b + l->o_mask + (size_t)j * l->mask_bytes : NULL,
            .size = (int64_t *)(b + l->o_size) + 2 * j,
            .orig_size = (int64_t *)(b + l->o_orig) + 2 * j,
        };
        st = kpl__xform_sample(&l->x, values, l->cfg.seed, it->epoch, it->example, s, &out);
    }
    if (st >= 0) {
        b[l->o_valid + j] = 1;
        return KPL_OK;
    }
    char msg[1536];
    describe_failure(l, it, parsed ? values : NULL, where, msg, sizeof msg);
    if (st == KPL_EFORMAT && l->cfg.transform.skip_corrupt) {
        char *why = (char *)b + l->o_why + (size_t)j * WHY_BYTES;
        size_t k = strlen(msg) < WHY_BYTES ? strlen(msg) : WHY_BYTES - 1;
        memcpy(why, msg, k);
        why[k] = 0;
        *skip = true;
        return KPL_OK;
    }
    return KPL_ERROR(st, "%s", msg);
}

static kpl_status worker_run(kpl_loader *l)
{
    shm_ctl *c = l->ctl;
    kpl__xform_scratch *s = kpl__xform_scratch_create();
    kpl_feature_value *values = malloc((size_t)kpl_dataset_num_features(l->ds) * sizeof *values);
    kpl_status st = KPL_OK;
    if (!s || !values) {
        st = KPL_ERROR(KPL_ENOMEM, "transformer: no memory for scratch buffers");
        goto fail;
    }
    for (;;) {
        shm_lock(c);
        while (!child_should_exit(l) && c->q_take == c->q_prod) shm_wait(c, &c->cv_work);
        if (child_should_exit(l)) {
            shm_unlock(c);
            break;
        }
        uint64_t q = c->q_take++;
        shm_item it = l->items[q % l->nitems];
        l->items[q % l->nitems].state = ITEM_TAKEN;
        shm_slot *slot = &l->slots[it.g % l->nslots];
        while (!child_should_exit(l) && slot->g != it.g) shm_wait(c, &c->cv_work);
        bool leave = child_should_exit(l);
        shm_unlock(c);
        if (leave) break;

        bool skip = false;
        KPL_TRY_GOTO(work_one(l, &it, s, values, &skip));

        shm_lock(c);
        l->items[q % l->nitems].state = ITEM_DONE;
        bool freed = false;
        while (c->q_free < c->q_take && l->items[c->q_free % l->nitems].state == ITEM_DONE) {
            shm_item *f = &l->items[c->q_free % l->nitems];
            f->state = ITEM_FREE;
            c->ring_tail = f->ring_end;
            c->q_free++;
            freed = true;
        }
        if (freed) shm_wake(&c->cv_reader);
        slot->size = it.bsize;
        slot->epoch = it.epoch;
        slot->pos = it.pos - it.j;
        slot->last = it.last;
        slot->skipped += skip;
        if (++slot->done == slot->size) shm_wake(&c->cv_iter);
        shm_unlock(c);
    }
fail:
    kpl__xform_scratch_destroy(s);
    free(values);
    return st;
}

/* The body of a forked child: never returns. */
static void child_main(kpl_loader *l, int k)
{
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (getppid() != l->parent) _exit(1); /* the parent died before prctl */
    /* A stop is the trainer's to handle: Ctrl-C and the SIGTERM that
     * schedulers (SLURM, Kubernetes, systemd, timeout) send to every
     * process of a job reach these processes too, and must not take the
     * data away from a trainer that is finishing its step and writing its
     * checkpoint.  The trainer ends them (a stop flag, then SIGKILL), and
     * PR_SET_PDEATHSIG ends them when the trainer dies. */
    signal(SIGINT, SIG_IGN);
    signal(SIGTERM, SIG_IGN);
    signal(SIGPIPE, SIG_DFL);
    sigset_t none;
    sigemptyset(&none);
    sigprocmask(SIG_SETMASK, &none, NULL);
    kpl_status st;
    char stage[48];
    if (k == 0) {
        snprintf(stage, sizeof stage, "reader");
        st = reader_run(l);
    } else {
        snprintf(stage, sizeof stage, "transformer %d", k - 1);
        st = worker_run(l);
    }
    if (st < 0) child_fail(l, stage, kpl_last_error());
    _exit(st < 0 ? EXIT_REPORTED : 0);
}

/* ---- the consumer's side ------------------------------------------------------------ */

static const char *stage_name(int k, char *buf, size_t n)
{
    if (k == 0)
        snprintf(buf, n, "reader");
    else
        snprintf(buf, n, "transformer %d", k - 1);
    return buf;
}

/* Stops every child: a stop flag, then SIGKILL after `grace` seconds (they
 * ignore SIGTERM); reaps them all. */
static void stop_children(kpl_loader *l, double grace)
{
    if (!l->ctl) return;
    shm_lock(l->ctl);
    l->ctl->stop = 1;
    shm_wake(&l->ctl->cv_reader);
    shm_wake(&l->ctl->cv_work);
    shm_wake(&l->ctl->cv_iter);
    shm_unlock(l->ctl);
    double t0 = kpl_seconds();
    int sig = 0;
    for (;;) {
        int left = 0;
        for (int k = 0; k < l->nproc; k++) {
            if (!l->alive[k]) continue;
            if (waitpid(l->pids[k], NULL, WNOHANG) == l->pids[k])
                l->alive[k] = false;
            else
                left++;
        }
        if (!left) break;
        double el = kpl_seconds() - t0;
        if (!sig && el >= grace) {
            sig = SIGKILL;
            for (int k = 0; k < l->nproc; k++)
                if (l->alive[k]) kill(l->pids[k], sig);
        }
        if (sig) {
            for (int k = 0; k < l->nproc; k++)
                if (l->alive[k] && waitpid(l->pids[k], NULL, 0) == l->pids[k]) l->alive[k] = false;
            break;
        }
        usleep(2000);
    }
}

/* Marks the loader failed for good: stops the rest and keeps the message. */
static kpl_status fail_for_good(kpl_loader *l, const char *msg)
{
    snprintf(l->dead_msg, sizeof l->dead_msg, "data loader (%s): %s", kpl_dataset_path(l->ds),
             msg);
    l->dead = KPL_ECHILD;
    stop_children(l, 0.0);
    return KPL_ERROR(KPL_ECHILD, "%s", l->dead_msg);
}

/* Whether a child died (called with the lock released): reaps every child
 * that ended and describes the most telling death in msg — a signal, then
 * an exit that reported nothing.  A child that leaves with status 0 (on a
 * stop, or on another's failure) or with EXIT_REPORTED (after putting its
 * error in the shared block) did not die: a reported error, such as a
 * corrupt sample without skip_corrupt, is returned by kpl_loader_next when
 * it reaches a batch the error spoiled.  Returns whether one died. */
static bool child_died(kpl_loader *l, char *msg, size_t n)
{
    int best = 0; /* 2 signal, 1 an exit status that reported nothing */
    for (int k = 0; k < l->nproc; k++) {
        if (!l->alive[k]) continue;
        int status = 0;
        if (waitpid(l->pids[k], &status, WNOHANG) != l->pids[k]) continue;
        l->alive[k] = false;
        int code = WIFEXITED(status) ? WEXITSTATUS(status) : 0;
        int rank = WIFSIGNALED(status) ? 2 : code != 0 && code != EXIT_REPORTED ? 1 : 0;
        if (rank <= best) continue;
        best = rank;
        char stage[48];
        stage_name(k, stage, sizeof stage);
        if (rank == 2)
            snprintf(msg, n, "%s (pid %d) was killed by signal %d (%s)", stage, (int)l->pids[k],
                     WTERMSIG(status), strsignal(WTERMSIG(status)));
        else
            snprintf(msg, n, "%s (pid %d) exited with status %d", stage, (int)l->pids[k], code);
    }
    return best > 0;
}

/* Whether every child has ended (reaped by child_died). */
static bool all_ended(const kpl_loader *l)
{
    for (int k = 0; k < l->nproc; k++)
        if (l->alive[k]) return false;
    return true;
}

/* Fails the loader for good with the most telling message: a child
 * killed by a signal usually takes the others down with it (they leave on
 * the failure it caused), so keep reaping for up to 0.2 s to find it.
 * msg holds a description already (`found`: of a child that died). */
static kpl_status fail_named(kpl_loader *l, char *msg, size_t n, bool found)
{
    char m2[sizeof l->ctl->error + 128];
    for (int t = 0; t < 100 && !strstr(msg, "killed by signal"); t++) {
        if (child_died(l, m2, sizeof m2) && (!found || strstr(m2, "killed by signal"))) {
            snprintf(msg, n, "%s", m2);
            found = true;
        }
        usleep(2000);
    }
    return fail_for_good(l, msg);
}

static void loader_free(kpl_loader *l)
{
    if (l->pinned && l->slot_data) kpl_device_unpin_host(l->pinned, l->slot_data);
    if (l->map) munmap(l->map, l->map_bytes);
    kpl_dataset_close(l->ds);
    free(l->pids);
    free(l->alive);
    free(l->refs);
    free(l->relay);
    free(l);
}

/* The last tensor of a batch went: its slot serves the batch `nslots` on. */
static void slot_release(void *ctx)
{
    struct slot_ref *r = ctx;
    kpl_loader *l = r->l;
    if (!l->destroyed && !l->dead) {
        shm_lock(l->ctl);
        shm_slot *s = &l->slots[r->idx];
        s->held = 0;
        s->g += l->nslots;
        s->done = s->size = s->skipped = s->last = s->laid = 0;
        shm_wake(&l->ctl->cv_work);
        shm_unlock(l->ctl);
    } else {
        l->slots[r->idx].held = 0;
    }
    if (--l->outstanding == 0 && l->destroyed) loader_free(l);
}

/* Names the samples of a slot that were skipped, as the batch is handed
 * out: one line for each skip kpl_loader_skipped counts (a bad file fails
 * again in every epoch that reaches it, and is named again). */
static void warn_skipped(kpl_loader *l, const uint8_t *b, int64_t n)
{
    for (int64_t i = 0; i < n; i++)
        if (!b[l->o_valid + i])
            fprintf(stderr, "kpl loader (%s): skipping %.*s\n", kpl_dataset_path(l->ds),
                    WHY_BYTES, (const char *)b + l->o_why + (size_t)i * WHY_BYTES);
}

/* Moves the valid samples of a slot to its front; returns how many. */
static int64_t compact(kpl_loader *l, uint8_t *b, int64_t n)
{
    const size_t mb = (size_t)l->max_boxes;
    struct {
        size_t off, each;
    } area[] = {
        {l->o_image, l->img_bytes},
        {l->o_label, 8},
        {l->o_boxes, mb * 16},
        {l->o_box_labels, mb * 8},
        {l->o_num_boxes, mb ? 8 : 0},
        {l->o_mask, l->mask_bytes},
        {l->o_example, 8},
        {l->o_size, 16},
        {l->o_orig, 16},
    };
    int64_t k = 0;
    for (int64_t i = 0; i < n; i++) {
        if (!b[l->o_valid + i]) continue;
        if (k != i)
            for (size_t a = 0; a < sizeof area / sizeof area[0]; a++)
                if (area[a].each)
                    memmove(b + area[a].off + (size_t)k * area[a].each,
                            b + area[a].off + (size_t)i * area[a].each, area[a].each);
        k++;
    }
    return k;
}

/* Lays out n samples written densely, sample i's (planes, h_i, w_i)
 * elements of `es` bytes at base + i * stride ((h_i, w_i) at hw + 2i), as
 * (n, planes, H, W) from base, each plane padded right and below with the
 * byte `pad`.  In place: sample i's destination starts at or before its
 * source, and ends before the next sample's source (i P + P <= (i + 1)
 * stride), so only the sample itself can overlap its destination; such a
 * sample is moved aside into `aside` first. */
static void relay(uint8_t *base, size_t stride, int64_t n, int planes, size_t es,
                  const int64_t *hw, int64_t H, int64_t W, int pad, uint8_t *aside)
{
    const size_t row = (size_t)W * es, P = (size_t)planes * (size_t)H * row;
    for (int64_t i = 0; i < n; i++) {
        const size_t h = (size_t)hw[2 * i], w = (size_t)hw[2 * i + 1];
        const uint8_t *src = base + (size_t)i * stride;
        uint8_t *dst = base + (size_t)i * P;
        const size_t dense = (size_t)planes * h * w * es;
        if (dst == src && h == (size_t)H && w == (size_t)W) continue; /* already in place */
        if (dst + P > src) {
            memcpy(aside, src, dense);
            src = aside;
        }
        for (int c = 0; c < planes; c++) {
            uint8_t *d = dst + (size_t)c * (size_t)H * row;
            for (size_t y = 0; y < h; y++, d += row) {
                memmove(d, src + ((size_t)c * h + y) * w * es, w * es);
                memset(d + w * es, pad, row - w * es);
            }
            memset(d, pad, ((size_t)H - h) * row);
        }
    }
}

/* keep_ratio: the batch's padded size (the largest height and width,
 * rounded up to size_divisor), and its images and masks laid out at it. */
static void relay_batch(kpl_loader *l, uint8_t *b, int64_t n, int64_t *H, int64_t *W)
{
    const kpl_transform_config *t = &l->x.cfg;
    const int64_t *hw = (const int64_t *)(b + l->o_size);
    int64_t d = t->size_divisor > 1 ? t->size_divisor : 1, mh = 0, mw = 0;
    for (int64_t i = 0; i < n; i++) {
        if (hw[2 * i] > mh) mh = hw[2 * i];
        if (hw[2 * i + 1] > mw) mw = hw[2 * i + 1];
    }
    *H = (mh + d - 1) / d * d;
    *W = (mw + d - 1) / d * d;
    relay(b + l->o_image, l->img_bytes, n, l->x.out_c, kpl_dtype_size(t->out_dtype), hw, *H,
          *W, 0, l->relay);
    if (l->mask_bytes)
        relay(b + l->o_mask, l->mask_bytes, n, 1, 1, hw, *H, *W, t->mask_pad, l->relay);
}

/* The valid samples of slot idx at its front, laid out at one size:
 * *n samples of *h x *w.  Once per batch. */
static void lay_out(kpl_loader *l, int idx, int64_t size, int64_t skipped, int64_t *n,
                    int64_t *h, int64_t *w)
{
    shm_slot *s = &l->slots[idx];
    if (!s->laid) {
        s->n = skipped ? compact(l, slot_base(l, idx), size) : size;
        s->h = l->x.out_h;
        s->w = l->x.out_w;
        if (l->x.cfg.crop == KPL_CROP_KEEP_RATIO)
            relay_batch(l, slot_base(l, idx), s->n, &s->h, &s->w);
        s->laid = 1;
    }
    *n = s->n, *h = s->h, *w = s->w;
}

static kpl_status build_batch(kpl_loader *l, int idx, int64_t n, int64_t H, int64_t W,
                              kpl_batch *b)
{
    size_t base = (size_t)idx * l->slot_bytes;
    kpl_storage *st = NULL;
    KPL_TRY(kpl_storage_wrap(l->slot_data + base, l->slot_bytes, slot_release, &l->refs[idx],
                             &st));
    l->outstanding++;
    const kpl__xform *x = &l->x;
    int64_t mb = l->max_boxes;
    bool boxes = mb > 0;
    struct {
        bool want;
        size_t off;
        kpl_dtype dt;
        int nd;
        int64_t shape[4];
        kpl_tensor **out;
    } t[] = {
        {true, l->o_image, x->cfg.out_dtype, 4, {n, x->out_c, H, W}, &b->image},
        {x->label >= 0, l->o_label, KPL_I64, 1, {n}, &b->label},
        {boxes, l->o_boxes, KPL_F32, 3, {n, mb, 4}, &b->boxes},
        {boxes, l->o_box_labels, KPL_I64, 2, {n, mb}, &b->box_labels},
        {boxes, l->o_num_boxes, KPL_I64, 1, {n}, &b->num_boxes},
        {l->mask_bytes > 0, l->o_mask, KPL_U8, 3, {n, H, W}, &b->mask},
        {true, l->o_example, KPL_I64, 1, {n}, &b->example},
        {true, l->o_size, KPL_I64, 2, {n, 2}, &b->image_size},
        {true, l->o_orig, KPL_I64, 2, {n, 2}, &b->orig_size},
    };
    kpl_status s = KPL_OK;
    for (size_t i = 0; i < sizeof t / sizeof t[0]; i++)
        if (t[i].want &&
            (s = kpl_tensor_from_storage(st, t[i].off, t[i].dt, t[i].nd, t[i].shape, t[i].out)) < 0)
            goto fail;
    kpl_storage_release(st); /* the tensors hold it now */
    return KPL_OK;
fail:
    kpl_batch_release(b);
    kpl_storage_release(st);
    return s;
}

kpl_status kpl_loader_next(kpl_loader *l, kpl_batch *b)
{
    KPL_CHECK(l && b, KPL_EINVAL, "loader_next: NULL argument");
    memset(b, 0, sizeof *b);
    if (l->dead) return KPL_ERROR(l->dead, "%s", l->dead_msg);
    /* A death is reported even while finished batches are still queued. */
    char msg[sizeof l->ctl->error + 128];
    if (child_died(l, msg, sizeof msg)) return fail_named(l, msg, sizeof msg, true);
    int idx = (int)(l->g_next % l->nslots);
    shm_slot *s = &l->slots[idx];
    shm_ctl *c = l->ctl;
    shm_lock(c);
    while (!(s->g == l->g_next && s->size > 0 && s->done == s->size)) {
        if (c->failed) {
            char err[sizeof c->error];
            snprintf(err, sizeof err, "%s", c->error);
            shm_unlock(c);
            /* Name the process that ended, if one did (a child killed while
             * holding the lock leaves only a generic message behind). */
            snprintf(msg, sizeof msg, "%s", err);
            return fail_named(l, msg, sizeof msg, false);
        }
        if (s->held) {
            shm_unlock(c);
            return KPL_ERROR(KPL_ESTATE, "loader_next: all %d batch slots are held by batches "
                             "not yet released (kpl_batch_release them first)", l->nslots);
        }
        shm_wait(c, &c->cv_iter);
        if (s->g == l->g_next && s->size > 0 && s->done == s->size) break;
        shm_unlock(c);
        if (child_died(l, msg, sizeof msg)) return fail_named(l, msg, sizeof msg, true);
        shm_lock(c);
        if (!c->failed && all_ended(l)) { /* nobody left to finish it (a guard: cannot happen) */
            shm_unlock(c);
            snprintf(msg, sizeof msg, "every process of the pipeline has ended");
            return fail_named(l, msg, sizeof msg, false);
        }
    }
    s->held = 1;
    int64_t epoch = s->epoch, pos = s->pos, size = s->size, skipped = s->skipped;
    bool last = s->last;
    shm_unlock(c);

    if (skipped && !s->laid) warn_skipped(l, slot_base(l, idx), size);
    int64_t n, h, w;
    lay_out(l, idx, size, skipped, &n, &h, &w);
    kpl_status st = build_batch(l, idx, n, h, w, b);
    if (st < 0) {
        s->held = 0;
        return st;
    }
    b->size = n;
    b->epoch = epoch;
    b->position = pos;
    b->skipped = skipped;
    b->last = last;
    l->skipped += skipped;
    l->g_next++;
    /* the position is where the next batch starts: after an epoch's last,
     * the next epoch's beginning */
    l->epoch = last ? epoch + 1 : epoch;
    l->pos = last ? 0 : pos + size;
    if (n == 0 && !last) { /* every sample of it was corrupt: hand out the next one */
        kpl_batch_release(b);
        return kpl_loader_next(l, b);
    }
    return KPL_OK;
}

kpl_status kpl_loader_check(kpl_loader *l)
{
    KPL_CHECK(l, KPL_EINVAL, "loader_check: NULL loader");
    if (l->dead) return KPL_ERROR(l->dead, "%s", l->dead_msg);
    char msg[sizeof l->ctl->error + 128];
    if (child_died(l, msg, sizeof msg)) return fail_named(l, msg, sizeof msg, true);
    return KPL_OK;
}

kpl_tensor *kpl_batch_get(const kpl_batch *b, const char *name)
{
    static const struct {
        const char *name, *field;
    } members[] = {{"image", "image_feature"},      {"label", "label_feature"},
                   {"boxes", "boxes_feature"},      {"box_labels", "box_labels_feature"},
                   {"num_boxes", "boxes_feature"},  {"mask", "mask_feature"},
                   {"example", "image_feature"},    {"image_size", "image_feature"},
                   {"orig_size", "image_feature"}};
    if (!b || !name) {
        kpl_set_error(KPL_EINVAL, "kpl_batch_get: NULL %s", b ? "name" : "batch");
        return NULL;
    }
    kpl_tensor *const t[] = {b->image,   b->label,   b->boxes,      b->box_labels, b->num_boxes,
                             b->mask,    b->example, b->image_size, b->orig_size};
    for (size_t i = 0; i < sizeof t / sizeof t[0]; i++) {
        if (strcmp(name, members[i].name)) continue;
        if (!t[i])
            kpl_set_error(KPL_ENOTFOUND, "the batch has no %s: the loader was not asked for "
                          "them (transform.%s; in a recipe data.<split>.%s)", name,
                          members[i].field, members[i].field);
        return t[i];
    }
    kpl_set_error(KPL_ENOTFOUND, "the batch has no member '%.40s' (image, label, boxes, "
                  "box_labels, num_boxes, mask, example, image_size, orig_size)", name);
    return NULL;
}

void kpl_batch_release(kpl_batch *b)
{
    if (!b) return;
    kpl_tensor **t[] = {&b->image, &b->label,   &b->boxes,      &b->box_labels, &b->num_boxes,
                        &b->mask,  &b->example, &b->image_size, &b->orig_size};
    for (size_t i = 0; i < sizeof t / sizeof t[0]; i++) {
        kpl_tensor_release(*t[i]);
        *t[i] = NULL;
    }
}

/* ---- create / destroy ------------------------------------------------------------- */

static kpl_status check_config(const kpl_loader_config *c)
{
    KPL_CHECK(c->path && *c->path, KPL_EINVAL, "loader: path is empty");
    KPL_CHECK(c->batch_size >= 1, KPL_EINVAL, "loader: batch_size %lld must be >= 1",
              (long long)c->batch_size);
    KPL_CHECK(c->workers >= 1 && c->workers <= 256, KPL_EINVAL,
              "loader: workers %d must be in [1, 256]", c->workers);
    KPL_CHECK(c->prefetch >= 1 && c->prefetch <= 64, KPL_EINVAL,
              "loader: prefetch %d must be in [1, 64]", c->prefetch);
    KPL_CHECK(c->world_size >= 1 && c->rank >= 0 && c->rank < c->world_size, KPL_EINVAL,
              "loader: rank %d of world size %d", (int)c->rank, (int)c->world_size);
    KPL_CHECK(c->shuffle >= KPL_SHUFFLE_NONE && c->shuffle <= KPL_SHUFFLE_EXAMPLE, KPL_EINVAL,
              "loader: unknown shuffle mode %d", (int)c->shuffle);
    KPL_CHECK(c->shuffle != KPL_SHUFFLE_CHUNK || c->shuffle_window >= 1, KPL_EINVAL,
              "loader: shuffle_window %d must be >= 1", c->shuffle_window);
    KPL_CHECK(c->shuffle != KPL_SHUFFLE_BUFFER || c->initial_fill >= 1, KPL_EINVAL,
              "loader: initial_fill %lld must be >= 1", (long long)c->initial_fill);
    KPL_CHECK(c->limit >= 0, KPL_EINVAL, "loader: limit %lld must be >= 0 (0: all)",
              (long long)c->limit);
    KPL_CHECK(c->start_epoch >= 0 && c->start_position >= 0, KPL_EINVAL,
              "loader: start epoch %lld / position %lld must be >= 0",
              (long long)c->start_epoch, (long long)c->start_position);
    return KPL_OK;
}

/* Sizes the shared mapping: control, items, slots, ring, slot data. */
static void layout(kpl_loader *l, size_t *o_items, size_t *o_slots, size_t *o_ring,
                   size_t *o_data)
{
    size_t B = (size_t)l->B, mb = (size_t)l->max_boxes, a = 64, o = 0;
    l->img_bytes = kpl__xform_image_bytes(&l->x);
    l->mask_bytes = kpl__xform_mask_bytes(&l->x);
    l->o_image = o;
    o = ALIGN_UP(o + B * l->img_bytes, a);
    l->o_label = o;
    o = ALIGN_UP(o + B * 8, a);
    l->o_boxes = o;
    o = ALIGN_UP(o + B * mb * 16, a);
    l->o_box_labels = o;
    o = ALIGN_UP(o + B * mb * 8, a);
    l->o_num_boxes = o;
    o = ALIGN_UP(o + B * 8, a);
    l->o_mask = o;
    o = ALIGN_UP(o + B * l->mask_bytes, a);
    l->o_example = o;
    o = ALIGN_UP(o + B * 8, a);
    l->o_size = o;
    o = ALIGN_UP(o + B * 16, a);
    l->o_orig = o;
    o = ALIGN_UP(o + B * 16, a);
    l->o_valid = o;
    o = ALIGN_UP(o + B, a);
    l->o_why = o;
    o = ALIGN_UP(o + (l->cfg.transform.skip_corrupt ? B * WHY_BYTES : 0), 4096);
    l->slot_bytes = o;

    o = ALIGN_UP(sizeof(shm_ctl), a);
    *o_items = o;
    o = ALIGN_UP(o + l->nitems * sizeof(shm_item), a);
    *o_slots = o;
    o = ALIGN_UP(o + (size_t)l->nslots * sizeof(shm_slot), 4096);
    *o_ring = o;
    o = ALIGN_UP(o + l->ring_bytes, 4096);
    *o_data = o;
    l->map_bytes = o + (size_t)l->nslots * l->slot_bytes;
}

kpl_status kpl_loader_create(const kpl_loader_config *cfg, kpl_loader **out)
{
    KPL_CHECK(cfg && out, KPL_EINVAL, "loader_create: NULL argument");
    *out = NULL;
    KPL_TRY(check_config(cfg));
    kpl_loader *l = calloc(1, sizeof *l);
    KPL_CHECK(l, KPL_ENOMEM, "loader_create: no memory");
    kpl_status st = KPL_OK;
    l->cfg = *cfg;
    KPL_TRY_GOTO(kpl_dataset_open(cfg->path, &l->ds));
    KPL_TRY_GOTO(kpl__xform_init(&l->x, &cfg->transform, l->ds));
    /* What names an example's source in messages: imagefolder conversions
     * store `path`, LMDB conversions `key`. */
    l->source = -1;
    for (int k = 0; k < 2 && l->source < 0; k++) {
        int f = kpl_dataset_find_feature(l->ds, k ? "key" : "path");
        if (f >= 0 && kpl_dataset_feature(l->ds, f)->type == KPL_FEATURE_STRING) l->source = f;
    }
    l->op = (kpl__order_params){cfg->shuffle, cfg->seed, cfg->rank, cfg->world_size,
                                cfg->shuffle_window, cfg->initial_fill, cfg->pad, cfg->rotate,
                                cfg->limit, cfg->interleave};
    int64_t n = kpl__order_examples(l->ds, &l->op);
    l->B = cfg->batch_size;
    l->epoch_size = kpl__order_size(n, cfg->world_size, cfg->pad);
    l->batches = cfg->drop_last ? l->epoch_size / l->B : (l->epoch_size + l->B - 1) / l->B;
    l->epoch_end = cfg->drop_last ? l->batches * l->B : l->epoch_size;
    if (l->batches == 0) {
        st = KPL_ERROR(KPL_EINVAL, "loader: %s has %lld examples, %lld for rank %d of %d: not "
                       "one batch of %lld%s", cfg->path, (long long)n, (long long)l->epoch_size,
                       (int)cfg->rank, (int)cfg->world_size, (long long)l->B,
                       cfg->drop_last ? " (drop_last)" : "");
        goto fail;
    }
    l->epoch = cfg->start_epoch;
    l->pos = cfg->start_position;
    if (l->pos >= l->epoch_end) { /* resuming at an epoch's end: the next one */
        if (l->pos > l->epoch_size) {
            st = KPL_ERROR(KPL_EINVAL, "loader: start_position %lld is past the epoch's %lld "
                           "samples", (long long)l->pos, (long long)l->epoch_size);
            goto fail;
        }
        l->epoch++;
        l->pos = 0;
    }
    l->max_boxes = l->x.boxes >= 0 ? cfg->transform.max_boxes : 0;
    l->nslots = cfg->prefetch + 1;
    l->nitems = (uint64_t)l->B * (uint64_t)l->nslots * 2;
    if (l->nitems < 1024) l->nitems = 1024;
    size_t max_raw = 0;
    for (int64_t c = 0; c < kpl_dataset_num_chunks(l->ds); c++) {
        kpl_chunk_info ci = kpl_dataset_chunk_info(l->ds, c);
        if (ci.raw_bytes > max_raw) max_raw = ci.raw_bytes;
    }
    l->ring_bytes = ALIGN_UP((uint64_t)max_raw * 2 + (1u << 20), 4096);
    if (l->ring_bytes < (32u << 20)) l->ring_bytes = 32u << 20;

    size_t o_items, o_slots, o_ring, o_data;
    layout(l, &o_items, &o_slots, &o_ring, &o_data);
    if (cfg->transform.crop == KPL_CROP_KEEP_RATIO) {
        l->relay = malloc(l->img_bytes);
        if (!l->relay) {
            st = KPL_ERROR(KPL_ENOMEM, "loader: no memory for the %zu bytes of keep_ratio's "
                           "layout buffer", l->img_bytes);
            goto fail;
        }
    }
    l->map = mmap(NULL, l->map_bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    if (l->map == MAP_FAILED) {
        l->map = NULL;
        st = KPL_ERROR(KPL_ENOMEM, "loader: cannot map %zu bytes of shared memory: %s",
                       l->map_bytes, strerror(errno));
        goto fail;
    }
    uint8_t *m = l->map;
    l->ctl = (shm_ctl *)m;
    l->items = (shm_item *)(m + o_items);
    l->slots = (shm_slot *)(m + o_slots);
    l->ring = m + o_ring;
    l->slot_data = m + o_data;
    KPL_TRY_GOTO(shm_init(l->ctl));
    for (int i = 0; i < l->nslots; i++) l->slots[i].g = i;
    l->refs = calloc((size_t)(unsigned)l->nslots, sizeof *l->refs);
    l->nproc = 1 + cfg->workers;
    l->pids = calloc((size_t)(unsigned)l->nproc, sizeof *l->pids);
    l->alive = calloc((size_t)(unsigned)l->nproc, sizeof *l->alive);
    if (!l->refs || !l->pids || !l->alive) {
        st = KPL_ERROR(KPL_ENOMEM, "loader_create: no memory");
        goto fail;
    }
    for (int i = 0; i < l->nslots; i++) l->refs[i] = (struct slot_ref){l, i};

    l->parent = getpid();
    fflush(stdout);
    fflush(stderr);
    /* Children are born with SIGINT and SIGTERM blocked, so that a stop
     * sent to the whole process group between fork and child_main's
     * SIG_IGN cannot kill one; child_main unblocks them once ignored. */
    sigset_t stop_set, old_set;
    sigemptyset(&stop_set);
    sigaddset(&stop_set, SIGINT);
    sigaddset(&stop_set, SIGTERM);
    sigprocmask(SIG_BLOCK, &stop_set, &old_set);
    for (int k = 0; k < l->nproc; k++) {
        pid_t pid = fork();
        if (pid == 0) child_main(l, k);
        if (pid < 0) {
            sigprocmask(SIG_SETMASK, &old_set, NULL);
            st = KPL_ERROR(KPL_EIO, "loader: fork of the %s failed: %s",
                           k ? "transformer" : "reader", strerror(errno));
            goto fail;
        }
        l->pids[k] = pid;
        l->alive[k] = true;
    }
    sigprocmask(SIG_SETMASK, &old_set, NULL);
    /* The batch slots are page-locked for fast copies to a GPU only now,
     * in the parent alone: the children write into these pages, and
     * NVIDIA has a child between fork and exec keep away from memory CUDA
     * allocated or registered (the driver may also mark registered ranges
     * MADV_DONTFORK, which would leave a child forked after it without
     * its slots).  Registering the shared pages after the fork pins the
     * same physical memory the children fill. */
    if (cfg->device && kpl_device_type_of(cfg->device) != KPL_DEVICE_CPU) {
        KPL_TRY_GOTO(kpl_device_pin_host(cfg->device, l->slot_data,
                                         (size_t)l->nslots * l->slot_bytes));
        l->pinned = cfg->device;
    }
    *out = l;
    return KPL_OK;
fail:
    if (l->pids) stop_children(l, 0.0);
    loader_free(l);
    return st;
}

void kpl_loader_destroy(kpl_loader *l)
{
    if (!l) return;
    stop_children(l, 2.0);
    l->destroyed = true;
    if (l->outstanding == 0) loader_free(l);
}

int64_t kpl_loader_epoch_size(const kpl_loader *l) { return l->epoch_size; }
int64_t kpl_loader_num_examples(const kpl_loader *l) { return kpl__order_examples(l->ds, &l->op); }
int64_t kpl_loader_batches_per_epoch(const kpl_loader *l) { return l->batches; }

void kpl_loader_position(const kpl_loader *l, int64_t *epoch, int64_t *position)
{
    int64_t e = l->epoch, p = l->pos;
    if (p >= l->epoch_end) {
        e++;
        p = 0;
    }
    if (epoch) *epoch = e;
    if (position) *position = p;
}

int64_t kpl_loader_skipped(const kpl_loader *l) { return l->skipped; }

int kpl_loader_pids(const kpl_loader *l, int *pids, int max)
{
    int n = 0;
    for (int k = 0; k < l->nproc && n < max; k++) pids[n++] = (int)l->pids[k];
    return n;
}
