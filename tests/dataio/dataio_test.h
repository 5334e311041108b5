/* dataio_test.h — what the dataio test programs share: a scratch directory
 * made before the group runs and removed after it, a detection schema.  Define KPL_TEST_NAME
 * (a short word for the directory name) before including. */
#ifndef KPL_DATAIO_TEST_H
#define KPL_DATAIO_TEST_H

#include "dataio.h"
#include "kpl_test.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static char tmp_root[64];

static int setup(void **state)
{
    (void)state;
    snprintf(tmp_root, sizeof tmp_root, "/tmp/kpl_test_%s_XXXXXX", KPL_TEST_NAME);
    return mkdtemp(tmp_root) ? 0 : -1;
}

/* tmp_root/name, in one of 8 rotating buffers (a few may be live at once). */
static inline const char *tmp_path(const char *name)
{
    static char p[8][256];
    static int k;
    k = (k + 1) % 8;
    snprintf(p[k], sizeof p[k], "%s/%s", tmp_root, name);
    return p[k];
}

/* The schema of a detection set whose images have sizes of their own:
 * raw pixels with each record's (H, W, C) in image_shape, boxes (float,
 * 4 per box), classes (int64, one per box), a raw mask of the image's size. */
static inline void det_schema(kpl_feature_spec s[5])
{
    const kpl_feature_spec d[5] = {
        {.name = "image", .type = KPL_FEATURE_BYTES, .encoding = "raw"},
        {.name = "image_shape", .type = KPL_FEATURE_INT64},
        {.name = "boxes", .type = KPL_FEATURE_FLOAT},
        {.name = "classes", .type = KPL_FEATURE_INT64},
        {.name = "mask", .type = KPL_FEATURE_BYTES, .encoding = "raw"},
    };
    memcpy(s, d, sizeof d);
}

static int teardown(void **state)
{
    (void)state;
    char cmd[128];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", tmp_root);
    return system(cmd) == 0 ? 0 : -1;
}

#endif /* KPL_DATAIO_TEST_H */
