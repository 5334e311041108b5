#!/usr/bin/env bash
# cluster_fault.sh CLUSTER KPLRUN LAUNCH_CHECK — a node's link goes down
# mid-job.  Two nodes of bench/cluster.sh (network namespaces joined by a
# bridge), one rank each, allreducing in a loop (launch_check loop: 5 s
# collective timeout); once both ranks are in the loop the test takes node
# 1's link down (`ip link set eth0 down` in its namespace, as a cable or
# switch port fails); a second job then also has everything on node 1
# killed at once (the node crashed).  Open MPI reports the two through
# different messages, and the first through either, by a race: its own
# connection to node 1's daemon failing ("lost communication with a remote
# daemon", naming the node) or the daemon's launcher exiting ("unable to
# reliably start one or more daemons", naming none; the crash makes this
# one certain, as ssh's exit does on a real cluster).  Checked for both:
# every rank stops within the timeout plus a margin; rank 0's report names
# rank 1 and its host as not answering (link down); kplrun names the lost host and its
# rank and exits 1; nothing of the job is left running in either
# namespace.  Skips (77) where namespaces cannot be made.
set -euo pipefail
cluster=$1 kplrun=$2 check=$3

if [[ -z ${KPL_IN_CLUSTER:-} ]]; then
  export KPL_IN_CLUSTER=1
  exec "$cluster" --nodes 2 -- "$0" "$@"
fi

# ---- on node 0 of the cluster ----
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
read -r -a netns <<< "$KPL_CLUSTER_NETNS"
read -r -a names <<< "$KPL_CLUSTER_NAMES"
read -r -a ips <<< "$KPL_CLUSTER_IPS"
what=""
die() {
  echo "FAIL (cluster_fault, $what): $*" >&2
  for f in "$tmp/out.txt" "$tmp/err.txt"; do [[ -f $f ]] && { echo "--- $f" >&2; cat "$f" >&2; }; done
  exit 1
}
has() { grep -qE -- "$1" "$tmp/out.txt" "$tmp/err.txt" || die "the output lacks /$1/"; }
unset KPL_NO_UCX SLURM_JOB_NODELIST PBS_NODEFILE OMP_NUM_THREADS

# one_case link|crash
one_case() {
  what=$1
  rm -rf "$tmp/logs" "$tmp/out.txt" "$tmp/err.txt"
  # this job's processes, told from any other job on the machine: the
  # ranks carry the mark, kplrun's agents and mpirun the log directory
  local mark=cluster-fault-$$-$RANDOM-$what
  # shellcheck disable=SC2086
  "$kplrun" -np 2 $KPL_CLUSTER_MPI -x UCX_TLS=tcp,sm,self ${KPL_TEST_MPIRUN_EXTRA:-} --stop-timeout 20 \
    --log-dir "$tmp/logs" -- "$check" mpi loop "$mark" > "$tmp/out.txt" 2> "$tmp/err.txt" &
  local job=$!

  local deadline=$((SECONDS + 90))
  until [[ $(grep -c '^\[r[01]\] LOOPING rank' "$tmp/out.txt" 2> /dev/null) == 2 ]]; do
    kill -0 $job 2> /dev/null || die "the job ended before both ranks were in the loop"
    ((SECONDS < deadline)) || { kill $job; die "the ranks did not reach the loop in 90 s"; }
    sleep 0.2
  done

  ip -n "${netns[1]}" link set "$KPL_CLUSTER_DEV" down
  # the crash: node 1's Open MPI daemon, kplrun's agent and the rank at once
  [[ $what == crash ]] && ip netns pids "${netns[1]}" | xargs -r kill -9
  local cut=$SECONDS rc=0
  # Within the collective timeout (30 s), from the link's cut.
  while kill -0 $job 2> /dev/null; do
    if ((SECONDS - cut > 30)); then
      kill -9 $job 2> /dev/null || true
      die "kplrun still running 30 s after the link went down"
    fi
    sleep 0.2
  done
  wait $job || rc=$?
  local took=$((SECONDS - cut))
  echo "$what: kplrun exited $rc, ${took} s after the link went down"
  ((rc != 0)) || die "kplrun exited 0 after a node was cut off"
  # rank 0's communicator names the rank that does not answer, and where
  # it is (after a crash, mpirun may stop rank 0 before its report is due)
  [[ $what == crash ]] ||
    has "\[r0\] kpl\[0\] comm: stall: allreduce #[0-9]+ .*; not joined: rank 1 on host ${names[1]}: no answer for [0-9.]+ s \(stopped, hung, or unreachable\?\)"
  # kplrun's verdict names the host that was lost (as --host gave it) and
  # its rank; exit status 1; Open MPI's box about daemons that could not
  # start is not shown (they had started)
  has "^kplrun: lost host (${names[1]}|${ips[1]}): Open MPI's daemon there stopped answering .*; its rank 1; the other ranks were stopped$"
  ((rc == 1)) || die "kplrun exited $rc, expected 1 for a lost host"
  ! grep -q "unable to reliably start" "$tmp/err.txt" || die "Open MPI's box about a failed start was shown"

  # nothing of the job left: not in node 1 (its Open MPI daemon and rank),
  # not here (no rank, agent or daemon of the job)
  sleep 1
  local left
  left=$(ip netns pids "${netns[1]}" || true)
  [[ -z $left ]] || die "processes left on node 1: $(ps -o pid=,args= -p "${left//$'\n'/,}")"
  if pgrep -f "$mark" > /dev/null; then die "ranks left: $(pgrep -af "$mark")"; fi
  if pgrep -f "$tmp/logs" > /dev/null; then die "kplrun's agents or mpirun left: $(pgrep -af "$tmp/logs")"; fi
  echo "PASS (cluster_fault, $what): ${names[1]} cut off; kplrun exited $rc after ${took} s"
  # the link back up for the next case
  ip -n "${netns[1]}" link set "$KPL_CLUSTER_DEV" up
}

one_case link
one_case crash
