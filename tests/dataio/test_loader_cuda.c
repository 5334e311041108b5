/* test_loader_cuda.c — the loader with device = cuda:0 (label cuda; exits
 * 77, skipped, without a GPU).  Its batch slots are page-locked, so an
 * upload of a batch does not make the host wait; the batch may be released
 * (its slot handed back to the workers, who write the next batches into
 * it) right after the upload is queued.  The GPU copies must still hold
 * the batches the CPU loader gives for the same configuration, over
 * several epochs of slots cycling, for batches small enough to go straight
 * to the device and large enough to go through a staging block. */
#define KPL_TEST_NAME "loader_cuda"
#include "dataio_test.h"

#include <unistd.h>

#define SIDE 64 /* 4 KiB raw gray images: 16 KiB each as f32 */

static kpl_device *gpu;

static uint8_t pix(int64_t e, int y, int x) { return (uint8_t)((5 * e + 3 * y + x) % 256); }

static const char *make_set(int64_t n)
{
    const char *p = tmp_path("set");
    if (access(p, F_OK) == 0) return p;
    kpl_feature_spec schema[2] = {
        {.name = "image", .type = KPL_FEATURE_BYTES, .encoding = "raw", .ndim = 3,
         .shape = {SIDE, SIDE, 1}},
        {.name = "label", .type = KPL_FEATURE_INT64},
    };
    kpl_record_writer_config cfg = KPL_RECORD_WRITER_CONFIG_INIT;
    cfg.shards = 2;
    cfg.chunk_bytes = 1 << 16;
    kpl_record_writer *w = NULL;
    OK(kpl_record_writer_create(p, 2, schema, &cfg, &w));
    for (int64_t e = 0; e < n; e++) {
        uint8_t img[SIDE * SIDE];
        for (int y = 0; y < SIDE; y++)
            for (int x = 0; x < SIDE; x++) img[y * SIDE + x] = pix(e, y, x);
        kpl_feature_value v[2] = {{img, SIDE * SIDE}, {&e, 1}};
        OK(kpl_record_writer_add(w, v));
    }
    OK(kpl_record_writer_close(w));
    return p;
}

/* A batch's image and label: GPU copies (uploaded while the batch was
 * held) or host copies. */
typedef struct {
    kpl_tensor *image, *label;
} held;

static void test_loader_cuda_batches(void **state)
{
    (void)state;
    const int64_t n = 300, epochs = 3;
    const char *path = make_set(n);
    const int64_t sizes[2] = {8, 80}; /* 128 KiB and 1.25 MiB images */
    for (int k = 0; k < 2; k++) {
        kpl_loader_config c = KPL_LOADER_CONFIG_INIT;
        c.path = path;
        c.batch_size = sizes[k];
        c.workers = 2;
        c.prefetch = 2;
        c.seed = 11;
        c.transform.channels = 1;
        kpl_loader *lc = NULL, *lg = NULL;
        OK(kpl_loader_create(&c, &lc));
        c.device = gpu;
        OK(kpl_loader_create(&c, &lg));
        int64_t per = kpl_loader_batches_per_epoch(lc);
        assert_int_equal(kpl_loader_batches_per_epoch(lg), per);
        held *want = calloc((size_t)(per * epochs), sizeof *want);
        held *got = calloc((size_t)(per * epochs), sizeof *got);
        assert_true(want && got);
        for (int64_t i = 0; i < per * epochs; i++) {
            kpl_batch b;
            OK(kpl_loader_next(lg, &b));
            OK(kpl_tensor_to_device(b.image, gpu, &got[i].image));
            OK(kpl_tensor_to_device(b.label, gpu, &got[i].label));
            kpl_batch_release(&b); /* the slot goes back while the upload may run */
            OK(kpl_loader_next(lc, &b));
            OK(kpl_tensor_to_device(b.image, kpl_device_cpu(), &want[i].image));
            OK(kpl_tensor_to_device(b.label, kpl_device_cpu(), &want[i].label));
            kpl_batch_release(&b);
        }
        for (int64_t i = 0; i < per * epochs; i++) {
            kpl_tensor *gi = NULL, *gl = NULL;
            OK(kpl_tensor_to_device(got[i].image, kpl_device_cpu(), &gi));
            OK(kpl_tensor_to_device(got[i].label, kpl_device_cpu(), &gl));
            assert_int_equal(kpl_tensor_nbytes(gi), kpl_tensor_nbytes(want[i].image));
            if (memcmp(kpl_tensor_host_data(gi), kpl_tensor_host_data(want[i].image),
                       kpl_tensor_nbytes(gi)))
                fail_msg("batch %lld of %lld (size %lld): the GPU copy differs from the CPU "
                         "loader's batch", (long long)i, (long long)(per * epochs),
                         (long long)sizes[k]);
            assert_memory_equal(kpl_tensor_host_data(gl), kpl_tensor_host_data(want[i].label),
                                kpl_tensor_nbytes(gl));
            /* and the pixels are the dataset's */
            const float *px = kpl_tensor_host_data(gi);
            const int64_t *lab = kpl_tensor_host_data(gl);
            assert_float_equal(px[SIDE + 2], pix(lab[0], 1, 2) / 255.0f, 1e-7);
            kpl_tensor_release(gi);
            kpl_tensor_release(gl);
            kpl_tensor_release(got[i].image);
            kpl_tensor_release(got[i].label);
            kpl_tensor_release(want[i].image);
            kpl_tensor_release(want[i].label);
        }
        free(want);
        free(got);
        kpl_loader_destroy(lg);
        kpl_loader_destroy(lc);
    }
    OK(kpl_device_synchronize(gpu));
}

int main(void)
{
    gpu = kpl_test_gpu();
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_loader_cuda_batches),
    };
    return cmocka_run_group_tests_name("loader_cuda", tests, setup, teardown);
}
