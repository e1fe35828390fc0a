"""Benchmark of the pipeline foundation (iterative mode), for docs/benchmarks/memory.md.

    python scripts/bench_pipeline.py [--n 128] [--repeat 3] [--ranks 1,2,4] \
        [--models smollm2-135m,smollm2-goliath-40l-f32] [--json results/pipeline.json]

1. Single-node parity: ggpipe on one rank (no mpiexec) vs llama-cpp-python's
   own decode loop (ggpipe.bench.baseline) at the same thread count,
   alternating runs, generation tokens/s (prompt processing excluded).
2. Scaling: ``mpiexec -n R ggpipe generate`` for each R and model: tokens/s
   and every rank's peak RSS / PSS.
3. Per-hop overhead derived from (2): (ITL at R=2 - ITL at R=1) / 2 hops
   (head -> rank 1 hidden states, rank 1 -> head logits); the compute is the
   same layers either way. The raw message latency is in
   scripts/bench_transport.py.

Greedy, --ignore-eos (every run generates exactly --n tokens), one thread per
rank. On a machine with fewer cores than ranks, ranks share cores: say so
when quoting numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

from ggpipe.bench import baseline
from ggpipe.bench.runner import PROMPTS, ggpipe_run
from ggpipe.models.registry import resolve

def ggpipe_gen(model, prompt, n, ranks, threads):
    return ggpipe_run(model, prompt, n, ranks, ["-t", str(threads)])


def parity(model_path: str, n: int, repeat: int, threads: int) -> dict:
    ours, ref = [], []
    for r in range(repeat):
        for prompt in PROMPTS:
            b = baseline.greedy(model_path, prompt, n, n_threads=threads, ignore_eos=True)
            g = ggpipe_gen(model_path, prompt, n, None, threads)
            assert g["tokens"] == b.tokens, "ggpipe and llama-cpp-python disagree"
            ref.append(b.tokens_per_s)
            ours.append(g["metrics"]["tokens_per_s"])
            print(f"  parity rep {r} prompt {prompt[:20]!r}: llama-cpp-python {b.tokens_per_s:.1f} tok/s, "
                  f"ggpipe {g['metrics']['tokens_per_s']:.1f} tok/s", flush=True)
    return {"ggpipe_tps": statistics.mean(ours), "llama_cpp_python_tps": statistics.mean(ref),
            "ratio": statistics.mean(ours) / statistics.mean(ref), "samples": len(ours)}


def scaling(model: str, n: int, repeat: int, ranks_list: list[int], threads: int) -> list[dict]:
    for ranks in ranks_list:  # warm-up: cut and cache every slice, so peak RSS is the run's, not the slicing's
        ggpipe_gen(model, PROMPTS[0], 1, ranks, threads)
    rows = []
    for r in range(repeat):
        for ranks in ranks_list:
            for prompt in PROMPTS:
                g = ggpipe_gen(model, prompt, n, ranks, threads)
                rows.append({"model": model, "prompt": prompt, "ranks": ranks, "rep": r, "tps": g["metrics"]["tokens_per_s"],
                             "itl_s": g["metrics"]["itl_mean_s"], "tokens": g["tokens"],
                             "rank_mem": [(x["layers"], x["peak_rss_bytes"], x["peak_pss_bytes"])
                                          for x in g["ranks"]]})
                print(f"  {model} R={ranks} rep {r}: {g['metrics']['tokens_per_s']:.1f} tok/s", flush=True)
    return rows


def summarize(rows: list[dict], ranks_list: list[int]) -> list[dict]:
    out = []
    for ranks in ranks_list:
        sel = [r for r in rows if r["ranks"] == ranks]
        mem = sel[-1]["rank_mem"]
        out.append({
            "ranks": ranks,
            "tps": statistics.mean(r["tps"] for r in sel),
            "itl_ms": 1e3 * statistics.mean(r["itl_s"] for r in sel),
            "layers": [m[0] for m in mem],
            "peak_rss_mb": [max(r["rank_mem"][i][1] for r in sel) / 2**20 for i in range(ranks)],
            "peak_pss_mb": [max((r["rank_mem"][i][2] or 0) for r in sel) / 2**20 for i in range(ranks)],
        })
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=128)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--ranks", default="1,2,4")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--models", default="smollm2-135m,smollm2-goliath-40l-f32")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    ranks_list = [int(x) for x in a.ranks.split(",")]
    models = a.models.split(",")
    env = {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
           "date": time.strftime("%Y-%m-%d %H:%M"), "n": a.n, "repeat": a.repeat, "threads": a.threads}
    print(f"# {env}", flush=True)

    print("## single-node parity", flush=True)
    par = parity(str(resolve(models[0])), a.n, a.repeat, a.threads)
    result = {"env": env, "parity": par, "scaling": {}}
    for model in models:
        print(f"## scaling {model}", flush=True)
        rows = scaling(model, a.n, a.repeat, ranks_list, a.threads)
        for prompt in PROMPTS:  # exactness across splits is part of the benchmark
            outs = {tuple(r["tokens"]) for r in rows if r["prompt"] == prompt}
            if len(outs) != 1:
                raise SystemExit(f"EXACTNESS FAILURE: {model} gave different tokens across ranks for {prompt!r}")
        result["scaling"][model] = summarize(rows, ranks_list)

    print("\n### Single-node parity (1 thread, greedy, %d tokens x %d prompts x %d)" % (a.n, len(PROMPTS), a.repeat))
    print("| | tokens/s |\n|---|---:|")
    print(f"| llama-cpp-python decode loop | {par['llama_cpp_python_tps']:.1f} |")
    print(f"| ggpipe, 1 rank | {par['ggpipe_tps']:.1f} |")
    print(f"| ratio ggpipe / llama-cpp-python | **{par['ratio']:.3f}** |")
    for model, summ in result["scaling"].items():
        print(f"\n### {model}: tokens/s and per-rank peak memory by number of stages")
        print("| ranks | layers per rank | tokens/s | ITL (ms) | peak RSS per rank (MiB) | peak PSS per rank (MiB) |")
        print("|---:|---|---:|---:|---|---|")
        for s in summ:
            lay = ", ".join(f"{a0}-{b0 - 1}" for a0, b0 in s["layers"])
            rss = ", ".join(f"{x:.0f}" for x in s["peak_rss_mb"])
            pss = ", ".join(f"{x:.0f}" for x in s["peak_pss_mb"])
            print(f"| {s['ranks']} | {lay} | {s['tps']:.1f} | {s['itl_ms']:.2f} | {rss} | {pss} |")
        by = {s["ranks"]: s for s in summ}
        if 1 in by and 2 in by:
            hop_us = (by[2]["itl_ms"] - by[1]["itl_ms"]) * 1e3 / 2
            print(f"\nDerived per-hop overhead (ITL at 2 ranks - ITL at 1 rank) / 2 hops: {hop_us:.0f} us")
            result["scaling_hop_us_" + model] = hop_us
    if a.json:
        os.makedirs(os.path.dirname(a.json) or ".", exist_ok=True)
        with open(a.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
