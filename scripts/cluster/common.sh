# Helpers shared by the launcher scripts in this folder (sourced, not run).
# (ggpipe.sbatch keeps its own copy: Slurm runs a spooled copy of a batch
# script, so it cannot find files beside it.)

# the script's header comment, as its --help
usage() { sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; }
# print a command line, quoting only the words that need it
show() {
  local out=() a
  for a in "$@"; do
    if [[ $a =~ ^[A-Za-z0-9_@%+=:,./-]+$ ]]; then out+=("$a"); else out+=("${a@Q}"); fi
  done
  echo "${out[*]}"
}
die() { echo "${0##*/}: error: $*" >&2; exit 2; }
warn() { echo "${0##*/}: warning: $*" >&2; }
