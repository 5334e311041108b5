/*
 * convert_idx.c — MNIST-family IDX files to KPLRecord.
 *
 * IDX: a big-endian header (two zero bytes, a type byte, 0x08 = u8, a
 * dimension count) and the extents, then the values.  zlib's gzread reads
 * gzip-compressed and plain files alike.
 */
#include "convert_impl.h"

#include <errno.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>

static uint32_t be32(const uint8_t *p)
{
    return (uint32_t)p[0] << 24 | (uint32_t)p[1] << 16 | (uint32_t)p[2] << 8 | p[3];
}

kpl_status kpl__idx_read(kpl__idx_file *x, void *buf, size_t n, const char *what)
{
    int r = gzread(x->f, buf, (unsigned)n);
    if (r < 0) {
        int e;
        const char *msg = gzerror(x->f, &e);
        return KPL_ERROR(KPL_EIO, "%s: reading %s: %s", x->path, what,
                         e == Z_ERRNO ? strerror(errno) : msg);
    }
    KPL_CHECK((size_t)r == n, KPL_EFORMAT, "%s: file ends inside %s (%d of %zu bytes)", x->path,
              what, r, n);
    return KPL_OK;
}

kpl_status kpl__idx_open(kpl__idx_file *x, const char *path, int want_ndim)
{
    x->path = path;
    x->f = gzopen(path, "rb");
    KPL_CHECK(x->f, errno == ENOENT ? KPL_ENOTFOUND : KPL_EIO, "%s: %s", path,
              errno ? strerror(errno) : "cannot open");
    gzbuffer(x->f, 1 << 20);
    uint8_t h[4];
    KPL_TRY(kpl__idx_read(x, h, 4, "the IDX header"));
    KPL_CHECK(h[0] == 0 && h[1] == 0, KPL_EFORMAT, "%s: not an IDX file (bad magic)", path);
    KPL_CHECK(h[2] == 0x08, KPL_EFORMAT, "%s: IDX value type 0x%02x, only u8 (0x08) is read",
              path, h[2]);
    KPL_CHECK(h[3] == want_ndim, KPL_EFORMAT, "%s: %d dimensions, expected %d", path, h[3],
              want_ndim);
    x->ndim = h[3];
    uint8_t d[16];
    KPL_TRY(kpl__idx_read(x, d, 4 * (size_t)x->ndim, "the IDX extents"));
    for (int i = 0; i < x->ndim; i++) {
        x->dims[i] = be32(d + 4 * i);
        KPL_CHECK(x->dims[i] > 0 && (i == 0 || x->dims[i] <= 65536), KPL_EFORMAT,
                  "%s: extent %d is %lld", path, i, (long long)x->dims[i]);
    }
    return KPL_OK;
}

kpl_status kpl_convert_idx(const char *images_path, const char *labels_path,
                           const char *out_dir, const kpl_convert_options *opt,
                           int64_t *count)
{
    kpl_convert_options o = KPL_CONVERT_OPTIONS_INIT;
    if (opt) o = *opt;
    kpl__idx_file im = {0}, lb = {0};
    kpl_record_writer *w = NULL;
    uint8_t *img = NULL, *labels = NULL;
    char *attrs = NULL;
    kpl_status st = KPL_OK;
    KPL_TRY_GOTO(kpl__idx_open(&im, images_path, 3));
    KPL_TRY_GOTO(kpl__idx_open(&lb, labels_path, 1));
    if (im.dims[0] != lb.dims[0]) {
        st = KPL_ERROR(KPL_EFORMAT, "%s holds %lld images but %s holds %lld labels", images_path,
                       (long long)im.dims[0], labels_path, (long long)lb.dims[0]);
        goto fail;
    }
    int64_t n = im.dims[0], hw = im.dims[1] * im.dims[2];
    labels = malloc((size_t)n);
    img = malloc((size_t)hw);
    if (!labels || !img) {
        st = KPL_ERROR(KPL_ENOMEM, "convert idx: no memory");
        goto fail;
    }
    KPL_TRY_GOTO(kpl__idx_read(&lb, labels, (size_t)n, "the labels"));
    int maxl = 0;
    for (int64_t i = 0; i < n; i++) maxl = labels[i] > maxl ? labels[i] : maxl;
    json_t *aj = json_pack("{s:s, s:i, s:s, s:s}", "source", "idx", "num_classes", maxl + 1,
                           "images", images_path, "labels", labels_path);
    attrs = aj ? json_dumps(aj, JSON_COMPACT | JSON_PRESERVE_ORDER) : NULL;
    json_decref(aj);
    if (!attrs) {
        st = KPL_ERROR(KPL_EINVAL, "convert idx: paths are not valid UTF-8");
        goto fail;
    }
    kpl_feature_spec schema[2] = {
        {.name = "image", .type = KPL_FEATURE_BYTES, .encoding = "raw", .ndim = 3,
         .shape = {im.dims[1], im.dims[2], 1}},
        {.name = "label", .type = KPL_FEATURE_INT64},
    };
    o.writer.attributes_json = attrs;
    KPL_TRY_GOTO(kpl_record_writer_create(out_dir, 2, schema, &o.writer, &w));
    kpl__progress pr;
    kpl__progress_init(&pr, &o, out_dir);
    for (int64_t i = 0; i < n; i++) {
        char what[48];
        snprintf(what, sizeof what, "image %lld", (long long)i);
        KPL_TRY_GOTO(kpl__idx_read(&im, img, (size_t)hw, what));
        int64_t label = labels[i];
        kpl_feature_value v[2] = {{img, (uint32_t)hw}, {&label, 1}};
        KPL_TRY_GOTO(kpl_record_writer_add(w, v));
        KPL_TRY_GOTO(kpl__progress_update(&pr, (uint64_t)i + 1, (uint64_t)n, "images"));
    }
    uint8_t extra;
    if (gzread(im.f, &extra, 1) != 0 || gzread(lb.f, &extra, 1) != 0) {
        st = KPL_ERROR(KPL_EFORMAT, "%s or %s: bytes after the last of the %lld examples its "
                       "header declares", images_path, labels_path, (long long)n);
        goto fail;
    }
    kpl_record_writer *done = w;
    w = NULL;
    KPL_TRY_GOTO(kpl_record_writer_close(done));
    if (count) *count = n;
fail:
    kpl_record_writer_destroy(w);
    if (im.f) gzclose(im.f);
    if (lb.f) gzclose(lb.f);
    free(img);
    free(labels);
    free(attrs);
    return st;
}
