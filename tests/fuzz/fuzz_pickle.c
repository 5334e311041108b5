/*
 * fuzz_pickle.c — the strict pickle reader of dataio/pickle.c and the CIFAR
 * batch and meta readers over it (dataio/convert_cifar.c): what `kpl data
 * convert --from cifar` runs on the python version's files, and the binary
 * version's record reader.
 *
 * Input: the bytes of one file, read as a pickle (kpl__pickle_load, and
 * in the torch dialect: kpl__pickle_load_torch), as a
 * CIFAR-10 and a CIFAR-100 batch and meta file, and as a binary batch of
 * either set.  Seeds (corpus/pickle) are small batches and meta files as
 * Python 2's cPickle and Python 3 write them, from tests/dataio/gen_cifar.py
 * --seeds, and data.pkl of torch.save archives (torch_ref.py views; a
 * ResNet-18 state dict's).
 */
#include "fuzz_common.h"

#include "pickle_impl.h"

/* Whatever a parsed pickle holds must be consistent: every built array's
 * bytes match its shape, containers hold what they count. */
static void check_values(const kpl__pk_value *root)
{
    const kpl__pk_value *v = root;
    if (v->kind == KPL__PK_DICT && v->n % 2) abort();
    for (int64_t i = 0; (v->kind == KPL__PK_DICT || v->kind == KPL__PK_LIST ||
                         v->kind == KPL__PK_TUPLE) && i < v->n; i++) {
        const kpl__pk_value *e = v->items[i];
        if (e->kind == KPL__PK_ARRAY && e->built) {
            uint64_t n = 1;
            for (int d = 0; d < e->ndim; d++) n *= (uint64_t)e->shape[d];
            if (n != e->len) abort();
            fuzz_touch(e->bytes, e->len);
        }
        if (e->kind == KPL__PK_BYTES || e->kind == KPL__PK_STR) fuzz_touch(e->bytes, e->len);
        if (e->kind == KPL__PK_TENSOR) { /* a view of a storage, up to 8 counts */
            if (e->ndim < 0 || e->ndim > 8 || e->n != 1 || e->items[0]->kind != KPL__PK_STORAGE ||
                e->num < 0)
                abort();
            for (int d = 0; d < e->ndim; d++)
                if (e->shape[d] < 0 || e->stride[d] < 0) abort();
            fuzz_touch(e->items[0]->bytes, e->items[0]->len);
        }
    }
}

static void check_batch(const kpl__cifar_batch *b, bool cifar100)
{
    if (b->n < 1) abort();
    fuzz_touch(b->pixels, (size_t)b->n * KPL__CIFAR_PIXELS);
    for (int64_t i = 0; i < b->n; i++)
        if (b->label[i] < 0 || b->label[i] >= (cifar100 ? 100 : 10) ||
            (cifar100 && (b->coarse[i] < 0 || b->coarse[i] >= 20)))
            abort();
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    fuzz_reset();
    uint8_t *buf = malloc(size ? size : 1); /* exactly its size: overreads are caught */
    if (!buf) abort();
    memcpy(buf, data, size);
    kpl__pickle *p = NULL;
    if (fuzz_st(kpl__pickle_load(buf, size, "fuzz", &p), "pickle") == KPL_OK) {
        check_values(kpl__pickle_root(p));
        kpl__pickle_free(p);
    }
    /* the torch dialect (kpl import torch's data.pkl) */
    if (fuzz_st(kpl__pickle_load_torch(buf, size, "fuzz", &p), "torch pickle") == KPL_OK) {
        check_values(kpl__pickle_root(p));
        kpl__pickle_free(p);
    }
    for (int c100 = 0; c100 < 2; c100++) {
        kpl__cifar_batch b;
        if (fuzz_st(kpl__cifar_parse_pickle(buf, size, "fuzz", c100, &b), "batch") == KPL_OK) {
            check_batch(&b, c100);
            kpl__cifar_batch_free(&b);
        }
        if (fuzz_st(kpl__cifar_parse_binary(buf, size, "fuzz", c100, &b), "binary") == KPL_OK) {
            check_batch(&b, c100);
            kpl__cifar_batch_free(&b);
        }
        char **fine = NULL, **coarse = NULL;
        if (fuzz_st(kpl__cifar_parse_meta(buf, size, "fuzz", c100, &fine, &coarse), "meta") ==
            KPL_OK) {
            for (int i = 0; i < (c100 ? 100 : 10); i++)
                if (!fine[i] || !fine[i][0] || strchr(fine[i], '\n')) abort();
            for (int i = 0; c100 && i < 20; i++)
                if (!coarse[i] || !coarse[i][0] || strchr(coarse[i], '\n')) abort();
            kpl__cifar_names_free(fine, c100 ? 100 : 10);
            kpl__cifar_names_free(coarse, 20);
        }
    }
    free(buf);
    return 0;
}
