/*
 * keys.c — the keys an owner (task, model, optimizer rule) declares
 * (keys.h): a YAML value checked against its row into the canonical text
 * kpl_keyvals keeps, the set checked against the owner's table, and the
 * typed reads.
 */
#include "recipe_impl.h"

#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

KPL_ENUM_DEFINE(kpl_key_type, KPL_KEY_TYPES)

/* The origin of values a program set (kpl_keyvals_set), not a recipe's. */
static const char hand_made[] = "(set by the program)";
/* The origin of an owner's declared defaults. */
static const char declared[] = "declared default";

static const char *place(const node *n, char *buf, size_t len)
{
    if (n && n->line == 0 && n->origin == hand_made) return snprintf(buf, len, "configuration"), buf;
    if (n && n->line == 0 && n->origin == declared) return snprintf(buf, len, "%s", declared), buf;
    return kpl__rc_where(n, buf, len);
}

/* What a value of type t is, for messages. */
static const char *words(kpl_key_type t)
{
    switch (t) {
    case KPL_KEY_BOOL: return "true or false";
    case KPL_KEY_INT: return "an integer";
    case KPL_KEY_FLOAT: return "a number";
    case KPL_KEY_STRING: return "a string";
    case KPL_KEY_CHOICE: return "a name";
    case KPL_KEY_INTS: return "a list of integers";
    case KPL_KEY_FLOATS: return "a list of numbers";
    }
    return "a value";
}

static bool any_range(const kpl_key *k) { return k->min == 0 && k->max == 0; }

/* One number of a scalar, checked against k's range, as text. */
static kpl_status number(const kpl_key *k, const node *n, const char *key, bool integer,
                         char *out, size_t cap)
{
    char loc[1200];
    place(n, loc, sizeof loc);
    const char *what = integer ? "an integer" : "a number";
    if (n->kind != N_SCALAR || n->null)
        return KPL_ERROR(KPL_EINVAL, "%s: %s: expected %s", loc, key, what);
    const char *s = n->text;
    char *end = NULL;
    errno = 0;
    double v;
    long long i = 0;
    if (integer) v = (double)(i = strtoll(s, &end, 10));
    else v = strtod(s, &end);
    if (end == s || *end || errno || !isfinite(v))
        return KPL_ERROR(KPL_EINVAL, "%s: %s: expected %s, got '%s'", loc, key, what, CLIP(s));
    if (!any_range(k) && (v < k->min || v > k->max))
        return KPL_ERROR(KPL_ERANGE, "%s: %s: %s is out of range [%.15g, %.15g]", loc, key,
                         CLIP(s), k->min, k->max);
    if (integer) snprintf(out, cap, "%lld", i);
    else kpl__rc_number_text(v, false, out, cap);
    return KPL_OK;
}

static bool choice_listed(const char *choices, const char *s)
{
    size_t n = strlen(s);
    for (const char *p = choices; p && *p;) {
        size_t l = strcspn(p, "|");
        if (l == n && !strncmp(p, s, n)) return true;
        p += l + (p[l] == '|');
    }
    return false;
}

/* n, the value of key (dotted, for messages), checked against k into its
 * canonical text. */
kpl_status kpl__key_value(const kpl_key *k, const node *n, const char *key, char *out,
                          size_t cap)
{
    char loc[1200];
    place(n, loc, sizeof loc);
    bool list = k->type == KPL_KEY_INTS || k->type == KPL_KEY_FLOATS;
    if (n->kind == N_MAP || (n->kind == N_SEQ && !list))
        return KPL_ERROR(KPL_EINVAL, "%s: %s: expected %s, got a %s", loc, key, words(k->type),
                         n->kind == N_MAP ? "section" : "list");
    switch (k->type) {
    case KPL_KEY_BOOL: {
        bool v;
        if (n->null || !kpl__rc_parse_bool(n->text, &v))
            return KPL_ERROR(KPL_EINVAL, "%s: %s: expected true or false, got '%s'", loc, key,
                             CLIP(n->text));
        snprintf(out, cap, "%s", v ? "true" : "false");
        return KPL_OK;
    }
    case KPL_KEY_INT:
    case KPL_KEY_FLOAT: return number(k, n, key, k->type == KPL_KEY_INT, out, cap);
    case KPL_KEY_STRING:
    case KPL_KEY_CHOICE: {
        const char *s = n->null ? "" : n->text;
        if (k->type == KPL_KEY_CHOICE && !choice_listed(k->choices, s))
            return KPL_ERROR(KPL_EINVAL, "%s: %s: expected one of %s; got '%s'", loc, key,
                             k->choices ? k->choices : "(none)", CLIP(s));
        for (const char *c = s; *c; c++)
            if ((unsigned char)*c < 0x20 || *c == 0x7f)
                return KPL_ERROR(KPL_EINVAL, "%s: %s: control character 0x%02x in '%s'", loc,
                                 key, (unsigned char)*c, CLIP(s));
        if (strlen(s) >= cap)
            return KPL_ERROR(KPL_EINVAL, "%s: %s: longer than %zu characters", loc, key, cap - 1);
        memcpy(out, s, strlen(s) + 1);
        return KPL_OK;
    }
    case KPL_KEY_INTS:
    case KPL_KEY_FLOATS: {
        size_t at = (size_t)snprintf(out, cap, "[");
        if (n->kind == N_SCALAR && n->null) return snprintf(out, cap, "[]"), KPL_OK;
        const node *e = n->kind == N_SEQ ? n->first : n; /* a scalar is a list of one */
        for (int i = 0; e; e = n->kind == N_SEQ ? e->next : NULL, i++) {
            char one[64];
            KPL_TRY(number(k, e, key, k->type == KPL_KEY_INTS, one, sizeof one));
            if (at + strlen(one) + 4 >= cap)
                return KPL_ERROR(KPL_EINVAL, "%s: %s: the list is longer than %zu characters",
                                 loc, key, cap - 1);
            at += (size_t)snprintf(out + at, cap - at, "%s%s", i ? ", " : "", one);
        }
        snprintf(out + at, cap - at, "]");
        return KPL_OK;
    }
    }
    return KPL_ERROR(KPL_EINVAL, "%s: %s: the key's declared type %d is unknown", loc, key,
                     (int)k->type);
}

const kpl_key *kpl__key_find(const kpl_key *keys, const char *name)
{
    for (const kpl_key *k = keys; k && k->name; k++)
        if (!strcmp(k->name, name)) return k;
    return NULL;
}

/* "a, b, c": the names of keys (for messages). */
void kpl__key_names(const kpl_key *keys, char *buf, size_t len)
{
    size_t at = 0;
    buf[0] = 0;
    for (const kpl_key *k = keys; k && k->name && at < len; k++)
        at += (size_t)snprintf(buf + at, len - at, "%s%s", at ? ", " : "", k->name);
    if (!at) snprintf(buf, len, "none");
}

static int slot(const kpl_keyvals *kv, const char *name)
{
    for (int i = 0; kv && i < kv->n && i < KPL_KEYVALS_MAX; i++)
        if (!strcmp(kv->v[i].name, name)) return i;
    return -1;
}

/* Puts name = value (canonical) into kv. */
kpl_status kpl__keyvals_put(kpl_keyvals *kv, const char *name, const char *value)
{
    int i = slot(kv, name);
    if (i < 0) {
        KPL_CHECK(kv->n >= 0 && kv->n < KPL_KEYVALS_MAX, KPL_EINVAL,
                  "keys: more than %d keys for one owner", KPL_KEYVALS_MAX);
        i = kv->n++;
    }
    KPL_CHECK(strlen(name) < KPL_KEY_NAME, KPL_EINVAL, "keys: name '%s' longer than %d bytes",
              CLIP(name), KPL_KEY_NAME - 1);
    KPL_CHECK(strlen(value) < KPL_KEY_VALUE, KPL_EINVAL,
              "keys: %s: value longer than %d bytes", name, KPL_KEY_VALUE - 1);
    snprintf(kv->v[i].name, KPL_KEY_NAME, "%s", name);
    snprintf(kv->v[i].value, KPL_KEY_VALUE, "%s", value);
    return KPL_OK;
}

kpl_status kpl_keyvals_set(kpl_keyvals *kv, const char *name, const char *value)
{
    KPL_CHECK(kv && name && value, KPL_EINVAL, "kpl_keyvals_set: NULL argument");
    return kpl__keyvals_put(kv, name, value);
}

/* A default (YAML text) or a value set by hand (YAML text; strings the
 * text itself) checked against k. */
static kpl_status text_value(const kpl_key *k, const char *text, bool hand, const char *key,
                             char *out, size_t cap)
{
    node *n = NULL, one = {.kind = N_SCALAR, .text = (char *)text, .origin = hand_made};
    /* a string set by a program is the text itself, not YAML ("[x]", "a: b") */
    if (hand && (k->type == KPL_KEY_STRING || k->type == KPL_KEY_CHOICE))
        return kpl__key_value(k, &one, key, out, cap);
    KPL_TRY(kpl__rc_parse_yaml(text, strlen(text), hand ? hand_made : declared, false, key, &n));
    one.null = true, one.text = "";
    kpl_status st = kpl__key_value(k, n ? n : &one, key, out, cap);
    kpl__rc_node_free(n);
    return st;
}

/* Whether a key's name is [a-z0-9_]{1,47}. */
static bool good_name(const char *s)
{
    size_t l = strlen(s);
    if (l == 0 || l >= KPL_KEY_NAME) return false;
    for (; *s; s++)
        if (!((*s >= 'a' && *s <= 'z') || (*s >= '0' && *s <= '9') || *s == '_')) return false;
    return true;
}

kpl_status kpl__keys_declared_ok(const kpl_key *keys, const char *section)
{
    int n = 0;
    for (const kpl_key *k = keys; k && k->name; k++, n++) {
        KPL_CHECK(good_name(k->name), KPL_EINVAL,
                  "%s: key name '%s' must be 1 to %d of [a-z0-9_]", section, CLIP(k->name),
                  KPL_KEY_NAME - 1);
        KPL_CHECK(kpl__key_find(keys, k->name) == k, KPL_EINVAL, "%s: key '%s' declared twice",
                  section, k->name);
        KPL_CHECK((int)k->type >= 0 && k->type <= KPL_KEY_FLOATS, KPL_EINVAL,
                  "%s.%s: unknown key type %d", section, k->name, (int)k->type);
        KPL_CHECK(k->type != KPL_KEY_CHOICE || (k->choices && *k->choices), KPL_EINVAL,
                  "%s.%s: a choice key needs its choices (\"a|b\")", section, k->name);
        KPL_CHECK(k->doc, KPL_EINVAL, "%s.%s: no doc line", section, k->name);
        if (k->def) {
            char key[256], out[KPL_KEY_VALUE];
            snprintf(key, sizeof key, "%s.%s", section, k->name);
            KPL_TRY(text_value(k, k->def, false, key, out, sizeof out));
        }
    }
    KPL_CHECK(n <= KPL_KEYVALS_MAX, KPL_EINVAL, "%s: %d keys, at most %d", section, n,
              KPL_KEYVALS_MAX);
    return KPL_OK;
}

kpl_status kpl_keyvals_check(const kpl_key *keys, const char *section, kpl_keyvals *kv)
{
    KPL_CHECK(section && kv, KPL_EINVAL, "kpl_keyvals_check: NULL argument");
    KPL_CHECK(kv->n >= 0 && kv->n <= KPL_KEYVALS_MAX, KPL_EINVAL,
              "%s: a key set of %d values (not initialised?)", section, kv->n);
    char key[256], out[KPL_KEY_VALUE];
    for (int i = 0; i < kv->n; i++) {
        snprintf(key, sizeof key, "%s.%s", section, kv->v[i].name);
        const kpl_key *k = kpl__key_find(keys, kv->v[i].name);
        if (!k) {
            char names[512];
            kpl__key_names(keys, names, sizeof names);
            return KPL_ERROR(KPL_EINVAL, "%s: unknown key (%s has: %s)", key, section, names);
        }
        KPL_TRY(text_value(k, kv->v[i].value, true, key, out, sizeof out));
        memcpy(kv->v[i].value, out, strlen(out) + 1);
    }
    /* the owner's order, defaults for what is missing, unused bytes zero */
    kpl_keyvals *done = calloc(1, sizeof *done);
    KPL_CHECK(done, KPL_ENOMEM, "keys: out of memory");
    kpl_status st = KPL_OK;
    for (const kpl_key *k = keys; st >= 0 && k && k->name; k++) {
        int i = slot(kv, k->name);
        snprintf(key, sizeof key, "%s.%s", section, k->name);
        if (i >= 0) st = kpl__keyvals_put(done, k->name, kv->v[i].value);
        else if (!k->def)
            st = KPL_ERROR(KPL_EINVAL, "missing required key '%s' (%s)", key, k->doc);
        else if ((st = text_value(k, k->def, false, key, out, sizeof out)) >= 0)
            st = kpl__keyvals_put(done, k->name, out);
    }
    if (st >= 0) *kv = *done;
    free(done);
    return st;
}

/* The text of key name, or an error listing the keys kv has. */
static kpl_status text_of(const kpl_keyvals *kv, const char *name, const char **out)
{
    KPL_CHECK(kv && name && out, KPL_EINVAL, "kpl_key: NULL argument");
    int i = slot(kv, name);
    if (i >= 0) return *out = kv->v[i].value, KPL_OK;
    char names[512] = "none";
    size_t at = 0;
    for (int j = 0; j < kv->n && j < KPL_KEYVALS_MAX && at < sizeof names; j++)
        at += (size_t)snprintf(names + at, sizeof names - at, "%s%s", j ? ", " : "", kv->v[j].name);
    return KPL_ERROR(KPL_ENOTFOUND, "no key '%s' (the set has: %s)", CLIP(name), names);
}

kpl_status kpl_key_string(const kpl_keyvals *kv, const char *name, const char **out)
{
    return text_of(kv, name, out);
}

kpl_status kpl_key_bool(const kpl_keyvals *kv, const char *name, bool *out)
{
    const char *s = NULL;
    KPL_TRY(text_of(kv, name, &s));
    KPL_CHECK(kpl__rc_parse_bool(s, out), KPL_EINVAL, "key '%s' is '%s', not true or false",
              name, CLIP(s));
    return KPL_OK;
}

/* One number of s (up to *end): integer or not, whole. */
static kpl_status parse_number(const char *name, const char *s, size_t len, bool integer,
                               double *d, int64_t *i)
{
    char buf[64];
    KPL_CHECK(len < sizeof buf, KPL_EINVAL, "key '%s': a number of %zu characters", name, len);
    memcpy(buf, s, len);
    buf[len] = 0;
    char *end = NULL;
    errno = 0;
    if (integer) *i = strtoll(buf, &end, 10);
    else *d = strtod(buf, &end);
    KPL_CHECK(end != buf && !*end && !errno, KPL_EINVAL, "key '%s' holds '%s', not %s", name,
              CLIP(buf), integer ? "an integer" : "a number");
    return KPL_OK;
}

kpl_status kpl_key_int(const kpl_keyvals *kv, const char *name, int64_t *out)
{
    const char *s = NULL;
    KPL_TRY(text_of(kv, name, &s));
    double d;
    return parse_number(name, s, strlen(s), true, &d, out);
}

kpl_status kpl_key_float(const kpl_keyvals *kv, const char *name, double *out)
{
    const char *s = NULL;
    KPL_TRY(text_of(kv, name, &s));
    int64_t i;
    return parse_number(name, s, strlen(s), false, out, &i);
}

static kpl_status list_of(const kpl_keyvals *kv, const char *name, bool integer, int64_t *iv,
                          double *dv, int cap, int *n)
{
    const char *s = NULL;
    KPL_TRY(text_of(kv, name, &s));
    KPL_CHECK(n && cap >= 0 && (cap == 0 || (integer ? iv != NULL : dv != NULL)), KPL_EINVAL,
              "kpl_key list '%s': bad arguments", name);
    size_t len = strlen(s);
    KPL_CHECK(len >= 2 && s[0] == '[' && s[len - 1] == ']', KPL_EINVAL,
              "key '%s' is '%s', not a list", name, CLIP(s));
    *n = 0;
    for (const char *p = s + 1; p < s + len - 1;) {
        while (*p == ' ') p++;
        size_t l = strcspn(p, ",]");
        KPL_CHECK(*n < cap, KPL_ERANGE, "key '%s' holds more than %d values", name, cap);
        int64_t i = 0;
        double d = 0;
        KPL_TRY(parse_number(name, p, l, integer, &d, &i));
        if (integer) iv[*n] = i;
        else dv[*n] = d;
        (*n)++;
        p += l + 1;
    }
    return KPL_OK;
}

kpl_status kpl_key_ints(const kpl_keyvals *kv, const char *name, int64_t *out, int cap, int *n)
{
    return list_of(kv, name, true, out, NULL, cap, n);
}

kpl_status kpl_key_floats(const kpl_keyvals *kv, const char *name, double *out, int cap, int *n)
{
    return list_of(kv, name, false, NULL, out, cap, n);
}
