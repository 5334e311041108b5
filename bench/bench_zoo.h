/* bench_zoo.h — the benches' models: zoo presets as module trees. */
#ifndef KPL_BENCH_ZOO_H
#define KPL_BENCH_ZOO_H

#include "zoo.h"

#include <stdio.h>
#include <string.h>

/* A zoo preset (zoo.h: "lenet", "resnet18_cifar", "resnet50") as a module
 * tree in training mode. */
/* The instruction set kpl's oneDNN kernels use ("avx512_core_bf16"), from
 * kpl_cpu_math_info, for bench rows that name both sides' kernels. */
static inline void bench_kpl_isa(char *buf, size_t len)
{
    const char *mi = kpl_cpu_math_info(), *on = strstr(mi, "oneDNN ");
    snprintf(buf, len, "%.*s", on ? (int)strcspn(on + 7, "; ") : 1, on ? on + 7 : "?");
}

static inline kpl_status bench_zoo(const char *name, int64_t classes, kpl_device *dev,
                                   uint64_t seed, kpl_module **out)
{
    kpl_model_config c;
    kpl_status st = kpl_zoo_preset(name, classes, &c);
    return st < 0 ? st : kpl_zoo_create(&c, dev, seed, out);
}

/* The segmentation benches' networks (bench_seg, bench_graph) at size x
 * size: "unet" (kpl's U-Net, depth 4, `width` base channels, 1 input
 * channel, 11 classes, transposed-convolution upsampling) or "deeplab"
 * (DeepLabv3 on ResNet-18, output stride 16, ASPP rates 6/12/18 with 256
 * channels, the auxiliary head, 21 classes).  Fills mc and the row's tag. */
static inline kpl_status bench_seg_config(const char *name, int64_t size, int64_t width,
                                          kpl_model_config *mc, char *tag, size_t tag_len)
{
    memset(mc, 0, sizeof *mc);
    mc->in_h = mc->in_w = size;
    kpl_status st = KPL_OK;
    if (!strcmp(name, "unet")) {
        snprintf(mc->name, sizeof mc->name, "unet");
        mc->width = width, mc->depth = 4, mc->in_channels = 1, mc->num_classes = 11;
        st = kpl_keyvals_set(&mc->keys, "upsample", "transpose");
        snprintf(tag, tag_len, "unet_w%lld_d4", (long long)width);
    } else {
        snprintf(mc->name, sizeof mc->name, "deeplabv3");
        mc->depth = 18, mc->width = 64, mc->in_channels = 3, mc->num_classes = 21;
        const char *kv[4][2] = {{"output_stride", "16"}, {"aspp_rates", "[6, 12, 18]"},
                                {"aspp_channels", "256"}, {"aux", "true"}};
        for (int i = 0; i < 4 && st == KPL_OK; i++) st = kpl_keyvals_set(&mc->keys, kv[i][0], kv[i][1]);
        snprintf(tag, tag_len, "deeplabv3_r18_os16");
    }
    return st < 0 ? st : kpl_model_config_complete(mc);
}

#endif /* KPL_BENCH_ZOO_H */
