"""Time llama_decode of one multi-sequence decode step through ggpipe's own
Stage (ggpipe.runtime.stage) of a whole model, one KV stream per sequence as
under ``--parallel``: the per-step cost to set beside
``llama-batched-bench``'s T_TG / ntg on the same cores, without the
scheduler, the pipeline or MPI around it (docs/BENCHMARKS.md §25).

    python scripts/stage_decode_time.py -m smollm2-goliath-40l-f32 -t 1 --seqs 8

Prints the median and the fastest step (milliseconds) after a prompt of
``--prompt`` tokens per sequence; steps after the first 8 count.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from ggpipe.models.registry import resolve
from ggpipe.runtime.stage import Stage, StageSpec
from ggpipe.models.gguf_info import read_model_info


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-m", "--model", required=True, help="a registry name or a GGUF path")
    ap.add_argument("-t", "--threads", type=int, default=1)
    ap.add_argument("--seqs", type=int, default=8, help="sequences, one token each per step")
    ap.add_argument("--prompt", type=int, default=64, help="prompt tokens per sequence")
    ap.add_argument("--steps", type=int, default=48)
    ap.add_argument("-c", "--ctx", type=int, default=0, help="KV cells in all (default: 2048 per sequence)")
    a = ap.parse_args()
    path = resolve(a.model)
    n_ctx = a.ctx or 2048 * a.seqs
    st = Stage(StageSpec(model_path=path, n_layer=read_model_info(path).n_layer, first=True, last=True, n_ctx=n_ctx,
                         n_threads=a.threads, n_seq_max=a.seqs, kv_unified=False))
    pp = a.prompt
    for s in range(a.seqs):
        st.decode(pos=np.arange(pp, dtype=np.int32), n_seq_id=np.ones(pp, np.int32),
                  seq_ids=np.full(pp, s, np.int32), outputs=np.zeros(pp, np.int8),
                  tokens=np.arange(100 + s, 100 + s + pp, dtype=np.int32))
    times = []
    for i in range(a.steps):
        t0 = time.perf_counter()
        st.decode(pos=np.full(a.seqs, pp + i, np.int32), n_seq_id=np.ones(a.seqs, np.int32),
                  seq_ids=np.arange(a.seqs, dtype=np.int32), outputs=np.ones(a.seqs, np.int8),
                  tokens=np.full(a.seqs, 200 + i, np.int32))
        times.append(time.perf_counter() - t0)
    st.close()
    ms = 1000 * np.array(times[8:])
    print(f"{a.seqs} sequences, {a.threads} thread(s), n_ctx {n_ctx}: median {np.median(ms):.1f} ms, "
          f"fastest {ms.min():.1f} ms per step")


if __name__ == "__main__":
    main()
