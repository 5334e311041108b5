/*
 * fuzz_checkpoint.c — kpl_checkpoint_load (trainer/io/checkpoint.c,
 * docs/checkpoint.md) of a file made from the input, then everything a
 * resume does with what loaded: the metadata, every tensor's name, bytes
 * and a restore into a tensor of its shape.
 *
 * Input: one mode byte, then
 *   mode even: the checkpoint file itself (header, zstd frame);
 *   mode odd:  the decompressed payload (table length, JSON table, tensor
 *              bytes); the harness compresses it and writes a valid header
 *              with both CRC32Cs, so that mutations reach the table parser.
 * Seeds (corpus/checkpoint) are checkpoints written by kpl_checkpoint_save,
 * in both modes.
 */
#include "fuzz_common.h"
#include "fuzz_ckpt.h"

#include "trainer.h"

#define RESTORE_MAX ((size_t)1 << 20) /* bytes restored per tensor */

static void use(kpl_checkpoint *c)
{
    const char *meta = kpl_checkpoint_meta(c);
    fuzz_touch(meta, strlen(meta));
    int n = kpl_checkpoint_num_tensors(c);
    for (int i = 0; i < n; i++) {
        const char *name = kpl_checkpoint_name(c, i);
        kpl_tensor *t = kpl_checkpoint_find(c, name);
        if (!t) abort(); /* every listed name must be found */
        size_t nb = kpl_tensor_nbytes(t);
        if (nb > RESTORE_MAX) continue;
        const void *p = kpl_tensor_host_data(t);
        if (p) fuzz_touch(p, nb);
        kpl_tensor *dst = NULL;
        if (kpl_tensor_empty_like(t, &dst) == KPL_OK) {
            if (kpl_checkpoint_restore(c, name, dst) != KPL_OK) {
                fprintf(stderr, "fuzz_checkpoint: restoring '%s' into its own shape failed: %s\n",
                        name, kpl_last_error());
                abort();
            }
            kpl_tensor_release(dst);
        }
    }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 1) return 0;
    fuzz_reset();
    char path[PATH_MAX];
    fuzz_path(path, fuzz_dir("checkpoint"), "ckpt.kpl");
    uint8_t *wrapped = NULL;
    size_t n = size - 1;
    const uint8_t *file = data + 1;
    if (data[0] & 1) {
        wrapped = fuzz_ckpt_wrap(data + 1, size - 1, &n);
        file = wrapped;
    }
    fuzz_write(path, file, n);
    kpl_checkpoint *c = NULL;
    if (fuzz_st(kpl_checkpoint_load(path, &c), "load") == KPL_OK) {
        use(c);
        kpl_checkpoint_destroy(c);
    }
    unlink(path);
    free(wrapped);
    return 0;
}
