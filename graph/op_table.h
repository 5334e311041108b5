/*
 * op_table.h — every op of the graph, declared once (included by graph.h).
 *
 * One row per op; each part of kpl that needs to know something of ops
 * expands the columns it reads and keeps no list of its own:
 *
 *   graph.h      the kpl_op enum, the kpl_<name>(x) of each plain unary
 *   tape.c       names, the tensors recording saves for the gradient
 *   autocast.c   the precision class
 *   eager.c      the plain unary ops' functions
 *   exec.c, ir.c how a graph runs the op, its shape inference, its
 *                attributes in a dump
 *   grad_fns.c   the gradient (g_<ENUM>, a compile error when missing)
 *   onnx_export.c (trainer/io) the ONNX form
 *
 * X(ENUM, name, arity, attrs, autocast, saved, run, infer, grad, onnx):
 *
 *   arity     (inputs min, max, outputs min, max)
 *   attrs     which kpl_op_attrs fields the op reads (KPL_ATTRS_*)
 *   autocast  its class under autocast (KPL_AUTOCAST_*, docs/precision.md)
 *   saved     (input mask, output mask): what its gradient reads from the
 *             forward pass (bit i = input i; output 0); all else is freed
 *   run       how a graph runs it (KPL_OP_RUN_*): (UN, k) kpl_k_unary with
 *             KPL_UN_k, its eager function kpl_<name>(x) generated; (UNA, k)
 *             the same with attributes, its function written by hand;
 *             (BIN, k) kpl_k_binary; (BINS, k) kpl_k_binary_scalar; (RED, k)
 *             kpl_k_reduce; (EW, f) an element-wise kpl__op_run_f; (FN, f)
 *             kpl__op_run_f; (VIEW, -) a view the executor's plan makes;
 *             (NONE, -) never in a graph, on purpose
 *   infer     kpl__op_infer_<infer>, its output shapes and dtypes in a graph
 *             (none: not in graphs)
 *   grad      1: differentiable (autograd's g_<ENUM>), 0: no gradient
 *   onnx      (DIRECT, "Type"): one ONNX node of that type on the inputs;
 *             (CODED, f): onnx_export.c's emit_f writes it; (NONE, -): no
 *             ONNX form, on purpose (adjoints, training-only ops)
 *
 * Append only: the enum's values are in files (graph files name ops, but
 * checkpoints of older builds must keep meaning the same).  Adding an op:
 * docs/graph-autograd.md, "Adding an op".
 */
#ifndef KPL_OP_TABLE_H
#define KPL_OP_TABLE_H

/* clang-format off */
#define KPL_OP_LIST(X)                                                                                          \
  X(NEG,               neg,               (1,1,1,1), NONE,   KEEP,    (0,0), (UN,NEG),        same,      1, (DIRECT,"Neg"))     \
  X(ABS,               abs,               (1,1,1,1), NONE,   KEEP,    (1,0), (UN,ABS),        same,      1, (DIRECT,"Abs"))     \
  X(EXP,               exp,               (1,1,1,1), NONE,   F32,     (0,1), (UN,EXP),        same,      1, (DIRECT,"Exp"))     \
  X(LOG,               log,               (1,1,1,1), NONE,   F32,     (1,0), (UN,LOG),        same,      1, (DIRECT,"Log"))     \
  X(SQRT,              sqrt,              (1,1,1,1), NONE,   F32,     (0,1), (UN,SQRT),       same,      1, (DIRECT,"Sqrt"))    \
  X(RSQRT,             rsqrt,             (1,1,1,1), NONE,   F32,     (0,1), (UN,RSQRT),      same,      1, (CODED,rsqrt))      \
  X(SQUARE,            square,            (1,1,1,1), NONE,   F32,     (1,0), (UN,SQUARE),     same,      1, (CODED,square))     \
  X(RECIPROCAL,        reciprocal,        (1,1,1,1), NONE,   F32,     (0,1), (UN,RECIPROCAL), same,      1, (DIRECT,"Reciprocal")) \
  X(SIN,               sin,               (1,1,1,1), NONE,   F32,     (1,0), (UN,SIN),        same,      1, (DIRECT,"Sin"))     \
  X(COS,               cos,               (1,1,1,1), NONE,   F32,     (1,0), (UN,COS),        same,      1, (DIRECT,"Cos"))     \
  X(TANH,              tanh,              (1,1,1,1), NONE,   KEEP,    (0,1), (UN,TANH),       same,      1, (DIRECT,"Tanh"))    \
  X(SIGMOID,           sigmoid,           (1,1,1,1), NONE,   KEEP,    (0,1), (UN,SIGMOID),    same,      1, (DIRECT,"Sigmoid")) \
  X(RELU,              relu,              (1,1,1,1), NONE,   KEEP,    (0,1), (UN,RELU),       same,      1, (DIRECT,"Relu"))    \
  X(LEAKY_RELU,        leaky_relu,        (1,1,1,1), SLOPE,  KEEP,    (0,1), (UNA,LEAKY_RELU),same,      1, (CODED,leaky_relu)) \
  X(GELU,              gelu,              (1,1,1,1), NONE,   F32,     (1,0), (UN,GELU),       same,      1, (CODED,gelu))       \
  X(CLIP,              clip,              (1,1,1,1), BOUNDS, KEEP,    (1,0), (UNA,CLIP),      same,      1, (CODED,clip))       \
  X(SIGN,              sign,              (1,1,1,1), NONE,   KEEP,    (0,0), (UN,SIGN),       same,      1, (DIRECT,"Sign"))    \
  X(GELU_TANH,         gelu_tanh,         (1,1,1,1), NONE,   F32,     (1,0), (UN,GELU_TANH),  same,      1, (NONE,-))           \
  X(ADD,               add,               (2,2,1,1), NONE,   PROMOTE, (0,0), (BIN,ADD),       broadcast, 1, (DIRECT,"Add"))     \
  X(SUB,               sub,               (2,2,1,1), NONE,   PROMOTE, (0,0), (BIN,SUB),       broadcast, 1, (DIRECT,"Sub"))     \
  X(MUL,               mul,               (2,2,1,1), NONE,   PROMOTE, (3,0), (BIN,MUL),       broadcast, 1, (DIRECT,"Mul"))     \
  X(DIV,               div,               (2,2,1,1), NONE,   PROMOTE, (3,0), (BIN,DIV),       broadcast, 1, (DIRECT,"Div"))     \
  X(POW,               pow,               (2,2,1,1), NONE,   F32,     (3,1), (BIN,POW),       broadcast, 1, (DIRECT,"Pow"))     \
  X(MAXIMUM,           maximum,           (2,2,1,1), NONE,   PROMOTE, (3,0), (BIN,MAXIMUM),   broadcast, 1, (DIRECT,"Max"))     \
  X(MINIMUM,           minimum,           (2,2,1,1), NONE,   PROMOTE, (3,0), (BIN,MINIMUM),   broadcast, 1, (DIRECT,"Min"))     \
  X(ADD_SCALAR,        add_scalar,        (1,1,1,1), SCALAR, KEEP,    (0,0), (BINS,ADD),      same,      1, (DIRECT,"Add"))     \
  X(SUB_SCALAR,        sub_scalar,        (1,1,1,1), SCALAR, KEEP,    (0,0), (BINS,SUB),      same,      1, (DIRECT,"Sub"))     \
  X(MUL_SCALAR,        mul_scalar,        (1,1,1,1), SCALAR, KEEP,    (0,0), (BINS,MUL),      same,      1, (DIRECT,"Mul"))     \
  X(DIV_SCALAR,        div_scalar,        (1,1,1,1), SCALAR, KEEP,    (1,0), (BINS,DIV),      same,      1, (DIRECT,"Div"))     \
  X(POW_SCALAR,        pow_scalar,        (1,1,1,1), SCALAR, F32,     (1,1), (BINS,POW),      same,      1, (DIRECT,"Pow"))     \
  X(MAXIMUM_SCALAR,    maximum_scalar,    (1,1,1,1), SCALAR, KEEP,    (1,0), (BINS,MAXIMUM),  same,      1, (DIRECT,"Max"))     \
  X(MINIMUM_SCALAR,    minimum_scalar,    (1,1,1,1), SCALAR, KEEP,    (1,0), (BINS,MINIMUM),  same,      1, (DIRECT,"Min"))     \
  X(WHERE,             where,             (3,3,1,1), NONE,   PROMOTE, (1,0), (FN,where),      where,     1, (DIRECT,"Where"))   \
  X(SUM,               sum,               (1,1,1,1), REDUCE, F32,     (0,0), (RED,SUM),       reduce,    1, (DIRECT,"ReduceSum")) \
  X(MEAN,              mean,              (1,1,1,1), REDUCE, F32,     (0,0), (RED,MEAN),      reduce,    1, (DIRECT,"ReduceMean")) \
  X(MAX,               max,               (1,1,1,1), REDUCE, KEEP,    (1,1), (RED,MAX),       reduce,    1, (DIRECT,"ReduceMax")) \
  X(MIN,               min,               (1,1,1,1), REDUCE, KEEP,    (1,1), (RED,MIN),       reduce,    1, (DIRECT,"ReduceMin")) \
  X(VAR,               var,               (1,1,1,1), REDUCE, F32,     (1,0), (RED,VAR),       reduce,    1, (CODED,var))        \
  X(LOGSUMEXP,         logsumexp,         (1,1,1,1), REDUCE, F32,     (1,1), (RED,LOGSUMEXP), reduce,    1, (DIRECT,"ReduceLogSumExp")) \
  X(MATMUL,            matmul,            (2,2,1,1), MATMUL, LOW,     (3,0), (FN,matmul),     matmul,    1, (CODED,matmul))     \
  X(CAST,              cast,              (1,1,1,1), DTYPE,  KEEP,    (0,0), (FN,cast),       cast,      1, (CODED,cast))       \
  X(RESHAPE,           reshape,           (1,1,1,1), NONE,   KEEP,    (0,0), (VIEW,-),        reshape,   1, (CODED,reshape))    \
  X(PERMUTE,           permute,           (1,1,1,1), PERM,   KEEP,    (0,0), (FN,permute),    permute,   1, (CODED,permute))    \
  X(NARROW,            narrow,            (1,1,1,1), ROWS,   KEEP,    (0,0), (VIEW,-),        narrow,    1, (CODED,narrow))     \
  X(EXPAND,            expand,            (1,1,1,1), NONE,   KEEP,    (0,0), (FN,expand),     expand,    1, (CODED,expand))     \
  X(ERF,               erf,               (1,1,1,1), NONE,   F32,     (1,0), (UN,ERF),        same,      1, (DIRECT,"Erf"))     \
  X(PAD_ROWS,          pad_rows,          (1,1,1,1), ROWS,   KEEP,    (0,0), (FN,pad_rows),   pad_rows,  1, (CODED,pad_rows))   \
  X(CONV2D,            conv2d,            (2,3,1,1), CONV,   LOW,     (3,0), (FN,conv2d),     conv2d,    1, (CODED,conv2d))     \
  X(CONV2D_BWD_DATA,   conv2d_bwd_data,   (2,2,1,1), CONV,   LOW,     (3,0), (FN,conv2d_bwd_data), shape4, 1, (CODED,conv2d_bwd_data)) \
  X(CONV2D_BWD_WEIGHT, conv2d_bwd_weight, (2,2,1,2), CONV,   LOW,     (3,0), (FN,conv2d_bwd_weight), conv2d_bwd_weight, 1, (NONE,-)) \
  X(PLANE_GATHER,      plane_gather,      (2,2,1,1), NONE,   KEEP,    (2,0), (FN,plane_gather), gather,  1, (NONE,-))           \
  X(PLANE_SCATTER,     plane_scatter,     (2,2,1,1), SHAPE4, KEEP,    (2,0), (FN,plane_scatter), shape4, 1, (NONE,-))           \
  X(AVG_POOL2D,        avg_pool2d,        (1,1,1,1), POOL,   KEEP,    (0,0), (FN,avg_pool2d), pool2d,    1, (CODED,pool2d))     \
  X(AVG_POOL2D_BWD,    avg_pool2d_bwd,    (1,1,1,1), POOL,   KEEP,    (0,0), (FN,avg_pool2d_bwd), shape4, 1, (NONE,-))         \
  X(INDEX_SELECT,      index_select,      (2,2,1,1), AXIS,   KEEP,    (2,0), (FN,index_select), index,   1, (CODED,index_select)) \
  X(INDEX_ADD,         index_add,         (2,2,1,1), AXIS,   KEEP,    (2,0), (FN,index_add),  index,     1, (NONE,-))           \
  X(BATCH_NORM,        batch_norm,        (3,3,1,3), EPS,    MIXED,   (3,0), (FN,batch_norm), batch_norm, 1, (NONE,-))          \
  X(SOFTPLUS,          softplus,          (1,1,1,1), NONE,   F32,     (1,0), (UN,SOFTPLUS),   same,      1, (DIRECT,"Softplus")) \
  X(GATHER,            gather,            (2,2,1,1), AXIS,   KEEP,    (2,0), (FN,gather),     gather,    1, (CODED,gather))     \
  X(SCATTER_ADD,       scatter_add,       (3,3,1,1), AXIS,   PROMOTE, (2,0), (FN,scatter_add), same,     1, (NONE,-))           \
  X(ROI_ALIGN,         roi_align,         (2,2,1,1), ROI,    F32,     (2,0), (FN,roi_align),  roi_align, 1, (NONE,-))           \
  X(ROI_ALIGN_BWD,     roi_align_bwd,     (2,2,1,1), ROI,    F32,     (2,0), (FN,roi_align_bwd), out_value, 1, (NONE,-))        \
  X(BATCH_NORM_RELU,   batch_norm_relu,   (3,3,1,3), EPS,    MIXED,   (3,1), (FN,batch_norm_relu), batch_norm, 1, (NONE,-))     \
  X(CONV2D_RELU,       conv2d_relu,       (2,3,1,1), CONV,   LOW,     (3,1), (FN,conv2d_relu), conv2d,   1, (CODED,conv2d))     \
  X(CUSTOM,            custom,            (1,1,1,1), CUSTOM, KEEP,    (0,0), (NONE,-),        none,      1, (NONE,-))           \
  X(COMPARE,           compare,           (2,2,1,1), SUB,    KEEP,    (0,0), (FN,binary),     compare,   0, (CODED,compare))    \
  X(ARGMAX,            argmax,            (1,1,1,1), REDUCE, KEEP,    (0,0), (RED,ARGMAX),    argreduce, 0, (CODED,argreduce))  \
  X(ARGMIN,            argmin,            (1,1,1,1), REDUCE, KEEP,    (0,0), (RED,ARGMIN),    argreduce, 0, (CODED,argreduce))  \
  X(MAX_POOL2D,        max_pool2d,        (1,1,2,2), POOL,   KEEP,    (0,0), (FN,max_pool2d), pool2d,    0, (CODED,pool2d))     \
  X(BINARY,            binary,            (2,2,1,1), SUB,    KEEP,    (0,0), (EW,binary),     broadcast, 0, (NONE,-))           \
  X(BATCH_NORM_BWD,    batch_norm_bwd,    (3,4,3,3), EPS,    KEEP,    (0,0), (FN,batch_norm_bwd), batch_norm, 0, (NONE,-)) \
  X(UPSAMPLE_BILINEAR, upsample_bilinear, (1,1,1,1), RESIZE, KEEP,    (0,0), (FN,upsample_bilinear), resize, 1, (CODED,resize)) \
  X(UPSAMPLE_BILINEAR_BWD, upsample_bilinear_bwd, (1,1,1,1), RESIZE, KEEP, (0,0), (FN,upsample_bilinear_bwd), shape4, 1, (NONE,-)) \
  X(CONCAT,            concat,            (1,3,1,1), AXIS,   PROMOTE, (0,0), (FN,concat),     concat,    1, (CODED,concat))    \
  X(SOFTMAX_XENT,      softmax_xent,      (2,2,1,1), XENT,   F32,     (3,0), (FN,softmax_xent), xent,    1, (NONE,-))           \
  X(SOFTMAX_XENT_BWD,  softmax_xent_bwd,  (3,3,1,1), XENT,   F32,     (7,0), (FN,softmax_xent_bwd), same,   1, (NONE,-)) \
  X(SIGMOID_FOCAL,     sigmoid_focal,     (2,2,1,1), FOCAL,  F32,     (3,0), (FN,sigmoid_focal), same,   1, (NONE,-))           \
  X(SIGMOID_FOCAL_BWD, sigmoid_focal_bwd, (3,3,1,1), FOCAL,  F32,     (7,0), (FN,sigmoid_focal_bwd), same, 1, (NONE,-)) \
  X(GROUP_NORM,        group_norm,        (3,3,1,1), GROUPS, F32,     (3,0), (NONE,-),        none,      1, (NONE,-))           \
  X(GROUP_NORM_BWD,    group_norm_bwd,    (3,3,3,3), GROUPS, KEEP,    (0,0), (NONE,-),        none,      0, (NONE,-))           \
  X(CONV2D_ADD,        conv2d_add,        (3,4,1,1), CONV,   LOW,     (0,0), (FN,conv2d_add), conv2d_add, 0, (CODED,conv2d))    \
  X(CONV2D_ADD_RELU,   conv2d_add_relu,   (3,4,1,1), CONV,   LOW,     (0,0), (FN,conv2d_add), conv2d_add, 0, (CODED,conv2d))
/* clang-format on */

/* Picking one field of a column: KPL_OP_IN_MIN arity, KPL_OP_RUN_KIND run. */
#define KPL_OP_IN_MIN(a, b, c, d) a
#define KPL_OP_IN_MAX(a, b, c, d) b
#define KPL_OP_OUT_MIN(a, b, c, d) c
#define KPL_OP_OUT_MAX(a, b, c, d) d
#define KPL_OP_FIRST(a, b) a
#define KPL_OP_SECOND(a, b) b
/* Pasting after expansion: KPL_OP_CAT(P_, KPL_OP_FIRST run) is P_UN;
 * KPL_OP_PAIR(P_, (UN, NEG)) is P_UN(NEG). */
#define KPL_OP_CAT_(a, b) a##b
#define KPL_OP_CAT(a, b) KPL_OP_CAT_(a, b)
#define KPL_OP_PAIR__(p, a, b) p##a(b)
#define KPL_OP_PAIR_(p, a, b) KPL_OP_PAIR__(p, a, b)
#define KPL_OP_PAIR(p, pair) KPL_OP_PAIR_(p, KPL_OP_FIRST pair, KPL_OP_SECOND pair)

#endif /* KPL_OP_TABLE_H */
