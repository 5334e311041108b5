/*
 * sampler.c — which examples a rank sees in an epoch, and in what order.
 *
 * An epoch's global sequence G lists every example once (or, with a limit,
 * every one of the dataset's first `limit`): in dataset order
 * (none, buffer), chunk by chunk in a shuffled chunk order (chunk), or as a
 * full permutation (example).  Rank r takes the contiguous slice number
 * s = r (or (r + epoch) mod world with rotation) of m = N/world examples
 * (rounded up with padding, where the slice wraps to G's start; rounded down
 * without, leaving G's last N mod world examples out).  Then, inside the
 * slice: chunk mode shuffles the examples of each window of `window`
 * consecutive chunks, and buffer mode passes the slice through a shuffle
 * buffer.  Every random draw is keyed by (seed, epoch, what it is for), so
 * the order is a pure function of its inputs.
 */
#include "loader_impl.h"

#include <stdlib.h>

/* The third key of each random stream: one domain per purpose. */
#define KEY_CHUNKS (1ull << 63)
#define KEY_EXAMPLES ((1ull << 63) | 1)
#define KEY_WINDOW(slot, w) ((2ull << 60) | ((uint64_t)(slot) << 36) | (uint64_t)(w))
#define KEY_BUFFER(slot) ((3ull << 60) | (uint64_t)(slot))

KPL_ENUM_DEFINE(kpl_shuffle_mode, KPL_SHUFFLE_MODES)

int64_t kpl__order_examples(const kpl_dataset *ds, const kpl__order_params *p)
{
    int64_t n = kpl_dataset_num_examples(ds);
    return p->limit > 0 && p->limit < n ? p->limit : n;
}

int64_t kpl__order_size(int64_t n, int32_t world, bool pad)
{
    return pad ? (n + world - 1) / world : n / world;
}

/* Shuffle buffer over v[0..n), in place: the first `fill` examples fill
 * the buffer; each further example replaces a random buffer entry, which is
 * emitted; at the end the buffer drains in random order. */
static kpl_status buffer_shuffle(kpl__rng *r, int64_t *v, int64_t n, int64_t fill)
{
    if (fill > n) fill = n;
    if (fill <= 1) return KPL_OK;
    int64_t *buf = malloc((size_t)fill * sizeof *buf);
    KPL_CHECK(buf, KPL_ENOMEM, "sampler: no memory for a %lld-example shuffle buffer",
              (long long)fill);
    memcpy(buf, v, (size_t)fill * sizeof *buf);
    int64_t out = 0;
    for (int64_t i = fill; i < n; i++) {
        int64_t j = (int64_t)kpl__rng_below(r, (uint64_t)fill);
        v[out++] = buf[j];
        buf[j] = v[i];
    }
    kpl__rng_shuffle(r, buf, fill);
    memcpy(v + out, buf, (size_t)fill * sizeof *buf);
    free(buf);
    return KPL_OK;
}

kpl_status kpl__order_epoch(const kpl_dataset *ds, const kpl__order_params *p, int64_t epoch,
                            int64_t *order)
{
    int64_t n = kpl__order_examples(ds, p);
    int64_t m = kpl__order_size(n, p->world, p->pad);
    int64_t slot = p->rotate ? (p->rank + epoch % p->world) % p->world : p->rank;
    if (m == 0) return KPL_OK;
    int64_t *g = NULL;  /* G, unless it is the identity */
    int32_t *gc = NULL; /* chunk mode: the chunk of each G entry */
    kpl_status st = KPL_OK;

    if (p->mode == KPL_SHUFFLE_CHUNK || p->mode == KPL_SHUFFLE_EXAMPLE) {
        g = malloc((size_t)n * sizeof *g);
        if (!g) return KPL_ERROR(KPL_ENOMEM, "sampler: no memory for %lld examples", (long long)n);
    }
    if (p->mode == KPL_SHUFFLE_CHUNK) {
        int64_t nc = kpl_dataset_num_chunks(ds);
        int64_t *perm = malloc((size_t)nc * sizeof *perm);
        gc = malloc((size_t)n * sizeof *gc);
        if (!perm || !gc) {
            free(perm);
            st = KPL_ERROR(KPL_ENOMEM, "sampler: no memory for %lld chunks", (long long)nc);
            goto done;
        }
        for (int64_t c = 0; c < nc; c++) perm[c] = c;
        kpl__rng r = kpl__rng_key(p->seed, (uint64_t)epoch, KEY_CHUNKS);
        kpl__rng_shuffle(&r, perm, nc);
        int64_t k = 0;
        for (int64_t c = 0; c < nc; c++) {
            kpl_chunk_info ci = kpl_dataset_chunk_info(ds, perm[c]);
            /* with a limit, chunks past it contribute nothing or a part */
            for (int64_t i = 0; i < ci.num_records && ci.first_example + i < n; i++, k++) {
                g[k] = ci.first_example + i;
                gc[k] = (int32_t)perm[c];
            }
        }
        free(perm);
        KPL_ASSERT(k == n, "chunk table does not cover the examples");
    } else if (p->mode == KPL_SHUFFLE_EXAMPLE) {
        for (int64_t i = 0; i < n; i++) g[i] = i;
        kpl__rng r = kpl__rng_key(p->seed, (uint64_t)epoch, KEY_EXAMPLES);
        kpl__rng_shuffle(&r, g, n);
    }

    /* G's position of the rank's i-th example: a contiguous slice, or
     * every world-th example from the slot's (interleave). */
#define AT(i) (p->interleave ? ((i) * p->world + slot) % n : (slot * m + (i)) % n)
    for (int64_t i = 0; i < m; i++) {
        int64_t at = AT(i);
        order[i] = g ? g[at] : at;
    }

    if (p->mode == KPL_SHUFFLE_CHUNK && p->window > 0) {
        /* Windows end after `window` runs of one chunk each. */
        int64_t ws = 0, w = 0;
        int runs = 1;
        for (int64_t i = 1; i <= m; i++) {
            bool change = i == m || gc[AT(i)] != gc[AT(i - 1)];
            if (!change) continue;
            if (i < m && runs < p->window) {
                runs++;
                continue;
            }
            kpl__rng r = kpl__rng_key(p->seed, (uint64_t)epoch, KEY_WINDOW(slot, w));
            kpl__rng_shuffle(&r, order + ws, i - ws);
            ws = i;
            w++;
            runs = 1;
        }
    } else if (p->mode == KPL_SHUFFLE_BUFFER) {
        kpl__rng r = kpl__rng_key(p->seed, (uint64_t)epoch, KEY_BUFFER(slot));
        st = buffer_shuffle(&r, order, m, p->initial_fill);
    }
done:
#undef AT
    free(g);
    free(gc);
    return st;
}
