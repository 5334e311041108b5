/*
 * bench_seg.h — what bench_seg.c and its `ops` case (bench_seg_ops.c) share.
 */
#ifndef KPL_BENCH_SEG_H
#define KPL_BENCH_SEG_H

#define SEG_THREADS 2
#define SEG_SEED 4321

/* The `ops` case, `rounds` rounds: kpl's fused segmentation and detection ops alone
 * against bench/torch_segops.py (bench_seg.c's header says which). */
void bench_seg_ops(const char *bench_dir, int rounds);

#endif
