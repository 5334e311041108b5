/*
 * optim.h — optimizers (SGD, Adam, AdamW, LARS, and rules registered from
 * outside), parameter groups, gradient clipping, and learning-rate schedules as pure functions of
 * training progress.  Thread-safety: one thread at a time per optimizer.
 */
#ifndef KPL_OPTIM_H
#define KPL_OPTIM_H

#include "autograd.h"
#include "keys.h"

#ifdef __cplusplus
extern "C" {
#endif

/*
 * One optimizer object for every update rule.  The built-in rules follow
 * PyTorch's formulations:
 *
 *   sgd    g' = g + wd p;  v = momentum v + g' (v = g' at the first step);
 *          p -= lr (nesterov ? g' + momentum v : v)          (torch.optim.SGD)
 *   adam   g' = g + wd p;  m = b1 m + (1 - b1) g';  v = b2 v + (1 - b2) g'^2;
 *          p -= lr (m / (1 - b1^t)) / (sqrt(v / (1 - b2^t)) + eps)
 *                                                            (torch.optim.Adam)
 *   adamw  p *= 1 - lr wd, then adam without the wd term     (torch.optim.AdamW)
 *   lars   g' = g + wd p;  trust = eta ||p|| / (||g|| + wd ||p||) when both
 *          norms are > 0, else 1;  v = momentum v + lr trust g';  p -= v
 *          (You et al. 2017, as MLPerf's ResNet-50 reference)
 *
 * t counts the steps that updated the parameter (per parameter, as PyTorch).
 * Parameters flagged in `no_decay` (batch-norm scales and shifts, biases,
 * when the recipe asks) get no weight decay, and under lars no trust
 * ratio either (plain momentum SGD), as the LARS references exclude them.
 * Other rules (LAMB, Adafactor) come from programs and plugins:
 * kpl_optim_register below.
 *
 *   kpl_optim_config oc = KPL_OPTIM_CONFIG_INIT;
 *   snprintf(oc.name, sizeof oc.name, "adamw"); oc.lr = 1e-3; oc.weight_decay = 0.05;
 *   kpl_optim *opt = NULL;
 *   kpl_optim_create(&oc, kpl_module_num_params(net), kpl_module_params(net), NULL, &opt);
 *   each step: backward; kpl_clip_grad_norm(...); kpl_optim_set_lr(opt, lr);
 *              kpl_optim_step(opt);     // reads, then clears, every .grad
 */
typedef struct {
    char name[32];            /* the rule: "sgd", "adam", "adamw", "lars", or a registered one */
    double lr;                /* >= 0 */
    double momentum;          /* sgd, lars: [0, 1) */
    bool nesterov;            /* sgd: needs momentum > 0 */
    double weight_decay;      /* >= 0 */
    double beta1, beta2, eps; /* adam, adamw: betas in [0, 1), eps > 0 */
    double trust_coefficient; /* lars: eta > 0 */
    bool keep_grad;           /* step leaves .grad alone: whoever owns the gradient
                                 buffers zeroes them (kpl_ddp_zero_grad) */
    kpl_keyvals keys;         /* optimizer.<name>.<key>: the rule's own keys
                                 (kpl_optim_rule.keys); kpl_optim_create fills
                                 their defaults */
} kpl_optim_config;
#define KPL_OPTIM_CONFIG_INIT {"sgd", 0.1, 0.0, false, 0.0, 0.9, 0.999, 1e-8, 0.001, false, {0}}

/* ---- update rules --------------------------------------------------------------------- */
/*
 * A rule updates one parameter from its gradient and its state.  The
 * optimizer owns the state: `slots` tensors per parameter, by name (a
 * checkpoint saves them as optim.<model>.<parameter>.<slot>), created by
 * the rule at its first update (kpl_optim_slot_zeros) and NULL until then;
 * a slot named "step" is a one-element i64 count on the CPU (the steps
 * that updated the parameter, as Adam's), any other has the parameter's
 * shape, dtype and device.  The optimizer also lends `scratch`
 * parameter-shaped temporaries and `scalars` 0-d ones of the parameter's
 * dtype (shared between parameters, contents undefined at the call).
 * The update runs with grad mode off and must use the kpl_k_* kernels
 * (or any op) on the parameter's device; it must not keep the tensors.
 */
typedef struct {
    const kpl_optim_config *cfg; /* cfg->lr is the schedule's */
    kpl_tensor *param;           /* updated in place */
    const kpl_tensor *grad;      /* read only: it may be a DDP bucket's view */
    kpl_tensor **slot;           /* the rule's slots for this parameter */
    kpl_tensor *const *scratch;  /* `scratch` tensors like param */
    kpl_tensor *const *scalars;  /* `scalars` 0-d tensors of param's dtype */
    double lr, weight_decay;     /* this parameter's, with its group's multipliers
                                    (weight_decay 0 for no_decay parameters) */
    bool no_decay;
    kpl_tensor *lr_tensor;       /* lr as a 0-d tensor of param's dtype (kept equal to lr
                                    by kpl_optim_set_lr): a traced step multiplies by
                                    it, so its graph follows the schedule */
} kpl_optim_update;

#define KPL_OPTIM_MAX_SLOTS 8
#define KPL_OPTIM_MAX_SCRATCH 4
#define KPL_OPTIM_MAX_SCALARS 8
typedef struct {
    const char *name; /* optimizer.name in a recipe; first member (registries) */
    /* The state slots for a configuration (names static, at most
     * KPL_OPTIM_MAX_SLOTS; sgd has none without momentum). */
    int (*slots)(const kpl_optim_config *c, const char *const **names);
    /* Temporaries the update borrows, for a configuration. */
    int (*scratch)(const kpl_optim_config *c);
    int scalars;
    /* Optional: KPL_EINVAL naming the field when c cannot be used (only the
     * fields the rule reads; lr and weight_decay are checked for all). */
    kpl_status (*check)(const kpl_optim_config *c);
    kpl_status (*update)(const kpl_optim_update *u);
    /* Optional: its own recipe keys, optimizer.<name>.<key> (keys.h),
     * read from cfg->keys; a NULL-named row ends them. */
    const kpl_key *keys;
} kpl_optim_rule;

/* Adds a rule (borrowed, static) that kpl_optim_create and recipes find by
 * its name.  KPL_EINVAL for a name known already.  From a plugin's
 * constructor: see kpl_plugin_load (trainer.h). */
kpl_status kpl_optim_register(const kpl_optim_rule *rule);
/* The rule called name, or NULL; every rule known, built-ins first. */
const kpl_optim_rule *kpl_optim_rule_find(const char *name);
int kpl_optim_rule_count(void);
const kpl_optim_rule *kpl_optim_rule_at(int i);
/* For rules: a slot's first value, zeros like the parameter (or, for the
 * slot "step", a CPU i64 count of 0), into *slot. */
kpl_status kpl_optim_slot_zeros(const kpl_optim_update *u, const char *slot_name,
                                kpl_tensor **slot);

typedef struct kpl_optim kpl_optim;

/* params: n float tensors (borrowed; they must outlive the optimizer).
 * no_decay: NULL, or n flags (copied).  KPL_EINVAL naming the field for a
 * value out of range (only the fields the kind uses are checked).  Besides
 * the state, the optimizer keeps scratch memory of one or two times the
 * largest parameter per device.  *out owned by the caller. */
kpl_status kpl_optim_create(const kpl_optim_config *cfg, int n, kpl_tensor *const *params,
                            const bool *no_decay, kpl_optim **out);
void kpl_optim_destroy(kpl_optim *o); /* NULL is a no-op */
void kpl_optim_set_lr(kpl_optim *o, double lr); /* lr >= 0 and finite (asserted) */
double kpl_optim_lr(const kpl_optim *o);
/* Parameter groups, as multipliers: parameter i steps with lr x lr_mult
 * and weight_decay x wd_mult (1 and 1 at create), so that a schedule's
 * kpl_optim_set_lr moves every group together (torch's param_groups with
 * lr = base x mult).  KPL_EINVAL for i out of range or a multiplier that
 * is negative or not finite. */
kpl_status kpl_optim_set_multipliers(kpl_optim *o, int i, double lr_mult, double wd_mult);

/* A parameter group: the parameters whose dotted names match `params`
 * (fnmatch(3) without flags, so * crosses dots: "backbone.*",
 * "*.bn*.weight") step with these multipliers. */
typedef struct {
    char params[128];
    double lr_mult, weight_decay_mult;
} kpl_param_group;

/* Sets every parameter's multipliers from the first group whose pattern
 * matches names[i] (the optimizer's parameters' dotted names; unmatched
 * ones keep 1 and 1).  A group that matches no parameter is KPL_EINVAL
 * naming it (a typo would otherwise change nothing).  counts (may be
 * NULL) receives the parameters each group took. */
kpl_status kpl_optim_set_groups(kpl_optim *o, const char *const *names, int ngroups,
                                const kpl_param_group *groups, int *counts);
const kpl_optim_config *kpl_optim_get_config(const kpl_optim *o);
/* Updates every parameter that has a .grad (a parameter without one is
 * left alone, its state too), then clears the gradients (kpl_zero_grad),
 * also when it fails, unless the config says keep_grad.  .grad is read, never written.  KPL_EDTYPE /
 * KPL_ESHAPE for a .grad whose dtype or shape is not its parameter's.
 * Unrecorded (grad mode off); runs on the parameters' device. */
kpl_status kpl_optim_step(kpl_optim *o);

/* The state, for checkpoints.  Slots per parameter: sgd with momentum and
 * lars "momentum_buffer"; adam and adamw "exp_avg", "exp_avg_sq" and
 * "step" (a one-element i64 tensor on the CPU); sgd without momentum none.
 * *names (borrowed, static; names may be NULL) receives the slot names;
 * returns their count. */
int kpl_optim_state_slots(const kpl_optim *o, const char *const **names);
/* Parameter i's state in slot s (borrowed), NULL until a step created it.
 * i and s must be in range (asserted). */
kpl_tensor *kpl_optim_state_get(const kpl_optim *o, int i, int s);
/* Installs a copy of t as parameter i's state in slot s (checkpoint load;
 * t may live on another device): KPL_ESHAPE / KPL_EDTYPE naming the slot
 * when t does not fit, KPL_ERANGE for a negative "step", KPL_EINVAL for i
 * or s out of range.  A slot left NULL starts as at the first step. */
kpl_status kpl_optim_state_set(kpl_optim *o, int i, int s, const kpl_tensor *t);

/* Gradient clipping by the global norm (torch.nn.utils.clip_grad_norm_):
 * total = the 2-norm of all the .grad of params taken together; when
 * max_norm > 0 and total > max_norm, every gradient is multiplied by
 * max_norm / (total + 1e-6).  *total_norm (may be NULL) receives total
 * (inf or nan when a gradient is: nothing is scaled then).  Parameters
 * without .grad are skipped.  Scales in place (a tensor that is the .grad
 * of several parameters once).  KPL_EINVAL for a negative max_norm.  Reads
 * the norm to the host (a GPU sync). */
kpl_status kpl_clip_grad_norm(int n, kpl_tensor *const *params, double max_norm,
                              double *total_norm);

/* ---- learning-rate schedules ------------------------------------------------------- */
/*
 * lr as a pure function of training progress t in epochs (fractional: the
 * trainer passes epoch + step / steps_per_epoch, or whole epochs when the
 * schedule moves per epoch).  A linear warmup from warmup_factor x base_lr
 * at t = 0 to base_lr at t = warmup_epochs comes first; then
 *   constant   base_lr
 *   step       base_lr gamma^floor(t / step_size)
 *   multistep  base_lr gamma^(number of milestones <= t)
 *   cosine     min_lr + (base_lr - min_lr) (1 + cos(pi u)) / 2
 *   poly       min_lr + (base_lr - min_lr) (1 - u)^power
 * with u = (t - warmup_epochs) / (epochs - warmup_epochs) clamped to [0, 1].
 * step and multistep count epochs from 0 (milestones are absolute epochs,
 * as in torchvision's reference recipes).
 */
#define KPL_SCHED_KINDS(X)                                                              \
    X(KPL_SCHED_CONSTANT, "constant") X(KPL_SCHED_STEP, "step")                          \
    X(KPL_SCHED_MULTISTEP, "multistep") X(KPL_SCHED_COSINE, "cosine") X(KPL_SCHED_POLY, "poly")
typedef enum { KPL_SCHED_KINDS(KPL_ENUM_VALUE) } kpl_sched_kind;
/* kpl_sched_kind_names (NULL-terminated), _name, _parse (-1 otherwise) */
KPL_ENUM_DECLARE(kpl_sched_kind);

#define KPL_SCHED_MAX_MILESTONES 16
typedef struct {
    kpl_sched_kind kind;
    double base_lr;
    double epochs;          /* the end of cosine and poly */
    double warmup_epochs;   /* 0: none */
    double warmup_factor;   /* lr at t = 0 as a fraction of base_lr */
    double step_size;       /* step: epochs between decays */
    double gamma;           /* step, multistep: decay factor */
    double milestones[KPL_SCHED_MAX_MILESTONES]; /* multistep, increasing */
    int num_milestones;
    double power;           /* poly */
    double min_lr;          /* cosine, poly: the floor */
} kpl_lr_schedule;
#define KPL_LR_SCHEDULE_INIT {KPL_SCHED_CONSTANT, 0.1, 1, 0, 0, 30, 0.1, {0}, 0, 2.0, 0}

/* KPL_EINVAL naming the field when the schedule cannot be used. */
kpl_status kpl_lr_schedule_check(const kpl_lr_schedule *s);
double kpl_lr_at(const kpl_lr_schedule *s, double t);

#ifdef __cplusplus
}
#endif
#endif /* KPL_OPTIM_H */
