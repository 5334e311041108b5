/* bench_dataio.h — what the data group's benchmarks share. */
#ifndef KPL_BENCH_DATAIO_H
#define KPL_BENCH_DATAIO_H

#include "bench_common.h"
#include "dataio.h"

#include <string.h>

/* ImageNet training augmentation: random-resized crop 224 (scale (0.08,
 * 1), ratio (3/4, 4/3)), flip p = 0.5, ImageNet mean/std, (3, 224, 224) f32. */
static inline kpl_transform_config bench_imagenet_train(void)
{
    kpl_transform_config t = KPL_TRANSFORM_CONFIG_INIT;
    t.crop = KPL_CROP_RANDOM_RESIZED;
    t.out_h = t.out_w = 224;
    t.flip_prob = 0.5f;
    const float mean[3] = {0.485f, 0.456f, 0.406f}, std[3] = {0.229f, 0.224f, 0.225f};
    memcpy(t.mean, mean, sizeof mean);
    memcpy(t.std, std, sizeof std);
    return t;
}

#endif /* KPL_BENCH_DATAIO_H */
