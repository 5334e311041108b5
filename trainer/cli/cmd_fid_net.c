/*
 * cmd_fid_net.c — `kpl data fid-net`: the feature network of FID and the
 * Inception Score (fid.h, docs/fid.md) made as one checkpoint file, the
 * file a GAN recipe's task.gan.fid_network names and the task only loads.
 *
 *   kpl data fid-net [--recipe R] [-o FILE] [--force] [KEY=VALUE ...]
 *
 * The recipe trains in this process, as `kpl train` runs it
 * (kpl__cli_train), in a run directory of its own beside FILE
 * (FILE.run-XXXXXX).  Its final checkpoint, written and fsync'd there, is
 * renamed over FILE: the same file system, so FILE appears complete or
 * not at all.  The directory is removed after, whatever happened; a
 * failure or a stop (SIGINT, SIGTERM: exit 128 + the signal) leaves FILE
 * as it was.  Under mpirun or kplrun the ranks train it together, as they
 * would a kpl train, and rank 0 keeps the file and says what it is.
 */
#define _GNU_SOURCE /* nftw, mkdtemp */
#include "cli.h"

#include <errno.h>
#include <ftw.h>
#include <limits.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#define CMD "kpl data fid-net"

typedef struct {
    const char *recipe, *out;
    const char **ov; /* the KEY=VALUE overrides, argc long */
    int nov;
    bool force;
} fid_args;

/* The command line into a: 0, or 2 after saying what is wrong. */
static int parse(int argc, char **argv, fid_args *a)
{
    a->recipe = KPL_FID_DEFAULT_RECIPE, a->out = KPL_FID_DEFAULT_NETWORK;
    for (int i = 0; i < argc; i++) {
        const char *s = argv[i];
        if (!strcmp(s, "--recipe") && i + 1 < argc) {
            a->recipe = argv[++i];
        } else if ((!strcmp(s, "-o") || !strcmp(s, "--out")) && i + 1 < argc) {
            a->out = argv[++i];
        } else if (!strcmp(s, "--force")) {
            a->force = true;
        } else if (!strncmp(s, "run_dir=", 8)) {
            fprintf(stderr, CMD ": '%s': the run directory is the command's own (beside the "
                    "output, removed after)\n", s);
            return 2;
        } else if (s[0] != '-' && strchr(s, '=')) {
            a->ov[a->nov++] = s;
        } else {
            fprintf(stderr, CMD ": unexpected argument '%s' (try 'kpl data --help')\n", s);
            return 2;
        }
    }
    if (!a->out[0] || a->out[strlen(a->out) - 1] == '/') {
        fprintf(stderr, CMD ": -o '%s' names no file\n", a->out);
        return 2;
    }
    return 0;
}

static int rm_entry(const char *path, const struct stat *sb, int flag, struct FTW *ftw)
{
    (void)sb, (void)flag, (void)ftw;
    return remove(path) != 0 && errno != ENOENT ? -1 : 0;
}

/* rm -rf dir, saying so when it cannot. */
static void remove_tree(const char *dir)
{
    if (nftw(dir, rm_entry, 16, FTW_DEPTH | FTW_PHYS) != 0 && errno != ENOENT)
        fprintf(stderr, CMD ": warning: cannot remove the run directory %s: %s\n", dir,
                strerror(errno));
}

/* A new empty directory out.run-XXXXXX beside out (its parents made). */
static kpl_status make_run_dir(const char *out, char *dir, size_t len)
{
    KPL_CHECK((size_t)snprintf(dir, len, "%s", out) < len, KPL_EINVAL, "%s: path too long", out);
    char *slash = strrchr(dir, '/');
    if (slash && slash != dir) {
        *slash = 0;
        KPL_TRY(kpl__mkdirs(dir));
    }
    snprintf(dir, len, "%s.run-XXXXXX", out);
    KPL_CHECK(mkdtemp(dir), KPL_EIO, "cannot create a run directory %s: %s", dir,
              strerror(errno));
    return KPL_OK;
}

/* The newest complete checkpoint of the run in dir renamed to out. */
static kpl_status keep_final(const char *dir, const char *out)
{
    char ckdir[PATH_MAX + 16], src[PATH_MAX + 48];
    int64_t steps[1024];
    int n = 0;
    KPL_CHECK(snprintf(ckdir, sizeof ckdir, "%s/checkpoints", dir) < (int)sizeof ckdir,
              KPL_EINVAL, "%s: path too long", dir);
    KPL_TRY(kpl__checkpoint_list(ckdir, steps, 1024, &n));
    KPL_CHECK(n > 0, KPL_ENOTFOUND, "the training left no checkpoint in %s", ckdir);
    kpl__checkpoint_path(ckdir, steps[n - 1], src, sizeof src);
    KPL_CHECK(rename(src, out) == 0, KPL_EIO, "cannot rename %s to %s: %s", src, out,
              strerror(errno));
    return KPL_OK;
}

/* The recipe with the overrides trained to its end in a run directory
 * beside a->out, whose final checkpoint then becomes a->out (rank 0).  The
 * exit status: 0, 1 failed, 2 a bad recipe, 128 + the signal of a stop.
 * *rank: this process's rank in the job. */
static int train(const fid_args *a, kpl_recipe *r, int32_t *rank)
{
    *rank = 0;
    if (kpl__recipe_load_known_task(a->recipe, a->nov, a->ov, r) < 0) {
        fprintf(stderr, CMD ": %s\n", kpl_last_error());
        return 2;
    }
    char dir[PATH_MAX];
    if (make_run_dir(a->out, dir, sizeof dir) < 0 ||
        (size_t)snprintf(r->run_dir, sizeof r->run_dir, "%s", dir) >= sizeof r->run_dir) {
        fprintf(stderr, CMD ": %s\n", kpl_last_error());
        return 1;
    }
    fprintf(stderr, "fid: training the feature network %s: kpl train %s%s (run directory %s, "
            "removed after)\n", a->out, a->recipe, a->nov ? " with overrides" : "", dir);
    double t0 = kpl_seconds();
    kpl_trainer_options o = KPL_TRAINER_OPTIONS_INIT;
    kpl__console con;
    kpl__console_init(&con, KPL_PROGRESS_NEVER);
    con.out = stderr; /* stdout is for the JSON line */
    int rc = kpl__cli_train(r, &o, &con, rank);
    kpl__console_end(&con);
    if (rc == 0 && *rank == 0 && keep_final(dir, a->out) < 0) {
        fprintf(stderr, CMD ": %s\n", kpl_last_error());
        rc = 1;
    }
    remove_tree(dir); /* rank 0's is the run's; the other ranks' stayed empty */
    if (rc == 0 && *rank == 0)
        fprintf(stderr, "fid: feature network %s made in %.0f s\n", a->out, kpl_seconds() - t0);
    else if (rc != 0)
        fprintf(stderr, "fid: %s: %s not made (left as it was)\n",
                rc > 128 ? kpl__signal_name(rc - 128) : "the training failed", a->out);
    return rc;
}

/* The network loaded once as the task loads it, and said in one line. */
static int report(const fid_args *a, bool existed, double t0)
{
    kpl_feature_net *net = NULL;
    if (kpl_feature_net_create_with(a->recipe, a->nov, a->ov, a->out, NULL, &net) < 0) {
        fprintf(stderr, CMD ": %s\n", kpl_last_error());
        return 1;
    }
    printf("{\"event\":\"fid-net\",\"checkpoint\":\"%s\",\"recipe\":\"%s\",\"existed\":%s,"
           "\"dim\":%lld,\"classes\":%lld,\"id\":\"%s\",\"seconds\":%.1f}\n", a->out, a->recipe,
           existed ? "true" : "false", (long long)kpl_feature_net_dim(net),
           (long long)kpl_feature_net_classes(net), kpl_feature_net_id(net), kpl_seconds() - t0);
    kpl_feature_net_destroy(net);
    return 0;
}

int kpl__cmd_fid_net(int argc, char **argv)
{
    fid_args a;
    memset(&a, 0, sizeof a);
    a.ov = calloc((size_t)argc + 1, sizeof *a.ov);
    kpl_recipe *r = malloc(sizeof *r);
    int rc = !a.ov || !r ? 1 : parse(argc, argv, &a);
    if (rc == 1) fprintf(stderr, CMD ": out of memory\n");
    double t0 = kpl_seconds();
    bool existed = rc == 0 && !a.force && access(a.out, F_OK) == 0;
    int32_t rank = 0;
    if (rc == 0 && !existed) {
        /* as kpl train: a console that goes away loses lines, not the
         * run; a stop ends the run at its next step, and nothing is kept */
        signal(SIGPIPE, SIG_IGN);
        kpl_catch_stop_signals(true);
        rc = train(&a, r, &rank);
    }
    if (rc == 0 && rank == 0) rc = report(&a, existed, t0);
    free(r);
    free(a.ov);
    return rc;
}
