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

int kpl__rc_owner_count(int which)
{
    switch (which) {
    case 0: return kpl_task_count();
    case 1: return kpl_zoo_count();
    default: return kpl_optim_rule_count();
    }
}

const kpl_key *kpl__rc_owner_at(int which, int i, const char **name, const char **doc)
{
    *doc = NULL;
    switch (which) {
    case 0: {
        const kpl_task_kind *k = kpl_task_at(i);
        *name = k->name;
        return k->keys;
    }
    case 1: {
        const kpl_zoo_model *m = kpl_zoo_at(i);
        *name = m->name, *doc = m->doc;
        return m->keys;
    }
    default: {
        const kpl_optim_rule *r = kpl_optim_rule_at(i);
        *name = r->name;
        return r->keys;
    }
    }
}

kpl_keyvals *kpl__rc_owner_selected(int which, kpl_recipe *r, const char **name,
                                    const kpl_key **keys, bool *known)
{
    switch (which) {
    case 0: {
        const kpl_task_kind *k = kpl_task_find(r->task);
        *name = r->task, *keys = k ? k->keys : NULL, *known = k != NULL;
        return &r->task_keys;
    }
    case 1: {
        const kpl_zoo_model *m = kpl_zoo_find(r->model.name);
        *name = r->model.name, *keys = m ? m->keys : NULL, *known = m != NULL;
        return &r->model.keys;
    }
    default: {
        const kpl_optim_rule *o = kpl_optim_rule_find(r->optimizer.config.name);
        *name = r->optimizer.config.name, *keys = o ? o->keys : NULL, *known = o != NULL;
        return &r->optimizer.config.keys;
    }
    }
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
