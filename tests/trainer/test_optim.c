/* test_optim.c — the optimizers of optim.h against PyTorch 1.13 (SGD
 * plain, with momentum, Nesterov and weight decay; Adam; AdamW) and an
 * explicit LARS formula, five steps on small f32 parameters with gradients
 * set by hand; resuming from the state slots equals an uninterrupted run
 * bit for bit; parameters without .grad are left alone; bad configurations
 * are named; gradient clipping by the global norm. */
#include "kpl_test.h"
#include "trainer.h"

/* ---- the parameters and gradients the reference script uses ------------------------- */

/* a (2, 3), b (3) and c (2), which starts at zero (LARS: a trust ratio of
 * 1 at the first step).  Values are multiples of 1/8 and 1/4, exact in
 * f32, so the C and Python sides start from the same bits. */
enum { NP = 3, NUMEL = 11 };
static const int64_t shapes[NP][2] = {{2, 3}, {3, 0}, {2, 0}};
static const int ndims[NP] = {2, 1, 1};

/* Element e of t (f32 or f64) becomes v. */
static void put(kpl_tensor *t, int64_t e, double v)
{
    if (kpl_tensor_dtype(t) == KPL_F64)
        ((double *)kpl_tensor_host_mutable(t))[e] = v;
    else
        ((float *)kpl_tensor_host_mutable(t))[e] = (float)v;
}

/* The parameters: a and b in dtype ab, c in dtype c. */
static void params_create_as(kpl_tensor **p, kpl_dtype ab, kpl_dtype c)
{
    int64_t j = 0;
    for (int i = 0; i < NP; i++) {
        OK(kpl_tensor_empty(kpl_device_cpu(), i < 2 ? ab : c, ndims[i], shapes[i], &p[i]));
        for (int64_t e = 0; e < kpl_tensor_numel(p[i]); e++, j++)
            put(p[i], e, i < 2 ? (double)((j * 5 + 3) % 13) / 8 - 0.75 : 0.0);
        OK(kpl_set_requires_grad(p[i], true));
    }
}

static void params_create(kpl_tensor **p) { params_create_as(p, KPL_F32, KPL_F32); }

/* Copies of p (other tensors, same values), for a resumed run. */
static void params_copy(kpl_tensor *const *p, kpl_tensor **q)
{
    for (int i = 0; i < NP; i++) {
        OK(kpl_tensor_empty_like(p[i], &q[i]));
        OK(kpl_k_copy(q[i], p[i]));
        OK(kpl_set_requires_grad(q[i], true));
    }
}

static void params_release(kpl_tensor **p)
{
    for (int i = 0; i < NP; i++) kpl_tensor_release(p[i]);
}

/* The gradients of step k; c's is zero at step 2 (LARS: a trust ratio of
 * 1 again, and a step of decay alone). */
static void grads_set(kpl_tensor *const *p, int k)
{
    int64_t j = 0;
    for (int i = 0; i < NP; i++) {
        kpl_tensor *g = NULL;
        OK(kpl_tensor_empty_like(p[i], &g));
        for (int64_t e = 0; e < kpl_tensor_numel(g); e++, j++)
            put(g, e, i == 2 && k == 2 ? 0.0 : (double)((j * 7 + k * 3) % 11 - 5) / 4);
        kpl_grad_set(p[i], g);
        kpl_tensor_release(g);
    }
}

/* Steps k0 .. k1 - 1. */
static void run(kpl_optim *o, kpl_tensor *const *p, int k0, int k1)
{
    for (int k = k0; k < k1; k++) {
        grads_set(p, k);
        OK(kpl_optim_step(o));
        for (int i = 0; i < NP; i++) assert_null(kpl_grad_get(p[i]));
    }
}

/* ---- against PyTorch -------------------------------------------------------------- */

/* Printed by this script (PyTorch 1.13.0, numpy 1.24; LARS, which torch
 * lacks, by the explicit formula of optim.h in float64), lines wrapped:
 *
 * import torch, numpy as np
 * SHAPES = [(2, 3), (3,), (2,)]              # a, b, c (c starts at zero)
 * def init():
 *     ps, j = [], 0
 *     for i, s in enumerate(SHAPES):
 *         n = int(np.prod(s))
 *         v = [((j + k) * 5 + 3) % 13 / 8 - 0.75 if i < 2 else 0.0 for k in range(n)]
 *         ps.append(torch.tensor(v, dtype=torch.float32).reshape(s)); j += n
 *     return ps
 * def grads(k):
 *     gs, j = [], 0
 *     for i, s in enumerate(SHAPES):
 *         n = int(np.prod(s))
 *         v = [(((j + e) * 7 + k * 3) % 11 - 5) / 4 for e in range(n)]
 *         if i == 2 and k == 2: v = [0.0] * n  # a zero gradient (lars: trust 1)
 *         gs.append(torch.tensor(v, dtype=torch.float32).reshape(s)); j += n
 *     return gs
 * def run_torch(make, nd, steps=5):
 *     ps = [p.requires_grad_() for p in init()]
 *     groups = [{'params': [p]} if not nd[i] else {'params': [p], 'weight_decay': 0.0}
 *               for i, p in enumerate(ps)]
 *     opt = make(groups)
 *     for k in range(steps):
 *         for p, g in zip(ps, grads(k)): p.grad = g.clone()
 *         opt.step()
 *     return torch.cat([p.detach().flatten() for p in ps]).tolist()
 * def run_lars(lr, m, wd, eta, nd, steps=5):   # float64, MLPerf's formula
 *     ps = [p.double().numpy().copy() for p in init()]
 *     vs = [np.zeros_like(p) for p in ps]
 *     for k in range(steps):
 *         for i, g in enumerate(grads(k)):
 *             g = g.double().numpy(); p = ps[i]
 *             if nd[i]:
 *                 u = lr * g
 *             else:
 *                 pn, gn = np.linalg.norm(p), np.linalg.norm(g)
 *                 t = eta * pn / (gn + wd * pn) if pn > 0 and gn > 0 else 1.0
 *                 u = lr * t * (g + wd * p)
 *             vs[i] = m * vs[i] + u; ps[i] = p - vs[i]
 *     return np.concatenate([p.flatten() for p in ps]).tolist()
 * N, D = [False] * 3, [False, True, True]
 * S, A, W = torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW
 * cases = {
 *   'sgd_plain':    run_torch(lambda g: S(g, lr=0.1), N),
 *   'sgd_momentum': run_torch(lambda g: S(g, lr=0.1, momentum=0.9), N),
 *   'sgd_nesterov': run_torch(lambda g: S(g, lr=0.1, momentum=0.9, nesterov=True), N),
 *   'sgd_nesterov_wd': run_torch(lambda g: S(g, lr=0.1, momentum=0.9, nesterov=True,
 *                                            weight_decay=0.05), N),
 *   'sgd_wd':       run_torch(lambda g: S(g, lr=0.1, weight_decay=0.05), N),
 *   'sgd_momentum_wd_nodecay': run_torch(lambda g: S(g, lr=0.1, momentum=0.9,
 *                                                    weight_decay=0.05), D),
 *   'adam':         run_torch(lambda g: A(g, lr=0.01), N),
 *   'adam_wd':      run_torch(lambda g: A(g, lr=0.01, betas=(0.8, 0.99), eps=1e-6,
 *                                         weight_decay=0.1), N),
 *   'adamw':        run_torch(lambda g: W(g, lr=0.01, weight_decay=0.1), N),
 *   'adamw_nodecay': run_torch(lambda g: W(g, lr=0.01, weight_decay=0.1), D),
 *   'lars':         run_lars(0.5, 0.9, 0.01, 0.02, N),
 *   'lars_nodecay': run_lars(0.5, 0.9, 0.01, 0.02, D),
 * }
 * for k, v in cases.items():
 *     print('static const double ref_%s[] = {%s};' % (k, ', '.join('%.9g' % x for x in v)))
 */
static const double ref_sgd_plain[] = {
    -0.225000024, 0.075000003, -0.699999988, -0.125, 0.449999988, -0.324999988,
    -0.0249999929, 0.825000048, -0.225000009, -0.075000003, 0.0500000007};
static const double ref_sgd_momentum[] = {
    0.151087493, -0.256379992, -0.687220037, -0.39646247, 0.322222501, -0.108617537,
    -0.0928599909, 0.900825024, -0.0525150187, -0.0247574914, 0.0729274973};
static const double ref_sgd_nesterov[] = {
    0.248478726, -0.380741984, -0.643498003, -0.36931625, 0.29000023, 0.0272442345,
    -0.221074, 0.960742474, -0.0472635031, -0.0972817317, 0.115634747};
static const double ref_sgd_nesterov_wd[] = {
    0.256289423, -0.384085387, -0.584252417, -0.344126552, 0.257551104, 0.0573840849,
    -0.2249901, 0.899187565, -0.0412656367, -0.0968190134, 0.115121581};
static const double ref_sgd_wd[] = {
    -0.218196481, 0.0709222332, -0.68155849, -0.12016917, 0.438490599, -0.313990027,
    -0.0276007392, 0.806059062, -0.22004661, -0.075251855, 0.0498749949};
static const double ref_sgd_momentum_wd_nodecay[] = {
    0.163491294, -0.264143914, -0.640256286, -0.38066864, 0.294361651, -0.0817506611,
    -0.0928599909, 0.900825024, -0.0525150187, -0.0247574914, 0.0729274973};
static const double ref_adam[] = {
    -0.347037733, 0.22031568, -0.739187241, -0.1413358, 0.480060816, -0.47537142,
    0.11234615, 0.751246274, -0.2311721, -0.0064112898, 0.00955549069};
static const double ref_adam_wd[] = {
    -0.348354369, 0.220638692, -0.735405684, -0.138845429, 0.479126692, -0.473892927,
    0.112162016, 0.738933325, -0.232910678, -0.00641397806, 0.00989254843};
static const double ref_adamw[] = {
    -0.345244974, 0.219145417, -0.7354846, -0.14065966, 0.477632552, -0.472938746,
    0.111758485, 0.747517169, -0.229992777, -0.00638553314, 0.00952890329};
static const double ref_adamw_nodecay[] = {
    -0.345244974, 0.219145417, -0.7354846, -0.14065966, 0.477632552, -0.472938746,
    0.11234615, 0.751246274, -0.2311721, -0.0064112898, 0.00955549069};
static const double ref_lars[] = {
    -0.345142542, 0.220987964, -0.748511449, -0.137814622, 0.489796061, -0.479703352,
    0.115199208, 0.756734227, -0.238227559, -1.53259574, 0.52235451};
static const double ref_lars_nodecay[] = {
    -0.345142542, 0.220987964, -0.748511449, -0.137814622, 0.489796061, -0.479703352,
    -0.9643, 1.504125, 0.737425, -0.1237875, 0.3646375};

typedef struct {
    const char *name;
    const char *rule;
    double lr, momentum;
    bool nesterov;
    double weight_decay, beta1, beta2, eps, eta;
    bool no_decay; /* b and c flagged, as the script's D */
    const double *ref;
} optim_case;

static const optim_case cases[] = {
    {"sgd plain", "sgd", 0.1, 0, false, 0, 0.9, 0.999, 1e-8, 0.001, false, ref_sgd_plain},
    {"sgd momentum", "sgd", 0.1, 0.9, false, 0, 0.9, 0.999, 1e-8, 0.001, false,
     ref_sgd_momentum},
    {"sgd nesterov", "sgd", 0.1, 0.9, true, 0, 0.9, 0.999, 1e-8, 0.001, false,
     ref_sgd_nesterov},
    {"sgd nesterov wd", "sgd", 0.1, 0.9, true, 0.05, 0.9, 0.999, 1e-8, 0.001, false,
     ref_sgd_nesterov_wd},
    {"sgd wd", "sgd", 0.1, 0, false, 0.05, 0.9, 0.999, 1e-8, 0.001, false, ref_sgd_wd},
    {"sgd momentum wd no_decay", "sgd", 0.1, 0.9, false, 0.05, 0.9, 0.999, 1e-8, 0.001,
     true, ref_sgd_momentum_wd_nodecay},
    {"adam", "adam", 0.01, 0, false, 0, 0.9, 0.999, 1e-8, 0.001, false, ref_adam},
    {"adam wd", "adam", 0.01, 0, false, 0.1, 0.8, 0.99, 1e-6, 0.001, false, ref_adam_wd},
    {"adamw", "adamw", 0.01, 0, false, 0.1, 0.9, 0.999, 1e-8, 0.001, false, ref_adamw},
    {"adamw no_decay", "adamw", 0.01, 0, false, 0.1, 0.9, 0.999, 1e-8, 0.001, true,
     ref_adamw_nodecay},
    {"lars", "lars", 0.5, 0.9, false, 0.01, 0.9, 0.999, 1e-8, 0.02, false, ref_lars},
    {"lars no_decay", "lars", 0.5, 0.9, false, 0.01, 0.9, 0.999, 1e-8, 0.02, true,
     ref_lars_nodecay},
};

static kpl_optim_config config_of(const optim_case *c)
{
    kpl_optim_config oc = KPL_OPTIM_CONFIG_INIT;
    snprintf(oc.name, sizeof oc.name, "%s", c->rule);
    oc.lr = c->lr;
    oc.momentum = c->momentum;
    oc.nesterov = c->nesterov;
    oc.weight_decay = c->weight_decay;
    oc.beta1 = c->beta1;
    oc.beta2 = c->beta2;
    oc.eps = c->eps;
    oc.trust_coefficient = c->eta;
    return oc;
}

static const bool no_decay_bc[NP] = {false, true, true};

static kpl_optim *optim_of(const optim_case *c, kpl_tensor *const *p)
{
    kpl_optim_config oc = config_of(c);
    kpl_optim *o = NULL;
    OK(kpl_optim_create(&oc, NP, p, c->no_decay ? no_decay_bc : NULL, &o));
    return o;
}

static void test_against_reference(void **state)
{
    (void)state;
    for (size_t n = 0; n < sizeof cases / sizeof cases[0]; n++) {
        const optim_case *c = &cases[n];
        kpl_tensor *p[NP];
        params_create(p);
        kpl_optim *o = optim_of(c, p);
        run(o, p, 0, 5);
        double worst = 0;
        for (int i = 0, j = 0; i < NP; i++)
            for (int64_t e = 0; e < kpl_tensor_numel(p[i]); e++, j++) {
                double got = tget(p[i], e), want = c->ref[j];
                /* 1e-6 relative; the absolute term covers values near zero. */
                assert_close(got, want, 1e-6, 1e-7, c->name, j);
                double rel = fabs(got - want) / fmax(fabs(want), 1e-3);
                if (rel > worst) worst = rel;
            }
        print_message("%-26s largest relative difference %.2g\n", c->name, worst);
        kpl_optim_destroy(o);
        params_release(p);
    }
}

static void assert_same_bits(kpl_tensor *a, kpl_tensor *b, const char *what)
{
    assert_int_equal(kpl_tensor_dtype(a), kpl_tensor_dtype(b));
    assert_int_equal(kpl_tensor_numel(a), kpl_tensor_numel(b));
    if (memcmp(kpl_tensor_host_data(a), kpl_tensor_host_data(b), kpl_tensor_nbytes(a)) != 0)
        fail_msg("%s: the bits differ", what);
}

/* Parameters of two dtypes on one device share the scratch memory, LARS's
 * one-element values too.  With c in f64, and first in the optimizer's
 * list so that the f32 parameters write the shared bytes after it, a and b
 * take the very steps of the all-f32 run, and c follows the float64 LARS
 * formula to the 9 digits printed (PyTorch's f32 AdamW to 1e-6). */
static void test_mixed_dtypes(void **state)
{
    (void)state;
    static const struct {
        size_t c;
        double rtol;
    } runs[] = {{10, 1e-8}, {11, 1e-8}, {8, 1e-6}}; /* lars, lars no_decay, adamw */
    for (size_t r = 0; r < sizeof runs / sizeof runs[0]; r++) {
        const optim_case *c = &cases[runs[r].c];
        kpl_tensor *p[NP], *q[NP];
        params_create(p);
        params_create_as(q, KPL_F32, KPL_F64);
        kpl_optim *op = optim_of(c, p);
        kpl_optim_config oc = config_of(c);
        kpl_tensor *order[NP] = {q[2], q[0], q[1]};
        const bool nd[NP] = {c->no_decay, false, c->no_decay}; /* c, a, b */
        kpl_optim *oq = NULL;
        OK(kpl_optim_create(&oc, NP, order, nd, &oq));
        run(op, p, 0, 5);
        run(oq, q, 0, 5);
        assert_same_bits(q[0], p[0], c->name);
        assert_same_bits(q[1], p[1], c->name);
        for (int64_t e = 0; e < 2; e++)
            assert_close(tget(q[2], e), c->ref[9 + e], runs[r].rtol, 0, c->name, 9 + e);
        kpl_optim_destroy(op);
        kpl_optim_destroy(oq);
        params_release(p);
        params_release(q);
    }
}

/* ---- state slots and resuming ------------------------------------------------------- */

/* Three steps, the state copied out through state_get into fresh tensors,
 * a new optimizer on copies of the parameters given it through state_set,
 * three more steps: bit-identical to six uninterrupted steps, which is what
 * resuming from a checkpoint relies on. */
static void test_resume_equals_uninterrupted(void **state)
{
    (void)state;
    static const struct {
        size_t c; /* index in cases */
        int nslots;
        const char *names[3];
    } want[] = {
        {0, 0, {NULL}},                                    /* sgd plain: no state */
        {3, 1, {"momentum_buffer"}},                       /* sgd nesterov wd */
        {5, 1, {"momentum_buffer"}},                       /* sgd momentum, no_decay */
        {7, 3, {"exp_avg", "exp_avg_sq", "step"}},         /* adam wd */
        {9, 3, {"exp_avg", "exp_avg_sq", "step"}},         /* adamw no_decay */
        {10, 1, {"momentum_buffer"}},                      /* lars */
        {11, 1, {"momentum_buffer"}},                      /* lars no_decay */
    };
    for (size_t w = 0; w < sizeof want / sizeof want[0]; w++) {
        const optim_case *c = &cases[want[w].c];
        kpl_tensor *full[NP], *first[NP], *resumed[NP];

        params_create(full);
        kpl_optim *o = optim_of(c, full);
        const char *const *names = NULL;
        assert_int_equal(kpl_optim_state_slots(o, &names), want[w].nslots);
        assert_int_equal(kpl_optim_state_slots(o, NULL), want[w].nslots);
        for (int s = 0; s < want[w].nslots; s++) {
            assert_string_equal(names[s], want[w].names[s]);
            for (int i = 0; i < NP; i++) assert_null(kpl_optim_state_get(o, i, s));
        }
        run(o, full, 0, 6);

        params_create(first);
        kpl_optim *o1 = optim_of(c, first);
        run(o1, first, 0, 3);
        int ns = want[w].nslots;
        kpl_tensor *saved[NP][3] = {{NULL}};
        for (int i = 0; i < NP; i++)
            for (int s = 0; s < ns; s++) {
                kpl_tensor *t = NN(kpl_optim_state_get(o1, i, s));
                OK(kpl_tensor_empty_like(t, &saved[i][s]));
                OK(kpl_k_copy(saved[i][s], t));
            }
        if (ns == 3) { /* adam's step count: a host i64 */
            kpl_tensor *t = kpl_optim_state_get(o1, 0, 2);
            assert_int_equal(kpl_tensor_dtype(t), KPL_I64);
            assert_int_equal(kpl_device_type_of(kpl_tensor_device(t)), KPL_DEVICE_CPU);
            assert_float_equal(tget(t, 0), 3, 0);
        }
        params_copy(first, resumed);
        kpl_optim_destroy(o1);
        params_release(first);

        kpl_optim *o2 = optim_of(c, resumed);
        for (int i = 0; i < NP; i++)
            for (int s = 0; s < ns; s++) {
                OK(kpl_optim_state_set(o2, i, s, saved[i][s]));
                kpl_tensor_release(saved[i][s]);
            }
        run(o2, resumed, 3, 6);
        for (int i = 0; i < NP; i++) {
            assert_same_bits(resumed[i], full[i], c->name);
            for (int s = 0; s < ns; s++)
                assert_same_bits(kpl_optim_state_get(o2, i, s), kpl_optim_state_get(o, i, s),
                                 names[s]);
        }
        kpl_optim_destroy(o2);
        kpl_optim_destroy(o);
        params_release(resumed);
        params_release(full);
    }
}

/* Parameter groups as multipliers: parameter a with (lr x 0.5, weight
 * decay x 0.25) steps exactly as it does under an optimizer whose lr and
 * weight decay are those products, and the others as under the plain
 * optimizer, for every update rule. */
static void test_group_multipliers(void **state)
{
    (void)state;
    for (size_t n = 0; n < sizeof cases / sizeof cases[0]; n++) {
        const optim_case *c = &cases[n];
        kpl_tensor *p[NP], *plain[NP], *scaled[NP];
        params_create(p);
        params_create(plain);
        params_create(scaled);
        kpl_optim *o = optim_of(c, p), *op = optim_of(c, plain);
        OK(kpl_optim_set_multipliers(o, 0, 0.5, 0.25));
        kpl_optim_config sc = config_of(c);
        sc.lr *= 0.5;
        sc.weight_decay *= 0.25;
        kpl_optim *os = NULL;
        OK(kpl_optim_create(&sc, NP, scaled, c->no_decay ? no_decay_bc : NULL, &os));
        for (int k = 0; k < 5; k++) {
            kpl_optim_set_lr(o, c->lr * (1 - 0.1 * k)); /* a schedule moves every group */
            kpl_optim_set_lr(op, c->lr * (1 - 0.1 * k));
            kpl_optim_set_lr(os, sc.lr * (1 - 0.1 * k));
            run(o, p, k, k + 1);
            run(op, plain, k, k + 1);
            run(os, scaled, k, k + 1);
        }
        /* lr x (1 - 0.1 k) x 0.5 and lr x 0.5 x (1 - 0.1 k) may differ in the
         * last bit: compare closely rather than bit for bit */
        for (int64_t e = 0; e < kpl_tensor_numel(p[0]); e++)
            assert_close(tget(p[0], e), tget(scaled[0], e), 1e-6, 1e-7, c->name, e);
        for (int i = 1; i < NP; i++) assert_same_bits(p[i], plain[i], c->name);
        /* and the multipliers matter: a differs from the plain run */
        double diff = 0;
        for (int64_t e = 0; e < kpl_tensor_numel(p[0]); e++)
            diff += fabs(tget(p[0], e) - tget(plain[0], e));
        assert_true(diff > 1e-3);
        FAILS(kpl_optim_set_multipliers(o, NP, 1, 1), KPL_EINVAL, "parameter 3 out of range");
        FAILS(kpl_optim_set_multipliers(o, 0, -1, 1), KPL_EINVAL, "must be >= 0 and finite");
        kpl_optim_destroy(o);
        kpl_optim_destroy(op);
        kpl_optim_destroy(os);
        params_release(p);
        params_release(plain);
        params_release(scaled);
    }
}

static void test_state_set_checks(void **state)
{
    (void)state;
    kpl_tensor *p[NP];
    params_create(p);
    kpl_optim *o = optim_of(&cases[6], p); /* adam */
    int64_t s3 = 3, s23[2] = {2, 3}, one = 1;
    kpl_tensor *wrong_shape = NULL, *wrong_dtype = NULL, *steps = NULL, *f32_step = NULL;
    OK(kpl_tensor_zeros(kpl_device_cpu(), KPL_F32, 1, &s3, &wrong_shape));
    OK(kpl_tensor_zeros(kpl_device_cpu(), KPL_F64, 2, s23, &wrong_dtype));
    OK(kpl_tensor_zeros(kpl_device_cpu(), KPL_I64, 1, &one, &steps));
    OK(kpl_tensor_zeros(kpl_device_cpu(), KPL_F32, 1, &one, &f32_step));
    FAILS(kpl_optim_state_set(o, 0, 0, wrong_shape), KPL_ESHAPE, "'exp_avg' of parameter 0");
    FAILS(kpl_optim_state_set(o, 0, 1, wrong_dtype), KPL_EDTYPE, "'exp_avg_sq' of parameter 0");
    FAILS(kpl_optim_state_set(o, 0, 2, f32_step), KPL_EDTYPE, "'step' of parameter 0");
    FAILS(kpl_optim_state_set(o, 0, 2, wrong_shape), KPL_EDTYPE, "'step'");
    FAILS(kpl_optim_state_set(o, 0, 3, steps), KPL_EINVAL, "slot 3");
    FAILS(kpl_optim_state_set(o, NP, 0, steps), KPL_EINVAL, "parameter 3");
    ((int64_t *)kpl_tensor_host_mutable(steps))[0] = -1;
    FAILS(kpl_optim_state_set(o, 1, 2, steps), KPL_ERANGE, "'step' of parameter 1: -1 steps");
    for (int s = 0; s < 3; s++) assert_null(kpl_optim_state_get(o, 0, s));
    assert_null(kpl_optim_state_get(o, 1, 2));
    /* The step count alone, the moments left to start at zero: the bias
     * corrections of step 8 apply at the next step. */
    ((int64_t *)kpl_tensor_host_mutable(steps))[0] = 7;
    OK(kpl_optim_state_set(o, 1, 2, steps));
    ((int64_t *)kpl_tensor_host_mutable(steps))[0] = 100; /* a copy was installed */
    run(o, p, 0, 1);
    assert_float_equal(tget(kpl_optim_state_get(o, 1, 2), 0), 8, 0);
    assert_float_equal(tget(kpl_optim_state_get(o, 0, 2), 0), 1, 0);
    kpl_tensor_release(wrong_shape);
    kpl_tensor_release(wrong_dtype);
    kpl_tensor_release(steps);
    kpl_tensor_release(f32_step);
    kpl_optim_destroy(o);
    params_release(p);
}

/* ---- what a step touches ----------------------------------------------------------- */

/* A parameter without .grad keeps its value and its state (adam's step
 * count is per parameter, as in PyTorch); .grad itself is never written,
 * even by weight decay, and is cleared after the step, gradient buffers
 * included. */
static void test_step_touches_only_what_it_should(void **state)
{
    (void)state;
    kpl_tensor *p[NP];
    params_create(p);
    kpl_optim *o = optim_of(&cases[7], p); /* adam with weight decay */
    grads_set(p, 0);
    kpl_grad_set(p[1], NULL);
    kpl_tensor *g0 = kpl_grad_get(p[0]);
    kpl_tensor_retain(g0);
    float before[NP][6];
    for (int i = 0; i < NP; i++) OK(kpl_tensor_to_host(p[i], before[i], sizeof before[i]));
    float g_before[6];
    OK(kpl_tensor_to_host(g0, g_before, sizeof g_before));
    OK(kpl_optim_step(o));
    assert_memory_equal(kpl_tensor_host_data(g0), g_before, sizeof g_before);
    assert_memory_equal(kpl_tensor_host_data(p[1]), before[1], 3 * sizeof(float));
    assert_memory_not_equal(kpl_tensor_host_data(p[0]), before[0], 6 * sizeof(float));
    for (int s = 0; s < 3; s++) assert_null(kpl_optim_state_get(o, 1, s));
    assert_float_equal(tget(kpl_optim_state_get(o, 0, 2), 0), 1, 0);

    /* A second step with every gradient: b's count starts, a's goes on. */
    run(o, p, 1, 2);
    assert_float_equal(tget(kpl_optim_state_get(o, 0, 2), 0), 2, 0);
    assert_float_equal(tget(kpl_optim_state_get(o, 1, 2), 0), 1, 0);

    /* A gradient buffer (DDP's bucket views) is read, then let go. */
    kpl_tensor *buf = NULL;
    OK(kpl_tensor_empty_like(p[0], &buf));
    OK(kpl_k_fill(buf, 0.25));
    OK(kpl_grad_set_buffer(p[0], buf));
    assert_true(kpl_grad_is_buffer(p[0]));
    OK(kpl_optim_step(o));
    assert_null(kpl_grad_get(p[0]));
    assert_false(kpl_grad_is_buffer(p[0]));
    for (int64_t e = 0; e < 6; e++) assert_float_equal(tget(buf, e), 0.25, 0);
    assert_float_equal(tget(kpl_optim_state_get(o, 0, 2), 0), 3, 0);
    assert_float_equal(tget(kpl_optim_state_get(o, 1, 2), 0), 1, 0);

    /* A gradient that does not fit its parameter is an error (the
     * element-wise calls would broadcast it), and the gradients are still
     * cleared. */
    int64_t s6 = 6;
    kpl_tensor *flat = NULL;
    OK(kpl_tensor_zeros(kpl_device_cpu(), KPL_F32, 1, &s6, &flat));
    kpl_grad_set(p[0], flat);
    FAILS(kpl_optim_step(o), KPL_ESHAPE, "parameter 0 has shape (2,3) but its gradient (6)");
    assert_null(kpl_grad_get(p[0]));

    kpl_tensor_release(flat);
    kpl_tensor_release(buf);
    kpl_tensor_release(g0);
    kpl_optim_destroy(o);
    params_release(p);
}

/* ---- configuration ------------------------------------------------------------------ */

static void test_config(void **state)
{
    (void)state;
    /* the built-in rules, in order, found by name */
    const char *builtin[] = {"sgd", "adam", "adamw", "lars"};
    assert_true(kpl_optim_rule_count() >= 4);
    for (int i = 0; i < 4; i++) {
        assert_string_equal(kpl_optim_rule_at(i)->name, builtin[i]);
        assert_ptr_equal(kpl_optim_rule_find(builtin[i]), kpl_optim_rule_at(i));
    }
    assert_null(kpl_optim_rule_find("rmsprop"));
    assert_null(kpl_optim_rule_find(NULL));

    kpl_tensor *p[NP];
    params_create(p);
    kpl_optim *o = NULL;
    kpl_optim_config oc = KPL_OPTIM_CONFIG_INIT;
#define BAD(field, value, needle)                                                     \
    do {                                                                              \
        kpl_optim_config b_ = oc;                                                     \
        b_.field = value;                                                             \
        FAILS(kpl_optim_create(&b_, NP, p, NULL, &o), KPL_EINVAL, needle);            \
        assert_null(o);                                                               \
    } while (0)
    BAD(lr, -1, "sgd: lr -1 must be >= 0");
    BAD(lr, NAN, "sgd: lr nan");
    BAD(momentum, 1, "sgd: momentum 1 must be in [0, 1)");
    BAD(momentum, -0.5, "sgd: momentum -0.5");
    BAD(nesterov, true, "sgd: nesterov needs momentum > 0");
    BAD(weight_decay, -1e-4, "sgd: weight_decay -0.0001 must be >= 0");
    {
        kpl_optim_config b = oc;
        snprintf(b.name, sizeof b.name, "rmsprop");
        FAILS(kpl_optim_create(&b, NP, p, NULL, &o), KPL_EINVAL,
              "optim: unknown optimizer 'rmsprop' (known: sgd, adam, adamw, lars");
    }
    snprintf(oc.name, sizeof oc.name, "adam");
    oc.momentum = 5; /* adam has no momentum field to check */
    BAD(beta1, 1, "adam: beta1 1 must be in [0, 1)");
    BAD(beta2, -0.1, "adam: beta2 -0.1 must be in [0, 1)");
    BAD(eps, 0, "adam: eps 0 must be > 0");
    BAD(eps, -1e-8, "adam: eps -1e-08");
    snprintf(oc.name, sizeof oc.name, "adamw");
    BAD(lr, -0.1, "adamw: lr -0.1");
    snprintf(oc.name, sizeof oc.name, "lars");
    oc.momentum = 0.9;
    BAD(momentum, 1.5, "lars: momentum 1.5");
    BAD(trust_coefficient, 0, "lars: trust_coefficient 0 must be > 0");
#undef BAD
    snprintf(oc.name, sizeof oc.name, "adam");
    FAILS(kpl_optim_create(NULL, NP, p, NULL, &o), KPL_EINVAL, "NULL config");
    FAILS(kpl_optim_create(&oc, 1, NULL, NULL, &o), KPL_EINVAL, "bad parameter list");

    OK(kpl_optim_create(&oc, NP, p, NULL, &o));
    assert_float_equal(kpl_optim_lr(o), 0.1, 0);
    kpl_optim_set_lr(o, 0.025);
    assert_float_equal(kpl_optim_lr(o), 0.025, 0);
    const kpl_optim_config *got = kpl_optim_get_config(o);
    assert_string_equal(got->name, "adam");
    assert_float_equal(got->lr, 0.025, 0);
    assert_float_equal(got->beta2, 0.999, 0);
    kpl_optim_destroy(o);
    kpl_optim_destroy(NULL);

    /* No parameters: a step does nothing. */
    OK(kpl_optim_create(&oc, 0, NULL, NULL, &o));
    OK(kpl_optim_step(o));
    kpl_optim_destroy(o);
    params_release(p);
}

/* A learning rate set between steps is the one the next step uses: two
 * plain SGD steps at 0.1 equal one at 0.1 and one at 0.05 twice over. */
static void test_set_lr_applies(void **state)
{
    (void)state;
    kpl_tensor *p[NP], *q[NP];
    params_create(p);
    params_create(q);
    kpl_optim *a = optim_of(&cases[0], p), *b = optim_of(&cases[0], q);
    run(a, p, 0, 2);
    run(b, q, 0, 1);
    kpl_optim_set_lr(b, 0.05);
    grads_set(q, 1);
    for (int i = 0; i < NP; i++) {
        kpl_tensor *g = kpl_grad_get(q[i]);
        OK(kpl_k_binary_scalar(g, KPL_BIN_MUL, g, 2, false));
    }
    OK(kpl_optim_step(b));
    for (int i = 0; i < NP; i++)
        for (int64_t e = 0; e < kpl_tensor_numel(p[i]); e++)
            assert_float_equal(tget(q[i], e), tget(p[i], e), 1e-7);
    kpl_optim_destroy(a);
    kpl_optim_destroy(b);
    params_release(p);
    params_release(q);
}

/* ---- clip_grad_norm ------------------------------------------------------------------ */

static kpl_tensor *vec(int64_t n, const float *v)
{
    kpl_tensor *t = NULL;
    OK(kpl_tensor_from_data(kpl_device_cpu(), KPL_F32, 1, &n, v, &t));
    return t;
}

static void test_clip_grad_norm(void **state)
{
    (void)state;
    kpl_tensor *p[3];
    for (int i = 0; i < 3; i++) {
        int64_t n = 2;
        OK(kpl_tensor_zeros(kpl_device_cpu(), KPL_F32, 1, &n, &p[i]));
        OK(kpl_set_requires_grad(p[i], true));
    }
    const float ga[2] = {3, 4}, gb[2] = {12, 0};
    kpl_tensor *a = vec(2, ga), *b = vec(2, gb);
    kpl_grad_set(p[0], a);
    kpl_grad_set(p[1], b); /* p[2] has no gradient: skipped */

    /* sqrt(9 + 16 + 144) = 13: below max_norm nothing moves. */
    double total = -1;
    OK(kpl_clip_grad_norm(3, p, 26, &total));
    assert_float_equal(total, 13, 1e-12);
    assert_float_equal(tget(a, 0), 3, 0);
    assert_float_equal(tget(b, 0), 12, 0);
    /* max_norm 0 only computes. */
    OK(kpl_clip_grad_norm(3, p, 0, &total));
    assert_float_equal(total, 13, 1e-12);
    assert_float_equal(tget(a, 1), 4, 0);
    /* Exactly at max_norm: not above it, so nothing is scaled. */
    OK(kpl_clip_grad_norm(3, p, 13, NULL));
    assert_float_equal(tget(b, 0), 12, 0);
    /* Above: every gradient times 6.5 / (13 + 1e-6), in place. */
    OK(kpl_clip_grad_norm(3, p, 6.5, &total));
    assert_float_equal(total, 13, 1e-12);
    double coef = 6.5 / (13 + 1e-6);
    assert_close(tget(a, 0), 3 * coef, 1e-7, 0, "a", 0);
    assert_close(tget(a, 1), 4 * coef, 1e-7, 0, "a", 1);
    assert_close(tget(b, 0), 12 * coef, 1e-7, 0, "b", 0);
    assert_float_equal(tget(b, 1), 0, 0);
    OK(kpl_clip_grad_norm(3, p, 0, &total));
    assert_close(total, 6.5, 1e-6, 0, "norm after clipping", 0);

    /* One tensor as the gradient of two parameters counts twice in the
     * norm but is scaled once. */
    const float gs[2] = {3, 4};
    kpl_tensor *shared = vec(2, gs);
    kpl_grad_set(p[0], shared);
    kpl_grad_set(p[1], shared);
    OK(kpl_clip_grad_norm(2, p, 5, &total));
    assert_float_equal(total, sqrt(50.0), 1e-6);
    coef = 5 / (sqrt(50.0) + 1e-6);
    assert_close(tget(shared, 0), 3 * coef, 1e-7, 0, "shared", 0);
    assert_close(tget(shared, 1), 4 * coef, 1e-7, 0, "shared", 1);

    /* A nan gradient: the norm is nan and nothing is scaled; inf likewise. */
    const float gn[2] = {NAN, 1}, gc[2] = {30, 40}, gi[2] = {INFINITY, 1};
    kpl_tensor *bad = vec(2, gn), *c = vec(2, gc), *inf = vec(2, gi);
    kpl_grad_set(p[0], c);
    kpl_grad_set(p[1], bad);
    OK(kpl_clip_grad_norm(2, p, 1, &total));
    assert_true(isnan(total));
    assert_float_equal(tget(c, 0), 30, 0);
    assert_float_equal(tget(bad, 1), 1, 0);
    kpl_grad_set(p[1], inf);
    OK(kpl_clip_grad_norm(2, p, 1, &total));
    assert_true(isinf(total) && total > 0);
    assert_float_equal(tget(c, 1), 40, 0);

    /* No gradient at all: a norm of 0. */
    kpl_zero_grad(3, p);
    OK(kpl_clip_grad_norm(3, p, 1, &total));
    assert_float_equal(total, 0, 0);
    FAILS(kpl_clip_grad_norm(3, p, -1, &total), KPL_EINVAL, "max_norm -1");

    kpl_tensor_release(a);
    kpl_tensor_release(b);
    kpl_tensor_release(shared);
    kpl_tensor_release(bad);
    kpl_tensor_release(c);
    kpl_tensor_release(inf);
    for (int i = 0; i < 3; i++) kpl_tensor_release(p[i]);
}

/* Learning-rate schedules: values worked out by hand from the formulas
 * in optim.h (torch.optim.lr_scheduler's closed forms). */
static void test_schedules(void **state)
{
    (void)state;
    kpl_lr_schedule s = KPL_LR_SCHEDULE_INIT;
    s.base_lr = 0.1, s.warmup_epochs = 2, s.warmup_factor = 0.1;
    OK(kpl_lr_schedule_check(&s));
    assert_float_equal(kpl_lr_at(&s, 0), 0.01, 1e-15);
    assert_float_equal(kpl_lr_at(&s, 1), 0.055, 1e-15);
    assert_float_equal(kpl_lr_at(&s, 2), 0.1, 1e-15);
    assert_float_equal(kpl_lr_at(&s, 7), 0.1, 1e-15);

    s = (kpl_lr_schedule)KPL_LR_SCHEDULE_INIT;
    s.kind = KPL_SCHED_STEP, s.base_lr = 0.1, s.step_size = 30, s.gamma = 0.1;
    assert_float_equal(kpl_lr_at(&s, 29.99), 0.1, 1e-15);
    assert_float_equal(kpl_lr_at(&s, 30), 0.01, 1e-15);
    assert_float_equal(kpl_lr_at(&s, 65), 0.001, 1e-15);

    s.kind = KPL_SCHED_MULTISTEP, s.num_milestones = 3;
    s.milestones[0] = 30, s.milestones[1] = 60, s.milestones[2] = 80;
    OK(kpl_lr_schedule_check(&s));
    assert_float_equal(kpl_lr_at(&s, 10), 0.1, 1e-15);
    assert_float_equal(kpl_lr_at(&s, 59.99), 0.01, 1e-15);
    assert_float_equal(kpl_lr_at(&s, 60), 0.001, 1e-15);
    assert_float_equal(kpl_lr_at(&s, 90), 0.0001, 1e-15);

    s = (kpl_lr_schedule)KPL_LR_SCHEDULE_INIT;
    s.kind = KPL_SCHED_COSINE, s.base_lr = 0.1, s.epochs = 11, s.warmup_epochs = 1;
    s.warmup_factor = 0;
    OK(kpl_lr_schedule_check(&s));
    assert_float_equal(kpl_lr_at(&s, 0.5), 0.05, 1e-15);     /* warmup */
    assert_float_equal(kpl_lr_at(&s, 1), 0.1, 1e-15);
    assert_float_equal(kpl_lr_at(&s, 3.5), 0.1 * (1 + cos(M_PI / 4)) / 2, 1e-15);
    assert_float_equal(kpl_lr_at(&s, 6), 0.05, 1e-15);
    assert_float_equal(kpl_lr_at(&s, 11), 0, 1e-15);
    assert_float_equal(kpl_lr_at(&s, 12), 0, 1e-15);         /* past the end: the floor */
    s.min_lr = 0.001;
    assert_float_equal(kpl_lr_at(&s, 6), 0.001 + 0.099 / 2, 1e-15);

    s.kind = KPL_SCHED_POLY, s.power = 2, s.min_lr = 0;
    assert_float_equal(kpl_lr_at(&s, 6), 0.1 * 0.25, 1e-15);
    s.min_lr = 0.01;
    assert_float_equal(kpl_lr_at(&s, 6), 0.01 + 0.09 * 0.25, 1e-15);

    assert_int_equal(kpl_sched_kind_parse("cosine"), KPL_SCHED_COSINE);
    assert_int_equal(kpl_sched_kind_parse("linear"), -1);
    assert_string_equal(kpl_sched_kind_name(KPL_SCHED_MULTISTEP), "multistep");

    kpl_lr_schedule b = s;
    b.epochs = 1;
    FAILS(kpl_lr_schedule_check(&b), KPL_EINVAL, "poly needs epochs (1) > warmup_epochs (1)");
    b = s, b.min_lr = 1;
    FAILS(kpl_lr_schedule_check(&b), KPL_EINVAL, "min_lr 1 must be in [0, base_lr 0.1]");
    b = s, b.warmup_factor = 2;
    FAILS(kpl_lr_schedule_check(&b), KPL_EINVAL, "warmup_factor 2");
    b = s, b.kind = KPL_SCHED_STEP, b.step_size = 0;
    FAILS(kpl_lr_schedule_check(&b), KPL_EINVAL, "step_size 0 must be > 0");
    b = s, b.kind = KPL_SCHED_MULTISTEP, b.num_milestones = 2, b.milestones[0] = 5,
    b.milestones[1] = 5, b.gamma = 0.5;
    FAILS(kpl_lr_schedule_check(&b), KPL_EINVAL, "positive and increasing");
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_against_reference),
        cmocka_unit_test(test_mixed_dtypes),
        cmocka_unit_test(test_resume_equals_uninterrupted),
        cmocka_unit_test(test_group_multipliers),
        cmocka_unit_test(test_state_set_checks),
        cmocka_unit_test(test_step_touches_only_what_it_should),
        cmocka_unit_test(test_config),
        cmocka_unit_test(test_set_lr_applies),
        cmocka_unit_test(test_clip_grad_norm),
        cmocka_unit_test(test_schedules),
    };
    return cmocka_run_group_tests_name("optim", tests, NULL, NULL);
}
