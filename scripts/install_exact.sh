#!/usr/bin/env bash
# pip install, with llama-cpp-python built without llamafile's sgemm
# (-DGGML_LLAMAFILE=OFF): the build `--exact` needs, where a token inside a
# verification batch gets logits bit-identical to a token alone (README
# "Exactness"). pip's wheel cache does not know build flags, so this uses a
# cache of its own that only ever holds wheels built with these flags, then
# checks the llama.cpp it installed (rebuilding it once if an earlier install
# in the same venv had other flags).
#   bash scripts/install_exact.sh -e ".[mpich,test]"
set -euo pipefail
export CMAKE_ARGS="-DGGML_LLAMAFILE=OFF${CMAKE_ARGS:+ $CMAKE_ARGS}"
export PIP_CACHE_DIR="${GGPIPE_PIP_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/ggpipe/pip-llamafile-off}"
python -m pip install --quiet "$@"
has_sgemm() {  # ggpipe's own check of the loaded llama.cpp (ggpipe/runtime/llama.py)
  python -c 'import sys; from ggpipe.runtime.llama import llamafile_sgemm; sys.exit(0 if llamafile_sgemm() else 1)'
}
if has_sgemm; then
  echo "install_exact: llama-cpp-python has llamafile's sgemm (installed earlier with other flags); rebuilding it" >&2
  python -m pip install --quiet --force-reinstall --no-deps "$(python -c 'import importlib.metadata as m; print("llama-cpp-python==" + m.version("llama-cpp-python"))')"
  if has_sgemm; then echo "install_exact: llama-cpp-python still has llamafile's sgemm" >&2; exit 1; fi
fi
