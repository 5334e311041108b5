/* eager_impl.h — private to graph/: how an eager op finishes (eager.c,
 * eager_nn.c): its result recorded on the tape and in the open trace, then
 * handed to the current pool. */
#ifndef KPL_EAGER_IMPL_H
#define KPL_EAGER_IMPL_H

#include "graph_impl.h"
#include "ir_impl.h"

/* Autoreleases a finished result, or drops it when the op failed. */
static inline kpl_tensor *finish(kpl_status st, kpl_tensor *out)
{
    if (st < 0) {
        kpl_tensor_release(out);
        return NULL;
    }
    return kpl_autorelease(out);
}

/* Records a finished op on the tape (when it needs a gradient) and in the
 * open trace; traced ops that record something else on the tape (max
 * pooling as a gather) trace themselves and pass trace = false. */
static inline kpl_tensor *record_finish_as(kpl_status st, kpl_op op, const kpl_op_attrs *attrs, int nin,
                                    kpl_tensor *const *ins, kpl_tensor *out, bool trace)
{
    /* traced first: the tape's alias of a saved output maps to its value */
    if (st == KPL_OK && trace) kpl__trace_op(op, attrs, nin, ins, 1, &out);
    if (st == KPL_OK) st = kpl__graph_record(op, attrs, nin, ins, out);
    if (st == KPL_OK && kpl_memrec_active()) kpl__mem_note_op(op, out);
    return finish(st, out);
}

static inline kpl_tensor *record_finish(kpl_status st, kpl_op op, const kpl_op_attrs *attrs, int nin,
                                 kpl_tensor *const *ins, kpl_tensor *out)
{
    return record_finish_as(st, op, attrs, nin, ins, out, true);
}

/* A result with no gradient (comparisons, indices, integer casts): traced only. */
static inline kpl_tensor *trace_finish(kpl_status st, kpl_op op, const kpl_op_attrs *attrs, int nin,
                                kpl_tensor *const *ins, kpl_tensor *out)
{
    if (st == KPL_OK) kpl__trace_op(op, attrs, nin, ins, 1, &out);
    return finish(st, out);
}

static inline kpl_tensor *new_like(kpl_tensor *x, kpl_dtype dt, int ndim, const int64_t *shape)
{
    kpl_tensor *out = NULL;
    if (kpl_tensor_empty(kpl_tensor_device(x), dt, ndim, shape, &out) < 0) return NULL;
    return out;
}

#endif
