/*
 * checkpoint.h — named tensors and a JSON object in one file
 * (docs/checkpoint.md), and module trees in and out of them by dotted
 * names (state dicts).
 */
#ifndef KPL_CHECKPOINT_H
#define KPL_CHECKPOINT_H

#include "module.h"

#ifdef __cplusplus
extern "C" {
#endif

/*
 * Named tensors and a JSON object (docs/checkpoint.md):
 *
 *   kpl_checkpoint *c = NULL;
 *   kpl_checkpoint_create(&c);
 *   kpl_checkpoint_add(c, "model.fc.weight", w);     // read at save time
 *   kpl_checkpoint_set_meta(c, "{\"step\": 100}");
 *   kpl_checkpoint_save(c, "run/checkpoints/ckpt-0000000100.kpl");
 *   kpl_checkpoint_destroy(c);
 *
 *   kpl_checkpoint_load(path, &c);                    // every byte checked
 *   kpl_checkpoint_restore(c, "model.fc.weight", w);  // shape and dtype checked
 *
 * save writes PATH.tmp (zstd, CRC32C), fsyncs it, renames it to PATH,
 * fsyncs the directory, and then writes the completion marker PATH.done the
 * same way: a crash at any point leaves either the previous state or a
 * complete checkpoint, and a checkpoint without its marker is never picked
 * up as the latest.  Blocking; one thread per checkpoint object.
 */
typedef struct kpl_checkpoint kpl_checkpoint;

kpl_status kpl_checkpoint_create(kpl_checkpoint **out);
void kpl_checkpoint_destroy(kpl_checkpoint *c); /* NULL is a no-op */
/* Adds t (retained until destroy; its contents are read by save).  Names
 * are unique, 1 to 255 bytes. */
kpl_status kpl_checkpoint_add(kpl_checkpoint *c, const char *name, kpl_tensor *t);
/* The metadata: the text of a JSON object (copied). */
kpl_status kpl_checkpoint_set_meta(kpl_checkpoint *c, const char *json);
const char *kpl_checkpoint_meta(const kpl_checkpoint *c);
kpl_status kpl_checkpoint_save(kpl_checkpoint *c, const char *path);
/* Reads and checks a checkpoint (header and payload CRC32C, sizes, the
 * tensor table): KPL_EFORMAT naming the file and what is wrong,
 * KPL_ENOTFOUND for a missing file.  *out owned by the caller. */
kpl_status kpl_checkpoint_load(const char *path, kpl_checkpoint **out);
int kpl_checkpoint_num_tensors(const kpl_checkpoint *c);
const char *kpl_checkpoint_name(const kpl_checkpoint *c, int i);
/* The tensor called name (a CPU tensor over the loaded bytes, borrowed),
 * or NULL. */
kpl_tensor *kpl_checkpoint_find(const kpl_checkpoint *c, const char *name);
/* Copies the tensor called name into dst (any device): KPL_ENOTFOUND,
 * KPL_EDTYPE or KPL_ESHAPE naming the file, the tensor and both shapes. */
kpl_status kpl_checkpoint_restore(const kpl_checkpoint *c, const char *name, kpl_tensor *dst);
/* kpl_checkpoint_restore's checks alone: the tensor called name exists
 * with like's dtype and shape (its errors otherwise); nothing is copied. */
kpl_status kpl_checkpoint_check(const kpl_checkpoint *c, const char *name, const kpl_tensor *like);

/* ---- state dicts: module trees in checkpoints --------------------------------------------- */
/*
 * A model's tensors travel by dotted name: `prefix` + "layer1.0.conv1.weight".
 *
 *   kpl_module_state_save(model, c, "model.");            // a resume's model
 *   // a classifier's backbone into a detector's "backbone" child:
 *   kpl_state_report rep;
 *   kpl_module_state_load(kpl_module_find(det, "backbone"), ckpt, "model.", false, &rep);
 *   printf("%d loaded, missing: %s, unexpected: %s\n", rep.nloaded, rep.missing, rep.unexpected);
 *   kpl_state_report_clear(&rep);
 */
typedef struct {
    int nloaded, nmissing, nunexpected, nmismatched;
    char *missing;    /* the first 20 model names the checkpoint lacks, ", "-joined (malloc'd) */
    char *unexpected; /* the first 20 checkpoint names under prefix the model lacks */
    char *mismatched; /* the first 20 model names whose shape or dtype differs in c */
} kpl_state_report;

/* Adds every parameter and buffer under m as prefix + dotted name (read
 * at save time). */
kpl_status kpl_module_state_save(kpl_module *m, kpl_checkpoint *c, const char *prefix);
/* Copies every tensor of m that c has (prefix + dotted name); a dtype or
 * shape that differs is an error naming both (and listing every tensor
 * that differs), and any error leaves m as it was (everything is checked
 * before anything is copied).  strict: a tensor of m missing from c, or a
 * tensor of c under prefix that m lacks, is KPL_ENOTFOUND listing them;
 * not strict, a load that matches none of m's tensors is KPL_ENOTFOUND too
 * (a misspelt prefix), naming the prefix and some of c's names.
 * report (may be NULL) receives the counts and names, on success and on
 * failure alike (nloaded 0 then); free it with kpl_state_report_clear. */
kpl_status kpl_module_state_load(kpl_module *m, const kpl_checkpoint *c, const char *prefix,
                                 bool strict, kpl_state_report *report);
void kpl_state_report_clear(kpl_state_report *r);

#ifdef __cplusplus
}
#endif
#endif /* KPL_CHECKPOINT_H */
