/*
 * cmd_train.c — `kpl train` and `kpl eval`: arguments and the recipe; the
 * run itself is kpl_trainer_fit's (run/fit.c).
 */
#include "cli.h"

#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static void usage_train(FILE *f)
{
    fprintf(f,
            "usage: kpl train RECIPE.yaml [KEY=VALUE ...] [--resume [CHECKPOINT]\n"
            "                 [--reset-optimizer]] [--plugin LIB.so ...]\n"
            "       kpl train RECIPE.yaml [KEY=VALUE ...] --print-config\n"
            "       kpl train --keys [--plugin LIB.so ...]\n"
            "\n"
            "Trains what the recipe describes.  KEY=VALUE overrides a recipe key, e.g.\n"
            "optimizer.lr=0.2 data.train.batch_size=64 run_dir=runs/try1 (VALUE in YAML:\n"
            "0.1, text, [1, 2]).  Under mpirun or kplrun every rank runs the same command\n"
            "and the ranks train one model data-parallel.\n"
            "\n"
            "  --resume [FILE]  continue from FILE, or from the newest complete checkpoint\n"
            "                   of run_dir, or of the newest runs/<name>-* of this recipe\n"
            "  --reset-optimizer  with --resume: start the optimizer state fresh (needed\n"
            "                   when the optimizer changed: another rule, momentum on/off)\n"
            "  --print-config   print the resolved recipe (every key) and exit\n"
            "  --keys           list every recipe key with its default and meaning\n"
            "  --plugin LIB.so  load a plugin first: the tasks, models and optimizers it\n"
            "                   registers (a recipe's plugins: list does the same).\n"
            "                   Loading a plugin runs its code\n"
            "\n"
            "The run directory (runs/<name>-<time>/ unless run_dir is given) holds\n"
            "config.yaml, metrics.jsonl, logs/rank-NNNNN.log, tb/ (TensorBoard) and\n"
            "checkpoints/.  The last line on stdout is a JSON object with \"event\":\"done\".\n"
            "SIGINT or SIGTERM (to kpl or its whole process group) stops the run at the\n"
            "next step every rank agrees on, with a checkpoint (docs/faults.md).\n"
            "\n"
            "Under kplrun --max-restarts, a restarted launch (KPL_RESTART_COUNT >= 1)\n"
            "continues from the newest complete checkpoint of its own run directory\n"
            "(run_dir, or runs/<name>-<KPL_JOB_ID>, the same for every launch of a\n"
            "kplrun job), or starts fresh when there is none, and records a \"restart\"\n"
            "event in metrics.jsonl.\n"
            "Exit status: 0 done, 1 failed, 2 bad recipe or usage, 130/143 stopped by\n"
            "SIGINT/SIGTERM after saving a checkpoint.\n");
}

static void usage_eval(FILE *f)
{
    fprintf(f,
            "usage: kpl eval RECIPE.yaml --checkpoint FILE [KEY=VALUE ...] [--plugin LIB.so ...]\n"
            "\n"
            "Evaluates a checkpoint on the recipe's validation split (data.val): top-1,\n"
            "top-5 and loss, and the confusion matrix when there are at most\n"
            "eval.confusion_max_classes classes.  The last line is a JSON object.  Only\n"
            "data.val is read (converted first when data.convert asks); the training split\n"
            "need not exist.\n");
}

/* What kpl train and kpl eval share on their command lines: the recipe,
 * its overrides and the plugins. */
typedef struct {
    const char *cmd, *recipe;
    const char **ov, **plugins; /* argc each */
    int nov, np;
} args;

static bool args_init(args *a, const char *cmd, int argc)
{
    memset(a, 0, sizeof *a);
    a->cmd = cmd;
    a->ov = calloc((size_t)argc + 1, sizeof *a->ov);
    a->plugins = calloc((size_t)argc + 1, sizeof *a->plugins);
    return a->ov && a->plugins;
}

static void args_free(args *a)
{
    free(a->ov);
    free(a->plugins);
}

/* argv[*i] when it is --plugin PATH, an override (KEY=VALUE) or the
 * recipe: 0 (*i moved past it), or 2 after saying what is wrong. */
static int common_arg(args *a, int argc, char **argv, int *i)
{
    const char *s = argv[*i];
    if (!strcmp(s, "--plugin")) {
        if (*i + 1 >= argc || argv[*i + 1][0] == '-') {
            fprintf(stderr, "kpl %s: --plugin needs the path of a shared library\n", a->cmd);
            return 2;
        }
        a->plugins[a->np++] = argv[++*i];
    } else if (s[0] == '-' && s[1]) {
        fprintf(stderr, "kpl %s: unknown option '%s' (try 'kpl %s --help')\n", a->cmd, s, a->cmd);
        return 2;
    } else if (strchr(s, '=')) {
        a->ov[a->nov++] = s;
    } else if (!a->recipe) {
        a->recipe = s;
    } else {
        fprintf(stderr, "kpl %s: unexpected argument '%s' (overrides are KEY=VALUE)\n", a->cmd,
                s);
        return 2;
    }
    return 0;
}

/* Loads the --plugin libraries, before the recipe names what they add. */
static int load_plugins(const args *a)
{
    for (int i = 0; i < a->np; i++)
        if (kpl_plugin_load(a->plugins[i]) < 0) {
            fprintf(stderr, "kpl %s: %s\n", a->cmd, kpl_last_error());
            return 2;
        }
    return 0;
}

/* The recipe's task, or NULL after saying that it is unknown. */
static const kpl_task_kind *task_of(const kpl_recipe *r)
{
    const kpl_task_kind *k = kpl_task_find(r->task);
    if (!k) {
        char known[512];
        kpl__task_names(known, sizeof known);
        fprintf(stderr, "kpl: unknown task '%s' (known: %s)\n", r->task, known);
    }
    return k;
}

/* A failure's exit status: the job ends on every rank first (the others
 * may wait in a collective for this one); a stop is 128 + its signal. */
static int failed(kpl_trainer *t, kpl_status st)
{
    if (st == KPL_ECANCELED && kpl_stop_requested()) return 128 + kpl_stop_requested();
    kpl_trainer_end_job(t, 1);
    return 1;
}

/* What a launcher that restarts failed jobs (kplrun --max-restarts) tells
 * each launch: the job's name and which launch this is, into o.  2 after
 * saying so when a count is no number; else 0. */
static int restart_from_env(kpl_trainer_options *o)
{
    static const char *const names[] = {"KPL_RESTART_COUNT", "KPL_MAX_RESTARTS"};
    int *dst[] = {&o->restart, &o->max_restarts};
    for (int i = 0; i < 2; i++) {
        const char *v = getenv(names[i]);
        if (!v || !*v) continue;
        char *end;
        long n = strtol(v, &end, 10);
        if (*end || n < 0 || n > 1000000) {
            fprintf(stderr, "kpl train: %s='%s' is not a count\n", names[i], v);
            return 2;
        }
        *dst[i] = (int)n;
    }
    o->job_id = getenv("KPL_JOB_ID");
    o->restart_reason = getenv("KPL_RESTART_REASON");
    return 0;
}

int kpl__cli_train(const kpl_recipe *r, kpl_trainer_options *o, kpl__console *con,
                   int32_t *rank)
{
    if (rank) *rank = 0;
    const kpl_task_kind *task = task_of(r);
    if (!task) return 1;
    o->log = kpl__console_log, o->log_ctx = con, o->progress = con->bar;
    kpl_trainer *t = NULL;
    kpl_status st = kpl_trainer_create(r, task, o, &t);
    if (st < 0) return failed(NULL, st);
    if (rank) *rank = kpl_trainer_rank(t);
    st = kpl_trainer_fit(t);
    int rc = 0;
    if (st == KPL_ECANCELED) rc = 128 + kpl_trainer_stop_signal(t);
    else if (st < 0) rc = failed(t, st);
    kpl_trainer_destroy(t);
    return rc;
}

/* `kpl train`: the recipe's task over kpl_trainer_fit; resume NULL (a new
 * run), "" (the newest checkpoint) or a checkpoint file. */
static int train_run(const kpl_recipe *r, const char *resume, bool reset_optimizer)
{
    kpl_trainer_options o = KPL_TRAINER_OPTIONS_INIT;
    if (restart_from_env(&o)) return 2;
    o.resume = resume;
    o.reset_optimizer = reset_optimizer;
    kpl__console con;
    kpl__console_init(&con, r->log.progress);
    int rc = kpl__cli_train(r, &o, &con, NULL);
    kpl__console_end(&con);
    return rc;
}

/* `kpl eval`: the checkpoint's models on the recipe's validation split. */
/* The checkpoint's trainer for evaluation (its models and weights, the
 * validation data); KPL_EINVAL after saying so for an unknown task. */
static kpl_status eval_trainer(const kpl_recipe *r, const char *checkpoint, kpl__console *con,
                               kpl_trainer **t)
{
    const kpl_task_kind *task = task_of(r);
    kpl__console_init(con, KPL_PROGRESS_NEVER);
    if (!task) return KPL_EINVAL;
    kpl_trainer_options o = KPL_TRAINER_OPTIONS_INIT;
    o.checkpoint = checkpoint;
    o.log = kpl__console_log, o.log_ctx = con;
    return kpl_trainer_create(r, task, &o, t);
}

static int eval_run(const kpl_recipe *r, const char *checkpoint)
{
    kpl__console con;
    kpl_trainer *t = NULL;
    kpl_status st = eval_trainer(r, checkpoint, &con, &t);
    if (!kpl_task_find(r->task)) { /* said by task_of */
        kpl__console_end(&con);
        return 1;
    }
    if (st >= 0) st = kpl_trainer_eval_checkpoint(t, checkpoint);
    int rc = st < 0 ? failed(t, st) : 0;
    kpl_trainer_destroy(t);
    kpl__console_end(&con);
    return rc;
}

static int load_recipe(const args *a, kpl_recipe *r)
{
    if (!a->recipe) {
        fprintf(stderr, "kpl %s: no recipe given (try 'kpl %s --help')\n", a->cmd, a->cmd);
        return 2;
    }
    if (kpl__recipe_load_known_task(a->recipe, a->nov, a->ov, r) < 0) {
        fprintf(stderr, "kpl %s: %s\n", a->cmd, kpl_last_error());
        return 2;
    }
    return 0;
}

int kpl__cmd_train(int argc, char **argv)
{
    const char *resume = NULL;
    args A;
    int rc = 0;
    bool print_config = false, reset_optimizer = false, keys = false;
    if (!args_init(&A, "train", argc)) {
        rc = 1;
        goto out;
    }
    for (int i = 0; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "-h") || !strcmp(a, "--help")) {
            usage_train(stdout);
            goto out;
        } else if (!strcmp(a, "--keys")) {
            keys = true;
        } else if (!strcmp(a, "--print-config")) {
            print_config = true;
        } else if (!strcmp(a, "--reset-optimizer")) {
            reset_optimizer = true;
        } else if (!strcmp(a, "--resume")) {
            /* an optional file: the next argument when it is neither an
             * override nor an option nor the recipe still missing */
            resume = "";
            if (i + 1 < argc && argv[i + 1][0] != '-' && !strchr(argv[i + 1], '=') &&
                (A.recipe || strstr(argv[i + 1], ".kpl")))
                resume = argv[++i];
        } else if ((rc = common_arg(&A, argc, argv, &i)) != 0) {
            goto out;
        }
    }
    if ((rc = load_plugins(&A)) != 0) goto out;
    if (keys) {
        kpl_recipe_print_keys(stdout);
        goto out;
    }
    /* A console that goes away (a terminal closed, kplrun's relay torn
     * down with mpirun by a scheduler's stop) must not kill a run that is
     * writing its checkpoint: what it prints then is lost, nothing else. */
    signal(SIGPIPE, SIG_IGN);
    /* a stop from here on is noted, and the run stops at its first step;
     * the handlers stay through the end (a scheduler may signal again
     * while the run winds down: its loaders, MPI), so the exit status
     * stays the stop's */
    if (!print_config) kpl_catch_stop_signals(true);
    if (reset_optimizer && !resume) {
        fprintf(stderr, "kpl train: --reset-optimizer goes with --resume (a new run's optimizer "
                        "starts fresh anyway)\n");
        rc = 2;
        goto out;
    }
    kpl_recipe *r = malloc(sizeof *r);
    if (!r) {
        rc = 1;
        goto out;
    }
    if ((rc = load_recipe(&A, r)) == 0) {
        if (print_config) {
            char *yaml = NULL;
            if (kpl_recipe_to_yaml(r, &yaml) == KPL_OK) fputs(yaml, stdout);
            free(yaml);
        } else {
            rc = train_run(r, resume, reset_optimizer);
        }
    }
    free(r);
out:
    args_free(&A);
    return rc;
}

int kpl__cmd_eval(int argc, char **argv)
{
    const char *ckpt = NULL;
    args A;
    int rc = 0;
    if (!args_init(&A, "eval", argc)) {
        rc = 1;
        goto out;
    }
    for (int i = 0; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "-h") || !strcmp(a, "--help")) {
            usage_eval(stdout);
            goto out;
        } else if (!strcmp(a, "--checkpoint") && i + 1 < argc) {
            ckpt = argv[++i];
        } else if (!strcmp(a, "--checkpoint")) {
            fprintf(stderr, "kpl eval: --checkpoint needs a FILE\n");
            rc = 2;
            goto out;
        } else if ((rc = common_arg(&A, argc, argv, &i)) != 0) {
            goto out;
        }
    }
    if (!ckpt) {
        fprintf(stderr, "kpl eval: --checkpoint FILE is required\n");
        rc = 2;
        goto out;
    }
    if ((rc = load_plugins(&A)) != 0) goto out;
    kpl_recipe *r = malloc(sizeof *r);
    if (!r) {
        rc = 1;
        goto out;
    }
    if ((rc = load_recipe(&A, r)) == 0) rc = eval_run(r, ckpt);
    free(r);
out:
    args_free(&A);
    return rc;
}

/* ---- kpl export and kpl graph: a checkpoint's inference graph ---- */

static void usage_export(FILE *f)
{
    fprintf(f,
            "usage: kpl export RECIPE.yaml --checkpoint FILE -o MODEL.kplm [--batch N]\n"
            "                  [--level 0-3] [--format kplm|onnx] [KEY=VALUE ...]\n"
            "                  [--plugin LIB.so ...]\n"
            "       kpl graph RECIPE.yaml --checkpoint FILE [--dot] [--level 0-3] [--batch N]\n"
            "       kpl graph MODEL.kplm [--dot]\n"
            "\n"
            "export traces model 0's forward in eval mode on an input batch of N images\n"
            "(default 1) of the size the data gives, runs the graph passes of the level\n"
            "(default 3: prune, in place, buffer reuse) and the inference fusions (batch\n"
            "norm folded into the convolution before it, convolution + ReLU, a residual\n"
            "add (+ ReLU) into the convolution before it), and writes a\n"
            "model file (docs/model-format.md) that 'kpl infer' and the C API (infer.h)\n"
            "run.  The recipe's validation transform goes with it.  Like 'kpl eval', the\n"
            "recipe's data.val is read for the input size.  --format onnx writes the same\n"
            "graph as an ONNX model (opset 13) instead, for onnxruntime and other tools.\n"
            "\n"
            "graph prints the traced graph before and after the passes (text, or Graphviz\n"
            "dot with --dot), or the graph of a model file.\n");
}

static int export_or_graph(bool graph, int argc, char **argv)
{
    const char *cmd = graph ? "graph" : "export";
    const char *ckpt = NULL, *out = NULL, *format = "kplm";
    long long batch = 1, level = 3;
    bool dot = false;
    args A;
    int rc = 0;
    if (!args_init(&A, cmd, argc)) return 1;
    for (int i = 0; i < argc; i++) {
        const char *a = argv[i];
        char *end = NULL;
        if (!strcmp(a, "-h") || !strcmp(a, "--help")) {
            usage_export(stdout);
            goto out;
        } else if (!strcmp(a, "--dot") && graph) {
            dot = true;
        } else if (!strcmp(a, "--format") && !graph && i + 1 < argc) {
            format = argv[++i];
            if (strcmp(format, "kplm") && strcmp(format, "onnx")) {
                fprintf(stderr, "kpl export: --format '%s' is not kplm or onnx\n", format);
                rc = 2;
                goto out;
            }
        } else if ((!strcmp(a, "--checkpoint") || !strcmp(a, "-o") || !strcmp(a, "--batch") ||
                    !strcmp(a, "--level")) && i + 1 < argc) {
            const char *v = argv[++i];
            if (a[2] == 'c') ckpt = v;
            else if (a[1] == 'o') out = v;
            else if (a[2] == 'b' && (!(batch = strtoll(v, &end, 10)) || *end || batch < 1)) rc = 2;
            else if (a[2] == 'l' && ((level = strtoll(v, &end, 10)), *end || level < 0 || level > 3))
                rc = 2;
            if (rc) {
                fprintf(stderr, "kpl %s: %s '%s' is not %s\n", cmd, a, v,
                        a[2] == 'b' ? "a positive integer" : "0, 1, 2 or 3");
                goto out;
            }
        } else if (!strcmp(a, "--checkpoint") || !strcmp(a, "-o") || !strcmp(a, "--batch") ||
                   !strcmp(a, "--level")) {
            fprintf(stderr, "kpl %s: %s needs a value\n", cmd, a);
            rc = 2;
            goto out;
        } else if ((rc = common_arg(&A, argc, argv, &i)) != 0) {
            goto out;
        }
    }
    if (graph && A.recipe && strstr(A.recipe, ".kplm") && !ckpt) { /* a model file's graph */
        kpl_model *m = NULL;
        if (kpl_model_load(A.recipe, -1, &m) < 0) {
            fprintf(stderr, "kpl graph: %s\n", kpl_last_error());
            rc = 1;
        } else {
            kpl_ir_dump(kpl_model_graph(m), stdout, dot);
            kpl_model_destroy(m);
        }
        goto out;
    }
    if (!ckpt || (!graph && !out)) {
        fprintf(stderr, "kpl %s: --checkpoint FILE%s is required (try 'kpl %s --help')\n", cmd,
                graph ? "" : " and -o MODEL.kplm are", cmd);
        rc = 2;
        goto out;
    }
    if ((rc = load_plugins(&A)) != 0) goto out;
    kpl_recipe *r = malloc(sizeof *r);
    if (!r) {
        rc = 1;
        goto out;
    }
    const kpl_task_kind *task = NULL;
    if ((rc = load_recipe(&A, r)) == 0 && !(task = task_of(r))) {
        rc = 2;
    } else if (rc == 0 && kpl_task_export_check(task) < 0) {
        fprintf(stderr, "kpl %s: %s\n", cmd, kpl_last_error());
        rc = 2;
    } else if (rc == 0) {
        kpl__console con;
        kpl_trainer *t = NULL;
        kpl_ir *ir = NULL;
        kpl_status st = eval_trainer(r, ckpt, &con, &t);
        if (st >= 0 && graph) {
            st = kpl_trainer_export(t, batch, 0, false, NULL, &ir);
            if (st >= 0) {
                printf("%s# traced (%d nodes)\n", dot ? "// " : "", kpl_ir_num_nodes(ir));
                kpl_ir_dump(ir, stdout, dot);
                st = kpl_ir_optimize(ir, (int)level, true);
            }
            if (st >= 0) {
                printf("%s# after the passes of O%lld and the inference fusions (%d nodes)\n",
                       dot ? "// " : "", level, kpl_ir_num_nodes(ir));
                kpl_ir_dump(ir, stdout, dot);
            }
            kpl_ir_destroy(ir);
        } else if (st >= 0) {
            bool onnx = !strcmp(format, "onnx");
            st = kpl_trainer_export(t, batch, (int)level, true, onnx ? NULL : out, &ir);
            if (st >= 0 && onnx) st = kpl_onnx_export(ir, out);
            if (st >= 0) {
                kpl_exec *ex = NULL;
                kpl_exec_stats es = {0};
                if (kpl_exec_create(ir, &ex) == KPL_OK) es = kpl_exec_get_stats(ex);
                kpl_exec_destroy(ex);
                printf("{\"event\":\"exported\",\"model\":\"%s\",\"file\":\"%s\",\"format\":\"%s\","
                       "\"nodes\":%d,\"level\":%lld,\"batch\":%lld,\"arena_bytes\":%zu}\n",
                       r->model.name, out, format, kpl_ir_num_nodes(ir), level, batch,
                       es.arena_bytes);
            }
            kpl_ir_destroy(ir);
        }
        if (st < 0) {
            fprintf(stderr, "kpl %s: %s\n", cmd, kpl_last_error());
            rc = st == KPL_EINVAL || st == KPL_ENOTFOUND ? 2 : 1;
        }
        kpl_trainer_destroy(t);
        kpl__console_end(&con);
    }
    free(r);
out:
    args_free(&A);
    return rc;
}

int kpl__cmd_export(int argc, char **argv) { return export_or_graph(false, argc, argv); }
int kpl__cmd_graph(int argc, char **argv) { return export_or_graph(true, argc, argv); }
