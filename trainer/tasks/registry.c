/*
 * registry.c — the tasks `kpl train` knows by name: classification,
 * detection, segmentation, gan, and what programs and plugins register
 * (kpl_task_register).  Link with
 * -Wl,-u,kpl_task_find (the trainer's CMake target does) so that a static
 * link keeps this file and its built-ins.
 */
#include "io_impl.h"

static const void *const builtin[] = {&kpl_task_classification, &kpl_task_detection,
                                     &kpl_task_segmentation, &kpl_task_gan, NULL};
/* Registered into the owners' registry at the bottom (io/plugin.c) when
 * kpl loads, before any recipe is read; it checks each task's table. */
__attribute__((constructor)) static void register_builtin(void)
{
    kpl__owners_builtin(KPL__OWN_TASK, builtin);
}

static kpl__registry *const tasks = &kpl__owners[KPL__OWN_TASK];

kpl_status kpl_task_register(const kpl_task_kind *k)
{
    return kpl__registry_add(tasks, k);
}

const kpl_task_kind *kpl_task_find(const char *name) { return kpl__registry_find(tasks, name); }
int kpl_task_count(void) { return kpl__registry_count(tasks); }
const kpl_task_kind *kpl_task_at(int i) { return kpl__registry_at(tasks, i); }
