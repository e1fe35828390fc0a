#!/usr/bin/env python3
"""Balanced vs even split, for real, with one rank slowed by a CPU quota.

    sudo python scripts/experiments/balance_real.py [-m smollm2-goliath-40l-f32] [--quota 0.5] [-n 64] [--rounds 2] [--md OUT.md]

Rank 1 runs in a cgroup (v1 ``cpu`` controller) limited to ``--quota`` of
one CPU, so the ranks' hosts differ as an old and a new node do. Then, in
one run:

1. ``ggpipe calibrate`` under that launcher, 3 ranks (rank 1 measures
   itself slowed);
2. ``ggpipe plan --balance`` chooses the split for iterative mode on 2 ranks
   and for pipeinfer on 3 (target on ranks 0-1, the draft on rank 2);
3. ``ggpipe generate --json`` with the even split and the balanced one, rows
   interleaved, ``--rounds`` times; and ``ggpipe simulate``'s prediction
   of each, from the same profile.

The ranks have the same memory, so llama.cpp's memory-proportional default
split is the even split here. The simulation uses the draft behaviour
fitted to this prompt when the simulator was validated
(docs/benchmarks/simulator.md; ``--acceptance 0.57
--confidence-exponent 0.5``). Needs root (cgroups); removes the
cgroup it made.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from ggpipe.child_process import ggpipe_command

CG_ROOT = Path("/sys/fs/cgroup/cpu")
PROMPT = "Once upon a time, a warrior named Goliath"


def run(cmd: list[str], timeout: float = 600) -> subprocess.CompletedProcess:
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if p.returncode != 0:
        sys.exit(f"failed ({p.returncode}): {shlex.join(cmd)}\n{p.stderr[-2000:]}")
    return p


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-m", "--model", default="smollm2-goliath-40l-f32")
    ap.add_argument("-md", "--draft-model", default="smollm2-135m")
    ap.add_argument("--quota", type=float, default=0.5, help="CPU share of the slowed rank (of one CPU).")
    ap.add_argument("-n", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--md", type=Path, default=None)
    a = ap.parse_args()
    if os.geteuid() != 0 or not (CG_ROOT / "cpu.cfs_quota_us").exists():
        sys.exit("needs root and the cgroup v1 cpu controller at /sys/fs/cgroup/cpu")
    cg = CG_ROOT / f"ggpipe-slow-{os.getpid()}"
    cg.mkdir()
    tmp = Path(tempfile.mkdtemp(prefix="ggpipe-balance-"))
    try:
        (cg / "cpu.cfs_period_us").write_text("100000\n")
        (cg / "cpu.cfs_quota_us").write_text(f"{int(a.quota * 100000)}\n")
        wrap = tmp / "slow.sh"
        wrap.write_text(f'#!/bin/sh\necho $$ > {cg}/tasks\nexec "$@"\n')
        wrap.chmod(0o755)
        py = ggpipe_command()

        def job(args: list[str], ranks: int) -> list[str]:  # rank 1 in the slow cgroup (MPMD)
            cmd = ["mpiexec", "-n", "1", *py, *args, ":", "-n", "1", str(wrap), *py, *args]
            return cmd + [":", "-n", str(ranks - 2), *py, *args] if ranks > 2 else cmd

        prof = tmp / "profile.json"
        run(job(["calibrate", "-m", a.model, "-md", a.draft_model, "-o", str(prof)], 3))
        h = json.loads(prof.read_text())["hosts"]
        print(f"calibrated: layer ms at batch 1: rank 0 {1e3 * h[0]['layer_s'][0]:.3f}, "
              f"rank 1 {1e3 * h[1]['layer_s'][0]:.3f}", file=sys.stderr)
        modes = {"iterative": (2, ["--mode", "iterative"]),
                 "pipeinfer": (3, ["--mode", "pipeinfer", "-md", a.draft_model])}
        splits = {}
        for name, (ranks, margs) in modes.items():
            p = run(py + ["plan", "-n", str(ranks), "--balance", str(prof), "--acceptance", "0.6", "--json", "--",
                          "generate", "-m", a.model, *margs, "-p", "x"])
            splits[name] = json.loads(p.stdout)["balance"]["split"]
        rows: dict = {}
        for rnd in range(a.rounds):
            for name, (ranks, margs) in modes.items():
                for label, split in (("even", None), ("balanced", splits[name])):
                    extra = [] if split is None else ["--split", split]
                    p = run(job(["generate", "-m", a.model, "-p", PROMPT, "-n", str(a.n), "--ignore-eos", "--json",
                                 *margs, *extra], ranks))
                    out = json.loads(p.stdout)
                    rows.setdefault((name, label), []).append(out["metrics"]["tokens_per_s"])
                    print(f"round {rnd}: {name} {label}: {out['metrics']['tokens_per_s']:.1f} tok/s", file=sys.stderr)
        lines = [f"Rank 1 limited to {a.quota:g} CPU; {a.model}; {a.n} tokens; {a.rounds} rounds (median).", "",
                 "| mode | ranks | split | measured tok/s | simulated tok/s |", "|---|---:|---|---:|---:|"]
        for name, (ranks, margs) in modes.items():
            for label, split in (("even", None), ("balanced", splits[name])):
                sim_args = ["--split", split] if split else []
                p = run(py + ["simulate", "--profile", str(prof), "-m", a.model, "-md", a.draft_model, "--modes", name,
                              "--ranks", str(ranks), "-n", str(a.n), "--prompts", "2", "--acceptance", "0.57",
                              "--confidence-exponent", "0.5", "--json", *sim_args])
                sim = json.loads(p.stdout.splitlines()[0])["tokens_per_s"]
                layers = f"{label} ({split})" if split else "even"
                lines.append(f"| {name} | {ranks} | {layers} | {statistics.median(rows[(name, label)]):.1f} | {sim:.1f} |")
        text = "\n".join(lines)
        print(text)
        if a.md:
            a.md.write_text(text + "\n")
    finally:
        for pid in (cg / "tasks").read_text().split():
            print(f"warning: process {pid} still in {cg}", file=sys.stderr)
        cg.rmdir()
    return 0


if __name__ == "__main__":
    sys.exit(main())
