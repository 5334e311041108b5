/*
 * synth_det.c — fmnist-det, a detection set anyone can make: Fashion-MNIST
 * items pasted onto textured backgrounds, written as JPEGs plus COCO
 * instances JSON (docs/detection-data.md), so that it goes through the
 * same `--from coco` path as real COCO; and fmnist-seg, the same scenes as
 * a segmentation set (docs/segmentation-data.md): each JPEG with a PNG of
 * a class per pixel, the layout `--from masks` reads.
 *
 * Every image is a function of (seed, split, image number) alone, computed
 * in integer arithmetic, so the bytes do not depend on the thread count or
 * on how the compiler contracts floating-point expressions.
 *
 * Occlusion: items are pasted in order, each over the ones before.  A new
 * item may not leave an earlier one with less than min_visible of its
 * pixels: such a position is drawn again (up to 10 times), and an item that
 * finds no such place is not pasted at all.  So every item in an image is
 * annotated, and each annotation is the item's visible pixels: its mask is
 * the item's pixels above the threshold minus what later items cover, and
 * its box is tight around that mask.  fmnist-seg's mask is the same
 * ownership of pixels as classes: an item's visible pixels hold its label
 * + 1, the background 0.
 */
#include "convert_impl.h"

#include <dirent.h>
#include <errno.h>
#include <jansson.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <turbojpeg.h>
#include <unistd.h>

#define ITEM 28       /* Fashion-MNIST's side */
#define MAX_ITEMS 64  /* max_objects' limit */
#define PLACE_TRIES 10

static const char *const fmnist_classes[10] = {
    "T-shirt/top", "Trouser", "Pullover", "Dress", "Coat",
    "Sandal",      "Shirt",   "Sneaker",  "Bag",   "Ankle boot",
};

/* One split's source items. */
typedef struct {
    uint8_t *pix;    /* (n, 28, 28) */
    uint8_t *labels; /* (n) */
    int64_t n;
} items;

/* One object of an image, as written. */
typedef struct {
    int x0, y0, x1, y1; /* tight box, pixels [x0, x1) x [y0, y1) */
    int64_t area;
    int label;
    char *rle; /* compressed COCO RLE, malloc'd */
} synth_obj;

typedef struct {
    synth_obj obj[MAX_ITEMS];
    int nobj;
    char why[300]; /* non-empty: failed */
    bool nomem;
} synth_image;

typedef struct {
    const kpl_synth_det_config *cfg;
    const items *src;
    int split; /* 0 train, 1 val */
    const char *dir; /* where the JPEGs go */
    const char *mask_dir; /* fmnist-seg: where the masks go; NULL: fmnist-det */
    int64_t first;   /* image number of the batch's first */
    synth_image *out;
} synth_job;

static kpl_status load_items(const char *dir, const char *prefix, items *it)
{
    char ip[PATH_MAX], lp[PATH_MAX];
    memset(it, 0, sizeof *it);
    const char *ext[2] = {".gz", ""};
    for (int e = 0; e < 2; e++) {
        snprintf(ip, sizeof ip, "%s/%s-images-idx3-ubyte%s", dir, prefix, ext[e]);
        snprintf(lp, sizeof lp, "%s/%s-labels-idx1-ubyte%s", dir, prefix, ext[e]);
        if (access(ip, R_OK) == 0 && access(lp, R_OK) == 0) break;
    }
    kpl__idx_file im = {0}, lb = {0};
    kpl_status st = KPL_OK;
    KPL_TRY_GOTO(kpl__idx_open(&im, ip, 3));
    KPL_TRY_GOTO(kpl__idx_open(&lb, lp, 1));
    if (im.dims[1] != ITEM || im.dims[2] != ITEM || im.dims[0] != lb.dims[0]) {
        st = KPL_ERROR(KPL_EFORMAT, "fmnist-det: %s holds %lld x %lld x %lld images and %s %lld "
                       "labels: want 28 x 28 images, one label each", ip, (long long)im.dims[0],
                       (long long)im.dims[1], (long long)im.dims[2], lp, (long long)lb.dims[0]);
        goto fail;
    }
    it->n = im.dims[0];
    it->pix = malloc((size_t)it->n * ITEM * ITEM);
    it->labels = malloc((size_t)it->n);
    if (!it->pix || !it->labels) {
        st = KPL_ERROR(KPL_ENOMEM, "fmnist-det: no memory for %lld items", (long long)it->n);
        goto fail;
    }
    KPL_TRY_GOTO(kpl__idx_read(&im, it->pix, (size_t)it->n * ITEM * ITEM, "the images"));
    KPL_TRY_GOTO(kpl__idx_read(&lb, it->labels, (size_t)it->n, "the labels"));
    for (int64_t i = 0; i < it->n; i++)
        if (it->labels[i] > 9) {
            st = KPL_ERROR(KPL_EFORMAT, "fmnist-det: %s: label %d of item %lld is not 0..9", lp,
                           it->labels[i], (long long)i);
            goto fail;
        }
fail:
    if (im.f) gzclose(im.f);
    if (lb.f) gzclose(lb.f);
    if (st < 0) {
        free(it->pix);
        free(it->labels);
        memset(it, 0, sizeof *it);
    }
    return st;
}

static int64_t below(kpl__rng *r, int64_t n)
{
    return (int64_t)kpl__rng_below(r, (uint64_t)n);
}

/* The textured background: a linear gradient between two colors, plus
 * coarse value noise (bilinear between random grid values), plus pixel
 * noise.  (S, S, 3) u8. */
static void background(kpl__rng *r, int S, uint8_t *rgb)
{
    int c0[3], c1[3];
    for (int c = 0; c < 3; c++) {
        c0[c] = (int)below(r, 256);
        c1[c] = (int)below(r, 256);
    }
    int dx = (int)below(r, 513) - 256, dy = (int)below(r, 513) - 256;
    int norm = abs(dx) + abs(dy) + 1;
    int g = 3 + (int)below(r, 8); /* grid cells per side */
    int grid[12][12][3];
    for (int i = 0; i <= g; i++)
        for (int j = 0; j <= g; j++)
            for (int c = 0; c < 3; c++) grid[i][j][c] = (int)below(r, 81) - 40;
    for (int y = 0; y < S; y++)
        for (int x = 0; x < S; x++) {
            /* gradient position t in [0, 256] */
            int t = ((2 * x - S) * dx + (2 * y - S) * dy) * 128 / (S * norm) + 128;
            t = t < 0 ? 0 : t > 256 ? 256 : t;
            int gx = x * g * 256 / S, gy = y * g * 256 / S; /* grid coordinates, 8.8 fixed */
            int ix = gx >> 8, iy = gy >> 8, fx = gx & 255, fy = gy & 255;
            for (int c = 0; c < 3; c++) {
                int base = (c0[c] * (256 - t) + c1[c] * t) >> 8;
                int top = grid[iy][ix][c] * (256 - fx) + grid[iy][ix + 1][c] * fx;
                int bot = grid[iy + 1][ix][c] * (256 - fx) + grid[iy + 1][ix + 1][c] * fx;
                int noise = (top * (256 - fy) + bot * fy) >> 16;
                int v = base + noise + (int)below(r, 25) - 12;
                rgb[(y * S + x) * 3 + c] = (uint8_t)(v < 0 ? 0 : v > 255 ? 255 : v);
            }
        }
}

/* An item scaled to s x s (bilinear, pixel centers aligned, integer
 * arithmetic), mirrored when flip. */
static void scale_item(const uint8_t *src, int s, bool flip, uint8_t *out)
{
    for (int y = 0; y < s; y++) {
        /* source coordinate (y + 0.5) * 28 / s - 0.5, in 1/256 units */
        int sy = ((2 * y + 1) * ITEM * 256 / s - 256) / 2;
        sy = sy < 0 ? 0 : sy;
        int iy = sy >> 8, fy = sy & 255, iy1 = iy + 1 < ITEM ? iy + 1 : ITEM - 1;
        for (int x = 0; x < s; x++) {
            int sx = ((2 * x + 1) * ITEM * 256 / s - 256) / 2;
            sx = sx < 0 ? 0 : sx;
            int ix = sx >> 8, fx = sx & 255, ix1 = ix + 1 < ITEM ? ix + 1 : ITEM - 1;
            int top = src[iy * ITEM + ix] * (256 - fx) + src[iy * ITEM + ix1] * fx;
            int bot = src[iy1 * ITEM + ix] * (256 - fx) + src[iy1 * ITEM + ix1] * fx;
            out[y * s + (flip ? s - 1 - x : x)] = (uint8_t)((top * (256 - fy) + bot * fy) >> 16);
        }
    }
}

/* Makes image number i of a split: its pixels into rgb, its objects into
 * img, or with `cls` (fmnist-seg) its class per pixel (S, S) there and
 * only the count of objects into img.  owner and inten are (S, S)
 * scratch. */
static void make_image(const synth_job *j, int64_t i, uint8_t *rgb, int8_t *owner, uint8_t *inten,
                       uint8_t *item, uint8_t *mask, uint8_t *cls, synth_image *img)
{
    const kpl_synth_det_config *cfg = j->cfg;
    const int S = cfg->size, T = cfg->threshold;
    kpl__rng r = kpl__rng_key(cfg->seed, (uint64_t)j->split + 1, (uint64_t)i);
    background(&r, S, rgb);
    memset(owner, -1, (size_t)S * S);
    int want = 1 + (int)below(&r, cfg->max_objects);
    int64_t full[MAX_ITEMS], vis[MAX_ITEMS]; /* each item's pixels, and those still visible */
    int tint[MAX_ITEMS][3], label[MAX_ITEMS], n = 0;
    for (int k = 0; k < want; k++) {
        int64_t src = below(&r, j->src->n);
        int s = cfg->min_side + (int)below(&r, cfg->max_side - cfg->min_side + 1);
        bool flip = below(&r, 2);
        scale_item(j->src->pix + src * ITEM * ITEM, s, flip, item);
        int64_t area = 0;
        for (int p = 0; p < s * s; p++) area += item[p] > T;
        int px = 0, py = 0;
        bool placed = false;
        for (int t = 0; t < PLACE_TRIES && area > 0 && !placed; t++) {
            px = (int)below(&r, S - s + 1);
            py = (int)below(&r, S - s + 1);
            /* What each earlier item would keep. */
            int64_t lose[MAX_ITEMS] = {0};
            for (int y = 0; y < s; y++)
                for (int x = 0; x < s; x++) {
                    int o = owner[(py + y) * S + px + x];
                    if (o >= 0 && item[y * s + x] > T) lose[o]++;
                }
            placed = true;
            for (int e = 0; e < n && placed; e++)
                placed = (double)(vis[e] - lose[e]) >= (double)cfg->min_visible * (double)full[e];
        }
        if (!placed) continue;
        /* Its color stands out from the background under it: each channel
         * is drawn on the other side of the background's mean there. */
        int64_t sum[3] = {0, 0, 0};
        for (int y = 0; y < s; y++)
            for (int x = 0; x < s; x++)
                if (item[y * s + x] > T)
                    for (int c = 0; c < 3; c++) sum[c] += rgb[((py + y) * S + px + x) * 3 + c];
        for (int c = 0; c < 3; c++)
            tint[n][c] = sum[c] < 128 * area ? 150 + (int)below(&r, 106) : (int)below(&r, 106);
        for (int y = 0; y < s; y++)
            for (int x = 0; x < s; x++)
                if (item[y * s + x] > T) {
                    int8_t *o = &owner[(py + y) * S + px + x];
                    if (*o >= 0) vis[*o]--;
                    *o = (int8_t)n;
                    inten[(py + y) * S + px + x] = item[y * s + x];
                }
        full[n] = vis[n] = area;
        label[n] = j->src->labels[src];
        n++;
    }
    /* The items' pixels: their color, shaded by their intensity (so the
     * garment's texture shows). */
    for (int p = 0; p < S * S; p++) {
        int o = owner[p];
        if (o < 0) continue;
        int shade = 160 + inten[p] * 95 / 255;
        for (int c = 0; c < 3; c++) rgb[p * 3 + c] = (uint8_t)(tint[o][c] * shade / 255);
    }
    if (cls) {
        for (int p = 0; p < S * S; p++) cls[p] = (uint8_t)(owner[p] < 0 ? 0 : label[owner[p]] + 1);
        img->nobj = n;
        return;
    }
    img->nobj = 0;
    for (int e = 0; e < n; e++) {
        synth_obj *ob = &img->obj[img->nobj];
        int x0 = S, y0 = S, x1 = 0, y1 = 0;
        int64_t area = 0;
        for (int y = 0; y < S; y++)
            for (int x = 0; x < S; x++) {
                bool on = owner[y * S + x] == e;
                mask[y * S + x] = on;
                if (!on) continue;
                area++;
                x0 = x < x0 ? x : x0;
                y0 = y < y0 ? y : y0;
                x1 = x + 1 > x1 ? x + 1 : x1;
                y1 = y + 1 > y1 ? y + 1 : y1;
            }
        kpl_rle rle;
        if (kpl_rle_encode(mask, S, S, &rle) < 0 || kpl_rle_to_string(&rle, &ob->rle, NULL) < 0) {
            kpl_rle_free(&rle);
            img->nomem = true;
            snprintf(img->why, sizeof img->why, "%s", kpl_last_error());
            return;
        }
        kpl_rle_free(&rle);
        *ob = (synth_obj){x0, y0, x1, y1, area, label[e], ob->rle};
        img->nobj++;
    }
}

static void synth_one(int64_t b, kpl__codec *c, void *ctx)
{
    synth_job *j = ctx;
    synth_image *img = &j->out[b];
    int64_t i = j->first + b;
    const int S = j->cfg->size, side = j->cfg->max_side;
    memset(img, 0, sizeof *img);
    uint8_t *rgb = malloc((size_t)S * S * 3), *inten = malloc((size_t)S * S);
    uint8_t *item = malloc((size_t)side * side), *mask = malloc((size_t)S * S);
    int8_t *owner = malloc((size_t)S * S);
    uint8_t *cls = j->mask_dir ? malloc((size_t)S * S) : NULL, *png = NULL;
    unsigned char *jpg = NULL;
    unsigned long len = 0;
    char p[PATH_MAX];
    if (!c || !rgb || !inten || !item || !mask || !owner || (j->mask_dir && !cls)) {
        img->nomem = true;
        snprintf(img->why, sizeof img->why, "no memory");
        goto done;
    }
    make_image(j, i, rgb, owner, inten, item, mask, cls, img);
    if (img->why[0]) goto done;
    if (cls) {
        size_t plen = 0;
        if (kpl__png_encode_gray(cls, S, S, &png, &plen) < 0) {
            img->nomem = kpl_last_status() == KPL_ENOMEM;
            snprintf(img->why, sizeof img->why, "%s", kpl_last_error());
            goto done;
        }
        snprintf(p, sizeof p, "%s/%06lld.png", j->mask_dir, (long long)i + 1);
        FILE *f = fopen(p, "wb");
        bool ok = f && fwrite(png, 1, plen, f) == plen;
        if (f) ok &= fclose(f) == 0;
        if (!ok) {
            snprintf(img->why, sizeof img->why, "%.200s: %s", p, strerror(errno));
            goto done;
        }
    }
    tjhandle tj = kpl__codec_encoder(c);
    if (tjCompress2(tj, rgb, S, 0, S, TJPF_RGB, &jpg, &len, TJSAMP_420, j->cfg->quality, 0)) {
        snprintf(img->why, sizeof img->why, "JPEG encode: %s", tjGetErrorStr2(tj));
        goto done;
    }
    snprintf(p, sizeof p, "%s/%06lld.jpg", j->dir, (long long)i + 1);
    FILE *f = fopen(p, "wb");
    bool ok = f && fwrite(jpg, 1, len, f) == len;
    if (f) ok &= fclose(f) == 0;
    if (!ok) snprintf(img->why, sizeof img->why, "%.200s: %s", p, strerror(errno));
done:
    tjFree(jpg);
    free(png);
    free(cls);
    free(rgb);
    free(inten);
    free(item);
    free(mask);
    free(owner);
}

/* A COCO instances object for one split, filled image by image. */
static json_t *coco_skeleton(const kpl_synth_det_config *cfg, const char *split)
{
    json_t *cats = json_array();
    for (int c = 0; c < 10; c++)
        json_array_append_new(cats, json_pack("{s:i, s:s, s:s}", "id", c + 1, "name",
                                              fmnist_classes[c], "supercategory", "fashion"));
    return json_pack("{s:{s:s, s:s, s:s, s:I, s:i, s:i, s:i, s:i, s:i, s:f}, s:o, s:[], s:[]}",
                     "info", "description", "kpl fmnist-det: Fashion-MNIST items on textured "
                     "backgrounds (docs/detection-data.md)", "version", "1", "split", split,
                     "seed", (json_int_t)cfg->seed, "size", cfg->size, "min_side", cfg->min_side,
                     "max_side", cfg->max_side, "max_objects", cfg->max_objects, "threshold",
                     cfg->threshold, "min_visible", (double)cfg->min_visible, "categories", cats,
                     "images", "annotations");
}

/* Adds a batch's images and objects to the split's JSON. */
static kpl_status add_batch(json_t *root, const char *split, int S, int64_t first,
                            const synth_image *imgs, int64_t nb, int64_t *next_ann)
{
    json_t *images = json_object_get(root, "images"), *anns = json_object_get(root, "annotations");
    for (int64_t b = 0; b < nb; b++) {
        const synth_image *img = &imgs[b];
        int64_t id = first + b + 1;
        char file[32];
        snprintf(file, sizeof file, "%06lld.jpg", (long long)id);
        bool ok = !json_array_append_new(images,
                                         json_pack("{s:I, s:s, s:i, s:i}", "id", (json_int_t)id,
                                                   "file_name", file, "width", S, "height", S));
        for (int k = 0; k < img->nobj && ok; k++) {
            const synth_obj *o = &img->obj[k];
            json_t *a = json_pack("{s:I, s:I, s:i, s:[i, i, i, i], s:I, s:i, s:{s:[i, i], s:s}}",
                                  "id", (json_int_t)(*next_ann)++, "image_id", (json_int_t)id,
                                  "category_id", o->label + 1, "bbox", o->x0, o->y0,
                                  o->x1 - o->x0, o->y1 - o->y0, "area", (json_int_t)o->area,
                                  "iscrowd", 0, "segmentation", "size", S, S, "counts", o->rle);
            ok = !json_array_append_new(anns, a);
        }
        KPL_CHECK(ok, KPL_ENOMEM, "fmnist-det: %s: no memory for the JSON", split);
    }
    return KPL_OK;
}

/* Whether dir is absent or empty; creates it. */
static kpl_status fresh_dir(const char *name, const char *dir)
{
    DIR *d = opendir(dir);
    if (d) {
        struct dirent *e;
        bool empty = true;
        while ((e = readdir(d)))
            if (strcmp(e->d_name, ".") && strcmp(e->d_name, "..")) empty = false;
        closedir(d);
        KPL_CHECK(empty, KPL_EINVAL, "%s: %s holds files: the set is written only into "
                  "a new or empty directory", name, dir);
        return KPL_OK;
    }
    if (kpl__mkdirs(dir) < 0) return kpl_error_prefix(kpl_last_status(), "%s: ", name);
    return KPL_OK;
}

/* fmnist-seg's split: n images into out_dir/<split>/images/ and their
 * masks into out_dir/<split>/masks/. */
static kpl_status make_seg_split(const char *out_dir, const char *split, int sn, const items *src,
                                 const kpl_synth_det_config *cfg, int64_t n, int64_t *objects)
{
    enum { BATCH = 256 };
    char dir[PATH_MAX], img_dir[PATH_MAX], mask_dir[PATH_MAX], name[64];
    KPL_TRY(kpl__path_join(dir, sizeof dir, out_dir, split));
    KPL_TRY(kpl__path_join(img_dir, sizeof img_dir, dir, "images"));
    KPL_TRY(kpl__path_join(mask_dir, sizeof mask_dir, dir, "masks"));
    const char *mk[3] = {dir, img_dir, mask_dir};
    for (int k = 0; k < 3; k++)
        KPL_CHECK(mkdir(mk[k], 0777) == 0, KPL_EIO, "fmnist-seg: %s: %s", mk[k], strerror(errno));
    synth_image *out = calloc(BATCH, sizeof *out);
    KPL_CHECK(out, KPL_ENOMEM, "fmnist-seg: no memory");
    kpl_convert_options po = KPL_CONVERT_OPTIONS_INIT;
    po.progress = cfg->progress;
    snprintf(name, sizeof name, "fmnist-seg %s", split);
    po.label = name;
    kpl__progress pr;
    kpl__progress_init(&pr, &po, NULL);
    kpl_status st = KPL_OK;
    for (int64_t b0 = 0; b0 < n && st == KPL_OK; b0 += BATCH) {
        int64_t nb = n - b0 < BATCH ? n - b0 : BATCH;
        synth_job job = {cfg, src, sn, img_dir, mask_dir, b0, out};
        kpl__convert_parallel(nb, cfg->threads, synth_one, &job);
        for (int64_t b = 0; b < nb && st == KPL_OK; b++) {
            if (out[b].why[0])
                st = KPL_ERROR(out[b].nomem ? KPL_ENOMEM : KPL_EIO, "fmnist-seg: %s image %lld: "
                               "%s", split, (long long)(b0 + b + 1), out[b].why);
            *objects += out[b].nobj;
        }
        if (st == KPL_OK)
            st = kpl__progress_update(&pr, (uint64_t)(b0 + nb), (uint64_t)n, "images");
    }
    free(out);
    return st;
}

/* One split: n images into out_dir/<split>/ and out_dir/<split>.json. */
static kpl_status make_split(const char *out_dir, const char *split, int sn, const items *src,
                             const kpl_synth_det_config *cfg, int64_t n, int64_t *objects)
{
    enum { BATCH = 256 };
    char dir[PATH_MAX], name[64];
    KPL_TRY(kpl__path_join(dir, sizeof dir, out_dir, split));
    KPL_CHECK(mkdir(dir, 0777) == 0, KPL_EIO, "fmnist-det: %s: %s", dir, strerror(errno));
    json_t *root = coco_skeleton(cfg, split);
    synth_image *out = calloc(BATCH, sizeof *out);
    char *text = NULL;
    kpl_status st = KPL_OK;
    if (!root || !out) {
        st = KPL_ERROR(KPL_ENOMEM, "fmnist-det: no memory");
        goto fail;
    }
    kpl_convert_options po = KPL_CONVERT_OPTIONS_INIT;
    po.progress = cfg->progress;
    snprintf(name, sizeof name, "fmnist-det %s", split);
    po.label = name;
    kpl__progress pr;
    kpl__progress_init(&pr, &po, NULL);
    int64_t next_ann = 1;
    for (int64_t b0 = 0; b0 < n && st == KPL_OK; b0 += BATCH) {
        int64_t nb = n - b0 < BATCH ? n - b0 : BATCH;
        synth_job job = {cfg, src, sn, dir, NULL, b0, out};
        kpl__convert_parallel(nb, cfg->threads, synth_one, &job);
        for (int64_t b = 0; b < nb && st == KPL_OK; b++)
            if (out[b].why[0])
                st = KPL_ERROR(out[b].nomem ? KPL_ENOMEM : KPL_EIO, "fmnist-det: %s image %lld: "
                               "%s", split, (long long)(b0 + b + 1), out[b].why);
        if (st == KPL_OK) st = add_batch(root, split, cfg->size, b0, out, nb, &next_ann);
        for (int64_t b = 0; b < nb; b++)
            for (int k = 0; k < out[b].nobj; k++) free(out[b].obj[k].rle);
        if (st == KPL_OK)
            st = kpl__progress_update(&pr, (uint64_t)(b0 + nb), (uint64_t)n, "images");
    }
    if (st < 0) goto fail;
    *objects += next_ann - 1;
    text = json_dumps(root, JSON_COMPACT | JSON_PRESERVE_ORDER);
    if (!text) {
        st = KPL_ERROR(KPL_ENOMEM, "fmnist-det: no memory for %s.json", split);
        goto fail;
    }
    snprintf(name, sizeof name, "%s.json", split);
    st = kpl__write_text(out_dir, name, text, strlen(text));
fail:
    free(text);
    free(out);
    json_decref(root);
    return st;
}

/* Either set: fmnist-seg when seg. */
static kpl_status synth(const char *out_dir, const kpl_synth_det_config *cfg, bool seg,
                        int64_t *objects)
{
    const char *nm = seg ? "fmnist-seg" : "fmnist-det";
    kpl_synth_det_config c = KPL_SYNTH_DET_CONFIG_INIT;
    if (cfg) c = *cfg;
    KPL_CHECK(c.size >= 32 && c.size <= 4096, KPL_EINVAL,
              "%s: size %d must be in [32, 4096]", nm, c.size);
    KPL_CHECK(c.min_side >= 8 && c.min_side <= c.max_side && c.max_side <= c.size, KPL_EINVAL,
              "%s: item sides %d..%d must satisfy 8 <= min <= max <= size (%d)", nm,
              c.min_side, c.max_side, c.size);
    KPL_CHECK(c.max_objects >= 1 && c.max_objects <= MAX_ITEMS, KPL_EINVAL,
              "%s: max_objects %d must be in [1, %d]", nm, c.max_objects, MAX_ITEMS);
    KPL_CHECK(c.threshold >= 0 && c.threshold <= 254, KPL_EINVAL,
              "%s: threshold %d must be in [0, 254]", nm, c.threshold);
    KPL_CHECK(c.min_visible >= 0 && c.min_visible <= 1, KPL_EINVAL,
              "%s: min_visible %g must be in [0, 1]", nm, (double)c.min_visible);
    KPL_CHECK(c.quality >= 1 && c.quality <= 100, KPL_EINVAL,
              "%s: quality %d must be in [1, 100]", nm, c.quality);
    KPL_CHECK(c.train >= 0 && c.val >= 0 && c.train + c.val > 0 && c.train < 100000000 &&
                  c.val < 100000000, KPL_EINVAL,
              "%s: train %lld and val %lld: want 0 .. 10^8 - 1 each, not both 0", nm,
              (long long)c.train, (long long)c.val);
    KPL_CHECK(c.fmnist_dir, KPL_EINVAL, "%s: no Fashion-MNIST directory", nm);
    KPL_TRY(fresh_dir(nm, out_dir));
    int64_t nobj = 0;
    kpl_status st = KPL_OK;
    static const char *const splits[2] = {"train", "val"}, *const prefix[2] = {"train", "t10k"};
    int64_t counts[2] = {c.train, c.val};
    for (int s = 0; s < 2 && st == KPL_OK; s++) {
        if (!counts[s]) continue;
        items src;
        st = load_items(c.fmnist_dir, prefix[s], &src);
        if (st == KPL_OK)
            st = seg ? make_seg_split(out_dir, splits[s], s, &src, &c, counts[s], &nobj)
                     : make_split(out_dir, splits[s], s, &src, &c, counts[s], &nobj);
        free(src.pix);
        free(src.labels);
    }
    if (st == KPL_OK && seg) {
        const char *lines[11] = {"background"};
        for (int k = 0; k < 10; k++) lines[k + 1] = fmnist_classes[k];
        st = kpl__write_lines(out_dir, "classes.txt", (char *const *)lines, 11);
    }
    if (st == KPL_OK && objects) *objects = nobj;
    return st;
}

kpl_status kpl_synth_fmnist_det(const char *out_dir, const kpl_synth_det_config *cfg,
                                int64_t *objects)
{
    return synth(out_dir, cfg, false, objects);
}

kpl_status kpl_synth_fmnist_seg(const char *out_dir, const kpl_synth_det_config *cfg,
                                int64_t *objects)
{
    return synth(out_dir, cfg, true, objects);
}
