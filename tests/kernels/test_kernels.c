/* test_kernels.c — devices, status, dtypes, tensors, views, storage, RNG;
 * main() of the kernels test executable. */
#include "test_util.h"

#include <stdlib.h>
#include <time.h>

static void test_status_and_version(void **state)
{
    (void)state;
    assert_string_equal(kpl_status_str(KPL_ESHAPE), "KPL_ESHAPE");
    assert_string_equal(kpl_status_msg(KPL_ENOMEM), "out of memory");
    assert_string_equal(kpl_status_str(-999), "KPL_UNKNOWN_STATUS");
    assert_string_equal(kpl_version(), "0.1.0");
    assert_non_null(strstr(kpl_build_info(), "oneDNN"));
    kpl_dtype dt;
    OK(kpl_dtype_parse("float32", &dt));
    assert_int_equal(dt, KPL_F32);
    OK(kpl_dtype_parse("bf16", &dt));
    assert_int_equal(dt, KPL_BF16);
    FAILS(kpl_dtype_parse("float8", &dt), KPL_EDTYPE, "unknown dtype 'float8'");
    assert_int_equal(kpl_dtype_size(KPL_I64), 8);
    assert_int_equal(kpl_dtype_size((kpl_dtype)99), 0);
    assert_string_equal(kpl_dtype_name((kpl_dtype)99), "invalid");
}

static void test_devices(void **state)
{
    (void)state;
    kpl_device *d = NULL;
    OK(kpl_device_get("cpu", &d));
    assert_ptr_equal(d, kpl_device_cpu());
    assert_string_equal(kpl_device_name(d), "cpu");
    assert_int_equal(kpl_device_count(KPL_DEVICE_CPU), 1);
    FAILS(kpl_device_get("tpu:0", &d), KPL_EINVAL, "unknown device 'tpu:0'");
    FAILS(kpl_device_get("cuda:x", &d), KPL_EINVAL, "malformed device name");
    if (kpl_device_count(KPL_DEVICE_CUDA) == 0) {
        /* With or without a CUDA backend, asking for a GPU says why not. */
        kpl_status st = kpl_device_get("cuda:0", &d);
        assert_int_equal(st, KPL_EDEVICE);
        assert_true(strstr(kpl_last_error(), "no CUDA GPU was found") ||
                    strstr(kpl_last_error(), "no CUDA backend"));
        /* The reason on its own (the trainer's and comm's messages carry
         * it), and the same text inside device_get's message. */
        const char *why = kpl_device_unavailable_reason(KPL_DEVICE_CUDA);
        assert_non_null(why);
        assert_true(strlen(why) > 5);
        if (kpl_device_type_built(KPL_DEVICE_CUDA)) {
            (void)kpl_device_get("cuda:0", &d);
            if (!strstr(kpl_last_error(), why))
                fail_msg("'%s' lacks the reason '%s'", kpl_last_error(), why);
        } else {
            assert_non_null(strstr(why, "no CUDA backend"));
        }
    } else {
        FAILS(kpl_device_get("cuda:99", &d), KPL_EDEVICE, "only");
        assert_null(kpl_device_unavailable_reason(KPL_DEVICE_CUDA));
    }
    assert_null(kpl_device_unavailable_reason(KPL_DEVICE_CPU));
    OK(kpl_device_synchronize(kpl_device_cpu()));
    /* CPU events: complete once recorded, timed by the host clock. */
    kpl_event *e0 = NULL, *e1 = NULL;
    OK(kpl_event_create(kpl_device_cpu(), &e0));
    OK(kpl_event_create(kpl_device_cpu(), &e1));
    bool done = false;
    FAILS(kpl_event_query(e0, &done), KPL_ESTATE, "never recorded");
    OK(kpl_event_record(e0));
    struct timespec ts = {0, 20 * 1000 * 1000};
    nanosleep(&ts, NULL);
    OK(kpl_event_record(e1));
    OK(kpl_event_synchronize(e1));
    OK(kpl_event_query(e1, &done));
    assert_true(done);
    double ms = 0;
    OK(kpl_event_elapsed_ms(e0, e1, &ms));
    assert_true(ms >= 19.0 && ms < 2000.0);
    kpl_event_destroy(e0);
    kpl_event_destroy(e1);
    kpl_event_destroy(NULL);
}

static void test_tensor_basics(void **state)
{
    (void)state;
    int64_t shape[3] = {2, 3, 4};
    kpl_tensor *t = tnew(KPL_F32, 3, shape);
    assert_int_equal(kpl_tensor_ndim(t), 3);
    assert_int_equal(kpl_tensor_numel(t), 24);
    assert_int_equal(kpl_tensor_nbytes(t), 96);
    assert_int_equal(kpl_tensor_dim(t, -1), 4);
    char buf[64];
    assert_string_equal(kpl_shape_str(3, shape, buf, sizeof buf), "(2,3,4)");
    assert_int_equal(kpl_storage_state(kpl_tensor_storage(t)), KPL_MEM_EMPTY);
    OK(kpl_k_arange(t, 0, 1));
    assert_int_equal(kpl_storage_state(kpl_tensor_storage(t)), KPL_MEM_HOST);
    assert_float_equal(tget(t, 23), 23.0, 0);

    /* Views share storage, count references, and see writes. */
    kpl_tensor *r = NULL, *f = NULL, *u = NULL, *s = NULL, *n = NULL;
    int64_t rs[2] = {6, -1};
    OK(kpl_tensor_reshape(t, 2, rs, &r));
    assert_int_equal(kpl_tensor_shape(r)[1], 4);
    assert_true(kpl_tensor_shares_storage(r, t));
    OK(kpl_tensor_flatten(t, 1, 2, &f));
    assert_int_equal(kpl_tensor_ndim(f), 2);
    assert_int_equal(kpl_tensor_shape(f)[1], 12);
    OK(kpl_tensor_unsqueeze(t, 1, &u));
    assert_int_equal(kpl_tensor_ndim(u), 4);
    assert_int_equal(kpl_tensor_shape(u)[1], 1);
    OK(kpl_tensor_squeeze(u, 1, &s));
    assert_int_equal(kpl_tensor_ndim(s), 3);
    OK(kpl_tensor_narrow(t, 1, 1, &n));
    assert_int_equal(kpl_tensor_numel(n), 12);
    assert_int_equal(kpl_tensor_offset(n), 48);
    assert_float_equal(tget(n, 0), 12.0, 0);
    float *w = kpl_tensor_host_mutable(n);
    w[0] = -5.0f;
    assert_float_equal(tget(t, 12), -5.0, 0);
    assert_float_equal(tget(r, 12), -5.0, 0);

    int64_t bad[2] = {5, -1};
    kpl_tensor *x = NULL;
    FAILS(kpl_tensor_reshape(t, 2, bad, &x), KPL_ESHAPE, "cannot view (2,3,4) as (5,-1)");
    FAILS(kpl_tensor_squeeze(t, 0, &x), KPL_ESHAPE, "has size 2, not 1");
    FAILS(kpl_tensor_narrow(t, 1, 2, &x), KPL_ERANGE, "rows [1, 3) out of range for (2,3,4)");
    FAILS(kpl_tensor_unsqueeze(t, 5, &x), KPL_ESHAPE, "axis 5 out of range");
    int64_t nine[9] = {1, 1, 1, 1, 1, 1, 1, 1, 1};
    FAILS(kpl_tensor_empty(kpl_device_cpu(), KPL_F32, 9, nine, &x), KPL_ESHAPE,
          "at most 8 are supported");
    FAILS(kpl_tensor_empty(kpl_device_cpu(), (kpl_dtype)42, 1, nine, &x), KPL_EDTYPE,
          "unknown dtype 42");
    int64_t neg[1] = {-3};
    FAILS(kpl_tensor_empty(kpl_device_cpu(), KPL_F32, 1, neg, &x), KPL_ESHAPE,
          "negative size -3");
    /* Releasing the base first keeps the views alive (storage refcount). */
    kpl_tensor_release(t);
    assert_float_equal(tget(r, 23), 23.0, 0);
    kpl_tensor_release(r);
    kpl_tensor_release(f);
    kpl_tensor_release(u);
    kpl_tensor_release(s);
    kpl_tensor_release(n);
    kpl_tensor_release(NULL);
}

static int meta_freed;
static void meta_free(void *m)
{
    meta_freed += *(int *)m;
}

/* Accessors take NULL as ops do: neutral answers, and the data accessors
 * say what was NULL, keeping the failed op's message. */
static void test_tensor_null(void **state)
{
    (void)state;
    assert_int_equal(kpl_tensor_ndim(NULL), 0);
    assert_int_equal(kpl_tensor_numel(NULL), 0);
    assert_int_equal(kpl_tensor_nbytes(NULL), 0);
    assert_int_equal(kpl_tensor_dim(NULL, 0), 0);
    assert_null(kpl_tensor_shape(NULL));
    assert_null(kpl_tensor_device(NULL));
    kpl_clear_error();
    assert_null(kpl_tensor_host_data(NULL));
    assert_int_equal(kpl_last_status(), KPL_EINVAL);
    assert_non_null(strstr(kpl_last_error(), "tensor_host_data: NULL tensor (a batch feature"));
    kpl_set_error(KPL_ESHAPE, "add: shapes (2) and (3)");
    assert_null(kpl_tensor_host_mutable(NULL));
    assert_int_equal(kpl_last_status(), KPL_ESHAPE);
    assert_non_null(strstr(kpl_last_error(),
                           "tensor_host_mutable: NULL tensor, from a failed op: add: shapes"));
    kpl_clear_error();
}

static void test_tensor_meta(void **state)
{
    (void)state;
    int64_t n = 4;
    kpl_tensor *t = tnew(KPL_F32, 1, &n), *v = NULL;
    static int tag = 7;
    assert_null(kpl_tensor_meta(t));
    kpl_tensor_set_meta(t, &tag, meta_free);
    assert_ptr_equal(kpl_tensor_meta(t), &tag);
    OK(kpl_tensor_reshape(t, 1, &n, &v));
    assert_null(kpl_tensor_meta(v)); /* a view has its own header */
    kpl_tensor_retain(t);
    assert_int_equal(kpl_tensor_refcount(t), 2);
    meta_freed = 0;
    kpl_tensor_release(t);
    assert_int_equal(meta_freed, 0);
    kpl_tensor_release(t);
    assert_int_equal(meta_freed, 7); /* freed with the header */
    kpl_tensor_release(v);
}

static void test_permute(void **state)
{
    (void)state;
    int64_t shape[3] = {2, 3, 4};
    kpl_tensor *t = tnew(KPL_I64, 3, shape), *p = NULL;
    OK(kpl_k_arange(t, 0, 1));
    int perm[3] = {2, 0, 1};
    OK(kpl_tensor_permute(t, perm, &p));
    assert_int_equal(kpl_tensor_shape(p)[0], 4);
    assert_int_equal(kpl_tensor_shape(p)[1], 2);
    assert_int_equal(kpl_tensor_shape(p)[2], 3);
    /* p[k][i][j] = t[i][j][k] = 12 i + 4 j + k */
    for (int k = 0; k < 4; k++)
        for (int i = 0; i < 2; i++)
            for (int j = 0; j < 3; j++)
                assert_int_equal((int64_t)tget(p, k * 6 + i * 3 + j), 12 * i + 4 * j + k);
    assert_false(kpl_tensor_shares_storage(p, t));
    int bad[3] = {0, 0, 1};
    kpl_tensor *x = NULL;
    FAILS(kpl_tensor_permute(t, bad, &x), KPL_EINVAL, "not a permutation");
    kpl_tensor_release(p);
    kpl_tensor_release(t);
}

static void test_half_conversions(void **state)
{
    (void)state;
    /* Reference encodings (IEEE 754 binary16 and bfloat16). */
    assert_int_equal(kpl_f32_to_f16(1.0f), 0x3c00);
    assert_int_equal(kpl_f32_to_f16(-2.0f), 0xc000);
    assert_int_equal(kpl_f32_to_f16(65504.0f), 0x7bff);
    assert_int_equal(kpl_f32_to_f16(65520.0f), 0x7c00); /* rounds to Inf */
    assert_int_equal(kpl_f32_to_f16(5.9604645e-8f), 0x0001); /* smallest subnormal */
    assert_int_equal(kpl_f32_to_f16(1.0009765625f), 0x3c01);
    assert_int_equal(kpl_f32_to_f16(1.00048828125f), 0x3c00); /* tie to even */
    assert_int_equal(kpl_f32_to_f16(1.00146484375f), 0x3c02); /* tie to even (up) */
    assert_true((kpl_f32_to_f16(NAN) & 0x7c00) == 0x7c00 && (kpl_f32_to_f16(NAN) & 0x3ff));
    assert_float_equal(kpl_f16_to_f32(0x3555), 0.333251953125, 0);
    assert_float_equal(kpl_f16_to_f32(0x0001), 5.9604644775390625e-8, 0);
    assert_true(isinf(kpl_f16_to_f32(0xfc00)) && kpl_f16_to_f32(0xfc00) < 0);
    assert_int_equal(kpl_f32_to_bf16(1.0f), 0x3f80);
    assert_int_equal(kpl_f32_to_bf16(3.140625f), 0x4049);
    assert_int_equal(kpl_f32_to_bf16(1.00390625f), 0x3f80); /* tie to even */
    assert_float_equal(kpl_bf16_to_f32(0x4049), 3.140625, 0);
    /* Every finite f16 survives f16 -> f32 -> f16. */
    for (uint32_t h = 0; h < 0x10000; h++) {
        if ((h & 0x7c00) == 0x7c00) continue;
        assert_int_equal(kpl_f32_to_f16(kpl_f16_to_f32((uint16_t)h)), h);
    }
}

static void test_philox(void **state)
{
    (void)state;
    /* Known-answer vectors of Philox-4x32-10 (Random123's kat_vectors). */
    uint32_t r[4];
    kpl_philox4x32(0, 0, 0, r);
    assert_int_equal(r[0], 0x6627e8d5);
    assert_int_equal(r[1], 0xe169c58d);
    assert_int_equal(r[2], 0xbc57ac4c);
    assert_int_equal(r[3], 0x9b00dbd8);
    kpl_philox4x32(0xffffffffffffffffULL, 0xffffffffffffffffULL, 0xffffffffffffffffULL, r);
    assert_int_equal(r[0], 0x408f276d);
    assert_int_equal(r[1], 0x41c83b0e);
    assert_int_equal(r[2], 0xa20bc7c6);
    assert_int_equal(r[3], 0x6d5451fd);
    /* key (0xa4093822, 0x299f31d0), counter (0x243f6a88, 0x85a308d3,
     * 0x13198a2e, 0x03707344) */
    kpl_philox4x32(0x299f31d0a4093822ULL, 0x0370734413198a2eULL, 0x85a308d3243f6a88ULL, r);
    assert_int_equal(r[0], 0xd16cfe09);
    assert_int_equal(r[1], 0x94fdcceb);
    assert_int_equal(r[2], 0x5001e420);
    assert_int_equal(r[3], 0x24126ea1);
}

static void test_random_reproducible(void **state)
{
    (void)state;
    int64_t n = 100003; /* odd size: a partial last block */
    kpl_tensor *a = tnew(KPL_F32, 1, &n), *b = tnew(KPL_F32, 1, &n);
    kpl_rng *r = kpl_rng_create(2024);
    kpl_set_num_threads(1);
    OK(kpl_k_normal(a, r, 1.0, 2.0));
    assert_int_equal(kpl_rng_offset(r), (uint64_t)(n + 3) / 4);
    kpl_rng_set_state(r, 2024, 0);
    kpl_set_num_threads(2);
    OK(kpl_k_normal(b, r, 1.0, 2.0));
    assert_memory_equal(kpl_tensor_host_data(a), kpl_tensor_host_data(b), (size_t)n * 4);
    /* Statistics of normal(1, 2): mean and variance within 4 sigma. */
    kpl_tensor *m = tnew(KPL_F32, 0, NULL), *v = tnew(KPL_F32, 0, NULL);
    OK(kpl_k_reduce(m, KPL_RED_MEAN, a, NULL, 0, false, 0));
    OK(kpl_k_reduce(v, KPL_RED_VAR, a, NULL, 0, false, 1));
    assert_true(fabs(tget(m, 0) - 1.0) < 4 * 2.0 / sqrt((double)n));
    assert_true(fabs(tget(v, 0) - 4.0) < 4 * 4.0 * sqrt(2.0 / (double)n));
    /* Uniform values: element i comes from block i/4, word i%4. */
    kpl_rng_set_state(r, 7, 5);
    OK(kpl_k_uniform(a, r, -1.0, 3.0));
    uint32_t w[4];
    kpl_philox4x32(7, 0, 5 + 2, w);
    double expect = -1.0 + 4.0 * (double)(w[1] >> 8) / 16777216.0;
    assert_float_equal(tget(a, 9), expect, 1e-6);
    /* Bounds hold for every element. */
    kpl_tensor *mx = tnew(KPL_F32, 0, NULL), *mn = tnew(KPL_F32, 0, NULL);
    OK(kpl_k_reduce(mx, KPL_RED_MAX, a, NULL, 0, false, 0));
    OK(kpl_k_reduce(mn, KPL_RED_MIN, a, NULL, 0, false, 0));
    assert_true(tget(mx, 0) < 3.0 && tget(mx, 0) > 2.99);
    assert_true(tget(mn, 0) >= -1.0 && tget(mn, 0) < -0.99);
    /* f64 normal: mean and spread too. */
    kpl_tensor *d = tnew(KPL_F64, 1, &n);
    OK(kpl_k_normal(d, r, -3.0, 0.5));
    kpl_tensor *dm = tnew(KPL_F64, 0, NULL);
    OK(kpl_k_reduce(dm, KPL_RED_MEAN, d, NULL, 0, false, 0));
    assert_true(fabs(tget(dm, 0) + 3.0) < 4 * 0.5 / sqrt((double)n));
    kpl_tensor *i32 = tnew(KPL_I32, 1, &n);
    FAILS(kpl_k_uniform(i32, r, 0, 1), KPL_EDTYPE,
          "uniform: 'out' has dtype i32; f32, f64, f16 and bf16 are supported");
    FAILS(kpl_k_uniform(a, NULL, 0, 1), KPL_EINVAL, "'rng' is NULL");
    FAILS(kpl_k_normal(a, r, 0, -1), KPL_EINVAL, "negative std");
    kpl_rng_destroy(r);
    kpl_tensor *ts[] = {a, b, m, v, mx, mn, d, dm, i32};
    for (size_t i = 0; i < sizeof ts / sizeof ts[0]; i++) kpl_tensor_release(ts[i]);
}

static void test_registry(void **state)
{
    (void)state;
    kpl_kernel_fn fn = NULL;
    OK(kpl_kernel_lookup(KPL_KOP_MATMUL, KPL_DEVICE_CPU, KPL_F32, &fn));
    assert_non_null(fn);
    FAILS(kpl_kernel_lookup(KPL_KOP_MATMUL, KPL_DEVICE_CPU, KPL_I32, &fn), KPL_ENOKERNEL,
          "no 'matmul' kernel for device cpu and dtype i32");
    if (!kpl_device_type_built(KPL_DEVICE_CUDA))
        FAILS(kpl_kernel_lookup(KPL_KOP_BINARY, KPL_DEVICE_CUDA, KPL_F32, &fn), KPL_ENOKERNEL,
              "device cuda");
    FAILS(kpl_kernel_register(KPL_KOP_COUNT, KPL_DEVICE_CPU, KPL_F32, fn), KPL_EINVAL,
          "out of range");
}

int run_tensor_tests(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_status_and_version),
        cmocka_unit_test(test_devices),
        cmocka_unit_test(test_tensor_basics),
        cmocka_unit_test(test_tensor_null),
        cmocka_unit_test(test_tensor_meta),
        cmocka_unit_test(test_permute),
        cmocka_unit_test(test_half_conversions),
        cmocka_unit_test(test_philox),
        cmocka_unit_test(test_random_reproducible),
        cmocka_unit_test(test_registry),
    };
    return cmocka_run_group_tests_name("tensor", tests, NULL, NULL);
}

int main(void)
{
    int failed = 0;
    failed += run_tensor_tests();
    failed += run_alloc_tests();
    failed += run_ops_tests();
    failed += run_conv_tests();
    failed += run_copy_rows_tests();
    failed += run_bn_saved_tests();
    failed += run_sgd_tests();
    return failed ? 1 : 0;
}
