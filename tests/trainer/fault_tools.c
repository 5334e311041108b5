/* fault_tools — makes the broken things faults_e2e.sh feeds to kpl:
 *
 *   fault_tools baddata OUT N BAD_EVERY
 *       a KPLRecord dataset of N 28x28 gray JPEGs (label i % 10, a
 *       class-dependent pattern) whose every BAD_EVERY-th image is cut in
 *       half (a truncated JPEG: its header parses, its data does not
 *       decode), with a `path` feature "class/img_I.jpg" as image-folder
 *       conversions have; BAD_EVERY 0: none bad
 *   fault_tools poison CKPT OUT
 *       CKPT with every model weight set to NaN, saved as OUT
 *   fault_tools meta CKPT OUT SECTION.KEY JSON
 *       CKPT with one key of its metadata set to a JSON value
 *       (train.step -5, say), saved as OUT
 *   fault_tools meta-get CKPT SECTION.KEY
 *       prints that key of CKPT's metadata (JSON)
 */
#include "dataio.h"
#include "trainer.h"

#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <turbojpeg.h>

static int fail(const char *what)
{
    fprintf(stderr, "fault_tools %s: %s\n", what, kpl_last_error());
    return 1;
}

static int baddata(const char *out, int n, int bad_every)
{
    kpl_feature_spec schema[3] = {
        {.name = "image", .type = KPL_FEATURE_BYTES, .encoding = "jpeg"},
        {.name = "label", .type = KPL_FEATURE_INT64},
        {.name = "path", .type = KPL_FEATURE_STRING},
    };
    kpl_record_writer_config cfg = KPL_RECORD_WRITER_CONFIG_INIT;
    cfg.chunk_bytes = 16 << 10;
    kpl_record_writer *w = NULL;
    if (kpl_record_writer_create(out, 3, schema, &cfg, &w) < 0) return fail("baddata");
    tjhandle tj = tjInitCompress();
    unsigned char px[28 * 28];
    for (int i = 0; i < n; i++) {
        int64_t label = i % 10;
        for (int y = 0; y < 28; y++)
            for (int x = 0; x < 28; x++)
                px[y * 28 + x] = (unsigned char)((x * (label + 1) + y * 7 + i) % 256);
        unsigned char *jpg = NULL;
        unsigned long len = 0;
        if (tjCompress2(tj, px, 28, 0, 28, TJPF_GRAY, &jpg, &len, TJSAMP_GRAY, 90, 0) != 0) {
            fprintf(stderr, "fault_tools baddata: %s\n", tjGetErrorStr2(tj));
            return 1;
        }
        if (bad_every > 0 && i % bad_every == bad_every - 1) len /= 2;
        char path[64];
        snprintf(path, sizeof path, "%lld/img_%d.jpg", (long long)label, i);
        kpl_feature_value v[3] = {{jpg, (uint32_t)len}, {&label, 1},
                                  {path, (uint32_t)strlen(path)}};
        kpl_status st = kpl_record_writer_add(w, v);
        tjFree(jpg);
        if (st < 0) return fail("baddata");
    }
    tjDestroy(tj);
    if (kpl_record_writer_close(w) < 0) return fail("baddata");
    return 0;
}

static int poison(const char *in, const char *out)
{
    kpl_checkpoint *c = NULL;
    if (kpl_checkpoint_load(in, &c) < 0) return fail("poison");
    int hit = 0;
    for (int i = 0; i < kpl_checkpoint_num_tensors(c); i++) {
        const char *name = kpl_checkpoint_name(c, i);
        size_t l = strlen(name);
        if (strncmp(name, "model.", 6) || l < 7 || strcmp(name + l - 7, ".weight")) continue;
        if (kpl_k_fill(kpl_checkpoint_find(c, name), NAN) < 0) return fail("poison");
        hit++;
    }
    if (!hit) {
        fprintf(stderr, "fault_tools poison: %s has no model.*.weight\n", in);
        return 1;
    }
    if (kpl_checkpoint_save(c, out) < 0) return fail("poison");
    kpl_checkpoint_destroy(c);
    return 0;
}

static int set_meta(const char *in, const char *out, const char *key, const char *value)
{
    kpl_checkpoint *c = NULL;
    if (kpl_checkpoint_load(in, &c) < 0) return fail("meta");
    json_t *m = json_loads(kpl_checkpoint_meta(c), 0, NULL);
    json_t *v = json_loads(value, JSON_DECODE_ANY, NULL);
    const char *dot = strchr(key, '.');
    char section[64];
    snprintf(section, sizeof section, "%.*s", dot ? (int)(dot - key) : 0, key);
    json_t *where = dot ? json_object_get(m, section) : m;
    if (!m || !v || !where || json_object_set_new(where, dot ? dot + 1 : key, v) != 0) {
        fprintf(stderr, "fault_tools meta: cannot set %s to %s\n", key, value);
        return 1;
    }
    char *text = json_dumps(m, JSON_COMPACT);
    json_decref(m);
    if (kpl_checkpoint_set_meta(c, text) < 0 || kpl_checkpoint_save(c, out) < 0) return fail("meta");
    free(text);
    kpl_checkpoint_destroy(c);
    return 0;
}

static int get_meta(const char *in, const char *key)
{
    kpl_checkpoint *c = NULL;
    if (kpl_checkpoint_load(in, &c) < 0) return fail("meta-get");
    json_t *m = json_loads(kpl_checkpoint_meta(c), 0, NULL);
    const char *dot = strchr(key, '.');
    char section[64];
    snprintf(section, sizeof section, "%.*s", dot ? (int)(dot - key) : 0, key);
    json_t *v = json_object_get(dot ? json_object_get(m, section) : m, dot ? dot + 1 : key);
    char *text = v ? json_dumps(v, JSON_ENCODE_ANY | JSON_COMPACT) : NULL;
    if (text) printf("%s\n", text);
    else fprintf(stderr, "fault_tools meta-get: %s: no %s\n", in, key);
    free(text);
    json_decref(m);
    kpl_checkpoint_destroy(c);
    return v ? 0 : 1;
}

int main(int argc, char **argv)
{
    if (argc == 4 && !strcmp(argv[1], "meta-get")) return get_meta(argv[2], argv[3]);
    if (argc == 5 && !strcmp(argv[1], "baddata"))
        return baddata(argv[2], atoi(argv[3]), atoi(argv[4]));
    if (argc == 4 && !strcmp(argv[1], "poison")) return poison(argv[2], argv[3]);
    if (argc == 6 && !strcmp(argv[1], "meta")) return set_meta(argv[2], argv[3], argv[4], argv[5]);
    fprintf(stderr, "usage: fault_tools baddata OUT N BAD_EVERY | poison CKPT OUT | "
                    "meta CKPT OUT SECTION.KEY JSON | meta-get CKPT SECTION.KEY\n");
    return 2;
}
