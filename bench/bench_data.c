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
 * this is the memory-speed bound; with a cold disk both are disk-bound.
 * Throughput is in MB/s of the stored (compressed) bytes for both sides;
 * the raw (decompressed) MB/s is printed as an extra field.
 */
#include "bench_common.h"
#include "dataio.h"

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

int main(int argc, char **argv)
{
    if (argc != 2) {
        fprintf(stderr, "usage: bench_data WORKDIR\n");
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
        int64_t n = 0;
        for (int64_t k = 0; k < kpl_dataset_num_chunks(ds); k++) {
            if (kpl_dataset_read_chunk(ds, k, c) < 0) return die("read_chunk");
            n += kpl_chunk_num_records(c);
        }
        if (n != kpl_dataset_num_examples(ds)) return 1;
        tk[round] = stored / 1e6 / (bench_now() - t0);
    }
    double k = bench_median(tk, ROUNDS), ref = bench_median(tr, ROUNDS);
    char casename[64], nraw[BENCH_NUM_LEN];
    snprintf(casename, sizeof casename, "fmnist_x4/%lld_examples",
             (long long)kpl_dataset_num_examples(ds));
    bench_emit("reader", casename, "MB/s stored", 1, k, ref, "cat", 0.8,
               ",\"raw_MBps\":%s,\"stored_MB\":%.1f,\"compression\":%.2f,\"page_cache\":true",
               bench_jnum(nraw, k * raw / stored), stored / 1e6, raw / stored);
    kpl_chunk_destroy(c);
    kpl_dataset_close(ds);
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    return system(cmd) == 0 ? bench_exit_code() : 1;
}
