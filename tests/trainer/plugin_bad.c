/* plugin_bad.c — plugins kpl_plugin_load must refuse, one per build:
 *   PLUGIN_BAD_ABI  built against "another kpl" (ABI 999): its constructor
 *                   registers a task that must never be read or kept
 *   PLUGIN_DUP      registers a task called classification, which kpl has
 *   PLUGIN_NONE     not a kpl plugin at all (no ABI symbol) */
#include "trainer.h"

#include <stdlib.h>

static kpl_status never(kpl_trainer *t, void **state)
{
    (void)t, (void)state;
    abort(); /* a refused plugin's task must never run */
}

#if defined(PLUGIN_BAD_ABI)
__attribute__((visibility("default"))) const int kpl_plugin_abi_version = 999;
static const kpl_task_kind task = {.name = "from_another_kpl", .create = never};
#elif defined(PLUGIN_DUP)
KPL_PLUGIN_ABI;
static const kpl_task_kind task = {.name = "classification", .create = never};
#else
static const kpl_task_kind task = {.name = "no_abi", .create = never};
#endif

__attribute__((constructor)) static void add(void) { kpl_task_register(&task); }
