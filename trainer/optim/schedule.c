/*
 * schedule.c — learning rate as a pure function of training progress, so a
 * resumed run needs only its step counter to continue the schedule.
 */
#include "optim.h"

#include <math.h>
#include <string.h>

kpl_status kpl_lr_schedule_check(const kpl_lr_schedule *s)
{
    KPL_CHECK(s, KPL_EINVAL, "schedule: NULL");
    KPL_CHECK((unsigned)s->kind <= KPL_SCHED_POLY, KPL_EINVAL, "schedule: unknown kind %d",
              (int)s->kind);
    KPL_CHECK(isfinite(s->base_lr) && s->base_lr >= 0, KPL_EINVAL,
              "schedule: base_lr %g must be >= 0", s->base_lr);
    KPL_CHECK(isfinite(s->warmup_epochs) && s->warmup_epochs >= 0, KPL_EINVAL,
              "schedule: warmup_epochs %g must be >= 0", s->warmup_epochs);
    KPL_CHECK(s->warmup_factor >= 0 && s->warmup_factor <= 1, KPL_EINVAL,
              "schedule: warmup_factor %g must be in [0, 1]", s->warmup_factor);
    KPL_CHECK(isfinite(s->min_lr) && s->min_lr >= 0 && s->min_lr <= s->base_lr, KPL_EINVAL,
              "schedule: min_lr %g must be in [0, base_lr %g]", s->min_lr, s->base_lr);
    switch (s->kind) {
    case KPL_SCHED_CONSTANT: break;
    case KPL_SCHED_STEP:
        KPL_CHECK(s->step_size > 0, KPL_EINVAL, "schedule: step_size %g must be > 0",
                  s->step_size);
        KPL_CHECK(s->gamma > 0 && s->gamma <= 1, KPL_EINVAL,
                  "schedule: gamma %g must be in (0, 1]", s->gamma);
        break;
    case KPL_SCHED_MULTISTEP:
        KPL_CHECK(s->gamma > 0 && s->gamma <= 1, KPL_EINVAL,
                  "schedule: gamma %g must be in (0, 1]", s->gamma);
        KPL_CHECK(s->num_milestones >= 1 && s->num_milestones <= KPL_SCHED_MAX_MILESTONES,
                  KPL_EINVAL, "schedule: multistep needs 1 to %d milestones (got %d)",
                  KPL_SCHED_MAX_MILESTONES, s->num_milestones);
        for (int i = 0; i < s->num_milestones; i++)
            KPL_CHECK(s->milestones[i] > 0 && (i == 0 || s->milestones[i] > s->milestones[i - 1]),
                      KPL_EINVAL, "schedule: milestones must be positive and increasing "
                      "(milestone %d is %g)", i, s->milestones[i]);
        break;
    case KPL_SCHED_COSINE:
    case KPL_SCHED_POLY:
        KPL_CHECK(s->epochs > s->warmup_epochs, KPL_EINVAL,
                  "schedule: %s needs epochs (%g) > warmup_epochs (%g)",
                  kpl_sched_kind_name(s->kind), s->epochs, s->warmup_epochs);
        KPL_CHECK(s->kind != KPL_SCHED_POLY || s->power > 0, KPL_EINVAL,
                  "schedule: power %g must be > 0", s->power);
        break;
    }
    return KPL_OK;
}

double kpl_lr_at(const kpl_lr_schedule *s, double t)
{
    if (t < 0) t = 0;
    if (t < s->warmup_epochs) {
        double f = s->warmup_factor + (1 - s->warmup_factor) * t / s->warmup_epochs;
        return s->base_lr * f;
    }
    double u = s->epochs > s->warmup_epochs ? (t - s->warmup_epochs) / (s->epochs - s->warmup_epochs)
                                            : 1;
    if (u > 1) u = 1;
    switch (s->kind) {
    case KPL_SCHED_CONSTANT: return s->base_lr;
    case KPL_SCHED_STEP: return s->base_lr * pow(s->gamma, floor(t / s->step_size));
    case KPL_SCHED_MULTISTEP: {
        int passed = 0;
        while (passed < s->num_milestones && s->milestones[passed] <= t) passed++;
        return s->base_lr * pow(s->gamma, passed);
    }
    case KPL_SCHED_COSINE:
        return s->min_lr + (s->base_lr - s->min_lr) * 0.5 * (1 + cos(M_PI * u));
    case KPL_SCHED_POLY: return s->min_lr + (s->base_lr - s->min_lr) * pow(1 - u, s->power);
    }
    return s->base_lr;
}
