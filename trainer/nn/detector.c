/*
 * detector.c — the registry of detector heads (detector.h): FCOS built
 * in, others from programs and plugins.
 */
#include "detector.h"
#include "nn_impl.h"

static const void *const builtin[] = {&kpl_detector_fcos, NULL};

/* What detector.h requires of a head's table: refused at registration. */
static kpl_status check_head(const void *item)
{
    const kpl_detector_head *h = item;
    KPL_CHECK(h->create && h->destroy && h->loss && h->decode, KPL_EINVAL,
              "a detector head needs create, destroy, loss and decode");
    KPL_CHECK(h->nlosses >= 1 && h->nlosses <= 4, KPL_EINVAL,
              "a detector head has 1 to 4 losses, not %d", h->nlosses);
    for (int i = 0; i < h->nlosses; i++)
        KPL_CHECK(h->loss_names[i] && h->loss_names[i][0], KPL_EINVAL, "loss %d has no name", i);
    return KPL_OK;
}

static kpl__registry heads = {.what = "detector head", .builtin = builtin, .check = check_head};

kpl_status kpl_detector_head_register(const kpl_detector_head *h)
{
    return kpl__registry_add(&heads, h);
}
const kpl_detector_head *kpl_detector_head_find(const char *name)
{
    return kpl__registry_find(&heads, name);
}
int kpl_detector_head_count(void) { return kpl__registry_count(&heads); }
const kpl_detector_head *kpl_detector_head_at(int i) { return kpl__registry_at(&heads, i); }
