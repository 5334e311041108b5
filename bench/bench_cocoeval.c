/*
 * bench_cocoeval.c — `bench/run.sh cocoeval`: COCO box mAP of 5000 images
 * x 100 detections, kpl (trainer/cocoeval.h) next to pycocotools.
 *
 *   bench_cocoeval ROOT WORK_DIR
 *
 * A synthetic COCO-like set is written once into WORK_DIR: 5000 images,
 * 80 categories with COCO's gaps in the ids, 1 to 15 objects per image
 * (1% crowd regions, areas from 8^2 to 300^2), and 100 detections per
 * image: jittered copies of the objects (right or wrong category) and
 * random boxes, uniform scores.  Cases (seconds, lower is better; kpl and
 * pycocotools alternate for KPL_BENCH_ROUNDS rounds, default 3):
 *  - cocoeval/5000x100/eval: evaluate + accumulate + summarize, the data
 *    already loaded (kpl_coco_evaluate on arrays; COCOeval on COCO
 *    objects).
 *  - cocoeval/5000x100/load+eval: the same from the two JSON files (what
 *    `kpl data cocoeval` does; COCO(gt) + loadRes(dt) + COCOeval).
 * Extra fields: detections, max_abs_diff (the largest difference between
 * kpl's twelve figures and pycocotools' in the last round; 0 means the
 * same doubles) and kpl's AP.  The reference is
 * tests/trainer/cocoeval_ref.py eval --time with /usr/bin/python3.
 */
#include "bench_common.h"
#include "trainer.h"

#include <sys/stat.h>

enum { IMAGES = 5000, DETS_PER_IMAGE = 100, CATEGORIES = 80 };

static void die(const char *what)
{
    fprintf(stderr, "bench_cocoeval: %s: %s\n", what, kpl_last_error());
    exit(1);
}

static uint64_t rng_state = 0x9E3779B97F4A7C15ull;
static double uniform(void) /* [0, 1), xorshift64* */
{
    rng_state ^= rng_state >> 12;
    rng_state ^= rng_state << 25;
    rng_state ^= rng_state >> 27;
    return (double)((rng_state * 2685821657736338717ull) >> 11) * 0x1.0p-53;
}

static int64_t cat_id(int k) { return 1 + k + k / 9; } /* gaps, as COCO's 1..90 */

/* A box of side 8..300 (log-uniform) inside a 640x480 image. */
static void random_box(double b[4])
{
    double side = 8 * pow(300.0 / 8, uniform());
    b[2] = round(side * (0.5 + uniform()) * 10) / 10;
    b[3] = round(side * (0.5 + uniform()) * 10) / 10;
    b[0] = round(uniform() * 600 * 10) / 10;
    b[1] = round(uniform() * 440 * 10) / 10;
}

/* Writes WORK/gt.json and WORK/dt.json (unless there). */
static void make_data(const char *gt_path, const char *dt_path)
{
    struct stat st;
    if (stat(gt_path, &st) == 0 && stat(dt_path, &st) == 0) return;
    fprintf(stderr, "bench_cocoeval: writing %s and %s\n", gt_path, dt_path);
    FILE *f = fopen(gt_path, "w");
    if (!f) {
        perror(gt_path);
        exit(1);
    }
    fprintf(f, "{\"images\":[");
    for (int i = 0; i < IMAGES; i++)
        fprintf(f, "%s{\"id\":%d,\"width\":640,\"height\":480}", i ? "," : "", 100000 + 7 * i);
    fprintf(f, "],\"categories\":[");
    for (int k = 0; k < CATEGORIES; k++)
        fprintf(f, "%s{\"id\":%lld,\"name\":\"c%d\"}", k ? "," : "", (long long)cat_id(k), k);
    fprintf(f, "],\"annotations\":[");
    kpl_coco_detection *dets = malloc(sizeof *dets * IMAGES * DETS_PER_IMAGE);
    int64_t nd = 0, ann_id = 1;
    for (int i = 0; i < IMAGES; i++) {
        int64_t img = 100000 + 7 * i;
        int ngt = 1 + (int)(uniform() * 15);
        int64_t first = nd;
        for (int j = 0; j < ngt; j++) {
            double b[4];
            random_box(b);
            int k = (int)(uniform() * CATEGORIES);
            int crowd = uniform() < 0.01;
            fprintf(f, "%s{\"id\":%lld,\"image_id\":%lld,\"category_id\":%lld,\"bbox\":[%g,%g,"
                       "%g,%g],\"area\":%.2f,\"iscrowd\":%d}", ann_id > 1 ? "," : "",
                    (long long)ann_id, (long long)img, (long long)cat_id(k), b[0], b[1], b[2],
                    b[3], b[2] * b[3] * (0.5 + 0.5 * uniform()), crowd);
            ann_id++;
            for (int c = 0; c < 3 && nd - first < DETS_PER_IMAGE; c++) {
                kpl_coco_detection *d = &dets[nd++];
                d->image_id = img;
                d->category_id =
                    uniform() < 0.8 ? cat_id(k) : cat_id((int)(uniform() * CATEGORIES));
                for (int q = 0; q < 2; q++) {
                    d->bbox[q] = round((b[q] + (uniform() - 0.5) * 0.3 * b[q + 2]) * 100) / 100;
                    d->bbox[q + 2] = round(b[q + 2] * (0.8 + 0.4 * uniform()) * 100) / 100;
                }
                d->score = round(uniform() * 1e4) / 1e4;
            }
        }
        while (nd - first < DETS_PER_IMAGE) {
            kpl_coco_detection *d = &dets[nd++];
            d->image_id = img;
            d->category_id = cat_id((int)(uniform() * CATEGORIES));
            random_box(d->bbox);
            d->score = round(uniform() * 1e4) / 1e4;
        }
    }
    fprintf(f, "]}\n");
    if (fclose(f) != 0) {
        perror(gt_path);
        exit(1);
    }
    if (kpl_coco_dets_save(dt_path, dets, nd) < 0) die("writing detections");
    free(dets);
}

struct ref_result {
    double load_s, eval_s, stats[KPL_COCO_NSTATS];
    int ok;
};

static void ref_line(const char *line, void *ctx)
{
    struct ref_result *r = ctx;
    const char *p;
    if (!(p = strstr(line, "\"load_s\": "))) return;
    r->load_s = strtod(p + 10, NULL);
    if (!(p = strstr(line, "\"eval_s\": "))) return;
    r->eval_s = strtod(p + 10, NULL);
    for (int i = 0; i < KPL_COCO_NSTATS; i++) {
        char key[32];
        snprintf(key, sizeof key, "\"%s\": ", kpl_coco_stat_names[i]);
        if (!(p = strstr(line, key))) return;
        r->stats[i] = strtod(p + strlen(key), NULL);
    }
    r->ok = 1;
}

int main(int argc, char **argv)
{
    if (argc != 3) {
        fprintf(stderr, "usage: bench_cocoeval ROOT WORK_DIR\n");
        return 2;
    }
    char gt_path[4096], dt_path[4096], cmd[16384];
    snprintf(gt_path, sizeof gt_path, "%s/cocoeval_gt.json", argv[2]);
    snprintf(dt_path, sizeof dt_path, "%s/cocoeval_dt.json", argv[2]);
    make_data(gt_path, dt_path);
    snprintf(cmd, sizeof cmd,
             "/usr/bin/python3 '%s/tests/trainer/cocoeval_ref.py' eval --time '%s' '%s'", argv[1],
             gt_path, dt_path);
    int rounds = bench_env_int("KPL_BENCH_ROUNDS", 3, 1, 8);
    double k_eval[8], k_all[8], r_eval[8], r_all[8], diff = NAN, ap = NAN;
    int64_t ndet = 0;
    for (int round = 0; round < rounds; round++) {
        /* kpl: from the files, then again from the arrays */
        double t0 = bench_now();
        kpl_coco_gt *gt = NULL;
        kpl_coco_detection *dets = NULL;
        kpl_coco_stats s;
        if (kpl_coco_gt_load(gt_path, &gt) < 0 || kpl_coco_dets_load(dt_path, &dets, &ndet) < 0 ||
            kpl_coco_evaluate(gt, dets, ndet, &s) < 0)
            die("evaluation");
        k_all[round] = bench_now() - t0;
        t0 = bench_now();
        if (kpl_coco_evaluate(gt, dets, ndet, &s) < 0) die("evaluation");
        k_eval[round] = bench_now() - t0;
        ap = s.stats[KPL_COCO_AP];
        free(dets);
        kpl_coco_gt_destroy(gt);
        /* pycocotools */
        struct ref_result r = {0};
        r_eval[round] = r_all[round] = NAN;
        if (bench_run_lines(cmd, ref_line, &r) == 0 && r.ok) {
            r_eval[round] = r.eval_s;
            r_all[round] = r.load_s + r.eval_s;
            diff = 0;
            for (int i = 0; i < KPL_COCO_NSTATS; i++)
                diff = fmax(diff, fabs(r.stats[i] - s.stats[i]));
        }
        fprintf(stderr, "bench_cocoeval: round %d: kpl %.3f s (%.3f s with loading), pycocotools "
                        "%.3f s (%.3f s)\n", round + 1, k_eval[round], k_all[round],
                r_eval[round], r_all[round]);
    }
    char n1[BENCH_NUM_LEN], n2[BENCH_NUM_LEN], rk[BENCH_RANGE_LEN], rr[BENCH_RANGE_LEN];
    const char *extra = ",\"detections\":%lld,\"rounds\":%d,\"kpl_range\":%s,\"ref_range\":%s,"
                        "\"max_abs_diff\":%s,\"kpl_AP\":%s";
    bench_emit("cocoeval", "5000x100/eval", "s", 0, bench_median(k_eval, rounds),
               bench_median(r_eval, rounds), "pycocotools", NAN, extra, (long long)ndet, rounds,
               bench_jrange(rk, k_eval, rounds), bench_jrange(rr, r_eval, rounds),
               bench_jnum(n1, diff), bench_jnum(n2, ap));
    bench_emit("cocoeval", "5000x100/load+eval", "s", 0, bench_median(k_all, rounds),
               bench_median(r_all, rounds), "pycocotools", NAN, extra, (long long)ndet, rounds,
               bench_jrange(rk, k_all, rounds), bench_jrange(rr, r_all, rounds),
               bench_jnum(n1, diff), bench_jnum(n2, ap));
    return bench_exit_code();
}
