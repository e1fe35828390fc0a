#!/usr/bin/env python3
"""Balanced vs even vs memory-proportional splits on mixed clusters, simulated.

    python scripts/balance_sim.py [--profile PROFILE] [-n 64] [--md OUT.md]

Two described clusters (ggpipe.sim.profile.HostProfile roofline hosts; the
loop overheads from ``--profile`` when given):

* PipeInfer's cluster B (Table II): 8 dual Xeon E5-2650 nodes (128 GB) and
  5 old desktops with dual-channel DDR3 (8 GB), Dolphin-70B Q3_K_M with
  TinyLlama-1.1B (acceptance 0.79), 13 ranks, the draft on a Xeon;
* 2 new (dual Xeon Gold 6140, 384 GB) and 2 old (dual Xeon E5, 128 GB)
  nodes, Goliath-120B Q2_K with XWin-7B (acceptance 0.52).

For each: ggpipe's even split, llama.cpp's default split in proportion to
memory, and ``plan --balance``'s split, in iterative and pipeinfer mode.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

from ggpipe.cluster.roles import Roles
from ggpipe.cluster.split import SplitSpec, parse_split, plan_layers
from ggpipe.decoding.settings import SpecSettings
from ggpipe.errors import GGPipeError
from ggpipe.sim.model import resolve_desc
from ggpipe.sim.placement import place
from ggpipe.sim.profile import HostProfile, LinkProfile, Profile
from ggpipe.sim.run import SimConfig, simulate

GOLD = dict(mem_bw_Bps=120e9, flops=1.5e12, mem_bytes=384 << 30)
E5 = dict(mem_bw_Bps=50e9, flops=0.25e12, mem_bytes=128 << 30)
DESKTOP = dict(mem_bw_Bps=18e9, flops=0.1e12, mem_bytes=8 << 30)
GBE = (50e-6, 117e6)


def cluster(kinds: list[tuple[str, dict]], overhead: tuple[float, float]) -> Profile:
    hosts = [HostProfile(f"{name}-{i}", rank=i, overhead_s=overhead[0], spec_overhead_s=overhead[1], **spec)
             for i, (name, spec) in enumerate(kinds)]
    return Profile("described", None, hosts, [LinkProfile(0, 1, *GBE)])


def fits_for(prof: Profile, model):
    def fits(rank: int, start: int, stop: int, n_stages: int) -> bool:
        need = sum(s.bytes for s in model.layers[start:stop]) + (model.head.bytes if stop == model.n_layer else 0)
        return need <= 0.9 * prof.host(rank).mem_bytes
    return fits


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--profile", type=Path, default=None)
    ap.add_argument("-n", type=int, default=64)
    ap.add_argument("--md", type=Path, default=None)
    a = ap.parse_args()
    overhead = (2e-5, 3.4e-4)
    if a.profile:
        h = Profile.load(a.profile).hosts[0]
        overhead = (h.overhead_s, h.spec_overhead_s)
    setups = [
        ("cluster B: 8 Xeon E5 + 5 desktops", [("e5", E5)] * 8 + [("desktop", DESKTOP)] * 5,
         "llama2-70b:Q3_K_M", "tinyllama-1.1b:Q4_K_M", 0.79),
        ("2 Xeon Gold + 2 Xeon E5", [("gold", GOLD)] * 2 + [("e5", E5)] * 2,
         "goliath-120b:Q2_K", "llama2-7b:Q4_K_M", 0.52),
    ]
    lines = ["| cluster | model | mode | split | layers per target rank | tokens/s |", "|---|---|---|---|---|---:|"]
    for title, kinds, tgt, drf, acc in setups:
        n = len(kinds)
        t, d = resolve_desc(tgt), resolve_desc(drf)
        for mode in ("iterative", "pipeinfer"):
            draft = d if mode == "pipeinfer" else None
            # the draft on rank 1 (a fast node): put the fast nodes first, the draft's rank last
            order = kinds if mode == "iterative" else [kinds[0]] + kinds[2:] + [kinds[1]]
            prof = cluster(order, overhead)
            base = SimConfig(prof, t, draft, mode=mode, ranks=n, acceptance=acc, n_prompt=64, n_predict=a.n,
                             prompts=1, spec=SpecSettings(draft_max=4))
            n_target = n if draft is None else n - 1
            mem = ",".join(str(prof.host(r).mem_bytes >> 30) for r in range(n_target))
            splits = {"even": SplitSpec(None, None) if draft is None else parse_split(",".join(["1"] * n_target) + "/1"),
                      "memory-proportional": parse_split(mem + ("/1" if draft is not None else ""))}
            bal = place(prof, t, draft, n, mode, fits_for(prof, t), base)
            splits[f"balanced (--split {bal.split})"] = parse_split(bal.split)
            for label, sp in splits.items():
                try:
                    roles = Roles.plan(n, sp, draft is not None)
                    ranges = plan_layers(t.n_layer, roles.n_target, sp.target)
                except GGPipeError as exc:  # e.g. a desktop's share of memory rounds to no layer
                    lines.append(f"| {title} | {tgt} | {mode} | {label} | - | not a split ggpipe can run: {exc} |")
                    continue
                over = [i for i, (a_, b) in enumerate(ranges) if not fits_for(prof, t)(i, a_, b, roles.n_target)]
                r = simulate(replace(base, split=sp, ranks=n))
                note = f" (ranks {over} out of memory)" if over else ""
                layers = ",".join(str(b - a_) for a_, b in ranges)
                lines.append(f"| {title} | {tgt} | {mode} | {label} | {layers}{note} | {r['tokens_per_s']:.2f} |")
                print(lines[-1], file=sys.stderr)
    text = "\n".join(lines)
    print(text)
    if a.md:
        a.md.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
