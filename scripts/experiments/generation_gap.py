"""Where does one process's generation speed go between ``llama-bench`` and
``ggpipe``? Four rows, interleaved round by round, each a fresh process, one
model, ``-t THREADS``, tokens generated at KV depth ``--depth``:

* ``llama-bench``: ``llama-bench -p 0 -n N -d DEPTH -fa 0 -r 1`` (llama.cpp's
  default build: ``python scripts/peer_llamacpp.py build``);
* ``bare``: a Python process holding the model as ggpipe's ``Stage`` loads
  it (llama-cpp-python's library, repacked weights), a context of its own
  with llama-bench's settings (``n_batch`` 2048,
  ``n_ubatch`` 512, one sequence, no callbacks), and a loop of
  ``llama_decode(llama_batch_get_one(token, 1))`` + ``llama_synchronize``
  (the same calls as llama-bench's generation test, through ctypes);
* ``stage``: the same loop through ggpipe's ``Stage.decode``
  (``ggpipe.runtime.stage``: its context, batch filler, logits copy and
  checks), no decoding loop, pipeline or sampler around it;
* ``ggpipe``: ``ggpipe batch --parallel 1`` over ``--requests`` prompts of
  ``--depth`` tokens, ``-n N`` greedy tokens each, the median request's
  tokens/s after the first (a warm-up).

    python scripts/peer_llamacpp.py build
    python scripts/experiments/generation_gap.py -m GOLIATH_Q4_0.gguf --rounds 6

Prints one line a round and the medians, each row also as a fraction of
``llama-bench``'s. Every row attends over a KV cache of llama-bench's own
size (depth + N rounded up to 256 cells; ``-c`` sets another for the rows
but llama-bench): without flash attention a larger one costs a few percent.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from bench_kernels import bench_ctx, prompts  # noqa: E402
from peer_llamacpp import bin_path  # noqa: E402

from ggpipe.child_process import child_env, ggpipe_command  # noqa: E402

ROWS = ("llama-bench", "bare", "stage", "ggpipe")


def in_process(row: str, model: str, threads: int, depth: int, n: int, ctx: int) -> float:
    """``bare`` or ``stage`` in this process: generation tokens/s."""
    import numpy as np  # noqa: PLC0415

    from ggpipe.models.gguf_info import read_model_info  # noqa: PLC0415
    from ggpipe.runtime import llama as _llama  # noqa: PLC0415
    from ggpipe.runtime.stage import Stage, StageSpec  # noqa: PLC0415

    st = Stage(StageSpec(model_path=model, n_layer=read_model_info(model).n_layer, first=True, last=True,
                         n_ctx=ctx, n_threads=threads, n_seq_max=1, kv_unified=True))
    L = st._L
    prompt = np.arange(depth, dtype=np.int32) % 1000 + 50
    if row == "stage":
        outs = np.zeros(depth, np.int8)
        outs[-1] = 1
        st.decode(pos=np.arange(depth, dtype=np.int32), n_seq_id=np.ones(depth, np.int32),
                  seq_ids=np.zeros(depth, np.int32), outputs=outs, tokens=prompt)

        def step(i: int) -> None:
            st.decode(pos=np.array([depth + i], np.int32), n_seq_id=np.ones(1, np.int32),
                      seq_ids=np.zeros(1, np.int32), outputs=np.ones(1, np.int8), tokens=np.array([100 + i], np.int32))
    else:
        cp = L.llama_context_default_params()
        cp.n_ctx, cp.n_batch, cp.n_ubatch = ctx, 2048, 512
        cp.n_threads = cp.n_threads_batch = threads
        cp.flash_attn_type = _llama.flash_attn_type("off")
        lctx = L.llama_init_from_model(st.model, cp)
        toks = (ctypes.c_int32 * depth)(*prompt.tolist())
        if L.llama_decode(lctx, L.llama_batch_get_one(toks, depth)) != 0:
            raise SystemExit("llama_decode failed on the prompt")
        one = (ctypes.c_int32 * 1)()

        def step(i: int) -> None:
            one[0] = 100 + i
            if L.llama_decode(lctx, L.llama_batch_get_one(one, 1)) != 0:
                raise SystemExit("llama_decode failed")
            L.llama_synchronize(lctx)
    for i in range(4):          # warm-up, as llama-bench's
        step(i)
    t0 = time.perf_counter()
    for i in range(4, 4 + n):
        step(i)
    return n / (time.perf_counter() - t0)


def one_row(row: str, a: argparse.Namespace, req: Path, workdir: Path) -> float:
    """One row in a process of its own: generation tokens/s."""
    if row == "llama-bench":
        out = subprocess.run([str(bin_path("llama-bench")), "-m", a.model, "-t", str(a.threads), "-p", "0",
                              "-n", str(a.n), "-d", str(a.depth), "-fa", "0", "-r", "1", "-o", "json"],
                             capture_output=True, text=True, check=True).stdout
        return float(json.loads(out)[0]["avg_ts"])
    if row == "ggpipe":
        out = workdir / "out.jsonl"
        out.unlink(missing_ok=True)
        subprocess.run([*ggpipe_command(), "batch", str(req), "-o", str(out), "-m", a.model, "-t", str(a.threads),
                        "-c", str(a.ctx), "--parallel", "1", "--ignore-eos", "--no-progress"],
                       capture_output=True, check=True, env=child_env())
        tps = [json.loads(ln)["metrics"]["tokens_per_s"] for ln in out.read_text().splitlines()][1:]
        return statistics.median(tps)
    out = subprocess.run([sys.executable, __file__, "--row", row, "-m", a.model, "-t", str(a.threads),
                          "--depth", str(a.depth), "-n", str(a.n), "-c", str(a.ctx)],
                         capture_output=True, text=True, check=True).stdout
    return float(out.split()[-1])


def requests(model: str, depth: int, n: int, k: int) -> str:
    """``k`` requests of about ``depth`` prompt tokens (scripts/bench_kernels.py's held-out prompts)."""
    texts, _ = prompts(Path(model), k, depth)
    return "".join(json.dumps({"id": i, "prompt": t, "n": n}) + "\n" for i, t in enumerate(texts))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-m", "--model", required=True, help="a GGUF path")
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--depth", type=int, default=298, help="KV depth (prompt tokens) where tokens are generated")
    ap.add_argument("-n", type=int, default=128, help="tokens generated")
    ap.add_argument("-c", "--ctx", type=int, default=0,
                    help="context (cells) of every row but llama-bench (default: llama-bench's own, depth + n "
                         "rounded up to 256)")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--requests", type=int, default=4, help="ggpipe row: requests (the first is a warm-up)")
    ap.add_argument("--row", choices=("bare", "stage"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    a.ctx = a.ctx or bench_ctx(a.depth, a.n)
    if a.row:
        print(in_process(a.row, a.model, a.threads, a.depth, a.n, a.ctx))
        return
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        req = workdir / "req.jsonl"
        req.write_text(requests(a.model, a.depth, a.n, a.requests))
        got: dict[str, list[float]] = {r: [] for r in ROWS}
        for i in range(a.rounds):
            order = ROWS[i % len(ROWS):] + ROWS[:i % len(ROWS)]
            for row in order:
                got[row].append(one_row(row, a, req, workdir))
            print(f"round {i}: " + ", ".join(f"{r} {got[r][-1]:.1f}" for r in ROWS), flush=True)
    base = statistics.median(got["llama-bench"])
    print("| row | generation tok/s (median) | / llama-bench |\n|---|---:|---:|")
    for r in ROWS:
        m = statistics.median(got[r])
        print(f"| {r} | {m:.1f} | {m / base:.2f}x |")


if __name__ == "__main__":
    main()
