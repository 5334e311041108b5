/* ddp_batch.h — the synthetic batches test_ddp.c and test_ddp_cuda.c
 * train on (CLASSES must be defined by the includer). */
#ifndef KPL_TEST_DDP_BATCH_H
#define KPL_TEST_DDP_BATCH_H

/* Sample i of step s: an image of uniform noise plus a class-dependent
 * bar, and its class; the same on every rank. */
static inline void batch(int step, int from, int n, kpl_tensor **x, kpl_tensor **y)
{
    const int64_t xs[4] = {n, 1, 28, 28}, ys = n;
    OK(kpl_tensor_empty(kpl_device_cpu(), KPL_F32, 4, xs, x));
    OK(kpl_tensor_empty(kpl_device_cpu(), KPL_I64, 1, &ys, y));
    float *px = kpl_tensor_host_mutable(*x);
    int64_t *py = kpl_tensor_host_mutable(*y);
    for (int k = 0; k < n; k++) {
        int i = from + k;
        int cls = (i * 7 + step * 3) % CLASSES;
        py[k] = cls;
        kpl_rng *r = kpl_rng_create((uint64_t)(step * 1000 + i));
        kpl_tensor *noise = NULL;
        const int64_t one[3] = {1, 28, 28};
        OK(kpl_tensor_empty(kpl_device_cpu(), KPL_F32, 3, one, &noise));
        OK(kpl_k_uniform(noise, r, 0, 1));
        const float *pn = kpl_tensor_host_data(noise);
        for (int j = 0; j < 784; j++)
            px[(size_t)k * 784 + j] = pn[j] + ((j / 28) / 3 == cls ? 2.0f : 0.0f);
        kpl_tensor_release(noise);
        kpl_rng_destroy(r);
    }
}

#endif
