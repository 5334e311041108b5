/*
 * recipe_impl.h — what the recipe's three files share (not installed):
 * recipe_keys.c (the key table, and writing a recipe out), recipe_yaml.c
 * (YAML into a tree that remembers where each value came from; bases,
 * overrides), recipe.c (binding the tree into kpl_recipe; loading).
 */
#ifndef KPL_RECIPE_IMPL_H
#define KPL_RECIPE_IMPL_H

#include "io_impl.h"

#include <stdio.h>
#include <string.h>
#include <strings.h>

/* ---- the key table (recipe_keys.c) ---- */

/* T_INT2 / T_FLOAT2: a pair of members ([h, w], [min, max], betas). */
typedef enum { T_BOOL, T_INT, T_FLOAT, T_STR, T_ENUM, T_INTS, T_FLOATS, T_INT2, T_FLOAT2,
               T_GROUPS } vtype;

typedef struct {
    const char *key;
    vtype type;
    size_t off, size; /* the member in kpl_recipe and its bytes (lists: an element's) */
    size_t off2;      /* pairs: the second member */
    size_t cap;       /* T_STR: buffer bytes; lists: element capacity; pairs: 2 when both
                         values are required, 1 when both or [] (both 0, unset) will do, 0
                         when [] or one value (both) will do too */
    size_t count_off; /* lists: the int holding the count */
    const char *def;  /* the default as YAML text; NULL: required */
    double lo, hi;    /* numbers and list elements */
    const char *const *choices; /* T_ENUM: the owning module's table, NULL-terminated; the
                                   value is the index */
    const char *help;
    const char *form; /* pairs: what the two values are, "[h, w]" */
    void (*known)(char *buf, size_t len); /* T_STR naming a registered thing: the names
                                             known now (built-ins and plugins') */
} field;

extern const field kpl__rc_fields[];
extern const int kpl__rc_nfields;
/* Whether name is one of list's ", "-separated names. */
bool kpl__rc_name_listed(const char *name, const char *list);

/* true/yes/on, false/no/off (any case). */
static inline bool kpl__rc_parse_bool(const char *s, bool *v)
{
    static const char *const t[] = {"true", "yes", "on"}, *const f[] = {"false", "no", "off"};
    for (int i = 0; i < 3; i++) {
        if (!strcasecmp(s, t[i])) return *v = true, true;
        if (!strcasecmp(s, f[i])) return *v = false, true;
    }
    return false;
}

/* The fewest digits that read back to the same double (or float), with
 * a '.' or an exponent, so that it reads as a number, not an integer. */
void kpl__rc_number_text(double v, bool single, char *s, size_t cap);

/* Members of the modules' structs are int or int64_t, float or double:
 * stored and read at their own width. */
static inline void store_int(char *dst, size_t size, int64_t v)
{
    if (size == sizeof(int64_t)) memcpy(dst, &v, sizeof v);
    else if (size == sizeof(int32_t)) memcpy(dst, &(int32_t){(int32_t)v}, sizeof(int32_t));
    else KPL_ASSERT(false, "recipe: an integer member of unexpected width");
}

static inline int64_t load_int(const char *src, size_t size)
{
    int64_t v;
    int32_t w;
    if (size == sizeof v) return memcpy(&v, src, sizeof v), v;
    return memcpy(&w, src, sizeof w), w;
}

static inline void store_real(char *dst, size_t size, double v)
{
    if (size == sizeof(double)) memcpy(dst, &v, sizeof v);
    else memcpy(dst, &(float){(float)v}, sizeof(float));
}

static inline double load_real(const char *src, size_t size)
{
    double d;
    float f;
    if (size == sizeof d) return memcpy(&d, src, sizeof d), d;
    return memcpy(&f, src, sizeof f), f;
}

/* ---- the tree (recipe_yaml.c) ---- */

typedef enum { N_SCALAR, N_SEQ, N_MAP } nkind;

typedef struct node {
    nkind kind;
    char *key;          /* this entry's key in its map */
    char *text;         /* scalars */
    bool null;          /* an empty plain scalar, ~ or null */
    const char *origin; /* file name, or the override text */
    int line, col;      /* the value's place: 1-based; line 0 for overrides */
    int kline, kcol;    /* its key's place in a map */
    struct node *first, *last, *next;
} node;

/* One load: the origins (file names, override texts) outlive the nodes
 * that point at them. */
typedef struct {
    char *origins[64];
    int norigins;
} ctx;

const char *kpl__rc_keep_origin(ctx *c, const char *s);
void kpl__rc_node_free(node *n);
node *kpl__rc_child(const node *map, const char *key);

/* What a message echoes of its input is cut short: the thread's message
 * holds under 1 KiB, and what is wrong comes after the value, so a long
 * override or YAML scalar would push it out.  A value keeps its first
 * ECHO_MAX bytes and "..."; a path its last PATH_ECHO_MAX, with its file
 * name.  Cuts fall between UTF-8 characters. */
#define ECHO_MAX 60
#define PATH_ECHO_MAX 200
#define CLIP(s) kpl__rc_clip((s), false, (char[PATH_ECHO_MAX + 4]){0})
#define CLIP_PATH(s) kpl__rc_clip((s), true, (char[PATH_ECHO_MAX + 4]){0})
const char *kpl__rc_clip(const char *s, bool path, char *buf);
/* "file:12:3" or "override 'a.b=c'"; of a map entry: its key's place */
const char *kpl__rc_where(const node *n, char *buf, size_t len);
const char *kpl__rc_where_key(const node *n, char *buf, size_t len);
/* One YAML text into a tree (at_key: the key it is the value of, "" for
 * a file); *out NULL for an empty document. */
kpl_status kpl__rc_parse_yaml(const char *text, size_t len, const char *origin, bool is_file,
                              const char *at_key, node **out);
/* Reads path (and its bases) into a tree; or a text (origin names it). */
kpl_status kpl__rc_load_file(ctx *cx, const char *path, int depth, node **out);
kpl_status kpl__rc_load_tree(ctx *cx, const char *text, size_t len, const char *origin,
                             bool is_file, const char *dir, int depth, node **out);
/* Lays "a.b.c=VALUE" over the tree. */
kpl_status kpl__rc_apply_override(ctx *cx, node *root, const char *ov);

/* Whether path is one of the table's keys or a section of them. */
bool kpl__rc_is_field_or_section(const char *path);
/* Levenshtein distance of two short strings (99 past 60 bytes), for "did
 * you mean". */
int kpl__rc_distance(const char *a, const char *b);

/* ---- owners' keys (keys.c, recipe_owners.c) ---- */

/* n, the value of key (dotted, for messages), checked against k's row
 * into its canonical text. */
kpl_status kpl__key_value(const kpl_key *k, const node *n, const char *key, char *out,
                          size_t cap);
/* The sections whose owners declare keys: 0 task, 1 model, 2 optimizer. */
#define KPL__RC_OWNERS KPL__OWN_KINDS
extern const char *const kpl__rc_owner_sections[KPL__RC_OWNERS];
/* The registered owners of section `which`: the i-th's name, one-line doc
 * (or NULL) and keys. */
int kpl__rc_owner_count(int which);
const kpl_key *kpl__rc_owner_at(int which, int i, const char **name, const char **doc);
/* The owner r names in section `which` (*known: registered), and where r
 * keeps its values. */
kpl_keyvals *kpl__rc_owner_selected(int which, kpl_recipe *r, const char **name,
                                    const kpl_key **keys, bool *known);
/* The owners' sections of the tree into r (after kpl's own keys). */
kpl_status kpl__rc_bind_owners(const node *root, kpl_recipe *r, const char *file);

#endif /* KPL_RECIPE_IMPL_H */
