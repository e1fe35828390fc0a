#!/usr/bin/env bash
# The exactness tests in the exact build: a virtual environment of its own with
# llama-cpp-python built without llamafile's sgemm (scripts/install_exact.sh),
# every job run with --exact (GGPIPE_EXACT=1) and the single-node reference with
# the same kernels. There, every speculative mode's greedy output equals the
# reference in every run, also at near-ties (tests/test_exact_every_run.py).
#   bash scripts/test_exact_build.sh         # a short set; venv in $GGPIPE_EXACT_VENV or a temporary directory
#   bash scripts/test_exact_build.sh --all   # every greedy speculation, exactness and --parallel test
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${GGPIPE_EXACT_VENV:-$(mktemp -d)/venv-exact}"
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
# shellcheck disable=SC1091
source "$VENV/bin/activate"
python -m pip install --quiet --upgrade pip
bash scripts/install_exact.sh -e ".[mpich,test]"
# Without arguments: the kernel report, every run of the near-tie prompts in each speculative loop, and
# bursts under --parallel (prompts batched together, a shared prefix, a lone request's drafts) and seeded sampling
# in each speculative mode, which must equal the reference bit for bit here. With --all: every greedy and seeded
# speculation test and the rest of each matrix.
if [ "${1:-}" = "--all" ]; then
  GGPIPE_EXACT=1 python -m pytest -q -rs --all tests/test_kernels.py tests/test_exact_every_run.py tests/test_exactness.py \
    tests/test_speculation_modes.py -k "greedy or seed or not test_speculation_modes" \
    "tests/test_chat.py::test_piped_conversation_equals_single_node" tests/test_parallel.py
else
  GGPIPE_EXACT=1 python -m pytest -q -rs --full "tests/test_kernels.py::test_the_probe_measures_the_build" \
    tests/test_exact_every_run.py \
    "tests/test_parallel.py::test_batch_requests_equal_single_node_at_any_parallel" \
    "tests/test_parallel.py::test_requests_sharing_a_prefix_borrow_its_cells_and_stay_exact" \
    "tests/test_parallel.py::test_a_sampled_request_alone_drafts_and_gives_its_seeded_tokens" \
    "tests/test_parallel.py::test_ngram_chains_of_a_request_alone_are_exact" \
    "tests/test_speculation_modes.py::test_sampled_speculation_gives_iterative_tokens_for_the_seed"
fi
