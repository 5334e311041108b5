/*
 * fuzz_onnx.c — kpl_onnx_import (trainer/io/onnx_import.c) of an ONNX file
 * made from the input: the protobuf parse, every initializer's dtype, dims
 * and data (raw, typed, external), then the checkpoint's tensors read.
 *
 * Input: one byte of options, then the file.  Bit 0 adds a prefix, bit 1
 * excludes "layer*" names, bit 2 writes the file's own bytes as
 * "ext.bin" next to it (so external data may point somewhere real).
 * Seeds (corpus/onnx): kpl's ONNX export of a small traced network.
 */
#include "fuzz_common.h"

#include "trainer.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 1) return 0;
    fuzz_reset();
    const char *dir = fuzz_dir("onnx");
    char path[PATH_MAX], ext[PATH_MAX];
    fuzz_path(path, dir, "m.onnx");
    fuzz_path(ext, dir, "ext.bin");
    fuzz_write(path, data + 1, size - 1);
    if (data[0] & 4) fuzz_write(ext, data + 1, size - 1);
    kpl_checkpoint *c = NULL;
    const char *excl[] = {"layer*"};
    kpl_status st = kpl_onnx_import(path, data[0] & 1 ? "model." : NULL, data[0] & 2 ? 1 : 0, excl, &c);
    if (fuzz_st(st, "import") == KPL_OK) {
        for (int i = 0; i < kpl_checkpoint_num_tensors(c); i++) {
            kpl_tensor *t = kpl_checkpoint_find(c, kpl_checkpoint_name(c, i));
            if (!t) abort(); /* every name it lists, it has */
            const void *p = kpl_tensor_host_data(t);
            if (!p && kpl_tensor_nbytes(t)) abort();
            if (p) fuzz_touch(p, kpl_tensor_nbytes(t));
        }
        kpl_checkpoint_destroy(c);
    } else if (c) {
        abort(); /* a failure leaves nothing */
    }
    unlink(path);
    unlink(ext);
    return 0;
}
