"""Time llama_decode of one multi-sequence decode step through ggpipe's own
Stage (ggpipe.runtime.stage) of a whole model, one KV stream per sequence as
under ``--parallel``: the per-step cost to set beside
``llama-batched-bench``'s T_TG / ntg on the same cores, without the
scheduler, the pipeline or MPI around it (docs/benchmarks/many-requests.md).

    python scripts/experiments/stage_decode_time.py -m smollm2-goliath-40l-f32 -t 1 --seqs 8

``--layers A:B`` times one stage's slice instead (layers A..B-1, the slice
file ``ggpipe.models.derive.stage_slice`` gives a rank; a stage after the
first gets hidden states of random values, a stage before the last returns
hidden states), and ``--start-at T`` (a time.time() value) holds the timed
steps until then, so that two such processes started together time their
steps beside each other, as a pipeline's stages compute on one host
(docs/benchmarks/many-requests.md, What bounds it on two cores).

Prints the median and the fastest step (milliseconds) after a prompt of
``--prompt`` tokens per sequence; steps after the first 8 count. Also the
prompts' cost per row, with ``--prompt-seqs K`` sequences' prompts in one
run (K * --prompt rows, at most the ubatch of 512).
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from ggpipe.models.derive import stage_slice
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
    ap.add_argument("--slots", type=int, default=0,
                    help="sequences in the context (default --seqs); a multiple of --seqs: the steps take the "
                         "groups of --seqs consecutive ids in turn, as --parallel's micro-batches do")
    ap.add_argument("--layers", default="", help="A:B, one stage's slice (default: the whole model)")
    ap.add_argument("--prompt-seqs", type=int, default=1, help="sequences whose prompts share one run")
    ap.add_argument("--start-at", type=float, default=0.0, help="time.time() at which the timed steps start")
    a = ap.parse_args()
    whole = resolve(a.model)
    n_all = read_model_info(whole).n_layer
    start, stop = (int(x) for x in a.layers.split(":")) if a.layers else (0, n_all)
    path = stage_slice(whole, start, stop)
    slots = a.slots or a.seqs
    if slots % a.seqs:
        raise SystemExit("--slots must be a multiple of --seqs")
    n_ctx = a.ctx or 2048 * slots
    first, last = start == 0, stop == n_all
    st = Stage(StageSpec(model_path=path, n_layer=stop - start, first=first, last=last, n_ctx=n_ctx,
                         n_threads=a.threads, n_seq_max=slots, kv_unified=False))
    rng = np.random.default_rng(0)

    def inputs(n: int, base: int) -> dict:
        if first:
            return {"tokens": np.arange(base, base + n, dtype=np.int32)}
        return {"embd": rng.standard_normal((n, st.n_embd), dtype=np.float32)}

    pp, k = a.prompt, a.prompt_seqs
    if slots % k or k * pp > 512:
        raise SystemExit("--prompt-seqs must divide the sequences and --prompt-seqs x --prompt be at most 512")
    prompt_s = []
    for s in range(0, slots, k):
        t0 = time.perf_counter()
        st.decode(pos=np.tile(np.arange(pp, dtype=np.int32), k), n_seq_id=np.ones(k * pp, np.int32),
                  seq_ids=np.repeat(np.arange(s, s + k, dtype=np.int32), pp), outputs=np.zeros(k * pp, np.int8),
                  **inputs(k * pp, 100 + s))
        prompt_s.append(time.perf_counter() - t0)
    steps = [inputs(a.seqs, 200 + i) for i in range(a.steps)]
    if a.start_at:
        time.sleep(max(0.0, a.start_at - time.time()))
    times = []
    groups = slots // a.seqs
    for i in range(a.steps):
        g = i % groups
        t0 = time.perf_counter()
        st.decode(pos=np.full(a.seqs, pp + i // groups, np.int32), n_seq_id=np.ones(a.seqs, np.int32),
                  seq_ids=np.arange(g * a.seqs, (g + 1) * a.seqs, dtype=np.int32), outputs=np.ones(a.seqs, np.int8),
                  **steps[i])
        times.append(time.perf_counter() - t0)
    st.close()
    ms = 1000 * np.array(times[8:])
    print(f"layers {start}-{stop - 1} of {n_all}, {a.seqs} of {slots} sequences a step, {a.threads} thread(s), n_ctx {n_ctx}: "
          f"median {np.median(ms):.1f} ms, fastest {ms.min():.1f} ms per step; prompts in runs of {k * pp} rows: "
          f"{1000 * np.median(prompt_s) / (k * pp):.2f} ms a row (median)")


if __name__ == "__main__":
    main()
