/* test_tboard.c — the TensorBoard event writer against bytes derived by hand
 * from event.proto and summary.proto, and written files read back by a
 * parser of this test's own (its own bitwise CRC32C too, so a shared bug
 * in kpl_crc32c could not hide).
 *
 * KPL_TB_KEEP=DIR keeps the files written under DIR, for reading them with
 * TensorBoard itself. */
#define _XOPEN_SOURCE 700
#include "kpl_test.h"
#include "run_impl.h"

#include <ftw.h>
#include <png.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

/* ---- an independent reader ---- */

/* Bit by bit, reflected Castagnoli polynomial. */
static uint32_t ref_crc32c(const uint8_t *p, size_t n)
{
    uint32_t c = 0xFFFFFFFFu;
    for (size_t i = 0; i < n; i++) {
        c ^= p[i];
        for (int k = 0; k < 8; k++) c = (c >> 1) ^ (0x82F63B78u & (0u - (c & 1)));
    }
    return ~c;
}

static uint32_t ref_mask(uint32_t c) { return ((c >> 15) | (c << 17)) + 0xa282ead8u; }

static uint64_t le(const uint8_t *p, int bytes)
{
    uint64_t v = 0;
    for (int i = 0; i < bytes; i++) v |= (uint64_t)p[i] << (8 * i);
    return v;
}

typedef struct {
    double wall_time;
    int64_t step;
    char file_version[32];
    int nvalues;
    char tag[KPL__TB_TAG_MAX + 1];
    float value;
    int64_t img_h, img_w, img_c; /* an image value */
    uint8_t *png;                /* its encoded bytes (malloc'd) */
    size_t png_len;
} parsed_event;

static uint64_t rd_varint(const uint8_t **p, const uint8_t *end)
{
    uint64_t v = 0;
    for (int shift = 0; shift < 70; shift += 7) {
        if (*p >= end) fail_msg("varint runs past the message");
        uint8_t b = *(*p)++;
        v |= (uint64_t)(b & 0x7F) << shift;
        if (!(b & 0x80)) return v;
    }
    fail_msg("varint longer than 10 bytes");
    return 0;
}

/* One field: its number, wire type, and where its payload is (varints and
 * fixed-size fields in *num, length-delimited ones in *data / *n). */
static int rd_field(const uint8_t **p, const uint8_t *end, uint64_t *num, const uint8_t **data,
                    size_t *n)
{
    uint64_t key = rd_varint(p, end);
    int wt = (int)(key & 7);
    size_t size = 0;
    *data = NULL;
    *n = 0;
    switch (wt) {
    case 0: *num = rd_varint(p, end); return (int)(key >> 3) * 8 + wt;
    case 1: size = 8; break;
    case 5: size = 4; break;
    case 2: size = (size_t)rd_varint(p, end); break;
    default: fail_msg("wire type %d unexpected", wt);
    }
    if ((size_t)(end - *p) < size) fail_msg("field runs past the message");
    if (wt == 2) {
        *data = *p;
        *n = size;
    } else {
        *num = le(*p, (int)size);
    }
    *p += size;
    return (int)(key >> 3) * 8 + wt;
}

#define FIELD(num, wt) ((num) * 8 + (wt))

static void parse_value(const uint8_t *p, const uint8_t *end, parsed_event *e)
{
    while (p < end) {
        uint64_t num = 0;
        const uint8_t *d;
        size_t n;
        switch (rd_field(&p, end, &num, &d, &n)) {
        case FIELD(1, 2):
            assert_true(n <= KPL__TB_TAG_MAX);
            memcpy(e->tag, d, n);
            e->tag[n] = 0;
            break;
        case FIELD(2, 5): {
            uint32_t bits = (uint32_t)num;
            memcpy(&e->value, &bits, 4);
            break;
        }
        case FIELD(4, 2): { /* Summary.Image */
            const uint8_t *s = d, *send = d + n;
            while (s < send) {
                const uint8_t *b;
                size_t bn;
                switch (rd_field(&s, send, &num, &b, &bn)) {
                case FIELD(1, 0): e->img_h = (int64_t)num; break;
                case FIELD(2, 0): e->img_w = (int64_t)num; break;
                case FIELD(3, 0): e->img_c = (int64_t)num; break;
                case FIELD(4, 2):
                    e->png = malloc(bn);
                    assert_non_null(e->png);
                    memcpy(e->png, b, bn);
                    e->png_len = bn;
                    break;
                default: fail_msg("unexpected field in Summary.Image");
                }
            }
            break;
        }
        default: fail_msg("unexpected field in Summary.Value");
        }
    }
}

static void parse_event(const uint8_t *p, const uint8_t *end, parsed_event *e)
{
    memset(e, 0, sizeof *e);
    while (p < end) {
        uint64_t num = 0;
        const uint8_t *d;
        size_t n;
        switch (rd_field(&p, end, &num, &d, &n)) {
        case FIELD(1, 1): memcpy(&e->wall_time, &num, 8); break;
        case FIELD(2, 0): e->step = (int64_t)num; break;
        case FIELD(3, 2):
            assert_true(n < sizeof e->file_version);
            memcpy(e->file_version, d, n);
            break;
        case FIELD(5, 2): {
            const uint8_t *s = d, *send = d + n;
            while (s < send) {
                const uint8_t *v;
                size_t vn;
                assert_int_equal(rd_field(&s, send, &num, &v, &vn), FIELD(1, 2));
                parse_value(v, v + vn, e);
                e->nvalues++;
            }
            break;
        }
        default: fail_msg("unexpected field in Event");
        }
    }
}

/* Every record of the file at `path`, CRCs checked; returns the count. */
static int read_events(const char *path, parsed_event *ev, int max)
{
    FILE *f = fopen(path, "rb");
    if (!f) fail_msg("cannot open %s", path);
    fseek(f, 0, SEEK_END);
    long size = ftell(f);
    fseek(f, 0, SEEK_SET);
    uint8_t *buf = malloc((size_t)size + 1);
    assert_non_null(buf);
    assert_int_equal(fread(buf, 1, (size_t)size, f), (size_t)size);
    fclose(f);
    int count = 0;
    const uint8_t *p = buf, *end = buf + size;
    while (p < end) {
        if (end - p < 12) fail_msg("%s: truncated record header", path);
        uint64_t n = le(p, 8);
        assert_int_equal(le(p + 8, 4), ref_mask(ref_crc32c(p, 8)));
        p += 12;
        if ((uint64_t)(end - p) < n + 4) fail_msg("%s: truncated record", path);
        assert_int_equal(le(p + n, 4), ref_mask(ref_crc32c(p, (size_t)n)));
        if (count >= max) fail_msg("%s: more than %d records", path, max);
        parse_event(p, p + n, &ev[count++]);
        p += n + 4;
    }
    free(buf);
    return count;
}

/* ---- fixtures ---- */

static int rm_entry(const char *path, const struct stat *sb, int flag, struct FTW *ftw)
{
    (void)sb, (void)flag, (void)ftw;
    return remove(path);
}

/* A fresh directory for one test: under $KPL_TB_KEEP (kept) or /tmp. */
static void make_root(char *root, size_t n, const char *name)
{
    const char *keep = getenv("KPL_TB_KEEP");
    if (keep && keep[0]) {
        snprintf(root, n, "%s/%s", keep, name);
        return;
    }
    snprintf(root, n, "/tmp/kpl_tboard_XXXXXX");
    if (!mkdtemp(root)) fail_msg("mkdtemp failed");
}

static void drop_root(const char *root)
{
    const char *keep = getenv("KPL_TB_KEEP");
    if (keep && keep[0]) return;
    nftw(root, rm_entry, 16, FTW_DEPTH | FTW_PHYS);
}

static long file_size(const char *path)
{
    struct stat sb;
    if (stat(path, &sb) != 0) fail_msg("cannot stat %s", path);
    return (long)sb.st_size;
}

/* ---- tests ---- */

/* Bytes derived by hand from the .proto files and the protobuf encoding. */
static void test_scalar_event_bytes(void **state)
{
    (void)state;
    uint8_t buf[KPL__TB_EVENT_MAX];
    size_t n = 0;

    /* wall_time 1.5, step 300 (a two-byte varint), "loss" = 0.5. */
    static const uint8_t want1[] = {
        0x09, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0xF8, 0x3F, /* 1: double 1.5 */
        0x10, 0xAC, 0x02,                                     /* 2: varint 300 */
        0x2A, 0x0D,                                           /* 5: Summary, 13 bytes */
        0x0A, 0x0B,                                           /*   1: Value, 11 bytes */
        0x0A, 0x04, 'l', 'o', 's', 's',                       /*     1: tag */
        0x15, 0x00, 0x00, 0x00, 0x3F,                         /*     2: float 0.5 */
    };
    OK(kpl__tb_encode_scalar(buf, "loss", 300, 0.5, 1.5, &n));
    assert_int_equal(n, sizeof want1);
    assert_memory_equal(buf, want1, sizeof want1);

    /* wall_time 2.0, step -1 (ten bytes of two's complement), -2.0. */
    static const uint8_t want2[] = {
        0x09, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x40,
        0x10, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0x01,
        0x2A, 0x13,
        0x0A, 0x11,
        0x0A, 0x0A, 't', 'r', 'a', 'i', 'n', '/', 'l', 'o', 's', 's',
        0x15, 0x00, 0x00, 0x00, 0xC0,
    };
    OK(kpl__tb_encode_scalar(buf, "train/loss", -1, -2.0, 2.0, &n));
    assert_int_equal(n, sizeof want2);
    assert_memory_equal(buf, want2, sizeof want2);

    /* A 200-byte tag: the Value's and the Summary's lengths take two bytes. */
    char tag[201];
    memset(tag, 'x', 200);
    tag[200] = 0;
    OK(kpl__tb_encode_scalar(buf, tag, 0, 1.0, 0.0, &n));
    assert_int_equal(n, 9 + 2 + 3 + 3 + 3 + 200 + 5);
    static const uint8_t head[] = {0x10, 0x00, 0x2A, 0xD3, 0x01, 0x0A, 0xD0, 0x01, 0x0A, 0xC8, 0x01};
    assert_memory_equal(buf + 9, head, sizeof head);
    assert_memory_equal(buf + n - 5, ((const uint8_t[]){0x15, 0x00, 0x00, 0x80, 0x3F}), 5);
}

static void test_tag_validation(void **state)
{
    (void)state;
    uint8_t buf[KPL__TB_EVENT_MAX];
    size_t n = 0;
    FAILS(kpl__tb_encode_scalar(buf, "", 0, 1, 0, &n), KPL_EINVAL, "empty");
    FAILS(kpl__tb_encode_scalar(buf, NULL, 0, 1, 0, &n), KPL_EINVAL, "NULL");
    char tag[KPL__TB_TAG_MAX + 2];
    memset(tag, 'a', sizeof tag - 1);
    tag[sizeof tag - 1] = 0;
    FAILS(kpl__tb_encode_scalar(buf, tag, 0, 1, 0, &n), KPL_EINVAL, "longer than 1024 bytes");
    tag[KPL__TB_TAG_MAX] = 0;
    OK(kpl__tb_encode_scalar(buf, tag, 0, 1, 0, &n));
    assert_true(n <= KPL__TB_EVENT_MAX);
    OK(kpl__tb_encode_scalar(buf, "loss/\xC3\xA9t\xC3\xA9 \xE2\x82\xAC \xF0\x9F\x94\xA5", 0, 1, 0, &n));
    static const char *bad[] = {"\xC0\x80", "a\xFF", "\xE2\x82", "\xED\xA0\x80", "\xF4\x90\x80\x80",
                                "\xE0\x80\xAF", "\x80"};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++)
        FAILS(kpl__tb_encode_scalar(buf, bad[i], 0, 1, 0, &n), KPL_EINVAL, "not UTF-8");
}

static void test_masked_crc(void **state)
{
    (void)state;
    /* CRC32C("123456789") = 0xE3069283 and of 32 zero bytes 0x8A9136AA
     * (RFC 3720, B.4); masked by hand. */
    assert_int_equal(ref_crc32c((const uint8_t *)"123456789", 9), 0xE3069283u);
    assert_int_equal(kpl__tb_masked_crc("123456789", 9), 0xC78AB0E5u);
    uint8_t zeros[32] = {0};
    assert_int_equal(ref_crc32c(zeros, 32), 0x8A9136AAu);
    assert_int_equal(kpl__tb_masked_crc(zeros, 32), 0x0FD7FFFAu);
}

static void test_write_and_read_back(void **state)
{
    (void)state;
    char root[512], dir[600];
    make_root(root, sizeof root, "scalars");
    snprintf(dir, sizeof dir, "%s/run/a//tb/", root); /* parents, a doubled and a trailing slash */

    char host[256] = "";
    gethostname(host, sizeof host - 1);
    long long before = (long long)time(NULL);
    kpl_tb_writer *tb = NULL;
    OK(kpl_tb_writer_create(dir, &tb));
    long long after = (long long)time(NULL);
    char path[1024]; /* the writer's copy goes with it at close */
    snprintf(path, sizeof path, "%s", kpl_tb_writer_path(tb));

    /* The name: events.out.tfevents.<10 digits>.<host>.<pid>. */
    const char *base = strrchr(path, '/') + 1;
    assert_int_equal(strncmp(path, dir, strlen(dir) - 1), 0);
    assert_int_equal(strncmp(base, "events.out.tfevents.", 20), 0);
    char *stop = NULL;
    long long secs = strtoll(base + 20, &stop, 10);
    assert_int_equal(stop - (base + 20), 10);
    assert_true(secs >= before && secs <= after);
    char tail[600];
    snprintf(tail, sizeof tail, ".%s.%d", host, (int)getpid());
    assert_string_equal(stop, tail);

    /* The file_version record is on disk as soon as the writer exists. */
    parsed_event ev[64];
    assert_int_equal(read_events(path, ev, 64), 1);
    assert_string_equal(ev[0].file_version, "brain.Event:2");
    assert_int_equal(ev[0].nvalues, 0);

    static const double loss[] = {2.3, 1.7, 0.9, 0.42, 0.25};
    for (int i = 0; i < 5; i++) {
        OK(kpl_tb_add_scalar(tb, "train/loss", 100 * i, loss[i]));
        OK(kpl_tb_add_scalar(tb, "train/acc", 100 * i, 0.1 + 0.2 * i));
    }
    long size = file_size(path);
    FAILS(kpl_tb_add_scalar(tb, "", 7, 1.0), KPL_EINVAL, "empty");
    FAILS(kpl_tb_add_scalar(tb, "a\xFF", 7, 1.0), KPL_EINVAL, "not UTF-8");
    OK(kpl_tb_add_scalar(tb, "odd/nan", 1, NAN));
    OK(kpl_tb_add_scalar(tb, "odd/inf", 2, INFINITY));
    OK(kpl_tb_add_scalar(tb, "odd/-inf", 3, -INFINITY));
    OK(kpl_tb_add_scalar(tb, "odd/big", 4, 1e300)); /* past float's range */
    OK(kpl_tb_add_scalar(tb, "odd/negative_step", -5, 3.0));
    char longtag[301];
    memset(longtag, 'z', 300);
    longtag[300] = 0;
    OK(kpl_tb_add_scalar(tb, longtag, (int64_t)1 << 40, 7.0));
    /* Buffered until the flush. */
    assert_int_equal(file_size(path), size);
    OK(kpl_tb_flush(tb));
    assert_true(file_size(path) > size);
    assert_int_equal(read_events(path, ev, 64), 1 + 10 + 6);
    kpl_tb_writer_close(tb);
    kpl_tb_writer_close(NULL);

    int n = read_events(path, ev, 64);
    assert_int_equal(n, 17);
    assert_string_equal(ev[0].file_version, "brain.Event:2");
    double now = (double)time(NULL);
    for (int i = 0; i < n; i++) {
        assert_true(ev[i].wall_time > before - 1 && ev[i].wall_time < now + 1);
        if (i) assert_true(ev[i].wall_time >= ev[i - 1].wall_time);
        if (i) assert_int_equal(ev[i].nvalues, 1);
        if (i) assert_string_equal(ev[i].file_version, "");
    }
    for (int i = 0; i < 5; i++) {
        parsed_event *l = &ev[1 + 2 * i], *a = &ev[2 + 2 * i];
        assert_string_equal(l->tag, "train/loss");
        assert_int_equal(l->step, 100 * i);
        assert_true(l->value == (float)loss[i]);
        assert_string_equal(a->tag, "train/acc");
        assert_int_equal(a->step, 100 * i);
        assert_true(a->value == (float)(0.1 + 0.2 * i));
    }
    assert_string_equal(ev[11].tag, "odd/nan");
    assert_true(isnan(ev[11].value));
    assert_true(isinf(ev[12].value) && ev[12].value > 0);
    assert_true(isinf(ev[13].value) && ev[13].value < 0);
    assert_string_equal(ev[14].tag, "odd/big");
    assert_true(isinf(ev[14].value) && ev[14].value > 0);
    assert_int_equal(ev[15].step, -5);
    assert_true(ev[15].value == 3.0f);
    assert_string_equal(ev[16].tag, longtag);
    assert_int_equal(ev[16].step, (int64_t)1 << 40);
    assert_true(ev[16].value == 7.0f);
    drop_root(root);
}

/* Two writers in one directory and one second get two files; thousands of
 * unflushed scalars reach the disk on their own and all survive close. */
static void test_two_writers_and_volume(void **state)
{
    (void)state;
    char root[512];
    make_root(root, sizeof root, "volume");
    kpl_tb_writer *a = NULL, *b = NULL;
    OK(kpl_tb_writer_create(root, &a));
    OK(kpl_tb_writer_create(root, &b));
    assert_string_not_equal(kpl_tb_writer_path(a), kpl_tb_writer_path(b));
    enum { N = 5000 };
    long first = file_size(kpl_tb_writer_path(a));
    for (int i = 0; i < N; i++) OK(kpl_tb_add_scalar(a, "train/loss", i, 1.0 / (i + 1)));
    assert_true(file_size(kpl_tb_writer_path(a)) > first);
    OK(kpl_tb_add_scalar(b, "b", 1, 2.0));
    char pa[1024];
    snprintf(pa, sizeof pa, "%s", kpl_tb_writer_path(a));
    char pb[1024];
    snprintf(pb, sizeof pb, "%s", kpl_tb_writer_path(b));
    kpl_tb_writer_close(a);
    kpl_tb_writer_close(b);

    parsed_event *ev = malloc(sizeof *ev * (N + 1));
    assert_non_null(ev);
    assert_int_equal(read_events(pa, ev, N + 1), N + 1);
    for (int i = 0; i < N; i++) {
        assert_int_equal(ev[1 + i].step, i);
        assert_true(ev[1 + i].value == (float)(1.0 / (i + 1)));
    }
    assert_int_equal(read_events(pb, ev, N + 1), 2);
    assert_string_equal(ev[1].tag, "b");
    free(ev);
    drop_root(root);
}

static void test_errors(void **state)
{
    (void)state;
    char root[512], file[600], dir[700];
    make_root(root, sizeof root, "errors");
    mkdir(root, 0777);
    snprintf(file, sizeof file, "%s/plain_file", root);
    FILE *f = fopen(file, "w");
    assert_non_null(f);
    fclose(f);

    kpl_tb_writer *tb = (kpl_tb_writer *)1;
    snprintf(dir, sizeof dir, "%s/sub/tb", file);
    FAILS(kpl_tb_writer_create(dir, &tb), KPL_EIO, dir);
    assert_null(tb);
    assert_non_null(strstr(kpl_last_error(), "Not a directory"));
    FAILS(kpl_tb_writer_create(file, &tb), KPL_EIO, file);
    assert_null(tb);
    FAILS(kpl_tb_writer_create("", &tb), KPL_EINVAL, "no directory");
    FAILS(kpl_tb_writer_create(NULL, &tb), KPL_EINVAL, "no directory");
    drop_root(root);
}

/* Images: the Summary.Image fields, and PNG bytes that decode (libpng,
 * as TensorBoard's PIL would) to exactly the pixels given. */
static void test_images(void **state)
{
    (void)state;
    char root[512];
    make_root(root, sizeof root, "images");
    kpl_tb_writer *tb = NULL;
    OK(kpl_tb_writer_create(root, &tb));
    enum { H = 5, W = 7 };
    uint8_t rgb[H * W * 3], gray[3 * 4];
    for (int i = 0; i < H * W * 3; i++) rgb[i] = (uint8_t)(i * 37 + 11);
    for (int i = 0; i < 12; i++) gray[i] = (uint8_t)(255 - 21 * i);
    OK(kpl_tb_add_image(tb, "val/rgb", 12, H, W, 3, rgb));
    OK(kpl_tb_add_image(tb, "val/gray", -3, 3, 4, 1, gray));
    FAILS(kpl_tb_add_image(tb, "bad", 0, H, W, 2, rgb), KPL_EINVAL, "has 2 channels");
    FAILS(kpl_tb_add_image(tb, "bad", 0, 0, W, 3, rgb), KPL_EINVAL, "0 x 7 pixels");
    FAILS(kpl_tb_add_image(tb, "", 0, H, W, 3, rgb), KPL_EINVAL, "tag is empty");
    FAILS(kpl_tb_add_image(tb, "bad", 0, H, W, 3, NULL), KPL_EINVAL, "without pixels");
    char path[1024];
    snprintf(path, sizeof path, "%s", kpl_tb_writer_path(tb));
    kpl_tb_writer_close(tb);

    parsed_event ev[4];
    assert_int_equal(read_events(path, ev, 4), 3); /* file_version, two images */
    const struct {
        const char *tag;
        int64_t step, h, w, c;
        const uint8_t *px;
        png_uint_32 format;
    } want[2] = {{"val/rgb", 12, H, W, 3, rgb, PNG_FORMAT_RGB},
                 {"val/gray", -3, 3, 4, 1, gray, PNG_FORMAT_GRAY}};
    for (int k = 0; k < 2; k++) {
        parsed_event *e = &ev[k + 1];
        assert_string_equal(e->tag, want[k].tag);
        assert_int_equal(e->step, want[k].step);
        assert_int_equal(e->nvalues, 1);
        assert_int_equal(e->img_h, want[k].h);
        assert_int_equal(e->img_w, want[k].w);
        assert_int_equal(e->img_c, want[k].c);
        assert_non_null(e->png);
        png_image im;
        memset(&im, 0, sizeof im);
        im.version = PNG_IMAGE_VERSION;
        assert_true(png_image_begin_read_from_memory(&im, e->png, e->png_len));
        assert_int_equal(im.width, want[k].w);
        assert_int_equal(im.height, want[k].h);
        im.format = want[k].format;
        size_t n = (size_t)(want[k].h * want[k].w * want[k].c);
        uint8_t *px = malloc(n);
        assert_non_null(px);
        assert_true(png_image_finish_read(&im, NULL, px, 0, NULL));
        assert_memory_equal(px, want[k].px, n);
        free(px);
        free(e->png);
    }
    drop_root(root);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_scalar_event_bytes),
        cmocka_unit_test(test_tag_validation),
        cmocka_unit_test(test_masked_crc),
        cmocka_unit_test(test_write_and_read_back),
        cmocka_unit_test(test_two_writers_and_volume),
        cmocka_unit_test(test_errors),
        cmocka_unit_test(test_images),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
