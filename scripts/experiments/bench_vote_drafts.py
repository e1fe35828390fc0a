#!/usr/bin/env python3
"""Minions' vote over two draft models, each on a rank of its own, against
each proposer alone (acceptance and tokens per target pass of the vote
against each proposer alone, on all bench prompts).

Rows, all interleaved and rotated each round, 1 thread per rank, greedy,
``--mode MODE`` (default pipeinfer):

* 2 ranks (target on rank 0, the draft on rank 1): ``A alone``
  (``-md A --spec-type draft``), ``B alone`` (``-md B``), ``ngram alone``
  (``--spec-type ngram``; the draft rank idles), ``vote A+ngram``;
* 3 ranks (A on rank 1, B on rank 2): ``vote A+B`` (``-md A,B --spec-type
  vote --spec-vote draft``) and ``vote A+B+ngram`` (``--spec-vote draft,ngram``).

Every row must give the same tokens. On a 2-core machine the 3-rank rows
share the cores three ways: compare their acceptance and tokens per target
pass with the others, not their tokens/s.

    python scripts/experiments/bench_vote_drafts.py --rounds 2 -n 128 --md results.md
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ggpipe.bench.prompts import load_prompts, render_prompts
from ggpipe.bench.runner import ggpipe_run, median_of as med, publish
from ggpipe.models.registry import fetch

ROOT = Path(__file__).resolve().parents[2]
EXTRA = ROOT / "scripts" / "prompts" / "speculation.jsonl"


def rows(a: str, b: str) -> dict[str, tuple[int, list[str]]]:
    """row -> (ranks, ggpipe arguments)."""
    return {
        "A alone": (2, ["-md", a, "--spec-type", "draft"]),
        "B alone": (2, ["-md", b, "--spec-type", "draft"]),
        "ngram alone": (2, ["-md", a, "--spec-type", "ngram"]),
        "vote A+ngram": (2, ["-md", a, "--spec-type", "vote", "--spec-vote", "draft,ngram"]),
        "vote A+B": (3, ["-md", f"{a},{b}", "--spec-type", "vote", "--spec-vote", "draft"]),
        "vote A+B+ngram": (3, ["-md", f"{a},{b}", "--spec-type", "vote", "--spec-vote", "draft,ngram"]),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--model", default="smollm2-goliath-40l-f32")
    ap.add_argument("--draft-a", default="smollm2-135m")
    ap.add_argument("--draft-b", default="smollm2-135m-f16")
    ap.add_argument("--mode", default="pipeinfer")
    ap.add_argument("-n", "--n-predict", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--json", default=None)
    ap.add_argument("--md", default=None, help="also write the table here")
    a = ap.parse_args()
    model = str(fetch(a.model, progress=False)) if not a.model.endswith(".gguf") else a.model
    da, db = (str(fetch(d, progress=False)) if not d.endswith(".gguf") else d for d in (a.draft_a, a.draft_b))
    table = rows(da, db)
    prompts = load_prompts("default") + load_prompts(str(EXTRA))
    texts = render_prompts(model, prompts)
    res: dict = {p["id"]: {r: [] for r in table} for p in prompts}
    tokens: dict = {}
    names = list(table)
    for rnd in range(a.rounds):
        order = names[rnd % len(names):] + names[:rnd % len(names)]
        for p, text in zip(prompts, texts):
            for r in order:
                ranks, args = table[r]
                j = ggpipe_run(model, text, a.n_predict, ranks, ["--mode", a.mode, *args], timeout_s=900, cwd="/")
                d = j["decoder"]
                rec = {"tokens_per_s": j["metrics"]["tokens_per_s"], "per_pass": d.get("accepted_per_pass"),
                       "acceptance": d.get("acceptance_rate")}
                rec.update({k: v for k, v in d.items() if k.startswith("vote_")})
                res[p["id"]][r].append(rec)
                if tokens.setdefault(p["id"], j["tokens"]) != j["tokens"]:
                    raise SystemExit(f"{r} on {p['id']}: tokens differ from the first run's")
            print(f"round {rnd + 1}/{a.rounds}: {p['id']} done", file=sys.stderr, flush=True)

    out = [f"{a.model}; A = {a.draft_a}, B = {a.draft_b}; --mode {a.mode}, 1 thread per rank, {a.n_predict} "
           f"tokens, {a.rounds} rounds; per row: median tokens/s / tokens per target pass / acceptance\n",
           "| prompt | " + " | ".join(f"{r} (R{table[r][0]})" for r in table)
           + " | vote A+B+ngram: A / B / ngram alone would accept | weights A / B / ngram |",
           "|---|" + "---:|" * len(table) + "---|---|"]
    for pid, rr in res.items():
        cells = [f"{med(rr[r], 'tokens_per_s'):.1f} / {med(rr[r], 'per_pass'):.2f} / {med(rr[r], 'acceptance'):.2f}"
                 for r in table]
        v = rr["vote A+B+ngram"]

        def f(key, fmt):
            x = med(v, key)
            return "-" if x is None else format(x, fmt)
        out.append(f"| {pid} | " + " | ".join(cells)
                   + f" | {f('vote_draft_acceptance', '.2f')} / {f('vote_draft2_acceptance', '.2f')} / "
                     f"{f('vote_ngram_acceptance', '.2f')} | {f('vote_draft_weight', '.3g')} / "
                     f"{f('vote_draft2_weight', '.3g')} / {f('vote_ngram_weight', '.3g')} |")
    publish("\n".join(out), a.md, a.json, res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
