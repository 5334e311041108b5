/*
 * cli.h — the `kpl` command's files (not installed).
 */
#ifndef KPL_CLI_H
#define KPL_CLI_H

#include "run_impl.h"

int kpl__cmd_data(int argc, char **argv);  /* cmd_data.c */
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
} kpl__console;

void kpl__console_init(kpl__console *c, kpl_progress_mode mode);
/* The trainer's kpl_log_fn, ctx a kpl__console. */
void kpl__console_log(void *ctx, const kpl_log_event *e);
/* Wipes the bar (before the process exits). */
void kpl__console_end(kpl__console *c);

#endif /* KPL_CLI_H */
