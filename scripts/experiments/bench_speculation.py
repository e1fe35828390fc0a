"""Benchmark of the speculation modes (PipeInfer's evaluation, V.A), for
docs/benchmarks/one-stream.md.

    python scripts/experiments/bench_speculation.py [--n 128] [--ranks 2,3] [--json results/speculation.json]
    python scripts/experiments/bench_speculation.py --sweep          # the sweep that chose the defaults

Target ``smollm2-goliath-40l-f32`` (681 MB, memory-bandwidth bound), draft
``smollm2-135m``, greedy, exactly --n tokens (--ignore-eos) for each of the
three prompt categories, one thread per rank. 2 ranks: target on rank 0,
draft on rank 1; 3 ranks: target split over ranks 0-1 (0.5,0.5/1.0). All
configurations run side by side in one invocation, interleaved prompt by
prompt, so their ratios share the machine's state. Every run's tokens must
equal the iterative run's (exactness is part of the benchmark).

Single-node baseline on the same cores: llama-cpp-python's own decode loop on
the target with as many threads as the pipeline has ranks.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import time

from ggpipe.bench import baseline
from ggpipe.bench.runner import PROMPTS, ggpipe_run
from ggpipe.models.registry import resolve

TARGET, DRAFT = "smollm2-goliath-40l-f32", "smollm2-135m"

MODES = {
    "iterative": ["--mode", "iterative"],
    "speculative": ["--mode", "speculative"],
    "pipeinfer": ["--mode", "pipeinfer"],
    "pipeinfer --no-cancel": ["--mode", "pipeinfer", "--no-cancel"],
    "pipeinfer --no-continuous": ["--mode", "pipeinfer", "--no-continuous"],
}


def split_for(ranks: int) -> list[str]:
    return [] if ranks == 2 else ["--split", ",".join(["%.3g" % (1 / (ranks - 1))] * (ranks - 1)) + "/1.0"]


def run_configs(configs: dict[str, list[str]], ranks: int, n: int) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {k: [] for k in configs}
    for prompt in PROMPTS:
        ref = None
        for name, args in configs.items():
            g = ggpipe_run(TARGET, prompt, n, ranks, ["-md", DRAFT, "-t", "1", *split_for(ranks), *args])
            ref = ref or g["tokens"]
            if g["tokens"] != ref:
                raise SystemExit(f"EXACTNESS FAILURE: {name} at {ranks} ranks differs on {prompt!r}")
            out[name].append(g)
            m, d = g["metrics"], g["decoder"]
            print(f"  R={ranks} {name:28s} {m['tokens_per_s']:6.1f} tok/s  TTFT {1e3 * m['ttft_s']:6.1f} ms  "
                  f"accept {d.get('acceptance_rate') or 0:.2f}  per pass {d.get('accepted_per_pass') or 1:.2f}",
                  flush=True)
    return out


def summarize(runs: list[dict]) -> dict:
    mean = lambda xs: statistics.mean(x for x in xs if x is not None) if any(x is not None for x in xs) else None  # noqa: E731
    return {
        "tps": mean(r["metrics"]["tokens_per_s"] for r in runs),
        "ttft_ms": 1e3 * mean(r["metrics"]["ttft_s"] for r in runs),
        "itl_ms": 1e3 * mean(r["metrics"]["itl_mean_s"] for r in runs),
        "itl_p90_ms": 1e3 * mean(r["metrics"]["itl_p90_s"] for r in runs),
        "acceptance": mean(r["decoder"].get("acceptance_rate") for r in runs),
        "per_pass": mean(r["decoder"].get("accepted_per_pass") for r in runs),
        "cancelled": sum(r["decoder"].get("cancel_sent", 0) for r in runs),
        "aborted_mid": sum(sum(x.get("cancelled_mid_compute", 0) for x in r["ranks"]) for r in runs),
        "peak_rss_mb": [max(r["ranks"][i]["peak_rss_bytes"] for r in runs) / 2**20 for i in range(len(runs[0]["ranks"]))],
    }


def table(summ: dict[str, dict], base: str = "iterative") -> str:
    b = summ[base]["tps"]
    lines = ["| mode | tokens/s | vs iterative | vs speculative | TTFT (ms) | ITL mean / p90 (ms) | acceptance "
             "| tokens per target pass | runs cancelled (aborted mid-compute) | peak RSS per rank (MiB) |",
             "|---|---:|---:|---:|---:|---|---:|---:|---|---|"]
    sp = summ.get("speculative", {}).get("tps")
    for name, s in summ.items():
        acc = f"{s['acceptance']:.2f}" if s["acceptance"] is not None else "-"
        pp = f"{s['per_pass']:.2f}" if s["per_pass"] is not None else "1.00"
        vs_sp = f"{s['tps'] / sp:.2f}x" if sp else "-"
        rss = ", ".join(f"{x:.0f}" for x in s["peak_rss_mb"])
        lines.append(f"| {name} | {s['tps']:.1f} | {s['tps'] / b:.2f}x | {vs_sp} | {s['ttft_ms']:.1f} | "
                     f"{s['itl_ms']:.1f} / {s['itl_p90_ms']:.1f} | {acc} | {pp} | {s['cancelled']} ({s['aborted_mid']}) "
                     f"| {rss} |")
    return "\n".join(lines)


def single_node(n: int, threads: int) -> float:
    path = str(resolve(TARGET))
    tps = [baseline.greedy(path, p, n, n_threads=threads, ignore_eos=True).tokens_per_s for p in PROMPTS]
    return statistics.mean(tps)


def sweep(n: int) -> None:
    grid = {"--p-accept": ["0.1", "0.3"], "--draft": ["2", "4"], "--branches": ["1", "2"]}
    configs = {}
    for pa, dr, br in itertools.product(*grid.values()):
        configs[f"p_accept={pa} draft={dr} branches={br}"] = ["--mode", "pipeinfer", "--p-accept", pa, "--draft", dr,
                                                              "--branches", br]
    res = run_configs({"iterative": MODES["iterative"], **configs}, 2, n)
    summ = {k: summarize(v) for k, v in res.items()}
    print("\n### Sweep (2 ranks, pipeinfer)\n" + table(summ))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=128)
    ap.add_argument("--ranks", default="2,3")
    ap.add_argument("--json", default=None)
    ap.add_argument("--sweep", action="store_true")
    a = ap.parse_args()
    print(f"# {time.strftime('%Y-%m-%d %H:%M')}, {os.cpu_count()} cores, target {TARGET}, draft {DRAFT}", flush=True)
    if a.sweep:
        sweep(a.n)
        return
    result = {}
    for ranks in [int(x) for x in a.ranks.split(",")]:
        summ = {k: summarize(v) for k, v in run_configs(MODES, ranks, a.n).items()}
        result[ranks] = summ
        print(f"\n### {ranks} ranks\n" + table(summ), flush=True)
    sn = {t: single_node(a.n, t) for t in (1, 2)}
    print(f"\nSingle-node llama-cpp-python decode loop on the target: {sn[1]:.1f} tok/s (1 thread), "
          f"{sn[2]:.1f} tok/s (2 threads)")
    if a.json:
        os.makedirs(os.path.dirname(a.json) or ".", exist_ok=True)
        with open(a.json, "w") as f:
            json.dump({"modes": result, "single_node": sn}, f, indent=1)


if __name__ == "__main__":
    main()
