#!/usr/bin/env python3
"""Same tokens every run: many greedy runs of the speculative modes, compared
token for token with the single-node reference.

    python scripts/exactness_stress.py -m smollm2-goliath-40l-f32 -md smollm2-135m \\
        --prompts goliath,encyclopedia --runs 50 --ranks 2,3,4 --load 1 -o results/exact

For each mode and rank count, one ``mpiexec -n R ggpipe batch`` job runs
``--runs`` requests, cycling through the prompts (chat-rendered as the bench
renders them; pick prompts with near-ties: ``scripts/near_ties.py``). Each
request's tokens are compared with ``ggpipe.bench.baseline.greedy`` of the
same prompt (the reference configuration: one process, 1 thread, flash
attention off). ``--load K`` keeps K busy-looping processes running during
every job, so timings (and with them which tokens travel in which batch)
vary from run to run. Writes ``summary.md`` and ``summary.json`` in the
output folder and prints the table; exits 1 if any run differed.

The build matters: llama-cpp-python built with llamafile's sgemm (the default)
computes a token inside a batch with another kernel than a token alone, so an
F16/F32 target can differ at near-ties; the README's install line builds it
with ``-DGGML_LLAMAFILE=OFF``. The table says which build ran.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _busy_loops(k: int) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(k)]


def _stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:          # only the processes this script started, by their pid
        p.kill()
        p.wait()


def main() -> int:
    from ggpipe.bench import baseline
    from ggpipe.bench.prompts import load_prompts, render_prompts
    from ggpipe.child_process import ggpipe_command
    from ggpipe.models.registry import resolve
    from ggpipe.runtime.llama import llamafile_sgemm
    from ggpipe.transport.launcher_path import find_launcher

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--model", default="smollm2-goliath-40l-f32")
    ap.add_argument("-md", "--draft-model", default="smollm2-135m")
    ap.add_argument("--spec-type", default="draft")
    ap.add_argument("--prompts", default="goliath,encyclopedia", help="comma-separated prompt ids")
    ap.add_argument("-n", "--n-predict", type=int, default=64)
    ap.add_argument("--runs", type=int, default=50, help="requests per mode and rank count")
    ap.add_argument("--ranks", default="2,3,4")
    ap.add_argument("--modes", default="speculative,pipeinfer")
    ap.add_argument("--load", type=int, default=1, help="busy-looping processes during each job")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds per job")
    ap.add_argument("-o", "--out", default="results/exact")
    ap.add_argument("extra", nargs="*", help="more ggpipe batch options, after --")
    a = ap.parse_args()

    out = Path(a.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    target = resolve(a.model)
    draft = resolve(a.draft_model) if a.spec_type.startswith("draft") else None
    prompts = load_prompts("default") + load_prompts(str(ROOT / "scripts" / "prompts" / "speculation.jsonl"))
    ids = a.prompts.split(",")
    prompts = [p for i in ids for p in prompts if p["id"] == i]
    if len(prompts) != len(ids):
        ap.error(f"unknown prompt id among {ids}")
    texts = render_prompts(target, prompts)
    refs, margins = {}, {}
    for p, text in zip(prompts, texts):
        m: list[float] = []
        refs[p["id"]] = baseline.greedy(target, text, a.n_predict, margins=m, n_ctx=4096, ignore_eos=True).tokens
        margins[p["id"]] = m
    requests = out / "requests.jsonl"
    with requests.open("w") as f:
        for k in range(a.runs):
            p, text = prompts[k % len(prompts)], texts[k % len(prompts)]
            f.write(json.dumps({"id": f"{p['id']}-{k}", "prompt": text}) + "\n")

    build = "llamafile sgemm ON (default build)" if llamafile_sgemm() else "llamafile sgemm OFF"
    rows = []
    failed = 0
    for mode in a.modes.split(","):
        for ranks in [int(r) for r in a.ranks.split(",")]:
            res = out / f"{mode}-{ranks}.jsonl"
            res.unlink(missing_ok=True)
            cmd = [find_launcher("mpiexec"), "-n", str(ranks), *ggpipe_command(), "batch", str(requests),
                   "-m", str(target), "--mode", mode, "--spec-type", a.spec_type, "-n", str(a.n_predict),
                   "--temp", "0", "--ignore-eos", "-c", "4096", "-o", str(res), *a.extra]
            if draft is not None:
                cmd[cmd.index("--mode"):cmd.index("--mode")] = ["-md", str(draft)]
            load = _busy_loops(a.load)
            t0 = time.perf_counter()
            try:
                # cwd "/" and -P (ggpipe_command): nothing in the working directory shadows a
                # PYTHONPATH pointing at another checkout
                p = subprocess.run(cmd, capture_output=True, text=True, timeout=a.timeout, cwd="/")
            finally:
                _stop(load)
            wall = time.perf_counter() - t0
            recs = [json.loads(ln) for ln in res.read_text().splitlines()] if res.exists() else []
            same, diffs = 0, []
            for rec in recs:
                pid = rec["id"].rsplit("-", 1)[0]
                ref, got = refs[pid], rec["tokens"]
                if got == ref:
                    same += 1
                    continue
                i = next((j for j, (x, y) in enumerate(zip(got, ref)) if x != y), min(len(got), len(ref)))
                diffs.append({"id": rec["id"], "at": i,
                              "margin": round(margins[pid][i], 5) if i < len(margins[pid]) else None})
            bad = len(recs) - same + (a.runs - len(recs))
            failed += bad
            rows.append({"mode": mode, "ranks": ranks, "runs": len(recs), "identical": same, "differed": diffs,
                         "exit": p.returncode, "wall_s": round(wall, 1),
                         "stderr_tail": p.stderr[-400:] if p.returncode else ""})
            print(f"{mode:>12} x{ranks}: {same}/{a.runs} identical ({wall:.0f} s)"
                  + (f"; differ: {diffs[:4]}" if diffs else "") + (f"; exit {p.returncode}" if p.returncode else ""),
                  flush=True)

    ties = {pid: [(i, round(m, 4)) for i, m in enumerate(ms) if m < 0.01] for pid, ms in margins.items()}
    summary = {"command": " ".join([os.path.basename(sys.argv[0]), *sys.argv[1:]]), "build": build,
               "model": str(target), "draft": str(draft) if draft else None, "n_predict": a.n_predict,
               "load_processes": a.load, "near_ties_below_0.01": ties, "rows": rows}
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    lines = [f"Build: {build}. Target {target.name}, draft {draft.name if draft else a.spec_type}, "
             f"{a.n_predict} tokens, greedy, {a.load} busy process(es) beside each job.",
             "Reference near-ties (generated token index, top-2 margin < 0.01): "
             + "; ".join(f"{pid}: {t}" for pid, t in ties.items()), "",
             "| mode | ranks | identical runs | first differences (token, reference margin) |", "|---|---:|---:|---|"]
    for r in rows:
        d = ", ".join(f"#{x['at']} ({x['margin']})" for x in r["differed"][:6]) or "none"
        lines.append(f"| {r['mode']} | {r['ranks']} | {r['identical']}/{a.runs} | {d} |")
    (out / "summary.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
