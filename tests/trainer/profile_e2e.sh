#!/usr/bin/env bash
# profile_e2e.sh CASE KPL SOURCE_DIR FAULT_INJECT — the step profiler and the
# timing records end to end (docs/profiling.md), one CTest test per case;
# profile_check.py (/usr/bin/python3, standard library) reads the files:
#   np2        2 ranks (mpirun) of LeNet on Fashion-MNIST with
#              profile.steps=[3,5], log.every_steps=2: each rank's trace has
#              the fixed layout, parses, holds steps 3..5 only with their
#              spans nested, module spans covering LeNet's five layers,
#              buckets moving its 61706 x 4 gradient bytes each step; the
#              timing records at every second step add up, name a rank
#              and count the same bytes
#   straggler  the same with rank 1 slowed by 100 ms per waitpid(2)
#              (fault_inject.so's KPL_DELAY, which only that rank loads):
#              every timing record after the first (the first step's
#              one-time work) names rank 1, a median of over 200 ms a step
#              slower
#   single     one process, across an epoch's end and past the window's
#              end by a stop: its trace (no allreduce lane events), its
#              records (no communication, slowest rank 0); a run stopped
#              inside the window writes the steps it did
#   errors     bad profile.steps values: exit 2 naming the key; a window
#              past the run's last step: a warning at its end, no trace
#   kplrun     np2 under kplrun: the ranks' traces merged into one
#              (LOG_DIR/profile.trace.json) holding exactly their events
#   memory     profile.memory over step 3 of LeNet: the blocks live at the
#              peak add up to it, and it to the allocator's peak in the
#              timing record within 2%; each parameter and its momentum a
#              block of its size, the saved tensors' holders naming an op
#              and a module, the trace's counter reaching the peak
#              (profile_check.py memory); without profile.steps: refused
set -euo pipefail
# fault_inject.so is preloaded before an ASan build's runtime (straggler)
export ASAN_OPTIONS=${ASAN_OPTIONS:+$ASAN_OPTIONS:}verify_asan_link_order=0
case_=$1 kpl=$2 src=$3 inject=${4:-}
. "$(dirname "$0")/e2e_common.sh"
check=$(dirname "$0")/profile_check.py
[[ -x /usr/bin/python3 ]] || kpl_skip ref "/usr/bin/python3"
# LeNet-5 on 28x28: conv1 6x1x5x5+6, conv2 16x6x5x5+16, fc1 120x400+120,
# fc2 84x120+84, fc3 10x84+10 (f32: 4 bytes each)
ELEMENTS=$((6 * 25 + 6)),$((16 * 6 * 25 + 16)),$((120 * 400 + 120)),$((84 * 120 + 84)),$((10 * 84 + 10))
GRAD_BYTES=$(( (6 * 25 + 6 + 16 * 6 * 25 + 16 + 120 * 400 + 120 + 84 * 120 + 84 + 10 * 84 + 10) * 4 ))
R=("$src/recipes/fashion_mnist/lenet.yaml" data.root="$tmp/fm" "${QUIET[@]}" epochs=1
   data.train.limit=1280 data.val.limit=500 log.every_steps=2 log.tensorboard=false)
# 2 ranks x 32: 20 steps an epoch; 8 of them
NP2=("${R[@]}" data.train.batch_size=32 max_steps=8 profile.steps=[3,5])

case $case_ in
np2)
  need_fm
  command -v mpirun > /dev/null || kpl_skip env "no mpirun"
  mpirun --allow-run-as-root --oversubscribe -np 2 "$kpl" train "${NP2[@]}" run_dir=run \
    > out.txt 2> err.txt || die "2 ranks: $(tail -5 err.txt)"
  /usr/bin/python3 "$check" trace run 2 3 5 "$GRAD_BYTES" "$ELEMENTS" || die "trace"
  /usr/bin/python3 "$check" timing run 2 "$GRAD_BYTES" 2,4,6,8 || die "timing records"
  # rank 0's console says each record in a line
  [[ $(grep -cE '^timing: [0-9.]+ ms/step = data [0-9.]+ \+ compute [0-9.]+ \+ exposed comm [0-9.]+ \+ optimizer [0-9.]+ \+ other [0-9.]+ \| peak [0-9]+ MB \| slowest rank [01] \([0-9.]+ ms\)$' out.txt) == 4 ]] \
    || die "console: $(grep timing out.txt)"
  # every rank says where its profile went (kplrun merges them)
  [[ $(grep -c 'profile: steps 3-5 written to' out.txt) == 2 ]] || die "console: $(grep profile out.txt)"
  ;;
kplrun)
  # the same job under kplrun: the ranks' profiles merged into one trace
  # in kplrun's log directory, a track per rank
  need_fm
  kplrun=$(dirname "$kpl")/kplrun
  [[ -x $kplrun ]] || die "no kplrun beside $kpl"
  "$kplrun" -np 2 --log-dir logs -- "$kpl" train "${NP2[@]}" run_dir=run > out.txt 2> err.txt ||
    die "kplrun: $(tail -5 err.txt)"
  grep -q "^kplrun: the step profiles of 2 ranks merged into .*/logs/profile.trace.json" err.txt ||
    die "kplrun's merge line: $(grep profile err.txt)"
  /usr/bin/python3 -c '
import json, os, sys
ranks = sorted(f for f in os.listdir(sys.argv[1]) if f.endswith(".trace.json"))
per = [json.load(open(os.path.join(sys.argv[1], f)))["traceEvents"] for f in ranks]
merged = json.load(open(sys.argv[2]))["traceEvents"]
want = sorted(json.dumps(e, sort_keys=True) for evs in per for e in evs)
got = sorted(json.dumps(e, sort_keys=True) for e in merged)
assert len(ranks) == 2, ranks
assert got == want, "the merged trace is not the ranks events (%d vs %d)" % (len(got), len(want))
assert {e["pid"] for e in merged} == {0, 1}, "tracks: %r" % {e["pid"] for e in merged}
print("merged: %d events of 2 ranks" % len(merged))
' run/profile logs/profile.trace.json || die "the merged trace"
  ;;
straggler)
  need_fm
  command -v mpirun > /dev/null || kpl_skip env "no mpirun"
  [[ -f $inject ]] || die "no fault_inject.so"
  # rank 1 alone loads the library: an MPMD launch of the same command
  mpirun --allow-run-as-root --oversubscribe -np 1 "$kpl" train "${NP2[@]}" run_dir=run : \
    -np 1 env LD_PRELOAD="$inject" KPL_DELAY=waitpid:100 "$kpl" train "${NP2[@]}" run_dir=run \
    > out.txt 2> err.txt || die "2 ranks: $(tail -5 err.txt)"
  # its loader asks after its 2 processes once per batch (and the
  # validation loader's 2 once per step): 400 ms a step; 200 leaves room
  # for a loaded machine (an ASan build next to other tests once made rank
  # 0 370 ms slower over a window of 2 steps, when the delay was 160 ms)
  /usr/bin/python3 "$check" timing run 2 "$GRAD_BYTES" 2,4,6,8 1 200 || die "timing records"
  /usr/bin/python3 "$check" trace run 2 3 5 "$GRAD_BYTES" "$ELEMENTS" || die "trace"
  grep -qE '^timing: .* \| slowest rank 1 \([0-9.]+ ms\)$' out.txt || die "console: $(grep timing out.txt)"
  ;;
single)
  need_fm
  # 1 x 64 over 640 examples: 10 steps an epoch; records at 2, 4, ..., 10
  # (the epoch's end), 12, 14; the window 9..11 crosses the epoch's end
  S=("${R[@]}" epochs=2 data.train.limit=640 data.train.batch_size=64 max_steps=14)
  "$kpl" train "${S[@]}" run_dir=one profile.steps=[9,11] > out.txt 2> err.txt || die "train: $(tail -3 err.txt)"
  /usr/bin/python3 "$check" trace one 1 9 11 0 "$ELEMENTS" || die "trace"
  /usr/bin/python3 "$check" timing one 1 0 2,4,6,8,10,12,14 EPOCH=10 || die "timing records"
  grep -qE '^timing: [0-9.]+ ms/step = data [0-9.]+ \+ compute [0-9.]+ \+ exposed comm 0\.0 \+ optimizer [0-9.]+ \+ other [0-9.]+ \| peak [0-9]+ MB$' out.txt \
    || die "console: $(grep timing out.txt)"
  # max_steps inside the window: the steps done are written
  "$kpl" train "${S[@]}" run_dir=short max_steps=4 profile.steps=[3,7] > out2.txt 2> err2.txt \
    || die "train: $(tail -3 err2.txt)"
  /usr/bin/python3 "$check" trace short 1 3 4 0 "$ELEMENTS" || die "trace of a run that ended inside its window"
  # a window the run never reaches: no file, no line
  "$kpl" train "${S[@]}" run_dir=never max_steps=2 profile.steps=[5,6] > out3.txt 2> err3.txt \
    || die "train: $(tail -3 err3.txt)"
  [[ ! -e never/profile ]] && ! grep -q 'profile:' never/logs/rank-00000.log || die "a profile of steps never run"
  # off by default: no profile directory either
  "$kpl" train "${S[@]}" run_dir=off max_steps=2 > out4.txt 2> err4.txt || die "train: $(tail -3 err4.txt)"
  [[ ! -e off/profile ]] || die "a profile directory without profile.steps"
  ;;
errors)
  recipe=$src/recipes/fashion_mnist/lenet.yaml
  expect_usage_error "last before first" \
    "profile.steps: expected [first, last] with first <= last, got [5, 3]" train "$recipe" 'profile.steps=[5, 3]'
  expect_usage_error "step 0" "profile.steps: 0 is out of range [1, " train "$recipe" 'profile.steps=[0, 2]'
  expect_usage_error "one value" "profile.steps: expected [first, last] (or [] for none)" \
    train "$recipe" profile.steps=4
  printf 'base: %s\nprofile:\n  steps: [4, 2]\n' "$recipe" > bad.yaml
  expect_usage_error "file and line" "bad.yaml:3:10: profile.steps: expected [first, last] with first <= last" \
    train bad.yaml
  # a window past the run's last step: said at the end, no trace
  need_fm
  "$kpl" train "${R[@]}" run_dir=past max_steps=3 'profile.steps=[10, 12]' > past.txt 2> past.err \
    || die "a window past the end: $(tail -3 past.err)"
  grep -q "profile.steps \[10, 12\]: the run ended at step 3 without training any of those steps: no trace written" \
    past.txt past.err || die "no warning: $(tail -3 past.err)"
  ! ls past/profile/*.trace.json > /dev/null 2>&1 || die "a trace was written"
  ;;
memory)
  need_fm
  "$kpl" train "${R[@]}" run_dir=mem max_steps=4 log.every_steps=1 'profile.steps=[3, 3]' \
    profile.memory=true > mem.txt 2> mem.err || die "profile.memory: $(tail -3 mem.err)"
  P=conv1.weight:150,conv1.bias:6,conv2.weight:2400,conv2.bias:16,fc1.weight:48000,fc1.bias:120
  P=$P,fc2.weight:10080,fc2.bias:84,fc3.weight:840,fc3.bias:10
  /usr/bin/python3 "$check" memory mem 3 "$P" || die "memory profile"
  expect_usage_error "memory without steps" \
    "profile.memory: true needs profile.steps, the steps it profiles" \
    train "$src/recipes/fashion_mnist/lenet.yaml" profile.memory=true
  ;;
*) die "unknown case" ;;
esac
echo "OK ($case_)"
