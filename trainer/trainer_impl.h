/*
 * trainer_impl.h — the trainer module's internals that its tests reach
 * (not installed; not part of the API).
 */
#ifndef KPL_TRAINER_IMPL_H
#define KPL_TRAINER_IMPL_H

#include "trainer.h"

#include <stdio.h>

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

/* ---- checkpoint files (checkpoint.c) ---- */

/* DIR/ckpt-<step, 10 digits>.kpl */
/* kpl_checkpoint_restore's checks alone: the tensor exists with dst's
 * dtype and shape (errors as restore's). */
kpl_status kpl__checkpoint_check(const kpl_checkpoint *c, const char *name, const kpl_tensor *dst);
void kpl__checkpoint_path(const char *dir, int64_t step, char *path, size_t len);
/* The steps of DIR's complete checkpoints (those with a marker), ascending;
 * *count <= max.  A missing DIR has none. */
kpl_status kpl__checkpoint_list(const char *dir, int64_t *steps, int max, int *count);
/* Removes what interrupted saves left in DIR: temporary files, checkpoints
 * without their completion marker and markers without their checkpoint,
 * except the file `keep` (may be NULL: the one being resumed from);
 * *removed and *bytes count them.  Only while no save is under way. */
kpl_status kpl__checkpoint_clean(const char *dir, const char *keep, int *removed, double *bytes);
/* A checkpoint written before its epoch's evaluation (metadata
 * train.eval_pending): once that evaluation has run, its marker says so
 * ("evaluated": true), and a resume from it does not evaluate again. */
kpl_status kpl__checkpoint_mark_evaluated(const char *path);
bool kpl__checkpoint_evaluated(const char *path);
/* Removes a checkpoint, its marker first. */
kpl_status kpl__checkpoint_remove(const char *path);
/* dst becomes the same checkpoint as src (a hard link, else a copy) with
 * its own marker, replacing what dst was atomically. */
kpl_status kpl__checkpoint_link(const char *src, const char *dst);

/* ---- what a run says (train_log.c) ---- */

typedef struct {
    int rank;
    FILE *log;         /* this rank's log file in the run directory */
    FILE *metrics;     /* rank 0: metrics.jsonl */
    kpl_tb_writer *tb; /* rank 0, when TensorBoard is on */
    bool bar;          /* rank 0 draws a progress bar on stdout */
    bool bar_drawn;
    int width;         /* of the terminal */
} kpl__runlog;

double kpl__wall(void); /* Unix time */
/* progress_mode: 0 auto (a terminal on stdout), 1 always, 2 never. */
void kpl__log_init(kpl__runlog *l, int rank, int progress_mode);
void kpl__log_close(kpl__runlog *l);
/* Rank 0: stdout and the log file; other ranks: their log file. */
void kpl__log_info(kpl__runlog *l, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* Every rank: standard error ("kpl[rank]: warning: ...") and the log file. */
void kpl__log_warn(kpl__runlog *l, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
void kpl__log_error(kpl__runlog *l, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* One line of metrics.jsonl (rank 0). */
void kpl__log_metrics(kpl__runlog *l, const char *json);
/* Redraws rank 0's progress bar (a no-op when there is none). */
void kpl__log_bar(kpl__runlog *l, int64_t epoch, int64_t epochs, int64_t step, int64_t steps,
                  double loss, double lr, double img_s, double eta);
void kpl__log_bar_end(kpl__runlog *l);

/* ---- the data of a run (train_data.c) ---- */

/* Builds the recipe's missing splits from data.convert.source, one process
 * per node at a time (a lock file in data.root); the others wait and then
 * find them built. */
kpl_status kpl__data_prepare(const kpl_recipe *r, kpl__runlog *log);
/* mkdir -p */
kpl_status kpl__mkdirs(const char *dir);
/* root + split path into buf. */
void kpl__data_split_path(const kpl_recipe *r, const kpl_recipe_split *s, char *buf, size_t len);
/* The loader configuration of a split (pointers into r and path). */
void kpl__data_loader_config(const kpl_recipe *r, const kpl_recipe_split *s, const char *path,
                             bool train, int32_t rank, int32_t world, kpl_loader_config *c);
/* The model's input (C, H, W): model.input_size and in_channels when set,
 * else the train transform's size and channels, else the stored size of
 * the image feature. */
kpl_status kpl__data_input_shape(const kpl_recipe *r, int64_t *chw);

/* ---- runs (train.c) ---- */

/* Whether SIGINT or SIGTERM asked the run to stop (long waits give up). */
bool kpl__stop_requested(void);

/* `kpl train`: the whole run; resume NULL (a new run), "" (the newest
 * checkpoint) or a checkpoint file.  Returns the exit status: 0, 1 on an
 * error (printed), 130 / 143 after SIGINT / SIGTERM (with a checkpoint). */
int kpl__train_run(const kpl_recipe *r, const char *resume);
/* `kpl eval`: the checkpoint's model on the recipe's validation split. */
int kpl__eval_run(const kpl_recipe *r, const char *checkpoint);

#endif /* KPL_TRAINER_IMPL_H */
