/*
 * bench_data.c — the data group: KPLRecord reader throughput next to `cat`
 * of the same shard files (the page-cache / disk limit), in one invocation.
 *
 *   bench_data WORKDIR
 *
 * Builds a zstd-compressed shard set from Debian's Fashion-MNIST (4 passes
 * over the 60,000 training images, 4 shards; synthetic images when the
 * package is absent) in WORKDIR, then alternates, for several rounds:
 *   ref: `cat` of the .data files to /dev/null
 *   kpl: every chunk read with kpl_dataset_read_chunk (pread, chunk and
 *        record CRC32C, zstd decompression, record walk), one thread, as
 *        the DataReader does
 * Both run from the page cache (the files were just written and read), so
 * this is the memory-speed bound.  As root, a second case drops the page
 * cache before each side (cold_cache): both then read from the disk.
 * Throughput is in MB/s of the stored (compressed) bytes for both sides;
 * the raw (decompressed) MB/s is printed as an extra field.
 *
 *   bench_data WORKDIR BASELINES_DIR
 *
 * adds the end-to-end loader: a set of 1024 JPEGs (the 500x375 photos of
 * BASELINES_DIR/jpeg, alternating) read through kpl_loader with
 * random-resized crop 224 + flip + normalize to f32, batch 64, for 1 and 2
 * transformer workers: images/s over two epochs after the first batch,
 * next to the same transform run in-process on one core (no pipeline), so
 * the ratio shows what the processes and queues cost or gain.
 */
#include "bench_dataio.h"
#include "transform_impl.h"

#include <stdint.h>
#include <sys/stat.h>
#include <unistd.h>

static int die(const char *what)
{
    fprintf(stderr, "bench_data: %s: %s\n", what, kpl_last_error());
    return 1;
}

static int build_set(const char *dir)
{
    const char *fm = "/usr/share/datasets/fashion-mnist";
    kpl_feature_spec schema[2] = {
        {.name = "image", .type = KPL_FEATURE_BYTES, .encoding = "raw", .ndim = 3,
         .shape = {28, 28, 1}},
        {.name = "label", .type = KPL_FEATURE_INT64},
    };
    kpl_record_writer_config cfg = KPL_RECORD_WRITER_CONFIG_INIT;
    cfg.shards = 4;
    kpl_record_writer *w = NULL;
    char tmp[600];
    snprintf(tmp, sizeof tmp, "%s.idx", dir);
    kpl_dataset *src = NULL;
    char im[600], lb[600];
    snprintf(im, sizeof im, "%s/train-images-idx3-ubyte.gz", fm);
    snprintf(lb, sizeof lb, "%s/train-labels-idx1-ubyte.gz", fm);
    bool have_fm = access(im, R_OK) == 0 && access(lb, R_OK) == 0;
    if (have_fm) {
        kpl_convert_options o = KPL_CONVERT_OPTIONS_INIT;
        if (kpl_convert_idx(im, lb, tmp, &o, NULL) < 0) return die("convert idx");
        if (kpl_dataset_open(tmp, &src) < 0) return die("open");
    } else {
        fprintf(stderr, "bench_data: no Fashion-MNIST; synthetic images\n");
    }
    if (kpl_record_writer_create(dir, 2, schema, &cfg, &w) < 0) return die("writer");
    kpl_chunk *c = kpl_chunk_create();
    uint8_t img[784];
    uint64_t r = 1;
    for (int pass = 0; pass < 4; pass++) {
        for (int64_t i = 0; i < 60000; i++) {
            kpl_feature_value v[2];
            int64_t label = i % 10;
            if (src) {
                if (kpl_dataset_read_example(src, i, c, v) < 0) return die("read");
            } else {
                for (int k = 0; k < 784; k++) { /* blobs: compressible like real images */
                    r = r * 6364136223846793005ull + 1442695040888963407ull;
                    img[k] = (k % 28 > 6 && k % 28 < 22) ? (uint8_t)(128 + (r >> 60)) : 0;
                }
                v[0] = (kpl_feature_value){img, 784};
                v[1] = (kpl_feature_value){&label, 1};
            }
            if (kpl_record_writer_add(w, v) < 0) return die("add");
        }
    }
    kpl_chunk_destroy(c);
    kpl_dataset_close(src);
    if (kpl_record_writer_close(w) < 0) return die("close");
    if (have_fm) {
        char cmd[700];
        snprintf(cmd, sizeof cmd, "rm -rf '%s'", tmp);
        if (system(cmd) != 0) return 1;
    }
    return 0;
}

/* Every chunk of ds through kpl_dataset_read_chunk (pread, chunk and
 * record CRC32C, zstd, record walk), with the next chunk's read-ahead hint
 * first, as the DataReader does.  Non-zero on error. */
static int read_all(kpl_dataset *ds, kpl_chunk *c)
{
    int64_t n = 0, nc = kpl_dataset_num_chunks(ds);
    for (int64_t k = 0; k < nc; k++) {
        kpl__dataset_willneed(ds, k + 1);
        if (kpl_dataset_read_chunk(ds, k, c) < 0) return die("read_chunk");
        n += kpl_chunk_num_records(c);
    }
    return n == kpl_dataset_num_examples(ds) ? 0 : 1;
}

static int drop_caches(void)
{
    if (system("sync") != 0) return 1;
    FILE *f = fopen("/proc/sys/vm/drop_caches", "w");
    if (!f) return 1;
    int bad = fputs("3\n", f) < 0;
    return fclose(f) != 0 || bad;
}

/* The loader case's dataset: n JPEGs cycling through the photos. */
static int build_jpeg_set(const char *dir, const char *baselines, int n)
{
    const char *names[2] = {"photo1_500x375_q90.jpg", "photo2_500x375_q90.jpg"};
    char *data[2] = {NULL, NULL};
    size_t len[2] = {0, 0};
    for (int i = 0; i < 2; i++) {
        char p[600];
        snprintf(p, sizeof p, "%s/jpeg/%s", baselines, names[i]);
        FILE *f = fopen(p, "rb");
        if (!f) {
            fprintf(stderr, "bench_data: %s: missing\n", p);
            return 1;
        }
        data[i] = malloc(1 << 20);
        len[i] = fread(data[i], 1, 1 << 20, f);
        fclose(f);
    }
    kpl_feature_spec schema[2] = {
        {.name = "image", .type = KPL_FEATURE_BYTES, .encoding = "jpeg"},
        {.name = "label", .type = KPL_FEATURE_INT64},
    };
    kpl_record_writer_config cfg = KPL_RECORD_WRITER_CONFIG_INIT;
    cfg.shards = 2;
    kpl_record_writer *w = NULL;
    if (kpl_record_writer_create(dir, 2, schema, &cfg, &w) < 0) return die("writer");
    for (int64_t i = 0; i < n; i++) {
        kpl_feature_value v[2] = {{data[i % 2], (uint32_t)len[i % 2]}, {&i, 1}};
        if (kpl_record_writer_add(w, v) < 0) return die("add");
    }
    free(data[0]);
    free(data[1]);
    return kpl_record_writer_close(w) < 0 ? die("close") : 0;
}

/* The same transforms in this process, one core: images/s. */
static double in_process_rate(const char *dir, int n)
{
    kpl_dataset *ds = NULL;
    if (kpl_dataset_open(dir, &ds) < 0) return -1;
    kpl_transform_config t = bench_imagenet_train();
    kpl__xform x;
    kpl__xform_scratch *s = kpl__xform_scratch_create();
    float *out = malloc(3 * 224 * 224 * sizeof *out);
    kpl_chunk *c = kpl_chunk_create();
    kpl_feature_value v[2];
    int64_t label;
    double rate = -1;
    if (kpl__xform_init(&x, &t, ds) < 0) goto done;
    kpl__sample_out o = {.image = out, .label = &label};
    double t0 = bench_now();
    for (int64_t e = 0; e < n; e++) {
        if (kpl_dataset_read_example(ds, e, c, v) < 0 ||
            kpl__xform_sample(&x, v, 1, 0, e, s, &o) < 0)
            goto done;
    }
    rate = n / (bench_now() - t0);
done:
    kpl_chunk_destroy(c);
    free(out);
    kpl__xform_scratch_destroy(s);
    kpl_dataset_close(ds);
    return rate;
}

/* The loader with `workers` transformers: images/s over two epochs after
 * the first batch. */
static double loader_rate(const char *dir, int workers)
{
    kpl_loader_config c = KPL_LOADER_CONFIG_INIT;
    c.path = dir;
    c.batch_size = 64;
    c.workers = workers;
    c.prefetch = 2;
    c.seed = 1;
    c.transform = bench_imagenet_train();
    kpl_loader *l = NULL;
    if (kpl_loader_create(&c, &l) < 0) return -1;
    kpl_batch b;
    if (kpl_loader_next(l, &b) < 0) return -1;
    kpl_batch_release(&b);
    double t0 = bench_now();
    int64_t n = 0;
    for (int ends = 0; ends < 2;) {
        if (kpl_loader_next(l, &b) < 0) return -1;
        n += b.size;
        ends += b.last;
        kpl_batch_release(&b);
    }
    double rate = (double)n / (bench_now() - t0);
    kpl_loader_destroy(l);
    return rate;
}

static int loader_cases(const char *workdir, const char *baselines)
{
    char dir[600], cmd[700];
    snprintf(dir, sizeof dir, "%s/bench_data_jpeg", workdir);
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    if (system(cmd) != 0) return 1;
    const int n = 1024;
    if (build_jpeg_set(dir, baselines, n)) return 1;
    enum { ROUNDS = 3 };
    for (int workers = 1; workers <= 2; workers++) {
        double tk[ROUNDS], tr[ROUNDS];
        for (int round = 0; round < ROUNDS; round++) {
            tr[round] = in_process_rate(dir, 256);
            tk[round] = loader_rate(dir, workers);
            if (tr[round] < 0 || tk[round] < 0) return die("loader case");
        }
        char casename[64], rk[BENCH_RANGE_LEN];
        snprintf(casename, sizeof casename, "jpeg500x375_rrc224_b64/workers%d", workers);
        bench_emit("loader", casename, "images/s", 1, bench_median(tk, ROUNDS),
                   bench_median(tr, ROUNDS), "same_transform_in_process_1core", NAN,
                   ",\"kpl_range\":%s,\"cores\":%ld", bench_jrange(rk, tk, ROUNDS),
                   sysconf(_SC_NPROCESSORS_ONLN));
    }
    return system(cmd) == 0 ? 0 : 1;
}

int main(int argc, char **argv)
{
    if (argc != 2 && argc != 3) {
        fprintf(stderr, "usage: bench_data WORKDIR [BASELINES_DIR]\n");
        return 2;
    }
    char dir[480], cmd[1100];
    if (strlen(argv[1]) > 400) return 2;
    snprintf(dir, sizeof dir, "%s/bench_data_fm4", argv[1]);
    snprintf(cmd, sizeof cmd, "rm -rf '%s' '%s.idx'", dir, dir);
    if (system(cmd) != 0) return 1;
    fprintf(stderr, "bench_data: writing the shard set in %s\n", dir);
    if (build_set(dir)) return 1;
    kpl_dataset *ds = NULL;
    if (kpl_dataset_open(dir, &ds) < 0) return die("open");
    kpl_chunk *c = kpl_chunk_create();
    double stored = 0, raw = 0;
    for (int64_t k = 0; k < kpl_dataset_num_chunks(ds); k++) {
        kpl_chunk_info ci = kpl_dataset_chunk_info(ds, k);
        stored += (double)ci.stored_bytes;
        raw += (double)ci.raw_bytes;
    }
    snprintf(cmd, sizeof cmd, "cat '%s'/*.data > /dev/null", dir);
    enum { ROUNDS = 7 };
    double tk[ROUNDS], tr[ROUNDS];
    if (system(cmd) != 0) return 1; /* warm the page cache for both */
    for (int round = 0; round < ROUNDS; round++) {
        double t0 = bench_now();
        if (system(cmd) != 0) return 1;
        tr[round] = stored / 1e6 / (bench_now() - t0);
        t0 = bench_now();
        if (read_all(ds, c)) return 1;
        tk[round] = stored / 1e6 / (bench_now() - t0);
    }
    double k = bench_median(tk, ROUNDS), ref = bench_median(tr, ROUNDS);
    char casename[64], nraw[BENCH_NUM_LEN];
    snprintf(casename, sizeof casename, "fmnist_x4/%lld_examples",
             (long long)kpl_dataset_num_examples(ds));
    bench_emit("reader", casename, "MB/s stored", 1, k, ref, "cat", 0.8,
               ",\"raw_MBps\":%s,\"stored_MB\":%.1f,\"compression\":%.2f,\"page_cache\":true",
               bench_jnum(nraw, k * raw / stored), stored / 1e6, raw / stored);
    /* Cold: the page cache dropped before each side (root only), so both
     * read from the disk; the reader's read-ahead hint overlaps the disk
     * with decompression as the DataReader's does. */
    FILE *dc = fopen("/proc/sys/vm/drop_caches", "w");
    if (dc) {
        fclose(dc);
        enum { COLD = 3 };
        double ck[COLD], cr[COLD];
        for (int round = 0; round < COLD; round++) {
            if (drop_caches()) break;
            double t0 = bench_now();
            if (system(cmd) != 0) return 1;
            cr[round] = stored / 1e6 / (bench_now() - t0);
            if (drop_caches()) break;
            t0 = bench_now();
            if (read_all(ds, c)) return 1;
            ck[round] = stored / 1e6 / (bench_now() - t0);
            if (round == COLD - 1) {
                k = bench_median(ck, COLD);
                bench_emit("reader", "fmnist_x4/cold_cache", "MB/s stored", 1, k,
                           bench_median(cr, COLD), "cat", 0.8,
                           ",\"raw_MBps\":%s,\"page_cache\":false",
                           bench_jnum(nraw, k * raw / stored));
            }
        }
    } else {
        fprintf(stderr, "bench_data: cannot drop the page cache (not root): no cold case\n");
    }
    kpl_chunk_destroy(c);
    kpl_dataset_close(ds);
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    if (system(cmd) != 0) return 1;
    if (argc == 3 && loader_cases(argv[1], argv[2])) return 1;
    return bench_exit_code();
}
