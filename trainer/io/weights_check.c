/*
 * weights_check.c — weights given to a run (model.weights, a feature
 * network, kpl import): a model file refused as a checkpoint, and every
 * floating tensor finite (io_impl.h).
 */
#include "checkpoint.h"
#include "io_impl.h"

#include <jansson.h>
#include <math.h>
#include <string.h>

kpl_status kpl__weights_check(const kpl_checkpoint *c, const char *path)
{
    json_t *meta = json_loads(kpl_checkpoint_meta(c), 0, NULL);
    json_t *fmt = json_object_get(meta, "format");
    bool model_file = json_is_string(fmt) && !strcmp(json_string_value(fmt), "kpl-model");
    json_decref(meta);
    KPL_CHECK(!model_file, KPL_EFORMAT, "%s: a model file (kpl export), not a checkpoint: give "
              "one that kpl train wrote (RUN/checkpoints/*.kpl) or kpl import made", path);
    for (int i = 0; i < kpl_checkpoint_num_tensors(c); i++) {
        kpl_tensor *t = kpl_checkpoint_find(c, kpl_checkpoint_name(c, i));
        int64_t bad = kpl__tensor_nonfinite(t);
        KPL_CHECK(bad < 0, KPL_EFORMAT, "%s: tensor '%s' holds NaN or inf (element %lld of %lld): "
                  "weights must be finite", path, kpl_checkpoint_name(c, i), (long long)bad,
                  (long long)kpl_tensor_numel(t));
    }
    return KPL_OK;
}

int64_t kpl__tensor_nonfinite(kpl_tensor *t)
{
    kpl_dtype dt = kpl_tensor_dtype(t);
    if (dt != KPL_F32 && dt != KPL_F64 && dt != KPL_F16 && dt != KPL_BF16) return -1;
    const void *d = kpl_tensor_host_data(t);
    int64_t n = kpl_tensor_numel(t);
    for (int64_t j = 0; d && j < n; j++) {
        double v = dt == KPL_F32   ? ((const float *)d)[j]
                   : dt == KPL_F64 ? ((const double *)d)[j]
                   : dt == KPL_F16 ? kpl_f16_to_f32(((const uint16_t *)d)[j])
                                   : kpl_bf16_to_f32(((const uint16_t *)d)[j]);
        if (!isfinite(v)) return j;
    }
    return -1;
}
