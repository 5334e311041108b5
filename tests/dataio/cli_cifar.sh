#!/usr/bin/env bash
# cli_cifar.sh KPL SOURCE_DIR: `kpl data convert --from cifar` and `--from
# images` from the command line, and as a recipe's data.convert.from.
#   - the python layout (as Python 2 wrote it) given by the folder holding
#     it: OUT/train and OUT/test with their counts, schema and classes.txt
#   - a batch cut short, a label that is no class, a pickle opcode that is
#     not read: exit 1, a message naming the file and the record or byte
#     offset, and no split left behind as if complete
#   - a folder of images without classes, nested: image and path, no
#     label; a cut PNG is named (exit 1) or skipped with --skip-bad;
#     imagefolder on a flat folder points to images
#   - kpl train converting CIFAR on first use and training on it; a
#     classification recipe on a label-free set fails naming the features
set -euo pipefail
kpl=$1 src=$2
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
die() { echo "FAIL: $*" >&2; exit 1; }
# expect_fail WHAT NEEDLE ARGS...: kpl ARGS exits 1 with NEEDLE on stderr
expect_fail() {
  local what=$1 needle=$2 rc=0
  shift 2
  "$kpl" "$@" > "$tmp/out.txt" 2> "$tmp/err.txt" || rc=$?
  [[ $rc == 1 ]] || die "$what: exit $rc (want 1): $(cat "$tmp/err.txt")"
  grep -qF -- "$needle" "$tmp/err.txt" || die "$what: message '$(cat "$tmp/err.txt")' lacks '$needle'"
}

/usr/bin/python3 "$src/tests/dataio/gen_cifar.py" "$tmp/gen" || die "gen_cifar.py (python3 with numpy)"

"$kpl" data convert --from cifar --quiet "$tmp/gen/c10py2" "$tmp/c10" > "$tmp/conv.txt"
grep -q '"out":"'"$tmp"'/c10/train","examples":25' "$tmp/conv.txt" || die "train count: $(cat "$tmp/conv.txt")"
grep -q '"out":"'"$tmp"'/c10/test","examples":9' "$tmp/conv.txt" || die "test count: $(cat "$tmp/conv.txt")"
"$kpl" data inspect "$tmp/c10/train" | tr -d ' \n' > "$tmp/inspect.json"
grep -q '"features":\[{"name":"image","type":"bytes","encoding":"raw","shape":\[32,32,3\]},{"name":"label","type":"int64"}\]' \
  "$tmp/inspect.json" || die "schema: $(cat "$tmp/inspect.json")"
grep -q '"layout":"python"' "$tmp/inspect.json" || die "attributes"
for s in train test; do
  [[ $(sed -n 1p "$tmp/c10/$s/classes.txt") == airplane && $(sed -n 10p "$tmp/c10/$s/classes.txt") == truck &&
     $(wc -l < "$tmp/c10/$s/classes.txt") == 10 ]] || die "$s/classes.txt"
  "$kpl" data verify "$tmp/c10/$s" > /dev/null || die "verify $s"
done
"$kpl" data convert --from cifar --quiet "$tmp/gen/c100/cifar-100-binary" "$tmp/c100" > /dev/null
"$kpl" data inspect "$tmp/c100/test" | tr -d ' \n' | grep -q '{"name":"coarse_label","type":"int64"}' \
  || die "CIFAR-100 coarse_label"
[[ $(wc -l < "$tmp/c100/test/coarse_classes.txt") == 20 ]] || die "coarse_classes.txt"
expect_fail "two layouts" "holds both cifar-10-batches-bin and cifar-10-batches-py" \
  data convert --from cifar --quiet "$tmp/gen/c10" "$tmp/both"

# Damage, one file each; the split it spoils is not left behind.
cp -r "$tmp/gen/c10/cifar-10-batches-bin" "$tmp/cut"
truncate -s 18000 "$tmp/cut/data_batch_3.bin"
expect_fail "cut batch" "cut/data_batch_3.bin: 18000 bytes is not a whole number of 3073-byte records" \
  data convert --from cifar --quiet "$tmp/cut" "$tmp/cut-out"
[[ ! -e $tmp/cut-out/train ]] || die "a cut batch left $tmp/cut-out/train"
cp -r "$tmp/gen/c10/cifar-10-batches-bin" "$tmp/label"
printf '\x0c' | dd of="$tmp/label/data_batch_1.bin" bs=1 seek=$((4 * 3073)) conv=notrunc status=none
expect_fail "bad label" "label/data_batch_1.bin: record 4 (byte offset 12292): label 12 is not a class (0..9)" \
  data convert --from cifar --quiet "$tmp/label" "$tmp/label-out"
cp -r "$tmp/gen/c100py2/cifar-100-python" "$tmp/opcode"
off=$(grep -abo 'coarse_labels' "$tmp/opcode/test" | head -1 | cut -d: -f1)
# the SHORT_BINSTRING opcode of the key, two bytes before its text, made LONG ('L')
printf 'L' | dd of="$tmp/opcode/test" bs=1 seek=$((off - 2)) conv=notrunc status=none
expect_fail "bad opcode" "opcode/test: pickle byte offset $((off - 2)): opcode 0x4c (LONG) is not one kpl reads" \
  data convert --from cifar --quiet "$tmp/opcode" "$tmp/opcode-out"
# the train split was fine and is complete; test is not there
"$kpl" data verify "$tmp/opcode-out/train" > /dev/null || die "train after a bad test file"
[[ ! -e $tmp/opcode-out/test ]] || die "a bad pickle left $tmp/opcode-out/test"
rc=0
"$kpl" data convert --from cifar10 "$tmp/gen" "$tmp/x" 2> "$tmp/err.txt" || rc=$?
[[ $rc == 2 ]] && grep -qF "known: idx, imagefolder, lmdb, coco, voc, voc-seg, masks, cifar and images" "$tmp/err.txt" \
  || die "unknown source: exit $rc, $(cat "$tmp/err.txt")"

# A folder of images without classes.
/usr/bin/python3 - "$tmp/faces" <<'EOF'
import os, struct, sys, zlib
def png(path, w, h, seed):
    rows = b"".join(b"\0" + bytes((x * 7 + y * 3 + seed) & 255 for x in range(3 * w)) for y in range(h))
    chunk = lambda t, d: struct.pack(">I", len(d)) + t + d + struct.pack(">I", zlib.crc32(t + d))
    data = (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(rows)) + chunk(b"IEND", b""))
    os.makedirs(os.path.dirname(path), exist_ok=True)
    open(path, "wb").write(data)
root = sys.argv[1]
for i, rel in enumerate(["train/00000/a.png", "train/00000/b.png", "train/01000/c.png", "train/d.png"]):
    png(os.path.join(root, rel), 10 + i, 12, i)
png(os.path.join(root, "bad", "ok.png"), 8, 8, 9)
open(os.path.join(root, "bad", "cut.png"), "wb").write(open(os.path.join(root, "train/d.png"), "rb").read()[:60])
EOF
"$kpl" data convert --from images --quiet "$tmp/faces/train" "$tmp/faces-out" > "$tmp/conv.txt"
grep -q '"from":"images",.*"examples":4,"skipped":0' "$tmp/conv.txt" || die "images: $(cat "$tmp/conv.txt")"
"$kpl" data inspect "$tmp/faces-out" | tr -d ' \n' > "$tmp/inspect.json"
grep -q '"features":\[{"name":"image","type":"bytes","encoding":"png"},{"name":"path","type":"string"}\]' \
  "$tmp/inspect.json" || die "images schema: $(cat "$tmp/inspect.json")"
expect_fail "cut PNG" "images: $tmp/faces/bad/cut.png: " \
  data convert --from images --quiet "$tmp/faces/bad" "$tmp/bad-out"
"$kpl" data convert --from images --quiet --skip-bad "$tmp/faces/bad" "$tmp/bad-out" > "$tmp/conv.txt" 2> "$tmp/err.txt"
grep -q '"examples":1,"skipped":1' "$tmp/conv.txt" || die "--skip-bad: $(cat "$tmp/conv.txt")"
expect_fail "imagefolder on a flat folder" "for images without classes use the images source" \
  data convert --from imagefolder --quiet "$tmp/faces/bad" "$tmp/flat-out"

# Recipes: CIFAR converted on first use, then trained on.
cat > "$tmp/cifar.yaml" <<EOF
name: cifar-e2e
task: classification
epochs: 1
max_steps: 2
threads: 1
run_dir: $tmp/run
model: {name: mlp, num_classes: 10, hidden: [16]}
data:
  root: $tmp/rec
  convert: {from: cifar, source: $tmp/gen/c100py2}
  train: {path: cifar/train, batch_size: 8}
  val: {path: cifar/test, batch_size: 8}
optimizer: {name: sgd, lr: 0.01}
log: {every_steps: 100, progress: never, tensorboard: false}
EOF
"$kpl" train "$tmp/cifar.yaml" model.num_classes=100 > "$tmp/train.txt" 2> "$tmp/train.err" \
  || die "train on CIFAR-100: $(tail -5 "$tmp/train.err")"
tail -n 1 "$tmp/train.txt" | grep -q '"event":"done"' || die "no done event: $(tail -n 1 "$tmp/train.txt")"
"$kpl" data inspect "$tmp/rec/cifar/train" | grep -q '^  "num_examples": 300,$' || die "recipe train split"
[[ -s $tmp/rec/cifar/test/classes.txt ]] || die "recipe test split's classes.txt"
# A label-free set under classification: converted, then refused by name.
sed -e "s|from: cifar, source: $tmp/gen/c100py2|from: images, source: $tmp/faces|" \
    -e "s|path: cifar/train, batch_size: 8|path: train, batch_size: 2, transform: {size: [12, 12]}|" \
    -e "s|val: {path: cifar/test, batch_size: 8}|val: {path: \"\"}|" "$tmp/cifar.yaml" > "$tmp/faces.yaml"
expect_fail "classification without labels" "label_feature 'label' is not a feature of $tmp/rec/train (it has: image, path)" \
  train "$tmp/faces.yaml"
echo "cli_cifar: ok"
