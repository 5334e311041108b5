/*
 * trainer.h — the model zoo and the optimizers (the parts of the trainer the
 * benchmarks and tests share; recipes, checkpoints and the training loop
 * join them with the trainer issue).
 *
 *   kpl_model *m = NULL;
 *   kpl_model_create("resnet18_cifar", 10, kpl_device_cpu(), 42, &m);
 *   kpl_sgd *opt = NULL;
 *   kpl_sgd_create(kpl_model_num_params(m), kpl_model_params(m), 0.1, 0.9, 0, false, &opt);
 *   for (...) {
 *       kpl_pool *p = kpl_pool_push();
 *       kpl_tensor *loss = kpl_cross_entropy(kpl_model_forward(m, x, true), y,
 *                                            KPL_REDUCE_MEAN, 0, -100);
 *       kpl_backward(loss, NULL, false);
 *       kpl_sgd_step(opt);            // also clears the gradients
 *       kpl_pool_pop(p);
 *   }
 *   kpl_sgd_destroy(opt);
 *   kpl_model_destroy(m);
 *
 * Thread-safety: a model or an optimizer is used by one thread at a time.
 */
#ifndef KPL_TRAINER_H
#define KPL_TRAINER_H

#include "autograd.h"
#include "collective.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---- models ------------------------------------------------------------------- */

typedef struct kpl_model kpl_model;

/* Names: "mlp" (784-512-256-C), "lenet" (LeNet-5 on 1x28x28, padding 2 on
 * the first conv), "resnet18_cifar" (3x3 stem, no max-pool, 3x32x32),
 * "resnet18", "resnet34", "resnet50" (ImageNet stems, 3x224x224).
 * Parameters start as PyTorch's do (Kaiming-uniform linear layers;
 * Kaiming-normal fan-out convolutions in ResNets; BN scale 1, shift 0),
 * drawn from Philox with `seed`.  *out owned by the caller
 * (kpl_model_destroy).  KPL_EINVAL for an unknown name, listing the known. */
kpl_status kpl_model_create(const char *name, int64_t num_classes, kpl_device *dev,
                            uint64_t seed, kpl_model **out);
void kpl_model_destroy(kpl_model *m);
/* Logits (N, num_classes) of x (N, C, H, W) (pool-owned; NULL on error).
 * `training` selects batch statistics (and moves the running ones) or the
 * running statistics in batch norm. */
kpl_tensor *kpl_model_forward(kpl_model *m, kpl_tensor *x, bool training);
/* The trainable parameters, in creation order (borrowed). */
int kpl_model_num_params(const kpl_model *m);
kpl_tensor *const *kpl_model_params(const kpl_model *m);
/* State that is not trained but belongs to the model (batch norm's
 * running statistics), in creation order (borrowed). */
int kpl_model_num_buffers(const kpl_model *m);
kpl_tensor *const *kpl_model_buffers(const kpl_model *m);
/* Parameter element count. */
int64_t kpl_model_param_count(const kpl_model *m);
/* Multiply-adds x 2 of the convolutions and linear layers of one forward
 * pass of one sample; `train_flops` adds their two backward products
 * (input gradient skipped for the first layer, as autograd does). */
double kpl_model_flops(const kpl_model *m, bool train_flops);
const char *kpl_model_name(const kpl_model *m);

/* ---- SGD with momentum -------------------------------------------------------- */

typedef struct kpl_sgd kpl_sgd;

/* PyTorch's SGD: v = momentum v + (g + wd p); p -= lr (nesterov ? g' +
 * momentum v : v).  Borrows `params` (they must outlive the optimizer). */
kpl_status kpl_sgd_create(int n, kpl_tensor *const *params, double lr, double momentum,
                          double weight_decay, bool nesterov, kpl_sgd **out);
void kpl_sgd_destroy(kpl_sgd *o);
void kpl_sgd_set_lr(kpl_sgd *o, double lr);
/* Updates every parameter that has a gradient, then clears the gradients.
 * Unrecorded (runs with grad mode off). */
kpl_status kpl_sgd_step(kpl_sgd *o);

/* ---- data parallelism (DDP) ---------------------------------------------------- */
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
 *       kpl_sgd_step(opt);                // reads and then clears .grad
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
/* Before the forward pass of a (micro-)step.  sync false: an accumulation
 * micro-step, no communication; true: the step's gradients are reduced at
 * finish.  A parameter whose .grad was cleared (the optimizer does) gets
 * its zeroed bucket view as gradient buffer; one that still has it keeps
 * accumulating. */
kpl_status kpl_ddp_begin(kpl_ddp *d, bool sync);
/* After backward: waits for the allreduces (zeroing unused parameters'
 * gradients); with sync, every .grad is then the average over ranks.
 * Reports a failure of the ready hooks too.  Collective. */
kpl_status kpl_ddp_finish(kpl_ddp *d);
/* The bucketer underneath (statistics, parameter check). */
kpl_bucketer *kpl_ddp_bucketer(kpl_ddp *d);

#ifdef __cplusplus
}
#endif
#endif /* KPL_TRAINER_H */
