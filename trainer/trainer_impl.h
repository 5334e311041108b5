/*
 * trainer_impl.h — the trainer module's internals that its tests reach
 * (not installed; not part of the API).
 */
#ifndef KPL_TRAINER_IMPL_H
#define KPL_TRAINER_IMPL_H

#include "trainer.h"

/* ---- TensorBoard event files (tboard.c) ---- */

/* The longest scalar tag in bytes; longer ones are KPL_EINVAL. */
#define KPL__TB_TAG_MAX 1024
/* Room for one encoded scalar Event with the longest tag. */
#define KPL__TB_EVENT_MAX (KPL__TB_TAG_MAX + 64)

/* TFRecord's masked CRC32C of n bytes. */
uint32_t kpl__tb_masked_crc(const void *data, size_t n);

/* Encodes the tensorflow.Event protobuf message (unframed) of one scalar
 * summary into buf (at least KPL__TB_EVENT_MAX bytes); *len receives its
 * size.  KPL_EINVAL for an empty tag, one longer than KPL__TB_TAG_MAX or
 * one that is not UTF-8. */
kpl_status kpl__tb_encode_scalar(uint8_t *buf, const char *tag, int64_t step, double value,
                                 double wall_time, size_t *len);

#endif /* KPL_TRAINER_IMPL_H */
