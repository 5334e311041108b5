/* recipe_case.h — a recipe test case (test_recipe.c, test_keys.c): a
 * file's text and an override, and what loading them must give. */
#ifndef KPL_TEST_RECIPE_CASE_H
#define KPL_TEST_RECIPE_CASE_H

#include "kpl_test.h"
#include "recipe.h"

typedef struct {
    const char *yaml, *override;
    kpl_status st;      /* KPL_OK: it must load */
    const char *needle; /* words the message must hold */
} recipe_case;

/* Loads path with c's override into *r and checks the outcome; i numbers
 * the case in a failure. */
static inline void check_recipe_case(size_t i, const recipe_case *c, const char *path,
                                     kpl_recipe *r)
{
    const char *ov[1] = {c->override};
    int nov = c->override ? 1 : 0;
    if (!c->st) {
        OK(kpl_recipe_load(path, nov, ov, r));
        return;
    }
    kpl_clear_error();
    kpl_status st = kpl_recipe_load(path, nov, ov, r);
    if (st != c->st || !strstr(kpl_last_error(), c->needle))
        fail_msg("case %zu: got %s '%s', expected %s with '%s'", i, kpl_status_str(st),
                 kpl_last_error(), kpl_status_str(c->st), c->needle);
}

#endif
