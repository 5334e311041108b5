/* layers_impl.h — private to trainer/nn/: what the layer kinds share
 * (layers.c, norms.c). */
#ifndef KPL_LAYERS_IMPL_H
#define KPL_LAYERS_IMPL_H

#include "layers.h"

/* One input, one output: the kinds that take a single tensor. */
#define ONE_OUT(out, expr)                                   \
    do {                                                     \
        (out)->t[0] = (expr);                                \
        (out)->n = 1;                                        \
        return (out)->t[0] ? KPL_OK : kpl_last_status();     \
    } while (0)

/* KPL_EINVAL naming the kind unless in holds one tensor. */
kpl_status kpl__layer_one_input(const kpl_module *m, const kpl_tensor_list *in);
/* A new module whose state is a malloc'd copy of `size` bytes at `init`. */
kpl_status kpl__layer_create_with(kpl_module *parent, const char *name,
                                  const kpl_module_kind *kind, const void *init, size_t size,
                                  kpl_module **out);
/* An f32 parameter of m (uninitialised), borrowed in *out. */
kpl_status kpl__layer_new_param(kpl_module *m, const char *name, int ndim, const int64_t *shape,
                                kpl_tensor **out);
/* An f32 buffer of m of n elements, all v. */
kpl_status kpl__layer_new_buffer(kpl_module *m, const char *name, int64_t n, double v);
/* A batch norm's "this forward ends in a ReLU" flag (norms.c); NULL for
 * any other kind. */
bool *kpl__batch_norm_relu_flag(kpl_module *m);

#endif
