/*
 * fuzz_recipe.c — recipes (trainer/io/recipe*.c): YAML through libyaml into
 * kpl's tree, `base:` chains, KEY=VALUE overrides, binding with every check,
 * then kpl_recipe_to_yaml of what loaded, which must load again to the very
 * same kpl_recipe (the resolved config.yaml of every run relies on it).
 *
 * Input: the recipe's text, optionally followed by a line "#--" and up to
 * eight overrides, one per line:
 *   epochs: 3
 *   model: {name: mlp, num_classes: 10}
 *   ...
 *   #--
 *   optimizer.lr=0.2
 *   data.train.transform.size=[32, 32]
 *
 * `base:` paths resolve inside the harness's scratch directory only: the
 * harness links with -Wl,--wrap=stat,--wrap=open, and the wrappers below
 * map relative paths there and refuse absolute ones elsewhere while kpl
 * loads (kpl judges a recipe file by stat, then opens it), so no input
 * reads the machine's files.  The directory
 * holds base.yaml (a whole recipe), part.yaml (based on base.yaml),
 * loop.yaml (based on itself) and bad.yaml (a syntax error).
 */
#include "fuzz_common.h"

#include "trainer.h"

#include <stdarg.h>

#define SEP "\n#--\n"
#define MAX_OVERRIDES 8

int __real_stat(const char *path, struct stat *sb);
int __wrap_stat(const char *path, struct stat *sb);
int __real_open(const char *path, int flags, ...);
int __wrap_open(const char *path, int flags, ...);

/* Set while kpl reads a recipe: libFuzzer's own calls (corpus,
 * artifacts) pass through untouched. */
static bool in_kpl;

/* path inside the scratch directory into p[PATH_MAX]; false (errno set)
 * for a path elsewhere. */
static bool sandboxed(const char *path, char *p)
{
    const char *root = fuzz_dir("recipe");
    size_t rl = strlen(root);
    if (path[0] == '/') {
        if (strncmp(path, root, rl) || (path[rl] && path[rl] != '/')) {
            errno = ENOENT;
            return false;
        }
        snprintf(p, PATH_MAX, "%s", path);
    } else if (snprintf(p, PATH_MAX, "%s/%s", root, path) >= PATH_MAX) {
        errno = ENAMETOOLONG;
        return false;
    }
    if (strstr(p, "..")) { /* stay inside */
        errno = ENOENT;
        return false;
    }
    return true;
}

int __wrap_stat(const char *path, struct stat *sb)
{
    if (!in_kpl) return __real_stat(path, sb);
    char p[PATH_MAX];
    return sandboxed(path, p) ? __real_stat(p, sb) : -1;
}

int __wrap_open(const char *path, int flags, ...)
{
    mode_t mode = 0;
    if (flags & O_CREAT) {
        va_list ap;
        va_start(ap, flags);
        mode = (mode_t)va_arg(ap, int);
        va_end(ap);
    }
    if (!in_kpl) return __real_open(path, flags, mode);
    char p[PATH_MAX];
    return sandboxed(path, p) ? __real_open(p, flags, mode) : -1;
}

static const char base_yaml[] =
    "name: base\n"
    "epochs: 2\n"
    "model: {name: cnn, num_classes: 10}\n"
    "data:\n"
    "  root: data\n"
    "  train: {path: train, batch_size: 32, transform: {crop: random_resized, size: [24, 24]}}\n"
    "  val: {path: val}\n"
    "optimizer: {name: sgd, lr: 0.1, momentum: 0.9, nesterov: true}\n"
    "schedule: {name: multistep, milestones: [1, 1.5]}\n";
static const char part_yaml[] =
    "base: base.yaml\n"
    "epochs: 3\n"
    "optimizer:\n"
    "  lr: 0.05\n";
static const char loop_yaml[] = "base: loop.yaml\nepochs: 1\n";
static const char bad_yaml[] = "model: {name: [\n";

static void setup(void)
{
    static bool done;
    if (done) return;
    done = true;
    const char *root = fuzz_dir("recipe");
    const struct {
        const char *name, *text;
    } files[] = {{"base.yaml", base_yaml}, {"part.yaml", part_yaml}, {"loop.yaml", loop_yaml},
                 {"bad.yaml", bad_yaml}};
    for (size_t i = 0; i < sizeof files / sizeof files[0]; i++) {
        char p[PATH_MAX];
        fuzz_path(p, root, files[i].name);
        fuzz_write(p, files[i].text, strlen(files[i].text));
    }
}

/* Where two recipes differ, for the report of a failed round trip. */
static void report(const kpl_recipe *a, const kpl_recipe *b, const char *yaml)
{
    const uint8_t *x = (const uint8_t *)a, *y = (const uint8_t *)b;
    for (size_t i = 0; i < sizeof *a; i++)
        if (x[i] != y[i]) {
            fprintf(stderr, "fuzz_recipe: the reloaded recipe differs at byte %zu of %zu\n", i,
                    sizeof *a);
            break;
        }
    fprintf(stderr, "--- kpl_recipe_to_yaml gave:\n%s---\n", yaml);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    setup();
    fuzz_reset();
    fuzz_part parts[1 + MAX_OVERRIDES];
    int np = fuzz_split(data, size, SEP, strlen(SEP), parts, 2);
    char *yaml = fuzz_strndup(parts[0].p, parts[0].n);
    char *ov_text = np > 1 ? fuzz_strndup(parts[1].p, parts[1].n) : NULL;
    const char *ov[MAX_OVERRIDES];
    int nov = 0;
    for (char *s = ov_text, *nl; s && *s && nov < MAX_OVERRIDES; s = nl ? nl + 1 : NULL) {
        nl = strchr(s, '\n');
        if (nl) *nl = 0;
        ov[nov++] = s;
    }

    kpl_recipe *r = malloc(sizeof *r), *r2 = malloc(sizeof *r2);
    if (!r || !r2) abort();
    in_kpl = true;
    kpl_status st = kpl_recipe_load_string(yaml, "fuzz.yaml", nov, ov, r);
    in_kpl = false;
    if (fuzz_st(st, "load") == KPL_OK) {
        char *out = NULL;
        if (kpl_recipe_to_yaml(r, &out) != KPL_OK) {
            fprintf(stderr, "fuzz_recipe: to_yaml failed: %s\n", kpl_last_error());
            abort();
        }
        if (kpl_recipe_load_string(out, "resolved", 0, NULL, r2) != KPL_OK) {
            fprintf(stderr, "fuzz_recipe: the resolved recipe does not load: %s\n",
                    kpl_last_error());
            report(r, r, out);
            abort();
        }
        /* The second load names no file and an explicit name: compare
         * everything else. */
        memcpy(r2->file, r->file, sizeof r->file);
        if (memcmp(r, r2, sizeof *r)) {
            report(r, r2, out);
            abort();
        }
        free(out);
    }
    free(r);
    free(r2);
    free(yaml);
    free(ov_text);
    return 0;
}
