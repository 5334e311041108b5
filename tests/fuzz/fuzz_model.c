/*
 * fuzz_model.c — kpl_model_load (trainer/io/model_file.c,
 * docs/model-format.md) of a file made from the input, then what kpl infer
 * does with a model that loaded: its inputs, outputs, transform and graph
 * dump, and, when its buffers are small, a run on zeros.
 *
 * Input: one mode byte, then
 *   mode even: the model file itself (a checkpoint container);
 *   mode odd:  the decompressed payload (table length, JSON with the graph,
 *              tensor bytes), wrapped by the harness in a valid container
 *              so that mutations reach the graph parser.
 * The mode byte's bits 1-2 pick the level the graph is planned at.  Seeds
 * (corpus/model) are model files written by kpl_model_save, both modes.
 */
#include "fuzz_common.h"
#include "fuzz_ckpt.h"

#include "trainer.h"

#define RUN_MAX ((size_t)16 << 20) /* bytes of op values a run may take */

static void use(kpl_model *m)
{
    const kpl_ir *ir = kpl_model_graph(m);
    FILE *f = fopen("/dev/null", "w");
    if (f) {
        kpl_ir_dump(ir, f, false);
        kpl_ir_dump(ir, f, true);
        fclose(f);
    }
    kpl_transform_config tc;
    (void)kpl_model_transform(m, &tc);
    const char *info = kpl_model_info(m);
    fuzz_touch(info, strlen(info));
    size_t bytes = 0;
    for (int v = 0; v < kpl_ir_num_values(ir); v++) {
        int64_t shape[KPL_MAX_DIMS], n = 1;
        int nd = kpl_ir_value_shape(ir, v, shape);
        for (int d = 0; d < nd; d++) n = shape[d] && n > INT64_MAX / shape[d] ? INT64_MAX : n * shape[d];
        size_t b = (size_t)n * kpl_dtype_size(kpl_ir_value_dtype(ir, v));
        bytes = n > (int64_t)RUN_MAX || bytes + b > RUN_MAX ? RUN_MAX + 1 : bytes + b;
    }
    if (bytes > RUN_MAX) return;
    for (int i = 0; i < kpl_model_num_inputs(m); i++) {
        int64_t shape[KPL_MAX_DIMS];
        int nd = kpl_model_input_shape(m, i, shape);
        kpl_tensor *x = NULL;
        if (kpl_tensor_zeros(kpl_device_cpu(), kpl_model_input_dtype(m, i), nd, shape, &x) != KPL_OK)
            return;
        kpl_status st = kpl_model_set_input(m, i, x);
        kpl_tensor_release(x);
        if (fuzz_st(st, "set_input") != KPL_OK) return;
    }
    if (fuzz_st(kpl_model_run(m), "run") != KPL_OK) return;
    for (int i = 0; i < kpl_model_num_outputs(m); i++) {
        kpl_tensor *y = kpl_model_output(m, i);
        const void *p = y ? kpl_tensor_host_data(y) : NULL;
        if (!p) abort(); /* a run that succeeded has its outputs */
        fuzz_touch(p, kpl_tensor_nbytes(y));
    }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 1) return 0;
    fuzz_reset();
    char path[PATH_MAX];
    fuzz_path(path, fuzz_dir("model"), "m.kplm");
    uint8_t *wrapped = NULL;
    size_t n = size - 1;
    const uint8_t *file = data + 1;
    if (data[0] & 1) {
        wrapped = fuzz_ckpt_wrap(data + 1, size - 1, &n);
        file = wrapped;
    }
    fuzz_write(path, file, n);
    kpl_model *m = NULL;
    int level = (data[0] >> 1) & 3;
    if (fuzz_st(kpl_model_load(path, level, &m), "load") == KPL_OK) {
        use(m);
        kpl_model_destroy(m);
    }
    unlink(path);
    free(wrapped);
    return 0;
}
