/*
 * export.c — a trained model's inference graph: model 0's forward in eval
 * mode, traced from a placeholder of the input the data gives, optimised,
 * and written as a model file with what inference needs to know.
 */
#include "infer.h"
#include "run_impl.h"

#include <jansson.h>
#include <stdlib.h>
#include <string.h>

static json_t *floats(const float *v, int n)
{
    json_t *a = json_array();
    for (int i = 0; i < n; i++) json_array_append_new(a, json_real(v[i]));
    return a;
}

/* The info object: task, model, input, the validation transform. */
static char *info_json(kpl_trainer *t, const kpl_transform_config *tc, int64_t batch)
{
    const kpl_recipe *r = t->r;
    json_t *o = json_pack("{s:s, s:s, s:s, s:I}", "task", r->task, "model", r->model.name,
                          "recipe", r->name, "classes", (json_int_t)r->model.num_classes);
    json_object_set_new(o, "input",
                        json_pack("{s:s, s:s, s:[I, I, I, I]}", "name", "image", "layout", "NCHW",
                                  "shape", (json_int_t)batch, (json_int_t)t->chw[0],
                                  (json_int_t)t->chw[1], (json_int_t)t->chw[2]));
    /* crop none with no size keeps the stored size: the model's input size */
    int oh = tc->out_h ? tc->out_h : (int)t->chw[1], ow = tc->out_w ? tc->out_w : (int)t->chw[2];
    json_object_set_new(
        o, "transform",
        json_pack("{s:s, s:i, s:i, s:i, s:i, s:s, s:o, s:o}", "crop", kpl_crop_mode_name(tc->crop),
                  "out_h", oh, "out_w", ow, "resize_shorter", tc->resize_shorter, "channels",
                  tc->channels, "out_dtype", kpl_dtype_name(tc->out_dtype), "mean",
                  floats(tc->mean, tc->channels), "std", floats(tc->std, tc->channels)));
    char *s = json_dumps(o, JSON_COMPACT | JSON_PRESERVE_ORDER | JSON_REAL_PRECISION(9));
    json_decref(o);
    return s;
}

kpl_status kpl_task_export_check(const kpl_task_kind *task)
{
    KPL_CHECK(task, KPL_EINVAL, "export: no task");
    KPL_CHECK(task->export_output && task->export_output[0], KPL_EINVAL,
              "task '%s' has no inference graph (its export_output is not set: the graph is "
              "model 0's forward on an image batch; a detector's boxes and a GAN's sampling are "
              "not)",
              task->name ? task->name : "?");
    return KPL_OK;
}

kpl_status kpl_trainer_export(kpl_trainer *t, int64_t batch, int level, bool fuse,
                              const char *path, kpl_ir **out_ir)
{
    KPL_CHECK(t, KPL_EINVAL, "kpl_trainer_export: NULL trainer");
    if (out_ir) *out_ir = NULL;
    const kpl_recipe *r = t->r;
    KPL_TRY(kpl_task_export_check(t->task));
    KPL_CHECK(level >= 0 && level <= 3, KPL_EINVAL, "export level %d is not in [0, 3]", level);
    const char *oname = t->task->export_output;
    KPL_CHECK(batch >= 1 && batch <= 65536, KPL_EINVAL, "export batch %lld is not in [1, 65536]",
              (long long)batch);
    kpl_module *m = kpl_trainer_model(t, 0);
    kpl_module_set_training(m, false);
    kpl_loader_config lc;
    kpl__data_loader_config(r, &r->data.val, t->val_path, false, 0, 1, &lc);
    if (t->task->data) t->task->data(r, false, &lc);
    const kpl_transform_config *tc = &lc.transform;
    KPL_CHECK(tc->crop != KPL_CROP_KEEP_RATIO && tc->crop != KPL_CROP_SCALE_CROP, KPL_EINVAL,
              "the validation transform (crop %s) gives each image its own size; a "
              "graph has one input shape (use crop none or center)",
              kpl_crop_mode_name(tc->crop));
    kpl_dtype in_dt = tc->out_dtype;
    int64_t shape[4] = {batch, t->chw[0], t->chw[1], t->chw[2]};
    kpl_pool *pool = kpl_pool_push();
    KPL_CHECK(pool, KPL_ENOMEM, "export: no host memory");
    bool prev = kpl_set_grad_enabled(false);
    /* one forward: the library's kernels, untimed (a timed search of every
     * convolution would cost more than the trace) */
    bool det = kpl_get_deterministic();
    kpl_set_deterministic(true);
    kpl_ir *ir = NULL;
    kpl_status st = KPL_OK;
    kpl_tensor *x = kpl_full(t->dev, in_dt, 4, shape, 0);
    if (!x || (st = kpl_trace_begin()) < 0) {
        st = x ? st : kpl_last_status();
    } else {
        /* the forward's first output (an autoencoder's reconstruction,
         * not its code) */
        kpl_tensor_list in = {1, {kpl_trace_input(x, "image")}}, out = {0};
        if ((st = kpl_module_forward_list(m, &in, &out)) < 0 || out.n < 1) {
            st = st < 0 ? st : KPL_ERROR(KPL_EINVAL, "the forward gave no output");
            kpl_trace_abort();
        } else {
            st = kpl_trace_end(1, &out.t[0], &oname, &ir);
        }
    }
    kpl_set_grad_enabled(prev);
    kpl_set_deterministic(det);
    kpl_pool_pop(pool);
    if (st < 0) return kpl_error_prefix(st, "model %s: ", r->model.name);
    int np = kpl_module_num_params(m), nb = kpl_module_num_buffers(m);
    const char **names = malloc((size_t)(np + nb + 1) * sizeof *names);
    kpl_tensor **ts = malloc((size_t)(np + nb + 1) * sizeof *ts);
    if (!names || !ts) st = KPL_ERROR(KPL_ENOMEM, "export: no host memory");
    for (int i = 0; st == KPL_OK && i < np; i++) {
        names[i] = kpl_module_param_name(m, i);
        ts[i] = kpl_module_params(m)[i];
    }
    for (int i = 0; st == KPL_OK && i < nb; i++) {
        names[np + i] = kpl_module_buffer_name(m, i);
        ts[np + i] = kpl_module_buffers(m)[i];
    }
    if (st == KPL_OK) kpl_ir_name_params(ir, np + nb, names, ts);
    free(names);
    free(ts);
    if (st == KPL_OK) st = kpl_ir_optimize(ir, level, fuse);
    char *info = st == KPL_OK ? info_json(t, tc, batch) : NULL;
    if (st == KPL_OK && !info) st = KPL_ERROR(KPL_ENOMEM, "export: no host memory");
    if (st == KPL_OK && path) st = kpl_model_save(ir, info, path);
    free(info);
    if (st == KPL_OK && out_ir) {
        *out_ir = ir;
        return KPL_OK;
    }
    kpl_ir_destroy(ir);
    return st;
}
