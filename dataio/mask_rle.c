/*
 * mask_rle.c — COCO's run-length encoding of binary masks, its compressed
 * string form, and polygons rasterised the way pycocotools does
 * (docs/kplrecord.md, "Masks" and "Polygons").
 *
 * Written from the definitions, so that a mask kpl stores is the very mask
 * pycocotools computes for the same annotation: COCO's evaluation of
 * segmentations (and every model trained on COCO masks) uses that
 * rasterisation, whose boundary rounding is its own.
 */
#include "dataio_impl.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>

/* Pixels a mask may have: counts are u32 (and the loader's image limit is
 * 2^28 pixels anyway). */
#define MAX_PIXELS 0xffffffffll
/* A polygon coordinate's magnitude limit: keeps every product below in
 * range and the boundary walk bounded by the image-sized work it does. */
#define MAX_COORD 16777216.0
/* The boundary walk's steps (a fifth of a pixel each) a polygon may take. */
#define MAX_WALK ((int64_t)1 << 26)

static kpl_status check_size(int64_t h, int64_t w)
{
    KPL_CHECK(h >= 1 && w >= 1 && h <= MAX_PIXELS / w, KPL_EINVAL,
              "mask size %lld x %lld: want 1 .. 2^32 - 1 pixels", (long long)h, (long long)w);
    return KPL_OK;
}

void kpl_rle_free(kpl_rle *r)
{
    if (!r) return;
    free(r->counts);
    memset(r, 0, sizeof *r);
}

int64_t kpl_rle_area(const kpl_rle *r)
{
    int64_t a = 0;
    for (int64_t i = 1; i < r->n; i += 2) a += r->counts[i];
    return a;
}

kpl_status kpl_rle_encode(const uint8_t *mask, int64_t h, int64_t w, kpl_rle *out)
{
    memset(out, 0, sizeof *out);
    KPL_TRY(check_size(h, w));
    /* Runs change at most at every pixel: count them first. */
    int64_t n = 1;
    uint8_t prev = 0;
    for (int64_t x = 0; x < w; x++)
        for (int64_t y = 0; y < h; y++) {
            uint8_t v = mask[y * w + x] != 0;
            n += v != prev;
            prev = v;
        }
    uint32_t *c = malloc(sizeof *c * (size_t)n);
    KPL_CHECK(c, KPL_ENOMEM, "RLE of a %lld x %lld mask: no memory", (long long)h,
              (long long)w);
    int64_t k = 0;
    uint32_t run = 0;
    prev = 0;
    for (int64_t x = 0; x < w; x++)
        for (int64_t y = 0; y < h; y++) {
            uint8_t v = mask[y * w + x] != 0;
            if (v != prev) {
                c[k++] = run;
                run = 0;
                prev = v;
            }
            run++;
        }
    c[k++] = run;
    *out = (kpl_rle){h, w, k, c};
    return KPL_OK;
}

kpl_status kpl_rle_decode(const kpl_rle *r, uint8_t *mask)
{
    KPL_TRY(check_size(r->h, r->w));
    int64_t total = 0;
    for (int64_t i = 0; i < r->n; i++) total += r->counts[i];
    KPL_CHECK(total == r->h * r->w, KPL_EFORMAT,
              "RLE of a %lld x %lld mask: its runs cover %lld pixels", (long long)r->h,
              (long long)r->w, (long long)total);
    int64_t p = 0, h = r->h, w = r->w;
    for (int64_t i = 0; i < r->n; i++) {
        uint8_t v = (uint8_t)(i & 1);
        for (int64_t e = p + r->counts[i]; p < e; p++) mask[(p % h) * w + p / h] = v;
    }
    return KPL_OK;
}

/* The string form: each count (from the fourth on, its difference from the
 * count two before it) as a signed little-endian sequence of 5-bit groups,
 * each group a character 48 + group, with 32 added to every group but the
 * last of a value; the last group's bit 4 is the sign. */
kpl_status kpl_rle_to_string(const kpl_rle *r, char **s, size_t *len)
{
    *s = NULL;
    /* A u32 difference needs at most 7 groups of 5 bits. */
    char *t = malloc((size_t)r->n * 7 + 1);
    KPL_CHECK(t, KPL_ENOMEM, "RLE string of %lld runs: no memory", (long long)r->n);
    size_t p = 0;
    for (int64_t i = 0; i < r->n; i++) {
        int64_t x = r->counts[i];
        if (i > 2) x -= r->counts[i - 2];
        bool more = true;
        while (more) {
            int c = (int)(x & 0x1f);
            x >>= 5; /* arithmetic: the sign carries */
            more = (c & 0x10) ? x != -1 : x != 0;
            if (more) c |= 0x20;
            t[p++] = (char)(c + 48);
        }
    }
    t[p] = 0;
    *s = t;
    if (len) *len = p;
    return KPL_OK;
}

kpl_status kpl_rle_from_string(const char *s, size_t len, int64_t h, int64_t w, kpl_rle *out)
{
    memset(out, 0, sizeof *out);
    KPL_TRY(check_size(h, w));
    /* At most one count per character. */
    uint32_t *c = malloc(sizeof *c * (len ? len : 1));
    KPL_CHECK(c, KPL_ENOMEM, "RLE string of %zu bytes: no memory", len);
    int64_t m = 0, total = 0, hw = h * w;
    size_t p = 0;
    while (p < len) {
        int64_t x = 0;
        int k = 0;
        bool more = true;
        while (more) {
            if (p >= len) {
                free(c);
                return KPL_ERROR(KPL_EFORMAT, "RLE string ends inside the value of run %lld",
                                 (long long)m);
            }
            int ch = (unsigned char)s[p] - 48;
            if (ch < 0 || ch > 63) {
                free(c);
                return KPL_ERROR(KPL_EFORMAT, "RLE string: byte %zu is 0x%02x, not one of "
                                 "'0'..'o'", p, (unsigned char)s[p]);
            }
            if (k == 7) {
                free(c);
                return KPL_ERROR(KPL_EFORMAT, "RLE string: the value of run %lld is longer "
                                 "than 7 characters", (long long)m);
            }
            x |= (int64_t)(ch & 0x1f) << (5 * k);
            more = ch & 0x20;
            p++;
            k++;
            if (!more && (ch & 0x10)) x -= (int64_t)1 << (5 * k); /* sign-extend */
        }
        if (m > 2) x += c[m - 2];
        if (x < 0 || x > hw - total) {
            free(c);
            return KPL_ERROR(KPL_EFORMAT, "RLE string: run %lld is %lld, %s", (long long)m,
                             (long long)x, x < 0 ? "negative" : "past the mask's end");
        }
        c[m++] = (uint32_t)x;
        total += x;
    }
    if (total != hw) {
        free(c);
        return KPL_ERROR(KPL_EFORMAT, "RLE string: its runs cover %lld pixels of the %lld x "
                         "%lld mask", (long long)total, (long long)h, (long long)w);
    }
    *out = (kpl_rle){h, w, m, c};
    return KPL_OK;
}

static int cmp_i64(const void *a, const void *b)
{
    int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return (x > y) - (x < y);
}

/* The crossings of a polygon's boundary walk with the pixel columns'
 * center lines, gathered as run starts/ends (column-major pixel numbers). */
typedef struct {
    int64_t h, w;
    int64_t pu, pv; /* the walk's previous point */
    bool started;
    int64_t *t;
    int64_t n, cap;
} walk;

/* The walk's next point (u, v), in scaled units.  A step between scaled x
 * 5c + 2 and 5c + 3 crosses column c's center line, at the row ceil of
 * (the lower scaled y - 2) / 5, clamped to [0, h]. */
static bool walk_to(walk *k, int64_t u, int64_t v)
{
    int64_t pu = k->pu, pv = k->pv;
    bool first = !k->started;
    k->pu = u;
    k->pv = v;
    k->started = true;
    if (first || u == pu) return true;
    int64_t q = u < pu ? u : u - 1;
    if (q < 2 || (q - 2) % 5 != 0) return true;
    int64_t col = (q - 2) / 5;
    if (col > k->w - 1) return true;
    int64_t c = (v < pv ? v : pv) - 2;
    int64_t row = c <= 0 ? 0 : (c + 4) / 5;
    if (row > k->h) row = k->h;
    if (k->n == k->cap) {
        int64_t cap = k->cap ? 2 * k->cap : 64;
        int64_t *nt = realloc(k->t, sizeof *nt * (size_t)cap);
        if (!nt) return false;
        k->t = nt;
        k->cap = cap;
    }
    k->t[k->n++] = col * k->h + row;
    return true;
}

/* pycocotools' frPoly, from its definition: the vertices are scaled by 5
 * and rounded ((int)(5 x + 0.5), truncating towards zero); each edge is
 * walked one scaled unit at a time along its major axis from its lower end
 * (each step's minor coordinate rounded the same way), so that rounding
 * does not depend on its direction; wherever the closed walk crosses a
 * pixel column's center line (x + 0.5) inside the image, a run of that
 * column starts or ends (walk_to); runs are filled by parity over the
 * column-major pixel order. */
kpl_status kpl_mask_fill_polygon(const double *xy, int64_t npoints, int64_t h, int64_t w,
                                 uint8_t *mask)
{
    KPL_TRY(check_size(h, w));
    KPL_CHECK(npoints >= 1, KPL_EINVAL, "polygon without points");
    for (int64_t j = 0; j < 2 * npoints; j++)
        KPL_CHECK(isfinite(xy[j]) && fabs(xy[j]) <= MAX_COORD, KPL_ERANGE,
                  "polygon coordinate %lld is %g: not finite, or past +-2^24",
                  (long long)j, xy[j]);
    /* The walk takes max(|dx|, |dy|) + 1 steps an edge: bound the work
     * before doing it (a legitimate polygon's perimeter is far shorter). */
    int64_t steps = 0;
    for (int64_t j = 0; j < npoints; j++) {
        int64_t e = j + 1 < npoints ? j + 1 : 0;
        double dx = fabs(5 * xy[2 * e] - 5 * xy[2 * j]);
        double dy = fabs(5 * xy[2 * e + 1] - 5 * xy[2 * j + 1]);
        steps += (int64_t)(dx > dy ? dx : dy) + 2;
        KPL_CHECK(steps <= MAX_WALK, KPL_ERANGE, "polygon of %lld points: its perimeter is past "
                  "%lld pixels", (long long)npoints, (long long)(MAX_WALK / 5));
    }
    walk k = {h, w, 0, 0, false, NULL, 0, 0};
    bool ok = true;
    for (int64_t j = 0; j < npoints && ok; j++) {
        int64_t e = j + 1 < npoints ? j + 1 : 0;
        int64_t xs = (int64_t)(5 * xy[2 * j] + 0.5), ys = (int64_t)(5 * xy[2 * j + 1] + 0.5);
        int64_t xe = (int64_t)(5 * xy[2 * e] + 0.5), ye = (int64_t)(5 * xy[2 * e + 1] + 0.5);
        int64_t dx = llabs(xe - xs), dy = llabs(ys - ye);
        if (dx == 0 && dy == 0) { /* a repeated vertex: one point */
            ok = walk_to(&k, xs, ys);
            continue;
        }
        bool flip = (dx >= dy && xs > xe) || (dx < dy && ys > ye);
        if (flip) {
            int64_t q = xs;
            xs = xe;
            xe = q;
            q = ys;
            ys = ye;
            ye = q;
        }
        int64_t n = dx >= dy ? dx : dy;
        double s = dx >= dy ? (double)(ye - ys) / (double)dx : (double)(xe - xs) / (double)dy;
        for (int64_t d = 0; d <= n && ok; d++) {
            int64_t i = flip ? n - d : d;
            int64_t minor = (int64_t)((double)(dx >= dy ? ys : xs) + s * (double)i + 0.5);
            ok = dx >= dy ? walk_to(&k, xs + i, minor) : walk_to(&k, minor, ys + i);
        }
    }
    if (!ok) {
        free(k.t);
        return KPL_ERROR(KPL_ENOMEM, "polygon of %lld points: no memory", (long long)npoints);
    }
    if (k.n) qsort(k.t, (size_t)k.n, sizeof *k.t, cmp_i64);
    for (int64_t r = 0; r < k.n; r += 2) {
        int64_t a = k.t[r], b = r + 1 < k.n ? k.t[r + 1] : h * w;
        for (int64_t p = a; p < b; p++) mask[(p % h) * w + p / h] = 1;
    }
    free(k.t);
    return KPL_OK;
}
