#!/usr/bin/env python3
"""Target pass cost against batch size (what a speculative verification pass
costs), for one or two llama-cpp-python builds side by side.

    python scripts/experiments/bench_batch_cost.py -m smollm2-goliath-40l-f32 --sizes 1,2,4,8 \\
        --compare /path/to/other-venv/bin/python --rounds 3

Each measurement: the whole model in one llama.cpp context (1 thread, flash
attention off, as a ggpipe rank), a 96-token prompt, then ``--reps`` batches of
each size with logits for every row (as verification asks), each removed again
with ``seq_rm`` so the KV length stays put; the median time per batch. With
``--compare``, rounds alternate between this interpreter and the other one
(e.g. a venv whose llama-cpp-python was built with llamafile's sgemm, the
default, while this one was built with ``-DGGML_LLAMAFILE=OFF``), so the two
builds meet the machine's drift alike. Prints a table of medians over rounds
and the ratio; ``--json`` writes every round.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def measure(model: str, sizes: list[int], reps: int, threads: int) -> dict:
    """Median seconds per batch of each size; and whether llamafile's sgemm is built in."""
    import numpy as np

    from ggpipe.bench.baseline import _open
    from ggpipe.runtime.llama import lib, llamafile_sgemm

    L = lib()
    mdl, ctx = _open(L, model, 1024, threads)
    mem = L.llama_get_memory(ctx)
    n_prompt = 96
    batch = L.llama_batch_init(max(sizes + [n_prompt]), 0, 1)
    rng = np.random.default_rng(0)

    def decode(tokens, p0: int, all_logits: bool) -> None:
        batch.n_tokens = len(tokens)
        for i, t in enumerate(tokens):
            batch.token[i] = int(t)
            batch.pos[i] = p0 + i
            batch.n_seq_id[i] = 1
            batch.seq_id[i][0] = 0
            batch.logits[i] = 1 if all_logits or i == len(tokens) - 1 else 0
        if L.llama_decode(ctx, batch) != 0:
            raise RuntimeError("llama_decode failed")

    try:
        decode(rng.integers(100, 20000, n_prompt), 0, False)
        out = {}
        for n in sizes:
            times = []
            for _ in range(reps):
                toks = rng.integers(100, 20000, n)
                t0 = time.perf_counter()
                decode(toks, n_prompt, True)
                times.append(time.perf_counter() - t0)
                L.llama_memory_seq_rm(mem, 0, n_prompt, -1)
            out[str(n)] = statistics.median(times)
        return {"llamafile_sgemm": llamafile_sgemm(), "seconds": out}
    finally:
        L.llama_batch_free(batch)
        L.llama_free(ctx)
        L.llama_model_free(mdl)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--model", default="smollm2-goliath-40l-f32")
    ap.add_argument("--sizes", default="1,2,4,8")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("-t", "--threads", type=int, default=1)
    ap.add_argument("--compare", default=None, help="another interpreter (venv python) to alternate with")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", dest="json_out", default=None)
    ap.add_argument("--one", action="store_true", help=argparse.SUPPRESS)  # a single measurement, as JSON
    a = ap.parse_args()
    sizes = [int(x) for x in a.sizes.split(",")]
    if a.one:
        print(json.dumps(measure(a.model, sizes, a.reps, a.threads)))
        return 0
    from ggpipe.models.registry import resolve

    model = str(resolve(a.model))
    pythons = [sys.executable] + ([a.compare] if a.compare else [])
    rounds = []
    for r in range(a.rounds):
        for py in (pythons if r % 2 == 0 else pythons[::-1]):
            p = subprocess.run([py, __file__, "--one", "-m", model, "--sizes", a.sizes, "--reps", str(a.reps),
                                "-t", str(a.threads)], capture_output=True, text=True, check=True)
            res = json.loads(p.stdout.strip().splitlines()[-1])
            res.update(python=py, round=r)
            rounds.append(res)
            print(f"round {r} {py}: sgemm={res['llamafile_sgemm']} "
                  + " ".join(f"{n}:{1e3 * s:.1f}ms" for n, s in res["seconds"].items()), flush=True)
    print(f"\n{Path(model).name}, {a.threads} thread(s), median over {a.rounds} rounds of the per-round medians")
    print("| build | " + " | ".join(f"{n} tok" for n in sizes) + " |")
    print("|---|" + "---:|" * len(sizes))
    med = {}
    for py in pythons:
        rs = [x for x in rounds if x["python"] == py]
        label = "llamafile sgemm (default)" if rs[0]["llamafile_sgemm"] else "-DGGML_LLAMAFILE=OFF"
        med[py] = {n: statistics.median(x["seconds"][str(n)] for x in rs) for n in sizes}
        print(f"| {label} | " + " | ".join(f"{1e3 * med[py][n]:.1f} ms" for n in sizes) + " |")
    if a.compare:
        print("| ratio (this / other) | " + " | ".join(f"{med[pythons[0]][n] / med[pythons[1]][n]:.2f}x"
                                                      for n in sizes) + " |")
    if a.json_out:
        Path(a.json_out).write_text(json.dumps({"model": model, "threads": a.threads, "rounds": rounds}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
