#!/usr/bin/env bash
# train_cuda_e2e.sh KPL SOURCE_DIR — `kpl train` on the GPU (label cuda;
# exit 77, skipped, where `kpl info` lists no cuda:0):
#   - the default Fashion-MNIST recipe with device=cuda and deterministic:
#     true, one epoch on a subset, learns (val top-1 >= 50%, an untrained
#     model has 10%) and follows the CPU's run of the same recipe step by
#     step (losses to 1e-2 relative: cuDNN and cuBLAS sum in other orders);
#   - run again, it gives the same loss at every step bit for bit, and so
#     does a run stopped by max_steps and resumed: the convolution
#     algorithms are chosen without timing and every sum has a fixed
#     order, so a new process computes what the first one did.
set -euo pipefail
case_=cuda kpl=$1 src=$2
. "$(dirname "$0")/e2e_common.sh"
"$kpl" info | grep -q 'cuda:0' || kpl_skip env "no CUDA GPU"
need_fm
# lr 0.01, not the recipe's 0.05: at 0.05 the first 20 steps are chaotic
# (the loss jumps to 2.9 at step 11), and the CPU alone, run on 1 and on 2
# threads, already differs by 1.25% there; at 0.01 by at most 4e-4, which
# leaves the 1e-2 below for what the GPU's other summation orders add.
R=("$src/recipes/fashion_mnist/cnn.yaml" data.root="$tmp/fm" data.convert.source="$fm" "${QUIET[@]}" deterministic=true
   epochs=1 data.train.limit=2560 data.val.limit=1000 log.every_steps=1 optimizer.lr=0.01)
"$kpl" train "${R[@]}" device=cuda run_dir=gpu > gpu.txt 2> gpu.err \
  || die "GPU run: $(tail -5 gpu.err)"
losses gpu > gpu.loss
[[ $(wc -l < gpu.loss) == 20 ]] || die "GPU run: $(wc -l < gpu.loss) steps logged"
done_=$(tail -n 1 gpu.txt)
[[ $(field event "$done_") == done ]] || die "the last line is not the done event: $done_"
top1=$(field val_top1 "$done_")
awk -v a="$top1" 'BEGIN { exit !(a >= 50) }' || die "val top-1 $top1 < 50"
grep -q ' on cuda:0, ' gpu/logs/rank-00000.log gpu.txt || die "the run did not say it used cuda:0"
# the CPU's run of the same recipe
"$kpl" train "${R[@]}" device=cpu threads=2 run_dir=cpu > cpu.txt 2> cpu.err \
  || die "CPU run: $(tail -5 cpu.err)"
losses cpu > cpu.loss
paste gpu.loss cpu.loss | awk '{ d = $2 - $4; if (d < 0) d = -d; m = $4 < 0 ? -$4 : $4
                                 if (m < 0.01) m = 0.01
                                 if ($1 != $3 || d > 1e-2 * m) { print "step " $1 ": GPU " $2 ", CPU " $4; bad = 1 } }
                                 END { exit bad }' > drift.txt || die "GPU and CPU losses differ: $(head -4 drift.txt)"
# deterministic on the GPU: again, and stopped at step 7 then resumed
"$kpl" train "${R[@]}" device=cuda run_dir=again > again.txt 2> again.err \
  || die "second GPU run: $(tail -5 again.err)"
losses again > again.loss
diff gpu.loss again.loss > /dev/null || die "two GPU runs differ: $(diff gpu.loss again.loss | head -4)"
"$kpl" train "${R[@]}" device=cuda run_dir=cut max_steps=7 > cut1.txt 2> cut1.err \
  || die "cut run: $(tail -5 cut1.err)"
"$kpl" train "${R[@]}" device=cuda run_dir=cut --resume > cut2.txt 2> cut2.err \
  || die "resume: $(tail -5 cut2.err)"
grep -q "resumed from cut/checkpoints/ckpt-0000000007.kpl at step 7" cut2.txt || die "resume line"
losses cut > cut.loss
diff gpu.loss cut.loss > /dev/null || die "resumed losses differ: $(diff gpu.loss cut.loss | head -4)"
a=$(tail -n 1 gpu.txt) b=$(tail -n 1 cut2.txt)
[[ $(field val_loss "$a") == $(field val_loss "$b") ]] || die "final val loss $a vs $b"
echo "OK: GPU top-1 $top1, the CPU's losses to 1e-2, bit-identical again and after a resume"
