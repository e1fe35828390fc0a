#!/usr/bin/env python3
"""A real network path against the in-transport link emulation, side by side.

Two ranks on two hosts of an emulated cluster (scripts/netns_cluster.py:
network namespaces, veth, a bridge; MPI over TCP), with host 2's link
unshaped and shaped to 1 Gbit/s by ``tc tbf``, against two ranks on one host
(shared memory) with and without ``GGPIPE_LINK`` (ggpipe/transport/link.py).
Rounds are interleaved (every path once per round), so the machine's drift
hits every path alike. Per path it reports:

- the per-hop one-way time of the messages a pipeline hop carries
  (scripts/bench_transport.py's ping-pong: a hidden state of 1, 4 and 32
  tokens and one token's logits), median over rounds;
- tokens/s of ``ggpipe generate`` in each of ``--modes`` (greedy,
  ``--ignore-eos``), median over rounds, and whether every run's tokens were
  identical to the first path's.

With ``--checkout DIR`` (repeatable) every path runs once per checkout of
ggpipe (``PYTHONPATH=DIR``), interleaved too: code before and after a change,
on the same paths in the same run.

    python scripts/bench_network_path.py                   # builds a 2-host cluster, removes it after
    python scripts/bench_network_path.py --rounds 5 --emulate 1gbit,60us --json out.json
    python scripts/bench_network_path.py --checkout /work/before --checkout . --emulate 100mbit,1ms \
        --modes iterative,speculative,pipeinfer --no-pingpong

Needs root (the cluster); prints a markdown table (docs/benchmarks/one-stream.md, Over a network).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import netns_cluster as nc  # noqa: E402 (this folder's cluster script)

from ggpipe.child_process import ggpipe_command

ROOT = Path(__file__).resolve().parents[1]
MESSAGES = ["1 token hidden state", "4 tokens hidden state", "32 tokens hidden state", "1 token logits"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--model", default="smollm2-goliath-40l-f32")
    ap.add_argument("-md", "--draft-model", default="smollm2-135m")
    ap.add_argument("-p", "--prompt", default="Once upon a time, a warrior named Goliath")
    ap.add_argument("-n", "--n-predict", type=int, default=96)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--iters", type=int, default=400, help="ping-pong iterations per message size")
    ap.add_argument("--rate", default="1gbit", help="tc tbf rate of the shaped path")
    ap.add_argument("--emulate", action="append", default=None,
                    help="GGPIPE_LINK values to compare (repeatable; default 1gbit,0us and 1gbit,50us)")
    ap.add_argument("--modes", default="iterative,pipeinfer", help="generate modes, comma-separated")
    ap.add_argument("--checkout", action="append", default=None,
                    help="a ggpipe checkout to run (PYTHONPATH; repeatable; default: the installed one)")
    ap.add_argument("--no-pingpong", action="store_true", help="tokens/s only")
    ap.add_argument("--name", default="ggbench")
    ap.add_argument("--subnet", default="10.234.0.0/24")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    emulate = a.emulate or ["1gbit,0us", "1gbit,50us"]
    modes = a.modes.split(",")
    checkouts = [(None, "")] if not a.checkout else [
        (str(Path(c).resolve()), " @" + subprocess.run(["git", "-C", c, "log", "-1", "--format=%h"], capture_output=True,
                                                        text=True).stdout.strip()) for c in a.checkout]
    mpiexec = str(Path(sys.executable).with_name("mpiexec"))
    tmp = Path(tempfile.mkdtemp(prefix="ggpipe-netpath-"))
    try:
        desc = nc.up(a.name, 2, a.subnet, str(tmp / "cluster"), mpiexec)
    except nc.ClusterError as e:
        print(f"bench_network_path: error: {e}", file=sys.stderr)
        return 2
    across = desc["launch"]
    # (label, launcher prefix, GGPIPE_LINK, tc rate on host 2's link)
    paths = [("one host, shared memory", [mpiexec], None, None)]
    paths += [(f"one host, emulated {e}", [mpiexec], e, None) for e in emulate]
    paths += [("two hosts, TCP over veth", across, None, None),
              (f"two hosts, TCP, tc tbf {a.rate}", across, None, a.rate)]
    rows = [(path, co) for path in paths for co in checkouts]
    res = {p[0] + co[1]: {"pingpong": {k: [] for k in MESSAGES}, "tokens_per_s": {m: [] for m in modes},
                          "tokens": []} for p, co in rows}
    try:
        for rnd in range(a.rounds):
            for (label, launch, link, rate), (pythonpath, tag) in rows:
                label += tag
                nc.shape(desc, "2", rate or "none")
                env = dict(os.environ, PYTHONUNBUFFERED="1")
                env.pop("GGPIPE_LINK", None)
                if link:
                    env["GGPIPE_LINK"] = link
                if pythonpath:
                    env["PYTHONPATH"] = pythonpath
                out = tmp / "pp.json"
                if not a.no_pingpong:
                    p = subprocess.run([*launch, "-n", "2", sys.executable, str(ROOT / "scripts" / "bench_transport.py"),
                                        "--iters", str(a.iters), "--json", str(out)], capture_output=True, text=True,
                                       env=env, cwd="/", timeout=600)
                    if p.returncode != 0:
                        raise SystemExit(f"{label}: ping-pong failed:\n{p.stderr[-2000:]}")
                    for row in json.loads(out.read_text())["rows"]:
                        res[label]["pingpong"][row["message"]].append(row["ggpipe_us"])
                for mode in modes:
                    draft = ["-md", a.draft_model] if mode != "iterative" else []
                    g = subprocess.run([*launch, "-n", "2", *ggpipe_command(), "generate", "-m", a.model,
                                        *draft, "--mode", mode, "-p", a.prompt, "-n", str(a.n_predict),
                                        "--ignore-eos", "--json"], capture_output=True, text=True, env=env,
                                       cwd="/", timeout=900)
                    if g.returncode != 0:
                        raise SystemExit(f"{label}: {mode} failed:\n{g.stderr[-2000:]}")
                    j = json.loads(g.stdout)
                    res[label]["tokens_per_s"][mode].append(j["metrics"]["tokens_per_s"])
                    res[label]["tokens"].append(j["tokens"])
                print(f"round {rnd + 1}/{a.rounds}: {label} done", file=sys.stderr, flush=True)
    finally:
        nc.down(a.name, str(tmp / "cluster"))
    first = next(iter(res.values()))["tokens"][0]
    print(f"model {a.model}, draft {a.draft_model}, {a.n_predict} tokens, 2 ranks, {a.rounds} rounds interleaved, "
          f"medians" + ("" if a.no_pingpong else f"; one-way times from scripts/bench_transport.py (--iters {a.iters})")
          + "\n")
    pp_cols = [] if a.no_pingpong else [f"{k} (us)" for k in MESSAGES]
    print("| path | " + " | ".join(pp_cols + [f"{m} tok/s" for m in modes]) + " | identical tokens |")
    print("|---|" + "---:|" * (len(pp_cols) + len(modes)) + "---|")
    for label, r in res.items():
        cells = [] if a.no_pingpong else [f"{statistics.median(r['pingpong'][k]):.0f}" for k in MESSAGES]
        cells += [f"{statistics.median(r['tokens_per_s'][m]):.1f}" for m in modes]
        same = sum(t == first for t in r["tokens"])
        print(f"| {label} | {' | '.join(cells)} | {same}/{len(r['tokens'])} |")
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
