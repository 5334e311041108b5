/*
 * autograd.h — reverse-mode differentiation over graph/'s recorded nodes.
 *
 *   kpl_pool *fw = kpl_pool_push();
 *   kpl_tensor *loss = model(x);            // ops record nodes
 *   kpl_tensor_retain(loss);
 *   kpl_pool_pop(fw);                       // temporaries die; the graph keeps
 *                                           // only what backward needs
 *   kpl_backward(loss, NULL, false);        // .grad of every parameter
 *   kpl_tensor_release(loss);
 *
 * Reverse-mode GC: a node's saved tensors are released as soon as its
 * gradient has run, and every intermediate gradient as soon as its last
 * consumer has used it; their memory goes back to the allocator's LIFO bins
 * for the next gradient.  Popping the forward pool before backward (as
 * above) is what lets saved activations go early: a pool holds its results
 * until it closes.
 *
 * Gradient functions are written with graph/'s eager ops, so with
 * `create_graph` they are recorded again and can be differentiated.
 * Thread-safety: one backward per thread at a time; the registry of
 * gradient functions is filled at load time and read-only afterwards.
 */
#ifndef KPL_AUTOGRAD_H
#define KPL_AUTOGRAD_H

#include "graph.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Accumulates d(loss)/d(p) into p's .grad for every parameter p the loss
 * depends on.  grad_output: the seed gradient, NULL for ones (loss must
 * then have one element).  retain_graph keeps the saved tensors for a
 * second backward; without it a second backward through the same nodes
 * fails with KPL_ESTATE. */
kpl_status kpl_backward(kpl_tensor *loss, kpl_tensor *grad_output, bool retain_graph);

/* Gradients of `output` with respect to each of `inputs` (parameters or
 * intermediate results), returned in grads[i] (pool-owned; NULL when the
 * output does not depend on input i).  .grad is not touched.  With
 * create_graph the gradients are themselves recorded (higher order); the
 * graph is then retained. */
kpl_status kpl_grad(kpl_tensor *output, kpl_tensor *grad_output, int ninputs,
                    kpl_tensor *const *inputs, bool create_graph, kpl_tensor **grads);

/* Sets every listed parameter's .grad to NULL. */
void kpl_zero_grad(int n, kpl_tensor *const *params);

/* Whether a gradient function exists for op. */
bool kpl_op_has_grad(kpl_op op);

/* ---- gradient checking (for tests of every op) ------------------------------- */

/* Builds the output from the inputs with eager ops (pool-owned result). */
typedef kpl_tensor *(*kpl_gradcheck_fn)(kpl_tensor *const *inputs, void *user);

/* Compares the gradients autograd computes for fn against central finite
 * differences.  Inputs: f64 parameters (requires_grad) for precise
 * differences (f32 works with looser tolerances).  A non-scalar output is
 * projected on fixed random weights first.  `order` 1 checks the gradient;
 * order k > 1 checks the (k-1)-th gradient's gradient, i.e. that the
 * gradient functions are themselves differentiable (create_graph).
 * KPL_EINVAL with the input, element, analytic and numeric values on a
 * mismatch. */
kpl_status kpl_gradcheck(kpl_gradcheck_fn fn, void *user, int ninputs,
                         kpl_tensor *const *inputs, int order, double eps, double atol,
                         double rtol);

#ifdef __cplusplus
}
#endif
#endif /* KPL_AUTOGRAD_H */
