/*
 * cmd_infer.c — `kpl infer`: a model file (kpl export) on image files or
 * on a KPLRecord split, one JSON line per example.
 */
#include "cli.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

static void usage_infer(FILE *f)
{
    fprintf(f,
            "usage: kpl infer MODEL.kplm INPUT... [--top K] [--limit N] [--level 0-3] [--search]\n"
            "                 [--logits]\n"
            "\n"
            "Runs a model file (kpl export) on each INPUT: an image file (JPEG or PNG),\n"
            "or a directory holding a KPLRecord split (every example, or the first N with\n"
            "--limit), through the input transform stored in the model, or a NumPy file\n"
            "(.npy: float32, (C, H, W) or (N, C, H, W) already transformed, one example a\n"
            "row).  One JSON line per\n"
            "example on stdout: a classifier's top K classes (default 5) with their\n"
            "softmax probabilities, a segmenter's classes by share of pixels (--logits adds\n"
            "the whole output row).  Examples of\n"
            "a split with labels count towards a top-1 in the last line, a JSON object\n"
            "with \"event\":\"done\".  An image that cannot be read is named on stderr and\n"
            "skipped; the exit status is then 1, as it is when an output holds NaN or inf\n"
            "(printed as null, and named on stderr).\n"
            "\n"
            "Convolutions use oneDNN's preferred kernels (deterministic mode): two runs print\n"
            "the same digits.  --search times the candidates at the first batch instead\n"
            "and keeps the fastest (as training does), which may change the last bits.\n");
}

typedef struct {
    kpl_model *m;
    kpl_transform_config tc;
    int64_t shape[4]; /* the model's input (B, C, H, W) */
    kpl_tensor *batch;
    char **names;     /* per row: what it came from */
    int64_t *labels;  /* per row: -1 when unknown */
    int n;            /* rows filled */
    int top;
    bool logits; /* print the whole output row */
    int64_t done, labelled, right;
    int64_t nonfinite; /* rows whose output holds NaN or inf */
    double run_ms;
} infer;

/* A JSON number, or null for NaN and inf (which JSON lacks). */
static void print_num(const char *fmt, double v)
{
    if (isfinite(v)) printf(fmt, v);
    else fputs("null", stdout);
}

/* "input":"<s>" with JSON's escapes (a file name may hold quotes). */
static void print_input(const char *s)
{
    fputs("{\"input\":\"", stdout);
    for (const unsigned char *p = (const unsigned char *)s; *p; p++) {
        if (*p == '"' || *p == '\\') printf("\\%c", *p);
        else if (*p < 0x20) printf("\\u%04x", *p);
        else putchar(*p);
    }
    putchar('"');
}

static int cmp_desc(const void *a, const void *b)
{
    const double *x = a, *y = b;
    return x[0] < y[0] ? 1 : x[0] > y[0] ? -1 : (x[1] > y[1]) - (x[1] < y[1]);
}

/* One classifier row: softmax over C logits, the top k. */
static void print_classes(infer *in, int row, const float *lg, int64_t C)
{
    double mx = -INFINITY, sum = 0;
    for (int64_t j = 0; j < C; j++) mx = lg[j] > mx ? lg[j] : mx;
    double (*p)[2] = malloc((size_t)C * sizeof *p);
    if (!p) return;
    for (int64_t j = 0; j < C; j++) sum += exp(lg[j] - mx);
    for (int64_t j = 0; j < C; j++) p[j][0] = exp(lg[j] - mx) / sum, p[j][1] = (double)j;
    qsort(p, (size_t)C, sizeof *p, cmp_desc);
    print_input(in->names[row]);
    if (in->labels[row] >= 0) {
        printf(",\"label\":%lld", (long long)in->labels[row]);
        in->labelled++;
        in->right += (int64_t)p[0][1] == in->labels[row];
    }
    printf(",\"top\":[");
    int k = in->top < C ? in->top : (int)C;
    for (int j = 0; j < k; j++) {
        printf("%s{\"class\":%lld,\"prob\":", j ? "," : "", (long long)p[j][1]);
        print_num("%.6g", p[j][0]);
        putchar('}');
    }
    printf("]}\n");
    free(p);
}

/* One segmenter row: the argmax class of each pixel, classes by share. */
static void print_mask(infer *in, int row, const float *lg, int64_t C, int64_t hw)
{
    int64_t *count = calloc((size_t)C, sizeof *count);
    if (!count) return;
    for (int64_t i = 0; i < hw; i++) {
        int64_t best = 0;
        for (int64_t c = 1; c < C; c++)
            if (lg[c * hw + i] > lg[best * hw + i]) best = c;
        count[best]++;
    }
    print_input(in->names[row]);
    printf(",\"pixels\":%lld,\"classes\":[", (long long)hw);
    bool first = true;
    for (int64_t c = 0; c < C; c++) {
        if (!count[c]) continue;
        printf("%s{\"class\":%lld,\"share\":%.6g}", first ? "" : ",", (long long)c,
               (double)count[c] / (double)hw);
        first = false;
    }
    printf("]}\n");
    free(count);
}

/* Runs the rows filled so far and prints them. */
static kpl_status flush(infer *in)
{
    if (!in->n) return KPL_OK;
    double t0 = kpl_seconds();
    KPL_TRY(kpl_model_set_input(in->m, 0, in->batch));
    KPL_TRY(kpl_model_run(in->m));
    kpl_tensor *y = kpl_model_output(in->m, 0);
    int nd = kpl_tensor_ndim(y);
    const int64_t *s = kpl_tensor_shape(y);
    char b[96];
    KPL_CHECK(nd >= 1 && s[0] == in->shape[0], KPL_EFORMAT,
              "the model's output %s has no row per example of its input batch %lld",
              kpl_shape_str(nd, s, b, sizeof b), (long long)in->shape[0]);
    kpl_tensor *yf = NULL;
    if (kpl_tensor_dtype(y) != KPL_F32) {
        KPL_TRY(kpl_tensor_empty(kpl_device_cpu(), KPL_F32, nd, s, &yf));
        if (kpl_k_cast(yf, y) < 0) {
            kpl_tensor_release(yf);
            return kpl_last_status();
        }
        y = yf;
    }
    const float *v = kpl_tensor_host_data(y);
    in->run_ms += (kpl_seconds() - t0) * 1e3;
    if (!v) {
        kpl_tensor_release(yf);
        return kpl_last_status();
    }
    int64_t per = kpl_tensor_numel(y) / s[0];
    for (int r = 0; r < in->n; r++) {
        if (in->logits) {
            print_input(in->names[r]);
            printf(",\"logits\":[");
            for (int64_t j = 0; j < per; j++) {
                if (j) putchar(',');
                print_num("%.9g", v[r * per + j]);
            }
            printf("]}\n");
        }
        for (int64_t j = 0; j < per; j++)
            if (!isfinite(v[r * per + j])) {
                in->nonfinite++;
                fprintf(stderr, "kpl infer: %s: the output holds NaN or inf\n", in->names[r]);
                break;
            }
        if (nd == 2) print_classes(in, r, v + r * per, s[1]);
        else if (nd == 4) print_mask(in, r, v + r * per, s[1], s[2] * s[3]);
        else {
            print_input(in->names[r]);
            printf(",\"output_numel\":%lld}\n", (long long)per);
        }
        free(in->names[r]);
        in->names[r] = NULL;
    }
    fflush(stdout);
    kpl_tensor_release(yf);
    in->done += in->n;
    in->n = 0;
    return KPL_OK;
}

/* The (C, H, W) view of row n of the batch. */
static kpl_status row_view(infer *in, kpl_tensor **row)
{
    kpl_tensor *r1 = NULL;
    KPL_TRY(kpl_tensor_narrow(in->batch, in->n, 1, &r1));
    kpl_status st = kpl_tensor_reshape(r1, 3, in->shape + 1, row);
    kpl_tensor_release(r1);
    return st;
}

static kpl_status add_row(infer *in, const char *name, int64_t label)
{
    in->names[in->n] = strdup(name);
    in->labels[in->n] = label;
    if (++in->n == in->shape[0]) return flush(in);
    return KPL_OK;
}

static kpl_status image_file(infer *in, const char *path)
{
    char *buf = NULL;
    size_t len = 0;
    FILE *f = fopen(path, "rb");
    KPL_CHECK(f, KPL_EIO, "%s: cannot open", path);
    if (fseek(f, 0, SEEK_END) == 0) {
        long n = ftell(f);
        if (n >= 0 && fseek(f, 0, SEEK_SET) == 0 && (buf = malloc((size_t)n + 1)))
            len = fread(buf, 1, (size_t)n, f) == (size_t)n ? (size_t)n : 0;
    }
    fclose(f);
    kpl_tensor *row = NULL;
    kpl_status st = buf && len ? row_view(in, &row) : KPL_ERROR(KPL_EIO, "%s: cannot read", path);
    if (st == KPL_OK) st = kpl_transform_image(&in->tc, buf, len, row);
    kpl_tensor_release(row);
    free(buf);
    if (st < 0) return kpl_error_prefix(st, "%s: ", path);
    return add_row(in, path, -1);
}

/* The tuple of an .npy header's 'shape' (text after the key): "(a, b, c)",
 * "(a,)" or "()"; each a non-negative decimal integer below 2^40.  The
 * number of dims, or -1 for anything else. */
static int npy_shape(const char *p, int64_t dims[8])
{
    int nd = 0;
    while (*p == ' ') p++;
    if (*p++ != '(') return -1;
    for (;;) {
        while (*p == ' ') p++;
        if (*p == ')') return nd;
        if (*p < '0' || *p > '9' || nd == 8) return -1;
        int64_t v = 0;
        while (*p >= '0' && *p <= '9') {
            v = v * 10 + (*p++ - '0');
            if (v >= (int64_t)1 << 40) return -1;
        }
        dims[nd++] = v;
        while (*p == ' ') p++;
        if (*p == ',') p++;
        else if (*p != ')') return -1;
    }
}

/* A NumPy file of float32 rows shaped as the model's (C, H, W). */
static kpl_status npy_file(infer *in, const char *path)
{
    FILE *f = fopen(path, "rb");
    KPL_CHECK(f, KPL_EIO, "%s: cannot open", path);
    uint8_t head[10];
    char hdr[4096];
    kpl_status st = KPL_OK;
    size_t hl = 0;
    if (fread(head, 1, 10, f) != 10 || memcmp(head, "\x93NUMPY", 6) || head[6] < 1 || head[6] > 3) {
        st = KPL_ERROR(KPL_EFORMAT, "%s: not a NumPy .npy file", path);
    } else if (head[6] == 1) {
        hl = (size_t)head[8] | (size_t)head[9] << 8;
    } else { /* 4-byte length: two more bytes */
        uint8_t more[2];
        if (fread(more, 1, 2, f) != 2) st = KPL_ERROR(KPL_EFORMAT, "%s: truncated header", path);
        hl = (size_t)head[8] | (size_t)head[9] << 8 | (size_t)more[0] << 16 | (size_t)more[1] << 24;
    }
    if (st == KPL_OK && (hl >= sizeof hdr || fread(hdr, 1, hl, f) != hl))
        st = KPL_ERROR(KPL_EFORMAT, "%s: header of %zu bytes", path, hl);
    int64_t dims[8], nd = 0;
    if (st == KPL_OK) {
        hdr[hl] = 0;
        const char *sh = strstr(hdr, "'shape':");
        if (!strstr(hdr, "'descr': '<f4'") || !strstr(hdr, "'fortran_order': False") || !sh) {
            st = KPL_ERROR(KPL_EFORMAT, "%s: want little-endian float32 ('<f4') in C order: %s",
                           path, hdr);
        } else if ((nd = npy_shape(sh + 8, dims)) < 0) {
            st = KPL_ERROR(KPL_EFORMAT, "%s: the header's shape is not a tuple of up to 8 "
                           "non-negative integers: %s", path, hdr);
        }
    }
    int64_t rows = nd == 4 ? dims[0] : 1;
    const int64_t *chw = nd == 4 ? dims + 1 : dims;
    if (st == KPL_OK && ((nd != 3 && nd != 4) || memcmp(chw, in->shape + 1, 3 * sizeof *chw) ||
                         kpl_model_input_dtype(in->m, 0) != KPL_F32))
        st = KPL_ERROR(KPL_ESHAPE, "%s: the array must be float32 (C, H, W) or (N, C, H, W) with "
                       "(C, H, W) = (%lld, %lld, %lld), the model's input",
                       path, (long long)in->shape[1], (long long)in->shape[2], (long long)in->shape[3]);
    size_t n = (size_t)(in->shape[1] * in->shape[2] * in->shape[3]) * sizeof(float);
    /* the data after the header is exactly the shape's, no less, no more */
    struct stat sb;
    long at = st == KPL_OK ? ftell(f) : -1;
    if (st == KPL_OK && (at < 0 || fstat(fileno(f), &sb) != 0))
        st = KPL_ERROR(KPL_EIO, "%s: cannot tell its size", path);
    if (st == KPL_OK && (uint64_t)(sb.st_size - at) != (uint64_t)rows * n)
        st = KPL_ERROR(KPL_EFORMAT, "%s: %lld bytes of data after the header, the shape says "
                       "%lld x %zu", path, (long long)(sb.st_size - at), (long long)rows, n);
    for (int64_t r = 0; r < rows && st == KPL_OK; r++) {
        kpl_tensor *row = NULL;
        st = row_view(in, &row);
        void *dst = st == KPL_OK ? kpl_tensor_host_mutable(row) : NULL;
        if (st == KPL_OK && (!dst || fread(dst, 1, n, f) != n))
            st = KPL_ERROR(KPL_EFORMAT, "%s: row %lld is cut short", path, (long long)r);
        kpl_tensor_release(row);
        char name[4200];
        snprintf(name, sizeof name, "%s#%lld", path, (long long)r);
        if (st == KPL_OK) st = add_row(in, name, -1);
    }
    fclose(f);
    return st;
}

static kpl_status record_split(infer *in, const char *dir, int64_t limit)
{
    kpl_dataset *ds = NULL;
    KPL_TRY(kpl_dataset_open(dir, &ds));
    kpl_chunk *c = kpl_chunk_create();
    kpl_status st = c ? KPL_OK : KPL_ERROR(KPL_ENOMEM, "no host memory");
    kpl_transform_config tc = in->tc;
    tc.label_feature = kpl_dataset_find_feature(ds, "label") >= 0 ? "label" : NULL;
    int64_t n = kpl_dataset_num_examples(ds);
    if (limit > 0 && limit < n) n = limit;
    for (int64_t e = 0; e < n && st == KPL_OK; e++) {
        kpl_tensor *row = NULL;
        int64_t label = -1;
        st = row_view(in, &row);
        if (st == KPL_OK)
            st = kpl_transform_example(&tc, ds, e, c, row, tc.label_feature ? &label : NULL);
        kpl_tensor_release(row);
        char name[4200];
        snprintf(name, sizeof name, "%s#%lld", dir, (long long)e);
        if (st == KPL_OK) st = add_row(in, name, label);
    }
    kpl_chunk_destroy(c);
    kpl_dataset_close(ds);
    return st;
}

int kpl__cmd_infer(int argc, char **argv)
{
    const char *model = NULL;
    long long top = 5, limit = 0, level = -1;
    bool search = false, logits = false;
    const char **inputs = calloc((size_t)argc + 1, sizeof *inputs);
    int ninputs = 0, rc = 0;
    if (!inputs) return 1;
    for (int i = 0; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "-h") || !strcmp(a, "--help")) {
            usage_infer(stdout);
            free(inputs);
            return 0;
        } else if (!strcmp(a, "--top") || !strcmp(a, "--limit") || !strcmp(a, "--level")) {
            char *end = NULL;
            long long v = i + 1 < argc ? strtoll(argv[i + 1], &end, 10) : -1;
            if (i + 1 >= argc || *end || v < (a[2] == 'l' && a[3] == 'e' ? 0 : 1) ||
                (a[3] == 'e' && v > 3)) {
                fprintf(stderr, "kpl infer: %s needs %s\n", a,
                        a[3] == 'e' ? "0, 1, 2 or 3" : "a positive integer");
                free(inputs);
                return 2;
            }
            i++;
            if (a[2] == 't') top = v;
            else if (a[3] == 'i') limit = v;
            else level = v;
        } else if (!strcmp(a, "--search")) {
            search = true;
        } else if (!strcmp(a, "--logits")) {
            logits = true;
        } else if (a[0] == '-' && a[1]) {
            fprintf(stderr, "kpl infer: unknown option '%s' (try 'kpl infer --help')\n", a);
            free(inputs);
            return 2;
        } else if (!model) {
            model = a;
        } else {
            inputs[ninputs++] = a;
        }
    }
    if (!model || !ninputs) {
        fprintf(stderr, "kpl infer: a MODEL.kplm and at least one INPUT are required (try 'kpl "
                        "infer --help')\n");
        free(inputs);
        return 2;
    }
    kpl_set_deterministic(!search);
    infer in = {.top = (int)top, .logits = logits};
    kpl_status st = kpl_model_load(model, (int)level, &in.m);
    int64_t ishape[KPL_MAX_DIMS];
    if (st == KPL_OK && (kpl_model_num_inputs(in.m) != 1 ||
                         kpl_model_input_shape(in.m, 0, ishape) != 4 || ishape[0] < 1))
        st = KPL_ERROR(KPL_EINVAL, "%s: not a model of one image batch (N, C, H, W)", model);
    if (st == KPL_OK) memcpy(in.shape, ishape, sizeof in.shape);
    if (st == KPL_OK) st = kpl_model_transform(in.m, &in.tc);
    if (st == KPL_OK && in.tc.out_dtype != kpl_model_input_dtype(in.m, 0))
        st = KPL_ERROR(KPL_EFORMAT, "%s: the transform makes %s, the model takes %s", model,
                       kpl_dtype_name(in.tc.out_dtype),
                       kpl_dtype_name(kpl_model_input_dtype(in.m, 0)));
    if (st == KPL_OK) st = kpl_tensor_zeros(kpl_device_cpu(), kpl_model_input_dtype(in.m, 0), 4,
                                            in.shape, &in.batch);
    if (st == KPL_OK) {
        in.names = calloc((size_t)in.shape[0], sizeof *in.names);
        in.labels = calloc((size_t)in.shape[0], sizeof *in.labels);
        if (!in.names || !in.labels) st = KPL_ERROR(KPL_ENOMEM, "no host memory");
    }
    if (st < 0) {
        fprintf(stderr, "kpl infer: %s\n", kpl_last_error());
        rc = st == KPL_ENOTFOUND ? 2 : 1;
        goto out;
    }
    int64_t failed = 0;
    for (int i = 0; i < ninputs && st >= 0; i++) {
        struct stat sb;
        bool dir = stat(inputs[i], &sb) == 0 && S_ISDIR(sb.st_mode);
        size_t len = strlen(inputs[i]);
        bool npy = len > 4 && !strcmp(inputs[i] + len - 4, ".npy");
        kpl_status s = dir   ? record_split(&in, inputs[i], limit)
                       : npy ? npy_file(&in, inputs[i])
                             : image_file(&in, inputs[i]);
        if (s < 0 && (s == KPL_EFORMAT || s == KPL_EIO || s == KPL_ENOTFOUND) && !dir) {
            fprintf(stderr, "kpl infer: skipped %s\n", kpl_last_error());
            failed++;
        } else if (s < 0) {
            st = s;
        }
    }
    if (st >= 0) st = flush(&in);
    if (st < 0) {
        fprintf(stderr, "kpl infer: %s\n", kpl_last_error());
        rc = 1;
    } else {
        printf("{\"event\":\"done\",\"examples\":%lld,\"failed\":%lld", (long long)in.done,
               (long long)failed);
        if (in.labelled)
            printf(",\"labelled\":%lld,\"top1\":%.4f", (long long)in.labelled,
                   100.0 * (double)in.right / (double)in.labelled);
        if (in.nonfinite) printf(",\"nonfinite\":%lld", (long long)in.nonfinite);
        printf(",\"batch\":%lld,\"run_ms\":%.1f}\n", (long long)in.shape[0], in.run_ms);
        rc = failed || in.nonfinite ? 1 : 0;
    }
out:
    for (int r = 0; in.names && r < in.shape[0]; r++) free(in.names[r]);
    free(in.names);
    free(in.labels);
    kpl_tensor_release(in.batch);
    kpl_model_destroy(in.m);
    free(inputs);
    return rc;
}

/* ---- kpl import onnx, kpl import torch ---- */

static void usage_import(FILE *f)
{
    fprintf(f,
            "usage: kpl import onnx MODEL.onnx -o WEIGHTS.kpl [--prefix P] [--exclude GLOB]...\n"
            "                  [--check PRESET [--classes N]]\n"
            "       kpl import torch FILE.pth -o WEIGHTS.kpl [--key K] [--prefix P]\n"
            "                  [--exclude GLOB]... [--check PRESET [--classes N]]\n"
            "\n"
            "Writes the weights of an ONNX model (its initializers) or of a PyTorch\n"
            "checkpoint (what torch.save writes, PyTorch 1.6 and later: a state dict, or a\n"
            "dict holding one under state_dict, model, ...; --key K names it) as a kpl\n"
            "checkpoint, each tensor under P + its name (P defaults to \"model.\", what the\n"
            "recipe key model.weights and kpl's own checkpoints use).  Nothing in either\n"
            "file is executed.  torchvision's and timm's state dicts have the names of kpl's\n"
            "zoo: conv1.weight, layer1.0.bn1.running_mean, fc.bias.  A torchvision model\n"
            "exported to ONNX in training mode (torch.onnx.export(...,\n"
            "training=torch.onnx.TrainingMode.TRAINING, do_constant_folding=False)) keeps\n"
            "them too; an eval-mode export folded batch norm into the convolutions\n"
            "(onnx::Conv_N names) and is refused.\n"
            "--exclude leaves out the tensors whose names match (e.g. 'fc.*' to train a new\n"
            "head).  --check builds a zoo preset (resnet18, resnet50, ...; --classes N for\n"
            "its head, 0 for the backbone) and loads the weights into it, printing how many\n"
            "of its tensors the file sets and which it does not.\n");
}

int kpl__cmd_import(int argc, char **argv)
{
    if (argc >= 1 && (!strcmp(argv[0], "-h") || !strcmp(argv[0], "--help"))) {
        usage_import(stdout);
        return 0;
    }
    if (argc < 1 || (strcmp(argv[0], "onnx") && strcmp(argv[0], "torch"))) {
        fprintf(stderr, "kpl import: the format comes first: kpl import onnx MODEL.onnx -o OUT.kpl, "
                        "or kpl import torch FILE.pth -o OUT.kpl\n");
        usage_import(stderr);
        return 2;
    }
    const char *fmt = argv[0];
    bool torch = !strcmp(fmt, "torch");
    const char *in = NULL, *out = NULL, *prefix = "model.", *check = NULL, *key = NULL;
    long long classes = 1000;
    const char **excl = calloc((size_t)argc + 1, sizeof *excl);
    int nexcl = 0;
    if (!excl) return 1;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        bool val = !strcmp(a, "-o") || !strcmp(a, "--prefix") || !strcmp(a, "--exclude") ||
                   !strcmp(a, "--check") || !strcmp(a, "--classes") ||
                   (torch && !strcmp(a, "--key"));
        if (!strcmp(a, "-h") || !strcmp(a, "--help")) {
            usage_import(stdout);
            free(excl);
            return 0;
        } else if (val && i + 1 >= argc) {
            fprintf(stderr, "kpl import %s: %s needs a value\n", fmt, a);
            free(excl);
            return 2;
        } else if (!strcmp(a, "-o")) {
            out = argv[++i];
        } else if (!strcmp(a, "--key")) {
            key = argv[++i];
        } else if (!strcmp(a, "--prefix")) {
            prefix = argv[++i];
        } else if (!strcmp(a, "--exclude")) {
            excl[nexcl++] = argv[++i];
        } else if (!strcmp(a, "--check")) {
            check = argv[++i];
        } else if (!strcmp(a, "--classes")) {
            char *end = NULL;
            classes = strtoll(argv[++i], &end, 10);
            if (*end || classes < 0) {
                fprintf(stderr, "kpl import %s: --classes needs a count >= 0\n", fmt);
                free(excl);
                return 2;
            }
        } else if (a[0] == '-' || in) {
            fprintf(stderr, "kpl import %s: unexpected argument '%s'\n", fmt, a);
            usage_import(stderr);
            free(excl);
            return 2;
        } else {
            in = a;
        }
    }
    if (!in || !out) {
        fprintf(stderr, "kpl import %s: needs %s and -o WEIGHTS.kpl\n", fmt,
                torch ? "FILE.pth" : "MODEL.onnx");
        free(excl);
        return 2;
    }
    kpl_checkpoint *c = NULL;
    kpl_module *net = NULL;
    int rc = 0;
    if ((torch ? kpl_torch_import(in, prefix, key, nexcl, excl, &c)
               : kpl_onnx_import(in, prefix, nexcl, excl, &c)) < 0) {
        fprintf(stderr, "kpl %s\n", kpl_last_error()); /* "import onnx: ..." */
        rc = 1;
        goto done;
    }
    if (check) {
        kpl_model_config mc;
        kpl_state_report rep;
        memset(&rep, 0, sizeof rep);
        if (kpl_zoo_preset(check, classes, &mc) < 0 ||
            kpl_zoo_create(&mc, kpl_device_cpu(), 0, &net) < 0 ||
            kpl_module_state_load(net, c, prefix, false, &rep) < 0) {
            fprintf(stderr, "kpl import %s: --check %s: %s\n", fmt, check, kpl_last_error());
            kpl_state_report_clear(&rep);
            rc = 1;
            goto done;
        }
        printf("{\"check\":\"%s\",\"loaded\":%d,\"missing\":%d,\"unexpected\":%d}\n", check,
               rep.nloaded, rep.nmissing, rep.nunexpected);
        if (rep.nmissing)
            fprintf(stderr, "kpl import %s: %s tensors the file does not set: %s\n", fmt, check,
                    rep.missing);
        if (rep.nunexpected)
            fprintf(stderr, "kpl import %s: tensors of the file %s does not have: %s\n", fmt,
                    check, rep.unexpected);
        kpl_state_report_clear(&rep);
    }
    char meta[1024];
    snprintf(meta, sizeof meta, "{\"source\":\"%s\",\"tensors\":%d}", fmt,
             kpl_checkpoint_num_tensors(c));
    if (kpl_checkpoint_set_meta(c, meta) < 0 || kpl_checkpoint_save(c, out) < 0) {
        fprintf(stderr, "kpl import %s: %s\n", fmt, kpl_last_error());
        rc = 1;
        goto done;
    }
    printf("{\"event\":\"done\",\"output\":\"%s\",\"tensors\":%d}\n", out,
           kpl_checkpoint_num_tensors(c));
done:
    kpl_module_destroy(net);
    kpl_checkpoint_destroy(c);
    free(excl);
    return rc;
}
