/*
 * optim.c — the optimizers of optim.h (SGD with momentum or Nesterov,
 * Adam, AdamW, LARS) in PyTorch's formulations (clip.c clips by the
 * global gradient norm).  Everything is written with the compute calls of
 * kernels.h, so it runs on whichever device the parameters live, queued in
 * order on that device's stream.
 */
#include "io_impl.h"

#include <fnmatch.h>

#include <math.h>
#include <stdlib.h>
#include <string.h>

/* Temporaries of one parameter's update.  They are views into memory that
 * all the parameters of a device share: a step updates the parameters one
 * after the other, in order on the device's queue, so one parameter's
 * temporaries are dead before the next parameter writes them.  That costs
 * at most a few copies of the largest parameter instead of a copy of the
 * model, and no allocation per step.  Scalars (LARS's norms, trust ratio,
 * conditions) stay on the device, so a step never waits for a GPU. */
#define SC_BYTES 8 /* per scalar: the widest dtype, so every view is aligned */

typedef struct {
    kpl_tensor *tmp[KPL_OPTIM_MAX_SCRATCH]; /* the parameter's shape and dtype */
    kpl_tensor *sc[KPL_OPTIM_MAX_SCALARS];  /* () each: the parameter's dtype, then bools */
    size_t stride;            /* bytes from one temporary to the next in the device's memory */
} scratch;

struct kpl_optim {
    kpl_optim_config cfg;      /* cfg.lr follows kpl_optim_set_lr */
    const kpl_optim_rule *rule;
    int ntmp, nsc;             /* the rule's scratch and scalars for cfg */
    int n;
    kpl_tensor *const *params; /* n, borrowed */
    bool *no_decay;            /* n flags */
    double *mult;              /* n pairs: lr and weight-decay multipliers (parameter groups) */
    int nslots;
    const char *const *slot_names;
    kpl_tensor **state;        /* n * nslots, NULL until a step or state_set creates them */
    scratch *scratch;          /* n */
    kpl_tensor **lr_t;         /* n: each parameter's lr, 0-d in its dtype (traced steps) */
    kpl_status lr_status;      /* of the last lr_fill */
};


static double lr_of(const kpl_optim *o, int i) { return o->cfg.lr * o->mult[2 * i]; }

/* The lr tensors follow every change of the lr: a traced step's graph
 * reads them (a parameter of the graph), so it follows the schedule. */
static kpl_status lr_fill(kpl_optim *o)
{
    for (int i = 0; o->lr_t && i < o->n; i++) KPL_TRY(kpl_k_fill(o->lr_t[i], lr_of(o, i)));
    return KPL_OK;
}

/* ---- the built-in rules ---------------------------------------------------------- */

/* x in [0, 1); NaN is not. */
static bool in_unit_interval(double x) { return x >= 0 && x < 1; }

static kpl_status momentum_check(const kpl_optim_config *c)
{
    KPL_CHECK(in_unit_interval(c->momentum), KPL_EINVAL, "%s: momentum %g must be in [0, 1)",
              c->name, c->momentum);
    return KPL_OK;
}

static kpl_status sgd_check(const kpl_optim_config *c)
{
    KPL_TRY(momentum_check(c));
    KPL_CHECK(!c->nesterov || c->momentum > 0, KPL_EINVAL,
              "sgd: nesterov needs momentum > 0 (momentum is %g)", c->momentum);
    return KPL_OK;
}

static kpl_status adam_check(const kpl_optim_config *c)
{
    KPL_CHECK(in_unit_interval(c->beta1), KPL_EINVAL, "%s: beta1 %g must be in [0, 1)", c->name,
              c->beta1);
    KPL_CHECK(in_unit_interval(c->beta2), KPL_EINVAL, "%s: beta2 %g must be in [0, 1)", c->name,
              c->beta2);
    KPL_CHECK(c->eps > 0 && isfinite(c->eps), KPL_EINVAL, "%s: eps %g must be > 0 and finite",
              c->name, c->eps);
    return KPL_OK;
}

static kpl_status lars_check(const kpl_optim_config *c)
{
    KPL_TRY(momentum_check(c));
    KPL_CHECK(c->trust_coefficient > 0 && isfinite(c->trust_coefficient), KPL_EINVAL,
              "lars: trust_coefficient %g must be > 0 and finite", c->trust_coefficient);
    return KPL_OK;
}

/* The state slots of each rule (optim.h lists them). */
static const char *const momentum_slots[] = {"momentum_buffer"};
static const char *const adam_slots[] = {"exp_avg", "exp_avg_sq", "step"};
enum { ADAM_EXP_AVG, ADAM_EXP_AVG_SQ, ADAM_STEP };

static int sgd_slots(const kpl_optim_config *c, const char *const **names)
{
    *names = momentum_slots;
    return c->momentum > 0 ? 1 : 0;
}
static int momentum_slots_of(const kpl_optim_config *c, const char *const **names)
{
    (void)c;
    *names = momentum_slots;
    return 1;
}
static int adam_slots_of(const kpl_optim_config *c, const char *const **names)
{
    (void)c;
    *names = adam_slots;
    return 3;
}
/* Temporaries: adam two (the moments' increments, then the denominator and
 * the step), sgd two only when Nesterov's g' + momentum v must not
 * overwrite g' = g + wd p. */
static int sgd_scratch(const kpl_optim_config *c) { return c->nesterov && c->weight_decay > 0 ? 2 : 1; }
static int two(const kpl_optim_config *c) { (void)c; return 2; }
static int one(const kpl_optim_config *c) { (void)c; return 1; }

/* A new tensor like p holding a copy of x, or zeros when x is NULL. */
static kpl_status state_new(const kpl_tensor *p, const kpl_tensor *x, kpl_tensor **out)
{
    kpl_tensor *t = NULL;
    KPL_TRY(kpl_tensor_empty_like(p, &t));
    kpl_status st = x ? kpl_k_copy(t, x) : kpl_k_fill(t, 0);
    if (st < 0) {
        kpl_tensor_release(t);
        return st;
    }
    *out = t;
    return KPL_OK;
}

/* tmp = g + wd p, the decayed gradient g', kept out of .grad: the caller
 * may still hold that tensor, or it may be another parameter's too. */
static kpl_status decayed(kpl_tensor *tmp, const kpl_tensor *g, const kpl_tensor *p, double wd)
{
    KPL_TRY(kpl_write_scalar(tmp, KPL_BIN_MUL, (kpl_tensor *)p, wd, false));
    return kpl_write_binary(tmp, KPL_BIN_ADD, tmp, (kpl_tensor *)g);
}

/* torch.optim.SGD: g' = g + wd p;  v = momentum v + g' (v = g' at the
 * first step);  p -= lr (nesterov ? g' + momentum v : v). */
static kpl_status sgd_update(const kpl_optim_update *u)
{
    const kpl_optim_config *c = u->cfg;
    kpl_tensor *p = u->param, *const *tmp = u->scratch;
    const kpl_tensor *g = u->grad, *d = g; /* g', then the step to take times lr */
    double wd = u->weight_decay;
    /* One pass where the device has the fused kernel (the same bits as the
     * ops below: a ResNet-50's 25.6M parameters cross memory 5 times a step
     * instead of 10); a traced step records the ops. */
    kpl_dtype dt = kpl_tensor_dtype(p);
    if (!kpl_tracing() && (dt == KPL_F32 || dt == KPL_F64) &&
        kpl_kernel_registered(KPL_KOP_SGD, kpl_device_type_of(kpl_tensor_device(p)), dt)) {
        kpl_tensor **v = c->momentum > 0 ? &u->slot[0] : NULL;
        bool first = v && !*v;
        if (first) KPL_TRY(kpl_tensor_empty_like(p, v)); /* written whole: v = g' */
        kpl_status st = kpl_k_sgd_update(p, v ? *v : NULL, g, u->lr, c->momentum, wd,
                                         c->nesterov, first);
        if (st < 0 && first) {
            kpl_tensor_release(*v);
            *v = NULL;
        }
        return st;
    }
    if (wd > 0) {
        KPL_TRY(decayed(tmp[0], g, p, wd));
        d = tmp[0];
    }
    if (c->momentum > 0) {
        kpl_tensor **v = &u->slot[0];
        if (!*v) { /* a clone of g', as torch makes it */
            KPL_TRY(state_new(p, d, v));
        } else {
            KPL_TRY(kpl_write_scalar(*v, KPL_BIN_MUL, *v, c->momentum, false));
            KPL_TRY(kpl_write_binary(*v, KPL_BIN_ADD, *v, (kpl_tensor *)d));
        }
        if (c->nesterov) {
            kpl_tensor *t = tmp[d == tmp[0] ? 1 : 0];
            KPL_TRY(kpl_write_scalar(t, KPL_BIN_MUL, *v, c->momentum, false));
            KPL_TRY(kpl_write_binary(t, KPL_BIN_ADD, t, (kpl_tensor *)d));
            d = t;
        } else {
            d = *v;
        }
    }
    /* p -= lr d: d is scaled in place when it is scratch, and into scratch
     * when it is .grad or the momentum buffer.  (kpl_write_*: a traced
     * step sees these as graph ops.) */
    kpl_tensor *s = d == tmp[0] || d == tmp[1] ? (kpl_tensor *)d : tmp[0];
    if (kpl_tracing() && u->lr_tensor) /* the same product, with the lr the graph's to read */
        KPL_TRY(kpl_write_binary(s, KPL_BIN_MUL, (kpl_tensor *)d, u->lr_tensor));
    else
        KPL_TRY(kpl_write_scalar(s, KPL_BIN_MUL, (kpl_tensor *)d, u->lr, false));
    return kpl_write_binary(p, KPL_BIN_SUB, p, s);
}

/* torch.optim.Adam and AdamW, in torch's order of operations:
 * m = b1 m + (1 - b1) g;  v = b2 v + ((1 - b2) g) g;
 * p -= (lr / (1 - b1^t)) m / (sqrt(v) / sqrt(1 - b2^t) + eps), with
 * g = g + wd p for adam and p *= 1 - lr wd first for adamw. */
static kpl_status adam_update(const kpl_optim_update *u)
{
    const kpl_optim_config *c = u->cfg;
    const kpl_tensor *g = u->grad;
    kpl_tensor *p = u->param, *a = u->scratch[0], *b = u->scratch[1];
    kpl_tensor **m = &u->slot[ADAM_EXP_AVG], **v = &u->slot[ADAM_EXP_AVG_SQ];
    kpl_tensor **t = &u->slot[ADAM_STEP];
    if (!*m) KPL_TRY(state_new(p, NULL, m));
    if (!*v) KPL_TRY(state_new(p, NULL, v));
    /* the count lives on the host: the bias corrections are host scalars */
    if (!*t) KPL_TRY(kpl_optim_slot_zeros(u, "step", t));
    int64_t *step = kpl_tensor_host_mutable(*t);
    if (!step) return kpl_last_status();

    double wd = u->weight_decay;
    if (wd > 0 && !strcmp(c->name, "adamw")) {
        KPL_TRY(kpl_k_binary_scalar(p, KPL_BIN_MUL, p, 1 - u->lr * wd, false));
    } else if (wd > 0) {
        KPL_TRY(decayed(a, g, p, wd));
        g = a;
    }
    KPL_TRY(kpl_k_binary_scalar(*m, KPL_BIN_MUL, *m, c->beta1, false));
    KPL_TRY(kpl_k_binary_scalar(b, KPL_BIN_MUL, g, 1 - c->beta1, false));
    KPL_TRY(kpl_k_binary(*m, KPL_BIN_ADD, *m, b));
    KPL_TRY(kpl_k_binary_scalar(*v, KPL_BIN_MUL, *v, c->beta2, false));
    KPL_TRY(kpl_k_binary_scalar(b, KPL_BIN_MUL, g, 1 - c->beta2, false));
    KPL_TRY(kpl_k_binary(b, KPL_BIN_MUL, b, g));
    KPL_TRY(kpl_k_binary(*v, KPL_BIN_ADD, *v, b));

    *step += 1;
    double bc1 = 1 - pow(c->beta1, (double)*step), bc2 = 1 - pow(c->beta2, (double)*step);
    KPL_TRY(kpl_k_unary(b, KPL_UN_SQRT, *v, 0, 0));
    KPL_TRY(kpl_k_binary_scalar(b, KPL_BIN_DIV, b, sqrt(bc2), false));
    KPL_TRY(kpl_k_binary_scalar(b, KPL_BIN_ADD, b, c->eps, false));
    KPL_TRY(kpl_k_binary_scalar(a, KPL_BIN_MUL, *m, u->lr / bc1, false));
    KPL_TRY(kpl_k_binary(a, KPL_BIN_DIV, a, b));
    return kpl_k_binary(p, KPL_BIN_SUB, p, a);
}

/* out (()) = the 2-norm of x, through tmp (x's shape) for the squares; the
 * sum accumulates in f64 (kpl_k_reduce). */
static kpl_status norm2(kpl_tensor *out, kpl_tensor *tmp, const kpl_tensor *x)
{
    KPL_TRY(kpl_k_unary(tmp, KPL_UN_SQUARE, x, 0, 0));
    KPL_TRY(kpl_k_reduce(out, KPL_RED_SUM, tmp, NULL, 0, false, 0));
    return kpl_k_unary(out, KPL_UN_SQRT, out, 0, 0);
}

/* LARS as MLPerf's ResNet-50 reference: g' = g + wd p;
 * trust = eta ||p|| / (||g|| + wd ||p||) when both norms are > 0, else 1;
 * v = momentum v + lr trust g' (v starts at zero);  p -= v.  A no_decay
 * parameter takes plain momentum steps: v = momentum v + lr g. */
enum { SC_PNORM, SC_GNORM, SC_DEN, SC_TRUST, SC_ONE, SC_PPOS, SC_GPOS, SC_COUNT };
static kpl_status lars_update(const kpl_optim_update *u)
{
    const kpl_optim_config *c = u->cfg;
    const kpl_tensor *g = u->grad;
    kpl_tensor *p = u->param, *a = u->scratch[0], *const *sc = u->scalars;
    kpl_tensor **v = &u->slot[0];
    if (!*v) KPL_TRY(state_new(p, NULL, v));
    if (u->no_decay) {
        KPL_TRY(kpl_k_binary_scalar(a, KPL_BIN_MUL, g, u->lr, false));
    } else {
        double wd = u->weight_decay;
        kpl_tensor *pn = sc[SC_PNORM], *gn = sc[SC_GNORM], *trust = sc[SC_TRUST];
        KPL_TRY(norm2(pn, a, p));
        KPL_TRY(norm2(gn, a, g));
        KPL_TRY(kpl_k_binary_scalar(sc[SC_DEN], KPL_BIN_MUL, pn, wd, false));
        KPL_TRY(kpl_k_binary(sc[SC_DEN], KPL_BIN_ADD, sc[SC_DEN], gn));
        KPL_TRY(kpl_k_binary_scalar(trust, KPL_BIN_MUL, pn, c->trust_coefficient, false));
        KPL_TRY(kpl_k_binary(trust, KPL_BIN_DIV, trust, sc[SC_DEN]));
        /* Both norms > 0 (bool minimum is a logical and), else a ratio of
         * 1; the constant is written each time because parameters of other
         * dtypes share its bytes. */
        KPL_TRY(kpl_k_binary_scalar(sc[SC_PPOS], KPL_BIN_GT, pn, 0, false));
        KPL_TRY(kpl_k_binary_scalar(sc[SC_GPOS], KPL_BIN_GT, gn, 0, false));
        KPL_TRY(kpl_k_binary(sc[SC_PPOS], KPL_BIN_MINIMUM, sc[SC_PPOS], sc[SC_GPOS]));
        KPL_TRY(kpl_k_fill(sc[SC_ONE], 1));
        KPL_TRY(kpl_k_where(trust, sc[SC_PPOS], trust, sc[SC_ONE]));
        KPL_TRY(kpl_k_binary_scalar(trust, KPL_BIN_MUL, trust, u->lr, false));
        if (wd > 0) {
            KPL_TRY(decayed(a, g, p, wd));
            KPL_TRY(kpl_k_binary(a, KPL_BIN_MUL, a, trust));
        } else {
            KPL_TRY(kpl_k_binary(a, KPL_BIN_MUL, g, trust));
        }
    }
    KPL_TRY(kpl_k_binary_scalar(*v, KPL_BIN_MUL, *v, c->momentum, false));
    KPL_TRY(kpl_k_binary(*v, KPL_BIN_ADD, *v, a));
    return kpl_k_binary(p, KPL_BIN_SUB, p, *v);
}


static const kpl_optim_rule sgd_rule = {"sgd", sgd_slots, sgd_scratch, 0, sgd_check, sgd_update, NULL};
static const kpl_optim_rule adam_rule = {"adam", adam_slots_of, two, 0, adam_check, adam_update, NULL};
static const kpl_optim_rule adamw_rule = {"adamw", adam_slots_of, two, 0, adam_check,
                                          adam_update, NULL};
/* LARS's scalars: the norms of the parameter and of its gradient, the
 * trust ratio's denominator, the ratio itself, the constant 1, and (bool)
 * the two conditions under which the ratio is used. */
static const kpl_optim_rule lars_rule = {"lars", momentum_slots_of, one, SC_COUNT, lars_check,
                                         lars_update, NULL};

static const void *const builtin[] = {&sgd_rule, &adam_rule, &adamw_rule, &lars_rule, NULL};
/* Registered into the owners' registry at the bottom (io/plugin.c) when
 * kpl loads, before any recipe is read. */
__attribute__((constructor)) static void register_builtin(void)
{
    kpl__owners_builtin(KPL__OWN_OPTIM, builtin);
}

static kpl__registry *const rules = &kpl__owners[KPL__OWN_OPTIM];

kpl_status kpl_optim_register(const kpl_optim_rule *rule) { return kpl__registry_add(rules, rule); }
const kpl_optim_rule *kpl_optim_rule_find(const char *name) { return kpl__registry_find(rules, name); }
int kpl_optim_rule_count(void) { return kpl__registry_count(rules); }
const kpl_optim_rule *kpl_optim_rule_at(int i) { return kpl__registry_at(rules, i); }

kpl_status kpl_optim_slot_zeros(const kpl_optim_update *u, const char *slot_name,
                                kpl_tensor **slot)
{
    KPL_CHECK(u && slot_name && slot, KPL_EINVAL, "optim_slot_zeros: NULL argument");
    if (!strcmp(slot_name, "step")) {
        int64_t n = 1;
        return kpl_tensor_zeros(kpl_device_cpu(), KPL_I64, 1, &n, slot);
    }
    return state_new(u->param, NULL, slot);
}

/* ---- creation ------------------------------------------------------------------- */

/* The rule's checks of the fields it uses; the others are ignored, as a
 * recipe for adam need not say anything about momentum. */
/* Checks c and fills its rule's keys' defaults. */
static kpl_status check_config(kpl_optim_config *c, const kpl_optim_rule **rule)
{
    char known[512];
    *rule = kpl_optim_rule_find(c->name);
    if (!*rule) kpl__registry_names(rules, known, sizeof known);
    KPL_CHECK(*rule, KPL_EINVAL, "optim: unknown optimizer '%.32s' (known: %s)", c->name, known);
    char section[64];
    snprintf(section, sizeof section, "optimizer.%.32s", c->name);
    KPL_TRY(kpl_keyvals_check((*rule)->keys, section, &c->keys));
    KPL_CHECK(c->lr >= 0 && isfinite(c->lr), KPL_EINVAL, "%s: lr %g must be >= 0 and finite",
              c->name, c->lr);
    KPL_CHECK(c->weight_decay >= 0 && isfinite(c->weight_decay), KPL_EINVAL,
              "%s: weight_decay %g must be >= 0 and finite", c->name, c->weight_decay);
    const char *const *names = NULL;
    int ns = (*rule)->slots(c, &names), nt = (*rule)->scratch(c);
    KPL_CHECK(ns >= 0 && ns <= KPL_OPTIM_MAX_SLOTS && (ns == 0 || names), KPL_EINVAL,
              "optimizer %s: %d state slots (0 to %d, named)", c->name, ns, KPL_OPTIM_MAX_SLOTS);
    KPL_CHECK(nt >= 0 && nt <= KPL_OPTIM_MAX_SCRATCH && (*rule)->scalars >= 0 &&
                  (*rule)->scalars <= KPL_OPTIM_MAX_SCALARS,
              KPL_EINVAL, "optimizer %s: %d temporaries and %d scalars (at most %d and %d)",
              c->name, nt, (*rule)->scalars, KPL_OPTIM_MAX_SCRATCH, KPL_OPTIM_MAX_SCALARS);
    return (*rule)->check ? (*rule)->check(c) : KPL_OK;
}

/* Parameter i's scratch views.  The first parameter of a device allocates
 * the device's memory, sized for its largest parameter; the others view
 * the same storages. */
static kpl_status scratch_create(kpl_optim *o, int i)
{
    kpl_tensor *p = o->params[i];
    kpl_device *dev = kpl_tensor_device(p);
    scratch *s = &o->scratch[i];
    int ntmp = o->ntmp, nsc = o->nsc;
    bool scalars = nsc > 0;
    int first = 0;
    while (kpl_tensor_device(o->params[first]) != dev) first++;
    kpl_storage *big = NULL, *small = NULL;
    kpl_status st = KPL_OK;
    if (first == i) {
        s->stride = 64; /* a multiple of 64, as the allocator aligns */
        for (int j = i; j < o->n; j++) {
            size_t b = (kpl_tensor_nbytes(o->params[j]) + 63) / 64 * 64;
            if (kpl_tensor_device(o->params[j]) == dev && b > s->stride) s->stride = b;
        }
        KPL_TRY_GOTO(kpl_storage_create(dev, s->stride * (size_t)(ntmp ? ntmp : 1), &big));
        if (scalars) KPL_TRY_GOTO(kpl_storage_create(dev, (size_t)nsc * SC_BYTES, &small));
    } else {
        const scratch *f = &o->scratch[first];
        s->stride = f->stride;
        big = kpl_tensor_storage(f->tmp[0]);
        kpl_storage_retain(big);
        if (scalars) {
            small = kpl_tensor_storage(f->sc[0]);
            kpl_storage_retain(small);
        }
    }
    kpl_dtype dt = kpl_tensor_dtype(p);
    for (int k = 0; k < ntmp; k++)
        KPL_TRY_GOTO(kpl_tensor_from_storage(big, (size_t)k * s->stride, dt, kpl_tensor_ndim(p),
                                             kpl_tensor_shape(p), &s->tmp[k]));
    /* LARS's two conditions are bools: its last two scalars (the only
     * built-in rule with scalars); other rules get the parameter's dtype */
    bool lars = o->rule == &lars_rule;
    for (int k = 0; k < nsc; k++)
        KPL_TRY_GOTO(kpl_tensor_from_storage(small, (size_t)k * SC_BYTES,
                                             lars && (k == SC_PPOS || k == SC_GPOS) ? KPL_BOOL
                                                                                    : dt,
                                             0, NULL, &s->sc[k]));
fail: /* the views hold their own references to the storages */
    kpl_storage_release(small);
    kpl_storage_release(big);
    return st;
}

kpl_status kpl_optim_create(const kpl_optim_config *cfg, int n, kpl_tensor *const *params,
                            const bool *no_decay, kpl_optim **out)
{
    KPL_CHECK(out, KPL_EINVAL, "optim: NULL out");
    *out = NULL;
    KPL_CHECK(cfg, KPL_EINVAL, "optim: NULL config");
    KPL_CHECK(n >= 0 && (n == 0 || params), KPL_EINVAL, "optim: bad parameter list (%d)", n);
    const kpl_optim_rule *rule = NULL;
    kpl_optim_config c = *cfg;
    KPL_TRY(check_config(&c, &rule));
    cfg = &c;
    for (int i = 0; i < n; i++) {
        KPL_CHECK(params[i], KPL_EINVAL, "optim: parameter %d is NULL", i);
        KPL_CHECK(kpl_dtype_is_float(kpl_tensor_dtype(params[i])), KPL_EDTYPE,
                  "optim: parameter %d has dtype %s, not a floating-point one", i,
                  kpl_dtype_name(kpl_tensor_dtype(params[i])));
    }
    kpl_optim *o = calloc(1, sizeof *o);
    KPL_CHECK(o, KPL_ENOMEM, "optim: out of memory");
    o->cfg = c;
    o->rule = rule;
    o->ntmp = rule->scratch(cfg), o->nsc = rule->scalars;
    o->n = n;
    o->params = params;
    o->nslots = rule->slots(cfg, &o->slot_names);
    size_t m = (size_t)(n ? n : 1);
    o->no_decay = calloc(m, sizeof *o->no_decay);
    o->mult = malloc(2 * m * sizeof *o->mult);
    o->state = calloc(m * (size_t)(o->nslots ? o->nslots : 1), sizeof *o->state);
    o->scratch = calloc(m, sizeof *o->scratch);
    o->lr_t = calloc(m, sizeof *o->lr_t);
    kpl_status st = KPL_OK;
    if (!o->no_decay || !o->mult || !o->state || !o->scratch || !o->lr_t) {
        st = KPL_ERROR(KPL_ENOMEM, "optim: out of memory");
        goto fail;
    }
    if (no_decay) memcpy(o->no_decay, no_decay, (size_t)n * sizeof *no_decay);
    for (size_t i = 0; i < 2 * m; i++) o->mult[i] = 1;
    for (int i = 0; i < n; i++) {
        KPL_TRY_GOTO(scratch_create(o, i));
        KPL_TRY_GOTO(kpl_tensor_empty(kpl_tensor_device(params[i]), kpl_tensor_dtype(params[i]), 0,
                                      NULL, &o->lr_t[i]));
    }
    KPL_TRY_GOTO(lr_fill(o));
    *out = o;
    return KPL_OK;
fail:
    kpl_optim_destroy(o);
    return st;
}

void kpl_optim_destroy(kpl_optim *o)
{
    if (!o) return;
    for (int i = 0; o->state && i < o->n * o->nslots; i++) kpl_tensor_release(o->state[i]);
    for (int i = 0; o->scratch && i < o->n; i++) {
        for (int k = 0; k < KPL_OPTIM_MAX_SCRATCH; k++) kpl_tensor_release(o->scratch[i].tmp[k]);
        for (int k = 0; k < KPL_OPTIM_MAX_SCALARS; k++) kpl_tensor_release(o->scratch[i].sc[k]);
    }
    for (int i = 0; o->lr_t && i < o->n; i++) kpl_tensor_release(o->lr_t[i]);
    free(o->lr_t);
    free(o->scratch);
    free(o->state);
    free(o->no_decay);
    free(o->mult);
    free(o);
}

void kpl_optim_set_lr(kpl_optim *o, double lr)
{
    KPL_ASSERT(lr >= 0 && isfinite(lr), "optim: the learning rate must be >= 0 and finite");
    o->cfg.lr = lr;
    o->lr_status = lr_fill(o); /* a failure is kpl_optim_step's to report */
}

double kpl_optim_lr(const kpl_optim *o) { return o->cfg.lr; }

kpl_status kpl_optim_set_multipliers(kpl_optim *o, int i, double lr_mult, double wd_mult)
{
    KPL_CHECK(i >= 0 && i < o->n, KPL_EINVAL, "optim: parameter %d out of range (%d)", i, o->n);
    KPL_CHECK(lr_mult >= 0 && isfinite(lr_mult) && wd_mult >= 0 && isfinite(wd_mult), KPL_EINVAL,
              "optim: parameter %d: multipliers lr %g and weight decay %g must be >= 0 and finite",
              i, lr_mult, wd_mult);
    o->mult[2 * i] = lr_mult;
    o->mult[2 * i + 1] = wd_mult;
    return o->lr_t && o->lr_t[i] ? kpl_k_fill(o->lr_t[i], lr_of(o, i)) : KPL_OK;
}

kpl_status kpl_optim_set_groups(kpl_optim *o, const char *const *names, int ngroups,
                                const kpl_param_group *groups, int *counts)
{
    KPL_CHECK(ngroups >= 0 && (ngroups == 0 || (groups && names)), KPL_EINVAL,
              "optim: bad parameter groups");
    int *n = calloc((size_t)(ngroups ? ngroups : 1), sizeof *n);
    KPL_CHECK(n, KPL_ENOMEM, "optim: out of memory");
    for (int i = 0; i < o->n; i++) {
        o->mult[2 * i] = o->mult[2 * i + 1] = 1;
        for (int g = 0; g < ngroups; g++)
            if (!fnmatch(groups[g].params, names[i], 0)) {
                kpl_status st = kpl_optim_set_multipliers(o, i, groups[g].lr_mult,
                                                          groups[g].weight_decay_mult);
                if (st < 0) {
                    free(n);
                    return st;
                }
                n[g]++;
                break;
            }
    }
    for (int g = 0; g < ngroups; g++)
        if (!n[g]) {
            /* a group whose parameters all went to earlier groups is as
             * likely a mistake as a typo */
            bool any = false;
            for (int i = 0; i < o->n && !any; i++) any = !fnmatch(groups[g].params, names[i], 0);
            free(n);
            if (any)
                return KPL_ERROR(KPL_EINVAL, "optimizer group %d ('%s') takes no parameter: "
                                 "those it matches belong to earlier groups", g + 1,
                                 groups[g].params);
            return KPL_ERROR(KPL_EINVAL, "optimizer group %d ('%s') matches none of the %d "
                             "parameters (names such as '%s')", g + 1, groups[g].params, o->n,
                             o->n ? names[0] : "");
        }
    if (counts) memcpy(counts, n, (size_t)ngroups * sizeof *n);
    free(n);
    return lr_fill(o); /* the multipliers reset to 1 too */
}


const kpl_optim_config *kpl_optim_get_config(const kpl_optim *o) { return &o->cfg; }

/* ---- state ---------------------------------------------------------------------- */

enum { SHAPE_STR = 96 }; /* room for "(d0,...,d7)" */

static bool same_shape(const kpl_tensor *a, const kpl_tensor *b)
{
    if (kpl_tensor_ndim(a) != kpl_tensor_ndim(b)) return false;
    for (int d = 0; d < kpl_tensor_ndim(a); d++)
        if (kpl_tensor_shape(a)[d] != kpl_tensor_shape(b)[d]) return false;
    return true;
}

static const char *shape_str(const kpl_tensor *t, char *buf)
{
    return kpl_shape_str(kpl_tensor_ndim(t), kpl_tensor_shape(t), buf, SHAPE_STR);
}

int kpl_optim_state_slots(const kpl_optim *o, const char *const **names)
{
    if (names) *names = o->slot_names;
    return o->nslots;
}

static kpl_tensor **state_at(const kpl_optim *o, int i, int s)
{
    return &o->state[(size_t)i * (size_t)o->nslots + (size_t)s];
}

static bool is_step_slot(const kpl_optim *o, int s) { return !strcmp(o->slot_names[s], "step"); }

kpl_tensor *kpl_optim_state_get(const kpl_optim *o, int i, int s)
{
    KPL_ASSERT(i >= 0 && i < o->n && s >= 0 && s < o->nslots,
               "optim_state_get: parameter or slot out of range");
    return *state_at(o, i, s);
}

kpl_status kpl_optim_state_set(kpl_optim *o, int i, int s, const kpl_tensor *t)
{
    KPL_CHECK(o && t, KPL_EINVAL, "optim_state_set: NULL argument");
    KPL_CHECK(i >= 0 && i < o->n, KPL_EINVAL, "optim_state_set: parameter %d out of range [0, %d)",
              i, o->n);
    KPL_CHECK(s >= 0 && s < o->nslots, KPL_EINVAL,
              "optim_state_set: slot %d out of range [0, %d) for %s", s, o->nslots, o->cfg.name);
    const char *const *names;
    kpl_optim_state_slots(o, &names);
    const char *name = names[s];
    kpl_tensor *p = o->params[i], *copy = NULL;
    char b1[SHAPE_STR], b2[SHAPE_STR];
    if (is_step_slot(o, s)) {
        KPL_CHECK(kpl_tensor_dtype(t) == KPL_I64, KPL_EDTYPE,
                  "optim state '%s' of parameter %d: dtype %s, expected i64", name, i,
                  kpl_dtype_name(kpl_tensor_dtype(t)));
        KPL_CHECK(kpl_tensor_numel(t) == 1, KPL_ESHAPE,
                  "optim state '%s' of parameter %d: shape %s, expected one element", name, i,
                  shape_str(t, b1));
        int64_t one = 1;
        KPL_TRY(kpl_tensor_empty(kpl_device_cpu(), KPL_I64, 1, &one, &copy));
    } else {
        KPL_CHECK(kpl_tensor_dtype(t) == kpl_tensor_dtype(p), KPL_EDTYPE,
                  "optim state '%s' of parameter %d: dtype %s, the parameter's is %s", name, i,
                  kpl_dtype_name(kpl_tensor_dtype(t)), kpl_dtype_name(kpl_tensor_dtype(p)));
        KPL_CHECK(same_shape(t, p), KPL_ESHAPE,
                  "optim state '%s' of parameter %d: shape %s, the parameter's is %s", name, i,
                  shape_str(t, b1), shape_str(p, b2));
        KPL_TRY(kpl_tensor_empty_like(p, &copy));
    }
    /* kpl_k_copy crosses devices: a checkpoint's host tensor lands on the
     * parameter's device. */
    kpl_status st = KPL_OK;
    KPL_TRY_GOTO(kpl_k_copy(copy, t));
    if (is_step_slot(o, s)) {
        const int64_t *v = kpl_tensor_host_data(copy);
        if (!v) {
            st = kpl_last_status();
            goto fail;
        }
        if (*v < 0) {
            st = KPL_ERROR(KPL_ERANGE, "optim state '%s' of parameter %d: %lld steps", name, i,
                           (long long)*v);
            goto fail;
        }
    }
    kpl_tensor **slot = state_at(o, i, s);
    if (*slot && kpl_tensor_dtype(*slot) == kpl_tensor_dtype(copy) && same_shape(*slot, copy)) {
        /* into the tensor already there: a traced step's graph keeps
         * updating that one (its momentum buffer) */
        st = kpl_k_copy(*slot, copy);
        kpl_tensor_release(copy);
        return st;
    }
    kpl_tensor_release(*slot);
    *slot = copy;
    return KPL_OK;
fail:
    kpl_tensor_release(copy);
    return st;
}

/* A .grad set by hand (kpl_grad_set) may not fit its parameter; the
 * element-wise calls would broadcast some such gradients silently. */
static kpl_status check_grad(const kpl_optim *o, int i, const kpl_tensor *g)
{
    const kpl_tensor *p = o->params[i];
    KPL_CHECK(kpl_tensor_dtype(g) == kpl_tensor_dtype(p), KPL_EDTYPE,
              "optim: parameter %d is %s but its gradient %s", i,
              kpl_dtype_name(kpl_tensor_dtype(p)), kpl_dtype_name(kpl_tensor_dtype(g)));
    char b1[SHAPE_STR], b2[SHAPE_STR];
    KPL_CHECK(same_shape(g, p), KPL_ESHAPE, "optim: parameter %d has shape %s but its gradient %s",
              i, shape_str(p, b1), shape_str(g, b2));
    return KPL_OK;
}

/* While a step is traced: what the graph cannot repeat is refused, and
 * the rule gets temporaries of the step's own (the optimizer's scratch
 * would be state the graph writes back). */
static kpl_status traced_scratch(kpl_optim *o, int i, kpl_tensor **tmp)
{
    if (o->cfg.keep_grad)
        kpl_trace_refuse("optim: keep_grad leaves the gradients for later steps, which the "
                         "graph does not keep");
    else if (o->rule != &sgd_rule)
        kpl_trace_refuse("optim: rule '%s' updates through kernel calls a trace does not see; "
                         "only sgd steps can be traced yet",
                         o->rule->name);
    else if (kpl_tensor_dtype(o->params[i]) != KPL_F32 && kpl_tensor_dtype(o->params[i]) != KPL_F64)
        kpl_trace_refuse("optim: parameter %d is %s: the step's lr tensor would round the lr "
                         "differently from eager sgd; trace f32 or f64 parameters (AMP keeps "
                         "f32 masters)",
                         i, kpl_dtype_name(kpl_tensor_dtype(o->params[i])));
    else if (o->cfg.momentum > 0 && !*state_at(o, i, 0))
        kpl_trace_refuse("optim: parameter %d has no momentum buffer yet (sgd makes it at its "
                         "first step, a different computation): trace a later step",
                         i);
    kpl_tensor *p = o->params[i];
    for (int k = 0; k < o->ntmp; k++)
        if (!(tmp[k] = kpl_empty(kpl_tensor_device(p), kpl_tensor_dtype(p), kpl_tensor_ndim(p),
                                 kpl_tensor_shape(p))))
            return kpl_last_status();
    return KPL_OK;
}

kpl_status kpl_optim_step(kpl_optim *o)
{
    KPL_CHECK(o, KPL_EINVAL, "optim_step: NULL optimizer");
    bool prev = kpl_set_grad_enabled(false);
    kpl_status st = KPL_OK;
    bool traced = kpl_tracing();
    if (o->lr_status < 0) { /* set_lr could not fill the lr tensors: again */
        if ((st = o->lr_status = lr_fill(o)) < 0) {
            kpl_set_grad_enabled(prev);
            return kpl_error_prefix(st, "optim: the learning rate tensors: ");
        }
    }
    for (int i = 0; i < o->n && st >= 0; i++) {
        const kpl_tensor *g = kpl_grad_get(o->params[i]);
        if (!g) continue; /* no gradient this step: parameter and state stay as they are */
        st = check_grad(o, i, g);
        if (st < 0) break;
        kpl_tensor *tmp[KPL_OPTIM_MAX_SCRATCH] = {0};
        if (traced && (st = traced_scratch(o, i, tmp)) < 0) break;
        kpl_optim_update u = {&o->cfg, o->params[i], g, state_at(o, i, 0),
                              traced ? tmp : o->scratch[i].tmp, o->scratch[i].sc, lr_of(o, i),
                              o->no_decay[i] ? 0 : o->cfg.weight_decay * o->mult[2 * i + 1],
                              o->no_decay[i], o->lr_t[i]};
        st = o->rule->update(&u);
    }
    kpl_set_grad_enabled(prev);
    if (!o->cfg.keep_grad) kpl_zero_grad(o->n, o->params);
    return st;
}
