/*
 * tboard.c — scalars in TensorBoard's event-file format, without TensorFlow.
 *
 * An event file is a TFRecord stream: each record is the little-endian
 * uint64 length of its data, the masked CRC32C of those 8 bytes, the data
 * and the masked CRC32C of the data.  Every record holds one serialized
 * tensorflow.Event (tensorflow/core/util/event.proto); the first one
 * carries file_version "brain.Event:2", the others a Summary with one
 * simple_value, or one image (Summary.Image: height, width, colorspace and
 * the PNG bytes, encoded with libpng).  The few protobuf fields needed are
 * encoded here by hand.
 *
 * Events collect in a memory buffer and reach the file with write(2) at
 * kpl_tb_flush, at close, or when the buffer passes TB_FLUSH_BYTES.
 * A writer is used by one thread at a time.
 */
#include "io_impl.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <png.h>
#include <stdio.h>
#include <stdlib.h>
#include <math.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

/* Frequent scalars (every step) should cost no system call each, yet a
 * run that never flushes must not hold its whole history in memory. */
#define TB_FLUSH_BYTES (64 * 1024)
/* A record's framing: length, its CRC, and the data's CRC. */
#define TB_FRAMING (8 + 4 + 4)
#define TB_FILE_VERSION "brain.Event:2"

/* Protobuf wire types (protobuf.dev, "Encoding"). */
enum { WT_VARINT = 0, WT_FIXED64 = 1, WT_LEN = 2, WT_FIXED32 = 5 };

struct kpl_tb_writer {
    int fd;
    char path[PATH_MAX];
    uint8_t *buf; /* framed records not yet written */
    size_t len, cap;
};

uint32_t kpl__tb_masked_crc(const void *data, size_t n)
{
    uint32_t c = kpl_crc32c(0, data, n);
    return ((c >> 15) | (c << 17)) + 0xa282ead8u;
}

static uint8_t *put_varint(uint8_t *p, uint64_t v)
{
    while (v >= 0x80) {
        *p++ = (uint8_t)(v | 0x80);
        v >>= 7;
    }
    *p++ = (uint8_t)v;
    return p;
}

static size_t varint_size(uint64_t v)
{
    size_t n = 1;
    while (v >= 0x80) {
        v >>= 7;
        n++;
    }
    return n;
}

static uint8_t *put_key(uint8_t *p, unsigned field, unsigned wire_type)
{
    return put_varint(p, (uint64_t)(field << 3 | wire_type));
}

static uint8_t *put_le(uint8_t *p, uint64_t v, int bytes)
{
    for (int i = 0; i < bytes; i++) *p++ = (uint8_t)(v >> (8 * i));
    return p;
}

static uint8_t *put_double(uint8_t *p, unsigned field, double d)
{
    uint64_t bits;
    memcpy(&bits, &d, sizeof bits);
    return put_le(put_key(p, field, WT_FIXED64), bits, 8);
}

/* True when s[0..n) is well-formed UTF-8 (RFC 3629: no overlong forms,
 * no surrogates, nothing past U+10FFFF).  Event.proto is proto3, whose
 * parsers reject a string field that is not, so a bad tag would make
 * TensorBoard drop the whole record. */
static bool utf8_valid(const uint8_t *s, size_t n)
{
    size_t i = 0;
    while (i < n) {
        uint8_t c = s[i];
        size_t more;
        uint8_t lo = 0x80, hi = 0xBF; /* the range of the first continuation byte */
        if (c < 0x80) {
            i++;
            continue;
        } else if (c >= 0xC2 && c <= 0xDF) {
            more = 1;
        } else if (c >= 0xE0 && c <= 0xEF) {
            more = 2;
            if (c == 0xE0) lo = 0xA0;
            if (c == 0xED) hi = 0x9F;
        } else if (c >= 0xF0 && c <= 0xF4) {
            more = 3;
            if (c == 0xF0) lo = 0x90;
            if (c == 0xF4) hi = 0x8F;
        } else {
            return false;
        }
        if (n - i - 1 < more) return false;
        if (s[i + 1] < lo || s[i + 1] > hi) return false;
        for (size_t k = 2; k <= more; k++)
            if ((s[i + k] & 0xC0) != 0x80) return false;
        i += more + 1;
    }
    return true;
}

/* A tag's length, after the checks TensorBoard's parsers need. */
static kpl_status check_tag(const char *tag, size_t *len)
{
    KPL_CHECK(tag, KPL_EINVAL, "tensorboard: the tag is NULL");
    size_t n = strnlen(tag, KPL__TB_TAG_MAX + 1);
    KPL_CHECK(n > 0, KPL_EINVAL, "tensorboard: the tag is empty");
    KPL_CHECK(n <= KPL__TB_TAG_MAX, KPL_EINVAL,
              "tensorboard: tag '%.32s...' is longer than %d bytes", tag, KPL__TB_TAG_MAX);
    KPL_CHECK(utf8_valid((const uint8_t *)tag, n), KPL_EINVAL,
              "tensorboard: tag '%s' is not UTF-8", tag);
    *len = n;
    return KPL_OK;
}

/* Event: wall_time = 1 (double), step = 2 (int64, a negative one as its
 * 64-bit two's complement), summary = 5, whose repeated Value value = 1
 * holds one Value of value_len bytes; the Value's fields follow. */
static uint8_t *put_event_head(uint8_t *p, double wall_time, int64_t step, size_t value_len)
{
    size_t summary_len = 1 + varint_size(value_len) + value_len;
    p = put_double(p, 1, wall_time);
    p = put_varint(put_key(p, 2, WT_VARINT), (uint64_t)step);
    p = put_varint(put_key(p, 5, WT_LEN), summary_len);
    return put_varint(put_key(p, 1, WT_LEN), value_len);
}

kpl_status kpl__tb_encode_scalar(uint8_t *buf, const char *tag, int64_t step, double value,
                                 double wall_time, size_t *len)
{
    *len = 0;
    size_t n = 0;
    KPL_TRY(check_tag(tag, &n));

    /* TensorBoard's scalars are float32.  Past float's range the
     * conversion gives an infinity (IEC 60559, C Annex F), and NaN stays
     * NaN: TensorBoard shows both. */
    float f = (float)value;
    uint32_t fbits;
    memcpy(&fbits, &f, sizeof fbits);

    /* Summary.Value: tag = 1 (string), simple_value = 2 (float). */
    size_t value_len = 1 + varint_size(n) + n + 1 + 4;
    uint8_t *p = put_event_head(buf, wall_time, step, value_len);
    p = put_varint(put_key(p, 1, WT_LEN), n);
    memcpy(p, tag, n);
    p += n;
    p = put_le(put_key(p, 2, WT_FIXED32), fbits, 4);
    *len = (size_t)(p - buf);
    KPL_ASSERT(*len <= KPL__TB_EVENT_MAX, "tensorboard: event larger than its bound");
    return KPL_OK;
}

static double wall_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

/* Frames `data` as one TFRecord at the end of the buffer. */
static kpl_status append_record(kpl_tb_writer *w, const uint8_t *data, size_t n)
{
    size_t need = w->len + n + TB_FRAMING;
    if (need > w->cap) {
        size_t cap = w->cap ? w->cap : 4096;
        while (cap < need) cap *= 2;
        uint8_t *b = realloc(w->buf, cap);
        KPL_CHECK(b, KPL_ENOMEM, "tensorboard: no memory for %zu bytes of events", cap);
        w->buf = b;
        w->cap = cap;
    }
    uint8_t *p = w->buf + w->len;
    put_le(p, n, 8);
    put_le(p + 8, kpl__tb_masked_crc(p, 8), 4);
    memcpy(p + 12, data, n);
    put_le(p + 12 + n, kpl__tb_masked_crc(data, n), 4);
    w->len = need;
    return KPL_OK;
}

/* Writes out the buffer.  On failure the unwritten tail stays buffered:
 * a later flush continues exactly where this one stopped, so the file
 * remains a well-formed record stream if the disk recovers. */
static kpl_status write_buffer(kpl_tb_writer *w)
{
    size_t done = 0;
    kpl_status st = KPL_OK;
    while (done < w->len) {
        ssize_t r = write(w->fd, w->buf + done, w->len - done);
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) {
            st = KPL_ERROR(KPL_EIO, "tensorboard: cannot write %s: %s", w->path,
                           r < 0 ? strerror(errno) : "no progress");
            break;
        }
        done += (size_t)r;
    }
    memmove(w->buf, w->buf + done, w->len - done);
    w->len -= done;
    return st;
}


/* Creates the event file exclusively.  Two writers of one process started
 * in the same second would pick the same name, so the second one gets a
 * ".<n>" suffix; it sorts after the first, and TensorBoard reads a run's
 * files in name order. */
static kpl_status open_event_file(kpl_tb_writer *w, const char *dir)
{
    char host[256];
    if (gethostname(host, sizeof host) != 0 || !host[0]) snprintf(host, sizeof host, "localhost");
    host[sizeof host - 1] = 0;
    for (char *h = host; *h; h++)
        if (*h == '/') *h = '_';
    int dlen = (int)strlen(dir);
    while (dlen > 1 && dir[dlen - 1] == '/') dlen--;
    long long secs = (long long)time(NULL);
    int pid = (int)getpid();
    for (int attempt = 0;; attempt++) {
        char suffix[16] = "";
        if (attempt) snprintf(suffix, sizeof suffix, ".%d", attempt);
        int n = snprintf(w->path, sizeof w->path, "%.*s/events.out.tfevents.%010lld.%s.%d%s",
                         dlen, dir, secs, host, pid, suffix);
        KPL_CHECK(n > 0 && (size_t)n < sizeof w->path, KPL_EINVAL,
                  "tensorboard: event file path in %s too long", dir);
        w->fd = open(w->path, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0666);
        if (w->fd >= 0) return KPL_OK;
        if (errno != EEXIST || attempt >= 1000)
            return KPL_ERROR(KPL_EIO, "tensorboard: cannot create %s: %s", w->path,
                             strerror(errno));
    }
}

kpl_status kpl_tb_writer_create(const char *dir, kpl_tb_writer **out)
{
    *out = NULL;
    KPL_CHECK(dir && dir[0], KPL_EINVAL, "tensorboard: no directory given");
    if (kpl__mkdirs(dir) < 0) return kpl_error_prefix(kpl_last_status(), "tensorboard: ");
    kpl_tb_writer *w = calloc(1, sizeof *w);
    KPL_CHECK(w, KPL_ENOMEM, "tensorboard: out of memory");
    w->fd = -1;
    kpl_status st = KPL_OK;
    KPL_TRY_GOTO(open_event_file(w, dir));

    /* Event: wall_time = 1, file_version = 3 (string).  Written at once so
     * the file is a valid event file from the moment it exists. */
    uint8_t ev[64];
    uint8_t *p = put_double(ev, 1, wall_now());
    p = put_varint(put_key(p, 3, WT_LEN), sizeof TB_FILE_VERSION - 1);
    memcpy(p, TB_FILE_VERSION, sizeof TB_FILE_VERSION - 1);
    p += sizeof TB_FILE_VERSION - 1;
    KPL_TRY_GOTO(append_record(w, ev, (size_t)(p - ev)));
    KPL_TRY_GOTO(write_buffer(w));
    *out = w;
    return KPL_OK;
fail:
    /* A file without its file_version record would only confuse readers. */
    if (w->fd >= 0) {
        close(w->fd);
        unlink(w->path);
    }
    free(w->buf);
    free(w);
    return st;
}

kpl_status kpl_tb_add_scalar(kpl_tb_writer *w, const char *tag, int64_t step, double value)
{
    uint8_t ev[KPL__TB_EVENT_MAX];
    size_t n;
    KPL_TRY(kpl__tb_encode_scalar(ev, tag, step, value, wall_now(), &n));
    KPL_TRY(append_record(w, ev, n));
    if (w->len >= TB_FLUSH_BYTES) KPL_TRY(write_buffer(w));
    return KPL_OK;
}

kpl_status kpl__tb_encode_image(const char *tag, int64_t step, int height, int width,
                                int channels, const uint8_t *png, size_t png_len,
                                double wall_time, uint8_t **out, size_t *len)
{
    *out = NULL, *len = 0;
    size_t n = 0;
    KPL_TRY(check_tag(tag, &n));
    /* Summary.Image: height = 1, width = 2, colorspace = 3 (int32; 1 gray,
     * 3 RGB, 4 RGBA), encoded_image_string = 4 (bytes). */
    size_t image_len = 1 + varint_size((uint64_t)height) + 1 + varint_size((uint64_t)width) + 1 +
                       varint_size((uint64_t)channels) + 1 + varint_size(png_len) + png_len;
    /* Summary.Value: tag = 1, image = 4. */
    size_t value_len = 1 + varint_size(n) + n + 1 + varint_size(image_len) + image_len;
    uint8_t *buf = malloc(value_len + 64);
    KPL_CHECK(buf, KPL_ENOMEM, "tensorboard: no memory for a %zu-byte image event", value_len);
    uint8_t *p = put_event_head(buf, wall_time, step, value_len);
    p = put_varint(put_key(p, 1, WT_LEN), n);
    memcpy(p, tag, n);
    p += n;
    p = put_varint(put_key(p, 4, WT_LEN), image_len);
    p = put_varint(put_key(p, 1, WT_VARINT), (uint64_t)height);
    p = put_varint(put_key(p, 2, WT_VARINT), (uint64_t)width);
    p = put_varint(put_key(p, 3, WT_VARINT), (uint64_t)channels);
    p = put_varint(put_key(p, 4, WT_LEN), png_len);
    memcpy(p, png, png_len);
    p += png_len;
    *out = buf, *len = (size_t)(p - buf);
    return KPL_OK;
}

kpl_status kpl_tb_add_image(kpl_tb_writer *w, const char *tag, int64_t step, int height,
                            int width, int channels, const uint8_t *pixels)
{
    KPL_CHECK(height > 0 && width > 0 && height <= 1 << 14 && width <= 1 << 14, KPL_EINVAL,
              "tensorboard: image '%s' of %d x %d pixels (each side 1..16384)", tag ? tag : "",
              height, width);
    KPL_CHECK(channels == 1 || channels == 3 || channels == 4, KPL_EINVAL,
              "tensorboard: image '%s' has %d channels (want 1, 3 or 4)", tag ? tag : "",
              channels);
    KPL_CHECK(pixels, KPL_EINVAL, "tensorboard: image '%s' without pixels", tag ? tag : "");
    png_image im;
    memset(&im, 0, sizeof im);
    im.version = PNG_IMAGE_VERSION;
    im.width = (png_uint_32)width, im.height = (png_uint_32)height;
    im.format = channels == 1 ? PNG_FORMAT_GRAY : channels == 3 ? PNG_FORMAT_RGB : PNG_FORMAT_RGBA;
    png_alloc_size_t png_len = 0;
    KPL_CHECK(png_image_write_to_memory(&im, NULL, &png_len, 0, pixels, 0, NULL), KPL_EINVAL,
              "tensorboard: image '%s': PNG: %s", tag ? tag : "", im.message);
    uint8_t *png = malloc(png_len);
    KPL_CHECK(png, KPL_ENOMEM, "tensorboard: no memory for a %zu-byte PNG", (size_t)png_len);
    kpl_status st = KPL_OK;
    if (!png_image_write_to_memory(&im, png, &png_len, 0, pixels, 0, NULL))
        st = KPL_ERROR(KPL_EINVAL, "tensorboard: image '%s': PNG: %s", tag ? tag : "", im.message);
    uint8_t *ev = NULL;
    size_t n = 0;
    if (st >= 0)
        st = kpl__tb_encode_image(tag, step, height, width, channels, png, png_len, wall_now(),
                                  &ev, &n);
    free(png);
    if (st >= 0) st = append_record(w, ev, n);
    free(ev);
    KPL_TRY(st);
    return w->len >= TB_FLUSH_BYTES ? write_buffer(w) : KPL_OK;
}

kpl_status kpl_tb_flush(kpl_tb_writer *w) { return write_buffer(w); }

/* A write error here cannot be returned; it stays in kpl_last_error(), and
 * callers that must know call kpl_tb_flush first. */
void kpl_tb_writer_close(kpl_tb_writer *w)
{
    if (!w) return;
    if (w->fd >= 0) {
        write_buffer(w);
        close(w->fd);
    }
    free(w->buf);
    free(w);
}

const char *kpl_tb_writer_path(const kpl_tb_writer *w) { return w->path; }

void kpl_tb_rgb8(const float *x, int64_t C, int64_t H, int64_t W, int64_t i, int h, int w,
                 const float *scale, const float *shift, uint8_t *rgb, int64_t row_pixels)
{
    for (int y = 0; y < h; y++)
        for (int xx = 0; xx < w; xx++)
            for (int c = 0; c < 3; c++) {
                int64_t cc = C == 3 ? c : 0;
                double v = (double)x[((i * C + cc) * H + y) * W + xx] * scale[cc] + shift[cc];
                rgb[((size_t)y * (size_t)row_pixels + (size_t)xx) * 3 + (size_t)c] =
                    (uint8_t)fmin(fmax(v * 255 + 0.5, 0), 255);
            }
}

kpl_status kpl_tb_png_write(const char *path, int h, int w, int channels, const uint8_t *px,
                          const char *what)
{
    kpl__afile a;
    if (kpl__afile_open(&a, path) < 0) return kpl_error_prefix(kpl_last_status(), "%s: ", what);
    png_image im;
    memset(&im, 0, sizeof im);
    im.version = PNG_IMAGE_VERSION;
    im.width = (png_uint_32)w, im.height = (png_uint_32)h;
    im.format = channels == 3 ? PNG_FORMAT_RGB : PNG_FORMAT_GRAY;
    if (!png_image_write_to_stdio(&im, a.f, 0, px, w * channels, NULL)) {
        kpl__afile_abort(&a);
        return KPL_ERROR(KPL_EIO, "%s: cannot write %s: %s", what, path, im.message);
    }
    if (kpl__afile_commit(&a) < 0) return kpl_error_prefix(kpl_last_status(), "%s: ", what);
    return KPL_OK;
}
