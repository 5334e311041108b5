/*
 * tboard.h — TensorBoard event files, without TensorFlow.
 */
#ifndef KPL_TBOARD_H
#define KPL_TBOARD_H

#include "kernels.h"

#ifdef __cplusplus
extern "C" {
#endif

/*
 * Scalars and images in TensorBoard's event-file format (TFRecord framing with masked
 * CRC32C, tensorflow.Event protobuf messages), readable by TensorBoard and
 * tensorboard.backend.event_processing without TensorFlow here.
 *
 *   kpl_tb_writer *tb = NULL;
 *   kpl_tb_writer_create("runs/x/tb", &tb);
 *   kpl_tb_add_scalar(tb, "train/loss", step, 0.42);
 *   kpl_tb_writer_close(tb);
 */
typedef struct kpl_tb_writer kpl_tb_writer;

/* Creates dir (and parents) and in it a new
 * events.out.tfevents.<seconds>.<hostname>.<pid> file holding the
 * file_version event.  *out owned by the caller (kpl_tb_writer_close). */
kpl_status kpl_tb_writer_create(const char *dir, kpl_tb_writer **out);
/* Appends one scalar summary event (wall time now).  Buffered. */
kpl_status kpl_tb_add_scalar(kpl_tb_writer *w, const char *tag, int64_t step, double value);
/* Appends one image summary (TensorBoard's IMAGES tab): 8-bit pixels,
 * height x width x channels row-major (channels 1 gray, 3 RGB, 4 RGBA),
 * stored as PNG.  KPL_EINVAL for a side outside 1..16384 or another
 * channel count.  Buffered. */
kpl_status kpl_tb_add_image(kpl_tb_writer *w, const char *tag, int64_t step, int height,
                            int width, int channels, const uint8_t *pixels);
/* Sample i of an f32 batch x (N, C, H, W), C 1 or 3, its top-left h x w,
 * as 8-bit RGB for kpl_tb_add_image: each value v becomes
 * 255 (v scale[c] + shift[c]) rounded and clamped to [0, 255] (a
 * normalisation undone: scale the std, shift the mean; tanh outputs:
 * 0.5, 0.5); gray is repeated over the three channels.  Pixel (y, x) goes
 * to rgb[(y * row_pixels + x) * 3 + c], row_pixels >= w (wider for a grid
 * of samples). */
void kpl_tb_rgb8(const float *x, int64_t C, int64_t H, int64_t W, int64_t i, int h, int w,
                 const float *scale, const float *shift, uint8_t *rgb, int64_t row_pixels);
/* Writes an 8-bit gray (channels 1) or RGB (3) image of h x w pixels as a
 * PNG file at path, whole or not at all (through path.tmp and a rename);
 * errors name `what` and the file. */
kpl_status kpl_tb_png_write(const char *path, int h, int w, int channels, const uint8_t *px,
                            const char *what);
/* Writes the buffered events to the file (no fsync). */
kpl_status kpl_tb_flush(kpl_tb_writer *w);
/* Flushes, closes and frees; NULL is a no-op. */
void kpl_tb_writer_close(kpl_tb_writer *w);
/* The event file's path (borrowed). */
const char *kpl_tb_writer_path(const kpl_tb_writer *w);

#ifdef __cplusplus
}
#endif
#endif /* KPL_TBOARD_H */
