#!/usr/bin/env bash
# precision_e2e.sh CASE KPL SOURCE_DIR — mixed precision end to end, one
# CTest test per case:
#   bf16     the default recipe with precision=bf16 on a fifth of the
#            training set for 2 epochs: >= 85% on 2000 test images and
#            within 1 point of the same run in f32
#   fp16     the dynamic loss scale from a start far too high: overflowing
#            steps are skipped and halve the scale, each run of
#            loss_scale.interval good steps doubles it (checked record by
#            record in metrics.jsonl), and the model still learns
#   resume   fp16 stopped after 12 steps and resumed: the losses and the
#            loss scale of steps 13..24 equal an uninterrupted run's
#   errors   a bad precision, loss scale or tf32 is refused, naming the key;
#            good ones reach the resolved recipe
set -euo pipefail
case_=$1 kpl=$2 src=$3
. "$(dirname "$0")/e2e_common.sh"
FM=(data.root="$tmp/fm")
recipe=$src/recipes/fashion_mnist/cnn.yaml

# scale_rule METRICS INIT INTERVAL: every train record obeys the scaler's rule
scale_rule() {
  /usr/bin/python3 - "$1" "$2" "$3" <<'PY'
import json, sys
path, scale, interval = sys.argv[1], float(sys.argv[2]), int(sys.argv[3])
good, skips, n, grew = 0, 0, 0, 0
for line in open(path):
    r = json.loads(line)
    if r.get("event") != "train":
        continue
    n += 1
    if r["overflow_skips"] == skips + 1:
        scale *= 0.5
        good = 0
    elif r["overflow_skips"] == skips:
        good += 1
        if good == interval:
            scale *= 2
            good = 0
            grew += 1
    else:
        sys.exit("step %d: overflow_skips went from %d to %d" % (r["step"], skips, r["overflow_skips"]))
    skips = r["overflow_skips"]
    # (the records carry 9 significant digits)
    if abs(r["loss_scale"] - scale) > 1e-7 * scale:
        sys.exit("step %d: loss_scale %g, the rule gives %g" % (r["step"], r["loss_scale"], scale))
if n < 30 or skips < 5 or grew < 1:
    sys.exit("%d records, %d overflow skips, %d growths: the rule was not exercised" % (n, skips, grew))
print("%d steps: %d overflow skips, %d growths, final scale %g" % (n, skips, grew, scale))
PY
}

case $case_ in
bf16)
  need_fm
  for p in f32 bf16; do
    "$kpl" train "$recipe" "${FM[@]}" "${QUIET[@]}" run_dir=run_$p precision=$p epochs=2 \
      data.train.limit=12000 data.val.limit=2000 > out_$p.txt 2> err_$p.txt \
      || die "$p: train failed: $(tail -5 err_$p.txt)"
  done
  grep -q "precision bf16: convolutions and matmuls in bf16" run_bf16/logs/rank-00000.log \
    || grep -q "precision bf16: cpu has no native bf16" run_bf16/logs/rank-00000.log \
    || die "the log does not say how bf16 runs: $(head -3 run_bf16/logs/rank-00000.log)"
  a=$(field val_top1 "$(tail -n 1 out_f32.txt)") b=$(field val_top1 "$(tail -n 1 out_bf16.txt)")
  echo "val top-1: f32 $a, bf16 $b"
  awk -v a="$a" -v b="$b" 'BEGIN { exit !(b >= 85 && b >= a - 1) }' \
    || die "bf16 top-1 $b (f32 $a): below 85 or more than 1 point behind"
  ;;
fp16)
  need_fm
  "$kpl" train "$recipe" "${FM[@]}" "${QUIET[@]}" run_dir=run precision=fp16 \
    loss_scale.init=1e12 loss_scale.interval=4 log.every_steps=1 max_steps=60 \
    data.train.limit=12000 data.val.limit=500 > out.txt 2> err.txt \
    || die "train failed: $(tail -5 err.txt)"
  scale_rule run/metrics.jsonl 1e12 4 || die "the loss scale broke its rule"
  first=$(grep -m1 '"event":"train"' run/metrics.jsonl) last=$(grep '"event":"train"' run/metrics.jsonl | tail -n 1)
  awk -v a="$(field loss "$first")" -v b="$(field loss "$last")" 'BEGIN { exit !(b < 0.8 * a) }' \
    || die "fp16 did not learn: loss $(field loss "$first") -> $(field loss "$last")"
  ;;
resume)
  need_fm
  A=("$recipe" "${FM[@]}" "${QUIET[@]}" precision=fp16 deterministic=true loss_scale.init=1e9
     loss_scale.interval=3 log.every_steps=1 data.train.limit=6000 data.val.limit=200
     eval.every_epochs=0)
  "$kpl" train "${A[@]}" run_dir=full max_steps=24 > /dev/null 2> err.txt || die "full: $(tail -3 err.txt)"
  "$kpl" train "${A[@]}" run_dir=part max_steps=12 > /dev/null 2> err.txt || die "part: $(tail -3 err.txt)"
  "$kpl" train "${A[@]}" run_dir=part max_steps=24 --resume > /dev/null 2> err.txt \
    || die "resume: $(tail -3 err.txt)"
  keep() { grep '"event":"train"' "$1" | sed -n 's/.*"step":\([0-9]*\).*"loss":\([^,]*\),.*"loss_scale":\([^,]*\),.*/\1 \2 \3/p' | awk '$1 > 12'; }
  keep full/metrics.jsonl > a.txt
  keep part/metrics.jsonl > b.txt
  [[ $(wc -l < a.txt) == 12 ]] || die "expected 12 records after step 12: $(cat a.txt)"
  diff a.txt b.txt > /dev/null || die "resumed run differs: $(diff a.txt b.txt | head -5)"
  ;;
errors)
  expect_usage_error "precision" "precision: expected one of f32, fp16, bf16; got 'f8'" train "$recipe" precision=f8 --print-config
  expect_usage_error "backoff" "loss_scale.backoff: 2 is out of range" train "$recipe" \
    loss_scale.backoff=2 --print-config
  expect_usage_error "tf32" "tf32: expected true or false, got 'maybe'" train "$recipe" \
    tf32=maybe --print-config
  "$kpl" train "$recipe" tf32=true precision=bf16 --print-config > cfg.txt 2> err.txt \
    || die "tf32=true: $(cat err.txt)"
  grep -q '^tf32: true$' cfg.txt && grep -q '^precision: bf16$' cfg.txt \
    || die "the resolved recipe lacks tf32/precision: $(head -20 cfg.txt)"
  ;;
*) die "unknown case" ;;
esac
echo "ok ($case_)"
