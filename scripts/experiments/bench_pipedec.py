#!/usr/bin/env python3
"""PipeDec against the other modes at 2, 3 and 4 ranks: tokens/s, tokens per
target pass, acceptance, TTFT and per-rank busy share, all rows interleaved
and rotated each round.

Rows per rank count R (1 thread per rank):

* ``iterative``: R target stages (even split), no draft;
* ``speculative``, ``pipeinfer``, ``pipedec`` (its default, a chain: ``--tree-width
  1``), ``pipedec tree`` (``--tree-width 4 --max-children 4``), ``pipedec wide``
  (``--tree-width 16 --max-children 8``): R-1 target stages and the draft on the
  last rank.

Every row must give the same tokens for a prompt (greedy; exactness). On a
2-core machine, 3 and 4 busy ranks share 2 cores: those rows measure the
schedule under contention, not a cluster.

    python scripts/experiments/bench_pipedec.py --ranks 2,3,4 --rounds 2 -n 128 --md docs/pipedec.md

``--before DIR`` adds a ``<row> (before)`` twin of every tree row (``pipedec
tree``, ``pipedec wide``) run from another ggpipe checkout (``git worktree add
/tmp/ggpipe-before REV`` with the built ``ggpipe/_native*.so`` copied in), in
the same interleaved rounds: a before/after comparison of a change to the
tree's handling (e.g. the row masking of layers in flight). The table's
"target rows" column is the rows the target's worker stages evaluated and,
after the slash, the rows they masked (ggpipe.pipeline.masking).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

from ggpipe.bench.prompts import load_prompts, render_prompts
from ggpipe.bench.runner import ggpipe_run, median_of as med, publish
from ggpipe.models.registry import fetch

ROWS = {"iterative": ["--mode", "iterative"], "speculative": ["--mode", "speculative"],
        "pipeinfer": ["--mode", "pipeinfer"], "pipedec": ["--mode", "pipedec"],
        "pipedec tree": ["--mode", "pipedec", "--tree-width", "4", "--max-children", "4"],
        "pipedec wide": ["--mode", "pipedec", "--tree-width", "16", "--max-children", "8"]}


def _split(row: str, ranks: int) -> list[str]:
    if row == "iterative" or ranks == 2:
        return []
    t = ranks - 1
    return ["--split", ",".join([f"{1 / t:.3f}"] * t) + "/1.0"]


def _target_ranks(row: str, ranks: int) -> int:
    """Ranks holding target stages: all of them for iterative, else all but the draft's (the last)."""
    return ranks if row == "iterative" else ranks - 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--model", default="smollm2-goliath-40l-f32")
    ap.add_argument("-md", "--draft-model", default="smollm2-135m")
    ap.add_argument("--ranks", default="2,3,4")
    ap.add_argument("--rows", default=",".join(ROWS))
    ap.add_argument("--prompts", default="default", help="a ggpipe bench prompt set or a .jsonl file")
    ap.add_argument("-n", "--n-predict", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--json", default=None)
    ap.add_argument("--md", default=None, help="also write the table here")
    ap.add_argument("--before", default=None, help="another ggpipe checkout for '(before)' twins of the tree rows")
    a = ap.parse_args()
    model = str(fetch(a.model, progress=False)) if not a.model.endswith(".gguf") else a.model
    prompts = load_prompts(a.prompts)
    texts = render_prompts(model, prompts)
    rows = a.rows.split(",")
    if a.before:
        rows += [f"{row} (before)" for row in rows if row in ("pipedec tree", "pipedec wide")]
    before_env = dict(os.environ, PYTHONPATH=str(Path(a.before).resolve())) if a.before else None
    jobs = [(int(r), row) for r in a.ranks.split(",") for row in rows]
    res: dict = {f"{row} R{r}": {p["id"]: [] for p in prompts} for r, row in jobs}
    tokens: dict = {}
    for rnd in range(a.rounds):
        order = jobs[rnd % len(jobs):] + jobs[:rnd % len(jobs)]
        for p, text in zip(prompts, texts):
            for r, row in order:
                base = row.removesuffix(" (before)")
                extra = ([] if row == "iterative" else ["-md", a.draft_model]) + ROWS[base] + _split(base, r)
                j = ggpipe_run(model, text, a.n_predict, r, extra, timeout_s=900, cwd="/",
                               env=before_env if row != base else None)
                d, m = j.get("decoder") or {}, j["metrics"]
                runs = d.get("verified_runs")
                res[f"{row} R{r}"][p["id"]].append({
                    "tokens_per_s": m["tokens_per_s"], "ttft_s": m.get("ttft_s"),
                    "per_pass": (len(j["tokens"]) - 1) / runs if runs else 1.0,
                    "acceptance": d.get("acceptance_rate"),
                    "busy": [round(x.get("busy_s", 0.0) / m["total_s"], 2) for x in j["ranks"]],
                    "new_trees": d.get("new_trees"), "unsent_hits": d.get("unsent_hits"),
                    # the target's worker stages (rank 0 is the head, the draft's rank is last)
                    "target_rows": sum(x.get("tokens", 0) for x in j["ranks"][1:_target_ranks(row, r)]),
                    "rows_masked": sum(x.get("rows_masked", 0) for x in j["ranks"][1:_target_ranks(row, r)])})
                if tokens.setdefault(p["id"], j["tokens"]) != j["tokens"]:
                    raise SystemExit(f"{row} R{r} on {p['id']}: tokens differ from the first run's")
            print(f"round {rnd + 1}/{a.rounds}: {p['id']} done", file=sys.stderr, flush=True)

    out = [f"{a.model} + {a.draft_model}, 1 thread per rank, {a.n_predict} tokens, {a.rounds} rounds, "
           f"prompts {a.prompts}; median per prompt, then the mean over prompts\n",
           "| row | tokens/s | vs iterative (same R) | vs pipeinfer (same R) | tokens per target pass | acceptance "
           "| TTFT s | busy share per rank | new trees / unsent hits (pipedec) | target rows / masked |",
           "|---|---:|---:|---:|---:|---:|---:|---|---|---:|"]
    pids = [p["id"] for p in prompts]
    for key, per in res.items():
        r = key.rsplit(" R", 1)[1]
        tps = [med(per[p], "tokens_per_s") for p in pids]

        def ratio(other):
            o = res.get(f"{other} R{r}")
            if not o:
                return "-"
            return f"{statistics.mean(t / med(o[p], 'tokens_per_s') for t, p in zip(tps, pids)):.2f}x"

        busy = [statistics.median(x["busy"][i] for p in pids for x in per[p]) for i in range(int(r))]
        trees = ("-" if med(per[pids[0]], "new_trees") != med(per[pids[0]], "new_trees") else
                 f"{statistics.mean(med(per[p], 'new_trees') for p in pids):.0f} / "
                 f"{statistics.mean(med(per[p], 'unsent_hits') for p in pids):.0f}")
        acc = [med(per[p], "acceptance") for p in pids]
        out.append(f"| {key} | {statistics.mean(tps):.1f} ({' / '.join(f'{t:.1f}' for t in tps)}) | "
                   f"{ratio('iterative')} | {ratio('pipeinfer')} | "
                   f"{statistics.mean(med(per[p], 'per_pass') for p in pids):.2f} | "
                   f"{'-' if acc[0] != acc[0] else f'{statistics.mean(acc):.2f}'} | "
                   f"{statistics.mean(med(per[p], 'ttft_s') for p in pids):.3f} | "
                   f"{' / '.join(f'{b:.2f}' for b in busy)} | {trees} | "
                   f"{statistics.mean(med(per[p], 'target_rows') for p in pids):.0f} / "
                   f"{statistics.mean(med(per[p], 'rows_masked') for p in pids):.0f} |")
    publish("\n".join(out), a.md, a.json, res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
