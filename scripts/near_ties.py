#!/usr/bin/env python3
"""Find near-ties: generated positions where the single-node reference's top
two logits are closer than a margin (where a speculative mode that
summed in another order, or used another matmul kernel, would pick another
token). The exactness stress run (scripts/exactness_stress.py) uses prompts
with such positions.

    python scripts/near_ties.py -m smollm2-goliath-40l-f32 -n 128 --below 0.01

Prints, per prompt (the bench prompts and scripts/prompts/speculation.jsonl,
chat-rendered as ggpipe renders them), the positions (generated token index,
0-based) and margins below the threshold; ``--json`` writes them as JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> int:
    from ggpipe.bench import baseline
    from ggpipe.bench.prompts import load_prompts, render_prompts
    from ggpipe.models.registry import resolve

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--model", default="smollm2-goliath-40l-f32", help="name in models.toml or a GGUF path")
    ap.add_argument("-n", "--n-predict", type=int, default=128)
    ap.add_argument("--below", type=float, default=0.01, help="report margins below this (logits)")
    ap.add_argument("--prompts", default=None, help="comma-separated prompt ids (default: all)")
    ap.add_argument("--json", dest="json_out", default=None, help="also write the result here")
    a = ap.parse_args()

    model = resolve(a.model)
    prompts = load_prompts("default") + load_prompts(str(ROOT / "scripts" / "prompts" / "speculation.jsonl"))
    if a.prompts:
        prompts = [p for p in prompts if p["id"] in a.prompts.split(",")]
    result = {}
    for p, text in zip(prompts, render_prompts(model, prompts)):
        margins: list[float] = []
        baseline.greedy(model, text, a.n_predict, margins=margins, n_ctx=4096)
        ties = [(i, round(m, 5)) for i, m in enumerate(margins) if m < a.below]
        result[p["id"]] = {"n": len(margins), "near_ties": ties, "min_margin": round(min(margins), 5)}
        print(f"{p['id']:>14}: {len(ties)} of {len(margins)} below {a.below}: "
              + ", ".join(f"#{i} ({m:.4f})" for i, m in ties), flush=True)
    if a.json_out:
        Path(a.json_out).write_text(json.dumps({"model": str(model), "below": a.below, "prompts": result}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
