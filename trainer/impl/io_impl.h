/*
 * io_impl.h — the io room's internals (trainer/io/, the lowest room of the
 * trainer: recipes, owners' keys, the registries of owners, checkpoints,
 * TensorBoard).  Rooms above include it; nothing here names a room above
 * (not installed; not part of the API).
 */
#ifndef KPL_IO_IMPL_H
#define KPL_IO_IMPL_H

#include "trainer.h"

/* ---- TensorBoard event files (tboard.c) ---- */

/* The longest scalar tag in bytes; longer ones are KPL_EINVAL. */
#define KPL__TB_TAG_MAX 1024
/* Room for one encoded scalar Event with the longest tag. */
#define KPL__TB_EVENT_MAX (KPL__TB_TAG_MAX + 64)

/* TFRecord's masked CRC32C of n bytes. */
uint32_t kpl__tb_masked_crc(const void *data, size_t n);

/* Encodes the tensorflow.Event protobuf message (unframed) of one scalar
 * summary into buf (at least KPL__TB_EVENT_MAX bytes); *len receives its
 * size.  KPL_EINVAL for an empty tag, one longer than KPL__TB_TAG_MAX or
 * one that is not UTF-8. */
kpl_status kpl__tb_encode_scalar(uint8_t *buf, const char *tag, int64_t step, double value,
                                 double wall_time, size_t *len);
/* The same for an image summary holding png (png_len bytes); *out is
 * malloc'd (the caller frees it). */
kpl_status kpl__tb_encode_image(const char *tag, int64_t step, int height, int width,
                                int channels, const uint8_t *png, size_t png_len,
                                double wall_time, uint8_t **out, size_t *len);

/* ---- recipes (recipe.c) ---- */

/* kpl_recipe_load for the kpl command, which runs only the tasks it knows:
 * a `task` that the task registry does not know is KPL_EINVAL naming the
 * task key's place, as other bad values are.  (A program with a task of
 * its own loads its recipe with kpl_recipe_load.) */
kpl_status kpl__recipe_load_known_task(const char *path, int noverrides,
                                       const char *const *overrides, kpl_recipe *out);
/* Weights given to a run (model.weights, a feature network, an import):
 * KPL_EFORMAT for a model file (kpl export) given as a checkpoint, and
 * for a floating tensor holding NaN or inf, naming path and tensor. */
struct kpl_checkpoint;
kpl_status kpl__weights_check(const struct kpl_checkpoint *c, const char *path);
/* The first NaN or inf element of a floating CPU tensor; -1 when there is
 * none (and for other dtypes). */
int64_t kpl__tensor_nonfinite(kpl_tensor *t);
/* Whether a dotted name is one of kpl's own recipe keys ("model.num_classes"). */
bool kpl__rc_is_field(const char *path);
/* The plugins loaded, in order ("" when none): for the run's log. */
void kpl__plugin_list(char *buf, size_t len);

/* ---- registries (io/plugin.c) ---- */

/* What kpl train consults by name: tasks, zoo models, optimizer rules.
 * Every item is a struct whose first member is its `const char *name`;
 * items are borrowed (static in kpl or in a plugin that stays loaded).
 * The built-ins come first, in the order given. */
typedef struct {
    const char *what;            /* "task", "model", "optimizer" */
    const void *const *builtin;  /* NULL-terminated */
    const void **items;          /* registered after the built-ins */
    const char **from;           /* per item: the plugin that registered it, or NULL */
    int n, cap;
    /* the item's own recipe keys (what.<name>.<key>), checked when it is
     * added; NULL: items have none */
    const kpl_key *(*keys)(const void *item);
    /* the rest of the item's table, checked when it is added (the
     * functions it must have, the names it refers to); NULL: nothing */
    kpl_status (*check)(const void *item);
} kpl__registry;

/* Adds item (kpl_task_register & co.).  While a plugin loads, the item
 * waits until the plugin's ABI is checked (its struct is not read before).
 * KPL_EINVAL for a name registered before, naming both origins. */
kpl_status kpl__registry_add(kpl__registry *r, const void *item);
/* The item called name, or NULL; the count and the i-th (built-ins first). */
const void *kpl__registry_find(const kpl__registry *r, const char *name);
int kpl__registry_count(const kpl__registry *r);
const void *kpl__registry_at(const kpl__registry *r, int i);
/* "a, b, c": every name, into buf. */
void kpl__registry_names(const kpl__registry *r, char *buf, size_t len);

/* ---- the owners recipes name (io/plugin.c) ---- */

/* The three registries a recipe's names are looked up in: tasks (task.h),
 * zoo models (zoo.h) and optimizer rules (optim.h).  They sit here, at the
 * bottom, so that recipe validation asks them and never a room above; the
 * rooms that own the items register into them: their built-ins from a
 * constructor (kpl__owners_builtin), programs and plugins through
 * kpl_task_register, kpl_zoo_register and kpl_optim_register.  The item
 * structs are read here only through their public declarations. */
typedef enum { KPL__OWN_TASK, KPL__OWN_MODEL, KPL__OWN_OPTIM, KPL__OWN_KINDS } kpl__owner_kind;
extern kpl__registry kpl__owners[KPL__OWN_KINDS];
/* A room's built-ins (NULL-terminated, in the order listed), once. */
void kpl__owners_builtin(kpl__owner_kind kind, const void *const *builtin);
/* "classification, ...", "mlp, lenet, ...", "sgd, adam, ...": into buf. */
void kpl__task_names(char *buf, size_t len);
void kpl__zoo_names(char *buf, size_t len);
void kpl__optim_names(char *buf, size_t len);

/* ---- owners' keys (keys.c) ---- */

const kpl_key *kpl__key_find(const kpl_key *keys, const char *name);
/* "a, b, c" ("none"): the names of keys. */
void kpl__key_names(const kpl_key *keys, char *buf, size_t len);
/* name = value (canonical) into kv. */
kpl_status kpl__keyvals_put(kpl_keyvals *kv, const char *name, const char *value);
/* Whether an owner's declared keys are well formed (names, types, defaults
 * that fit their own rows); section ("task.detection") names it. */
kpl_status kpl__keys_declared_ok(const kpl_key *keys, const char *section);

/* ---- checkpoint files (checkpoint.c) ---- */

/* DIR/ckpt-<step, 10 digits>.kpl */
/* kpl_checkpoint_save, with the completion marker PATH.done or without
 * (a file that is not a run's checkpoint: a model file). */
kpl_status kpl__checkpoint_write(kpl_checkpoint *c, const char *path, bool marker);
void kpl__checkpoint_path(const char *dir, int64_t step, char *path, size_t len);
/* The steps of DIR's complete checkpoints (those with a marker), ascending;
 * *count <= max.  A missing DIR has none. */
kpl_status kpl__checkpoint_list(const char *dir, int64_t *steps, int max, int *count);
/* Removes what interrupted saves left in DIR: temporary files, checkpoints
 * without their completion marker and markers without their checkpoint,
 * except the file `keep` (may be NULL: the one being resumed from);
 * *removed and *bytes count them.  Only while no save is under way. */
kpl_status kpl__checkpoint_clean(const char *dir, const char *keep, int *removed, double *bytes);
/* A checkpoint written before its epoch's evaluation (metadata
 * train.eval_pending): once that evaluation has run, its marker says so
 * ("evaluated": true), and a resume from it does not evaluate again. */
kpl_status kpl__checkpoint_mark_evaluated(const char *path);
bool kpl__checkpoint_evaluated(const char *path);
/* Removes a checkpoint, its marker first. */
kpl_status kpl__checkpoint_remove(const char *path);
/* dst becomes the same checkpoint as src (a hard link, else a copy) with
 * its own marker, replacing what dst was atomically. */
kpl_status kpl__checkpoint_link(const char *src, const char *dst);

#endif /* KPL_IO_IMPL_H */
