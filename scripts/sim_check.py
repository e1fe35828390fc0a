#!/usr/bin/env python3
"""The simulator against the jobs it predicts, in one run: calibrate, then for
each configuration ``ggpipe simulate`` and the measured job side by side.

    python scripts/sim_check.py -o OUT [--rounds 3] [--quick] [--goliath-model NAME] [--plot PNG]

Configurations (2 ranks x 1 thread, and 3 ranks where given): the goliath
(SmolLM2's blocks x 40, F16, or F32 with ``--goliath-model
smollm2-goliath-40l-f32``) in iterative and pipeinfer mode with SmolLM2-135M
as the draft; the 7B shape (``llama-7b-shape-q4_k_m``, random weights: speed
only) in iterative mode and as 8 requests at once (``batch --parallel 8``,
aggregate tokens/s). A round calibrates the model at the job's rank count
(``mpiexec -n R ggpipe calibrate``), then simulates and measures each of its
configurations, one right after the other: this machine's speed moves by a
fifth within minutes, so a prediction is compared only with the job measured
next to its calibration, and the rounds (``--rounds``) give the spread. The
pipeinfer simulation takes the draft agreement its calibration measured
(``calibrate -md``, on calibrate's own prompts, not the measured job's), as a
user's plan would; the random-weight 7B shape has no agreement to speak of and
runs without a draft.

Writes OUT/sim_check.jsonl (one record per configuration and round:
simulated and measured tokens/s, the error) and prints a Markdown table of the
median error per configuration and its range over the rounds; with
``--plot``, a scatter of predicted against measured tokens/s (matplotlib).
``--from-jsonl FILE`` redraws the table and the plot from earlier records.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ggpipe.child_process import child_env, ggpipe_command
from ggpipe.sim.profile import Profile

PROMPT = ("The history of the steam engine begins with simple devices that used heat to move water. Engineers in "
          "the eighteenth century improved them step by step, adding separate condensers, valves and governors, "
          "until engines drove mills, ships and railways across the world. ")
# one-stream jobs: prompts of the kind calibrate's own (ggpipe.service.agreement.DEFAULT_PROMPTS), none of them
JOB_PROMPTS = (
    "Tell me about the life of a honeybee colony through the seasons.",
    "Write a letter to a friend describing your first week in a new city.",
    "How does a bicycle stay upright while it moves? Explain it for a curious child.",
)


def run(args: list[str], ranks: int | None = None, timeout: float = 1800) -> str:
    cmd = ([*["mpiexec", "-n", str(ranks)]] if ranks else []) + ggpipe_command() + args
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=child_env(), check=False)
    if p.returncode != 0:
        sys.exit(f"sim_check: {' '.join(cmd)} failed:\n{p.stderr[-3000:]}")
    return p.stdout


def simulate(profile: Path, model: str, draft: str | None, mode: str, ranks: int, n: int, n_prompt: int,
             parallel: int = 1) -> dict:
    args = ["simulate", "--profile", str(profile), "-m", model, "--modes", mode, "--ranks", str(ranks), "-n", str(n),
            "--n-prompt", str(n_prompt), "--json", "--prompts", str(8 if parallel > 1 else 1),
            "--parallel", str(parallel)]
    if draft:
        args += ["-md", draft]
    rec = json.loads(run(args).strip().splitlines()[-1])
    return {"tokens_per_s": rec.get("aggregate_tokens_per_s") if parallel > 1 else rec["tokens_per_s"]}


def measure_one(model: str, draft: str | None, mode: str, ranks: int, n: int) -> dict:
    """One stream, each of JOB_PROMPTS in turn: tokens/s over all of them
    (tokens over generation seconds), the mean prompt length, and the jobs'
    acceptance rate (accepted over drafted tokens)."""
    tokens = seconds = n_prompt = drafted = accepted = 0
    for prompt in JOB_PROMPTS:
        args = ["generate", "-m", model, "-p", prompt, "-n", str(n), "-t", "1", "--ignore-eos", "--json",
                "--mode", mode]
        if draft:
            args += ["-md", draft]
        d = json.loads(run(args, ranks))
        tokens += d["metrics"]["n_gen_tokens"]
        seconds += d["metrics"]["gen_s"]
        n_prompt += d["n_prompt"]
        dec = d.get("decoder") or {}
        drafted, accepted = drafted + (dec.get("drafted") or 0), accepted + (dec.get("draft_accepted") or 0)
    return {"tokens_per_s": tokens / seconds, "n_prompt": round(n_prompt / len(JOB_PROMPTS)),
            "acceptance": accepted / drafted if drafted else None}


def measure_parallel(model: str, ranks: int, n: int, work: Path) -> dict:
    items = work / "items.jsonl"
    short = PROMPT.split(". ")[0] + "."   # about 20 tokens: the 8 prompts' prefill stays short beside generation
    items.write_text("".join(json.dumps({"id": f"r{i}", "prompt": f"Request {i}: " + short}) + "\n"
                             for i in range(8)))
    out = work / f"out-{time.monotonic_ns()}.jsonl"
    t0 = time.monotonic()
    run(["batch", str(items), "-m", model, "-o", str(out), "-n", str(n), "-t", "1", "--ignore-eos",
         "--parallel", "8", "--no-progress"], ranks)
    wall = time.monotonic() - t0
    recs = [json.loads(line) for line in out.read_text().splitlines()]
    tokens = sum(len(r.get("tokens") or []) or (r.get("metrics") or {}).get("n_gen_tokens", 0) for r in recs)
    span = max((r.get("metrics") or {}).get("total_s") or 0 for r in recs) or wall
    return {"tokens_per_s": tokens / span, "n_prompt": round(statistics.mean(r["n_prompt"] for r in recs)),
            "acceptance": None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-o", "--out", type=Path, required=True)
    ap.add_argument("--quick", action="store_true", help="the goliath only, 2 ranks")
    ap.add_argument("--goliath", action="store_true", help="the goliath only, 2 and 3 ranks")
    ap.add_argument("--goliath-model", default="smollm2-goliath-40l",
                    help="the goliath's weights (default: F16; smollm2-goliath-40l-f32: F32)")
    ap.add_argument("--rounds", type=int, default=3, help="calibrate-and-measure rounds per model and rank count")
    ap.add_argument("--plot", type=Path, help="write a scatter of simulated against measured tokens/s (PNG)")
    ap.add_argument("--from-jsonl", type=Path, help="report earlier records instead of measuring")
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="sim_check."))
    goliath, small, big, big_draft = a.goliath_model, "smollm2-135m", "llama-7b-shape-q4_k_m", None
    # (model, draft or None, mode, ranks, tokens, slots); a model's profile is measured with its job's draft
    plan = [(goliath, None, "iterative", 2, 128, 1), (goliath, small, "pipeinfer", 2, 128, 1)]
    if not a.quick:
        plan += [(goliath, None, "iterative", 3, 128, 1), (goliath, small, "pipeinfer", 3, 128, 1)]
    if not (a.quick or a.goliath):
        plan += [(big, big_draft, "iterative", 2, 32, 1), (big, big_draft, "iterative", 2, 48, 8)]
    drafts = {m: d for m, d, *_ in plan if d}
    if a.from_jsonl:
        records = [json.loads(line) for line in a.from_jsonl.read_text().splitlines() if line.strip()]
        report(records, a.plot)
        return
    records = []
    groups: dict[tuple, list] = {}
    for entry in plan:
        groups.setdefault((entry[0], entry[3]), []).append(entry)
    for rnd in range(a.rounds):
        for (model, ranks), entries in groups.items():
            prof = a.out / f"profile-{model}-{ranks}r-{rnd}.json"
            run(["calibrate", "-m", model, "-t", "1", "-o", str(prof)] + (["-md", drafts[model]] if model in drafts
                                                                          else []), ranks)
            for _, draft, mode, _, n, parallel in entries:
                if parallel > 1:
                    meas = measure_parallel(model, ranks, n, work)
                    sim = simulate(prof, model, None, mode, ranks, n, meas["n_prompt"], parallel)
                else:
                    meas = measure_one(model, draft, mode, ranks, n)
                    sim = simulate(prof, model, draft, mode, ranks, n, meas["n_prompt"], 1)
                agreement = (Profile.load(prof).agreement or {}).get("rate") if draft else None
                rec = {"model": model, "mode": mode, "ranks": ranks, "parallel": parallel, "n": n, "round": rnd,
                       "simulated_tokens_per_s": round(sim["tokens_per_s"], 2),
                       "measured_tokens_per_s": round(meas["tokens_per_s"], 2),
                       "error": round(sim["tokens_per_s"] / meas["tokens_per_s"] - 1, 3),
                       "agreement": None if agreement is None else round(agreement, 3),
                       "measured_acceptance": None if meas["acceptance"] is None else round(meas["acceptance"], 3)}
                records.append(rec)
                print(json.dumps(rec), file=sys.stderr, flush=True)
    (a.out / "sim_check.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    report(records, a.plot)


def report(records: list[dict], plot: Path | None) -> None:
    """The Markdown table (median over rounds per configuration) and the scatter."""
    configs = list(dict.fromkeys((r["model"], r["mode"], r["ranks"], r["parallel"]) for r in records))
    print("| model | mode | ranks | parallel | simulated tok/s | measured tok/s | error, median (range) |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for model, mode, ranks, parallel in configs:
        rs = [r for r in records if (r["model"], r["mode"], r["ranks"], r["parallel"]) == (model, mode, ranks, parallel)]
        errs = [100 * r["error"] for r in rs]
        print(f"| {model} | {mode} | {ranks} | {parallel} "
              f"| {statistics.median(r['simulated_tokens_per_s'] for r in rs):.1f} "
              f"| {statistics.median(r['measured_tokens_per_s'] for r in rs):.1f} "
              f"| {statistics.median(errs):+.0f}% ({min(errs):+.0f}% to {max(errs):+.0f}%) |")
    if plot is None:
        return
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    fig, ax = plt.subplots(figsize=(5.5, 5))
    for model, mode, ranks, parallel in configs:
        rs = [r for r in records if (r["model"], r["mode"], r["ranks"], r["parallel"]) == (model, mode, ranks, parallel)]
        label = f"{model.split('-q4')[0]} {mode}{' x8' if parallel > 1 else ''}, {ranks} ranks"
        ax.scatter([r["measured_tokens_per_s"] for r in rs], [r["simulated_tokens_per_s"] for r in rs], label=label)
    hi = 1.1 * max(max(r["measured_tokens_per_s"], r["simulated_tokens_per_s"]) for r in records)
    lo = 0.8 * min(min(r["measured_tokens_per_s"], r["simulated_tokens_per_s"]) for r in records)
    for f, style in ((1.0, "-"), (1.15, ":"), (0.85, ":")):
        ax.plot([lo, hi], [lo * f, hi * f], "k" + style, linewidth=0.8)
    from matplotlib.ticker import NullFormatter, ScalarFormatter  # noqa: PLC0415

    ax.set_xscale("log")
    ax.set_yscale("log")
    for axis in (ax.xaxis, ax.yaxis):
        axis.set_major_formatter(ScalarFormatter())
        axis.set_minor_formatter(NullFormatter())
    ax.set_xlabel("measured tokens/s")
    ax.set_ylabel("simulated tokens/s")
    ax.set_title("simulated against measured (dotted: +-15%)", fontsize=10)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(plot, dpi=120)


if __name__ == "__main__":
    main()
