/*
 * ddp.h — data parallelism: autograd joined to collective.h's bucketed
 * allreduce.
 */
#ifndef KPL_DDP_H
#define KPL_DDP_H

#include "autograd.h"
#include "collective.h"

#ifdef __cplusplus
extern "C" {
#endif

/*
 * Joins autograd to the bucketed allreduce of collective.h: every
 * parameter's gradient is a buffer in a bucket (kpl_grad_set_buffer), its
 * ready hook starts the bucket's allreduce while backward goes on, and
 * after kpl_ddp_finish each .grad holds the average over the ranks.
 *
 *   kpl_ddp_create(comm, n, params, nbuf, buffers, NULL, &ddp);  // rank 0's values
 *   each step:
 *       kpl_ddp_begin(ddp, true);         // false on accumulation micro-steps
 *       loss = ...; kpl_backward(loss, NULL, false);
 *       kpl_ddp_finish(ddp);              // waits for the buckets
 *       kpl_optim_step(opt);              // keep_grad: reads .grad, leaves it
 *       kpl_ddp_zero_grad(ddp);           // whole buckets to zero
 *
 * Each rank's loss is the mean over its own samples; averaging the
 * gradients makes the step the one of the mean over all ranks' samples.
 * Buffers (batch norm statistics) are broadcast once at create, then each
 * rank keeps its own (no SyncBN).
 */
typedef struct kpl_ddp kpl_ddp;

/* params / buffers: borrowed, must outlive the kpl_ddp; cfg NULL for
 * KPL_BUCKETER_CONFIG_INIT.  Collective: broadcasts rank 0's parameters
 * and buffers.  Adds a ready hook to every parameter (removed by
 * destroy, with any other hooks of the parameters: kpl_clear_hooks). */
kpl_status kpl_ddp_create(kpl_comm *comm, int n, kpl_tensor *const *params, int nbuf,
                          kpl_tensor *const *buffers, const kpl_bucketer_config *cfg,
                          kpl_ddp **out);
void kpl_ddp_destroy(kpl_ddp *d);
/* Before the backward of a (micro-)step.  sync false: an accumulation
 * micro-step, no communication; true: the step's gradients are reduced at
 * finish.  The bucket views stay installed as the parameters' gradient
 * buffers across steps (backward accumulates into them); a parameter whose
 * .grad was replaced or cleared gets its view back, zeroed. */
kpl_status kpl_ddp_begin(kpl_ddp *d, bool sync);
/* After the optimizer step (created with keep_grad): every gradient back to
 * zero, a fill per bucket, the views staying where they are. */
kpl_status kpl_ddp_zero_grad(kpl_ddp *d);
/* After backward: waits for the allreduces (zeroing unused parameters'
 * gradients); with sync, every .grad is then the average over ranks.
 * Reports a failure of the ready hooks too.  Collective. */
kpl_status kpl_ddp_finish(kpl_ddp *d);
/* The bucketer underneath (statistics, parameter check). */
kpl_bucketer *kpl_ddp_bucketer(kpl_ddp *d);

#ifdef __cplusplus
}
#endif
#endif /* KPL_DDP_H */
