"""How well does the draft's confidence predict acceptance?

    python scripts/experiments/draft_calibration.py [-m TARGET] [-md DRAFT] [-n 128]

For each prompt of the bench set and scripts/prompts/speculation.jsonl: the
target's greedy continuation (the single-node reference), then the draft
evaluates prompt + continuation in one pass; at every generated position it
compares the draft's most likely token with the target's and records the
draft's probability q of it. Prints acceptance per bin of q (what greedy
verification would accept) and per prompt. PipeInfer's fixed cutoff stops
drafting below ``--p-accept``; this shows what such tokens are worth.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-m", "--model", default="smollm2-goliath-40l-f32")
    ap.add_argument("-md", "--draft-model", default="smollm2-135m")
    ap.add_argument("-n", type=int, default=128)
    a = ap.parse_args()

    from llama_cpp import Llama

    from ggpipe.bench import baseline
    from ggpipe.bench.prompts import load_prompts, render_prompts
    from ggpipe.models.registry import resolve

    target, draft_path = str(resolve(a.model)), str(resolve(a.draft_model))
    extra = Path(__file__).resolve().parents[1] / "prompts" / "speculation.jsonl"   # scripts/prompts/
    prompts = load_prompts("default") + load_prompts(str(extra))
    texts = render_prompts(target, prompts)
    draft = Llama(draft_path, n_ctx=4096, logits_all=True, verbose=False, n_threads=2)
    rows = []
    for p, text in zip(prompts, texts):
        ref = baseline.greedy(target, text, a.n).tokens
        toks = draft.tokenize(text.encode(), add_bos=True, special=True)
        draft.reset()
        draft.eval(toks + ref[:-1])
        scores = np.array(draft.scores[len(toks) - 1: len(toks) - 1 + len(ref)])
        for i, t in enumerate(ref):
            top = int(np.argmax(scores[i]))
            q = 1.0 / float(np.exp(scores[i] - scores[i][top]).sum())
            rows.append((p["id"], q, top == t))
    q = np.array([r[1] for r in rows])
    ok = np.array([r[2] for r in rows], dtype=float)
    print("| draft probability q | tokens | accepted |\n|---|---:|---:|")
    for lo in np.arange(0.0, 1.0, 0.1):
        m = (q >= lo) & (q < lo + 0.1 + (1e-9 if lo >= 0.9 else 0))
        print(f"| {lo:.1f}-{lo + 0.1:.1f} | {int(m.sum())} | {ok[m].mean():.2f} |" if m.any() else
              f"| {lo:.1f}-{lo + 0.1:.1f} | 0 | |")
    print()
    for pid in dict.fromkeys(r[0] for r in rows):
        sel = [r[2] for r in rows if r[0] == pid]
        print(f"{pid}: draft's top token equals the target's at {np.mean(sel):.2f} of positions")


if __name__ == "__main__":
    main()
