/*
 * loader_impl.h — the loader's sample order (sampler.c), separate from the
 * processes that follow it (loader.c) so it can be tested on its own.
 */
#ifndef KPL_LOADER_IMPL_H
#define KPL_LOADER_IMPL_H

#include "dataio_impl.h"

/* Everything the order depends on besides the dataset and the epoch. */
typedef struct {
    kpl_shuffle_mode mode;
    uint64_t seed;
    int32_t rank, world;
    int window;           /* CHUNK */
    int64_t initial_fill; /* BUFFER */
    bool pad, rotate;
    int64_t limit;        /* > 0: the dataset's first `limit` examples only */
    bool interleave;      /* every world-th example instead of a slice */
} kpl__order_params;

/* The examples an epoch draws from: the dataset's, or the limit. */
int64_t kpl__order_examples(const kpl_dataset *ds, const kpl__order_params *p);

/* Examples per rank and epoch: ceil(n / world) with pad, else floor. */
int64_t kpl__order_size(int64_t n, int32_t world, bool pad);

/* This rank's example sequence for `epoch`: order[kpl__order_size(...)].
 * A pure function of (dataset chunk layout, params, epoch).  Allocates only
 * temporaries. */
kpl_status kpl__order_epoch(const kpl_dataset *ds, const kpl__order_params *p, int64_t epoch,
                            int64_t *order);

#endif /* KPL_LOADER_IMPL_H */
