/* libkpl.so is the union of the module archives linked whole; this file only
 * gives the shared-library target a translation unit of its own. */
#include "kernels.h"
int kpl__so_marker(void);
int kpl__so_marker(void) { return KPL_VERSION_NUMBER; }
