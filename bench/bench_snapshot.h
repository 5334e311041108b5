/* bench_snapshot.h — every parameter and buffer of a module, in order, as
 * host copies: a benchmark round starts the kpl side from the initial
 * weights, as each PyTorch process starts from the file (a step's cost
 * may depend on the weights).  For the benchmarks that compare whole
 * models with PyTorch (bench_fcos.c, bench_seg.c). */
#ifndef KPL_BENCH_SNAPSHOT_H
#define KPL_BENCH_SNAPSHOT_H

#include "trainer.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
    int n;
    kpl_tensor *t[1024];
    float *v[1024];
} snapshot;

static void snapshot_fail(const char *what)
{
    fprintf(stderr, "bench snapshot: %s\n", what);
    exit(1);
}

static void snapshot_take(snapshot *s, kpl_module *m)
{
    s->n = 0;
    for (int pass = 0; pass < 2; pass++) {
        int n = pass ? kpl_module_num_buffers(m) : kpl_module_num_params(m);
        kpl_tensor *const *ts = pass ? kpl_module_buffers(m) : kpl_module_params(m);
        for (int i = 0; i < n; i++) {
            if (s->n == (int)(sizeof s->t / sizeof s->t[0])) snapshot_fail("more than 1024 tensors");
            size_t bytes = sizeof(float) * (size_t)kpl_tensor_numel(ts[i]);
            s->t[s->n] = ts[i];
            s->v[s->n] = malloc(bytes);
            if (!s->v[s->n]) snapshot_fail("out of memory");
            memcpy(s->v[s->n++], kpl_tensor_host_data(ts[i]), bytes);
        }
    }
}

static void snapshot_restore(const snapshot *s)
{
    for (int i = 0; i < s->n; i++) {
        float *v = kpl_tensor_host_mutable(s->t[i]);
        if (!v) snapshot_fail("restoring the weights");
        memcpy(v, s->v[i], sizeof(float) * (size_t)kpl_tensor_numel(s->t[i]));
    }
}

static void snapshot_free(snapshot *s)
{
    for (int i = 0; i < s->n; i++) free(s->v[i]);
    s->n = 0;
}

#endif
