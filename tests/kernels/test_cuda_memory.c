/* test_cuda_memory.c — memory and ordering on the GPU: transfers (pageable
 * through the staging buffer, page-locked without a host wait), the order
 * of kernels, frees, reallocations and uploads, the deferred index errors,
 * and tensors large enough for several grid-stride passes or indices past
 * 2^31. */
#include "test_cuda_util.h"

/* The release callback of a wrapped storage: counts calls. */
static void count_release(void *ctx) { ++*(int *)ctx; }

/* A CPU tensor over caller memory (as the loader's batches are). */
static kpl_tensor *wrap_u8(void *p, int64_t n, int *released)
{
    kpl_storage *s = NULL;
    kpl_tensor *t = NULL;
    OK(kpl_storage_wrap(p, (size_t)n, count_release, released, &s));
    OK(kpl_tensor_from_storage(s, 0, KPL_U8, 1, &n, &t));
    kpl_storage_release(s); /* the tensor holds it */
    return t;
}

static void fill_pattern(uint8_t *p, int64_t n, unsigned seed)
{
    for (int64_t i = 0; i < n; i++) p[i] = (uint8_t)((i * 131 + seed) % 251);
}

static void assert_pattern(kpl_tensor *g, int64_t n, unsigned seed, const char *what)
{
    kpl_tensor *h = to_cpu(g);
    const uint8_t *p = kpl_tensor_host_data(h);
    for (int64_t i = 0; i < n; i++)
        if (p[i] != (uint8_t)((i * 131 + seed) % 251))
            fail_msg("%s: byte %lld is %u, expected %u", what, (long long)i, p[i],
                     (unsigned)((i * 131 + seed) % 251));
    kpl_tensor_release(h);
}

/* Host <-> device copies of every kind arrive whole: pageable ones small
 * and through the staging buffer (several chunks, a partial last one);
 * page-locked ones small (straight behind the compute stream) and large
 * (through a staging block).  A wrapped page-locked buffer may be
 * overwritten once its tensor is released or written: the upload has
 * read it by then. */
static void test_transfers(void **state)
{
    (void)state;
    const int64_t sizes[3] = {1000, 70000, (20 << 20) + 12345};
    for (int k = 0; k < 3; k++) {
        int64_t n = sizes[k];
        uint8_t *buf = malloc((size_t)n);
        assert_non_null(buf);
        fill_pattern(buf, n, (unsigned)k);
        kpl_tensor *t = NULL, *u = gnew(KPL_U8, 1, &n);
        OK(kpl_tensor_from_data(gpu, KPL_U8, 1, &n, buf, &t)); /* a host copy... */
        OK(kpl_k_copy(u, t));                                 /* ...uploaded here */
        assert_pattern(u, n, (unsigned)k, "pageable upload, download");
        /* from a pageable CPU tensor, and back into one */
        kpl_tensor *c = NULL;
        OK(kpl_tensor_from_data(kpl_device_cpu(), KPL_U8, 1, &n, buf, &c));
        OK(kpl_k_copy(u, c));
        assert_pattern(u, n, (unsigned)k, "pageable CPU tensor upload");
        free(buf);
        RELEASE(t, u, c);
    }
    const int64_t psz[2] = {64 << 10, 3 << 20};
    for (int k = 0; k < 2; k++) {
        int64_t n = psz[k];
        uint8_t *pin = aligned_alloc(4096, (size_t)n);
        assert_non_null(pin);
        OK(kpl_device_pin_host(gpu, pin, (size_t)n));
        int released = 0;
        fill_pattern(pin, n, 7);
        kpl_tensor *ct = wrap_u8(pin, n, &released), *gt = to_gpu(ct);
        kpl_tensor_release(ct); /* waits for the upload, then gives the memory back */
        assert_int_equal(released, 1);
        memset(pin, 0xab, (size_t)n);
        assert_pattern(gt, n, 7, "page-locked upload, buffer reused after release");
        /* a host write into the wrapped memory waits for the upload too */
        fill_pattern(pin, n, 9);
        ct = wrap_u8(pin, n, &released);
        kpl_tensor *gt2 = to_gpu(ct);
        uint8_t *w = kpl_tensor_host_mutable(ct);
        assert_ptr_equal(w, pin);
        memset(w, 0xcd, (size_t)n);
        assert_pattern(gt2, n, 9, "page-locked upload, buffer written after");
        kpl_tensor_release(ct);
        assert_int_equal(released, 2);
        kpl_device_unpin_host(gpu, pin);
        free(pin);
        RELEASE(gt, gt2);
    }
    OK(kpl_device_synchronize(gpu));
}

/* Kernels, frees, reallocations and uploads in a tight loop: a kernel
 * reads A, A is released at once (its block back in the cache while the
 * kernel may still run), the next tensor probably gets A's block and is
 * filled by an upload (pageable or page-locked, small or staged), and
 * D = exp(A) + C must still be right. */
static void test_ordering_stress(void **state)
{
    (void)state;
    const int64_t sizes[4] = {1000, 300000, 1 << 20, 3 << 20};
    const int64_t maxn = 3 << 20;
    float *pin = aligned_alloc(4096, (size_t)maxn * sizeof(float));
    assert_non_null(pin);
    OK(kpl_device_pin_host(gpu, pin, (size_t)maxn * sizeof(float)));
    for (int round = 0; round < 24; round++) {
        int64_t n = sizes[round % 4];
        kpl_tensor *ca = trand(KPL_F32, 1, &n, 300 + round, -2, 2);
        kpl_tensor *cc = trand(KPL_F32, 1, &n, 400 + round, -1, 1);
        kpl_tensor *ga = to_gpu(ca), *gb = gnew(KPL_F32, 1, &n), *gc = NULL;
        OK(kpl_k_unary(gb, KPL_UN_EXP, ga, 0, 0));
        kpl_tensor_release(ga); /* freed while exp may still read it */
        if (round % 2) {        /* from page-locked memory, the loader's way */
            memcpy(pin, kpl_tensor_host_data(cc), (size_t)n * sizeof(float));
            kpl_storage *s = NULL;
            kpl_tensor *wt = NULL;
            int released = 0;
            OK(kpl_storage_wrap(pin, (size_t)n * sizeof(float), count_release, &released, &s));
            OK(kpl_tensor_from_storage(s, 0, KPL_F32, 1, &n, &wt));
            kpl_storage_release(s);
            gc = to_gpu(wt);
            kpl_tensor_release(wt); /* the next round writes pin again */
            assert_int_equal(released, 1);
        } else {
            gc = to_gpu(cc);
        }
        kpl_tensor *gd = gnew(KPL_F32, 1, &n), *d = tnew(KPL_F32, 1, &n);
        OK(kpl_k_binary(gd, KPL_BIN_ADD, gb, gc));
        OK(kpl_k_unary(d, KPL_UN_EXP, ca, 0, 0));
        OK(kpl_k_binary(d, KPL_BIN_ADD, d, cc));
        assert_same(gd, d, 4e-6, 1e-6, "exp(A) + C after free, reallocation and upload");
        RELEASE(ca, cc, gb, gc, gd, d);
    }
    kpl_device_unpin_host(gpu, pin);
    free(pin);
}

/* Index errors on CUDA are reported by the next read or synchronisation,
 * naming the first failing call, its bad index and position, once; the
 * calls after the report are clean. */
static void test_deferred_index_errors(void **state)
{
    (void)state;
    int64_t xs[4] = {1, 2, 3, 4}, is[4] = {1, 2, 2, 2}, k3 = 3;
    kpl_tensor *x = trand(KPL_F32, 4, xs, 500, -1, 1), *idx = tnew(KPL_I64, 4, is);
    int64_t *iv = kpl_tensor_host_mutable(idx);
    for (int i = 0; i < 8; i++) iv[i] = (i * 5) % 12;
    iv[5] = 12; /* position (0,1,0,1), one past the 3x4 plane */
    kpl_tensor *gx = to_gpu(x), *gi = to_gpu(idx), *go = gnew(KPL_F32, 4, is);
    kpl_tensor *ggx = gnew(KPL_F32, 4, xs), *ri = tnew(KPL_I64, 1, &k3);
    int64_t *rv = kpl_tensor_host_mutable(ri);
    rv[0] = 0, rv[1] = -1, rv[2] = 2; /* -1 at position (1) */
    kpl_tensor *gri = to_gpu(ri);
    int64_t ss[4] = {1, 3, 3, 4};
    kpl_tensor *gsel = gnew(KPL_F32, 4, ss);
    double v;
    if (!on_cuda()) { /* the CPU fails at once */
        FAILS(kpl_k_plane_gather(go, gx, gi), KPL_ERANGE, "plane_gather");
        FAILS(kpl_k_index_select(gsel, gx, 1, gri), KPL_ERANGE, "index_select");
        RELEASE(x, idx, gx, gi, go, ggx, ri, gri, gsel);
        return;
    }
    OK(kpl_k_plane_gather(go, gx, gi)); /* nothing waits */
    FAILS(kpl_tensor_get(go, 0, &v), KPL_ERANGE,
          "plane_gather: index 12 at position (0,1,0,1) of idx is outside [0, 12) of the 3x4 "
          "plane (1 bad indices in all)");
    OK(kpl_tensor_get(go, 0, &v)); /* reported once */
    /* two failing calls: the first is named, every bad index counted */
    OK(kpl_k_plane_scatter(ggx, go, gi));
    OK(kpl_k_index_select(gsel, gx, 1, gri));
    FAILS(kpl_device_synchronize(gpu), KPL_ERANGE, "plane_scatter: index 12 at position (0,1,0,1)");
    /* plane_scatter's one, index_select's -1 and 2 (its axis holds 2) */
    assert_non_null(strstr(kpl_last_error(), "(3 bad indices in all)"));
    OK(kpl_device_synchronize(gpu));
    /* the deterministic adjoints check as they group */
    kpl_set_deterministic(true);
    OK(kpl_k_plane_scatter(ggx, go, gi));
    kpl_set_deterministic(false);
    FAILS(kpl_tensor_get(ggx, 0, &v), KPL_ERANGE, "plane_scatter: index 12");
    int64_t as[4] = {1, 3, 3, 4};
    kpl_tensor *gadd = gnew(KPL_F32, 4, xs), *gsrc = gnew(KPL_F32, 4, as);
    OK(kpl_k_fill(gsrc, 1));
    OK(kpl_k_index_add(gadd, gsrc, 1, gri));
    FAILS(kpl_tensor_get(gadd, 0, &v), KPL_ERANGE,
          "index_add: index -1 at position (1) of idx is outside [0, 2)");
    /* and a clean call reads clean */
    iv[5] = 3;
    kpl_tensor *gi2 = to_gpu(idx);
    OK(kpl_k_plane_gather(go, gx, gi2));
    OK(kpl_tensor_get(go, 5, &v));
    assert_float_equal(v, tget(x, 1 * 12 + 3), 0);
    RELEASE(x, idx, gx, gi, go, ggx, ri, gri, gsel, gadd, gsrc, gi2);
}

/* Element-wise kernels, a cast and a reduction over 2^24 + 3 values (many
 * grid-stride passes per thread); then a u8 tensor of 2^31 + 64 bytes,
 * whose indices and offsets need 64 bits (when the GPU has the room). */
static void test_large_tensors(void **state)
{
    (void)state;
    int64_t n = ((int64_t)1 << 24) + 3, one = 1;
    kpl_tensor *x = trand(KPL_F32, 1, &n, 600, -4, 4), *gx = to_gpu(x);
    kpl_tensor *y = tnew(KPL_F32, 1, &n), *gy = gnew(KPL_F32, 1, &n);
    OK(kpl_k_unary(y, KPL_UN_SIGMOID, x, 0, 0));
    OK(kpl_k_unary(gy, KPL_UN_SIGMOID, gx, 0, 0));
    OK(kpl_k_binary_scalar(y, KPL_BIN_MUL, y, 3, false));
    OK(kpl_k_binary_scalar(gy, KPL_BIN_MUL, gy, 3, false));
    assert_same(gy, y, 4e-6, 1e-7, "sigmoid x 3 over 2^24 + 3");
    kpl_tensor *h = tnew(KPL_BF16, 1, &n), *gh = gnew(KPL_BF16, 1, &n);
    OK(kpl_k_cast(h, x));
    OK(kpl_k_cast(gh, gx));
    assert_bits(gh, h, "cast to bf16 over 2^24 + 3");
    kpl_tensor *sm = tnew(KPL_F32, 0, &one), *gsm = gnew(KPL_F32, 0, &one);
    OK(kpl_k_reduce(sm, KPL_RED_SUM, y, NULL, 0, false, 0));
    OK(kpl_k_reduce(gsm, KPL_RED_SUM, gy, NULL, 0, false, 0));
    assert_same(gsm, sm, 1e-6, 0, "sum over 2^24 + 3");
    RELEASE(x, gx, y, gy, h, gh, sm, gsm);
    if (!on_cuda()) return; /* 4 GB of host memory for nothing */

    int64_t big = ((int64_t)1 << 31) + 64;
    kpl_tensor *u = NULL, *v = NULL;
    if (kpl_tensor_empty(gpu, KPL_U8, 1, &big, &u) < 0 ||
        kpl_tensor_empty(gpu, KPL_U8, 1, &big, &v) < 0) {
        printf("cuda: no room for two 2 GiB tensors, skipping the 2^31 case (%s)\n",
               kpl_last_error());
        kpl_clear_error();
        RELEASE(u, v);
        return;
    }
    OK(kpl_k_fill(u, 1));
    /* the last 64 bytes: 2s and a 7 at 40, written through a view */
    uint8_t tv[64];
    memset(tv, 2, sizeof tv);
    tv[40] = 7;
    int64_t k64 = 64;
    kpl_tensor *tail = NULL, *ct = NULL;
    OK(kpl_tensor_narrow(u, big - 64, 64, &tail));
    OK(kpl_tensor_from_data(kpl_device_cpu(), KPL_U8, 1, &k64, tv, &ct));
    OK(kpl_k_copy(tail, ct));
    OK(kpl_k_binary(v, KPL_BIN_ADD, u, u)); /* one element-wise pass over all of it */
    kpl_tensor *am = gnew(KPL_I64, 0, &one), *mx = gnew(KPL_U8, 0, &one);
    OK(kpl_k_reduce(am, KPL_RED_ARGMAX, v, NULL, 0, false, 0));
    OK(kpl_k_reduce(mx, KPL_RED_MAX, v, NULL, 0, false, 0));
    assert_float_equal(tget(am, 0), (double)(big - 64 + 40), 0);
    assert_float_equal(tget(mx, 0), 14, 0);
    OK(kpl_k_reduce(am, KPL_RED_ARGMIN, v, NULL, 0, false, 0));
    assert_float_equal(tget(am, 0), 0, 0);
    /* a view past 2^31 bytes reads the right bytes */
    kpl_tensor *vt = NULL, *vtc = NULL;
    OK(kpl_tensor_narrow(v, big - 64, 64, &vt));
    kpl_tensor *vtg = gnew(KPL_U8, 1, &k64);
    OK(kpl_k_copy(vtg, vt));
    vtc = to_cpu(vtg);
    for (int i = 0; i < 64; i++) assert_int_equal(((const uint8_t *)kpl_tensor_host_data(vtc))[i],
                                                  2 * tv[i]);
    RELEASE(u, v, tail, ct, am, mx, vt, vtg, vtc);
}

int run_cuda_memory_tests(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_transfers),
        cmocka_unit_test(test_ordering_stress),
        cmocka_unit_test(test_deferred_index_errors),
        cmocka_unit_test(test_large_tensors),
    };
    return RUN_GROUP("cuda memory and ordering", tests);
}
