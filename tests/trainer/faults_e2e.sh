#!/usr/bin/env bash
# faults_e2e.sh CASE KPL SOURCE_DIR FAULT_TOOLS FAULT_INJECT_SO — kpl train
# attacked from outside, one CTest test per case:
#   convert    a `kpl data convert` still writing when kpl train starts is
#              waited for (both finish, both datasets whole); the leftovers
#              of a convert killed with SIGKILL are removed and converted
#              again; an empty leftover directory is used as it is
#   kill9      SIGKILL of the trainer inside checkpoint saves (in the data,
#              at the fsync, before the rename, in the marker, before the
#              marker's rename: LD_PRELOAD fault_inject.so) and at random
#              steps; every --resume starts from the newest complete
#              checkpoint, the leftovers are removed, and every step's loss
#              is the uninterrupted run's, bit for bit (deterministic)
#   loader     SIGKILL of a training transformer process, and of a
#              validation one while that loader sits idle: a clear error
#              naming the process within 2 s (the time is printed)
#   disk       a checkpoint on a full file system (a 5 MB tmpfs in a
#              private mount namespace): a clear error, the previous
#              checkpoint intact and complete, no temporary file left
#   corrupt    a flipped byte in a shard: the error names the shard file
#              and chunk; truncated JPEGs: the error names the example and
#              its source path, skip_corrupt drops and counts them; an
#              evaluation that fails after its epoch's checkpoint loses
#              nothing, and --resume runs it first
#   nonfinite  a checkpoint whose weights are NaN: kpl eval prints the
#              figures and exits 1; training from it stops with a clear
#              message, or skips steps under loss.nonfinite: skip until
#              loss.max_skips; a checkpoint whose metadata says step -5, or
#              has no step, is named as such; a run whose steps are all
#              skipped (max_skips 0: no limit) reports null figures and the
#              same skip count in every record, never the last good epoch's
#   rundir     a second run in a live run's directory is refused at once,
#              naming the holder's pid, and touches nothing; the first one
#              ends well; a killed run's lock is taken over by --resume
#   optimizer  a resume whose optimizer changed (another rule, momentum
#              on/off) is refused naming both; --reset-optimizer starts the
#              optimizer state fresh; a changed momentum value or lr is not
#              a change of state
set -euo pipefail
case_=$1 kpl=$2 src=$3 tools=$4 inject=$5
. "$(dirname "$0")/e2e_common.sh"
# A sanitizer build preloads its runtime; fault_inject.so comes after it.
export ASAN_OPTIONS=${ASAN_OPTIONS:+$ASAN_OPTIONS:}verify_asan_link_order=0
CNN=$src/recipes/fashion_mnist/cnn.yaml
# run NAME CMD...: runs CMD with stdout/stderr in NAME.out/NAME.err; $rc
run() {
  local name=$1
  shift
  set +e
  "$@" > "$name.out" 2> "$name.err"
  rc=$?
  set -e
}
# expect_fail NAME NEEDLE CMD...: exit 1 and NEEDLE in stderr
expect_fail() {
  local name=$1 needle=$2
  shift 2
  run "$name" "$@"
  [[ $rc == 1 ]] || die "$name: exit $rc, expected 1: $(tail -3 "$name.err")"
  grep -qF -- "$needle" "$name.err" || die "$name: stderr lacks '$needle': $(tail -3 "$name.err")"
}
# wait_for FILE PATTERN: until FILE matches PATTERN (a bound against a
# hang, not a speed limit: sanitizer builds on a busy machine are slow)
wait_for() {
  for _ in $(seq 6000); do
    grep -q -- "$2" "$1" 2> /dev/null && return 0
    sleep 0.1
  done
  die "timed out waiting for '$2' in $1"
}

case $case_ in
convert)
  need_fm
  # a conversion still under way when the trainer starts: waited for
  "$kpl" data convert --from idx --zstd-level 19 --quiet "$fm" R > conv.out 2> conv.err &
  conv=$!
  for _ in $(seq 600); do [[ -e R/test/WRITING || -e R/train/METADATA ]] && break; sleep 0.05; done
  run train "$kpl" train "$CNN" "${QUIET[@]}" data.root=R run_dir=r max_steps=2 data.val.limit=200
  wait $conv || die "kpl data convert failed while kpl train waited: $(cat conv.err)"
  [[ $rc == 0 ]] || die "kpl train failed: $(tail -3 train.err)"
  grep -q "waiting for another conversion" train.out || die "train did not wait: $(head -3 train.out)"
  ! grep -q "removed" train.err || die "train removed something: $(cat train.err)"
  for s in train test; do "$kpl" data verify R/$s > /dev/null || die "R/$s does not verify"; done
  # a conversion killed while writing: what it left is removed, converted again
  "$kpl" data convert --from idx --zstd-level 19 --quiet "$fm" K > /dev/null 2>&1 &
  conv=$!
  for _ in $(seq 6000); do [[ -e K/test/WRITING ]] && break; sleep 0.02; done
  kill -KILL $conv
  wait $conv || true
  [[ -e K/test/WRITING ]] || die "the killed conversion left no WRITING marker (too fast?)"
  run train2 "$kpl" train "$CNN" "${QUIET[@]}" data.root=K run_dir=r2 max_steps=2 data.val.limit=200
  [[ $rc == 0 ]] || die "train after a killed conversion: $(tail -3 train2.err)"
  grep -q "removed K/test, left unfinished by an interrupted conversion (pid $conv " train2.err \
    || die "no removal warning naming pid $conv: $(cat train2.err)"
  "$kpl" data verify K/test > /dev/null || die "K/test does not verify"
  # an empty directory (a writer killed before its marker): used as it is
  mkdir -p E/train
  run train3 "$kpl" train "$CNN" "${QUIET[@]}" data.root=E run_dir=r3 max_steps=1 data.val.limit=200
  [[ $rc == 0 ]] || die "train into an empty split directory: $(tail -3 train3.err)"
  # a directory with something else in it is refused, and kept
  mkdir -p F/train && echo mine > F/train/notes.txt
  expect_fail train4 "F/train exists but is not a usable dataset" \
    "$kpl" train "$CNN" "${QUIET[@]}" data.root=F run_dir=r4 max_steps=1
  [[ -f F/train/notes.txt ]] || die "a user's file was removed"
  ;;

kill9)
  need_fm
  R=("$CNN" "${QUIET[@]}" data.root="$tmp/fm" deterministic=true threads=2 epochs=2
     data.train.limit=2560 data.val.limit=500 log.every_steps=1)
  run full "$kpl" train "${R[@]}" run_dir=full
  [[ $rc == 0 ]] || die "full run: $(tail -3 full.err)"
  losses full > full.loss
  [[ $(wc -l < full.loss) == 40 ]] || die "full run: $(wc -l < full.loss) steps logged"
  K=("${R[@]}" run_dir=k checkpoint.every_steps=3 checkpoint.keep_last=2)
  # Each round is killed at one point of a save (the checkpoint of this
  # small CNN is ~25 zstd writes), the next resumes; two more rounds are
  # killed at a random step.  The last one runs to the end.
  faults=("write:.kpl.tmp:30" "fsync:.kpl.tmp:2" "rename:.kpl.tmp:2" "write:.done.tmp:2"
          "rename:.done.tmp:3" "random" "random" "")
  kills=0 cleaned=0
  for f in "${faults[@]}"; do
    args=("${K[@]}")
    ls k/checkpoints/ckpt-*.kpl.done > /dev/null 2>&1 && args+=(--resume)
    if [[ $f == random ]]; then
      # Killed once it has logged a random step a few steps ahead of the
      # newest logged one: chosen by progress, not by time, so that a fast
      # machine cannot finish the run before the kill (a timed kill did).
      n0=$(losses k | wc -l)
      last=$(losses k | tail -n 1 | cut -d' ' -f1)
      target=$(( ${last:-0} + 1 + RANDOM % 4 ))
      ((target <= 30)) || die "too few steps left for a random kill (newest step $last)"
      "$kpl" train "${args[@]}" > round.out 2> round.err &
      pid=$!
      until losses k | tail -n +$((n0 + 1)) | awk -v t=$target '$1 >= t { f = 1 } END { exit !f }'; do
        kill -0 $pid 2> /dev/null || break
        sleep 0.005
      done
      kill -KILL $pid 2> /dev/null || true
      set +e; wait $pid; rc=$?; set -e
      [[ $rc == 137 ]] || die "random kill at step $target: exit $rc: $(tail -3 round.err)"
    elif [[ -n $f ]]; then
      run round env LD_PRELOAD="$inject" KPL_FAULT="$f" "$kpl" train "${args[@]}"
      [[ $rc == 137 ]] || die "fault $f: exit $rc, expected 137 (SIGKILL): $(tail -3 round.err)"
    else
      run round "$kpl" train "${args[@]}"
      [[ $rc == 0 ]] || die "the last resume failed: $(tail -3 round.err)"
    fi
    [[ $rc == 137 ]] && kills=$((kills + 1))
    grep -q "unfinished checkpoint file" round.err && cleaned=$((cleaned + 1))
    # every checkpoint with a marker is whole: the next round resumes from
    # the newest (kpl_checkpoint_load checks every byte)
    if [[ ${args[-1]} == --resume ]]; then
      grep -q "^resumed from k/checkpoints/ckpt-" round.out || [[ $rc == 137 ]] \
        || die "round $f did not resume: $(head -3 round.out)"
    fi
  done
  ((kills == 7)) || die "only $kills rounds were killed"
  ((cleaned >= 2)) || die "leftovers of interrupted saves were removed in only $cleaned rounds"
  ! ls k/checkpoints/*.tmp > /dev/null 2>&1 || die "temporary files left: $(ls k/checkpoints)"
  for c in k/checkpoints/ckpt-*.kpl k/checkpoints/best.kpl; do
    [[ -f $c.done ]] || die "$c has no marker after the last run"
  done
  # every step logged, in any round, has the uninterrupted run's loss
  losses k | sort -n -k1,1 -u > k.steps
  [[ $(wc -l < k.steps) == 40 ]] || die "steps logged: $(wc -l < k.steps)"
  losses k | sort -n -k1,1 | join - full.loss | awk '$2 != $3 { print "step " $1 ": " $2 " vs " $3; bad = 1 } END { exit bad }' \
    || die "a resumed step's loss differs from the uninterrupted run"
  # metrics.jsonl read as docs/recipes.md says: at each resume record, the
  # records before it with a larger step are dropped; then every step has
  # one train record, and the resume records' "superseded" add up to what
  # was dropped
  read -r trains dups dropped claimed < <(awk '
    { step = ""; if (match($0, /"step":[0-9]+/)) step = substr($0, RSTART + 7, RLENGTH - 7) + 0 }
    step == "" { next }
    /^\{"event":"resume"/ {
      m = 0
      for (i = 1; i <= n; i++) if (s[i] <= step) { m++; s[m] = s[i]; tr[m] = tr[i] } else dropped++
      n = m
      if (match($0, /"superseded":[0-9]+/)) claimed += substr($0, RSTART + 13, RLENGTH - 13)
      next
    }
    { n++; s[n] = step; tr[n] = /^\{"event":"train"/ }
    END { for (i = 1; i <= n; i++) if (tr[i]) { trains++; if (seen[s[i]]++) dups++ }
          print trains + 0, dups + 0, dropped + 0, claimed + 0 }' k/metrics.jsonl)
  [[ $trains == 40 && $dups == 0 ]] || die "metrics.jsonl read by the rule: $trains train records, $dups twice"
  ((dropped > 0)) || die "no record was superseded after $kills kills"
  [[ $dropped == "$claimed" ]] || die "resume records say $claimed superseded, the rule drops $dropped"
  a=$(tail -n 1 full.out) b=$(tail -n 1 round.out)
  [[ $(field val_loss "$a") == $(field val_loss "$b") ]] || die "final val loss $a vs $b"
  echo "kill9: $kills rounds killed, leftovers removed in $cleaned, $dropped records superseded"
  ;;

loader)
  need_fm
  L=("$CNN" "${QUIET[@]}" data.root="$tmp/fm" data.workers=1 epochs=3 data.val.limit=500
     log.every_steps=1)
  run prep "$kpl" train "${L[@]}" run_dir=prep max_steps=1
  [[ $rc == 0 ]] || die "prep: $(tail -3 prep.err)"
  # kpl looks at its loaders between steps: it must stop at the first step
  # boundary after the death and exit at once.  How long a step takes
  # depends on the machine's load (seconds when the cores are shared), so
  # the time allowed is 2 s (a sanitizer build: 20 s) beyond three of the
  # slowest step seen before the kill, and the steps run after the kill are
  # counted.
  bound=2
  ldd "$kpl" | grep -q 'libasan\|libubsan' && bound=20
  # children in order of creation: train reader, train transformer, val
  # reader, val transformer (data.workers 1)
  for which in 1 3; do
    "$kpl" train "${L[@]}" run_dir=l$which > l$which.out 2> l$which.err &
    pid=$!
    wait_for l$which/metrics.jsonl '"event":"train","step":10,'
    kids=($(ps --ppid $pid -o pid= | sort -n))
    ((${#kids[@]} == 4)) || die "expected 4 loader processes, found ${#kids[@]}"
    victim=${kids[$which]}
    before=$(grep -c '"event":"train"' l$which/metrics.jsonl)
    t0=$(date +%s.%N)
    kill -KILL "$victim"
    set +e; wait $pid; rc=$?; set -e
    t1=$(date +%s.%N)
    [[ $rc == 1 ]] || die "loader process killed: exit $rc"
    grep -q "pid $victim" l$which.err || die "the error does not name pid $victim: $(cat l$which.err)"
    grep -qi "signal 9\|killed" l$which.err || die "the error does not say how it died: $(cat l$which.err)"
    [[ $which == 1 ]] || grep -q "validation loader of" l$which.err || die "not named as the validation loader: $(cat l$which.err)"
    # the step in flight at the kill may end, and the one after it when
    # the kill came while its batch was being taken; no more
    after=$(( $(grep -c '"event":"train"' l$which/metrics.jsonl) - before ))
    ((after <= 2)) || die "kpl ran $after steps after its loader process died"
    slowest=$(grep '"event":"train"' l$which/metrics.jsonl | head -n "$before" \
      | sed 's/.*"time":\([0-9.]*\).*/\1/' | awk 'NR > 1 && $1 - p > m { m = $1 - p } { p = $1 } END { printf "%.3f", m }')
    secs=$(awk -v a="$t0" -v b="$t1" 'BEGIN { printf "%.2f", b - a }')
    allowed=$(awk -v b="$bound" -v s="$slowest" 'BEGIN { printf "%.2f", b + 3 * s }')
    echo "loader: killed process $which ($victim), kpl exited after $secs s ($after steps; slowest step before $slowest s)"
    awk -v s="$secs" -v b="$allowed" 'BEGIN { exit !(s < b) }' \
      || die "kpl took $secs s (more than $allowed) to stop after its loader process died"
    sleep 0.3
    ! ps --ppid $pid -o pid= > /dev/null || die "processes left behind"
  done
  ;;

disk)
  need_fm
  command -v unshare > /dev/null || kpl_skip env "no unshare"
  unshare -m --propagation private true 2> /dev/null || kpl_skip env "no mount namespaces"
  run prep "$kpl" train "$CNN" "${QUIET[@]}" data.root="$tmp/fm" run_dir=prep max_steps=1 data.val.path=
  [[ $rc == 0 ]] || die "prep: $(tail -3 prep.err)"
  # A 5 MB tmpfs in a private mount namespace (gone with it): the first
  # checkpoint (~3.1 MB) fits, the second does not.  What is left on it is
  # looked at, and copied out, from inside.
  cat > inner.sh << 'EOF'
mount -t tmpfs -o size=5m tmpfs d || exit 77
"$@" > full.out 2> full.err
echo $? > rc.txt
ls -a d/checkpoints > ls.txt
cp d/checkpoints/ckpt-0000000002.kpl d/checkpoints/ckpt-0000000002.kpl.done .
EOF
  mkdir -p d
  set +e
  unshare -m --propagation private bash inner.sh \
    "$kpl" train "$CNN" "${QUIET[@]}" data.root="$tmp/fm" run_dir=d data.train.limit=1280 \
    checkpoint.every_steps=2 checkpoint.keep_last=0 data.val.path= epochs=1
  rc=$?
  set -e
  [[ $rc == 77 ]] && kpl_skip env "cannot mount a tmpfs"
  [[ $rc == 0 && $(cat rc.txt) == 1 ]] || die "full disk: exit $(cat rc.txt 2> /dev/null): $(tail -3 full.err)"
  grep -q "ckpt-0000000004.kpl.tmp: write failed: No space left on device" full.err \
    || die "no clear error: $(tail -3 full.err)"
  grep -qx "ckpt-0000000002.kpl" ls.txt && grep -qx "ckpt-0000000002.kpl.done" ls.txt \
    || die "the previous checkpoint is gone: $(cat ls.txt)"
  ! grep -q "tmp\|ckpt-0000000004" ls.txt || die "left behind: $(cat ls.txt)"
  # and that checkpoint is whole: a run resumes from it
  run resume "$kpl" train "$CNN" "${QUIET[@]}" data.root="$tmp/fm" run_dir=again \
    data.train.limit=1280 data.val.path= epochs=1 max_steps=3 --resume ckpt-0000000002.kpl
  [[ $rc == 0 ]] && grep -q "resumed from ckpt-0000000002.kpl at step 2" resume.out \
    || die "the checkpoint before the full disk does not resume: $(tail -3 resume.err)"
  ;;

corrupt)
  need_fm
  # a flipped byte in the middle of a shard
  run prep "$kpl" data convert --from idx --quiet "$fm" fm
  [[ $rc == 0 ]] || die "convert: $(cat prep.err)"
  size=$(stat -c %s fm/train/00000.data)
  printf '\xff' | dd of=fm/train/00000.data bs=1 seek=$((size / 2)) conv=notrunc status=none
  expect_fail shard "00000.data" "$kpl" train "$CNN" "${QUIET[@]}" data.root="$tmp/fm" run_dir=s \
    data.convert.from=none epochs=1 data.val.path=
  grep -q "chunk" shard.err || die "the shard error names no chunk: $(cat shard.err)"
  # truncated JPEGs: 12 of 600 training images, none of the validation ones
  "$tools" baddata bad/train 600 50 && "$tools" baddata bad/val 200 0 || die "fault_tools baddata"
  B=("$CNN" "${QUIET[@]}" data.root="$tmp/bad" data.convert.from=none data.train.path=train
     data.val.path=val data.train.shuffle=none data.train.interleave=false
     data.train.transform.flip=0 data.train.transform.size=28 data.val.transform.size=28
     epochs=1 data.train.batch_size=50 data.val.batch_size=50)
  expect_fail img "img_49.jpg" "$kpl" train "${B[@]}" run_dir=i
  grep -q "example 49" img.err || die "the image error names no example: $(cat img.err)"
  run skip "$kpl" train "${B[@]}" run_dir=j data.train.skip_corrupt=true epochs=2
  [[ $rc == 0 ]] || die "skip_corrupt: $(tail -3 skip.err)"
  last=$(grep '"event":"train"' j/metrics.jsonl | tail -n 1)
  [[ $(field skipped_examples "$last") == 24 ]] || die "skipped examples: $last"
  [[ $(grep -c "img_49.jpg" skip.err) == 2 ]] || die "each skip is warned once per epoch: $(grep -c img_49.jpg skip.err)"
  # an evaluation that fails after the epoch: its checkpoint is there, and
  # --resume runs the evaluation first
  rm -rf bad/val && "$tools" baddata bad/val 200 40
  expect_fail ev "img_39.jpg" "$kpl" train "${B[@]}" run_dir=e data.train.skip_corrupt=true epochs=2
  [[ -f e/checkpoints/ckpt-0000000012.kpl.done ]] || die "the epoch's checkpoint was not written before its evaluation"
  run ev2 "$kpl" train "${B[@]}" run_dir=e data.train.skip_corrupt=true epochs=2 \
    data.val.skip_corrupt=true --resume
  [[ $rc == 0 ]] || die "resume after a failed evaluation: $(tail -3 ev2.err)"
  grep -q "evaluating the resumed checkpoint first" ev2.out || die "the pending evaluation did not run first"
  first=$(grep '"event":"eval"' e/metrics.jsonl | head -n 1)
  [[ $(field step "$first") == 12 && $(field skipped_examples "$first") == 5 ]] || die "pending eval: $first"
  [[ $(field examples "$first") == 195 ]] || die "pending eval examples: $first"
  [[ -f e/checkpoints/best.kpl.done ]] || die "no best.kpl"
  ;;

nonfinite)
  need_fm
  N=("$CNN" "${QUIET[@]}" data.root="$tmp/fm" data.train.limit=1280 data.val.limit=500)
  # (no evaluation in this run: a checkpoint waiting for one would be
  # evaluated first when resumed)
  run base "$kpl" train "${N[@]}" run_dir=b max_steps=3 data.val.path=
  [[ $rc == 0 ]] || die "base: $(tail -3 base.err)"
  "$tools" poison b/checkpoints/ckpt-0000000003.kpl nan.kpl || die "fault_tools poison"
  run ev "$kpl" eval "${N[@]}" --checkpoint nan.kpl
  [[ $rc == 1 ]] || die "kpl eval of NaN weights: exit $rc"
  grep -q "500 of 500 validation examples gave NaN or inf outputs" ev.err || die "eval message: $(cat ev.err)"
  e=$(grep '"event":"eval"' ev.out)
  [[ $(field val_top1 "$e") =~ ^0(\.0*)?$ && $(field nonfinite "$e") == 500 && $(field val_loss "$e") == null ]] \
    || die "eval figures: $e"
  # and kpl eval of a healthy checkpoint says nothing of the kind
  run ok "$kpl" eval "${N[@]}" --checkpoint b/checkpoints/ckpt-0000000003.kpl
  [[ $rc == 0 && $(field nonfinite "$(grep '"event":"eval"' ok.out)") == 0 ]] || die "healthy eval: $rc"
  expect_fail stop "the loss is NaN at step 4" "$kpl" train "${N[@]}" run_dir=s --resume nan.kpl
  expect_fail skip "3 steps in a row up to step 6 had a NaN or inf loss" \
    "$kpl" train "${N[@]}" run_dir=k loss.nonfinite=skip loss.max_skips=3 --resume nan.kpl
  [[ $(grep -c "its update is skipped" skip.err) == 3 ]] || die "skip warnings: $(cat skip.err)"
  # metadata that lies is named for what it is
  "$tools" meta b/checkpoints/ckpt-0000000003.kpl neg.kpl train.step -5 || die "fault_tools meta"
  expect_fail neg "neg.kpl: metadata train.step is negative, expected an integer >= 0" \
    "$kpl" train "${N[@]}" run_dir=n --resume neg.kpl
  "$tools" meta b/checkpoints/ckpt-0000000003.kpl nostep.kpl train '{"epoch": 0}' || die "fault_tools meta"
  expect_fail nostep "nostep.kpl: not a training checkpoint (metadata train.step missing)" \
    "$kpl" train "${N[@]}" run_dir=n --resume nostep.kpl
  # every step after the first few skipped, with no limit (max_skips 0):
  # the run ends (0: the recipe asked for no limit), and every record
  # says what happened; 10 steps an epoch, 3 epochs
  run allskip "$kpl" train "${N[@]}" run_dir=z model.name=mlp optimizer.lr=1e6 epochs=3 \
    loss.nonfinite=skip loss.max_skips=0 log.every_steps=5
  [[ $rc == 0 ]] || die "allskip: exit $rc: $(tail -3 allskip.err)"
  mapfile -t ep < <(grep '"event":"epoch"' z/metrics.jsonl)
  [[ ${#ep[@]} == 3 ]] || die "allskip: ${#ep[@]} epoch records"
  total=0
  for e in "${ep[@]}"; do
    s=$(field skipped_steps "$e")
    [[ $s =~ ^[0-9]+$ ]] || die "allskip: an epoch record without skipped_steps: $e"
    total=$((total + s))
  done
  for k in 1 2; do
    [[ $(field train_loss "${ep[$k]}") == null && $(field train_acc "${ep[$k]}") == null && \
       $(field skipped_steps "${ep[$k]}") == 10 ]] || die "allskip: epoch $((k + 1)): ${ep[$k]}"
  done
  d=$(tail -n 1 allskip.out)
  last=$(grep '"event":"train"' z/metrics.jsonl | tail -n 1)
  [[ $(grep -c '"event":"train"' z/metrics.jsonl) == 6 ]] || die "allskip: a train record per report: $(grep -c '"event":"train"' z/metrics.jsonl)"
  [[ $(field skipped_steps "$d") == "$total" && $(field skipped_steps "$last") == "$total" && \
     $(field train_loss "$d") == null ]] || die "allskip: done $d, last train record $last, epochs' sum $total"
  "$tools" meta-get z/checkpoints/ckpt-0000000030.kpl train.skipped_steps > sk.txt || die "fault_tools meta-get"
  [[ $(cat sk.txt) == "$total" ]] || die "allskip: the checkpoint counts $(cat sk.txt) skipped steps, the records $total"
  grep -q "epoch 3/3: train loss nan acc nan .*(10 of its 10 steps skipped: NaN or inf)" allskip.out \
    || die "allskip: the console's epoch line: $(grep 'epoch 3/3:' allskip.out)"
  ;;

rundir)
  need_fm
  L=("$CNN" "${QUIET[@]}" data.root="$tmp/fm" data.train.limit=2560 data.val.limit=500 epochs=4
     checkpoint.every_steps=5 log.every_steps=1)
  run prep "$kpl" train "${L[@]}" run_dir=prep max_steps=1
  [[ $rc == 0 ]] || die "prep: $(tail -3 prep.err)"
  "$kpl" train "${L[@]}" run_dir=t > a.out 2> a.err &
  a=$!
  wait_for t/metrics.jsonl '"step":2,'
  run b "$kpl" train "${L[@]}" run_dir=t
  [[ $rc == 1 ]] || die "the second run: exit $rc, expected 1: $(tail -3 b.err)"
  grep -qF "run directory t is in use by another run (pid $a on host $(hostname)" b.err \
    || die "the second run's message: $(cat b.err)"
  set +e; wait $a; arc=$?; set -e
  [[ $arc == 0 ]] || die "the first run failed beside the second: $(tail -3 a.err)"
  ! grep -q "unfinished\|rename" a.err || die "the first run lost files: $(cat a.err)"
  [[ $(grep -c '"event":"done"' t/metrics.jsonl) == 1 && $(grep -c '"event":"resume"' t/metrics.jsonl) == 0 ]] \
    || die "metrics.jsonl has another run's records"
  [[ $(grep -c "[0-9] kpl train fashion_mnist_cnn: " t/logs/rank-00000.log) == 1 ]] \
    || die "the second run wrote into the first one's log"
  for c in t/checkpoints/ckpt-*.kpl; do [[ -f $c.done ]] || die "$c is incomplete"; done
  # a run killed outright leaves its lock free: --resume takes it over
  "$kpl" train "${L[@]}" run_dir=k > k1.out 2> k1.err &
  k=$!
  wait_for k/metrics.jsonl '"why":"steps"'
  kill -KILL $k
  set +e; wait $k; set -e
  run k2 "$kpl" train "${L[@]}" run_dir=k --resume
  [[ $rc == 0 ]] || die "resume after a killed run: exit $rc: $(tail -3 k2.err)"
  grep -q "run directory k: the run before this one (pid $k on host .*) ended without releasing it; taken over" k2.out \
    || die "the takeover is not said: $(head -3 k2.out)"
  [[ ! -s k/.kpl-run.lock ]] || die "a finished run left its lock described: $(cat k/.kpl-run.lock)"
  ;;

optimizer)
  need_fm
  O=("$CNN" "${QUIET[@]}" data.root="$tmp/fm" data.train.limit=1280 data.val.limit=500 epochs=2)
  run base "$kpl" train "${O[@]}" run_dir=o epochs=1
  [[ $rc == 0 ]] || die "base: $(tail -3 base.err)"
  c=o/checkpoints/ckpt-0000000010.kpl
  cp "$c" keep.kpl && cp "$c.done" keep.kpl.done
  for change in "optimizer.name=adam" "optimizer.name=lars" "optimizer.momentum=0"; do
    expect_fail "$change" "model 'model' was trained with sgd (momentum 0.9, nesterov), this run's optimizer is" \
      "$kpl" train "${O[@]}" run_dir=o optimizer.nesterov=false "$change" --resume keep.kpl
    grep -q "Resume with --reset-optimizer" "$change.err" || die "$change: no advice: $(cat "$change.err")"
  done
  grep -q "this run's optimizer is adam:" optimizer.name=adam.err || die "adam not named"
  grep -q "this run's optimizer is sgd (no momentum):" optimizer.momentum=0.err || die "momentum 0 not named"
  # the same state, other settings: resumed as before
  run mom "$kpl" train "${O[@]}" run_dir=m optimizer.momentum=0.8 optimizer.lr=0.01 --resume keep.kpl
  [[ $rc == 0 ]] || die "momentum 0.8: exit $rc: $(tail -3 mom.err)"
  # --reset-optimizer: the weights resume, the optimizer starts fresh
  run reset "$kpl" train "${O[@]}" run_dir=r optimizer.nesterov=false optimizer.name=adam \
    optimizer.lr=0.001 --resume keep.kpl --reset-optimizer
  [[ $rc == 0 ]] || die "--reset-optimizer: exit $rc: $(tail -3 reset.err)"
  grep -q "reset-optimizer: the optimizer state of keep.kpl starts fresh" reset.err || die "reset not said"
  grep -q "resumed from keep.kpl at step 10" reset.out || die "reset did not resume: $(head -3 reset.out)"
  # its checkpoints name the new optimizer: resuming them as adam is no change
  run again "$kpl" train "${O[@]}" run_dir=r optimizer.nesterov=false optimizer.name=adam epochs=3 --resume
  [[ $rc == 0 ]] || die "resume of the reset run: exit $rc: $(tail -3 again.err)"
  run noresume "$kpl" train "${O[@]}" run_dir=x --reset-optimizer
  [[ $rc == 2 ]] && grep -q "reset-optimizer goes with --resume" noresume.err || die "--reset-optimizer alone: $rc"
  ;;
*)
  echo "faults_e2e.sh: unknown case '$case_'" >&2
  exit 2
  ;;
esac
echo "faults_e2e $case_ OK"
