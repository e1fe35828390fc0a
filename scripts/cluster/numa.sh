#!/usr/bin/env bash
# One ggpipe rank per NUMA node of this (multi-socket) machine, each pinned
# to its node with `numactl --cpunodebind N --membind N` and running as many
# threads as the node has CPUs, so every stage's weights and KV cache are
# first touched in its own node's memory (PipeInfer enabled this on its
# multi-socket nodes). The ranks are started with the launcher's MPMD syntax
# (`mpiexec -n 1 numactl ... ggpipe ... : -n 1 numactl ... ggpipe ...`),
# which MPICH and Open MPI both understand; every rank gets the same ggpipe
# arguments, with `-t` listing the threads of each rank.
#
# Topology: /sys/devices/system/node/node*/cpulist (nodes without CPUs are
# skipped). Without that directory the machine counts as one node with
# every CPU. Without numactl the ranks are not pinned by this script: with
# several nodes the launcher binds them instead (`-bind-to numa`, Open MPI
# `--map-by numa --bind-to numa`); with one node nothing needs pinning.
#
# usage: scripts/cluster/numa.sh [options] -- GGPIPE-COMMAND...
#   --ranks-per-node K  K ranks per NUMA node, each on its own share of the
#                       node's CPUs (numactl --physcpubind); default 1
#   --nodes LIST        use only these NUMA nodes (e.g. 0,1); default all with CPUs
#   --dry-run           print the topology, the command and `ggpipe plan`'s table; run nothing
# environment: MPIEXEC (default mpiexec), GGPIPE (default ggpipe; e.g. "python -P -m ggpipe"),
#              NUMACTL (default numactl; "none" to not use it), MPI_FLAVOR=openmpi|mpich,
#              NUMA_SYSFS (default /sys/devices/system/node; a fake tree for tests).
#
# example:
#   scripts/cluster/numa.sh --dry-run -- generate -m smollm2-goliath-40l -p "Hello" -n 64
set -euo pipefail

# shellcheck source=common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

MPIEXEC=${MPIEXEC:-mpiexec}
read -r -a GGPIPE_CMD <<< "${GGPIPE:-ggpipe}"
NUMACTL=${NUMACTL:-numactl}
SYSFS=${NUMA_SYSFS:-/sys/devices/system/node}
per_node=1 only="" dry=0
while [ $# -gt 0 ]; do
  case "$1" in
    --ranks-per-node) per_node=${2:?}; shift 2 ;;
    --nodes) only=${2:?}; shift 2 ;;
    --dry-run) dry=1; shift ;;
    -h|--help) usage; exit 0 ;;
    --) shift; break ;;
    *) die "unknown option $1 (the ggpipe command goes after --; see --help)" ;;
  esac
done
[ $# -gt 0 ] || die "give the ggpipe command after --, e.g. -- generate -m MODEL -p \"Hello\""
[[ $per_node =~ ^[1-9][0-9]*$ ]] || die "--ranks-per-node must be a positive integer"
for a in "$@"; do
  case "$a" in -t|--threads|--threads=*) die "numa.sh sets -t itself (threads per rank = CPUs of its node)" ;; esac
done

# expand a cpulist such as 0-3,8-11 into "0 1 2 3 8 9 10 11"
expand() {
  local out=() part a b
  IFS=, read -r -a parts <<< "$1"
  for part in "${parts[@]}"; do
    [ -n "$part" ] || continue
    if [[ $part == *-* ]]; then a=${part%-*}; b=${part#*-}; for ((c = a; c <= b; c++)); do out+=("$c"); done
    else out+=("$part"); fi
  done
  echo "${out[@]:-}"
}

# NUMA nodes with CPUs: ids and their CPU lists
nodes=() cpus=()
if [ -d "$SYSFS" ]; then
  for d in "$SYSFS"/node[0-9]*; do
    [ -r "$d/cpulist" ] || continue
    id=${d##*node}; list=$(expand "$(cat "$d/cpulist")")
    [ -n "$list" ] || continue
    if [ -n "$only" ] && [[ ",$only," != *",$id,"* ]]; then continue; fi
    nodes+=("$id"); cpus+=("$list")
  done
fi
if [ ${#nodes[@]} -eq 0 ]; then
  [ -z "$only" ] || die "--nodes $only: no such NUMA node with CPUs"
  n=$(nproc 2>/dev/null || getconf _NPROCESSORS_ONLN)
  nodes=(0); cpus=("$(seq -s ' ' 0 $((n - 1)))")
  warn "no NUMA topology in $SYSFS: treating the machine as one node with $n CPUs"
fi
order=()  # sort by node id
while read -r i; do order+=("$i"); done < <(for i in "${!nodes[@]}"; do echo "${nodes[$i]} $i"; done | sort -n | cut -d' ' -f2)

have_numactl=0
if [ "$NUMACTL" != none ] && command -v "$NUMACTL" >/dev/null 2>&1; then have_numactl=1; fi

# one entry per rank: its node, its CPUs, its threads
r_node=() r_cpus=() r_threads=()
for i in "${order[@]}"; do
  read -r -a list <<< "${cpus[$i]}"
  n=${#list[@]}
  [ "$n" -ge "$per_node" ] || die "node ${nodes[$i]} has $n CPUs, fewer than --ranks-per-node $per_node"
  for ((k = 0; k < per_node; k++)); do
    lo=$((k * n / per_node)); hi=$(((k + 1) * n / per_node))
    share=("${list[@]:lo:hi-lo}")
    r_node+=("${nodes[$i]}"); r_cpus+=("$(IFS=,; echo "${share[*]}")"); r_threads+=("${#share[@]}")
  done
done
ranks=${#r_node[@]}
threads=$(IFS=,; echo "${r_threads[*]}")
n_nodes=${#nodes[@]}

flavor=${MPI_FLAVOR:-}
if [ -z "$flavor" ]; then
  case "$("$MPIEXEC" --version 2>&1 || true)" in
    *"Open MPI"*|*OpenRTE*|*open-mpi.org*) flavor=openmpi ;;
    *) flavor=mpich ;;
  esac
fi

ggpipe_args=("${GGPIPE_CMD[@]}" "$@" -t "$threads")
cmd=("$MPIEXEC")
# hydra: survivors are told of a dead rank (SIGUSR1) instead of being killed, so ggpipe can name it
[ "$flavor" = mpich ] && cmd+=(-disable-auto-cleanup)
if [ "$have_numactl" = 1 ]; then
  [ "$flavor" = openmpi ] && cmd+=(--bind-to none)  # numactl pins; Open MPI must not bind on top
  for ((r = 0; r < ranks; r++)); do
    [ "$r" -gt 0 ] && cmd+=(:)
    if [ "$per_node" -gt 1 ]; then pin=(--physcpubind "${r_cpus[$r]}" --membind "${r_node[$r]}")
    else pin=(--cpunodebind "${r_node[$r]}" --membind "${r_node[$r]}"); fi
    cmd+=(-n 1 "$NUMACTL" "${pin[@]}" "${ggpipe_args[@]}")
  done
else
  cmd+=(-n "$ranks")
  if [ "$n_nodes" -gt 1 ]; then
    warn "numactl not available: the launcher binds the ranks to NUMA nodes instead (memory is not bound)"
    if [ "$flavor" = openmpi ]; then cmd+=(--map-by numa --bind-to numa); else cmd+=(-bind-to numa); fi
  else
    warn "numactl not available: ranks are not pinned (this machine has one NUMA node)"
  fi
  cmd+=("${ggpipe_args[@]}")
fi

if [ "$dry" = 1 ]; then
  echo "# NUMA nodes: $n_nodes; MPI: $flavor; numactl: $([ "$have_numactl" = 1 ] && echo yes || echo no)"
  for ((r = 0; r < ranks; r++)); do
    echo "#   rank $r: node ${r_node[$r]}, CPUs ${r_cpus[$r]}, ${r_threads[$r]} threads"
  done
  show "${cmd[@]}"
  echo
  "${GGPIPE_CMD[@]}" plan -n "$ranks" --no-command -- "$@" -t "$threads"
  exit $?
fi
"${cmd[@]}"
