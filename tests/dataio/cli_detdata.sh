#!/usr/bin/env bash
# cli_detdata.sh KPL: `kpl data synth fmnist-det` and `kpl data convert
# --from coco|voc` end to end: a small synthetic set made twice with one
# seed (the same bytes), converted, inspected and verified; the usage
# errors (exit 2) and a bad annotation (exit 1 naming it, or with
# --skip-bad a warning and the counts on the summary line).
set -euo pipefail
kpl=$1
src=/usr/share/datasets/fashion-mnist
. "$(dirname "$0")/../skip.sh"
[[ -r $src/t10k-images-idx3-ubyte.gz ]] || kpl_skip ref "Fashion-MNIST ($src, dataset-fashion-mnist)"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
die() { echo "FAIL: $*" >&2; exit 1; }

"$kpl" data synth fmnist-det "$tmp/a" --train 30 --val 10 --size 96 --seed 4 --quiet > "$tmp/synth.out"
grep -q '"event":"synthesized","set":"fmnist-det","out":"'"$tmp"'/a","train":30,"val":10,' \
  "$tmp/synth.out" || die "synth summary: $(cat "$tmp/synth.out")"
"$kpl" data synth fmnist-det "$tmp/b" --train 30 --val 10 --size 96 --seed 4 --threads 1 --quiet > /dev/null
diff -r "$tmp/a" "$tmp/b" > /dev/null || die "the same seed gave other bytes"
[[ $(ls "$tmp/a/train" | wc -l) == 30 && $(ls "$tmp/a/val" | wc -l) == 10 ]] || die "image count"
if "$kpl" data synth fmnist-det "$tmp/a" --quiet 2> "$tmp/again.err"; then die "synth wrote into a full directory"; fi
grep -q 'holds files' "$tmp/again.err" || die "synth refusal: $(cat "$tmp/again.err")"

"$kpl" data convert --from coco "$tmp/a/train.json" "$tmp/a/train" "$tmp/rec/train" --quiet > "$tmp/conv.out"
grep -q '"from":"coco",.*"examples":30,"objects":[0-9]*,"skipped_images":0,"skipped_objects":0' \
  "$tmp/conv.out" || die "convert summary: $(cat "$tmp/conv.out")"
"$kpl" data verify "$tmp/rec/train" | grep -q '"examples":30' || die "verify"
"$kpl" data inspect "$tmp/rec/train" | tr -d ' \n' \
  | grep -q '{"name":"boxes","type":"float"},{"name":"labels","type":"int64"}' || die "inspect schema"
[[ $(head -1 "$tmp/rec/train/classes.txt") == "T-shirt/top" ]] || die "classes.txt"

# usage errors: exit 2
set +e
"$kpl" data convert --from coco "$tmp/a/train.json" "$tmp/x" 2> "$tmp/e1"; rc1=$?
"$kpl" data convert --from voc "$tmp" "$tmp/x" 2> "$tmp/e2"; rc2=$?
"$kpl" data convert --from idx --drop-empty "$src" "$tmp/x" 2> "$tmp/e3"; rc3=$?
"$kpl" data synth nosuch "$tmp/x" 2> "$tmp/e4"; rc4=$?
set -e
[[ $rc1 == 2 ]] && grep -q 'ANNOTATIONS.json, IMAGE_DIR and OUT' "$tmp/e1" || die "coco arity ($rc1)"
[[ $rc2 == 2 ]] && grep -q -- '--from voc needs --split' "$tmp/e2" || die "voc split ($rc2)"
[[ $rc3 == 2 ]] && grep -q -- '--drop-empty is for' "$tmp/e3" || die "drop-empty ($rc3)"
[[ $rc4 == 2 ]] && grep -q 'want fmnist-det OUT' "$tmp/e4" || die "synth set name ($rc4)"

# a bad annotation (the JSON is one line: the first box moves far right):
# exit 1 naming it; --skip-bad converts the rest
sed 's/"bbox":\[\([0-9]*\),/"bbox":[\1000,/' "$tmp/a/val.json" > "$tmp/bad.json"
if "$kpl" data convert --from coco "$tmp/bad.json" "$tmp/a/val" "$tmp/rec/bad" --quiet 2> "$tmp/bad.err"; then
  die "a box far outside its image was accepted"
fi
grep -q 'annotation 1 (annotations\[0\], image 1): bbox \[[0-9]*000, .* reaches outside the 96 x 96 image' \
  "$tmp/bad.err" || die "bad annotation message: $(cat "$tmp/bad.err")"
[[ ! -e $tmp/rec/bad ]] || die "a failed conversion left its output"
nann=$(grep -o '"iscrowd"' "$tmp/bad.json" | wc -l)
"$kpl" data convert --from coco "$tmp/bad.json" "$tmp/a/val" "$tmp/rec/bad" --skip-bad --quiet \
  > "$tmp/skip.out" 2> "$tmp/skip.err"
[[ $(grep -c '^kpl: skipping coco: ' "$tmp/skip.err") == 1 ]] || die "one warning: $(cat "$tmp/skip.err")"
grep -q 'skipped 0 bad images and 1 bad objects' "$tmp/skip.err" || die "skip count line"
grep -q "\"examples\":10,\"objects\":$((nann - 1)),\"skipped_images\":0,\"skipped_objects\":1," "$tmp/skip.out" \
  || die "skip summary: $(cat "$tmp/skip.out")"
echo "cli_detdata: ok"
