/*
 * cli.h — the `kpl` command's files (not installed).
 */
#ifndef KPL_CLI_H
#define KPL_CLI_H

#include "run_impl.h"

int kpl__cmd_data(int argc, char **argv);  /* cmd_data.c */
int kpl__cmd_fid_net(int argc, char **argv); /* cmd_fid_net.c: kpl data fid-net */
int kpl__cmd_train(int argc, char **argv); /* cmd_train.c */
int kpl__cmd_eval(int argc, char **argv);  /* cmd_train.c */
int kpl__cmd_export(int argc, char **argv); /* cmd_train.c */
int kpl__cmd_graph(int argc, char **argv);  /* cmd_train.c */
int kpl__cmd_infer(int argc, char **argv);  /* cmd_infer.c */
int kpl__cmd_import(int argc, char **argv); /* cmd_infer.c */

/* The console of a run (console.c): rank 0's lines on stdout, a progress
 * bar when log.progress and the terminal (or kplrun) say so, warnings and
 * errors of every rank on stderr. */
typedef struct {
    bool bar, bar_drawn;
    int width; /* of the terminal */
    FILE *out; /* rank 0's lines and the bar: stdout after init; a caller may change it */
} kpl__console;

void kpl__console_init(kpl__console *c, kpl_progress_mode mode);
/* The trainer's kpl_log_fn, ctx a kpl__console. */
void kpl__console_log(void *ctx, const kpl_log_event *e);
/* Wipes the bar (before the process exits). */
void kpl__console_end(kpl__console *c);

/* `kpl train`'s run of a loaded recipe (cmd_train.c): the recipe's task
 * through kpl_trainer_create and kpl_trainer_fit with options o, whose
 * log is set to con (initialised by the caller, ended by it too).  The
 * exit status: 0 done, 128 + the signal after a stop, 1 failed or an
 * unknown task (said on stderr; a failed job is ended on every rank
 * first).  *rank (may be NULL): this process's rank in the job, 0 when
 * the trainer did not start. */
int kpl__cli_train(const kpl_recipe *r, kpl_trainer_options *o, kpl__console *con,
                   int32_t *rank);

#endif /* KPL_CLI_H */
