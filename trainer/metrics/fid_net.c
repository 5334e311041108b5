/*
 * fid_net.c — the feature network of FID and the Inception Score (fid.h,
 * docs/fid.md): a classifier of the zoo with a checkpoint's weights, cut
 * before its last linear layer; and the stand-in made on first use by a
 * `kpl train` child that one process of a job runs while the others wait.
 */
#define _GNU_SOURCE
#include "run_impl.h"
#include "fid.h"

#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <ftw.h>
#include <limits.h>
#include <sched.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

extern char **environ;

struct kpl_feature_net {
    kpl_module *model;   /* a sequential: body children, then the head */
    kpl_module *head;    /* its last child, a linear layer */
    int nbody;
    kpl_device *dev;
    int64_t chw[3];      /* the model's input */
    kpl_tensor *mean, *std; /* (1, C, 1, 1) f32 on dev: the recipe's validation mean/std */
    int64_t dim, classes;
    char id[PATH_MAX + 64];
};

/* ---- building it ------------------------------------------------------------------------- */

/* The model's input (C, H, W): model.in_channels and input_size, else the
 * evaluation split's transform, else its stored images (converted first
 * when the recipe says how, as kpl eval does). */
static kpl_status input_shape(const kpl_recipe *r, int64_t *chw)
{
    bool val = r->data.val.path[0] != 0;
    const kpl_recipe_split *s = val ? &r->data.val : &r->data.train;
    const kpl_transform_config *t = &s->loader.transform;
    chw[0] = r->model.in_channels ? r->model.in_channels : t->channels;
    if (r->model.in_h > 0 && r->model.in_w > 0) {
        chw[1] = r->model.in_h, chw[2] = r->model.in_w;
        return KPL_OK;
    }
    if (t->out_h > 0 && t->out_w > 0 && t->crop != KPL_CROP_KEEP_RATIO) {
        chw[1] = t->out_h, chw[2] = t->out_w;
        return KPL_OK;
    }
    KPL_CHECK(s->path[0], KPL_EINVAL, "no model.input_size, and no data split whose images "
              "would give it");
    kpl__runlog quiet;
    memset(&quiet, 0, sizeof quiet);
    KPL_TRY(val ? kpl__data_prepare_val(r, &quiet) : kpl__data_prepare(r, &quiet));
    return val ? kpl__data_val_input_shape(r, chw) : kpl__data_input_shape(r, chw);
}

/* The body/head cut: a sequential whose last child is a linear layer. */
static kpl_status find_head(kpl_feature_net *f, const char *model_name)
{
    kpl_module *m = f->model;
    int n = kpl_module_num_children(m);
    kpl_module *last = n > 0 ? kpl_module_child(m, n - 1) : NULL;
    const char *kind = kpl_module_kind_of(m)->name;
    const char *last_kind = last ? kpl_module_kind_of(last)->name : "nothing";
    KPL_CHECK(!strcmp(kind, "sequential") && n >= 2 && !strcmp(last_kind, "linear"), KPL_EINVAL,
              "model '%s' is a %s of %d children ending in %s, not a sequential ending in a "
              "linear layer (supported: the zoo's mlp, lenet, cnn, and resnet with "
              "num_classes > 0)", model_name, kind, n, last_kind);
    kpl_tensor *w = kpl_module_get_param(last, "weight"); /* (classes, dim) */
    KPL_CHECK(w && kpl_tensor_ndim(w) == 2, KPL_EINVAL, "model '%s': its last layer '%s' has no "
              "2-d weight", model_name, kpl_module_name(last));
    f->head = last;
    f->nbody = n - 1;
    f->classes = kpl_tensor_shape(w)[0];
    f->dim = kpl_tensor_shape(w)[1];
    return KPL_OK;
}

/* "<file name> crc32c <hex> dim <dim>" of the checkpoint's bytes. */
static kpl_status make_id(kpl_feature_net *f, const char *path)
{
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    KPL_CHECK(fd >= 0, KPL_EIO, "%s: cannot open: %s", path, strerror(errno));
    enum { BUF = 1 << 20 };
    unsigned char *buf = malloc(BUF);
    uint32_t crc = 0;
    ssize_t r = -1;
    while (buf && ((r = read(fd, buf, BUF)) > 0 || (r < 0 && errno == EINTR)))
        if (r > 0) crc = kpl_crc32c(crc, buf, (size_t)r);
    int e = buf ? errno : ENOMEM;
    close(fd);
    free(buf);
    KPL_CHECK(r == 0, KPL_EIO, "%s: read failed: %s", path, strerror(e));
    const char *base = strrchr(path, '/');
    snprintf(f->id, sizeof f->id, "%s crc32c %08x dim %lld", base ? base + 1 : path, crc,
             (long long)f->dim);
    return KPL_OK;
}

static kpl_status norm_tensors(kpl_feature_net *f, const kpl_transform_config *t)
{
    int64_t c = f->chw[0], shape[4] = {1, c, 1, 1};
    KPL_CHECK(c >= 1 && c <= 3, KPL_EINVAL, "the model takes %lld channels (1 or 3 here)",
              (long long)c);
    float mean[3], std[3];
    for (int64_t i = 0; i < c; i++) {
        mean[i] = t->mean[c == 1 ? 0 : i];
        std[i] = t->std[c == 1 ? 0 : i];
        KPL_CHECK(std[i] > 0, KPL_EINVAL, "the validation transform's std %g is not > 0",
                  (double)std[i]);
    }
    KPL_TRY(kpl_tensor_from_data(f->dev, KPL_F32, 4, shape, mean, &f->mean));
    return kpl_tensor_from_data(f->dev, KPL_F32, 4, shape, std, &f->std);
}

kpl_status kpl_feature_net_create(const char *recipe_path, const char *checkpoint_path,
                                  kpl_device *dev, kpl_feature_net **out)
{
    return kpl_feature_net_create_with(recipe_path, 0, NULL, checkpoint_path, dev, out);
}

kpl_status kpl_feature_net_create_with(const char *recipe_path, int noverrides,
                                       const char *const *overrides,
                                       const char *checkpoint_path, kpl_device *dev,
                                       kpl_feature_net **out)
{
    KPL_CHECK(recipe_path && checkpoint_path && out && (noverrides == 0 || overrides),
              KPL_EINVAL, "feature_net_create: NULL argument");
    *out = NULL;
    kpl_status st = KPL_OK;
    kpl_recipe *r = malloc(sizeof *r);
    kpl_feature_net *f = calloc(1, sizeof *f);
    kpl_checkpoint *c = NULL;
    if (!r || !f) {
        st = KPL_ERROR(KPL_ENOMEM, "feature_net_create: out of memory");
        goto fail;
    }
    f->dev = dev ? dev : kpl_device_cpu();
    KPL_TRY_GOTO(kpl_recipe_load(recipe_path, noverrides, overrides, r));
    if ((st = input_shape(r, f->chw)) < 0) {
        st = kpl_error_prefix(st, "feature network: the input size of %s's model: ",
                               recipe_path);
        goto fail;
    }
    kpl_model_config mc = r->model;
    mc.in_channels = f->chw[0], mc.in_h = f->chw[1], mc.in_w = f->chw[2];
    st = kpl_zoo_create(&mc, f->dev, (uint64_t)r->seed, &f->model);
    if (st >= 0) st = find_head(f, mc.name);
    if (st >= 0) st = norm_tensors(f, &(r->data.val.path[0] ? &r->data.val : &r->data.train)
                                            ->loader.transform);
    if (st < 0) {
        st = kpl_error_prefix(st, "feature network of %s: ", recipe_path);
        goto fail;
    }
    KPL_TRY_GOTO(kpl_checkpoint_load(checkpoint_path, &c));
    if ((st = kpl__weights_check(c, checkpoint_path)) < 0) {
        st = kpl_error_prefix(st, "feature network: ");
        goto fail;
    }
    if ((st = kpl_module_state_load(f->model, c, "model.", true, NULL)) < 0) {
        st = kpl_error_prefix(st, "feature network: %s does not hold the weights of %s's model "
                               "(%s): ", checkpoint_path, recipe_path, mc.name);
        goto fail;
    }
    KPL_TRY_GOTO(make_id(f, checkpoint_path));
    kpl_module_set_training(f->model, false);
    kpl_checkpoint_destroy(c);
    free(r);
    *out = f;
    return KPL_OK;
fail:
    kpl_checkpoint_destroy(c);
    kpl_feature_net_destroy(f);
    free(r);
    return st;
}

void kpl_feature_net_destroy(kpl_feature_net *f)
{
    if (!f) return;
    kpl_module_destroy(f->model);
    kpl_tensor_release(f->mean);
    kpl_tensor_release(f->std);
    free(f);
}

int64_t kpl_feature_net_dim(const kpl_feature_net *f) { return f ? f->dim : 0; }
int64_t kpl_feature_net_classes(const kpl_feature_net *f) { return f ? f->classes : 0; }
const int64_t *kpl_feature_net_input_shape(const kpl_feature_net *f) { return f ? f->chw : NULL; }
const char *kpl_feature_net_id(const kpl_feature_net *f) { return f ? f->id : ""; }
kpl_module *kpl_feature_net_model(kpl_feature_net *f) { return f ? f->model : NULL; }

/* ---- running it ------------------------------------------------------------------------- */

/* (N, C, H, W) in [0, 1] -> the model's normalised input. */
static kpl_tensor *prepare(kpl_feature_net *f, kpl_tensor *images)
{
    const int64_t *s = kpl_tensor_shape(images);
    kpl_tensor *x = images;
    if (kpl_tensor_device(x) != f->dev) x = kpl_to_device(x, f->dev);
    if (s[1] == 1 && f->chw[0] == 3) {
        int64_t to[4] = {s[0], 3, s[2], s[3]};
        x = kpl_expand(x, 4, to);
    } else if (s[1] == 3 && f->chw[0] == 1) {
        int axis = 1;
        x = kpl_mean(x, &axis, 1, true);
    }
    if (s[2] != f->chw[1] || s[3] != f->chw[2])
        x = kpl_upsample_bilinear(x, f->chw[1], f->chw[2], false);
    return kpl_div(kpl_sub(x, f->mean), f->std);
}

kpl_status kpl_feature_net_run(kpl_feature_net *f, kpl_tensor *images, kpl_tensor **features,
                               kpl_tensor **probs)
{
    if (features) *features = NULL;
    if (probs) *probs = NULL;
    KPL_CHECK(f && images, KPL_EINVAL, "feature_net_run: NULL argument");
    const int64_t *s = kpl_tensor_shape(images);
    int nd = kpl_tensor_ndim(images);
    KPL_CHECK(nd == 4 && kpl_tensor_dtype(images) == KPL_F32, KPL_EINVAL,
              "feature_net_run: images must be (N, C, H, W) f32 in [0, 1], got a %d-d %s tensor",
              nd, kpl_dtype_name(kpl_tensor_dtype(images)));
    KPL_CHECK(s[0] >= 1 && s[2] >= 1 && s[3] >= 1 &&
                  (s[1] == f->chw[0] || s[1] == 1 || s[1] == 3),
              KPL_EINVAL, "feature_net_run: images (%lld, %lld, %lld, %lld): want N >= 1 and 1, "
              "3 or %lld channels (the network takes (%lld, %lld, %lld))", (long long)s[0],
              (long long)s[1], (long long)s[2], (long long)s[3], (long long)f->chw[0],
              (long long)f->chw[0], (long long)f->chw[1], (long long)f->chw[2]);
    bool grad = kpl_set_grad_enabled(false);
    kpl_module_set_training(f->model, false);
    kpl_tensor *x = prepare(f, images);
    for (int i = 0; i < f->nbody; i++) x = kpl_module_forward(kpl_module_child(f->model, i), x);
    kpl_tensor *p = probs && x ? kpl_softmax(kpl_module_forward(f->head, x), 1) : NULL;
    kpl_set_grad_enabled(grad);
    if (!x || (probs && !p)) return kpl_error_prefix(kpl_last_status(), "feature network: ");
    KPL_CHECK(kpl_tensor_ndim(x) == 2 && kpl_tensor_shape(x)[1] == f->dim, KPL_ESHAPE,
              "feature network: its body gives a %d-d tensor, not (N, %lld) features",
              kpl_tensor_ndim(x), (long long)f->dim);
    if (features) *features = x;
    if (probs) *probs = p;
    return KPL_OK;
}

/* ---- making the stand-in ---------------------------------------------------------------- */

typedef struct {
    const kpl_feature_net_ensure_options *o;
    const char *ckpt;
} ensure_ctx;

static void say(const ensure_ctx *e, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void say(const ensure_ctx *e, const char *fmt, ...)
{
    if (!e->o->log) return;
    char line[2048];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(line, sizeof line, fmt, ap);
    va_end(ap);
    e->o->log(e->o->log_ctx, line);
}

static bool exists(const char *path)
{
    struct stat sb;
    return stat(path, &sb) == 0;
}

static bool executable(const char *path)
{
    struct stat sb;
    return stat(path, &sb) == 0 && S_ISREG(sb.st_mode) && access(path, X_OK) == 0;
}

/* dir/rel into out when it is an executable file. */
static bool try_exe(char *out, size_t len, const char *dir, const char *rel)
{
    char p[PATH_MAX];
    if (snprintf(p, sizeof p, "%s/%s", dir, rel) >= (int)sizeof p || !executable(p)) return false;
    return realpath(p, out) != NULL && strlen(out) < len;
}

/* The kpl command: this program when it is kpl; beside the library (or
 * the program) that holds this code, or in a bin/ next to its lib/; beside
 * the program; on PATH. */
static kpl_status find_kpl(const char *given, char *out, size_t len)
{
    if (given) {
        KPL_CHECK(executable(given) && realpath(given, out), KPL_ENOTFOUND,
                  "fid: the kpl command %s is not an executable file", given);
        return KPL_OK;
    }
    char self[PATH_MAX];
    ssize_t n = readlink("/proc/self/exe", self, sizeof self - 1);
    self[n > 0 ? n : 0] = 0;
    const char *base = strrchr(self, '/');
    if (n > 0 && base && !strcmp(base + 1, "kpl")) {
        snprintf(out, len, "%s", self);
        return KPL_OK;
    }
    Dl_info info;
    char dir[PATH_MAX];
    if (dladdr((void *)kpl_feature_net_ensure_opts, &info) && info.dli_fname &&
        realpath(info.dli_fname, dir)) {
        char *slash = strrchr(dir, '/');
        if (slash) *slash = 0;
        if (try_exe(out, len, dir, "kpl") || try_exe(out, len, dir, "../bin/kpl") ||
            try_exe(out, len, dir, "../../bin/kpl"))
            return KPL_OK;
    }
    if (n > 0 && base) {
        snprintf(dir, sizeof dir, "%.*s", (int)(base - self), self);
        if (try_exe(out, len, dir, "kpl")) return KPL_OK;
    }
    const char *path = getenv("PATH");
    while (path && *path) {
        const char *end = strchr(path, ':');
        size_t l = end ? (size_t)(end - path) : strlen(path);
        snprintf(dir, sizeof dir, "%.*s", (int)l, l ? path : ".");
        if (try_exe(out, len, dir, "kpl")) return KPL_OK;
        path = end ? end + 1 : NULL;
    }
    return KPL_ERROR(KPL_ENOTFOUND, "fid: no kpl command to train the feature network with "
                     "(not this program, not beside %s, not on PATH): make it with `kpl data "
                     "fid-net`, or say where kpl is (kpl_feature_net_ensure_options.kpl_path)",
                     n > 0 ? self : "the program");
}

static int rm_entry(const char *path, const struct stat *sb, int flag, struct FTW *ftw)
{
    (void)sb, (void)flag, (void)ftw;
    return remove(path) != 0 && errno != ENOENT ? -1 : 0;
}

/* rm -rf dir */
static kpl_status remove_tree(const char *dir)
{
    if (!exists(dir)) return KPL_OK;
    KPL_CHECK(nftw(dir, rm_entry, 16, FTW_DEPTH | FTW_PHYS) == 0, KPL_EIO,
              "fid: cannot remove %s: %s", dir, strerror(errno));
    return KPL_OK;
}

/* Whether an environment entry belongs to the launcher of the caller's
 * job (mpirun, PMIx, MPICH/Hydra, srun, kplrun), or sets its threads per
 * rank: the training is a job of one process on every core. */
static bool launcher_var(const char *e)
{
    static const char *const prefixes[] = {"OMPI_", "PMIX_", "PMI_", "HYDRA_", "MPI_LOCAL",
                                           "SLURM_", "KPL_RANK=", "KPL_WORLD_SIZE=",
                                           "KPL_LOCAL_", "KPL_PROGRESS=", "OMP_NUM_THREADS=",
                                           NULL};
    for (int i = 0; prefixes[i]; i++)
        if (!strncmp(e, prefixes[i], strlen(prefixes[i]))) return true;
    return false;
}

typedef struct {
    char **argv, **envp;
    int log_fd, null_fd;
    pid_t parent;
    cpu_set_t cpus;
    sigset_t no_signals;
} child_plan;

/* In the child between fork and exec: async-signal-safe calls only (the
 * parent may have threads, whose locks the child inherits held). */
static void child_exec(const child_plan *p)
{
    setpgid(0, 0); /* the caller's terminal and scheduler signal the caller, which forwards */
    prctl(PR_SET_PDEATHSIG, SIGTERM);
    if (getppid() != p->parent) _exit(126); /* the caller died before the line above */
    sched_setaffinity(0, sizeof p->cpus, &p->cpus); /* mpirun bound the caller to its cores */
    sigprocmask(SIG_SETMASK, &p->no_signals, NULL); /* a mask survives exec: SIGTERM must reach it */
    dup2(p->null_fd, 0);
    dup2(p->log_fd, 1);
    dup2(p->log_fd, 2);
    execve(p->argv[0], p->argv, p->envp);
    static const char msg[] = "fid: cannot run the kpl command (execve failed)\n";
    ssize_t w = write(2, msg, sizeof msg - 1);
    (void)w;
    _exit(127);
}

/* The last non-empty line of the log, for an error message. */
static void last_line(const char *log, char *buf, size_t len)
{
    buf[0] = 0;
    FILE *f = fopen(log, "r");
    char line[1024];
    while (f && fgets(line, sizeof line, f)) {
        line[strcspn(line, "\r\n")] = 0;
        if (line[0]) snprintf(buf, len, "%.500s", line);
    }
    if (f) fclose(f);
}

/* Runs the training to its end (or a stop) and waits for it. */
static kpl_status run_training(const ensure_ctx *e, child_plan *plan, const char *log,
                               int *status)
{
    pid_t pid = fork();
    KPL_CHECK(pid >= 0, KPL_EIO, "fid: fork failed: %s", strerror(errno));
    if (pid == 0) child_exec(plan);
    double t0 = kpl_seconds(), said = 0, termed = 0;
    for (;;) {
        pid_t w = waitpid(pid, status, WNOHANG);
        if (w == pid) break;
        if (w < 0 && errno != EINTR) return KPL_ERROR(KPL_ECHILD, "fid: waitpid: %s", strerror(errno));
        double now = kpl_seconds() - t0;
        if (kpl_stop_requested() && !termed) {
            say(e, "fid: stopping the training of %s (a stop was asked)", e->ckpt);
            kill(pid, SIGTERM);
            termed = now;
        } else if (termed && now - termed > 60) {
            kill(pid, SIGKILL); /* a stop that does not end is ended */
        }
        if (now - said >= 60) {
            say(e, "fid: still training %s (%.0f s; log: %s)", e->ckpt, now, log);
            said = now;
        }
        usleep(100 * 1000);
    }
    return termed ? KPL_ERROR(KPL_ECANCELED, "fid: the training of %s was stopped on request",
                              e->ckpt)
                  : KPL_OK;
}

/* Trains into dir/checkpoints with the lock held, then renames the final
 * checkpoint to e->ckpt. */
static kpl_status train(const ensure_ctx *e, const char *recipe, const char *dir,
                        const char *log)
{
    const kpl_feature_net_ensure_options *o = e->o;
    char kpl[PATH_MAX], run_dir[PATH_MAX + 16];
    KPL_TRY(find_kpl(o->kpl_path, kpl, sizeof kpl));
    KPL_TRY(remove_tree(dir)); /* what a training that died left */
    snprintf(run_dir, sizeof run_dir, "run_dir=%s", dir);
    child_plan plan;
    memset(&plan, 0, sizeof plan);
    plan.parent = getpid();
    memset(&plan.cpus, 0xff, sizeof plan.cpus);
    sigemptyset(&plan.no_signals);
    int nenv = 0;
    while (environ[nenv]) nenv++;
    plan.argv = calloc((size_t)o->noverrides + 8, sizeof *plan.argv);
    plan.envp = calloc((size_t)nenv + 1, sizeof *plan.envp);
    plan.log_fd = open(log, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    plan.null_fd = open("/dev/null", O_RDONLY | O_CLOEXEC);
    kpl_status st = KPL_OK;
    if (!plan.argv || !plan.envp) st = KPL_ERROR(KPL_ENOMEM, "fid: out of memory");
    else if (plan.log_fd < 0 || plan.null_fd < 0)
        st = KPL_ERROR(KPL_EIO, "fid: cannot open %s: %s", plan.log_fd < 0 ? log : "/dev/null",
                       strerror(errno));
    if (st >= 0) {
        int a = 0;
        plan.argv[a++] = kpl;
        plan.argv[a++] = "train";
        plan.argv[a++] = (char *)recipe;
        plan.argv[a++] = run_dir;
        plan.argv[a++] = "log.progress=never";
        for (int i = 0; i < o->noverrides; i++) plan.argv[a++] = (char *)o->overrides[i];
        for (int i = 0, k = 0; i < nenv; i++)
            if (!launcher_var(environ[i])) plan.envp[k++] = environ[i];
        say(e, "fid: training the feature network %s: %s train %s%s (log: %s)", e->ckpt, kpl,
            recipe, o->noverrides ? " with overrides" : "", log);
        double t0 = kpl_seconds();
        int status = 0;
        st = run_training(e, &plan, log, &status);
        char tail[512];
        if (st >= 0 && !(WIFEXITED(status) && WEXITSTATUS(status) == 0)) {
            last_line(log, tail, sizeof tail);
            st = KPL_ERROR(KPL_ECHILD, "fid: training the feature network %s failed (%s %d); "
                           "its log %s ends: %s", e->ckpt,
                           WIFEXITED(status) ? "exit status" : "signal",
                           WIFEXITED(status) ? WEXITSTATUS(status) : WTERMSIG(status), log, tail);
        }
        if (st >= 0) {
            char ckdir[PATH_MAX + 32], src[PATH_MAX + 64];
            int64_t steps[1024];
            int n = 0;
            snprintf(ckdir, sizeof ckdir, "%s/checkpoints", dir);
            st = kpl__checkpoint_list(ckdir, steps, 1024, &n);
            if (st >= 0 && n == 0)
                st = KPL_ERROR(KPL_ECHILD, "fid: the training of %s left no checkpoint in %s "
                               "(log: %s)", e->ckpt, ckdir, log);
            if (st >= 0) {
                kpl__checkpoint_path(ckdir, steps[n - 1], src, sizeof src);
                if (rename(src, e->ckpt) != 0)
                    st = KPL_ERROR(KPL_EIO, "fid: cannot rename %s to %s: %s", src, e->ckpt,
                                   strerror(errno));
            }
            if (st >= 0)
                say(e, "fid: feature network %s made in %.0f s", e->ckpt, kpl_seconds() - t0);
        }
    }
    if (plan.log_fd >= 0) close(plan.log_fd);
    if (plan.null_fd >= 0) close(plan.null_fd);
    free(plan.argv);
    free(plan.envp);
    kpl_status rm = remove_tree(dir);
    return st < 0 ? st : rm;
}

kpl_status kpl_feature_net_ensure(const char *recipe_path, const char *checkpoint_path)
{
    return kpl_feature_net_ensure_opts(recipe_path, checkpoint_path, NULL);
}

kpl_status kpl_feature_net_ensure_opts(const char *recipe_path, const char *checkpoint_path,
                                       const kpl_feature_net_ensure_options *opts)
{
    KPL_CHECK(recipe_path && checkpoint_path && *checkpoint_path, KPL_EINVAL,
              "feature_net_ensure: NULL argument");
    kpl_feature_net_ensure_options defaults = KPL_FEATURE_NET_ENSURE_OPTIONS_INIT;
    const kpl_feature_net_ensure_options *o = opts ? opts : &defaults;
    KPL_CHECK(o->noverrides >= 0 && o->noverrides <= 64 && (o->overrides || !o->noverrides),
              KPL_EINVAL, "feature_net_ensure: %d overrides", o->noverrides);
    if (exists(checkpoint_path)) return KPL_OK;
    ensure_ctx e = {o, checkpoint_path};
    char dir[PATH_MAX], lock[PATH_MAX + 8], run[PATH_MAX + 8], log[PATH_MAX + 8];
    KPL_CHECK(strlen(checkpoint_path) < PATH_MAX, KPL_EINVAL, "fid: path too long: %s",
              checkpoint_path);
    snprintf(dir, sizeof dir, "%s", checkpoint_path);
    char *slash = strrchr(dir, '/');
    if (slash && slash != dir) {
        *slash = 0;
        KPL_TRY(kpl__mkdirs(dir));
    }
    snprintf(lock, sizeof lock, "%s.lock", checkpoint_path);
    snprintf(run, sizeof run, "%s.run", checkpoint_path);
    snprintf(log, sizeof log, "%s.log", checkpoint_path);
    /* One process trains; the others wait for its lock, then find the file. */
    int fd = -1;
    double t0 = kpl_seconds(), said = -1;
    char holder[512], prev[512];
    for (;;) {
        if (exists(checkpoint_path)) return KPL_OK;
        KPL_TRY(kpl__lockfile_try(lock, &fd, holder, sizeof holder, prev, sizeof prev));
        if (fd >= 0) break;
        double waited = kpl_seconds() - t0;
        if (said < 0 || waited - said >= 60) {
            say(&e, "fid: waiting for %s to finish making %s (%.0f s so far)", holder,
                checkpoint_path, waited);
            said = waited;
        }
        KPL_CHECK(!kpl_stop_requested(), KPL_ECANCELED, "fid: stopped while waiting for %s to "
                  "make %s", holder, checkpoint_path);
        usleep(200 * 1000);
    }
    kpl_status st = KPL_OK;
    if (!exists(checkpoint_path)) { /* the holder before may have made it */
        if (prev[0]) say(&e, "fid: a training of %s (%s) ended without it; starting again",
                         checkpoint_path, prev);
        st = train(&e, recipe_path, run, log);
    }
    if (exists(checkpoint_path)) unlink(lock); /* nobody needs it now */
    kpl__lockfile_release(fd);
    return st;
}
