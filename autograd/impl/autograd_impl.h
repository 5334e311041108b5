/* autograd_impl.h — private to autograd/. */
#ifndef KPL_AUTOGRAD_IMPL_H
#define KPL_AUTOGRAD_IMPL_H

#include "autograd.h"

/* Runs the gradient function of n: gin[i] receives the gradient of input i
 * (pool-owned) for every input that requires grad. */
kpl_status kpl__autograd_apply(kpl_node *n, kpl_tensor *gy, kpl_tensor **gin);

#endif
