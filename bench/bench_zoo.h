/* bench_zoo.h — the benches' models: zoo presets as module trees. */
#ifndef KPL_BENCH_ZOO_H
#define KPL_BENCH_ZOO_H

#include "zoo.h"

/* A zoo preset (zoo.h: "lenet", "resnet18_cifar", "resnet50") as a module
 * tree in training mode. */
static inline kpl_status bench_zoo(const char *name, int64_t classes, kpl_device *dev,
                                   uint64_t seed, kpl_module **out)
{
    kpl_model_config c;
    kpl_status st = kpl_zoo_preset(name, classes, &c);
    return st < 0 ? st : kpl_zoo_create(&c, dev, seed, out);
}

#endif /* KPL_BENCH_ZOO_H */
