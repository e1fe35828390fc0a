#!/usr/bin/env python3
"""Project PipeInfer's section V configurations with ``ggpipe simulate``.

    python scripts/project_paper.py [--nodes 1,2,4,8,15,32] [-n 64] [--md OUT.md] [--plot OUT.png]

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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", default="1,2,4,8,15,32")
    ap.add_argument("-n", type=int, default=64, help="Tokens generated per projection.")
    ap.add_argument("--profile", type=Path, default=None, help="Take the loop overheads from this profile.")
    ap.add_argument("--md", type=Path, default=None)
    ap.add_argument("--plot", type=Path, default=None)
    a = ap.parse_args()
    nodes = [int(x) for x in a.nodes.split(",")]
    overhead = (2e-5, 3.4e-4)
    if a.profile:
        h = Profile.load(a.profile).hosts[0]
        overhead = (h.overhead_s, h.spec_overhead_s)
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
                    cfg = SimConfig(prof, t, d, mode=mode, ranks=n, spec=SpecSettings(draft=4), acceptance=acc,
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
