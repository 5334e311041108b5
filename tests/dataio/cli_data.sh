#!/usr/bin/env bash
# cli_data.sh KPL: `kpl data convert/inspect/verify` end to end on Debian's
# Fashion-MNIST: the conversion's counts, a clean verify, then a flipped
# byte that verify must report (non-zero exit, naming shard file and chunk),
# an edited METADATA that inspect and verify refuse,
# and a second conversion into the same place that must refuse and keep
# the dataset intact; a conversion killed with -9: verify advises
# converting again, and converting again clears what it left and converts,
# while a live writer's files and files no writer makes are kept.
set -euo pipefail
kpl=$1
src=/usr/share/datasets/fashion-mnist
. "$(dirname "$0")/../skip.sh"
[[ -r $src/t10k-images-idx3-ubyte.gz ]] || kpl_skip ref "Fashion-MNIST ($src, dataset-fashion-mnist)"
tmp=$(mktemp -d)
# background jobs a failing check leaves behind are killed too
trap 'jobs -p | xargs -r kill -KILL 2> /dev/null; rm -rf "$tmp"' EXIT
die() { echo "FAIL: $*" >&2; exit 1; }

"$kpl" data convert --from idx --shards 2 --chunk-mb 1 --quiet "$src" "$tmp/fm" > "$tmp/convert.out"
grep -q '"out":"'"$tmp"'/fm/test","examples":10000' "$tmp/convert.out" || die "test split count"
grep -q '"out":"'"$tmp"'/fm/train","examples":60000' "$tmp/convert.out" || die "train split count"
"$kpl" data inspect "$tmp/fm/test" > "$tmp/inspect.json"
# No python on a fresh machine: the pretty-printed JSON is checked line-wise.
j="$tmp/inspect.json"
grep -q '^  "num_examples": 10000,$' "$j" || die "inspect num_examples"
grep -q '^  "num_shards": 2,$' "$j" || die "inspect num_shards"
[[ $(grep -c '^      "num_examples": ' "$j") == 2 ]] || die "inspect shard list"
tr -d ' \n' < "$j" | grep -q '"features":\[{"name":"image","type":"bytes","encoding":"raw","shape":\[28,28,1\]},{"name":"label","type":"int64"}\]' \
  || die "inspect schema"
grep -q '"num_classes": 10' "$j" || die "inspect attributes"
ratio=$(sed -n 's/^  "compression_ratio": \([0-9.]*\),$/\1/p' "$j")
awk -v r="$ratio" 'BEGIN { exit !(r > 1.2) }' || die "compression ratio '$ratio'"
"$kpl" data verify "$tmp/fm/test" | grep -q '"examples":10000' || die "verify counts"

# A flipped byte in shard 1's first chunk payload.
f="$tmp/fm/test/00001.data"
off=$((32 + 32 + 1000))
byte=$(od -An -tu1 -j "$off" -N1 "$f" | tr -d ' ')
printf "\\$(printf '%03o' $((byte ^ 0x40)))" | dd of="$f" bs=1 seek="$off" conv=notrunc status=none
if "$kpl" data verify "$tmp/fm/test" > /dev/null 2> "$tmp/verify.err"; then die "verify passed a corrupt set"; fi
grep -q '00001.data chunk 0 (offset 32): payload CRC32C mismatch' "$tmp/verify.err" \
  || die "verify message: $(cat "$tmp/verify.err")"

# Converting over an existing dataset is refused; the dataset stays readable.
if "$kpl" data convert --from idx --quiet "$src" "$tmp/fm" 2> "$tmp/again.err"; then
  die "convert wrote over an existing dataset"
fi
grep -q 'is not empty' "$tmp/again.err" || die "refusal message: $(cat "$tmp/again.err")"
"$kpl" data verify "$tmp/fm/train" > /dev/null || die "the existing train split was damaged"
# An edited METADATA is refused by inspect and verify (its checksum).
cp -r "$tmp/fm/train" "$tmp/edited"
sed -i 's/"num_classes": 10/"num_classes": 11/' "$tmp/edited/METADATA"
if "$kpl" data verify "$tmp/edited" > /dev/null 2> "$tmp/edited.err"; then die "verify passed an edited METADATA"; fi
grep -q 'METADATA checksum mismatch' "$tmp/edited.err" || die "edited METADATA message: $(cat "$tmp/edited.err")"
if "$kpl" data inspect "$tmp/edited" > /dev/null 2>&1; then die "inspect passed an edited METADATA"; fi
# A conversion killed with SIGKILL while writing leaves its WRITING marker
# and partial shards.  verify says to convert again, and that works: the
# leftovers are removed (said on stderr) and the split converted whole.
t10k=$src/t10k-images-idx3-ubyte.gz
"$kpl" data convert --from idx --zstd-level 19 --quiet "$t10k" "$tmp/k/test" > /dev/null 2>&1 &
conv=$!
for _ in $(seq 3000); do [[ -e $tmp/k/test/WRITING ]] && break; sleep 0.01; done
kill -KILL $conv
wait $conv 2> /dev/null || true
[[ -e $tmp/k/test/WRITING ]] || die "the killed conversion left no WRITING marker (too fast?)"
cp -r "$tmp/k/test" "$tmp/live" && cp -r "$tmp/k/test" "$tmp/foreign"
if "$kpl" data verify "$tmp/k/test" > /dev/null 2> "$tmp/k.err"; then die "verify passed an unfinished set"; fi
grep -q "did not finish .*; convert it again" "$tmp/k.err" || die "verify advice: $(cat "$tmp/k.err")"
# ... but not over a live writer (its marker locked, as a writer holds it)
( exec 9< "$tmp/live/WRITING"; flock -x 9; : > "$tmp/locked"; exec sleep 600 ) &
holder=$!
for _ in $(seq 1000); do [[ -e $tmp/locked ]] && break; sleep 0.01; done
before=$(ls -l --time-style=+%s.%N "$tmp/live")
if "$kpl" data verify "$tmp/live" > /dev/null 2> "$tmp/live.err"; then die "verify passed a set being written"; fi
grep -q "is still being written .*: wait for its writer to finish" "$tmp/live.err" \
  || die "verify of a live set: $(cat "$tmp/live.err")"
if "$kpl" data convert --from idx --quiet "$t10k" "$tmp/live" > /dev/null 2> "$tmp/live.err"; then
  die "convert wrote over a live writer's files"
fi
grep -q "$tmp/live is being written by another process (pid $conv " "$tmp/live.err" \
  || die "convert over a live writer: $(cat "$tmp/live.err")"
[[ $(ls -l --time-style=+%s.%N "$tmp/live") == "$before" ]] || die "a live writer's files were touched"
kill -KILL $holder
wait $holder 2> /dev/null || true
# ... nor over files that no dataset writer makes
echo mine > "$tmp/foreign/notes.txt"
if "$kpl" data convert --from idx --quiet "$t10k" "$tmp/foreign" > /dev/null 2> "$tmp/foreign.err"; then
  die "convert removed a directory with a user's file"
fi
grep -q "holds 'notes.txt', which no dataset writer makes: not removed" "$tmp/foreign.err" \
  || die "convert over foreign files: $(cat "$tmp/foreign.err")"
[[ -f $tmp/foreign/notes.txt && -f $tmp/foreign/WRITING ]] || die "foreign files were removed"
"$kpl" data convert --from idx --quiet "$t10k" "$tmp/k/test" > "$tmp/k.out" 2> "$tmp/k.err" \
  || die "converting again after a killed conversion: $(cat "$tmp/k.err")"
grep -q "removed $tmp/k/test, left unfinished by an interrupted conversion (pid $conv " "$tmp/k.err" \
  || die "no removal message naming pid $conv: $(cat "$tmp/k.err")"
grep -q '"examples":10000' "$tmp/k.out" || die "converting again: $(cat "$tmp/k.out")"
"$kpl" data verify "$tmp/k/test" | grep -q '"examples":10000' || die "the converted-again set does not verify"
# Bad arguments name the problem.
if "$kpl" data convert --from lmdbx "$src" "$tmp/x" 2> "$tmp/arg.err"; then die "bad --from"; fi
grep -q "unknown source 'lmdbx'" "$tmp/arg.err" || die "bad --from message"
echo "cli_data OK"
