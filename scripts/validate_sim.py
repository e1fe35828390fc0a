#!/usr/bin/env python3
"""Check ``ggpipe simulate`` against a measured ``ggpipe bench`` sweep.

    mpiexec -n 3 ggpipe calibrate -m smollm2-goliath-40l-f32 -md smollm2-135m -o OUT/profile.json
    ggpipe bench -m smollm2-goliath-40l-f32 -md smollm2-135m --modes iterative,speculative,pipeinfer \\
        --ranks 2,3 --prompts default -n 128 --link shm --link 10gbit,50us --link 1gbit,200us \\
        --link 100mbit,1ms -o OUT/bench
    python scripts/validate_sim.py --profile OUT/profile.json --bench OUT/bench [--md OUT/validation.md]

Every configuration of the sweep (link x ranks x mode x prompt) is simulated
with the prompt's token count, the sweep's -n, the default speculation knobs,
and the prompt's acceptance behaviour: the draft's agreement rate and its
confidence exponent (ggpipe.sim.lm.CalibratedDraft) are fitted so that the
simulated *speculative* mode's acceptance rate and tokens per target pass
equal the measured ones for that prompt. Speculative mode is synchronous, so under
greedy decoding its acceptance rate is the same in every run of a prompt (any
earlier recording gives the same figure); pipeinfer's acceptance is left to
the simulation.

Reports per configuration (mean over prompts): measured and simulated
tokens/s and their error, tokens per target pass, TTFT; the median absolute
error of tokens/s; and for every (link, ranks), whether the simulation picks
the same winner in each pair of modes.
"""

from __future__ import annotations

import argparse
import glob
import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path

from ggpipe.sim.model import from_gguf
from ggpipe.sim.profile import Profile
from ggpipe.sim.run import SimConfig, simulate
from ggpipe.transport.link import parse_link

MODES = ("iterative", "speculative", "pipeinfer")


def load_runs(bench: Path) -> list[dict]:
    out = []
    for f in sorted(glob.glob(str(bench / "runs" / "*.json"))):
        d = json.loads(Path(f).read_text())
        if d.get("status") != "ok" or not d.get("result"):
            continue
        res = d["result"]
        c = d["config"]
        out.append({"mode": c["mode"], "ranks": c["ranks"], "link": c["link"], "prompt": c["prompt"],
                    "n": d["n"], "n_prompt": res["n_prompt"], "tokens_per_s": res["metrics"]["tokens_per_s"],
                    "ttft_ms": 1e3 * res["metrics"]["ttft_s"],
                    "accepted_per_pass": res["decoder"].get("accepted_per_pass"),
                    "acceptance_rate": res["decoder"].get("acceptance_rate"),
                    "target": d["target"], "draft": d["draft"]})
    return out


def sim(prof, tdesc, ddesc, mode, ranks, link, n_prompt, n, a, seed, k=1.0) -> dict:
    cfg = SimConfig(prof, tdesc, ddesc, mode=mode, ranks=ranks, link=parse_link(link), acceptance=a,
                    confidence_exponent=k, n_prompt=n_prompt, n_predict=n, prompts=1, seed=seed)
    return simulate(cfg)


def fit_acceptance(prof, tdesc, ddesc, n_prompt, n, want, seed, k=1.0) -> float:
    """Agreement rate whose simulated speculative acceptance is ``want``."""
    lo, hi = 0.3, 0.98
    for _ in range(10):
        mid = (lo + hi) / 2
        got = sim(prof, tdesc, ddesc, "speculative", 2, "shm", n_prompt, n, mid, seed, k)["acceptance_rate"] or 0.0
        lo, hi = (mid, hi) if got < want else (lo, mid)
    return (lo + hi) / 2


def fit_draft(prof, tdesc, ddesc, n_prompt, n, want_acc, want_tpp, seed) -> tuple[float, float]:
    """(agreement rate, confidence exponent) reproducing the measured
    speculative acceptance rate and tokens per target pass."""
    best = None
    for k in (0.25, 0.35, 0.5, 0.7, 1.0, 1.4, 2.0):
        a = fit_acceptance(prof, tdesc, ddesc, n_prompt, n, want_acc, seed, k)
        tpp = sim(prof, tdesc, ddesc, "speculative", 2, "shm", n_prompt, n, a, seed, k)["accepted_per_pass"]
        if best is None or abs(tpp - want_tpp) < best[0]:
            best = (abs(tpp - want_tpp), a, k)
    return best[1], best[2]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--profile", required=True, type=Path)
    ap.add_argument("--bench", required=True, type=Path)
    ap.add_argument("--md", type=Path, default=None, help="Also write the tables here.")
    a = ap.parse_args()
    prof = Profile.load(a.profile)
    runs = load_runs(a.bench)
    if not runs:
        sys.exit(f"no successful runs in {a.bench}/runs")
    tdesc, ddesc = from_gguf(runs[0]["target"]), from_gguf(runs[0]["draft"])
    prompts = sorted({r["prompt"] for r in runs})
    fitted = {}
    for i, p in enumerate(prompts):
        spec = [r for r in runs if r["prompt"] == p and r["mode"] == "speculative" and r["acceptance_rate"]]
        want = statistics.mean(r["acceptance_rate"] for r in spec) if spec else 0.7
        tpp = statistics.mean(r["accepted_per_pass"] for r in spec) if spec else 2.0
        pr = next(r for r in runs if r["prompt"] == p)
        fitted[p] = (*fit_draft(prof, tdesc, ddesc, pr["n_prompt"], pr["n"], want, tpp, i), want, tpp)
    cells = defaultdict(lambda: {"meas": [], "sim": [], "tpp_m": [], "tpp_s": [], "ttft_m": [], "ttft_s": []})
    for r in runs:
        i = prompts.index(r["prompt"])
        fa, fk = fitted[r["prompt"]][:2]
        s = sim(prof, tdesc, ddesc, r["mode"], r["ranks"], r["link"], r["n_prompt"], r["n"], fa, i, fk)
        c = cells[(r["link"], r["ranks"], r["mode"])]
        c["meas"].append(r["tokens_per_s"])
        c["sim"].append(s["tokens_per_s"])
        c["tpp_m"].append(r["accepted_per_pass"] or 1.0)
        c["tpp_s"].append(s["accepted_per_pass"] or 1.0)
        c["ttft_m"].append(r["ttft_ms"])
        c["ttft_s"].append(s["ttft_ms"])
    lines = ["Draft per prompt (measured speculative acceptance, tokens per pass -> fitted agreement rate, "
             "confidence exponent): " + ", ".join(f"{p} {w:.2f}, {t:.2f} -> {f:.2f}, {k:.2f}"
                                                  for p, (f, k, w, t) in fitted.items()), "",
             "| link | ranks | mode | measured tok/s | simulated tok/s | error | tokens/pass measured / simulated "
             "| TTFT ms measured / simulated |", "|---|---:|---|---:|---:|---:|---|---|"]
    errs = []
    mean = statistics.mean
    order = sorted(cells, key=lambda k: (["shm", "10gbit,50us", "1gbit,200us", "100mbit,1ms"].index(k[0])
                                         if k[0] in ("shm", "10gbit,50us", "1gbit,200us", "100mbit,1ms") else 9,
                                         k[1], MODES.index(k[2]) if k[2] in MODES else 9))
    for k in order:
        c = cells[k]
        m, s = mean(c["meas"]), mean(c["sim"])
        err = (s - m) / m
        errs.append(abs(err))
        lines.append(f"| {k[0]} | {k[1]} | {k[2]} | {m:.1f} | {s:.1f} | {100 * err:+.0f}% | "
                     f"{mean(c['tpp_m']):.2f} / {mean(c['tpp_s']):.2f} | "
                     f"{mean(c['ttft_m']):.0f} / {mean(c['ttft_s']):.0f} |")
    lines += ["", f"Median absolute error of tokens/s over {len(errs)} configurations: "
              f"{100 * statistics.median(errs):.1f}% (max {100 * max(errs):.0f}%)."]
    pairs_ok, pairs = 0, 0
    wrong = []
    for link, ranks in sorted({(k[0], k[1]) for k in cells}):
        for x in range(len(MODES)):
            for y in range(x + 1, len(MODES)):
                kx, ky = (link, ranks, MODES[x]), (link, ranks, MODES[y])
                if kx not in cells or ky not in cells:
                    continue
                pairs += 1
                mw = mean(cells[kx]["meas"]) > mean(cells[ky]["meas"])
                sw = mean(cells[kx]["sim"]) > mean(cells[ky]["sim"])
                if mw == sw:
                    pairs_ok += 1
                else:
                    wrong.append(f"{link} {ranks} ranks: {MODES[x]} vs {MODES[y]} (measured "
                                 f"{mean(cells[kx]['meas']):.1f} vs {mean(cells[ky]['meas']):.1f})")
    lines.append(f"Same winner in {pairs_ok} of {pairs} pairs of modes." + (
        " Wrong: " + "; ".join(wrong) + "." if wrong else ""))
    text = "\n".join(lines)
    print(text)
    if a.md:
        a.md.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
