/*
 * recipe.c — a recipe's tree (recipe_yaml.c) bound into kpl_recipe by the
 * key table (recipe_keys.c): types, ranges, unknown keys with a hint, the
 * rules between keys, plugins loaded first; kpl_recipe_load.
 */
#include "recipe_impl.h"

#include <ctype.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <math.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include <yaml.h>

/* ---- binding -------------------------------------------------------------------------- */

static node *lookup(node *root, const char *key)
{
    char buf[256];
    snprintf(buf, sizeof buf, "%s", key);
    node *m = root;
    for (char *seg = buf; m;) {
        char *dot = strchr(seg, '.');
        if (dot) *dot = 0;
        if (m->kind != N_MAP) return NULL;
        node *c = kpl__rc_child(m, seg);
        if (!dot) return c;
        m = c;
        seg = dot + 1;
    }
    return NULL;
}

/* A number from a scalar, checked against the field's range. */
static kpl_status scalar_number(const field *f, const node *n, const char *loc, bool integer,
                                double *out)
{
    const char *s = n->text;
    char *end = NULL;
    errno = 0;
    double v;
    if (integer) {
        long long i = strtoll(s, &end, 10);
        v = (double)i;
        if (end == s || *end || errno)
            return KPL_ERROR(KPL_EINVAL, "%s: %s: expected an integer, got '%s'", loc, f->key,
                             CLIP(s));
    } else {
        v = strtod(s, &end);
        if (end == s || *end || errno || !isfinite(v))
            return KPL_ERROR(KPL_EINVAL, "%s: %s: expected a number, got '%s'", loc, f->key,
                             CLIP(s));
    }
    if (v < f->lo || v > f->hi)
        return KPL_ERROR(KPL_ERANGE, "%s: %s: %s is out of range [%.15g, %.15g]", loc, f->key,
                         CLIP(s), f->lo, f->hi);
    *out = v;
    return KPL_OK;
}

static const char *type_name(vtype t)
{
    switch (t) {
    case T_BOOL: return "true or false";
    case T_INT: return "an integer";
    case T_FLOAT: return "a number";
    case T_STR: return "a string";
    case T_ENUM: return "a name";
    case T_INTS: return "a list of integers";
    case T_FLOATS: return "a list of numbers";
    case T_INT2: return "two integers";
    case T_FLOAT2: return "two numbers";
    case T_GROUPS: return "a list of {params, lr_mult, weight_decay_mult}";
    }
    return "?";
}


/* One number of a scalar into dst, at the member's width. */
static kpl_status bind_number(const field *f, const node *n, const char *loc, bool integer,
                              char *dst)
{
    double v = 0;
    KPL_TRY(scalar_number(f, n, loc, integer, &v));
    if (integer) store_int(dst, f->size, strtoll(n->text, NULL, 10));
    else store_real(dst, f->size, v);
    return KPL_OK;
}

/* A pair: [a, b]; with cap 1 also [] (both 0); with cap 0 also one value
 * (both). */
static kpl_status bind_pair(const field *f, const node *n, const char *loc, kpl_recipe *r)
{
    char *dst[2] = {(char *)r + f->off, (char *)r + f->off2};
    bool integer = f->type == T_INT2;
    const node *e[2] = {NULL, NULL};
    int count = 0;
    if (n->kind == N_SEQ) {
        for (const node *c = n->first; c; c = c->next, count++)
            if (count < 2) e[count] = c;
    } else if (!n->null) {
        e[0] = n, count = 1;
    }
    if (count > 2 || (f->cap == 2 && count != 2) || (f->cap == 1 && count == 1))
        return KPL_ERROR(KPL_EINVAL, "%s: %s: expected %s%s", loc, f->key, f->form,
                         f->cap == 2 ? "" : f->cap == 1 ? " (or [] for none)" : " or one value");
    for (int i = 0; i < 2; i++) {
        const node *v = e[i] ? e[i] : e[0];
        if (!v) {
            store_int(dst[i], f->size, 0); /* []: the member's "unset" */
            continue;
        }
        char eloc[1200];
        kpl__rc_where(v, eloc, sizeof eloc);
        if (v->kind != N_SCALAR || v->null)
            return KPL_ERROR(KPL_EINVAL, "%s: %s: expected %s", eloc, f->key, type_name(f->type));
        KPL_TRY(bind_number(f, v, eloc, integer, dst[i]));
    }
    return KPL_OK;
}

typedef kpl_param_group group;

/* One parameter group: a map with `params` and the two multipliers. */
static kpl_status bind_group(const field *f, const node *e, group *g)
{
    char loc[1200];
    kpl__rc_where(e, loc, sizeof loc);
    if (e->kind != N_MAP)
        return KPL_ERROR(KPL_EINVAL, "%s: %s: each group is a map {params: PATTERN, lr_mult: X, "
                                     "weight_decay_mult: Y}", loc, f->key);
    memset(g, 0, sizeof *g);
    g->lr_mult = g->weight_decay_mult = 1;
    bool have_params = false;
    for (const node *c = e->first; c; c = c->next) {
        char cloc[1200], key[160];
        kpl__rc_where(c, cloc, sizeof cloc);
        snprintf(key, sizeof key, "%s[].%s", f->key, c->key);
        field sub = {key, T_FLOAT, 0, sizeof(double), 0, 0, 0, NULL, f->lo, f->hi, NULL, NULL,
                     NULL, NULL};
        if (c->kind != N_SCALAR || c->null)
            return KPL_ERROR(KPL_EINVAL, "%s: %s: expected a %s", cloc, key,
                             strcmp(c->key, "params") ? "number" : "pattern");
        if (!strcmp(c->key, "params")) {
            if (!c->text[0] || strlen(c->text) >= sizeof g->params)
                return KPL_ERROR(KPL_EINVAL, "%s: %s: a pattern of 1 to %zu characters", cloc, key,
                                 sizeof g->params - 1);
            for (const char *t = c->text; *t; t++)
                if ((unsigned char)*t < 0x20 || *t == 0x7f)
                    return KPL_ERROR(KPL_EINVAL, "%s: %s: control character 0x%02x", cloc, key,
                                     (unsigned char)*t);
            snprintf(g->params, sizeof g->params, "%s", c->text);
            have_params = true;
        } else if (!strcmp(c->key, "lr_mult")) {
            KPL_TRY(scalar_number(&sub, c, cloc, false, &g->lr_mult));
        } else if (!strcmp(c->key, "weight_decay_mult")) {
            KPL_TRY(scalar_number(&sub, c, cloc, false, &g->weight_decay_mult));
        } else {
            return KPL_ERROR(KPL_EINVAL, "%s: %s: unknown key (a group has params, lr_mult, "
                                         "weight_decay_mult)", kpl__rc_where_key(c, cloc, sizeof cloc), key);
        }
    }
    if (!have_params)
        return KPL_ERROR(KPL_EINVAL, "%s: %s: a group needs params: PATTERN", loc, f->key);
    return KPL_OK;
}

static kpl_status bind_field(const field *f, const node *n, kpl_recipe *r)
{
    char loc[1200];
    kpl__rc_where(n, loc, sizeof loc);
    char *dst = (char *)r + f->off;
    bool list = f->type == T_INTS || f->type == T_FLOATS || f->type == T_GROUPS ||
                f->type == T_INT2 || f->type == T_FLOAT2;
    if ((n->kind == N_MAP && f->type != T_GROUPS) || (n->kind == N_SEQ && !list))
        return KPL_ERROR(KPL_EINVAL, "%s: %s: expected %s, got a %s", loc, f->key,
                         type_name(f->type), n->kind == N_MAP ? "section" : "list");
    if (n->kind == N_SCALAR && n->null && f->type != T_STR && !list)
        return KPL_ERROR(KPL_EINVAL, "%s: %s: no value (expected %s)", loc, f->key,
                         type_name(f->type));
    switch (f->type) {
    case T_BOOL: {
        bool v;
        if (!kpl__rc_parse_bool(n->text, &v))
            return KPL_ERROR(KPL_EINVAL, "%s: %s: expected true or false, got '%s'", loc, f->key,
                             CLIP(n->text));
        *(bool *)dst = v;
        return KPL_OK;
    }
    case T_INT:
    case T_FLOAT: return bind_number(f, n, loc, f->type == T_INT, dst);
    case T_INT2:
    case T_FLOAT2: return bind_pair(f, n, loc, r);
    case T_STR: {
        const char *s = n->null ? "" : n->text;
        if (f->known) { /* a registered thing's name: one of those known now */
            char known[1024];
            f->known(known, sizeof known);
            if (!kpl__rc_name_listed(s, known))
                return KPL_ERROR(KPL_EINVAL, "%s: %s: expected one of %s; got '%s'", loc, f->key,
                                 known, CLIP(s));
        }
        if (strlen(s) >= f->cap)
            return KPL_ERROR(KPL_EINVAL, "%s: %s: longer than %zu characters", loc, f->key,
                             f->cap - 1);
        /* names and paths: a newline or escape code would end up in file
         * names and logs */
        for (const char *c = s; *c; c++)
            if ((unsigned char)*c < 0x20 || *c == 0x7f)
                return KPL_ERROR(KPL_EINVAL, "%s: %s: control character 0x%02x in '%s'", loc,
                                 f->key, (unsigned char)*c, CLIP(s));
        memcpy(dst, s, strlen(s) + 1);
        return KPL_OK;
    }
    case T_ENUM: {
        int i = kpl__name_index(f->choices, n->text);
        if (i >= 0) {
            store_int(dst, f->size, i);
            return KPL_OK;
        }
        char opts[256] = "";
        for (int c = 0; f->choices[c]; c++) {
            size_t l = strlen(opts);
            snprintf(opts + l, sizeof opts - l, "%s%s", c ? ", " : "", f->choices[c]);
        }
        return KPL_ERROR(KPL_EINVAL, "%s: %s: expected one of %s; got '%s'", loc, f->key, opts,
                         CLIP(n->text));
    }
    case T_INTS:
    case T_FLOATS: {
        int *count = (int *)((char *)r + f->count_off);
        *count = 0;
        if (n->kind == N_SCALAR && n->null) return KPL_OK;
        const node *e = n->kind == N_SEQ ? n->first : n; /* a scalar is a list of one */
        for (; e; e = n->kind == N_SEQ ? e->next : NULL) {
            char eloc[1200];
            kpl__rc_where(e, eloc, sizeof eloc);
            if (e->kind != N_SCALAR || e->null)
                return KPL_ERROR(KPL_EINVAL, "%s: %s: expected %s", eloc, f->key,
                                 type_name(f->type));
            if ((size_t)*count == f->cap)
                return KPL_ERROR(KPL_EINVAL, "%s: %s: more than %zu values", loc, f->key, f->cap);
            KPL_TRY(bind_number(f, e, eloc, f->type == T_INTS, dst + (size_t)*count * f->size));
            (*count)++;
        }
        return KPL_OK;
    }
    case T_GROUPS: {
        int *count = (int *)((char *)r + f->count_off);
        *count = 0;
        if (n->kind == N_SCALAR && n->null) return KPL_OK;
        if (n->kind != N_SEQ)
            return KPL_ERROR(KPL_EINVAL, "%s: %s: expected %s", loc, f->key, type_name(f->type));
        for (const node *e = n->first; e; e = e->next) {
            if ((size_t)*count == f->cap)
                return KPL_ERROR(KPL_EINVAL, "%s: %s: more than %zu groups", loc, f->key, f->cap);
            KPL_TRY(bind_group(f, e, &((group *)dst)[*count]));
            (*count)++;
        }
        return KPL_OK;
    }
    }
    return KPL_OK;
}

static bool is_section(const char *path)
{
    size_t l = strlen(path);
    for (int i = 0; i < kpl__rc_nfields; i++)
        if (!strncmp(kpl__rc_fields[i].key, path, l) && kpl__rc_fields[i].key[l] == '.') return true;
    return false;
}

static const field *find_field(const char *path)
{
    for (int i = 0; i < kpl__rc_nfields; i++)
        if (!strcmp(kpl__rc_fields[i].key, path)) return &kpl__rc_fields[i];
    return NULL;
}

bool kpl__rc_is_field(const char *path) { return find_field(path) != NULL; }

bool kpl__rc_is_field_or_section(const char *path)
{
    return find_field(path) || is_section(path);
}

/* Whether path (task.X, model.X, optimizer.X) may be an owner's section,
 * which kpl__rc_bind_owners reads. */
static bool owner_section(const char *path, const node *c)
{
    for (int w = 0; w < KPL__RC_OWNERS; w++) {
        size_t l = strlen(kpl__rc_owner_sections[w]);
        if (!strncmp(path, kpl__rc_owner_sections[w], l) && path[l] == '.' &&
            !strchr(path + l + 1, '.'))
            return c->kind == N_MAP;
    }
    return false;
}

/* Every key of the tree must be a field or a section of the key table
 * (or an owner's section). */
static kpl_status check_unknown(const node *map, const char *prefix)
{
    for (const node *c = map->first; c; c = c->next) {
        char path[512], loc[1200];
        snprintf(path, sizeof path, "%s%s%s", prefix, *prefix ? "." : "", c->key);
        if (find_field(path) || owner_section(path, c)) continue;
        if (is_section(path)) {
            if (c->kind != N_MAP)
                return KPL_ERROR(KPL_EINVAL, "%s: %s: is a section of keys, not a value",
                                 kpl__rc_where(c, loc, sizeof loc), path);
            KPL_TRY(check_unknown(c, path));
            continue;
        }
        /* an unknown section: name its first key, so that the hint can
         * compare whole keys ("optimiser.lr" -> "optimizer.lr") */
        for (const node *d = c; d->kind == N_MAP && d->first; d = d->first) {
            size_t l = strlen(path);
            snprintf(path + l, sizeof path - l, ".%s", d->first->key);
        }
        const char *best = NULL;
        int bd = 99;
        for (int i = 0; i < kpl__rc_nfields; i++) {
            int d = kpl__rc_distance(path, kpl__rc_fields[i].key);
            if (d < bd) bd = d, best = kpl__rc_fields[i].key;
        }
        char hint[300] = "";
        if (best && bd <= 3) snprintf(hint, sizeof hint, " (did you mean '%s'?)", best);
        return KPL_ERROR(KPL_EINVAL, "%s: unknown key '%s'%s", kpl__rc_where_key(c, loc, sizeof loc),
                         CLIP(path), hint);
    }
    return KPL_OK;
}

/* Where key k is given ("(default)" when it is not); needs root and loc. */
#define AT(k) kpl__rc_where(lookup(root, k), loc, sizeof loc)

/* A split's keep_ratio and scale_crop keys: crop keep_ratio needs
 * short_sides and max_side and no size; the other crops leave the four at
 * their defaults (by value: a resolved recipe lists every key), except
 * mask_pad, which scale_crop pads with too; scale_range and cat_max_ratio
 * are scale_crop's alone; an evaluation resizes every image one way (one
 * short side). */
static kpl_status check_keep_ratio(node *root, const char *split, const kpl_transform_config *t,
                                   bool eval)
{
    char loc[1200], k[128];
    static const char *const only[4] = {"short_sides", "max_side", "size_divisor", "mask_pad"};
    const kpl_transform_config def = KPL_TRANSFORM_CONFIG_INIT;
    if (t->crop != KPL_CROP_SCALE_CROP) {
        static const char *const sc[2] = {"scale_range", "cat_max_ratio"};
        const bool set[2] = {t->scale_range[0] != def.scale_range[0] ||
                                 t->scale_range[1] != def.scale_range[1],
                             t->cat_max_ratio != def.cat_max_ratio};
        for (int j = 0; j < 2; j++) {
            snprintf(k, sizeof k, "%s.transform.%s", split, sc[j]);
            if (set[j])
                return KPL_ERROR(KPL_EINVAL, "%s: %s: only used with %s.transform.crop "
                                 "scale_crop (crop is %s)", AT(k), k, split,
                                 kpl_crop_mode_name(t->crop));
        }
    }
    if (t->crop != KPL_CROP_KEEP_RATIO) {
        /* scale_crop pads its crops too: mask_pad is its as well */
        const bool set[4] = {t->num_short_sides != 0, t->max_side != def.max_side,
                             t->size_divisor != def.size_divisor,
                             t->mask_pad != def.mask_pad && t->crop != KPL_CROP_SCALE_CROP};
        for (int j = 0; j < 4; j++) {
            snprintf(k, sizeof k, "%s.transform.%s", split, only[j]);
            if (set[j])
                return KPL_ERROR(KPL_EINVAL, "%s: %s: only used with %s.transform.crop "
                                 "keep_ratio%s (crop is %s)", AT(k), k, split,
                                 j == 3 ? " or scale_crop" : "",
                                 kpl_crop_mode_name(t->crop));
        }
        return KPL_OK;
    }
    snprintf(k, sizeof k, "%s.transform.crop", split);
    if (t->num_short_sides == 0 || t->max_side == 0)
        return KPL_ERROR(KPL_EINVAL, "%s: %s: keep_ratio needs %s.transform.%s (e.g. %s)", AT(k),
                         k, split, t->num_short_sides ? "max_side" : "short_sides",
                         t->num_short_sides ? "1333" : "[800], or [640, 672, 704, 736, 768, "
                                                       "800] to train at several scales");
    snprintf(k, sizeof k, "%s.transform.size", split);
    if (t->out_h != 0)
        return KPL_ERROR(KPL_EINVAL, "%s: %s: not with crop keep_ratio, which sizes each image "
                         "by %s.transform.short_sides and max_side", AT(k), k, split);
    snprintf(k, sizeof k, "%s.transform.short_sides", split);
    if (eval && t->num_short_sides > 1)
        return KPL_ERROR(KPL_EINVAL, "%s: %s: evaluation resizes every image the same way: one "
                         "value, not %d", AT(k), k, t->num_short_sides);
    return KPL_OK;
}

/* Rules that join several keys; messages point at the key to change.
 * known_task: the task must be one the task registry knows (the kpl command). */
static kpl_status check_rules(node *root, kpl_recipe *r, bool known_task)
{
    char loc[1200];
    if (known_task && !kpl__registry_find(&kpl__owners[KPL__OWN_TASK], r->task)) {
        char names[256];
        kpl__task_names(names, sizeof names);
        return KPL_ERROR(KPL_EINVAL, "%s: task: unknown task '%s' (kpl train and kpl eval know: "
                         "%s; a program with a task of its own runs it through "
                         "kpl_trainer_create)", AT("task.name"), CLIP(r->task), names);
    }
    /* the common keys the task needs given: required for it */
    const kpl_task_kind *kind = kpl__registry_find(&kpl__owners[KPL__OWN_TASK], r->task);
    for (const char *const *k = kind ? kind->needs : NULL; k && *k; k++)
        if (!lookup(root, *k))
            return KPL_ERROR(KPL_EINVAL, "%s: missing required key '%s' (task %s needs it)",
                             *r->file ? CLIP_PATH(r->file) : "recipe", *k, r->task);
    if (kind && kind->check) { /* the task's own rules, on its keys with defaults */
        kpl_keyvals kv = r->task_keys;
        char section[sizeof r->task + 8];
        snprintf(section, sizeof section, "task.%s", r->task);
        KPL_TRY(kpl_keyvals_check(kind->keys, section, &kv));
        const char *key = NULL;
        kpl_status st = kind->check(r, &kv, &key);
        if (st < 0)
            return key ? kpl_error_prefix(st, "%s: %s: ", AT(key), key)
                       : kpl_error_prefix(st, "%s: task %s: ",
                                           *r->file ? CLIP_PATH(r->file) : "recipe", r->task);
    }
    kpl_recipe_split *sp[2] = {&r->data.train, &r->data.val};
    const char *spn[2] = {"data.train", "data.val"};
    for (int i = 0; i < 2; i++) {
        char k[128];
        kpl_transform_config *t = &sp[i]->loader.transform;
        int *count[2] = {&sp[i]->nmean, &sp[i]->nstd};
        float *value[2] = {t->mean, t->std};
        snprintf(k, sizeof k, "%s.transform.scale", spn[i]);
        if (t->scale[0] > t->scale[1] || t->scale[0] <= 0)
            return KPL_ERROR(KPL_EINVAL, "%s: %s: expected [min, max] with 0 < min <= max <= 1",
                             AT(k), k);
        snprintf(k, sizeof k, "%s.transform.ratio", spn[i]);
        if (t->ratio[0] > t->ratio[1])
            return KPL_ERROR(KPL_EINVAL, "%s: %s: expected [min, max] with min <= max", AT(k), k);
        for (int m = 0; m < 2; m++) {
            snprintf(k, sizeof k, "%s.transform.%s", spn[i], m ? "std" : "mean");
            if (*count[m] != 1 && *count[m] != t->channels)
                return KPL_ERROR(KPL_EINVAL, "%s: %s: %s, got %d", AT(k), k,
                                 t->channels == 1 ? "expected 1 value (transform.channels is 1)"
                                                  : "expected 1 value or 3 (one per channel)",
                                 *count[m]);
            for (int c = *count[m]; c < 3; c++) value[m][c] = value[m][0]; /* one for all */
        }
        snprintf(k, sizeof k, "%s.boxes_feature", spn[i]);
        if (sp[i]->boxes_feature[0] && t->max_boxes == 0)
            return KPL_ERROR(KPL_EINVAL, "%s: %s: needs %s.max_boxes >= 1 (the boxes a batch "
                             "holds per image)", AT(k), k, spn[i]);
        snprintf(k, sizeof k, "%s.box_labels_feature", spn[i]);
        if (sp[i]->box_labels_feature[0] && !sp[i]->boxes_feature[0])
            return KPL_ERROR(KPL_EINVAL, "%s: %s: needs %s.boxes_feature", AT(k), k, spn[i]);
        snprintf(k, sizeof k, "%s.box_ignore_feature", spn[i]);
        if (sp[i]->box_ignore_feature[0] && !sp[i]->boxes_feature[0])
            return KPL_ERROR(KPL_EINVAL, "%s: %s: needs %s.boxes_feature", AT(k), k, spn[i]);
        snprintf(k, sizeof k, "%s.transform.channels", spn[i]);
        if (t->channels == 2)
            return KPL_ERROR(KPL_EINVAL, "%s: %s: 1 or 3, not 2", AT(k), k);
        snprintf(k, sizeof k, "%s.transform.size", spn[i]);
        if (t->crop != KPL_CROP_NONE && t->crop != KPL_CROP_KEEP_RATIO && t->out_h == 0)
            return KPL_ERROR(KPL_EINVAL, "%s: %s: crop '%s' needs an output size", AT(k), k,
                             kpl_crop_mode_name(t->crop));
        KPL_TRY(check_keep_ratio(root, spn[i], t, i == 1));
    }
    if (r->data.train.loader.batch_size < 1)
        return KPL_ERROR(KPL_EINVAL, "%s: data.train.batch_size: must be >= 1",
                         AT("data.train.batch_size"));
    if (r->data.convert.from != KPL_CONVERT_NONE && !r->data.convert.source[0])
        return KPL_ERROR(KPL_EINVAL, "%s: data.convert.source: needed with data.convert.from %s",
                         AT("data.convert.source"), kpl_convert_source_name(r->data.convert.from));
    if (!strcmp(r->model.name, "resnet")) {
        int64_t d = r->model.depth;
        if (d != 18 && d != 34 && d != 50 && d != 101 && d != 152)
            return KPL_ERROR(KPL_EINVAL, "%s: model.depth: resnet depth is 18, 34, 50, 101 or "
                             "152, got %lld", AT("model.depth"), (long long)d);
    }
    const kpl_optim_config *oc = &r->optimizer.config;
    if (oc->nesterov && (strcmp(oc->name, "sgd") || oc->momentum <= 0))
        return KPL_ERROR(KPL_EINVAL, "%s: optimizer.nesterov: needs optimizer.name sgd and "
                         "momentum > 0", AT("optimizer.nesterov"));
    const kpl_lr_schedule *sc = &r->schedule.config;
    if (sc->kind == KPL_SCHED_MULTISTEP && sc->num_milestones == 0)
        return KPL_ERROR(KPL_EINVAL, "%s: schedule.milestones: multistep needs milestones",
                         AT("schedule.milestones"));
    for (int i = 1; i < sc->num_milestones; i++)
        if (sc->milestones[i] <= sc->milestones[i - 1])
            return KPL_ERROR(KPL_EINVAL, "%s: schedule.milestones: must increase",
                             AT("schedule.milestones"));
    if (r->schedule.span == KPL_LR_SPAN_MAX_STEPS && r->max_steps <= 0)
        return KPL_ERROR(KPL_EINVAL, "%s: schedule.span: max_steps needs max_steps (the steps "
                         "the decay spans), which is 0", AT("schedule.span"));
    if ((sc->kind == KPL_SCHED_COSINE || sc->kind == KPL_SCHED_POLY) &&
        r->schedule.span == KPL_LR_SPAN_EPOCHS && sc->warmup_epochs >= (double)r->epochs)
        return KPL_ERROR(KPL_EINVAL, "%s: schedule.warmup_epochs: %g leaves nothing of %lld "
                         "epochs for the %s schedule", AT("schedule.warmup_epochs"),
                         sc->warmup_epochs, (long long)r->epochs, kpl_sched_kind_name(sc->kind));
    const int64_t *ps = r->profile.steps;
    if (ps[1] < ps[0])
        return KPL_ERROR(KPL_EINVAL, "%s: profile.steps: expected [first, last] with first <= "
                         "last, got [%lld, %lld]", AT("profile.steps"), (long long)ps[0],
                         (long long)ps[1]);
    if (r->profile.memory && ps[0] <= 0)
        return KPL_ERROR(KPL_EINVAL, "%s: profile.memory: true needs profile.steps, the steps "
                         "it profiles (e.g. [5, 5])", AT("profile.memory"));
    if (r->memory.recompute == KPL_RECOMPUTE_AUTO && r->memory.budget_mb <= 0)
        return KPL_ERROR(KPL_EINVAL,
                         "%s: memory.recompute: auto needs memory.budget_mb, the "
                         "MiB the training device's allocator may hold (e.g. 4096)",
                         AT("memory.recompute"));
    if (r->memory.recompute != KPL_RECOMPUTE_AUTO && r->memory.budget_mb > 0)
        return KPL_ERROR(KPL_EINVAL,
                         "%s: memory.budget_mb is for memory.recompute: auto "
                         "(it is %s)",
                         AT("memory.budget_mb"), kpl_recompute_mode_names[r->memory.recompute]);
    if (sc->min_lr > oc->lr)
        return KPL_ERROR(KPL_EINVAL, "%s: schedule.min_lr: %g is above optimizer.lr %g",
                         AT("schedule.min_lr"), sc->min_lr, oc->lr);
    /* The name becomes a directory, runs/<name>-<time>: one path part. */
    for (const char *c = r->name; *c; c++)
        if (!isalnum((unsigned char)*c) && !strchr("._+-", *c))
            return KPL_ERROR(KPL_EINVAL, "%s: name: '%s' may hold only letters, digits and . _ + "
                             "- (it names the run directory runs/<name>-<time>)", AT("name"),
                             CLIP(r->name));
    if (r->name[0] == '.')
        return KPL_ERROR(KPL_EINVAL, "%s: name: '%s' must not start with '.'", AT("name"),
                         CLIP(r->name));
    const char *dev = r->device;
    if (strcmp(dev, "auto") && strcmp(dev, "cpu") && strcmp(dev, "cuda")) {
        char *end = NULL;
        if (strncmp(dev, "cuda:", 5) || !isdigit((unsigned char)dev[5]) ||
            (strtol(dev + 5, &end, 10), *end))
            return KPL_ERROR(KPL_EINVAL, "%s: device: expected auto, cpu, cuda or cuda:N; got "
                             "'%s'", AT("device"), dev);
    }
    return KPL_OK;
#undef AT
}

static kpl_status bind(node *root, const char *file, bool known_task, kpl_recipe *r)
{
    /* what no key sets keeps its module's default; pointers stay NULL.
     * The defaults are copied byte for byte from static objects, whose
     * padding is zero: assigning a compound literal may copy a stack
     * temporary's padding, and a resolved recipe must read back to the
     * same bytes (fuzz_recipe compares them). */
    static const kpl_loader_config loader = KPL_LOADER_CONFIG_INIT;
    static const kpl_convert_options convert = KPL_CONVERT_OPTIONS_INIT;
    static const kpl_optim_config optim = KPL_OPTIM_CONFIG_INIT;
    static const kpl_lr_schedule sched = KPL_LR_SCHEDULE_INIT;
    static const kpl_comm_config comm = KPL_COMM_CONFIG_INIT;
    static const kpl_bucketer_config buckets = KPL_BUCKETER_CONFIG_INIT;
    memset(r, 0, sizeof *r);
    kpl_recipe_split *sp[2] = {&r->data.train, &r->data.val};
    for (int i = 0; i < 2; i++) {
        memcpy(&sp[i]->loader, &loader, sizeof loader);
        sp[i]->loader.transform.image_feature = sp[i]->loader.transform.label_feature = NULL;
    }
    memcpy(&r->data.convert.options, &convert, sizeof convert);
    memcpy(&r->optimizer.config, &optim, sizeof optim);
    memcpy(&r->schedule.config, &sched, sizeof sched);
    r->schedule.config.base_lr = r->schedule.config.epochs = 0; /* the trainer's */
    memcpy(&r->dist.comm, &comm, sizeof comm);
    memcpy(&r->dist.buckets, &buckets, sizeof buckets);
    KPL_TRY(check_unknown(root, ""));
    for (int i = 0; i < kpl__rc_nfields; i++) {
        const field *f = &kpl__rc_fields[i];
        node *n = lookup(root, f->key);
        if (n) {
            KPL_TRY(bind_field(f, n, r));
            continue;
        }
        if (!f->def)
            return KPL_ERROR(KPL_EINVAL, "%s: missing required key '%s' (%s)",
                             *file ? CLIP_PATH(file) : "recipe", f->key, f->help);
        node *d = NULL;
        KPL_TRY(kpl__rc_parse_yaml(f->def, strlen(f->def), "default", false, "", &d));
        kpl_status st = bind_field(f, d, r);
        kpl__rc_node_free(d);
        KPL_ASSERT(st >= 0, "recipe: a default does not fit its own key");
    }
    if (!r->name[0]) { /* the file's name without directory and extension */
        const char *b = strrchr(file, '/');
        b = b ? b + 1 : file;
        size_t l = strcspn(b, ".");
        if (l >= sizeof r->name) l = sizeof r->name - 1;
        memcpy(r->name, b, l);
        r->name[l] = 0;
        for (char *c = r->name; *c; c++) /* what the name rule allows */
            if (!isalnum((unsigned char)*c) && !strchr("_+-", *c)) *c = '_';
        if (!r->name[0]) snprintf(r->name, sizeof r->name, "run");
    }
    snprintf(r->file, sizeof r->file, "%s", file);
    KPL_TRY(kpl__rc_bind_owners(root, r, file));
    return check_rules(root, r, known_task);
}

/* `plugins` (a path or a list of them), taken out of the tree and loaded
 * before anything else is read: what they register may be named by the
 * other keys.  Each path is relative to the file that names it (an
 * override's to the working directory); *n resolved paths into paths. */
static kpl_status take_plugins(node *root, char (*paths)[KPL_RECIPE_PATH], int *n)
{
    *n = 0;
    node **link = &root->first, *prev = NULL;
    while (*link && strcmp((*link)->key, "plugins")) {
        prev = *link;
        link = &(*link)->next;
    }
    node *p = *link;
    if (!p) return KPL_OK;
    *link = p->next;
    if (root->last == p) root->last = prev;
    p->next = NULL;
    char w[1200];
    kpl_status st = KPL_OK;
    const node *one[1] = {p};
    int count = p->kind == N_SEQ ? 0 : p->null ? 0 : 1;
    for (const node *e = p->kind == N_SEQ ? p->first : NULL; e; e = e->next) count++;
    if (p->kind == N_MAP) {
        st = KPL_ERROR(KPL_EINVAL, "%s: plugins: expected a list of paths", kpl__rc_where(p, w, sizeof w));
    } else if (count > KPL_RECIPE_LIST) {
        st = KPL_ERROR(KPL_EINVAL, "%s: plugins: at most %d", kpl__rc_where(p, w, sizeof w), KPL_RECIPE_LIST);
    }
    const node *e = p->kind == N_SEQ ? p->first : count ? one[0] : NULL;
    for (; st >= 0 && e; e = p->kind == N_SEQ ? e->next : NULL) {
        if (e->kind != N_SCALAR || e->null || !*e->text) {
            st = KPL_ERROR(KPL_EINVAL, "%s: plugins: expected the path of a shared library",
                           kpl__rc_where(e, w, sizeof w));
            break;
        }
        char file[2 * KPL_RECIPE_PATH + 2];
        const char *slash = e->line > 0 ? strrchr(e->origin, '/') : NULL;
        if (e->text[0] != '/' && slash)
            snprintf(file, sizeof file, "%.*s/%s", (int)(slash - e->origin), e->origin, e->text);
        else
            snprintf(file, sizeof file, "%s", e->text);
        if ((st = kpl_plugin_load(file)) < 0) {
            kpl_error_prefix(st, "%s: plugins: ", kpl__rc_where(e, w, sizeof w));
            break;
        }
        char real[PATH_MAX];
        if (!realpath(file, real) || strlen(real) >= KPL_RECIPE_PATH) {
            st = KPL_ERROR(KPL_EINVAL, "%s: plugins: path longer than %d bytes",
                           kpl__rc_where(e, w, sizeof w), KPL_RECIPE_PATH - 1);
            break;
        }
        memcpy(paths[(*n)++], real, strlen(real) + 1);
    }
    kpl__rc_node_free(p);
    return st;
}

static kpl_status load(const char *path, const char *yaml, const char *origin, int nov,
                       const char *const *ov, bool known_task, kpl_recipe *out)
{
    KPL_CHECK(out && (nov == 0 || ov), KPL_EINVAL, "recipe: bad arguments");
    ctx cx;
    memset(&cx, 0, sizeof cx);
    node *root = NULL;
    kpl_status st;
    if (path) st = kpl__rc_load_file(&cx, path, 0, &root);
    else st = kpl__rc_load_tree(&cx, yaml, strlen(yaml), kpl__rc_keep_origin(&cx, origin), true, "", 0, &root);
    for (int i = 0; i < nov && st >= 0; i++) st = kpl__rc_apply_override(&cx, root, ov[i]);
    char(*plugins)[KPL_RECIPE_PATH] = calloc(KPL_RECIPE_LIST, KPL_RECIPE_PATH);
    int nplugins = 0;
    if (st >= 0 && !plugins) st = KPL_ERROR(KPL_ENOMEM, "recipe: out of memory");
    if (st >= 0) st = take_plugins(root, plugins, &nplugins);
    if (st >= 0) st = bind(root, path ? path : "", known_task, out);
    if (st >= 0) {
        memcpy(out->plugins, plugins, sizeof out->plugins);
        out->nplugins = nplugins;
    }
    free(plugins);
    kpl__rc_node_free(root);
    for (int i = 0; i < cx.norigins; i++) free(cx.origins[i]);
    return st;
}

kpl_status kpl_recipe_load(const char *path, int noverrides, const char *const *overrides,
                           kpl_recipe *out)
{
    KPL_CHECK(path, KPL_EINVAL, "recipe: no path");
    return load(path, NULL, NULL, noverrides, overrides, false, out);
}

kpl_status kpl__recipe_load_known_task(const char *path, int noverrides,
                                       const char *const *overrides, kpl_recipe *out)
{
    KPL_CHECK(path, KPL_EINVAL, "recipe: no path");
    return load(path, NULL, NULL, noverrides, overrides, true, out);
}

kpl_status kpl_recipe_load_string(const char *yaml, const char *origin, int noverrides,
                                  const char *const *overrides, kpl_recipe *out)
{
    KPL_CHECK(yaml, KPL_EINVAL, "recipe: no text");
    return load(NULL, yaml, origin ? origin : "recipe", noverrides, overrides, false, out);
}
