#!/usr/bin/env bash
# Launch a ggpipe job on the hosts of a hostfile, with Open MPI or MPICH
# (also Intel MPI / MVAPICH: Hydra). Detects which one `mpiexec` is and uses
# its flags:
#
#                     Open MPI                       MPICH (Hydra)
#   hostfile          --hostfile FILE (host slots=N)  -f FILE (host:N)
#   one rank / host   --map-by node                  -ppn 1
#   fill slots        --map-by slot                  (default)
#   binding           --bind-to core|socket|numa     -bind-to core:T|socket|numa
#
# A hostfile in either format is accepted and converted when needed.
#
# usage: scripts/cluster/mpirun-hostfile.sh [options] -- GGPIPE-COMMAND...
#   --hostfile FILE   hosts (default: $GGPIPE_HOSTFILE or ./hosts)
#   -n RANKS          ranks (default: one per host with --map-by node, else all slots)
#   --map-by node|slot  (default node: pipeline stages on different hosts)
#   --bind-to none|core|socket|numa  (default none; core gives each rank -t cores)
#   --dry-run         print the command and `ggpipe plan`'s rank/memory table; run nothing
#   --mem-per-node SIZE  memory of each host for the plan's fit warning (e.g. 64G)
# environment: MPIEXEC (default mpiexec), GGPIPE (default ggpipe; e.g. "python -P -m ggpipe"),
#              MPI_FLAVOR=openmpi|mpich to skip detection.
#
# example:
#   scripts/cluster/mpirun-hostfile.sh --hostfile hosts --dry-run -- generate -m /nfs/models/m.gguf -t 8 -p "Hello"
set -euo pipefail

# shellcheck source=common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

MPIEXEC=${MPIEXEC:-mpiexec}
read -r -a GGPIPE_CMD <<< "${GGPIPE:-ggpipe}"
hostfile=${GGPIPE_HOSTFILE:-hosts}
ranks="" map_by=node bind_to=none dry=0 mem=""
while [ $# -gt 0 ]; do
  case "$1" in
    --hostfile|-hostfile|-f) hostfile=${2:?}; shift 2 ;;
    -n|-np) ranks=${2:?}; shift 2 ;;
    --map-by) map_by=${2:?}; shift 2 ;;
    --bind-to) bind_to=${2:?}; shift 2 ;;
    --mem-per-node) mem=${2:?}; shift 2 ;;
    --dry-run) dry=1; shift ;;
    -h|--help) usage; exit 0 ;;
    --) shift; break ;;
    *) die "unknown option $1 (the ggpipe command goes after --; see --help)" ;;
  esac
done
[ $# -gt 0 ] || die "give the ggpipe command after --, e.g. -- generate -m MODEL -p \"Hello\""
case "$map_by" in node|slot) ;; *) die "--map-by must be node or slot" ;; esac
case "$bind_to" in none|core|socket|numa) ;; *) die "--bind-to must be none, core, socket or numa" ;; esac
[ -r "$hostfile" ] || die "hostfile $hostfile not found (give --hostfile FILE)"

# hosts and slots, from either format ('host', 'host slots=N', 'host:N'; # comments)
hosts=() slots=()
while IFS= read -r line || [ -n "$line" ]; do
  line=${line%%#*}; line=$(echo "$line" | xargs)
  [ -n "$line" ] || continue
  h=${line%%[ :]*}; s=1
  if [[ $line =~ :([0-9]+) ]]; then s=${BASH_REMATCH[1]}; fi
  if [[ $line =~ slots[[:space:]]*=[[:space:]]*([0-9]+) ]]; then s=${BASH_REMATCH[1]}; fi
  hosts+=("$h"); slots+=("$s")
done < "$hostfile"
[ ${#hosts[@]} -gt 0 ] || die "hostfile $hostfile lists no hosts"
if [ -z "$ranks" ]; then
  if [ "$map_by" = node ]; then ranks=${#hosts[@]}; else ranks=0; for s in "${slots[@]}"; do ranks=$((ranks + s)); done; fi
fi

# threads per rank: the largest value of the command's -t (for core binding)
threads=1 prev=""
for a in "$@"; do
  if [ "$prev" = -t ] || [ "$prev" = --threads ]; then
    for v in ${a//,/ }; do [ "$v" -gt "$threads" ] 2>/dev/null && threads=$v; done
  fi
  prev=$a
done

flavor=${MPI_FLAVOR:-}
if [ -z "$flavor" ]; then
  version=$("$MPIEXEC" --version 2>&1 || true)
  case "$version" in
    *"Open MPI"*|*OpenRTE*|*open-mpi.org*) flavor=openmpi ;;
    *HYDRA*|*MPICH*|*"Intel(R) MPI"*) flavor=mpich ;;
    *) die "cannot tell which MPI '$MPIEXEC' is (set MPI_FLAVOR=openmpi or mpich)" ;;
  esac
fi

# the hostfile in the launcher's own format (converted into a temporary file when needed)
tmp=$hostfile
if { [ "$flavor" = openmpi ] && grep -q '^[^#]*:' "$hostfile"; } ||
   { [ "$flavor" = mpich ] && grep -q '^[^#]*slots' "$hostfile"; }; then
  tmp=$(mktemp "${TMPDIR:-/tmp}/ggpipe-hosts.XXXXXX")
  trap 'rm -f "$tmp"' EXIT
  for i in "${!hosts[@]}"; do
    if [ "$flavor" = openmpi ]; then echo "${hosts[$i]} slots=${slots[$i]}"; else echo "${hosts[$i]}:${slots[$i]}"; fi
  done > "$tmp"
fi

cmd=("$MPIEXEC" -n "$ranks")
if [ "$flavor" = openmpi ]; then
  mapping=$map_by
  if [ "$bind_to" = core ] && [ "$threads" -gt 1 ]; then mapping="$map_by:PE=$threads"; fi
  cmd+=(--hostfile "$tmp" --map-by "$mapping" --bind-to "$bind_to")
else
  # hydra: survivors are told of a dead rank (SIGUSR1) instead of being killed, so ggpipe can name it
  cmd+=(-disable-auto-cleanup -f "$tmp")
  [ "$map_by" = node ] && cmd+=(-ppn 1)
  if [ "$bind_to" = core ] && [ "$threads" -gt 1 ]; then cmd+=(-bind-to "core:$threads")
  elif [ "$bind_to" != none ]; then cmd+=(-bind-to "$bind_to"); fi
fi
cmd+=("${GGPIPE_CMD[@]}" "$@")

if [ "$dry" = 1 ]; then
  echo "# MPI: $flavor; $ranks ranks, --map-by $map_by, --bind-to $bind_to"
  if [ "$tmp" != "$hostfile" ]; then echo "# $hostfile converted to $flavor's format:"; sed 's/^/#   /' "$tmp"; fi
  show "${cmd[@]}"
  echo
  plan=("${GGPIPE_CMD[@]}" plan -n "$ranks" --hostfile "$hostfile" --map-by "$map_by" --no-command)
  [ -n "$mem" ] && plan+=(--mem-per-node "$mem")
  "${plan[@]}" -- "$@"
  exit $?
fi
"${cmd[@]}"
