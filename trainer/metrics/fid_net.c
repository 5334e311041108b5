/*
 * fid_net.c — the feature network of FID and the Inception Score (fid.h,
 * docs/fid.md): a classifier of the zoo with a checkpoint's weights, cut
 * before its last linear layer.  It only loads the file; `kpl data
 * fid-net` (cli/cmd_fid_net.c) makes it.
 */
#include "run_impl.h"
#include "fid.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

struct kpl_feature_net {
    kpl_module *model;   /* a sequential: body children, then the head */
    kpl_module *head;    /* its last child, a linear layer */
    int nbody;
    kpl_device *dev;
    int64_t chw[3];      /* the model's input */
    kpl_tensor *mean, *std; /* (1, C, 1, 1) f32 on dev: the recipe's validation mean/std */
    int64_t dim, classes;
    char id[PATH_MAX + 64];
};

/* ---- building it ------------------------------------------------------------------------- */

/* The model's input (C, H, W): model.in_channels and input_size, else the
 * evaluation split's transform, else its stored images (converted first
 * when the recipe says how, as kpl eval does). */
static kpl_status input_shape(const kpl_recipe *r, int64_t *chw)
{
    bool val = r->data.val.path[0] != 0;
    const kpl_recipe_split *s = val ? &r->data.val : &r->data.train;
    const kpl_transform_config *t = &s->loader.transform;
    chw[0] = r->model.in_channels ? r->model.in_channels : t->channels;
    if (r->model.in_h > 0 && r->model.in_w > 0) {
        chw[1] = r->model.in_h, chw[2] = r->model.in_w;
        return KPL_OK;
    }
    if (t->out_h > 0 && t->out_w > 0 && t->crop != KPL_CROP_KEEP_RATIO) {
        chw[1] = t->out_h, chw[2] = t->out_w;
        return KPL_OK;
    }
    KPL_CHECK(s->path[0], KPL_EINVAL, "no model.input_size, and no data split whose images "
              "would give it");
    kpl__runlog quiet;
    memset(&quiet, 0, sizeof quiet);
    KPL_TRY(val ? kpl__data_prepare_val(r, &quiet) : kpl__data_prepare(r, &quiet));
    return val ? kpl__data_val_input_shape(r, chw) : kpl__data_input_shape(r, chw);
}

/* The body/head cut: a sequential whose last child is a linear layer. */
static kpl_status find_head(kpl_feature_net *f, const char *model_name)
{
    kpl_module *m = f->model;
    int n = kpl_module_num_children(m);
    kpl_module *last = n > 0 ? kpl_module_child(m, n - 1) : NULL;
    const char *kind = kpl_module_kind_of(m)->name;
    const char *last_kind = last ? kpl_module_kind_of(last)->name : "nothing";
    KPL_CHECK(!strcmp(kind, "sequential") && n >= 2 && !strcmp(last_kind, "linear"), KPL_EINVAL,
              "model '%s' is a %s of %d children ending in %s, not a sequential ending in a "
              "linear layer (supported: the zoo's mlp, lenet, cnn, and resnet with "
              "num_classes > 0)", model_name, kind, n, last_kind);
    kpl_tensor *w = kpl_module_get_param(last, "weight"); /* (classes, dim) */
    KPL_CHECK(w && kpl_tensor_ndim(w) == 2, KPL_EINVAL, "model '%s': its last layer '%s' has no "
              "2-d weight", model_name, kpl_module_name(last));
    f->head = last;
    f->nbody = n - 1;
    f->classes = kpl_tensor_shape(w)[0];
    f->dim = kpl_tensor_shape(w)[1];
    return KPL_OK;
}

/* "<file name> crc32c <hex> dim <dim>" of the checkpoint's bytes. */
static kpl_status make_id(kpl_feature_net *f, const char *path)
{
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    KPL_CHECK(fd >= 0, KPL_EIO, "%s: cannot open: %s", path, strerror(errno));
    enum { BUF = 1 << 20 };
    unsigned char *buf = malloc(BUF);
    uint32_t crc = 0;
    ssize_t r = -1;
    while (buf && ((r = read(fd, buf, BUF)) > 0 || (r < 0 && errno == EINTR)))
        if (r > 0) crc = kpl_crc32c(crc, buf, (size_t)r);
    int e = buf ? errno : ENOMEM;
    close(fd);
    free(buf);
    KPL_CHECK(r == 0, KPL_EIO, "%s: read failed: %s", path, strerror(e));
    const char *base = strrchr(path, '/');
    snprintf(f->id, sizeof f->id, "%s crc32c %08x dim %lld", base ? base + 1 : path, crc,
             (long long)f->dim);
    return KPL_OK;
}

static kpl_status norm_tensors(kpl_feature_net *f, const kpl_transform_config *t)
{
    int64_t c = f->chw[0], shape[4] = {1, c, 1, 1};
    KPL_CHECK(c >= 1 && c <= 3, KPL_EINVAL, "the model takes %lld channels (1 or 3 here)",
              (long long)c);
    float mean[3], std[3];
    for (int64_t i = 0; i < c; i++) {
        mean[i] = t->mean[c == 1 ? 0 : i];
        std[i] = t->std[c == 1 ? 0 : i];
        KPL_CHECK(std[i] > 0, KPL_EINVAL, "the validation transform's std %g is not > 0",
                  (double)std[i]);
    }
    KPL_TRY(kpl_tensor_from_data(f->dev, KPL_F32, 4, shape, mean, &f->mean));
    return kpl_tensor_from_data(f->dev, KPL_F32, 4, shape, std, &f->std);
}

kpl_status kpl_feature_net_create(const char *recipe_path, const char *checkpoint_path,
                                  kpl_device *dev, kpl_feature_net **out)
{
    return kpl_feature_net_create_with(recipe_path, 0, NULL, checkpoint_path, dev, out);
}

kpl_status kpl_feature_net_create_with(const char *recipe_path, int noverrides,
                                       const char *const *overrides,
                                       const char *checkpoint_path, kpl_device *dev,
                                       kpl_feature_net **out)
{
    KPL_CHECK(recipe_path && checkpoint_path && out && (noverrides == 0 || overrides),
              KPL_EINVAL, "feature_net_create: NULL argument");
    *out = NULL;
    kpl_status st = KPL_OK;
    kpl_recipe *r = malloc(sizeof *r);
    kpl_feature_net *f = calloc(1, sizeof *f);
    kpl_checkpoint *c = NULL;
    if (!r || !f) {
        st = KPL_ERROR(KPL_ENOMEM, "feature_net_create: out of memory");
        goto fail;
    }
    f->dev = dev ? dev : kpl_device_cpu();
    KPL_TRY_GOTO(kpl_recipe_load(recipe_path, noverrides, overrides, r));
    if ((st = input_shape(r, f->chw)) < 0) {
        st = kpl_error_prefix(st, "feature network: the input size of %s's model: ",
                               recipe_path);
        goto fail;
    }
    kpl_model_config mc = r->model;
    mc.in_channels = f->chw[0], mc.in_h = f->chw[1], mc.in_w = f->chw[2];
    st = kpl_zoo_create(&mc, f->dev, (uint64_t)r->seed, &f->model);
    if (st >= 0) st = find_head(f, mc.name);
    if (st >= 0) st = norm_tensors(f, &(r->data.val.path[0] ? &r->data.val : &r->data.train)
                                            ->loader.transform);
    if (st < 0) {
        st = kpl_error_prefix(st, "feature network of %s: ", recipe_path);
        goto fail;
    }
    KPL_TRY_GOTO(kpl_checkpoint_load(checkpoint_path, &c));
    if ((st = kpl__weights_check(c, checkpoint_path)) < 0) {
        st = kpl_error_prefix(st, "feature network: ");
        goto fail;
    }
    if ((st = kpl_module_state_load(f->model, c, "model.", true, NULL)) < 0) {
        st = kpl_error_prefix(st, "feature network: %s does not hold the weights of %s's model "
                               "(%s): ", checkpoint_path, recipe_path, mc.name);
        goto fail;
    }
    KPL_TRY_GOTO(make_id(f, checkpoint_path));
    kpl_module_set_training(f->model, false);
    kpl_checkpoint_destroy(c);
    free(r);
    *out = f;
    return KPL_OK;
fail:
    kpl_checkpoint_destroy(c);
    kpl_feature_net_destroy(f);
    free(r);
    return st;
}

void kpl_feature_net_destroy(kpl_feature_net *f)
{
    if (!f) return;
    kpl_module_destroy(f->model);
    kpl_tensor_release(f->mean);
    kpl_tensor_release(f->std);
    free(f);
}

int64_t kpl_feature_net_dim(const kpl_feature_net *f) { return f ? f->dim : 0; }
int64_t kpl_feature_net_classes(const kpl_feature_net *f) { return f ? f->classes : 0; }
const int64_t *kpl_feature_net_input_shape(const kpl_feature_net *f) { return f ? f->chw : NULL; }
const char *kpl_feature_net_id(const kpl_feature_net *f) { return f ? f->id : ""; }
kpl_module *kpl_feature_net_model(kpl_feature_net *f) { return f ? f->model : NULL; }

/* ---- running it ------------------------------------------------------------------------- */

/* (N, C, H, W) in [0, 1] -> the model's normalised input. */
static kpl_tensor *prepare(kpl_feature_net *f, kpl_tensor *images)
{
    const int64_t *s = kpl_tensor_shape(images);
    kpl_tensor *x = images;
    if (kpl_tensor_device(x) != f->dev) x = kpl_to_device(x, f->dev);
    if (s[1] == 1 && f->chw[0] == 3) {
        int64_t to[4] = {s[0], 3, s[2], s[3]};
        x = kpl_expand(x, 4, to);
    } else if (s[1] == 3 && f->chw[0] == 1) {
        int axis = 1;
        x = kpl_mean(x, &axis, 1, true);
    }
    if (s[2] != f->chw[1] || s[3] != f->chw[2])
        x = kpl_upsample_bilinear(x, f->chw[1], f->chw[2], false);
    return kpl_div(kpl_sub(x, f->mean), f->std);
}

kpl_status kpl_feature_net_run(kpl_feature_net *f, kpl_tensor *images, kpl_tensor **features,
                               kpl_tensor **probs)
{
    if (features) *features = NULL;
    if (probs) *probs = NULL;
    KPL_CHECK(f && images, KPL_EINVAL, "feature_net_run: NULL argument");
    const int64_t *s = kpl_tensor_shape(images);
    int nd = kpl_tensor_ndim(images);
    KPL_CHECK(nd == 4 && kpl_tensor_dtype(images) == KPL_F32, KPL_EINVAL,
              "feature_net_run: images must be (N, C, H, W) f32 in [0, 1], got a %d-d %s tensor",
              nd, kpl_dtype_name(kpl_tensor_dtype(images)));
    KPL_CHECK(s[0] >= 1 && s[2] >= 1 && s[3] >= 1 &&
                  (s[1] == f->chw[0] || s[1] == 1 || s[1] == 3),
              KPL_EINVAL, "feature_net_run: images (%lld, %lld, %lld, %lld): want N >= 1 and 1, "
              "3 or %lld channels (the network takes (%lld, %lld, %lld))", (long long)s[0],
              (long long)s[1], (long long)s[2], (long long)s[3], (long long)f->chw[0],
              (long long)f->chw[0], (long long)f->chw[1], (long long)f->chw[2]);
    bool grad = kpl_set_grad_enabled(false);
    kpl_module_set_training(f->model, false);
    kpl_tensor *x = prepare(f, images);
    for (int i = 0; i < f->nbody; i++) x = kpl_module_forward(kpl_module_child(f->model, i), x);
    kpl_tensor *p = probs && x ? kpl_softmax(kpl_module_forward(f->head, x), 1) : NULL;
    kpl_set_grad_enabled(grad);
    if (!x || (probs && !p)) return kpl_error_prefix(kpl_last_status(), "feature network: ");
    KPL_CHECK(kpl_tensor_ndim(x) == 2 && kpl_tensor_shape(x)[1] == f->dim, KPL_ESHAPE,
              "feature network: its body gives a %d-d tensor, not (N, %lld) features",
              kpl_tensor_ndim(x), (long long)f->dim);
    if (features) *features = x;
    if (probs) *probs = p;
    return KPL_OK;
}
