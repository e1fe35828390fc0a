#!/usr/bin/env bash
# Bundle ggpipe for the workplace's lent 16-core machine (the `device` tool; no network there, Python 3.12,
# at most 64 MiB travel with the working tree). Writes .dev/ (add "/.dev/" to .git/info/exclude) and
# ggpipe/_native.cpython-312-x86_64-linux-gnu.so; then
#   device run: bash scripts/device/run_batch.sh   carry: [".dev", "ggpipe/_native.cpython-312-x86_64-linux-gnu.so"]
# What goes: mpich + mpi4py + gguf + diskcache wheels (cp312), this venv's llama_cpp package (ctypes, so
# any Python; built here with -DGGML_LLAMAFILE=OFF and -march=native, which the lent Xeon runs), layers 0-1
# of SmolLM2-135M (Q4_1, 35 MB: its Q8_0 token embedding is most of it), from which the machine derives a
# 40-layer F32 model of the goliath's shapes (layers 0-1 twenty times: the same tensors, so the same cost
# per token, not the same text), and optionally llama.cpp's llama-batched-bench (BENCH=1; static,
# llamafile off, built from the pinned sdist's vendored source given as LLAMA_CPP_SRC).
# Needs: a Python 3.12 with headers (PY312), the venv's python active, smollm2-135m fetched.
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
PY312=${PY312:-python3.12}
mkdir -p .dev/whl
python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform manylinux1_x86_64 -d .dev/whl mpich==5.0.2 mpi4py==4.1.2 diskcache==5.6.3 gguf==0.19.0
python - <<'PY'
from ggpipe.models.derive import derive_gguf
from ggpipe.models.registry import resolve
derive_gguf(resolve("smollm2-135m"), [0, 1], ".dev/smol2.gguf", "keep")
PY
xz -6 -f .dev/smol2.gguf
SP=$(python -c "import llama_cpp, os; print(os.path.dirname(os.path.dirname(llama_cpp.__file__)))")
tar -C "$SP" -cJf .dev/llama_cpp.tar.xz llama_cpp $(cd "$SP" && ls -d llama_cpp_python-*.dist-info)
SUF=$($PY312 -c "import sysconfig; print(sysconfig.get_config_var('EXT_SUFFIX'))")
gcc -O2 -std=c11 -fPIC -shared -I"$($PY312 -c "import sysconfig; print(sysconfig.get_paths()['include'])")" \
  native/ggpipe_native.c -ldl -o "ggpipe/_native$SUF"
if [ -n "${BENCH:-}" ]; then
  B=$(mktemp -d)
  cmake -S "$LLAMA_CPP_SRC" -B "$B" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DGGML_AMX_TILE=OFF \
    -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DBUILD_SHARED_LIBS=OFF \
    "-DCMAKE_C_FLAGS=-mno-amx-tile -mno-amx-int8 -mno-amx-bf16" \
    "-DCMAKE_CXX_FLAGS=-mno-amx-tile -mno-amx-int8 -mno-amx-bf16" -DGGML_LLAMAFILE=OFF > /dev/null
  cmake --build "$B" -j "$(nproc)" --target llama-batched-bench > /dev/null
  strip -o .dev/llama-batched-bench "$B/bin/llama-batched-bench" && xz -6 -f .dev/llama-batched-bench
fi
du -sh .dev
