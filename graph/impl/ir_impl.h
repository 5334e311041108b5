/* ir_impl.h — private to graph/: the layout of GraphIR and the tracer's
 * hooks in the eager ops. */
#ifndef KPL_IR_IMPL_H
#define KPL_IR_IMPL_H

#include "ir.h"

#define KPL_IR_MAX_IN KPL_IR_MAX_INPUTS
#define KPL_IR_MAX_OUT KPL_IR_MAX_OUTPUTS

typedef struct {
    kpl_irv_kind kind;
    kpl_dtype dtype;
    int ndim;
    int64_t shape[KPL_MAX_DIMS];
    int node;         /* producer (KPL_IRV_OP), else -1 */
    char *name;       /* owned; NULL when it has none */
    kpl_tensor *data; /* parameter or constant (owned reference) */
} kpl_irv;

typedef struct {
    kpl_op op;
    kpl_op_attrs at; /* custom pointers always NULL */
    int nin, nout;
    int in[KPL_IR_MAX_IN]; /* -1: absent */
    int out[KPL_IR_MAX_OUT];
} kpl_irn;

struct kpl_ir {
    kpl_irv *v;
    int nv, cap_v;
    kpl_irn *n;
    int nn, cap_n;
    int *inputs, ninputs;
    int *outputs, noutputs;
    char **out_names;
    int *upd_param, *upd_value, nupdates; /* write-backs: parameter <- value */
    int level; /* of kpl_ir_optimize: what the executor plans */
};

/* Whether the op's output 0 is a view of input 0's bytes (no kernel). */
static inline bool kpl__ir_is_view(kpl_op op)
{
    return op == KPL_OP_RESHAPE || op == KPL_OP_NARROW;
}

/* Runs one node of a graph on tensors made for its values (exec.c; the
 * views are made by the caller). */
kpl_status kpl__ir_run_node(const kpl_irn *n, kpl_tensor *const *ins, kpl_tensor *const *outs);
/* The output shapes and dtypes of a node from its inputs' (exec.c):
 * fills ndim/shape/dtype of each output, KPL_ESHAPE naming the op. */
kpl_status kpl__ir_infer(const kpl_ir *ir, const kpl_irn *n, int *ndim,
                         int64_t (*shape)[KPL_MAX_DIMS], kpl_dtype *dt);

/* ---- the tracer's hooks (trace.c), no-ops when no trace is open ---- */

/* outs = op(ins) was computed: record a node. */
void kpl__trace_op(kpl_op op, const kpl_op_attrs *at, int nin, kpl_tensor *const *ins, int nout,
                   kpl_tensor *const *outs);
/* out = op(ins) was computed in place, over out's bytes: record a node
 * whose result is out's value from now on (written back into out at the
 * end of a run when out is from before the trace). */
void kpl__trace_write(kpl_op op, const kpl_op_attrs *at, int nin, kpl_tensor *const *ins,
                      kpl_tensor *out);
/* alias (a new header over of's bytes, made by the tape) is of's value. */
void kpl__trace_alias(kpl_tensor *alias, kpl_tensor *of);
/* t (just made from no traced value) is a constant of the trace. */
void kpl__trace_const(kpl_tensor *t);

#endif
