/*
 * keys.h — recipe keys that a task, a model or an optimizer rule declares
 * for itself, as rows of one typed table, and the values a recipe gave
 * them.
 *
 * An owner lists its keys (a NULL-named row ends the list) and finds them
 * in its own section of the recipe: task.<task>.<key>,
 * model.<model>.<key>, optimizer.<rule>.<key>.  The recipe checks them as
 * it checks its own keys (type, range, choices; file:line:key in every
 * message), fills the defaults, and `kpl train --keys`, --print-config and
 * config.yaml show them.
 *
 *   static const kpl_key fcos_keys[] = {
 *       {"levels", KPL_KEY_INT, "5", 1, 8, NULL, "FPN levels P3.."},
 *       {"center_sampling", KPL_KEY_BOOL, "true", 0, 0, NULL, "positives near the centre"},
 *       {"loss", KPL_KEY_CHOICE, "giou", 0, 0, "iou|giou|diou", "box regression loss"},
 *       {NULL},
 *   };
 *   ...
 *   int64_t levels;
 *   KPL_TRY(kpl_key_int(&cfg->keys, "levels", &levels));
 */
#ifndef KPL_KEYS_H
#define KPL_KEYS_H

#include "kernels.h"

#include <stdbool.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define KPL_KEY_TYPES(X)                                                                    \
    X(KPL_KEY_BOOL, "bool") X(KPL_KEY_INT, "int") X(KPL_KEY_FLOAT, "float")                  \
    X(KPL_KEY_STRING, "string") X(KPL_KEY_CHOICE, "choice") X(KPL_KEY_INTS, "ints")          \
    X(KPL_KEY_FLOATS, "floats")
typedef enum { KPL_KEY_TYPES(KPL_ENUM_VALUE) } kpl_key_type;
KPL_ENUM_DECLARE(kpl_key_type);

/* One key.  Numbers (and the elements of lists) must lie in [min, max];
 * min == max == 0 allows any finite value. */
typedef struct {
    const char *name;    /* below the owner's section: [a-z0-9_], 1..47 bytes */
    kpl_key_type type;
    const char *def;     /* the default as YAML text ("0.5", "[8, 16]", "giou");
                            NULL: the recipe must give it */
    double min, max;
    const char *choices; /* KPL_KEY_CHOICE: "iou|giou|diou" */
    const char *doc;     /* one line for `kpl train --keys` */
} kpl_key;

/* The values of one owner's keys, as checked YAML text (a plain value:
 * copy it freely). */
#define KPL_KEYVALS_MAX 32
#define KPL_KEY_NAME 48
#define KPL_KEY_VALUE 208
typedef struct {
    int n;
    struct {
        char name[KPL_KEY_NAME];
        char value[KPL_KEY_VALUE]; /* strings and choices: the text itself */
    } v[KPL_KEYVALS_MAX];
} kpl_keyvals;

/* Sets name to the YAML text value ("0.25", "[1, 2]", "giou") for a
 * program that builds a configuration by hand; kpl_keyvals_check checks
 * it.  KPL_EINVAL for a name or value too long, or a full set. */
kpl_status kpl_keyvals_set(kpl_keyvals *kv, const char *name, const char *value);
/* Checks kv against the owner's keys: every value of its type and range,
 * no name the owner does not list, the defaults filled in, the required
 * given, in the owner's order (so equal settings make equal bytes).
 * section names the owner in messages ("model.fcos").  The
 * recipe has done this for the values it gave; kpl_zoo_create,
 * kpl_optim_create and kpl_trainer_create do it again (for hand-made
 * configurations). */
kpl_status kpl_keyvals_check(const kpl_key *keys, const char *section, kpl_keyvals *kv);

/* The value of key name: KPL_ENOTFOUND when kv has no such key (listing
 * those it has), KPL_EINVAL when it is of another type. */
kpl_status kpl_key_bool(const kpl_keyvals *kv, const char *name, bool *out);
kpl_status kpl_key_int(const kpl_keyvals *kv, const char *name, int64_t *out);
kpl_status kpl_key_float(const kpl_keyvals *kv, const char *name, double *out);
/* Strings and choices: *out points into kv. */
kpl_status kpl_key_string(const kpl_keyvals *kv, const char *name, const char **out);
/* Lists: up to cap values into out, their count into *n (KPL_ERANGE when
 * more than cap). */
kpl_status kpl_key_ints(const kpl_keyvals *kv, const char *name, int64_t *out, int cap, int *n);
kpl_status kpl_key_floats(const kpl_keyvals *kv, const char *name, double *out, int cap, int *n);

#ifdef __cplusplus
}
#endif
#endif /* KPL_KEYS_H */
