#!/usr/bin/env bash
# multihost.sh KPLRUN LAUNCH_CHECK — kplrun across two "hosts" on this one
# machine.  Each host is a network namespace with its own host name (UTS
# namespace), joined to the other by a veth pair; an ssh stand-in (what
# Open MPI's rsh launcher calls) runs the remote daemon inside the other
# namespace.  kplrun starts in host A with --host A:1,B:1, so one rank runs
# in each place, and they can only reach each other over TCP between the
# two namespaces' addresses.  The ranks report their host name and
# addresses and sum a vector (launch_check); rank 0 gathers every rank's
# place.  Checked: through Open MPI's TCP transport alone (ob1 + btl tcp),
# through kplrun's defaults (UCX), through kpl's own UCX backend; and a
# failure on host B is named with host B.
# Without the rights to make namespaces (not root, no `ip`, no unshare) it
# falls back to two loopback addresses, 127.0.0.2 and .3, with a host name
# each (KPL_TEST_LOOPBACK_HOSTS=1 asks for that); and skips (77) when even
# that is impossible.
set -euo pipefail
kplrun=$1 check=$2
skip() { echo "skipped: $*"; exit 77; }
tmp=$(mktemp -d)
nsA=kplA$$ nsB=kplB$$ vA=kvA$$ vB=kvB$$
nameA=kpl-a-$$ nameB=kpl-b-$$
net=10.$((RANDOM % 200 + 20)).$((RANDOM % 250 + 1))
cleanup() {
  ip netns pids $nsA 2> /dev/null | xargs -r kill -9 2> /dev/null || true
  ip netns pids $nsB 2> /dev/null | xargs -r kill -9 2> /dev/null || true
  ip netns del $nsA 2> /dev/null || true
  ip netns del $nsB 2> /dev/null || true
  rm -rf "$tmp"
}
trap cleanup EXIT
die() {
  echo "FAIL (multihost, $mode): $*" >&2
  for f in "$tmp/out.txt" "$tmp/err.txt"; do [[ -f $f ]] && { echo "--- $f" >&2; cat "$f" >&2; }; done
  exit 1
}
unset KPL_NO_UCX SLURM_JOB_NODELIST PBS_NODEFILE OMP_NUM_THREADS

[[ $(id -u) == 0 ]] || skip "namespaces need root"
command -v unshare > /dev/null || skip "no unshare (util-linux)"
unshare --uts true 2> /dev/null || skip "cannot make a UTS namespace here"

mode=netns
if [[ -z ${KPL_TEST_LOOPBACK_HOSTS:-} ]] && command -v ip > /dev/null &&
   ip netns add $nsA 2> /dev/null && ip netns add $nsB 2> /dev/null &&
   ip link add $vA type veth peer name $vB 2> /dev/null; then
  ip link set $vA netns $nsA
  ip link set $vB netns $nsB
  ip -n $nsA addr add $net.1/24 dev $vA
  ip -n $nsB addr add $net.2/24 dev $vB
  for ns in $nsA $nsB; do ip -n $ns link set lo up; done
  ip -n $nsA link set $vA up
  ip -n $nsB link set $vB up
  ipA=$net.1 ipB=$net.2
  inA=(ip netns exec $nsA) inB=(ip netns exec $nsB)
else
  mode=loopback
  ip netns del $nsA 2> /dev/null || true
  ipA=127.0.0.2 ipB=127.0.0.3
  inA=() inB=()
fi
echo "mode $mode: host A = $nameA at $ipA, host B = $nameB at $ipB"

# The ssh stand-in: `fakessh [options] HOST COMMAND...`
cat > "$tmp/fakessh" << EOF
#!/bin/sh
while [ "\${1#-}" != "\$1" ]; do shift; done
host=\$1; shift
case \$host in
  $ipA) exec ${inA[*]} unshare --uts /bin/sh -c "hostname $nameA; \$*" ;;
  $ipB) exec ${inB[*]} unshare --uts /bin/sh -c "hostname $nameB; \$*" ;;
  *) echo "fakessh: no host \$host" >&2; exit 255 ;;
esac
EOF
chmod +x "$tmp/fakessh"

# kplrun as started on host A.  In loopback mode neither address is this
# machine's to Open MPI, so both daemons go through the stand-in.
kplrun_on_A() {
  set +e
  "${inA[@]}" unshare --uts /bin/sh -c "hostname $nameA; exec \"\$@\"" sh \
    "$kplrun" -np 2 --host $ipA:1,$ipB:1 --mca plm_rsh_agent "$tmp/fakessh" \
    --log-dir "$tmp/logs" "$@" > "$tmp/out.txt" 2> "$tmp/err.txt"
  rc=$?
  set -e
}
has() { grep -qE -- "$1" "$tmp/out.txt" "$tmp/err.txt" || die "the output lacks /$1/"; }
both_places() {
  [[ $rc == 0 ]] || die "$1: exit $rc"
  has "^\[r0\] CHECK rank 0/2 local 0/1 device cpu host $nameA net [^ ]*"
  has "^\[r1\] CHECK rank 1/2 local 0/1 device cpu host $nameB net [^ ]*"
  if [[ $mode == netns ]]; then
    # each rank saw only its own namespace's address; rank 0 gathered both
    has "^\[r0\] CHECK .* net $ipA "
    has "^\[r1\] CHECK .* net $ipB "
    has "^\[r0\] PLACES r0=$nameA@$ipA r1=$nameB@$ipB$"
  else
    has "^\[r0\] PLACES r0=$nameA@[^ ]* r1=$nameB@[^ ]*$"
  fi
  has "^\[r0\] SUM-OK over $2$"
  # host B's agent reached kplrun in host A (its lines did not come
  # through mpirun)
  ! grep -q "cannot reach kplrun" "$tmp/err.txt" || die "$1: an agent could not reach kplrun"
  [[ -f $tmp/logs/rank-00001.log ]] || die "no log of rank 1"
}

# 1. Open MPI's TCP transport is the only way between the ranks
kplrun_on_A --no-ucx --mca btl tcp,self -- "$check" mpi
both_places "ob1 over btl tcp" mpi
# 2. kplrun's defaults (UCX pml when Open MPI has it), UCX held to TCP
kplrun_on_A -x UCX_TLS=tcp,self -- "$check" mpi
both_places "defaults" mpi
# 3. kpl's own UCX backend between the hosts
kplrun_on_A -x UCX_TLS=tcp,self -- "$check" ucx
both_places "kpl ucx backend" ucx
# 4. a rank on host B fails: named with host B, nothing left in either
kplrun_on_A -- sh -c 'if [ "$KPL_RANK" = 1 ]; then sleep 1; exit 3; fi; sleep 60'
[[ $rc == 3 ]] || die "failure on host B: exit $rc, expected 3"
has "^kplrun: rank 1 on host $nameB \(pid [0-9]+\) exited with status 3"
if [[ $mode == netns ]]; then
  sleep 0.5
  [[ -z $(ip netns pids $nsA) && -z $(ip netns pids $nsB) ]] ||
    die "processes left in the namespaces: $(ip netns pids $nsA) $(ip netns pids $nsB)"
fi
echo "PASS (multihost, $mode)"
