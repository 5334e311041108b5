/*
 * bucketer.c — the bucketed gradient allreduce (PyTorch DDP's reducer,
 * Horovod's fusion buffer without the packing copy): flat bucket buffers
 * whose slices are the gradients, an allreduce started as soon as a bucket
 * is complete, buckets issued in index order on every rank.
 *
 * Low-precision reduction (grad_dtype bf16/f16 over f32 parameters, as
 * PyTorch's bf16_compress_hook): each bucket has a second buffer of the
 * low dtype, the "wire".  A complete bucket is cast into it (on the
 * bucket's device, queued before the allreduce like any kernel), summed
 * over the ranks in place, and at finish cast back into the f32 bucket
 * and divided by the rank count there.  Summing and dividing afterwards
 * (rather than scaling by 1/size before the cast) keeps small f16
 * gradients out of f16's subnormal range; the price is that an f16 sum
 * can overflow where the average would not (docs/collective.md).  The
 * result is the same on every rank (one allreduce result, one cast), so
 * the ranks' parameters stay bit-identical.
 */
#include "collective_impl.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
    kpl_tensor *flat;  /* (numel) the bucket's buffer */
    kpl_tensor *wire;  /* (numel) its grad_dtype copy for the allreduce, or NULL */
    int64_t numel;
    int nparams, nready;
    kpl_comm_work *work; /* its allreduce in flight */
    double ready, issued; /* this step's (kpl_bucket_timing) */
} bucket;

struct kpl_bucketer {
    kpl_comm *comm;
    kpl_bucketer_config cfg;
    int n;
    kpl_tensor **params;
    kpl_dtype dtype;
    kpl_dtype wire_dtype; /* == dtype: no conversion */
    kpl_device *device;
    kpl_tensor **grads; /* views into the buckets */
    int *bucket_of;
    bool *ready;
    int *order; /* parameters in the order they became ready this step */
    int nordered;
    bucket *buckets;
    int nbuckets, next_launch;
    bool sync, rebuilt;
    int check_due; /* 1: check the parameters at the next finish */
    kpl_bucketer_stats stats;
    kpl_bucket_timing *timing; /* the last synchronised finish's, ntiming of them */
    int ntiming;
};

static void free_buckets(kpl_bucketer *b)
{
    for (int k = 0; k < b->nbuckets; k++) {
        kpl_comm_work_destroy(b->buckets[k].work);
        kpl_tensor_release(b->buckets[k].flat);
        kpl_tensor_release(b->buckets[k].wire);
    }
    free(b->buckets);
    b->buckets = NULL;
    for (int i = 0; i < b->n; i++) {
        kpl_tensor_release(b->grads[i]);
        b->grads[i] = NULL;
    }
    b->nbuckets = 0;
}

/* Assigns parameters to buckets walking `seq` (a permutation of the
 * parameters), makes the flat buffers (zeroed) and the gradient views. */
static kpl_status build(kpl_bucketer *b, const int *seq)
{
    size_t esize = kpl_dtype_size(b->dtype);
    double limit = b->cfg.first_bucket_mb * 1048576.0, used = 0;
    b->buckets = calloc((size_t)b->n, sizeof *b->buckets);
    KPL_CHECK(b->buckets, KPL_ENOMEM, "bucketer: no memory");
    int k = 0;
    for (int s = 0; s < b->n; s++) {
        int i = seq[s];
        double bytes = (double)kpl_tensor_numel(b->params[i]) * (double)esize;
        if (b->buckets[k].nparams > 0 && used + bytes > limit) {
            k++;
            used = 0;
            limit = b->cfg.bucket_mb * 1048576.0;
        }
        b->bucket_of[i] = k;
        b->buckets[k].nparams++;
        b->buckets[k].numel += kpl_tensor_numel(b->params[i]);
        used += bytes;
    }
    b->nbuckets = k + 1;
    for (k = 0; k < b->nbuckets; k++) {
        int64_t numel = b->buckets[k].numel;
        KPL_TRY(kpl_tensor_zeros(b->device, b->dtype, 1, &numel, &b->buckets[k].flat));
        if (b->wire_dtype != b->dtype)
            KPL_TRY(kpl_tensor_empty(b->device, b->wire_dtype, 1, &numel, &b->buckets[k].wire));
    }
    int64_t *off = calloc((size_t)b->nbuckets, sizeof *off);
    KPL_CHECK(off, KPL_ENOMEM, "bucketer: no memory");
    kpl_status st = KPL_OK;
    for (int s = 0; s < b->n && st == KPL_OK; s++) {
        int i = seq[s];
        bucket *bk = &b->buckets[b->bucket_of[i]];
        st = kpl_tensor_from_storage(kpl_tensor_storage(bk->flat),
                                     kpl_tensor_offset(bk->flat) +
                                         (size_t)off[b->bucket_of[i]] * esize,
                                     b->dtype, kpl_tensor_ndim(b->params[i]),
                                     kpl_tensor_shape(b->params[i]), &b->grads[i]);
        off[b->bucket_of[i]] += kpl_tensor_numel(b->params[i]);
    }
    free(off);
    return st;
}

kpl_status kpl_bucketer_create(kpl_comm *comm, int n, kpl_tensor *const *params,
                               const kpl_bucketer_config *cfg, kpl_bucketer **out)
{
    KPL_CHECK(comm && params && out && n >= 1, KPL_EINVAL, "bucketer_create: bad arguments");
    *out = NULL;
    kpl_bucketer_config c = KPL_BUCKETER_CONFIG_INIT;
    if (cfg) c = *cfg;
    KPL_CHECK(c.bucket_mb >= 0 && c.first_bucket_mb >= 0, KPL_EINVAL,
              "bucketer_create: bucket sizes %g / %g MB must be >= 0", c.bucket_mb,
              c.first_bucket_mb);
    KPL_CHECK(params[0], KPL_EINVAL, "bucketer_create: parameter 0 is NULL");
    kpl_dtype dt = kpl_tensor_dtype(params[0]);
    kpl_device *dev = kpl_tensor_device(params[0]);
    for (int i = 0; i < n; i++) {
        KPL_CHECK(params[i] && kpl_tensor_dtype(params[i]) == dt, KPL_EDTYPE,
                  "bucketer_create: parameter %d is not %s like parameter 0", i,
                  kpl_dtype_name(dt));
        KPL_CHECK(kpl_tensor_device(params[i]) == dev, KPL_EDEVICE,
                  "bucketer_create: parameter %d is on %s, parameter 0 on %s", i,
                  kpl_device_name(kpl_tensor_device(params[i])), kpl_device_name(dev));
    }
    KPL_CHECK(dt == KPL_F32 || dt == KPL_F64 || dt == KPL_F16 || dt == KPL_BF16, KPL_EDTYPE,
              "bucketer_create: %s parameters have no gradients", kpl_dtype_name(dt));
    kpl_dtype wire = c.grad_dtype == KPL_F32 ? dt : c.grad_dtype;
    KPL_CHECK(c.grad_dtype == KPL_F32 || c.grad_dtype == KPL_BF16 || c.grad_dtype == KPL_F16,
              KPL_EDTYPE, "bucketer_create: grad_dtype %s: gradients are reduced in f32 (the "
              "parameters' dtype), bf16 or f16", kpl_dtype_name(c.grad_dtype));
    KPL_CHECK(wire == dt || dt == KPL_F32, KPL_EDTYPE,
              "bucketer_create: grad_dtype %s needs f32 parameters, not %s", kpl_dtype_name(wire),
              kpl_dtype_name(dt));
    KPL_CHECK(kpl_comm_backend_for(comm, kpl_device_type_of(dev)), KPL_EDEVICE,
              "bucketer_create: the parameters are on %s, which this communicator cannot "
              "reduce (backend %s)", kpl_device_name(dev),
              kpl_comm_backend_for(comm, KPL_DEVICE_CPU));
    kpl_bucketer *b = calloc(1, sizeof *b);
    KPL_CHECK(b, KPL_ENOMEM, "bucketer_create: no memory");
    b->comm = comm;
    b->cfg = c;
    b->n = n;
    b->dtype = dt;
    b->wire_dtype = wire;
    b->device = dev;
    b->sync = true;
    b->params = calloc((size_t)n, sizeof *b->params);
    b->grads = calloc((size_t)n, sizeof *b->grads);
    b->bucket_of = calloc((size_t)n, sizeof *b->bucket_of);
    b->ready = calloc((size_t)n, sizeof *b->ready);
    b->order = calloc((size_t)n, sizeof *b->order);
    b->timing = calloc((size_t)n, sizeof *b->timing); /* at most one bucket per parameter */
    kpl_status st = KPL_OK;
    if (!b->params || !b->grads || !b->bucket_of || !b->ready || !b->order || !b->timing) {
        st = KPL_ERROR(KPL_ENOMEM, "bucketer_create: no memory");
        goto fail;
    }
    for (int i = 0; i < n; i++) {
        b->params[i] = params[i];
        kpl_tensor_retain(params[i]);
        b->order[i] = n - 1 - i; /* reverse registration order */
    }
    if ((st = build(b, b->order)) < 0) goto fail;
    *out = b;
    return KPL_OK;
fail:
    kpl_bucketer_destroy(b);
    return st;
}

void kpl_bucketer_destroy(kpl_bucketer *b)
{
    if (!b) return;
    if (b->buckets) free_buckets(b);
    for (int i = 0; b->params && i < b->n; i++) kpl_tensor_release(b->params[i]);
    free(b->params);
    free(b->grads);
    free(b->bucket_of);
    free(b->ready);
    free(b->order);
    free(b->timing);
    free(b);
}

kpl_status kpl_bucketer_broadcast_params(kpl_bucketer *b)
{
    KPL_CHECK(b, KPL_EINVAL, "bucketer_broadcast_params: NULL");
    for (int i = 0; i < b->n; i++) KPL_TRY(kpl_comm_broadcast(b->comm, b->params[i], 0));
    return KPL_OK;
}

/* A 64-bit digest of a tensor's bytes (multiply-xor over 8-byte words):
 * equal parameters give equal digests, and a difference of one bit in
 * 25 M floats changes it. */
static int64_t digest(kpl_tensor *t)
{
    const unsigned char *p = kpl_tensor_host_data(t);
    size_t n = kpl_tensor_nbytes(t);
    uint64_t h = 0x9e3779b97f4a7c15ull ^ n;
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        uint64_t w;
        memcpy(&w, p + i, 8);
        h = (h ^ w) * 0x100000001b3ull;
        h ^= h >> 29;
    }
    for (; i < n; i++) h = (h ^ p[i]) * 0x100000001b3ull;
    return (int64_t)h;
}

kpl_status kpl_bucketer_check_params(kpl_bucketer *b)
{
    KPL_CHECK(b, KPL_EINVAL, "bucketer_check_params: NULL");
    int size = kpl_comm_size(b->comm);
    int64_t n = b->n, all = n * size;
    kpl_tensor *mine = NULL, *every = NULL;
    KPL_TRY(kpl_tensor_empty(kpl_device_cpu(), KPL_I64, 1, &n, &mine));
    kpl_status st = kpl_tensor_empty(kpl_device_cpu(), KPL_I64, 1, &all, &every);
    if (st == KPL_OK) {
        int64_t *d = kpl_tensor_host_mutable(mine);
        for (int i = 0; i < b->n; i++) d[i] = digest(b->params[i]);
        st = kpl_comm_allgather(b->comm, mine, every);
    }
    if (st == KPL_OK) {
        const int64_t *e = kpl_tensor_host_data(every);
        for (int i = 0; i < b->n && st == KPL_OK; i++) {
            char ranks[256] = "";
            size_t used = 0;
            for (int r = 1; r < size; r++)
                if (e[(int64_t)r * n + i] != e[i] && used < sizeof ranks)
                    used += (size_t)snprintf(ranks + used, sizeof ranks - used, "%s%d",
                                             used ? ", " : "", r);
            if (!used) continue;
            char sh[96];
            kpl_tensor *p = b->params[i];
            st = KPL_ERROR(KPL_ESTATE, "bucketer: the ranks hold different parameters: "
                           "parameter %d %s differs on rank(s) %s from rank 0 (did every rank "
                           "start from rank 0's values, kpl_bucketer_broadcast_params, and "
                           "apply the same update?)", i,
                           kpl_shape_str(kpl_tensor_ndim(p), kpl_tensor_shape(p), sh, sizeof sh),
                           ranks);
        }
    }
    kpl_tensor_release(mine);
    kpl_tensor_release(every);
    return st;
}

kpl_tensor *kpl_bucketer_grad(kpl_bucketer *b, int i)
{
    return i >= 0 && i < b->n ? b->grads[i] : NULL;
}

void kpl_bucketer_set_sync(kpl_bucketer *b, bool sync) { b->sync = sync; }
bool kpl_bucketer_sync(const kpl_bucketer *b) { return b->sync; }
kpl_status kpl_bucketer_zero_grads(kpl_bucketer *b)
{
    for (int k = 0; k < b->nbuckets; k++) {
        KPL_CHECK(!b->buckets[k].work, KPL_ESTATE,
                  "bucketer: zeroing gradients while bucket %d's allreduce is in flight", k);
        KPL_TRY(kpl_k_fill(b->buckets[k].flat, 0));
    }
    return KPL_OK;
}

int kpl_bucketer_num_buckets(const kpl_bucketer *b) { return b->nbuckets; }
int kpl_bucketer_bucket_of(const kpl_bucketer *b, int i) { return b->bucket_of[i]; }
kpl_bucketer_stats kpl_bucketer_get_stats(const kpl_bucketer *b) { return b->stats; }

const kpl_bucket_timing *kpl_bucketer_timings(const kpl_bucketer *b, int *n)
{
    *n = b ? b->ntiming : 0;
    return b ? b->timing : NULL;
}
void kpl_bucketer_reset_stats(kpl_bucketer *b) { memset(&b->stats, 0, sizeof b->stats); }

/* Starts the allreduce of every complete bucket at the front of the
 * launch order (index order, the same on every rank): an AVG of the
 * bucket, or a SUM of its low-precision copy (see the top of the file). */
static kpl_status launch_ready(kpl_bucketer *b)
{
    while (b->next_launch < b->nbuckets) {
        bucket *bk = &b->buckets[b->next_launch];
        if (bk->nready < bk->nparams) break;
        bk->issued = kpl_seconds();
        if (bk->wire) {
            KPL_TRY(kpl_k_cast(bk->wire, bk->flat));
            KPL_TRY(kpl_comm_allreduce_async(b->comm, bk->wire, bk->wire, KPL_COMM_SUM,
                                             &bk->work));
        } else {
            KPL_TRY(kpl_comm_allreduce_async(b->comm, bk->flat, bk->flat, KPL_COMM_AVG,
                                             &bk->work));
        }
        b->next_launch++;
    }
    return KPL_OK;
}

/* A low-precision bucket's sum back into its f32 buffer, averaged there.
 * After the wait, which on a GPU orders the compute stream after the
 * allreduce, so the kernels here read the finished sum. */
static kpl_status unwire(kpl_bucketer *b, bucket *bk)
{
    KPL_TRY(kpl_k_cast(bk->flat, bk->wire));
    int32_t size = kpl_comm_size(b->comm);
    return size > 1 ? kpl_k_binary_scalar(bk->flat, KPL_BIN_DIV, bk->flat, size, false) : KPL_OK;
}

kpl_status kpl_bucketer_mark_ready(kpl_bucketer *b, int i)
{
    KPL_CHECK(b && i >= 0 && i < b->n, KPL_EINVAL, "bucketer_mark_ready: parameter %d of %d",
              i, b ? b->n : 0);
    KPL_CHECK(!b->ready[i], KPL_ESTATE, "bucketer_mark_ready: parameter %d marked twice in "
              "one step", i);
    b->ready[i] = true;
    b->order[b->nordered++] = i;
    bucket *bk = &b->buckets[b->bucket_of[i]];
    if (++bk->nready == bk->nparams) bk->ready = kpl_seconds();
    return b->sync && !b->cfg.after_backward ? launch_ready(b) : KPL_OK;
}

/* Waits for every bucket in flight (all of them, even after a failure, so
 * none is left running); adds to the statistics. */
static kpl_status wait_all(kpl_bucketer *b)
{
    kpl_status st = KPL_OK;
    double t0 = kpl_seconds();
    b->ntiming = 0;
    for (int k = 0; k < b->nbuckets; k++) {
        bucket *bk = &b->buckets[k];
        if (!bk->work) continue;
        kpl_status w = kpl_comm_work_wait(bk->work);
        if (w == KPL_OK && bk->wire) w = unwire(b, bk);
        if (st == KPL_OK) st = w;
        double s = kpl_comm_work_seconds(bk->work);
        if (s > 0) b->stats.comm_seconds += s;
        kpl_bucket_timing *tm = &b->timing[b->ntiming++];
        tm->bytes = (int64_t)kpl_tensor_nbytes(bk->wire ? bk->wire : bk->flat);
        tm->ready = bk->ready, tm->issued = bk->issued;
        if (s < 0 || kpl_comm_work_times(bk->work, &tm->issued, &tm->started, &tm->ended) < 0)
            tm->started = bk->issued, tm->ended = kpl_seconds(); /* CUDA work */
        b->stats.bytes += tm->bytes;
        kpl_comm_work_destroy(bk->work);
        bk->work = NULL;
    }
    b->stats.wait_seconds += kpl_seconds() - t0;
    b->stats.steps++;
    return st;
}

/* Rebuilds the buckets from rank 0's ready order of the step just
 * finished (parameters never marked go last, in reverse registration
 * order), keeping the reduced gradients. */
static kpl_status rebuild(kpl_bucketer *b)
{
    int64_t nn = b->n;
    kpl_tensor *ord = NULL;
    KPL_TRY(kpl_tensor_empty(kpl_device_cpu(), KPL_I64, 1, &nn, &ord));
    int64_t *o = kpl_tensor_host_mutable(ord);
    int k = 0;
    for (int s = 0; s < b->nordered; s++) o[k++] = b->order[s];
    for (int i = b->n - 1; i >= 0; i--)
        if (!b->ready[i]) o[k++] = i;
    kpl_status st = kpl_comm_broadcast(b->comm, ord, 0);
    int *seq = malloc((size_t)b->n * sizeof *seq);
    kpl_tensor **old = malloc((size_t)b->n * sizeof *old);
    if (st == KPL_OK && (!seq || !old)) st = KPL_ERROR(KPL_ENOMEM, "bucketer: no memory");
    if (st == KPL_OK) {
        o = kpl_tensor_host_mutable(ord);
        for (int i = 0; i < b->n; i++) {
            seq[i] = (int)o[i];
            old[i] = b->grads[i];
            kpl_tensor_retain(old[i]);
        }
        free_buckets(b);
        st = build(b, seq);
        for (int i = 0; i < b->n; i++) {
            if (st == KPL_OK) st = kpl_k_copy(b->grads[i], old[i]);
            kpl_tensor_release(old[i]);
        }
    }
    free(seq);
    free(old);
    kpl_tensor_release(ord);
    return st;
}

kpl_status kpl_bucketer_finish(kpl_bucketer *b)
{
    KPL_CHECK(b, KPL_EINVAL, "bucketer_finish: NULL");
    kpl_status st = KPL_OK;
    if (b->check_due == 1) { /* the optimizer has moved the parameters once */
        b->check_due = 2;
        st = kpl_bucketer_check_params(b);
    }
    if (b->sync) {
        /* Unused parameters: no gradient this step, so zero, and ready. */
        double now = kpl_seconds();
        for (int i = 0; i < b->n && st == KPL_OK; i++) {
            if (b->ready[i]) continue;
            st = kpl_k_fill(b->grads[i], 0);
            if (++b->buckets[b->bucket_of[i]].nready == b->buckets[b->bucket_of[i]].nparams)
                b->buckets[b->bucket_of[i]].ready = now;
        }
        if (st == KPL_OK) st = launch_ready(b);
        kpl_status w = wait_all(b);
        if (st == KPL_OK) st = w;
        if (st < 0) return st;
        if (b->cfg.check_params && b->check_due == 0) b->check_due = 1;
        if (!b->rebuilt) {
            b->rebuilt = true;
            KPL_TRY(rebuild(b));
        }
    }
    if (st < 0) return st;
    /* The next step. */
    for (int i = 0; i < b->n; i++) b->ready[i] = false;
    for (int k = 0; k < b->nbuckets; k++) b->buckets[k].nready = 0;
    b->nordered = 0;
    b->next_launch = 0;
    return KPL_OK;
}
