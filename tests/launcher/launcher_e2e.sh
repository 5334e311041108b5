#!/usr/bin/env bash
# launcher_e2e.sh CASE KPLRUN LAUNCH_CHECK — kplrun end to end on this
# machine, one CTest test per case:
#   ranks      2 and 4 ranks: each sees its KPL_* environment agree with MPI
#              (launch_check), a sum over ranks through the mpi and ucx
#              backends is right, console lines carry [rN], and every rank
#              has its log file; 2 x 50000 lines arrive whole
#   fail       rank 2 of 4 exits 3 after 1 s while the others sleep 60 s:
#              kplrun exits 3 within 10 s naming rank 2, its host and
#              status 3, shows the end of its log; no process is left
#   kill       a rank's command is killed by SIGKILL; then a rank's agent
#              itself: kplrun names the rank and signal 9 (exit 137)
#   timeout    --timeout 5 on a job that sleeps: exit 124 within 10 s
#   stall      rank 1 stops itself (SIGSTOP) before a collective: rank 0
#              times out (3 s) and ends the job; kplrun names rank 1 as the
#              rank rank 0 waited for, and nothing is left (rank 1 included);
#              a stopped rank that catches SIGTERM gets to handle it
#   interrupt  one SIGINT reaches every rank's command as SIGINT; a command
#              that ignores it is stopped by the second one; one SIGTERM
#              reaches every command as SIGTERM and is waited for (exit
#              143); a command that ignores it is killed after --stop-timeout
#   bar        on a terminal, rank 0's progress bar stays whole: a line
#              handled in one batch with a new frame (kplrun stopped while
#              both arrive) wipes the old frame first, and rank 1's lines
#              print above the moving bar; the log keeps lines, not frames
#   gpu        a stand-in nvidia sysfs directory with two GPUs: one rank
#              per GPU, KPL_DEVICE in PCI order, each bound to its cores;
#              under CUDA_VISIBLE_DEVICES (an index, UUIDs in reverse
#              order) KPL_DEVICE numbers the visible GPUs as CUDA will
#              and each rank is bound to the cores of the GPU it gets
#   cli        usage errors, --dry-run, hosts from SLURM and PBS variables,
#              a command that does not exist
#   restart    --max-restarts: bad values are usage errors; a command that
#              always fails exhausts --max-restarts 1 after exactly 2
#              launches (KPL_RESTART_COUNT 0 and 1, one KPL_JOB_ID, the
#              reason in KPL_RESTART_REASON and the ranks' logs) and exits
#              with its status; SIGTERM or SIGINT during the back-off ends
#              kplrun at once with 143 / 130; stops are never restarted
#              (SIGTERM to kplrun, --timeout, every rank exiting 143)
#              (restart_train.sh: kpl train restarted after a SIGKILL)
set -euo pipefail
case_=$1 kplrun=$2 check=$3
tmp=$(mktemp -d)
token=$$$RANDOM # marks this test's processes
cleanup() {
  pkill -9 -f "sleep 6[01]\.$token" 2> /dev/null || true
  rm -rf "$tmp"
}
trap cleanup EXIT
cd "$tmp"
die() {
  echo "FAIL ($case_): $*" >&2
  for f in out.txt err.txt; do [[ -f $f ]] && { echo "--- $f" >&2; cat "$f" >&2; }; done
  exit 1
}
# the defaults are what is tested (UCX when Open MPI has it)
unset KPL_NO_UCX CUDA_VISIBLE_DEVICES KPLRUN_NVIDIA_PROC SLURM_JOB_NODELIST SLURM_NTASKS_PER_NODE SLURM_TASKS_PER_NODE SLURM_NTASKS \
  PBS_NODEFILE OMP_NUM_THREADS

# run ARGS...: kplrun in the background with stdout/stderr to out.txt and
# err.txt; sets rc and secs
run() {
  local t0=$EPOCHREALTIME
  set +e
  "$kplrun" "$@" > out.txt 2> err.txt
  rc=$?
  set -e
  secs=$(awk -v a="$t0" -v b="$EPOCHREALTIME" 'BEGIN { print b - a }')
}
has() { grep -qE -- "$2" "$1" || die "$1 lacks /$2/"; }
# nothing of this test's job may be left: the ranks' sleeps, agents, mpirun
# (a rank's guard may take a moment to see its group gone)
none_left() {
  for _ in $(seq 30); do
    pgrep -f "sleep 6[01]\.$token" > /dev/null || pgrep -f "agent --log-dir $tmp/" > /dev/null || break
    sleep 0.1
  done
  if pgrep -f "sleep 6[01]\.$token" > /dev/null || pgrep -f "agent --log-dir $tmp/" > /dev/null; then
    ps -ef | grep -E "sleep 6[01]\.$token|agent --log-dir $tmp/" | grep -v grep >&2
    die "processes left behind"
  fi
}
faster() { awk -v s="$secs" -v m="$1" 'BEGIN { exit !(s < m) }' || die "took $secs s (limit $1 s)"; }
# ended STATUS PATTERN: the job ended with STATUS within 10 s, kplrun said
# PATTERN, and nothing of it is left
ended() {
  [[ $rc == "$1" ]] || die "exit $rc, expected $1"
  faster 10
  has err.txt "$2"
  none_left
}

case $case_ in
ranks)
  for np in 2 4; do
    for backend in mpi ucx; do
      run -np $np --log-dir "$tmp/logs$np$backend" -- "$check" $backend
      [[ $rc == 0 ]] || die "-np $np $backend: exit $rc"
      for ((r = 0; r < np; r++)); do
        has out.txt "^\[r$r\] CHECK rank $r/$np local $r/$np device cpu host [^ ]+ net [^ ]+ omp 1$"
        has "$tmp/logs$np$backend/rank-0000$r.log" "^CHECK rank $r/$np "
        has "$tmp/logs$np$backend/rank-0000$r.log" "^kplrun: rank $r exited with status 0"
      done
      has out.txt "^\[r0\] SUM-OK over $backend$"
      ! grep -qv '^\[r[0-9]\] ' out.txt || die "a console line without its [rN] prefix"
      has err.txt "^kplrun: $np ranks on this machine"
    done
  done
  ! grep -q "cannot reach kplrun" err.txt || die "an agent fell back to mpirun's output"
  # many lines at full speed: every one arrives whole, with its prefix
  # (through mpirun's own forwarding, lines of two ranks can cut each other)
  text=$(printf '%0100d' 5)
  run -np 2 --log-dir "$tmp/lines" -- sh -c "yes $text | head -n 50000"
  [[ $rc == 0 ]] || die "lines: exit $rc"
  for r in 0 1; do
    n=$(grep -c "^\[r$r\] $text\$" out.txt || true)
    [[ $n == 50000 ]] || die "rank $r: $n whole lines of 50000"
  done
  [[ $(wc -l < out.txt) == 100000 ]] || die "$(wc -l < out.txt) lines, expected 100000"
  # OMP_NUM_THREADS: the cores shared out when there are enough of them
  cores=$(nproc)
  run -np 1 --log-dir "$tmp/l1" -- "$check" mpi
  [[ $rc == 0 ]] || die "-np 1: exit $rc"
  has out.txt "CHECK rank 0/1 local 0/1 device cpu .* omp $cores$"
  ;;

fail)
  run -np 4 --log-dir "$tmp/logs" -- sh -c \
    'echo started; if [ "$KPL_RANK" = 2 ]; then sleep 1; echo "giving up" >&2; exit 3; fi; sleep 60.'$token
  ended 3 "^kplrun: rank 2 on host $(hostname) \(pid [0-9]+\) exited with status 3 after 1\.[0-9] s; the other ranks were stopped$"
  has err.txt "^kplrun: the last lines of rank 2 \($tmp/logs/rank-00002.log\):$"
  has err.txt "^  \[r2\] giving up$"
  has "$tmp/logs/rank-00002.log" "^giving up$"
  # (the torn-down ranks' agents may be killed before they log their end:
  # mpirun sends SIGKILL a millisecond after SIGTERM)
  for r in 0 1 3; do has "$tmp/logs/rank-0000$r.log" "^started$"; done
  ;;

kill)
  run -np 2 --log-dir "$tmp/logs" -- sh -c \
    'if [ "$KPL_RANK" = 1 ]; then sleep 1; kill -KILL $$; fi; sleep 60.'$token
  ended 137 "^kplrun: rank 1 on host $(hostname) \(pid [0-9]+\) was killed by signal 9 \(Killed\)"
  # the agent itself (as the OOM killer might): mpirun's word for it, and
  # the command's whole process group goes with its agent (sleep is the
  # shell's child here, out of reach of the shell's parent-death signal)
  run -np 2 --log-dir "$tmp/logs2" -- sh -c \
    'if [ "$KPL_RANK" = 0 ]; then sleep 1; kill -KILL $PPID; fi; sleep 61.'$token
  ended 137 "^kplrun: rank 0 on host [^ ]+ was killed by signal 9 \(Killed\)"
  # the first failure in time is the cause, whatever order the reports
  # come in: rank 1 is killed first, but a process it left holds its output
  # open, so its agent drains for 0.5 s before it reports; rank 0 aborts
  # 0.2 s after rank 1 died (as a rank does in a collective whose peer
  # is gone) and is reported first
  run -np 2 --log-dir "$tmp/logs3" -- sh -c \
    'if [ "$KPL_RANK" = 1 ]; then sleep 61.'$token' & sleep 0.5; touch "$0/dead"; kill -KILL $$; fi
     until [ -e "$0/dead" ]; do sleep 0.01; done; sleep 0.2; kill -ABRT $$' "$tmp"
  ended 137 "^kplrun: rank 1 on host $(hostname) \(pid [0-9]+\) was killed by signal 9 \(Killed\)"
  ;;

timeout)
  run -np 2 --timeout 5 --log-dir "$tmp/logs" -- sleep 60.$token
  ended 124 "^kplrun: the job ran past --timeout 5 s and was stopped"
  has err.txt "^kplrun: --timeout 5 s reached: stopping every rank$"
  ;;

stall)
  run -np 2 --log-dir "$tmp/logs" -- "$check" mpi stop "$token"
  # rank 0's watchdog: the stall report after 1 s, the timeout after 3 s
  # (and up to 2 s for answers), then the job's end after a grace of 3.5 s
  [[ $rc == 124 ]] || die "exit $rc, expected 124"
  faster 25
  has err.txt "^\[r0\] kpl\[0\] comm: stall: allgather #1 .*; not joined: rank 1 on host [^:;]+: no answer for [0-9.]+ s \(stopped, hung, or unreachable\?\); joined: rank 0$"
  has err.txt "^kplrun: rank 0 on host [^ ]+ \(pid [0-9]+\) exited with status 124 after [0-9.]+ s; the other ranks were stopped$"
  has err.txt "^kplrun: rank 0 timed out waiting for rank 1, which has not joined allgather #1; rank 1 on host [^:;]+: no answer for [0-9.]+ s \(stopped, hung, or unreachable\?\)$"
  # the stuck rank's last lines first, then those of the rank that failed
  has err.txt "^kplrun: the last lines of rank 1 \($tmp/logs/rank-00001.log\):$"
  has err.txt "^  \[r1\] stopping before the allgather$"
  [[ $(grep -o '^kplrun: the last lines of rank [0-9]*' err.txt | grep -o '[0-9]*$' | tr '\n' ' ') == "1 0 " ]] ||
    die "the last lines: rank 1's, then rank 0's"
  for _ in $(seq 30); do pgrep -f "$check mpi stop $token" > /dev/null || break; sleep 0.1; done
  ! pgrep -f "$check mpi stop $token" > /dev/null || die "a rank is left: $(pgrep -af "$check mpi stop $token")"
  none_left
  # A stopped command that catches SIGTERM (kpl train checkpoints) gets to
  # handle it when the job is torn down: it is continued along with it,
  # not left stopped until the SIGKILL.  Rank 0 fails once rank 1 is
  # stopped (its state in /proc says so).
  cat > job.sh << 'EOF2'
d=$1
if [ "$KPL_RANK" = 1 ]; then
  trap 'echo "$$" > "$d/got-term"; exit 143' TERM
  echo $$ > "$d/pid1"
  kill -STOP $$
  exit 0
fi
i=0
until [ -s "$d/pid1" ] && grep -q '^State:.*T' "/proc/$(cat "$d/pid1")/status" 2> /dev/null; do
  sleep 0.02; i=$((i + 1)); [ $i -lt 1500 ] || { echo "rank 1 never stopped"; exit 9; }
done
exit 3
EOF2
  run -np 2 --log-dir "$tmp/logs2" -- sh "$tmp/job.sh" "$tmp"
  [[ $rc == 3 ]] || die "exit $rc, expected 3"
  for _ in $(seq 50); do kill -0 "$(cat pid1)" 2> /dev/null || break; sleep 0.1; done
  ! kill -0 "$(cat pid1)" 2> /dev/null || die "the stopped rank is left"
  [[ $(cat got-term 2> /dev/null) == "$(cat pid1)" ]] || die "the stopped rank did not get to handle SIGTERM"
  ;;

interrupt)
  # start ARGS...: kplrun in the background until both ranks said "ready"
  start() {
    # emptied here, not by the background job's redirection: the wait
    # below could otherwise read the previous start's two "ready" lines
    # before the new job truncates the file
    : > out.txt
    "$kplrun" "$@" > out.txt 2> err.txt &
    pid=$!
    for _ in $(seq 100); do [[ $(grep -c ready out.txt) == 2 ]] && break; sleep 0.1; done
    [[ $(grep -c ready out.txt) == 2 ]] || die "the ranks did not start"
  }
  # interrupt: SIGINT to kplrun (Ctrl-C), then wait for it; sets rc and secs
  interrupt() {
    local t0=$EPOCHREALTIME
    kill -INT $pid
    set +e; wait $pid; rc=$?; set -e
    secs=$(awk -v a="$t0" -v b="$EPOCHREALTIME" 'BEGIN { print b - a }')
  }
  # first Ctrl-C: every command gets SIGINT and may finish its way
  start -np 2 --log-dir "$tmp/logs" -- sh -c \
    'trap "echo got SIGINT; exit 130" INT; echo ready; sleep 60.'$token' & wait'
  interrupt
  ended 130 "^kplrun: stopped by SIGINT: all 2 ranks exited with status 130$"
  has out.txt "^\[r0\] got SIGINT$"
  has out.txt "^\[r1\] got SIGINT$"
  has err.txt "^kplrun: interrupt: asking every rank to stop \(Ctrl-C again to kill them\)$"
  # a command deaf to SIGINT: the second one stops it
  start -np 2 --log-dir "$tmp/logs2" -- sh -c 'trap "" INT; echo ready; sleep 60.'$token
  kill -INT $pid
  sleep 1
  kill -0 $pid 2> /dev/null || die "the first SIGINT ended a job that ignores it"
  interrupt
  ended 130 "^kplrun: stopping every rank$"
  has err.txt "^kplrun: stopped by SIGINT: the ranks were killed before they ended on their own"
  # SIGTERM (a scheduler's stop): every command gets SIGTERM and may finish
  # its way (kpl train checkpoints); kplrun waits for them
  start -np 2 --log-dir "$tmp/logs3" -- sh -c \
    'trap "sleep 1; echo got SIGTERM; exit 143" TERM; echo ready; sleep 60.'$token' & wait'
  t0=$EPOCHREALTIME
  kill -TERM $pid
  set +e; wait $pid; rc=$?; set -e
  secs=$(awk -v a="$t0" -v b="$EPOCHREALTIME" 'BEGIN { print b - a }')
  ended 143 "^kplrun: stopped by SIGTERM: all 2 ranks exited with status 143$"
  has out.txt "^\[r0\] got SIGTERM$"
  has out.txt "^\[r1\] got SIGTERM$"
  has err.txt "^kplrun: SIGTERM: asking every rank to checkpoint and stop \(killed after 60 s, or at another signal\)$"
  # a command deaf to it is killed after --stop-timeout (its processes,
  # which ignore SIGTERM too, by the agents' guards 10 s later)
  start -np 2 --stop-timeout 2 --log-dir "$tmp/logs4" -- sh -c 'trap "" TERM; echo ready; sleep 60.'$token
  t0=$EPOCHREALTIME
  kill -TERM $pid
  set +e; wait $pid; rc=$?; set -e
  secs=$(awk -v a="$t0" -v b="$EPOCHREALTIME" 'BEGIN { print b - a }')
  [[ $rc == 143 ]] || die "deaf to SIGTERM: exit $rc, expected 143"
  awk -v s="$secs" 'BEGIN { exit !(s >= 2 && s < 10) }' || die "deaf to SIGTERM: ended after $secs s (--stop-timeout 2)"
  has err.txt "^kplrun: the ranks did not stop within 2 s \(--stop-timeout\): killing them$"
  has err.txt "^kplrun: stopped by SIGTERM: the ranks were killed before they ended on their own"
  for _ in $(seq 150); do pgrep -f "sleep 60\.$token" > /dev/null || break; sleep 0.1; done
  none_left
  ;;

bar)
  # On a terminal (script(1) makes one) rank 0's progress bar stays on the
  # bottom line; the other lines print above it, never into it.  First, the
  # case that once made this test fail 2 runs in 12 under load, made
  # certain: kplrun is stopped while rank 0 sends a new frame and then a
  # line, so that one read takes both and kplrun handles them in one batch;
  # the line must still wipe the frame on the screen (the old one: the new
  # frame is drawn after the batch).  Then rank 1 prints lines while the
  # bar moves.
  command -v script > /dev/null || { echo "no script(1): skipped"; exit 77; }
  command -v ss > /dev/null || { echo "no ss(8): skipped"; exit 77; }
  cat > job.sh << 'EOF2'
d=$1
wait_for() { # a file the test creates; 30 s at most
  i=0
  while [ ! -e "$d/$1" ]; do
    sleep 0.02; i=$((i + 1)); [ $i -lt 1500 ] || { echo "no $1" >&2; exit 9; }
  done
}
if [ "$KPL_RANK" = 0 ]; then
  [ "$KPL_PROGRESS" = always ] || echo "KPL_PROGRESS is '$KPL_PROGRESS'"
  printf '\rstep 1/30\033[K'
  wait_for go
  printf '\rstep 2/30\033[K'
  echo warning >&2
  wait_for resumed
  i=3; while [ $i -le 30 ]; do printf '\rstep %d/30\033[K' $i; sleep 0.05; i=$((i + 1)); done
  printf '\r\033[Kdone\n'
else
  wait_for resumed
  i=1; while [ $i -le 10 ]; do echo "line $i"; sleep 0.12; i=$((i + 1)); done
fi
EOF2
  # until CMD...: polls CMD for up to 20 s
  until_ok() { for _ in $(seq 400); do "$@" && return 0; sleep 0.05; done; return 1; }
  # (kplrun is not script's own child: script stops itself when its child
  # stops, and a shell that waits without job control does not)
  COLUMNS=100 script -qfec "'$kplrun' -np 2 --log-dir '$tmp/logs' -- sh '$tmp/job.sh' '$tmp'; exit \$?" \
    typescript > /dev/null &
  spid=$!
  show() { cat -v typescript; }
  until_ok grep -qs 'step 1/30' typescript || die "rank 0's first frame never showed: $(show)"
  kpid=$(pgrep -f "^$kplrun -np 2 --log-dir $tmp/logs") || die "kplrun not found"
  kill -STOP "$kpid"
  touch go
  # "\001bar 0 step 2/30\n" and "2[r0] warning\n": 31 bytes in kplrun's sockets
  queued() {
    ss -Htnp state established | awk -v p="pid=$kpid," 'index($0, p) { q += $1 } END { exit !(q >= 31) }'
  }
  until_ok queued || { kill -CONT "$kpid"; die "rank 0's frame and line never reached kplrun"; }
  kill -CONT "$kpid"
  touch resumed
  set +e
  wait $spid
  rc=$?
  set -e
  [[ $rc == 0 ]] || die "exit $rc: $(show)"
  # each frame and line on its own, the erase-to-end-of-line codes gone
  tr '\r' '\n' < typescript | sed 's/\x1b\[K//g' > screen.txt
  grep -q '^\[r0\] warning$' screen.txt || die "rank 0's line is not on a line of its own: $(show)"
  grep -q '^step 1[0-9]/30$' screen.txt || die "no bar frames on the terminal: $(show)"
  for i in $(seq 10); do
    grep -q "^\[r1\] line $i\$" screen.txt || die "rank 1's line $i is not on a line of its own: $(show)"
  done
  ! grep -q 'step [0-9]*/30.*\[r' screen.txt || die "a line printed into the bar: $(show)"
  grep -q '^\[r0\] done$' screen.txt || die "rank 0's last line: $(show)"
  ! grep -q KPL_PROGRESS screen.txt || die "rank 0 was not told to draw its bar"
  # the log has what the terminal finally showed, not every frame
  [[ $(head -2 "$tmp/logs/rank-00000.log" | tr '\n' ' ') == "warning done " ]] ||
    die "rank 0's log: $(cat -v "$tmp/logs/rank-00000.log")"
  ;;

gpu)
  # The GPU path on a machine without GPUs: a stand-in for the nvidia
  # driver's sysfs directory (KPLRUN_NVIDIA_SYSFS) with two GPUs, listed
  # out of PCI order, each next to one core.  One rank per GPU, CUDA's
  # numbering in PCI order, each rank bound to its GPU's cores.
  (($(nproc) >= 2)) || { echo "one core: skipped"; exit 77; }
  mkdir -p nv/0000:3b:00.0 nv/0000:1a:00.0 nv/module
  echo 0 > nv/0000:3b:00.0/local_cpulist
  echo 1 > nv/0000:1a:00.0/local_cpulist
  : > nv/bind
  export KPLRUN_NVIDIA_SYSFS=$tmp/nv
  run -np 2 --dry-run -- true
  has out.txt "^mpirun -np 2 .*--map-by ppr:2:node --bind-to none -x OMP_NUM_THREADS=$(($(nproc) / 2)) "
  run -np 2 --log-dir "$tmp/logs" -- sh -c \
    'echo "device $KPL_DEVICE order $CUDA_DEVICE_ORDER cpus $(awk "/Cpus_allowed_list/ { print \$2 }" /proc/self/status)"'
  [[ $rc == 0 ]] || die "exit $rc"
  has err.txt "one per GPU"
  has out.txt "^\[r0\] device cuda:0 order PCI_BUS_ID cpus 1$"
  has out.txt "^\[r1\] device cuda:1 order PCI_BUS_ID cpus 0$"
  # A container (or SLURM) that leaves one GPU visible: CUDA numbers it 0,
  # and it is the second in PCI order, next to core 0.
  CUDA_VISIBLE_DEVICES=1 run -np 1 --log-dir "$tmp/logs" -- sh -c \
    'echo "device $KPL_DEVICE cpus $(awk "/Cpus_allowed_list/ { print \$2 }" /proc/self/status)"'
  [[ $rc == 0 ]] || die "CUDA_VISIBLE_DEVICES=1: exit $rc"
  has out.txt "^\[r0\] device cuda:0 cpus 0$"
  # UUIDs (the driver's information files), named in reverse PCI order
  mkdir -p nvproc/0000:3b:00.0 nvproc/0000:1a:00.0
  printf 'Model: \t\t NVIDIA A100\nGPU UUID: \t GPU-3b3b3b3b-0000-4000-8000-000000000001\n' \
    > nvproc/0000:3b:00.0/information
  printf 'Model: \t\t NVIDIA A100\nGPU UUID: \t GPU-1a1a1a1a-0000-4000-8000-000000000002\n' \
    > nvproc/0000:1a:00.0/information
  export KPLRUN_NVIDIA_PROC=$tmp/nvproc
  CUDA_VISIBLE_DEVICES=GPU-3b3b3b3b,GPU-1a1a1a1a run -np 2 --log-dir "$tmp/logs" -- sh -c \
    'echo "device $KPL_DEVICE cpus $(awk "/Cpus_allowed_list/ { print \$2 }" /proc/self/status)"'
  [[ $rc == 0 ]] || die "CUDA_VISIBLE_DEVICES by UUID: exit $rc"
  has out.txt "^\[r0\] device cuda:0 cpus 0$"
  has out.txt "^\[r1\] device cuda:1 cpus 1$"
  # one that names no GPU: the ranks see none, and kplrun says why
  CUDA_VISIBLE_DEVICES=GPU-ffff run -np 1 --log-dir "$tmp/logs" -- sh -c 'echo "device $KPL_DEVICE"'
  [[ $rc == 0 ]] || die "CUDA_VISIBLE_DEVICES=GPU-ffff: exit $rc"
  has out.txt "^\[r0\] device cpu$"
  has err.txt "no GPU of this node has UUID GPU-ffff"
  ;;

cli)
  expect_usage() { # NEEDLE ARGS...: exit 2 and NEEDLE on stderr
    local needle=$1
    shift
    run "$@"
    [[ $rc == 2 ]] || die "kplrun $*: exit $rc, expected 2"
    grep -qF -- "$needle" err.txt || die "kplrun $*: '$(cat err.txt)' lacks '$needle'"
  }
  expect_usage "-np wants a number >= 1, got '0'" -np 0 -- true
  expect_usage "no command: put it after '--'" -np 2
  expect_usage "give --host or --hostfile, not both" -np 2 --host a --hostfile b -- true
  expect_usage "hostfile /nonexistent/h: No such file or directory" --hostfile /nonexistent/h -- true
  expect_usage "--host: 'a:0': the slots after ':'" --host a:0 -- true
  expect_usage "unknown option or missing value: '--fast'" -np 2 --fast -- true
  expect_usage "--timeout wants seconds > 0, got '-3'" -np 2 --timeout -3 -- true
  expect_usage "--stop-timeout wants seconds > 0, got '0'" -np 2 --stop-timeout 0 -- true
  run --help
  [[ $rc == 0 ]] && has out.txt "^usage: kplrun -np N"
  # --dry-run: the exact command, nothing started
  run -np 2 --dry-run --log-dir L --mca btl_tcp_if_include eth0 -x FOO -- echo 'a b'
  [[ $rc == 0 ]] || die "--dry-run: exit $rc"
  has out.txt "^mpirun -np 2 .*-x OMP_NUM_THREADS=[0-9]+ .*--mca btl_tcp_if_include eth0 -x FOO [^ ]*kplrun --agent --log-dir $PWD/L --job-id [0-9]{8}-[0-9]{6}-[0-9]+ -- echo 'a b'$"
  [[ ! -d L ]] || die "--dry-run made the log directory"
  # the hosts and -np of a SLURM allocation, of a PBS job
  SLURM_JOB_NODELIST='gpu[07-08]' SLURM_NTASKS_PER_NODE=3 SLURM_NTASKS=6 run --dry-run -- true
  has out.txt "^mpirun -np 6 .*--host gpu07:3,gpu08:3 "
  printf 'cn1\ncn1\ncn2\ncn2\n' > nodes
  PBS_NODEFILE=$tmp/nodes run --dry-run -- true
  has out.txt "^mpirun -np 4 .*--hostfile $tmp/nodes "
  # a hostfile goes to mpirun as it is (after kplrun read it: -np)
  printf 'n1 slots=2 max_slots=4\nn2 slots=2\n' > hosts
  run --dry-run --hostfile hosts -- true
  has out.txt "^mpirun -np 4 .*--hostfile hosts "
  # a given host list wins over the allocation's
  SLURM_JOB_NODELIST='gpu[07-08]' run -np 2 --dry-run --host x:2 -- true
  has out.txt "--host x:2 "
  # a command that is not there
  run -np 2 --log-dir "$tmp/logs" -- /nonexistent/program
  [[ $rc == 127 ]] || die "missing command: exit $rc, expected 127"
  has err.txt "cannot run /nonexistent/program: No such file or directory"
  has err.txt "^kplrun: rank [01] on host .* exited with status 127"
  ;;

restart)
  for v in -1 x 1.5 '' +1 10001 --; do
    run -np 2 --max-restarts "$v" -- true
    [[ $rc == 2 ]] || die "--max-restarts '$v': exit $rc, expected 2"
    grep -qF -- "--max-restarts wants a number from 0 to 10000, got '$v'" err.txt || die "--max-restarts '$v': $(cat err.txt)"
  done
  for v in -1 abc '' inf nan 1e7; do
    run -np 2 --max-restarts 1 --restart-backoff "$v" -- true
    [[ $rc == 2 ]] || die "--restart-backoff '$v': exit $rc, expected 2"
    grep -qF -- "--restart-backoff wants seconds >= 0, got '$v'" err.txt || die "--restart-backoff '$v': $(cat err.txt)"
  done
  run --help
  has out.txt "^  --max-restarts N "
  has out.txt "^  --restart-backoff S "
  # launched NAME N: the job's command ran N times in all (a line each)
  launched() {
    local n
    n=$(wc -l < "$tmp/$1" 2> /dev/null || echo 0)
    [[ $n == "$2" ]] || die "$1: the command ran $n times, expected $2: $(cat "$tmp/$1" 2> /dev/null)"
  }
  # exhausted: rank 1 always fails; rank 0 waits to be torn down
  run -np 2 --max-restarts 1 --restart-backoff 0.2 --log-dir "$tmp/logs" -- sh -c \
    'echo "launch $KPL_RESTART_COUNT/$KPL_MAX_RESTARTS job $KPL_JOB_ID reason <$KPL_RESTART_REASON>" >> "$0/runs"
     echo "rank $KPL_RANK launch $KPL_RESTART_COUNT"
     if [ "$KPL_RANK" = 1 ]; then exit 3; fi; sleep 60.'$token "$tmp"
  [[ $rc == 3 ]] || die "exhausted: exit $rc, expected 3"
  launched runs 4
  why="rank 1 on host $(hostname) exited with status 3; the console saw no progress report"
  [[ $(grep -c "^launch 0/1 job [0-9]\{8\}-[0-9]\{6\}-[0-9]* reason <>$" runs) == 2 ]] || die "first launch: $(cat runs)"
  [[ $(grep -cF "reason <$why>" runs) == 2 ]] || die "the restart's reason: $(cat runs)"
  [[ $(grep -c "^launch 1/1 " runs) == 2 ]] || die "second launch: $(cat runs)"
  [[ $(cut -d' ' -f4 runs | sort -u | wc -l) == 1 ]] || die "the job id changed: $(cat runs)"
  has err.txt "^kplrun: restart 1/1 in 0\.2 s: $why$"
  has err.txt "^kplrun: restarts exhausted \(1 of 1 made\): $why; exit status 3$"
  [[ $(grep -c "^kplrun: rank 1 on host .* exited with status 3 after" err.txt) == 2 ]] || die "two failures said: $(cat err.txt)"
  # the ranks' logs keep both launches, the restart said between them
  for r in 0 1; do
    [[ $(grep -v '^kplrun: rank' "$tmp/logs/rank-0000$r.log" | tr '\n' '|') == "rank $r launch 0|kplrun: restart 1/1: $why|rank $r launch 1|" ]] ||
      die "rank $r's log: $(cat "$tmp/logs/rank-0000$r.log")"
  done
  none_left
  # SIGTERM and SIGINT during the back-off: kplrun ends at once, restarting nothing
  for sig in TERM INT; do
    : > out.txt; : > err.txt # (not the last round's lines: emptied before the job starts)
    "$kplrun" -np 2 --max-restarts 3 --restart-backoff 60 --log-dir "$tmp/lb$sig" -- sh -c \
      'echo x >> "$0/back'$sig'"; exit 4' "$tmp" > out.txt 2> err.txt &
    pid=$!
    for _ in $(seq 600); do
      grep -q "^kplrun: restart 1/3 in 60 s: rank [01] on host [^ ]* exited with status 4" err.txt && break
      kill -0 $pid 2> /dev/null || break
      sleep 0.05
    done
    has err.txt "^kplrun: restart 1/3 in 60 s: "
    t0=$EPOCHREALTIME
    kill -$sig $pid
    set +e; wait $pid; rc=$?; set -e
    secs=$(awk -v a="$t0" -v b="$EPOCHREALTIME" 'BEGIN { print b - a }')
    want=143
    [[ $sig == INT ]] && want=130
    ended $want "^kplrun: SIG$sig during the restart's back-off: not restarting$"
    faster 5
    launched back$sig 2
  done
  # stops are never restarted: SIGTERM to kplrun while the ranks run
  : > out.txt # (emptied before the job starts, as start() in interrupt)
  "$kplrun" -np 2 --max-restarts 2 --restart-backoff 0 --log-dir "$tmp/ls" -- sh -c \
    'echo x >> "$0/stop"; trap "exit 143" TERM; echo ready; sleep 60.'$token' & wait' "$tmp" > out.txt 2> err.txt &
  pid=$!
  for _ in $(seq 200); do [[ $(grep -c ready out.txt) == 2 ]] && break; sleep 0.05; done
  [[ $(grep -c ready out.txt) == 2 ]] || die "the ranks did not start"
  kill -TERM $pid
  set +e; wait $pid; rc=$?; set -e
  secs=0
  ended 143 "^kplrun: stopped by SIGTERM: all 2 ranks exited with status 143$"
  launched stop 2
  # --timeout, counted from the first launch
  run -np 2 --max-restarts 2 --restart-backoff 0 --timeout 2 --log-dir "$tmp/lt" -- sh -c \
    'echo x >> "$0/timeout"; sleep 60.'$token "$tmp"
  ended 124 "^kplrun: the job ran past --timeout 2 s"
  launched timeout 2
  # every rank ending 143 on its own (kpl train stopped by a signal to its
  # ranks, not to kplrun): a stop too
  run -np 2 --max-restarts 2 --restart-backoff 0 --log-dir "$tmp/l143" -- sh -c 'echo x >> "$0/own"; exit 143' "$tmp"
  ended 143 "^kplrun: stopped by SIGTERM: all 2 ranks exited with status 143 \(the signal reached a rank, not kplrun\)$"
  launched own 2
  ! grep -q "restart" err.txt || die "a stop was restarted: $(cat err.txt)"
  ;;

*) die "unknown case" ;;
esac
echo "PASS ($case_)"
