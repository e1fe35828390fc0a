"""Rows per second and each stage's busy share from a ``GGPIPE_TRACE_DIR``
trace of a job (ggpipe/trace.py), the start-up left out.

    GGPIPE_TRACE_DIR=tr mpiexec -n 4 ggpipe batch scripts/prompts/holdout16.jsonl -o out.jsonl \\
        -m smollm2-goliath-40l-f32 -n 128 --ignore-eos --parallel 16 -t 4 --micro-batches 2
    python scripts/trace_rows.py tr

Rows: the tokens the first stage computed (prompt and generated), over the
seconds from its first run's start to the last stage's last run's end.
Busy: each stage's share of the middle 60% of that span spent in runs.
"""

from __future__ import annotations

import argparse

from ggpipe.bench.timeline import load_traces


def summary(trace_dir: str) -> dict:
    """``{"rows", "seconds", "rows_per_s", "busy": [share per rank]}``.

    Raises:
        ConfigError: the directory holds no traces (ggpipe.bench.timeline.load_traces).
    """
    _, events, _ = load_traces(trace_dir)
    runs = {r: sorted((e["t"], e["dur"], e.get("n") or 0) for e in evs if e["name"] == "run")
            for r, evs in events.items()}
    first, last = min(runs), max(runs)
    t0 = runs[first][0][0]
    t1 = max(t + d for t, d, _ in runs[last])
    rows = sum(n for _, _, n in runs[first])
    a, b = t0 + 0.2 * (t1 - t0), t0 + 0.8 * (t1 - t0)
    busy = [sum(d for t, d, _ in runs[r] if a <= t <= b) / (b - a) for r in sorted(runs)]
    return {"rows": rows, "seconds": t1 - t0, "rows_per_s": rows / (t1 - t0), "busy": busy}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trace_dir")
    s = summary(ap.parse_args().trace_dir)
    print(f"rows {s['rows']} in {s['seconds']:.2f} s: {s['rows_per_s']:.1f} rows/s; busy "
          + " ".join(f"{x:.0%}" for x in s["busy"]))


if __name__ == "__main__":
    main()
