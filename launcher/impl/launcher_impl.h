/*
 * launcher_impl.h — kplrun's internals shared by its files (not installed).
 */
#ifndef KPL_LAUNCHER_IMPL_H
#define KPL_LAUNCHER_IMPL_H

#include "launcher.h"

/* `kplrun --agent ...` (agent.c): argv after "--agent". */
int kpl__agent_main(int argc, char **argv);
/* NVIDIA GPUs of this node, from sysfs (no CUDA needed). */
int kpl__launcher_gpu_count(void);

#endif /* KPL_LAUNCHER_IMPL_H */
