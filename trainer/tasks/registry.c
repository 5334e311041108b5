/*
 * registry.c — the tasks `kpl train` knows by name: classification, detection,
 * segmentation, gan, and
 * what programs and plugins register (kpl_task_register).
 */
#include "trainer_impl.h"

static const void *const builtin[] = {&kpl_task_classification, &kpl_task_detection,
                                     &kpl_task_segmentation, &kpl_task_gan, NULL};
static const kpl_key *keys_of(const void *k) { return ((const kpl_task_kind *)k)->keys; }
static kpl__registry tasks = {.what = "task", .builtin = builtin, .keys = keys_of};

kpl_status kpl_task_register(const kpl_task_kind *k)
{
    return kpl__registry_add(&tasks, k);
}

const kpl_task_kind *kpl_task_find(const char *name) { return kpl__registry_find(&tasks, name); }
int kpl_task_count(void) { return kpl__registry_count(&tasks); }
const kpl_task_kind *kpl_task_at(int i) { return kpl__registry_at(&tasks, i); }
void kpl__task_names(char *buf, size_t len) { kpl__registry_names(&tasks, buf, len); }
