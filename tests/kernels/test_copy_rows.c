/* test_copy_rows.c — where() and the copies a row at a time (expand,
 * permute) on tensors long enough to cross chunks and vector ends, each
 * element against the value it must take. */
#include "test_util.h"
#include "kernels_impl.h"

/* where() on tensors long enough to split into chunks, with a, b or both
 * scalars (the contiguous fast paths) and with a row-broadcast condition
 * (the general walk), each element against its own choice; and the copies
 * a row at a time: an expand along the last dim (a fill), along the first
 * (whole rows), and a permute's strided rows, element for element. */
static kpl_tensor *normal_f32(int ndim, const int64_t *shape, kpl_rng *rng)
{
    kpl_tensor *t = tnew(KPL_F32, ndim, shape);
    OK(kpl_k_normal(t, rng, 0, 1));
    return t;
}

static void test_where_and_copy_rows(void **state)
{
    (void)state;
    enum { R = 37, C = 211 }; /* odd sizes: rows and chunks end mid-vector */
    int64_t s2[2] = {R, C}, s1 = 1, r1[2] = {R, 1}, c1[2] = {1, C};
    kpl_rng *rng = kpl_rng_create(21);
    kpl_tensor *a = normal_f32(2, s2, rng), *b = normal_f32(2, s2, rng);
    kpl_tensor *a0 = normal_f32(2, c1, rng), *b0 = normal_f32(2, c1, rng);
    kpl_tensor *ca = tnew(KPL_BOOL, 2, s2), *crow = tnew(KPL_BOOL, 2, c1);
    kpl_tensor *sa = tf32(1, &s1, (float[]){7}), *sb = tf32(1, &s1, (float[]){-3});
    OK(kpl_k_binary(ca, KPL_BIN_GT, a, b));
    OK(kpl_k_binary(crow, KPL_BIN_GT, a0, b0));
    kpl_tensor *o = tnew(KPL_F32, 2, s2);
    for (int k = 0; k < 4; k++) { /* (a, b), (a, 7), (-3, b), (a, b) by a row's mask */
        kpl_tensor *x = k == 2 ? sb : a, *y = k == 1 ? sa : b, *c = k == 3 ? crow : ca;
        OK(kpl_k_where(o, c, x, y));
        for (int64_t i = 0; i < R * C; i++) {
            bool pick = tget(c, k == 3 ? i % C : i) != 0;
            double want = pick ? tget(x, k == 2 ? 0 : i) : tget(y, k == 1 ? 0 : i);
            if (tget(o, i) != want)
                fail_msg("where %d [%lld]: %g, want %g", k, (long long)i, tget(o, i), want);
        }
    }
    kpl_tensor *cc = normal_f32(2, r1, rng), *rc = normal_f32(2, c1, rng);
    kpl_tensor *ec = tnew(KPL_F32, 2, s2), *er = tnew(KPL_F32, 2, s2);
    OK(kpl_k_expand(ec, cc));
    OK(kpl_k_expand(er, rc));
    int64_t st[2] = {C, R};
    kpl_tensor *t = tnew(KPL_F32, 2, st);
    OK(kpl_k_permute(t, a, (int[]){1, 0}));
    for (int64_t i = 0; i < R * C; i++) {
        int64_t r = i / C, q = i % C;
        assert_float_equal(tget(ec, i), tget(cc, r), 0);
        assert_float_equal(tget(er, i), tget(rc, q), 0);
        assert_float_equal(tget(t, q * R + r), tget(a, i), 0);
    }
    kpl_tensor *ts[] = {a, b, a0, b0, ca, crow, sa, sb, o, cc, rc, ec, er, t};
    for (size_t i = 0; i < sizeof ts / sizeof ts[0]; i++) kpl_tensor_release(ts[i]);
    kpl_rng_destroy(rng);
}

int run_copy_rows_tests(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_where_and_copy_rows),
    };
    return cmocka_run_group_tests_name("copy_rows", tests, NULL, NULL);
}
