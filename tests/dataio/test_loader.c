/* test_loader.c — the sample order (every example once per epoch across 2
 * and 4 ranks, padding and dropping, rotation, chunk windows, the shuffle
 * buffer) and the multi-process loader: exact pixels and labels in the
 * order the sampler gives, the same batches whatever the worker count,
 * resume equivalence, a killed worker or reader reported within a second
 * with no process left behind, corrupt images skipped or reported, bad
 * configurations refused, boxes, box labels and masks in their own
 * tensors, and keep_ratio batches of mixed sizes padded, with each image's
 * size. */
#define KPL_TEST_NAME "loader"
#include "dataio_test.h"
#include "loader_impl.h"
#include "transform_impl.h"

#include <errno.h>
#include <fcntl.h>
#include <png.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <time.h>
#include <turbojpeg.h>
#include <unistd.h>

/* ---- a synthetic raw-pixel dataset: example e is a 32x32 gray image with
 *      pixel (y, x) = (7e + 8y + x) mod 256, and label e ---- */

#define S 32 /* 1 KiB records: several per 4 KiB chunk */
static uint8_t pix(int64_t e, int y, int x) { return (uint8_t)((7 * e + S * y + x) % 256); }

static const char *make_set_z(const char *name, int64_t n, int shards, size_t chunk_bytes,
                              int zstd_level)
{
    static char p[4][256];
    static int k;
    k = (k + 1) % 4;
    snprintf(p[k], sizeof p[k], "%s/%s", tmp_root, name);
    if (access(p[k], F_OK) == 0) return p[k];
    kpl_feature_spec schema[2] = {
        {.name = "image", .type = KPL_FEATURE_BYTES, .encoding = "raw", .ndim = 3,
         .shape = {S, S, 1}},
        {.name = "label", .type = KPL_FEATURE_INT64},
    };
    kpl_record_writer_config cfg = KPL_RECORD_WRITER_CONFIG_INIT;
    cfg.shards = shards;
    cfg.chunk_bytes = chunk_bytes;
    cfg.zstd_level = zstd_level;
    kpl_record_writer *w = NULL;
    OK(kpl_record_writer_create(p[k], 2, schema, &cfg, &w));
    for (int64_t e = 0; e < n; e++) {
        uint8_t img[S * S];
        for (int y = 0; y < S; y++)
            for (int x = 0; x < S; x++) img[y * S + x] = pix(e, y, x);
        kpl_feature_value v[2] = {{img, S * S}, {&e, 1}};
        OK(kpl_record_writer_add(w, v));
    }
    OK(kpl_record_writer_close(w));
    return p[k];
}

static const char *make_set(const char *name, int64_t n, int shards, size_t chunk_bytes)
{
    return make_set_z(name, n, shards, chunk_bytes, 3);
}

/* ---- the order ------------------------------------------------------------------- */

static void test_order_partition(void **state)
{
    (void)state;
    const int64_t n = 103;
    kpl_dataset *ds = NULL;
    OK(kpl_dataset_open(make_set("order", n, 3, 4096), &ds));
    assert_true(kpl_dataset_num_chunks(ds) >= 8);
    int64_t order[128], count[103];
    /* limit 37: the same rules over the dataset's first 37 examples */
    for (int inter = 0; inter < 2; inter++)
    for (int64_t limit = 0; limit <= 37; limit += 37)
    for (int mode = KPL_SHUFFLE_NONE; mode <= KPL_SHUFFLE_EXAMPLE; mode++)
        for (int world = 1; world <= 4; world *= 2)
            for (int pad = 0; pad < 2; pad++)
                for (int rotate = 0; rotate < 2; rotate++)
                    for (int64_t epoch = 0; epoch < 3; epoch++) {
                        int64_t ne = limit ? limit : n;
                        memset(count, 0, sizeof count);
                        int64_t m = kpl__order_size(ne, world, pad);
                        assert_int_equal(m, pad ? (ne + world - 1) / world : ne / world);
                        for (int r = 0; r < world; r++) {
                            kpl__order_params p = {(kpl_shuffle_mode)mode, 42, r, world, 3, 10,
                                                   pad, rotate, limit, inter};
                            assert_int_equal(kpl__order_examples(ds, &p), ne);
                            OK(kpl__order_epoch(ds, &p, epoch, order));
                            for (int64_t i = 0; i < m; i++) {
                                assert_true(order[i] >= 0 && order[i] < ne);
                                count[order[i]]++;
                            }
                        }
                        int64_t total = 0, twice = 0, zero = 0;
                        for (int64_t e = 0; e < ne; e++) {
                            total += count[e];
                            twice += count[e] > 1 ? count[e] - 1 : 0;
                            zero += count[e] == 0;
                            assert_true(count[e] <= 2);
                        }
                        assert_int_equal(total, world * m);
                        /* No pad: each at most once, N mod world left out.
                         * Pad: each at least once, the rest repeated. */
                        assert_int_equal(pad ? zero : twice, 0);
                        assert_int_equal(pad ? twice : zero, pad ? world * m - ne : ne % world);
                    }
    kpl_dataset_close(ds);
}

static void test_order_properties(void **state)
{
    (void)state;
    const int64_t n = 103;
    kpl_dataset *ds = NULL;
    OK(kpl_dataset_open(make_set("order", n, 3, 4096), &ds));
    int64_t a[103], b[103], c[103];
    /* none: the dataset order, sliced. */
    kpl__order_params p = {KPL_SHUFFLE_NONE, 1, 1, 2, 0, 0, false, false, 0, false};
    OK(kpl__order_epoch(ds, &p, 0, a));
    for (int64_t i = 0; i < 51; i++) assert_int_equal(a[i], 51 + i);
    /* Interleaved: rank r takes every world-th example from r, so two
     * ranks' k-th examples are the k-th pair of one rank's order (example
     * shuffle: the permutation does not depend on the world size). */
    for (int mode = KPL_SHUFFLE_NONE; mode <= KPL_SHUFFLE_EXAMPLE; mode += 3) {
        kpl__order_params one = {(kpl_shuffle_mode)mode, 3, 0, 1, 0, 0, false, false, 0, true};
        OK(kpl__order_epoch(ds, &one, 2, c));
        for (int r = 0; r < 2; r++) {
            kpl__order_params two = one;
            two.rank = r, two.world = 2;
            OK(kpl__order_epoch(ds, &two, 2, a));
            for (int64_t i = 0; i < 51; i++) assert_int_equal(a[i], c[2 * i + r]);
        }
    }
    /* Rotation: in epoch 1 rank 1 has partition 0. */
    p.rotate = true;
    OK(kpl__order_epoch(ds, &p, 1, a));
    for (int64_t i = 0; i < 51; i++) assert_int_equal(a[i], i);

    /* chunk: deterministic, new each epoch, and at most `window` chunks in
     * use at any time (a chunk is in use from its first to its last
     * example in the order). */
    for (int window = 1; window <= 4; window++) {
        p = (kpl__order_params){KPL_SHUFFLE_CHUNK, 7, 0, 1, window, 0, false, false, 0, false};
        OK(kpl__order_epoch(ds, &p, 0, a));
        OK(kpl__order_epoch(ds, &p, 0, b));
        OK(kpl__order_epoch(ds, &p, 1, c));
        assert_memory_equal(a, b, sizeof a);
        assert_memory_not_equal(a, c, sizeof a);
        int64_t first[64], last[64];
        for (int k = 0; k < 64; k++) first[k] = last[k] = -1;
        for (int64_t i = 0; i < n; i++) {
            int64_t ch;
            int rec;
            OK(kpl_dataset_locate(ds, a[i], &ch, &rec));
            if (first[ch] < 0) first[ch] = i;
            last[ch] = i;
        }
        int worst = 0;
        for (int64_t i = 0; i < n; i++) {
            int open = 0;
            for (int k = 0; k < 64; k++) open += first[k] >= 0 && first[k] <= i && i <= last[k];
            if (open > worst) worst = open;
        }
        assert_true(worst <= window);
        if (window > 1) assert_true(worst > 1); /* examples do mix across chunks */
    }

    /* buffer: a permutation in which example i of the stream leaves no
     * later than position i + fill - 1... and no earlier than it arrives:
     * the element at output i arrived at stream index <= i + fill - 1. */
    p = (kpl__order_params){KPL_SHUFFLE_BUFFER, 9, 0, 1, 0, 16, false, false, 0, false};
    OK(kpl__order_epoch(ds, &p, 0, a));
    int64_t seen[103] = {0};
    int64_t moved = 0;
    for (int64_t i = 0; i < n; i++) {
        seen[a[i]]++;
        assert_true(a[i] <= i + 15);
        moved += a[i] != i;
    }
    for (int64_t e = 0; e < n; e++) assert_int_equal(seen[e], 1);
    assert_true(moved > n / 2);
    /* example: a full permutation, different per seed. */
    p = (kpl__order_params){KPL_SHUFFLE_EXAMPLE, 1, 0, 1, 0, 0, false, false, 0, false};
    OK(kpl__order_epoch(ds, &p, 0, a));
    p.seed = 2;
    OK(kpl__order_epoch(ds, &p, 0, b));
    assert_memory_not_equal(a, b, sizeof a);
    kpl_dataset_close(ds);
}

/* ---- the loader ------------------------------------------------------------------ */

static kpl_loader_config raw_config(const char *path, int64_t batch, int workers)
{
    kpl_loader_config c = KPL_LOADER_CONFIG_INIT;
    c.path = path;
    c.batch_size = batch;
    c.workers = workers;
    c.seed = 5;
    c.shuffle_window = 3;
    c.transform.channels = 1;
    return c;
}

/* The label (= the order it was written in) of each example of a set:
 * with several shards, examples are numbered shard by shard, so example
 * numbers and writing order differ. */
static int64_t label_of[5000];
static void load_labels(const char *path)
{
    kpl_dataset *ds = NULL;
    OK(kpl_dataset_open(path, &ds));
    kpl_chunk *c = NN(kpl_chunk_create());
    int64_t moved = 0;
    for (int64_t e = 0; e < kpl_dataset_num_examples(ds); e++) {
        kpl_feature_value v[2];
        OK(kpl_dataset_read_example(ds, e, c, v));
        memcpy(&label_of[e], v[1].data, 8);
        moved += label_of[e] != e;
    }
    assert_true(kpl_dataset_chunk_info(ds, kpl_dataset_num_chunks(ds) - 1).shard == 0 || moved > 0);
    kpl_chunk_destroy(c);
    kpl_dataset_close(ds);
}

/* Checks a batch of the raw set against the pixel formula (f32 output,
 * mean 0, std 1: x / 255) and returns its examples in ex[]. */
static void check_raw_batch(const kpl_batch *b, int64_t *ex)
{
    const int64_t *e = kpl_tensor_host_data(b->example);
    const int64_t *lab = kpl_tensor_host_data(b->label);
    const float *img = kpl_tensor_host_data(b->image);
    assert_int_equal(kpl_tensor_dim(b->image, 0), b->size);
    assert_int_equal(kpl_tensor_dim(b->image, 1), 1);
    assert_int_equal(kpl_tensor_dim(b->image, 2), S);
    for (int64_t i = 0; i < b->size; i++) {
        assert_int_equal(lab[i], label_of[e[i]]);
        for (int y = 0; y < S; y++)
            for (int x = 0; x < S; x++)
                assert_float_equal(img[(i * S + y) * S + x], pix(lab[i], y, x) / 255.0f, 1e-7);
        ex[i] = e[i];
    }
}

static void test_loader_batches_follow_order(void **state)
{
    (void)state;
    const int64_t n = 103;
    const char *path = make_set("order", n, 3, 4096);
    load_labels(path);
    for (int drop_last = 0; drop_last < 2; drop_last++) {
        kpl_loader_config c = raw_config(path, 10, 2);
        c.drop_last = drop_last;
        kpl_loader *l = NULL;
        OK(kpl_loader_create(&c, &l));
        assert_int_equal(kpl_loader_epoch_size(l), n);
        assert_int_equal(kpl_loader_batches_per_epoch(l), drop_last ? 10 : 11);
        kpl_dataset *ds = NULL;
        OK(kpl_dataset_open(path, &ds));
        kpl__order_params p = {KPL_SHUFFLE_CHUNK, 5, 0, 1, 3, 0, false, false, 0, false};
        for (int64_t epoch = 0; epoch < 3; epoch++) {
            int64_t want[103], got[110];
            OK(kpl__order_epoch(ds, &p, epoch, want));
            int64_t k = 0, nb = 0;
            kpl_batch b;
            for (bool last = false; !last;) {
                OK(kpl_loader_next(l, &b));
                assert_int_equal(b.epoch, epoch);
                assert_int_equal(b.position, k);
                assert_int_equal(b.size, k + 10 <= n ? 10 : n - k);
                check_raw_batch(&b, got + k);
                k += b.size;
                nb++;
                last = b.last;
                /* the last batch says so, and only the last */
                assert_int_equal(last, nb == (drop_last ? 10 : 11));
                kpl_batch_release(&b);
            }
            assert_int_equal(nb, drop_last ? 10 : 11);
            assert_int_equal(k, drop_last ? 100 : n);
            assert_memory_equal(got, want, (size_t)k * sizeof *got);
        }
        kpl_dataset_close(ds);
        kpl_loader_destroy(l);
    }
}

/* All batches of `epochs` epochs: examples into ex (returns the count),
 * images into img when not NULL. */
static int64_t drain(kpl_loader *l, int epochs, int64_t *ex, uint8_t *img, size_t img_each)
{
    int64_t k = 0;
    for (int e = 0; e < epochs; e++) {
        kpl_batch b;
        for (bool last = false; !last;) {
            OK(kpl_loader_next(l, &b));
            memcpy(ex + k, kpl_tensor_host_data(b.example), (size_t)b.size * 8);
            if (img) memcpy(img + (size_t)k * img_each, kpl_tensor_host_data(b.image),
                            (size_t)b.size * img_each);
            k += b.size;
            last = b.last;
            kpl_batch_release(&b);
        }
    }
    return k;
}

static void test_loader_ranks_cover_once(void **state)
{
    (void)state;
    const int64_t n = 103;
    const char *path = make_set("order", n, 3, 4096);
    for (int world = 2; world <= 4; world += 2)
        for (int pad = 0; pad < 2; pad++) {
            int64_t count[2][103] = {{0}};
            for (int r = 0; r < world; r++) {
                kpl_loader_config c = raw_config(path, 8, 1);
                c.rank = r;
                c.world_size = world;
                c.pad = pad;
                c.rotate = true;
                kpl_loader *l = NULL;
                OK(kpl_loader_create(&c, &l));
                int64_t ex[2 * 60];
                int64_t m = kpl_loader_epoch_size(l);
                assert_int_equal(drain(l, 2, ex, NULL, 0), 2 * m);
                for (int64_t i = 0; i < 2 * m; i++) count[i / m][ex[i]]++;
                kpl_loader_destroy(l);
            }
            for (int e = 0; e < 2; e++) {
                int64_t once = 0;
                for (int64_t i = 0; i < n; i++) {
                    assert_true(pad ? count[e][i] >= 1 : count[e][i] <= 1);
                    once += count[e][i] == 1;
                }
                assert_int_equal(once, pad ? n - (world - n % world) % world : n - n % world);
            }
        }
}

/* Random-resized crops and flips: the batches do not depend on the
 * number of workers. */
static void test_loader_workers_deterministic(void **state)
{
    (void)state;
    const char *path = make_set("order", 103, 3, 4096);
    uint8_t *img[2];
    int64_t ex[2][220];
    for (int k = 0; k < 2; k++) {
        kpl_loader_config c = raw_config(path, 7, k ? 3 : 1);
        c.transform.crop = KPL_CROP_RANDOM_RESIZED;
        c.transform.out_h = c.transform.out_w = 6;
        c.transform.flip_prob = 0.5f;
        c.transform.out_dtype = KPL_U8;
        c.shuffle = KPL_SHUFFLE_EXAMPLE;
        kpl_loader *l = NULL;
        OK(kpl_loader_create(&c, &l));
        img[k] = malloc(220 * 36);
        assert_int_equal(drain(l, 2, ex[k], img[k], 36), 206);
        kpl_loader_destroy(l);
    }
    assert_memory_equal(ex[0], ex[1], 206 * 8);
    assert_memory_equal(img[0], img[1], 206 * 36);
    /* The crops really are random: the same example differs across epochs. */
    int differ = 0;
    for (int64_t i = 0; i < 103; i++)
        for (int64_t j = 103; j < 206; j++)
            if (ex[0][i] == ex[0][j]) differ += memcmp(img[0] + i * 36, img[0] + j * 36, 36) != 0;
    assert_true(differ > 50);
    free(img[0]);
    free(img[1]);
}

/* Stopping after some batches and resuming from kpl_loader_position gives
 * the uninterrupted sequence; so does a start in the middle of a batch. */
static void test_loader_resume(void **state)
{
    (void)state;
    const char *path = make_set("order", 103, 3, 4096);
    for (int mode = KPL_SHUFFLE_NONE; mode <= KPL_SHUFFLE_EXAMPLE; mode++) {
        kpl_loader_config c = raw_config(path, 10, 2);
        c.shuffle = (kpl_shuffle_mode)mode;
        c.initial_fill = 20;
        c.transform.crop = KPL_CROP_RANDOM_RESIZED;
        c.transform.out_h = c.transform.out_w = 5;
        c.transform.out_dtype = KPL_U8;
        kpl_loader *l = NULL;
        OK(kpl_loader_create(&c, &l));
        int64_t full[206], part[206];
        uint8_t fimg[206 * 25], pimg[206 * 25];
        assert_int_equal(drain(l, 2, full, fimg, 25), 206);
        kpl_loader_destroy(l);

        OK(kpl_loader_create(&c, &l));
        int64_t k = 0;
        kpl_batch b;
        for (int i = 0; i < 13; i++) { /* 11 batches, the last marked, + 2 */
            OK(kpl_loader_next(l, &b));
            assert_true((i == 10) == b.last);
            memcpy(part + k, kpl_tensor_host_data(b.example), (size_t)b.size * 8);
            memcpy(pimg + k * 25, kpl_tensor_host_data(b.image), (size_t)b.size * 25);
            k += b.size;
            kpl_batch_release(&b);
        }
        int64_t epoch, pos;
        kpl_loader_position(l, &epoch, &pos);
        assert_int_equal(epoch, 1);
        assert_int_equal(pos, 20);
        kpl_loader_destroy(l);
        c.start_epoch = epoch;
        c.start_position = pos;
        OK(kpl_loader_create(&c, &l));
        int64_t more = drain(l, 1, part + k, pimg + k * 25, 25);
        assert_int_equal(k + more, 206);
        assert_memory_equal(full, part, sizeof full);
        assert_memory_equal(fimg, pimg, sizeof fimg);
        kpl_loader_destroy(l);

        /* From the middle of a batch. */
        c.start_epoch = 0;
        c.start_position = 17;
        OK(kpl_loader_create(&c, &l));
        OK(kpl_loader_next(l, &b));
        assert_int_equal(b.position, 17);
        assert_int_equal(b.size, 10);
        assert_memory_equal(kpl_tensor_host_data(b.example), full + 17, 10 * 8);
        kpl_batch_release(&b);
        kpl_loader_destroy(l);
    }
}

static void assert_no_children(void)
{
    int status;
    errno = 0;
    assert_int_equal(waitpid(-1, &status, WNOHANG), -1);
    assert_int_equal(errno, ECHILD);
}

/* Kills process `which` (0 the reader, 1.. a worker) after one batch:
 * kpl_loader_next fails within a second naming it; nothing is left. */
static void kill_one(const char *path, int which)
{
    kpl_loader_config c = raw_config(path, 4, 2);
    kpl_loader *l = NULL;
    OK(kpl_loader_create(&c, &l));
    kpl_batch b;
    OK(kpl_loader_next(l, &b));
    kpl_batch_release(&b);
    int pids[3];
    assert_int_equal(kpl_loader_pids(l, pids, 3), 3);
    assert_int_equal(kill(pids[which], SIGKILL), 0);
    double t0 = kpl_seconds();
    kpl_status st = KPL_OK;
    for (int i = 0; i < 1000 && st == KPL_OK; i++) {
        st = kpl_loader_next(l, &b);
        kpl_batch_release(&b);
    }
    assert_true(kpl_seconds() - t0 < 1.0);
    assert_int_equal(st, KPL_ECHILD);
    char want[80];
    if (which)
        snprintf(want, sizeof want, "transformer %d (pid %d) was killed by signal 9", which - 1,
                 pids[which]);
    else
        snprintf(want, sizeof want, "reader (pid %d) was killed by signal 9", pids[0]);
    if (!strstr(kpl_last_error(), want)) fail_msg("'%s' lacks '%s'", kpl_last_error(), want);
    /* It stays failed, and destroying it leaves no process behind. */
    FAILS(kpl_loader_next(l, &b), KPL_ECHILD, "killed by signal 9");
    kpl_loader_destroy(l);
    assert_no_children();
}

static void test_loader_process_death(void **state)
{
    (void)state;
    const char *path = make_set("big", 5000, 2, 1 << 16);
    kill_one(path, 1);
    kill_one(path, 0);
    /* A plain destroy with work in flight also leaves nothing. */
    kpl_loader_config c = raw_config(path, 4, 3);
    kpl_loader *l = NULL;
    OK(kpl_loader_create(&c, &l));
    double t0 = kpl_seconds();
    kpl_loader_destroy(l);
    assert_true(kpl_seconds() - t0 < 3.0);
    assert_no_children();
}

/* Polls kpl_loader_check every 5 ms for up to 2 s; returns the first
 * status that is not KPL_OK and the seconds it took in *took. */
static kpl_status check_until_failed(kpl_loader *l, double *took)
{
    double t0 = kpl_seconds();
    kpl_status st = KPL_OK;
    while (st == KPL_OK && kpl_seconds() - t0 < 2.0) {
        st = kpl_loader_check(l);
        if (st == KPL_OK) usleep(5000);
    }
    *took = kpl_seconds() - t0;
    return st;
}

/* kpl_loader_check on an idle loader (every slot prefetched, nobody
 * calling next): OK while everyone lives; a killed worker or reader is
 * reported within 1 s with the message next gives; next then fails the
 * same way and destroy leaves no process behind. */
static void test_loader_check(void **state)
{
    (void)state;
    const char *path = make_set("big", 5000, 2, 1 << 16);
    FAILS(kpl_loader_check(NULL), KPL_EINVAL, "NULL");
    for (int which = 1; which >= 0; which--) {
        kpl_loader_config c = raw_config(path, 4, 2);
        kpl_loader *l = NULL;
        OK(kpl_loader_create(&c, &l));
        kpl_batch b;
        OK(kpl_loader_next(l, &b));
        kpl_batch_release(&b);
        usleep(200 * 1000); /* the workers fill the slots and go idle */
        for (int i = 0; i < 20; i++) OK(kpl_loader_check(l));
        int pids[3];
        assert_int_equal(kpl_loader_pids(l, pids, 3), 3);
        assert_int_equal(kill(pids[which], SIGKILL), 0);
        double took;
        assert_int_equal(check_until_failed(l, &took), KPL_ECHILD);
        assert_true(took < 1.0);
        char want[80];
        if (which)
            snprintf(want, sizeof want, "transformer %d (pid %d) was killed by signal 9",
                     which - 1, pids[which]);
        else
            snprintf(want, sizeof want, "reader (pid %d) was killed by signal 9", pids[0]);
        if (!strstr(kpl_last_error(), want)) fail_msg("'%s' lacks '%s'", kpl_last_error(), want);
        FAILS(kpl_loader_check(l), KPL_ECHILD, want);
        FAILS(kpl_loader_next(l, &b), KPL_ECHILD, want);
        kpl_loader_destroy(l);
        assert_no_children();
    }
}

/* A set of 32x32 JPEGs, label = example, with a string feature `source`
 * ("path" or "key") = "img_NN.jpg" (NULL: none).  With `damaged`, six
 * examples cannot be decoded, each in its own way (damage_of). */
enum { D_NONE, D_TRUNCATED, D_GARBAGE, D_PNG_CRC, D_HUGE, D_MARKER, D_NO_EOI };
static int damage_of(int64_t e)
{
    switch (e) {
    case 3: return D_TRUNCATED; /* cut inside the scan: "Premature end of JPEG file" */
    case 5: return D_GARBAGE;   /* everything after SOI overwritten */
    case 9: return D_PNG_CRC;   /* a PNG whose IDAT CRC is one byte off */
    case 12: return D_HUGE;     /* the frame header claims 20000 x 20000 */
    case 17: return D_MARKER;   /* an RST marker in the middle of the scan (a libjpeg warning) */
    case 20: return D_NO_EOI;   /* every byte but the final FF D9 */
    default: return D_NONE;
    }
}

static const char *make_jpeg_set(const char *name, int64_t n, const char *source, bool damaged)
{
    static char p[256];
    snprintf(p, sizeof p, "%s/%s", tmp_root, name);
    kpl_feature_spec schema[3] = {
        {.name = "image", .type = KPL_FEATURE_BYTES, .encoding = "jpeg"},
        {.name = "label", .type = KPL_FEATURE_INT64},
        {.type = KPL_FEATURE_STRING},
    };
    if (source) snprintf(schema[2].name, sizeof schema[2].name, "%s", source);
    kpl_record_writer_config cfg = KPL_RECORD_WRITER_CONFIG_INIT;
    kpl_record_writer *w = NULL;
    OK(kpl_record_writer_create(p, source ? 3 : 2, schema, &cfg, &w));
    tjhandle tj = tjInitCompress();
    for (int64_t e = 0; e < n; e++) {
        uint8_t rgb[32 * 32 * 3];
        for (int i = 0; i < 32 * 32 * 3; i++) rgb[i] = (uint8_t)(e * 11 + i * 7 + (i / 96) * 3);
        unsigned char *jpg = NULL;
        unsigned long len = 0;
        assert_int_equal(tjCompress2(tj, rgb, 32, 0, 32, TJPF_RGB, &jpg, &len, TJSAMP_420, 90, 0),
                         0);
        uint8_t *bytes = jpg, *png = NULL;
        size_t sof = 2, sos = 2;
        while (jpg[sof + 1] != 0xc0) sof += 2 + ((size_t)jpg[sof + 2] << 8 | jpg[sof + 3]);
        while (jpg[sos + 1] != 0xda) sos += 2 + ((size_t)jpg[sos + 2] << 8 | jpg[sos + 3]);
        size_t scan = sos + 2 + ((size_t)jpg[sos + 2] << 8 | jpg[sos + 3]);
        switch (damaged ? damage_of(e) : D_NONE) {
        case D_TRUNCATED: len = scan + (len - scan) / 2; break;
        case D_GARBAGE: memset(jpg + 2, 0x5a, len - 2); break;
        case D_PNG_CRC: {
            png_image im;
            memset(&im, 0, sizeof im);
            im.version = PNG_IMAGE_VERSION;
            im.width = im.height = 32;
            im.format = PNG_FORMAT_RGB;
            png_alloc_size_t pl = 0;
            assert_true(png_image_write_to_memory(&im, NULL, &pl, 0, rgb, 0, NULL));
            png = malloc(pl);
            assert_true(png_image_write_to_memory(&im, png, &pl, 0, rgb, 0, NULL));
            size_t c = 8;
            while (memcmp(png + c + 4, "IDAT", 4)) c += 12 + __builtin_bswap32(kpl__rd32(png + c));
            png[c + 8 + __builtin_bswap32(kpl__rd32(png + c)) + 1] ^= 0x55;
            bytes = png;
            len = pl;
            break;
        }
        case D_HUGE:
            jpg[sof + 5] = jpg[sof + 7] = 20000 >> 8;
            jpg[sof + 6] = jpg[sof + 8] = 20000 & 0xff;
            break;
        case D_MARKER: jpg[scan + (len - scan) / 2] = 0xff, jpg[scan + (len - scan) / 2 + 1] = 0xd3; break;
        case D_NO_EOI: len -= 2; break;
        }
        char src[32];
        snprintf(src, sizeof src, "img_%02lld.jpg", (long long)e);
        kpl_feature_value v[3] = {{bytes, (uint32_t)len}, {&e, 1}, {src, (uint32_t)strlen(src)}};
        OK(kpl_record_writer_add(w, v));
        tjFree(jpg);
        free(png);
    }
    tjDestroy(tj);
    OK(kpl_record_writer_close(w));
    return p;
}

/* Runs fn with stderr going to a file; returns the file's text (malloc'd). */
static char *capture_stderr(void (*fn)(void *), void *ctx)
{
    char f[300];
    snprintf(f, sizeof f, "%s/stderr.txt", tmp_root);
    fflush(stderr);
    int saved = dup(2), fd = open(f, O_CREAT | O_TRUNC | O_WRONLY, 0600);
    assert_true(saved >= 0 && fd >= 0);
    dup2(fd, 2);
    close(fd);
    fn(ctx);
    fflush(stderr);
    dup2(saved, 2);
    close(saved);
    char *text = NULL;
    OK(kpl__read_file(f, &text, NULL));
    return text;
}

static int count_of(const char *text, const char *needle)
{
    int n = 0;
    for (const char *p = text; (p = strstr(p, needle)); p += strlen(needle)) n++;
    return n;
}

/* Two epochs of the damaged set with skip_corrupt: every damaged example
 * dropped from its batch and counted each epoch. */
static void two_epochs_skipping(void *ctx)
{
    kpl_loader_config c = KPL_LOADER_CONFIG_INIT;
    c.path = ctx;
    c.batch_size = 8;
    c.workers = 2;
    c.shuffle = KPL_SHUFFLE_NONE;
    c.transform.out_h = c.transform.out_w = 16;
    c.transform.skip_corrupt = true;
    kpl_loader *l = NULL;
    OK(kpl_loader_create(&c, &l));
    static const int64_t kept[3][6] = {{0, 1, 2, 4, 6, 7}, {8, 10, 11, 13, 14, 15},
                                       {16, 18, 19, 21, 22, 23}};
    for (int epoch = 0; epoch < 2; epoch++) {
        for (int k = 0; k < 3; k++) {
            kpl_batch b;
            OK(kpl_loader_next(l, &b));
            assert_int_equal(b.epoch, epoch);
            assert_int_equal(b.position, 8 * k);
            assert_int_equal(b.size, 6);
            assert_int_equal(b.skipped, 2);
            assert_memory_equal(kpl_tensor_host_data(b.label), kept[k], sizeof kept[k]);
            assert_memory_equal(kpl_tensor_host_data(b.example), kept[k], sizeof kept[k]);
            assert_int_equal(kpl_tensor_dim(b.image, 1), 3);
            assert_int_equal(kpl_tensor_dim(b.image, 3), 16);
            assert_int_equal(b.last, k == 2);
            kpl_batch_release(&b);
        }
    }
    assert_int_equal(kpl_loader_skipped(l), 12);
    /* The workers run on into epoch 2 meanwhile: nothing of it is said. */
    usleep(300 * 1000);
    kpl_loader_destroy(l);
}

/* Batches of one over the first 6 examples, of which 3 and 5 are
 * corrupt: a batch left empty is passed over, unless it is the epoch's
 * last, which comes with size 0 and says it is the last. */
static void empty_batches(void *ctx)
{
    kpl_loader_config c = KPL_LOADER_CONFIG_INIT;
    c.path = ctx;
    c.batch_size = 1;
    c.limit = 6;
    c.shuffle = KPL_SHUFFLE_NONE;
    c.transform.out_h = c.transform.out_w = 16;
    c.transform.skip_corrupt = true;
    kpl_loader *l = NULL;
    OK(kpl_loader_create(&c, &l));
    static const int64_t pos[5] = {0, 1, 2, 4, 5}, size[5] = {1, 1, 1, 1, 0};
    kpl_batch b;
    for (int k = 0; k < 5; k++) {
        OK(kpl_loader_next(l, &b));
        assert_int_equal(b.epoch, 0);
        assert_int_equal(b.position, pos[k]);
        assert_int_equal(b.size, size[k]);
        assert_int_equal(b.last, k == 4);
        kpl_batch_release(&b);
    }
    int64_t e = 0, p = 0;
    kpl_loader_position(l, &e, &p);
    assert_int_equal(e, 1);
    assert_int_equal(p, 0);
    OK(kpl_loader_next(l, &b));
    assert_int_equal(b.epoch, 1);
    assert_int_equal(b.position, 0);
    assert_int_equal(b.size, 1);
    kpl_batch_release(&b);
    kpl_loader_destroy(l);
}

/* Every way an image can fail to decode is skipped, and each skip is
 * counted and named once (the example, its shard, chunk and record, its
 * path) when the consumer receives the batch: two epochs, two lines for
 * each bad example, though the workers run ahead into the third.  Without
 * skip_corrupt the first one stops the iterator with the same
 * description. */
static void test_loader_corrupt_image(void **state)
{
    (void)state;
    const char *path = make_jpeg_set("jpeg", 24, "path", true);
    char *err = capture_stderr(two_epochs_skipping, (void *)path);
    static const struct {
        int64_t e;
        const char *why;
    } want[6] = {{3, "JPEG: Premature end of JPEG file"}, {5, "JPEG:"}, {9, "PNG: IDAT: CRC error"},
                 {12, "JPEG of 20000x20000 pixels is too large"}, {17, "JPEG: Corrupt JPEG data"},
                 {20, "JPEG: Premature end of JPEG file"}};
    assert_int_equal(count_of(err, "skipping"), 12);
    for (int k = 0; k < 6; k++) {
        char line[200];
        snprintf(line, sizeof line, "kpl loader (%s): skipping example %lld (shard 0, chunk 0, "
                 "record %lld, path 'img_%02lld.jpg'): feature 'image': %s", path,
                 (long long)want[k].e, (long long)want[k].e, (long long)want[k].e, want[k].why);
        if (count_of(err, line) != 2) fail_msg("stderr lacks '%s' twice:\n%s", line, err);
    }
    free(err);
    free(capture_stderr(empty_batches, (void *)path));

    kpl_loader_config c = KPL_LOADER_CONFIG_INIT;
    c.path = path;
    c.batch_size = 8;
    c.workers = 1;
    c.shuffle = KPL_SHUFFLE_NONE;
    c.transform.out_h = c.transform.out_w = 16;
    kpl_loader *l = NULL;
    kpl_batch b;
    OK(kpl_loader_create(&c, &l));
    FAILS(kpl_loader_next(l, &b), KPL_ECHILD,
          "transformer 0 (pid ");
    if (!strstr(kpl_last_error(), "): example 3 (shard 0, chunk 0, record 3, path 'img_03.jpg'): "
                                  "feature 'image': JPEG: Premature end of JPEG file"))
        fail_msg("message: %s", kpl_last_error());
    kpl_loader_destroy(l);
    /* An LMDB-style `key` names the example the same way. */
    path = make_jpeg_set("jpeg_key", 24, "key", true);
    c.path = path;
    OK(kpl_loader_create(&c, &l));
    FAILS(kpl_loader_next(l, &b), KPL_ECHILD, "example 3 (shard 0, chunk 0, record 3, key 'img_03.jpg')");
    kpl_loader_destroy(l);
    /* A reported error is not a death: kpl_loader_check stays OK (the
     * worker stopped at example 3 long before the 0.3 s are up), batches
     * finished before it are still handed out, and next returns it at the
     * batch it spoiled. */
    c.batch_size = 2;
    OK(kpl_loader_create(&c, &l));
    usleep(300 * 1000);
    for (int i = 0; i < 10; i++) OK(kpl_loader_check(l));
    OK(kpl_loader_next(l, &b));
    assert_int_equal(b.size, 2);
    assert_int_equal(((const int64_t *)kpl_tensor_host_data(b.label))[1], 1);
    kpl_batch_release(&b);
    FAILS(kpl_loader_next(l, &b), KPL_ECHILD, "example 3 (shard 0, chunk 0, record 3, key");
    FAILS(kpl_loader_check(l), KPL_ECHILD, "example 3 (shard 0");
    kpl_loader_destroy(l);
    assert_no_children();
}

static void test_loader_bad_config(void **state)
{
    (void)state;
    const char *path = make_set("order", 103, 3, 4096);
    kpl_loader *l = NULL;
    kpl_loader_config c = raw_config(path, 10, 0);
    FAILS(kpl_loader_create(&c, &l), KPL_EINVAL, "workers 0");
    c = raw_config(path, 60, 1);
    c.world_size = 2;
    c.drop_last = true;
    FAILS(kpl_loader_create(&c, &l), KPL_EINVAL, "not one batch of 60");
    c = raw_config(path, 10, 1);
    c.rank = 2;
    c.world_size = 2;
    FAILS(kpl_loader_create(&c, &l), KPL_EINVAL, "rank 2 of world size 2");
    c = raw_config(path, 10, 1);
    c.transform.image_feature = "nope";
    FAILS(kpl_loader_create(&c, &l), KPL_EINVAL, "nope");
    c = raw_config(path, 10, 1);
    c.start_position = 104;
    FAILS(kpl_loader_create(&c, &l), KPL_EINVAL, "start_position 104");
    c = raw_config("/nonexistent/set", 10, 1);
    assert_true(kpl_loader_create(&c, &l) < 0);
    assert_null(l);
    assert_no_children();
}

/* Holding every slot is an error, not a hang; a batch outlives its loader. */
static void test_loader_slots_held(void **state)
{
    (void)state;
    const char *path = make_set("order", 103, 3, 4096);
    kpl_loader_config c = raw_config(path, 10, 1);
    c.prefetch = 1;
    load_labels(path);
    kpl_loader *l = NULL;
    OK(kpl_loader_create(&c, &l));
    kpl_batch b1, b2, b3;
    OK(kpl_loader_next(l, &b1));
    OK(kpl_loader_next(l, &b2));
    FAILS(kpl_loader_next(l, &b3), KPL_ESTATE, "held");
    kpl_batch_release(&b1);
    OK(kpl_loader_next(l, &b3));
    assert_int_equal(b3.position, 20);
    kpl_batch_release(&b3);
    kpl_loader_destroy(l);
    int64_t ex[10];
    check_raw_batch(&b2, ex);
    kpl_batch_release(&b2);
    assert_no_children();
}

/* Detection and segmentation outputs through the pipeline: boxes, box
 * labels, counts and masks land in their own tensors, per sample. */
static void test_loader_boxes_and_masks(void **state)
{
    (void)state;
    char p[256];
    snprintf(p, sizeof p, "%s/det", tmp_root);
    kpl_feature_spec schema[4] = {
        {.name = "image", .type = KPL_FEATURE_BYTES, .encoding = "raw", .ndim = 3,
         .shape = {6, 10, 3}},
        {.name = "boxes", .type = KPL_FEATURE_FLOAT},
        {.name = "classes", .type = KPL_FEATURE_INT64},
        {.name = "mask", .type = KPL_FEATURE_BYTES, .encoding = "raw", .ndim = 2,
         .shape = {6, 10}},
    };
    kpl_record_writer_config wc = KPL_RECORD_WRITER_CONFIG_INIT;
    kpl_record_writer *w = NULL;
    OK(kpl_record_writer_create(p, 4, schema, &wc, &w));
    for (int64_t e = 0; e < 12; e++) {
        uint8_t img[6 * 10 * 3], mask[6 * 10];
        for (int i = 0; i < 180; i++) img[i] = (uint8_t)(e + i);
        for (int i = 0; i < 60; i++) mask[i] = (uint8_t)((e + i) % 5);
        /* Example e has e % 3 boxes: box k = (k, 1, k + 2 + e % 4, 5), class 10e + k. */
        float boxes[12];
        int64_t cls[3];
        int nb = (int)(e % 3);
        for (int k = 0; k < nb; k++) {
            float b[4] = {(float)k, 1, (float)(k + 2 + e % 4), 5};
            memcpy(boxes + 4 * k, b, sizeof b);
            cls[k] = 10 * e + k;
        }
        kpl_feature_value v[4] = {{img, 180}, {boxes, (uint32_t)(4 * nb)}, {cls, (uint32_t)nb},
                                  {mask, 60}};
        OK(kpl_record_writer_add(w, v));
    }
    OK(kpl_record_writer_close(w));

    kpl_loader_config c = KPL_LOADER_CONFIG_INIT;
    c.path = p;
    c.batch_size = 5;
    c.workers = 2;
    c.shuffle = KPL_SHUFFLE_EXAMPLE;
    c.transform.label_feature = NULL;
    c.transform.boxes_feature = "boxes";
    c.transform.box_labels_feature = "classes";
    c.transform.mask_feature = "mask";
    c.transform.max_boxes = 2;
    c.transform.out_dtype = KPL_U8;
    kpl_loader *l = NULL;
    OK(kpl_loader_create(&c, &l));
    int64_t seen = 0;
    kpl_batch b;
    for (bool last = false; !last;) {
        OK(kpl_loader_next(l, &b));
        last = b.last;
        assert_null(b.label);
        assert_int_equal(kpl_tensor_dim(b.boxes, 1), 2);
        assert_int_equal(kpl_tensor_dim(b.boxes, 2), 4);
        assert_int_equal(kpl_tensor_dim(b.mask, 1), 6);
        assert_int_equal(kpl_tensor_dim(b.mask, 2), 10);
        const int64_t *ex = kpl_tensor_host_data(b.example);
        const float *bx = kpl_tensor_host_data(b.boxes);
        const int64_t *bl = kpl_tensor_host_data(b.box_labels);
        const int64_t *nbx = kpl_tensor_host_data(b.num_boxes);
        const uint8_t *m = kpl_tensor_host_data(b.mask), *im = kpl_tensor_host_data(b.image);
        for (int64_t i = 0; i < b.size; i++) {
            int64_t e = ex[i]; /* one shard: example number = writing order */
            int nb = (int)(e % 3) < 2 ? (int)(e % 3) : 2;
            assert_int_equal(nbx[i], nb);
            for (int k = 0; k < 2; k++) {
                const float *q = bx + (i * 2 + k) * 4;
                if (k < nb) {
                    assert_float_equal(q[0], k, 1e-5);
                    assert_float_equal(q[1], 1, 1e-5);
                    assert_float_equal(q[2], k + 2 + e % 4, 1e-5);
                    assert_float_equal(q[3], 5, 1e-5);
                    assert_int_equal(bl[i * 2 + k], 10 * e + k);
                } else {
                    assert_true(q[0] == 0 && q[1] == 0 && q[2] == 0 && q[3] == 0);
                    assert_int_equal(bl[i * 2 + k], -1);
                }
            }
            for (int j = 0; j < 60; j++) assert_int_equal(m[i * 60 + j], (e + j) % 5);
            /* CHW u8: channel ch of pixel j is byte 3j + ch of the HWC image. */
            for (int ch = 0; ch < 3; ch++)
                for (int j = 0; j < 60; j++)
                    assert_int_equal(im[(i * 3 + ch) * 60 + j], (uint8_t)(e + 3 * j + ch));
            seen++;
        }
        kpl_batch_release(&b);
    }
    assert_int_equal(seen, 12);
    kpl_loader_destroy(l);
}

/* ---- keep_ratio: images of their own sizes, batches padded ---- */

#define KR_N 13
#define KR_BAD 7 /* its bytes are one short of its shape: corrupt */

static int kr_h(int64_t e) { return 24 + 9 * (int)(e % 4); }
static int kr_w(int64_t e) { return 30 + 13 * (int)(e % 3); }

/* Raw images of differing sizes (image_shape per record), landscape and
 * portrait, one box each (example 11: three), a mask, one corrupt
 * example. */
static const char *kr_set(void)
{
    const char *p = tmp_path("keep_ratio");
    if (access(p, F_OK) == 0) return p;
    kpl_feature_spec schema[5];
    det_schema(schema);
    kpl_record_writer_config wc = KPL_RECORD_WRITER_CONFIG_INIT;
    wc.chunk_bytes = 8192;
    kpl_record_writer *w = NULL;
    OK(kpl_record_writer_create(p, 5, schema, &wc, &w));
    for (int64_t e = 0; e < KR_N; e++) {
        int h = kr_h(e), wd = kr_w(e);
        uint8_t *img = malloc((size_t)h * wd * 3), *mask = malloc((size_t)h * wd);
        for (int y = 0; y < h; y++)
            for (int x = 0; x < wd; x++) {
                for (int c = 0; c < 3; c++)
                    img[((size_t)y * wd + x) * 3 + c] = (uint8_t)((e * 5 + x * 3 + y * 2 + c * 40) % 200);
                mask[(size_t)y * wd + x] = (uint8_t)((x + y + e) % 7);
            }
        int64_t shape[3] = {h, wd, 3}, cls[3] = {e, 100 + e, 200 + e};
        float boxes[12] = {2, 3, (float)(wd - 4), (float)(h - 5), 0, 0, 5, 5, 1, 1, 9, 9};
        int nb = e == 11 ? 3 : 1;
        kpl_feature_value v[5] = {{img, (uint32_t)(h * wd * 3 - (e == KR_BAD))}, {shape, 3},
                                  {boxes, (uint32_t)(4 * nb)}, {cls, (uint32_t)nb},
                                  {mask, (uint32_t)(h * wd)}};
        OK(kpl_record_writer_add(w, v));
        free(img);
        free(mask);
    }
    OK(kpl_record_writer_close(w));
    return p;
}

static kpl_loader_config kr_config(int workers, int divisor, int mask_pad)
{
    kpl_loader_config c = KPL_LOADER_CONFIG_INIT;
    c.path = kr_set();
    c.batch_size = 5;
    c.workers = workers;
    c.seed = 9;
    c.shuffle = KPL_SHUFFLE_EXAMPLE;
    kpl_transform_config *t = &c.transform;
    t->label_feature = NULL;
    t->boxes_feature = "boxes";
    t->box_labels_feature = "classes";
    t->mask_feature = "mask";
    t->max_boxes = 3;
    t->crop = KPL_CROP_KEEP_RATIO;
    t->short_sides[0] = 40, t->short_sides[1] = 56, t->short_sides[2] = 72;
    t->num_short_sides = 3;
    t->max_side = 90;
    t->size_divisor = divisor;
    t->mask_pad = mask_pad;
    t->flip_prob = 0.5f;
    for (int k = 0; k < 3; k++) t->mean[k] = 0.5f, t->std[k] = 0.25f; /* no pixel is 0 */
    t->skip_corrupt = true;
    return c;
}

/* Two epochs of c's batches, each sample checked against the transform run
 * alone on its example (the same key): the image and mask at the top
 * left of the batch's (Hb, Wb), 0 and mask_pad around them, Hb and Wb the
 * largest height and width rounded up to the divisor, image_size and
 * orig_size, boxes in output pixels.  Returns a CRC32C of every batch's
 * bytes, in order, and counts batches of mixed sizes. */
static uint32_t kr_check(const kpl_loader_config *c, int *mixed)
{
    const kpl_transform_config *t = &c->transform;
    kpl_dataset *ds = NULL;
    OK(kpl_dataset_open(c->path, &ds));
    kpl__xform x;
    OK(kpl__xform_init(&x, t, ds));
    kpl__xform_scratch *scr = NN(kpl__xform_scratch_create());
    kpl_chunk *ch = NN(kpl_chunk_create());
    const int side = kpl_transform_canvas_side(t), d = t->size_divisor > 1 ? t->size_divisor : 1;
    assert_int_equal(side, d == 32 ? 96 : 90);
    float *ref = malloc(sizeof(float) * 3 * side * side), rb[12];
    uint8_t *rm = malloc((size_t)side * side);
    kpl_loader *l = NULL;
    OK(kpl_loader_create(c, &l));
    uint32_t crc = 0;
    int64_t seen = 0, skipped = 0;
    for (int epoch = 0; epoch < 2; epoch++) {
        kpl_batch b;
        for (bool last = false; !last;) {
            OK(kpl_loader_next(l, &b));
            last = b.last;
            skipped += b.skipped;
            const int64_t n = b.size, H = kpl_tensor_dim(b.image, 2), W = kpl_tensor_dim(b.image, 3);
            assert_int_equal(kpl_tensor_dim(b.image, 0), n);
            assert_int_equal(kpl_tensor_dim(b.image, 1), 3);
            assert_int_equal(kpl_tensor_dim(b.mask, 1), H);
            assert_int_equal(kpl_tensor_dim(b.mask, 2), W);
            assert_int_equal(kpl_tensor_dim(b.image_size, 1), 2);
            const float *im = kpl_tensor_host_data(b.image), *bx = kpl_tensor_host_data(b.boxes);
            const uint8_t *m = kpl_tensor_host_data(b.mask);
            const int64_t *ex = kpl_tensor_host_data(b.example);
            const int64_t *sz = kpl_tensor_host_data(b.image_size);
            const int64_t *orig = kpl_tensor_host_data(b.orig_size);
            const int64_t *nb = kpl_tensor_host_data(b.num_boxes);
            const int64_t *bl = kpl_tensor_host_data(b.box_labels);
            int64_t mh = 0, mw = 0;
            bool differ = false;
            for (int64_t i = 0; i < n; i++) {
                mh = sz[2 * i] > mh ? sz[2 * i] : mh;
                mw = sz[2 * i + 1] > mw ? sz[2 * i + 1] : mw;
                differ |= sz[2 * i] != sz[0] || sz[2 * i + 1] != sz[1];
            }
            assert_int_equal(H, (mh + d - 1) / d * d);
            assert_int_equal(W, (mw + d - 1) / d * d);
            *mixed += differ;
            for (int64_t i = 0; i < n; i++) {
                const int64_t e = ex[i]; /* one shard: example number = writing order */
                assert_true(e != KR_BAD);
                assert_int_equal(orig[2 * i], kr_h(e));
                assert_int_equal(orig[2 * i + 1], kr_w(e));
                kpl_feature_value v[5];
                OK(kpl_dataset_read_example(ds, e, ch, v));
                int64_t rs[2], rn = -1, rl[3];
                kpl__sample_out o = {.image = ref, .boxes = rb, .box_labels = rl,
                                     .num_boxes = &rn, .mask = rm, .size = rs};
                OK(kpl__xform_sample(&x, v, c->seed, b.epoch, e, scr, &o));
                const int64_t h = rs[0], w = rs[1];
                assert_int_equal(sz[2 * i], h);
                assert_int_equal(sz[2 * i + 1], w);
                /* the short side is one of the list, or the long side is capped */
                int64_t lo = h < w ? h : w, hi = h < w ? w : h;
                assert_true(lo == 40 || lo == 56 || lo == 72 || hi == 90);
                for (int k = 0; k < 3; k++)
                    for (int64_t y = 0; y < H; y++)
                        for (int64_t xx = 0; xx < W; xx++) {
                            float got = im[((i * 3 + k) * H + y) * W + xx];
                            float want = y < h && xx < w ? ref[(k * h + y) * w + xx] : 0.0f;
                            if (memcmp(&got, &want, 4))
                                fail_msg("example %lld channel %d (%lld, %lld) of %lldx%lld in "
                                         "%lldx%lld: %g, want %g", (long long)e, k, (long long)y,
                                         (long long)xx, (long long)h, (long long)w,
                                         (long long)H, (long long)W, got, want);
                        }
                for (int64_t y = 0; y < H; y++)
                    for (int64_t xx = 0; xx < W; xx++)
                        assert_int_equal(m[(i * H + y) * W + xx],
                                         y < h && xx < w ? rm[y * w + xx] : t->mask_pad);
                /* the box: (2, 3, w0 - 4, h0 - 5) of the stored w0 x h0 in output
                 * pixels, mirrored or not */
                assert_int_equal(nb[i], rn);
                assert_int_equal(nb[i], e == 11 ? 3 : 1);
                assert_memory_equal(bx + i * 12, rb, sizeof(float) * 4 * (size_t)rn);
                double sx = (double)w / kr_w(e), sy = (double)h / kr_h(e);
                double x0 = 2 * sx, x1 = (kr_w(e) - 4) * sx;
                bool mirrored = fabs(bx[i * 12] - x0) > 1e-3;
                if (mirrored) x0 = w - (kr_w(e) - 4) * sx, x1 = w - 2 * sx;
                assert_float_equal(bx[i * 12], x0, 1e-3);
                assert_float_equal(bx[i * 12 + 1], 3 * sy, 1e-3);
                assert_float_equal(bx[i * 12 + 2], x1, 1e-3);
                assert_float_equal(bx[i * 12 + 3], (kr_h(e) - 5) * sy, 1e-3);
                assert_int_equal(bl[i * 3], e);
                seen++;
            }
            kpl_tensor *parts[] = {b.image, b.mask, b.image_size, b.orig_size, b.boxes, b.example};
            for (size_t k = 0; k < sizeof parts / sizeof parts[0]; k++)
                crc = kpl_crc32c(crc, kpl_tensor_host_data(parts[k]),
                                 (size_t)kpl_tensor_numel(parts[k]) *
                                     kpl_dtype_size(kpl_tensor_dtype(parts[k])));
            kpl_batch_release(&b);
        }
    }
    assert_int_equal(seen, 2 * (KR_N - 1));
    assert_int_equal(skipped, 2);
    kpl_loader_destroy(l);
    free(ref);
    free(rm);
    kpl_chunk_destroy(ch);
    kpl__xform_scratch_destroy(scr);
    kpl_dataset_close(ds);
    return crc;
}

/* ---- scale_crop: fixed-size crops of random scale, padded where the
 *      scaled image is smaller; the same batches for any worker count ---- */

/* Two epochs of scale_crop batches over the keep_ratio set: every sample
 * equals the transform run alone on its example; returns a CRC32C of the
 * batches' bytes and counts the samples padded. */
static uint32_t sc_check(int workers, int *padded)
{
    kpl_loader_config c = KPL_LOADER_CONFIG_INIT;
    c.path = kr_set();
    c.batch_size = 4;
    c.workers = workers;
    c.seed = 5;
    c.shuffle = KPL_SHUFFLE_EXAMPLE;
    kpl_transform_config *t = &c.transform;
    t->label_feature = NULL;
    t->mask_feature = "mask";
    t->crop = KPL_CROP_SCALE_CROP;
    t->out_h = t->out_w = 48;
    t->mask_pad = 255;
    t->flip_prob = 0.5f;
    t->brightness = 0.3f;
    for (int k = 0; k < 3; k++) t->mean[k] = 0.5f, t->std[k] = 0.25f;
    t->skip_corrupt = true;
    kpl_dataset *ds = NULL;
    OK(kpl_dataset_open(c.path, &ds));
    kpl__xform x;
    OK(kpl__xform_init(&x, t, ds));
    kpl__xform_scratch *scr = NN(kpl__xform_scratch_create());
    kpl_chunk *ch = NN(kpl_chunk_create());
    static float ref[3 * 48 * 48];
    static uint8_t rm[48 * 48];
    kpl_loader *l = NULL;
    OK(kpl_loader_create(&c, &l));
    uint32_t crc = 0;
    for (int epoch = 0; epoch < 2; epoch++) {
        kpl_batch b;
        for (bool last = false; !last;) {
            OK(kpl_loader_next(l, &b));
            last = b.last;
            assert_int_equal(kpl_tensor_dim(b.image, 2), 48);
            assert_int_equal(kpl_tensor_dim(b.mask, 2), 48);
            const float *im = kpl_tensor_host_data(b.image);
            const uint8_t *m = kpl_tensor_host_data(b.mask);
            const int64_t *ex = kpl_tensor_host_data(b.example);
            for (int64_t i = 0; i < b.size; i++) {
                kpl_feature_value v[5];
                OK(kpl_dataset_read_example(ds, ex[i], ch, v));
                int64_t rs[2];
                kpl__sample_out o = {.image = ref, .mask = rm, .size = rs};
                OK(kpl__xform_sample(&x, v, c.seed, b.epoch, ex[i], scr, &o));
                assert_memory_equal(im + i * 3 * 48 * 48, ref, sizeof ref);
                assert_memory_equal(m + i * 48 * 48, rm, sizeof rm);
                *padded += rs[0] < 48 || rs[1] < 48;
            }
            kpl_tensor *parts[] = {b.image, b.mask, b.example};
            for (size_t k = 0; k < sizeof parts / sizeof parts[0]; k++)
                crc = kpl_crc32c(crc, kpl_tensor_host_data(parts[k]),
                                 (size_t)kpl_tensor_numel(parts[k]) *
                                     kpl_dtype_size(kpl_tensor_dtype(parts[k])));
            kpl_batch_release(&b);
        }
    }
    kpl_loader_destroy(l);
    kpl_chunk_destroy(ch);
    kpl__xform_scratch_destroy(scr);
    kpl_dataset_close(ds);
    return crc;
}

static void test_loader_scale_crop(void **state)
{
    (void)state;
    int padded = 0;
    uint32_t a = sc_check(2, &padded);
    assert_true(padded > 0);
    for (int workers = 1; workers <= 3; workers += 2) assert_int_equal(sc_check(workers, &padded), a);
    assert_no_children();
}

static void test_loader_keep_ratio(void **state)
{
    (void)state;
    int mixed = 0;
    kpl_loader_config c = kr_config(2, 32, 255);
    uint32_t a = kr_check(&c, &mixed);
    assert_true(mixed >= 2); /* batches of differing sizes were padded */
    /* The number of workers changes nothing. */
    for (int workers = 1; workers <= 3; workers += 2) {
        c = kr_config(workers, 32, 255);
        assert_int_equal(kr_check(&c, &mixed), a);
    }
    /* No rounding, masks padded with 0. */
    c = kr_config(2, 0, 0);
    kr_check(&c, &mixed);

    /* The batches of a hand-checked order: shuffle none, one short side,
     * batch 4: examples 0-3 are 30x24, 43x33, 56x42, 30x51 (w x h); short
     * side 40 with max_side 90 gives 50x40, 52x40, 53x40, 40x68; padded
     * to 96 high (68 rounded up to 32s) and 64 wide (53). */
    c = kr_config(2, 32, 255);
    c.shuffle = KPL_SHUFFLE_NONE;
    c.batch_size = 4;
    c.transform.num_short_sides = 1;
    kpl_loader *l = NULL;
    OK(kpl_loader_create(&c, &l));
    kpl_batch b;
    OK(kpl_loader_next(l, &b));
    assert_int_equal(b.size, 4);
    assert_int_equal(kpl_tensor_dim(b.image, 2), 96);
    assert_int_equal(kpl_tensor_dim(b.image, 3), 64);
    const int64_t want[4][4] = {{40, 50, 24, 30}, {40, 52, 33, 43}, {40, 53, 42, 56},
                                {68, 40, 51, 30}};
    const int64_t *sz = kpl_tensor_host_data(b.image_size), *orig = kpl_tensor_host_data(b.orig_size);
    for (int i = 0; i < 4; i++) {
        assert_int_equal(sz[2 * i], want[i][0]);
        assert_int_equal(sz[2 * i + 1], want[i][1]);
        assert_int_equal(orig[2 * i], want[i][2]);
        assert_int_equal(orig[2 * i + 1], want[i][3]);
    }
    assert_ptr_equal(kpl_batch_get(&b, "image_size"), b.image_size);
    assert_ptr_equal(kpl_batch_get(&b, "orig_size"), b.orig_size);
    kpl_batch_release(&b);
    kpl_loader_destroy(l);

    /* Example 11 stores 3 boxes: with max_boxes 2 the loader stops naming
     * it and the key to raise, skip_corrupt or not. */
    c = kr_config(1, 32, 0);
    c.transform.max_boxes = 2;
    OK(kpl_loader_create(&c, &l));
    kpl_status st = KPL_OK;
    for (int i = 0; i < 10 && st == KPL_OK; i++) {
        st = kpl_loader_next(l, &b);
        kpl_batch_release(&b);
    }
    assert_int_equal(st, KPL_ECHILD);
    assert_non_null(strstr(kpl_last_error(), "example 11 (shard 0, chunk "));
    assert_non_null(strstr(kpl_last_error(), "feature 'boxes': 3 boxes, more than max_boxes 2 "
                                             "(raise max_boxes"));
    assert_non_null(strstr(kpl_last_error(), "data.<split>.max_boxes"));
    kpl_loader_destroy(l);
    assert_no_children();
}

/* Example shuffling over stored (uncompressed) chunks reads each record
 * alone: the same batches as over compressed chunks of the same layout,
 * and a damaged record is still caught, named by chunk and record. */
static void test_loader_record_reads(void **state)
{
    (void)state;
    const char *zpath = make_set("order", 103, 3, 4096);
    const char *rpath = make_set_z("order_stored", 103, 3, 4096, 0);
    kpl_dataset *ds = NULL;
    OK(kpl_dataset_open(rpath, &ds));
    assert_false(kpl_dataset_chunk_info(ds, 0).compressed);
    kpl_dataset_close(ds);
    OK(kpl_dataset_open(zpath, &ds));
    assert_true(kpl_dataset_chunk_info(ds, 0).compressed);
    kpl_dataset_close(ds);
    int64_t ex[2][206];
    uint8_t *img[2];
    for (int k = 0; k < 2; k++) {
        kpl_loader_config c = raw_config(k ? rpath : zpath, 10, 2);
        c.shuffle = KPL_SHUFFLE_EXAMPLE;
        c.transform.out_dtype = KPL_U8;
        kpl_loader *l = NULL;
        OK(kpl_loader_create(&c, &l));
        img[k] = malloc(206 * S * S);
        assert_int_equal(drain(l, 2, ex[k], img[k], S * S), 206);
        kpl_loader_destroy(l);
    }
    assert_memory_equal(ex[0], ex[1], sizeof ex[0]);
    assert_memory_equal(img[0], img[1], 206 * S * S);
    free(img[0]);
    free(img[1]);

    /* A byte inside example 0's image (file header, chunk header, record
     * header, then the image's count). */
    char f[300];
    snprintf(f, sizeof f, "%s/00000.data", rpath);
    FILE *fp = fopen(f, "r+b");
    assert_non_null(fp);
    assert_int_equal(fseek(fp, 32 + 32 + 8 + 4 + 100, SEEK_SET), 0);
    int ch = fgetc(fp);
    assert_int_equal(fseek(fp, 32 + 32 + 8 + 4 + 100, SEEK_SET), 0);
    fputc(ch ^ 0x40, fp);
    fclose(fp);
    kpl_loader_config c = raw_config(rpath, 103, 1);
    c.shuffle = KPL_SHUFFLE_EXAMPLE;
    kpl_loader *l = NULL;
    OK(kpl_loader_create(&c, &l));
    kpl_batch b;
    FAILS(kpl_loader_next(l, &b), KPL_ECHILD, "chunk 0 record 0 (example 0): record CRC32C");
    kpl_loader_destroy(l);
    assert_no_children();
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_order_partition),
        cmocka_unit_test(test_order_properties),
        cmocka_unit_test(test_loader_batches_follow_order),
        cmocka_unit_test(test_loader_ranks_cover_once),
        cmocka_unit_test(test_loader_workers_deterministic),
        cmocka_unit_test(test_loader_resume),
        cmocka_unit_test(test_loader_process_death),
        cmocka_unit_test(test_loader_check),
        cmocka_unit_test(test_loader_corrupt_image),
        cmocka_unit_test(test_loader_bad_config),
        cmocka_unit_test(test_loader_slots_held),
        cmocka_unit_test(test_loader_boxes_and_masks),
        cmocka_unit_test(test_loader_keep_ratio),
        cmocka_unit_test(test_loader_scale_crop),
        cmocka_unit_test(test_loader_record_reads),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
