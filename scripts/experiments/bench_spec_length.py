#!/usr/bin/env python3
"""Adaptive speculation length against every fixed length, per prompt
(Minions section 3.3's claim): does
``--p-accept auto`` (ggpipe/speculation/adaptive.py: drafting goes on while
the calibrated probability that the whole path is accepted pays for the
measured marginal cost of a token in a target pass) land within 5% of the
best fixed length for each prompt, without being told which?

Rows: ``fixed L`` = ``--draft L --p-accept 0`` (always L draft tokens per
verification), ``auto`` = ``--draft MAX --p-accept auto``, and ``default`` =
the CLI's defaults. All rows interleaved, rotated each round.

    python scripts/experiments/bench_spec_length.py --mode speculative --rounds 2 -n 128
    python scripts/experiments/bench_spec_length.py --lengths 1,2,4,8 --prompts default --json out.json
    python scripts/experiments/bench_spec_length.py --mode speculative --rounds 6 -n 128 --before /tmp/ggpipe-before

``--before DIR`` adds an ``auto (before)`` row: the auto row of another
ggpipe checkout (its ``PYTHONPATH``), e.g. ``git worktree add --detach
/tmp/ggpipe-before REV`` with the built ``ggpipe/_native*.so`` copied in.

Prints a markdown table per prompt and a summary: auto / best fixed, per prompt.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

from ggpipe.bench.prompts import load_prompts, render_prompts
from ggpipe.bench.runner import ggpipe_run
from ggpipe.models.registry import fetch

ROOT = Path(__file__).resolve().parents[2]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--model", default="smollm2-goliath-40l-f32")
    ap.add_argument("-md", "--draft-model", default="smollm2-135m")
    ap.add_argument("--mode", default="speculative", choices=["speculative", "pipeinfer"])
    ap.add_argument("--lengths", default="1,2,3,4,6,8")
    ap.add_argument("--max-draft", type=int, default=8, help="--draft of the auto row")
    ap.add_argument("--prompts", default="default")
    ap.add_argument("-n", "--n-predict", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--json", default=None)
    ap.add_argument("--before", default=None, help="another ggpipe checkout for an 'auto (before)' row")
    a = ap.parse_args()
    model = str(fetch(a.model, progress=False)) if not a.model.endswith(".gguf") else a.model
    prompts = load_prompts(a.prompts)
    texts = render_prompts(model, prompts)
    rows = {f"fixed {L}": ["--draft", L, "--p-accept", "0"] for L in a.lengths.split(",")}
    rows["auto"] = ["--draft", str(a.max_draft), "--p-accept", "auto"]
    if a.before:
        rows["auto (before)"] = rows["auto"]
    rows["default"] = []
    names = list(rows)
    before_env = dict(os.environ, PYTHONPATH=str(Path(a.before).resolve())) if a.before else None
    res: dict = {p["id"]: {r: [] for r in names} for p in prompts}
    tokens: dict = {}
    for rnd in range(a.rounds):
        order = names[rnd % len(names):] + names[:rnd % len(names)]
        for p, text in zip(prompts, texts):
            for r in order:
                j = ggpipe_run(model, text, a.n_predict, 2, ["-md", a.draft_model, "--mode", a.mode, *rows[r]],
                               timeout_s=900, cwd="/", env=before_env if r == "auto (before)" else None)
                d = j["decoder"]
                res[p["id"]][r].append({"tokens_per_s": j["metrics"]["tokens_per_s"],
                                        "per_pass": d.get("accepted_per_pass"), "acceptance": d.get("acceptance_rate"),
                                        "draft_decodes": d.get("draft_decodes"), "drafted": d.get("drafted"),
                                        "looks_skipped": d.get("looks_skipped"),
                                        "look_threshold": d.get("look_threshold")})
                same = tokens.setdefault(p["id"], j["tokens"]) == j["tokens"]
                if not same:
                    raise SystemExit(f"{r} on {p['id']}: tokens differ from the first run's")
            print(f"round {rnd + 1}/{a.rounds}: {p['id']} done", file=sys.stderr, flush=True)
    med = {pid: {r: statistics.median(x["tokens_per_s"] for x in v) for r, v in rr.items()} for pid, rr in res.items()}
    print(f"{a.mode}, {a.model} + {a.draft_model}, 2 ranks x 1 thread, {a.n_predict} tokens, {a.rounds} rounds, "
          f"median tokens/s (tokens per target pass, acceptance)\n")
    extra = " auto / auto (before) |" if a.before else ""
    print("| prompt | " + " | ".join(names) + " | best fixed | auto / best fixed |" + extra)
    print("|---|" + "---:|" * (len(names) + 2 + bool(a.before)))
    for pid, rr in res.items():
        fixed = {r: v for r, v in med[pid].items() if r.startswith("fixed")}
        best = max(fixed, key=fixed.get)
        cells = []
        for r in names:
            pp = statistics.median(x["per_pass"] or 0 for x in rr[r])
            cells.append(f"{med[pid][r]:.1f} ({pp:.2f})")
        vs = f" {med[pid]['auto'] / med[pid]['auto (before)']:.2f}x |" if a.before else ""
        print(f"| {pid} | " + " | ".join(cells) + f" | {best} | {med[pid]['auto'] / fixed[best]:.2f}x |" + vs)
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
