#!/usr/bin/env python3
"""Project PipeInfer's section V configurations with ``ggpipe simulate``.

    python scripts/project_paper.py [--nodes 1,2,4,8,15,32] [-n 64] [--md OUT.md] [--plot OUT.png]
    python scripts/project_paper.py --pipedec [--nodes 4,8,14] [--md OUT.md]

``--pipedec``: PipeDec's pair (Llama-3.1-70B with Llama-3.2-1B, its section
4) on N target stages plus one draft node, iterative (N nodes, no draft),
speculative (the synchronous stand-in for its static-tree baseline STPP),
pipeinfer and pipedec, and pipedec's ratios to iterative and speculative
(the paper's 14 stages: 4.46-7.79x over plain pipeline parallelism and
2.2-2.69x over STPP, on GPUs over 10 Gbps Ethernet).

Models are described from their architecture and quantization (no weights:
ggpipe.sim.model.ARCHITECTURES, BITS_PER_WEIGHT); nodes are *described*
hosts (roofline: memory bandwidth, effective FLOP/s) with the decoding loop
overhead measured on this machine (``--profile``, optional); links are
Infiniband EDR or Gigabit Ethernet. Every figure is a projection from those
assumptions, not a measurement; the assumptions are the constants below.

Acceptance: the paper's measured acceptance rate is used as the draft's
agreement rate (ggpipe.sim.lm.CalibratedDraft).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ggpipe.decoding.settings import SpecSettings
from ggpipe.sim.model import resolve_desc
from ggpipe.sim.profile import HostProfile, LinkProfile, Profile
from ggpipe.sim.run import SimConfig, simulate

# Cluster C node: 2x Xeon Gold 6140 (2 x 6 channels DDR4-2666 = 256 GB/s peak); llama.cpp with NUMA
# distribution reaches about half of it; effective FLOP/s of its quantized dot products ~1.5 TFLOP/s
# (so batches above ~3 tokens turn compute-bound, as on the CPUs we measure).
XEON_GOLD = dict(mem_bw_Bps=120e9, flops=1.5e12, mem_bytes=384 << 30)
# Cluster A node: 2x Xeon E5-2650 (2 x 4 channels DDR3-1600 = 102 GB/s peak), AVX without FMA.
XEON_E5 = dict(mem_bw_Bps=50e9, flops=0.25e12, mem_bytes=128 << 30)
LINKS = {"infiniband-edr": (2e-6, 12.0e9), "gigabit-ethernet": (50e-6, 117e6)}

PAIRS = [  # (name, target, draft, acceptance from the paper's section V)
    ("Dolphin-70B + TinyLlama-1.1B", "llama2-70b:Q3_K_M", "tinyllama-1.1b:Q4_K_M", 0.79),
    ("Goliath-120B + XWin-7B", "goliath-120b:Q2_K", "llama2-7b:Q4_K_M", 0.52),
    ("Falcon-180B + Falcon-7B", "falcon-180b:Q3_K_M", "falcon-7b:Q3_K_M", 0.69),
]


def profile_for(node: dict, link: str, overhead: tuple[float, float]) -> Profile:
    lat, bw = LINKS[link]
    h = HostProfile("node", mem_bw_Bps=node["mem_bw_Bps"], flops=node["flops"], mem_bytes=node["mem_bytes"],
                    overhead_s=overhead[0], spec_overhead_s=overhead[1])
    return Profile("described", None, [h], [LinkProfile(0, 1, lat, bw)], {"node": node, "link": link})


# PipeDec's pair; its prediction accuracy is not given as one figure: 0.8 is this project's measured
# per-layer hit rate of a 135M draft for its target (docs/benchmarks/scaling.md, PipeDec)
PIPEDEC_PAIR = ("Llama-3.1-70B + Llama-3.2-1B", "llama3.1-70b:Q4_K_M", "llama3.2-1b:Q4_K_M", 0.8)
# (row, mode, knobs): pipedec as a chain (its default) and as a tree of 4 nodes per layer
PIPEDEC_ROWS = (("iterative", "iterative", {}), ("speculative", "speculative", {}), ("pipeinfer", "pipeinfer", {}),
                ("pipedec", "pipedec", {}), ("pipedec --tree-width 4", "pipedec", {"tree_width": 4, "max_children": 4}))


def project_pipedec(stages: list[int], n: int, overhead: tuple[float, float]) -> str:
    """PipeDec's configurations: N target stages (+ 1 draft node for the
    speculative modes) per link; a markdown table of tokens/s and ratios."""
    name, tgt, drf, acc = PIPEDEC_PAIR
    t, d = resolve_desc(tgt), resolve_desc(drf)
    lines = ["| link | mode | " + " | ".join(f"{s} stages" for s in stages) + " |",
             "|---|---|" + "---:|" * len(stages)]
    for link in LINKS:
        prof = profile_for(XEON_GOLD, link, overhead)
        res = {}
        for label, mode, knobs in PIPEDEC_ROWS:
            row = []
            for s in stages:
                ranks = s if mode == "iterative" else s + 1
                cfg = SimConfig(prof, t, None if mode == "iterative" else d, mode=mode, ranks=ranks,
                                spec=SpecSettings(draft_max=4, **knobs), acceptance=acc, n_prompt=64,
                                n_predict=n, prompts=1)
                row.append(simulate(cfg)["tokens_per_s"])
            res[label] = row
            lines.append(f"| {link} | {label} | " + " | ".join(f"{v:.2f}" for v in row) + " |")
        best = [max(a, b) for a, b in zip(res["pipedec"], res["pipedec --tree-width 4"])]
        for base in ("iterative", "speculative", "pipeinfer"):
            lines.append(f"| {link} | best pipedec / {base} | "
                         + " | ".join(f"{p / b:.2f}x" for p, b in zip(best, res[base])) + " |")
        print("\n".join(lines[-8:]), file=sys.stderr)
    return f"{name}, acceptance {acc}, {n} tokens\n\n" + "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", default=None, help="Node counts (default 1,2,4,8,15,32; --pipedec: target "
                                                   "stages, default 4,8,14).")
    ap.add_argument("--pipedec", action="store_true", help="Project PipeDec's pair and modes instead.")
    ap.add_argument("-n", type=int, default=64, help="Tokens generated per projection.")
    ap.add_argument("--profile", type=Path, default=None, help="Take the loop overheads from this profile.")
    ap.add_argument("--md", type=Path, default=None)
    ap.add_argument("--plot", type=Path, default=None)
    a = ap.parse_args()
    nodes = [int(x) for x in (a.nodes or ("4,8,14" if a.pipedec else "1,2,4,8,15,32")).split(",")]
    overhead = (2e-5, 3.4e-4)
    if a.profile:
        h = Profile.load(a.profile).hosts[0]
        overhead = (h.overhead_s, h.spec_overhead_s)
    if a.pipedec:
        text = project_pipedec(nodes, a.n, overhead)
        print(text)
        if a.md:
            a.md.write_text(text + "\n")
        return 0
    lines = ["| pair | link | mode | " + " | ".join(f"{n} nodes" for n in nodes) + " |",
             "|---|---|---|" + "---:|" * len(nodes)]
    curves = {}
    for name, tgt, drf, acc in PAIRS:
        t, d = resolve_desc(tgt), resolve_desc(drf)
        for link in LINKS:
            prof = profile_for(XEON_GOLD, link, overhead)
            res = {}
            for mode in ("iterative", "speculative", "pipeinfer"):
                row = []
                for n in nodes:
                    if mode != "iterative" and n < 2:
                        row.append(None)
                        continue
                    cfg = SimConfig(prof, t, d, mode=mode, ranks=n, spec=SpecSettings(draft_max=4), acceptance=acc,
                                    n_prompt=64, n_predict=a.n, prompts=1)
                    row.append(simulate(cfg)["tokens_per_s"])
                res[mode] = row
                lines.append(f"| {name} | {link} | {mode} | "
                             + " | ".join("-" if v is None else f"{v:.2f}" for v in row) + " |")
            ratio = [None if s is None or p is None else p / s for p, s in zip(res["pipeinfer"], res["speculative"])]
            lines.append(f"| {name} | {link} | pipeinfer / speculative | "
                         + " | ".join("-" if v is None else f"{v:.2f}x" for v in ratio) + " |")
            curves[(name, link)] = res
            print(lines[-4:], file=sys.stderr)
    text = "\n".join(lines)
    print(text)
    if a.md:
        a.md.write_text(text + "\n")
    if a.plot:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(len(LINKS), len(PAIRS), figsize=(5 * len(PAIRS), 3.6 * len(LINKS)), squeeze=False)
        for j, (name, *_rest) in enumerate(PAIRS):
            for i, link in enumerate(LINKS):
                ax = axes[i][j]
                for mode, row in curves[(name, link)].items():
                    xs = [n for n, v in zip(nodes, row) if v is not None]
                    ax.plot(xs, [v for v in row if v is not None], marker="o", label=mode)
                ax.set_title(f"{name}\n{link}", fontsize=9)
                ax.set_xlabel("nodes")
                ax.set_ylabel("tokens/s (projected)")
                ax.set_xscale("log", base=2)
                ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(a.plot, dpi=90)
    return 0


if __name__ == "__main__":
    sys.exit(main())
