/*
 * fcos_assign.c — FCOS's locations and target assignment (detect_impl.h):
 * plain loops on the host, over locations x boxes of one image (a 128x128
 * input has 341 locations, an 800x1333 one about 20 000).
 */
#include "detect_impl.h"

#include <float.h>
#include <math.h>
#include <string.h>

int64_t kpl__fcos_count(const kpl__fcos_level *lv, int nlevels)
{
    int64_t n = 0;
    for (int l = 0; l < nlevels; l++) n += lv[l].h * lv[l].w;
    return n;
}

void kpl__fcos_points(const kpl__fcos_level *lv, int nlevels, float *xy)
{
    for (int l = 0; l < nlevels; l++) {
        int s = lv[l].stride;
        for (int64_t i = 0; i < lv[l].h; i++)
            for (int64_t j = 0; j < lv[l].w; j++, xy += 2) {
                xy[0] = (float)(s * j + s / 2);
                xy[1] = (float)(s * i + s / 2);
            }
    }
}

static float fmin4(float a, float b, float c, float d) { return fminf(fminf(a, b), fminf(c, d)); }
static float fmax4(float a, float b, float c, float d) { return fmaxf(fmaxf(a, b), fmaxf(c, d)); }

int64_t kpl__fcos_assign(const kpl__fcos_level *lv, int nlevels, const float *xy,
                         const float *boxes, const int64_t *labels, int64_t nb, double radius,
                         int64_t *cls, float *ltrb, float *ctr)
{
    int64_t p = 0, positives = 0;
    for (int l = 0; l < nlevels; l++) {
        float r = (float)(lv[l].stride * radius);
        for (int64_t k = 0; k < lv[l].h * lv[l].w; k++, p++) {
            float x = xy[2 * p], y = xy[2 * p + 1];
            int64_t best = -1;
            float best_area = FLT_MAX;
            for (int64_t b = 0; b < nb; b++) {
                const float *g = boxes + 4 * b;
                if (!(g[2] > g[0] && g[3] > g[1])) continue; /* empty (or NaN) */
                float dl = x - g[0], dt = y - g[1], dr = g[2] - x, db = g[3] - y;
                float inside;
                if (radius > 0) { /* the box cut to the centre region */
                    float cx = (g[0] + g[2]) / 2, cy = (g[1] + g[3]) / 2;
                    float x0 = fmaxf(cx - r, g[0]), y0 = fmaxf(cy - r, g[1]);
                    float x1 = fminf(cx + r, g[2]), y1 = fminf(cy + r, g[3]);
                    inside = fmin4(x - x0, y - y0, x1 - x, y1 - y);
                } else {
                    inside = fmin4(dl, dt, dr, db);
                }
                float reach = fmax4(dl, dt, dr, db);
                if (!(inside > 0) || reach < lv[l].lo || reach > lv[l].hi) continue;
                float area = (g[2] - g[0]) * (g[3] - g[1]);
                if (area < best_area) best_area = area, best = b;
            }
            if (best < 0) {
                cls[p] = -1;
                memset(ltrb + 4 * p, 0, 4 * sizeof *ltrb);
                ctr[p] = 0;
                continue;
            }
            const float *g = boxes + 4 * best;
            float d[4] = {x - g[0], y - g[1], g[2] - x, g[3] - y};
            memcpy(ltrb + 4 * p, d, sizeof d);
            cls[p] = labels[best];
            ctr[p] = sqrtf(fminf(d[0], d[2]) / fmaxf(d[0], d[2]) *
                           (fminf(d[1], d[3]) / fmaxf(d[1], d[3])));
            positives++;
        }
    }
    return positives;
}
