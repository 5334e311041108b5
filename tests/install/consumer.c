/* Uses the installed libkpl.so: a 2x2 matmul checked by hand. */
#include <kernels.h>
#include <stdio.h>

int main(void)
{
    float a[4] = {1, 2, 3, 4}, b[4] = {5, 6, 7, 8};
    int64_t s[2] = {2, 2};
    kpl_tensor *ta = NULL, *tb = NULL, *tc = NULL;
    kpl_device *cpu = kpl_device_cpu();
    if (kpl_tensor_from_data(cpu, KPL_F32, 2, s, a, &ta) < 0 ||
        kpl_tensor_from_data(cpu, KPL_F32, 2, s, b, &tb) < 0 ||
        kpl_tensor_empty(cpu, KPL_F32, 2, s, &tc) < 0 ||
        kpl_k_matmul(tc, ta, tb, false, false) < 0) {
        fprintf(stderr, "consumer: %s\n", kpl_last_error());
        return 1;
    }
    const float *c = kpl_tensor_host_data(tc);
    int ok = c[0] == 19 && c[1] == 22 && c[2] == 43 && c[3] == 50;
    printf("kpl %s: [[%g, %g], [%g, %g]] %s\n", kpl_version(), c[0], c[1], c[2], c[3],
           ok ? "ok" : "WRONG");
    kpl_tensor_release(tc);
    kpl_tensor_release(tb);
    kpl_tensor_release(ta);
    return ok ? 0 : 1;
}
