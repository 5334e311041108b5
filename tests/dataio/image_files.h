/* image_files.h — image files the dataio tests write: JPEGs and PNGs of
 * seeded pixels, and whole-file writes.  Include after kpl_test.h. */
#ifndef KPL_IMAGE_FILES_H
#define KPL_IMAGE_FILES_H

#include <png.h>
#include <stdio.h>
#include <stdlib.h>
#include <turbojpeg.h>

static inline void write_bytes(const char *file, const void *b, size_t n)
{
    FILE *f = fopen(file, "wb");
    assert_non_null(f);
    assert_int_equal(fwrite(b, 1, n, f), n);
    fclose(f);
}

/* A w x h RGB JPEG whose pixels depend on `seed`; *len bytes, tjFree it. */
static inline unsigned char *make_jpeg(int w, int h, int seed, unsigned long *len)
{
    unsigned char *rgb = malloc((size_t)w * h * 3), *jpg = NULL;
    for (int i = 0; i < w * h * 3; i++) rgb[i] = (unsigned char)(i * seed + seed * 17);
    tjhandle tj = tjInitCompress();
    *len = 0;
    assert_int_equal(tjCompress2(tj, rgb, w, 0, h, TJPF_RGB, &jpg, len, TJSAMP_420, 90, 0), 0);
    tjDestroy(tj);
    free(rgb);
    return jpg;
}

/* A w x h RGB PNG (malloc'd) whose pixels depend on seed. */
static inline unsigned char *make_png(int w, int h, int seed, size_t *len)
{
    unsigned char *rgb = malloc((size_t)w * h * 3);
    for (int i = 0; i < w * h * 3; i++) rgb[i] = (unsigned char)(i * seed + seed * 17);
    png_image im;
    memset(&im, 0, sizeof im);
    im.version = PNG_IMAGE_VERSION;
    im.width = (png_uint_32)w;
    im.height = (png_uint_32)h;
    im.format = PNG_FORMAT_RGB;
    png_alloc_size_t n = 0;
    assert_true(png_image_write_to_memory(&im, NULL, &n, 0, rgb, 0, NULL));
    unsigned char *buf = malloc(n);
    assert_true(png_image_write_to_memory(&im, buf, &n, 0, rgb, 0, NULL));
    free(rgb);
    *len = n;
    return buf;
}

#endif /* KPL_IMAGE_FILES_H */
