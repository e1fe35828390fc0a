"""Rows per second and each stage's busy share from a ``GGPIPE_TRACE_DIR``
trace of a job (ggpipe/trace.py), the start-up left out.

    GGPIPE_TRACE_DIR=tr mpiexec -n 4 ggpipe batch scripts/prompts/holdout16.jsonl -o out.jsonl \\
        -m smollm2-goliath-40l-f32 -n 128 --ignore-eos --parallel 16 -t 4 --micro-batches 2
    python scripts/trace_rows.py tr

Rows: the tokens the first stage computed (prompt and generated), over the
seconds from its first run's start to the last stage's last run's end.
Busy: each stage's share of the middle 60% of that span spent in runs.
Bound: the rows per second the job would make if its busiest stage never
waited, every run as long as it took (rows over that stage's run seconds,
the whole trace): no schedule of the same runs beats it (docs/benchmarks/many-requests.md).

``--detail`` adds where the time went (docs/benchmarks/many-requests.md): per rank the
runs by size (count, seconds, median milliseconds); the prefill phase (up to
the end of the last run of more rows than ``--group`` on the first stage)
and, after it, each stage's busy share, its waits between runs (median, p90,
and the sum of those above 5 ms); and the hops of a run: first stage's end
to the next stage's start, the last stage's end to the head's receipt, the
head's receipt to its next submission.
"""

from __future__ import annotations

import argparse
import bisect

import numpy as np

from ggpipe.bench.timeline import load_traces


def _runs(events: dict[int, list[dict]]) -> dict[int, list[tuple]]:
    """Each rank's runs as sorted (start, duration, rows, run id)."""
    return {r: sorted((e["t"], e["dur"], e.get("n") or 0, e.get("run")) for e in evs if e["name"] == "run")
            for r, evs in events.items()}


def summary(trace_dir: str, events: dict[int, list[dict]] | None = None) -> dict:
    """``{"rows", "seconds", "rows_per_s", "busy": [share per rank],
    "work_s": [seconds in runs per rank], "bound_rows_per_s"}``;
    ``events``: the directory's traces already loaded (load_traces).

    Raises:
        ConfigError: the directory holds no traces (ggpipe.bench.timeline.load_traces).
    """
    if events is None:
        _, events, _ = load_traces(trace_dir)
    runs = _runs(events)
    first, last = min(runs), max(runs)
    t0 = runs[first][0][0]
    t1 = max(t + d for t, d, _, _ in runs[last])
    rows = sum(n for _, _, n, _ in runs[first])
    a, b = t0 + 0.2 * (t1 - t0), t0 + 0.8 * (t1 - t0)
    busy = [sum(d for t, d, _, _ in runs[r] if a <= t <= b) / (b - a) for r in sorted(runs)]
    work = [sum(d for _, d, _, _ in runs[r]) for r in sorted(runs)]
    return {"rows": rows, "seconds": t1 - t0, "rows_per_s": rows / (t1 - t0), "busy": busy, "work_s": work,
            "bound_rows_per_s": rows / max(work)}


def _pct(v: list[float], q: float) -> float:
    return float(np.quantile(v, q, method="lower")) if v else float("nan")


def detail(trace_dir: str, group: int = 8, events: dict[int, list[dict]] | None = None) -> list[str]:
    """Lines of ``--detail`` (the module docstring); ``events`` as for :func:`summary`."""
    if events is None:
        _, events, _ = load_traces(trace_dir)
    runs = _runs(events)
    first, last = min(runs), max(runs)
    out = []
    big = [t + d for t, d, n, _ in runs[first] if n > group]
    end_prefill = max(big) if big else runs[first][0][0]
    out.append(f"prefill phase: {end_prefill - runs[first][0][0]:.2f} s (runs of more than {group} rows on the first stage)")
    for r in sorted(runs):
        sizes: dict[int, list[float]] = {}
        for _, d, n, _ in runs[r]:
            sizes.setdefault(n, []).append(d)
        out.append(f"rank {r} runs: " + ", ".join(f"{n} rows x{len(v)} {sum(v):.2f} s p50 {1e3 * _pct(v, .5):.1f} ms"
                                                  for n, v in sorted(sizes.items())))
        after = [x for x in runs[r] if x[0] >= end_prefill]
        if len(after) > 1:
            span = after[-1][0] + after[-1][1] - after[0][0]
            gaps = [b[0] - (a[0] + a[1]) for a, b in zip(after, after[1:])]
            out.append(f"rank {r} after prefill: {span:.2f} s, busy {sum(x[1] for x in after) / span:.0%}, waits "
                       f"p50 {1e3 * _pct(gaps, .5):.1f} ms p90 {1e3 * _pct(gaps, .9):.1f} ms, "
                       f"{sum(g > 5e-3 for g in gaps)} above 5 ms ({sum(g for g in gaps if g > 5e-3):.2f} s)")
    by_run = {r: {x[3]: x for x in runs[r]} for r in runs}
    head = {e.get("run"): e["t"] for e in events[first] if e["name"] == "recv"}
    sub = {e.get("run"): e["t"] for e in events[first] if e["name"] == "submit"}
    if last != first:
        nxt = min(r for r in runs if r > first)
        hop = [by_run[nxt][k][0] - (v[0] + v[1]) for k, v in by_run[first].items() if k in by_run[nxt]]
        back = [head[k] - (v[0] + v[1]) for k, v in by_run[last].items() if k in head]
        out.append(f"hops p50/p90: first stage's end -> rank {nxt}'s start {1e3 * _pct(hop, .5):.2f}/"
                   f"{1e3 * _pct(hop, .9):.2f} ms (with its queue), last stage's end -> head's receipt "
                   f"{1e3 * _pct(back, .5):.2f}/{1e3 * _pct(back, .9):.2f} ms")
    subs = sorted(sub.values())
    turn = [subs[i] - t for t in head.values() if (i := bisect.bisect_left(subs, t)) < len(subs)]
    out.append(f"head: receipt -> its next submission p50 {1e3 * _pct(turn, .5):.2f} ms")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trace_dir")
    ap.add_argument("--detail", action="store_true", help="where the time went (see the module docstring)")
    ap.add_argument("--group", type=int, default=8, help="runs above this many rows count as prefill (--detail)")
    a = ap.parse_args()
    _, events, _ = load_traces(a.trace_dir)
    s = summary(a.trace_dir, events)
    print(f"rows {s['rows']} in {s['seconds']:.2f} s: {s['rows_per_s']:.1f} rows/s; busy "
          + " ".join(f"{x:.0%}" for x in s["busy"])
          + f"; bound {s['bound_rows_per_s']:.1f} rows/s (runs " + " ".join(f"{x:.2f}" for x in s["work_s"]) + " s)")
    if a.detail:
        print("\n".join(detail(a.trace_dir, a.group, events)))


if __name__ == "__main__":
    main()
