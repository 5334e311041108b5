/*
 * cmd_data.c — `kpl data`: convert datasets to KPLRecord, inspect and
 * verify them (docs/kplrecord.md).
 *
 *   kpl data convert --from idx SRC OUT [--labels FILE] [writer options]
 *   kpl data convert --from cifar SRC OUT [writer options]
 *   kpl data convert --from imagefolder|images ROOT OUT [options]
 *   kpl data convert --from coco ANNOTATIONS.json IMAGE_DIR OUT [options]
 *   kpl data convert --from voc VOC_ROOT OUT --split SPLIT [options]
 *   kpl data convert --from voc-seg VOC_ROOT OUT --split SPLIT [--masks-dir NAME] [options]
 *   kpl data convert --from masks IMAGE_DIR MASK_DIR OUT [--classes FILE] [options]
 *   kpl data synth fmnist-det|fmnist-seg OUT [--train N] [--val M] [--size S] [--seed S]
 *                                 [--objects N] [--sides A B] [--min-visible F]
 *   kpl data inspect DIR
 *   kpl data verify DIR
 *   kpl data cocoeval GT.json DETECTIONS.json [--iou-type bbox]
 *   kpl data fid-net [--recipe R] [-o FILE] [--force] [KEY=VALUE ...]
 */
#include "cli.h" /* trainer.h: cocoeval.h, fid.h, stop requests */
#include "dataio.h"

#include <dirent.h>
#include <errno.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

static void usage(FILE *f)
{
    fprintf(f,
            "usage: kpl data <command> ...\n"
            "\n"
            "  convert --from idx SRC OUT [options]\n"
            "      SRC is an IDX images file (gzip or not; the labels file is found by\n"
            "      name or given with --labels), or a directory of MNIST-style files:\n"
            "      every <prefix>-images-idx3-ubyte[.gz] becomes OUT/<split>, where\n"
            "      split is 'train' for train, 'test' for t10k, else the prefix.\n"
            "  convert --from cifar SRC OUT [options]\n"
            "      CIFAR-10 or CIFAR-100, binary or python version, found from the files in\n"
            "      SRC (the extracted folder, e.g. cifar-10-batches-py, or the folder\n"
            "      holding it): OUT/train and OUT/test with image (raw 32x32x3 RGB), label\n"
            "      (CIFAR-100: the fine label) and for CIFAR-100 coarse_label, in file\n"
            "      order; OUT/<split>/classes.txt (and coarse_classes.txt) from the meta\n"
            "      files.  The python version's pickles are read without running them.\n"
            "  convert --from lmdb SRC OUT [options]\n"
            "      SRC is a Caffe Datum LMDB database (a directory or a .mdb file),\n"
            "      opened read-only; encoded or raw Datums, in key order.\n"
            "  convert --from coco ANNOTATIONS.json IMAGE_DIR OUT [options]\n"
            "      COCO instances (boxes, labels, crowd flags, areas, masks as COCO RLE), one\n"
            "      example per image in image id order; labels = categories in id order\n"
            "      (OUT/classes.txt, OUT/categories.json); images decoded whole as a check.\n"
            "  convert --from voc VOC_ROOT OUT --split SPLIT [options]\n"
            "      Pascal VOC: ImageSets/Main/SPLIT.txt, Annotations/, JPEGImages/; boxes,\n"
            "      the 20 classes in the standard order, difficult flags.\n"
            "    --drop-empty      (coco, voc) leave out images without objects\n"
            "    --skip-bad        (coco, voc) leave out bad annotations and images (box\n"
            "                      outside the image, zero area, unknown category, missing\n"
            "                      or undecodable file, wrong size) with a warning each\n"
            "    --semantic        (coco) also a class-per-pixel `mask` PNG: 0 background,\n"
            "                      label + 1, 255 crowd regions and overlaps of classes\n"
            "  convert --from voc-seg VOC_ROOT OUT --split SPLIT [options]\n"
            "      Pascal VOC segmentation: ImageSets/Segmentation/SPLIT.txt, JPEGImages/,\n"
            "      masks (palette indices: 0 background, 1..20, 255 ignore); OUT/classes.txt.\n"
            "    --masks-dir NAME  the masks' directory under VOC_ROOT (default:\n"
            "                      SegmentationClass, or SegmentationClassAug (SBD's aug set)\n"
            "                      when that one holds every listed mask)\n"
            "  convert --from masks IMAGE_DIR MASK_DIR OUT [options]\n"
            "      images (.jpg/.jpeg/.png) with the PNG masks of the same file stem.\n"
            "    --classes FILE    class names, one a line (line k: mask value k); every\n"
            "                      mask value must then be a class or 255; OUT/classes.txt\n"
            "    --skip-bad        (voc-seg, masks) leave out bad pairs (a missing, truncated\n"
            "                      or corrupt file, a mask of another size, a value that is\n"
            "                      no class) with a warning each\n"
            "  convert --from imagefolder ROOT OUT [options]\n"
            "      ROOT/<class>/<image>.{jpg,jpeg,png}; class index = sorted folder order\n"
            "      (OUT/classes.txt); each image decoded whole as a check, then kept as\n"
            "      its original bytes.\n"
            "  convert --from images ROOT OUT [options]\n"
            "      every .jpg/.jpeg/.png under ROOT, subfolders included, without classes\n"
            "      (a GAN's data): features image and path, no label; checked and stored\n"
            "      as imagefolder does, and its options apply.\n"
            "    --max-side N      re-encode JPEGs whose longer side exceeds N at N\n"
            "                      (upright by their EXIF orientation)\n"
            "    --quality Q       JPEG quality of re-encoded images (default 90)\n"
            "    --seed S          shuffle seed of the example order (default 0)\n"
            "    --keep-order      keep the sorted folder walk order instead\n"
            "    --skip-bad        skip images that do not decode whole (truncated, corrupt,\n"
            "                      too large) with a warning naming each (default: error)\n"
            "    --threads N       reading/checking threads (default: all cores)\n"
            "    --shards N        shard count (default 1)\n"
            "    --chunk-mb X      raw chunk size in MiB (default 4)\n"
            "    --zstd-level L    0 (off) to 19 (default 3)\n"
            "    --quiet           no progress line\n"
            "    OUT may hold what a conversion that died left (its WRITING marker):\n"
            "    that is removed first; a finished dataset or other files are refused.\n"
            "  synth fmnist-det OUT [options]\n"
            "      a synthetic detection set: Fashion-MNIST items (Debian's\n"
            "      dataset-fashion-mnist) pasted at random scales, places and counts onto\n"
            "      textured backgrounds; OUT/{train,val}/*.jpg and OUT/{train,val}.json\n"
            "      (COCO, masks as RLE), for --from coco.  The same seed gives the same bytes.\n"
            "  synth fmnist-seg OUT [options]\n"
            "      the same scenes as a segmentation set: OUT/{train,val}/images/*.jpg,\n"
            "      OUT/{train,val}/masks/*.png (0 background, label + 1) and\n"
            "      OUT/classes.txt, for --from masks (with --classes OUT/classes.txt).\n"
            "    --train N --val M number of images (default 2000, 500)\n"
            "    --size S          image side (default 128)\n"
            "    --objects N       1..N items an image (default 8)\n"
            "    --sides A B       an item's side is A..B px (default 20 90)\n"
            "    --min-visible F   an item keeps at least this share of its pixels\n"
            "                      under later ones (default 0.5; 1: no occlusion)\n"
            "    --seed S          (default 0)\n"
            "    --fmnist DIR      Fashion-MNIST's IDX files (default\n"
            "                      /usr/share/datasets/fashion-mnist)\n"
            "    --threads N, --quiet\n"
            "  inspect DIR         a JSON summary: counts, schema, shards, bytes\n"
            "  verify DIR          read everything and check every checksum, and every\n"
            "                      record against METADATA's fixed shapes\n"
            "  cocoeval GT.json DETECTIONS.json [--iou-type bbox]\n"
            "                      COCO box mAP of a results file against COCO instances\n"
            "                      ground truth: pycocotools' 12 summary figures as one JSON\n"
            "                      object (docs/cocoeval.md)\n"
            "  fid-net [--recipe R] [-o FILE] [--force] [KEY=VALUE ...]\n"
            "                      the feature network of FID and the Inception Score\n"
            "                      (docs/fid.md), which a GAN recipe's task.gan.fid_network\n"
            "                      names: trains recipe R (default %s)\n"
            "                      with the overrides, as kpl train does, in a run directory\n"
            "                      beside FILE that goes after, and keeps its final checkpoint\n"
            "                      as FILE (default %s), unless FILE\n"
            "                      exists (--force: train again; FILE is replaced when the\n"
            "                      new one is complete).  One JSON line on stdout says what it\n"
            "                      is; the training's lines go to stderr.  A stop (SIGINT,\n"
            "                      SIGTERM) exits 128 + the signal, leaving FILE as it was\n",
            KPL_FID_DEFAULT_RECIPE, KPL_FID_DEFAULT_NETWORK);
}

static int fail(const char *cmd)
{
    fprintf(stderr, "kpl data %s: %s\n", cmd, kpl_last_error());
    return 1;
}

static bool parse_num(const char *s, double lo, double hi, double *v)
{
    char *end;
    errno = 0;
    *v = strtod(s, &end);
    return !errno && end != s && !*end && *v >= lo && *v <= hi;
}

/* What a conversion that died left in `out` (its WRITING marker, which
 * nobody holds locked) is removed, saying so, so that converting again is
 * the cure `kpl data verify` advises.  A live writer's files, a finished
 * dataset and files no writer makes are left alone: the live writer is
 * named here, the others are refused by the writer as before.  Runs with
 * the conversion lock of out's directory held. */
static int clear_dead_writer(const char *out)
{
    kpl_writer_state ws;
    char who[300];
    if (kpl_dataset_writer_state(out, &ws, who, sizeof who) < 0) return fail("convert");
    if (ws == KPL_WRITER_NONE) return 0;
    if (ws == KPL_WRITER_ALIVE) {
        fprintf(stderr, "kpl data convert: %s is being written by another process (%s); not "
                        "touched\n", out, who);
        return 1;
    }
    if (kpl_dataset_remove_unfinished(out) < 0) return fail("convert");
    fprintf(stderr, "kpl data convert: removed %s, left unfinished by an interrupted conversion "
                    "(%s)\n", out, who);
    return 0;
}

/* Before each dataset a conversion writes: what a dead conversion left
 * goes (clear_dead_writer); a live writer's set stops the run. */
static kpl_status before_dataset(const char *out, void *ctx)
{
    (void)ctx;
    int rc = clear_dead_writer(out);
    if (rc == 0) return KPL_OK;
    return KPL_ERROR(KPL_ESTATE, "%s: not converted (said above)", out);
}

/* After each: its record on stdout, what was left out on stderr. */
static void after_dataset(const char *src, const char *out, const kpl_convert_result *r,
                          double seconds, void *ctx)
{
    const kpl_converter *c = ctx;
    printf("{\"event\":\"converted\",\"from\":\"%s\",\"src\":\"%s\",\"out\":\"%s\","
           "\"examples\":%lld", c->name, src, out, (long long)r->examples);
    if (c->flags & KPL_CONVERT_REPORTS_SKIPPED) {
        if (r->skipped)
            fprintf(stderr, "kpl data convert: skipped %lld bad inputs (each named above)\n",
                    (long long)r->skipped);
        printf(",\"skipped\":%lld", (long long)r->skipped);
    }
    if (c->flags & KPL_CONVERT_REPORTS_OBJECTS) {
        const kpl_detection_stats *d = &r->det;
        if (d->skipped_images || d->skipped_objects)
            fprintf(stderr, "kpl data convert: skipped %lld bad images and %lld bad objects "
                            "(each named above)\n", (long long)d->skipped_images,
                    (long long)d->skipped_objects);
        printf(",\"objects\":%lld,\"skipped_images\":%lld,\"skipped_objects\":%lld,"
               "\"dropped_empty\":%lld,\"clipped_boxes\":%lld,\"dropped_polygons\":%lld",
               (long long)d->objects, (long long)d->skipped_images, (long long)d->skipped_objects,
               (long long)d->dropped_empty, (long long)d->clipped_boxes,
               (long long)d->dropped_polygons);
    }
    printf(",\"seconds\":%.2f}\n", seconds);
    fflush(stdout);
}

static bool keep_waiting(const char *lock, double waited, void *ctx);

/* The options given that c does not take: KPL_CONVERT_TAKES_* bits. */
static int check_takes(const kpl_converter *c, unsigned given)
{
    static const struct {
        unsigned bit;
        const char *opt;
    } opts[] = {
        {KPL_CONVERT_TAKES_LABELS, "--labels"},         {KPL_CONVERT_TAKES_SPLIT, "--split"},
        {KPL_CONVERT_TAKES_MASKS_DIR, "--masks-dir"},   {KPL_CONVERT_TAKES_CLASSES, "--classes"},
        {KPL_CONVERT_TAKES_SEMANTIC, "--semantic"},     {KPL_CONVERT_TAKES_DROP_EMPTY, "--drop-empty"},
        {KPL_CONVERT_TAKES_SKIP_BAD, "--skip-bad"},     {KPL_CONVERT_TAKES_MAX_SIDE, "--max-side and --quality"},
        {KPL_CONVERT_TAKES_KEEP_ORDER, "--keep-order"},
    };
    for (size_t k = 0; k < sizeof opts / sizeof opts[0]; k++) {
        if (!(given & opts[k].bit) || (c->flags & opts[k].bit)) continue;
        char names[200];
        kpl_converter_names(opts[k].bit, names, sizeof names);
        fprintf(stderr, "kpl data convert: %s %s for --from %s\n", opts[k].opt,
                strchr(opts[k].opt, ' ') ? "are" : "is", names);
        return 2;
    }
    if ((c->flags & KPL_CONVERT_TAKES_SPLIT) && !(given & KPL_CONVERT_TAKES_SPLIT)) {
        fprintf(stderr, "kpl data convert: --from %s needs --split SPLIT\n", c->name);
        return 2;
    }
    return 0;
}

static int cmd_convert(int argc, char **argv)
{
    kpl_convert_options o = KPL_CONVERT_OPTIONS_INIT;
    o.progress = isatty(2);
    const char *from = NULL, *pos[3] = {NULL, NULL, NULL};
    kpl_convert_inputs in = {{NULL, NULL}, NULL, NULL, NULL, NULL};
    unsigned given = 0; /* KPL_CONVERT_TAKES_* */
    int npos = 0;
    for (int i = 0; i < argc; i++) {
        const char *a = argv[i];
        double v;
        bool has = i + 1 < argc;
        if (!strcmp(a, "--from") && has) {
            from = argv[++i];
        } else if (!strcmp(a, "--labels") && has) {
            in.labels = argv[++i];
            given |= KPL_CONVERT_TAKES_LABELS;
        } else if (!strcmp(a, "--shards") && has) {
            if (!parse_num(argv[++i], 1, 99999, &v) || v != (int)v) goto bad;
            o.writer.shards = (int)v;
        } else if (!strcmp(a, "--chunk-mb") && has) {
            if (!parse_num(argv[++i], 0.0625, 1024, &v)) goto bad;
            o.writer.chunk_bytes = (size_t)(v * 1048576.0);
        } else if (!strcmp(a, "--zstd-level") && has) {
            if (!parse_num(argv[++i], 0, 19, &v) || v != (int)v) goto bad;
            o.writer.zstd_level = (int)v;
        } else if (!strcmp(a, "--seed") && has) {
            if (!parse_num(argv[++i], 0, 9007199254740992.0, &v) || v != (double)(uint64_t)v)
                goto bad;
            o.seed = (uint64_t)v;
        } else if (!strcmp(a, "--threads") && has) {
            if (!parse_num(argv[++i], 1, 1024, &v) || v != (int)v) goto bad;
            o.threads = (int)v;
        } else if (!strcmp(a, "--max-side") && has) {
            if (!parse_num(argv[++i], 1, 65535, &v) || v != (int)v) goto bad;
            o.max_side = (int)v;
            given |= KPL_CONVERT_TAKES_MAX_SIDE;
        } else if (!strcmp(a, "--quality") && has) {
            if (!parse_num(argv[++i], 1, 100, &v) || v != (int)v) goto bad;
            o.quality = (int)v;
            given |= KPL_CONVERT_TAKES_MAX_SIDE;
        } else if (!strcmp(a, "--keep-order")) {
            o.keep_order = true;
            given |= KPL_CONVERT_TAKES_KEEP_ORDER;
        } else if (!strcmp(a, "--skip-bad")) {
            o.skip_bad = true;
            given |= KPL_CONVERT_TAKES_SKIP_BAD;
        } else if (!strcmp(a, "--drop-empty")) {
            o.drop_empty = true;
            given |= KPL_CONVERT_TAKES_DROP_EMPTY;
        } else if (!strcmp(a, "--split") && has) {
            in.split = argv[++i];
            given |= KPL_CONVERT_TAKES_SPLIT;
        } else if (!strcmp(a, "--masks-dir") && has) {
            in.masks_dir = argv[++i];
            given |= KPL_CONVERT_TAKES_MASKS_DIR;
        } else if (!strcmp(a, "--classes") && has) {
            in.classes = argv[++i];
            given |= KPL_CONVERT_TAKES_CLASSES;
        } else if (!strcmp(a, "--semantic")) {
            o.semantic = true;
            given |= KPL_CONVERT_TAKES_SEMANTIC;
        } else if (!strcmp(a, "--quiet")) {
            o.progress = false;
        } else if (a[0] == '-' && a[1]) {
            fprintf(stderr, "kpl data convert: unknown option '%s'%s\n", a,
                    has ? "" : " (or its value is missing)");
            return 2;
        } else if (npos < 3) {
            pos[npos++] = a;
        } else {
            fprintf(stderr, "kpl data convert: unexpected argument '%s'\n", a);
            return 2;
        }
        continue;
    bad:
        fprintf(stderr, "kpl data convert: %s: bad value '%s'\n", a, argv[i]);
        return 2;
    }
    int src = from ? kpl_convert_source_parse(from) : -1;
    const kpl_converter *c = src > KPL_CONVERT_NONE ? kpl_converter_of((kpl_convert_source)src)
                                                    : NULL;
    if (from && !c) {
        char known[256];
        kpl_converter_names(0, known, sizeof known);
        fprintf(stderr, "kpl data convert: unknown source '%s' (known: %s)\n", from, known);
        return 2;
    }
    if (!from || npos != c->ninputs + 1) {
        fprintf(stderr, "kpl data convert: want --from SOURCE, %s and OUT (see 'kpl data "
                        "--help')\n", c ? c->inputs : "SRC");
        return 2;
    }
    int rc = check_takes(c, given);
    if (rc) return rc;
    for (int k = 0; k < c->ninputs; k++) in.in[k] = pos[k];
    const char *out = pos[c->ninputs];
    kpl_status st = c->check ? c->check(&in) : KPL_OK;
    if (st < 0) {
        fprintf(stderr, "kpl data convert: %s\n", kpl_last_error());
        return st == KPL_EINVAL ? 2 : 1; /* EINVAL: what to give, as a usage error */
    }
    /* Take turns with other conversions into the same directory (kpl
     * train converts on first use): the lock lives in the directory that
     * holds the dataset(s); an IDX directory and CIFAR write OUT/train and
     * OUT/test. */
    bool holds_splits = c->out_holds_splits && c->out_holds_splits(&in);
    char parent[PATH_MAX];
    snprintf(parent, sizeof parent, "%s", out);
    char *slash = strrchr(parent, '/');
    if (!holds_splits && slash == parent) slash[1] = 0;
    else if (!holds_splits && slash) *slash = 0;
    else if (!holds_splits) snprintf(parent, sizeof parent, ".");
    double said = -1;
    int lock = -1;
    if (kpl_convert_lock(parent, keep_waiting, &said, &lock) < 0) return fail("convert");
    kpl_convert_hooks h = {before_dataset, after_dataset, (void *)c};
    st = c->run(&in, out, &o, &h);
    kpl_convert_unlock(lock);
    return st < 0 ? fail("convert") : 0;
}

/* While another conversion holds the lock: say so once a minute. */
static bool keep_waiting(const char *lock, double waited, void *ctx)
{
    double *said = ctx;
    if (*said < 0 || waited - *said >= 60) {
        fprintf(stderr, "kpl data convert: waiting for another conversion to finish (it holds "
                "%s; %.0f s so far)\n", lock, waited);
        *said = waited;
    }
    return true;
}

static int cmd_inspect(int argc, char **argv)
{
    if (argc != 1) {
        fprintf(stderr, "kpl data inspect: want one dataset directory\n");
        return 2;
    }
    kpl_dataset *ds = NULL;
    if (kpl_dataset_open(argv[0], &ds) < 0) return fail("inspect");
    char *json = NULL;
    kpl_status st = kpl_dataset_describe(ds, &json);
    kpl_dataset_close(ds);
    if (st < 0) return fail("inspect");
    printf("%s\n", json);
    free(json);
    return 0;
}

/* "\rverify: 812/2048 MiB", at most five times a second. */
static void verify_progress(uint64_t done, uint64_t total, void *ctx)
{
    double *last = ctx, t = kpl_seconds();
    if (done < total && t - *last < 0.2) return;
    *last = t;
    fprintf(stderr, "\rverify: %llu/%llu MiB%s", (unsigned long long)(done >> 20),
            (unsigned long long)(total >> 20), done >= total ? "\n" : "");
}

static int cmd_verify(int argc, char **argv)
{
    if (argc != 1) {
        fprintf(stderr, "kpl data verify: want one dataset directory\n");
        return 2;
    }
    bool tty = isatty(2);
    double last = 0, t0 = kpl_seconds();
    kpl_verify_stats vs;
    if (kpl_dataset_verify(argv[0], &vs, tty ? verify_progress : NULL, &last) < 0) {
        if (tty) fputc('\n', stderr);
        return fail("verify");
    }
    printf("{\"event\":\"verified\",\"path\":\"%s\",\"examples\":%lld,\"chunks\":%lld,"
           "\"bytes\":%llu,\"seconds\":%.2f}\n",
           argv[0], (long long)vs.examples, (long long)vs.chunks, (unsigned long long)vs.bytes,
           kpl_seconds() - t0);
    return 0;
}

/* kpl data synth fmnist-det|fmnist-seg OUT [options] */
static int cmd_synth(int argc, char **argv)
{
    kpl_synth_det_config c = KPL_SYNTH_DET_CONFIG_INIT;
    c.progress = isatty(2);
    const char *pos[2] = {NULL, NULL};
    int npos = 0;
    for (int i = 0; i < argc; i++) {
        const char *a = argv[i];
        double v;
        bool has = i + 1 < argc;
        if (!strcmp(a, "--train") && has) {
            if (!parse_num(argv[++i], 0, 99999999, &v) || v != (int64_t)v) goto bad;
            c.train = (int64_t)v;
        } else if (!strcmp(a, "--val") && has) {
            if (!parse_num(argv[++i], 0, 99999999, &v) || v != (int64_t)v) goto bad;
            c.val = (int64_t)v;
        } else if (!strcmp(a, "--size") && has) {
            if (!parse_num(argv[++i], 32, 4096, &v) || v != (int)v) goto bad;
            c.size = (int)v;
        } else if (!strcmp(a, "--seed") && has) {
            if (!parse_num(argv[++i], 0, 9007199254740992.0, &v) || v != (double)(uint64_t)v)
                goto bad;
            c.seed = (uint64_t)v;
        } else if (!strcmp(a, "--threads") && has) {
            if (!parse_num(argv[++i], 1, 1024, &v) || v != (int)v) goto bad;
            c.threads = (int)v;
        } else if (!strcmp(a, "--objects") && has) {
            if (!parse_num(argv[++i], 1, 64, &v) || v != (int)v) goto bad;
            c.max_objects = (int)v;
        } else if (!strcmp(a, "--sides") && i + 2 < argc) {
            double hi;
            if (!parse_num(argv[++i], 4, 4096, &v) || v != (int)v) goto bad;
            if (!parse_num(argv[++i], v, 4096, &hi) || hi != (int)hi) goto bad;
            c.min_side = (int)v, c.max_side = (int)hi;
        } else if (!strcmp(a, "--min-visible") && has) {
            if (!parse_num(argv[++i], 0, 1, &v)) goto bad;
            c.min_visible = (float)v;
        } else if (!strcmp(a, "--fmnist") && has) {
            c.fmnist_dir = argv[++i];
        } else if (!strcmp(a, "--quiet")) {
            c.progress = false;
        } else if (a[0] == '-' && a[1]) {
            fprintf(stderr, "kpl data synth: unknown option '%s'%s\n", a,
                    has ? "" : " (or its value is missing)");
            return 2;
        } else if (npos < 2) {
            pos[npos++] = a;
        } else {
            fprintf(stderr, "kpl data synth: unexpected argument '%s'\n", a);
            return 2;
        }
        continue;
    bad:
        fprintf(stderr, "kpl data synth: %s: bad value '%s'\n", a, argv[i]);
        return 2;
    }
    if (npos != 2 || (strcmp(pos[0], "fmnist-det") && strcmp(pos[0], "fmnist-seg"))) {
        fprintf(stderr, "kpl data synth: want fmnist-det OUT or fmnist-seg OUT (see 'kpl "
                        "data --help')\n");
        return 2;
    }
    bool seg = !strcmp(pos[0], "fmnist-seg");
    /* The items are at most the image. */
    if (c.max_side > c.size) c.max_side = c.size;
    if (c.min_side > c.max_side) c.min_side = c.max_side;
    int64_t objects = 0;
    double t0 = kpl_seconds();
    kpl_status st = seg ? kpl_synth_fmnist_seg(pos[1], &c, &objects)
                        : kpl_synth_fmnist_det(pos[1], &c, &objects);
    if (st < 0) return fail("synth");
    printf("{\"event\":\"synthesized\",\"set\":\"%s\",\"out\":\"%s\",\"train\":%lld,"
           "\"val\":%lld,\"objects\":%lld,\"seed\":%llu,\"seconds\":%.2f}\n",
           pos[0], pos[1], (long long)c.train, (long long)c.val, (long long)objects,
           (unsigned long long)c.seed, kpl_seconds() - t0);
    return 0;
}

/* The 12 COCOeval figures of a results file; every failure is the
 * input's (exit 2).  What pycocotools skips quietly is said on stderr. */
static int cmd_cocoeval(int argc, char **argv)
{
    const char *pos[2] = {NULL, NULL};
    int npos = 0;
    for (int i = 0; i < argc; i++) {
        if (!strcmp(argv[i], "--iou-type") && i + 1 < argc) {
            if (strcmp(argv[++i], "bbox") != 0) {
                fprintf(stderr, "kpl data cocoeval: --iou-type %s: only bbox is supported\n",
                        argv[i]);
                return 2;
            }
        } else if (argv[i][0] == '-' && argv[i][1]) {
            fprintf(stderr, "kpl data cocoeval: unknown option '%s'\n", argv[i]);
            return 2;
        } else if (npos < 2) {
            pos[npos++] = argv[i];
        } else {
            fprintf(stderr, "kpl data cocoeval: unexpected argument '%s'\n", argv[i]);
            return 2;
        }
    }
    if (npos != 2) {
        fprintf(stderr, "kpl data cocoeval: want GT.json and DETECTIONS.json\n");
        return 2;
    }
    kpl_coco_gt *gt = NULL;
    kpl_coco_detection *dets = NULL;
    int64_t n = 0;
    kpl_coco_stats s;
    kpl_status st = kpl_coco_gt_load(pos[0], &gt);
    if (st >= 0) st = kpl_coco_dets_load(pos[1], &dets, &n);
    if (st >= 0) st = kpl_coco_evaluate(gt, dets, n, &s);
    free(dets);
    kpl_coco_gt_destroy(gt);
    if (st < 0) {
        fprintf(stderr, "kpl data cocoeval: %s\n", kpl_last_error());
        return 2;
    }
    if (s.gt_skipped)
        fprintf(stderr, "kpl data cocoeval: warning: %lld annotations of %s name an image or "
                        "category it does not list; skipped\n", (long long)s.gt_skipped, pos[0]);
    if (s.dets_skipped)
        fprintf(stderr, "kpl data cocoeval: warning: %lld detections name a category the ground "
                        "truth lacks; skipped\n", (long long)s.dets_skipped);
    char json[512];
    kpl_coco_stats_json(&s, json, sizeof json);
    printf("%s\n", json);
    return 0;
}

int kpl__cmd_data(int argc, char **argv)
{
    if (argc < 1) {
        usage(stderr);
        return 2;
    }
    const char *c = argv[0];
    if (!strcmp(c, "-h") || !strcmp(c, "--help") || !strcmp(c, "help")) {
        usage(stdout);
        return 0;
    }
    if (!strcmp(c, "convert")) return cmd_convert(argc - 1, argv + 1);
    if (!strcmp(c, "inspect")) return cmd_inspect(argc - 1, argv + 1);
    if (!strcmp(c, "verify")) return cmd_verify(argc - 1, argv + 1);
    if (!strcmp(c, "synth")) return cmd_synth(argc - 1, argv + 1);
    if (!strcmp(c, "cocoeval")) return cmd_cocoeval(argc - 1, argv + 1);
    if (!strcmp(c, "fid-net")) return kpl__cmd_fid_net(argc - 1, argv + 1);
    fprintf(stderr, "kpl data: unknown command '%s' (try 'kpl data --help')\n", c);
    return 2;
}
