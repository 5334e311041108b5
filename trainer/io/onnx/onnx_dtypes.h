/* onnx_dtypes.h — kpl's dtypes and ONNX's TensorProto.DataType codes, for
 * the ONNX writer and reader (private to trainer/io). */
#ifndef KPL_ONNX_DTYPES_H
#define KPL_ONNX_DTYPES_H

#include "kpl_onnx.pb-c.h"
#include "kernels.h"

static const struct {
    kpl_dtype kpl;
    int onnx;
} kpl_onnx_dtypes[] = {
    {KPL_F32, ONNX__TENSOR_PROTO__DATA_TYPE__FLOAT},
    {KPL_F64, ONNX__TENSOR_PROTO__DATA_TYPE__DOUBLE},
    {KPL_F16, ONNX__TENSOR_PROTO__DATA_TYPE__FLOAT16},
    {KPL_BF16, ONNX__TENSOR_PROTO__DATA_TYPE__BFLOAT16},
    {KPL_I32, ONNX__TENSOR_PROTO__DATA_TYPE__INT32},
    {KPL_I64, ONNX__TENSOR_PROTO__DATA_TYPE__INT64},
    {KPL_U8, ONNX__TENSOR_PROTO__DATA_TYPE__UINT8},
    {KPL_BOOL, ONNX__TENSOR_PROTO__DATA_TYPE__BOOL},
};

/* ONNX's code for dt, 0 (UNDEFINED) when it has none. */
static inline int kpl_onnx_dtype(kpl_dtype dt)
{
    for (size_t i = 0; i < sizeof kpl_onnx_dtypes / sizeof *kpl_onnx_dtypes; i++)
        if (kpl_onnx_dtypes[i].kpl == dt) return kpl_onnx_dtypes[i].onnx;
    return 0;
}

/* kpl's dtype for ONNX's code: false when kpl has none. */
static inline bool kpl_onnx_to_dtype(int code, kpl_dtype *dt)
{
    for (size_t i = 0; i < sizeof kpl_onnx_dtypes / sizeof *kpl_onnx_dtypes; i++)
        if (kpl_onnx_dtypes[i].onnx == code) {
            *dt = kpl_onnx_dtypes[i].kpl;
            return true;
        }
    return false;
}

#endif
