/* Uses the installed libkpl.so: a 2x2 matmul checked by hand, a module of
 * trainer.h (its headers, module.h among them, are installed; nothing
 * internal is needed), a box IoU of vision.h and a COCO mAP of
 * cocoeval.h. */
#include <kernels.h>
#include <trainer.h>
#include <vision.h>
#include <stdio.h>
#include <string.h>

/* linear 2 -> 1 with weight [1, 1]: the forward of [3, 4] is 7 + bias */
static int module_ok(void)
{
    kpl_module *net = NULL, *lin = NULL;
    if (kpl_nn_sequential_root(NULL, 1, &net) < 0 || kpl_nn_linear(net, "fc", 2, 1, false, &lin) < 0)
        return 0;
    float one[2] = {1, 1}, in[2] = {3, 4};
    memcpy(kpl_tensor_host_mutable(kpl_module_get_param(lin, "weight")), one, sizeof one);
    kpl_pool *p = kpl_pool_push();
    kpl_tensor *x = NULL;
    int64_t s[2] = {1, 2};
    double v = 0;
    int ok = kpl_tensor_from_data(kpl_device_cpu(), KPL_F32, 2, s, in, &x) >= 0 &&
             kpl_tensor_get(kpl_module_forward(net, kpl_autorelease(x)), 0, &v) >= 0 && v == 7 &&
             !strcmp(kpl_module_param_name(net, 0), "fc.weight");
    kpl_pool_pop(p);
    kpl_module_destroy(net);
    return ok;
}

/* (0, 0, 2, 2) and (1, 1, 3, 3) overlap in 1 of their union 7 */
static int vision_ok(void)
{
    float a[4] = {0, 0, 2, 2}, b[4] = {1, 1, 3, 3};
    int64_t s[2] = {1, 4};
    kpl_pool *p = kpl_pool_push();
    kpl_tensor *ta = NULL, *tb = NULL;
    double v = 0;
    int ok = kpl_tensor_from_data(kpl_device_cpu(), KPL_F32, 2, s, a, &ta) >= 0 &&
             kpl_tensor_from_data(kpl_device_cpu(), KPL_F32, 2, s, b, &tb) >= 0 &&
             kpl_tensor_get(kpl_box_iou(kpl_autorelease(ta), kpl_autorelease(tb)), 0, &v) >= 0 &&
             v == (double)(1.0f / 7.0f);
    kpl_pool_pop(p);
    return ok;
}

/* one object found at IoU 64/100: AP50 1, AR100 .3 (thresholds .50 to .60) */
static int cocoeval_ok(void)
{
    int64_t img = 1, cat = 3;
    kpl_coco_annotation ann = {7, 1, 3, {0, 0, 10, 10}, 100, 0};
    kpl_coco_detection det = {1, 3, {0, 0, 10, 6.4}, 0.9};
    kpl_coco_gt *gt = NULL;
    kpl_coco_stats st;
    int ok = kpl_coco_gt_create(&img, 1, &cat, 1, &ann, 1, &gt) >= 0 &&
             kpl_coco_evaluate(gt, &det, 1, &st) >= 0 && st.stats[KPL_COCO_AP50] > 0.999 &&
             st.stats[KPL_COCO_AR100] > 0.2999 && st.stats[KPL_COCO_AR100] < 0.3001;
    kpl_coco_gt_destroy(gt);
    return ok;
}

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
    int ok = c[0] == 19 && c[1] == 22 && c[2] == 43 && c[3] == 50 && module_ok() && vision_ok() &&
             cocoeval_ok();
    printf("kpl %s: [[%g, %g], [%g, %g]] %s\n", kpl_version(), c[0], c[1], c[2], c[3],
           ok ? "ok" : "WRONG");
    kpl_tensor_release(tc);
    kpl_tensor_release(tb);
    kpl_tensor_release(ta);
    return ok ? 0 : 1;
}
