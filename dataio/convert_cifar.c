/*
 * convert_cifar.c — CIFAR-10 and CIFAR-100 to KPLRecord, from either of
 * the layouts they are distributed in:
 *
 *   cifar-10-batches-bin/  data_batch_1..5.bin, test_batch.bin, batches.meta.txt
 *   cifar-10-batches-py/   data_batch_1..5, test_batch, batches.meta
 *   cifar-100-binary/      train.bin, test.bin, fine_label_names.txt,
 *                          coarse_label_names.txt
 *   cifar-100-python/      train, test, meta
 *
 * A binary batch is records of 1 label byte (CIFAR-100: coarse, then fine)
 * and 3072 pixel bytes: the 32 x 32 red plane, then green, then blue, rows
 * top to bottom.  A python batch is a pickled dict (pickle.c) holding the
 * same pixels as a numpy uint8 array (N, 3072) and the labels as lists.
 * Every file of a split is read and checked before the dataset is started,
 * so a bad file leaves nothing behind; examples follow the files' order.
 */
#include "convert_impl.h"
#include "pickle_impl.h"

#include <ctype.h>
#include <errno.h>
#include <jansson.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/stat.h>

#define SIDE 32
#define PLANE (SIDE * SIDE)

void kpl__cifar_batch_free(kpl__cifar_batch *b)
{
    if (!b) return;
    free(b->pixels);
    free(b->label);
    free(b->coarse);
    memset(b, 0, sizeof *b);
}

void kpl__cifar_names_free(char **names, int64_t n)
{
    for (int64_t i = 0; names && i < n; i++) free(names[i]);
    free(names);
}

static kpl_status batch_alloc(kpl__cifar_batch *b, int64_t n, bool cifar100, const char *name)
{
    memset(b, 0, sizeof *b);
    b->n = n;
    b->pixels = malloc((size_t)n * KPL__CIFAR_PIXELS);
    b->label = malloc((size_t)n * sizeof *b->label);
    b->coarse = cifar100 ? malloc((size_t)n * sizeof *b->coarse) : NULL;
    if (!b->pixels || !b->label || (cifar100 && !b->coarse)) {
        kpl__cifar_batch_free(b);
        return KPL_ERROR(KPL_ENOMEM, "%s: no memory for %lld images", name, (long long)n);
    }
    return KPL_OK;
}

kpl_status kpl__cifar_parse_binary(const uint8_t *buf, size_t len, const char *name,
                                   bool cifar100, kpl__cifar_batch *b)
{
    memset(b, 0, sizeof *b);
    size_t head = cifar100 ? 2 : 1, rec = head + KPL__CIFAR_PIXELS;
    const char *what = cifar100 ? "CIFAR-100 binary: coarse and fine label bytes"
                                : "CIFAR-10 binary: 1 label byte";
    KPL_CHECK(len > 0, KPL_EFORMAT, "%s: empty file", name);
    KPL_CHECK(len % rec == 0, KPL_EFORMAT, "%s: %zu bytes is not a whole number of %zu-byte "
              "records (%s and 3072 pixel bytes each): record %zu is cut short after %zu bytes "
              "(truncated, or the other CIFAR's file?)", name, len, rec, what, len / rec,
              len % rec);
    KPL_TRY(batch_alloc(b, (int64_t)(len / rec), cifar100, name));
    for (int64_t i = 0; i < b->n; i++) {
        const uint8_t *r = buf + (size_t)i * rec;
        int64_t fine = r[head - 1], coarse = r[0];
        if (fine >= (cifar100 ? 100 : 10) || (cifar100 && coarse >= 20)) {
            bool c = cifar100 && coarse >= 20;
            kpl__cifar_batch_free(b);
            return KPL_ERROR(KPL_EFORMAT, "%s: record %lld (byte offset %zu): %slabel %lld is "
                             "not a class (0..%d)", name, (long long)i,
                             (size_t)i * rec + (c ? 0 : head - 1),
                             c ? "coarse " : cifar100 ? "fine " : "", (long long)(c ? coarse : fine),
                             c ? 19 : cifar100 ? 99 : 9);
        }
        b->label[i] = fine;
        if (cifar100) b->coarse[i] = coarse;
        memcpy(b->pixels + (size_t)i * KPL__CIFAR_PIXELS, r + head, KPL__CIFAR_PIXELS);
    }
    return KPL_OK;
}

/* The labels list `key` of a batch dict: n ints in [0, classes), into out. */
static kpl_status pickle_labels(const kpl__pk_value *root, const char *key, int64_t n,
                                int64_t classes, const char *name, int64_t *out)
{
    const kpl__pk_value *l = kpl__pk_dict_get(root, key);
    KPL_CHECK(l, KPL_EFORMAT, "%s: the pickle's dict has no '%s'%s", name, key,
              !strcmp(key, "labels") && kpl__pk_dict_get(root, "fine_labels")
                  ? " (it has 'fine_labels': a CIFAR-100 file?)"
              : strcmp(key, "labels") && kpl__pk_dict_get(root, "labels")
                  ? " (it has 'labels': a CIFAR-10 file?)" : "");
    KPL_CHECK(l->kind == KPL__PK_LIST || l->kind == KPL__PK_TUPLE, KPL_EFORMAT,
              "%s: '%s' is a %s (byte offset %zu), not a list of ints", name, key,
              kpl__pk_kind_name(l->kind), l->offset);
    KPL_CHECK(l->n == n, KPL_EFORMAT, "%s: '%s' has %lld entries for %lld images", name, key,
              (long long)l->n, (long long)n);
    for (int64_t i = 0; i < n; i++) {
        const kpl__pk_value *v = l->items[i];
        KPL_CHECK(v->kind == KPL__PK_INT, KPL_EFORMAT, "%s: %s[%lld] is a %s (byte offset %zu), "
                  "not an int", name, key, (long long)i, kpl__pk_kind_name(v->kind), v->offset);
        KPL_CHECK(v->num >= 0 && v->num < classes, KPL_EFORMAT, "%s: %s[%lld] is %lld (byte "
                  "offset %zu), not a class (0..%lld)", name, key, (long long)i,
                  (long long)v->num, v->offset, (long long)classes - 1);
        out[i] = v->num;
    }
    return KPL_OK;
}

kpl_status kpl__cifar_parse_pickle(const uint8_t *buf, size_t len, const char *name,
                                   bool cifar100, kpl__cifar_batch *b)
{
    memset(b, 0, sizeof *b);
    kpl__pickle *p = NULL;
    KPL_TRY(kpl__pickle_load(buf, len, name, &p));
    kpl_status st = KPL_OK;
    const kpl__pk_value *root = kpl__pickle_root(p), *d = kpl__pk_dict_get(root, "data");
    if (root->kind != KPL__PK_DICT) {
        st = KPL_ERROR(KPL_EFORMAT, "%s: the pickle holds a %s, not a CIFAR batch's dict", name,
                       kpl__pk_kind_name(root->kind));
        goto fail;
    }
    if (!d || d->kind != KPL__PK_ARRAY) {
        st = KPL_ERROR(KPL_EFORMAT, "%s: %s", name, d ? "'data' is not a numpy uint8 array"
                                                      : "the pickle's dict has no 'data'");
        goto fail;
    }
    if (d->ndim != 2 || d->shape[1] != KPL__CIFAR_PIXELS || d->shape[0] < 1) {
        char shape[96];
        int at = 0;
        for (int i = 0; i < d->ndim; i++)
            at += snprintf(shape + at, sizeof shape - (size_t)at, "%s%lld", i ? ", " : "",
                           (long long)d->shape[i]);
        st = KPL_ERROR(KPL_EFORMAT, "%s: 'data' is a (%s) array (byte offset %zu); CIFAR's is "
                       "(N, 3072) with N >= 1: each row 32 x 32 red, then green, then blue",
                       name, shape, d->offset);
        goto fail;
    }
    KPL_TRY_GOTO(batch_alloc(b, d->shape[0], cifar100, name));
    memcpy(b->pixels, d->bytes, (size_t)b->n * KPL__CIFAR_PIXELS);
    if (cifar100) {
        KPL_TRY_GOTO(pickle_labels(root, "fine_labels", b->n, 100, name, b->label));
        KPL_TRY_GOTO(pickle_labels(root, "coarse_labels", b->n, 20, name, b->coarse));
    } else {
        KPL_TRY_GOTO(pickle_labels(root, "labels", b->n, 10, name, b->label));
    }
fail:
    if (st < 0) kpl__cifar_batch_free(b);
    kpl__pickle_free(p);
    return st;
}

/* A class name fit for a line of classes.txt: 1..200 bytes, no control
 * characters. */
static bool name_ok(const uint8_t *s, size_t n)
{
    if (n < 1 || n > 200) return false;
    for (size_t i = 0; i < n; i++)
        if (s[i] < 0x20 || s[i] == 0x7f) return false;
    return true;
}

/* The list `key` of a meta dict: want names, malloc'd into *out. */
static kpl_status pickle_names(const kpl__pk_value *root, const char *key, int64_t want,
                               const char *name, char ***out)
{
    *out = NULL;
    const kpl__pk_value *l = kpl__pk_dict_get(root, key);
    KPL_CHECK(l, KPL_EFORMAT, "%s: the pickle's dict has no '%s'", name, key);
    KPL_CHECK((l->kind == KPL__PK_LIST || l->kind == KPL__PK_TUPLE) && l->n == want, KPL_EFORMAT,
              "%s: '%s' is not a list of %lld names (a %s of %lld)", name, key, (long long)want,
              kpl__pk_kind_name(l->kind), (long long)l->n);
    char **v = calloc((size_t)want, sizeof *v);
    KPL_CHECK(v, KPL_ENOMEM, "%s: no memory", name);
    for (int64_t i = 0; i < want; i++) {
        const kpl__pk_value *s = l->items[i];
        if ((s->kind != KPL__PK_BYTES && s->kind != KPL__PK_STR) || !name_ok(s->bytes, s->len)) {
            kpl__cifar_names_free(v, want);
            return KPL_ERROR(KPL_EFORMAT, "%s: %s[%lld] (byte offset %zu) is not a class name "
                             "(text of 1 to 200 characters, no control characters)", name, key,
                             (long long)i, s->offset);
        }
        if (!(v[i] = strndup((const char *)s->bytes, s->len))) {
            kpl__cifar_names_free(v, want);
            return KPL_ERROR(KPL_ENOMEM, "%s: no memory", name);
        }
    }
    *out = v;
    return KPL_OK;
}

kpl_status kpl__cifar_parse_meta(const uint8_t *buf, size_t len, const char *name,
                                 bool cifar100, char ***fine, char ***coarse)
{
    *fine = *coarse = NULL;
    kpl__pickle *p = NULL;
    KPL_TRY(kpl__pickle_load(buf, len, name, &p));
    const kpl__pk_value *root = kpl__pickle_root(p);
    kpl_status st = pickle_names(root, cifar100 ? "fine_label_names" : "label_names",
                                 cifar100 ? 100 : 10, name, fine);
    if (st >= 0 && cifar100) st = pickle_names(root, "coarse_label_names", 20, name, coarse);
    if (st < 0) {
        kpl__cifar_names_free(*fine, cifar100 ? 100 : 10);
        *fine = NULL;
    }
    kpl__pickle_free(p);
    return st;
}

/* ---- the layouts ---- */

typedef struct {
    char dir[PATH_MAX];
    bool cifar100, python;
} layout;

static const char *const layout_dirs[4] = {"cifar-10-batches-bin", "cifar-10-batches-py",
                                           "cifar-100-binary", "cifar-100-python"};

static bool is_file(const char *dir, const char *name)
{
    char p[PATH_MAX];
    struct stat sb;
    return kpl__path_join(p, sizeof p, dir, name) >= 0 && stat(p, &sb) == 0 && S_ISREG(sb.st_mode);
}

/* Which layout `dir` holds (its index in layout_dirs), or -1 for none, -2
 * for more than one. */
static int layout_of(const char *dir)
{
    bool has[4] = {
        is_file(dir, "data_batch_1.bin") || is_file(dir, "test_batch.bin"),
        is_file(dir, "data_batch_1") || is_file(dir, "test_batch"),
        is_file(dir, "train.bin") || is_file(dir, "test.bin"),
        is_file(dir, "train") || is_file(dir, "test"),
    };
    int found = -1;
    for (int k = 0; k < 4; k++)
        if (has[k]) found = found == -1 ? k : -2;
    return found;
}

static kpl_status find_layout(const char *src, layout *l)
{
    struct stat sb;
    KPL_CHECK(stat(src, &sb) == 0, errno == ENOENT ? KPL_ENOTFOUND : KPL_EIO, "cifar: %s: %s",
              src, strerror(errno));
    KPL_CHECK(S_ISDIR(sb.st_mode), KPL_EINVAL, "cifar: %s is not a directory (extract the "
              "archive first, e.g. tar xzf cifar-10-python.tar.gz, and give the folder)", src);
    int k = layout_of(src);
    KPL_CHECK(k != -2, KPL_EFORMAT, "cifar: %s holds the files of more than one CIFAR layout",
              src);
    if (k >= 0) {
        snprintf(l->dir, sizeof l->dir, "%s", src);
    } else {
        /* the folder the archives were extracted into */
        int n = 0;
        for (int j = 0; j < 4; j++) {
            char d[PATH_MAX];
            if (kpl__path_join(d, sizeof d, src, layout_dirs[j]) < 0 || layout_of(d) != j)
                continue;
            KPL_CHECK(n == 0, KPL_EINVAL, "cifar: %s holds both %s and %s: give one of them",
                      src, layout_dirs[k], layout_dirs[j]);
            snprintf(l->dir, sizeof l->dir, "%s", d);
            k = j;
            n++;
        }
        KPL_CHECK(n == 1, KPL_ENOTFOUND, "cifar: %s holds no CIFAR files: want the folder of one "
                  "of cifar-10-batches-bin (data_batch_1.bin ...), cifar-10-batches-py "
                  "(data_batch_1 ...), cifar-100-binary (train.bin, test.bin) or "
                  "cifar-100-python (train, test), or the folder holding it", src);
    }
    l->cifar100 = k >= 2;
    l->python = k == 1 || k == 3;
    return KPL_OK;
}

/* Reads `path` whole into *buf (malloc'd); *buf stays NULL, and all is
 * well, when there is no such file. */
static kpl_status read_optional(const char *path, char **buf, size_t *len)
{
    *buf = NULL;
    kpl_status st = kpl__read_file(path, buf, len);
    if (st == KPL_ENOTFOUND) {
        kpl_clear_error();
        return KPL_OK;
    }
    return st;
}

/* The class names of a text file, one a line (blank lines and the spaces
 * around a name ignored): exactly `want` of them.  *out stays NULL when
 * the file is absent. */
static kpl_status text_names(const char *path, int64_t want, char ***out)
{
    *out = NULL;
    char *buf = NULL;
    size_t len = 0;
    KPL_TRY(read_optional(path, &buf, &len));
    if (!buf) return KPL_OK;
    kpl_status st = KPL_OK;
    char **v = calloc((size_t)want, sizeof *v);
    if (!v) st = KPL_ERROR(KPL_ENOMEM, "%s: no memory", path);
    int64_t n = 0;
    for (char *line = buf, *next; st >= 0 && line < buf + len; line = next) {
        char *end = memchr(line, '\n', (size_t)(buf + len - line));
        next = end ? end + 1 : buf + len;
        if (!end) end = buf + len;
        while (end > line && isspace((unsigned char)end[-1])) end--;
        while (line < end && isspace((unsigned char)*line)) line++;
        if (line == end) continue;
        if (n < want && !name_ok((const uint8_t *)line, (size_t)(end - line)))
            st = KPL_ERROR(KPL_EFORMAT, "%s: name %lld is not a class name (1 to 200 "
                           "characters, no control characters)", path, (long long)n + 1);
        else if (n < want && !(v[n] = strndup(line, (size_t)(end - line))))
            st = KPL_ERROR(KPL_ENOMEM, "%s: no memory", path);
        n++;
    }
    free(buf);
    if (st >= 0 && n != want)
        st = KPL_ERROR(KPL_EFORMAT, "%s: %lld class names, CIFAR has %lld", path, (long long)n,
                       (long long)want);
    if (st < 0) {
        kpl__cifar_names_free(v, want);
        return st;
    }
    *out = v;
    return KPL_OK;
}

/* The class names of the layout, or NULL when its meta files are absent. */
static kpl_status read_names(const layout *l, char ***fine, char ***coarse)
{
    *fine = *coarse = NULL;
    char p[PATH_MAX];
    if (!l->python) {
        KPL_TRY(kpl__path_join(p, sizeof p, l->dir, l->cifar100 ? "fine_label_names.txt"
                                                                 : "batches.meta.txt"));
        KPL_TRY(text_names(p, l->cifar100 ? 100 : 10, fine));
        if (!l->cifar100) return KPL_OK;
        KPL_TRY(kpl__path_join(p, sizeof p, l->dir, "coarse_label_names.txt"));
        kpl_status st = text_names(p, 20, coarse);
        if (st < 0) {
            kpl__cifar_names_free(*fine, 100);
            *fine = NULL;
        }
        return st;
    }
    KPL_TRY(kpl__path_join(p, sizeof p, l->dir, l->cifar100 ? "meta" : "batches.meta"));
    char *buf = NULL;
    size_t len = 0;
    KPL_TRY(read_optional(p, &buf, &len));
    if (!buf) return KPL_OK;
    kpl_status st = kpl__cifar_parse_meta((const uint8_t *)buf, len, p, l->cifar100, fine, coarse);
    free(buf);
    return st;
}

/* Reads and checks the batch file `name` of the layout. */
static kpl_status read_batch(const layout *l, const char *name, kpl__cifar_batch *b)
{
    char p[PATH_MAX];
    KPL_TRY(kpl__path_join(p, sizeof p, l->dir, name));
    char *buf = NULL;
    size_t len = 0;
    kpl_status st = kpl__read_file(p, &buf, &len);
    if (st == KPL_ENOTFOUND)
        return KPL_ERROR(st, "cifar: %s is missing (the %s layout's %s split needs it)", p,
                         layout_dirs[2 * l->cifar100 + l->python],
                         strstr(name, "test") ? "test" : "train");
    KPL_TRY(st);
    st = l->python ? kpl__cifar_parse_pickle((const uint8_t *)buf, len, p, l->cifar100, b)
                   : kpl__cifar_parse_binary((const uint8_t *)buf, len, p, l->cifar100, b);
    free(buf);
    return st;
}

static char *attributes(const layout *l, const char *split, char *const *files, int nfiles,
                        bool names)
{
    json_t *f = json_array();
    for (int i = 0; f && i < nfiles; i++) json_array_append_new(f, json_string(files[i]));
    json_t *a = json_pack("{s:s, s:s, s:s, s:s, s:s, s:o, s:i, s:s}", "source", "cifar",
                          "dataset", l->cifar100 ? "cifar-100" : "cifar-10", "layout",
                          l->python ? "python" : "binary", "split", split, "dir", l->dir,
                          "files", f, "num_classes", l->cifar100 ? 100 : 10, "pixels",
                          "(32, 32, 3) RGB, rows top to bottom");
    if (a && names) json_object_set_new(a, "classes_file", json_string("classes.txt"));
    if (a && l->cifar100) {
        json_object_set_new(a, "num_coarse_classes", json_integer(20));
        if (names) json_object_set_new(a, "coarse_classes_file", json_string("coarse_classes.txt"));
    }
    char *s = a ? json_dumps(a, JSON_COMPACT | JSON_PRESERVE_ORDER) : NULL;
    json_decref(a);
    return s;
}

kpl_status kpl_convert_cifar(const char *src, const char *split, const char *out_dir,
                             const kpl_convert_options *opt, int64_t *count)
{
    kpl_convert_options o = KPL_CONVERT_OPTIONS_INIT;
    if (opt) o = *opt;
    KPL_CHECK(src && split && out_dir, KPL_EINVAL, "cifar: NULL argument");
    bool test = !strcmp(split, "test") || !strcmp(split, "val");
    KPL_CHECK(test || !strcmp(split, "train"), KPL_EINVAL, "cifar: split '%s': CIFAR has train "
              "and test (val is taken for test)", split);
    layout l;
    KPL_TRY(find_layout(src, &l));
    char *files[5];
    int nfiles = 0;
    const char *ext = l.python ? "" : ".bin";
    char names_buf[5][32];
    if (l.cifar100) {
        snprintf(names_buf[0], sizeof names_buf[0], "%s%s", test ? "test" : "train", ext);
        files[nfiles++] = names_buf[0];
    } else if (test) {
        snprintf(names_buf[0], sizeof names_buf[0], "test_batch%s", ext);
        files[nfiles++] = names_buf[0];
    } else {
        for (int i = 0; i < 5; i++) {
            snprintf(names_buf[i], sizeof names_buf[i], "data_batch_%d%s", i + 1, ext);
            files[nfiles++] = names_buf[i];
        }
    }
    kpl_status st = KPL_OK;
    kpl__cifar_batch b[5];
    memset(b, 0, sizeof b);
    char **fine = NULL, **coarse = NULL, *attrs = NULL;
    kpl_record_writer *w = NULL;
    int64_t n = 0;
    /* Everything is read and checked before anything is written. */
    KPL_TRY_GOTO(read_names(&l, &fine, &coarse));
    for (int i = 0; i < nfiles; i++) {
        KPL_TRY_GOTO(read_batch(&l, files[i], &b[i]));
        n += b[i].n;
    }
    attrs = attributes(&l, test ? "test" : "train", files, nfiles, fine != NULL);
    if (!attrs) {
        st = KPL_ERROR(KPL_ENOMEM, "cifar: no memory (or the path %s is not UTF-8)", l.dir);
        goto fail;
    }
    kpl_feature_spec schema[3] = {
        {.name = "image", .type = KPL_FEATURE_BYTES, .encoding = "raw", .ndim = 3,
         .shape = {SIDE, SIDE, 3}},
        {.name = "label", .type = KPL_FEATURE_INT64},
        {.name = "coarse_label", .type = KPL_FEATURE_INT64},
    };
    o.writer.attributes_json = attrs;
    KPL_TRY_GOTO(kpl_record_writer_create(out_dir, l.cifar100 ? 3 : 2, schema, &o.writer, &w));
    kpl__progress pr;
    kpl__progress_init(&pr, &o, out_dir);
    uint8_t hwc[KPL__CIFAR_PIXELS];
    int64_t done = 0;
    for (int f = 0; f < nfiles; f++)
        for (int64_t i = 0; i < b[f].n; i++) {
            /* planes (C, H, W) to pixels (H, W, C), as the loader reads raw images */
            const uint8_t *px = b[f].pixels + (size_t)i * KPL__CIFAR_PIXELS;
            for (int k = 0; k < PLANE; k++)
                for (int c = 0; c < 3; c++) hwc[3 * k + c] = px[c * PLANE + k];
            kpl_feature_value v[3] = {{hwc, KPL__CIFAR_PIXELS},
                                      {&b[f].label[i], 1},
                                      {l.cifar100 ? &b[f].coarse[i] : NULL, 1}};
            KPL_TRY_GOTO(kpl_record_writer_add(w, v));
            KPL_TRY_GOTO(kpl__progress_update(&pr, (uint64_t)++done, (uint64_t)n, "images"));
        }
    kpl_record_writer *finished = w;
    w = NULL;
    KPL_TRY_GOTO(kpl_record_writer_close(finished));
    if (fine) KPL_TRY_GOTO(kpl__write_lines(out_dir, "classes.txt", fine, l.cifar100 ? 100 : 10));
    if (coarse) KPL_TRY_GOTO(kpl__write_lines(out_dir, "coarse_classes.txt", coarse, 20));
    if (count) *count = n;
fail:
    kpl_record_writer_destroy(w);
    for (int i = 0; i < nfiles; i++) kpl__cifar_batch_free(&b[i]);
    kpl__cifar_names_free(fine, l.cifar100 ? 100 : 10);
    kpl__cifar_names_free(coarse, 20);
    free(attrs);
    return st;
}
