#!/usr/bin/env bash
# train_e2e.sh CASE KPL SOURCE_DIR [GEN_IMAGEFOLDER [KPLRUN]] — `kpl train` and
# `kpl eval` end to end, one CTest test per case:
#   cli        bad recipes, overrides and arguments: exit 2 and the message
#   fmnist     the default recipe on a subset of Fashion-MNIST reaches an
#              accuracy bound; the run directory's files; kpl eval of the
#              best checkpoint gives the same top-1
#   resume     stopped by max_steps and by SIGTERM, then --resume: the same
#              loss at every step as an uninterrupted run, bit for bit
#   np2        2 ranks x 32 (mpirun) train like 1 rank x 64: the same losses
#              to 1e-4 and the same accuracy; so do 1 x (2 micro-batches of
#              32) and 2 x (2 x 16) with gradient accumulation (under
#              kplrun)
#   recompute  the ResNet-18 recipe, 4 steps: memory.recompute blocks and
#              auto (a budget between blocks' peak and none's) give the
#              same loss at every step, bit for bit, as none; each step's
#              allocator peak is lower with blocks, and under the budget with
#              auto; a budget the step cannot fit stops the run at step 1,
#              naming the module and the budget
#   imagenet   the ImageNet ResNet-50 recipe for a few steps on a generated
#              image folder converted to KPLRecord on first use
#   example    examples/autoencoder.c (a model and a task of its own, KPL is
#              that program here) learns, resumes exactly, and trains on 2
#              ranks x 64 as on 1 x 128
set -euo pipefail
case_=$1 kpl=$2 src=$3 kplrun=${5:-}
. "$(dirname "$0")/e2e_common.sh"
# Fashion-MNIST converted once per test into ./fm (the recipes' data.convert)
FM=(data.root="$tmp/fm")

case $case_ in
cli)
  recipe=$src/recipes/fashion_mnist/cnn.yaml
  expect_usage_error "unknown key" "override 'optimizer.lrr=0.1': unknown key 'optimizer.lrr' (did you mean 'optimizer.lr'?)" \
    train "$recipe" optimizer.lrr=0.1
  expect_usage_error "wrong type" "optimizer.lr: expected a number, got 'fast'" train "$recipe" optimizer.lr=fast
  printf 'base: %s\noptimizer:\n  momentum: 2\n' "$recipe" > bad.yaml
  expect_usage_error "range, with file and line" "bad.yaml:3:13: optimizer.momentum: 2 is out of range" train bad.yaml
  printf 'model: {name: cnn}\n' > missing.yaml
  expect_usage_error "missing key" "missing.yaml: missing required key 'epochs'" train missing.yaml
  # an unknown task is a bad value like any other: exit 2 naming its place,
  # for train, --print-config and eval alike
  printf 'base: %s\ntask: tracking\n' "$recipe" > task.yaml
  expect_usage_error "unknown task" "task.yaml:2:7: task: unknown task 'tracking'" train task.yaml
  expect_usage_error "unknown task, --print-config" "task.yaml:2:7: task: unknown task 'tracking'" \
    train task.yaml --print-config
  expect_usage_error "unknown task, eval" "task.yaml:2:7: task: unknown task 'tracking'" \
    eval task.yaml --checkpoint none.kpl
  expect_usage_error "unknown task, override" "override 'task=pose': task: unknown task 'pose'" \
    train "$recipe" task=pose --print-config
  # a FIFO as the recipe or as its base: refused by what it is, never
  # waited on (timeout: 124 if it hangs)
  mkfifo fifo.yaml
  printf 'base: fifo.yaml\n' > fifo_base.yaml
  for r in fifo.yaml fifo_base.yaml; do
    expect_usage_error "FIFO $r" "recipe fifo.yaml: not a regular file (a FIFO)" \
      train "$r" --print-config
  done
  # a long value is echoed cut short, and the reason is kept
  long=$(printf 'x%.0s' $(seq 950))
  expect_usage_error "long override" "optimizer.lr: expected a number, got 'xxxxxxxxxx" \
    train "$recipe" "optimizer.lr=$long"
  grep -qF "xxx...' [trainer/" err.txt || die "long override: not cut: $(cut -c 1-300 err.txt)"
  # YAML tags are refused, naming the key and the tag
  printf 'base: %s\nepochs: !!str 5\n' "$recipe" > tag.yaml
  expect_usage_error "tag" "tag.yaml:2:9: epochs: YAML tags (!!str) are not supported" \
    train tag.yaml --print-config
  expect_usage_error "no recipe" "no recipe given" train
  expect_usage_error "missing file" "recipe nothere.yaml: No such file" train nothere.yaml
  expect_usage_error "bad option" "unknown option '--fast'" train "$recipe" --fast
  expect_usage_error "eval without checkpoint" "--checkpoint FILE is required" eval "$recipe"
  "$kpl" train "$recipe" --print-config optimizer.lr=0.25 > cfg.yaml
  grep -q '^  lr: 0.25$' cfg.yaml || die "--print-config lacks the override"
  grep -q '^    initial_fill: 4096$' cfg.yaml || die "--print-config lacks a default"
  "$kpl" train --keys > keys.txt
  grep -q '^  momentum: 0  # sgd, lars: momentum$' keys.txt || die "--keys"
  # docs/recipes.md lists the same keys
  sed -n '/^```yaml$/,/^```$/p' "$src/docs/recipes.md" | sed '1d;$d' > doc_keys.txt
  diff keys.txt doc_keys.txt > /dev/null || die "docs/recipes.md's key list differs from kpl train --keys"
  # a dataset that is missing is named, and nothing is left behind
  set +e
  "$kpl" train "$recipe" data.convert.from=none data.root="$tmp/none" run_dir="$tmp/r" \
    > out.txt 2> err.txt
  rc=$?
  set -e
  [[ $rc == 1 ]] || die "missing dataset: exit $rc"
  grep -q "$tmp/none/train" err.txt || die "missing dataset message: $(cat err.txt)"
  # recomputation: a mode that does not exist; a model with no blocks
  expect_usage_error "recompute mode" \
    "memory.recompute: expected one of none, blocks, auto; got 'all'" \
    train "$recipe" memory.recompute=all
  expect_usage_error "auto without a budget" "memory.recompute: auto needs memory.budget_mb" \
    train "$recipe" memory.recompute=auto
  expect_usage_error "budget without auto" "memory.budget_mb is for memory.recompute: auto (it is blocks)" \
    train "$recipe" memory.recompute=blocks memory.budget_mb=100
  set +e
  "$kpl" train "$src/recipes/fashion_mnist/lenet.yaml" memory.recompute=blocks \
    run_dir="$tmp/rl" > out.txt 2> err.txt
  rc=$?
  set -e
  [[ $rc == 1 ]] || die "recompute of lenet: exit $rc"
  grep -q "memory.recompute: blocks, but model lenet marks no blocks" err.txt \
    || die "recompute of lenet: $(cat err.txt)"
  ! ls "$tmp"/rl/checkpoints/*.kpl > /dev/null 2>&1 || die "recompute of lenet wrote a checkpoint"
  ;;

recompute)
  need_fm
  R=("$src/recipes/fashion_mnist/resnet18.yaml" "${FM[@]}" "${QUIET[@]}" max_steps=4
     deterministic=true log.every_steps=1 eval.every_epochs=0)
  peaks() { sed -n 's/.*"event":"timing".*"peak_mb":\([^,}]*\).*/\1/p' "$1/metrics.jsonl"; }
  "$kpl" train "${R[@]}" run_dir=none > none.txt 2> none.err || die "none: $(tail -3 none.err)"
  "$kpl" train "${R[@]}" run_dir=blocks memory.recompute=blocks > blocks.txt 2> blocks.err \
    || die "blocks: $(tail -3 blocks.err)"
  grep -q "memory.recompute: 9 blocks of model run again" blocks.txt || die "$(head -5 blocks.txt)"
  pn=$(peaks none | sort -g | tail -n 1) pb=$(peaks blocks | sort -g | tail -n 1)
  budget=$(awk -v a="$pn" -v b="$pb" 'BEGIN { printf "%d", (a + b) / 2 }')
  "$kpl" train "${R[@]}" run_dir=auto memory.recompute=auto memory.budget_mb="$budget" \
    > auto.txt 2> auto.err || die "auto under $budget MiB (none $pn, blocks $pb): $(tail -3 auto.err)"
  for m in blocks auto; do
    losses none > none.loss
    losses $m > $m.loss
    [[ $(wc -l < none.loss) == 4 ]] || die "none: $(wc -l < none.loss) steps"
    cmp -s none.loss $m.loss || die "$m's losses differ: $(paste none.loss $m.loss)"
  done
  awk -v a="$pn" -v b="$pb" 'BEGIN { exit !(b < 0.8 * a) }' || die "blocks peak $pb MiB, none $pn"
  for p in $(peaks auto); do
    awk -v p="$p" -v b="$budget" 'BEGIN { exit !(p <= b) }' || die "auto: peak $p MiB over $budget"
  done
  # blocks runs 8 of its 9 units again (not the last); auto fewer, but some
  rec() { sed -n 's/.*"event":"timing".*"recomputed_per_step":\([^,}]*\).*/\1/p' "$1/metrics.jsonl"; }
  [[ $(rec blocks | sort -u) == 8.0 ]] || die "blocks recomputed $(rec blocks | paste -sd' ') a step"
  ra=$(rec auto | tail -n 1)
  awk -v r="$ra" 'BEGIN { exit !(r >= 1 && r < 8) }' || die "auto recomputed $(rec auto | paste -sd' ')"
  ! grep -q recomputed_per_step none/metrics.jsonl || die "none reports recomputation"
  echo "peaks: none $pn MiB, blocks $pb, auto under $budget: $(peaks auto | paste -sd' '); auto recomputed $ra a step"
  set +e
  "$kpl" train "${R[@]}" run_dir=tiny memory.recompute=auto memory.budget_mb=40 > tiny.txt 2> tiny.err
  rc=$?
  set -e
  [[ $rc == 1 ]] || die "a budget too small: exit $rc"
  grep -q "over the memory budget of 40.00 MiB on cpu" tiny.err || die "tiny: $(cat tiny.err)"
  grep -q "asked for in '" tiny.err || die "tiny names no module: $(cat tiny.err)"
  ! grep -q '"event":"train"' tiny/metrics.jsonl 2> /dev/null || die "tiny took a step"
  ;;

fmnist)
  need_fm
  # The default recipe on a fifth of the training set for 2 epochs (188
  # steps of 128, ~20 s): >= 85% on 2000 test images (87.6% measured; an
  # untrained model has 10%).  The whole recipe, 5 epochs on all 60000,
  # gives 92.2%.
  "$kpl" train "$src/recipes/fashion_mnist/cnn.yaml" "${FM[@]}" "${QUIET[@]}" run_dir=run \
    epochs=2 data.train.limit=12000 data.val.limit=2000 > out.txt 2> err.txt \
    || die "train failed: $(tail -5 err.txt)"
  done_=$(tail -n 1 out.txt)
  [[ $(field event "$done_") == done ]] || die "the last line is not the done event: $done_"
  top1=$(field val_top1 "$done_")
  awk -v a="$top1" 'BEGIN { exit !(a >= 85) }' || die "val top-1 $top1 < 85"
  awk -v e="$(field epochs "$done_")" 'BEGIN { exit !(e == 2) }' || die "epochs: $done_"
  [[ $(field run_dir "$done_") == run ]] || die "run_dir: $done_"
  for f in run/config.yaml run/metrics.jsonl run/logs/rank-00000.log; do
    [[ -s $f ]] || die "$f missing"
  done
  ls run/tb/events.out.tfevents.* > /dev/null || die "no TensorBoard event file"
  [[ $(grep -c '"event":"epoch"' run/metrics.jsonl) == 2 ]] || die "epoch records"
  [[ $(grep -c '"event":"eval"' run/metrics.jsonl) == 2 ]] || die "eval records"
  grep -q '^  lr: 0.05$' run/config.yaml || die "config.yaml"
  grep -q '^    limit: 12000$' run/config.yaml || die "config.yaml lacks the override"
  # keep_last 2: the two newest of the epoch checkpoints, with markers; best.kpl
  n=$(ls run/checkpoints/ckpt-*.kpl | wc -l)
  [[ $n == 2 ]] || die "$n checkpoints kept, expected 2"
  for c in run/checkpoints/ckpt-*.kpl run/checkpoints/best.kpl; do
    [[ -f $c.done ]] || die "$c has no completion marker"
  done
  ! ls run/checkpoints/*.tmp 2> /dev/null || die "a .tmp file was left"
  best=$(sed -n 's/.*"best_top1":\([^,]*\),.*/\1/p' <<<"$done_")
  "$kpl" eval "$src/recipes/fashion_mnist/cnn.yaml" "${FM[@]}" data.val.limit=2000 \
    --checkpoint run/checkpoints/best.kpl > eval.txt 2> eval.err || die "eval: $(cat eval.err)"
  e=$(tail -n 1 eval.txt)
  [[ $(field val_top1 "$e") == "$best" ]] || die "eval top-1 $(field val_top1 "$e") != best $best"
  grep -q '^confusion' eval.txt || die "no confusion matrix"
  # kpl eval reads only the split it evaluates: the same top-1 with no
  # training split given, or none on disk; where nothing was converted yet
  # it converts the validation split alone
  EV=("$src/recipes/fashion_mnist/cnn.yaml" data.val.limit=2000 --checkpoint run/checkpoints/best.kpl)
  mkdir valonly && cp -r fm/test valonly/test
  for how in "${FM[*]} data.train.path=" "data.root=$tmp/valonly data.convert.from=none" \
             "data.root=$tmp/fresh"; do
    # shellcheck disable=SC2086 # $how: the overrides of this way
    "$kpl" eval "${EV[@]}" $how > eval2.txt 2> eval2.err || die "eval with $how: $(cat eval2.err)"
    e=$(tail -n 1 eval2.txt)
    [[ $(field val_top1 "$e") == "$best" ]] || die "eval with $how: top-1 $(field val_top1 "$e") != best $best"
  done
  [[ -f fresh/test/METADATA && ! -e fresh/train ]] || die "eval converted more than its split: $(ls fresh)"
  # a checkpoint of another model is refused, naming the tensor
  set +e
  "$kpl" eval "$src/recipes/fashion_mnist/cnn.yaml" "${FM[@]}" model.width=16 \
    --checkpoint run/checkpoints/best.kpl > /dev/null 2> eval.err
  rc=$?
  set -e
  [[ $rc == 1 ]] && grep -q "tensor 'model.conv1.weight' has shape (32,1,3,3), the model's has (16,1,3,3)" eval.err \
    || die "mismatched checkpoint: exit $rc, $(cat eval.err)"
  ;;

resume)
  need_fm
  R=("$src/recipes/fashion_mnist/cnn.yaml" "${FM[@]}" "${QUIET[@]}" deterministic=true threads=2
     epochs=2 data.train.limit=2560 data.val.limit=1000 log.every_steps=1)
  "$kpl" train "${R[@]}" run_dir=full > full.txt 2> full.err || die "full run: $(tail -3 full.err)"
  losses full > full.loss
  [[ $(wc -l < full.loss) == 40 ]] || die "full run: $(wc -l < full.loss) steps logged"
  # parameter groups: lr x 2 with every parameter at lr_mult 0.5 is the same
  # run bit for bit (halving is exact); a pattern matching nothing is named
  "$kpl" train "${R[@]}" run_dir=grp optimizer.lr=0.1 'optimizer.groups=[{params: "*", lr_mult: 0.5}]' \
    max_steps=8 > grp.txt 2> grp.err || die "groups run: $(tail -3 grp.err)"
  grep -q "optimizer group '\*': 10 parameters, lr x 0.5" grp.txt || die "no group line: $(head -5 grp.txt)"
  losses grp > grp.loss
  head -n 8 full.loss | diff - grp.loss > /dev/null || die "groups changed the losses: $(head -n 8 full.loss | diff - grp.loss | head -4)"
  set +e
  "$kpl" train "${R[@]}" run_dir=grp2 'optimizer.groups=[{params: "layer1.*"}]' > /dev/null 2> grp2.err
  rc=$?
  set -e
  [[ $rc == 1 ]] && grep -q "optimizer group 1 ('layer1.\*') matches none of the 10 parameters" grp2.err \
    || die "a group matching nothing: exit $rc: $(cat grp2.err)"
  # stopped by max_steps in the first epoch, resumed to the end
  "$kpl" train "${R[@]}" run_dir=cut max_steps=13 > cut1.txt 2> cut1.err || die "cut run: $(tail -3 cut1.err)"
  [[ -f cut/checkpoints/ckpt-0000000013.kpl.done ]] || die "no checkpoint at step 13"
  "$kpl" train "${R[@]}" run_dir=cut --resume > cut2.txt 2> cut2.err || die "resume: $(tail -3 cut2.err)"
  grep -q "resumed from cut/checkpoints/ckpt-0000000013.kpl at step 13" cut2.txt || die "resume line"
  losses cut > cut.loss
  diff full.loss cut.loss > /dev/null || die "resumed losses differ: $(diff full.loss cut.loss | head -4)"
  a=$(tail -n 1 full.txt) b=$(tail -n 1 cut2.txt)
  [[ $(field val_loss "$a") == $(field val_loss "$b") ]] || die "final val loss $a vs $b"
  # stopped by SIGTERM wherever it lands, resumed from that checkpoint
  "$kpl" train "${R[@]}" run_dir=sig > sig1.txt 2> sig1.err &
  pid=$!
  for _ in $(seq 600); do
    grep -q '"step":3,' sig/metrics.jsonl 2> /dev/null && break
    sleep 0.1
  done
  kill -TERM $pid
  set +e
  wait $pid
  rc=$?
  set -e
  [[ $rc == 143 ]] || die "SIGTERM: exit $rc, expected 143: $(tail -3 sig1.err)"
  tail -n 1 sig1.txt | grep -q '"event":"interrupted"' || die "no interrupted event"
  grep -q '"why":"signal"' sig/metrics.jsonl || die "no checkpoint on SIGTERM"
  "$kpl" train "${R[@]}" run_dir=sig --resume > sig2.txt 2> sig2.err || die "resume after SIGTERM: $(tail -3 sig2.err)"
  losses sig > sig.loss
  diff full.loss sig.loss > /dev/null || die "losses after SIGTERM differ: $(diff full.loss sig.loss | head -4)"
  # --resume with nothing to resume from says so
  set +e
  "$kpl" train "${R[@]}" run_dir=empty --resume > /dev/null 2> none.err
  rc=$?
  set -e
  [[ $rc == 1 ]] && grep -q "no complete checkpoint in empty/checkpoints" none.err || die "empty resume: $rc $(cat none.err)"
  ;;

np2)
  need_fm
  command -v mpirun > /dev/null || kpl_skip env "no mpirun"
  # LeNet has no batch norm, so 2 x 32 is the same step as 1 x 64; one
  # thread per rank on both sides keeps the summation orders alike.  At the
  # recipe's lr (0.05) LeNet's first steps are chaotic: a 1e-7 difference
  # in rounding grows tenfold per step from step ~30 (measured), so the
  # comparison runs at lr 0.02, where 40 steps stay within 1e-7.
  R=("$src/recipes/fashion_mnist/lenet.yaml" "${FM[@]}" "${QUIET[@]}" deterministic=true threads=1
     epochs=1 data.train.limit=2560 data.val.limit=1000 log.every_steps=1 optimizer.lr=0.02)
  "$kpl" train "${R[@]}" run_dir=one data.train.batch_size=64 > one.txt 2> one.err || die "1 rank: $(tail -3 one.err)"
  mpirun --allow-run-as-root --oversubscribe -np 2 "$kpl" train "${R[@]}" run_dir=two \
    data.train.batch_size=32 > two.txt 2> two.err || die "2 ranks: $(tail -5 two.err)"
  losses one > one.loss
  losses two > two.loss
  [[ $(wc -l < one.loss) == 40 && $(wc -l < two.loss) == 40 ]] || die "steps: $(wc -l < one.loss) vs $(wc -l < two.loss)"
  close_losses one.loss two.loss || die "2 ranks x 32 differ from 1 x 64"
  a=$(tail -n 1 one.txt) b=$(tail -n 1 two.txt)
  [[ $(field ranks "$b") == 2 ]] || die "ranks: $b"
  awk -v x="$(field val_loss "$a")" -v y="$(field val_loss "$b")" 'BEGIN { d = x - y; exit !(d <= 1e-5 * x && d >= -1e-5 * x) }' \
    || die "val loss $(field val_loss "$a") vs $(field val_loss "$b")"
  [[ -s two/logs/rank-00001.log ]] || die "rank 1 wrote no log"
  # gradient accumulation: 2 micro-batches of 32 make the step of 64 too,
  # and so do 2 ranks x 2 micro-batches of 16
  "$kpl" train "${R[@]}" run_dir=acc data.train.batch_size=32 optimizer.accumulate=2 \
    > acc.txt 2> acc.err || die "accumulate: $(tail -3 acc.err)"
  # (this one through kplrun: its environment and binding change nothing)
  "$kplrun" -np 2 --log-dir kplrun-logs -- "$kpl" train "${R[@]}" run_dir=acc2 \
    data.train.batch_size=16 optimizer.accumulate=2 > acc2.txt 2> acc2.err || die "2 ranks accumulate: $(tail -5 acc2.err)"
  grep -q '^\[r0\] {"event":"done",.*"ranks":2' acc2.txt || die "kplrun's console: $(tail -3 acc2.txt)"
  [[ -s kplrun-logs/rank-00001.log ]] || die "kplrun kept no log of rank 1"
  for r in acc acc2; do
    losses $r > $r.loss
    [[ $(wc -l < $r.loss) == 40 ]] || die "$r: $(wc -l < $r.loss) steps"
    close_losses one.loss $r.loss || die "$r differs from 1 x 64"
  done
  ;;

imagenet)
  gen=$4
  "$gen" folder 4 6 3 || die "gen_imagefolder"
  # the real recipe, shrunk only in what it reads and how long it runs
  "$kpl" train "$src/recipes/imagenet/resnet50.yaml" "${QUIET[@]}" run_dir=run \
    data.root="$tmp/in" data.convert.source="$tmp/folder" data.convert.shards=2 \
    data.workers=1 data.train.batch_size=4 data.val.batch_size=4 max_steps=3 \
    log.every_steps=1 > out.txt 2> err.txt || die "train: $(tail -5 err.txt)"
  done_=$(tail -n 1 out.txt)
  [[ $(field event "$done_") == done && $(field steps "$done_") == 3 ]] || die "$done_"
  grep -q 'resnet50 (25.56M parameters, input 3x224x224)' out.txt || die "model line: $(head -3 out.txt)"
  [[ -f in/train/METADATA && -f in/val/METADATA && -f in/train/classes.txt ]] || die "conversion"
  [[ $(field examples "$(grep '"event":"eval"' run/metrics.jsonl)") == 12 ]] || die "eval examples"
  # lr: 0.1 x 4 / 256, the first step 10% of it (warmup from 0.1)
  lr=$(field lr "$(grep '"event":"train","step":1,' run/metrics.jsonl)")
  awk -v l="$lr" 'BEGIN { exit !(l > 0.99 * 0.1 * 4 / 256 * 0.1 && l < 0.1 * 4 / 256 * 0.11) }' \
    || die "lr at step 1: $lr"
  ;;
example)
  need_fm
  ex=$kpl
  R=("$src/examples/autoencoder.yaml" "${FM[@]}" "${QUIET[@]}" deterministic=true threads=1
     epochs=1 data.train.limit=12800 data.val.limit=1000 log.every_steps=1)
  "$ex" "${R[@]}" run_dir=one data.train.batch_size=128 > one.txt 2> one.err || die "1 rank: $(tail -3 one.err)"
  d=$(tail -n 1 one.txt)
  awk -v m="$(field val_mse "$d")" 'BEGIN { exit !(m > 0 && m < 0.03) }' || die "val mse: $d"
  losses one > one.loss
  [[ $(wc -l < one.loss) == 100 ]] || die "steps: $(wc -l < one.loss)"
  awk 'NR == 1 { f = $2 } END { exit !($2 < f / 3) }' one.loss || die "the loss did not fall: $(sed -n '1p;$p' one.loss)"
  # the task's TensorBoard image: 2 rows (inputs, reconstructions) of 8 28x28 images, a PNG
  ev=$(ls one/tb/events.out.tfevents.*)
  grep -aq "val/reconstructions" "$ev" && grep -aq $'\x89PNG' "$ev" || die "no image in $ev"
  /usr/bin/python3 - "$ev" <<'PY' || die "image event: wrong size"
import struct, sys, zlib
data = open(sys.argv[1], "rb").read()
i = data.index(b"\x89PNG")
w, h = struct.unpack(">II", data[i + 16:i + 24])  # IHDR
sys.exit(0 if (w, h) == (8 * 28, 2 * 28) else 1)
PY
  # stopped at step 40, resumed: every step's loss as the uninterrupted run's
  "$ex" "${R[@]}" run_dir=cut data.train.batch_size=128 max_steps=40 > /dev/null 2> cut.err || die "cut: $(tail -3 cut.err)"
  "$ex" "${R[@]}" run_dir=cut data.train.batch_size=128 --resume > cut.txt 2> cut2.err || die "resume: $(tail -3 cut2.err)"
  grep -q "resumed from cut/checkpoints/ckpt-0000000040.kpl at step 40" cut.txt || die "resume line: $(head -3 cut.txt)"
  losses cut | diff - one.loss > /dev/null || die "resumed losses differ: $(losses cut | diff - one.loss | head -4)"
  # 2 ranks x 64 (mpirun): the same steps to 1e-4
  if command -v mpirun > /dev/null; then
    mpirun --allow-run-as-root --oversubscribe -np 2 "$ex" "${R[@]}" run_dir=two \
      data.train.batch_size=64 > two.txt 2> two.err || die "2 ranks: $(tail -5 two.err)"
    losses two > two.loss
    close_losses one.loss two.loss || die "2 ranks x 64 differ from 1 x 128"
  fi
  # the recipe says which task it is for: another name with the
  # autoencoder's keys is refused as the recipe is read (exit 2); a recipe
  # naming another task, by the program's trainer (exit 1)
  set +e
  "$ex" "${R[@]}" run_dir=x task=detection > /dev/null 2> task.err
  rc=$?
  set -e
  [[ $rc == 2 ]] && grep -q "task.autoencoder: keys of task 'autoencoder', but task.name is 'detection'" task.err \
    || die "task keys mismatch: exit $rc: $(cat task.err)"
  sed '/^task:/,/^    noise:/d' "$src/examples/autoencoder.yaml" > other.yaml
  printf 'task: tracking\n' >> other.yaml
  R[0]=other.yaml
  set +e
  "$ex" "${R[@]}" run_dir=x > /dev/null 2> task.err
  rc=$?
  set -e
  [[ $rc == 1 ]] && grep -q "the recipe's task is 'tracking', the program's is 'autoencoder'" task.err \
    || die "task mismatch: exit $rc: $(cat task.err)"
  ;;
*)
  echo "train_e2e.sh: unknown case '$case_'" >&2
  exit 2
  ;;
esac
echo "train_e2e $case_ OK"
