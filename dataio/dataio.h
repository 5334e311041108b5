/*
 * dataio.h — datasets: the KPLRecord format (docs/kplrecord.md is the
 * specification), its writer and reader, the converters from IDX, image
 * folders (with classes or without), LMDB, CIFAR-10/100, COCO and Pascal
 * VOC (detection and segmentation), image and mask folders, COCO's run-length mask encoding, and synthetic
 * detection and segmentation sets (docs/detection-data.md,
 * docs/segmentation-data.md).
 *
 * Writing a dataset:
 *
 *   kpl_feature_spec schema[2] = {
 *       {.name = "image", .type = KPL_FEATURE_BYTES, .encoding = "jpeg"},
 *       {.name = "label", .type = KPL_FEATURE_INT64},
 *   };
 *   kpl_record_writer_config cfg = KPL_RECORD_WRITER_CONFIG_INIT;
 *   cfg.shards = 4;
 *   kpl_record_writer *w = NULL;
 *   kpl_record_writer_create("out/train", 2, schema, &cfg, &w);
 *   for (each example) {
 *       kpl_feature_value v[2] = {{jpeg, jpeg_len}, {&label, 1}};
 *       kpl_record_writer_add(w, v);
 *   }
 *   kpl_record_writer_close(w);      // the dataset is complete only now
 *
 * Reading it:
 *
 *   kpl_dataset *ds = NULL;
 *   kpl_dataset_open("out/train", &ds);
 *   kpl_chunk *c = kpl_chunk_create();
 *   for (int64_t k = 0; k < kpl_dataset_num_chunks(ds); k++) {
 *       kpl_dataset_read_chunk(ds, k, c);          // checked, decompressed
 *       for (int i = 0; i < kpl_chunk_num_records(c); i++) {
 *           kpl_feature_value v[2];
 *           kpl_chunk_record(c, i, v);               // views into c
 *       }
 *   }
 *   kpl_chunk_destroy(c);
 *   kpl_dataset_close(ds);
 *
 * Every function that can fail returns a kpl_status; the message from
 * kpl_last_error() names the file, shard, chunk and record at fault.
 *
 * The parts: record.h (the format, writer, reader), convert.h (the
 * converters and their records), transform.h (per-sample transforms),
 * loader.h (the pipeline); this header includes them all.
 */
#ifndef KPL_DATAIO_H
#define KPL_DATAIO_H

#include "record.h"
#include "convert.h"
#include "transform.h"
#include "loader.h"

#endif /* KPL_DATAIO_H */
