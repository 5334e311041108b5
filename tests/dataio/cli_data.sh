#!/usr/bin/env bash
# cli_data.sh KPL: `kpl data convert/inspect/verify` end to end on Debian's
# Fashion-MNIST: the conversion's counts, a clean verify, then a flipped
# byte that verify must report (non-zero exit, naming shard file and chunk),
# and a second conversion into the same place that must refuse and keep
# the dataset intact.
set -euo pipefail
kpl=$1
src=/usr/share/datasets/fashion-mnist
[[ -r $src/t10k-images-idx3-ubyte.gz ]] || exit 77
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
die() { echo "FAIL: $*" >&2; exit 1; }

"$kpl" data convert --from idx --shards 2 --chunk-mb 1 --quiet "$src" "$tmp/fm" > "$tmp/convert.out"
grep -q '"out":"'"$tmp"'/fm/test","examples":10000' "$tmp/convert.out" || die "test split count"
grep -q '"out":"'"$tmp"'/fm/train","examples":60000' "$tmp/convert.out" || die "train split count"
"$kpl" data inspect "$tmp/fm/test" > "$tmp/inspect.json"
python3 - "$tmp/inspect.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
assert d["num_examples"] == 10000, d["num_examples"]
assert d["num_shards"] == 2 and sum(s["num_examples"] for s in d["shards"]) == 10000
assert [f["name"] for f in d["features"]] == ["image", "label"]
assert d["attributes"]["num_classes"] == 10
assert d["compression_ratio"] > 1.2, d["compression_ratio"]
PY
"$kpl" data verify "$tmp/fm/test" | grep -q '"examples":10000' || die "verify counts"

# A flipped byte in shard 1's first chunk payload.
python3 - "$tmp/fm/test/00001.data" <<'PY'
import sys
with open(sys.argv[1], "r+b") as f:
    f.seek(32 + 32 + 1000); b = f.read(1); f.seek(32 + 32 + 1000); f.write(bytes([b[0] ^ 0x40]))
PY
if "$kpl" data verify "$tmp/fm/test" > /dev/null 2> "$tmp/verify.err"; then die "verify passed a corrupt set"; fi
grep -q '00001.data chunk 0 (offset 32): payload CRC32C mismatch' "$tmp/verify.err" \
  || die "verify message: $(cat "$tmp/verify.err")"

# Converting over an existing dataset is refused; the dataset stays readable.
if "$kpl" data convert --from idx --quiet "$src" "$tmp/fm" 2> "$tmp/again.err"; then
  die "convert wrote over an existing dataset"
fi
grep -q 'is not empty' "$tmp/again.err" || die "refusal message: $(cat "$tmp/again.err")"
"$kpl" data verify "$tmp/fm/train" > /dev/null || die "the existing train split was damaged"
# Bad arguments name the problem.
if "$kpl" data convert --from lmdbx "$src" "$tmp/x" 2> "$tmp/arg.err"; then die "bad --from"; fi
grep -q "unknown source 'lmdbx'" "$tmp/arg.err" || die "bad --from message"
echo "cli_data OK"
