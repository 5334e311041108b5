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

/* ---- ops in a graph: op_table.h's run and infer columns ---- */

/* What a shape inference reads and writes.  Output 0 starts as input 0's
 * ndim, shape and dtype; an infer function changes what differs. */
typedef struct {
    const kpl_ir *ir;
    const kpl_irn *n;
    const char *name;                 /* the op's */
    const kpl_irv *x[KPL_IR_MAX_IN];  /* the inputs, NULL when absent */
    const kpl_irv *o;                 /* output 0 as the graph records it */
    int *nd;                          /* per output */
    int64_t (*sh)[KPL_MAX_DIMS];
    kpl_dtype *dt;
} kpl__infer_ctx;

/* kpl__op_infer_<infer> of every row (exec_ops.c; an op may keep its own
 * beside its eager function); none: not in graphs. */
#define KPL_X_(e, s, ar, at, ac, sv, run, inf, ...) kpl_status kpl__op_infer_##inf(kpl__infer_ctx *c);
KPL_OP_LIST(KPL_X_)
#undef KPL_X_

/* kpl__op_run_<f> of the rows run as (EW, f) or (FN, f): node n on tensors
 * made for its values. */
#define KPL__RUN_DECL_FN(f) \
    kpl_status kpl__op_run_##f(const kpl_irn *n, kpl_tensor *const *in, kpl_tensor *const *out);
#define KPL__RUN_DECL_EW(f) KPL__RUN_DECL_FN(f)
#define KPL__RUN_DECL_UN(k)
#define KPL__RUN_DECL_UNA(k)
#define KPL__RUN_DECL_BIN(k)
#define KPL__RUN_DECL_BINS(k)
#define KPL__RUN_DECL_RED(k)
#define KPL__RUN_DECL_VIEW(k)
#define KPL__RUN_DECL_NONE(k)
#define KPL_X_(e, s, ar, at, ac, sv, run, ...) KPL_OP_PAIR(KPL__RUN_DECL_, run)
KPL_OP_LIST(KPL_X_)
#undef KPL_X_

/* Whether the op's output 0 is a view of input 0's bytes (no kernel). */
static inline bool kpl__ir_is_view(kpl_op op)
{
    return kpl_op_info_of(op)->run == KPL_OP_RUN_VIEW;
}

/* Whether the op is element-wise on input 0's shape: the executor may run
 * it over input 0's bytes (O2). */
static inline bool kpl__ir_is_elementwise(kpl_op op)
{
    kpl_op_run_kind k = kpl_op_info_of(op)->run;
    return k == KPL_OP_RUN_UN || k == KPL_OP_RUN_UNA || k == KPL_OP_RUN_BIN ||
           k == KPL_OP_RUN_BINS || k == KPL_OP_RUN_EW;
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
