/*
 * fuzz_record_parse.c — kpl__record_parse (dataio/record_read.c), the split
 * of one record body into its features that the loader's workers run on
 * every record they transform.
 *
 * Input: byte 0 gives the number of features (1 + low 3 bits); the next
 * ceil(nf / 4) bytes give their types, two bits each (bytes, int64, float,
 * string); the rest is the body.  The body is copied to a buffer of exactly
 * its size, so a view that runs past it is caught.
 */
#include "fuzz_common.h"

#include "dataio_impl.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 1) return 0;
    fuzz_reset();
    int nf = 1 + (data[0] & 7);
    size_t tb = (size_t)(nf + 3) / 4;
    if (size < 1 + tb) return 0;
    kpl_feature_spec schema[8];
    memset(schema, 0, sizeof schema);
    for (int f = 0; f < nf; f++) {
        snprintf(schema[f].name, sizeof schema[f].name, "f%d", f);
        schema[f].type = (kpl_feature_type)((data[1 + f / 4] >> (2 * (f % 4))) & 3);
    }
    size_t n = size - 1 - tb;
    if (n > UINT32_MAX) return 0;
    uint8_t *body = malloc(n ? n : 1);
    if (!body) abort();
    memcpy(body, data + 1 + tb, n);
    kpl_feature_value v[8];
    if (fuzz_st(kpl__record_parse(nf, schema, body, (uint32_t)n, v, "fuzz"), "parse") == KPL_OK) {
        size_t total = 0;
        for (int f = 0; f < nf; f++) {
            size_t bytes = (size_t)v[f].count * kpl__feature_elem_size(schema[f].type);
            fuzz_touch(v[f].data, bytes);
            total += 4 + bytes;
        }
        if (total != n) abort(); /* the counts must fill the body exactly */
    }
    /* The checking-only form (values NULL) must agree. */
    kpl_status a = kpl__record_parse(nf, schema, body, (uint32_t)n, NULL, "fuzz");
    kpl_status b = kpl__record_parse(nf, schema, body, (uint32_t)n, v, "fuzz");
    if (a != b) abort();
    free(body);
    return 0;
}
