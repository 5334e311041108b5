/*
 * cpu_conv_ref.c — the f64 reference loops of the CPU convolution
 * (cpu_conv.c runs f32 and bf16 on oneDNN and kpl's own loops): direct
 * sums in the order of the definition, what the tests check the fast
 * kernels against.
 */
#include "kernels_impl.h"

#define X4(t, a, b, c, d, B, C, D) (t)[(((a) * (B) + (b)) * (C) + (c)) * (D) + (d)]

/* The input row (dim 0) or column (dim 1) that output position o reads
 * through kernel tap k, or -1 when it falls in the padding. */
static inline int64_t tap(const kpl_conv_attrs *a, int dim, int64_t o, int64_t k)
{
    int64_t i = o * a->p.stride[dim] - a->p.padding[dim] + k * a->p.dilation[dim];
    return i < 0 || i >= (dim ? a->w : a->h) ? -1 : i;
}

static void ref_fwd(const kpl_conv_attrs *a, const double *x, const double *w, const double *b,
                    double *y) /* with a->acc, y holds the addend */
{
    int64_t cg = a->c / a->p.groups, og = a->o / a->p.groups;
    KPL_PARALLEL_FOR_IF(no, a->n * a->o, a->n * a->o > 1,
        int64_t n = no / a->o, o = no % a->o, g = o / og;
        for (int64_t oy = 0; oy < a->oh; oy++)
            for (int64_t ox = 0; ox < a->ow; ox++) {
                double s = b ? b[o] : 0;
                for (int64_t c = 0; c < cg; c++)
                    for (int64_t ky = 0; ky < a->kh; ky++) {
                        int64_t iy = tap(a, 0, oy, ky);
                        if (iy < 0) continue;
                        for (int64_t kx = 0; kx < a->kw; kx++) {
                            int64_t ix = tap(a, 1, ox, kx);
                            if (ix < 0) continue;
                            s += X4(x, n, g * cg + c, iy, ix, a->c, a->h, a->w) *
                                 X4(w, o, c, ky, kx, cg, a->kh, a->kw);
                        }
                    }
                double *yo = &X4(y, n, o, oy, ox, a->o, a->oh, a->ow);
                *yo = a->acc ? s + *yo : s;
            }
    );
}

/* gx = sum over the windows that read each input element (scatter per image). */
static void ref_bwd_data(const kpl_conv_attrs *a, const double *gy, const double *w, double *gx)
{
    int64_t cg = a->c / a->p.groups, og = a->o / a->p.groups;
    KPL_PARALLEL_FOR_IF(n, a->n, a->n > 1,
        memset(gx + n * a->c * a->h * a->w, 0, sizeof(double) * (size_t)(a->c * a->h * a->w));
        for (int64_t o = 0; o < a->o; o++) {
            int64_t g = o / og;
            for (int64_t oy = 0; oy < a->oh; oy++)
                for (int64_t ox = 0; ox < a->ow; ox++) {
                    double v = X4(gy, n, o, oy, ox, a->o, a->oh, a->ow);
                    for (int64_t c = 0; c < cg; c++)
                        for (int64_t ky = 0; ky < a->kh; ky++) {
                            int64_t iy = tap(a, 0, oy, ky);
                            if (iy < 0) continue;
                            for (int64_t kx = 0; kx < a->kw; kx++) {
                                int64_t ix = tap(a, 1, ox, kx);
                                if (ix < 0) continue;
                                X4(gx, n, g * cg + c, iy, ix, a->c, a->h, a->w) +=
                                    v * X4(w, o, c, ky, kx, cg, a->kh, a->kw);
                            }
                        }
                }
        }
    );
}

static void ref_bwd_weight(const kpl_conv_attrs *a, const double *x, const double *gy, double *gw,
                           double *gb)
{
    int64_t cg = a->c / a->p.groups, og = a->o / a->p.groups;
    KPL_PARALLEL_FOR_IF(o, a->o, a->o > 1,
        int64_t g = o / og;
        if (gb) {
            double s = 0;
            for (int64_t n = 0; n < a->n; n++)
                for (int64_t i = 0; i < a->oh * a->ow; i++) s += gy[(n * a->o + o) * a->oh * a->ow + i];
            gb[o] = s;
        }
        for (int64_t c = 0; c < cg; c++)
            for (int64_t ky = 0; ky < a->kh; ky++)
                for (int64_t kx = 0; kx < a->kw; kx++) {
                    double s = 0;
                    for (int64_t n = 0; n < a->n; n++)
                        for (int64_t oy = 0; oy < a->oh; oy++) {
                            int64_t iy = tap(a, 0, oy, ky);
                            if (iy < 0) continue;
                            for (int64_t ox = 0; ox < a->ow; ox++) {
                                int64_t ix = tap(a, 1, ox, kx);
                                if (ix < 0) continue;
                                s += X4(gy, n, o, oy, ox, a->o, a->oh, a->ow) *
                                     X4(x, n, g * cg + c, iy, ix, a->c, a->h, a->w);
                            }
                        }
                    X4(gw, o, c, ky, kx, cg, a->kh, a->kw) = s;
                }
    );
}

/* One f64 convolution of any kind on args (cpu_conv.c's ReLU, if any,
 * is applied by the caller). */
void kpl__conv_ref_run(const kpl_conv_attrs *a, const kpl_kernel_args *args)
{
    const double *i0 = kpl__cdata(args->in[0]), *i1 = kpl__cdata(args->in[1]);
    double *out = kpl__data(args->out);
    switch (a->kind) {
    case KPL_CONV_FWD: ref_fwd(a, i0, i1, args->in[2] ? kpl__cdata(args->in[2]) : NULL, out); break;
    case KPL_CONV_BWD_DATA: ref_bwd_data(a, i0, i1, out); break;
    case KPL_CONV_BWD_WEIGHT:
        ref_bwd_weight(a, i0, i1, out, args->in[2] ? kpl__data((kpl_tensor *)args->in[2]) : NULL);
        break;
    }
}
