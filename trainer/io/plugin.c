/*
 * plugin.c — registries of named things, the three a recipe names its
 * owners from (tasks, zoo models, optimizer rules: kpl__owners), and the
 * plugins that add to them: shared libraries whose constructors register
 * their items, loaded with dlopen by `kpl train --plugin` or a recipe's
 * `plugins:` key.  The rooms above fill the owners' built-ins from
 * constructors of their own; nothing here calls up into them.
 *
 * A plugin's constructors run inside dlopen, before kpl can know which
 * kpl it was built against; so what they register waits (its structs
 * unread) until the plugin's kpl_plugin_abi_version is checked, and is
 * then added, or dropped with the plugin.  Registration happens at
 * start-up on one thread; nothing here locks.
 */
#define _GNU_SOURCE
#include "io_impl.h"

#include <dlfcn.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static const char *name_of(const void *item) { return *(const char *const *)item; }

int kpl__registry_count(const kpl__registry *r)
{
    int n = 0;
    while (r->builtin && r->builtin[n]) n++;
    return n + r->n;
}

const void *kpl__registry_at(const kpl__registry *r, int i)
{
    int nb = kpl__registry_count(r) - r->n;
    if (i < 0 || i >= nb + r->n) return NULL;
    return i < nb ? r->builtin[i] : r->items[i - nb];
}

static int index_of(const kpl__registry *r, const char *name)
{
    for (int i = 0; name && i < kpl__registry_count(r); i++)
        if (!strcmp(name_of(kpl__registry_at(r, i)), name)) return i;
    return -1;
}

const void *kpl__registry_find(const kpl__registry *r, const char *name)
{
    int i = index_of(r, name);
    return i < 0 ? NULL : kpl__registry_at(r, i);
}

void kpl__registry_names(const kpl__registry *r, char *buf, size_t len)
{
    size_t at = 0;
    if (len) buf[0] = 0;
    for (int i = 0; i < kpl__registry_count(r) && at < len; i++)
        at += (size_t)snprintf(buf + at, len - at, "%s%s", i ? ", " : "",
                               name_of(kpl__registry_at(r, i)));
}

/* Where an item came from, for messages: "plugin P" or "kpl". */
static const char *origin(const kpl__registry *r, int i, char *buf, size_t len)
{
    int nb = kpl__registry_count(r) - r->n;
    const char *from = i >= nb ? r->from[i - nb] : NULL;
    if (from) snprintf(buf, len, "plugin %s", from);
    else snprintf(buf, len, i < nb ? "kpl itself" : "the program");
    return buf;
}

static kpl_status commit(kpl__registry *r, const void *item, const char *from)
{
    const char *name = name_of(item);
    KPL_CHECK(name && *name && strlen(name) < 64, KPL_EINVAL,
              "a %s needs a name of 1 to 63 bytes (registered by %s)", r->what,
              from ? from : "the program");
    for (const char *c = name; *c; c++)
        KPL_CHECK((*c >= 'a' && *c <= 'z') || (*c >= '0' && *c <= '9') || *c == '_' ||
                      *c == '-',
                  KPL_EINVAL, "%s name '%s' (registered by %s): use a-z, 0-9, _ and -", r->what,
                  name, from ? from : "the program");
    if (r->keys) {
        char section[96];
        snprintf(section, sizeof section, "%s.%s", r->what, name);
        kpl_status st = kpl__keys_declared_ok(r->keys(item), section);
        if (st < 0) return kpl_error_prefix(st, "%s '%s' (registered by %s): ", r->what, name,
                                             from ? from : "the program");
    }
    int i = index_of(r, name);
    if (i >= 0) {
        char had[PATH_MAX + 16];
        return KPL_ERROR(KPL_EINVAL, "%s '%s' is registered twice: by %s and by %s%s", r->what,
                         name, origin(r, i, had, sizeof had), from ? "plugin " : "",
                         from ? from : "the program");
    }
    if (r->check) {
        kpl_status st = r->check(item);
        if (st < 0) return kpl_error_prefix(st, "%s '%s' (registered by %s): ", r->what, name,
                                             from ? from : "the program");
    }
    if (r->n == r->cap) {
        int cap = r->cap ? 2 * r->cap : 8;
        const void **items = realloc(r->items, (size_t)cap * sizeof *items);
        KPL_CHECK(items, KPL_ENOMEM, "out of memory");
        r->items = items;
        const char **f = realloc(r->from, (size_t)cap * sizeof *f);
        KPL_CHECK(f, KPL_ENOMEM, "out of memory");
        r->from = f;
        r->cap = cap;
    }
    r->items[r->n] = item;
    r->from[r->n++] = from;
    return KPL_OK;
}

/* ---- plugins ------------------------------------------------------------------------------ */

#define MAX_PLUGINS 32
#define MAX_PENDING 256

static struct {
    bool active;
    int n;
    kpl__registry *reg[MAX_PENDING];
    const void *item[MAX_PENDING];
    bool overflow;
} loading;

static struct {
    char *path; /* as resolved (realpath), owned */
    void *handle;
} plugins[MAX_PLUGINS];
static int nplugins;

kpl_status kpl__registry_add(kpl__registry *r, const void *item)
{
    KPL_CHECK(r && item, KPL_EINVAL, "register: NULL item");
    if (!loading.active) return commit(r, item, NULL);
    if (loading.n == MAX_PENDING) {
        loading.overflow = true;
        return KPL_ERROR(KPL_ERANGE, "a plugin may register at most %d items", MAX_PENDING);
    }
    loading.reg[loading.n] = r, loading.item[loading.n++] = item;
    return KPL_OK;
}

/* Takes back the items a failed plugin had added (the last `n` of each
 * registry they went to). */
static void rollback(int n)
{
    for (int k = n - 1; k >= 0; k--) loading.reg[k]->n--;
}

kpl_status kpl_plugin_load(const char *path)
{
    KPL_CHECK(path && *path, KPL_EINVAL, "plugin: no path");
    char real[PATH_MAX];
    KPL_CHECK(realpath(path, real), KPL_ENOTFOUND, "plugin %s: cannot load: no such file",
              path);
    for (int i = 0; i < nplugins; i++)
        if (!strcmp(plugins[i].path, real)) return KPL_OK; /* loaded once */
    KPL_CHECK(nplugins < MAX_PLUGINS, KPL_ERANGE, "plugin %s: at most %d plugins", path,
              MAX_PLUGINS);
    loading.active = true, loading.n = 0, loading.overflow = false;
    dlerror();
    void *h = dlopen(real, RTLD_NOW | RTLD_LOCAL);
    loading.active = false;
    if (!h) {
        const char *why = dlerror();
        return KPL_ERROR(KPL_EIO, "plugin %s: cannot load: %s", path, why ? why : "dlopen failed");
    }
    kpl_status st = KPL_OK;
    const int *abi = dlsym(h, "kpl_plugin_abi_version");
    if (!abi) {
        st = KPL_ERROR(KPL_EFORMAT, "plugin %s: not a kpl plugin (it defines no "
                       "kpl_plugin_abi_version: put KPL_PLUGIN_ABI; in one of its files)", path);
    } else if (*abi != KPL_ABI_VERSION) {
        st = KPL_ERROR(KPL_EFORMAT, "plugin %s was built against kpl ABI %d, this kpl is ABI %d: "
                       "rebuild it against this kpl's headers", path, *abi, KPL_ABI_VERSION);
    } else if (loading.overflow) {
        st = KPL_ERROR(KPL_ERANGE, "plugin %s registers more than %d items", path, MAX_PENDING);
    }
    char *keep = st < 0 ? NULL : strdup(real);
    if (st >= 0 && !keep) st = KPL_ERROR(KPL_ENOMEM, "out of memory");
    int done = 0;
    for (; st >= 0 && done < loading.n; done++) {
        st = commit(loading.reg[done], loading.item[done], keep);
        if (st < 0) kpl_error_prefix(st, "plugin %s: ", path);
    }
    if (st < 0) {
        rollback(done > 0 ? done - 1 : 0); /* the items before the failed one */
        loading.n = 0;
        free(keep);
        dlclose(h);
        return st;
    }
    loading.n = 0;
    plugins[nplugins].path = keep;
    plugins[nplugins++].handle = h;
    return KPL_OK;
}

int kpl_plugin_count(void) { return nplugins; }
const char *kpl_plugin_path(int i) { return i >= 0 && i < nplugins ? plugins[i].path : NULL; }

/* ---- the owners recipes name --------------------------------------------------------- */

static const kpl_key *task_keys(const void *k) { return ((const kpl_task_kind *)k)->keys; }
static const kpl_key *model_keys(const void *m) { return ((const kpl_zoo_model *)m)->keys; }
static const kpl_key *rule_keys(const void *r) { return ((const kpl_optim_rule *)r)->keys; }

/* What task.h requires of a task's table, and needs naming kpl's keys:
 * refused at registration rather than failing every recipe later. */
static kpl_status check_task(const void *item)
{
    const kpl_task_kind *k = item;
    static const char *const fns[] = {"create", "destroy", "eval_begin", "eval_batch",
                                      "eval_end"};
    const bool have[] = {k->create, k->destroy, k->eval_begin, k->eval_batch, k->eval_end};
    for (size_t i = 0; i < sizeof fns / sizeof *fns; i++)
        KPL_CHECK(have[i], KPL_EINVAL, "no %s function (task.h: every member but the optional "
                  "ones is required)", fns[i]);
    KPL_CHECK(k->train_step || k->train_batch, KPL_EINVAL,
              "neither train_step nor train_batch (one is required)");
    KPL_CHECK(k->best_metric && *k->best_metric, KPL_EINVAL,
              "no best_metric (the figure that selects best.kpl)");
    for (const char *const *n = k->needs; n && *n; n++)
        KPL_CHECK(kpl__rc_is_field(*n), KPL_EINVAL,
                  "needs '%s', which is not one of kpl's recipe keys (kpl train --keys lists "
                  "them)", *n);
    return KPL_OK;
}

kpl__registry kpl__owners[KPL__OWN_KINDS] = {
    [KPL__OWN_TASK] = {.what = "task", .keys = task_keys, .check = check_task},
    [KPL__OWN_MODEL] = {.what = "model", .keys = model_keys},
    [KPL__OWN_OPTIM] = {.what = "optimizer", .keys = rule_keys},
};

void kpl__owners_builtin(kpl__owner_kind kind, const void *const *builtin)
{
    if (kind >= 0 && kind < KPL__OWN_KINDS && !kpl__owners[kind].builtin)
        kpl__owners[kind].builtin = builtin;
}

void kpl__task_names(char *buf, size_t len)
{
    kpl__registry_names(&kpl__owners[KPL__OWN_TASK], buf, len);
}
void kpl__zoo_names(char *buf, size_t len)
{
    kpl__registry_names(&kpl__owners[KPL__OWN_MODEL], buf, len);
}
void kpl__optim_names(char *buf, size_t len)
{
    kpl__registry_names(&kpl__owners[KPL__OWN_OPTIM], buf, len);
}

void kpl__plugin_list(char *buf, size_t len)
{
    size_t at = 0;
    if (len) buf[0] = 0;
    for (int i = 0; i < nplugins && at < len; i++)
        at += (size_t)snprintf(buf + at, len - at, "%s%s", i ? ", " : "", plugins[i].path);
}
