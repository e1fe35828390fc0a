"""What constrained sampling costs: generation tokens/s of the same prompts
plain, with penalties and a logit bias, and under a JSON schema, interleaved
rounds (the order rotates each round), one ``ggpipe batch`` job per row.

    python scripts/constraint_cost.py --rounds 3
    python scripts/constraint_cost.py -m smollm2-135m --ranks 2 --mode pipeinfer -md smollm2-135m-skip26

Rows: ``plain`` (greedy); ``penalties`` (``repeat_penalty`` 1.3,
``presence_penalty`` 0.5, ``frequency_penalty`` 0.3 and a bias on one
token: the head asks for whole logit rows); ``json_schema`` (a three-field
object: whole rows and the grammar on the head). Each request is one of
the held-out prompts (scripts/prompts/holdout16.jsonl), ``-n`` greedy
tokens, no end-of-generation stop for plain and penalties (``--ignore-eos``
does not apply to a grammar, which ends its replies itself). Reported: the
median over rounds of each row's median tokens/s over its requests (the
first request warms the page cache and is left out), and the ratio to
plain.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ggpipe.child_process import child_env, ggpipe_command  # noqa: E402

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 24},
                                           "year": {"type": "integer"}, "tags": {"type": "array",
                                                                                 "items": {"type": "string"},
                                                                                 "maxItems": 4}},
          "required": ["name", "year", "tags"]}
ROWS = {"plain": {}, "penalties": {"repeat_penalty": 1.3, "presence_penalty": 0.5, "frequency_penalty": 0.3,
                                   "logit_bias": {"11": -100}},
        "json_schema": {"json_schema": SCHEMA}}


def run_row(args, row: str, prompts: list[str], work: Path) -> float:
    """Median generation tokens/s of the row's requests (the first left out)."""
    inp, out = work / f"{row}.jsonl", work / f"{row}.out.jsonl"
    out.unlink(missing_ok=True)
    inp.write_text("".join(json.dumps({"id": i, "prompt": p, "n": args.n, **ROWS[row]}) + "\n"
                           for i, p in enumerate(prompts)), encoding="utf-8")
    cmd = ggpipe_command() + (["batch", "-m", args.model, str(inp), "-o", str(out), "--no-progress", "--mode", args.mode,
                          *(["-md", args.draft_model] if args.draft_model else []),
                          *(["--ignore-eos"] if row != "json_schema" else [])])
    if args.ranks > 1:
        cmd = ["mpiexec", "-n", str(args.ranks), *cmd]
    p = subprocess.run(cmd, capture_output=True, text=True, env=child_env(), cwd=ROOT, timeout=1800)
    if p.returncode:
        raise SystemExit(f"{row}: ggpipe batch failed ({p.returncode}):\n{p.stderr[-2000:]}")
    recs = sorted((json.loads(ln) for ln in out.read_text().splitlines() if ln), key=lambda r: r["id"])
    return statistics.median(r["metrics"]["tokens_per_s"] for r in recs[1:] if r["metrics"].get("tokens_per_s"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-m", "--model", default="smollm2-goliath-40l")
    ap.add_argument("-md", "--draft-model", default=None)
    ap.add_argument("--mode", default="iterative")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("-n", type=int, default=64)
    ap.add_argument("--requests", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    prompts = [json.loads(ln)["prompt"] for ln in (ROOT / "scripts" / "prompts" / "holdout16.jsonl")
               .read_text(encoding="utf-8").splitlines() if ln][: args.requests]
    got: dict[str, list[float]] = {r: [] for r in ROWS}
    names = list(ROWS)
    with tempfile.TemporaryDirectory() as tmp:
        for k in range(args.rounds):
            for row in names[k % len(names):] + names[: k % len(names)]:
                got[row].append(run_row(args, row, prompts, Path(tmp)))
                print(f"round {k + 1}: {row}: {got[row][-1]:.1f} tok/s", file=sys.stderr)
    base = statistics.median(got["plain"])
    print(f"| row | generation tok/s (median of {args.rounds}) | / plain |")
    print("|---|---:|---:|")
    for row in names:
        m = statistics.median(got[row])
        print(f"| {row} | {m:.1f} | {m / base:.2f}x |")


if __name__ == "__main__":
    main()
