#!/usr/bin/env python3
"""Minions' vote against each of its members alone (issue "Minions and
PipeDec": acceptance and tokens per target pass of the vote against each
proposer alone, on all bench prompts), and Staged SD's draft-of-draft
against the plain draft (issue "Speculation that pays", part 3).

Rows, all interleaved and rotated each round, 2 ranks x 1 thread (target on
rank 0, draft on rank 1): ``draft`` (--spec-type draft), ``ngram``
(--spec-type ngram; the draft rank idles), ``staged`` (--spec-type staged),
``vote`` (--spec-type vote --spec-vote draft,ngram). Every row must give the
same tokens (greedy).

    python scripts/bench_vote.py --modes speculative,pipeinfer --rounds 2 -n 128 --md docs/vote.md

Prints, per mode and prompt: tokens/s (median), tokens per target pass,
acceptance; and for the vote, each member's counterfactual acceptance (what
the target would have accepted of its chains alone) and final weight.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ggpipe.bench.prompts import load_prompts, render_prompts
from ggpipe.bench.runner import ggpipe_run, median_of as med, publish
from ggpipe.models.registry import fetch

ROOT = Path(__file__).resolve().parents[1]
EXTRA = ROOT / "scripts" / "prompts" / "speculation.jsonl"
ROWS = {"draft": ["--spec-type", "draft"], "ngram": ["--spec-type", "ngram"], "staged": ["--spec-type", "staged"],
        "vote": ["--spec-type", "vote", "--spec-vote", "draft,ngram"]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--model", default="smollm2-goliath-40l-f32")
    ap.add_argument("-md", "--draft-model", default="smollm2-135m")
    ap.add_argument("--modes", default="speculative,pipeinfer")
    ap.add_argument("-n", "--n-predict", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--json", default=None)
    ap.add_argument("--md", default=None, help="also write the tables here")
    a = ap.parse_args()
    model = str(fetch(a.model, progress=False)) if not a.model.endswith(".gguf") else a.model
    prompts = load_prompts("default") + load_prompts(str(EXTRA))
    texts = render_prompts(model, prompts)
    modes = a.modes.split(",")
    jobs = [(m, r) for m in modes for r in ROWS]
    res: dict = {m: {p["id"]: {r: [] for r in ROWS} for p in prompts} for m in modes}
    tokens: dict = {}
    for rnd in range(a.rounds):
        order = jobs[rnd % len(jobs):] + jobs[:rnd % len(jobs)]
        for p, text in zip(prompts, texts):
            for mode, r in order:
                j = ggpipe_run(model, text, a.n_predict, 2, ["-md", a.draft_model, "--mode", mode, *ROWS[r]],
                               timeout_s=900, cwd="/")
                d = j["decoder"]
                rec = {"tokens_per_s": j["metrics"]["tokens_per_s"], "per_pass": d.get("accepted_per_pass"),
                       "acceptance": d.get("acceptance_rate")}
                rec.update({k: v for k, v in d.items() if k.startswith(("vote_", "guesses_"))})
                rec["draft_decodes"] = d.get("draft_decodes")
                res[mode][p["id"]][r].append(rec)
                if tokens.setdefault(p["id"], j["tokens"]) != j["tokens"]:
                    raise SystemExit(f"{mode} {r} on {p['id']}: tokens differ from the first run's")
            print(f"round {rnd + 1}/{a.rounds}: {p['id']} done", file=sys.stderr, flush=True)
    out = [f"{a.model} + {a.draft_model}, 2 ranks x 1 thread, {a.n_predict} tokens, {a.rounds} rounds; "
           f"median tokens/s, tokens per target pass, acceptance\n"]

    for mode in modes:
        out += [f"\n{mode}\n", "| prompt | " + " | ".join(ROWS) + " | vote / best alone | staged / draft | "
                "vote: draft alone would accept | vote: ngram alone would accept | weights draft / ngram | "
                "staged: guesses taken / draft runs |", "|---|" + "---:|" * (len(ROWS) + 6)]
        for pid, rr in res[mode].items():
            cells = [f"{med(rr[r], 'tokens_per_s'):.1f} / {med(rr[r], 'per_pass'):.2f} / {med(rr[r], 'acceptance'):.2f}"
                     for r in ROWS]
            best = max(med(rr[r], "tokens_per_s") for r in ("draft", "ngram"))
            v, st = rr["vote"], rr["staged"]
            out.append(f"| {pid} | " + " | ".join(cells) + f" | {med(v, 'tokens_per_s') / best:.2f}x | "
                       f"{med(st, 'tokens_per_s') / med(rr['draft'], 'tokens_per_s'):.2f}x | "
                       f"{med(v, 'vote_draft_acceptance'):.2f} | {med(v, 'vote_ngram_acceptance'):.2f} | "
                       f"{med(v, 'vote_draft_weight'):.3g} / {med(v, 'vote_ngram_weight'):.3g} | "
                       f"{med(st, 'guesses_accepted'):.0f} / {med(st, 'draft_decodes'):.0f} |")
    publish("\n".join(out), a.md, a.json, res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
