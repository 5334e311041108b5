/*
 * onnx_import.c — the initializers of an ONNX model as a kpl checkpoint:
 * how pretrained weights (a torchvision ResNet exported with its parameter
 * names) come into a kpl model (`kpl import onnx`, the recipe key
 * model.weights).
 *
 * Tensor data may be raw_data (little-endian bytes), the typed repeated
 * fields, or external data in a file next to the model (location relative
 * to the model's directory, offset, length).  Every size is checked
 * against the shape before a byte is copied; a file protobuf cannot parse
 * is an error naming it, never a crash.
 */
#include "infer.h"
#include "io_impl.h"

#include "onnx/onnx_dtypes.h"

#include <errno.h>
#include <limits.h>
#include <fnmatch.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

/* Whether a path has a ".." component. */
static bool has_dotdot(const char *p)
{
    for (const char *c = p; (c = strstr(c, "..")); c += 2)
        if ((c == p || c[-1] == '/') && (c[2] == 0 || c[2] == '/')) return true;
    return false;
}

/* A regular file's stream, or NULL with the error set. */
static FILE *open_regular(const char *what, const char *path)
{
    struct stat sb;
    if (stat(path, &sb) != 0) {
        KPL_ERROR(errno == ENOENT ? KPL_ENOTFOUND : KPL_EIO, "import onnx: %s%s: %s", what, path,
                  strerror(errno));
        return NULL;
    }
    if (!S_ISREG(sb.st_mode)) {
        KPL_ERROR(KPL_EINVAL, "import onnx: %s%s is not a regular file", what, path);
        return NULL;
    }
    FILE *f = fopen(path, "rb");
    if (!f) KPL_ERROR(KPL_EIO, "import onnx: %s%s: %s", what, path, strerror(errno));
    return f;
}

/* The whole file in memory (malloc'd). */
static kpl_status slurp(const char *path, uint8_t **buf, size_t *len)
{
    FILE *f = open_regular("", path);
    if (!f) return kpl_last_status();
    kpl_status st = KPL_OK;
    long n = -1;
    if (fseek(f, 0, SEEK_END) == 0) n = ftell(f);
    if (n < 0 || fseek(f, 0, SEEK_SET) != 0) st = KPL_ERROR(KPL_EIO, "import onnx: %s: cannot seek", path);
    *buf = st == KPL_OK ? malloc((size_t)n + 1) : NULL;
    if (st == KPL_OK && !*buf) st = KPL_ERROR(KPL_ENOMEM, "import onnx: %s: %ld bytes", path, n);
    if (st == KPL_OK && fread(*buf, 1, (size_t)n, f) != (size_t)n)
        st = KPL_ERROR(KPL_EIO, "import onnx: %s: read error", path);
    fclose(f);
    if (st < 0) {
        free(*buf);
        *buf = NULL;
        return st;
    }
    *len = (size_t)n;
    return KPL_OK;
}

/* Bytes [offset, offset + length) of the external file `location`, a
 * relative path inside the model's directory. */
static kpl_status external(const char *model, const Onnx__TensorProto *t, size_t want,
                           uint8_t **out)
{
    const char *loc = NULL;
    long long off = 0, len = -1;
    for (size_t i = 0; i < t->n_external_data; i++) {
        const Onnx__StringStringEntryProto *e = t->external_data[i];
        if (!e->key || !e->value) continue;
        char *end = NULL;
        if (!strcmp(e->key, "location")) loc = e->value;
        else if (!strcmp(e->key, "offset")) off = strtoll(e->value, &end, 10);
        else if (!strcmp(e->key, "length")) len = strtoll(e->value, &end, 10);
        if (end && (*end || end == e->value || off < 0 || (len < 0 && !strcmp(e->key, "length"))))
            return KPL_ERROR(KPL_EFORMAT, "import onnx: %s: initializer '%s': external %s '%s'",
                             model, t->name, e->key, e->value);
    }
    KPL_CHECK(loc && loc[0] && loc[0] != '/' && !has_dotdot(loc), KPL_EFORMAT,
              "import onnx: %s: initializer '%s': external data needs a location inside the "
              "model's directory (got %s)",
              model, t->name, loc ? loc : "none");
    KPL_CHECK(len < 0 || (size_t)len == want, KPL_EFORMAT,
              "import onnx: %s: initializer '%s': external length %lld, its shape needs %zu bytes",
              model, t->name, len, want);
    const char *slash = strrchr(model, '/');
    int dirlen = slash ? (int)(slash - model) + 1 : 0;
    char path[4096];
    KPL_CHECK(snprintf(path, sizeof path, "%.*s%s", dirlen, model, loc) < (int)sizeof path,
              KPL_EINVAL, "import onnx: %s: path too long", loc);
    char what[600];
    snprintf(what, sizeof what, "%s: initializer '%s': external file ", model, t->name);
    /* a symbolic link may not lead outside the model's directory either */
    char dir[4096], real_dir[PATH_MAX], real[PATH_MAX];
    snprintf(dir, sizeof dir, "%.*s", dirlen ? dirlen : 1, dirlen ? model : ".");
    if (realpath(dir, real_dir) && realpath(path, real)) {
        size_t dl = strlen(real_dir);
        KPL_CHECK(!strncmp(real, real_dir, dl) && (real[dl] == '/' || dl == 1), KPL_EFORMAT,
                  "import onnx: %s%s leads to %s, outside the model's directory %s (through a "
                  "symbolic link)", what, path, real, real_dir);
    }
    FILE *f = open_regular(what, path);
    if (!f) return kpl_last_status();
    /* the file must hold the bytes before any memory is asked for them */
    off_t size = fseeko(f, 0, SEEK_END) == 0 ? ftello(f) : -1;
    if (size < 0 || (unsigned long long)off > (unsigned long long)size ||
        want > (unsigned long long)size - (unsigned long long)off) {
        fclose(f);
        return KPL_ERROR(KPL_EFORMAT,
                         "import onnx: %s: initializer '%s': %s has %lld bytes, the tensor needs "
                         "%zu from byte %lld",
                         model, t->name, path, (long long)size, want, off);
    }
    *out = malloc(want ? want : 1);
    kpl_status st = *out ? KPL_OK : KPL_ERROR(KPL_ENOMEM, "import onnx: no memory");
    if (st == KPL_OK && (fseeko(f, (off_t)off, SEEK_SET) != 0 || fread(*out, 1, want, f) != want))
        st = KPL_ERROR(KPL_EFORMAT,
                       "import onnx: %s: initializer '%s': %s ends before byte %lld + %zu", model,
                       t->name, path, off, want);
    fclose(f);
    if (st < 0) {
        free(*out);
        *out = NULL;
    }
    return st;
}

/* One initializer as a CPU tensor (owned). */
static kpl_status to_tensor(const char *model, const Onnx__TensorProto *t, kpl_tensor **out)
{
    const char *name = t->name;
    kpl_dtype dt;
    KPL_CHECK(t->has_data_type && kpl_onnx_to_dtype(t->data_type, &dt), KPL_EFORMAT,
              "import onnx: %s: initializer '%s' has data type %d, which kpl has no dtype for",
              model, name, t->has_data_type ? (int)t->data_type : 0);
    KPL_CHECK(t->n_dims <= KPL_MAX_DIMS, KPL_EFORMAT,
              "import onnx: %s: initializer '%s' has %zu dims (at most %d)", model, name,
              t->n_dims, KPL_MAX_DIMS);
    int64_t shape[KPL_MAX_DIMS];
    uint64_t n = 1;
    for (size_t d = 0; d < t->n_dims; d++) {
        KPL_CHECK(t->dims[d] >= 0 && (t->dims[d] == 0 || n <= (UINT64_C(1) << 48) / (uint64_t)t->dims[d]),
                  KPL_EFORMAT, "import onnx: %s: initializer '%s': dim %zu is %lld", model, name,
                  d, (long long)t->dims[d]);
        shape[d] = t->dims[d];
        n *= (uint64_t)t->dims[d];
    }
    size_t es = kpl_dtype_size(dt), want = (size_t)n * es;
    const uint8_t *src = NULL;
    uint8_t *owned = NULL;
    size_t have = 0;
    const char *field = "raw_data";
    bool ext = t->has_data_location && t->data_location == ONNX__TENSOR_PROTO__DATA_LOCATION__EXTERNAL;
    if (ext) {
        KPL_TRY(external(model, t, want, &owned));
        src = owned, have = want, field = "external data";
    } else if (t->has_raw_data) {
        src = t->raw_data.data, have = t->raw_data.len;
    } else if (dt == KPL_F32) {
        src = (const uint8_t *)t->float_data, have = t->n_float_data * 4, field = "float_data";
    } else if (dt == KPL_F64) {
        src = (const uint8_t *)t->double_data, have = t->n_double_data * 8, field = "double_data";
    } else if (dt == KPL_I64) {
        src = (const uint8_t *)t->int64_data, have = t->n_int64_data * 8, field = "int64_data";
    } else if (dt == KPL_I32) {
        src = (const uint8_t *)t->int32_data, have = t->n_int32_data * 4, field = "int32_data";
    } else { /* f16, bf16, u8, bool: one value per int32 */
        field = "int32_data";
        KPL_CHECK(t->n_int32_data == n, KPL_EFORMAT,
                  "import onnx: %s: initializer '%s' has %zu values in %s, its shape needs %llu",
                  model, name, t->n_int32_data, field, (unsigned long long)n);
        owned = malloc(want ? want : 1);
        KPL_CHECK(owned, KPL_ENOMEM, "import onnx: no memory");
        for (size_t i = 0; i < n; i++) {
            uint32_t v = (uint32_t)t->int32_data[i];
            if (es == 2) memcpy(owned + 2 * i, &(uint16_t){(uint16_t)v}, 2);
            else owned[i] = (uint8_t)v;
        }
        src = owned, have = want;
    }
    kpl_status st = KPL_OK;
    if (have != want)
        st = KPL_ERROR(KPL_EFORMAT,
                       "import onnx: %s: initializer '%s' (%s) has %zu bytes in %s, its shape "
                       "needs %zu",
                       model, name, kpl_dtype_name(dt), have, field, want);
    if (st == KPL_OK)
        st = kpl_tensor_from_data(kpl_device_cpu(), dt, (int)t->n_dims, shape, src, out);
    free(owned);
    return st;
}

kpl_status kpl_onnx_import(const char *path, const char *prefix, int nexclude,
                           const char *const *exclude, kpl_checkpoint **out)
{
    KPL_CHECK(path && out && nexclude >= 0 && (!nexclude || exclude), KPL_EINVAL,
              "import onnx: NULL argument");
    *out = NULL;
    if (!prefix) prefix = "";
    uint8_t *buf = NULL;
    size_t len = 0;
    KPL_TRY(slurp(path, &buf, &len));
    Onnx__ModelProto *m = onnx__model_proto__unpack(NULL, len, buf);
    free(buf);
    KPL_CHECK(m, KPL_EFORMAT,
              "import onnx: %s is not an ONNX model (the protobuf does not parse: truncated or "
              "another kind of file)",
              path);
    kpl_status st = KPL_OK;
    kpl_checkpoint *c = NULL;
    if (!m->graph || !m->graph->n_initializer)
        st = KPL_ERROR(KPL_ENOTFOUND, "import onnx: %s has no initializers (no weights to import)",
                       path);
    /* torch.onnx.export in eval mode folds batch norm into the
     * convolutions (even with do_constant_folding=False): the weights come
     * out renamed onnx::Conv_N and batch norm's tensors are gone */
    size_t folded = 0;
    for (size_t i = 0; st == KPL_OK && i < m->graph->n_initializer; i++) {
        const char *n = m->graph->initializer[i]->name;
        folded += n && !strncmp(n, "onnx::Conv_", 11);
    }
    if (st == KPL_OK && folded)
        st = KPL_ERROR(KPL_EFORMAT, "import onnx: %s: %zu of %zu initializers are named "
                       "onnx::Conv_*: the exporter folded batch norm into the convolutions, so "
                       "the weights lost their names and batch norm its tensors.  Export the "
                       "model in training mode, which keeps both: torch.onnx.export(model, x, "
                       "FILE, training=torch.onnx.TrainingMode.TRAINING, "
                       "do_constant_folding=False)", path, folded, m->graph->n_initializer);
    if (st == KPL_OK) st = kpl_checkpoint_create(&c);
    int kept = 0;
    for (size_t i = 0; st == KPL_OK && i < m->graph->n_initializer; i++) {
        const Onnx__TensorProto *t = m->graph->initializer[i];
        if (!t->name || !t->name[0]) {
            st = KPL_ERROR(KPL_EFORMAT, "import onnx: %s: initializer %zu has no name", path, i);
            break;
        }
        bool skip = false;
        for (int k = 0; k < nexclude && !skip; k++) skip = !fnmatch(exclude[k], t->name, 0);
        if (skip) continue;
        char name[512];
        if (snprintf(name, sizeof name, "%s%s", prefix, t->name) >= (int)sizeof name) {
            st = KPL_ERROR(KPL_EFORMAT, "import onnx: %s: initializer name '%.64s...' too long",
                           path, t->name);
            break;
        }
        kpl_tensor *x = NULL;
        if ((st = to_tensor(path, t, &x)) < 0) break;
        int64_t bad = kpl__tensor_nonfinite(x);
        if (bad >= 0) {
            st = KPL_ERROR(KPL_EFORMAT, "import onnx: %s: initializer '%s' holds NaN or inf "
                           "(element %lld of %lld): weights must be finite", path, t->name,
                           (long long)bad, (long long)kpl_tensor_numel(x));
            kpl_tensor_release(x);
            break;
        }
        st = kpl_checkpoint_add(c, name, x);
        kpl_tensor_release(x);
        kept++;
    }
    if (st == KPL_OK && !kept)
        st = KPL_ERROR(KPL_ENOTFOUND, "import onnx: %s: the exclusions left no initializer", path);
    onnx__model_proto__free_unpacked(m, NULL);
    if (st < 0) {
        kpl_checkpoint_destroy(c);
        return st;
    }
    *out = c;
    return KPL_OK;
}
