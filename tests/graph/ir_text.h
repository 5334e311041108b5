/* ir_text.h — a graph's dump as text, for the tests that check which ops
 * a trace recorded (test_segops.c, test_focal.c). */
#ifndef KPL_IR_TEXT_H
#define KPL_IR_TEXT_H

#include "kpl_test.h"
#include "ir.h"

#include <stdio.h>

/* kpl_ir_dump's text of ir (malloc'd). */
static inline char *ir_dump_text(kpl_ir *ir)
{
    char *dump = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&dump, &len);
    assert_non_null(f);
    OK(kpl_ir_dump(ir, f, false));
    fclose(f);
    return dump;
}

#endif
