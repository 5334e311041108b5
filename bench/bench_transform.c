/*
 * bench_transform.c — the data group's per-sample transform: kpl's decode +
 * random-resized crop + flip + normalize, one core, next to TurboJPEG's
 * plain full decode and PIL's pipeline of the same work.
 *
 *   bench_transform BASELINES_DIR
 *
 * For each JPEG in BASELINES_DIR/jpeg, pinned to the CPU the process started
 * on, alternating for several rounds (which side goes first alternates):
 *   kpl: kpl__xform_sample with RandomResizedCrop(224, scale (0.08, 1),
 *        ratio (3/4, 4/3)), flip p = 0.5, ImageNet mean/std, to (3, 224,
 *        224) f32; each call a new example number, so a new crop
 *   ref: tjDecompress2 of the same bytes to full-size RGB, flags 0
 * and, once in the middle of the rounds, `taskset -c CPU python3
 * pil_pipeline.py FILE N` (decode + the same crop/resize/flip/normalize in
 * PIL and numpy; its own 5 rounds, median).  Cases:
 *   transform  FILE/rrc224_flip_norm_f32/vs_tj_full_decode   target 1.0
 *   transform  FILE/rrc224_flip_norm_f32/vs_pil              target 2.0
 */
#define _GNU_SOURCE
#include "bench_dataio.h"
#include "transform_impl.h"

#include <glob.h>
#include <sched.h>
#include <stdint.h>
#include <turbojpeg.h>
#include <unistd.h>

enum { N_PER_ROUND = 300 };

static int die(const char *what)
{
    fprintf(stderr, "bench_transform: %s: %s\n", what, kpl_last_error());
    return 1;
}

static double pil_rate;

static void pil_line(const char *line, void *ctx)
{
    (void)ctx;
    const char *k = "pipeline_img_per_s_med=";
    const char *at = strstr(line, k);
    if (strncmp(line, "RESULT", 6) == 0 && at) pil_rate = strtod(at + strlen(k), NULL);
    fprintf(stderr, "bench_transform: pil: %s", line);
}

static int bench_file(const char *baselines, const char *file, int cpu, int rounds, bool have_pil,
                      const char *workdir, int nfile)
{
    FILE *f = fopen(file, "rb");
    if (!f) return die(file);
    fseek(f, 0, SEEK_END);
    long len = ftell(f);
    fseek(f, 0, SEEK_SET);
    uint8_t *jpg = malloc((size_t)len);
    if (!jpg || fread(jpg, 1, (size_t)len, f) != (size_t)len) return die("read");
    fclose(f);

    /* A one-example dataset: kpl__xform_init resolves the config against it. */
    char dir[600];
    snprintf(dir, sizeof dir, "%s/set%d", workdir, nfile);
    kpl_feature_spec schema[1] = {{.name = "image", .type = KPL_FEATURE_BYTES, .encoding = "jpeg"}};
    kpl_record_writer_config wc = KPL_RECORD_WRITER_CONFIG_INIT;
    kpl_record_writer *w = NULL;
    if (kpl_record_writer_create(dir, 1, schema, &wc, &w) < 0) return die("writer");
    kpl_feature_value v[1] = {{jpg, (uint32_t)len}};
    if (kpl_record_writer_add(w, v) < 0 || kpl_record_writer_close(w) < 0) return die("write");
    kpl_dataset *ds = NULL;
    if (kpl_dataset_open(dir, &ds) < 0) return die("open");

    kpl_transform_config cfg = bench_imagenet_train();
    cfg.label_feature = NULL;
    kpl__xform x;
    if (kpl__xform_init(&x, &cfg, ds) < 0) return die("xform_init");
    kpl__xform_scratch *s = kpl__xform_scratch_create();
    float *out = malloc(kpl__xform_image_bytes(&x));
    kpl__sample_out o = {.image = out};

    tjhandle tj = tjInitDecompress();
    int W, H, ss, cs;
    if (tjDecompressHeader3(tj, jpg, (unsigned long)len, &W, &H, &ss, &cs)) return die("tj header");
    uint8_t *rgb = malloc((size_t)W * H * 3);

    int64_t example = 0;
    for (int i = 0; i < 30; i++) { /* warm-up: scratch buffers reach their size */
        if (kpl__xform_sample(&x, v, 1, 0, example++, s, &o) < 0) return die("sample");
        tjDecompress2(tj, jpg, (unsigned long)len, rgb, W, 0, H, TJPF_RGB, 0);
    }
    double tk[64], tr[64];
    if (rounds > 64) rounds = 64;
    pil_rate = NAN;
    for (int r = 0; r < rounds; r++) {
        for (int side = 0; side < 2; side++) {
            bool kpl_side = (side == 0) == (r % 2 == 0);
            double t0 = bench_now();
            for (int i = 0; i < N_PER_ROUND; i++) {
                if (kpl_side) {
                    if (kpl__xform_sample(&x, v, 1, 0, example++, s, &o) < 0) return die("sample");
                } else if (tjDecompress2(tj, jpg, (unsigned long)len, rgb, W, 0, H, TJPF_RGB, 0)) {
                    fprintf(stderr, "bench_transform: tj: %s\n", tjGetErrorStr2(tj));
                    return 1;
                }
            }
            double rate = N_PER_ROUND / (bench_now() - t0);
            (kpl_side ? tk : tr)[r] = rate;
        }
        if (r == rounds / 2 && have_pil) {
            char cmd[1500];
            snprintf(cmd, sizeof cmd, "taskset -c %d /usr/bin/python3 '%s/pil_pipeline.py' '%s' %d",
                     cpu, baselines, file, N_PER_ROUND);
            if (bench_run_lines(cmd, pil_line, NULL) == 0 && isnan(pil_rate)) {
                fprintf(stderr, "bench_transform: no RESULT line from %s\n", cmd);
                bench_ref_failures++;
            }
        }
    }
    char rk[BENCH_RANGE_LEN], rr[BENCH_RANGE_LEN];
    bench_jrange(rk, tk, rounds);
    bench_jrange(rr, tr, rounds);
    double k = bench_median(tk, rounds), ref = bench_median(tr, rounds);
    const char *base = strrchr(file, '/') ? strrchr(file, '/') + 1 : file;
    char cas[300];
    snprintf(cas, sizeof cas, "%s/rrc224_flip_norm_f32/vs_tj_full_decode", base);
    bench_emit("transform", cas, "images/s", 1, k, ref, "turbojpeg-full-decode-rgb", 1.0,
               ",\"threads\":1,\"cpu\":%d,\"rounds\":%d,\"images_per_round\":%d,\"image\":\"%dx%d\","
               "\"kpl_range\":%s,\"ref_range\":%s",
               cpu, rounds, N_PER_ROUND, W, H, rk, rr);
    snprintf(cas, sizeof cas, "%s/rrc224_flip_norm_f32/vs_pil", base);
    if (have_pil)
        bench_emit("transform", cas, "images/s", 1, k, pil_rate, "pil-pipeline.py", 2.0,
                   ",\"threads\":1,\"cpu\":%d,\"rounds\":%d,\"kpl_range\":%s", cpu, rounds, rk);
    else
        bench_emit("transform", cas, "images/s", 1, k, NAN, "pil-pipeline.py", 2.0,
                   ",\"threads\":1,\"cpu\":%d,\"note\":\"python3-pil or python3-numpy missing: "
                   "no reference\"", cpu);

    free(rgb);
    tjDestroy(tj);
    free(out);
    kpl__xform_scratch_destroy(s);
    kpl_dataset_close(ds);
    free(jpg);
    return 0;
}

int main(int argc, char **argv)
{
    if (argc != 2 || strlen(argv[1]) > 400) {
        fprintf(stderr, "usage: bench_transform BASELINES_DIR\n");
        return 2;
    }
    const char *baselines = argv[1];
    int cpu = sched_getcpu();
    if (cpu < 0) cpu = 0;
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(cpu, &set);
    if (sched_setaffinity(0, sizeof set, &set) != 0) perror("bench_transform: sched_setaffinity");
    int rounds = bench_env_int("KPL_BENCH_ROUNDS", 7, 1, 64);
    bool have_pil =
        system("/usr/bin/python3 -c 'import PIL, numpy' > /dev/null 2>&1") == 0 &&
        system("command -v taskset > /dev/null 2>&1") == 0;
    if (!have_pil) fprintf(stderr, "bench_transform: python3-pil/numpy or taskset missing\n");

    char pat[600], workdir[64];
    snprintf(pat, sizeof pat, "%s/jpeg/*.jpg", baselines);
    glob_t g;
    if (glob(pat, 0, NULL, &g) != 0) {
        fprintf(stderr, "bench_transform: no JPEGs match %s\n", pat);
        return 1;
    }
    strcpy(workdir, "/tmp/kpl_bench_transform_XXXXXX");
    if (!mkdtemp(workdir)) return die("mkdtemp");
    int rc = 0;
    for (size_t i = 0; i < g.gl_pathc && rc == 0; i++) {
        fprintf(stderr, "bench_transform: %s on cpu %d\n", g.gl_pathv[i], cpu);
        rc = bench_file(baselines, g.gl_pathv[i], cpu, rounds, have_pil, workdir, (int)i);
    }
    globfree(&g);
    char cmd[128];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", workdir);
    if (system(cmd) != 0) rc = 1;
    return rc ? rc : bench_exit_code();
}
