#!/usr/bin/env python3
"""Minions' vote against each of its members alone (acceptance and tokens
per target pass of the vote against each proposer alone, on all bench
prompts), and Staged SD's draft-of-draft against the plain draft.

Rows, all interleaved and rotated each round, 2 ranks x 1 thread (target on
rank 0, draft on rank 1): ``draft`` (--spec-type draft), ``ngram``
(--spec-type ngram; the draft rank idles), ``staged`` (--spec-type staged),
``vote`` (--spec-type vote --spec-vote draft,ngram); on request (``--rows``)
``staged auto`` (staged with ``--p-accept auto``). Every row must give the
same tokens (greedy). ``--rows`` runs a subset; ``--before DIR`` adds a
``staged (before)`` row, ``--spec-type staged`` run from another checkout
(``git worktree add /tmp/ggpipe-before REV`` with the built
``ggpipe/_native*.so`` copied in), in the same interleaved rounds.

    python scripts/experiments/bench_vote.py --modes speculative,pipeinfer --rounds 2 -n 128 --md docs/vote.md
    python scripts/experiments/bench_vote.py --rows draft,staged --before /tmp/ggpipe-before --rounds 3

Prints, per mode and prompt: tokens/s (median), tokens per target pass,
acceptance; and for the vote, each member's counterfactual acceptance (what
the target would have accepted of its chains alone) and final weight.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from ggpipe.bench.prompts import load_prompts, render_prompts
from ggpipe.bench.runner import ggpipe_run, median_of as med, publish
from ggpipe.models.registry import fetch

ROOT = Path(__file__).resolve().parents[2]
EXTRA = ROOT / "scripts" / "prompts" / "speculation.jsonl"
ROWS = {"draft": ["--spec-type", "draft"], "ngram": ["--spec-type", "ngram"], "staged": ["--spec-type", "staged"],
        "vote": ["--spec-type", "vote", "--spec-vote", "draft,ngram"], "staged (before)": ["--spec-type", "staged"],
        "staged auto": ["--spec-type", "staged", "--p-accept", "auto"]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--model", default="smollm2-goliath-40l-f32")
    ap.add_argument("-md", "--draft-model", default="smollm2-135m")
    ap.add_argument("--modes", default="speculative,pipeinfer")
    ap.add_argument("-n", "--n-predict", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--json", default=None)
    ap.add_argument("--md", default=None, help="also write the tables here")
    ap.add_argument("--rows", default="draft,ngram,staged,vote", help="comma-separated rows (default: all four)")
    ap.add_argument("--prompts", default=None, help="comma-separated prompt ids (default: all five)")
    ap.add_argument("--before", default=None, help="another ggpipe checkout for a 'staged (before)' row")
    a = ap.parse_args()
    rows = a.rows.split(",") + (["staged (before)"] if a.before else [])
    if unknown := [r for r in rows if r not in ROWS]:
        raise SystemExit(f"unknown rows {unknown}; choose from {', '.join(r for r in ROWS if 'before' not in r)}")
    before_env = dict(os.environ, PYTHONPATH=str(Path(a.before).resolve())) if a.before else None
    model = str(fetch(a.model, progress=False)) if not a.model.endswith(".gguf") else a.model
    prompts = load_prompts("default") + load_prompts(str(EXTRA))
    if a.prompts:
        prompts = [p for p in prompts if p["id"] in a.prompts.split(",")]
    texts = render_prompts(model, prompts)
    modes = a.modes.split(",")
    jobs = [(m, r) for m in modes for r in rows]
    res: dict = {m: {p["id"]: {r: [] for r in rows} for p in prompts} for m in modes}
    tokens: dict = {}
    for rnd in range(a.rounds):
        order = jobs[rnd % len(jobs):] + jobs[:rnd % len(jobs)]
        for p, text in zip(prompts, texts):
            for mode, r in order:
                j = ggpipe_run(model, text, a.n_predict, 2, ["-md", a.draft_model, "--mode", mode, *ROWS[r]],
                               timeout_s=900, cwd="/", env=before_env if r.endswith("(before)") else None)
                d = j["decoder"]
                rec = {"tokens_per_s": j["metrics"]["tokens_per_s"], "per_pass": d.get("accepted_per_pass"),
                       "acceptance": d.get("acceptance_rate")}
                rec.update({k: v for k, v in d.items() if k.startswith(("vote_", "guess"))})
                rec["draft_decodes"] = d.get("draft_decodes")
                res[mode][p["id"]][r].append(rec)
                if tokens.setdefault(p["id"], j["tokens"]) != j["tokens"]:
                    raise SystemExit(f"{mode} {r} on {p['id']}: tokens differ from the first run's")
            print(f"round {rnd + 1}/{a.rounds}: {p['id']} done", file=sys.stderr, flush=True)
    out = [f"{a.model} + {a.draft_model}, 2 ranks x 1 thread, {a.n_predict} tokens, {a.rounds} rounds; "
           f"median tokens/s, tokens per target pass, acceptance\n"]

    for mode in modes:
        cols = ["tokens/s / per pass / acceptance: " + r for r in rows]
        extra = []
        if {"vote", "draft", "ngram"} <= set(rows):
            extra += ["vote / best alone", "vote: draft alone would accept", "vote: ngram alone would accept",
                      "weights draft / ngram"]
        staged = [r for r in rows if r.startswith("staged")]
        if "draft" in rows:
            extra += [f"{r} / draft" for r in staged]
        extra += [f"{r}: guesses decoded / taken / draft runs" for r in staged]
        out += [f"\n{mode}\n", "| prompt | " + " | ".join(cols + extra) + " |", "|---|" + "---:|" * (len(cols) + len(extra))]
        for pid, rr in res[mode].items():
            cells = [f"{med(rr[r], 'tokens_per_s'):.1f} / {med(rr[r], 'per_pass'):.2f} / {med(rr[r], 'acceptance'):.2f}"
                     for r in rows]
            if {"vote", "draft", "ngram"} <= set(rows):
                v = rr["vote"]
                best = max(med(rr[r], "tokens_per_s") for r in ("draft", "ngram"))
                cells += [f"{med(v, 'tokens_per_s') / best:.2f}x", f"{med(v, 'vote_draft_acceptance'):.2f}",
                          f"{med(v, 'vote_ngram_acceptance'):.2f}",
                          f"{med(v, 'vote_draft_weight'):.3g} / {med(v, 'vote_ngram_weight'):.3g}"]
            if "draft" in rows:
                cells += [f"{med(rr[r], 'tokens_per_s') / med(rr['draft'], 'tokens_per_s'):.2f}x" for r in staged]
            cells += [f"{med(rr[r], 'guesses_made'):.0f} / {med(rr[r], 'guesses_accepted'):.0f} / "
                      f"{med(rr[r], 'draft_decodes'):.0f}" for r in staged]
            out.append(f"| {pid} | " + " | ".join(cells) + " |")
    publish("\n".join(out), a.md, a.json, res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
