"""Draw the plots of the benchmark pages (docs/benchmarks/img/*.png) from
their data (docs/benchmarks/data/). Needs matplotlib (the ``docs`` extra).

    python scripts/plot_benchmarks.py            # every plot
    python scripts/plot_benchmarks.py kernels    # one of: one-stream many-requests kernels scaling memory
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "docs" / "benchmarks" / "data"
IMG = ROOT / "docs" / "benchmarks" / "img"


def _rows(name: str) -> list[dict]:
    with open(DATA / name, newline="") as f:
        return list(csv.DictReader(f))


def _save(fig, name: str) -> None:
    IMG.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(IMG / name, dpi=110, metadata={"Software": None})
    plt.close(fig)
    print(IMG / name)


def one_stream() -> None:
    """Tokens/s per prompt: llama.cpp on 2 threads against ggpipe's modes on 2 ranks x 1 thread."""
    rows = _rows("one-stream.csv")
    prompts = [k for k in rows[0] if k != "row"]
    fig, ax = plt.subplots(figsize=(9, 3.8))
    width = 0.8 / len(rows)
    for i, r in enumerate(rows):
        xs = [j + (i - (len(rows) - 1) / 2) * width for j in range(len(prompts))]
        ax.bar(xs, [float(r[p]) for p in prompts], width, label=r["row"],
               hatch="//" if r["row"].startswith("llama.cpp") else None)
    ax.set_xticks(range(len(prompts)), prompts)
    ax.set_ylabel("generated tokens/s")
    ax.set_ylim(0, 1.4 * max(float(r[p]) for r in rows for p in prompts))
    ax.set_title("One stream, F32 40-layer target + Q4_1 draft, held-out prompts, 128 tokens, 2 cores")
    ax.legend(fontsize=8, ncol=3, loc="upper center")
    _save(fig, "one-stream.png")


def many_requests() -> None:
    """Aggregate tokens/s against concurrent requests."""
    med: dict[str, dict[int, float]] = defaultdict(dict)
    groups: dict[tuple[str, int], list[float]] = defaultdict(list)
    for r in _rows("many-requests-sweep.csv"):
        groups[(r["system"], int(r["requests"]))].append(float(r["agg_tokens_per_s"]))
    for (system, c), v in groups.items():
        med[system][c] = statistics.median(v)
    labels = {
        "ggpipe 2 ranks": "ggpipe 2 ranks x 1 thread",
        "ggpipe 3 ranks": "ggpipe 3 ranks x 1 thread",
        "ggpipe one at a time, 2 ranks": "ggpipe one at a time",
        "ggpipe 2 ranks (alt python)": "ggpipe 2 ranks, llama.cpp default build",
        "llama-server 2 threads, llamafile off": "llama-server -t 2 (same kernels)",
        "llama-batched-bench 2 threads, llamafile off": "llama-batched-bench -t 2 (same kernels)",
        "llama-server 2 threads": "llama-server -t 2 (default build)",
        "llama-batched-bench 2 threads": "llama-batched-bench -t 2 (default build)",
    }
    fig, ax = plt.subplots(figsize=(8, 4.2))
    for system, label in labels.items():
        pts = sorted(med.get(system, {}).items())
        if pts:
            style = "--" if "default build" in label else "-"
            ax.plot([c for c, _ in pts], [v for _, v in pts], style, marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_xticks([1, 8, 16], ["1", "8", "16"])
    ax.set_xlabel("concurrent requests")
    ax.set_ylabel("aggregate tokens/s")
    ax.set_title("Many requests, F32 40-layer model, 2 cores")
    ax.legend(fontsize=7.5)
    _save(fig, "many-requests.png")


def kernels() -> None:
    """ggpipe's prompt and generation speed as a share of llama-bench's, per model."""
    by: dict[tuple[str, str], list[dict]] = defaultdict(list)
    with open(DATA / "kernels.jsonl") as f:
        for line in f:
            r = json.loads(line)
            by[(r["model"], r["kind"])].append(r)
    models = list(dict.fromkeys(m for m, _ in by))
    kinds = ["ggpipe", "ggpipe --exact"]
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8), sharey=True)
    for ax, key, title in zip(axes, ("pp", "tg"), ("prompt processing", "generation")):
        for i, kind in enumerate(kinds):
            ratios = []
            for m in models:
                ours = statistics.median(r[key] for r in by[(m, kind)])
                ref = statistics.median(r[key] for r in by[(m, "llama-bench")])
                ratios.append(ours / ref)
            ax.bar([j + (i - 0.5) * 0.38 for j in range(len(models))], ratios, 0.38, label=kind)
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_xticks(range(len(models)), [m.removesuffix(".gguf") for m in models], rotation=15, fontsize=8)
        ax.set_title(f"{title} / llama-bench")
    axes[0].set_ylabel("ratio")
    axes[0].legend(fontsize=8)
    _save(fig, "kernels.png")


def scaling() -> None:
    """Projected tokens/s against nodes, PipeInfer's pairs, InfiniBand."""
    rows = [r for r in _rows("scaling-projection.csv") if r["link"] == "infiniband-edr"]
    pairs = list(dict.fromkeys(r["pair"] for r in rows))
    fig, axes = plt.subplots(1, len(pairs), figsize=(11, 3.6))
    for ax, pair in zip(axes, pairs):
        for r in (r for r in rows if r["pair"] == pair):
            pts = [(int(k), float(v)) for k, v in r.items() if k.isdigit() and v]
            ax.plot([n for n, _ in pts], [v for _, v in pts], marker="o", label=r["mode"])
        ax.set_xscale("log", base=2)
        ax.set_xticks([1, 2, 4, 8, 15, 32], ["1", "2", "4", "8", "15", "32"])
        ax.set_title(pair, fontsize=9)
        ax.set_xlabel("nodes")
    axes[0].set_ylabel("tokens/s (projected)")
    axes[0].legend(fontsize=8)
    _save(fig, "scaling.png")


def memory() -> None:
    """Largest peak RSS of a rank against ranks; KV cache per rank by cache type."""
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.6))
    by: dict[str, list[tuple[int, float]]] = defaultdict(list)
    for r in _rows("memory-ranks.csv"):
        by[r["model"]].append((int(r["ranks"]), max(float(x) for x in r["peak_rss_mib"].split())))
    for model, pts in by.items():
        a.plot([n for n, _ in pts], [v for _, v in pts], marker="o", label=model)
    a.set_xticks([1, 2, 4])
    a.set_xlabel("ranks")
    a.set_ylabel("largest peak RSS of a rank (MiB)")
    a.set_title("iterative decoding")
    a.legend(fontsize=8)
    kv = _rows("kv-types.csv")
    types = list(dict.fromkeys(r["cache_type"] for r in kv))
    for i, ranks in enumerate(("1", "2")):
        vals = [float(r["kv_mib_per_rank"]) for r in kv if r["ranks"] == ranks]
        b.bar([j + (i - 0.5) * 0.38 for j in range(len(types))], vals, 0.38, label=f"{ranks} rank(s)")
    b.set_xticks(range(len(types)), types)
    b.set_ylabel("KV cache per rank (MiB)")
    b.set_title("SmolLM2-135M, -c 32768")
    b.legend(fontsize=8)
    _save(fig, "memory.png")


PLOTS = {"one-stream": one_stream, "many-requests": many_requests, "kernels": kernels,
         "scaling": scaling, "memory": memory}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("plots", nargs="*", choices=[[], *PLOTS], default=[], help="which plots (default: all)")
    args = ap.parse_args(argv)
    for name in args.plots or PLOTS:
        PLOTS[name]()
    return 0


if __name__ == "__main__":
    sys.exit(main())
