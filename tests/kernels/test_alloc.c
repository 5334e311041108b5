/* test_alloc.c — the caching allocator: reuse, splitting, merging, counters,
 * limits and out-of-memory errors (on the CPU device's allocator). */
#include "test_util.h"
#include "kernels_impl.h"

#include <stdlib.h>

static kpl_device *cpu;

static int setup(void **state)
{
    (void)state;
    cpu = kpl_device_cpu();
    kpl_device_empty_cache(cpu);
    kpl_device_set_memory_limit(cpu, 0);
    return 0;
}

static void test_reuse(void **state)
{
    (void)state;
    void *p = NULL, *q = NULL;
    OK(kpl_device_alloc(cpu, 3000, "test", &p));
    kpl_memory_stats s0 = kpl_device_memory_stats(cpu);
    assert_int_equal((uintptr_t)p % 64, 0);
    /* 3000 rounds up to 3072 (512-byte units). */
    kpl_device_free(cpu, p);
    kpl_memory_stats s1 = kpl_device_memory_stats(cpu);
    assert_int_equal(s0.allocated - s1.allocated, 3072);
    OK(kpl_device_alloc(cpu, 2900, "test", &q));
    kpl_memory_stats s2 = kpl_device_memory_stats(cpu);
    assert_ptr_equal(p, q); /* LIFO: the block just freed comes back */
    assert_int_equal(s2.n_cache_hit, s1.n_cache_hit + 1);
    assert_int_equal(s2.reserved, s1.reserved);
    kpl_device_free(cpu, q);
}

static void test_split_and_merge(void **state)
{
    (void)state;
    kpl_device_empty_cache(cpu);
    kpl_memory_stats s0 = kpl_device_memory_stats(cpu);
    void *a = NULL, *b = NULL, *c = NULL, *big = NULL;
    /* Small requests come from one 2 MiB segment, cut in order. */
    OK(kpl_device_alloc(cpu, 100 * 1024, "a", &a));
    kpl_memory_stats s1 = kpl_device_memory_stats(cpu);
    assert_int_equal(s1.reserved - s0.reserved, 2 << 20);
    assert_int_equal(s1.n_system, s0.n_system + 1);
    OK(kpl_device_alloc(cpu, 100 * 1024, "b", &b));
    OK(kpl_device_alloc(cpu, 100 * 1024, "c", &c));
    kpl_memory_stats s2 = kpl_device_memory_stats(cpu);
    assert_int_equal(s2.reserved, s1.reserved); /* split, not a new segment */
    assert_ptr_equal((char *)a + 100 * 1024, b);
    assert_ptr_equal((char *)b + 100 * 1024, c);
    assert_int_equal(s2.allocated - s0.allocated, 300 * 1024);
    /* Freeing a, then b merges them: a 200 KiB request fits at a. */
    kpl_device_free(cpu, a);
    kpl_device_free(cpu, b);
    OK(kpl_device_alloc(cpu, 200 * 1024, "merged", &big));
    assert_ptr_equal(big, a);
    assert_int_equal(kpl_device_memory_stats(cpu).reserved, s1.reserved);
    kpl_device_free(cpu, big);
    kpl_device_free(cpu, c);
    /* Everything free: the segment is one block again and goes back. */
    kpl_device_empty_cache(cpu);
    kpl_memory_stats s3 = kpl_device_memory_stats(cpu);
    assert_int_equal(s3.reserved, s0.reserved);
    assert_int_equal(s3.allocated, s0.allocated);
}

static void test_large_pool_and_peak(void **state)
{
    (void)state;
    kpl_device_empty_cache(cpu);
    kpl_device_reset_peak(cpu);
    kpl_memory_stats s0 = kpl_device_memory_stats(cpu);
    void *p = NULL, *q = NULL;
    OK(kpl_device_alloc(cpu, 3 << 20, "3MiB", &p)); /* from a 20 MiB segment */
    kpl_memory_stats s1 = kpl_device_memory_stats(cpu);
    assert_int_equal(s1.reserved - s0.reserved, 20 << 20);
    OK(kpl_device_alloc(cpu, 12 << 20, "12MiB", &q)); /* fits the rest of it */
    kpl_memory_stats s2 = kpl_device_memory_stats(cpu);
    assert_int_equal(s2.reserved, s1.reserved);
    assert_int_equal(s2.peak_allocated - s0.allocated, 15 << 20);
    kpl_device_free(cpu, q);
    kpl_device_free(cpu, p);
    kpl_memory_stats s3 = kpl_device_memory_stats(cpu);
    assert_int_equal(s3.peak_allocated, s2.peak_allocated); /* peak stays */
    assert_int_equal(s3.allocated, s0.allocated);
    kpl_device_reset_peak(cpu);
    assert_int_equal(kpl_device_memory_stats(cpu).peak_allocated, s0.allocated);
    /* A request past 10 MiB with no fitting cached block gets its own
     * segment rounded to 2 MiB. */
    kpl_device_empty_cache(cpu);
    kpl_memory_stats s4 = kpl_device_memory_stats(cpu);
    OK(kpl_device_alloc(cpu, (25 << 20) + 1, "25MiB", &p));
    assert_int_equal(kpl_device_memory_stats(cpu).reserved - s4.reserved, 26 << 20);
    kpl_device_free(cpu, p);
    kpl_device_empty_cache(cpu);
}

static void test_limit_and_oom(void **state)
{
    (void)state;
    kpl_device_empty_cache(cpu);
    kpl_memory_stats s0 = kpl_device_memory_stats(cpu);
    kpl_device_set_memory_limit(cpu, s0.reserved + (24 << 20));
    void *p = NULL, *q = NULL;
    OK(kpl_device_alloc(cpu, 15 << 20, "first", &p));
    /* A second 15 MiB block needs a new 20 MiB segment: over the limit. */
    FAILS(kpl_device_alloc(cpu, 15 << 20, "second", &q), KPL_ENOMEM, "second: out of memory on cpu");
    /* Freeing lets the cache serve it without new reservations. */
    kpl_device_free(cpu, p);
    OK(kpl_device_alloc(cpu, 15 << 20, "third", &q));
    kpl_device_free(cpu, q);
    /* Cached segments are released first when the limit would be hit. */
    OK(kpl_device_alloc(cpu, 22 << 20, "big", &p));
    kpl_device_free(cpu, p);
    kpl_device_set_memory_limit(cpu, 0);
    /* Tensors report the op and the size. */
    kpl_device_set_memory_limit(cpu, kpl_device_memory_stats(cpu).reserved + (1 << 20));
    kpl_tensor *t = NULL;
    int64_t shape[2] = {4096, 4096};
    FAILS(kpl_tensor_empty(cpu, KPL_F32, 2, shape, &t), KPL_ENOMEM, "67108864 bytes");
    assert_null(t);
    kpl_device_set_memory_limit(cpu, 0);
    /* An impossible size is an error, not a crash. */
    int64_t huge[3] = {1 << 30, 1 << 30, 1 << 30};
    FAILS(kpl_tensor_empty(cpu, KPL_F32, 3, huge, &t), KPL_ENOMEM, "too many elements");
    kpl_device_empty_cache(cpu);
}

static void test_many_blocks(void **state)
{
    (void)state;
    /* Random alloc/free churn keeps the counters consistent. */
    enum { N = 600 };
    static void *ptrs[N];
    static size_t sizes[N];
    kpl_memory_stats s0 = kpl_device_memory_stats(cpu);
    uint32_t x = 12345;
    size_t live = 0;
    for (int round = 0; round < 4; round++) {
        for (int i = 0; i < N; i++) {
            x = x * 1664525u + 1013904223u;
            if (ptrs[i]) {
                kpl_device_free(cpu, ptrs[i]);
                live -= sizes[i];
                ptrs[i] = NULL;
            } else {
                size_t sz = (x >> 8) % (3 << 20) + 1;
                OK(kpl_device_alloc(cpu, sz, "churn", &ptrs[i]));
                memset(ptrs[i], 0xab, sz); /* ASan checks the block is ours */
                sizes[i] = (sz + 511) / 512 * 512;
                live += sizes[i];
            }
        }
        /* A large block is handed out whole when the rest would be under
         * 1 MiB, so `allocated` may exceed the rounded requests by that. */
        size_t got = kpl_device_memory_stats(cpu).allocated - s0.allocated;
        size_t nlive = 0;
        for (int i = 0; i < N; i++) nlive += ptrs[i] != NULL;
        assert_true(got >= live && got <= live + nlive * (1u << 20));
    }
    for (int i = 0; i < N; i++)
        if (ptrs[i]) kpl_device_free(cpu, ptrs[i]);
    kpl_device_empty_cache(cpu);
    kpl_memory_stats s1 = kpl_device_memory_stats(cpu);
    assert_int_equal(s1.allocated, s0.allocated);
    assert_true(s1.reserved <= s0.reserved + (0u));
}

/* A raw source that counts what it hands out and takes back. */
typedef struct {
    int live;
    size_t last;
} counting_source;

static kpl_status counting_alloc(void *ctx, size_t bytes, void **out)
{
    counting_source *c = ctx;
    c->live++;
    c->last = bytes;
    *out = malloc(bytes);
    return *out ? KPL_OK : KPL_ENOMEM;
}

static void counting_free(void *ctx, void *ptr)
{
    ((counting_source *)ctx)->live--;
    free(ptr);
}

/* The uncached mode (KPL_CUDA_ALLOC_UNCACHED for compute-sanitizer): every
 * block is its own allocation of the exact size, given back when freed. */
static void test_uncached(void **state)
{
    (void)state;
    counting_source c = {0};
    kpl_allocator *a = kpl__allocator_create((kpl_raw_source){
        .alloc = counting_alloc, .free = counting_free, .ctx = &c, .name = "counting",
        .host_visible = true, .uncached = true});
    assert_non_null(a);
    void *p[3] = {NULL};
    size_t sz[3] = {1, 3000, 5u << 20};
    for (int i = 0; i < 3; i++) {
        OK(kpl__allocator_alloc(a, sz[i], "test", &p[i]));
        assert_int_equal(c.last, sz[i]); /* not rounded */
        memset(p[i], 0x5a, sz[i]);
    }
    assert_int_equal(c.live, 3);
    kpl_memory_stats st = kpl__allocator_stats(a);
    assert_int_equal(st.allocated, 1 + 3000 + (5u << 20));
    assert_int_equal(st.reserved, st.allocated);
    kpl__allocator_free(a, p[1]);
    assert_int_equal(c.live, 2); /* back to the source at once */
    OK(kpl__allocator_alloc(a, 3000, "test", &p[1]));
    assert_int_equal(c.live, 3);
    assert_int_equal(kpl__allocator_stats(a).n_cache_hit, 0);
    for (int i = 0; i < 3; i++) kpl__allocator_free(a, p[i]);
    assert_int_equal(c.live, 0);
    st = kpl__allocator_stats(a);
    assert_int_equal(st.allocated, 0);
    assert_int_equal(st.reserved, 0);
    assert_int_equal(st.peak_allocated, 1 + 3000 + (5u << 20));
    kpl__allocator_destroy(a);
}

int run_alloc_tests(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup(test_reuse, setup),
        cmocka_unit_test_setup(test_split_and_merge, setup),
        cmocka_unit_test_setup(test_large_pool_and_peak, setup),
        cmocka_unit_test_setup(test_limit_and_oom, setup),
        cmocka_unit_test_setup(test_many_blocks, setup),
        cmocka_unit_test(test_uncached),
    };
    return cmocka_run_group_tests_name("alloc", tests, NULL, NULL);
}
