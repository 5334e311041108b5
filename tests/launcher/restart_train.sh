#!/usr/bin/env bash
# restart_train.sh KPLRUN KPL FAULT_INJECT_SO SOURCE_DIR — kplrun
# --max-restarts 2 over 2 ranks of `kpl train` (Fashion-MNIST, deterministic,
# a checkpoint every 5 steps, 40 steps) whose rank 1 the test kills with
# SIGKILL mid-run, after checkpoints: kplrun names the failure, restarts
# the job once, the restarted ranks continue the same run directory (the
# recipe sets no run_dir: runs/<name>-<KPL_JOB_ID>) from its newest
# complete checkpoint, and the job ends 0 with exactly one "restart"
# record and an uninterrupted run's losses at every step, final loss and
# final accuracy, bit for bit.
#
# No sleep decides anything.  The first launch's rank 0 holds itself
# (fault_inject.so, SIGSTOP) as it renames its third checkpoint (step 15)
# into place, so the job cannot end before the kill; the test waits (with
# a deadline) until it is stopped and then kills rank 1, whose pid its own
# shell wrote before exec'ing kpl.  The torn-down rank 0 is continued
# with its SIGTERM, so the restart resumes from step 10 or, if that
# checkpoint completed, 15: either must give the same numbers.
set -euo pipefail
kplrun=$1 kpl=$2 inject=$3 src=$4
case_=restart_train
. "$(dirname "$0")/../trainer/e2e_common.sh"
need_fm
command -v mpirun > /dev/null || { echo "no mpirun: skipped"; exit 77; }
unset OMP_NUM_THREADS KPL_JOB_ID KPL_RESTART_COUNT KPL_MAX_RESTARTS KPL_RESTART_REASON
export ASAN_OPTIONS=${ASAN_OPTIONS:+$ASAN_OPTIONS:}verify_asan_link_order=0
R=("$src/recipes/fashion_mnist/cnn.yaml" "${QUIET[@]}" data.root="$tmp/fm" deterministic=true
   threads=1 data.workers=1 epochs=2 data.train.limit=2560 data.val.limit=1000
   log.every_steps=1 data.train.batch_size=64 checkpoint.every_steps=5)
# until DEADLINE_S CMD...: polls CMD every 20 ms for up to DEADLINE_S seconds
until_ok() {
  local end=$((SECONDS + $1))
  shift
  until "$@"; do
    ((SECONDS < end)) || return 1
    sleep 0.02
  done
}
# the only run directory a job made in its working directory
run_dir() { local d=("$1"/runs/*/); [[ ${#d[@]} == 1 && -d ${d[0]} ]] && echo "${d[0]%/}"; }

# the uninterrupted run (the data is converted here, once)
mkdir ref job
(cd ref && "$kplrun" -np 2 --log-dir "$tmp/ref/logs" -- "$kpl" train "${R[@]}") > ref.out 2> ref.err ||
  die "the uninterrupted run failed: $(tail -5 ref.err)"
refdir=$(run_dir ref) || die "the uninterrupted run's directory: $(ls ref/runs)"
losses "$refdir" > ref.loss
[[ $(wc -l < ref.loss) == 40 ]] || die "the uninterrupted run logged $(wc -l < ref.loss) steps"

# the job: each rank's shell writes its pid (kpl's, after exec) as
# pid-RANK-LAUNCH; the first launch's rank 0 stops itself in step 15's save
cd job
"$kplrun" -np 2 --max-restarts 2 --restart-backoff 1 --log-dir "$tmp/job/logs" -- sh -c '
  echo $$ > "$0/pid-$KPL_RANK-$KPL_RESTART_COUNT"
  if [ "$KPL_RANK" = 0 ] && [ "$KPL_RESTART_COUNT" = 0 ]; then
    export LD_PRELOAD="$1" KPL_FAULT=rename:.kpl.tmp:3:STOP
  fi
  shift
  exec "$@"' "$tmp/job" "$inject" "$kpl" train "${R[@]}" > ../job.out 2> ../job.err &
pid=$!
alive() { kill -0 $pid 2> /dev/null || die "kplrun ended early: $(tail -5 ../job.err)"; }
held() { alive && [[ -s pid-0-0 ]] && grep -q '^State:.*T' "/proc/$(cat pid-0-0)/status" 2> /dev/null; }
until_ok 300 held || die "rank 0 never reached its third checkpoint: $(tail -5 ../job.err)"
first=$(run_dir .) || die "the job's run directory: $(ls runs)"
for s in 5 10; do
  grep -q "\"event\":\"checkpoint\",\"step\":$s," "$first/metrics.jsonl" || die "no checkpoint of step $s before the kill"
done
! grep -q '"event":"done"' "$first/metrics.jsonl" || die "the job ended before the kill"
victim=$(cat pid-1-0)
kill -KILL "$victim"
finished() { ! kill -0 $pid 2> /dev/null; }
until_ok 300 finished || die "the job did not end within 300 s of the kill: $(tail -5 ../job.err)"
set +e; wait $pid; rc=$?; set -e
cd ..
[[ $rc == 0 ]] || die "the job ended with $rc: $(tail -8 job.err)"

# kplrun: the failure, the restart with its reason, and nothing else
host=$(hostname)
why="rank 1 on host $host was killed by signal 9 \(Killed\); the console last saw epoch 1/2 step 1[0-5]/20 and a checkpoint of step 1[05]"
grep -q "^kplrun: rank 1 on host $host (pid $victim) was killed by signal 9 (Killed) after" job.err ||
  die "kplrun did not name the killed rank: $(cat job.err)"
grep -qE "^kplrun: restart 1/2 in 1 s: $why$" job.err || die "no restart line: $(cat job.err)"
[[ $(grep -c "^kplrun: restart" job.err) == 1 ]] || die "restarted more than once: $(cat job.err)"
! grep -q "exhausted" job.err || die "$(cat job.err)"
# the launches: two, each of two ranks, KPL_RESTART_COUNT 0 then 1
[[ $(cd job && ls pid-* | sort | tr '\n' ' ') == "pid-0-0 pid-0-1 pid-1-0 pid-1-1 " ]] ||
  die "the launches' ranks: $(ls job/pid-*)"
# one run directory for both launches (the first one's), named by the job
dir=$(run_dir job) || die "run directories: $(ls job/runs)"
[[ $dir == "job/${first#./}" ]] || die "the run directory was $first, then $dir"
[[ $dir =~ ^job/runs/fashion_mnist_cnn-[0-9]{8}-[0-9]{6}-[0-9]+$ ]] || die "the default run directory is $dir"
restarts=$(grep '"event":"restart"' "$dir/metrics.jsonl" || true)
[[ $(grep -c . <<<"$restarts") == 1 ]] || die "restart records: $restarts"
[[ $(field restart "$restarts") == 1 && $(field max_restarts "$restarts") == 2 ]] || die "the restart record: $restarts"
from=$(field step "$restarts")
[[ $from == 10 || $from == 15 ]] || die "resumed from step $from, expected 10 or 15: $restarts"
[[ job/$(field from "$restarts") == "$dir/checkpoints/ckpt-$(printf %010d "$from").kpl" ]] ||
  die "the restart record's checkpoint: $restarts"
grep -qE "\"reason\":\"$why\"" <<<"$restarts" || die "the restart record's reason: $restarts"
grep -qE "^\[r0\] restart 1/2 after a failure \($why\): continuing from the newest complete checkpoint of [^ ]+ \(step $from\)$" job.out ||
  die "the trainer did not say it restarted: $(grep restart job.out)"
# the ranks' logs: the first launch's end and the restart, in each
for r in 0 1; do
  grep -qE "^kplrun: restart 1/2: $why$" "job/logs/rank-0000$r.log" || die "rank $r's log: $(cat "job/logs/rank-0000$r.log")"
done
grep -q "^kplrun: rank 1 was killed by signal 9 (Killed)" job/logs/rank-00001.log || die "rank 1's log lost the first launch"

# the numbers: every step's loss (the steps between the checkpoint and the
# kill are logged twice, identically), the final loss and accuracy
losses "$dir" | sort -n -u > job.loss
diff ref.loss job.loss > /dev/null || die "losses differ from the uninterrupted run: $(diff ref.loss job.loss | head -6)"
a=$(tail -n 1 "$refdir/metrics.jsonl") b=$(tail -n 1 "$dir/metrics.jsonl")
[[ $(field event "$b") == done ]] || die "the job's last record: $b"
for k in steps train_loss train_acc val_loss val_top1 val_top5 best_top1; do
  [[ -n $(field $k "$a") && $(field $k "$a") == "$(field $k "$b")" ]] || die "final $k: $(field $k "$b"), uninterrupted $(field $k "$a")"
done
echo "PASS (restart_train): resumed from step $from; final loss $(field train_loss "$b"), top-1 $(field val_top1 "$b")"
