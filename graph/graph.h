/*
 * graph.h — the eager tensor API and the dynamic graph (the tape).
 *
 * Every op here computes at once (through kernels/) and returns a new
 * tensor owned by the current autorelease pool.  When grad mode is on and an
 * input requires grad, the op also records a node: the op, its attributes,
 * edges to the nodes that produced its inputs, the input shapes, and the
 * tensors its gradient will need (the op's row in op_table.h says which;
 * the gradients themselves are autograd's).
 *
 *   kpl_pool *pool = kpl_pool_push();          // one training step
 *   kpl_tensor *h = kpl_relu(kpl_add(kpl_matmul(x, w, false, false), b));
 *   kpl_tensor *loss = kpl_mean(kpl_square(kpl_sub(h, y)), NULL, 0, false);
 *   if (!loss) fprintf(stderr, "%s\n", kpl_last_error());
 *   ...                                          // autograd: backward(loss)
 *   kpl_pool_pop(pool);                          // frees every temporary
 *
 * Errors: an op returns NULL and sets kpl_last_error().  A NULL input makes
 * an op return NULL without touching the message, so a chain of calls
 * reports the first failure.
 *
 * Thread-safety: the pool stack and grad mode are per thread (scopes of the
 * calling thread, as PyTorch's grad mode); tensors are not locked.
 */
#ifndef KPL_GRAPH_H
#define KPL_GRAPH_H

#include "kernels.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---- autorelease pools ------------------------------------------------------ */

typedef struct kpl_pool kpl_pool;

/* Opens a pool on this thread's stack; ops put their results in the
 * innermost pool.  NULL when out of memory. */
kpl_pool *kpl_pool_push(void);
/* Releases every reference the pool holds and closes it; pools close in
 * reverse order of opening (an inner pool still open is closed first). */
void kpl_pool_pop(kpl_pool *pool);
/* Hands one reference of `t` to the innermost pool and returns `t`; NULL
 * passes through.  With no pool open the reference is dropped at once and
 * an error is set (results must live in a scope). */
kpl_tensor *kpl_autorelease(kpl_tensor *t);
/* Number of references the pool holds. */
size_t kpl_pool_count(const kpl_pool *pool);

/* ---- grad mode ----------------------------------------------------------------- */

bool kpl_grad_enabled(void);
/* Sets this thread's grad mode; returns the previous one, so a no-grad
 * scope is `bool prev = kpl_set_grad_enabled(false); ... kpl_set_grad_enabled(prev);` */
bool kpl_set_grad_enabled(bool on);

/* ---- autocast (mixed precision) ------------------------------------------------------- */

/* This thread's autocast dtype: KPL_F32 (off, the default), KPL_BF16 or
 * KPL_F16.  While it is low, ops cast their floating inputs by their class
 * (kpl_autocast_class_of; docs/precision.md): convolutions and matmuls run
 * in the low dtype, reductions, norms, pooling and losses in f32, binary ops
 * in the wider of their inputs.  Parameters stay f32; the recorded casts
 * bring their gradients back to f32.  Backward runs with autocast off.
 *   kpl_dtype prev;
 *   kpl_set_autocast(KPL_BF16, &prev);  ... forward, loss ...
 *   kpl_set_autocast(prev, NULL);
 * KPL_EDTYPE for any other dtype. */
kpl_dtype kpl_autocast_dtype(void);
kpl_status kpl_set_autocast(kpl_dtype dt, kpl_dtype *prev);

/* ---- ops ---------------------------------------------------------------------- */

/* The ops, one row each in op_table.h (its columns: arity, attributes,
 * autocast class, saved tensors, how a graph runs it, shape inference,
 * gradient, ONNX form); the enum is append only. */
#include "op_table.h"

typedef enum {
#define KPL_X_(e, ...) KPL_OP_##e,
    KPL_OP_LIST(KPL_X_)
#undef KPL_X_
    KPL_OP_COUNT
} kpl_op;

const char *kpl_op_name(kpl_op op);

typedef enum {
    KPL_AUTOCAST_KEEP,    /* runs in its input's dtype */
    KPL_AUTOCAST_LOW,     /* runs in the autocast dtype */
    KPL_AUTOCAST_F32,     /* low-precision inputs are cast to f32 */
    KPL_AUTOCAST_PROMOTE, /* mixed float inputs meet in the wider dtype */
    KPL_AUTOCAST_MIXED,   /* low activations stay low, parameters and statistics
                             f32 (batch norm; f32 where the device has no such kernel) */
} kpl_autocast_class;

/* The class of an op under autocast (KEEP for ops outside the list). */
kpl_autocast_class kpl_autocast_class_of(kpl_op op);

/* Which kpl_op_attrs fields an op reads (op_table.h's attrs column). */
typedef enum {
    KPL_ATTRS_NONE,
    KPL_ATTRS_SLOPE,  /* alpha */
    KPL_ATTRS_BOUNDS, /* alpha, beta */
    KPL_ATTRS_SCALAR, /* scalar, scalar_first */
    KPL_ATTRS_REDUCE, /* axes, naxes, keepdim, correction */
    KPL_ATTRS_MATMUL, /* trans_a, trans_b */
    KPL_ATTRS_DTYPE,  /* dtype (the source's) */
    KPL_ATTRS_PERM,   /* axes, naxes */
    KPL_ATTRS_ROWS,   /* start, length */
    KPL_ATTRS_CONV,   /* conv (and shape4 for the adjoints) */
    KPL_ATTRS_SHAPE4, /* shape4 */
    KPL_ATTRS_POOL,   /* pool (and shape4 for the adjoint) */
    KPL_ATTRS_AXIS,   /* axes[0] (and length for index_add) */
    KPL_ATTRS_EPS,    /* alpha (and sub: batch_norm_bwd's ReLU) */
    KPL_ATTRS_ROI,    /* roi */
    KPL_ATTRS_CUSTOM, /* custom, custom_user */
    KPL_ATTRS_SUB,    /* sub: the kpl_binary_op */
    KPL_ATTRS_RESIZE, /* shape4 (the output's; x's for the adjoint), align_corners */
    KPL_ATTRS_XENT,   /* start (ignore_index), alpha (label smoothing) */
    KPL_ATTRS_FOCAL,  /* alpha, beta (gamma) */
    KPL_ATTRS_GROUPS, /* start (groups), alpha (eps) */
    KPL_ATTRS_COUNT   /* not a kind: how many there are */
} kpl_op_attr_kind;

/* How a graph runs an op (op_table.h's run column). */
typedef enum {
    KPL_OP_RUN_NONE, /* never in a graph */
    KPL_OP_RUN_UN,   /* kpl_k_unary, no attributes */
    KPL_OP_RUN_UNA,  /* kpl_k_unary with alpha, beta */
    KPL_OP_RUN_BIN,  /* kpl_k_binary */
    KPL_OP_RUN_BINS, /* kpl_k_binary_scalar */
    KPL_OP_RUN_RED,  /* kpl_k_reduce */
    KPL_OP_RUN_EW,   /* an element-wise function of the graph */
    KPL_OP_RUN_FN,   /* a function of the graph */
    KPL_OP_RUN_VIEW, /* a view of input 0, made by the executor's plan */
} kpl_op_run_kind;

/* How an op leaves for ONNX (op_table.h's onnx column). */
typedef enum { KPL_ONNX_NONE, KPL_ONNX_DIRECT, KPL_ONNX_CODED } kpl_onnx_kind;

/* An op's row (op_table.h), for tools and tests. */
typedef struct {
    const char *name;
    int in_min, in_max, out_min, out_max;
    kpl_op_attr_kind attrs;
    kpl_autocast_class autocast;
    unsigned saved_in, saved_out;
    kpl_op_run_kind run;
    int kernel;          /* UN, UNA: kpl_unary_op; BIN, BINS: kpl_binary_op; RED:
                            kpl_reduce_op; else -1 */
    const char *run_fn;  /* EW, FN: the graph's kpl__op_run_<run_fn>; else NULL */
    const char *infer;   /* kpl__op_infer_<infer>; "none" when not in graphs */
    bool differentiable; /* autograd has its gradient */
    kpl_onnx_kind onnx;
    const char *onnx_name; /* DIRECT: the ONNX type; CODED: the exporter's emit_<name>;
                              NONE: NULL */
} kpl_op_info;

/* The row of op (static storage); NULL for a value that is not an op. */
const kpl_op_info *kpl_op_info_of(kpl_op op);
/* The op named `name` (kpl_op_name's), or KPL_OP_COUNT when none is. */
kpl_op kpl_op_from_name(const char *name);

typedef struct kpl_custom_fn kpl_custom_fn; /* a caller-defined op, see kpl_custom */

/* Attributes of a recorded op (one flat struct: every op uses a few). */
typedef struct {
    double alpha, beta;      /* leaky_relu slope; clip bounds; batch_norm eps (alpha) */
    double scalar;           /* *_SCALAR ops */
    bool scalar_first;       /* s op x */
    int axes[KPL_MAX_DIMS];  /* reductions; permute (perm) */
    int naxes;
    bool keepdim;
    int correction;          /* var */
    bool trans_a, trans_b;   /* matmul */
    int64_t start, length;   /* narrow (dim 0) */
    kpl_dtype dtype;         /* cast: source dtype */
    kpl_conv2d_params conv;  /* conv2d family */
    int64_t shape4[4];       /* conv2d_bwd_*, *_scatter, *_bwd: the shape made */
    kpl_pool2d_params pool;  /* pooling */
    kpl_roi_align_params roi; /* roi_align, roi_align_bwd (vision.h) */
    const kpl_custom_fn *custom; /* custom: the caller's functions (borrowed) */
    void *custom_user;           /* custom: their argument (borrowed) */
    int sub;                     /* compare, binary: the kpl_binary_op;
                                    batch_norm_bwd: 1 with the ReLU's output */
    bool align_corners;          /* upsample_bilinear (and its adjoint) */
} kpl_op_attrs;

/* Unary (element-wise): kpl_<name>(x) for each op of op_table.h run as
 * (UN, k): kpl_neg, kpl_exp, kpl_relu, kpl_softplus (log(1 + e^x), stable
 * for any x; gradient sigmoid(x)) and the others there. */
#define KPL_X_(e, s, ar, at, ac, sv, run, ...) KPL_OP_CAT(KPL_UNARY_DECL_, KPL_OP_FIRST run)(s)
#define KPL_UNARY_DECL_UN(s) kpl_tensor *kpl_##s(kpl_tensor *x);
#define KPL_UNARY_DECL_UNA(s)
#define KPL_UNARY_DECL_BIN(s)
#define KPL_UNARY_DECL_BINS(s)
#define KPL_UNARY_DECL_RED(s)
#define KPL_UNARY_DECL_EW(s)
#define KPL_UNARY_DECL_FN(s)
#define KPL_UNARY_DECL_VIEW(s)
#define KPL_UNARY_DECL_NONE(s)
KPL_OP_LIST(KPL_X_)
#undef KPL_X_
kpl_tensor *kpl_leaky_relu(kpl_tensor *x, double slope);
kpl_tensor *kpl_clip(kpl_tensor *x, double lo, double hi);

/* Binary with numpy broadcasting; comparisons return KPL_BOOL and are not
 * recorded (no gradient flows through them). */
kpl_tensor *kpl_add(kpl_tensor *a, kpl_tensor *b);
kpl_tensor *kpl_sub(kpl_tensor *a, kpl_tensor *b);
kpl_tensor *kpl_mul(kpl_tensor *a, kpl_tensor *b);
kpl_tensor *kpl_div(kpl_tensor *a, kpl_tensor *b);
kpl_tensor *kpl_pow(kpl_tensor *a, kpl_tensor *b);
kpl_tensor *kpl_maximum(kpl_tensor *a, kpl_tensor *b);
kpl_tensor *kpl_minimum(kpl_tensor *a, kpl_tensor *b);
kpl_tensor *kpl_compare(kpl_binary_op cmp, kpl_tensor *a, kpl_tensor *b);
/* x op s, or s op x with `scalar_first`; op is one of ADD SUB MUL DIV POW
 * MAXIMUM MINIMUM. */
kpl_tensor *kpl_scalar_op(kpl_binary_op op, kpl_tensor *x, double s, bool scalar_first);
kpl_tensor *kpl_where(kpl_tensor *cond, kpl_tensor *a, kpl_tensor *b);

/* Reductions over `axes` (NULL/0 = all). */
kpl_tensor *kpl_sum(kpl_tensor *x, const int *axes, int naxes, bool keepdim);
kpl_tensor *kpl_mean(kpl_tensor *x, const int *axes, int naxes, bool keepdim);
kpl_tensor *kpl_max(kpl_tensor *x, const int *axes, int naxes, bool keepdim);
kpl_tensor *kpl_min(kpl_tensor *x, const int *axes, int naxes, bool keepdim);
kpl_tensor *kpl_var(kpl_tensor *x, const int *axes, int naxes, bool keepdim, int correction);
kpl_tensor *kpl_logsumexp(kpl_tensor *x, const int *axes, int naxes, bool keepdim);
/* Indices (KPL_I64, not recorded). */
kpl_tensor *kpl_argmax(kpl_tensor *x, int axis, bool keepdim);
kpl_tensor *kpl_argmin(kpl_tensor *x, int axis, bool keepdim);

kpl_tensor *kpl_matmul(kpl_tensor *a, kpl_tensor *b, bool trans_a, bool trans_b);
kpl_tensor *kpl_cast(kpl_tensor *x, kpl_dtype dt);
/* Shape ops: reshape/narrow are views of x's storage; permute and expand
 * (broadcast to `shape`) copy. */
kpl_tensor *kpl_reshape(kpl_tensor *x, int ndim, const int64_t *shape);
kpl_tensor *kpl_permute(kpl_tensor *x, const int *perm);
kpl_tensor *kpl_narrow(kpl_tensor *x, int64_t start, int64_t length);
kpl_tensor *kpl_expand(kpl_tensor *x, int ndim, const int64_t *shape);
/* `before` zero rows, x, `after` zero rows along dim 0 (narrow's inverse). */
kpl_tensor *kpl_pad_rows(kpl_tensor *x, int64_t before, int64_t after);

/* 2-D convolution, NCHW input, OIHW weights, bias (O) or NULL. */
kpl_tensor *kpl_conv2d(kpl_tensor *x, kpl_tensor *w, kpl_tensor *b, const kpl_conv2d_params *p);
/* kpl_relu(kpl_conv2d(...)): on a device with the fused kernel (the CPU)
 * one op, the ReLU applied as the convolution stores its sums (oneDNN's
 * post-op), which saves a pass over the output; the gradients are the two
 * ops'.  The values are equal, but for the sign of a zero (see
 * kpl_k_conv2d_relu). */
kpl_tensor *kpl_conv2d_relu(kpl_tensor *x, kpl_tensor *w, kpl_tensor *b,
                            const kpl_conv2d_params *p);
/* The two halves of conv2d's gradient, ops in their own right (so conv2d is
 * differentiable to any order): the input gradient (a transposed
 * convolution producing x_shape) and the weight gradient (w_shape). */
kpl_tensor *kpl_conv2d_bwd_data(kpl_tensor *gy, kpl_tensor *w, const int64_t *x_shape,
                                const kpl_conv2d_params *p);
kpl_tensor *kpl_conv2d_bwd_weight(kpl_tensor *x, kpl_tensor *gy, const int64_t *w_shape,
                                  const kpl_conv2d_params *p);

/* ---- fused gradients: what backward runs without create_graph.  Not
 * recorded on the tape (not differentiable), traced like any op ---- */

/* gy where y > 0, else 0 (KPL_BIN_RELU_BWD). */
kpl_tensor *kpl_relu_bwd(kpl_tensor *gy, kpl_tensor *y);
/* conv2d's weight gradient (w_shape) and bias gradient (w_shape[0]) in one
 * pass over gy; both pool-owned. */
kpl_status kpl_conv2d_bwd_weight_bias(kpl_tensor *x, kpl_tensor *gy, const int64_t *w_shape,
                                      const kpl_conv2d_params *p, kpl_tensor **gw,
                                      kpl_tensor **gb);
/* Group norm's gradients in one kernel (kpl_k_group_norm_bwd, where the
 * device has it; not recorded): each of gx, ggamma, gbeta that is not NULL
 * gets a pool-owned result. */
kpl_status kpl_group_norm_bwd(kpl_tensor *x, kpl_tensor *gy, kpl_tensor *gamma, int groups,
                              double eps, kpl_tensor **gx, kpl_tensor **ggamma,
                              kpl_tensor **gbeta);
/* Training batch norm's gradients (kpl_k_batch_norm_bwd; with relu_y, the
 * output of the fused batch_norm_relu, kpl_k_batch_norm_relu_bwd): each of
 * gx, ggamma, gbeta that is not NULL gets a pool-owned result. */
kpl_status kpl_batch_norm_bwd(kpl_tensor *x, kpl_tensor *relu_y, kpl_tensor *gy,
                              kpl_tensor *gamma, double eps, kpl_tensor **gx,
                              kpl_tensor **ggamma, kpl_tensor **gbeta);

/* ---- writes into existing tensors (an optimizer's update, running
 * statistics, gradient buffers): the kernels' in-place forms, never on the
 * tape.  A trace records each as a new value of out; when out is a tensor
 * from before the trace (a parameter, a momentum buffer), the graph writes
 * its last value back into it at the end of every run (ir.h). ---- */

kpl_status kpl_write_binary(kpl_tensor *out, kpl_binary_op op, kpl_tensor *a, kpl_tensor *b);
kpl_status kpl_write_scalar(kpl_tensor *out, kpl_binary_op op, kpl_tensor *a, double s,
                            bool scalar_first);
kpl_status kpl_write_copy(kpl_tensor *out, kpl_tensor *x);

/* ---- neural-network functions (graph/nn.c), built from the ops above, so
 * they are recorded and differentiable like any op ---- */

typedef enum { KPL_REDUCE_MEAN = 0, KPL_REDUCE_SUM, KPL_REDUCE_NONE } kpl_reduction;

/* y = x @ w^T + b: x (..., in), w (out, in), b (out) or NULL. */
kpl_tensor *kpl_linear(kpl_tensor *x, kpl_tensor *w, kpl_tensor *b);
kpl_tensor *kpl_softmax(kpl_tensor *x, int axis);
kpl_tensor *kpl_log_softmax(kpl_tensor *x, int axis);
/* Cross entropy of logits (N, C) against class indices (N) (KPL_I64), or
 * per element of logits (N, C, d1, ..., dk) (segmentation: (N, C, H, W))
 * against labels (N, d1, ..., dk), as PyTorch's F.cross_entropy: log_softmax
 * along axis 1, the label's log-probability gathered along it (the logits
 * stay NCHW), label smoothing in [0, 1), and elements whose label is
 * ignore_index left out (pass a negative value that never occurs, e.g.
 * -100, to keep all; 255 for VOC-style void pixels).  A label outside
 * [0, C) is KPL_ERANGE naming its row (or position) and value.  The mean is
 * over the elements that count; when none does it is 0, with gradient 0
 * (PyTorch returns NaN there: see docs/nn.md).  KPL_REDUCE_NONE returns
 * (N) or (N, d1, ..., dk) with 0 at ignored elements. */
kpl_tensor *kpl_cross_entropy(kpl_tensor *logits, kpl_tensor *labels, kpl_reduction red,
                              double label_smoothing, int64_t ignore_index);
/* The fused op under kpl_cross_entropy: per position of logits (N, C, d1,
 * ..., dk) (k >= 0) against i64 labels (N, d1, ..., dk), (1 - eps)(lse -
 * x[y]) + eps (lse - mean_c x[c]) in one kernel (nothing the size of the
 * logits is made), 0 where the label is ignore_index; (N, d1, ..., dk) in
 * the logits' dtype.  Its gradient in the logits is kpl_softmax_xent_bwd
 * (softmax(x) - (1 - eps) onehot(y) - eps / C, times gy), itself
 * differentiable.  A label outside [0, C) that is not ignore_index is
 * KPL_ERANGE naming its position. */
kpl_tensor *kpl_softmax_xent(kpl_tensor *logits, kpl_tensor *labels, int64_t ignore_index,
                             double label_smoothing);
kpl_tensor *kpl_softmax_xent_bwd(kpl_tensor *logits, kpl_tensor *labels, kpl_tensor *gy,
                                 int64_t ignore_index, double label_smoothing);
/* The same with class weights `weight` (C) (logits' dtype) or NULL (all 1),
 * PyTorch's semantics exactly: with w_i = weight[y_i] and eps the smoothing,
 *   loss_i = (1 - eps) w_i (-logp[y_i]) + eps / C sum_c weight[c] (-logp[c]),
 * 0 at ignored elements; KPL_REDUCE_MEAN is sum(loss_i) / sum(w_i) over the
 * elements that count (0 when none does; NaN, as PyTorch, when they count
 * but their weights sum to 0). */
kpl_tensor *kpl_cross_entropy_weighted(kpl_tensor *logits, kpl_tensor *labels,
                                       kpl_tensor *weight /* (C) or NULL */, kpl_reduction red,
                                       double label_smoothing, int64_t ignore_index);
/* Negative log likelihood of log-probabilities (N, C) or (N, C, d1, ...),
 * labels as cross_entropy's. */
kpl_tensor *kpl_nll_loss(kpl_tensor *logp, kpl_tensor *labels, kpl_reduction red,
                         int64_t ignore_index);
/* Multi-class soft Dice loss of logits (N, C, H, W) (or (N, C, d1, ...))
 * against labels (N, H, W) (KPL_I64), as mmsegmentation 0.x's DiceLoss:
 * p = softmax over C, t the one-hot labels; per (sample n, class c) over
 * the pixels whose label is not ignore_index,
 *   dice = (2 sum(p t) + smooth) / (sum(p^exponent) + sum(t^exponent) + smooth),
 * the loss of sample n is sum over c != ignore_index of (1 - dice) / C, and
 * `red` reduces the (N) losses.  smooth >= 0 (mmseg's default 1), exponent
 * > 0 (default 2); a label outside [0, C) is KPL_ERANGE as cross_entropy's.
 * Ignored pixels count in no sum (mmseg leaves them in the denominator, and
 * ignores `red`, always averaging: see docs/nn.md).  With smooth 0 a class
 * with no probability and no pixel gives 0 / 0 (NaN). */
kpl_tensor *kpl_dice_loss(kpl_tensor *logits, kpl_tensor *labels, int64_t ignore_index,
                          double smooth, double exponent, kpl_reduction red);
/* Element-wise regression losses: y must have x's shape (no broadcasting). */
kpl_tensor *kpl_mse_loss(kpl_tensor *x, kpl_tensor *y, kpl_reduction red);
kpl_tensor *kpl_l1_loss(kpl_tensor *x, kpl_tensor *y, kpl_reduction red);
/* 0.5 d^2 / beta where d = |x - y| < beta, else d - 0.5 beta; beta >= 0,
 * and beta = 0 is the L1 loss (as PyTorch). */
kpl_tensor *kpl_smooth_l1_loss(kpl_tensor *x, kpl_tensor *y, kpl_reduction red, double beta);
/* Batch normalisation of x (N, C, ...) over every axis but 1.  gamma, beta
 * (C) may be NULL.  Training: normalise with the batch statistics and move
 * the running ones (updated in place, unrecorded) by `momentum` (unbiased
 * variance, as PyTorch), which needs more than one value per channel
 * (N * H * W > 1, else KPL_ESHAPE, as PyTorch); eval: normalise with the
 * running statistics. */
kpl_tensor *kpl_batch_norm(kpl_tensor *x, kpl_tensor *gamma, kpl_tensor *beta,
                           kpl_tensor *running_mean, kpl_tensor *running_var, bool training,
                           double momentum, double eps);
/* kpl_relu(kpl_batch_norm(...)), the same values and gradients bit for
 * bit; in training on a device with the fused kernel (the CPU) one op
 * that reads and writes the activations once each way instead of twice. */
kpl_tensor *kpl_batch_norm_relu(kpl_tensor *x, kpl_tensor *gamma, kpl_tensor *beta,
                                kpl_tensor *running_mean, kpl_tensor *running_var,
                                bool training, double momentum, double eps);
/* Normalise over the last `ndims` dims; gamma, beta shaped like them. */
kpl_tensor *kpl_layer_norm(kpl_tensor *x, int ndims, kpl_tensor *gamma, kpl_tensor *beta,
                           double eps);
/* Normalise x (N, C, ...) over groups of C/groups channels; gamma, beta (C). */
kpl_tensor *kpl_group_norm(kpl_tensor *x, int groups, kpl_tensor *gamma, kpl_tensor *beta,
                           double eps);
/* Inverted dropout: zero each element with probability p and scale the rest
 * by 1/(1-p) (training only); the mask comes from rng (Philox), so a run is
 * reproducible. */
kpl_tensor *kpl_dropout(kpl_tensor *x, double p, bool training, kpl_rng *rng);
/* Binary cross entropy of logits z against targets y in [0, 1] (y has z's
 * shape): -[y log s(z) + (1 - y) log(1 - s(z))], s the sigmoid, computed as
 * y softplus(-z) + (1 - y) softplus(z) — two non-negative terms, so
 * nothing overflows or cancels for any z; the gradient is s(z) - y. */
kpl_tensor *kpl_bce_with_logits(kpl_tensor *z, kpl_tensor *y, kpl_reduction red);
/* The same with PyTorch's BCEWithLogitsLoss(weight, pos_weight):
 *   loss = weight * -[pos_weight y log s(z) + (1 - y) log(1 - s(z))].
 * pos_weight (typically (C), one per class of z (N, C)) weighs the
 * positive term; weight rescales each element.  Either may be NULL; each
 * must broadcast to z's shape (numpy rules, aligned on the last dim)
 * without enlarging it. */
kpl_tensor *kpl_bce_with_logits_weighted(kpl_tensor *z, kpl_tensor *y, kpl_tensor *weight,
                                         kpl_tensor *pos_weight, kpl_reduction red);

/* Transposed convolution: x (N, Cin, H, W), w (Cin, Cout/groups, KH, KW)
 * (PyTorch's ConvTranspose2d layout), bias (Cout) or NULL; the output is
 * (H - 1) stride - 2 padding + dilation (KH - 1) + output_padding + 1 high
 * (likewise wide); output_padding (h, w), NULL for none, each below
 * max(stride, dilation) as PyTorch.  It is conv2d's input gradient,
 * recorded as that op (and, where output_padding >= stride, a slice and a
 * zero pad of it). */
kpl_tensor *kpl_conv_transpose2d(kpl_tensor *x, kpl_tensor *w, kpl_tensor *b,
                                 const kpl_conv2d_params *p, const int *output_padding);

/* Pooling over NCHW.  max_pool2d records a gather of x at the window
 * maxima; the gather/scatter pair and avg_pool2d with its adjoint are ops
 * in their own right, so pooling is differentiable to any order. */
kpl_tensor *kpl_max_pool2d(kpl_tensor *x, const kpl_pool2d_params *p);
kpl_tensor *kpl_avg_pool2d(kpl_tensor *x, const kpl_pool2d_params *p);
kpl_tensor *kpl_global_avg_pool2d(kpl_tensor *x); /* (N, C, 1, 1) */
/* Average pooling to (oh, ow) with PyTorch's adaptive windows
 * [floor(i H / oh), ceil((i + 1) H / oh)). */
kpl_tensor *kpl_adaptive_avg_pool2d(kpl_tensor *x, int64_t oh, int64_t ow);
kpl_tensor *kpl_plane_gather(kpl_tensor *x, kpl_tensor *idx);
kpl_tensor *kpl_plane_scatter(kpl_tensor *gy, kpl_tensor *idx, const int64_t *x_shape);
kpl_tensor *kpl_avg_pool2d_bwd(kpl_tensor *gy, const int64_t *x_shape,
                               const kpl_pool2d_params *p);

/* Rows idx (KPL_I64, (K)) of x along `axis`, and the adjoint: g's rows
 * added into zeros of size `dim` along axis at idx. */
kpl_tensor *kpl_index_select(kpl_tensor *x, int axis, kpl_tensor *idx);
kpl_tensor *kpl_index_add(kpl_tensor *g, int axis, kpl_tensor *idx, int64_t dim);

/* torch.gather: an index per element.  idx (KPL_I64) has x's number of
 * dims and is no larger than x in any dim but `axis` (negative counts
 * from the end); out has idx's shape and takes x's element at the index
 * along axis, e.g. out[i][j][k] = x[i][idx[i][j][k]][k] for axis 1.  Any
 * dtype; gradients (float x) are the scatter_add of the output gradient
 * into zeros of x's shape, which needs f32 or f64.  An index outside
 * [0, x's size along axis) is KPL_ERANGE naming the axis, the value and
 * its position in idx (the first in row-major order). */
kpl_tensor *kpl_gather(kpl_tensor *x, int axis, kpl_tensor *idx);
/* gather's adjoint, torch.Tensor.scatter_add out of place: out = x, then
 * out[i][idx[i][j][k]][k] += src[i][j][k] for axis 1 (likewise for the
 * others), repeated indices adding up.  src must have idx's shape
 * (PyTorch also takes a larger src and reads its leading corner); idx is
 * checked as gather's.  f32 and f64.  Gradients: x gets the output
 * gradient, src its gather at idx. */
kpl_tensor *kpl_scatter_add(kpl_tensor *x, int axis, kpl_tensor *idx, kpl_tensor *src);

/* Shape ops built on index_select / index_add / permute (all recorded). */
/* weight (V, D) rows for ids (any shape, KPL_I64) -> ids.shape + (D). */
kpl_tensor *kpl_embedding(kpl_tensor *weight, kpl_tensor *ids);
kpl_tensor *kpl_slice(kpl_tensor *x, int axis, int64_t start, int64_t length);
kpl_tensor *kpl_concat(int n, kpl_tensor *const *xs, int axis);
kpl_tensor *kpl_transpose(kpl_tensor *x, int a, int b);
/* n pieces of x along axis with the given sizes (summing to the dim);
 * out[i] are pool-owned. */
kpl_status kpl_split(kpl_tensor *x, int axis, int n, const int64_t *sizes, kpl_tensor **out);
/* The k largest (or smallest) entries of each row along the last axis,
 * sorted, ties by lower index, NaN largest: values (recorded, gradients
 * flow to the chosen entries) and indices (KPL_I64); both pool-owned. */
kpl_status kpl_topk(kpl_tensor *x, int64_t k, bool largest, kpl_tensor **values,
                    kpl_tensor **indices);
typedef enum { KPL_PAD_CONSTANT = 0, KPL_PAD_REFLECT } kpl_pad_mode;
/* pads[2 i], pads[2 i + 1]: before/after for the i-th of the last npairs
 * dims (innermost first, as PyTorch's F.pad). */
kpl_tensor *kpl_pad(kpl_tensor *x, int npairs, const int64_t *pads, kpl_pad_mode mode,
                    double value);
/* NCHW resize to (oh, ow): nearest (a gather of rows and columns), or
 * bilinear with or without align_corners, F.interpolate's arithmetic
 * (kpl_k_upsample_bilinear), one op whose adjoint is
 * kpl_upsample_bilinear_bwd (x_shape: the input's (N, C, H, W)); each is
 * the other's gradient, so resizing is differentiable to any order. */
kpl_tensor *kpl_upsample_nearest(kpl_tensor *x, int64_t oh, int64_t ow);
kpl_tensor *kpl_upsample_bilinear(kpl_tensor *x, int64_t oh, int64_t ow, bool align_corners);
kpl_tensor *kpl_upsample_bilinear_bwd(kpl_tensor *gy, const int64_t *x_shape, bool align_corners);

/* A caller-defined differentiable op with one input and one output, for
 * values computed outside the graph (SyncBN's all-reduce of batch
 * statistics, a call into another library): the caller computes y from x
 * itself, then kpl_custom(x, y, fn, user) returns y recorded as a
 * function of x, whose gradient backward computes:
 *
 *   static kpl_tensor *times3_bwd(kpl_tensor *gy, void *user)
 *   {
 *       return kpl_scalar_op(KPL_BIN_MUL, gy, 3, false);
 *   }
 *   static const kpl_custom_fn times3 = {"times3", times3_bwd};
 *   ...
 *   kpl_tensor *y = kpl_custom(x, y_computed_from_x, &times3, NULL);
 *
 * backward(gy, user) gets the output gradient (y's shape and dtype) and
 * returns the input gradient: pool-owned (any eager op's result), with
 * x's shape and dtype.  Written with eager ops, it is recorded again under
 * create_graph, so second order works as far as its ops (and any further
 * kpl_custom inside it) allow.  On failure it returns NULL with
 * kpl_last_error() set (KPL_ERROR); the backward then fails with that
 * status and message, prefixed with the op's name.  It runs on the thread
 * of the backward, at most once per backward of a graph through it.
 *
 * The result is a new header on y's storage (pool-owned, like reshape's);
 * y's own graph, if it has one, is not followed: gradients reach x only
 * through backward.  With grad mode off, or when x does not require
 * grad, nothing is recorded and the result is that view of y.  fn, the
 * strings it points to and `user` are borrowed: they must outlive every
 * graph through the result (until its backward has run and its results
 * are released, or for ever with static storage, as above).  KPL_EINVAL
 * for a NULL fn or backward, KPL_EDEVICE when x and y sit on different
 * devices. */
struct kpl_custom_fn {
    const char *name; /* for messages; NULL reads "custom" */
    kpl_tensor *(*backward)(kpl_tensor *gy, void *user);
};
kpl_tensor *kpl_custom(kpl_tensor *x, kpl_tensor *y, const kpl_custom_fn *fn, void *user);

/* Creation (not recorded). */
kpl_tensor *kpl_empty(kpl_device *dev, kpl_dtype dt, int ndim, const int64_t *shape);
kpl_tensor *kpl_full(kpl_device *dev, kpl_dtype dt, int ndim, const int64_t *shape,
                     double value);
kpl_tensor *kpl_rand(kpl_device *dev, kpl_dtype dt, int ndim, const int64_t *shape,
                     kpl_rng *rng, double lo, double hi);
kpl_tensor *kpl_randn(kpl_device *dev, kpl_dtype dt, int ndim, const int64_t *shape,
                      kpl_rng *rng, double mean, double std);
/* (n): start, start + step, ... */
kpl_tensor *kpl_arange(kpl_device *dev, kpl_dtype dt, int64_t n, double start, double step);
/* A copy of x on dev (not recorded: gradients do not cross devices). */
kpl_tensor *kpl_to_device(kpl_tensor *x, kpl_device *dev);
/* x's values cut from the graph (torch's detach): a view sharing x's
 * storage (a new header, pool-owned, like reshape's), not recorded, so it
 * does not require grad and no gradient flows through it into x, even
 * when x is a parameter or a recorded result.  Because the storage is
 * shared, a later in-place write to either (an optimizer step) shows in
 * both; copy it (kpl_to_device to x's own device) to keep the values of
 * the moment. */
kpl_tensor *kpl_detach(kpl_tensor *x);

/* ---- autograd's view of a tensor ----------------------------------------------- */

typedef struct kpl_node kpl_node; /* a recorded op, see "the tape" below */

/* Marks a leaf (a tensor no op produced) as a parameter whose gradient
 * accumulates into its .grad.  Float dtypes only. */
kpl_status kpl_set_requires_grad(kpl_tensor *t, bool on);
/* True for parameters and for results recorded on the tape. */
bool kpl_requires_grad(const kpl_tensor *t);
/* The accumulated gradient of a parameter (borrowed; NULL if none yet). */
kpl_tensor *kpl_grad_get(const kpl_tensor *t);
/* Replaces the .grad of a parameter (retains g; NULL clears it). */
void kpl_grad_set(kpl_tensor *t, kpl_tensor *g);
/* Installs `buf` (retained; t's element count, dtype and device) as the
 * .grad of parameter t and makes it a gradient buffer: backward adds into
 * it in place instead of replacing .grad with a new tensor, so the owner
 * of the memory (the DDP bucketer, whose buckets hold every gradient) sees
 * the result where it expects it.  Fill it with zeros first for a fresh
 * step.  kpl_grad_set or kpl_zero_grad end the buffer mode. */
kpl_status kpl_grad_set_buffer(kpl_tensor *t, kpl_tensor *buf);
/* Whether t's .grad is such a buffer. */
bool kpl_grad_is_buffer(const kpl_tensor *t);

/* Hooks, stored here and run by autograd/ during backward.
 * A gradient hook sees the gradient flowing into tensor t (its total for
 * this backward) and may return a replacement (pool-owned), or NULL to keep
 * it.  A ready hook runs once per backward for each parameter, as soon as
 * its .grad is complete, in backward order (the DDP bucketer starts its
 * allreduce there); a status < 0 from it ends the backward with that
 * status (and the hook's message).  Hooks on a result apply to the node
 * that made it.  Up to 8 of each per tensor. */
typedef kpl_tensor *(*kpl_grad_hook)(kpl_tensor *t, kpl_tensor *grad, void *user);
typedef kpl_status (*kpl_ready_hook)(kpl_tensor *param, void *user);
kpl_status kpl_add_grad_hook(kpl_tensor *t, kpl_grad_hook fn, void *user);
kpl_status kpl_add_ready_hook(kpl_tensor *param, kpl_ready_hook fn, void *user);
void kpl_clear_hooks(kpl_tensor *t);

typedef struct {
    int n_grad, n_ready;
    kpl_grad_hook grad[8];
    void *grad_user[8];
    kpl_ready_hook ready[8];
    void *ready_user[8];
} kpl_hooks;
/* The hooks of a parameter or of a node (borrowed; NULL when none). */
const kpl_hooks *kpl_tensor_hooks(const kpl_tensor *t);
const kpl_hooks *kpl_node_hooks(const kpl_node *n);

/* ---- the tape ------------------------------------------------------------------ */

/* The node that produced t (borrowed), NULL for leaves and non-recorded
 * results; *out_index receives which output of the node t is. */
kpl_node *kpl_tensor_node(const kpl_tensor *t, int *out_index);

kpl_op kpl_node_op(const kpl_node *n);
const kpl_op_attrs *kpl_node_attrs(const kpl_node *n);
int kpl_node_num_inputs(const kpl_node *n);
/* Where input i's gradient goes: the producing node and its output index,
 * or a parameter (leaf), or nothing (input did not require grad). */
kpl_node *kpl_node_input_node(const kpl_node *n, int i, int *out_index);
kpl_tensor *kpl_node_input_leaf(const kpl_node *n, int i);
bool kpl_node_input_requires_grad(const kpl_node *n, int i);
/* Shape and dtype of input i / output 0 as recorded. */
int kpl_node_input_shape(const kpl_node *n, int i, int64_t *shape);
kpl_dtype kpl_node_input_dtype(const kpl_node *n, int i);
int kpl_node_output_shape(const kpl_node *n, int64_t *shape);
/* A saved input/output (borrowed; NULL if not saved or already freed). */
kpl_tensor *kpl_node_saved_input(const kpl_node *n, int i);
kpl_tensor *kpl_node_saved_output(const kpl_node *n);
/* Releases the saved tensors (the reverse-mode GC calls this once the
 * node's backward has run); later reads of them return NULL. */
void kpl_node_free_saved(kpl_node *n);
bool kpl_node_saved_freed(const kpl_node *n);
/* The label the memory profile (kpl_memrec) gives the blocks n's backward
 * allocates: "backward of OP @ MODULE"; 0 when no recorder runs. */
uint32_t kpl_node_backward_mem_label(const kpl_node *n);
void kpl_node_retain(kpl_node *n);
void kpl_node_release(kpl_node *n);

/* ---- recomputation (checkpointing): trading compute for memory ------------- */

/* A region of the forward whose saved tensors are let go and computed
 * again when the backward needs them (torch.utils.checkpoint, Chen et al.
 * 2016).  The caller brackets the region's ops:
 *
 *   static kpl_status block_again(void *user, int n, kpl_tensor *const *in)
 *   {
 *       return my_block(user, in[0]) ? KPL_OK : kpl_last_status();
 *   }
 *   ...
 *   kpl_recompute *r = NULL;
 *   KPL_TRY(kpl_recompute_begin("layer1.0", 1, &x, block_again, state, &r));
 *   kpl_tensor *y = my_block(state, x);
 *   KPL_TRY(kpl_recompute_end(r, y ? 1 : 0, &y));
 *
 * The nodes recorded in between are recorded as always; when the region
 * ends, and once the next region has begun (so the last region before a
 * backward, whose tensors that backward needs first, is never dropped),
 * they let go of every saved tensor but the parameters and the region's
 * inputs and outputs (alive anyway).  The first node of the region whose
 * gradient runs calls `fn(user, n, inputs)` again, with the inputs
 * retained since begin, grad mode on, autocast as in the forward: the
 * ops it records hand their saved tensors, in recording order, to the
 * region's nodes, which then run their gradients as if nothing had
 * happened.  Exact: the same values bit for bit, provided fn computes
 * what it computed the first time.  Its random draws (kpl_rand,
 * kpl_randn, kpl_dropout) are replayed from the generator positions of
 * the forward, and the generators are left where they were; batch norm
 * does not move its running statistics again; code with other side
 * effects keeps them with kpl_recompute_keep and takes them back with
 * kpl_recompute_replayed (SyncBN's all-reduced statistics).  An op
 * sequence that differs from the forward's fails the backward, naming
 * the region and the op.  Under create_graph the recomputed tensors keep
 * their graph, so gradients of gradients flow through them.
 *
 * A region inside another region (or inside a recomputation) is no
 * region: *out is NULL and its ops belong to the outer one; so too with
 * grad mode off.  kpl_recompute_end(NULL, ...) is a no-op, and n = 0
 * (the region's code failed) abandons the region.  `name` (copied) and
 * `user` (borrowed: it must outlive the graph) are for fn and messages.
 * A trace (graph/ir.h) is refused: a static graph plans its own memory. */
typedef struct kpl_recompute kpl_recompute;
typedef kpl_status (*kpl_recompute_fn)(void *user, int n, kpl_tensor *const *inputs);
kpl_status kpl_recompute_begin(const char *name, int n, kpl_tensor *const *inputs,
                               kpl_recompute_fn fn, void *user, kpl_recompute **out);
kpl_status kpl_recompute_end(kpl_recompute *r, int n, kpl_tensor *const *outputs);
/* Whether this thread is recomputing a region (the backward's replay). */
bool kpl_recompute_replaying(void);
/* Inside a region's forward: keeps t (retained) for the replay, where
 * kpl_recompute_replayed gives the kept tensors back in the same order
 * (pool-owned; NULL and an error when the replay asks for more than was
 * kept).  Outside a region (or in a replay) keep does nothing. */
kpl_status kpl_recompute_keep(kpl_tensor *t);
kpl_tensor *kpl_recompute_replayed(void);
/* Lets the last region's tensors stay (autograd calls it as a backward
 * starts).  */
void kpl_recompute_flush(void);
/* Computes again the saved tensors of n's region if they were let go;
 * keep_graph: with their graph (create_graph).  Autograd calls it before
 * n's gradient. */
kpl_status kpl_node_restore_saved(kpl_node *n, bool keep_graph);
/* Makes again the saved tensors of n that were not kept
 * (kpl_set_regenerate); keep_graph as above.  Autograd calls it before
 * n's gradient, after kpl_node_restore_saved. */
kpl_status kpl_node_regenerate_saved(kpl_node *n, bool keep_graph);
/* Whether n's saved tensors wait for kpl_node_restore_saved. */
bool kpl_node_saved_dropped(const kpl_node *n);
/* How many regions this thread has recomputed (tests and benches). */
uint64_t kpl_recompute_count(void);

/* Normalised activations made again instead of kept (on by default).
 * The output of a training batch norm (fused with its ReLU or not), of a
 * group norm, and of a ReLU or leaky ReLU applied to one of those, is not kept for the
 * backward by the op that made it nor by the ops that read it (the
 * convolution after it): the norm keeps its input and parameters, and
 * when the first gradient that needs the output runs, the norm's kernel
 * makes it again from them (batch statistics included: the same kernel
 * on the same input gives the same bits), and it stays until the norm's
 * own gradient has run.  One pass of the norm per layer in the backward
 * for one activation fewer per layer through the forward's end (Pleiss
 * et al. 2017's memory-efficient DenseNet, Rota Bulo et al. 2018's
 * in-place activated batch norm).  Exact, also under create_graph (the
 * remade output is linked to its node as a kept one is).  Per thread,
 * read when an op is recorded; off while tracing (a static graph plans
 * its own memory).  Returns the previous setting. */
bool kpl_set_regenerate(bool on);
bool kpl_regenerate_enabled(void);

/* Recomputation under a byte budget (memory.recompute: auto): from here
 * on this thread's regions are not let go when the next one begins;
 * instead, whenever one of this thread's allocations on dev would take
 * its allocated bytes past `bytes`, ended regions are let go one at a time
 * (kpl_device_set_budget's release hook) until it fits, the region of
 * least forward time / (bytes it frees x time since it ended) first
 * (DTR's heuristic over regions).  An allocation that still does not fit
 * fails with KPL_ENOMEM naming the budget, the request and the module.
 * bytes 0 ends it.  While a budget holds, kpl_set_regenerate is off on
 * this thread (its evictions do not count what the backward would make
 * again); bytes 0 puts back the setting from before.  Regions are released on the thread that
 * recorded them. */
kpl_status kpl_recompute_set_budget(kpl_device *dev, size_t bytes);
/* How many regions this thread's budget has let go. */
uint64_t kpl_recompute_evictions(void);
/* While held (autograd holds a node during its gradient), a budget does
 * not let go of the saved tensors of n's region; holds nest. */
void kpl_node_hold_saved(kpl_node *n, bool hold);

#ifdef __cplusplus
}
#endif
#endif /* KPL_GRAPH_H */
