/* test_ops.c — the compute calls against plain C references written here,
 * plus the errors that bad input must produce. */
#include "test_util.h"
#include "kernels_impl.h"

#include <stdlib.h>

/* ---- plain references (double) ---------------------------------------------- */

static double ref_unary(kpl_unary_op op, double x, double alpha, double beta)
{
    switch (op) {
    case KPL_UN_NEG: return -x;
    case KPL_UN_ABS: return fabs(x);
    case KPL_UN_EXP: return exp(x);
    case KPL_UN_LOG: return log(x);
    case KPL_UN_SQRT: return sqrt(x);
    case KPL_UN_RSQRT: return 1 / sqrt(x);
    case KPL_UN_SQUARE: return x * x;
    case KPL_UN_RECIPROCAL: return 1 / x;
    case KPL_UN_SIN: return sin(x);
    case KPL_UN_COS: return cos(x);
    case KPL_UN_TANH: return tanh(x);
    case KPL_UN_SIGMOID: return 1 / (1 + exp(-x));
    case KPL_UN_RELU: return x > 0 ? x : 0;
    case KPL_UN_LEAKY_RELU: return x > 0 ? x : alpha * x;
    case KPL_UN_GELU: return 0.5 * x * (1 + erf(x / sqrt(2.0)));
    case KPL_UN_CLIP: return x < alpha ? alpha : x > beta ? beta : x;
    case KPL_UN_SIGN: return (x > 0) - (x < 0);
    case KPL_UN_ERF: return erf(x);
    case KPL_UN_GELU_TANH:
        return 0.5 * x * (1 + tanh(sqrt(2 / M_PI) * (x + 0.044715 * x * x * x)));
    case KPL_UN_SOFTPLUS: return fmax(x, 0) + log1p(exp(-fabs(x)));
    default: return NAN;
    }
}

static double ref_binary(kpl_binary_op op, double a, double b)
{
    switch (op) {
    case KPL_BIN_ADD: return a + b;
    case KPL_BIN_SUB: return a - b;
    case KPL_BIN_MUL: return a * b;
    case KPL_BIN_DIV: return a / b;
    case KPL_BIN_POW: return pow(a, b);
    case KPL_BIN_MAXIMUM: return isnan(a) || isnan(b) ? NAN : (a > b ? a : b);
    case KPL_BIN_MINIMUM: return isnan(a) || isnan(b) ? NAN : (a < b ? a : b);
    case KPL_BIN_EQ: return a == b;
    case KPL_BIN_NE: return a != b;
    case KPL_BIN_LT: return a < b;
    case KPL_BIN_LE: return a <= b;
    case KPL_BIN_GT: return a > b;
    case KPL_BIN_GE: return a >= b;
    case KPL_BIN_RELU_BWD: return a * (b > 0);
    default: return NAN;
    }
}

/* Flat index of the input element that output element `i` reads (numpy
 * broadcasting, shapes aligned right). */
static int64_t bcast_index(int no, const int64_t *os, int ni, const int64_t *is, int64_t i)
{
    int64_t off = 0, stride = 1;
    for (int d = no - 1; d >= 0; d--) {
        int64_t idx = i % os[d];
        i /= os[d];
        int id = d - (no - ni);
        if (id >= 0) {
            if (is[id] != 1) off += idx * stride;
            stride *= is[id];
        }
    }
    return off;
}

/* ---- unary -------------------------------------------------------------------- */

static void test_unary_all(void **state)
{
    (void)state;
    int64_t n = 70001; /* > the parallel grain, odd */
    for (int dti = 0; dti < 2; dti++) {
        kpl_dtype dt = dti ? KPL_F64 : KPL_F32;
        double rtol = dti ? 1e-12 : 4e-6, atol = dti ? 1e-13 : 1e-6;
        kpl_tensor *x = trand(dt, 1, &n, 11, -3.0, 3.0);
        kpl_tensor *xp = trand(dt, 1, &n, 12, 0.01, 5.0); /* positive, for log/sqrt */
        kpl_tensor *o = tnew(dt, 1, &n);
        for (int op = 0; op < KPL_UNARY_COUNT; op++) {
            bool pos = op == KPL_UN_LOG || op == KPL_UN_SQRT || op == KPL_UN_RSQRT ||
                       op == KPL_UN_RECIPROCAL;
            kpl_tensor *in = pos ? xp : x;
            double al = op == KPL_UN_CLIP ? -0.5 : 0.1, be = 0.75;
            OK(kpl_k_unary(o, (kpl_unary_op)op, in, al, be));
            for (int64_t i = 0; i < n; i += 97)
                assert_close(tget(o, i), ref_unary((kpl_unary_op)op, tget(in, i), al, be), rtol,
                             atol, kpl_unary_name((kpl_unary_op)op), i);
        }
        /* In place. */
        OK(kpl_k_unary(x, KPL_UN_SQUARE, x, 0, 0));
        OK(kpl_k_unary(o, KPL_UN_SQRT, x, 0, 0));
        assert_true(tget(o, 5) >= 0);
        kpl_tensor_release(x);
        kpl_tensor_release(xp);
        kpl_tensor_release(o);
    }
    /* Special values: NaN passes through relu/clip, exp overflows to inf. */
    float sv[4] = {NAN, INFINITY, -INFINITY, 100.0f};
    int64_t four = 4;
    kpl_tensor *s = tf32(1, &four, sv), *o = tnew(KPL_F32, 1, &four);
    OK(kpl_k_unary(o, KPL_UN_RELU, s, 0, 0));
    assert_true(isnan(tget(o, 0)));
    assert_true(isinf(tget(o, 1)));
    assert_float_equal(tget(o, 2), 0, 0);
    OK(kpl_k_unary(o, KPL_UN_EXP, s, 0, 0));
    assert_true(isinf(tget(o, 3)) && tget(o, 2) == 0);
    OK(kpl_k_unary(o, KPL_UN_SIGMOID, s, 0, 0));
    assert_float_equal(tget(o, 1), 1, 0);
    assert_float_equal(tget(o, 2), 0, 0);
    /* softplus neither overflows (e^100 is inf in f32) nor rounds tiny
     * values away: log(1 + e^-40) would be 0 in f64 */
    OK(kpl_k_unary(o, KPL_UN_SOFTPLUS, s, 0, 0));
    assert_true(isnan(tget(o, 0)));
    assert_true(isinf(tget(o, 1)) && tget(o, 1) > 0);
    assert_float_equal(tget(o, 2), 0, 0);
    assert_float_equal(tget(o, 3), 100, 0);
    kpl_tensor_release(s);
    kpl_tensor_release(o);
    int64_t two = 2;
    kpl_tensor *d = tnew(KPL_F64, 1, &two), *od = tnew(KPL_F64, 1, &two);
    OK(kpl_k_arange(d, -40, 80)); /* -40, 40 */
    OK(kpl_k_unary(od, KPL_UN_SOFTPLUS, d, 0, 0));
    assert_close(tget(od, 0), 4.248354255291589e-18, 1e-14, 0, "softplus(-40)", 0); /* math.log1p(math.exp(-40)) */
    assert_close(tget(od, 1), 40, 1e-16, 0, "softplus(40)", 1);
    kpl_tensor_release(d);
    kpl_tensor_release(od);
}

static void test_unary_int(void **state)
{
    (void)state;
    int32_t v[6] = {-3, -1, 0, 1, 7, -2147483647};
    int64_t six = 6;
    kpl_tensor *x = NULL, *o = tnew(KPL_I32, 1, &six);
    OK(kpl_tensor_from_data(kpl_device_cpu(), KPL_I32, 1, &six, v, &x));
    OK(kpl_k_unary(o, KPL_UN_ABS, x, 0, 0));
    const int32_t *r = kpl_tensor_host_data(o);
    assert_int_equal(r[0], 3);
    assert_int_equal(r[5], 2147483647);
    OK(kpl_k_unary(o, KPL_UN_SIGN, x, 0, 0));
    assert_int_equal(r[0], -1);
    assert_int_equal(r[2], 0);
    assert_int_equal(r[4], 1);
    OK(kpl_k_unary(o, KPL_UN_RELU, x, 0, 0));
    assert_int_equal(r[0], 0);
    assert_int_equal(r[4], 7);
    FAILS(kpl_k_unary(o, KPL_UN_EXP, x, 0, 0), KPL_EDTYPE, "exp: not defined for dtype i32");
    kpl_tensor_release(x);
    kpl_tensor_release(o);
}

/* ---- binary ------------------------------------------------------------------- */

typedef struct {
    int na;
    int64_t a[4];
    int nb;
    int64_t b[4];
} bcase;

static void check_binary_case(kpl_dtype dt, const bcase *c, kpl_binary_op op)
{
    int no;
    int64_t os[KPL_MAX_DIMS];
    OK(kpl_shape_broadcast("test", c->na, c->a, c->nb, c->b, &no, os));
    bool pos = op == KPL_BIN_POW;
    kpl_tensor *a = trand(dt, c->na, c->a, 21, pos ? 0.1 : -4, 4);
    kpl_tensor *b = trand(dt, c->nb, c->b, 22, pos ? -2 : -4, pos ? 2 : 4);
    if (op == KPL_BIN_EQ || op == KPL_BIN_LE) { /* make some elements equal */
        OK(kpl_k_unary(a, KPL_UN_SIGN, a, 0, 0));
        OK(kpl_k_unary(b, KPL_UN_SIGN, b, 0, 0));
    }
    bool cmp = kpl_binary_is_compare(op);
    kpl_tensor *o = tnew(cmp ? KPL_BOOL : dt, no, os);
    OK(kpl_k_binary(o, op, a, b));
    int64_t n = kpl_tensor_numel(o);
    double rtol = dt == KPL_F32 ? 2e-6 : 1e-13;
    for (int64_t i = 0; i < n; i += (n > 5000 ? 37 : 1)) {
        double av = tget(a, bcast_index(no, os, c->na, c->a, i));
        double bv = tget(b, bcast_index(no, os, c->nb, c->b, i));
        double ref = ref_binary(op, av, bv);
        if (dt == KPL_F32 && !cmp) ref = (float)ref;
        assert_close(tget(o, i), ref, rtol, 1e-30, kpl_binary_name(op), i);
    }
    kpl_tensor_release(a);
    kpl_tensor_release(b);
    kpl_tensor_release(o);
}

static void test_binary_broadcast(void **state)
{
    (void)state;
    const bcase cases[] = {
        {2, {3, 4}, 2, {3, 4}},          {2, {3, 4}, 1, {4}},
        {2, {3, 1}, 2, {1, 5}},          {3, {2, 1, 4}, 2, {3, 1}},
        {1, {1}, 3, {2, 3, 4}},          {4, {2, 3, 1, 5}, 4, {1, 3, 4, 1}},
        {2, {300, 257}, 2, {300, 1}},    {2, {1, 70000}, 2, {2, 70000}},
        {2, {2000, 40}, 1, {40}},        {0, {0}, 2, {2, 2}},
    };
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++)
        for (int op = 0; op < KPL_BINARY_COUNT; op++) {
            check_binary_case(KPL_F32, &cases[c], (kpl_binary_op)op);
            if (c < 4) check_binary_case(KPL_F64, &cases[c], (kpl_binary_op)op);
        }
}

static void test_binary_int_scalar_inplace(void **state)
{
    (void)state;
    int64_t v[5] = {-7, -1, 0, 5, 9}, w[5] = {2, -1, 3, 0, 2};
    int64_t five = 5;
    kpl_tensor *a = NULL, *b = NULL, *o = tnew(KPL_I64, 1, &five);
    OK(kpl_tensor_from_data(kpl_device_cpu(), KPL_I64, 1, &five, v, &a));
    OK(kpl_tensor_from_data(kpl_device_cpu(), KPL_I64, 1, &five, w, &b));
    const int64_t *r = kpl_tensor_host_data(o);
    OK(kpl_k_binary(o, KPL_BIN_DIV, a, b)); /* truncating; x / 0 = 0 */
    int64_t div[5] = {-3, 1, 0, 0, 4};
    assert_memory_equal(r, div, sizeof div);
    OK(kpl_k_binary(o, KPL_BIN_POW, a, b));
    int64_t pw[5] = {49, -1, 0, 1, 81};
    assert_memory_equal(r, pw, sizeof pw);
    OK(kpl_k_binary_scalar(o, KPL_BIN_SUB, a, 10, true)); /* 10 - a */
    int64_t rs[5] = {17, 11, 10, 5, 1};
    assert_memory_equal(r, rs, sizeof rs);
    OK(kpl_k_binary_scalar(a, KPL_BIN_MUL, a, 3, false)); /* in place */
    assert_int_equal(((const int64_t *)kpl_tensor_host_data(a))[4], 27);

    /* f32 scalar forms and in-place with broadcasting of the other side. */
    float x[6] = {1, 2, 3, 4, 5, 6}, y[3] = {10, 20, 30};
    int64_t s23[2] = {2, 3}, s3 = 3;
    kpl_tensor *X = tf32(2, s23, x), *Y = tf32(1, &s3, y);
    OK(kpl_k_binary(X, KPL_BIN_ADD, X, Y));
    assert_float_equal(tget(X, 4), 25, 0);
    OK(kpl_k_binary_scalar(X, KPL_BIN_DIV, X, 2.0, true)); /* 2 / X */
    assert_float_equal(tget(X, 0), 2.0 / 11, 1e-7);
    /* bool logic */
    uint8_t p[4] = {0, 1, 0, 1}, q[4] = {0, 0, 1, 1};
    int64_t four = 4;
    kpl_tensor *P = NULL, *Q = NULL, *R = tnew(KPL_BOOL, 1, &four);
    OK(kpl_tensor_from_data(kpl_device_cpu(), KPL_BOOL, 1, &four, p, &P));
    OK(kpl_tensor_from_data(kpl_device_cpu(), KPL_BOOL, 1, &four, q, &Q));
    OK(kpl_k_binary(R, KPL_BIN_MAXIMUM, P, Q));
    uint8_t orr[4] = {0, 1, 1, 1};
    assert_memory_equal(kpl_tensor_host_data(R), orr, 4);
    OK(kpl_k_binary(R, KPL_BIN_NE, P, Q));
    uint8_t xr[4] = {0, 1, 1, 0};
    assert_memory_equal(kpl_tensor_host_data(R), xr, 4);
    FAILS(kpl_k_binary(R, KPL_BIN_ADD, P, Q), KPL_EDTYPE, "add: not defined for dtype bool");
    kpl_tensor *ts[] = {a, b, o, X, Y, P, Q, R};
    for (size_t i = 0; i < sizeof ts / sizeof ts[0]; i++) kpl_tensor_release(ts[i]);
}

static void test_binary_streaming(void **state)
{
    (void)state;
    /* Outputs past 16 MiB take the non-temporal path; an output that starts
     * 4 bytes into its storage checks the unaligned head and the tail. */
    int64_t n = ((int64_t)4 << 20) + 13, n1 = n + 1;
    kpl_tensor *a = trand(KPL_F32, 1, &n, 61, -1, 1), *b = trand(KPL_F32, 1, &n, 62, -1, 1);
    kpl_tensor *base = tnew(KPL_F32, 1, &n1), *o = NULL;
    OK(kpl_k_fill(base, -7));
    OK(kpl_tensor_narrow(base, 1, n, &o));
    const kpl_binary_op ops[3] = {KPL_BIN_ADD, KPL_BIN_SUB, KPL_BIN_MUL};
    for (int k = 0; k < 3; k++) {
        OK(kpl_k_binary(o, ops[k], a, b));
        const float *pa = kpl_tensor_host_data(a), *pb = kpl_tensor_host_data(b);
        const float *po = kpl_tensor_host_data(o);
        for (int64_t i = 0; i < n; i += (i < 64 || i > n - 64) ? 1 : 4099) {
            float ref = ops[k] == KPL_BIN_ADD ? pa[i] + pb[i]
                        : ops[k] == KPL_BIN_SUB ? pa[i] - pb[i] : pa[i] * pb[i];
            if (po[i] != ref) fail_msg("%s[%lld]: %g != %g", kpl_binary_name(ops[k]), (long long)i, po[i], ref);
        }
        assert_float_equal(tget(base, 0), -7, 0); /* the element before is untouched */
    }
    kpl_tensor_release(o);
    kpl_tensor_release(base);
    kpl_tensor_release(a);
    kpl_tensor_release(b);
}

static void test_binary_errors(void **state)
{
    (void)state;
    int64_t s23[2] = {2, 3}, s43[2] = {4, 3}, s3 = 3;
    kpl_tensor *a = tnew(KPL_F32, 2, s23), *b = tnew(KPL_F32, 2, s43);
    kpl_tensor *c = tnew(KPL_I32, 2, s23), *o = tnew(KPL_F32, 2, s23), *v = tnew(KPL_F32, 1, &s3);
    OK(kpl_k_fill(a, 1));
    OK(kpl_k_fill(b, 1));
    OK(kpl_k_fill(v, 1));
    FAILS(kpl_k_binary(o, KPL_BIN_ADD, a, b), KPL_ESHAPE,
          "add: shapes (2,3) and (4,3) cannot be broadcast");
    FAILS(kpl_k_binary(o, KPL_BIN_MUL, a, c), KPL_EDTYPE, "mul: 'b' has dtype i32, expected f32 like 'a'");
    FAILS(kpl_k_binary(o, KPL_BIN_ADD, NULL, a), KPL_EINVAL, "add: argument 'a' is NULL");
    FAILS(kpl_k_binary(NULL, KPL_BIN_ADD, a, a), KPL_EINVAL, "argument 'out' is NULL");
    FAILS(kpl_k_binary(v, KPL_BIN_SUB, a, v), KPL_ESHAPE,
          "sub: 'out' has shape (3), the result has shape (2,3)");
    FAILS(kpl_k_binary(o, KPL_BIN_LT, a, a), KPL_EDTYPE, "'out' has dtype f32, expected bool");
    FAILS(kpl_k_binary(o, (kpl_binary_op)77, a, a), KPL_EINVAL, "unknown op 77");
    FAILS(kpl_k_unary(o, KPL_UN_CLIP, a, 2, 1), KPL_EINVAL, "clip: lo 2 is greater than hi 1");
    /* partial overlap of out and an input is refused */
    kpl_tensor *n1 = NULL, *n2 = NULL, *big = tnew(KPL_F32, 2, s43);
    OK(kpl_k_fill(big, 0));
    OK(kpl_tensor_narrow(big, 0, 2, &n1));
    OK(kpl_tensor_narrow(big, 1, 2, &n2));
    FAILS(kpl_k_binary(n2, KPL_BIN_ADD, n1, a), KPL_EINVAL, "partially overlaps 'a'");
    kpl_tensor *ts[] = {a, b, c, o, v, n1, n2, big};
    for (size_t i = 0; i < sizeof ts / sizeof ts[0]; i++) kpl_tensor_release(ts[i]);
}

static void test_where(void **state)
{
    (void)state;
    uint8_t cv[3] = {1, 0, 1};
    float av[6] = {1, 2, 3, 4, 5, 6}, bv[1] = {-1};
    int64_t s3 = 3, s23[2] = {2, 3}, s1 = 1;
    kpl_tensor *c = NULL;
    OK(kpl_tensor_from_data(kpl_device_cpu(), KPL_BOOL, 1, &s3, cv, &c));
    kpl_tensor *a = tf32(2, s23, av), *b = tf32(1, &s1, bv), *o = tnew(KPL_F32, 2, s23);
    OK(kpl_k_where(o, c, a, b));
    double ref[6] = {1, -1, 3, 4, -1, 6};
    assert_tensor_close(o, ref, 0, 0, "where");
    FAILS(kpl_k_where(o, a, a, b), KPL_EDTYPE, "where: 'cond' has dtype f32, expected bool");
    kpl_tensor_release(c);
    kpl_tensor_release(a);
    kpl_tensor_release(b);
    kpl_tensor_release(o);
}

/* ---- reductions ----------------------------------------------------------------- */

/* Reference reduction of x (shape s, 3 dims) over the axes in mask: gather
 * each output's members in order, then compute the statistic. */
static void ref_reduce(kpl_reduce_op op, const double *x, const int64_t *s, unsigned mask,
                       int corr, double *out, int64_t *nout)
{
    int64_t os[3];
    for (int d = 0; d < 3; d++) os[d] = (mask & (1u << d)) ? 1 : s[d];
    *nout = os[0] * os[1] * os[2];
    for (int64_t o = 0; o < *nout; o++) {
        int64_t oi[3] = {o / (os[1] * os[2]), (o / os[2]) % os[1], o % os[2]};
        double v[128];
        int64_t cnt = 0;
        for (int64_t i = 0; i < s[0]; i++)
            for (int64_t j = 0; j < s[1]; j++)
                for (int64_t k = 0; k < s[2]; k++) {
                    int64_t ii[3] = {i, j, k};
                    bool in = true;
                    for (int d = 0; d < 3; d++)
                        if (!(mask & (1u << d)) && ii[d] != oi[d]) in = false;
                    if (in) v[cnt++] = x[(i * s[1] + j) * s[2] + k];
                }
        double sum = 0, m = -INFINITY, sq = 0, se = 0;
        int64_t amax = 0, amin = 0;
        for (int64_t c = 0; c < cnt; c++) {
            sum += v[c];
            if (v[c] > v[amax]) amax = c;
            if (v[c] < v[amin]) amin = c;
            if (v[c] > m) m = v[c];
        }
        double mean = sum / (double)cnt;
        for (int64_t c = 0; c < cnt; c++) {
            sq += (v[c] - mean) * (v[c] - mean);
            se += exp(v[c] - m);
        }
        switch (op) {
        case KPL_RED_SUM: out[o] = sum; break;
        case KPL_RED_MEAN: out[o] = mean; break;
        case KPL_RED_MAX: out[o] = v[amax]; break;
        case KPL_RED_MIN: out[o] = v[amin]; break;
        case KPL_RED_ARGMAX: out[o] = (double)amax; break;
        case KPL_RED_ARGMIN: out[o] = (double)amin; break;
        case KPL_RED_VAR: out[o] = sq / (double)(cnt - corr); break;
        case KPL_RED_LOGSUMEXP: out[o] = m + log(se); break;
        case KPL_RED_SUMEXP_SUB_MAX: out[o] = se; break;
        default: break;
        }
    }
}

static void test_reduce_all_axes_sets(void **state)
{
    (void)state;
    int64_t s[3] = {4, 5, 6};
    kpl_tensor *x = trand(KPL_F64, 3, s, 33, -2, 2);
    double xs[120];
    for (int i = 0; i < 120; i++) xs[i] = tget(x, i);
    kpl_tensor *x32 = tnew(KPL_F32, 3, s);
    OK(kpl_k_cast(x32, x));
    for (int op = 0; op < KPL_REDUCE_COUNT; op++) {
        bool arg = op == KPL_RED_ARGMAX || op == KPL_RED_ARGMIN;
        for (unsigned mask = 1; mask < 8; mask++) {
            int axes[3], na = 0;
            for (int d = 0; d < 3; d++)
                if (mask & (1u << d)) axes[na++] = d - 3 * (d == 2); /* -1 for dim 2 */
            if (arg && na != 1) continue;
            double ref[120];
            int64_t nref;
            ref_reduce((kpl_reduce_op)op, xs, s, mask, 1, ref, &nref);
            for (int keep = 0; keep < 2; keep++)
                for (int f = 0; f < 2; f++) {
                    kpl_tensor *in = f ? x32 : x;
                    int no;
                    int64_t os[3];
                    OK(kpl_shape_reduce("t", 3, s, axes, na, keep, &no, os));
                    kpl_tensor *o = tnew(arg ? KPL_I64 : kpl_tensor_dtype(in), no, os);
                    OK(kpl_k_reduce(o, (kpl_reduce_op)op, in, axes, na, keep, 1));
                    assert_int_equal(kpl_tensor_numel(o), nref);
                    if (!arg || !f) /* argmax of f32 may pick a near-tie differently */
                        assert_tensor_close(o, ref, f ? 2e-6 : 1e-12, f ? 1e-6 : 1e-13,
                                            kpl_reduce_name((kpl_reduce_op)op));
                    kpl_tensor_release(o);
                }
        }
    }
    kpl_tensor_release(x);
    kpl_tensor_release(x32);
}

static void test_reduce_large_and_special(void **state)
{
    (void)state;
    /* A long run split across threads: sum of arange is exact. */
    int64_t n = 1000001;
    kpl_tensor *x = tnew(KPL_F32, 1, &n), *o = tnew(KPL_F32, 0, NULL), *i = tnew(KPL_I64, 0, NULL);
    OK(kpl_k_arange(x, 0, 1));
    OK(kpl_k_reduce(o, KPL_RED_SUM, x, NULL, 0, false, 0));
    assert_float_equal(tget(o, 0), 500000500000.0, 1e5); /* f32 output rounding */
    OK(kpl_k_reduce(i, KPL_RED_ARGMAX, x, NULL, 0, false, 0));
    assert_int_equal((int64_t)tget(i, 0), n - 1);
    /* NaN wins max/argmax (first one), like numpy. */
    float *w = kpl_tensor_host_mutable(x);
    w[700000] = NAN;
    w[800000] = NAN;
    OK(kpl_k_reduce(o, KPL_RED_MAX, x, NULL, 0, false, 0));
    assert_true(isnan(tget(o, 0)));
    OK(kpl_k_reduce(i, KPL_RED_ARGMAX, x, NULL, 0, false, 0));
    assert_int_equal((int64_t)tget(i, 0), 700000);
    /* Column blocks (inner > 256): reduce (7, 600) over axis 0, NaN in a column. */
    int64_t s7[2] = {7, 600}, s600 = 600;
    kpl_tensor *c = trand(KPL_F32, 2, s7, 99, -1, 1), *cs = tnew(KPL_F32, 1, &s600);
    kpl_tensor *ca = tnew(KPL_I64, 1, &s600);
    ((float *)kpl_tensor_host_mutable(c))[3 * 600 + 517] = NAN;
    int ax0 = 0;
    OK(kpl_k_reduce(cs, KPL_RED_SUM, c, &ax0, 1, false, 0));
    for (int64_t j = 0; j < 600; j += 7) {
        double ref = 0;
        for (int r = 0; r < 7; r++) ref += tget(c, r * 600 + j);
        assert_close(tget(cs, j), ref, 1e-6, 1e-6, "column sum", j);
    }
    assert_true(isnan(tget(cs, 517)));
    OK(kpl_k_reduce(ca, KPL_RED_ARGMIN, c, &ax0, 1, false, 0));
    assert_int_equal((int64_t)tget(ca, 517), 3);
    for (int64_t j = 0; j < 600; j += 11) {
        if (j == 517) continue;
        int64_t best = 0;
        for (int r = 1; r < 7; r++)
            if (tget(c, r * 600 + j) < tget(c, best * 600 + j)) best = r;
        assert_int_equal((int64_t)tget(ca, j), best);
    }
    kpl_tensor_release(c);
    kpl_tensor_release(cs);
    kpl_tensor_release(ca);
    /* logsumexp is stable for large values */
    float big[3] = {1000, 1000, 1000};
    int64_t three = 3;
    kpl_tensor *b = tf32(1, &three, big);
    OK(kpl_k_reduce(o, KPL_RED_LOGSUMEXP, b, NULL, 0, false, 0));
    assert_float_equal(tget(o, 0), 1000 + log(3.0), 1e-3);
    /* integer sums are exact in int64 */
    int64_t iv[3] = {INT64_C(4000000000), INT64_C(5000000000), -1};
    kpl_tensor *ix = NULL, *io = tnew(KPL_I64, 0, NULL);
    OK(kpl_tensor_from_data(kpl_device_cpu(), KPL_I64, 1, &three, iv, &ix));
    OK(kpl_k_reduce(io, KPL_RED_SUM, ix, NULL, 0, false, 0));
    assert_int_equal(*(const int64_t *)kpl_tensor_host_data(io), INT64_C(8999999999));
    /* errors */
    FAILS(kpl_k_reduce(io, KPL_RED_MEAN, ix, NULL, 0, false, 0), KPL_EDTYPE,
          "mean: not defined for dtype i64");
    int ax2[2] = {0, 0};
    int64_t s23[2] = {2, 3};
    kpl_tensor *m = tnew(KPL_F32, 2, s23), *mo = tnew(KPL_F32, 1, &three);
    FAILS(kpl_k_reduce(mo, KPL_RED_SUM, m, ax2, 2, false, 0), KPL_ESHAPE, "axis 0 given twice");
    int ax5 = 5;
    FAILS(kpl_k_reduce(mo, KPL_RED_SUM, m, &ax5, 1, false, 0), KPL_ESHAPE,
          "sum: axis 5 out of range for shape (2,3)");
    int ax1 = 1;
    FAILS(kpl_k_reduce(mo, KPL_RED_SUM, m, &ax1, 1, false, 0), KPL_ESHAPE,
          "'out' has shape (3), the result has shape (2)");
    kpl_tensor *ts[] = {x, o, i, b, ix, io, m, mo};
    for (size_t k = 0; k < sizeof ts / sizeof ts[0]; k++) kpl_tensor_release(ts[k]);
}

/* ---- matmul ------------------------------------------------------------------- */

static void ref_matmul(const double *a, const double *b, double *c, int64_t M, int64_t N,
                       int64_t K, bool ta, bool tb)
{
    for (int64_t i = 0; i < M; i++)
        for (int64_t j = 0; j < N; j++) {
            double s = 0;
            for (int64_t k = 0; k < K; k++)
                s += (ta ? a[k * M + i] : a[i * K + k]) * (tb ? b[j * K + k] : b[k * N + j]);
            c[i * N + j] = s;
        }
}

static void test_matmul_transposes(void **state)
{
    (void)state;
    const int64_t M = 33, N = 47, K = 65;
    for (int f = 0; f < 2; f++)
        for (int ta = 0; ta < 2; ta++)
            for (int tb = 0; tb < 2; tb++) {
                kpl_dtype dt = f ? KPL_F64 : KPL_F32;
                int64_t sa[2] = {ta ? K : M, ta ? M : K}, sb[2] = {tb ? N : K, tb ? K : N};
                int64_t sc[2] = {M, N};
                kpl_tensor *a = trand(dt, 2, sa, 41, -1, 1), *b = trand(dt, 2, sb, 42, -1, 1);
                kpl_tensor *c = tnew(dt, 2, sc);
                OK(kpl_k_matmul(c, a, b, ta, tb));
                double *ad = malloc(sizeof(double) * M * K), *bd = malloc(sizeof(double) * K * N);
                double *cd = malloc(sizeof(double) * M * N);
                for (int64_t i = 0; i < M * K; i++) ad[i] = tget(a, i);
                for (int64_t i = 0; i < K * N; i++) bd[i] = tget(b, i);
                ref_matmul(ad, bd, cd, M, N, K, ta, tb);
                assert_tensor_close(c, cd, f ? 1e-12 : 1e-5, f ? 1e-12 : 1e-5, "matmul");
                free(ad);
                free(bd);
                free(cd);
                kpl_tensor_release(a);
                kpl_tensor_release(b);
                kpl_tensor_release(c);
            }
}

static void test_matmul_primitive_cache(void **state)
{
    (void)state;
    /* A shape seen before is a cache hit: no new oneDNN primitive. */
    int64_t sa[2] = {17, 23}, sb[2] = {23, 19}, sc[2] = {17, 19};
    kpl_tensor *a = trand(KPL_F32, 2, sa, 1, -1, 1), *b = trand(KPL_F32, 2, sb, 2, -1, 1);
    kpl_tensor *c = tnew(KPL_F32, 2, sc);
    OK(kpl_k_matmul(c, a, b, false, false));
    kpl_algo_cache_stats s0 = kpl_algo_cache_stats_get(KPL_DEVICE_CPU);
    for (int i = 0; i < 5; i++) OK(kpl_k_matmul(c, a, b, false, false));
    kpl_algo_cache_stats s1 = kpl_algo_cache_stats_get(KPL_DEVICE_CPU);
    assert_int_equal(s1.misses, s0.misses);
    assert_int_equal(s1.hits, s0.hits + 5);
    /* A transposed operand is another problem: one miss, then hits. */
    int64_t sbt[2] = {19, 23};
    kpl_tensor *bt = trand(KPL_F32, 2, sbt, 3, -1, 1);
    OK(kpl_k_matmul(c, a, bt, false, true));
    OK(kpl_k_matmul(c, a, bt, false, true));
    kpl_algo_cache_stats s2 = kpl_algo_cache_stats_get(KPL_DEVICE_CPU);
    assert_int_equal(s2.misses, s1.misses + 1);
    assert_int_equal(s2.hits, s1.hits + 1);
    assert_true(s2.entries >= 2);
    kpl_tensor_release(a);
    kpl_tensor_release(b);
    kpl_tensor_release(bt);
    kpl_tensor_release(c);
}

static void test_matmul_batched(void **state)
{
    (void)state;
    /* a (2,1,4,3) @ b (3,3,5) -> (2,3,4,5): batch dims broadcast. */
    int64_t sa[4] = {2, 1, 4, 3}, sb[3] = {3, 3, 5}, sc[4] = {2, 3, 4, 5};
    for (int f = 0; f < 2; f++) {
        kpl_dtype dt = f ? KPL_F64 : KPL_F32;
        kpl_tensor *a = trand(dt, 4, sa, 51, -1, 1), *b = trand(dt, 3, sb, 52, -1, 1);
        int no;
        int64_t os[8];
        OK(kpl_shape_matmul(4, sa, false, 3, sb, false, &no, os));
        assert_int_equal(no, 4);
        assert_memory_equal(os, sc, sizeof sc);
        kpl_tensor *c = tnew(dt, 4, sc);
        OK(kpl_k_matmul(c, a, b, false, false));
        for (int i = 0; i < 2; i++)
            for (int j = 0; j < 3; j++) {
                double ad[12], bd[15], cd[20];
                for (int k = 0; k < 12; k++) ad[k] = tget(a, i * 12 + k);
                for (int k = 0; k < 15; k++) bd[k] = tget(b, j * 15 + k);
                ref_matmul(ad, bd, cd, 4, 5, 3, false, false);
                for (int k = 0; k < 20; k++)
                    assert_close(tget(c, (i * 3 + j) * 20 + k), cd[k], 1e-5, 1e-6, "bmm", k);
            }
        kpl_tensor_release(a);
        kpl_tensor_release(b);
        kpl_tensor_release(c);
    }
    /* 1-D operands as in numpy: (3) @ (3,5) -> (5); (4,3) @ (3) -> (4). */
    int64_t v3 = 3, m35[2] = {3, 5}, m43[2] = {4, 3}, v5 = 5, v4 = 4;
    kpl_tensor *v = trand(KPL_F32, 1, &v3, 1, -1, 1), *m = trand(KPL_F32, 2, m35, 2, -1, 1);
    kpl_tensor *o5 = tnew(KPL_F32, 1, &v5);
    OK(kpl_k_matmul(o5, v, m, false, false));
    double r = 0;
    for (int k = 0; k < 3; k++) r += tget(v, k) * tget(m, k * 5 + 2);
    assert_float_equal(tget(o5, 2), r, 1e-6);
    kpl_tensor *m2 = trand(KPL_F32, 2, m43, 3, -1, 1), *o4 = tnew(KPL_F32, 1, &v4);
    OK(kpl_k_matmul(o4, m2, v, false, false));
    r = 0;
    for (int k = 0; k < 3; k++) r += tget(m2, 3 * 3 + k) * tget(v, k);
    assert_float_equal(tget(o4, 3), r, 1e-6);
    /* errors */
    FAILS(kpl_k_matmul(o4, m2, m2, false, false), KPL_ESHAPE,
          "matmul: inner dims differ: (4,3) @ (4,3) (3 vs 4)");
    kpl_tensor *i1 = tnew(KPL_I32, 1, &v3);
    FAILS(kpl_k_matmul(o4, i1, i1, false, false), KPL_EDTYPE,
          "matmul: 'a' has dtype i32; f32, f64, f16 and bf16 are supported");
    kpl_tensor *o43 = tnew(KPL_F32, 2, m43);
    FAILS(kpl_k_matmul(o43, m2, m2, false, true), KPL_ESHAPE,
          "'out' has shape (4,3), the result has shape (4,4)");
    FAILS(kpl_k_matmul(m2, m2, v, false, false), KPL_EINVAL, "matmul: 'out' may not alias 'a'");
    kpl_tensor *ts[] = {v, m, o5, m2, o4, i1, o43};
    for (size_t k = 0; k < sizeof ts / sizeof ts[0]; k++) kpl_tensor_release(ts[k]);
}

/* ---- fill / cast / copy / half math -------------------------------------------- */

static void test_fill_cast_copy(void **state)
{
    (void)state;
    int64_t n = 5;
    float v[5] = {-2.7f, -0.5f, 0.0f, 1.5f, 300.0f};
    kpl_tensor *x = tf32(1, &n, v);
    kpl_tensor *i32 = tnew(KPL_I32, 1, &n), *u8 = tnew(KPL_U8, 1, &n), *bl = tnew(KPL_BOOL, 1, &n);
    kpl_tensor *h = tnew(KPL_F16, 1, &n), *bf = tnew(KPL_BF16, 1, &n), *back = tnew(KPL_F32, 1, &n);
    OK(kpl_k_cast(i32, x));
    int32_t ri[5] = {-2, 0, 0, 1, 300};
    assert_memory_equal(kpl_tensor_host_data(i32), ri, sizeof ri);
    OK(kpl_k_cast(u8, x)); /* saturating */
    uint8_t ru[5] = {0, 0, 0, 1, 255};
    assert_memory_equal(kpl_tensor_host_data(u8), ru, sizeof ru);
    OK(kpl_k_cast(bl, x));
    uint8_t rb[5] = {1, 1, 0, 1, 1};
    assert_memory_equal(kpl_tensor_host_data(bl), rb, sizeof rb);
    OK(kpl_k_cast(h, x));
    OK(kpl_k_cast(back, h));
    assert_float_equal(tget(back, 0), -2.69921875, 0); /* nearest f16 */
    OK(kpl_k_cast(bf, x));
    OK(kpl_k_cast(back, bf));
    assert_float_equal(tget(back, 0), -2.703125, 0); /* nearest bf16 */
    /* fill converts to the dtype */
    OK(kpl_k_fill(i32, 7.9));
    assert_int_equal(((const int32_t *)kpl_tensor_host_data(i32))[4], 7);
    OK(kpl_k_fill(h, 0.1));
    assert_int_equal(((const uint16_t *)kpl_tensor_host_data(h))[2], kpl_f32_to_f16(0.1f));
    /* f16 math runs in f32 and rounds once */
    kpl_tensor *h2 = tnew(KPL_F16, 1, &n);
    OK(kpl_k_fill(h2, 0.2));
    OK(kpl_k_binary(h2, KPL_BIN_ADD, h, h2));
    assert_float_equal(tget(h2, 0),
                       kpl_f16_to_f32(kpl_f32_to_f16(kpl_f16_to_f32(kpl_f32_to_f16(0.1f)) +
                                                     kpl_f16_to_f32(kpl_f32_to_f16(0.2f)))),
                       0);
    OK(kpl_k_unary(h2, KPL_UN_EXP, h2, 0, 0));
    assert_float_equal(tget(h2, 1), exp(0.2998), 2e-3);
    kpl_tensor *hs = tnew(KPL_F16, 0, NULL);
    OK(kpl_k_reduce(hs, KPL_RED_SUM, h2, NULL, 0, false, 0));
    assert_float_equal(tget(hs, 0), 5 * exp(0.2998), 1e-2);
    /* f16 matmul in f32: (2,2) @ (2,2) by hand */
    uint16_t ha[4], hb[4];
    float fa[4] = {1, 2, 3, 4}, fb[4] = {0.5f, -1, 2, 0.25f};
    for (int k = 0; k < 4; k++) {
        ha[k] = kpl_f32_to_f16(fa[k]);
        hb[k] = kpl_f32_to_f16(fb[k]);
    }
    int64_t s22[2] = {2, 2};
    kpl_tensor *HA = NULL, *HB = NULL, *HC = tnew(KPL_F16, 2, s22);
    OK(kpl_tensor_from_data(kpl_device_cpu(), KPL_F16, 2, s22, ha, &HA));
    OK(kpl_tensor_from_data(kpl_device_cpu(), KPL_F16, 2, s22, hb, &HB));
    OK(kpl_k_matmul(HC, HA, HB, false, false));
    double hc[4] = {4.5, -0.5, 9.5, -2};
    assert_tensor_close(HC, hc, 0, 0, "f16 matmul");
    kpl_tensor_release(HA);
    kpl_tensor_release(HB);
    kpl_tensor_release(HC);
    /* copy: same numel, different shape is fine; dtypes must match */
    int64_t s51[2] = {5, 1};
    kpl_tensor *c = tnew(KPL_F32, 2, s51);
    OK(kpl_k_copy(c, x));
    assert_float_equal(tget(c, 4), 300, 0);
    FAILS(kpl_k_copy(c, i32), KPL_EDTYPE, "copy: 'out' has dtype f32, expected i32 like 'x'");
    kpl_tensor *d = NULL;
    OK(kpl_tensor_to_device(x, kpl_device_cpu(), &d));
    assert_float_equal(tget(d, 1), -0.5, 0);
    /* expand: broadcast into a larger shape */
    int64_t s3 = 3, s223[3] = {2, 2, 3};
    float ev[3] = {1, 2, 3};
    kpl_tensor *ex = tf32(1, &s3, ev), *eo = tnew(KPL_F32, 3, s223);
    OK(kpl_k_expand(eo, ex));
    for (int k = 0; k < 12; k++) assert_float_equal(tget(eo, k), ev[k % 3], 0);
    FAILS(kpl_k_expand(ex, eo), KPL_ESHAPE, "expand: 'out' has shape (3)");
    kpl_tensor_release(ex);
    kpl_tensor_release(eo);
    /* arange in ints */
    kpl_tensor *ar = tnew(KPL_I64, 1, &n);
    OK(kpl_k_arange(ar, 10, -3));
    assert_int_equal((int64_t)tget(ar, 4), -2);
    FAILS(kpl_k_arange(bl, 0, 1), KPL_EDTYPE,
          "arange: 'out' has dtype bool; f32, f64, i32 and i64 are supported");
    kpl_tensor *ts[] = {x, i32, u8, bl, h, bf, back, h2, hs, c, d, ar};
    for (size_t k = 0; k < sizeof ts / sizeof ts[0]; k++) kpl_tensor_release(ts[k]);
}

static void test_pool2d_by_hand(void **state)
{
    (void)state;
    int64_t xs[4] = {1, 1, 4, 4}, ys[4] = {1, 1, 2, 2};
    kpl_tensor *x = tnew(KPL_F32, 4, xs), *y = tnew(KPL_F32, 4, ys), *idx = tnew(KPL_I64, 4, ys);
    OK(kpl_k_arange(x, 0, 1));
    kpl_pool2d_params p = {.kernel = {2, 2}, .stride = {2, 2}, .padding = {0, 0}};
    OK(kpl_k_max_pool2d(y, idx, x, &p));
    double want[4] = {5, 7, 13, 15};
    assert_tensor_close(y, want, 0, 0, "max_pool2d");
    assert_tensor_close(idx, want, 0, 0, "max_pool2d indices");
    OK(kpl_k_avg_pool2d(y, x, &p));
    double avg[4] = {2.5, 4.5, 10.5, 12.5};
    assert_tensor_close(y, avg, 0, 0, "avg_pool2d");
    /* 3x3 windows, stride 1, padding 1 on the 4x4 input: the corner window
     * holds x[0:2, 0:2] = {0, 1, 4, 5} of 9 cells */
    kpl_tensor *y4 = tnew(KPL_F32, 4, xs), *i4 = tnew(KPL_I64, 4, xs);
    kpl_pool2d_params q = {.kernel = {3, 3}, .stride = {1, 1}, .padding = {1, 1}};
    OK(kpl_k_avg_pool2d(y4, x, &q));
    assert_float_equal(tget(y4, 0), 10.0 / 4, 1e-6);
    q.count_include_pad = true;
    OK(kpl_k_avg_pool2d(y4, x, &q));
    assert_float_equal(tget(y4, 0), 10.0 / 9, 1e-6);
    OK(kpl_k_max_pool2d(y4, i4, x, &q));
    assert_float_equal(tget(y4, 0), 5, 0);
    assert_float_equal(tget(y4, 15), 15, 0);
    /* NaN wins the window */
    ((float *)kpl_tensor_host_mutable(x))[6] = NAN;
    OK(kpl_k_max_pool2d(y, idx, x, &p));
    assert_true(isnan(tget(y, 1)));
    assert_float_equal(tget(idx, 1), 6, 0);
    /* adjoint pair: scatter(gather) puts each maximum back in place */
    kpl_tensor *g = tnew(KPL_F32, 4, xs);
    OK(kpl_k_plane_scatter(g, y, idx));
    assert_float_equal(tget(g, 5), 5, 0);
    assert_float_equal(tget(g, 4), 0, 0);
    /* bad input */
    kpl_pool2d_params big = {.kernel = {5, 5}, .stride = {1, 1}, .padding = {0, 0}};
    FAILS(kpl_k_avg_pool2d(y, x, &big), KPL_ESHAPE, "window 5x5 is larger than the padded input of (1,1,4,4)");
    kpl_pool2d_params padq = {.kernel = {2, 2}, .stride = {1, 1}, .padding = {2, 2}};
    FAILS(kpl_k_avg_pool2d(y, x, &padq), KPL_EINVAL, "padding 2 is more than half the window 2");
    ((int64_t *)kpl_tensor_host_mutable(idx))[2] = 99;
    FAILS(kpl_k_plane_gather(y, x, idx), KPL_ERANGE, "plane_gather: 1 indices outside the 4x4 plane");
    kpl_tensor *ts[] = {x, y, idx, y4, i4, g};
    for (size_t i = 0; i < sizeof ts / sizeof ts[0]; i++) kpl_tensor_release(ts[i]);
}

/* The 2x2/stride-2 fast path against a direct loop: odd sizes, many ties
 * (values in {0, 1, 2, 3}) and a few NaNs; first maximum wins, NaN wins. */
/* The 2x2 / stride 2 path against the general rule: ties (floored
 * values) keep the earlier cell, the first NaN wins; row widths from 4 to
 * 33 windows cover the vector loop's full steps and masked tails. */
static void test_max_pool_2x2_fast_path(void **state)
{
    (void)state;
    static const int64_t hw[4][2] = {{7, 9}, {4, 28}, {6, 35}, {3, 66}};
    for (int t = 0; t < 4; t++) {
        int64_t h = hw[t][0], w = hw[t][1], oh = h / 2, ow = w / 2;
        int64_t xs[4] = {2, 3, h, w}, ys[4] = {2, 3, oh, ow};
        kpl_tensor *x = trand(KPL_F32, 4, xs, 21 + t, 0, 4), *y = tnew(KPL_F32, 4, ys);
        kpl_tensor *idx = tnew(KPL_I64, 4, ys);
        float *xv = kpl_tensor_host_mutable(x);
        for (int64_t i = 0; i < kpl_tensor_numel(x); i++) xv[i] = floorf(xv[i]);
        xv[10] = NAN;
        xv[11] = NAN;
        xv[100] = NAN;
        kpl_pool2d_params p = {.kernel = {2, 2}, .stride = {2, 2}, .padding = {0, 0}};
        OK(kpl_k_max_pool2d(y, idx, x, &p));
        for (int64_t pl = 0; pl < 6; pl++)
            for (int64_t oy = 0; oy < oh; oy++)
                for (int64_t ox = 0; ox < ow; ox++) {
                    int64_t bi = 2 * oy * w + 2 * ox;
                    for (int64_t dy = 0; dy < 2; dy++)
                        for (int64_t dx = 0; dx < 2; dx++) {
                            int64_t c = (2 * oy + dy) * w + 2 * ox + dx;
                            float v = xv[pl * h * w + c], b = xv[pl * h * w + bi];
                            if (!isnan(b) && (isnan(v) || v > b)) bi = c;
                        }
                    int64_t o = (pl * oh + oy) * ow + ox;
                    assert_int_equal((int64_t)tget(idx, o), bi);
                    float want = xv[pl * h * w + bi];
                    if (isnan(want)) assert_true(isnan(tget(y, o)));
                    else assert_float_equal(tget(y, o), want, 0);
                }
        kpl_tensor_release(x);
        kpl_tensor_release(y);
        kpl_tensor_release(idx);
    }
}

/* Max pooling without indices (inference) gives the values of the kernel
 * with indices, bit for bit: windows of 1 to 4, strides 1 to 3, padding,
 * ceil_mode, NaNs (which win) and -inf, in f32, f64 and bf16. */
static void test_max_pool_values_only(void **state)
{
    (void)state;
    static const int cfg[][6] = {/* kh kw sh sw ph pw */
                                 {3, 3, 2, 2, 1, 1}, {2, 2, 2, 2, 0, 0}, {3, 2, 1, 3, 1, 0},
                                 {1, 1, 1, 1, 0, 0}, {4, 3, 3, 2, 2, 1}, {3, 3, 1, 1, 1, 1}};
    static const kpl_dtype dts[] = {KPL_F32, KPL_F64, KPL_BF16};
    for (int d = 0; d < 3; d++)
        for (int c = 0; c < 6; c++)
            for (int ceil = 0; ceil < 2; ceil++) {
                kpl_pool2d_params p = {{cfg[c][0], cfg[c][1]}, {cfg[c][2], cfg[c][3]},
                                       {cfg[c][4], cfg[c][5]}, false, ceil == 1};
                int64_t xs[4] = {2, 3, 9, 13}, ys[4];
                OK(kpl_shape_pool2d(xs, &p, ys));
                kpl_tensor *xf = trand(KPL_F32, 4, xs, 70 + c, -3, 3);
                float *xv = kpl_tensor_host_mutable(xf);
                xv[5] = NAN, xv[130] = NAN, xv[131] = -INFINITY, xv[400] = NAN;
                kpl_tensor *x = tnew(dts[d], 4, xs), *a = tnew(dts[d], 4, ys), *b = tnew(dts[d], 4, ys);
                kpl_tensor *idx = tnew(KPL_I64, 4, ys);
                OK(kpl_k_cast(x, xf));
                OK(kpl_k_max_pool2d(a, idx, x, &p));
                OK(kpl_k_max_pool2d(b, NULL, x, &p));
                for (int64_t i = 0; i < kpl_tensor_numel(a); i++) {
                    double va = tget(a, i), vb = tget(b, i);
                    if (isnan(va)) assert_true(isnan(vb));
                    else if (va != vb) fail_msg("%s case %d ceil %d: element %lld: %g vs %g",
                                                kpl_dtype_name(dts[d]), c, ceil, (long long)i, va, vb);
                }
                kpl_tensor_release(xf);
                kpl_tensor_release(x);
                kpl_tensor_release(a);
                kpl_tensor_release(b);
                kpl_tensor_release(idx);
            }
}

/* ceil_mode against PyTorch (torch 1.13): F.max_pool2d / F.avg_pool2d(...,
 * ceil_mode=True) on x = [(i * 7) % 25 for i in range(25)] as 1x1x5x5. */
static void test_pool2d_ceil_mode(void **state)
{
    (void)state;
    /* sizes: the division rounds up, unless the last window would start
     * past the input and its left padding (then PyTorch drops it) */
    static const struct {
        int64_t h, w;
        kpl_pool2d_params p;
        int64_t oh, ow;
    } sz[] = {
        {5, 5, {.kernel = {2, 2}, .stride = {2, 2}, .ceil_mode = true}, 3, 3},
        {6, 7, {.kernel = {3, 3}, .stride = {2, 2}, .padding = {1, 1}, .ceil_mode = true}, 4, 4},
        {4, 4, {.kernel = {2, 2}, .stride = {3, 3}, .padding = {1, 1}, .ceil_mode = true}, 2, 2},
        {5, 8, {.kernel = {2, 2}, .stride = {3, 3}, .padding = {1, 1}, .ceil_mode = true}, 2, 3},
        {5, 5, {.kernel = {2, 2}, .stride = {2, 2}}, 2, 2},
    };
    for (size_t i = 0; i < sizeof sz / sizeof sz[0]; i++) {
        int64_t xs[4] = {1, 1, sz[i].h, sz[i].w}, ys[4];
        OK(kpl_shape_pool2d(xs, &sz[i].p, ys));
        if (ys[2] != sz[i].oh || ys[3] != sz[i].ow)
            fail_msg("pool2d size case %zu: %lldx%lld, expected %lldx%lld", i, (long long)ys[2],
                     (long long)ys[3], (long long)sz[i].oh, (long long)sz[i].ow);
    }
    /* 2x2 / stride 2 on 5x5: the last row and column of windows hold one
     * input row or column (the shape the 2x2 fast path must not take) */
    int64_t xs[4] = {1, 1, 5, 5}, ys[4] = {1, 1, 3, 3};
    for (int f64 = 0; f64 < 2; f64++) {
        kpl_dtype dt = f64 ? KPL_F64 : KPL_F32;
        kpl_tensor *x = tnew(dt, 4, xs), *y = tnew(dt, 4, ys), *idx = tnew(KPL_I64, 4, ys);
        void *xv = kpl_tensor_host_mutable(x);
        for (int i = 0; i < 25; i++) {
            if (f64) ((double *)xv)[i] = (i * 7) % 25;
            else ((float *)xv)[i] = (float)((i * 7) % 25);
        }
        kpl_pool2d_params p = {.kernel = {2, 2}, .stride = {2, 2}, .ceil_mode = true};
        OK(kpl_k_max_pool2d(y, idx, x, &p));
        assert_tensor_close(y, (double[]){17, 24, 13, 20, 19, 23, 22, 11, 18}, 0, 0, "max ceil");
        /* F.max_pool2d(..., return_indices=True)[1] */
        assert_tensor_close(idx, (double[]){6, 7, 9, 10, 17, 14, 21, 23, 24}, 0, 0, "max ceil idx");
        /* count_include_pad counts no cell past the right padding (none
         * here): the corner window divides by 1 */
        p.count_include_pad = true;
        OK(kpl_k_avg_pool2d(y, x, &p));
        assert_tensor_close(y, (double[]){8.5, 16.25, 8.0, 9.75, 11.25, 15.5, 18.5, 7.5, 18.0}, 1e-6,
                            0, "avg ceil include_pad");
        kpl_tensor_release(x);
        kpl_tensor_release(y);
        kpl_tensor_release(idx);
    }
}

static void test_zero_size(void **state)
{
    (void)state;
    int64_t s[2] = {0, 4}, s4 = 4;
    kpl_tensor *a = tnew(KPL_F32, 2, s), *o = tnew(KPL_F32, 2, s), *r = tnew(KPL_F32, 1, &s4);
    OK(kpl_k_unary(o, KPL_UN_EXP, a, 0, 0));
    OK(kpl_k_binary(o, KPL_BIN_ADD, a, a));
    int ax = 0;
    OK(kpl_k_reduce(r, KPL_RED_SUM, a, &ax, 1, false, 0));
    assert_float_equal(tget(r, 3), 0, 0);
    FAILS(kpl_k_reduce(r, KPL_RED_MAX, a, &ax, 1, false, 0), KPL_ESHAPE, "no identity");
    kpl_tensor_release(a);
    kpl_tensor_release(o);
    kpl_tensor_release(r);
}

/* gather / scatter_add by their definition, the plain reference: for
 * every position of idx (row-major), its coordinates with the one along
 * `axis` replaced by the index there address x. */
static void gather_ref(int nd, const int64_t *xs, const int64_t *is, int axis,
                       const double *x, const int64_t *idx, const double *src, double *out)
{
    int64_t n = 1;
    for (int d = 0; d < nd; d++) n *= is[d];
    for (int64_t p = 0; p < n; p++) {
        int64_t c[KPL_MAX_DIMS], f = p, q = 0;
        for (int d = nd - 1; d >= 0; d--) {
            c[d] = f % is[d];
            f /= is[d];
        }
        c[axis] = idx[p];
        for (int d = 0; d < nd; d++) q = q * xs[d] + c[d];
        if (src) out[q] += src[p];
        else out[p] = x[q];
    }
}

/* An i64 tensor of `shape` with values in [0, hi). */
static kpl_tensor *rand_index(int nd, const int64_t *shape, uint64_t seed, int64_t hi)
{
    kpl_tensor *u = trand(KPL_F64, nd, shape, seed, 0, (double)hi), *t = tnew(KPL_I64, nd, shape);
    const double *uv = kpl_tensor_host_data(u);
    int64_t *tv = kpl_tensor_host_mutable(t);
    for (int64_t i = 0; i < kpl_tensor_numel(t); i++) tv[i] = (int64_t)uv[i];
    kpl_tensor_release(u);
    return t;
}

/* The kernels against gather_ref: idx as large as x off the axis (the
 * merged 3-D case), smaller in outer or inner dims (the general one),
 * the last axis, and sizes past the parallel threshold with many and with
 * one outer slice (axis 0, whose inner range is cut between threads). */
static void test_gather_scatter_add_vs_reference(void **state)
{
    (void)state;
    static const struct {
        int nd, axis;
        int64_t xs[4], is[4];
    } cases[] = {
        {3, 1, {3, 4, 5}, {3, 6, 5}},         {3, 0, {4, 5, 6}, {2, 3, 2}},
        {3, 2, {4, 5, 6}, {3, 2, 6}},         {2, 1, {5, 7}, {5, 9}},
        {4, 2, {2, 3, 4, 5}, {2, 1, 7, 5}},   {1, 0, {6}, {10}},
        {3, 1, {3, 300, 700}, {3, 500, 700}}, {2, 0, {40, 30000}, {45, 30000}},
    };
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        int nd = cases[c].nd, ax = cases[c].axis;
        const int64_t *xs = cases[c].xs, *is = cases[c].is;
        kpl_tensor *idx = rand_index(nd, is, 70 + c, xs[ax]);
        for (int f64 = 0; f64 < 2; f64++) {
            kpl_dtype dt = f64 ? KPL_F64 : KPL_F32;
            kpl_tensor *x = trand(dt, nd, xs, 80 + c, -1, 1);
            kpl_tensor *src = trand(dt, nd, is, 90 + c, -1, 1);
            kpl_tensor *g = tnew(dt, nd, is), *s = tnew(dt, nd, xs);
            kpl_tensor *x64 = tnew(KPL_F64, nd, xs), *src64 = tnew(KPL_F64, nd, is);
            OK(kpl_k_cast(x64, x));
            OK(kpl_k_cast(src64, src));
            int64_t nx = kpl_tensor_numel(x), ni = kpl_tensor_numel(idx);
            double *want = malloc((size_t)(nx > ni ? nx : ni) * sizeof *want);
            assert_non_null(want);
            OK(kpl_k_gather(g, x, ax - (c % 2 ? nd : 0), idx)); /* odd cases: negative axis */
            gather_ref(nd, xs, is, ax, kpl_tensor_host_data(x64), kpl_tensor_host_data(idx), NULL,
                       want);
            assert_tensor_close(g, want, 0, 0, "gather");
            OK(kpl_k_scatter_add(s, x, ax, idx, src));
            memcpy(want, kpl_tensor_host_data(x64), (size_t)nx * sizeof *want);
            gather_ref(nd, xs, is, ax, NULL, kpl_tensor_host_data(idx),
                       kpl_tensor_host_data(src64), want);
            /* each sum runs over the same terms in the same order */
            assert_tensor_close(s, want, f64 ? 1e-12 : 1e-5, f64 ? 1e-12 : 1e-5, "scatter_add");
            free(want);
            kpl_tensor *ts[] = {x, src, g, s, x64, src64};
            for (size_t i = 0; i < sizeof ts / sizeof ts[0]; i++) kpl_tensor_release(ts[i]);
        }
        kpl_tensor_release(idx);
    }
}

static void test_gather_dtypes_and_errors(void **state)
{
    (void)state;
    /* gather moves any dtype: i32, u8 and f16 columns picked per row */
    int64_t xs[2] = {2, 3}, is[2] = {2, 2}, iv[4] = {2, 0, 1, 1};
    kpl_tensor *idx = NULL;
    OK(kpl_tensor_from_data(kpl_device_cpu(), KPL_I64, 2, is, iv, &idx));
    kpl_tensor *x = tnew(KPL_F32, 2, xs);
    OK(kpl_k_arange(x, 1, 1)); /* 1 2 3 / 4 5 6 */
    kpl_dtype dts[3] = {KPL_I32, KPL_U8, KPL_F16};
    for (int d = 0; d < 3; d++) {
        kpl_tensor *xd = tnew(dts[d], 2, xs), *y = tnew(dts[d], 2, is);
        OK(kpl_k_cast(xd, x));
        OK(kpl_k_gather(y, xd, 1, idx));
        double want[4] = {3, 1, 5, 5};
        assert_tensor_close(y, want, 0, 0, kpl_dtype_name(dts[d]));
        kpl_tensor_release(xd);
        kpl_tensor_release(y);
    }
    /* scatter_add: repeated indices add up, in f32 */
    kpl_tensor *src = tnew(KPL_F32, 2, is), *s = tnew(KPL_F32, 2, xs);
    OK(kpl_k_fill(src, 10));
    OK(kpl_k_scatter_add(s, x, 1, idx, src));
    double sw[6] = {11, 2, 13, 4, 25, 6};
    assert_tensor_close(s, sw, 0, 0, "scatter_add");
    /* an index out of range, named with its position; negative too */
    kpl_tensor *y = tnew(KPL_F32, 2, is);
    int64_t *ip = kpl_tensor_host_mutable(idx);
    ip[3] = 3;
    FAILS(kpl_k_gather(y, x, 1, idx), KPL_ERANGE,
          "gather: index 3 at position (1,1) of idx is outside [0, 3) along axis 1 of x (2,3)");
    FAILS(kpl_k_scatter_add(s, x, -1, idx, src), KPL_ERANGE,
          "scatter_add: index 3 at position (1,1) of idx is outside [0, 3) along axis 1");
    ip[3] = 1;
    ip[1] = -1;
    FAILS(kpl_k_gather(y, x, 1, idx), KPL_ERANGE, "index -1 at position (0,1) of idx");
    ip[1] = 0;
    /* dtypes, ranks, shapes, aliasing */
    kpl_tensor *fi = tnew(KPL_F32, 2, is), *i32 = tnew(KPL_I32, 2, xs);
    kpl_tensor *i32o = tnew(KPL_I32, 2, xs);
    FAILS(kpl_k_gather(y, x, 1, fi), KPL_EDTYPE, "gather: 'idx' has dtype f32, expected i64");
    OK(kpl_k_fill(i32, 0));
    FAILS(kpl_k_scatter_add(i32o, i32, 1, idx, src), KPL_EDTYPE,
          "scatter_add: 'x' has dtype i32; f32 and f64 are supported");
    int64_t s1 = 4, s32[2] = {3, 2}, s13[2] = {1, 3};
    kpl_tensor *i1 = tnew(KPL_I64, 1, &s1), *y1 = tnew(KPL_F32, 1, &s1);
    OK(kpl_k_fill(i1, 0));
    FAILS(kpl_k_gather(y1, x, 1, i1), KPL_ESHAPE,
          "gather: idx (4) has 1 dims and x (2,3) has 2; they must have the same number");
    kpl_tensor *i32s = tnew(KPL_I64, 2, s32), *y32 = tnew(KPL_F32, 2, s32);
    OK(kpl_k_fill(i32s, 0));
    FAILS(kpl_k_gather(y32, x, 1, i32s), KPL_ESHAPE,
          "gather: idx (3,2) is larger than x (2,3) in dim 0 (3 > 2); only along axis 1");
    FAILS(kpl_k_gather(y, x, 2, idx), KPL_ESHAPE, "gather: axis 2 is out of range for x (2,3)");
    kpl_tensor *src13 = tnew(KPL_F32, 2, s13);
    FAILS(kpl_k_scatter_add(s, x, 1, idx, src13), KPL_ESHAPE,
          "scatter_add: 'src' has shape (1,3), expected (2,2) like 'idx'");
    FAILS(kpl_k_scatter_add(x, x, 1, idx, src), KPL_EINVAL, "'out' may not alias");
    FAILS(kpl_k_gather(y32, x, 1, idx), KPL_ESHAPE,
          "'out' has shape (3,2), the result has shape (2,2)");
    /* empty idx: gather makes nothing, scatter_add copies x */
    int64_t s20[2] = {2, 0};
    kpl_tensor *i0 = tnew(KPL_I64, 2, s20), *y0 = tnew(KPL_F32, 2, s20);
    kpl_tensor *src0 = tnew(KPL_F32, 2, s20);
    OK(kpl_k_gather(y0, x, 1, i0));
    OK(kpl_k_scatter_add(s, x, 1, i0, src0));
    double xw[6] = {1, 2, 3, 4, 5, 6};
    assert_tensor_close(s, xw, 0, 0, "scatter_add of nothing");
    kpl_tensor *ts[] = {idx, x, src, s, y, fi, i32, i32o, i1, y1, i32s, y32, src13, i0, y0, src0};
    for (size_t i = 0; i < sizeof ts / sizeof ts[0]; i++) kpl_tensor_release(ts[i]);
}

/* Batch norm: a channel by hand, then f32 against the f64 loops on data
 * whose mean (50) dwarfs its spread, forward and backward. */
static void test_batch_norm_kernels(void **state)
{
    (void)state;
    int64_t hs[3] = {2, 1, 2}, one = 1;
    float hx[4] = {1, 2, 3, 4}, hg = 2, hb = 0.5f;
    kpl_tensor *x = tf32(3, hs, hx), *g = tf32(1, &one, &hg), *b = tf32(1, &one, &hb);
    kpl_tensor *y = tnew(KPL_F32, 3, hs), *m = tnew(KPL_F32, 1, &one), *v = tnew(KPL_F32, 1, &one);
    OK(kpl_k_batch_norm(y, m, v, x, g, b, 0));
    assert_close(tget(m, 0), 2.5, 0, 1e-7, "mean", 0);
    assert_close(tget(v, 0), 1.25, 0, 1e-7, "var", 0);
    for (int i = 0; i < 4; i++)
        assert_close(tget(y, i), (hx[i] - 2.5) / sqrt(1.25) * 2 + 0.5, 1e-6, 1e-6, "y", i);
    /* a wrong gamma names the op and the shapes */
    int64_t two = 2;
    kpl_tensor *g2 = tnew(KPL_F32, 1, &two);
    FAILS(kpl_k_batch_norm(y, NULL, NULL, x, g2, b, 0), KPL_ESHAPE,
          "batch_norm: 'gamma' has shape (2)");
    kpl_tensor *all0[] = {x, g, b, y, m, v, g2};
    for (size_t i = 0; i < sizeof all0 / sizeof all0[0]; i++) kpl_tensor_release(all0[i]);

    int64_t xs[4] = {3, 5, 7, 9}, c = 5;
    kpl_tensor *x64 = trand(KPL_F64, 4, xs, 1, 46, 54), *gy64 = trand(KPL_F64, 4, xs, 2, -1, 1);
    kpl_tensor *g64 = trand(KPL_F64, 1, &c, 3, 0.5, 1.5), *b64 = trand(KPL_F64, 1, &c, 4, -1, 1);
    kpl_tensor *t32[4], *t64[4] = {x64, gy64, g64, b64};
    for (int i = 0; i < 4; i++) {
        t32[i] = tnew(KPL_F32, kpl_tensor_ndim(t64[i]), kpl_tensor_shape(t64[i]));
        OK(kpl_k_cast(t32[i], t64[i]));
    }
    kpl_tensor *y64 = tnew(KPL_F64, 4, xs), *y32 = tnew(KPL_F32, 4, xs);
    OK(kpl_k_batch_norm(y64, NULL, NULL, x64, g64, b64, 1e-5));
    OK(kpl_k_batch_norm(y32, NULL, NULL, t32[0], t32[2], t32[3], 1e-5));
    for (int64_t i = 0; i < kpl_tensor_numel(y64); i += 7)
        assert_close(tget(y32, i), tget(y64, i), 1e-4, 1e-4, "bn fwd f32", i);
    kpl_tensor *gx64 = tnew(KPL_F64, 4, xs), *gx32 = tnew(KPL_F32, 4, xs);
    kpl_tensor *gg64 = tnew(KPL_F64, 1, &c), *gg32 = tnew(KPL_F32, 1, &c);
    kpl_tensor *gb64 = tnew(KPL_F64, 1, &c), *gb32 = tnew(KPL_F32, 1, &c);
    OK(kpl_k_batch_norm_bwd(gx64, gg64, gb64, x64, gy64, g64, 1e-5));
    OK(kpl_k_batch_norm_bwd(gx32, gg32, gb32, t32[0], t32[1], t32[2], 1e-5));
    for (int64_t i = 0; i < kpl_tensor_numel(gx64); i += 7)
        assert_close(tget(gx32, i), tget(gx64, i), 1e-3, 1e-4, "bn bwd gx f32", i);
    for (int64_t i = 0; i < c; i++) {
        assert_close(tget(gg32, i), tget(gg64, i), 1e-3, 1e-3, "bn bwd ggamma f32", i);
        assert_close(tget(gb32, i), tget(gb64, i), 1e-4, 1e-4, "bn bwd gbeta f32", i);
    }
    /* gbeta = sum(gy), ggamma = sum(gy xhat): a direct f64 loop */
    const double *px = kpl_tensor_host_data(x64), *pg = kpl_tensor_host_data(gy64);
    const int64_t hw = 63, cnt = 3 * hw;
    for (int64_t ch = 0; ch < c; ch++) {
        double s = 0, mean = 0, var = 0, sx = 0;
        for (int64_t n = 0; n < 3; n++)
            for (int64_t i = 0; i < hw; i++) mean += px[(n * c + ch) * hw + i] / (double)cnt;
        for (int64_t n = 0; n < 3; n++)
            for (int64_t i = 0; i < hw; i++) {
                double d = px[(n * c + ch) * hw + i] - mean;
                var += d * d / (double)cnt;
            }
        for (int64_t n = 0; n < 3; n++)
            for (int64_t i = 0; i < hw; i++) {
                double gyv = pg[(n * c + ch) * hw + i];
                s += gyv;
                sx += gyv * (px[(n * c + ch) * hw + i] - mean) / sqrt(var + 1e-5);
            }
        assert_close(tget(gb64, ch), s, 1e-12, 1e-12, "gbeta", ch);
        assert_close(tget(gg64, ch), sx, 1e-10, 1e-10, "ggamma", ch);
    }
    FAILS(kpl_k_batch_norm_bwd(NULL, NULL, NULL, x64, gy64, g64, 1e-5), KPL_EINVAL,
          "batch_norm_bwd: no gradient asked for");
    kpl_tensor *all[] = {x64, gy64, g64, b64, t32[0], t32[1], t32[2], t32[3], y64, y32,
                         gx64, gx32, gg64, gg32, gb64, gb32};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) kpl_tensor_release(all[i]);
}

/* Element i of a and b hold the same bits, or both a NaN. */
static void same_bits(kpl_tensor *a, kpl_tensor *b, const char *what, kpl_dtype dt)
{
    size_t es = kpl_dtype_size(kpl_tensor_dtype(a));
    const unsigned char *pa = kpl_tensor_host_data(a), *pb = kpl_tensor_host_data(b);
    for (int64_t i = 0; i < kpl_tensor_numel(a); i++)
        if (memcmp(pa + i * es, pb + i * es, es) != 0 &&
            !(isnan(tget(a, i)) && isnan(tget(b, i))))
            fail_msg("%s %s[%lld]: fused %.9g, composed %.9g", kpl_dtype_name(dt), what,
                     (long long)i, tget(a, i), tget(b, i));
}

/* batch_norm_relu, the fused op, against batch_norm then relu, and its
 * backward against relu_bwd then batch_norm_bwd: bit for bit in every
 * dtype, for rows long and short (the kernel's two ways of summing), with
 * a NaN in one channel and, in another, outputs of exactly beta: a tiny
 * negative one (f16 rounds it to -0, which relu passes as -0). */
static void test_batch_norm_relu_kernels(void **state)
{
    (void)state;
    const kpl_dtype dts[4] = {KPL_F32, KPL_F64, KPL_BF16, KPL_F16};
    const int64_t shapes[2][4] = {{3, 5, 7, 9}, {4, 3, 1, 2}};
    for (int si = 0; si < 2; si++)
        for (int di = 0; di < 4; di++) {
            kpl_dtype dt = dts[di], pdt = dt == KPL_F64 ? KPL_F64 : KPL_F32;
            const int64_t *xs = shapes[si];
            int64_t c = xs[1], hw = xs[2] * xs[3], n = xs[0] * c * hw;
            float hx[945], hgy[945], hg[5], hb[5];
            for (int64_t i = 0; i < n; i++) {
                int64_t ch = i / hw % c;
                hx[i] = ch == 2 ? 0.0f : 2.0f * sinf(0.37f * (float)i);
                hgy[i] = cosf(0.11f * (float)i);
            }
            if (si == 0) hx[hw + 3] = NAN; /* channel 1 */
            for (int64_t ch = 0; ch < c; ch++) {
                hg[ch] = 0.5f + 0.1f * (float)ch;
                hb[ch] = 0.3f * (float)(ch - 1);
            }
            hb[2] = -1e-30f; /* channel 2 is all 0: its outputs are beta */
            kpl_tensor *src[4] = {tf32(4, xs, hx), tf32(4, xs, hgy), tf32(1, &c, hg),
                                  tf32(1, &c, hb)};
            kpl_tensor *t[4];
            for (int i = 0; i < 4; i++) {
                t[i] = tnew(i < 2 ? dt : pdt, kpl_tensor_ndim(src[i]), kpl_tensor_shape(src[i]));
                OK(kpl_k_cast(t[i], src[i]));
            }
            kpl_tensor *x = t[0], *gy = t[1], *g = t[2], *b = t[3];
            kpl_tensor *yf = tnew(dt, 4, xs), *yc = tnew(dt, 4, xs), *mf = tnew(pdt, 1, &c),
                       *mc = tnew(pdt, 1, &c), *vf = tnew(pdt, 1, &c), *vc = tnew(pdt, 1, &c);
            OK(kpl_k_batch_norm_relu(yf, mf, vf, x, g, b, 1e-5));
            OK(kpl_k_batch_norm(yc, mc, vc, x, g, b, 1e-5));
            OK(kpl_k_unary(yc, KPL_UN_RELU, yc, 0, 0));
            same_bits(yf, yc, "y", dt);
            same_bits(mf, mc, "mean", dt);
            same_bits(vf, vc, "var", dt);
            /* the fixture does what it says: zeros and negatives were cut */
            int64_t zeros = 0;
            for (int64_t i = 0; i < n; i++) zeros += tget(yf, i) == 0;
            assert_true(zeros > n / 4);
            if (dt == KPL_F16) assert_true(signbit(tget(yf, 2 * hw)));
            kpl_tensor *gxf = tnew(dt, 4, xs), *gxc = tnew(dt, 4, xs), *gyr = tnew(dt, 4, xs);
            kpl_tensor *ggf = tnew(pdt, 1, &c), *ggc = tnew(pdt, 1, &c), *gbf = tnew(pdt, 1, &c),
                       *gbc = tnew(pdt, 1, &c);
            OK(kpl_k_batch_norm_relu_bwd(gxf, ggf, gbf, x, yf, gy, g, 1e-5));
            OK(kpl_k_binary(gyr, KPL_BIN_RELU_BWD, gy, yc));
            OK(kpl_k_batch_norm_bwd(gxc, ggc, gbc, x, gyr, g, 1e-5));
            same_bits(gxf, gxc, "gx", dt);
            same_bits(ggf, ggc, "ggamma", dt);
            same_bits(gbf, gbc, "gbeta", dt);
            /* only gamma's gradient, and in place over gy */
            OK(kpl_k_batch_norm_relu_bwd(NULL, ggf, NULL, x, yf, gy, g, 1e-5));
            same_bits(ggf, ggc, "ggamma alone", dt);
            OK(kpl_k_batch_norm_relu_bwd(gy, NULL, NULL, x, yf, gy, g, 1e-5));
            same_bits(gy, gxc, "gx in place", dt);
            if (si == 0 && di == 0) {
                FAILS(kpl_k_batch_norm_relu_bwd(gxf, NULL, NULL, x, NULL, gy, g, 1e-5),
                      KPL_EINVAL, "batch_norm_relu_bwd");
                kpl_tensor *short_y = tnew(dt, 1, &c);
                FAILS(kpl_k_batch_norm_relu_bwd(gxf, NULL, NULL, x, short_y, gy, g, 1e-5),
                      KPL_ESHAPE, "batch_norm_relu_bwd: 'y' has shape (5), expected (3,5,7,9) like 'x'");
                kpl_tensor_release(short_y);
            }
            kpl_tensor *all[] = {src[0], src[1], src[2], src[3], x, gy, g, b, yf, yc, mf, mc,
                                 vf, vc, gxf, gxc, gyr, ggf, ggc, gbf, gbc};
            for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) kpl_tensor_release(all[i]);
        }
}

/* ---- loss scaling ---------------------------------------------------------------- */

/* One call of amp_unscale on 5 values of dtype dt (raw bits in `in`), each
 * expected as `want` (doubles; NaN compared as NaN) with found_inf going
 * from `flag0` to `flag1`. */
static void amp_case(kpl_dtype dt, const void *in, const double *want, float flag0, float flag1,
                     const char *what)
{
    int64_t n = 5, one = 1;
    kpl_tensor *g = NULL, *f = NULL;
    OK(kpl_tensor_from_data(kpl_device_cpu(), dt, 1, &n, in, &g));
    OK(kpl_tensor_from_data(kpl_device_cpu(), KPL_F32, 1, &one, &flag0, &f));
    OK(kpl_k_amp_unscale(g, 1.0 / 1024, f));
    for (int64_t i = 0; i < n; i++) {
        double v = tget(g, i);
        if (isnan(want[i])) {
            if (!isnan(v)) fail_msg("%s[%lld]: got %.9g, expected NaN", what, (long long)i, v);
        } else if (v != want[i]) {
            fail_msg("%s[%lld]: got %.9g, expected %.9g", what, (long long)i, v, want[i]);
        }
    }
    if (tget(f, 0) != flag1)
        fail_msg("%s: found_inf %g, expected %g", what, tget(f, 0), (double)flag1);
    kpl_tensor_release(g);
    kpl_tensor_release(f);
}

/* kpl_k_amp_unscale by hand: every value times 1/1024 exactly, found_inf
 * raised by inf, -inf or NaN in each float dtype and never lowered. */
static void test_amp_unscale(void **state)
{
    (void)state;
    const double inf = INFINITY;
    /* f32 and f64: finite values (exact products), then each special */
    float f32_fin[5] = {2048, -3, 0.5f, 65504, 0};
    double want_fin[5] = {2, -3.0 / 1024, 1.0 / 2048, 65504.0 / 1024, 0};
    amp_case(KPL_F32, f32_fin, want_fin, 0, 0, "f32 finite");
    amp_case(KPL_F32, f32_fin, want_fin, 1, 1, "f32 finite, flag already set");
    float f32_inf[5] = {2048, (float)inf, 0.5f, 65504, 0};
    double want_inf[5] = {2, inf, 1.0 / 2048, 65504.0 / 1024, 0};
    amp_case(KPL_F32, f32_inf, want_inf, 0, 1, "f32 inf");
    float f32_ninf[5] = {2048, -3, 0.5f, 65504, -(float)inf};
    double want_ninf[5] = {2, -3.0 / 1024, 1.0 / 2048, 65504.0 / 1024, -inf};
    amp_case(KPL_F32, f32_ninf, want_ninf, 0, 1, "f32 -inf");
    float f32_nan[5] = {NAN, -3, 0.5f, 65504, 0};
    double want_nan[5] = {NAN, -3.0 / 1024, 1.0 / 2048, 65504.0 / 1024, 0};
    amp_case(KPL_F32, f32_nan, want_nan, 0, 1, "f32 NaN");
    double f64_fin[5] = {2048, -3, 0.5, 65504, 0}, f64_inf[5] = {2048, -3, 0.5, inf, 0};
    double f64_nan[5] = {2048, -3, NAN, 65504, 0}, f64_ninf[5] = {-inf, -3, 0.5, 65504, 0};
    double w64_inf[5] = {2, -3.0 / 1024, 1.0 / 2048, inf, 0};
    double w64_nan[5] = {2, -3.0 / 1024, NAN, 65504.0 / 1024, 0};
    double w64_ninf[5] = {-inf, -3.0 / 1024, 1.0 / 2048, 65504.0 / 1024, 0};
    amp_case(KPL_F64, f64_fin, want_fin, 0, 0, "f64 finite");
    amp_case(KPL_F64, f64_inf, w64_inf, 0, 1, "f64 inf");
    amp_case(KPL_F64, f64_nan, w64_nan, 0, 1, "f64 NaN");
    amp_case(KPL_F64, f64_ninf, w64_ninf, 0, 1, "f64 -inf");
    /* f16: 2048, -3, 0.5, 65504 (its largest finite value), 0 and the
     * specials by their bits */
    uint16_t h_fin[5] = {0x6800, 0xc200, 0x3800, 0x7bff, 0x0000};
    uint16_t h_inf[5] = {0x6800, 0x7c00, 0x3800, 0x7bff, 0x0000};
    uint16_t h_ninf[5] = {0x6800, 0xc200, 0x3800, 0x7bff, 0xfc00};
    uint16_t h_nan[5] = {0x7e00, 0xc200, 0x3800, 0x7bff, 0x0000};
    amp_case(KPL_F16, h_fin, want_fin, 0, 0, "f16 finite");
    amp_case(KPL_F16, h_inf, want_inf, 0, 1, "f16 inf");
    amp_case(KPL_F16, h_ninf, want_ninf, 0, 1, "f16 -inf");
    amp_case(KPL_F16, h_nan, want_nan, 0, 1, "f16 NaN");
    /* bf16: 2048, -3, 0.5, 384, 0 */
    uint16_t b_fin[5] = {0x4500, 0xc040, 0x3f00, 0x43c0, 0x0000};
    uint16_t b_inf[5] = {0x4500, 0x7f80, 0x3f00, 0x43c0, 0x0000};
    uint16_t b_ninf[5] = {0x4500, 0xc040, 0x3f00, 0x43c0, 0xff80};
    uint16_t b_nan[5] = {0x7fc0, 0xc040, 0x3f00, 0x43c0, 0x0000};
    double wb_fin[5] = {2, -3.0 / 1024, 1.0 / 2048, 0.375, 0};
    double wb_inf[5] = {2, inf, 1.0 / 2048, 0.375, 0};
    double wb_ninf[5] = {2, -3.0 / 1024, 1.0 / 2048, 0.375, -inf};
    double wb_nan[5] = {NAN, -3.0 / 1024, 1.0 / 2048, 0.375, 0};
    amp_case(KPL_BF16, b_fin, wb_fin, 0, 0, "bf16 finite");
    amp_case(KPL_BF16, b_inf, wb_inf, 0, 1, "bf16 inf");
    amp_case(KPL_BF16, b_ninf, wb_ninf, 0, 1, "bf16 -inf");
    amp_case(KPL_BF16, b_nan, wb_nan, 0, 1, "bf16 NaN");
    /* a half product that rounds: 3 x f32(0.1) = 0.3 in f32, whose nearest
     * f16 is 0.300048828125 (0x34cd) */
    {
        int64_t one = 1;
        uint16_t three = 0x4200;
        float z = 0;
        kpl_tensor *g = NULL, *f = NULL;
        OK(kpl_tensor_from_data(kpl_device_cpu(), KPL_F16, 1, &one, &three, &g));
        OK(kpl_tensor_from_data(kpl_device_cpu(), KPL_F32, 1, &one, &z, &f));
        OK(kpl_k_amp_unscale(g, 0.1, f));
        assert_int_equal(*(const uint16_t *)kpl_tensor_host_data(g), 0x34cd);
        assert_float_equal(tget(f, 0), 0, 0);
        kpl_tensor_release(g);
        kpl_tensor_release(f);
    }
    /* large enough for the OpenMP chunks: one inf deep inside */
    int64_t big = 3 << 20, one = 1;
    kpl_tensor *g = tnew(KPL_F32, 1, &big), *f = tnew(KPL_F32, 1, &one);
    OK(kpl_k_fill(g, 6));
    OK(kpl_k_fill(f, 0));
    OK(kpl_k_amp_unscale(g, 0.5, f));
    assert_float_equal(tget(f, 0), 0, 0);
    ((float *)kpl_tensor_host_mutable(g))[big - 7] = INFINITY;
    OK(kpl_k_amp_unscale(g, 0.5, f));
    assert_float_equal(tget(f, 0), 1, 0);
    assert_float_equal(tget(g, 0), 1.5, 0);
    assert_float_equal(tget(g, big - 1), 1.5, 0);
    assert_true(isinf(tget(g, big - 7)));
    /* errors name the argument */
    int64_t two = 2;
    kpl_tensor *i32 = tnew(KPL_I32, 1, &one), *f64 = tnew(KPL_F64, 1, &one);
    kpl_tensor *f2 = tnew(KPL_F32, 1, &two);
    FAILS(kpl_k_amp_unscale(i32, 0.5, f), KPL_EDTYPE, "amp_unscale: 'g' has dtype i32");
    FAILS(kpl_k_amp_unscale(g, 0.5, f64), KPL_EDTYPE,
          "amp_unscale: 'found_inf' has dtype f64, expected f32");
    FAILS(kpl_k_amp_unscale(g, 0.5, f2), KPL_ESHAPE,
          "amp_unscale: 'found_inf' has shape (2) (2 elements)");
    FAILS(kpl_k_amp_unscale(g, NAN, f), KPL_EINVAL, "amp_unscale: inv_scale nan is not finite");
    FAILS(kpl_k_amp_unscale(NULL, 0.5, f), KPL_EINVAL, "argument 'g' is NULL");
    FAILS(kpl_k_amp_unscale(g, 0.5, NULL), KPL_EINVAL, "argument 'found_inf' is NULL");
    kpl_tensor *flat = NULL, *fv = NULL;
    OK(kpl_tensor_narrow(f2, 1, 1, &fv));
    OK(kpl_tensor_narrow(f2, 0, 2, &flat));
    FAILS(kpl_k_amp_unscale(flat, 0.5, fv), KPL_EINVAL, "'found_inf' overlaps 'g'");
    kpl_tensor *ts[] = {g, f, i32, f64, f2, flat, fv};
    for (size_t i = 0; i < sizeof ts / sizeof ts[0]; i++) kpl_tensor_release(ts[i]);
}

int run_ops_tests(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_unary_all),
        cmocka_unit_test(test_unary_int),
        cmocka_unit_test(test_binary_broadcast),
        cmocka_unit_test(test_binary_int_scalar_inplace),
        cmocka_unit_test(test_binary_streaming),
        cmocka_unit_test(test_binary_errors),
        cmocka_unit_test(test_where),
        cmocka_unit_test(test_reduce_all_axes_sets),
        cmocka_unit_test(test_reduce_large_and_special),
        cmocka_unit_test(test_matmul_transposes),
        cmocka_unit_test(test_matmul_primitive_cache),
        cmocka_unit_test(test_matmul_batched),
        cmocka_unit_test(test_fill_cast_copy),
        cmocka_unit_test(test_pool2d_by_hand),
        cmocka_unit_test(test_max_pool_2x2_fast_path),
        cmocka_unit_test(test_max_pool_values_only),
        cmocka_unit_test(test_pool2d_ceil_mode),
        cmocka_unit_test(test_batch_norm_kernels),
        cmocka_unit_test(test_batch_norm_relu_kernels),
        cmocka_unit_test(test_zero_size),
        cmocka_unit_test(test_gather_scatter_add_vs_reference),
        cmocka_unit_test(test_gather_dtypes_and_errors),
        cmocka_unit_test(test_amp_unscale),
    };
    return cmocka_run_group_tests_name("ops", tests, NULL, NULL);
}
