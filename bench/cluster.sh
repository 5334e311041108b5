#!/usr/bin/env bash
# bench/cluster.sh — a simulated cluster on this one machine, for scaling
# benchmarks and multi-node tests:
#
#   bench/cluster.sh [--nodes N] [--bandwidth RATE] [--slots S] [--no-pin]
#                    -- COMMAND [ARGS...]
#
# Each node is a network namespace with its own host name (a UTS namespace
# around every process started in it) and its own share of the cores
# (taskset), joined to the others through a bridge in a "switch" namespace
# by a veth pair whose two ends are shaped with the tbf qdisc to RATE
# (tc's units: 1gbit, 2500mbit, 10gbit; default unshaped): node to switch
# is the node's upload, switch to node its download, as on a full-duplex
# link to a switch port.  COMMAND runs on node 0 (in its namespace, under
# its host name, on its cores) with:
#
#   KPL_CLUSTER_HOSTS   "ip0:S,ip1:S,..." for --host (kplrun or mpirun)
#   KPL_CLUSTER_RSH     the ssh stand-in for --mca plm_rsh_agent: starts
#                       Open MPI's daemon of another node inside that node
#   KPL_CLUSTER_MPI     both as options: --host ... --mca plm_rsh_agent ...
#   KPL_CLUSTER_NAMES   the nodes' host names, KPL_CLUSTER_IPS their addresses
#   KPL_CLUSTER_NETNS   the namespaces, KPL_CLUSTER_DEV the node-side link
#                       device in each (`ip -n NS link set DEV down` cuts a
#                       node off, as a failed link or switch port would)
#   KPL_CLUSTER_RATE    RATE, or "unshaped"
#
#   bench/cluster.sh --nodes 2 --bandwidth 1gbit -- \
#     sh -c 'kplrun -np 2 $KPL_CLUSTER_MPI -x UCX_TLS=tcp,sm,self -- kpl train r.yaml'
#
# Everything it made (namespaces, links, every process in a namespace) is
# removed on every way out: COMMAND's end, a failure here, Ctrl-C, SIGTERM.
# Exit status: COMMAND's; 2 for bad usage; 77 when this machine cannot make
# namespaces (not root, no `ip`/`tc`/`unshare`, or no tbf qdisc).
# Needs root, iproute2 and util-linux (scripts/setup.sh installs them).
set -euo pipefail

usage() {
  sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'
}
nodes=2 rate="" slots=1 pin=1
while (($#)); do
  case "$1" in
    --nodes) nodes=${2:?}; shift 2 ;;
    --bandwidth) rate=${2:?}; shift 2 ;;
    --slots) slots=${2:?}; shift 2 ;;
    --no-pin) pin=0; shift ;;
    -h | --help) usage; exit 0 ;;
    --) shift; break ;;
    *) echo "cluster.sh: unknown option '$1' (try --help)" >&2; exit 2 ;;
  esac
done
(($#)) || { echo "cluster.sh: no command: put it after '--'" >&2; exit 2; }
[[ $nodes =~ ^[0-9]+$ ]] && ((nodes >= 1 && nodes <= 64)) ||
  { echo "cluster.sh: --nodes wants 1..64, got '$nodes'" >&2; exit 2; }
[[ $slots =~ ^[0-9]+$ ]] && ((slots >= 1)) ||
  { echo "cluster.sh: --slots wants a count >= 1, got '$slots'" >&2; exit 2; }
[[ -z $rate || $rate =~ ^[0-9.]+([kmg]?bit|[kmg]?bps)$ ]] ||
  { echo "cluster.sh: --bandwidth wants a tc rate such as 1gbit or 2500mbit, got '$rate'" >&2; exit 2; }

skip() { echo "cluster.sh: $*: cannot simulate a cluster here" >&2; exit 77; }
[[ $(id -u) == 0 ]] || skip "namespaces need root"
for c in ip tc unshare taskset; do command -v $c > /dev/null || skip "no '$c'"; done

tag=k$$
sw=${tag}sw
net=10.$((RANDOM % 200 + 20)).$((RANDOM % 250 + 1))
ns=() names=() ips=()
tmp=$(mktemp -d /tmp/kpl-cluster.XXXXXX)
cleanup() {
  local rc=$?
  trap - EXIT INT TERM
  for n in "${ns[@]}" $sw; do
    ip netns pids "$n" 2> /dev/null | xargs -r kill -9 2> /dev/null || true
  done
  for n in "${ns[@]}" $sw; do ip netns del "$n" 2> /dev/null || true; done
  rm -rf "$tmp"
  exit $rc
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

ip netns add $sw 2> /dev/null || skip "cannot make a network namespace"
ip -n $sw link add br0 type bridge
ip -n $sw link set br0 up
ip -n $sw link set lo up

# A node's cores: an even share of this machine's, round robin when there
# are more nodes than cores.
ncpu=$(nproc)
cores_of() {
  local i=$1 per=$((ncpu / nodes))
  if ((per >= 1)); then echo "$((i * per))-$((i * per + per - 1))"; else echo $((i % ncpu)); fi
}

shape() { # NS DEV: RATE on DEV's egress
  [[ -n $rate ]] || return 0
  # burst: at least one rate-millisecond of bytes (tbf needs more than
  # rate/HZ) and the largest segment GSO makes; latency bounds the queue.
  ip netns exec "$1" tc qdisc add dev "$2" root tbf rate "$rate" burst 512kb latency ${KPL_CLUSTER_QUEUE_MS:-20}ms ||
    skip "the tbf qdisc is not available"
}

for ((i = 0; i < nodes; i++)); do
  n=${tag}n$i
  ns+=("$n")
  names+=("node$i-$$")
  ips+=("$net.$((i + 1))")
  ip netns add "$n"
  ip link add "${tag}h$i" type veth peer name "${tag}p$i"
  ip link set "${tag}h$i" netns "$n"
  ip link set "${tag}p$i" netns $sw
  ip -n "$n" link set "${tag}h$i" name eth0
  ip -n "$n" addr add "${ips[i]}/24" dev eth0
  ip -n "$n" link set lo up
  ip -n "$n" link set eth0 up
  ip -n $sw link set "${tag}p$i" master br0
  ip -n $sw link set "${tag}p$i" up
  shape "$n" eth0
  shape $sw "${tag}p$i"
done

# The commands each node runs things with: its namespace, host name, cores.
{
  echo '#!/bin/sh'
  echo '# node NUMBER COMMAND...: runs COMMAND on that node of the cluster'
  echo 'i=$1; shift'
  echo 'case $i in'
  for ((i = 0; i < nodes; i++)); do
    pinning=""
    ((pin)) && pinning="taskset -c $(cores_of $i)"
    echo "  $i) exec ip netns exec ${ns[i]} unshare --uts sh -c 'hostname ${names[i]}; exec \"\$@\"' sh $pinning \"\$@\" ;;"
  done
  echo '  *) echo "cluster node: no node $i" >&2; exit 2 ;;'
  echo 'esac'
} > "$tmp/node"
# The ssh stand-in Open MPI's rsh launcher calls: `rsh [options] HOST COMMAND`.
{
  echo '#!/bin/sh'
  echo 'while [ "${1#-}" != "$1" ]; do shift; done'
  echo 'host=$1; shift'
  echo 'case $host in'
  for ((i = 0; i < nodes; i++)); do
    echo "  ${ips[i]} | ${names[i]}) exec \"$tmp/node\" $i /bin/sh -c \"\$*\" ;;"
  done
  echo '  *) echo "cluster rsh: no host $host" >&2; exit 255 ;;'
  echo 'esac'
} > "$tmp/rsh"
chmod +x "$tmp/node" "$tmp/rsh"

hosts=$(for ip in "${ips[@]}"; do printf '%s:%s,' "$ip" "$slots"; done)
export KPL_CLUSTER_HOSTS=${hosts%,}
export KPL_CLUSTER_RSH=$tmp/rsh
export KPL_CLUSTER_NODE=$tmp/node
export KPL_CLUSTER_MPI="--host $KPL_CLUSTER_HOSTS --mca plm_rsh_agent $tmp/rsh"
export KPL_CLUSTER_NAMES="${names[*]}" KPL_CLUSTER_IPS="${ips[*]}" KPL_CLUSTER_NETNS="${ns[*]}"
export KPL_CLUSTER_DEV=eth0 KPL_CLUSTER_RATE=${rate:-unshaped}
echo "cluster: $nodes node(s) ${names[*]} at ${ips[*]}, links ${rate:-unshaped}," \
  "$slots slot(s) each" >&2
set +e
"$tmp/node" 0 "$@"
rc=$?
set -e
exit $rc
