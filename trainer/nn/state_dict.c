/*
 * state_dict.c — a module tree in and out of a checkpoint by dotted names:
 * the whole model for a resume, or part of it (a backbone into a bigger
 * model) with a report of what did not match.
 */
#include "nn_impl.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define NAME_LEN 320

kpl_status kpl_module_state_save(kpl_module *m, kpl_checkpoint *c, const char *prefix)
{
    char name[NAME_LEN];
    if (!prefix) prefix = "";
    for (int b = 0; b < 2; b++) {
        int n = b ? kpl_module_num_buffers(m) : kpl_module_num_params(m);
        for (int i = 0; i < n; i++) {
            snprintf(name, sizeof name, "%s%s", prefix,
                     b ? kpl_module_buffer_name(m, i) : kpl_module_param_name(m, i));
            KPL_TRY(kpl_checkpoint_add(c, name, (b ? kpl_module_buffers(m) : kpl_module_params(m))[i]));
        }
    }
    return KPL_OK;
}

/* Appends ", name" (or "name") to a growing list; at most `cap` names are
 * written, the rest only counted. */
static void list_add(char **list, size_t *len, int count, const char *name)
{
    if (count >= 20) return; /* the report names the first 20 */
    size_t add = strlen(name) + 3;
    char *p = realloc(*list, *len + add);
    if (!p) return;
    *list = p;
    *len += (size_t)snprintf(p + *len, add, "%s%s", *len ? ", " : "", name);
}

void kpl_state_report_clear(kpl_state_report *r)
{
    if (!r) return;
    free(r->missing);
    free(r->unexpected);
    free(r->mismatched);
    memset(r, 0, sizeof *r);
}

kpl_status kpl_module_state_load(kpl_module *m, const kpl_checkpoint *c, const char *prefix,
                                 bool strict, kpl_state_report *report)
{
    kpl_state_report r;
    memset(&r, 0, sizeof r);
    size_t mlen = 0, ulen = 0;
    char name[NAME_LEN];
    if (!prefix) prefix = "";
    size_t plen = strlen(prefix);
    kpl_status st = KPL_OK, first = KPL_OK;
    char first_msg[512] = "";
    size_t xlen = 0;
    /* every tensor of the model: copied when the checkpoint has it */
    for (int b = 0; b < 2; b++) {
        int n = b ? kpl_module_num_buffers(m) : kpl_module_num_params(m);
        for (int i = 0; i < n; i++) {
            const char *own = b ? kpl_module_buffer_name(m, i) : kpl_module_param_name(m, i);
            snprintf(name, sizeof name, "%s%s", prefix, own);
            if (!kpl_checkpoint_find(c, name)) {
                list_add(&r.missing, &mlen, r.nmissing++, own);
                continue;
            }
            kpl_status cs = kpl_checkpoint_check(c, name,
                                                  (b ? kpl_module_buffers(m) : kpl_module_params(m))[i]);
            if (cs < 0) { /* every mismatch is listed; the first one's message is the error */
                if (first == KPL_OK) {
                    first = cs;
                    snprintf(first_msg, sizeof first_msg, "%s", kpl_last_error());
                }
                list_add(&r.mismatched, &xlen, r.nmismatched++, own);
                continue;
            }
            r.nloaded++;
        }
    }
    /* every tensor of the checkpoint under the prefix that the model lacks */
    for (int i = 0; i < kpl_checkpoint_num_tensors(c); i++) {
        const char *cn = kpl_checkpoint_name(c, i);
        if (strncmp(cn, prefix, plen)) continue;
        if (kpl_module_param_index(m, cn + plen) >= 0) continue;
        bool buf = false;
        for (int k = 0; k < kpl_module_num_buffers(m) && !buf; k++)
            buf = !strcmp(kpl_module_buffer_name(m, k), cn + plen);
        if (!buf) list_add(&r.unexpected, &ulen, r.nunexpected++, cn + plen);
    }
    if (r.nmismatched) {
        st = r.nmismatched == 1
                 ? KPL_ERROR(first, "%s", first_msg)
                 : KPL_ERROR(first, "%s; %d tensors differ in all (%s%s)", first_msg, r.nmismatched,
                             r.mismatched ? r.mismatched : "", r.nmismatched > 20 ? ", ..." : "");
        goto fail;
    }
    if (strict && (r.nmissing || r.nunexpected)) {
        st = KPL_ERROR(KPL_ENOTFOUND,
                       "state dict%s%s: %d missing (%s%s), %d unexpected (%s%s)",
                       plen ? " under " : "", prefix, r.nmissing, r.missing ? r.missing : "",
                       r.nmissing > 20 ? ", ..." : "", r.nunexpected,
                       r.unexpected ? r.unexpected : "", r.nunexpected > 20 ? ", ..." : "");
        goto fail;
    }
    /* a load that matches nothing is a misspelt prefix, not a partial load */
    if (r.nloaded == 0 && r.nmissing > 0) {
        char some[160] = "";
        for (int i = 0, at = 0; i < kpl_checkpoint_num_tensors(c) && i < 3; i++)
            at += snprintf(some + at, sizeof some - (size_t)at, "%s%s", i ? ", " : "",
                           kpl_checkpoint_name(c, i));
        st = KPL_ERROR(KPL_ENOTFOUND, "state dict under '%s': none of the model's %d tensors "
                       "(such as '%s%s') is in the checkpoint, which holds %d (%s%s): a wrong "
                       "prefix?", prefix, r.nmissing, prefix,
                       kpl_module_num_params(m) ? kpl_module_param_name(m, 0) : "",
                       kpl_checkpoint_num_tensors(c), some,
                       kpl_checkpoint_num_tensors(c) > 3 ? ", ..." : "");
        goto fail;
    }
    /* all checked: now copy, so a failed check leaves the model as it was */
    for (int b = 0; b < 2; b++) {
        int n = b ? kpl_module_num_buffers(m) : kpl_module_num_params(m);
        for (int i = 0; i < n; i++) {
            snprintf(name, sizeof name, "%s%s", prefix,
                     b ? kpl_module_buffer_name(m, i) : kpl_module_param_name(m, i));
            kpl_tensor *t = kpl_checkpoint_find(c, name);
            if (t) KPL_TRY_GOTO(kpl_k_copy((b ? kpl_module_buffers(m) : kpl_module_params(m))[i], t));
        }
    }
    if (report) *report = r;
    else kpl_state_report_clear(&r);
    return KPL_OK;
fail:
    /* the report says what did not match, also when that is the error */
    r.nloaded = 0;
    if (report) *report = r;
    else kpl_state_report_clear(&r);
    return st;
}
