/*
 * pickle_impl.h — a strict reader of the Python pickles that CIFAR's
 * "python version" files are (pickle.c), and the CIFAR batches read from
 * them and from the binary version (convert_cifar.c).
 *
 * The reader knows protocol 2 and exactly the opcodes that Python 2's
 * cPickle (the files as distributed) and Python 3's pickle at protocol 2
 * write for a dict of ints, strings, lists and numpy uint8 arrays.  It
 * runs nothing: the only globals it accepts are numpy's array and dtype
 * reconstructors, _codecs.encode (how Python 3 writes bytes at protocol
 * 2) and bytes (its empty bytes), and each is interpreted by kpl for the
 * one form numpy and Python write.  Anything else — another opcode,
 * protocol or global, a length past the end, a stack underflow, bytes
 * after STOP — is KPL_EFORMAT naming the file and the byte offset.
 *
 *   kpl__pickle *p = NULL;
 *   KPL_TRY(kpl__pickle_load(buf, len, "data_batch_1", &p));
 *   const kpl__pk_value *data = kpl__pk_dict_get(kpl__pickle_root(p), "data");
 *   ... data->kind == KPL__PK_ARRAY, data->shape, data->bytes ...
 *   kpl__pickle_free(p);
 */
#ifndef KPL_PICKLE_IMPL_H
#define KPL_PICKLE_IMPL_H

#include "dataio.h"

#include <stddef.h>
#include <stdint.h>

typedef enum {
    KPL__PK_NONE,
    KPL__PK_BOOL,   /* num: 0 or 1 */
    KPL__PK_INT,    /* num */
    KPL__PK_BYTES,  /* bytes[len]: Python 2's str, Python 3's bytes */
    KPL__PK_STR,    /* bytes[len]: UTF-8 (checked) */
    KPL__PK_TUPLE,  /* items[n] */
    KPL__PK_LIST,   /* items[n] */
    KPL__PK_DICT,   /* items[n], n even: key, value, key, value, ... in insertion order */
    KPL__PK_GLOBAL, /* one of the few callables the reader knows (pickle.c) */
    KPL__PK_ARRAY,  /* a numpy uint8 array: shape[ndim], bytes[len] in C order */
    KPL__PK_DTYPE,  /* numpy's uint8 dtype */
    /* the torch dialect (kpl__pickle_load_torch) only: */
    KPL__PK_FLOAT,   /* real */
    KPL__PK_OBJECT,  /* an instance of a class kpl does not interpret (never called) */
    KPL__PK_STORAGE, /* a storage by persistent id: dtype, key bytes[len] (its file in the
                        archive's data/), num: its elements */
    KPL__PK_TENSOR,  /* a view of items[0] (a STORAGE): num: its offset in elements,
                        shape[ndim], stride[ndim] in elements */
} kpl__pk_kind;

typedef struct kpl__pk_value kpl__pk_value;
struct kpl__pk_value {
    kpl__pk_kind kind;
    size_t offset;         /* byte offset of the opcode that made it, for messages */
    int64_t num;           /* BOOL, INT; GLOBAL: which callable */
    const uint8_t *bytes;  /* BYTES, STR, ARRAY: a view into the input or into `owned` */
    size_t len;
    kpl__pk_value **items; /* TUPLE, LIST, DICT */
    int64_t n, cap;
    int ndim;              /* ARRAY, TENSOR */
    int64_t shape[8];
    int64_t stride[8];     /* TENSOR */
    double real;           /* FLOAT */
    kpl_dtype dtype;       /* STORAGE; GLOBAL of a storage type */
    bool built;            /* ARRAY, DTYPE: BUILD has set its state */
    uint8_t *owned;        /* bytes decoded by _codecs.encode, freed with the pickle */
};

/* A parsed pickle: every value it made, and the one STOP returned. */
typedef struct kpl__pickle kpl__pickle;

/* Parses buf[len] (all of it: bytes after STOP are an error).  `name`
 * (the file) starts every message.  Values may view buf: keep it alive
 * while *out is used.  *out owned by the caller (kpl__pickle_free).
 * Memory is O(len); nothing recurses, so no input can exhaust the stack. */
kpl_status kpl__pickle_load(const uint8_t *buf, size_t len, const char *name,
                            kpl__pickle **out);
/* The same for the data.pkl of a torch.save archive (protocol 2, torch's
 * default): also collections.OrderedDict (a dict), torch._utils'
 * _rebuild_tensor_v2 and _rebuild_parameter (TENSOR values), the typed
 * storages torch.FloatStorage, HalfStorage, BFloat16Storage,
 * DoubleStorage, LongStorage, IntStorage, ByteStorage and BoolStorage as
 * persistent ids (BINPERSID: STORAGE values), BINFLOAT, LONG1 and
 * NEWOBJ; any other class a pickle names becomes an OBJECT that is never
 * called, and BUILD of a dict or an OBJECT (an OrderedDict's _metadata)
 * is read and dropped.  Nothing is imported or executed. */
kpl_status kpl__pickle_load_torch(const uint8_t *buf, size_t len, const char *name,
                                  kpl__pickle **out);
void kpl__pickle_free(kpl__pickle *p);
const kpl__pk_value *kpl__pickle_root(const kpl__pickle *p);

/* Whether v is BYTES or STR holding exactly the text s. */
bool kpl__pk_is_text(const kpl__pk_value *v, const char *s);
/* The value of the last entry of dict d whose key is the text `key`
 * (bytes or str, as Python 2 and 3 write keys), or NULL (also when d is
 * not a dict). */
const kpl__pk_value *kpl__pk_dict_get(const kpl__pk_value *d, const char *key);
/* "dict", "list", "uint8 array", ...: for messages. */
const char *kpl__pk_kind_name(kpl__pk_kind k);

/* ---- CIFAR batches (convert_cifar.c) ---- */

#define KPL__CIFAR_PIXELS 3072 /* 32 x 32 x 3: the red plane, the green, the blue */

/* The images and labels of one batch file, checked. */
typedef struct {
    int64_t n;
    uint8_t *pixels; /* (n, 3072) as stored: each image's R, G, B planes of 32 x 32; malloc'd */
    int64_t *label;  /* (n) the label (CIFAR-100: the fine label), malloc'd */
    int64_t *coarse; /* (n) CIFAR-100's coarse label, malloc'd; NULL for CIFAR-10 */
} kpl__cifar_batch;

void kpl__cifar_batch_free(kpl__cifar_batch *b);

/* One batch of the python version: a pickled dict with b'data', a uint8
 * array (N, 3072), and b'labels' (CIFAR-10) or b'fine_labels' and
 * b'coarse_labels' (CIFAR-100), lists of N ints, each a class.  `name`
 * starts every message (the file). */
kpl_status kpl__cifar_parse_pickle(const uint8_t *buf, size_t len, const char *name,
                                   bool cifar100, kpl__cifar_batch *b);
/* One batch of the binary version: records of 1 label byte (CIFAR-10) or
 * coarse and fine label bytes (CIFAR-100), then the 3072 pixel bytes. */
kpl_status kpl__cifar_parse_binary(const uint8_t *buf, size_t len, const char *name,
                                   bool cifar100, kpl__cifar_batch *b);
/* The class names of a python version meta file: b'label_names' (10), or
 * b'fine_label_names' (100) and b'coarse_label_names' (20).  *fine and
 * *coarse (CIFAR-100 only; else NULL) are malloc'd arrays of malloc'd
 * strings, freed with kpl__cifar_names_free. */
kpl_status kpl__cifar_parse_meta(const uint8_t *buf, size_t len, const char *name,
                                 bool cifar100, char ***fine, char ***coarse);
void kpl__cifar_names_free(char **names, int64_t n);

#endif /* KPL_PICKLE_IMPL_H */
