/*
 * recipe_owners.c — the keys tasks, models and optimizer rules declare for
 * themselves (keys.h), in their sections of a recipe: task.<task>.<key>,
 * model.<model>.<key>, optimizer.<rule>.<key>.  Only the section of the
 * task, model and rule the recipe names may be given; its values are
 * checked as kpl's own keys are, with the file, line and key.
 */
#include "recipe_impl.h"

#include <stdio.h>
#include <string.h>

const char *const kpl__rc_owner_sections[KPL__RC_OWNERS] = {"task", "model", "optimizer"};

/* which: 0 task, 1 model, 2 optimizer, as the owners' registries are
 * numbered (KPL__OWN_*). */
int kpl__rc_owner_count(int which) { return kpl__registry_count(&kpl__owners[which]); }

/* Every item's first member is its name; the registry knows its keys. */
static const kpl_key *owner_keys(int which, const void *item, const char **name)
{
    *name = item ? *(const char *const *)item : NULL;
    return item ? kpl__owners[which].keys(item) : NULL;
}

const kpl_key *kpl__rc_owner_at(int which, int i, const char **name, const char **doc)
{
    const void *item = kpl__registry_at(&kpl__owners[which], i);
    *doc = which == KPL__OWN_MODEL ? ((const kpl_zoo_model *)item)->doc : NULL;
    return owner_keys(which, item, name);
}

kpl_keyvals *kpl__rc_owner_selected(int which, kpl_recipe *r, const char **name,
                                    const kpl_key **keys, bool *known)
{
    kpl_keyvals *kv[] = {&r->task_keys, &r->model.keys, &r->optimizer.config.keys};
    const char *named[] = {r->task, r->model.name, r->optimizer.config.name};
    const void *item = kpl__registry_find(&kpl__owners[which], named[which]);
    *keys = owner_keys(which, item, name);
    *name = named[which], *known = item != NULL;
    return kv[which];
}

/* Levenshtein distance of short strings, for "did you mean". */
static int distance(const char *a, const char *b)
{
    int la = (int)strlen(a), lb = (int)strlen(b);
    if (la > 60 || lb > 60) return 99;
    int d[61][61];
    for (int i = 0; i <= la; i++) d[i][0] = i;
    for (int j = 0; j <= lb; j++) d[0][j] = j;
    for (int i = 1; i <= la; i++)
        for (int j = 1; j <= lb; j++) {
            int c = d[i - 1][j - 1] + (a[i - 1] != b[j - 1]);
            if (d[i - 1][j] + 1 < c) c = d[i - 1][j] + 1;
            if (d[i][j - 1] + 1 < c) c = d[i][j - 1] + 1;
            d[i][j] = c;
        }
    return d[la][lb];
}

int kpl__rc_distance(const char *a, const char *b) { return distance(a, b); }

/* The values of one owner's section (the map sec) into kv. */
static kpl_status bind_section(const node *sec, const char *section, const kpl_key *keys,
                               kpl_keyvals *kv)
{
    char loc[1200], key[600], value[KPL_KEY_VALUE];
    for (const node *e = sec->first; e; e = e->next) {
        snprintf(key, sizeof key, "%s.%s", section, e->key);
        const kpl_key *k = kpl__key_find(keys, e->key);
        if (!k) {
            char names[512], hint[128] = "";
            kpl__key_names(keys, names, sizeof names);
            const char *best = NULL;
            int bd = 99;
            for (const kpl_key *c = keys; c && c->name; c++) {
                int d = distance(e->key, c->name);
                if (d < bd) bd = d, best = c->name;
            }
            if (best && bd <= 3) snprintf(hint, sizeof hint, "; did you mean '%s'?", best);
            return KPL_ERROR(KPL_EINVAL, "%s: unknown key '%s' (%s has: %s%s)",
                             kpl__rc_where_key(e, loc, sizeof loc), CLIP(key), section, names, hint);
        }
        KPL_TRY(kpl__key_value(k, e, key, value, sizeof value));
        KPL_TRY(kpl__keyvals_put(kv, k->name, value));
    }
    return KPL_OK;
}

kpl_status kpl__rc_bind_owners(const node *root, kpl_recipe *r, const char *file)
{
    char loc[1200], path[256];
    for (int w = 0; w < KPL__RC_OWNERS; w++) {
        const char *what = kpl__rc_owner_sections[w], *name = NULL;
        const kpl_key *keys = NULL;
        bool known = false;
        kpl_keyvals *kv = kpl__rc_owner_selected(w, r, &name, &keys, &known);
        memset(kv, 0, sizeof *kv);
        const node *top = kpl__rc_child(root, what);
        for (const node *c = top && top->kind == N_MAP ? top->first : NULL; c; c = c->next) {
            snprintf(path, sizeof path, "%s.%s", what, c->key);
            if (kpl__rc_is_field_or_section(path)) continue; /* kpl's own */
            kpl__rc_where_key(c, loc, sizeof loc);
            if (strcmp(c->key, name))
                return KPL_ERROR(KPL_EINVAL, "%s: %s: keys of %s '%s', but %s.name is '%s'", loc,
                                 CLIP(path), what, CLIP(c->key), what, CLIP(name));
            if (!known)
                return KPL_ERROR(KPL_EINVAL, "%s: %s: %s '%s' is not registered, so its keys "
                                 "cannot be read (register it before the recipe is loaded, or "
                                 "load its plugin)", loc, CLIP(path), what, CLIP(name));
            if (!keys || !keys->name)
                return KPL_ERROR(KPL_EINVAL, "%s: %s: %s '%s' has no keys of its own", loc,
                                 CLIP(path), what, CLIP(name));
            KPL_TRY(bind_section(c, path, keys, kv));
        }
        if (!known) continue; /* a program's own task: kpl_trainer_create checks */
        snprintf(path, sizeof path, "%s.%s", what, name);
        kpl_status st = kpl_keyvals_check(keys, path, kv);
        if (st < 0) return kpl_error_prefix(st, "%s: ", *file ? CLIP_PATH(file) : "recipe");
    }
    return KPL_OK;
}
