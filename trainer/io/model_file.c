/*
 * model_file.c — the model file (docs/model-format.md): GraphIR as JSON
 * and its tensors in a checkpoint container, and the inference API over it.
 *
 * The container brings its own checks (CRC32C of the header and of the
 * compressed payload, sizes against the file, the tensor table); this
 * file checks the graph: every field's type and range, value references,
 * tensors present with the value's dtype and shape, op names it knows,
 * then shape inference over the whole graph (kpl_ir_check).
 */
#include "infer.h"
#include "io_impl.h"

#include <jansson.h>
#include <stdlib.h>
#include <string.h>

#define MODEL_FORMAT "kpl-model"

struct kpl_model {
    kpl_ir *ir;
    kpl_exec *ex; /* made at the first set_input or run */
    bool ran;
    char *info;   /* JSON object text */
    int version;
};

/* ---- attributes ---- */

static json_t *int_array(const int *v, int n)
{
    json_t *a = json_array();
    for (int i = 0; i < n; i++) json_array_append_new(a, json_integer(v[i]));
    return a;
}

static json_t *attrs_json(const kpl_op_attrs *a)
{
    json_t *o = json_object();
    if (a->alpha != 0) json_object_set_new(o, "alpha", json_real(a->alpha));
    if (a->beta != 0) json_object_set_new(o, "beta", json_real(a->beta));
    if (a->scalar != 0) json_object_set_new(o, "scalar", json_real(a->scalar));
    if (a->scalar_first) json_object_set_new(o, "scalar_first", json_true());
    if (a->naxes) json_object_set_new(o, "axes", int_array(a->axes, a->naxes));
    if (a->keepdim) json_object_set_new(o, "keepdim", json_true());
    if (a->correction) json_object_set_new(o, "correction", json_integer(a->correction));
    if (a->trans_a) json_object_set_new(o, "trans_a", json_true());
    if (a->trans_b) json_object_set_new(o, "trans_b", json_true());
    if (a->start) json_object_set_new(o, "start", json_integer(a->start));
    if (a->length) json_object_set_new(o, "length", json_integer(a->length));
    if (a->dtype) json_object_set_new(o, "dtype", json_string(kpl_dtype_name(a->dtype)));
    const kpl_conv2d_params *c = &a->conv;
    if (c->groups) {
        int v[7] = {c->stride[0], c->stride[1], c->padding[0], c->padding[1], c->dilation[0],
                    c->dilation[1], c->groups};
        json_object_set_new(o, "conv", int_array(v, 7));
    }
    if (a->shape4[0] || a->shape4[1] || a->shape4[2] || a->shape4[3]) {
        json_t *s = json_array();
        for (int i = 0; i < 4; i++) json_array_append_new(s, json_integer(a->shape4[i]));
        json_object_set_new(o, "shape4", s);
    }
    const kpl_pool2d_params *p = &a->pool;
    if (p->kernel[0] || p->kernel[1]) {
        int v[8] = {p->kernel[0], p->kernel[1], p->stride[0], p->stride[1], p->padding[0],
                    p->padding[1], p->count_include_pad, p->ceil_mode};
        json_object_set_new(o, "pool", int_array(v, 8));
    }
    const kpl_roi_align_params *r = &a->roi;
    if (r->out_h || r->out_w)
        json_object_set_new(o, "roi", json_pack("{s:I, s:I, s:f, s:i, s:b}", "out_h",
                                                (json_int_t)r->out_h, "out_w", (json_int_t)r->out_w,
                                                "spatial_scale", r->spatial_scale, "sampling_ratio",
                                                r->sampling_ratio, "aligned", r->aligned));
    if (a->sub) json_object_set_new(o, "sub", json_string(kpl_binary_name((kpl_binary_op)a->sub)));
    if (a->align_corners) json_object_set_new(o, "align_corners", json_true());
    return o;
}

/* Reading: every error names the file and the node. */
typedef struct {
    const char *path;
    int node;
} where;

#define BAD(w, ...) kpl_error_prefix(KPL_ERROR(KPL_EFORMAT, __VA_ARGS__), "%s: node %d: ", (w)->path, (w)->node)

static kpl_status get_ints(const where *w, json_t *o, const char *key, int *v, int n, int lo,
                           int hi)
{
    json_t *a = json_object_get(o, key);
    if (!json_is_array(a) || (int)json_array_size(a) != n)
        return BAD(w, "attribute '%s' must be a list of %d integers", key, n);
    for (int i = 0; i < n; i++) {
        json_t *x = json_array_get(a, (size_t)i);
        if (!json_is_integer(x) || json_integer_value(x) < lo || json_integer_value(x) > hi)
            return BAD(w, "attribute '%s'[%d] is not an integer in [%d, %d]", key, i, lo, hi);
        v[i] = (int)json_integer_value(x);
    }
    return KPL_OK;
}

static kpl_status attrs_parse(const where *w, json_t *o, kpl_op_attrs *a)
{
    memset(a, 0, sizeof *a);
    if (!o) return KPL_OK;
    if (!json_is_object(o)) return BAD(w, "attrs is not an object");
    const char *key;
    json_t *x;
    json_object_foreach(o, key, x) {
        if (!strcmp(key, "alpha") || !strcmp(key, "beta") || !strcmp(key, "scalar")) {
            if (!json_is_number(x)) return BAD(w, "attribute '%s' is not a number", key);
            double d = json_number_value(x);
            *(key[0] == 'a' ? &a->alpha : key[0] == 'b' ? &a->beta : &a->scalar) = d;
        } else if (!strcmp(key, "scalar_first") || !strcmp(key, "keepdim") ||
                   !strcmp(key, "trans_a") || !strcmp(key, "trans_b") ||
                   !strcmp(key, "align_corners")) {
            if (!json_is_boolean(x)) return BAD(w, "attribute '%s' is not true or false", key);
            bool b = json_is_true(x);
            if (!strcmp(key, "scalar_first")) a->scalar_first = b;
            else if (!strcmp(key, "keepdim")) a->keepdim = b;
            else if (!strcmp(key, "trans_a")) a->trans_a = b;
            else if (!strcmp(key, "align_corners")) a->align_corners = b;
            else a->trans_b = b;
        } else if (!strcmp(key, "axes")) {
            int n = json_is_array(x) ? (int)json_array_size(x) : -1;
            if (n < 1 || n > KPL_MAX_DIMS) return BAD(w, "attribute 'axes' must list 1 to %d axes", KPL_MAX_DIMS);
            KPL_TRY(get_ints(w, o, "axes", a->axes, n, -KPL_MAX_DIMS, KPL_MAX_DIMS - 1));
            a->naxes = n;
        } else if (!strcmp(key, "correction")) {
            if (!json_is_integer(x) || json_integer_value(x) < 0 || json_integer_value(x) > 1000)
                return BAD(w, "attribute 'correction' is not a small integer");
            a->correction = (int)json_integer_value(x);
        } else if (!strcmp(key, "start") || !strcmp(key, "length")) {
            if (!json_is_integer(x) || json_integer_value(x) < 0)
                return BAD(w, "attribute '%s' is not a non-negative integer", key);
            *(key[0] == 's' ? &a->start : &a->length) = json_integer_value(x);
        } else if (!strcmp(key, "dtype")) {
            if (!json_is_string(x) || kpl_dtype_parse(json_string_value(x), &a->dtype) < 0)
                return BAD(w, "attribute 'dtype' is not a dtype name");
        } else if (!strcmp(key, "conv")) {
            int v[7];
            KPL_TRY(get_ints(w, o, "conv", v, 7, 0, 1 << 20));
            a->conv = (kpl_conv2d_params){{v[0], v[1]}, {v[2], v[3]}, {v[4], v[5]}, v[6]};
        } else if (!strcmp(key, "shape4")) {
            if (!json_is_array(x) || json_array_size(x) != 4) return BAD(w, "attribute 'shape4' must list 4 sizes");
            for (int i = 0; i < 4; i++) {
                json_t *e = json_array_get(x, (size_t)i);
                if (!json_is_integer(e) || json_integer_value(e) < 0 || json_integer_value(e) > ((json_int_t)1 << 40))
                    return BAD(w, "attribute 'shape4'[%d] is not a size", i);
                a->shape4[i] = json_integer_value(e);
            }
        } else if (!strcmp(key, "pool")) {
            int v[8];
            KPL_TRY(get_ints(w, o, "pool", v, 8, 0, 1 << 20));
            a->pool = (kpl_pool2d_params){{v[0], v[1]}, {v[2], v[3]}, {v[4], v[5]}, v[6] != 0, v[7] != 0};
        } else if (!strcmp(key, "roi")) {
            json_int_t oh = 0, ow = 0;
            double sc = 0;
            int sr = 0, al = 0;
            if (json_unpack(x, "{s:I, s:I, s:F, s:i, s:b}", "out_h", &oh, "out_w", &ow,
                            "spatial_scale", &sc, "sampling_ratio", &sr, "aligned", &al) != 0 ||
                oh < 1 || ow < 1 || oh > 65536 || ow > 65536)
                return BAD(w, "attribute 'roi' is not {out_h, out_w, spatial_scale, sampling_ratio, aligned}");
            a->roi = (kpl_roi_align_params){oh, ow, sc, sr, al != 0};
        } else if (!strcmp(key, "sub")) {
            int found = -1;
            for (int b = 0; json_is_string(x) && b < KPL_BINARY_COUNT; b++)
                if (!strcmp(kpl_binary_name((kpl_binary_op)b), json_string_value(x))) found = b;
            if (found < 0) return BAD(w, "attribute 'sub' is not a binary op name");
            a->sub = found;
        } else {
            return BAD(w, "unknown attribute '%s' (a file of a newer kpl?)", key);
        }
    }
    return KPL_OK;
}

/* ---- writing ---- */

static const char *const kind_names[] = {"input", "param", "const", "op"};

kpl_status kpl_model_save(const kpl_ir *ir, const char *info, const char *path)
{
    KPL_CHECK(ir && path, KPL_EINVAL, "model_save: NULL argument");
    KPL_CHECK(!kpl_ir_num_updates(ir), KPL_EINVAL,
              "%s: the graph updates %d parameters (a traced training step); only inference "
              "graphs are saved",
              "model_save", kpl_ir_num_updates(ir));
    json_error_t je;
    json_t *meta = json_object(), *inf = info ? json_loads(info, 0, &je) : json_object();
    KPL_CHECK(meta, KPL_ENOMEM, "model_save: no host memory");
    if (!json_is_object(inf)) {
        json_decref(meta);
        json_decref(inf);
        return KPL_ERROR(KPL_EINVAL, "model_save: info is not a JSON object");
    }
    kpl_checkpoint *c = NULL;
    kpl_status st = kpl_checkpoint_create(&c);
    json_t *vals = json_array(), *nodes = json_array(), *ins = json_array(), *outs = json_array();
    int nv = kpl_ir_num_values(ir);
    for (int v = 0; v < nv && st == KPL_OK; v++) {
        kpl_irv_kind k = kpl_ir_value_kind(ir, v);
        int64_t shape[KPL_MAX_DIMS];
        int nd = kpl_ir_value_shape(ir, v, shape);
        json_t *sh = json_array();
        for (int i = 0; i < nd; i++) json_array_append_new(sh, json_integer(shape[i]));
        json_t *o = json_pack("{s:s, s:s, s:o}", "kind", kind_names[k], "dtype",
                              kpl_dtype_name(kpl_ir_value_dtype(ir, v)), "shape", sh);
        const char *name = kpl_ir_value_name(ir, v);
        if (name) json_object_set_new(o, "name", json_string(name));
        if (k == KPL_IRV_PARAM || k == KPL_IRV_CONST) {
            char tname[320];
            if (k == KPL_IRV_PARAM && name) snprintf(tname, sizeof tname, "param.%s", name);
            else snprintf(tname, sizeof tname, "const.%d", v);
            json_object_set_new(o, "tensor", json_string(tname));
            st = kpl_checkpoint_add(c, tname, kpl_ir_value_data(ir, v));
        }
        json_array_append_new(vals, o);
    }
    for (int i = 0; i < kpl_ir_num_nodes(ir) && st == KPL_OK; i++) {
        int in[KPL_IR_MAX_INPUTS], out[KPL_IR_MAX_OUTPUTS];
        int ni = kpl_ir_node_inputs(ir, i, in), no = kpl_ir_node_outputs(ir, i, out);
        json_t *n = json_pack("{s:s, s:o, s:o}", "op", kpl_op_name(kpl_ir_node_op(ir, i)), "in",
                              int_array(in, ni), "out", int_array(out, no));
        json_t *a = attrs_json(kpl_ir_node_attrs(ir, i));
        if (json_object_size(a)) json_object_set_new(n, "attrs", a);
        else json_decref(a);
        json_array_append_new(nodes, n);
    }
    for (int i = 0; i < kpl_ir_num_inputs(ir); i++)
        json_array_append_new(ins, json_integer(kpl_ir_input(ir, i)));
    for (int i = 0; i < kpl_ir_num_outputs(ir); i++)
        json_array_append_new(outs, json_pack("{s:i, s:s}", "value", kpl_ir_output(ir, i), "name",
                                              kpl_ir_output_name(ir, i)));
    json_object_set_new(meta, "format", json_string(MODEL_FORMAT));
    json_object_set_new(meta, "version", json_integer(KPL_MODEL_VERSION));
    json_object_set_new(meta, "info", inf);
    json_object_set_new(meta, "graph",
                        json_pack("{s:i, s:o, s:o, s:o, s:o}", "level", kpl_ir_level(ir), "values",
                                  vals, "nodes", nodes, "inputs", ins, "outputs", outs));
    char *text = st == KPL_OK ? json_dumps(meta, JSON_COMPACT | JSON_PRESERVE_ORDER |
                                                     JSON_REAL_PRECISION(17))
                              : NULL;
    json_decref(meta);
    if (st == KPL_OK && !text) st = KPL_ERROR(KPL_ENOMEM, "model_save: no host memory");
    if (st == KPL_OK) st = kpl_checkpoint_set_meta(c, text);
    free(text);
    if (st == KPL_OK) st = kpl__checkpoint_write(c, path, false);
    kpl_checkpoint_destroy(c);
    return st;
}

/* ---- reading ---- */

static kpl_status parse_graph(const char *path, json_t *g, const kpl_checkpoint *c, kpl_ir *ir)
{
    where w = {path, -1};
    json_t *vals = json_object_get(g, "values"), *nodes = json_object_get(g, "nodes");
    json_t *ins = json_object_get(g, "inputs"), *outs = json_object_get(g, "outputs");
    json_t *lv = json_object_get(g, "level");
    KPL_CHECK(json_is_array(vals) && json_is_array(nodes) && json_is_array(ins) &&
                  json_is_array(outs) && json_is_integer(lv),
              KPL_EFORMAT, "%s: the graph lacks values, nodes, inputs, outputs or level", path);
    KPL_CHECK(json_integer_value(lv) >= 0 && json_integer_value(lv) <= 3, KPL_EFORMAT,
              "%s: graph level %lld is not 0..3", path, (long long)json_integer_value(lv));
    kpl_ir_set_level(ir, (int)json_integer_value(lv));
    size_t i;
    json_t *o;
    json_array_foreach(vals, i, o) {
        const char *kind = NULL, *dt = NULL, *name = NULL, *tname = NULL;
        json_t *sh = NULL;
        if (json_unpack(o, "{s:s, s:s, s:o, s?s, s?s}", "kind", &kind, "dtype", &dt, "shape", &sh,
                        "name", &name, "tensor", &tname) != 0 ||
            !json_is_array(sh) || json_array_size(sh) > KPL_MAX_DIMS)
            return KPL_ERROR(KPL_EFORMAT, "%s: value %zu is not {kind, dtype, shape[<= %d dims]}",
                             path, i, KPL_MAX_DIMS);
        int k = -1;
        for (int j = 0; j < 4; j++)
            if (!strcmp(kind, kind_names[j])) k = j;
        kpl_dtype d;
        KPL_CHECK(k >= 0, KPL_EFORMAT, "%s: value %zu has kind '%s'", path, i, kind);
        KPL_CHECK(kpl_dtype_parse(dt, &d) == KPL_OK, KPL_EFORMAT, "%s: value %zu has dtype '%s'",
                  path, i, dt);
        int64_t shape[KPL_MAX_DIMS], numel = 1;
        int nd = (int)json_array_size(sh);
        for (int j = 0; j < nd; j++) {
            json_t *e = json_array_get(sh, (size_t)j);
            KPL_CHECK(json_is_integer(e) && json_integer_value(e) >= 0 &&
                          json_integer_value(e) <= ((json_int_t)1 << 40),
                      KPL_EFORMAT, "%s: value %zu: shape[%d] is not a size", path, i, j);
            shape[j] = json_integer_value(e);
            /* no value of more than 2^48 elements (nor a product that overflows) */
            numel = shape[j] && numel > ((int64_t)1 << 48) / shape[j] ? ((int64_t)1 << 48) + 1
                                                                     : numel * shape[j];
        }
        KPL_CHECK(numel <= ((int64_t)1 << 48), KPL_EFORMAT,
                  "%s: value %zu has more than 2^48 elements", path, i);
        kpl_tensor *data = NULL;
        if (k == KPL_IRV_PARAM || k == KPL_IRV_CONST) {
            KPL_CHECK(tname, KPL_EFORMAT, "%s: value %zu (%s) names no tensor", path, i, kind);
            data = kpl_checkpoint_find(c, tname);
            KPL_CHECK(data, KPL_EFORMAT, "%s: value %zu: tensor '%s' is not in the file", path, i,
                      tname);
            char b1[96], b2[96];
            KPL_CHECK(kpl_tensor_dtype(data) == d && kpl_tensor_ndim(data) == nd &&
                          !memcmp(kpl_tensor_shape(data), shape, (size_t)nd * sizeof *shape),
                      KPL_EFORMAT, "%s: value %zu: tensor '%s' is %s %s, the graph says %s %s",
                      path, i, tname, kpl_dtype_name(kpl_tensor_dtype(data)),
                      kpl_shape_str(kpl_tensor_ndim(data), kpl_tensor_shape(data), b1, sizeof b1),
                      dt, kpl_shape_str(nd, shape, b2, sizeof b2));
        }
        /* each tensor a storage of its own (the container's are views of
         * one payload): the graph's constants, which kernels may keep
         * derived copies of (kpl_tensor_set_constant) */
        kpl_tensor *own = NULL;
        if (data && (kpl_tensor_empty_like(data, &own) < 0 || kpl_k_copy(own, data) < 0)) {
            kpl_tensor_release(own);
            return kpl_error_prefix(kpl_last_status(), "%s: ", path);
        }
        if (own) kpl_tensor_set_constant(own, true);
        int id = kpl_ir_add_value(ir, (kpl_irv_kind)k, d, nd, shape, name, own);
        kpl_tensor_release(own);
        if (id < 0) return kpl_error_prefix(kpl_last_status(), "%s: ", path);
    }
    int nv = kpl_ir_num_values(ir);
    json_array_foreach(nodes, i, o) {
        w.node = (int)i;
        const char *op = NULL;
        json_t *in = NULL, *out = NULL, *at = NULL;
        if (json_unpack(o, "{s:s, s:o, s:o, s?o}", "op", &op, "in", &in, "out", &out, "attrs", &at) != 0 ||
            !json_is_array(in) || !json_is_array(out) ||
            json_array_size(in) > KPL_IR_MAX_INPUTS || json_array_size(out) < 1 ||
            json_array_size(out) > KPL_IR_MAX_OUTPUTS)
            return BAD(&w, "not {op, in[<= 4], out[1..3], attrs}");
        kpl_op opi = kpl_op_from_name(op);
        if (opi == KPL_OP_COUNT) return BAD(&w, "unknown op '%s' (a file of a newer kpl?)", op);
        int iv[KPL_IR_MAX_INPUTS], ov[KPL_IR_MAX_OUTPUTS];
        KPL_TRY(get_ints(&w, o, "in", iv, (int)json_array_size(in), -1, nv - 1));
        KPL_TRY(get_ints(&w, o, "out", ov, (int)json_array_size(out), 0, nv - 1));
        kpl_op_attrs a;
        KPL_TRY(attrs_parse(&w, at, &a));
        if (kpl_ir_add_node(ir, opi, &a, (int)json_array_size(in), iv,
                            (int)json_array_size(out), ov) < 0)
            return kpl_error_prefix(KPL_EFORMAT, "%s: ", path);
    }
    int nin = (int)json_array_size(ins), nout = (int)json_array_size(outs);
    KPL_CHECK(nin <= 64 && nout >= 1 && nout <= 64, KPL_EFORMAT, "%s: %d inputs, %d outputs", path,
              nin, nout);
    int iv[64], ov[64];
    const char *names[64];
    for (int j = 0; j < nin; j++) {
        json_t *e = json_array_get(ins, (size_t)j);
        KPL_CHECK(json_is_integer(e) && json_integer_value(e) >= 0 && json_integer_value(e) < nv,
                  KPL_EFORMAT, "%s: input %d is not a value", path, j);
        iv[j] = (int)json_integer_value(e);
    }
    for (int j = 0; j < nout; j++) {
        json_int_t v = -1;
        names[j] = NULL;
        KPL_CHECK(json_unpack(json_array_get(outs, (size_t)j), "{s:I, s:s}", "value", &v, "name",
                              &names[j]) == 0 && v >= 0 && v < nv,
                  KPL_EFORMAT, "%s: output %d is not {value, name}", path, j);
        ov[j] = (int)v;
    }
    if (kpl_ir_set_io(ir, nin, iv, nout, ov, names) < 0)
        return kpl_error_prefix(KPL_EFORMAT, "%s: ", path);
    if (kpl_ir_check(ir) < 0) return kpl_error_prefix(KPL_EFORMAT, "%s: ", path);
    return KPL_OK;
}

kpl_status kpl_model_load(const char *path, int level, kpl_model **out)
{
    KPL_CHECK(path && out, KPL_EINVAL, "model_load: NULL argument");
    KPL_CHECK(level >= -1 && level <= 3, KPL_EINVAL, "model_load: level %d (-1, 0..3)", level);
    *out = NULL;
    kpl_checkpoint *c = NULL;
    KPL_TRY(kpl_checkpoint_load(path, &c));
    kpl_model *m = calloc(1, sizeof *m);
    json_error_t je;
    json_t *meta = json_loads(kpl_checkpoint_meta(c), 0, &je);
    kpl_status st = m ? KPL_OK : KPL_ERROR(KPL_ENOMEM, "model_load: no host memory");
    json_t *fmt = json_object_get(meta, "format"), *ver = json_object_get(meta, "version");
    json_t *g = json_object_get(meta, "graph"), *info = json_object_get(meta, "info");
    if (st == KPL_OK && (!json_is_string(fmt) || strcmp(json_string_value(fmt), MODEL_FORMAT)))
        st = KPL_ERROR(KPL_EFORMAT, "%s: a kpl checkpoint, not a model file (export one with "
                       "'kpl export')", path);
    if (st == KPL_OK && (!json_is_integer(ver) || json_integer_value(ver) < 1))
        st = KPL_ERROR(KPL_EFORMAT, "%s: no format version", path);
    if (st == KPL_OK && json_integer_value(ver) > KPL_MODEL_VERSION)
        st = KPL_ERROR(KPL_EFORMAT, "%s: model format version %lld; this kpl reads up to %d",
                       path, (long long)json_integer_value(ver), KPL_MODEL_VERSION);
    if (st == KPL_OK && (!json_is_object(g) || !json_is_object(info)))
        st = KPL_ERROR(KPL_EFORMAT, "%s: no graph or info object", path);
    if (st == KPL_OK) {
        m->version = (int)json_integer_value(ver);
        m->info = json_dumps(info, JSON_COMPACT | JSON_PRESERVE_ORDER | JSON_REAL_PRECISION(17));
        if (!m->info) st = KPL_ERROR(KPL_ENOMEM, "model_load: no host memory");
    }
    if (st == KPL_OK) st = kpl_ir_create(&m->ir);
    if (st == KPL_OK) st = parse_graph(path, g, c, m->ir);
    if (st == KPL_OK && level >= 0) kpl_ir_set_level(m->ir, level);
    json_decref(meta);
    kpl_checkpoint_destroy(c); /* the graph holds its tensors */
    if (st < 0) {
        kpl_model_destroy(m);
        return st;
    }
    *out = m;
    return KPL_OK;
}

void kpl_model_destroy(kpl_model *m)
{
    if (!m) return;
    kpl_exec_destroy(m->ex);
    kpl_ir_destroy(m->ir);
    free(m->info);
    free(m);
}

const kpl_ir *kpl_model_graph(const kpl_model *m) { return m->ir; }
const char *kpl_model_info(const kpl_model *m) { return m->info; }
int kpl_model_version(const kpl_model *m) { return m->version; }
int kpl_model_num_inputs(const kpl_model *m) { return kpl_ir_num_inputs(m->ir); }
const char *kpl_model_input_name(const kpl_model *m, int i)
{
    return kpl_ir_value_name(m->ir, kpl_ir_input(m->ir, i));
}
kpl_dtype kpl_model_input_dtype(const kpl_model *m, int i)
{
    return kpl_ir_value_dtype(m->ir, kpl_ir_input(m->ir, i));
}
int kpl_model_input_shape(const kpl_model *m, int i, int64_t *shape)
{
    return kpl_ir_value_shape(m->ir, kpl_ir_input(m->ir, i), shape);
}
int kpl_model_num_outputs(const kpl_model *m) { return kpl_ir_num_outputs(m->ir); }
const char *kpl_model_output_name(const kpl_model *m, int i) { return kpl_ir_output_name(m->ir, i); }
/* The executor and its memory, made at the first use. */
static kpl_status ensure_exec(kpl_model *m)
{
    KPL_CHECK(m, KPL_EINVAL, "model: NULL");
    return m->ex ? KPL_OK : kpl_exec_create(m->ir, &m->ex);
}

kpl_status kpl_model_set_input(kpl_model *m, int i, kpl_tensor *x)
{
    KPL_TRY(ensure_exec(m));
    return kpl_exec_set_input(m->ex, i, x);
}

kpl_status kpl_model_run(kpl_model *m)
{
    KPL_TRY(ensure_exec(m));
    m->ran = true;
    return kpl_exec_run(m->ex);
}

kpl_tensor *kpl_model_output(kpl_model *m, int i)
{
    if (!m || !m->ran) {
        KPL_ERROR(KPL_ESTATE, "model_output: the model has not run");
        return NULL;
    }
    return kpl_exec_output(m->ex, i);
}

kpl_status kpl_model_transform(const kpl_model *m, kpl_transform_config *cfg)
{
    json_error_t je;
    json_t *info = json_loads(m->info, 0, &je), *t = json_object_get(info, "transform");
    kpl_status st = KPL_OK;
    *cfg = (kpl_transform_config)KPL_TRANSFORM_CONFIG_INIT;
    const char *crop = NULL, *dt = NULL;
    json_t *mean = NULL, *std = NULL;
    int oh = 0, ow = 0, rs = 0, ch = 3;
    if (!t) {
        st = KPL_ERROR(KPL_ENOTFOUND, "model: the file names no input transform");
    } else if (json_unpack(t, "{s:s, s:i, s:i, s:i, s:i, s:s, s:o, s:o}", "crop", &crop, "out_h",
                           &oh, "out_w", &ow, "resize_shorter", &rs, "channels", &ch, "out_dtype",
                           &dt, "mean", &mean, "std", &std) != 0 ||
               kpl_crop_mode_parse(crop) < 0 || kpl_dtype_parse(dt, &cfg->out_dtype) < 0 ||
               (ch != 1 && ch != 3) || json_array_size(mean) != (size_t)ch ||
               json_array_size(std) != (size_t)ch) {
        st = KPL_ERROR(KPL_EFORMAT, "model: the input transform is not {crop, out_h, out_w, "
                                    "resize_shorter, channels, out_dtype, mean, std}");
    } else {
        cfg->crop = (kpl_crop_mode)kpl_crop_mode_parse(crop);
        cfg->out_h = oh, cfg->out_w = ow, cfg->resize_shorter = rs, cfg->channels = ch;
        cfg->label_feature = NULL;
        for (int c = 0; c < ch; c++) {
            cfg->mean[c] = (float)json_number_value(json_array_get(mean, (size_t)c));
            cfg->std[c] = (float)json_number_value(json_array_get(std, (size_t)c));
        }
    }
    json_decref(info);
    return st;
}
