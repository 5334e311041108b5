/*
 * ir.h — the static graph: trace a function once into GraphIR, optimise
 * it with passes, and run it again and again from a memory plan made once.
 *
 *   kpl_trace_begin();
 *   kpl_tensor *x = kpl_trace_input(image, "image");  // a placeholder
 *   kpl_tensor *y = my_forward(model, x);               // eager ops, traced
 *   kpl_ir *ir = NULL;
 *   kpl_trace_end(1, &y, (const char *[]){"logits"}, &ir);
 *   kpl_ir_optimize(ir, 3, true);                       // O3, inference fusions
 *   kpl_exec *ex = NULL;
 *   kpl_exec_create(ir, &ex);
 *   kpl_exec_set_input(ex, 0, other_image);
 *   kpl_exec_run(ex);
 *   kpl_tensor *logits = kpl_exec_output(ex, 0);        // borrowed
 *
 * GraphIR: SSA values (each written once) and op nodes in execution order.
 * A value is a placeholder (an input given at run time), a parameter (a
 * tensor that existed before the trace began: weights, running
 * statistics; referenced, so later updates show), a constant (made during
 * the trace from no traced value: index tables, filled tensors), or an op
 * result.  Every value has the shape and dtype it had in the trace, and
 * kpl_ir_check re-derives each op's output from its inputs' (static shape
 * inference over the whole graph).
 *
 * A whole training step traces too: forward (batch norm in training mode
 * records its batch statistics), loss, kpl_backward (its fused gradients
 * are ops), and the update through kpl_write_* (graph.h), which the trace
 * records as new values of the tensors written; a tensor from before the
 * trace that is written (weights, momenta, running statistics) is an
 * update: the executor leaves its last value in it at the end of each run
 * (O2 computes it right there).  kpl_optim's sgd reads its learning rate
 * from a tensor kpl_optim_set_lr keeps current, so the graph follows a
 * schedule.  Trace a step after the first (sgd makes its momenta there).
 *
 * What a trace cannot represent is an error at kpl_trace_end naming it: a
 * host read or write of a traced value or a host write of a parameter (a
 * branch on data, a loss that inspects labels on the host, Adam's host
 * step count), a tensor made outside the traced ops from traced values,
 * random numbers, custom ops, a write into a constant, DDP's allreduce
 * (kpl_trace_refuse: the collective is outside the graph).
 * Tracing is per thread; the function runs eagerly while traced (its
 * results are real), with grad mode as the caller left it.
 */
#ifndef KPL_IR_H
#define KPL_IR_H

#include "graph.h"

#include <stdio.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct kpl_ir kpl_ir;

/* The most inputs and outputs a node has (batch_norm_bwd with the ReLU's
 * output reads 4; batch norm and max pooling write up to 3). */
#define KPL_IR_MAX_INPUTS 4
#define KPL_IR_MAX_OUTPUTS 3

typedef enum {
    KPL_IRV_INPUT = 0, /* placeholder */
    KPL_IRV_PARAM,     /* a live tensor from before the trace */
    KPL_IRV_CONST,     /* made during the trace from no traced value */
    KPL_IRV_OP,        /* an op's result */
} kpl_irv_kind;

/* ---- tracing ---- */

/* Starts tracing on this thread (KPL_ESTATE when a trace is open). */
kpl_status kpl_trace_begin(void);
/* Marks x as placeholder `name` (copied) and returns it: every op on x from
 * now on is traced.  NULL (with the trace's error set) on failure. */
kpl_tensor *kpl_trace_input(kpl_tensor *x, const char *name);
/* Ends the trace and returns the graph computing outs (names may be NULL,
 * or hold NULL entries: "output<i>").  An output that is a placeholder or
 * a parameter is KPL_EINVAL (nothing to run).  On failure the message
 * names the first thing the trace could not represent. */
kpl_status kpl_trace_end(int nout, kpl_tensor *const *outs, const char *const *names,
                         kpl_ir **out);
/* Ends a trace without a graph (after the traced function failed). */
void kpl_trace_abort(void);
bool kpl_tracing(void);
/* For code that computes outside kpl's ops (a collective, a host-side
 * optimizer state): while a trace is open, makes it fail at kpl_trace_end
 * with this reason (the first one given).  No-op without a trace. */
void kpl_trace_refuse(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
/* Whether t is from before the open trace (the graph reads it as it is at
 * each run: a parameter); false without a trace. */
bool kpl_trace_predates(const kpl_tensor *t);

/* ---- the graph ---- */

void kpl_ir_destroy(kpl_ir *ir);
int kpl_ir_num_values(const kpl_ir *ir);
int kpl_ir_num_nodes(const kpl_ir *ir);
int kpl_ir_num_inputs(const kpl_ir *ir);
int kpl_ir_num_outputs(const kpl_ir *ir);
/* Value ids of the placeholders and outputs, in order. */
int kpl_ir_input(const kpl_ir *ir, int i);
int kpl_ir_output(const kpl_ir *ir, int i);
const char *kpl_ir_output_name(const kpl_ir *ir, int i);
/* A value's kind, name (NULL when it has none), dtype and shape (returns
 * ndim; shape may be NULL). */
kpl_irv_kind kpl_ir_value_kind(const kpl_ir *ir, int v);
const char *kpl_ir_value_name(const kpl_ir *ir, int v);
kpl_dtype kpl_ir_value_dtype(const kpl_ir *ir, int v);
int kpl_ir_value_shape(const kpl_ir *ir, int v, int64_t *shape);
/* The tensor of a parameter or constant (borrowed), else NULL. */
kpl_tensor *kpl_ir_value_data(const kpl_ir *ir, int v);
/* Names the parameters that are among `tensors` (a state dict: the same
 * tensor headers, or headers over the same bytes and shape); returns
 * how many were named.  Serialisation and dumps use the names. */
int kpl_ir_name_params(kpl_ir *ir, int n, const char *const *names, kpl_tensor *const *tensors);
/* A node's op, attributes, inputs (-1: absent, e.g. a conv without bias)
 * and outputs. */
kpl_op kpl_ir_node_op(const kpl_ir *ir, int n);
const kpl_op_attrs *kpl_ir_node_attrs(const kpl_ir *ir, int n);
int kpl_ir_node_inputs(const kpl_ir *ir, int n, int *ids);  /* the count (<= KPL_IR_MAX_INPUTS) */
int kpl_ir_node_outputs(const kpl_ir *ir, int n, int *ids); /* the count (<= KPL_IR_MAX_OUTPUTS) */

/* Write-backs (a traced training step): at the end of every run the
 * executor leaves value `value` in parameter `param`'s tensor (an
 * optimizer's new weights and momenta, batch norm's running statistics).
 * The value may be computed right there (O2) or copied at the end. */
int kpl_ir_num_updates(const kpl_ir *ir);
void kpl_ir_update(const kpl_ir *ir, int i, int *param, int *value);
kpl_status kpl_ir_add_update(kpl_ir *ir, int param, int value);

/* Static shape inference: recomputes every op's output shape and dtype from
 * its inputs' and checks it against the value's, and checks the graph is
 * well formed (SSA, inputs defined before use, ops the executor runs).
 * KPL_ESHAPE / KPL_EINVAL naming the node, op and shapes. */
kpl_status kpl_ir_check(const kpl_ir *ir);

/* Building a graph by hand (the model loader): values and nodes appended
 * in order; the ids returned are their indices.  data is retained. */
kpl_status kpl_ir_create(kpl_ir **out);
int kpl_ir_add_value(kpl_ir *ir, kpl_irv_kind kind, kpl_dtype dt, int ndim, const int64_t *shape,
                     const char *name, kpl_tensor *data);
int kpl_ir_add_node(kpl_ir *ir, kpl_op op, const kpl_op_attrs *at, int nin, const int *in,
                    int nout, const int *out);
kpl_status kpl_ir_set_io(kpl_ir *ir, int nin, const int *inputs, int nout, const int *outputs,
                         const char *const *out_names);

/* ---- passes (each returns what it changed in *changed, may be NULL) ---- */

/* O1: drops nodes no output depends on, and values no node uses. */
kpl_status kpl_ir_prune(kpl_ir *ir, int *changed);
/* Inference fusions (parameters are read as they are now):
 * batch norm in eval form after a convolution folded into the
 * convolution's weights and bias; conv (+ bias) followed by ReLU as
 * conv2d_relu; and the eval batch norm's chain of element-wise ops on
 * its own as one scale and shift.  The graph no longer follows later
 * changes of the folded parameters. */
kpl_status kpl_ir_fuse_inference(kpl_ir *ir, int *changed);
/* Runs the passes of a level: 1 prune; 2 also marks in-place ops for the
 * plan; 3 also plans buffer reuse (the last two act in kpl_exec_create).
 * `inference` adds kpl_ir_fuse_inference.  The level is kept in the
 * graph for the executor. */
kpl_status kpl_ir_optimize(kpl_ir *ir, int level, bool inference);
int kpl_ir_level(const kpl_ir *ir);
void kpl_ir_set_level(kpl_ir *ir, int level);

/* Text (one line per node) or Graphviz dot. */
kpl_status kpl_ir_dump(const kpl_ir *ir, FILE *f, bool dot);

/* ---- the executor ---- */

typedef struct kpl_exec kpl_exec;

typedef struct {
    size_t arena_bytes;   /* the planned buffers (O3: one arena) */
    size_t value_bytes;   /* sum of every op value's bytes (what O0 allocates) */
    size_t live_bytes;    /* the most bytes alive at once (O3: the arena's lower bound) */
    int n_inplace;        /* ops writing over an input (O2) */
    int n_views;          /* reshapes and narrows: no memory of their own */
    int kept_layout;      /* the CPU convolutions' kept layout (kpl_layout) the
                           * executor settled on after its first runs, -1
                           * while tuning or where it does not tune */
} kpl_exec_stats;

/* Plans memory for ir's level on the device of its parameters (the CPU
 * when it has none), builds a tensor for every value once, and checks the
 * graph (kpl_ir_check).  The graph must outlive the executor. */
kpl_status kpl_exec_create(const kpl_ir *ir, kpl_exec **out);
void kpl_exec_destroy(kpl_exec *ex);
/* Copies x into placeholder i (x must have its shape and dtype; another
 * device is copied across).  KPL_ESHAPE naming both shapes. */
kpl_status kpl_exec_set_input(kpl_exec *ex, int i, kpl_tensor *x);
/* Runs every node in order, no allocation.  An inference graph on the CPU
 * (no weight gradients, no updates) times its first runs (9 to 27) with the
 * convolutions' layouts as chosen one by one, with all of them NHWC and
 * with all of them nChw16c, and keeps the fastest
 * (kpl_exec_stats.kept_layout). */
kpl_status kpl_exec_run(kpl_exec *ex);
/* Output i of the last run (borrowed: valid until the next run). */
kpl_tensor *kpl_exec_output(kpl_exec *ex, int i);
kpl_exec_stats kpl_exec_get_stats(const kpl_exec *ex);

#ifdef __cplusplus
}
#endif
#endif /* KPL_IR_H */
