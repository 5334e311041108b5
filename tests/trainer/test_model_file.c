/* test_model_file.c — model files (trainer/io/model_file.c): a traced graph
 * using many ops and every kind of attribute saved, loaded and run again
 * gives the same numbers; what the loader refuses; the ONNX writer's
 * refusals. */
#include "kpl_test.h"
#include "trainer.h"

#include <jansson.h>
#include <unistd.h>

static char dir[] = "/tmp/kpl-test-model-XXXXXX";

static kpl_tensor *randn(int nd, const int64_t *shape, uint64_t seed)
{
    kpl_rng *r = kpl_rng_create(seed);
    kpl_tensor *t = NULL;
    OK(kpl_tensor_empty(kpl_device_cpu(), KPL_F32, nd, shape, &t));
    OK(kpl_k_normal(t, r, 0, 1));
    kpl_rng_destroy(r);
    return t;
}

/* x (2, 3, 6, 6): a little of everything the serialiser must carry. */
static kpl_tensor *many_ops(kpl_tensor *x, kpl_tensor *w, kpl_tensor *fw, kpl_tensor *out2[2])
{
    kpl_conv2d_params cp = {{2, 1}, {1, 0}, {1, 1}, 1};
    kpl_tensor *h = kpl_conv2d(x, w, NULL, &cp); /* (2, 4, 3, 4) */
    h = kpl_leaky_relu(h, 0.1);
    h = kpl_clip(h, -1.5, 2.5);
    kpl_pool2d_params ap = {{2, 2}, {1, 2}, {1, 1}, true, true};
    h = kpl_avg_pool2d(h, &ap);
    h = kpl_scalar_op(KPL_BIN_SUB, h, 0.25, true); /* 0.25 - h */
    h = kpl_scalar_op(KPL_BIN_POW, kpl_abs(h), 1.5, false);
    int perm[4] = {0, 2, 3, 1};
    h = kpl_permute(h, perm);
    int64_t s2[2] = {2, -1};
    h = kpl_reshape(h, 2, s2);
    h = kpl_narrow(h, 1, 1);
    int ax = 1;
    kpl_tensor *v = kpl_var(h, &ax, 1, true, 1);
    kpl_tensor *m = kpl_mean(h, &ax, 1, true);
    kpl_tensor *z = kpl_div(kpl_sub(h, m), kpl_sqrt(kpl_scalar_op(KPL_BIN_ADD, v, 1e-3, false)));
    kpl_tensor *y = kpl_matmul(z, fw, false, true); /* (1, 5) */
    kpl_tensor *pos = kpl_compare(KPL_BIN_GT, y, kpl_full(kpl_device_cpu(), KPL_F32, 0, NULL, 0));
    y = kpl_where(pos, y, kpl_scalar_op(KPL_BIN_MUL, y, 0.5, false));
    out2[0] = y;
    out2[1] = kpl_argmax(y, 1, false);
    return y;
}

static void test_roundtrip(void **state)
{
    (void)state;
    kpl_pool *pool = kpl_pool_push();
    kpl_tensor *x = kpl_autorelease(randn(4, (int64_t[]){2, 3, 6, 6}, 1));
    kpl_tensor *w = randn(4, (int64_t[]){4, 3, 3, 3}, 2);
    kpl_tensor *outs[2];
    bool prev = kpl_set_grad_enabled(false);
    /* the linear layer's width: what pooling leaves of one image */
    int64_t fws[2] = {5, 0};
    kpl_conv2d_params cp = {{2, 1}, {1, 0}, {1, 1}, 1};
    kpl_pool2d_params ap = {{2, 2}, {1, 2}, {1, 1}, true, true};
    kpl_tensor *probe = NN(kpl_avg_pool2d(kpl_conv2d(x, w, NULL, &cp), &ap));
    fws[1] = kpl_tensor_numel(probe) / 2;
    kpl_tensor *fw = randn(2, fws, 3);
    OK(kpl_trace_begin());
    kpl_tensor *y = NN(many_ops(kpl_trace_input(x, "x"), w, fw, outs));
    (void)y;
    kpl_ir *ir = NULL;
    OK(kpl_trace_end(2, outs, (const char *[]){"scores", "best"}, &ir));
    assert_int_equal(kpl_ir_name_params(ir, 2, (const char *[]){"conv.w", "fc.w"},
                                        (kpl_tensor *[]){w, fw}),
                     2);
    OK(kpl_ir_optimize(ir, 3, false));
    char path[256];
    snprintf(path, sizeof path, "%s/m.kplm", dir);
    OK(kpl_model_save(ir, "{\"task\":\"test\"}", path));
    assert_int_equal(access(path, F_OK), 0);
    snprintf(path + strlen(path), 8, ".done");
    assert_int_not_equal(access(path, F_OK), 0); /* no marker: not a run's checkpoint */
    path[strlen(path) - 5] = 0;
    kpl_model *m = NULL;
    OK(kpl_model_load(path, -1, &m));
    assert_null(kpl_model_output(m, 0)); /* not run yet */
    assert_int_equal(kpl_last_status(), KPL_ESTATE);
    assert_int_equal(kpl_model_version(m), KPL_MODEL_VERSION);
    assert_int_equal(kpl_model_num_outputs(m), 2);
    assert_string_equal(kpl_model_output_name(m, 1), "best");
    assert_string_equal(kpl_model_input_name(m, 0), "x");
    assert_non_null(strstr(kpl_model_info(m), "\"task\":\"test\""));
    kpl_transform_config tc;
    FAILS(kpl_model_transform(m, &tc), KPL_ENOTFOUND, "names no input transform");
    kpl_tensor *x2 = kpl_autorelease(randn(4, (int64_t[]){2, 3, 6, 6}, 9));
    OK(kpl_model_set_input(m, 0, x2));
    OK(kpl_model_run(m));
    kpl_tensor *want[2];
    many_ops(x2, w, fw, want);
    for (int o = 0; o < 2; o++) {
        kpl_tensor *got = NN(kpl_model_output(m, o));
        assert_int_equal(kpl_tensor_numel(got), kpl_tensor_numel(want[o]));
        for (int64_t i = 0; i < kpl_tensor_numel(got); i++)
            assert_true(tget(got, i) == tget(want[o], i)); /* the same kernels: the same bits */
    }
    /* every level of the loaded graph */
    for (int lv = 0; lv < 3; lv++) {
        kpl_model *m2 = NULL;
        OK(kpl_model_load(path, lv, &m2));
        OK(kpl_model_set_input(m2, 0, x2));
        OK(kpl_model_run(m2));
        for (int64_t i = 0; i < kpl_tensor_numel(want[0]); i++)
            assert_true(tget(kpl_model_output(m2, 0), i) == tget(want[0], i));
        kpl_model_destroy(m2);
    }
    kpl_model_destroy(m);
    /* ONNX: this graph has every op a form; a pooling adjoint has none */
    snprintf(path, sizeof path, "%s/m.onnx", dir);
    OK(kpl_onnx_export(ir, path));
    kpl_ir_destroy(ir);
    OK(kpl_trace_begin());
    kpl_tensor *in = NN(kpl_trace_input(x, "x"));
    kpl_tensor *adj = NN(kpl_avg_pool2d_bwd(in, (int64_t[]){2, 3, 12, 12},
                                            &(kpl_pool2d_params){{2, 2}, {2, 2}, {0, 0}, false, false}));
    OK(kpl_trace_end(1, &adj, NULL, &ir));
    FAILS(kpl_onnx_export(ir, path), KPL_EINVAL, "op 'avg_pool2d_bwd' has no ONNX form");
    kpl_ir_destroy(ir);
    /* group norm (eagerly batch norm's training op on a view) traces as
     * ops ONNX has, and the graph gives eager's values */
    int64_t c3 = 3;
    kpl_tensor *gg = NN(kpl_full(kpl_device_cpu(), KPL_F32, 1, &c3, 1.5));
    kpl_tensor *gb = NN(kpl_full(kpl_device_cpu(), KPL_F32, 1, &c3, -0.25));
    kpl_tensor *geager = NN(kpl_group_norm(x, 3, gg, gb, 1e-5));
    OK(kpl_trace_begin());
    in = NN(kpl_trace_input(x, "x"));
    kpl_tensor *gn = NN(kpl_group_norm(in, 3, gg, gb, 1e-5));
    OK(kpl_trace_end(1, &gn, NULL, &ir));
    OK(kpl_onnx_export(ir, path));
    kpl_exec *ex = NULL;
    OK(kpl_exec_create(ir, &ex));
    OK(kpl_exec_set_input(ex, 0, x));
    OK(kpl_exec_run(ex));
    for (int64_t i = 0; i < kpl_tensor_numel(geager); i++)
        assert_close(tget(kpl_exec_output(ex, 0), i), tget(geager, i), 1e-5, 1e-5, "group norm", i);
    kpl_exec_destroy(ex);
    kpl_ir_destroy(ir);
    kpl_set_grad_enabled(prev);
    kpl_tensor_release(w);
    kpl_tensor_release(fw);
    kpl_pool_pop(pool);
}

/* A model file whose JSON was edited: each edit refused, naming it. */
static void write_meta(const char *path, const char *meta, kpl_tensor *t)
{
    kpl_checkpoint *c = NULL;
    OK(kpl_checkpoint_create(&c));
    if (t) OK(kpl_checkpoint_add(c, "param.w", t));
    OK(kpl_checkpoint_set_meta(c, meta));
    OK(kpl_checkpoint_save(c, path));
    kpl_checkpoint_destroy(c);
}

static void test_refusals(void **state)
{
    (void)state;
    char path[256];
    snprintf(path, sizeof path, "%s/bad.kplm", dir);
    kpl_tensor *w = randn(2, (int64_t[]){3, 4}, 5);
    kpl_model *m = NULL;
    const char *good =
        "{\"format\":\"kpl-model\",\"version\":1,\"info\":{},\"graph\":{\"level\":3,"
        "\"values\":[{\"kind\":\"input\",\"dtype\":\"f32\",\"shape\":[2,4],\"name\":\"x\"},"
        "{\"kind\":\"param\",\"dtype\":\"f32\",\"shape\":[3,4],\"name\":\"w\",\"tensor\":\"param.w\"},"
        "{\"kind\":\"op\",\"dtype\":\"f32\",\"shape\":[2,3]}],"
        "\"nodes\":[{\"op\":\"matmul\",\"in\":[0,1],\"out\":[2],\"attrs\":{\"trans_b\":true}}],"
        "\"inputs\":[0],\"outputs\":[{\"value\":2,\"name\":\"y\"}]}}";
    write_meta(path, good, w);
    OK(kpl_model_load(path, -1, &m));
    kpl_model_destroy(m);
    struct {
        const char *from, *to, *needle;
    } edits[] = {
        {"\"version\":1", "\"version\":2", "model format version 2; this kpl reads up to 1"},
        {"kpl-model", "kpl-other", "not a model file"},
        {"\"op\":\"matmul\"", "\"op\":\"matmul9\"", "node 0: unknown op 'matmul9'"},
        {"\"trans_b\":true", "\"trans_c\":true", "unknown attribute 'trans_c'"},
        {"\"trans_b\":true", "\"trans_b\":3", "attribute 'trans_b' is not true or false"},
        {"\"shape\":[2,3]", "\"shape\":[2,4]", "makes f32 (2,3) for output 0, the graph says %2 is f32 (2,4)"},
        {"\"shape\":[3,4],\"name\":\"w\"", "\"shape\":[4,3],\"name\":\"w\"", "tensor 'param.w' is f32 (3,4), the graph says f32 (4,3)"},
        {"param.w\"}", "param.v\"}", "tensor 'param.v' is not in the file"},
        {"\"in\":[0,1]", "\"in\":[0,7]", "attribute 'in'[1] is not an integer in [-1, 2]"},
        {"\"in\":[0,1]", "\"in\":[2,1]", "reads %2 before it is written"},
        {"\"value\":2", "\"value\":5", "output 0 is not {value, name}"},
        {"\"dtype\":\"f32\",\"shape\":[2,4]", "\"dtype\":\"f33\",\"shape\":[2,4]", "value 0 has dtype 'f33'"},
        {"\"level\":3", "\"level\":4", "graph level 4 is not 0..3"},
    };
    for (size_t i = 0; i < sizeof edits / sizeof *edits; i++) {
        char meta[2048];
        const char *at = strstr(good, edits[i].from);
        assert_non_null(at);
        snprintf(meta, sizeof meta, "%.*s%s%s", (int)(at - good), good, edits[i].to,
                 at + strlen(edits[i].from));
        write_meta(path, meta, w);
        kpl_clear_error();
        kpl_status st = kpl_model_load(path, -1, &m);
        if (st != KPL_EFORMAT || !strstr(kpl_last_error(), edits[i].needle) ||
            !strstr(kpl_last_error(), path))
            fail_msg("edit %zu (%s): %s: %s", i, edits[i].to, kpl_status_str(st), kpl_last_error());
        assert_null(m);
    }
    kpl_tensor_release(w);
}

/* An ONNX file's initializers under state-dict names (kpl's own export of
 * a ResNet's eval graph without fusions, named by its state dict) come
 * back into another ResNet (other seed) bit for bit, every tensor set; exclusions and a prefix apply; a truncated file, another
 * kind of file and a missing one are errors naming it. */
static void test_onnx_import(void **state)
{
    (void)state;
    kpl_pool *pool = kpl_pool_push();
    kpl_model_config mc;
    OK(kpl_zoo_preset("resnet18_cifar", 10, &mc));
    kpl_module *a = NULL, *b = NULL;
    OK(kpl_zoo_create(&mc, kpl_device_cpu(), 1, &a));
    OK(kpl_zoo_create(&mc, kpl_device_cpu(), 2, &b));
    kpl_module_set_training(a, false);
    bool prev = kpl_set_grad_enabled(false);
    kpl_tensor *x = NN(kpl_full(kpl_device_cpu(), KPL_F32, 4, (int64_t[]){1, 3, 32, 32}, 0.5));
    OK(kpl_trace_begin());
    kpl_tensor *y = NN(kpl_module_forward(a, kpl_trace_input(x, "image")));
    kpl_ir *ir = NULL;
    OK(kpl_trace_end(1, &y, NULL, &ir));
    kpl_set_grad_enabled(prev);
    int np = kpl_module_num_params(a), nb = kpl_module_num_buffers(a), n = 0;
    const char *names[256];
    kpl_tensor *ts[256];
    for (int i = 0; i < np; i++, n++) names[n] = kpl_module_param_name(a, i), ts[n] = kpl_module_params(a)[i];
    for (int i = 0; i < nb; i++, n++) names[n] = kpl_module_buffer_name(a, i), ts[n] = kpl_module_buffers(a)[i];
    assert_int_equal(kpl_ir_name_params(ir, n, names, ts), n);
    OK(kpl_ir_optimize(ir, 0, false));
    char path[256];
    snprintf(path, sizeof path, "%s/r18.onnx", dir);
    OK(kpl_onnx_export(ir, path));
    kpl_ir_destroy(ir);

    kpl_checkpoint *c = NULL;
    OK(kpl_onnx_import(path, "model.", 0, NULL, &c));
    assert_true(kpl_checkpoint_num_tensors(c) > n); /* and the graph's constants (_c*) */
    kpl_state_report rep;
    OK(kpl_module_state_load(b, c, "model.", false, &rep));
    assert_int_equal(rep.nloaded, n);
    assert_int_equal(rep.nmissing, 0);
    kpl_state_report_clear(&rep);
    for (int i = 0; i < n; i++) {
        kpl_tensor *t = i < np ? kpl_module_params(b)[i] : kpl_module_buffers(b)[i - np];
        if (memcmp(kpl_tensor_host_data(t), kpl_tensor_host_data(ts[i]), kpl_tensor_nbytes(t)))
            fail_msg("%s differs after the import", names[i]);
    }
    kpl_checkpoint_destroy(c);
    /* exclusions, no prefix */
    OK(kpl_onnx_import(path, NULL, 2, (const char *[]){"fc.*", "layer4.*"}, &c));
    assert_non_null(kpl_checkpoint_find(c, "conv1.weight"));
    assert_null(kpl_checkpoint_find(c, "fc.weight"));
    assert_null(kpl_checkpoint_find(c, "layer4.0.conv1.weight"));
    kpl_checkpoint_destroy(c);
    FAILS(kpl_onnx_import(path, NULL, 1, (const char *[]){"*"}, &c), KPL_ENOTFOUND, "left no initializer");
    assert_null(c);

    /* broken files */
    FILE *f = fopen(path, "rb");
    assert_non_null(f);
    fseek(f, 0, SEEK_END);
    long len = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *bytes = malloc((size_t)len);
    assert_int_equal(fread(bytes, 1, (size_t)len, f), (size_t)len);
    fclose(f);
    char bad[256];
    snprintf(bad, sizeof bad, "%s/cut.onnx", dir);
    for (long cut = len / 2; cut > 0; cut = cut * 2 / 3) { /* cut inside a tensor's bytes */
        f = fopen(bad, "wb");
        fwrite(bytes, 1, (size_t)cut, f);
        fclose(f);
        /* the weights are inside the graph, a length-prefixed field: cut
         * in it, the file does not parse; cut before it, it has none */
        kpl_status st = kpl_onnx_import(bad, NULL, 0, NULL, &c);
        bool named = strstr(kpl_last_error(), bad) != NULL;
        if (!named || !(st == KPL_EFORMAT || (st == KPL_ENOTFOUND && strstr(kpl_last_error(), "no initializers"))))
            fail_msg("cut at %ld: %s: %s", cut, kpl_status_str(st), kpl_last_error());
        assert_null(c);
        if (cut < 8) break;
    }
    free(bytes);
    snprintf(bad, sizeof bad, "%s/text.onnx", dir);
    f = fopen(bad, "w");
    fputs("name: not a protobuf at all\n", f);
    fclose(f);
    FAILS(kpl_onnx_import(bad, NULL, 0, NULL, &c), KPL_EFORMAT, "not an ONNX model");
    snprintf(bad, sizeof bad, "%s/none.onnx", dir);
    FAILS(kpl_onnx_import(bad, NULL, 0, NULL, &c), KPL_ENOTFOUND, "none.onnx");
    kpl_module_destroy(a);
    kpl_module_destroy(b);
    kpl_pool_pop(pool);
}

int main(void)
{
    if (!mkdtemp(dir)) return 1;
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_roundtrip),
        cmocka_unit_test(test_refusals),
        cmocka_unit_test(test_onnx_import),
    };
    int rc = cmocka_run_group_tests(tests, NULL, NULL);
    char cmd[300];
    snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
    if (system(cmd) != 0) rc = rc ? rc : 1;
    return rc;
}
