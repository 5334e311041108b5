/*
 * fpn.c — the feature pyramid network of detectors (layers.h's
 * kpl_nn_fpn): lateral 1x1 convolutions, the top-down path (nearest
 * upsampling to the finer map's size, then a sum), 3x3 output
 * convolutions, and the extra stride-2 levels of FCOS and RetinaNet.  Its
 * convolutions are kpl_nn_conv2d children under torchvision's names, so a
 * state dict of torchvision's FeaturePyramidNetwork loads as it is.
 */
#include "layers.h"

#include <stdio.h>
#include <stdlib.h>

typedef struct {
    int n_in, extra;
    bool extra_from_input;
    int64_t in_channels[KPL_MODULE_MAX_IO];
    kpl_module *inner[KPL_MODULE_MAX_IO], *layer[KPL_MODULE_MAX_IO], *more[KPL_MODULE_MAX_IO];
} fpn_state;

/* The maps the forward is given: as many as built for, each (N, C_i, H, W)
 * of its channels, one batch. */
static kpl_status fpn_inputs(const kpl_module *m, const fpn_state *s, const kpl_tensor_list *in)
{
    const char *name = kpl_module_name(m);
    KPL_CHECK(in->n == s->n_in, KPL_EINVAL, "fpn %s: takes %d feature maps, finest first; got %d",
              name, s->n_in, in->n);
    for (int i = 0; i < in->n; i++) {
        kpl_tensor *x = in->t[i];
        if (!x) return kpl_last_status(); /* a failed op upstream: its message stays */
        char b[96];
        kpl_shape_str(kpl_tensor_ndim(x), kpl_tensor_shape(x), b, sizeof b);
        KPL_CHECK(kpl_tensor_ndim(x) == 4 && kpl_tensor_dim(x, 1) == s->in_channels[i] &&
                      kpl_tensor_dim(x, 0) == kpl_tensor_dim(in->t[0], 0),
                  KPL_ESHAPE, "fpn %s: map %d has shape %s; expected (%lld, %lld, H, W)", name, i,
                  b, (long long)kpl_tensor_dim(in->t[0], 0), (long long)s->in_channels[i]);
    }
    return KPL_OK;
}

static kpl_status fpn_forward(kpl_module *m, const kpl_tensor_list *in, kpl_tensor_list *out)
{
    const fpn_state *s = kpl_module_state(m);
    KPL_TRY(fpn_inputs(m, s, in));
    int n = s->n_in;
    kpl_tensor *last = kpl_module_forward(s->inner[n - 1], in->t[n - 1]);
    out->t[n - 1] = kpl_module_forward(s->layer[n - 1], last);
    for (int i = n - 2; i >= 0; i--) {
        kpl_tensor *lat = kpl_module_forward(s->inner[i], in->t[i]);
        if (!lat) return kpl_last_status();
        last = kpl_add(lat, kpl_upsample_nearest(last, kpl_tensor_dim(lat, 2),
                                                 kpl_tensor_dim(lat, 3)));
        out->t[i] = kpl_module_forward(s->layer[i], last);
    }
    kpl_tensor *src = s->extra_from_input ? in->t[n - 1] : out->t[n - 1];
    for (int j = 0; j < s->extra; j++) {
        src = kpl_module_forward(s->more[j], j == 0 ? src : kpl_relu(src));
        out->t[n + j] = src;
    }
    out->n = n + s->extra;
    for (int i = 0; i < out->n; i++)
        if (!out->t[i]) return kpl_last_status();
    return KPL_OK;
}

static const kpl_module_kind fpn_kind = {"fpn", fpn_forward, free, KPL_MODULE_REPLAYABLE};

/* A convolution child of `holder` called `name` with torchvision's FPN init. */
static kpl_status conv(kpl_module *holder, const char *name, int64_t cin, int64_t cout, int k,
                       int stride, kpl_module **out)
{
    kpl_nn_conv c = {KPL_NN_CONV_INIT(cin, cout, k), .stride = {stride, stride},
                     .padding = {k / 2, k / 2}, .init = KPL_NN_INIT_KAIMING_UNIFORM_A1};
    return kpl_nn_conv2d(holder, name, &c, out);
}

kpl_status kpl_nn_fpn(kpl_module *parent, const char *name, const int64_t *in_channels, int n_in,
                      int64_t out_channels, int extra_levels, bool extra_from_input,
                      kpl_module **out)
{
    if (out) *out = NULL;
    const char *nm = name ? name : "";
    KPL_CHECK(in_channels && n_in >= 1 && extra_levels >= 0 &&
                  n_in + extra_levels <= KPL_MODULE_MAX_IO,
              KPL_EINVAL, "fpn %s: %d input maps and %d extra levels (1 or more inputs, at most %d "
              "maps in all)", nm, n_in, extra_levels, KPL_MODULE_MAX_IO);
    KPL_CHECK(out_channels > 0, KPL_EINVAL, "fpn %s: out_channels %lld must be positive", nm,
              (long long)out_channels);
    for (int i = 0; i < n_in; i++)
        KPL_CHECK(in_channels[i] > 0, KPL_EINVAL, "fpn %s: in_channels[%d] is %lld", nm, i,
                  (long long)in_channels[i]);
    fpn_state *s = calloc(1, sizeof *s);
    KPL_CHECK(s, KPL_ENOMEM, "fpn %s: out of memory", nm);
    s->n_in = n_in;
    s->extra = extra_levels;
    s->extra_from_input = extra_from_input;
    for (int i = 0; i < n_in; i++) s->in_channels[i] = in_channels[i];
    kpl_module *m = NULL, *inner = NULL, *layer = NULL, *more = NULL;
    KPL_TRY(kpl_module_create(parent, name, &fpn_kind, s, &m));
    kpl_module_mark_recompute_unit(m); /* memory.recompute: blocks */
    /* torchvision registers inner_blocks, layer_blocks, extra_blocks, in
     * that order: the state dict lists them so. */
    KPL_TRY(kpl_nn_sequential(m, "inner_blocks", &inner));
    KPL_TRY(kpl_nn_sequential(m, "layer_blocks", &layer));
    if (extra_levels) KPL_TRY(kpl_nn_sequential(m, "extra_blocks", &more));
    char child[16];
    for (int i = 0; i < n_in; i++) {
        snprintf(child, sizeof child, "%d", i);
        KPL_TRY(conv(inner, child, in_channels[i], out_channels, 1, 1, &s->inner[i]));
        KPL_TRY(conv(layer, child, out_channels, out_channels, 3, 1, &s->layer[i]));
    }
    for (int j = 0; j < extra_levels; j++) {
        snprintf(child, sizeof child, "p%d", 6 + j);
        int64_t cin = j == 0 && extra_from_input ? in_channels[n_in - 1] : out_channels;
        KPL_TRY(conv(more, child, cin, out_channels, 3, 2, &s->more[j]));
    }
    if (out) *out = m;
    return KPL_OK;
}
