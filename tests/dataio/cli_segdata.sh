#!/usr/bin/env bash
# cli_segdata.sh KPL: the segmentation data flow end to end — `kpl data
# synth fmnist-seg` made twice with one seed (the same bytes), `kpl data
# convert --from masks` of each split, inspected and verified; --from coco
# --semantic on fmnist-det's JSON; a bad mask (exit 1 naming both files, or
# with --skip-bad a warning and the count); the usage errors (exit 2).
set -euo pipefail
kpl=$1
src=/usr/share/datasets/fashion-mnist
. "$(dirname "$0")/../skip.sh"
[[ -r $src/t10k-images-idx3-ubyte.gz ]] || kpl_skip ref "Fashion-MNIST ($src, dataset-fashion-mnist)"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
die() { echo "FAIL: $*" >&2; exit 1; }

"$kpl" data synth fmnist-seg "$tmp/D" --train 20 --val 6 --size 64 --sides 16 40 --seed 2 --quiet \
  > "$tmp/synth.out"
grep -q '"event":"synthesized","set":"fmnist-seg","out":"'"$tmp"'/D","train":20,"val":6,' \
  "$tmp/synth.out" || die "synth summary: $(cat "$tmp/synth.out")"
"$kpl" data synth fmnist-seg "$tmp/E" --train 20 --val 6 --size 64 --sides 16 40 --seed 2 --threads 1 \
  --quiet > /dev/null
diff -r "$tmp/D" "$tmp/E" > /dev/null || die "the same seed gave other bytes"
[[ $(ls "$tmp/D/train/images" | wc -l) == 20 && $(ls "$tmp/D/train/masks" | wc -l) == 20 &&
   $(ls "$tmp/D/val/masks" | wc -l) == 6 ]] || die "file counts"
[[ $(head -1 "$tmp/D/classes.txt") == background && $(wc -l < "$tmp/D/classes.txt") == 11 ]] ||
  die "classes.txt"

for s in train val; do
  "$kpl" data convert --from masks "$tmp/D/$s/images" "$tmp/D/$s/masks" "$tmp/D/rec/$s" \
    --classes "$tmp/D/classes.txt" --quiet > "$tmp/conv.out"
  grep -q '"from":"masks",.*"examples":'"$([[ $s == train ]] && echo 20 || echo 6)"',"skipped":0' \
    "$tmp/conv.out" || die "convert $s: $(cat "$tmp/conv.out")"
done
"$kpl" data verify "$tmp/D/rec/train" | grep -q '"examples":20' || die "verify"
"$kpl" data inspect "$tmp/D/rec/train" | tr -d ' \n' | grep -q \
  '{"name":"image","type":"bytes","encoding":"jpeg"},{"name":"mask","type":"bytes","encoding":"png"},{"name":"path","type":"string"}' \
  || die "inspect schema"
cmp -s "$tmp/D/classes.txt" "$tmp/D/rec/train/classes.txt" || die "classes.txt copied"

# COCO semantic masks from fmnist-det's JSON: the detection features and mask
"$kpl" data synth fmnist-det "$tmp/F" --train 8 --val 0 --size 64 --sides 16 40 --seed 2 --quiet > /dev/null
"$kpl" data convert --from coco "$tmp/F/train.json" "$tmp/F/train" "$tmp/F/rec" --semantic --quiet \
  > /dev/null
"$kpl" data inspect "$tmp/F/rec" | tr -d ' \n' | grep -q \
  '{"name":"masks","type":"string","encoding":"coco_rle"},{"name":"mask","type":"bytes","encoding":"png"}' \
  || die "coco --semantic schema"
[[ $(head -1 "$tmp/F/rec/classes.txt") == background ]] || die "coco --semantic classes.txt"

# a mask of another size: an error naming both files, or skipped
cp "$tmp/D/val/masks/000001.png" "$tmp/small.png"
"$kpl" data synth fmnist-seg "$tmp/G" --train 1 --val 0 --size 32 --sides 8 16 --quiet > /dev/null
cp "$tmp/G/train/masks/000001.png" "$tmp/D/val/masks/000002.png"
set +e
"$kpl" data convert --from masks "$tmp/D/val/images" "$tmp/D/val/masks" "$tmp/bad" --quiet 2> "$tmp/e0"
rc=$?
set -e
[[ $rc == 1 ]] || die "a mask of another size: exit $rc"
grep -q 'masks/000002.png is 32x32, image .*images/000002.jpg is 64x64' "$tmp/e0" ||
  die "size message: $(cat "$tmp/e0")"
[[ ! -e $tmp/bad ]] || die "a failed conversion left $tmp/bad"
"$kpl" data convert --from masks "$tmp/D/val/images" "$tmp/D/val/masks" "$tmp/skip" --skip-bad \
  --quiet > "$tmp/skip.out" 2> "$tmp/skip.err"
grep -q '"examples":5,"skipped":1' "$tmp/skip.out" || die "skip summary: $(cat "$tmp/skip.out")"
grep -q 'kpl: skipping masks: 000002.jpg: mask' "$tmp/skip.err" || die "skip warning"

# usage errors: exit 2
set +e
"$kpl" data convert --from masks "$tmp/D/val/images" "$tmp/x" 2> "$tmp/e1"; rc1=$?
"$kpl" data convert --from voc-seg "$tmp" "$tmp/x" 2> "$tmp/e2"; rc2=$?
"$kpl" data convert --from voc --semantic "$tmp" "$tmp/x" --split train 2> "$tmp/e3"; rc3=$?
"$kpl" data convert --from masks --masks-dir A "$tmp/a" "$tmp/b" "$tmp/x" 2> "$tmp/e4"; rc4=$?
"$kpl" data convert --from voc-seg --classes c "$tmp" "$tmp/x" --split train 2> "$tmp/e5"; rc5=$?
set -e
[[ $rc1 == 2 ]] && grep -q 'IMAGE_DIR, MASK_DIR and OUT' "$tmp/e1" || die "masks arity ($rc1)"
[[ $rc2 == 2 ]] && grep -q -- '--from voc-seg needs --split' "$tmp/e2" || die "voc-seg split ($rc2)"
[[ $rc3 == 2 ]] && grep -q -- '--semantic is for --from coco' "$tmp/e3" || die "semantic ($rc3)"
[[ $rc4 == 2 ]] && grep -q -- '--masks-dir is for --from voc-seg' "$tmp/e4" || die "masks-dir ($rc4)"
[[ $rc5 == 2 ]] && grep -q -- '--classes is for --from masks' "$tmp/e5" || die "classes ($rc5)"
echo ok
