/*
 * op_info.c — the rows of op_table.h as data: names, arity, saved masks
 * and the rest, for the tape, the executor, tools and tests.
 */
#include "graph_impl.h"

#include <string.h>

/* ---- one column at a time: each maps the row's token to a value ---- */

#define RUN_KIND_UN(k) KPL_OP_RUN_UN
#define RUN_KIND_UNA(k) KPL_OP_RUN_UNA
#define RUN_KIND_BIN(k) KPL_OP_RUN_BIN
#define RUN_KIND_BINS(k) KPL_OP_RUN_BINS
#define RUN_KIND_RED(k) KPL_OP_RUN_RED
#define RUN_KIND_EW(f) KPL_OP_RUN_EW
#define RUN_KIND_FN(f) KPL_OP_RUN_FN
#define RUN_KIND_VIEW(f) KPL_OP_RUN_VIEW
#define RUN_KIND_NONE(f) KPL_OP_RUN_NONE
#define RUN_KIND(kind, k) RUN_KIND_##kind(k)

#define KERNEL_UN(k) KPL_UN_##k
#define KERNEL_UNA(k) KPL_UN_##k
#define KERNEL_BIN(k) KPL_BIN_##k
#define KERNEL_BINS(k) KPL_BIN_##k
#define KERNEL_RED(k) KPL_RED_##k
#define KERNEL_EW(f) -1
#define KERNEL_FN(f) -1
#define KERNEL_VIEW(f) -1
#define KERNEL_NONE(f) -1
#define KERNEL(kind, k) KERNEL_##kind(k)

#define RUN_FN_UN(k) NULL
#define RUN_FN_UNA(k) NULL
#define RUN_FN_BIN(k) NULL
#define RUN_FN_BINS(k) NULL
#define RUN_FN_RED(k) NULL
#define RUN_FN_EW(f) #f
#define RUN_FN_FN(f) #f
#define RUN_FN_VIEW(f) NULL
#define RUN_FN_NONE(f) NULL
#define RUN_FN(kind, k) RUN_FN_##kind(k)

#define ONNX_KIND(kind, x) KPL_ONNX_##kind
#define ONNX_NAME_DIRECT(x) x
#define ONNX_NAME_CODED(x) #x
#define ONNX_NAME_NONE(x) NULL
#define ONNX_NAME(kind, x) ONNX_NAME_##kind(x)

static const kpl_op_info infos[KPL_OP_COUNT] = {
#define KPL_X_(e, s, ar, at, ac, sv, rn, inf, gr, ox)                                             \
    [KPL_OP_##e] = {.name = #s,                                                                   \
                    .in_min = KPL_OP_IN_MIN ar,                                                   \
                    .in_max = KPL_OP_IN_MAX ar,                                                   \
                    .out_min = KPL_OP_OUT_MIN ar,                                                 \
                    .out_max = KPL_OP_OUT_MAX ar,                                                 \
                    .attrs = KPL_ATTRS_##at,                                                      \
                    .autocast = KPL_AUTOCAST_##ac,                                                \
                    .saved_in = KPL_OP_FIRST sv,                                                  \
                    .saved_out = KPL_OP_SECOND sv,                                                \
                    .run = RUN_KIND rn,                                                          \
                    .kernel = KERNEL rn,                                                         \
                    .run_fn = RUN_FN rn,                                                         \
                    .infer = #inf,                                                                \
                    .differentiable = gr,                                                         \
                    .onnx = ONNX_KIND ox,                                                         \
                    .onnx_name = ONNX_NAME ox},
    KPL_OP_LIST(KPL_X_)
#undef KPL_X_
};

const kpl_op_info *kpl_op_info_of(kpl_op op)
{
    return (unsigned)op < KPL_OP_COUNT ? &infos[op] : NULL;
}

const char *kpl_op_name(kpl_op op)
{
    return (unsigned)op < KPL_OP_COUNT ? infos[op].name : "invalid-op";
}

kpl_op kpl_op_from_name(const char *name)
{
    for (int k = 0; name && k < KPL_OP_COUNT; k++)
        if (!strcmp(infos[k].name, name)) return (kpl_op)k;
    return KPL_OP_COUNT;
}
