#!/usr/bin/env bash
# stop_e2e.sh CASE KPL SOURCE_DIR FAULT_INJECT_SO [KPLRUN] — stopping kpl train
# the way users and schedulers do, one CTest test per case.  Every stop must
# end with the exit status of its signal (143 SIGTERM, 130 SIGINT), a
# complete checkpoint, and a --resume that computes the very losses of an
# uninterrupted run (deterministic: true), bit for bit.
#   group      SIGTERM to the trainer's whole process group (its loader
#              processes too), as SLURM, Kubernetes, systemd and timeout
#              send it, at random steps
#   startup    SIGTERM and SIGINT during start-up (after the loaders, at the
#              run directory: a checkpoint of step 0), and during the
#              conversion of a missing split (stopped, its partial output
#              removed, converted whole by the next run)
#   ckpt       SIGTERM while a checkpoint is being written: that checkpoint
#              completes, the run stops at the next step with another
#   eval       SIGTERM while the epoch's checkpoint is written just before
#              its evaluation, and (no checkpoint due) just before the
#              evaluation: the evaluation ends at its first batch, the
#              checkpoint says its evaluation is to come, --resume runs it
#              first
#   kplrun     2 ranks under kplrun: SIGTERM and SIGINT to kplrun, SIGTERM
#              to rank 1 alone during start-up, and SIGTERM to every
#              process of the job (mpirun and the agents included, as
#              SLURM's scancel does): every rank stops at the same step
#   hammer     N (STOP_HAMMER_RUNS, default 10) runs stopped by SIGTERM or
#              SIGINT at random times, start-up included, to the whole
#              process group (with STOP_HAMMER_KPLRUN=1: 2 ranks under
#              kplrun, the signal to kplrun): each one exits 130/143 (or 0
#              when it finished first) with a complete checkpoint, never
#              aborts; run by hand 200 times under ASan and with glibc's
#              malloc checks (docs/faults.md)
set -euo pipefail
case_=$1 kpl=$2 src=$3 inject=$4 kplrun=${5:-}
. "$(dirname "$0")/e2e_common.sh"
export ASAN_OPTIONS=${ASAN_OPTIONS:+$ASAN_OPTIONS:}verify_asan_link_order=0
CNN=$src/recipes/fashion_mnist/cnn.yaml
# 20 steps of 128 an epoch, 2 epochs, every step logged
R=("$CNN" "${QUIET[@]}" data.root="$tmp/fm" deterministic=true threads=1 data.workers=1
   epochs=2 data.train.limit=2560 data.val.limit=1000 log.every_steps=1)

# run NAME CMD...: CMD in a process group of its own (as a job is), stdout
# and stderr in NAME.out / NAME.err; $rc
run() {
  local name=$1
  shift
  set +e
  setsid "$@" > "$name.out" 2> "$name.err"
  rc=$?
  set -e
}
# start NAME CMD...: the same in the background; $pid (also its group)
start() {
  local name=$1
  shift
  setsid "$@" > "$name.out" 2> "$name.err" &
  pid=$!
}
finish() { set +e; wait "$pid"; rc=$?; set -e; }
# until_step DIR N: until DIR's metrics.jsonl has logged step N
until_step() {
  for _ in $(seq 3000); do
    losses "$1" 2> /dev/null | awk -v n="$2" '$1 >= n { f = 1 } END { exit !f }' && return 0
    kill -0 "$pid" 2> /dev/null || die "the run ended before step $2: $(tail -3 "$1.err" 2> /dev/null)"
    sleep 0.02
  done
  die "step $2 was never logged in $1"
}
# stopped NAME DIR STATUS SIGNAME [quiet]: the run NAME in DIR was stopped
# with STATUS, says so in its log and metrics.jsonl (and on its console's
# last line, unless quiet: a console that went with the job), and left a
# complete checkpoint of the step it names; prints that step
stopped() {
  local name=$1 dir=$2 want=$3 sig=$4 quiet=${5:-}
  [[ $rc == "$want" ]] || die "$name: exit $rc, expected $want: $(tail -3 "$name.err")"
  local last
  last=$(tail -n 1 "$dir/metrics.jsonl")
  [[ $(field event "$last") == interrupted ]] || die "$name: metrics.jsonl does not end with the interrupted event: $last"
  [[ -n $quiet || $(tail -n 1 "$name.out") == "$last" ]] || die "$name: the console's last line is not the interrupted event: $(tail -n 1 "$name.out")"
  grep -q "stopped by $sig at step " "$dir/logs/rank-00000.log" || die "$name: no 'stopped by $sig' line: $(tail -3 "$dir/logs/rank-00000.log")"
  local step ckpt
  step=$(field steps "$last")
  ckpt=$(field checkpoint "$last")
  [[ $ckpt == "$dir/checkpoints/ckpt-$(printf %010d "$step").kpl" ]] || die "$name: checkpoint '$ckpt' is not step $step's"
  [[ -f $ckpt && -f $ckpt.done ]] || die "$name: $ckpt is not complete"
  ! ls "$dir"/checkpoints/*.tmp > /dev/null 2>&1 || die "$name: temporary files left: $(ls "$dir/checkpoints")"
  echo "$step"
}
# resumed NAME DIR REF: --resume of DIR runs to the end, and every step
# logged in DIR (before and after the stop) has REF's loss, bit for bit
resumed() {
  local name=$1 dir=$2 ref=$3
  shift 3
  "$@" > "$name.out" 2> "$name.err" || die "$name: resume failed: $(tail -3 "$name.err")"
  losses "$dir" | sort -n -k1,1 -u > "$dir.loss"
  diff "$ref" "$dir.loss" > /dev/null || die "$name: losses differ from the uninterrupted run: $(diff "$ref" "$dir.loss" | head -4)"
  local a b
  a=$(tail -n 1 "$ref.txt") b=$(tail -n 1 "$name.out")
  [[ $(field val_loss "$a") == $(field val_loss "$b") && -n $(field val_loss "$b") ]] \
    || die "$name: final val loss $(field val_loss "$b"), uninterrupted $(field val_loss "$a")"
}
# full NAME CMD...: the uninterrupted reference run; NAME.loss and NAME.loss.txt
full() {
  local name=$1
  shift
  "$@" > "$name.loss.txt" 2> "$name.err" || die "$name: $(tail -3 "$name.err")"
  losses "$name" > "$name.loss"
  [[ $(wc -l < "$name.loss") == 40 ]] || die "$name: $(wc -l < "$name.loss") steps logged"
}

case $case_ in
group)
  need_fm
  full ref "$kpl" train "${R[@]}" run_dir=ref
  for i in 1 2 3; do
    target=$(( i == 1 ? 1 : 2 + RANDOM % 36 ))
    start g$i "$kpl" train "${R[@]}" run_dir=g$i
    until_step g$i $target
    kill -TERM -- -$pid
    finish
    step=$(stopped g$i g$i 143 SIGTERM)
    ((step >= target)) || die "g$i: stopped at step $step, before step $target was logged"
    # the stop's own checkpoint, or, for a stop that landed at an epoch's
    # end (in its evaluation, or the run's last step), that epoch's, which
    # was written just before
    grep -q "\"step\":$step,\"why\":\"signal\"" g$i/metrics.jsonl \
      || { ((step % 20 == 0)) && grep -qE "\"step\":$step,\"why\":\"(epoch|end)\"" g$i/metrics.jsonl; } \
      || die "g$i: no checkpoint of step $step recorded: $(grep '"checkpoint"' g$i/metrics.jsonl | tail -2)"
    resumed g$i.r g$i ref.loss "$kpl" train "${R[@]}" run_dir=g$i --resume
    echo "group: round $i stopped at step $step, resumed bit for bit"
  done
  ;;

startup)
  need_fm
  full ref "$kpl" train "${R[@]}" run_dir=ref
  # at the run directory (the loaders run, MPI is up, the models not yet)
  for sig in TERM INT; do
    run s$sig env LD_PRELOAD="$inject" KPL_FAULT=mkdir:/checkpoints:1:$sig "$kpl" train "${R[@]}" run_dir=s$sig
    want=143
    [[ $sig == INT ]] && want=130
    step=$(stopped s$sig s$sig $want SIG$sig)
    [[ $step == 0 ]] || die "s$sig: stopped at step $step, expected 0"
    resumed s$sig.r s$sig ref.loss "$kpl" train "${R[@]}" run_dir=s$sig --resume
  done
  # during the conversion of a missing split: it stops, its partial output
  # goes, and the next run converts the split whole
  run conv env LD_PRELOAD="$inject" KPL_FAULT=write:fresh/train/00000.data:2:TERM \
    "$kpl" train "${R[@]}" data.root="$tmp/fresh" run_dir=c
  [[ $rc == 143 ]] || die "conversion: exit $rc, expected 143: $(tail -3 conv.err) $(tail -3 conv.out)"
  grep -q "stopped by SIGTERM during start-up, before the first step: .*conversion stopped on request" conv.out \
    || die "conversion: $(tail -3 conv.out)"
  [[ ! -e fresh/train ]] || die "the stopped conversion left $(ls fresh/train)"
  run conv2 "$kpl" train "${R[@]}" data.root="$tmp/fresh" run_dir=c2 max_steps=1
  [[ $rc == 0 ]] || die "after the stopped conversion: $(tail -3 conv2.err)"
  "$kpl" data verify fresh/train > verify.out || die "the converted split does not verify"
  grep -q '"examples":60000' verify.out || die "the converted split: $(cat verify.out)"
  ;;

ckpt)
  need_fm
  full ref "$kpl" train "${R[@]}" run_dir=ref checkpoint.every_steps=5
  # inside the first checkpoint's fsync (step 5): it completes, the run
  # stops after step 6 with a checkpoint of its own
  run c env LD_PRELOAD="$inject" KPL_FAULT=fsync:.kpl.tmp:1:TERM "$kpl" train "${R[@]}" run_dir=c \
    checkpoint.every_steps=5
  step=$(stopped c c 143 SIGTERM)
  [[ $step == 6 ]] || die "stopped at step $step, expected 6"
  [[ -f c/checkpoints/ckpt-0000000005.kpl.done ]] || die "the checkpoint being written did not complete"
  resumed c.r c ref.loss "$kpl" train "${R[@]}" run_dir=c checkpoint.every_steps=5 --resume
  ;;

eval)
  need_fm
  full ref "$kpl" train "${R[@]}" run_dir=ref
  # (a) the epoch's checkpoint is written before its evaluation; the signal
  # lands in its completion marker: the evaluation ends at its first batch
  run a env LD_PRELOAD="$inject" KPL_FAULT=rename:.done.tmp:1:TERM "$kpl" train "${R[@]}" run_dir=a
  step=$(stopped a a 143 SIGTERM)
  [[ $step == 20 ]] || die "a: stopped at step $step, expected 20 (the end of epoch 1)"
  grep -q "evaluation stopped by SIGTERM after 0 batches" a.out || die "a: the evaluation was not stopped: $(tail -4 a.out)"
  ! grep -q '"event":"eval"' a/metrics.jsonl || die "a: an evaluation was recorded"
  ! grep -q '"evaluated"' a/checkpoints/ckpt-0000000020.kpl.done || die "a: the checkpoint says it was evaluated"
  resumed a.r a ref.loss "$kpl" train "${R[@]}" run_dir=a --resume
  grep -q "evaluating the resumed checkpoint first" a.r.out || die "a: the resume did not evaluate first"
  [[ $(grep -c '"event":"eval"' a/metrics.jsonl) == 2 ]] || die "a: $(grep -c '"event":"eval"' a/metrics.jsonl) evaluations recorded, expected 2"
  # (b) no checkpoint due before the evaluation (every 2 epochs): the stop
  # writes one whose evaluation is to come.  The signal lands in the
  # TensorBoard write of the epoch's last report: the file's header is
  # write 1, the 20 reports of epoch 1 writes 2 to 21.
  run b env LD_PRELOAD="$inject" KPL_FAULT='write:*tfevents:21:TERM' "$kpl" train "${R[@]}" run_dir=b \
    checkpoint.every_epochs=2
  step=$(stopped b b 143 SIGTERM)
  [[ $step == 20 ]] || die "b: stopped at step $step, expected 20"
  grep -q "evaluation stopped by SIGTERM after 0 batches" b.out || die "b: the evaluation was not stopped: $(tail -4 b.out)"
  grep -q '"step":20,"why":"signal"' b/metrics.jsonl || die "b: no signal checkpoint at step 20"
  resumed b.r b ref.loss "$kpl" train "${R[@]}" run_dir=b checkpoint.every_epochs=2 --resume
  grep -q "evaluating the resumed checkpoint first" b.r.out || die "b: the resume did not evaluate first"
  ;;

kplrun)
  need_fm
  command -v mpirun > /dev/null || kpl_skip env "no mpirun"
  [[ -x $kplrun ]] || die "no kplrun"
  unset OMP_NUM_THREADS
  K=("$kplrun" -np 2 --log-dir)
  R+=(data.train.batch_size=64) # 2 ranks x 64: 20 steps an epoch, as above
  full ref "${K[@]}" lref -- "$kpl" train "${R[@]}" run_dir=ref
  # same_step DIR STEP: every rank's log says it stopped at STEP
  same_step() {
    for r in 0 1; do
      grep -q "stopped by SIG[A-Z]* at step $2\b" "$1/logs/rank-0000$r.log" \
        || die "$1: rank $r did not stop at step $2: $(tail -2 "$1/logs/rank-0000$r.log")"
    done
  }
  # SIGTERM and SIGINT to kplrun at random steps
  # (targets leave 19 steps or more to go: a loaded machine's kill must land
  # before the run ends)
  for sig in TERM INT; do
    target=$(( 2 + RANDOM % 20 ))
    start k$sig "${K[@]}" l$sig -- "$kpl" train "${R[@]}" run_dir=k$sig
    until_step k$sig $target
    kill -$sig $pid
    finish
    want=143
    [[ $sig == INT ]] && want=130
    sed -i 's/^\[r0\] //' k$sig.out # the console's prefix: the rank's own lines
    step=$(stopped k$sig k$sig $want SIG$sig)
    same_step k$sig "$step"
    [[ $sig == INT ]] || grep -q "^kplrun: SIGTERM: asking every rank to checkpoint and stop" k$sig.err \
      || die "k$sig: kplrun did not say it: $(cat k$sig.err)"
    grep -q "^kplrun: stopped by SIG$sig: all 2 ranks exited with status $want$" k$sig.err \
      || die "k$sig: kplrun's verdict: $(tail -3 k$sig.err)"
    resumed k$sig.r k$sig ref.loss "${K[@]}" l$sig.r -- "$kpl" train "${R[@]}" run_dir=k$sig --resume
    sed -i 's/^\[r0\] //' k$sig.r.out
    echo "kplrun: SIG$sig at step $step, resumed bit for bit"
  done
  # SIGTERM to rank 1 alone (its process group), during its start-up: both
  # ranks agree and stop at step 0
  start one "${K[@]}" lone -- sh -c '[ "$KPL_RANK" = 1 ] && export LD_PRELOAD="$0" KPL_FAULT=mkdir:/checkpoints:1:TERM; exec "$@"' \
    "$inject" "$kpl" train "${R[@]}" run_dir=one
  finish
  sed -i 's/^\[r0\] //' one.out
  step=$(stopped one one 143 SIGTERM)
  [[ $step == 0 ]] || die "one: stopped at step $step, expected 0"
  same_step one 0
  # SIGTERM to every process of the job at once (kplrun, mpirun, the
  # agents, the ranks and their loader processes), as SLURM's scancel;
  # finding them all takes a few processes, so the target is early
  target=$(( 2 + RANDOM % 11 ))
  start all "${K[@]}" lall -- "$kpl" train "${R[@]}" run_dir=all
  until_step all $target
  mp=$(pgrep -P "$pid" -x mpirun | head -n 1)
  [[ -n $mp ]] || die "no mpirun under kplrun"
  msid=$(ps -o sid= -p "$mp" | tr -d ' ')
  kill -TERM $(ps -eo pid=,sid= | awk -v a="$pid" -v b="$msid" '$2 == a || $2 == b { print $1 }')
  finish
  [[ $rc == 143 ]] || die "all: exit $rc, expected 143: $(tail -3 all.err)"
  # the agents that relay the ranks' output went with mpirun: the run's own
  # files say how it ended
  step=$(stopped all all 143 SIGTERM quiet)
  same_step all "$step"
  resumed all.r all ref.loss "${K[@]}" lall.r -- "$kpl" train "${R[@]}" run_dir=all --resume
  sed -i 's/^\[r0\] //' all.r.out
  ;;

hammer)
  need_fm
  n=${STOP_HAMMER_RUNS:-10} np2=${STOP_HAMMER_KPLRUN:-}
  "$kpl" train "${R[@]}" run_dir=warm max_steps=1 > /dev/null 2>&1 || die "the data conversion failed"
  cmd=("$kpl" train "${R[@]}")
  if [[ -n $np2 ]]; then
    command -v mpirun > /dev/null || kpl_skip env "no mpirun"
    unset OMP_NUM_THREADS
    cmd=("$kplrun" -np 2 --log-dir hl -- "$kpl" train "${R[@]}" data.train.batch_size=64)
  fi
  stats=""
  for i in $(seq "$n"); do
    sig=TERM
    ((RANDOM % 2)) && sig=INT
    # the whole run takes ~2-4 s here: 0 to 3 s lands anywhere, start-up included
    delay=$(awk -v r=$RANDOM -v m="${STOP_HAMMER_MAX_DELAY:-3}" 'BEGIN { printf "%.3f", r / 32768 * m }')
    start h$i "${cmd[@]}" run_dir=h$i
    sleep "$delay"
    if [[ -n $np2 ]]; then kill -$sig $pid 2> /dev/null || true; else kill -$sig -- -$pid 2> /dev/null || true; fi
    finish
    [[ -n $np2 ]] && sed -i 's/^\[r0\] //' h$i.out
    case $rc in
      0) stats+=" done" ;;
      130 | 143)
        if [[ ! -e h$i ]]; then
          stats+=" $sig@exec" # before kpl could install its handler: nothing to keep
        else
          s=$(stopped h$i h$i "$rc" SIG$sig)
          stats+=" $sig@$s"
        fi
        ;;
      *) die "h$i: SIG$sig after $delay s: exit $rc: $(tail -5 h$i.err)" ;;
    esac
    ! grep -qiE "corrupt|double free|AddressSanitizer|runtime error|malloc" h$i.err hl/*.log 2> /dev/null \
      || die "h$i: $(cat h$i.err)"
    rm -rf h$i hl
  done
  echo "hammer: $n runs:$stats"
  ;;

*)
  die "unknown case"
  ;;
esac
