/*
 * torch_import.c — a PyTorch checkpoint (what torch.save writes: a zip of
 * data.pkl, the pickled object, and one file per storage under data/) as
 * a kpl checkpoint: how torchvision's and timm's pretrained weights come
 * into a kpl model (`kpl import torch`, docs/static-graph.md).
 *
 * The zip is read with libzip; data.pkl with kpl's strict pickle reader in
 * its torch dialect (dataio/pickle.c): no code runs, only the opcodes and
 * the few globals torch.save writes for tensors and their containers are
 * interpreted, any other class is an object never called.  Each tensor is
 * a view of a storage (offset, size, stride, in elements); the view is
 * checked against the storage and copied out contiguous.
 */
#include "checkpoint.h"
#include "infer.h"
#include "pickle_impl.h"
#include "io_impl.h"

#include <errno.h>
#include <fnmatch.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <zip.h>

/* The keys under which training scripts keep the model's state dict
 * ({"model": ..., "optimizer": ..., "epoch": ...}), tried in order. */
static const char *const wrapped[] = {"state_dict", "model", "model_state_dict", "module",
                                      "state_dict_ema", "model_ema", NULL};

typedef struct {
    const char *path;
    zip_t *z;
    char prefix[256]; /* the archive's top folder, with its '/' */
    struct {
        char key[72];
        uint8_t *data;
        size_t len;
    } *st; /* storages read so far */
    int nst, capst;
} archive;

/* Entry `name` (below the archive's folder) read whole into *buf. */
static kpl_status read_entry(archive *a, const char *name, uint8_t **buf, size_t *len)
{
    char full[512];
    snprintf(full, sizeof full, "%s%s", a->prefix, name);
    zip_int64_t i = zip_name_locate(a->z, full, 0);
    KPL_CHECK(i >= 0, KPL_EFORMAT, "import torch: %s: no %s in the archive", a->path, full);
    zip_stat_t s;
    KPL_CHECK(zip_stat_index(a->z, (zip_uint64_t)i, 0, &s) == 0 && (s.valid & ZIP_STAT_SIZE),
              KPL_EFORMAT, "import torch: %s: %s: %s", a->path, full, zip_strerror(a->z));
    KPL_CHECK(s.size < ((zip_uint64_t)1 << 40), KPL_EFORMAT,
              "import torch: %s: %s says it holds %llu bytes", a->path, full,
              (unsigned long long)s.size);
    uint8_t *b = malloc(s.size ? s.size : 1);
    KPL_CHECK(b, KPL_ENOMEM, "import torch: %s: no memory for %s (%llu bytes)", a->path, full,
              (unsigned long long)s.size);
    zip_file_t *f = zip_fopen_index(a->z, (zip_uint64_t)i, 0);
    zip_int64_t got = f ? zip_fread(f, b, s.size) : -1;
    kpl_status st = KPL_OK;
    if (!f || got != (zip_int64_t)s.size)
        st = KPL_ERROR(KPL_EFORMAT, "import torch: %s: %s cannot be read whole: %s", a->path, full,
                       f ? zip_file_strerror(f) : zip_strerror(a->z));
    if (f) zip_fclose(f);
    if (st < 0) {
        free(b);
        return st;
    }
    *buf = b;
    *len = (size_t)s.size;
    return KPL_OK;
}

/* The bytes of storage s (read once, kept for the other views of it). */
static kpl_status storage_bytes(archive *a, const kpl__pk_value *s, const uint8_t **data,
                                size_t *len)
{
    char key[72];
    snprintf(key, sizeof key, "%.*s", (int)s->len, (const char *)s->bytes);
    for (int i = 0; i < a->nst; i++)
        if (!strcmp(a->st[i].key, key)) {
            *data = a->st[i].data, *len = a->st[i].len;
            return KPL_OK;
        }
    if (a->nst == a->capst) {
        int cap = a->capst ? 2 * a->capst : 64;
        void *p = realloc(a->st, (size_t)cap * sizeof *a->st);
        KPL_CHECK(p, KPL_ENOMEM, "import torch: no memory");
        a->st = p, a->capst = cap;
    }
    char name[96];
    snprintf(name, sizeof name, "data/%s", key);
    uint8_t *b = NULL;
    size_t n = 0;
    KPL_TRY(read_entry(a, name, &b, &n));
    size_t want = (size_t)s->num * kpl_dtype_size(s->dtype);
    if (n != want) {
        free(b);
        return KPL_ERROR(KPL_EFORMAT, "import torch: %s: storage %s holds %zu bytes, its %lld "
                         "%s elements take %zu", a->path, key, n, (long long)s->num,
                         kpl_dtype_name(s->dtype), want);
    }
    snprintf(a->st[a->nst].key, sizeof a->st[a->nst].key, "%s", key);
    a->st[a->nst].data = b, a->st[a->nst].len = n;
    a->nst++;
    *data = b, *len = n;
    return KPL_OK;
}

/* The tensor v (a view of a storage) copied out contiguous. */
static kpl_status to_tensor(archive *a, const char *name, const kpl__pk_value *v, kpl_tensor **out)
{
    const kpl__pk_value *s = v->items[0];
    int64_t numel = 1, last = 0;
    for (int d = 0; d < v->ndim; d++) {
        KPL_CHECK(!__builtin_mul_overflow(numel, v->shape[d], &numel), KPL_EFORMAT,
                  "import torch: %s: tensor '%s': its size overflows", a->path, name);
        last += v->shape[d] ? (v->shape[d] - 1) * v->stride[d] : 0;
    }
    KPL_CHECK(numel == 0 || (last >= 0 && v->num <= s->num - 1 - last), KPL_EFORMAT,
              "import torch: %s: tensor '%s' (offset %lld) reaches past its storage %.*s of %lld "
              "elements", a->path, name, (long long)v->num, (int)s->len, (const char *)s->bytes,
              (long long)s->num);
    const uint8_t *data = NULL;
    size_t len = 0;
    KPL_TRY(storage_bytes(a, s, &data, &len));
    kpl_tensor *t = NULL;
    int64_t shape[8];
    memcpy(shape, v->shape, sizeof shape);
    KPL_TRY(kpl_tensor_empty(kpl_device_cpu(), s->dtype, v->ndim, shape, &t));
    uint8_t *dst = kpl_tensor_host_mutable(t);
    size_t es = kpl_dtype_size(s->dtype);
    int64_t idx[8] = {0};
    for (int64_t i = 0; dst && i < numel; i++) {
        int64_t at = v->num;
        for (int d = 0; d < v->ndim; d++) at += idx[d] * v->stride[d];
        memcpy(dst + (size_t)i * es, data + (size_t)at * es, es);
        for (int d = v->ndim - 1; d >= 0 && ++idx[d] == v->shape[d]; d--) idx[d] = 0;
    }
    if (!dst) {
        kpl_tensor_release(t);
        return kpl_last_status();
    }
    *out = t;
    return KPL_OK;
}

/* Whether d is a dict with at least one tensor among its values. */
static bool has_tensors(const kpl__pk_value *d)
{
    for (int64_t i = 1; d && d->kind == KPL__PK_DICT && i < d->n; i += 2)
        if (d->items[i]->kind == KPL__PK_TENSOR) return true;
    return false;
}

/* The state dict in the file's object: the object itself, or the value of
 * `key` (or of the first of `wrapped`). */
static kpl_status find_state(const archive *a, const kpl__pk_value *root, const char *key,
                             const kpl__pk_value **out)
{
    KPL_CHECK(root->kind == KPL__PK_DICT, KPL_EFORMAT,
              "import torch: %s holds a pickled %s, not a state dict (save model.state_dict(), not "
              "the model itself)", a->path, kpl__pk_kind_name(root->kind));
    if (key) {
        *out = kpl__pk_dict_get(root, key);
        KPL_CHECK(has_tensors(*out), KPL_EFORMAT, "import torch: %s: --key %s names %s",
                  a->path, key, *out ? "no dict of tensors" : "nothing in the file's dict");
        return KPL_OK;
    }
    if (has_tensors(root)) {
        *out = root;
        return KPL_OK;
    }
    for (int k = 0; wrapped[k]; k++)
        if (has_tensors(kpl__pk_dict_get(root, wrapped[k]))) {
            *out = kpl__pk_dict_get(root, wrapped[k]);
            return KPL_OK;
        }
    char keys[512] = "";
    size_t at = 0;
    for (int64_t i = 0; i < root->n && at + 80 < sizeof keys; i += 2) {
        const kpl__pk_value *k = root->items[i];
        if (k->kind == KPL__PK_STR || k->kind == KPL__PK_BYTES)
            at += (size_t)snprintf(keys + at, sizeof keys - at, "%s%.*s", at ? ", " : "",
                                   (int)(k->len < 64 ? k->len : 64), (const char *)k->bytes);
    }
    return KPL_ERROR(KPL_EFORMAT, "import torch: %s: no dict of tensors at the top or under "
                     "state_dict, model, model_state_dict, module, state_dict_ema or model_ema "
                     "(its keys: %s); --key names another", a->path, at ? keys : "none");
}

static void archive_close(archive *a)
{
    for (int i = 0; i < a->nst; i++) free(a->st[i].data);
    free(a->st);
    if (a->z) zip_discard(a->z);
}

/* Opens path as torch.save's zip and finds its folder (the one holding
 * data.pkl); a legacy (pre-1.6) file is refused saying how to save it. */
static kpl_status archive_open(archive *a, const char *path)
{
    memset(a, 0, sizeof *a);
    a->path = path;
    FILE *f = fopen(path, "rb");
    KPL_CHECK(f, errno == ENOENT ? KPL_ENOTFOUND : KPL_EIO, "import torch: %s: %s", path,
              strerror(errno));
    uint8_t head[4] = {0};
    size_t n = fread(head, 1, 4, f);
    fclose(f);
    KPL_CHECK(n == 4 && !memcmp(head, "PK\003\004", 4), KPL_EFORMAT,
              "import torch: %s is not a zip archive: %s", path,
              n >= 2 && head[0] == 0x80 ? "a legacy torch.save file (PyTorch before 1.6, or "
                                          "_use_new_zipfile_serialization=False): load it in "
                                          "PyTorch and torch.save it again"
                                        : "not what torch.save writes");
    int err = 0;
    a->z = zip_open(path, ZIP_RDONLY | ZIP_CHECKCONS, &err);
    if (!a->z) {
        zip_error_t ze;
        zip_error_init_with_code(&ze, err);
        kpl_status st = KPL_ERROR(KPL_EFORMAT, "import torch: %s: a damaged zip: %s", path,
                                  zip_error_strerror(&ze));
        zip_error_fini(&ze);
        return st;
    }
    zip_int64_t ne = zip_get_num_entries(a->z, 0);
    for (zip_int64_t i = 0; i < ne; i++) {
        const char *e = zip_get_name(a->z, (zip_uint64_t)i, 0);
        const char *slash = e ? strchr(e, '/') : NULL;
        if (slash && !strcmp(slash, "/data.pkl") && (size_t)(slash - e) + 2 < sizeof a->prefix) {
            snprintf(a->prefix, sizeof a->prefix, "%.*s/", (int)(slash - e), e);
            break;
        }
    }
    KPL_CHECK(a->prefix[0], KPL_EFORMAT, "import torch: %s: a zip without <folder>/data.pkl: not "
              "what torch.save writes", path);
    uint8_t *bo = NULL;
    size_t bl = 0;
    char name[300];
    snprintf(name, sizeof name, "%sbyteorder", a->prefix);
    if (zip_name_locate(a->z, name, 0) >= 0 && read_entry(a, "byteorder", &bo, &bl) >= 0) {
        bool little = bl == 6 && !memcmp(bo, "little", 6);
        free(bo);
        KPL_CHECK(little, KPL_EFORMAT, "import torch: %s was saved on a big-endian machine "
                  "(its byteorder is not 'little'): kpl reads little-endian data", path);
    }
    return KPL_OK;
}

kpl_status kpl_torch_import(const char *path, const char *prefix, const char *key, int nexclude,
                            const char *const *exclude, kpl_checkpoint **out)
{
    KPL_CHECK(path && out && nexclude >= 0 && (!nexclude || exclude), KPL_EINVAL,
              "import torch: NULL argument");
    *out = NULL;
    if (!prefix) prefix = "";
    archive a;
    kpl_status st = archive_open(&a, path);
    uint8_t *pkl = NULL;
    size_t plen = 0;
    kpl__pickle *p = NULL;
    kpl_checkpoint *c = NULL;
    char where[600];
    snprintf(where, sizeof where, "import torch: %s: data.pkl", path);
    if (st >= 0) st = read_entry(&a, "data.pkl", &pkl, &plen);
    if (st >= 0) st = kpl__pickle_load_torch(pkl, plen, where, &p);
    const kpl__pk_value *sd = NULL;
    if (st >= 0) st = find_state(&a, kpl__pickle_root(p), key, &sd);
    if (st >= 0) st = kpl_checkpoint_create(&c);
    /* DataParallel's and DDP's "module." before every name goes */
    bool strip = sd != NULL;
    for (int64_t i = 0; st >= 0 && i + 1 < sd->n; i += 2)
        strip = strip && sd->items[i]->kind == KPL__PK_STR && sd->items[i]->len > 7 &&
                !memcmp(sd->items[i]->bytes, "module.", 7);
    int kept = 0;
    for (int64_t i = 0; st >= 0 && i + 1 < sd->n; i += 2) {
        const kpl__pk_value *k = sd->items[i], *v = sd->items[i + 1];
        if (v->kind != KPL__PK_TENSOR) continue; /* a state dict's odd entry: not a weight */
        if (k->kind != KPL__PK_STR || k->len == 0 || k->len > 400 || memchr(k->bytes, 0, k->len)) {
            st = KPL_ERROR(KPL_EFORMAT, "import torch: %s: entry %lld of the state dict has no "
                           "name a tensor can have", path, (long long)(i / 2));
            break;
        }
        char tname[512], name[1024];
        snprintf(tname, sizeof tname, "%.*s", (int)(k->len - (strip ? 7 : 0)),
                 (const char *)k->bytes + (strip ? 7 : 0));
        /* batch norm's num_batches_tracked: a counter, not a weight (kpl's
         * batch norm has a fixed momentum and keeps none) */
        size_t tl = strlen(tname);
        bool skip = tl > 20 && !strcmp(tname + tl - 20, ".num_batches_tracked");
        for (int e = 0; e < nexclude && !skip; e++) skip = !fnmatch(exclude[e], tname, 0);
        if (skip) continue;
        snprintf(name, sizeof name, "%s%s", prefix, tname);
        kpl_tensor *t = NULL;
        if ((st = to_tensor(&a, tname, v, &t)) < 0) break;
        int64_t bad = kpl__tensor_nonfinite(t);
        if (bad >= 0) {
            st = KPL_ERROR(KPL_EFORMAT, "import torch: %s: tensor '%s' holds NaN or inf (element "
                           "%lld of %lld): weights must be finite", path, tname, (long long)bad,
                           (long long)kpl_tensor_numel(t));
            kpl_tensor_release(t);
            break;
        }
        st = kpl_checkpoint_add(c, name, t);
        kpl_tensor_release(t);
        if (st < 0) st = kpl_error_prefix(st, "import torch: %s: ", path);
        kept++;
    }
    if (st >= 0 && !kept)
        st = KPL_ERROR(KPL_ENOTFOUND, "import torch: %s: the exclusions left no tensor", path);
    kpl__pickle_free(p);
    free(pkl);
    archive_close(&a);
    if (st < 0) {
        kpl_checkpoint_destroy(c);
        return st;
    }
    *out = c;
    return KPL_OK;
}
