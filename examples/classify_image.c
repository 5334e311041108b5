/*
 * classify_image.c — the inference API (infer.h) in a program of its own:
 * load a model file written by `kpl export`, put images through the
 * transform stored in it, run the graph, print each image's best class.
 *
 *   kpl export recipes/fashion_mnist/cnn.yaml --checkpoint runs/.../best.kpl -o cnn.kplm
 *   ./example_classify_image cnn.kplm shirt.png boot.jpg
 *   shirt.png: class 6 (p = 0.91)
 *
 * Build against an installed kpl:
 *   cc classify_image.c $(pkg-config --cflags --libs kpl) -lm
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <trainer.h>

static char *read_file(const char *path, size_t *len)
{
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    char *buf = NULL;
    if (fseek(f, 0, SEEK_END) == 0) {
        long n = ftell(f);
        if (n > 0 && fseek(f, 0, SEEK_SET) == 0 && (buf = malloc((size_t)n)) &&
            fread(buf, 1, (size_t)n, f) != (size_t)n) {
            free(buf);
            buf = NULL;
        }
        *len = (size_t)n;
    }
    fclose(f);
    return buf;
}

int main(int argc, char **argv)
{
    if (argc < 3) {
        fprintf(stderr, "usage: %s MODEL.kplm IMAGE...\n", argv[0]);
        return 2;
    }
    kpl_model *m = NULL;
    kpl_transform_config tc;
    if (kpl_model_load(argv[1], -1, &m) < 0 || kpl_model_transform(m, &tc) < 0) {
        fprintf(stderr, "%s\n", kpl_last_error());
        kpl_model_destroy(m);
        return 1;
    }
    int64_t shape[KPL_MAX_DIMS]; /* (B, C, H, W): the batch the model was exported for */
    kpl_model_input_shape(m, 0, shape);
    kpl_tensor *batch = NULL, *row1 = NULL, *row = NULL;
    int rc = 0;
    if (kpl_tensor_zeros(kpl_device_cpu(), kpl_model_input_dtype(m, 0), 4, shape, &batch) < 0 ||
        kpl_tensor_narrow(batch, 0, 1, &row1) < 0 || kpl_tensor_reshape(row1, 3, shape + 1, &row) < 0) {
        fprintf(stderr, "%s\n", kpl_last_error());
        rc = 1;
    }
    /* one image at a time, in row 0 of the batch */
    for (int i = 2; i < argc && rc == 0; i++) {
        size_t len = 0;
        char *bytes = read_file(argv[i], &len);
        if (!bytes || kpl_transform_image(&tc, bytes, len, row) < 0 ||
            kpl_model_set_input(m, 0, batch) < 0 || kpl_model_run(m) < 0) {
            fprintf(stderr, "%s: %s\n", argv[i], bytes ? kpl_last_error() : "cannot read");
            free(bytes);
            rc = 1;
            break;
        }
        free(bytes);
        kpl_tensor *logits = kpl_model_output(m, 0); /* (B, classes) */
        const float *v = kpl_tensor_host_data(logits);
        int64_t classes = kpl_tensor_shape(logits)[1], best = 0;
        double sum = 0;
        for (int64_t c = 0; c < classes; c++) best = v[c] > v[best] ? c : best;
        for (int64_t c = 0; c < classes; c++) sum += exp(v[c] - v[best]);
        printf("%s: class %lld (p = %.4f)\n", argv[i], (long long)best, 1 / sum);
    }
    kpl_tensor_release(row);
    kpl_tensor_release(row1);
    kpl_tensor_release(batch);
    kpl_model_destroy(m);
    return rc;
}
