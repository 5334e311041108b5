/*
 * registry.c — the tasks `kpl train` knows by name: classification, detection,
 * segmentation, gan, and
 * what programs and plugins register (kpl_task_register).
 */
#include "trainer_impl.h"

static const void *const builtin[] = {&kpl_task_classification, &kpl_task_detection,
                                     &kpl_task_segmentation, &kpl_task_gan, NULL};
static const kpl_key *keys_of(const void *k) { return ((const kpl_task_kind *)k)->keys; }

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

static kpl__registry tasks = {.what = "task", .builtin = builtin, .keys = keys_of,
                              .check = check_task};

kpl_status kpl_task_register(const kpl_task_kind *k)
{
    return kpl__registry_add(&tasks, k);
}

const kpl_task_kind *kpl_task_find(const char *name) { return kpl__registry_find(&tasks, name); }
int kpl_task_count(void) { return kpl__registry_count(&tasks); }
const kpl_task_kind *kpl_task_at(int i) { return kpl__registry_at(&tasks, i); }
void kpl__task_names(char *buf, size_t len) { kpl__registry_names(&tasks, buf, len); }
