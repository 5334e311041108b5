/*
 * pickle.c — the strict pickle reader of pickle_impl.h.
 *
 * A pickle is a program for a stack machine: each opcode pushes a value,
 * or pops some and pushes what it makes of them, and STOP returns the top.
 * This reader runs that machine for the opcodes of run_op's switch and no
 * others.  A "call" (REDUCE) is only ever one of the four constructions
 * that numpy and Python write for a uint8 array and for bytes, checked
 * argument by argument; nothing is imported or executed.
 *
 * Every length is checked against the bytes left before it is used, every
 * pop against the stack and the innermost MARK, every memo index against
 * a bound, so a hostile file gets an error naming the byte offset of the
 * opcode at fault, never a read past the buffer or an allocation out of
 * proportion to its size.  Containers may hold themselves (a memo can make
 * cycles); nothing here walks values recursively, so that is harmless.
 */
#include "pickle_impl.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* The callables a GLOBAL may name (torch: the torch dialect's only). */
enum { G_RECONSTRUCT, G_NDARRAY, G_DTYPE, G_ENCODE, G_BYTES, G_ODICT, G_TENSOR, G_PARAM,
       G_STORAGE };

static const struct {
    const char *module, *name;
    int which;
    bool torch;
    kpl_dtype dtype; /* G_STORAGE */
} known_globals[] = {
    {"numpy.core.multiarray", "_reconstruct", G_RECONSTRUCT, false, KPL_U8}, /* numpy 1.x, Python 2 */
    {"numpy._core.multiarray", "_reconstruct", G_RECONSTRUCT, false, KPL_U8}, /* numpy 2.x */
    {"numpy", "ndarray", G_NDARRAY, false, KPL_U8},
    {"numpy", "dtype", G_DTYPE, false, KPL_U8},
    {"_codecs", "encode", G_ENCODE, false, KPL_U8},  /* Python 3's bytes at protocol 2 */
    {"__builtin__", "bytes", G_BYTES, false, KPL_U8}, /* ... and its empty bytes */
    {"collections", "OrderedDict", G_ODICT, true, KPL_U8},
    {"torch._utils", "_rebuild_tensor_v2", G_TENSOR, true, KPL_U8},
    {"torch._utils", "_rebuild_parameter", G_PARAM, true, KPL_U8},
    {"torch", "FloatStorage", G_STORAGE, true, KPL_F32},
    {"torch", "HalfStorage", G_STORAGE, true, KPL_F16},
    {"torch", "BFloat16Storage", G_STORAGE, true, KPL_BF16},
    {"torch", "DoubleStorage", G_STORAGE, true, KPL_F64},
    {"torch", "LongStorage", G_STORAGE, true, KPL_I64},
    {"torch", "IntStorage", G_STORAGE, true, KPL_I32},
    {"torch", "ByteStorage", G_STORAGE, true, KPL_U8},
    {"torch", "BoolStorage", G_STORAGE, true, KPL_BOOL},
};

/* Bounds that keep memory in proportion to the input.  A real CIFAR-100
 * train file makes about 1.5 * 10^5 values and memoizes as many, numbered
 * from 0 or 1 by the one PUT (2 bytes or more) that stores each; so a memo
 * index is refused past MEMO_MAX and past half the file's length, the
 * values past MAX_VALUES (about 250 MB of them), and the bytes decoded by
 * _codecs.encode past the file's length (each encoded text appears once). */
#define MEMO_MAX (1 << 22)
#define MAX_VALUES (1 << 21)

/* Every opcode of protocols 0 to 5, for messages; the reader runs few. */
static const char *const opcode_names[256] = {
    ['('] = "MARK", ['.'] = "STOP", ['0'] = "POP", ['1'] = "POP_MARK", ['2'] = "DUP",
    ['F'] = "FLOAT", ['I'] = "INT", ['J'] = "BININT", ['K'] = "BININT1", ['L'] = "LONG",
    ['M'] = "BININT2", ['N'] = "NONE", ['P'] = "PERSID", ['Q'] = "BINPERSID",
    ['R'] = "REDUCE", ['S'] = "STRING", ['T'] = "BINSTRING", ['U'] = "SHORT_BINSTRING",
    ['V'] = "UNICODE", ['X'] = "BINUNICODE", ['a'] = "APPEND", ['b'] = "BUILD",
    ['c'] = "GLOBAL", ['d'] = "DICT", ['}'] = "EMPTY_DICT", ['e'] = "APPENDS", ['g'] = "GET",
    ['h'] = "BINGET", ['i'] = "INST", ['j'] = "LONG_BINGET", ['l'] = "LIST",
    [']'] = "EMPTY_LIST", ['o'] = "OBJ", ['p'] = "PUT", ['q'] = "BINPUT",
    ['r'] = "LONG_BINPUT", ['s'] = "SETITEM", ['t'] = "TUPLE", [')'] = "EMPTY_TUPLE",
    ['u'] = "SETITEMS", ['G'] = "BINFLOAT", [0x80] = "PROTO", [0x81] = "NEWOBJ",
    [0x82] = "EXT1", [0x83] = "EXT2", [0x84] = "EXT4", [0x85] = "TUPLE1", [0x86] = "TUPLE2",
    [0x87] = "TUPLE3", [0x88] = "NEWTRUE", [0x89] = "NEWFALSE", [0x8a] = "LONG1",
    [0x8b] = "LONG4", ['B'] = "BINBYTES", ['C'] = "SHORT_BINBYTES",
    [0x8c] = "SHORT_BINUNICODE", [0x8d] = "BINUNICODE8", [0x8e] = "BINBYTES8",
    [0x8f] = "EMPTY_SET", [0x90] = "ADDITEMS", [0x91] = "FROZENSET", [0x92] = "NEWOBJ_EX",
    [0x93] = "STACK_GLOBAL", [0x94] = "MEMOIZE", [0x95] = "FRAME", [0x96] = "BYTEARRAY8",
    [0x97] = "NEXT_BUFFER", [0x98] = "READONLY_BUFFER",
};

struct kpl__pickle {
    kpl__pk_value **all; /* every value made, for freeing */
    int64_t nall, cap;
    kpl__pk_value *root;
};

typedef struct {
    const uint8_t *b;
    size_t len, at;
    size_t op; /* offset of the opcode being run */
    const char *name;
    kpl__pickle *p;
    kpl__pk_value **stack;
    int64_t sp, stack_cap;
    int64_t *marks; /* stack heights at each open MARK */
    int64_t nmarks, marks_cap;
    kpl__pk_value **memo;
    int64_t memo_cap;
    size_t decoded; /* bytes made by _codecs.encode so far */
    bool torch;     /* the torch dialect */
} machine;

const char *kpl__pk_kind_name(kpl__pk_kind k)
{
    static const char *const names[] = {"None",   "bool",   "int",         "bytes", "str",
                                        "tuple",  "list",   "dict",        "global",
                                        "uint8 array", "dtype", "float", "object",
                                        "storage", "tensor"};
    return (unsigned)k < sizeof names / sizeof *names ? names[k] : "?";
}

/* An error at the opcode being run. */
static kpl_status bad(const machine *m, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static kpl_status bad(const machine *m, const char *fmt, ...)
{
    char msg[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    return KPL_ERROR(KPL_EFORMAT, "%s: pickle byte offset %zu: %s", m->name, m->op, msg);
}

/* p grown to hold `need` elements of `elem` bytes (capacity doubling), or
 * NULL (p left as it was) when memory runs out. */
static void *grow(void *p, int64_t *cap, int64_t need, size_t elem)
{
    if (need <= *cap) return p;
    int64_t c = *cap ? *cap : 8;
    while (c < need) c *= 2;
    void *q = realloc(p, (size_t)c * elem);
    if (q) *cap = c;
    return q;
}

static kpl_status no_memory(const machine *m)
{
    return KPL_ERROR(KPL_ENOMEM, "%s: no memory to read the pickle (at byte %zu)", m->name, m->op);
}

static kpl_status new_value(machine *m, kpl__pk_kind kind, kpl__pk_value **out)
{
    kpl__pickle *p = m->p;
    if (p->nall >= MAX_VALUES)
        return bad(m, "more than %d values (a CIFAR file makes about 150,000)", MAX_VALUES);
    kpl__pk_value **all = grow(p->all, &p->cap, p->nall + 1, sizeof *all);
    kpl__pk_value *v = all ? calloc(1, sizeof *v) : NULL;
    if (all) p->all = all;
    if (!v) return no_memory(m);
    v->kind = kind;
    v->offset = m->op;
    p->all[p->nall++] = v;
    *out = v;
    return KPL_OK;
}

static kpl_status add_item(machine *m, kpl__pk_value *c, kpl__pk_value *item)
{
    kpl__pk_value **it = grow(c->items, &c->cap, c->n + 1, sizeof *it);
    if (!it) return no_memory(m);
    c->items = it;
    c->items[c->n++] = item;
    return KPL_OK;
}

static kpl_status push(machine *m, kpl__pk_value *v)
{
    kpl__pk_value **s = grow(m->stack, &m->stack_cap, m->sp + 1, sizeof *s);
    if (!s) return no_memory(m);
    m->stack = s;
    m->stack[m->sp++] = v;
    return KPL_OK;
}

/* The lowest stack height a pop may reach: the innermost MARK's. */
static int64_t floor_of(const machine *m)
{
    return m->nmarks ? m->marks[m->nmarks - 1] : 0;
}

static kpl_status pop(machine *m, kpl__pk_value **v)
{
    if (m->sp <= floor_of(m)) return bad(m, "%s finds no value on the stack (underflow)",
                                         opcode_names[m->b[m->op]]);
    *v = m->stack[--m->sp];
    return KPL_OK;
}

static kpl_status peek(machine *m, kpl__pk_value **v)
{
    if (m->sp <= floor_of(m)) return bad(m, "%s finds no value on the stack (underflow)",
                                         opcode_names[m->b[m->op]]);
    *v = m->stack[m->sp - 1];
    return KPL_OK;
}

/* Closes the innermost MARK: the values above it are stack[*first, sp). */
static kpl_status pop_mark(machine *m, int64_t *first)
{
    if (!m->nmarks) return bad(m, "%s without a MARK", opcode_names[m->b[m->op]]);
    *first = m->marks[--m->nmarks];
    return KPL_OK;
}

/* n bytes of argument, or an error when the file ends first. */
static kpl_status take(machine *m, size_t n, const uint8_t **p)
{
    if (n > m->len - m->at)
        return bad(m, "%s needs %zu bytes, the file has %zu left (cut short?)",
                   opcode_names[m->b[m->op]], n, m->len - m->at);
    *p = m->b + m->at;
    m->at += n;
    return KPL_OK;
}

static uint32_t le32(const uint8_t *p)
{
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

/* Whether s[n] is UTF-8 as Python's pickle writes it (surrogates pass). */
static bool utf8_ok(const uint8_t *s, size_t n)
{
    for (size_t i = 0; i < n;) {
        uint8_t c = s[i];
        int k = c < 0x80 ? 0 : (c & 0xe0) == 0xc0 ? 1 : (c & 0xf0) == 0xe0 ? 2
                : (c & 0xf8) == 0xf0 ? 3 : -1;
        if (k < 0 || (size_t)k >= n - i) return false;
        uint32_t cp = k == 0 ? c : k == 1 ? c & 0x1fu : k == 2 ? c & 0x0fu : c & 0x07u;
        for (int j = 1; j <= k; j++) {
            if ((s[i + j] & 0xc0) != 0x80) return false;
            cp = cp << 6 | (s[i + j] & 0x3fu);
        }
        static const uint32_t least[4] = {0, 0x80, 0x800, 0x10000};
        if (cp < least[k] || cp > 0x10ffff) return false; /* overlong, or past Unicode */
        i += (size_t)k + 1;
    }
    return true;
}

bool kpl__pk_is_text(const kpl__pk_value *v, const char *s)
{
    size_t n = strlen(s);
    return v && (v->kind == KPL__PK_BYTES || v->kind == KPL__PK_STR) && v->len == n &&
           !memcmp(v->bytes, s, n);
}

const kpl__pk_value *kpl__pk_dict_get(const kpl__pk_value *d, const char *key)
{
    const kpl__pk_value *found = NULL;
    if (d && d->kind == KPL__PK_DICT)
        for (int64_t i = 0; i + 1 < d->n; i += 2)
            if (kpl__pk_is_text(d->items[i], key)) found = d->items[i + 1];
    return found;
}

static bool is_int(const kpl__pk_value *v, int64_t want)
{
    return v && (v->kind == KPL__PK_INT || v->kind == KPL__PK_BOOL) && v->num == want;
}

static bool is_flag(const kpl__pk_value *v)
{
    return v && (v->kind == KPL__PK_INT || v->kind == KPL__PK_BOOL) && (v->num == 0 || v->num == 1);
}

/* ---- the opcodes that make values from their arguments ---- */

static kpl_status op_const(machine *m, kpl__pk_kind kind, int64_t num);

/* GLOBAL "module\nname\n": one of known_globals, else refused. */
static kpl_status op_global(machine *m)
{
    char part[2][128];
    for (int k = 0; k < 2; k++) {
        const uint8_t *s = m->b + m->at;
        size_t left = m->len - m->at, n = 0;
        while (n < left && n < sizeof part[k] && s[n] != '\n') n++;
        if (n == left) return bad(m, "GLOBAL's %s ends with the file", k ? "name" : "module");
        if (n == sizeof part[k]) return bad(m, "GLOBAL's %s is longer than %zu bytes",
                                            k ? "name" : "module", sizeof part[k] - 1);
        for (size_t i = 0; i < n; i++) part[k][i] = s[i] >= 0x20 && s[i] < 0x7f ? (char)s[i] : '?';
        part[k][n] = 0;
        m->at += n + 1;
    }
    for (size_t i = 0; i < sizeof known_globals / sizeof *known_globals; i++)
        if (!strcmp(part[0], known_globals[i].module) && !strcmp(part[1], known_globals[i].name) &&
            (!known_globals[i].torch || m->torch)) {
            kpl__pk_value *v = NULL;
            KPL_TRY(new_value(m, KPL__PK_GLOBAL, &v));
            v->num = known_globals[i].which;
            v->dtype = known_globals[i].dtype;
            return push(m, v);
        }
    if (m->torch) { /* a class of the file's other contents: an object never called */
        if (!strcmp(part[0], "torch") && strstr(part[1], "Storage"))
            return bad(m, "GLOBAL torch.%s: a storage of a dtype kpl does not hold (kpl reads "
                       "float, half, bfloat16, double, long, int, byte and bool tensors)",
                       part[1]);
        return op_const(m, KPL__PK_OBJECT, 0);
    }
    return bad(m, "GLOBAL %s.%s: kpl reads only numpy uint8 arrays, lists, dicts, ints and "
               "strings from a pickle, and never runs code from one", part[0], part[1]);
}

/* _codecs.encode(text, 'latin1'): Python 3's way of writing bytes at
 * protocol 2 — each byte as the code point of the same value. */
static kpl_status make_latin1(machine *m, const kpl__pk_value *text, kpl__pk_value *out)
{
    if (text->len > m->len - m->decoded)
        return bad(m, "_codecs.encode makes more bytes than the file holds (the same text "
                   "encoded again and again)");
    m->decoded += text->len;
    uint8_t *b = malloc(text->len ? text->len : 1);
    if (!b) return no_memory(m);
    size_t n = 0;
    for (size_t i = 0; i < text->len; i++) {
        uint8_t c = text->bytes[i];
        if (c < 0x80) {
            b[n++] = c;
        } else if ((c == 0xc2 || c == 0xc3) && i + 1 < text->len) {
            b[n++] = (uint8_t)((c & 0x03) << 6 | (text->bytes[++i] & 0x3f));
        } else {
            free(b);
            return bad(m, "_codecs.encode of text with a character past U+00FF (at its byte %zu)"
                       ": not latin-1 bytes", i);
        }
    }
    out->kind = KPL__PK_BYTES;
    out->owned = b;
    out->bytes = b;
    out->len = n;
    return KPL_OK;
}

/* A tuple of n counts (ints >= 0, n <= 8) into out. */
static bool counts(const kpl__pk_value *t, int64_t *out, int64_t *n)
{
    if (t->kind != KPL__PK_TUPLE || t->n > 8) return false;
    for (int64_t i = 0; i < t->n; i++) {
        if (t->items[i]->kind != KPL__PK_INT || t->items[i]->num < 0) return false;
        out[i] = t->items[i]->num;
    }
    *n = t->n;
    return true;
}

/* torch._utils._rebuild_tensor_v2(storage, offset, size, stride,
 * requires_grad, backward_hooks[, metadata]): a view of the storage. */
static kpl_status make_tensor(machine *m, const kpl__pk_value *args, kpl__pk_value *v)
{
    kpl__pk_value **a = args->items;
    int64_t nd = 0, ns = 0;
    if (args->n < 6 || args->n > 7 || a[0]->kind != KPL__PK_STORAGE || a[1]->kind != KPL__PK_INT ||
        a[1]->num < 0 || !counts(a[2], v->shape, &nd) || !counts(a[3], v->stride, &ns) ||
        nd != ns || !is_flag(a[4]))
        return bad(m, "_rebuild_tensor_v2 with arguments other than (storage, offset, size, "
                   "stride, requires_grad, hooks) of up to 8 dimensions");
    v->kind = KPL__PK_TENSOR;
    v->num = a[1]->num;
    v->ndim = (int)nd;
    return add_item(m, v, a[0]);
}

/* BINPERSID: torch's ('storage', StorageType, key, location, numel). */
static kpl_status op_persid(machine *m)
{
    kpl__pk_value *pid = NULL, *v = NULL;
    KPL_TRY(pop(m, &pid));
    kpl__pk_value **a = pid->items;
    if (pid->kind != KPL__PK_TUPLE || pid->n != 5 || !kpl__pk_is_text(a[0], "storage") ||
        a[1]->kind != KPL__PK_GLOBAL || a[1]->num != G_STORAGE || a[2]->kind != KPL__PK_STR ||
        a[2]->len == 0 || a[2]->len > 64 || a[3]->kind != KPL__PK_STR || a[4]->kind != KPL__PK_INT ||
        a[4]->num < 0)
        return bad(m, "a persistent id other than torch's ('storage', StorageType, key, "
                   "location, numel)");
    for (size_t i = 0; i < a[2]->len; i++) {
        uint8_t c = a[2]->bytes[i];
        if (!((c >= '0' && c <= '9') || (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') ||
              c == '_'))
            return bad(m, "a storage key that is not a plain name");
    }
    KPL_TRY(new_value(m, KPL__PK_STORAGE, &v));
    v->dtype = a[1]->dtype;
    v->bytes = a[2]->bytes;
    v->len = a[2]->len;
    v->num = a[4]->num;
    return push(m, v);
}

/* LONG1: an int of n little-endian two's-complement bytes (n <= 8). */
static kpl_status op_long1(machine *m)
{
    const uint8_t *p = NULL;
    KPL_TRY(take(m, 1, &p));
    size_t n = p[0];
    if (n > 8) return bad(m, "LONG1 of %zu bytes (kpl reads ints of up to 64 bits)", n);
    KPL_TRY(take(m, n, &p));
    uint64_t u = 0;
    for (size_t i = 0; i < n; i++) u |= (uint64_t)p[i] << (8 * i);
    if (n && n < 8 && (p[n - 1] & 0x80)) u |= ~(uint64_t)0 << (8 * n); /* negative */
    kpl__pk_value *v = NULL;
    KPL_TRY(new_value(m, KPL__PK_INT, &v));
    v->num = (int64_t)u;
    return push(m, v);
}

/* BINFLOAT: a big-endian IEEE double. */
static kpl_status op_binfloat(machine *m)
{
    const uint8_t *p = NULL;
    KPL_TRY(take(m, 8, &p));
    uint64_t u = 0;
    for (int i = 0; i < 8; i++) u = u << 8 | p[i];
    kpl__pk_value *v = NULL;
    KPL_TRY(new_value(m, KPL__PK_FLOAT, &v));
    memcpy(&v->real, &u, sizeof v->real);
    return push(m, v);
}

/* NEWOBJ: cls.__new__(cls, *args), for a class never called: an object. */
static kpl_status op_newobj(machine *m)
{
    kpl__pk_value *args = NULL, *cls = NULL;
    KPL_TRY(pop(m, &args));
    KPL_TRY(pop(m, &cls));
    if (cls->kind != KPL__PK_OBJECT || args->kind != KPL__PK_TUPLE)
        return bad(m, "NEWOBJ of a %s", kpl__pk_kind_name(cls->kind));
    return op_const(m, KPL__PK_OBJECT, 0);
}

/* REDUCE: callable(*args), for the callables known_globals lists. */
static kpl_status op_reduce(machine *m)
{
    kpl__pk_value *args = NULL, *f = NULL, *v = NULL;
    KPL_TRY(pop(m, &args));
    KPL_TRY(pop(m, &f));
    if (m->torch && f->kind == KPL__PK_OBJECT) return op_const(m, KPL__PK_OBJECT, 0);
    if (f->kind != KPL__PK_GLOBAL) return bad(m, "REDUCE calls a %s", kpl__pk_kind_name(f->kind));
    if (args->kind != KPL__PK_TUPLE)
        return bad(m, "REDUCE's arguments are a %s, not a tuple", kpl__pk_kind_name(args->kind));
    kpl__pk_value **a = args->items;
    KPL_TRY(new_value(m, KPL__PK_NONE, &v));
    switch (f->num) {
    case G_RECONSTRUCT: /* _reconstruct(ndarray, (0,), b'b'): an empty array to BUILD */
        if (args->n != 3 || a[0]->kind != KPL__PK_GLOBAL || a[0]->num != G_NDARRAY ||
            a[1]->kind != KPL__PK_TUPLE || a[1]->n != 1 || !is_int(a[1]->items[0], 0) ||
            !kpl__pk_is_text(a[2], "b"))
            return bad(m, "numpy's _reconstruct with arguments other than (ndarray, (0,), b'b')");
        v->kind = KPL__PK_ARRAY;
        break;
    case G_DTYPE: /* dtype('u1', False, True) */
        if (args->n != 3 || !is_flag(a[1]) || !is_flag(a[2]) ||
            (a[0]->kind != KPL__PK_BYTES && a[0]->kind != KPL__PK_STR))
            return bad(m, "numpy.dtype with arguments other than (name, align, copy)");
        if (!kpl__pk_is_text(a[0], "u1"))
            return bad(m, "numpy.dtype '%.*s': kpl reads only uint8 ('u1') arrays",
                       (int)(a[0]->len < 16 ? a[0]->len : 16), (const char *)a[0]->bytes);
        v->kind = KPL__PK_DTYPE;
        break;
    case G_ENCODE:
        if (args->n != 2 || a[0]->kind != KPL__PK_STR ||
            !(kpl__pk_is_text(a[1], "latin1") || kpl__pk_is_text(a[1], "latin-1")))
            return bad(m, "_codecs.encode with arguments other than (str, 'latin1')");
        KPL_TRY(make_latin1(m, a[0], v));
        break;
    case G_BYTES:
        if (args->n != 0) return bad(m, "bytes() with arguments");
        v->kind = KPL__PK_BYTES;
        v->bytes = (const uint8_t *)"";
        break;
    case G_ODICT: /* OrderedDict() (its items come by SETITEMS) */
        if (args->n != 0) return bad(m, "OrderedDict with arguments");
        v->kind = KPL__PK_DICT;
        break;
    case G_TENSOR:
        KPL_TRY(make_tensor(m, args, v));
        break;
    case G_PARAM: /* _rebuild_parameter(tensor, requires_grad, hooks): the tensor */
        if (args->n < 2 || a[0]->kind != KPL__PK_TENSOR || !is_flag(a[1]))
            return bad(m, "_rebuild_parameter with arguments other than (tensor, requires_grad, "
                       "hooks)");
        return push(m, a[0]);
    default:
        return bad(m, "REDUCE calls numpy.ndarray itself");
    }
    return push(m, v);
}

/* BUILD of a dtype: numpy's state (3, '|', None, None, None, -1, -1, 0). */
static kpl_status build_dtype(machine *m, kpl__pk_value *d, const kpl__pk_value *s)
{
    kpl__pk_value **a = s->items;
    bool ok = s->kind == KPL__PK_TUPLE && s->n == 8 && is_int(a[0], 3) &&
              (kpl__pk_is_text(a[1], "|") || kpl__pk_is_text(a[1], "<") ||
               kpl__pk_is_text(a[1], ">") || kpl__pk_is_text(a[1], "=")) &&
              a[2]->kind == KPL__PK_NONE && a[3]->kind == KPL__PK_NONE &&
              a[4]->kind == KPL__PK_NONE && is_int(a[5], -1) && is_int(a[6], -1) &&
              a[7]->kind == KPL__PK_INT;
    if (!ok) return bad(m, "a uint8 dtype's state is not (3, '|', None, None, None, -1, -1, flags)");
    d->built = true;
    return KPL_OK;
}

/* BUILD of an array: numpy's state (1, shape, dtype, is_fortran, data). */
static kpl_status build_array(machine *m, kpl__pk_value *x, const kpl__pk_value *s)
{
    kpl__pk_value **a = s->items;
    if (s->kind != KPL__PK_TUPLE || s->n != 5 || !is_int(a[0], 1) || a[1]->kind != KPL__PK_TUPLE ||
        a[2]->kind != KPL__PK_DTYPE || !a[2]->built || !is_flag(a[3]) ||
        a[4]->kind != KPL__PK_BYTES)
        return bad(m, "an array's state is not (1, shape, uint8 dtype, is_fortran, bytes)");
    const kpl__pk_value *shape = a[1];
    if (shape->n < 1 || shape->n > 4)
        return bad(m, "an array of %lld dimensions (kpl reads 1 to 4)", (long long)shape->n);
    uint64_t count = 1;
    for (int64_t i = 0; i < shape->n; i++) {
        const kpl__pk_value *e = shape->items[i];
        if (e->kind != KPL__PK_INT || e->num < 0)
            return bad(m, "an array's extent %lld is not a count", (long long)i);
        if (__builtin_mul_overflow(count, (uint64_t)e->num, &count))
            return bad(m, "an array's shape overflows 64 bits");
        x->shape[i] = e->num;
    }
    x->ndim = (int)shape->n;
    if (a[3]->num && x->ndim > 1)
        return bad(m, "a Fortran-ordered array (kpl reads C order, as numpy writes by default)");
    if (count != a[4]->len)
        return bad(m, "an array of %llu elements holds %zu bytes of data",
                   (unsigned long long)count, a[4]->len);
    x->bytes = a[4]->bytes;
    x->len = a[4]->len;
    x->built = true;
    return KPL_OK;
}

static kpl_status op_build(machine *m)
{
    kpl__pk_value *state = NULL, *x = NULL;
    KPL_TRY(pop(m, &state));
    KPL_TRY(peek(m, &x));
    if ((x->kind == KPL__PK_ARRAY || x->kind == KPL__PK_DTYPE) && x->built)
        return bad(m, "BUILD of a %s built already", kpl__pk_kind_name(x->kind));
    if (x->kind == KPL__PK_DTYPE) return build_dtype(m, x, state);
    if (x->kind == KPL__PK_ARRAY) return build_array(m, x, state);
    /* torch: an OrderedDict's attributes (a state dict's _metadata), an
     * object's state: read, not kept */
    if (m->torch && (x->kind == KPL__PK_DICT || x->kind == KPL__PK_OBJECT)) return KPL_OK;
    return bad(m, "BUILD of a %s: only numpy arrays and dtypes are built",
               kpl__pk_kind_name(x->kind));
}

/* ---- the machine ---- */

static kpl_status memo_index(machine *m, size_t width, int64_t *idx)
{
    const uint8_t *p = NULL;
    KPL_TRY(take(m, width, &p));
    *idx = width == 1 ? p[0] : (int64_t)le32(p);
    int64_t most = (int64_t)(m->len / 2) < MEMO_MAX - 1 ? (int64_t)(m->len / 2) : MEMO_MAX - 1;
    if (*idx > most)
        return bad(m, "memo index %lld (kpl allows up to %lld in a file of %zu bytes)",
                   (long long)*idx, (long long)most, m->len);
    return KPL_OK;
}

static kpl_status op_put(machine *m, size_t width)
{
    int64_t idx = 0, old = m->memo_cap;
    kpl__pk_value *v = NULL;
    KPL_TRY(memo_index(m, width, &idx));
    KPL_TRY(peek(m, &v));
    kpl__pk_value **memo = grow(m->memo, &m->memo_cap, idx + 1, sizeof *memo);
    if (!memo) return no_memory(m);
    m->memo = memo;
    if (m->memo_cap > old) memset(m->memo + old, 0, (size_t)(m->memo_cap - old) * sizeof *memo);
    m->memo[idx] = v;
    return KPL_OK;
}

static kpl_status op_get(machine *m, size_t width)
{
    int64_t idx = 0;
    KPL_TRY(memo_index(m, width, &idx));
    if (idx >= m->memo_cap || !m->memo[idx]) return bad(m, "memo %lld was never stored",
                                                        (long long)idx);
    return push(m, m->memo[idx]);
}

/* A str or bytes of n bytes from the input. */
static kpl_status op_text(machine *m, kpl__pk_kind kind, size_t n)
{
    const uint8_t *s = NULL;
    kpl__pk_value *v = NULL;
    KPL_TRY(take(m, n, &s));
    if (kind == KPL__PK_STR && !utf8_ok(s, n)) return bad(m, "BINUNICODE that is not UTF-8");
    KPL_TRY(new_value(m, kind, &v));
    v->bytes = s;
    v->len = n;
    return push(m, v);
}

static kpl_status op_int(machine *m, size_t width)
{
    const uint8_t *p = NULL;
    kpl__pk_value *v = NULL;
    KPL_TRY(take(m, width, &p));
    KPL_TRY(new_value(m, KPL__PK_INT, &v));
    v->num = width == 1 ? p[0] : width == 2 ? (int64_t)(p[0] | p[1] << 8) : (int32_t)le32(p);
    return push(m, v);
}

/* TUPLE1..3 (n of them) or TUPLE (n < 0: down to the MARK). */
static kpl_status op_tuple(machine *m, int64_t n)
{
    int64_t first = m->sp - n;
    if (n < 0) KPL_TRY(pop_mark(m, &first));
    else if (first < floor_of(m)) return bad(m, "%s finds %lld values on the stack",
                                             opcode_names[m->b[m->op]],
                                             (long long)(m->sp - floor_of(m)));
    kpl__pk_value *t = NULL;
    KPL_TRY(new_value(m, KPL__PK_TUPLE, &t));
    for (int64_t i = first; i < m->sp; i++) KPL_TRY(add_item(m, t, m->stack[i]));
    m->sp = first;
    return push(m, t);
}

/* APPEND(S) and SETITEM(S): the values above the MARK (or the last one or
 * two) go into the list or dict below them. */
static kpl_status op_fill(machine *m, kpl__pk_kind want, bool marked)
{
    int64_t per = want == KPL__PK_DICT ? 2 : 1, first = m->sp - per;
    if (marked) KPL_TRY(pop_mark(m, &first));
    if (first - 1 < floor_of(m))
        return bad(m, "%s finds no %s below its values", opcode_names[m->b[m->op]],
                   kpl__pk_kind_name(want));
    kpl__pk_value *c = m->stack[first - 1];
    if (c->kind != want)
        return bad(m, "%s into a %s", opcode_names[m->b[m->op]], kpl__pk_kind_name(c->kind));
    if ((m->sp - first) % per)
        return bad(m, "SETITEMS with a key but no value");
    for (int64_t i = first; i < m->sp; i++) KPL_TRY(add_item(m, c, m->stack[i]));
    m->sp = first;
    return KPL_OK;
}

static kpl_status op_const(machine *m, kpl__pk_kind kind, int64_t num)
{
    kpl__pk_value *v = NULL;
    KPL_TRY(new_value(m, kind, &v));
    v->num = num;
    return push(m, v);
}

/* Runs the opcode at m->at; *stop once STOP has run. */
static kpl_status run_op(machine *m, bool *stop)
{
    m->op = m->at;
    uint8_t c = m->b[m->at++];
    const uint8_t *p = NULL;
    switch (c) {
    case 0x80: /* PROTO */
        KPL_TRY(take(m, 1, &p));
        if (m->op != 0) return bad(m, "PROTO after the start");
        if (p[0] != 2)
            return bad(m, "pickle protocol %d: kpl reads protocol 2, %s", p[0],
                       m->torch ? "torch.save's default (save again without pickle_protocol)"
                                : "the CIFAR files' own");
        return KPL_OK;
    case '.': { /* STOP */
        KPL_TRY(pop(m, &m->p->root));
        if (m->nmarks || m->sp) return bad(m, "STOP with %lld values and %lld MARKs left over",
                                           (long long)m->sp, (long long)m->nmarks);
        if (m->at != m->len) return bad(m, "%zu bytes after STOP", m->len - m->at);
        *stop = true;
        return KPL_OK;
    }
    case '(': { /* MARK */
        int64_t *mk = grow(m->marks, &m->marks_cap, m->nmarks + 1, sizeof *mk);
        if (!mk) return no_memory(m);
        m->marks = mk;
        m->marks[m->nmarks++] = m->sp;
        return KPL_OK;
    }
    case '}': return op_const(m, KPL__PK_DICT, 0);
    case ']': return op_const(m, KPL__PK_LIST, 0);
    case ')': return op_const(m, KPL__PK_TUPLE, 0);
    case 'N': return op_const(m, KPL__PK_NONE, 0);
    case 0x88: return op_const(m, KPL__PK_BOOL, 1);  /* NEWTRUE */
    case 0x89: return op_const(m, KPL__PK_BOOL, 0);  /* NEWFALSE */
    case 'K': return op_int(m, 1);                   /* BININT1 */
    case 'M': return op_int(m, 2);                   /* BININT2 */
    case 'J': return op_int(m, 4);                   /* BININT */
    case 't': return op_tuple(m, -1);
    case 0x85: return op_tuple(m, 1);
    case 0x86: return op_tuple(m, 2);
    case 0x87: return op_tuple(m, 3);
    case 'a': return op_fill(m, KPL__PK_LIST, false);  /* APPEND */
    case 'e': return op_fill(m, KPL__PK_LIST, true);   /* APPENDS */
    case 's': return op_fill(m, KPL__PK_DICT, false);  /* SETITEM */
    case 'u': return op_fill(m, KPL__PK_DICT, true);   /* SETITEMS */
    case 'q': return op_put(m, 1);                     /* BINPUT */
    case 'r': return op_put(m, 4);                     /* LONG_BINPUT */
    case 'h': return op_get(m, 1);                     /* BINGET */
    case 'j': return op_get(m, 4);                     /* LONG_BINGET */
    case 'U': /* SHORT_BINSTRING: Python 2's str */
        KPL_TRY(take(m, 1, &p));
        return op_text(m, KPL__PK_BYTES, p[0]);
    case 'T': { /* BINSTRING */
        KPL_TRY(take(m, 4, &p));
        int32_t n = (int32_t)le32(p);
        if (n < 0) return bad(m, "BINSTRING of negative length %d", n);
        return op_text(m, KPL__PK_BYTES, (size_t)n);
    }
    case 'X': /* BINUNICODE */
        KPL_TRY(take(m, 4, &p));
        return op_text(m, KPL__PK_STR, le32(p));
    case 'c': return op_global(m);
    case 'R': return op_reduce(m);
    case 'b': return op_build(m);
    case 'Q':
        if (m->torch) return op_persid(m);
        break;
    case 0x8a:
        if (m->torch) return op_long1(m);
        break;
    case 'G':
        if (m->torch) return op_binfloat(m);
        break;
    case 0x81:
        if (m->torch) return op_newobj(m);
        break;
    default: break;
    }
    {
        return bad(m, "opcode 0x%02x (%s) is not one kpl reads (only what protocol 2 pickles "
                   "of %s use)", c, opcode_names[c] ? opcode_names[c] : "not a pickle opcode",
                   m->torch ? "torch.save's state dicts"
                            : "CIFAR's dicts, lists, ints, strings and numpy uint8 arrays");
    }
}

void kpl__pickle_free(kpl__pickle *p)
{
    if (!p) return;
    for (int64_t i = 0; i < p->nall; i++) {
        free(p->all[i]->items);
        free(p->all[i]->owned);
        free(p->all[i]);
    }
    free(p->all);
    free(p);
}

const kpl__pk_value *kpl__pickle_root(const kpl__pickle *p)
{
    return p->root;
}

static kpl_status load(const uint8_t *buf, size_t len, const char *name, bool torch,
                       kpl__pickle **out)
{
    *out = NULL;
    machine m = {.b = buf, .len = len, .name = name, .torch = torch};
    if (len < 2 || buf[0] != 0x80)
        return KPL_ERROR(KPL_EFORMAT, "%s: not a protocol 2 pickle (it starts with %s)", name,
                         len ? (buf[0] == 0x80 ? "a PROTO cut short" : "no PROTO opcode")
                             : "nothing: the file is empty");
    m.p = calloc(1, sizeof *m.p);
    if (!m.p) return no_memory(&m);
    kpl_status st = KPL_OK;
    bool stop = false;
    while (st >= 0 && !stop) {
        if (m.at == m.len) {
            m.op = m.len;
            st = bad(&m, "the file ends before STOP (cut short?)");
            break;
        }
        st = run_op(&m, &stop);
    }
    free(m.stack);
    free(m.marks);
    free(m.memo);
    if (st < 0) {
        kpl__pickle_free(m.p);
        return st;
    }
    *out = m.p;
    return KPL_OK;
}

kpl_status kpl__pickle_load(const uint8_t *buf, size_t len, const char *name, kpl__pickle **out)
{
    return load(buf, len, name, false, out);
}

kpl_status kpl__pickle_load_torch(const uint8_t *buf, size_t len, const char *name,
                                  kpl__pickle **out)
{
    return load(buf, len, name, true, out);
}
