#!/usr/bin/env bash
# centernet_e2e.sh CASE KPL SOURCE_DIR CENTERNET_SO — a second detector head
# (examples/centernet_head.c, CenterNet) loaded as a plugin into the stock
# `kpl` and trained by the detection task, one CTest test per case:
#   train  examples/centernet_fmnistdet.yaml, narrowed, 12 epochs of 320
#          easy fmnist-det images in batches of 8: the task's COCO AP on
#          validation from 0 untrained (eval.at_start) to above 0.08
#          (0.182 measured), AP50 above 0.15 (0.349); the head's loss
#          figures in metrics.jsonl, the loss halved;
#          detections.json scores with pycocotools as kpl scored it;
#          `kpl eval` of the checkpoint prints the COCO table and the same
#          figures
#   heads  the two heads side by side: --keys lists the plugin's model
#          and its keys; without the plugin its model is unknown (exit 2);
#          with it loaded, the FCOS recipe still trains FCOS's head and a
#          centernet model CenterNet's; a bad model.centernet key names
#          the recipe's file, line and key
set -euo pipefail
case_=$1 kpl=$2 src=$3 so=$4
. "$(dirname "$0")/e2e_common.sh"
recipe=$src/examples/centernet_fmnistdet.yaml
fcos=$src/recipes/detection/fcos_r18_fmnistdet.yaml
# at_least X MIN: X is a number no smaller than MIN
at_least() { awk -v x="$1" -v m="$2" 'BEGIN { exit !(x + 0 == x && x >= m) }'; }
# the recipe's network narrowed (a 16-wide ResNet-18, 32-channel neck and heads)
SMALL=(model.width=16 model.centernet.neck_channels=32 model.centernet.head_channels=32)

case $case_ in
train)
  # the easy set of detect_fmnistdet (1-3 items of 32-64 px, little
  # occlusion); 480 steps of 8
  "$kpl" data synth fmnist-det d --train 320 --val 48 --seed 3 --objects 3 --sides 32 64 \
    --min-visible 0.9 > synth.txt || die "synth"
  D=(data.root="$tmp/d" data.convert.source="$tmp/d" "${QUIET[@]}" "${SMALL[@]}" deterministic=true)
  "$kpl" train --plugin "$so" "$recipe" "${D[@]}" optimizer.lr=0.003 data.train.batch_size=8 \
    run_dir=run epochs=12 eval.every_epochs=6 eval.at_start=true > train.txt 2> train.err || die "train: $(tail -5 train.err)"
  grep -q "^plugins: .*libkpl_centernet.so$" train.txt || die "the plugin is not named: $(head -8 train.txt)"
  grep -q "centernet_r18 (0\.[0-9]*M parameters" train.txt || die "not the plugin's model: $(grep -m1 'kpl train' train.txt)"
  done_line=$(tail -n 1 train.txt)
  echo "train: $done_line"
  [[ $(field event "$done_line") == done && $(field steps "$done_line") == 480 ]] || die "$done_line"
  # untrained (step 0) and trained, as the task reports them
  first=$(grep '"event":"eval"' run/metrics.jsonl | head -n 1)
  last=$(grep '"event":"eval"' run/metrics.jsonl | tail -n 1)
  [[ $(field step "$first") == 0 && $(field step "$last") == 480 ]] || die "evaluations: $first / $last"
  ap0=$(field val_ap "$first") ap=$(field val_ap "$last") ap50=$(field val_ap50 "$last")
  echo "AP untrained $ap0, trained $ap (AP50 $ap50)"
  awk -v x="$ap0" 'BEGIN { exit !(x + 0 == x && x < 0.01) }' || die "untrained AP $ap0 >= 0.01"
  at_least "$ap" 0.08 || die "AP $ap < 0.08 after 12 epochs (untrained: $ap0)"
  at_least "$ap50" 0.15 || die "AP50 $ap50 < 0.15 after 12 epochs"
  # the head's own losses, reported by the task under its names, falling
  for f in loss_hm loss_wh loss_off; do
    l=$(field "train_$f" "$done_line")
    at_least "$l" 0 || die "no train_$f: $done_line"
  done
  l1=$(field loss "$(grep '"event":"train"' run/metrics.jsonl | head -n 1)")
  awk -v a="$l1" -v b="$(field train_loss "$done_line")" 'BEGIN { exit !(b < a / 2) }' \
    || die "the loss did not fall: $l1 to $(field train_loss "$done_line")"
  [[ -s run/detections.json ]] || die "no run/detections.json"
  check_coco d/val.json run/detections.json "$last"
  # kpl eval of the checkpoint: the table, the same figures
  ck=run/checkpoints/ckpt-0000000480.kpl
  "$kpl" eval --plugin "$so" "$recipe" "${D[@]}" --checkpoint "$ck" \
    task.detection.save_detections=ev.json > eval.txt 2> eval.err || die "eval: $(tail -5 eval.err)"
  grep -q 'Average Precision  (AP) @\[ IoU=0.50:0.95 | area=   all | maxDets=100 \]' eval.txt \
    || die "kpl eval printed no COCO table: $(cat eval.txt)"
  ev=$(tail -n 1 eval.txt)
  [[ $(field val_ap "$ev") == "$ap" ]] || die "kpl eval's ap $(field val_ap "$ev") vs training's $ap"
  check_coco d/val.json ev.json "$ev"
  ;;

heads)
  "$kpl" data synth fmnist-det d --train 16 --val 8 --seed 5 > synth.txt || die "synth"
  D=(data.root="$tmp/d" data.convert.source="$tmp/d" "${QUIET[@]}" data.val.batch_size=8)
  "$kpl" train --keys --plugin "$so" > keys.txt
  grep -q '^  name: none  # .*|centernet|none\]$' keys.txt || die "--keys: model.name: $(grep -m1 '^  name: none' keys.txt)"
  grep -A3 "^  centernet:  # model centernet.s own keys" keys.txt | grep -q '^    neck_channels: 64  # ' \
    || die "--keys: model.centernet: $(grep -A3 '^  centernet:' keys.txt)"
  # without the plugin its model is unknown, named where it is
  expect_usage_error "no plugin" "centernet_fmnistdet.yaml:" train "$recipe" "${D[@]}" run_dir=x
  grep -q "model.name: expected one of" err.txt || die "no plugin: $(cat err.txt)"
  printf 'base: %s\nmodel:\n  centernet:\n    wh_weight: -1\n' "$recipe" > bad.yaml
  expect_usage_error "bad key" "bad.yaml:4:16: model.centernet.wh_weight: -1 is out of range [0, 100]" \
    train --plugin "$so" bad.yaml "${D[@]}"
  # with it loaded, each recipe's model finds its own head
  "$kpl" train --plugin "$so" "$fcos" "${D[@]}" model.width=16 model.fcos.fpn_channels=32 \
    model.fcos.gn_groups=8 max_steps=2 run_dir=f > f.txt 2> f.err || die "fcos: $(tail -3 f.err)"
  grep -q "fcos_r18 (" f.txt && grep -q '"train_loss_ctr":' f/metrics.jsonl || die "fcos with the plugin: $(head -8 f.txt)"
  "$kpl" train --plugin "$so" "$recipe" "${D[@]}" "${SMALL[@]}" max_steps=2 run_dir=c > c.txt 2> c.err \
    || die "centernet: $(tail -3 c.err)"
  grep -q "centernet_r18 (" c.txt && grep -q '"train_loss_hm":' c/metrics.jsonl || die "centernet: $(head -8 c.txt)"
  [[ -n $(field val_ap "$(tail -n 1 c.txt)") ]] || die "no evaluation: $(tail -n 1 c.txt)"
  ;;

*)
  die "unknown case"
  ;;
esac
echo "PASS ($case_)"
